/*
 * The train_logreg example (its path is this program's first argument) against the
 * loopback server: it creates its table, trains, and its loss must fall clearly.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/support/test_daemon.h"
#include "tests/support/test_support.h"

#define OUTPUT_MAX 65536

static const char *train_logreg_path;

/* Runs the example; returns its exit status, output in out. */
static int run(const char *const *args, char *out)
{
    FILE *capture = tmpfile();
    const char *argv[32] = {train_logreg_path};
    int argc = 1;
    for (; args[argc - 1] != NULL; argc++)
        argv[argc] = args[argc - 1];
    argv[argc] = NULL;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fileno(capture), STDOUT_FILENO);
        dup2(fileno(capture), STDERR_FILENO);
        unsetenv("EMBER_ADMIN_TOKEN");
        execv(train_logreg_path, (char *const *)argv);
        _exit(127);
    }
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    rewind(capture);
    size_t got = fread(out, 1, OUTPUT_MAX - 1, capture);
    out[got] = '\0';
    fclose(capture);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The losses of the "batch N ... loss X" lines, in order. */
static int losses(const char *out, double *values, int max)
{
    int count = 0;
    for (const char *line = strstr(out, "\nbatch "); line != NULL && count < max;
         line = strstr(line + 1, "\nbatch ")) {
        const char *at = strstr(line, " loss ");
        ck_assert_ptr_nonnull(at);
        values[count++] = strtod(at + 6, NULL);
    }
    return count;
}

START_TEST(loss_falls_clearly)
{
    em_test_daemon_options options = {.admin_token = "ember-dev-admin-token"};
    em_test_daemon *server = em_test_daemon_start(&options);
    const char *at = em_test_daemon_address(server);
    const char *admin = em_test_daemon_admin_address(server);
    static char out[OUTPUT_MAX];
    int code = run((const char *const[]){"--server", at, "--admin", admin, "--batches", "150",
                                         "--report-every", "30", NULL},
                   out);
    ck_assert_msg(code == 0, "exit %d:\n%s", code, out);
    ck_assert_msg(strstr(out, "created table 'logreg_demo'") != NULL, "%s", out);
    double values[16];
    int count = losses(out, values, 16);
    ck_assert_int_eq(count, 6);
    /* from ln 2 at the first batch (every weight starts at 0) ... */
    ck_assert_msg(values[0] > 0.6930 && values[0] < 0.6933, "%s", out);
    /* ... clearly down by the end, every window no worse than the one before */
    ck_assert_msg(values[count - 1] < values[0] - 0.15, "%s", out);
    for (int i = 1; i < count; i++)
        ck_assert_msg(values[i] < values[i - 1] + 0.01, "%s", out);
    ck_assert_msg(strstr(out, "loss went from ") != NULL, "%s", out);

    /* a second run finds the table and continues from its weights */
    code = run((const char *const[]){"--server", at, "--admin", admin, "--batches", "30",
                                     "--report-every", "30", NULL},
               out);
    ck_assert_msg(code == 0, "exit %d:\n%s", code, out);
    ck_assert_msg(strstr(out, "table 'logreg_demo' exists") != NULL, "%s", out);
    ck_assert_int_eq(losses(out, values + 8, 1), 1);
    ck_assert_msg(values[8] < values[0] - 0.15, "%s", out);
    em_test_daemon_stop(server);
}
END_TEST

START_TEST(errors_exit_non_zero_with_a_message)
{
    static char out[OUTPUT_MAX];
    ck_assert_int_eq(run((const char *const[]){"--batch-size", "0", NULL}, out), 2);
    ck_assert(strstr(out, "--batch-size '0'") != NULL);
    em_test_daemon_options options = {.admin_token = "another-token"};
    em_test_daemon *server = em_test_daemon_start(&options);
    const char *at = em_test_daemon_address(server);
    const char *admin = em_test_daemon_admin_address(server);
    ck_assert_int_eq(run((const char *const[]){"--server", at, "--admin", admin, NULL}, out), 1);
    ck_assert_msg(strstr(out, "train_logreg: UNAUTHENTICATED: ") != NULL, "%s", out);
    em_test_daemon_stop(server);
}
END_TEST

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH-TO-TRAIN_LOGREG\n", argv[0]);
        return 2;
    }
    train_logreg_path = argv[1];
    Suite *suite = suite_create("train_logreg");
    TCase *example = tcase_create("example");
    tcase_set_timeout(example, 120);
    tcase_add_test(example, loss_falls_clearly);
    tcase_add_test(example, errors_exit_non_zero_with_a_message);
    suite_add_tcase(suite, example);
    return em_test_run(suite);
}
