#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lib/table/table_config.h"
#include "tests/support/test_support.h"

static em_status parse(const char *text, em_table_config *config, em_error *err)
{
    return em_table_config_parse_text(text, config, err);
}

static void assert_rejected(const char *text, const char *expected_message)
{
    em_table_config config;
    em_error err;
    ck_assert_int_eq(parse(text, &config, &err), EM_INVALID_ARGUMENT);
    ck_assert_msg(strcmp(err.message, expected_message) == 0, "for %s\n got: %s\nwant: %s", text,
                  err.message, expected_message);
}

START_TEST(full_config_parses)
{
    em_table_config config;
    em_error err;
    ck_assert_int_eq(
        parse("{\"name\": \"clicks.v2\", \"dim\": 64, \"capacity\": 10000000, \"shards\": 8,"
              " \"optimizer\": {\"type\": \"adam\", \"lr\": 0.001, \"beta1\": 0.8,"
              " \"beta2\": 0.99},"
              " \"initializer\": {\"type\": \"normal\", \"stddev\": 0.02, \"seed\": 7}}",
              &config, &err),
        EM_OK);
    ck_assert_str_eq(config.name, "clicks.v2");
    ck_assert_uint_eq(config.dim, 64);
    ck_assert_uint_eq(config.capacity, 10000000);
    ck_assert_uint_eq(config.shards, 8);
    ck_assert_int_eq(config.optimizer.kind, EM_OPTIMIZER_ADAM);
    ck_assert_float_eq(config.optimizer.learning_rate, 0.001f);
    ck_assert_float_eq(config.optimizer.beta1, 0.8f);
    ck_assert_float_eq(config.optimizer.beta2, 0.99f);
    ck_assert_float_eq(config.optimizer.eps, 1e-8f); /* adam's default */
    ck_assert_int_eq(config.initializer.kind, EM_INIT_NORMAL);
    ck_assert_float_eq(config.initializer.stddev, 0.02f);
    ck_assert_uint_eq(config.initializer.seed, 7);
}
END_TEST

START_TEST(defaults_fill_the_rest)
{
    em_table_config config;
    em_error err;
    ck_assert_int_eq(parse("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100}", &config, &err),
                     EM_OK);
    ck_assert_uint_eq(config.shards, 0);
    ck_assert_int_eq(config.optimizer.kind, EM_OPTIMIZER_SGD);
    ck_assert_float_eq(config.optimizer.learning_rate, 0.01f);
    ck_assert_int_eq(config.initializer.kind, EM_INIT_UNIFORM);
    ck_assert_float_eq(config.initializer.bound, 0.01f);
    ck_assert_int_eq(parse("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100,"
                           " \"optimizer\": {\"type\": \"adagrad\"}}",
                           &config, &err),
                     EM_OK);
    ck_assert_float_eq(config.optimizer.eps, 1e-10f);
    ck_assert_float_eq(config.optimizer.initial_accumulator, 0.0f);
}
END_TEST

START_TEST(errors_name_path_and_value)
{
    assert_rejected("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100, \"shard\": 2}",
                    "table.shard: unknown key (known keys: name, dim, capacity, shards, optimizer, "
                    "initializer, eviction, admission)");
    assert_rejected("{\"name\": \"t\", \"capacity\": 100}", "table.dim: required key is missing");
    assert_rejected("{\"name\": \"t\", \"dim\": 5000, \"capacity\": 100}",
                    "table.dim: must be between 1 and 4096, got 5000");
    assert_rejected("{\"name\": \"t\", \"dim\": 8.5, \"capacity\": 100}",
                    "table.dim: must be an integer (exact; a string of digits from 2^53 on), got a "
                    "number 8.5");
    assert_rejected("{\"name\": \"t\", \"dim\": \"8\", \"capacity\": 0}",
                    "table.capacity: must be between 1 and 1099511627776, got 0");
    assert_rejected("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100,"
                    " \"optimizer\": {\"type\": \"adagrad\", \"lr\": -1}}",
                    "table.optimizer.lr: must be > 0 and <= 1e+06, got -1");
    /* above 0 as a double, 0 as the float the table keeps (found by fuzz_config) */
    assert_rejected("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100,"
                    " \"optimizer\": {\"type\": \"adagrad\", \"lr\": 1e-50}}",
                    "table.optimizer.lr: 1e-50 becomes 0 as a 32-bit float, which is not > 0 and "
                    "<= 1e+06");
    assert_rejected("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100,"
                    " \"optimizer\": {\"type\": \"sgd\", \"beta1\": 0.9}}",
                    "table.optimizer.beta1: does not apply to optimizer 'sgd'");
    assert_rejected("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100,"
                    " \"optimizer\": {\"type\": \"lamb\"}}",
                    "table.optimizer.type: 'lamb' is not one of sgd, adagrad, rowwise_adagrad, adam");
    assert_rejected("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100,"
                    " \"optimizer\": {\"lr\": 0.1}}",
                    "table.optimizer.type: required key is missing");
    assert_rejected("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100,"
                    " \"initializer\": {\"type\": \"zeros\", \"bound\": 1}}",
                    "table.initializer.bound: does not apply to initializer 'zeros'");
    assert_rejected("{\"name\": \"bad name\", \"dim\": 8, \"capacity\": 100}",
                    "table.name: table name 'bad name' has character 0x20 at position 3; allowed are "
                    "A-Z a-z 0-9 _ . -");
    assert_rejected("{\"name\": \"..\", \"dim\": 8, \"capacity\": 100}",
                    "table.name: table name '..' starts with '.'; it names the table's checkpoint "
                    "directory, which must not be hidden, '.' or '..'");
    assert_rejected("{\"name\": \".t\", \"dim\": 8, \"capacity\": 100}",
                    "table.name: table name '.t' starts with '.'; it names the table's checkpoint "
                    "directory, which must not be hidden, '.' or '..'");
    assert_rejected("{\"name\": \"t\", \"dim\": 8, \"dim\": 9, \"capacity\": 100}",
                    "table.dim: key given more than once");
    assert_rejected("[1, 2]", "table: must be an object, got an array [1,2]");
    assert_rejected("{\"name\": \"t\",\n \"dim\": 8,\n \"capacity\": }",
                    "table: invalid JSON at line 3, column 14");
}
END_TEST

START_TEST(big_seeds_travel_as_strings)
{
    em_table_config config;
    em_error err;
    ck_assert_int_eq(parse("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100,"
                           " \"initializer\": {\"seed\": \"18446744073709551615\"}}",
                           &config, &err),
                     EM_OK);
    ck_assert_uint_eq(config.initializer.seed, UINT64_MAX);
    cJSON *json = em_table_config_to_json(&config);
    cJSON *seed = cJSON_GetObjectItem(cJSON_GetObjectItem(json, "initializer"), "seed");
    ck_assert(cJSON_IsString(seed));
    ck_assert_str_eq(seed->valuestring, "18446744073709551615");
    cJSON_Delete(json);
    assert_rejected("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100,"
                    " \"initializer\": {\"seed\": \"18446744073709551616\"}}",
                    "table.initializer.seed: must be an integer (exact; a string of digits from "
                    "2^53 on), got a string \"18446744073709551616\"");
    /* 2^53 + 1 as a JSON number reads as 2^53: from 2^53 on, numbers are refused and
     * values are written back as strings, so no seed is ever silently another */
    assert_rejected("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100,"
                    " \"initializer\": {\"seed\": 9007199254740993}}",
                    "table.initializer.seed: must be an integer (exact; a string of digits from "
                    "2^53 on), got a number 9.00719925474099e+15");
    ck_assert_int_eq(parse("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100,"
                           " \"initializer\": {\"seed\": \"9007199254740993\"}}",
                           &config, &err),
                     EM_OK);
    ck_assert_uint_eq(config.initializer.seed, UINT64_C(9007199254740993));
    json = em_table_config_to_json(&config);
    seed = cJSON_GetObjectItem(cJSON_GetObjectItem(json, "initializer"), "seed");
    ck_assert(cJSON_IsString(seed));
    ck_assert_str_eq(seed->valuestring, "9007199254740993");
    cJSON_Delete(json);
    ck_assert_int_eq(parse("{\"name\": \"t\", \"dim\": 8, \"capacity\": 100,"
                           " \"initializer\": {\"seed\": 9007199254740991}}",
                           &config, &err),
                     EM_OK);
    ck_assert_uint_eq(config.initializer.seed, UINT64_C(9007199254740991));
}
END_TEST

START_TEST(to_json_round_trips)
{
    em_table_config config, again;
    em_error err;
    ck_assert_int_eq(parse("{\"name\": \"t\", \"dim\": 3, \"capacity\": 7, \"shards\": 2,"
                           " \"optimizer\": {\"type\": \"rowwise_adagrad\", \"lr\": 0.3,"
                           " \"initial_accumulator\": 0.5},"
                           " \"initializer\": {\"type\": \"zeros\", \"seed\": 9}}",
                           &config, &err),
                     EM_OK);
    cJSON *json = em_table_config_to_json(&config);
    ck_assert_ptr_null(cJSON_GetObjectItem(cJSON_GetObjectItem(json, "optimizer"), "beta1"));
    ck_assert_int_eq(em_table_config_parse(json, "", &again, &err), EM_OK);
    cJSON_Delete(json);
    ck_assert_str_eq(again.name, config.name);
    ck_assert_uint_eq(again.dim, config.dim);
    ck_assert_uint_eq(again.capacity, config.capacity);
    ck_assert_uint_eq(again.shards, config.shards);
    ck_assert(memcmp(&again.optimizer, &config.optimizer, sizeof(config.optimizer)) == 0);
    ck_assert_int_eq(again.initializer.kind, config.initializer.kind);
    ck_assert_uint_eq(again.initializer.seed, 9);
}
END_TEST

START_TEST(validate_checks_configs_built_in_code)
{
    em_table_config config;
    em_error err;
    em_table_config_init(&config, "ok", 16, 1000);
    ck_assert_int_eq(em_table_config_validate(&config, &err), EM_OK);
    config.dim = 0;
    ck_assert_int_eq(em_table_config_validate(&config, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "table.dim: must be between 1 and 4096, got 0");
    em_table_config_init(&config, "ok", 16, 1000);
    config.optimizer.learning_rate = 0;
    ck_assert_int_eq(em_table_config_validate(&config, &err), EM_INVALID_ARGUMENT);
    ck_assert(strstr(err.message, "optimizer.lr") != NULL);
    em_table_config_init(&config, "", 16, 1000);
    ck_assert_int_eq(em_table_config_validate(&config, &err), EM_INVALID_ARGUMENT);
    ck_assert(strstr(err.message, "1 to 128 characters, got 0") != NULL);
}
END_TEST

START_TEST(read_file_errors)
{
    char *text = NULL;
    em_error err;
    ck_assert_int_eq(em_config_read_file("/nonexistent/ember.json", 1024, &text, &err),
                     EM_NOT_FOUND);
    ck_assert(strstr(err.message, "'/nonexistent/ember.json'") != NULL);
    char path[] = "/tmp/ember-config-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, "{\"a\": 1}", 8), 8);
    close(fd);
    ck_assert_int_eq(em_config_read_file(path, 1024, &text, &err), EM_OK);
    ck_assert_str_eq(text, "{\"a\": 1}");
    free(text);
    ck_assert_int_eq(em_config_read_file(path, 4, &text, &err), EM_INVALID_ARGUMENT);
    unlink(path);
}
END_TEST

/* A live reload copies exactly the fields the schema marks RELOADABLE. */
typedef struct reload_target {
    uint32_t fixed;
    double rate;
    char name[16];
} reload_target;

static const em_config_field reload_fields[] = {
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "fixed", reload_target, fixed), .flags = EM_CONFIG_UNSIGNED},
    {EM_CONFIG_FIELD(EM_CONFIG_DOUBLE, "rate", reload_target, rate),
     .flags = EM_CONFIG_RELOADABLE},
    {EM_CONFIG_FIELD(EM_CONFIG_STRING, "name", reload_target, name),
     .flags = EM_CONFIG_RELOADABLE},
};

static const em_config_schema reload_schema = {
    .name = "reload",
    .fields = reload_fields,
    .field_count = sizeof(reload_fields) / sizeof(reload_fields[0]),
};

START_TEST(reload_copies_only_reloadable_fields)
{
    reload_target running, fresh;
    em_error err;
    ck_assert_int_eq(em_config_parse_text(&reload_schema,
                                          "{\"fixed\": 1, \"rate\": 0.5, \"name\": \"old\"}",
                                          "running", &running, &err),
                     EM_OK);
    ck_assert_int_eq(em_config_parse_text(&reload_schema,
                                          "{\"fixed\": 2, \"rate\": 0.25, \"name\": \"new\"}",
                                          "fresh", &fresh, &err),
                     EM_OK);
    em_config_copy_reloadable(&reload_schema, &running, &fresh);
    ck_assert_uint_eq(running.fixed, 1);
    ck_assert_double_eq(running.rate, 0.25);
    ck_assert_str_eq(running.name, "new");
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("config");
    TCase *tc = tcase_create("config");
    tcase_add_test(tc, full_config_parses);
    tcase_add_test(tc, defaults_fill_the_rest);
    tcase_add_test(tc, errors_name_path_and_value);
    tcase_add_test(tc, big_seeds_travel_as_strings);
    tcase_add_test(tc, to_json_round_trips);
    tcase_add_test(tc, validate_checks_configs_built_in_code);
    tcase_add_test(tc, read_file_errors);
    tcase_add_test(tc, reload_copies_only_reloadable_fields);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
