/*
 * emberd under hostile and careless clients: its memory stays within its budget, its
 * timeouts close what would pin memory, operators keep their own listener, and
 * well-behaved clients keep being served.
 *
 * Each case drives a real emberd (tests/integration/harness.h) and reads its resident
 * memory from /proc while the load is on. The bound checked is the configured
 * limits.memory_bytes plus OVERHEAD_BYTES over the daemon's resident size before the
 * load: the overhead covers the allocator's slack, the connections' own structures and
 * the read buffers of connections holding unconsumed bytes. Under ThreadSanitizer (a
 * build with -Db_sanitize=thread, whose daemon shadows every byte it touches with
 * several more) the bound is RSS_SCALE times the budget and overhead.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "tests/integration/harness.h"
#include "proto/ember.pb-c.h"
#include "proto/frame.h"

#define MIB (1024u * 1024u)
#define OVERHEAD_BYTES (48u * MIB)

#if defined(__SANITIZE_THREAD__)
#define RSS_SCALE 4u
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define RSS_SCALE 4u
#endif
#endif
#ifndef RSS_SCALE
#define RSS_SCALE 1u
#endif
#define DIM 1024u
/* What the STATS request asking holds while it runs (its frame and its answer's room). */
#define STATS_CHARGE_BYTES (300u * 1024u)

#define TABLE_JSON                                                                         \
    "{\"name\": \"t\", \"dim\": 1024, \"capacity\": 4096, \"shards\": 2,"                   \
    " \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.1}}"

/* ---- helpers --------------------------------------------------------------------------- */

static uint64_t rss_bytes(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *file = fopen(path, "r");
    ck_assert_msg(file != NULL, "cannot read %s", path);
    uint64_t kib = 0;
    while (fgets(line, sizeof(line), file) != NULL)
        if (sscanf(line, "VmRSS: %" SCNu64 " kB", &kib) == 1)
            break;
    fclose(file);
    return kib * 1024u;
}

static void sleep_ms(long ms)
{
    struct timespec pause = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&pause, NULL);
}

/* A PULL frame (header, meta, body, attachment) of rows empty rows pooled with SUM:
 * a request of about 4 bytes per row whose answer is dim floats per row. */
static uint8_t *pooled_pull_frame(uint64_t id, uint32_t rows, size_t *length)
{
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = "t";
    body.rows = rows;
    body.nnz = 0;
    body.combiner = EMBER__COMBINER__SUM;
    uint32_t *offsets = calloc((size_t)rows + 1, sizeof(uint32_t));
    size_t attachment_length = 0;
    uint8_t *attachment = test_csr_attachment(rows, offsets, 0, NULL, NULL, 0,
                                              &attachment_length);
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = id;
    meta.method = EMBER__METHOD__PULL;
    uint8_t *frame = NULL;
    size_t frame_length = 0;
    em_error err;
    ck_assert_int_eq(em_frame_pack(&meta, &body.base, attachment_length, &frame, &frame_length,
                                   &err),
                     EM_OK);
    uint8_t *whole = malloc(frame_length + attachment_length);
    memcpy(whole, frame, frame_length);
    memcpy(whole + frame_length, attachment, attachment_length);
    *length = frame_length + attachment_length;
    free(frame);
    free(attachment);
    free(offsets);
    return whole;
}

/* Sends what the socket takes now; returns the bytes sent. */
static size_t send_what_fits(int fd, const uint8_t *bytes, size_t length)
{
    size_t sent = 0;
    while (sent < length) {
        ssize_t n = send(fd, bytes + sent, length - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n <= 0)
            break;
        sent += (size_t)n;
    }
    return sent;
}

/* Pipelines count pooled pulls on fd without reading any answer; returns how many
 * whole frames went out. */
static int pipeline_pulls(int fd, uint32_t rows, int count)
{
    size_t length = 0;
    uint8_t *frame = pooled_pull_frame(1, rows, &length);
    int whole = 0;
    for (int i = 0; i < count; i++) {
        size_t sent = send_what_fits(fd, frame, length);
        if (sent < length)
            break;
        whole++;
    }
    free(frame);
    return whole;
}

static Ember__StatsResponse *stats(const test_daemon *daemon)
{
    int fd = test_connect(daemon->admin);
    Ember__StatsRequest request = EMBER__STATS_REQUEST__INIT;
    test_frame frame = test_call(fd, 99, EMBER__METHOD__STATS, TEST_ADMIN_TOKEN, &request.base,
                                 NULL, 0);
    ck_assert_msg(frame.meta->status == EMBER__STATUS__OK, "STATS: %s", frame.meta->error);
    Ember__StatsResponse *response = ember__stats_response__unpack(NULL, frame.body_length,
                                                                   frame.body);
    ck_assert(response != NULL);
    test_frame_free(&frame);
    close(fd);
    return response;
}

/* A well-behaved client: one pooled pull of 4 rows, answered OK within timeout_ms. */
static void assert_served(const test_daemon *daemon, int timeout_ms)
{
    int fd = test_connect(daemon->data);
    size_t length = 0;
    uint8_t *frame = pooled_pull_frame(7, 4, &length);
    ck_assert(test_send_all(fd, frame, length));
    free(frame);
    test_frame answer;
    ck_assert_int_eq(test_read_frame(fd, timeout_ms, &answer), 1);
    ck_assert_msg(answer.meta->status == EMBER__STATUS__OK, "pull: %s", answer.meta->error);
    ck_assert_uint_eq(answer.attachment_length, 4u * DIM * sizeof(float));
    test_frame_free(&answer);
    close(fd);
}

/* True when the server closes fd within timeout_ms; unlike test_wait_closed it reads
 * nothing, so a client that never reads stays one. */
static bool wait_hangup(int fd, int timeout_ms)
{
    struct pollfd watch = {.fd = fd, .events = POLLRDHUP};
    for (int waited = 0; waited < timeout_ms; waited += 50) {
        if (poll(&watch, 1, 50) > 0 && (watch.revents & (POLLRDHUP | POLLHUP | POLLERR)))
            return true;
    }
    return false;
}

static void assert_rss_within(const test_daemon *daemon, uint64_t baseline, uint64_t budget,
                              const char *when)
{
    uint64_t rss = rss_bytes(daemon->pid);
    printf("%s: RSS %" PRIu64 " MiB (baseline %" PRIu64 " MiB, budget %" PRIu64 " MiB)\n", when,
           rss / MIB, baseline / MIB, budget / MIB);
    fflush(stdout);
    ck_assert_msg(rss <= baseline + RSS_SCALE * (budget + OVERHEAD_BYTES),
                  "%s: RSS %" PRIu64 " MiB over baseline %" PRIu64 " MiB + %u x (budget %" PRIu64
                  " MiB + overhead %u MiB)",
                  when, rss / MIB, baseline / MIB, RSS_SCALE, budget / MIB, OVERHEAD_BYTES / MIB);
}

/* ---- answers nobody reads ------------------------------------------------------------- */

START_TEST(never_reading_clients_are_bounded_and_closed_by_the_write_timeout)
{
    /* 8 clients pipeline pulls of 256 empty pooled rows: 1 KiB asked, 1 MiB answered,
     * and never read. Each may hold its 4 MiB budget plus one answer; the server 64 MiB. */
    test_daemon *daemon = test_daemon_start(
        "{\"tables\": [" TABLE_JSON "], \"limits\": {\"memory_bytes\": 67108864,"
        " \"connection_inflight_bytes\": 4194304, \"write_timeout_ms\": 1500}}");
    assert_served(daemon, 5000);
    uint64_t baseline = rss_bytes(daemon->pid);
    enum { HOGS = 8 };
    int hogs[HOGS];
    int sent = 0;
    for (int i = 0; i < HOGS; i++) {
        hogs[i] = test_connect(daemon->data);
        sent += pipeline_pulls(hogs[i], 256, 400);
    }
    ck_assert_int_gt(sent, HOGS * 50); /* far more answer bytes than the budget */
    for (int round = 0; round < 5; round++) {
        sleep_ms(100);
        assert_rss_within(daemon, baseline, 64u * MIB, "never-reading clients");
        assert_served(daemon, 5000); /* others are still served */
    }
    Ember__StatsResponse *during = stats(daemon);
    ck_assert_uint_le(during->server->memory_peak_bytes, 64u * MIB);
    ck_assert_uint_eq(during->server->memory_limit_bytes, 64u * MIB);
    ember__stats_response__free_unpacked(during, NULL);
    /* No progress for 1.5 s: the server closes them and lets their memory go. */
    for (int i = 0; i < HOGS; i++)
        ck_assert_msg(wait_hangup(hogs[i], 10000), "a never-reading client stayed open");
    sleep_ms(100);
    Ember__StatsResponse *after = stats(daemon);
    ck_assert_uint_ge(after->server->timeouts_write, HOGS);
    ck_assert_uint_le(after->server->memory_used_bytes, STATS_CHARGE_BYTES);
    ember__stats_response__free_unpacked(after, NULL);
    for (int i = 0; i < HOGS; i++)
        close(hogs[i]);
    assert_served(daemon, 5000);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(a_full_server_budget_stops_reading_and_the_admin_still_answers)
{
    /* A server budget smaller than what the clients ask for: connections wait (STATS
     * says so), the admin listener still answers, and reading resumes as memory is
     * released. */
    test_daemon *daemon = test_daemon_start(
        "{\"tables\": [" TABLE_JSON "], \"limits\": {\"memory_bytes\": 8388608,"
        " \"connection_inflight_bytes\": 4194304, \"write_timeout_ms\": 1000}}");
    uint64_t baseline = rss_bytes(daemon->pid);
    enum { HOGS = 6 };
    int hogs[HOGS];
    for (int i = 0; i < HOGS; i++) {
        hogs[i] = test_connect(daemon->data);
        pipeline_pulls(hogs[i], 1024, 100); /* 4 MiB answers */
    }
    sleep_ms(300);
    Ember__StatsResponse *during = stats(daemon);
    ck_assert_uint_gt(during->server->memory_waits, 0);
    ck_assert_uint_le(during->server->memory_used_bytes, 8u * MIB + 5u * MIB);
    ember__stats_response__free_unpacked(during, NULL);
    assert_rss_within(daemon, baseline, 8u * MIB, "a full server budget");
    for (int i = 0; i < HOGS; i++) {
        ck_assert(wait_hangup(hogs[i], 20000));
        close(hogs[i]);
    }
    assert_served(daemon, 5000);
    Ember__StatsResponse *after = stats(daemon);
    ck_assert_uint_eq(after->server->connections_waiting, 0);
    ember__stats_response__free_unpacked(after, NULL);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* ---- slow and stalled senders ------------------------------------------------------------ */

START_TEST(trickling_and_stalled_frames_are_closed_by_the_frame_timeout)
{
    test_daemon *daemon = test_daemon_start(
        "{\"tables\": [" TABLE_JSON "], \"limits\": {\"memory_bytes\": 67108864,"
        " \"frame_timeout_ms\": 800, \"idle_timeout_ms\": 60000}}");
    uint64_t baseline = rss_bytes(daemon->pid);
    /* A frame announcing the largest meta, sent one byte at a time: each byte resets no
     * clock, so the frame timeout closes it although bytes keep coming. */
    int trickle = test_connect(daemon->data);
    uint8_t header[24];
    memcpy(header, "EMB1", 4);
    em_put_u32(header + 4, 65536);
    em_put_u64(header + 8, 0);
    em_put_u64(header + 16, 0);
    ck_assert(test_send_all(trickle, header, sizeof(header)));
    /* 100 valid pulls announcing 4M keys (a 32 MiB attachment each), then silence: what
     * is charged before the attachment is read is bounded by the server's budget. */
    enum { STALLED = 100 };
    int stalled[STALLED];
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = "t";
    body.rows = 1;
    body.nnz = 4u << 20;
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.method = EMBER__METHOD__PULL;
    em_csr_attachment layout;
    em_error err;
    ck_assert_int_eq(em_csr_attachment_layout(1, body.nnz, 0, &layout, &err), EM_OK);
    uint8_t *frame = NULL;
    size_t frame_length = 0;
    ck_assert_int_eq(em_frame_pack(&meta, &body.base, layout.total, &frame, &frame_length, &err),
                     EM_OK);
    for (int i = 0; i < STALLED; i++) {
        stalled[i] = test_connect(daemon->data);
        ck_assert(test_send_all(stalled[i], frame, frame_length));
    }
    free(frame);
    bool closed = false;
    for (int i = 0; i < 30 && !closed; i++) {
        uint8_t byte = 0;
        closed = send(trickle, &byte, 1, MSG_NOSIGNAL) < 0;
        assert_rss_within(daemon, baseline, 64u * MIB, "stalled frames");
        sleep_ms(100);
    }
    ck_assert(test_wait_closed(trickle, 5000));
    close(trickle);
    for (int i = 0; i < STALLED; i++) {
        ck_assert(test_wait_closed(stalled[i], 10000));
        close(stalled[i]);
    }
    Ember__StatsResponse *after = stats(daemon);
    ck_assert_uint_ge(after->server->timeouts_frame, STALLED + 1);
    ck_assert_uint_le(after->server->memory_used_bytes, STATS_CHARGE_BYTES);
    ember__stats_response__free_unpacked(after, NULL);
    assert_served(daemon, 5000);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(a_request_larger_than_the_whole_budget_is_refused_unread)
{
    test_daemon *daemon = test_daemon_start(
        "{\"tables\": [" TABLE_JSON "], \"limits\": {\"memory_bytes\": 4194304}}");
    int fd = test_connect(daemon->data);
    size_t length = 0;
    uint8_t *frame = pooled_pull_frame(5, 2048, &length); /* an 8 MiB answer */
    ck_assert(test_send_all(fd, frame, length));
    free(frame);
    test_frame answer;
    ck_assert_int_eq(test_read_frame(fd, 5000, &answer), 1);
    ck_assert_int_eq(answer.meta->status, EMBER__STATUS__RESOURCE_EXHAUSTED);
    ck_assert_msg(strstr(answer.meta->error, "more than limits.memory_bytes 4194304") != NULL,
                  "%s", answer.meta->error);
    ck_assert_uint_eq(answer.meta->correlation_id, 5);
    test_frame_free(&answer);
    /* The connection goes on: the refused frame's attachment was skipped, not parsed. */
    frame = pooled_pull_frame(6, 4, &length);
    ck_assert(test_send_all(fd, frame, length));
    free(frame);
    ck_assert_int_eq(test_read_frame(fd, 5000, &answer), 1);
    ck_assert_int_eq(answer.meta->status, EMBER__STATUS__OK);
    test_frame_free(&answer);
    close(fd);
    Ember__StatsResponse *after = stats(daemon);
    ck_assert_uint_eq(after->server->requests_refused_memory, 1);
    ember__stats_response__free_unpacked(after, NULL);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(frames_parked_for_memory_too_long_are_refused)
{
    /* A 16 MiB server budget and pulls answering 12 MiB each from clients that do not
     * read: one answer holds the budget (more than the sockets' buffers take), the other
     * frames wait for memory, and after frame_timeout_ms they are answered
     * RESOURCE_EXHAUSTED and their memory let go. */
    test_daemon *daemon = test_daemon_start(
        "{\"tables\": [" TABLE_JSON "], \"limits\": {\"memory_bytes\": 16777216,"
        " \"frame_timeout_ms\": 1000, \"write_timeout_ms\": 60000}}");
    enum { CLIENTS = 4 };
    int fds[CLIENTS];
    size_t length = 0;
    uint8_t *frame = pooled_pull_frame(3, 3072, &length);
    for (int i = 0; i < CLIENTS; i++) {
        fds[i] = test_connect(daemon->data);
        ck_assert(test_send_all(fds[i], frame, length));
    }
    free(frame);
    sleep_ms(2500);
    int refused = 0, answered = 0;
    for (int i = 0; i < CLIENTS; i++) {
        test_frame answer;
        ck_assert_int_eq(test_read_frame(fds[i], 20000, &answer), 1);
        if (answer.meta->status == EMBER__STATUS__OK) {
            answered++;
        } else {
            ck_assert_int_eq(answer.meta->status, EMBER__STATUS__RESOURCE_EXHAUSTED);
            ck_assert_msg(strstr(answer.meta->error, "for memory (limits.memory_bytes") != NULL,
                          "%s", answer.meta->error);
            refused++;
        }
        test_frame_free(&answer);
        close(fds[i]);
    }
    ck_assert_int_ge(answered, 1);
    ck_assert_int_ge(refused, 1);
    Ember__StatsResponse *after = stats(daemon);
    ck_assert_uint_ge(after->server->timeouts_frame, (uint64_t)refused);
    ember__stats_response__free_unpacked(after, NULL);
    assert_served(daemon, 5000);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* ---- connections ------------------------------------------------------------------------ */

START_TEST(two_thousand_data_connections_leave_the_admin_listener_open)
{
    /* max_connections 1500: 2,000 data connections fill it and are refused past it, and
     * operators still get in on the admin listener (its own limit). */
    test_daemon *daemon = test_daemon_start(
        "{\"tables\": [" TABLE_JSON "], \"log_level\": \"info\","
        " \"limits\": {\"max_connections\": 1500, \"max_admin_connections\": 4}}");
    uint64_t baseline = rss_bytes(daemon->pid);
    enum { CONNECTIONS = 2000 };
    int *fds = calloc(CONNECTIONS, sizeof(int));
    for (int i = 0; i < CONNECTIONS; i++)
        fds[i] = test_connect(daemon->data);
    sleep_ms(300);
    Ember__StatsResponse *during = stats(daemon);
    ck_assert_uint_ge(during->server->connections_rejected, CONNECTIONS - 1500);
    ck_assert_uint_le(during->server->connections_current - during->server->admin_connections_current,
                      1500);
    ember__stats_response__free_unpacked(during, NULL);
    assert_rss_within(daemon, baseline, 0, "2,000 connections");
    /* An admin connection over its own limit is refused with the reason. */
    int admins[5];
    for (int i = 0; i < 5; i++)
        admins[i] = test_connect(daemon->admin);
    test_frame refused;
    ck_assert_int_eq(test_read_frame(admins[4], 5000, &refused), 1);
    ck_assert_int_eq(refused.meta->status, EMBER__STATUS__RESOURCE_EXHAUSTED);
    ck_assert(strstr(refused.meta->error, "max_admin_connections") != NULL);
    test_frame_free(&refused);
    for (int i = 0; i < 5; i++)
        close(admins[i]);
    for (int i = 0; i < CONNECTIONS; i++)
        close(fds[i]);
    free(fds);
    sleep_ms(200);
    assert_served(daemon, 5000);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(requests_after_sigterm_are_answered_unavailable)
{
    test_daemon *daemon = test_daemon_start(
        "{\"tables\": [" TABLE_JSON "], \"limits\": {\"drain_linger_ms\": 3000}}");
    int fd = test_connect(daemon->data);
    assert_served(daemon, 5000);
    pid_t pid = daemon->pid;
    ck_assert_int_eq(kill(pid, SIGTERM), 0);
    sleep_ms(200);
    size_t length = 0;
    uint8_t *frame = pooled_pull_frame(41, 4, &length);
    ck_assert(test_send_all(fd, frame, length));
    free(frame);
    test_frame answer;
    ck_assert_int_eq(test_read_frame(fd, 5000, &answer), 1);
    ck_assert_int_eq(answer.meta->status, EMBER__STATUS__UNAVAILABLE);
    ck_assert_uint_eq(answer.meta->correlation_id, 41);
    ck_assert_msg(strstr(answer.meta->error, "draining") != NULL, "%s", answer.meta->error);
    test_frame_free(&answer);
    /* Quiet for the linger: the server closes the connection and exits. */
    ck_assert(test_wait_closed(fd, 10000));
    close(fd);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

static Suite *hostile_suite(void)
{
    Suite *suite = suite_create("hostile");
    TCase *tc = tcase_create("hostile");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, never_reading_clients_are_bounded_and_closed_by_the_write_timeout);
    tcase_add_test(tc, a_full_server_budget_stops_reading_and_the_admin_still_answers);
    tcase_add_test(tc, trickling_and_stalled_frames_are_closed_by_the_frame_timeout);
    tcase_add_test(tc, a_request_larger_than_the_whole_budget_is_refused_unread);
    tcase_add_test(tc, frames_parked_for_memory_too_long_are_refused);
    tcase_add_test(tc, two_thousand_data_connections_leave_the_admin_listener_open);
    tcase_add_test(tc, requests_after_sigterm_are_answered_unavailable);
    suite_add_tcase(suite, tc);
    return suite;
}

int main(void)
{
    test_skip_without_backend();
    SRunner *runner = srunner_create(hostile_suite());
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
