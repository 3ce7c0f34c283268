/*
 * A real emberd serving raw frames: results against the in-process engine, admin
 * methods, pipelining, per-connection ordering, backpressure, drain and reload.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "lib/device/backend.h"
#include "lib/table/table.h"
#include "tests/integration/harness.h"
#include "tests/support/test_batches.h"
#include "tests/support/test_support.h"

#define TABLE_JSON                                                                         \
    "{\"name\": \"t\", \"dim\": 8, \"capacity\": 1000000, \"shards\": 3,"                  \
    " \"optimizer\": {\"type\": \"adam\", \"lr\": 0.01},"                                  \
    " \"initializer\": {\"type\": \"uniform\", \"bound\": 0.1, \"seed\": 11}}"

static const char *with_table = "{\"tables\": [" TABLE_JSON "]}";

static bool send_pull(int fd, uint64_t id, const em_csr *b, int combiner, bool create)
{
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = "t";
    body.rows = b->rows;
    body.nnz = b->nnz;
    body.combiner = (Ember__Combiner)combiner;
    body.create_missing = create;
    size_t length = 0;
    uint8_t *attachment = test_csr_attachment(b->rows, b->offsets, b->nnz, b->keys, NULL, 0,
                                              &length);
    bool ok = test_send_request(fd, id, EMBER__METHOD__PULL, NULL, &body.base, attachment, length);
    free(attachment);
    return ok;
}

static bool send_push(int fd, uint64_t id, const em_csr *b, int combiner, const float *gradients,
                      uint64_t count)
{
    Ember__PushRequest body = EMBER__PUSH_REQUEST__INIT;
    body.table = "t";
    body.rows = b->rows;
    body.nnz = b->nnz;
    body.combiner = (Ember__Combiner)combiner;
    size_t length = 0;
    uint8_t *attachment =
        test_csr_attachment(b->rows, b->offsets, b->nnz, b->keys, gradients, count, &length);
    bool ok = test_send_request(fd, id, EMBER__METHOD__PUSH, NULL, &body.base, attachment, length);
    free(attachment);
    return ok;
}

static void assert_ok(const test_frame *frame)
{
    ck_assert_msg(frame->meta->status == EMBER__STATUS__OK, "status %d: %s",
                  (int)frame->meta->status, frame->meta->error);
}

/* The same table, in this process. */
static em_table *local_table(em_backend **backend)
{
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.pool_limit_bytes = 256u << 20;
    options.pool_initial_bytes = 16u << 20;
    em_error err;
    ck_assert_int_eq(em_backend_create_cpu(&options, backend, &err), EM_OK);
    em_table_config config;
    ck_assert_int_eq(em_table_config_parse_text(TABLE_JSON, &config, &err), EM_OK);
    em_table *table = NULL;
    ck_assert_int_eq(em_table_create(*backend, &config, &table, &err), EM_OK);
    return table;
}

static float *local_pull(em_table *table, const em_csr *b, em_combiner combiner, bool create,
                         uint64_t *floats)
{
    em_csr csr = {b->rows, b->nnz, b->offsets, b->keys};
    *floats = em_csr_output_vectors(&csr, combiner) * 8;
    float *out = malloc((*floats + 1) * sizeof(float));
    em_pull_request request = {csr, combiner, create, out, *floats};
    em_pull_result result;
    em_error err;
    ck_assert_int_eq(em_table_pull(table, &request, &result, &err), EM_OK);
    return out;
}

static void local_push(em_table *table, const em_csr *b, em_combiner combiner,
                       const float *gradients, uint64_t count)
{
    em_csr csr = {b->rows, b->nnz, b->offsets, b->keys};
    em_push_request request = {csr, combiner, gradients, count};
    em_push_result result;
    em_error err;
    ck_assert_int_eq(em_table_push(table, &request, &result, &err), EM_OK);
}

/* ---- results ------------------------------------------------------------------------- */

/* Pulls and pushes over the wire give bit for bit what the engine gives in process. */
START_TEST(wire_results_equal_the_engine)
{
    test_daemon *daemon = test_daemon_start(with_table);
    int fd = test_connect(daemon->data);
    em_backend *backend = NULL;
    em_table *table = local_table(&backend);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    for (int round = 0; round < 60; round++) {
        int combiner = round % 4;
        em_test_batch b = em_test_random_batch(&rng, 32, 6, 300);
        uint64_t floats = 0;
        float *expected = local_pull(table, &b.csr, (em_combiner)combiner, true, &floats);
        ck_assert(send_pull(fd, (uint64_t)round, &b.csr, combiner, true));
        test_frame frame;
        ck_assert_int_eq(test_read_frame(fd, 20000, &frame), 1);
        assert_ok(&frame);
        ck_assert_uint_eq(frame.attachment_length, floats * sizeof(float));
        test_assert_floats_match((const float *)(const void *)frame.attachment, expected, floats,
                                 "pull over the wire");
        test_frame_free(&frame);
        float *g = malloc((floats + 1) * sizeof(float));
        for (uint64_t i = 0; i < floats; i++)
            g[i] = (float)(em_test_rng_unit(&rng) - 0.5);
        local_push(table, &b.csr, (em_combiner)combiner, g, floats);
        ck_assert(send_push(fd, 1000 + (uint64_t)round, &b.csr, combiner, g, floats));
        ck_assert_int_eq(test_read_frame(fd, 20000, &frame), 1);
        assert_ok(&frame);
        Ember__PushResponse *pushed =
            ember__push_response__unpack(NULL, frame.body_length, frame.body);
        ck_assert_ptr_nonnull(pushed);
        ember__push_response__free_unpacked(pushed, NULL);
        test_frame_free(&frame);
        free(g);
        free(expected);
        em_test_batch_free(&b);
    }
    em_table_destroy(table);
    em_backend_destroy(backend);
    close(fd);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* ---- pipelining and ordering --------------------------------------------------------- */

START_TEST(thousand_pipelined_requests_all_answered)
{
    enum { REQUESTS = 1000 };
    test_daemon *daemon = test_daemon_start(with_table);
    int fd = test_connect(daemon->data);
    em_backend *backend = NULL;
    em_table *table = local_table(&backend);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 1);
    static float *expected[REQUESTS];
    static uint64_t floats[REQUESTS];
    for (int i = 0; i < REQUESTS; i++) {
        em_test_batch b = em_test_random_batch(&rng, 8, 4, 5000);
        expected[i] = local_pull(table, &b.csr, EM_COMBINER_SUM, true, &floats[i]);
        ck_assert(send_pull(fd, (uint64_t)i, &b.csr, EMBER__COMBINER__SUM, true));
        em_test_batch_free(&b);
    }
    static bool seen[REQUESTS];
    for (int n = 0; n < REQUESTS; n++) {
        test_frame frame;
        ck_assert_int_eq(test_read_frame(fd, 30000, &frame), 1);
        assert_ok(&frame);
        uint64_t id = frame.meta->correlation_id;
        ck_assert_uint_lt(id, REQUESTS);
        ck_assert(!seen[id]);
        seen[id] = true;
        ck_assert_uint_eq(frame.attachment_length, floats[id] * sizeof(float));
        test_assert_floats_match((const float *)(const void *)frame.attachment, expected[id],
                                 floats[id], "pipelined pull");
        test_frame_free(&frame);
        free(expected[id]);
    }
    em_table_destroy(table);
    em_backend_destroy(backend);
    close(fd);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* Pipelined push, pull, push, pull...: every pull sees every earlier push. The pushes
 * are heavy (20,000 keys) and the pulls light, so a pull that were allowed to overtake
 * its push on another worker would do so. */
START_TEST(later_requests_see_earlier_writes)
{
    enum { PAIRS = 60, PUSH_KEYS = 20001 };
    test_daemon *daemon = test_daemon_start(
        "{\"tables\": [{\"name\": \"t\", \"dim\": 8, \"capacity\": 100000,"
        " \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.5}, \"initializer\": {\"type\": \"zeros\"}}]}");
    int fd = test_connect(daemon->data);
    uint32_t push_offsets[] = {0, PUSH_KEYS};
    static uint64_t push_keys[PUSH_KEYS];
    static float g[PUSH_KEYS * 8];
    for (int i = 0; i < PUSH_KEYS; i++)
        push_keys[i] = i == 0 ? 42 : 1000 + (uint64_t)i;
    for (int i = 0; i < PUSH_KEYS * 8; i++)
        g[i] = 1.0f;
    em_csr heavy = {1, PUSH_KEYS, push_offsets, push_keys};
    uint32_t offsets[] = {0, 1};
    uint64_t keys[] = {42};
    em_csr light = {1, 1, offsets, keys};
    for (int i = 0; i < PAIRS; i++) {
        ck_assert(send_push(fd, 2 * (uint64_t)i, &heavy, EMBER__COMBINER__NONE, g,
                            PUSH_KEYS * 8));
        ck_assert(send_pull(fd, 2 * (uint64_t)i + 1, &light, EMBER__COMBINER__NONE, false));
    }
    for (int n = 0; n < 2 * PAIRS; n++) {
        test_frame frame;
        ck_assert_int_eq(test_read_frame(fd, 30000, &frame), 1);
        assert_ok(&frame);
        uint64_t id = frame.meta->correlation_id;
        if (id % 2 == 1) {
            float value;
            memcpy(&value, frame.attachment, sizeof(value));
            ck_assert_msg(value == -0.5f * (float)(id / 2 + 1), "pull %llu saw %g",
                          (unsigned long long)id, (double)value);
        }
        test_frame_free(&frame);
    }
    close(fd);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* ---- backpressure -------------------------------------------------------------------- */

/* A client that sends big pulls and never reads: the daemon stops reading it once its
 * in-flight budget is used, so what the client can push out is bounded by that budget
 * plus the kernel's socket buffers; every request it did send is still answered. */
START_TEST(a_client_that_does_not_read_is_held_back)
{
    test_daemon *daemon = test_daemon_start(
        "{\"limits\": {\"connection_inflight_bytes\": 65536},"
        " \"tables\": [{\"name\": \"t\", \"dim\": 64, \"capacity\": 100000}]}");
    int fd = test_connect(daemon->data);
    enum { KEYS = 4096 };
    uint32_t offsets[] = {0, KEYS};
    static uint64_t keys[KEYS];
    for (int i = 0; i < KEYS; i++)
        keys[i] = (uint64_t)i;
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = "t";
    body.rows = 1;
    body.nnz = KEYS;
    body.create_missing = true;
    size_t attachment_length = 0;
    uint8_t *attachment = test_csr_attachment(1, offsets, KEYS, keys, NULL, 0, &attachment_length);
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.method = EMBER__METHOD__PULL;
    uint8_t *head = NULL;
    size_t head_length = 0;
    em_error err;
    ck_assert_int_eq(em_frame_pack(&meta, &body.base, attachment_length, &head, &head_length,
                                   &err), EM_OK);
    size_t frame_length = head_length + attachment_length;
    uint8_t *frame = malloc(frame_length);
    memcpy(frame, head, head_length);
    memcpy(frame + head_length, attachment, attachment_length);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);

    /* Phase 1: send whole frames until the socket stays full for half a second. */
    const size_t attempt = (size_t)256 << 20;
    size_t sent = 0, frames = 0, partial = 0;
    double stalled_since = 0;
    while (sent < attempt) {
        ssize_t n = send(fd, frame + partial, frame_length - partial, MSG_NOSIGNAL);
        if (n > 0) {
            sent += (size_t)n;
            partial += (size_t)n;
            if (partial == frame_length) {
                partial = 0;
                frames++;
            }
            stalled_since = 0;
            continue;
        }
        ck_assert(errno == EAGAIN || errno == EWOULDBLOCK);
        if (stalled_since == 0)
            stalled_since = em_test_now();
        if (em_test_now() - stalled_since > 0.5)
            break;
        usleep(1000);
    }
    ck_assert_msg(sent < ((size_t)64 << 20), "daemon accepted %zu bytes from a client that "
                  "does not read", sent);
    /* Phase 2: finish the partial frame while reading every response. */
    size_t expected = frames + (partial > 0);
    size_t answered = 0;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    if (partial > 0) {
        /* the reads below make room; a blocking send would deadlock, so alternate */
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        while (partial > 0 && partial < frame_length) {
            struct pollfd poller = {.fd = fd, .events = POLLOUT | POLLIN};
            poll(&poller, 1, 1000);
            if (poller.revents & POLLOUT) {
                ssize_t n = send(fd, frame + partial, frame_length - partial, MSG_NOSIGNAL);
                if (n > 0)
                    partial += (size_t)n;
            }
            if (poller.revents & POLLIN) {
                fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
                test_frame response;
                ck_assert_int_eq(test_read_frame(fd, 30000, &response), 1);
                assert_ok(&response);
                test_frame_free(&response);
                answered++;
                fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
            }
        }
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    }
    for (; answered < expected; answered++) {
        test_frame response;
        ck_assert_int_eq(test_read_frame(fd, 30000, &response), 1);
        assert_ok(&response);
        ck_assert_uint_eq(response.attachment_length, KEYS * 64 * sizeof(float));
        test_frame_free(&response);
    }
    free(frame);
    free(head);
    free(attachment);
    close(fd);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* ---- drain and reload ---------------------------------------------------------------- */

START_TEST(sigterm_answers_requests_in_flight_and_exits_zero)
{
    enum { REQUESTS = 120, KEYS = 16384 };
    test_daemon *daemon = test_daemon_start(
        "{\"tables\": [{\"name\": \"t\", \"dim\": 32, \"capacity\": 1000000}]}");
    int fd = test_connect(daemon->data);
    uint32_t offsets[] = {0, KEYS};
    static uint64_t keys[KEYS];
    for (int i = 0; i < KEYS; i++)
        keys[i] = (uint64_t)i * 7919;
    em_csr b = {1, KEYS, offsets, keys};
    for (int i = 0; i < REQUESTS; i++)
        ck_assert(send_pull(fd, (uint64_t)i, &b, EMBER__COMBINER__NONE, true));
    /* The ping is read after every pull before it: once it is answered, all are in. */
    Ember__PingRequest ping = EMBER__PING_REQUEST__INIT;
    ck_assert(test_send_request(fd, 999999, EMBER__METHOD__PING, NULL, &ping.base, NULL, 0));
    int pulls = 0;
    bool signalled = false;
    while (pulls < REQUESTS) {
        test_frame frame;
        ck_assert_int_eq(test_read_frame(fd, 30000, &frame), 1);
        assert_ok(&frame);
        if (frame.meta->correlation_id == 999999) {
            ck_assert_int_eq(kill(daemon->pid, SIGTERM), 0);
            signalled = true;
        } else {
            pulls++;
        }
        test_frame_free(&frame);
    }
    if (!signalled) {
        test_frame frame;
        ck_assert_int_eq(test_read_frame(fd, 30000, &frame), 1);
        ck_assert_uint_eq(frame.meta->correlation_id, 999999);
        test_frame_free(&frame);
        ck_assert_int_eq(kill(daemon->pid, SIGTERM), 0);
    }
    ck_assert(test_wait_closed(fd, 10000));
    close(fd);
    ck_assert_int_eq(test_daemon_stop(daemon, 0, 10000), 0);
}
END_TEST

static bool log_contains(const test_daemon *daemon, const char *text, int timeout_ms)
{
    double deadline = em_test_now() + timeout_ms / 1000.0;
    while (em_test_now() < deadline) {
        char *log = test_daemon_log(daemon);
        bool found = strstr(log, text) != NULL;
        free(log);
        if (found)
            return true;
        usleep(20000);
    }
    return false;
}

START_TEST(sighup_reloads_tokens_and_reports_fixed_keys)
{
    test_daemon *daemon = test_daemon_start(
        "{\"data_token\": {\"value\": \"first\"}, \"tables\": [" TABLE_JSON "]}");
    test_daemon_rewrite_config(daemon,
                               "{\"data_token\": {\"value\": \"second\"}, \"tables\": [],"
                               " \"backend\": {\"type\": \"cpu\", \"threads\": 1}}");
    ck_assert_int_eq(kill(daemon->pid, SIGHUP), 0);
    ck_assert(log_contains(daemon, "configuration reloaded", 10000));
    char *log = test_daemon_log(daemon);
    ck_assert_msg(strstr(log, "reload: 'backend' changed but takes effect only after a restart"),
                  "%s", log);
    ck_assert(strstr(log, "reload: 'tables' changed") != NULL);
    free(log);
    int fd = test_connect(daemon->data);
    uint32_t offsets[] = {0, 1};
    uint64_t keys[] = {1};
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = "t";
    body.rows = 1;
    body.nnz = 1;
    size_t length = 0;
    uint8_t *attachment = test_csr_attachment(1, offsets, 1, keys, NULL, 0, &length);
    test_frame frame = test_call(fd, 1, EMBER__METHOD__PULL, "first", &body.base, attachment,
                                 length);
    ck_assert_int_eq(frame.meta->status, EMBER__STATUS__UNAUTHENTICATED);
    test_frame_free(&frame);
    frame = test_call(fd, 2, EMBER__METHOD__PULL, "second", &body.base, attachment, length);
    assert_ok(&frame);
    test_frame_free(&frame);
    /* A broken config on reload keeps the running one. */
    FILE *file = fopen(daemon->config_path, "w");
    fputs("{\"limits\": ", file);
    fclose(file);
    ck_assert_int_eq(kill(daemon->pid, SIGHUP), 0);
    ck_assert(log_contains(daemon, "reload failed, keeping the running configuration", 10000));
    frame = test_call(fd, 3, EMBER__METHOD__PULL, "second", &body.base, attachment, length);
    assert_ok(&frame);
    test_frame_free(&frame);
    free(attachment);
    close(fd);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* ---- admin ----------------------------------------------------------------------------- */

static test_frame admin_call(int fd, uint64_t id, int method, const ProtobufCMessage *body)
{
    return test_call(fd, id, method, TEST_ADMIN_TOKEN, body, NULL, 0);
}

START_TEST(admin_methods_create_list_stats_drop)
{
    test_daemon *daemon = test_daemon_start(NULL);
    int admin = test_connect(daemon->admin);
    Ember__CreateTableRequest create = EMBER__CREATE_TABLE_REQUEST__INIT;
    create.config_json = TABLE_JSON;
    test_frame frame = admin_call(admin, 1, EMBER__METHOD__CREATE_TABLE, &create.base);
    assert_ok(&frame);
    Ember__CreateTableResponse *created =
        ember__create_table_response__unpack(NULL, frame.body_length, frame.body);
    ck_assert_str_eq(created->table->name, "t");
    ck_assert_uint_eq(created->table->dim, 8);
    ck_assert_uint_eq(created->table->shards, 3);
    ck_assert_str_eq(created->table->optimizer, "adam");
    ck_assert(strstr(created->table->config_json, "\"beta2\"") != NULL);
    ember__create_table_response__free_unpacked(created, NULL);
    test_frame_free(&frame);

    frame = admin_call(admin, 2, EMBER__METHOD__CREATE_TABLE, &create.base);
    ck_assert_int_eq(frame.meta->status, EMBER__STATUS__ALREADY_EXISTS);
    test_frame_free(&frame);
    create.config_json = "{\"name\": \"u\", \"dim\": 0, \"capacity\": 5}";
    frame = admin_call(admin, 3, EMBER__METHOD__CREATE_TABLE, &create.base);
    ck_assert_int_eq(frame.meta->status, EMBER__STATUS__INVALID_ARGUMENT);
    ck_assert_str_eq(frame.meta->error, "table.dim: must be between 1 and 4096, got 0");
    test_frame_free(&frame);

    /* some traffic for the counters */
    int data = test_connect(daemon->data);
    uint32_t offsets[] = {0, 3};
    uint64_t keys[] = {5, 6, 5};
    em_csr b = {1, 3, offsets, keys};
    for (int i = 0; i < 4; i++) {
        ck_assert(send_pull(data, (uint64_t)i, &b, EMBER__COMBINER__MEAN, true));
        test_frame response;
        ck_assert_int_eq(test_read_frame(data, 10000, &response), 1);
        assert_ok(&response);
        test_frame_free(&response);
    }
    close(data);

    Ember__ListTablesRequest list = EMBER__LIST_TABLES_REQUEST__INIT;
    frame = admin_call(admin, 4, EMBER__METHOD__LIST_TABLES, &list.base);
    assert_ok(&frame);
    Ember__ListTablesResponse *tables =
        ember__list_tables_response__unpack(NULL, frame.body_length, frame.body);
    ck_assert_uint_eq(tables->n_tables, 1);
    ck_assert_str_eq(tables->tables[0]->name, "t");
    ck_assert_uint_eq(tables->tables[0]->rows, 2);
    ember__list_tables_response__free_unpacked(tables, NULL);
    test_frame_free(&frame);

    Ember__StatsRequest stats_request = EMBER__STATS_REQUEST__INIT;
    frame = admin_call(admin, 5, EMBER__METHOD__STATS, &stats_request.base);
    assert_ok(&frame);
    Ember__StatsResponse *stats =
        ember__stats_response__unpack(NULL, frame.body_length, frame.body);
    ck_assert_str_eq(stats->server->state, "serving");
    ck_assert_str_eq(stats->server->backend, test_backend_name());
    ck_assert_uint_ge(stats->server->connections_total, 2);
    ck_assert_uint_gt(stats->server->bytes_in, 0);
    ck_assert_uint_gt(stats->server->bytes_out, 0);
    bool saw_pull = false, saw_create = false;
    for (size_t i = 0; i < stats->server->n_methods; i++) {
        Ember__MethodStats *m = stats->server->methods[i];
        if (strcmp(m->method, "PULL") == 0) {
            ck_assert_uint_eq(m->requests, 4);
            ck_assert_uint_eq(m->errors, 0);
            saw_pull = true;
        }
        if (strcmp(m->method, "CREATE_TABLE") == 0) {
            ck_assert_uint_eq(m->requests, 3);
            ck_assert_uint_eq(m->errors, 2);
            saw_create = true;
        }
    }
    ck_assert(saw_pull && saw_create);
    ck_assert_uint_eq(stats->n_tables, 1);
    ck_assert_uint_eq(stats->tables[0]->rows, 2);
    ck_assert_uint_eq(stats->tables[0]->pulls, 4);
    ck_assert_uint_eq(stats->tables[0]->keys_pulled, 12);
    ck_assert_uint_eq(stats->n_pools, 1);
    ck_assert_uint_gt(stats->pools[0]->bytes_in_use, 0);
    if (!test_backend_is_cuda()) {
        ck_assert_str_eq(stats->pools[0]->device, "cpu0");
        ck_assert_uint_eq(stats->pools[0]->bytes_limit, 536870912);
    }
    ember__stats_response__free_unpacked(stats, NULL);
    test_frame_free(&frame);

    stats_request.table = "missing";
    frame = admin_call(admin, 6, EMBER__METHOD__STATS, &stats_request.base);
    ck_assert_int_eq(frame.meta->status, EMBER__STATUS__NOT_FOUND);
    test_frame_free(&frame);

    Ember__DropTableRequest drop = EMBER__DROP_TABLE_REQUEST__INIT;
    drop.table = "t";
    frame = admin_call(admin, 7, EMBER__METHOD__DROP_TABLE, &drop.base);
    assert_ok(&frame);
    test_frame_free(&frame);
    frame = admin_call(admin, 8, EMBER__METHOD__DROP_TABLE, &drop.base);
    ck_assert_int_eq(frame.meta->status, EMBER__STATUS__NOT_FOUND);
    ck_assert_str_eq(frame.meta->error, "no table 't' (tables: none)");
    test_frame_free(&frame);
    close(admin);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

int main(void)
{
    test_skip_without_backend();
    Suite *suite = suite_create("serving");
    TCase *tc = tcase_create("serving");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, wire_results_equal_the_engine);
    tcase_add_test(tc, thousand_pipelined_requests_all_answered);
    tcase_add_test(tc, later_requests_see_earlier_writes);
    tcase_add_test(tc, a_client_that_does_not_read_is_held_back);
    tcase_add_test(tc, sigterm_answers_requests_in_flight_and_exits_zero);
    tcase_add_test(tc, sighup_reloads_tokens_and_reports_fixed_keys);
    tcase_add_test(tc, admin_methods_create_list_stats_drop);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
