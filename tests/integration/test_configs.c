/* Every configuration shipped in configs/ passes `emberd --check-config`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/integration/harness.h"
#include "tests/support/test_support.h"

static void check_config(const char *name)
{
    const char *directory = getenv("EMBER_CONFIGS");
    ck_assert_ptr_nonnull(directory);
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", directory, name);
    char *argv[] = {getenv("EMBERD"), "--check-config", "--config", path, NULL};
    char *out = NULL;
    int code = test_run_program(argv, "token-from-the-environment", &out);
    ck_assert_msg(code == 0, "%s: exit %d: %s", name, code, out);
    ck_assert_msg(strstr(out, "configuration OK") != NULL, "%s: %s", name, out);
    free(out);
}

/* A private token file holding text; its path goes in path. */
static void make_token_file(char *path, size_t capacity, const char *text)
{
    snprintf(path, capacity, "/tmp/ember-token-XXXXXX");
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    chmod(path, 0600);
}

/* Replaces every occurrence of what in text (malloc'ed result). */
static char *replace_all(const char *text, const char *what, const char *with)
{
    size_t count = 0;
    for (const char *at = strstr(text, what); at != NULL; at = strstr(at + 1, what))
        count++;
    char *result = malloc(strlen(text) + count * strlen(with) + 1);
    char *out = result;
    for (const char *at; (at = strstr(text, what)) != NULL; text = at + strlen(what)) {
        memcpy(out, text, (size_t)(at - text));
        out += at - text;
        strcpy(out, with);
        out += strlen(with);
    }
    strcpy(out, text);
    return result;
}

/* The gpu configs name token files under /etc/ember, which a test cannot create: they
 * are checked with those paths pointing at temporary token files. */
static void check_config_with_token_files(const char *name)
{
    char source[1024], admin[64], data[64], copy[] = "/tmp/ember-config-copy-XXXXXX";
    snprintf(source, sizeof(source), "%s/%s", getenv("EMBER_CONFIGS"), name);
    make_token_file(admin, sizeof(admin), "admin-secret\n");
    make_token_file(data, sizeof(data), "data-secret\n");
    FILE *in = fopen(source, "r");
    ck_assert_ptr_nonnull(in);
    char *text = calloc(1, 1 << 20);
    ck_assert_uint_gt(fread(text, 1, (1 << 20) - 1, in), 0);
    fclose(in);
    char *with_admin = replace_all(text, "/etc/ember/admin.token", admin);
    char *rewritten = replace_all(with_admin, "/etc/ember/data.token", data);
    int fd = mkstemp(copy);
    ck_assert_int_eq(write(fd, rewritten, strlen(rewritten)), (ssize_t)strlen(rewritten));
    close(fd);
    char *argv[] = {getenv("EMBERD"), "--check-config", "--config", copy, NULL};
    char *out = NULL;
    int code = test_run_program(argv, NULL, &out);
    ck_assert_msg(code == 0, "%s: exit %d: %s", name, code, out);
    free(out);
    free(text);
    free(with_admin);
    free(rewritten);
    unlink(copy);
    unlink(admin);
    unlink(data);
}

START_TEST(default_config_is_valid)
{
    check_config("default.json");
}
END_TEST

START_TEST(cluster_config_is_valid)
{
    setenv("EMBER_DATA_TOKEN", "data-token-from-the-environment", 1);
    check_config("cluster-node.json");
}
END_TEST

START_TEST(gpu_configs_are_valid)
{
    check_config_with_token_files("gpu.json");
    check_config_with_token_files("gpu-multi.json");
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("configs");
    TCase *tc = tcase_create("configs");
    tcase_add_test(tc, default_config_is_valid);
    tcase_add_test(tc, cluster_config_is_valid);
    tcase_add_test(tc, gpu_configs_are_valid);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
