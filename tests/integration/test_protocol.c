/*
 * A real emberd on loopback, spoken to with raw frames: the wire contract of
 * README.md "Wire protocol", every kind of bad input, and what the daemon does after it.
 */
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/integration/harness.h"
#include "tests/support/test_support.h"

#define TABLE_JSON                                                                         \
    "{\"name\": \"t\", \"dim\": 4, \"capacity\": 1000, \"shards\": 2,"                     \
    " \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.5},"                                    \
    " \"initializer\": {\"type\": \"uniform\", \"bound\": 0.1, \"seed\": 3}}"

static const char *with_table = "{\"tables\": [" TABLE_JSON "]}";

/* ---- helpers --------------------------------------------------------------------------- */

static test_frame pull(int fd, uint64_t id, const char *table, uint32_t rows,
                       const uint32_t *offsets, uint64_t nnz, const uint64_t *keys, int combiner,
                       bool create)
{
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = (char *)table;
    body.rows = rows;
    body.nnz = nnz;
    body.combiner = (Ember__Combiner)combiner;
    body.create_missing = create;
    size_t length = 0;
    uint8_t *attachment = test_csr_attachment(rows, offsets, nnz, keys, NULL, 0, &length);
    test_frame frame = test_call(fd, id, EMBER__METHOD__PULL, NULL, &body.base, attachment, length);
    free(attachment);
    return frame;
}

static test_frame push(int fd, uint64_t id, const char *table, uint32_t rows,
                       const uint32_t *offsets, uint64_t nnz, const uint64_t *keys, int combiner,
                       const float *gradients, uint64_t gradient_count)
{
    Ember__PushRequest body = EMBER__PUSH_REQUEST__INIT;
    body.table = (char *)table;
    body.rows = rows;
    body.nnz = nnz;
    body.combiner = (Ember__Combiner)combiner;
    size_t length = 0;
    uint8_t *attachment =
        test_csr_attachment(rows, offsets, nnz, keys, gradients, gradient_count, &length);
    test_frame frame = test_call(fd, id, EMBER__METHOD__PUSH, NULL, &body.base, attachment, length);
    free(attachment);
    return frame;
}

static void assert_status(const test_frame *frame, int status, const char *fragment)
{
    ck_assert_msg((int)frame->meta->status == status, "status %d (%s), wanted %d",
                  (int)frame->meta->status, frame->meta->error, status);
    if (fragment != NULL)
        ck_assert_msg(strstr(frame->meta->error, fragment) != NULL, "error '%s' lacks '%s'",
                      frame->meta->error, fragment);
}

/* The daemon still answers a fresh connection. */
static void assert_still_serving(const test_daemon *daemon)
{
    int fd = test_connect(daemon->data);
    Ember__PingRequest ping = EMBER__PING_REQUEST__INIT;
    test_frame frame = test_call(fd, 4242, EMBER__METHOD__PING, NULL, &ping.base, NULL, 0);
    assert_status(&frame, EMBER__STATUS__OK, NULL);
    test_frame_free(&frame);
    close(fd);
}

/* Pulls keys 1..4 without creating: the table's current view of them. */
static void snapshot_keys(int fd, float out[16], uint64_t *missing)
{
    const uint32_t offsets[] = {0, 4};
    const uint64_t keys[] = {1, 2, 3, 4};
    test_frame frame = pull(fd, 900, "t", 1, offsets, 4, keys, EMBER__COMBINER__NONE, false);
    assert_status(&frame, EMBER__STATUS__OK, NULL);
    ck_assert_uint_eq(frame.attachment_length, 16 * sizeof(float));
    memcpy(out, frame.attachment, 16 * sizeof(float));
    Ember__PullResponse *response =
        ember__pull_response__unpack(NULL, frame.body_length, frame.body);
    *missing = response->missing;
    ember__pull_response__free_unpacked(response, NULL);
    test_frame_free(&frame);
}

/* Sends raw bytes and expects one error frame with the given status, then EOF. */
static void expect_fatal(const test_daemon *daemon, const void *bytes, size_t length,
                         int status, uint64_t correlation_id, const char *fragment)
{
    int fd = test_connect(daemon->data);
    ck_assert(test_send_all(fd, bytes, length));
    test_frame frame;
    ck_assert_int_eq(test_read_frame(fd, 10000, &frame), 1);
    assert_status(&frame, status, fragment);
    ck_assert_uint_eq(frame.meta->correlation_id, correlation_id);
    test_frame_free(&frame);
    ck_assert_msg(test_wait_closed(fd, 10000), "connection stayed open after a framing error");
    close(fd);
    assert_still_serving(daemon);
}

static void header(uint8_t out[24], const char *magic, uint32_t meta, uint64_t body,
                   uint64_t attachment)
{
    memcpy(out, magic, 4);
    em_put_u32(out + 4, meta);
    em_put_u64(out + 8, body);
    em_put_u64(out + 16, attachment);
}

/* ---- health ---------------------------------------------------------------------------- */

START_TEST(ping_and_health_on_both_listeners)
{
    test_daemon *daemon = test_daemon_start(with_table);
    const char *addresses[] = {daemon->data, daemon->admin};
    for (int i = 0; i < 2; i++) {
        int fd = test_connect(addresses[i]);
        Ember__PingRequest ping = EMBER__PING_REQUEST__INIT;
        test_frame frame = test_call(fd, 7, EMBER__METHOD__PING, NULL, &ping.base, NULL, 0);
        assert_status(&frame, EMBER__STATUS__OK, NULL);
        ck_assert_int_eq(frame.meta->method, EMBER__METHOD__PING);
        Ember__PingResponse *pong =
            ember__ping_response__unpack(NULL, frame.body_length, frame.body);
        ck_assert_ptr_nonnull(pong);
        ck_assert_str_eq(pong->version, "0.1.0");
        ember__ping_response__free_unpacked(pong, NULL);
        test_frame_free(&frame);

        Ember__HealthRequest health = EMBER__HEALTH_REQUEST__INIT;
        frame = test_call(fd, 8, EMBER__METHOD__HEALTH, NULL, &health.base, NULL, 0);
        assert_status(&frame, EMBER__STATUS__OK, NULL);
        Ember__HealthResponse *state =
            ember__health_response__unpack(NULL, frame.body_length, frame.body);
        ck_assert(state->ready);
        ck_assert_str_eq(state->state, "serving");
        ck_assert_str_eq(state->backend, test_backend_name());
        ck_assert_uint_eq(state->devices, 1);
        ck_assert_uint_eq(state->tables, 1);
        ember__health_response__free_unpacked(state, NULL);
        test_frame_free(&frame);
        close(fd);
    }
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* ---- framing errors -------------------------------------------------------------------- */

START_TEST(bad_magic_gets_one_error_and_closes)
{
    test_daemon *daemon = test_daemon_start(NULL);
    uint8_t bytes[24];
    header(bytes, "HTTP", 10, 0, 0);
    expect_fatal(daemon, bytes, sizeof(bytes), EMBER__STATUS__INVALID_ARGUMENT, 0,
                 "bad frame magic 48 54 54 50");
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(lengths_over_each_limit_are_refused_before_reading)
{
    test_daemon *daemon = test_daemon_start(
        "{\"limits\": {\"max_meta_bytes\": 512, \"max_body_bytes\": 4096,"
        " \"max_attachment_bytes\": 65536}}");
    uint8_t bytes[24];
    header(bytes, "EMB1", 0, 0, 0);
    expect_fatal(daemon, bytes, 24, EMBER__STATUS__INVALID_ARGUMENT, 0, "meta_len is 0");
    header(bytes, "EMB1", 513, 0, 0);
    expect_fatal(daemon, bytes, 24, EMBER__STATUS__RESOURCE_EXHAUSTED, 0,
                 "meta_len 513 exceeds the limit of 512 bytes");
    header(bytes, "EMB1", 10, 4097, 0);
    expect_fatal(daemon, bytes, 24, EMBER__STATUS__RESOURCE_EXHAUSTED, 0,
                 "body_len 4097 exceeds the limit of 4096 bytes");
    header(bytes, "EMB1", 10, 0, 65537);
    expect_fatal(daemon, bytes, 24, EMBER__STATUS__RESOURCE_EXHAUSTED, 0,
                 "attach_len 65537 exceeds the limit of 65536 bytes");
    /* A huge length never reaches malloc. */
    header(bytes, "EMB1", 10, UINT64_MAX, UINT64_MAX);
    expect_fatal(daemon, bytes, 24, EMBER__STATUS__RESOURCE_EXHAUSTED, 0, "body_len");
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(undecodable_meta_and_body)
{
    test_daemon *daemon = test_daemon_start(with_table);
    uint8_t garbage_meta[24 + 6];
    header(garbage_meta, "EMB1", 6, 0, 0);
    memset(garbage_meta + 24, 0xff, 6);
    expect_fatal(daemon, garbage_meta, sizeof(garbage_meta), EMBER__STATUS__INVALID_ARGUMENT, 0,
                 "RpcMeta could not be decoded");

    /* Good meta (correlation 77, PULL), garbage body: the error keeps the id. */
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = 77;
    meta.method = EMBER__METHOD__PULL;
    size_t meta_length = protobuf_c_message_get_packed_size(&meta.base);
    uint8_t frame[256];
    header(frame, "EMB1", (uint32_t)meta_length, 5, 0);
    protobuf_c_message_pack(&meta.base, frame + 24);
    memset(frame + 24 + meta_length, 0xff, 5);
    expect_fatal(daemon, frame, 24 + meta_length + 5, EMBER__STATUS__INVALID_ARGUMENT, 77,
                 "PULL body (5 bytes) could not be decoded");
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(truncated_frames_and_idle_connections_are_dropped)
{
    test_daemon *daemon = test_daemon_start("{\"limits\": {\"idle_timeout_ms\": 300}}");
    /* Half a frame, then the client leaves. */
    int fd = test_connect(daemon->data);
    uint8_t bytes[24 + 4];
    header(bytes, "EMB1", 40, 0, 0);
    ck_assert(test_send_all(fd, bytes, sizeof(bytes)));
    close(fd);
    assert_still_serving(daemon);
    /* Half a frame, then silence: the idle timeout closes it. */
    fd = test_connect(daemon->data);
    ck_assert(test_send_all(fd, bytes, sizeof(bytes)));
    ck_assert(test_wait_closed(fd, 5000));
    close(fd);
    /* A connection that never sends closes too. */
    fd = test_connect(daemon->data);
    ck_assert(test_wait_closed(fd, 5000));
    close(fd);
    assert_still_serving(daemon);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* ---- request errors: answered, connection open, nothing applied ----------------------- */

START_TEST(unknown_method_is_unimplemented_and_connection_stays)
{
    test_daemon *daemon = test_daemon_start(NULL);
    int fd = test_connect(daemon->data);
    Ember__PingRequest empty = EMBER__PING_REQUEST__INIT;
    test_frame frame = test_call(fd, 5, 99, NULL, &empty.base, NULL, 0);
    assert_status(&frame, EMBER__STATUS__UNIMPLEMENTED, "method 99");
    test_frame_free(&frame);
    frame = test_call(fd, 6, EMBER__METHOD__PING, NULL, &empty.base, NULL, 0);
    assert_status(&frame, EMBER__STATUS__OK, NULL);
    test_frame_free(&frame);
    close(fd);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(bad_requests_are_answered_and_apply_nothing)
{
    test_daemon *daemon = test_daemon_start(with_table);
    int fd = test_connect(daemon->data);
    const uint32_t offsets[] = {0, 2, 4};
    const uint64_t keys[] = {1, 2, 3, 4};
    float before[16], after[16];
    uint64_t missing = 0;
    /* Create keys 1 and 2 only. */
    test_frame frame = pull(fd, 1, "t", 1, offsets, 2, keys, EMBER__COMBINER__NONE, true);
    assert_status(&frame, EMBER__STATUS__OK, NULL);
    test_frame_free(&frame);
    snapshot_keys(fd, before, &missing);
    ck_assert_uint_eq(missing, 2);

    float gradients[4 * 4];
    for (int i = 0; i < 16; i++)
        gradients[i] = 1.0f;

    /* Unknown table. */
    frame = push(fd, 2, "nope", 2, offsets, 4, keys, EMBER__COMBINER__NONE, gradients, 16);
    assert_status(&frame, EMBER__STATUS__NOT_FOUND, "no table 'nope' (tables: t)");
    test_frame_free(&frame);
    /* Bad CSR. */
    const uint32_t bad_offsets[] = {0, 3, 2};
    frame = push(fd, 3, "t", 2, bad_offsets, 2, keys, EMBER__COMBINER__SUM, gradients, 8);
    assert_status(&frame, EMBER__STATUS__INVALID_ARGUMENT, "offsets[2]=2 < offsets[1]=3");
    test_frame_free(&frame);
    /* Wrong dim: gradients for dim 3. */
    frame = push(fd, 4, "t", 2, offsets, 4, keys, EMBER__COMBINER__NONE, gradients, 12);
    assert_status(&frame, EMBER__STATUS__INVALID_ARGUMENT,
                  "the gradients hold 3 floats a vector where the table's dim is 4");
    test_frame_free(&frame);
    /* Gradients that are no whole number of floats a vector: only the sizes named. */
    frame = push(fd, 4, "t", 2, offsets, 4, keys, EMBER__COMBINER__NONE, gradients, 15);
    assert_status(&frame, EMBER__STATUS__INVALID_ARGUMENT, "(dim 4)");
    ck_assert_ptr_null(strstr(frame.meta->error, "floats a vector"));
    test_frame_free(&frame);
    /* NaN in the gradient of the 4th key. */
    gradients[3 * 4 + 1] = NAN;
    frame = push(fd, 5, "t", 2, offsets, 4, keys, EMBER__COMBINER__NONE, gradients, 16);
    assert_status(&frame, EMBER__STATUS__INVALID_ARGUMENT,
                  "gradient of key 4 (keys[3], row 1) element 1 is NaN");
    test_frame_free(&frame);
    gradients[3 * 4 + 1] = 1.0f;
    /* Attachment shorter than the body says (nnz 4, keys for 3). */
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = "t";
    body.rows = 2;
    body.nnz = 4;
    body.create_missing = true;
    size_t length = 0;
    uint8_t *attachment = test_csr_attachment(2, offsets, 3, keys, NULL, 0, &length);
    frame = test_call(fd, 6, EMBER__METHOD__PULL, NULL, &body.base, attachment, length);
    free(attachment);
    assert_status(&frame, EMBER__STATUS__INVALID_ARGUMENT,
                  "PULL attachment is 40 bytes; rows=2 nnz=4 need 48");
    test_frame_free(&frame);
    /* Bad combiner. */
    frame = pull(fd, 7, "t", 2, offsets, 4, keys, 7, true);
    assert_status(&frame, EMBER__STATUS__INVALID_ARGUMENT, "combiner 7");
    test_frame_free(&frame);
    /* Non-zero padding. */
    attachment = test_csr_attachment(2, offsets, 4, keys, NULL, 0, &length);
    attachment[12] = 1;
    body.nnz = 4;
    frame = test_call(fd, 8, EMBER__METHOD__PULL, NULL, &body.base, attachment, length);
    free(attachment);
    assert_status(&frame, EMBER__STATUS__INVALID_ARGUMENT, "padding byte 12 is 0x01");
    test_frame_free(&frame);

    snapshot_keys(fd, after, &missing);
    ck_assert_uint_eq(missing, 2);
    ck_assert(memcmp(before, after, sizeof(before)) == 0);
    close(fd);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(capacity_exhaustion_is_resource_exhausted_and_whole)
{
    test_daemon *daemon = test_daemon_start(
        "{\"tables\": [{\"name\": \"small\", \"dim\": 2, \"capacity\": 3}]}");
    int fd = test_connect(daemon->data);
    const uint32_t offsets[] = {0, 4};
    const uint64_t keys[] = {10, 11, 12, 13};
    test_frame frame = pull(fd, 1, "small", 1, offsets, 4, keys, EMBER__COMBINER__SUM, true);
    assert_status(&frame, EMBER__STATUS__RESOURCE_EXHAUSTED,
                  "table 'small': capacity 3 rows would be exceeded: it holds 0 rows and this "
                  "request would create 4 new keys");
    test_frame_free(&frame);
    const uint32_t three[] = {0, 3};
    frame = pull(fd, 2, "small", 1, three, 3, keys, EMBER__COMBINER__SUM, true);
    assert_status(&frame, EMBER__STATUS__OK, NULL);
    test_frame_free(&frame);
    close(fd);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* ---- tokens ---------------------------------------------------------------------------- */

START_TEST(admin_methods_need_the_admin_listener_and_token)
{
    test_daemon *daemon = test_daemon_start(NULL);
    Ember__ListTablesRequest list = EMBER__LIST_TABLES_REQUEST__INIT;
    int data = test_connect(daemon->data);
    test_frame frame =
        test_call(data, 1, EMBER__METHOD__LIST_TABLES, TEST_ADMIN_TOKEN, &list.base, NULL, 0);
    assert_status(&frame, EMBER__STATUS__PERMISSION_DENIED,
                  "LIST_TABLES is an admin method; send it to the admin listener");
    test_frame_free(&frame);
    close(data);

    int admin = test_connect(daemon->admin);
    frame = test_call(admin, 2, EMBER__METHOD__LIST_TABLES, NULL, &list.base, NULL, 0);
    assert_status(&frame, EMBER__STATUS__UNAUTHENTICATED, "needs the admin token; none was sent");
    test_frame_free(&frame);
    frame = test_call(admin, 3, EMBER__METHOD__LIST_TABLES, "guess", &list.base, NULL, 0);
    assert_status(&frame, EMBER__STATUS__UNAUTHENTICATED, "is not the admin token");
    test_frame_free(&frame);
    frame = test_call(admin, 4, EMBER__METHOD__LIST_TABLES, TEST_ADMIN_TOKEN, &list.base, NULL, 0);
    assert_status(&frame, EMBER__STATUS__OK, NULL);
    test_frame_free(&frame);
    close(admin);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(data_token_guards_data_methods)
{
    test_daemon *daemon = test_daemon_start(
        "{\"data_token\": {\"value\": \"data-secret\"}, \"tables\": [" TABLE_JSON "]}");
    int fd = test_connect(daemon->data);
    const uint32_t offsets[] = {0, 1};
    const uint64_t keys[] = {1};
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = "t";
    body.rows = 1;
    body.nnz = 1;
    size_t length = 0;
    uint8_t *attachment = test_csr_attachment(1, offsets, 1, keys, NULL, 0, &length);
    test_frame frame =
        test_call(fd, 1, EMBER__METHOD__PULL, NULL, &body.base, attachment, length);
    assert_status(&frame, EMBER__STATUS__UNAUTHENTICATED, "PULL needs the data token");
    test_frame_free(&frame);
    frame = test_call(fd, 2, EMBER__METHOD__PULL, "wrong", &body.base, attachment, length);
    assert_status(&frame, EMBER__STATUS__UNAUTHENTICATED, "is not the data token");
    test_frame_free(&frame);
    frame = test_call(fd, 3, EMBER__METHOD__PULL, "data-secret", &body.base, attachment, length);
    assert_status(&frame, EMBER__STATUS__OK, NULL);
    test_frame_free(&frame);
    /* Ping needs no token. */
    Ember__PingRequest ping = EMBER__PING_REQUEST__INIT;
    frame = test_call(fd, 4, EMBER__METHOD__PING, NULL, &ping.base, NULL, 0);
    assert_status(&frame, EMBER__STATUS__OK, NULL);
    test_frame_free(&frame);
    free(attachment);
    close(fd);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(too_many_connections_are_refused_with_a_reason)
{
    test_daemon *daemon = test_daemon_start("{\"limits\": {\"max_connections\": 3}}");
    int fds[3];
    for (int i = 0; i < 3; i++)
        fds[i] = test_connect(daemon->data);
    /* make sure all three are accepted before the fourth */
    for (int i = 0; i < 3; i++) {
        Ember__PingRequest ping = EMBER__PING_REQUEST__INIT;
        test_frame frame = test_call(fds[i], 1, EMBER__METHOD__PING, NULL, &ping.base, NULL, 0);
        test_frame_free(&frame);
    }
    int extra = test_connect(daemon->data);
    test_frame frame;
    ck_assert_int_eq(test_read_frame(extra, 10000, &frame), 1);
    assert_status(&frame, EMBER__STATUS__RESOURCE_EXHAUSTED, "max_connections");
    test_frame_free(&frame);
    ck_assert(test_wait_closed(extra, 10000));
    close(extra);
    close(fds[0]);
    usleep(100000);
    int again = test_connect(daemon->data);
    Ember__PingRequest ping = EMBER__PING_REQUEST__INIT;
    frame = test_call(again, 2, EMBER__METHOD__PING, NULL, &ping.base, NULL, 0);
    assert_status(&frame, EMBER__STATUS__OK, NULL);
    test_frame_free(&frame);
    close(again);
    close(fds[1]);
    close(fds[2]);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

int main(void)
{
    test_skip_without_backend();
    Suite *suite = suite_create("protocol");
    TCase *tc = tcase_create("protocol");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, ping_and_health_on_both_listeners);
    tcase_add_test(tc, bad_magic_gets_one_error_and_closes);
    tcase_add_test(tc, lengths_over_each_limit_are_refused_before_reading);
    tcase_add_test(tc, undecodable_meta_and_body);
    tcase_add_test(tc, truncated_frames_and_idle_connections_are_dropped);
    tcase_add_test(tc, unknown_method_is_unimplemented_and_connection_stays);
    tcase_add_test(tc, bad_requests_are_answered_and_apply_nothing);
    tcase_add_test(tc, capacity_exhaustion_is_resource_exhausted_and_whole);
    tcase_add_test(tc, admin_methods_need_the_admin_listener_and_token);
    tcase_add_test(tc, data_token_guards_data_methods);
    tcase_add_test(tc, too_many_connections_are_refused_with_a_reason);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
