/*
 * Named failpoints (lib/base/failpoint.h) armed in a real emberd once it serves, through
 * the file EMBER_FAILPOINTS_FILE names and SIGHUP: each failure gives the named error,
 * applies nothing, and the daemon serves normally afterwards.
 */
#include <check.h>
#include <stdbool.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "proto/ember.pb-c.h"
#include "tests/integration/harness.h"

#define TABLE_JSON                                                                         \
    "{\"tables\": [{\"name\": \"t\", \"dim\": 4, \"capacity\": 1000, \"shards\": 2,"        \
    " \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.5}, \"initializer\": {\"type\": \"zeros\"}}]}"

static const uint32_t offsets[] = {0, 2, 3};
static const uint64_t keys[] = {10, 11, 12};

/* Starts a daemon, then arms failpoints in it (written to its failpoint file, SIGHUP)
 * and waits until its log says they are armed. */
static test_daemon *start_with(const char *failpoints)
{
    char path[] = "/tmp/ember-failpoints-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    setenv("EMBER_FAILPOINTS_FILE", path, 1);
    test_daemon *daemon = test_daemon_start(TABLE_JSON);
    unsetenv("EMBER_FAILPOINTS_FILE");
    FILE *file = fopen(path, "w");
    fprintf(file, "%s\n", failpoints);
    fclose(file);
    ck_assert_int_eq(kill(daemon->pid, SIGHUP), 0);
    /* generous: under sanitizers on a loaded machine the reload can take seconds */
    ck_assert_msg(test_daemon_wait_log(daemon, "failpoints armed (for tests only)", 30000),
                  "the daemon did not arm %s", failpoints);
    unlink(path);
    return daemon;
}

static test_frame push(const test_daemon *daemon, uint64_t id, uint64_t deadline_ms)
{
    float gradients[3 * 4];
    for (int i = 0; i < 12; i++)
        gradients[i] = 1.0f;
    Ember__PushRequest body = EMBER__PUSH_REQUEST__INIT;
    body.table = "t";
    body.rows = 2;
    body.nnz = 3;
    size_t length = 0;
    uint8_t *attachment = test_csr_attachment(2, offsets, 3, keys, gradients, 12, &length);
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = id;
    meta.method = EMBER__METHOD__PUSH;
    meta.deadline_ms = deadline_ms;
    int fd = test_connect(daemon->data);
    ck_assert(test_send_frame(fd, &meta, &body.base, attachment, length));
    free(attachment);
    test_frame frame;
    ck_assert_int_eq(test_read_frame(fd, 10000, &frame), 1);
    close(fd);
    return frame;
}

/* Pulls the three keys without creating them: how many are missing, and the values. */
static uint64_t pull_missing(const test_daemon *daemon, float out[12])
{
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = "t";
    body.rows = 2;
    body.nnz = 3;
    size_t length = 0;
    uint8_t *attachment = test_csr_attachment(2, offsets, 3, keys, NULL, 0, &length);
    int fd = test_connect(daemon->data);
    test_frame frame = test_call(fd, 7, EMBER__METHOD__PULL, NULL, &body.base, attachment, length);
    free(attachment);
    close(fd);
    ck_assert_msg(frame.meta->status == EMBER__STATUS__OK, "%s", frame.meta->error);
    ck_assert_uint_eq(frame.attachment_length, 12 * sizeof(float));
    memcpy(out, frame.attachment, 12 * sizeof(float));
    Ember__PullResponse *response = ember__pull_response__unpack(NULL, frame.body_length,
                                                                 frame.body);
    uint64_t missing = response->missing;
    ember__pull_response__free_unpacked(response, NULL);
    test_frame_free(&frame);
    return missing;
}

START_TEST(a_failed_pool_allocation_applies_nothing)
{
    test_daemon *daemon = start_with("pool_alloc*1");
    test_frame failed = push(daemon, 1, 0);
    ck_assert_int_eq(failed.meta->status, EMBER__STATUS__RESOURCE_EXHAUSTED);
    ck_assert_msg(strstr(failed.meta->error, "failpoint pool_alloc") != NULL, "%s",
                  failed.meta->error);
    test_frame_free(&failed);
    float values[12];
    ck_assert_uint_eq(pull_missing(daemon, values), 3); /* nothing was created */
    test_frame ok = push(daemon, 2, 0);
    ck_assert_msg(ok.meta->status == EMBER__STATUS__OK, "%s", ok.meta->error);
    test_frame_free(&ok);
    ck_assert_uint_eq(pull_missing(daemon, values), 0);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(a_stalled_worker_runs_out_the_deadline_and_applies_nothing)
{
    test_daemon *daemon = start_with("worker_stall=600*1");
    test_frame late = push(daemon, 1, 200);
    ck_assert_int_eq(late.meta->status, EMBER__STATUS__DEADLINE_EXCEEDED);
    ck_assert_msg(strstr(late.meta->error, "PUSH waited") != NULL, "%s", late.meta->error);
    test_frame_free(&late);
    float values[12];
    ck_assert_uint_eq(pull_missing(daemon, values), 3);
    test_frame ok = push(daemon, 2, 2000);
    ck_assert_msg(ok.meta->status == EMBER__STATUS__OK, "%s", ok.meta->error);
    test_frame_free(&ok);
    ck_assert_uint_eq(pull_missing(daemon, values), 0);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(answers_written_a_few_bytes_at_a_time_arrive_whole)
{
    test_daemon *daemon = start_with("partial_write=3");
    test_frame ok = push(daemon, 1, 0);
    ck_assert_msg(ok.meta->status == EMBER__STATUS__OK, "%s", ok.meta->error);
    ck_assert_uint_eq(ok.meta->correlation_id, 1);
    test_frame_free(&ok);
    float values[12];
    ck_assert_uint_eq(pull_missing(daemon, values), 0);
    /* zeros initialised, one sgd step of lr 0.5 on gradient 1 (key 10 and 11 in row 0) */
    for (int i = 0; i < 12; i++)
        ck_assert_float_eq(values[i], -0.5f);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(a_failed_accept_drops_one_connection_and_the_next_is_served)
{
    test_daemon *daemon = start_with("accept_fail*1");
    int dropped = test_connect(daemon->data);
    ck_assert(test_wait_closed(dropped, 5000));
    close(dropped);
    test_frame ok = push(daemon, 1, 0);
    ck_assert_msg(ok.meta->status == EMBER__STATUS__OK, "%s", ok.meta->error);
    test_frame_free(&ok);
    char *log = test_daemon_log(daemon);
    ck_assert_msg(strstr(log, "accept on the data listener failed") != NULL, "%s", log);
    free(log);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

static Suite *failpoints_suite(void)
{
    Suite *suite = suite_create("failpoints");
    TCase *tc = tcase_create("failpoints");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, a_failed_pool_allocation_applies_nothing);
    tcase_add_test(tc, a_stalled_worker_runs_out_the_deadline_and_applies_nothing);
    tcase_add_test(tc, answers_written_a_few_bytes_at_a_time_arrive_whole);
    tcase_add_test(tc, a_failed_accept_drops_one_connection_and_the_next_is_served);
    suite_add_tcase(suite, tc);
    return suite;
}

int main(void)
{
    SRunner *runner = srunner_create(failpoints_suite());
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
