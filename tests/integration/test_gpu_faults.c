/*
 * A GPU that fails while emberd serves: the request that meets the failure gets
 * UNAVAILABLE naming it, readiness goes, the daemon logs the cause, skips the shutdown
 * save (the last completed checkpoint stays current) and exits 1 by itself, so that
 * systemd (Restart=on-failure) restarts it; the restarted daemon restores that
 * checkpoint.
 *
 * The failure is the emulated kernels' sticky fault (failpoint gpu_fault,
 * tests/support/kernels_emulated.c), so this suite runs against emberd-emulated only.
 * The restarted daemon's pull also shows the cuda backend's data path: the request's
 * attachment and the answer are pinned host buffers, copied by DMA (STATS).
 */
#include <check.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "proto/ember.pb-c.h"
#include "tests/integration/harness.h"
#include "tests/support/test_support.h"

#define DIM 4

static const uint32_t offsets[] = {0, 2, 3};
static const uint64_t keys[] = {10, 11, 12};

static char *config_json(const char *dir)
{
    static char json[1024];
    snprintf(json, sizeof(json),
             "{\"checkpoint\": {\"dir\": \"%s\", \"on_shutdown\": true},"
             " \"tables\": [{\"name\": \"t\", \"dim\": %d, \"capacity\": 1000, \"shards\": 1,"
             " \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.5},"
             " \"initializer\": {\"type\": \"zeros\"}}]}",
             dir, DIM);
    return json;
}

static test_frame push(const test_daemon *daemon, uint64_t id)
{
    float gradients[3 * DIM];
    for (int i = 0; i < 3 * DIM; i++)
        gradients[i] = 1.0f;
    Ember__PushRequest body = EMBER__PUSH_REQUEST__INIT;
    body.table = "t";
    body.rows = 2;
    body.nnz = 3;
    size_t length = 0;
    uint8_t *attachment = test_csr_attachment(2, offsets, 3, keys, gradients, 3 * DIM, &length);
    int fd = test_connect(daemon->data);
    test_frame frame = test_call(fd, id, EMBER__METHOD__PUSH, NULL, &body.base, attachment, length);
    free(attachment);
    close(fd);
    return frame;
}

static test_frame pull(const test_daemon *daemon, uint64_t id)
{
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = "t";
    body.rows = 2;
    body.nnz = 3;
    size_t length = 0;
    uint8_t *attachment = test_csr_attachment(2, offsets, 3, keys, NULL, 0, &length);
    int fd = test_connect(daemon->data);
    test_frame frame = test_call(fd, id, EMBER__METHOD__PULL, NULL, &body.base, attachment, length);
    free(attachment);
    close(fd);
    return frame;
}

/* Every value of a pull's answer is `expected`. */
static void assert_pulled(const test_daemon *daemon, uint64_t id, float expected)
{
    test_frame pulled = pull(daemon, id);
    ck_assert_msg(pulled.meta->status == EMBER__STATUS__OK, "%s", pulled.meta->error);
    ck_assert_uint_eq(pulled.attachment_length, 3 * DIM * sizeof(float));
    const float *values = (const float *)pulled.attachment;
    for (int i = 0; i < 3 * DIM; i++)
        ck_assert_float_eq(values[i], expected);
    test_frame_free(&pulled);
}

static void save(const test_daemon *daemon)
{
    char *ctl = getenv("EMBERCTL"), *out = NULL;
    char *argv[] = {ctl, "--server", (char *)daemon->admin, "save", "t", NULL};
    ck_assert_int_eq(test_run_program(argv, TEST_ADMIN_TOKEN, &out), 0);
    ck_assert_msg(strstr(out, "full checkpoint 00000000000000000001") != NULL, "%s", out);
    free(out);
}

/* Arms failpoints in a running daemon (its EMBER_FAILPOINTS_FILE, then SIGHUP). */
static void arm(test_daemon *daemon, const char *path, const char *failpoints)
{
    FILE *file = fopen(path, "w");
    ck_assert_ptr_nonnull(file);
    fprintf(file, "%s\n", failpoints);
    fclose(file);
    ck_assert_int_eq(kill(daemon->pid, SIGHUP), 0);
    ck_assert_msg(test_daemon_wait_log(daemon, "failpoints armed (for tests only): gpu_fault",
                                       30000),
                  "the daemon did not arm %s", failpoints);
}

/* A number of the server's STATS, through emberctl --json. */
static double server_stat(const test_daemon *daemon, const char *name)
{
    char *ctl = getenv("EMBERCTL"), *out = NULL;
    char *argv[] = {ctl, "--server", (char *)daemon->admin, "--json", "stats", NULL};
    ck_assert_int_eq(test_run_program(argv, TEST_ADMIN_TOKEN, &out), 0);
    char quoted[96];
    snprintf(quoted, sizeof(quoted), "\"%s\":", name);
    const char *at = strstr(out, quoted);
    ck_assert_msg(at != NULL, "no %s in %s", name, out);
    double value = strtod(at + strlen(quoted), NULL);
    free(out);
    return value;
}

START_TEST(a_gpu_fault_fails_the_request_and_the_daemon_exits_for_a_restart)
{
    char dir[256];
    em_test_make_dir("ember-gpu-fault", dir, sizeof(dir));
    char failpoints[] = "/tmp/ember-failpoints-XXXXXX";
    int fd = mkstemp(failpoints);
    ck_assert_int_ge(fd, 0);
    close(fd);
    setenv("EMBER_FAILPOINTS_FILE", failpoints, 1);
    test_daemon *daemon = test_daemon_start(config_json(dir));
    unsetenv("EMBER_FAILPOINTS_FILE");

    test_frame first = push(daemon, 1);
    ck_assert_msg(first.meta->status == EMBER__STATUS__OK, "%s", first.meta->error);
    test_frame_free(&first);
    save(daemon); /* the checkpoint a restart comes back to: one push applied */

    arm(daemon, failpoints, "gpu_fault");
    test_frame failed = push(daemon, 2);
    ck_assert_int_eq(failed.meta->status, EMBER__STATUS__UNAVAILABLE);
    ck_assert_msg(strstr(failed.meta->error, "GPU context lost") != NULL &&
                      strstr(failed.meta->error, "illegal memory access") != NULL,
                  "%s", failed.meta->error);
    test_frame_free(&failed);

    /* no signal: the daemon drains and exits 1 on its own; the skipped shutdown save is
     * its last line before it exits */
    (void)test_daemon_wait_log(daemon, "shutdown save skipped", 30000);
    char *log = test_daemon_log(daemon);
    ck_assert_msg(strstr(log, "GPU failed: ") != NULL &&
                      strstr(log, "illegal memory access was encountered (emulated)") != NULL,
                  "%s", log);
    ck_assert_msg(strstr(log, "shutdown save skipped: a GPU failed") != NULL, "%s", log);
    free(log);
    ck_assert_int_eq(test_daemon_stop(daemon, 0, 30000), 1);
    unlink(failpoints);

    /* restarted, it comes back at the checkpoint: each key took the first push only */
    test_daemon *again = test_daemon_start(config_json(dir));
    char *restarted = test_daemon_log(again);
    ck_assert_msg(strstr(restarted, "restored table 't' from full checkpoint "
                                    "00000000000000000001") != NULL,
                  "%s", restarted);
    free(restarted);
    assert_pulled(again, 3, -0.5f); /* zeros - lr 0.5 x gradient 1, once */
    /* the pull's keys and answer went by DMA: the attachment and the answer buffer were
     * pinned memory of the backend (backend.pinned_buffer_bytes, 1 GiB by default) */
    ck_assert_double_eq(server_stat(again, "pinned_buffer_bytes_limit"), 1073741824.0);
    ck_assert_double_ge(server_stat(again, "bytes_copied_directly"),
                        3 * sizeof(uint64_t) + 3 * DIM * sizeof(float));
    /* pulls and pushes of the one-shard table's stored keys go with one wait for the GPU
     * (STATS pulls_at_once, pushes_at_once) */
    ck_assert_double_eq(server_stat(again, "pulls_at_once"), 1.0);
    for (uint64_t id = 5; id < 7; id++) {
        test_frame pushed = push(again, id);
        ck_assert_msg(pushed.meta->status == EMBER__STATUS__OK, "%s", pushed.meta->error);
        test_frame_free(&pushed);
    }
    ck_assert_double_eq(server_stat(again, "pushes_at_once"), 2.0);
    double waits = server_stat(again, "device_waits");
    assert_pulled(again, 7, -1.5f);
    ck_assert_double_eq(server_stat(again, "pulls_at_once"), 2.0);
    /* and the host waited once for the GPU in that pull (STATS device_waits; the time,
     * device_wait_ms, is there too) */
    ck_assert_double_eq(server_stat(again, "device_waits"), waits + 1.0);
    ck_assert_double_ge(server_stat(again, "device_wait_ms"), 0.0);
    char *ctl = getenv("EMBERCTL"), *shown = NULL; /* emberctl stats shows them */
    char *stats_argv[] = {ctl, "--server", (char *)again->admin, "stats", NULL};
    ck_assert_int_eq(test_run_program(stats_argv, TEST_ADMIN_TOKEN, &shown), 0);
    char expected[64];
    snprintf(expected, sizeof(expected), "  gpu waits    %.0f, ", waits + 1.0);
    ck_assert_msg(strstr(shown, expected) != NULL, "%s", shown);
    free(shown);
    ck_assert_int_eq(test_daemon_stop(again, SIGTERM, 30000), 0);
    em_test_remove_tree(dir);
}
END_TEST

static Suite *gpu_faults_suite(void)
{
    Suite *suite = suite_create("gpu_faults");
    TCase *tc = tcase_create("gpu_faults");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, a_gpu_fault_fails_the_request_and_the_daemon_exits_for_a_restart);
    suite_add_tcase(suite, tc);
    return suite;
}

int main(void)
{
    test_skip_without_backend();
    SRunner *runner = srunner_create(gpu_faults_suite());
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
