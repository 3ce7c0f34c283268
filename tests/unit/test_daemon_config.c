#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/daemon_config.h"
#include "tests/support/test_support.h"

static em_status parse(const char *text, em_daemon_config *config, em_error *err)
{
    return em_daemon_config_parse_text(text, "test.json", config, err);
}

static void assert_rejected(const char *text, const char *expected)
{
    em_daemon_config config;
    em_error err;
    ck_assert_int_ne(parse(text, &config, &err), EM_OK);
    ck_assert_msg(strcmp(err.message, expected) == 0, "for %s\n got: %s\nwant: %s", text,
                  err.message, expected);
}

START_TEST(minimal_config_takes_the_defaults)
{
    em_daemon_config config;
    em_error err;
    ck_assert_int_eq(parse("{\"admin_token\": {\"value\": \"a\"}}", &config, &err), EM_OK);
    ck_assert_str_eq(config.listen.data, "127.0.0.1:7070");
    ck_assert_str_eq(config.listen.admin, "127.0.0.1:7071");
    ck_assert_uint_eq(config.limits.max_connections, 1024);
    ck_assert_uint_eq(config.limits.max_attachment_bytes, 1073741824u);
    ck_assert_int_eq(config.backend.type, EM_BACKEND_AUTO);
    ck_assert_uint_eq(config.backend.lanes, 2);
    ck_assert(config.admin_token.set);
    ck_assert_str_eq(config.admin_token.value, "a");
    ck_assert(!config.data_token.set);
    ck_assert_uint_eq(config.tables.count, 0);
    em_daemon_config_deinit(&config);
}
END_TEST

START_TEST(errors_name_the_key_and_the_value)
{
    assert_rejected("{}", "test.json: admin_token: required key is missing");
    assert_rejected("{\"admin_token\": {\"value\": \"a\"}, \"listen\": {\"data\": \"localhost:70\"}}",
                    "test.json: listen.data: listen address 'localhost:70': not an IPv4 address "
                    "(expected IPv4:port or [IPv6]:port)");
    assert_rejected("{\"admin_token\": {\"value\": \"a\"}, \"listen\": {\"admin\": \"[::1]:99999\"}}",
                    "test.json: listen.admin: listen address '[::1]:99999': port must be a "
                    "number from 0 to 65535 (expected IPv4:port or [IPv6]:port)");
    assert_rejected("{\"admin_token\": {\"value\": \"a\"}, \"limits\": {\"max_connections\": 0}}",
                    "test.json: limits.max_connections: must be between 1 and 1048576, got 0");
    assert_rejected("{\"admin_token\": {\"value\": \"a\"}, \"backend\": {\"type\": \"tpu\"}}",
                    "test.json: backend.type: 'tpu' is not one of auto, cpu, cuda");
    assert_rejected("{\"admin_token\": {\"value\": \"a\"},"
                    " \"backend\": {\"type\": \"cpu\", \"gpus\": [0]}}",
                    "test.json: backend.gpus: applies to the cuda backend, not to type \"cpu\"");
    assert_rejected("{\"admin_token\": {\"value\": \"a\"}, \"backend\": {\"gpus\": [1, 1]}}",
                    "test.json: backend.gpus[1]: GPU 1 is listed twice");
    assert_rejected("{\"admin_token\": {\"value\": \"a\"}, \"log_level\": \"loud\"}",
                    "test.json: log_level: 'loud' is not one of error, warning, notice, info, "
                    "debug");
    assert_rejected("{\"admin_token\": {\"value\": \"a\"}, \"tables\": ["
                    "{\"name\": \"t\", \"dim\": 4, \"capacity\": 9},"
                    "{\"name\": \"t\", \"dim\": 8, \"capacity\": 9}]}",
                    "test.json: tables[1].name: 't' is already used by tables[0]");
    assert_rejected("{\"admin_token\": {\"value\": \"a\"}, \"tables\": ["
                    "{\"name\": \"t\", \"dim\": 4, \"capacity\": 9, \"optimzer\": {}}]}",
                    "test.json: tables[0].optimzer: unknown key (known keys: name, dim, capacity, "
                    "shards, optimizer, initializer, eviction, admission)");
    assert_rejected("{\"admin_token\": {\"value\": \"a\"},"
                    " \"checkpoint\": {\"dir\": \"/c\", \"restore\": \"newest\"}}",
                    "test.json: checkpoint.restore: 'newest' is not \"latest\", \"none\" or an "
                    "absolute path");
    assert_rejected("{\"admin_token\": {\"value\": \"a\"}, \"checkpoint\": {\"dir\": \"/c\","
                    " \"restore\": \"/seed\", \"cluster_index\": 3, \"cluster_size\": 3}}",
                    "test.json: checkpoint.cluster_index: 3 is not below cluster_size 3");
    assert_rejected("{\"admin_token\": {\"value\": \"a\"},"
                    " \"checkpoint\": {\"dir\": \"/c\", \"cluster_index\": 1}}",
                    "test.json: checkpoint.cluster_index: 1 without cluster_size");
}
END_TEST

/* checkpoint.restore: latest (the default), none, or a path to seed tables from. */
START_TEST(restore_is_latest_none_or_a_seed_path)
{
    const char *cases[3] = {"", ", \"restore\": \"none\"",
                            ", \"restore\": \"/seed\", \"cluster_index\": 1, \"cluster_size\": 2"};
    int modes[3] = {EM_RESTORE_LATEST, EM_RESTORE_NONE, EM_RESTORE_SEED};
    for (int i = 0; i < 3; i++) {
        char text[512];
        snprintf(text, sizeof(text),
                 "{\"admin_token\": {\"value\": \"a\"}, \"checkpoint\": {\"dir\": \"/c\"%s}}",
                 cases[i]);
        em_daemon_config config;
        em_error err;
        ck_assert_msg(em_daemon_config_parse_text(text, "test.json", &config, &err) == EM_OK, "%s",
                      err.message);
        ck_assert_int_eq(config.checkpoint.restore, modes[i]);
        if (i == 2) {
            ck_assert_str_eq(config.checkpoint.restore_text, "/seed");
            ck_assert_uint_eq(config.checkpoint.cluster_index, 1);
            ck_assert_uint_eq(config.checkpoint.cluster_size, 2);
        }
        em_daemon_config_deinit(&config);
    }
}
END_TEST

START_TEST(tokens_come_inline_from_a_file_or_the_environment)
{
    em_daemon_config config;
    em_error err;
    char path[] = "/tmp/ember-token-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_eq(write(fd, "from-file\n", 10), 10);
    close(fd);
    chmod(path, 0600);
    char text[512];
    snprintf(text, sizeof(text), "{\"admin_token\": {\"file\": \"%s\"},"
                                 " \"data_token\": {\"env\": \"EMBER_TEST_DATA_TOKEN\"}}", path);
    unsetenv("EMBER_TEST_DATA_TOKEN");
    ck_assert_int_eq(parse(text, &config, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "test.json: data_token.env: environment variable "
                                  "EMBER_TEST_DATA_TOKEN is not set");
    setenv("EMBER_TEST_DATA_TOKEN", "from-env", 1);
    ck_assert_int_eq(parse(text, &config, &err), EM_OK);
    ck_assert_str_eq(config.admin_token.value, "from-file"); /* trailing newline dropped */
    ck_assert_str_eq(config.data_token.value, "from-env");
    /* The secret is never printed, only where it came from. */
    cJSON *json = em_config_to_json(&em_daemon_config_schema, &config);
    char *printed = cJSON_PrintUnformatted(json);
    ck_assert(strstr(printed, "from-file") == NULL && strstr(printed, "from-env") == NULL);
    ck_assert(strstr(printed, "{\"env\":\"EMBER_TEST_DATA_TOKEN\"}") != NULL);
    free(printed);
    cJSON_Delete(json);
    em_daemon_config_deinit(&config);
    /* Only owner-only modes are accepted: group or others reading is refused. */
    const unsigned refused[] = {0644, 0640, 0660, 0604, 0700};
    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
        chmod(path, refused[i]);
        ck_assert_int_eq(parse(text, &config, &err), EM_PERMISSION_DENIED);
        char fragment[64];
        snprintf(fragment, sizeof(fragment), "has mode %04o; only its owner may read it",
                 refused[i]);
        ck_assert_msg(strstr(err.message, fragment) != NULL, "%s", err.message);
    }
    chmod(path, 0400);
    ck_assert_int_eq(parse(text, &config, &err), EM_OK);
    em_daemon_config_deinit(&config);
    /* A symbolic link to a good token file is refused, not followed. */
    char link_path[96];
    snprintf(link_path, sizeof(link_path), "%s.link", path);
    ck_assert_int_eq(symlink(path, link_path), 0);
    char linked[256];
    snprintf(linked, sizeof(linked), "{\"admin_token\": {\"file\": \"%s\"}}", link_path);
    ck_assert_int_eq(parse(linked, &config, &err), EM_PERMISSION_DENIED);
    ck_assert_msg(strstr(err.message, "token files may not be symbolic links") != NULL, "%s",
                  err.message);
    unlink(link_path);
    chmod(path, 0600);
    unlink(path);
    assert_rejected("{\"admin_token\": {\"value\": \"a\", \"env\": \"B\"}}",
                    "test.json: admin_token: must be an object with one string key: value, "
                    "file or env");
    assert_rejected("{\"admin_token\": {\"value\": \"same\"}, \"data_token\": {\"value\": \"same\"}}",
                    "test.json: data_token: must differ from admin_token, or data clients could "
                    "administer the server");
    assert_rejected("{\"admin_token\": {\"value\": \"\"}}",
                    "test.json: admin_token.value: token must have 1 to 256 characters, got 0");
}
END_TEST

/* "key " for a key that needs a restart, "key* " for a reloadable one. */
static void count_change(void *context, const char *key, bool reloadable)
{
    char *seen = context;
    strcat(seen, key);
    strcat(seen, reloadable ? "* " : " ");
}

START_TEST(reload_reports_keys_that_need_a_restart)
{
    em_daemon_config old_config, new_config;
    em_error err;
    ck_assert_int_eq(parse("{\"admin_token\": {\"value\": \"a\"}, \"log_level\": \"info\"}",
                           &old_config, &err), EM_OK);
    ck_assert_int_eq(parse("{\"admin_token\": {\"value\": \"b\"}, \"log_level\": \"debug\","
                           " \"limits\": {\"max_connections\": 5},"
                           " \"listen\": {\"data\": \"127.0.0.1:9\"},"
                           " \"backend\": {\"threads\": 3}}",
                           &new_config, &err), EM_OK);
    char seen[256] = "";
    ck_assert_int_eq(em_daemon_config_changes(&old_config, &new_config, count_change, seen), 4);
    ck_assert_str_eq(seen, "listen limits* backend log_level* ");
    em_daemon_config_deinit(&old_config);
    em_daemon_config_deinit(&new_config);
}
END_TEST

static char *printed(const em_daemon_config *config)
{
    cJSON *json = em_config_to_json(&em_daemon_config_schema, config);
    char *text = cJSON_PrintUnformatted(json);
    cJSON_Delete(json);
    return text;
}

/* What emberd --print-config prints parses again to a configuration that prints the
 * same: defaults filled in, the keys of another backend left out, tls only when set. */
START_TEST(the_printed_configuration_parses_again)
{
    static const char *const configs[] = {
        "{\"admin_token\": {\"env\": \"EMBER_TEST_ADMIN\"},"
        " \"backend\": {\"type\": \"cpu\", \"devices\": 2},"
        " \"limits\": {\"memory_bytes\": 67108864, \"write_timeout_ms\": 5000},"
        " \"tables\": [{\"name\": \"a\", \"dim\": 4, \"capacity\": 10,"
        "  \"optimizer\": {\"type\": \"adam\", \"lr\": 0.01}}]}",
        "{\"admin_token\": {\"value\": \"secret\"}, \"backend\": {\"type\": \"cuda\","
        " \"gpus\": [0, 1], \"lanes\": 3}, \"insecure\": true,"
        " \"tls\": {\"certificate_file\": \"/c.pem\", \"private_key_file\": \"/k.pem\","
        "  \"admin\": false}}",
        "{\"admin_token\": {\"value\": \"secret\"}}",
    };
    setenv("EMBER_TEST_ADMIN", "from-env", 1);
    for (size_t i = 0; i < sizeof(configs) / sizeof(configs[0]); i++) {
        em_daemon_config first, second;
        em_error err;
        ck_assert_msg(parse(configs[i], &first, &err) == EM_OK, "%s", err.message);
        char *text = printed(&first);
        ck_assert_msg(parse(text, &second, &err) == EM_OK, "%s does not parse: %s", text,
                      err.message);
        char *again = printed(&second);
        ck_assert_str_eq(text, again);
        if (first.backend.type == EM_BACKEND_CPU)
            ck_assert_ptr_null(strstr(text, "memory_fraction"));
        ck_assert_int_eq(strstr(text, "\"tls\"") != NULL, first.tls.enabled);
        ck_assert_ptr_null(strstr(text, "secret"));
        ck_assert_uint_ne(first.limits.memory_bytes, 0);
        free(text);
        free(again);
        em_daemon_config_deinit(&first);
        em_daemon_config_deinit(&second);
    }
    unsetenv("EMBER_TEST_ADMIN");
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("daemon_config");
    TCase *tc = tcase_create("daemon_config");
    tcase_add_test(tc, restore_is_latest_none_or_a_seed_path);
    tcase_add_test(tc, minimal_config_takes_the_defaults);
    tcase_add_test(tc, errors_name_the_key_and_the_value);
    tcase_add_test(tc, tokens_come_inline_from_a_file_or_the_environment);
    tcase_add_test(tc, reload_reports_keys_that_need_a_restart);
    tcase_add_test(tc, the_printed_configuration_parses_again);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
