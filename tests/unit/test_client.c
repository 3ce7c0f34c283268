/*
 * The client library end to end, against in-process servers on loopback
 * (tests/support/test_daemon.h) backed by real tables: results are compared bit for
 * bit with a local em_table, and the failure paths (server errors, timeouts, dropped
 * connections, malformed responses) are driven on purpose.
 */
#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clients/ember_client.h"
#include "ember_config.h"
#include "lib/device/backend.h"
#include "lib/table/table.h"
#include "proto/frame.h"
#include "tests/support/test_daemon.h"
#include "tests/support/test_batches.h"
#include "tests/support/test_support.h"

#define MAX_SERVERS 3
#define TABLE_CONFIG                                                                  \
    "{\"name\":\"t\",\"dim\":6,\"capacity\":1000000,\"shards\":2,"                    \
    "\"optimizer\":{\"type\":\"adagrad\",\"lr\":0.05},"                               \
    "\"initializer\":{\"type\":\"uniform\",\"bound\":0.5,\"seed\":5}}"
#define DIM 6

/* ---- fixtures ---------------------------------------------------------------------- */

static em_client *client_for(const char *servers, uint32_t window, uint32_t timeout_ms)
{
    em_client_options options;
    em_client_options_init(&options);
    options.servers = servers;
    options.window = window;
    options.timeout_ms = timeout_ms;
    em_client *client = NULL;
    em_error err;
    ck_assert_msg(em_client_create(&options, &client, &err) == EM_OK, "%s", err.message);
    return client;
}

static void create_table_on(em_test_daemon *server, const char *config)
{
    em_client_options options;
    em_client_options_init(&options);
    options.servers = em_test_daemon_admin_address(server);
    options.token = em_test_daemon_admin_token(server);
    em_client *admin = NULL;
    em_error err;
    ck_assert_msg(em_client_create(&options, &admin, &err) == EM_OK, "%s", err.message);
    ck_assert_msg(em_client_create_table(admin, config, NULL, &err) == EM_OK, "%s", err.message);
    em_client_destroy(admin);
}

/* n servers, each holding table t; *list gets "a:p,b:q,...". */
static void start_servers(em_test_daemon **servers, uint32_t n, const em_test_daemon_options *o,
                          char *list, size_t capacity)
{
    list[0] = '\0';
    for (uint32_t s = 0; s < n; s++) {
        servers[s] = em_test_daemon_start(o);
        create_table_on(servers[s], TABLE_CONFIG);
        snprintf(list + strlen(list), capacity - strlen(list), "%s%s", s > 0 ? "," : "",
                 em_test_daemon_address(servers[s]));
    }
}

static void stop_servers(em_test_daemon **servers, uint32_t n)
{
    for (uint32_t s = 0; s < n; s++)
        em_test_daemon_stop(servers[s]);
}

typedef struct local {
    em_backend *backend;
    em_table *table;
} local;

static local local_table(void)
{
    local l;
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.pool_limit_bytes = UINT64_C(256) << 20;
    options.pool_initial_bytes = UINT64_C(8) << 20;
    em_error err;
    ck_assert_int_eq(em_backend_create_cpu(&options, &l.backend, &err), EM_OK);
    em_table_config config;
    ck_assert_int_eq(em_table_config_parse_text(TABLE_CONFIG, &config, &err), EM_OK);
    ck_assert_int_eq(em_table_create(l.backend, &config, &l.table, &err), EM_OK);
    return l;
}

static void local_destroy(local *l)
{
    em_table_destroy(l->table);
    em_backend_destroy(l->backend);
}

static float *local_pull(local *l, const em_csr *csr, em_combiner combiner, bool create,
                         em_pull_result *result)
{
    uint64_t floats = em_csr_output_vectors(csr, combiner) * DIM;
    float *out = malloc((floats + 1) * sizeof(float));
    em_pull_request request = {.batch = *csr, .combiner = combiner, .create_missing = create,
                               .out = out, .out_capacity = floats};
    em_error err;
    ck_assert_int_eq(em_table_pull(l->table, &request, result, &err), EM_OK);
    return out;
}

static void local_push(local *l, const em_csr *csr, em_combiner combiner, const float *g,
                       em_push_result *result)
{
    em_push_request request = {.batch = *csr, .combiner = combiner, .gradients = g,
                               .gradient_count = em_csr_output_vectors(csr, combiner) * DIM};
    em_error err;
    ck_assert_int_eq(em_table_push(l->table, &request, result, &err), EM_OK);
}

static em_client_pull_args pull_args(const em_csr *csr, em_combiner combiner, bool create,
                                     float *out)
{
    return (em_client_pull_args){.table = "t", .batch = *csr, .combiner = combiner,
                                 .create_missing = create, .out = out,
                                 .out_capacity = em_csr_output_vectors(csr, combiner) * DIM};
}

/* Pulls through the client and from the local table; outputs and counts must agree. */
static void assert_pull_matches(em_client *client, local *l, const em_csr *csr,
                                em_combiner combiner, bool create)
{
    uint64_t floats = em_csr_output_vectors(csr, combiner) * DIM;
    float *got = malloc((floats + 1) * sizeof(float));
    em_client_pull_args args = pull_args(csr, combiner, create, got);
    em_client_pull_result result;
    em_error err;
    ck_assert_msg(em_client_pull(client, &args, &result, &err) == EM_OK, "%s", err.message);
    em_pull_result expected_result;
    float *expected = local_pull(l, csr, combiner, create, &expected_result);
    ck_assert_uint_eq(result.dim, DIM);
    ck_assert_msg(memcmp(got, expected, floats * sizeof(float)) == 0, "%s pull differs",
                  em_combiner_name(combiner));
    ck_assert_uint_eq(result.unique_keys, expected_result.unique_keys);
    ck_assert_uint_eq(result.missing, expected_result.missing);
    ck_assert_uint_eq(result.created, expected_result.created);
    free(got);
    free(expected);
}

static void assert_push_matches(em_client *client, local *l, const em_csr *csr,
                                em_combiner combiner, const float *g)
{
    em_client_push_args args = {.table = "t", .batch = *csr, .combiner = combiner,
                                .gradients = g,
                                .gradient_count = em_csr_output_vectors(csr, combiner) * DIM};
    em_client_push_result result;
    em_error err;
    ck_assert_msg(em_client_push(client, &args, &result, &err) == EM_OK, "%s", err.message);
    em_push_result expected;
    local_push(l, csr, combiner, g, &expected);
    ck_assert_uint_eq(result.updated, expected.updated);
    ck_assert_uint_eq(result.created, expected.created);
}

/* ---- results ------------------------------------------------------------------------ */

/* Loop index: servers - 1. */
START_TEST(pulls_and_pushes_match_a_local_table)
{
    uint32_t n = (uint32_t)_i + 1;
    em_test_daemon *servers[MAX_SERVERS];
    char list[256];
    start_servers(servers, n, NULL, list, sizeof(list));
    em_client *client = client_for(list, 8, 10000);
    ck_assert_uint_eq(em_client_server_count(client), n);
    local l = local_table();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + n);
    for (int round = 0; round < 16; round++) {
        em_combiner combiner = (em_combiner)(round % 4);
        em_test_batch b = em_test_random_batch(&rng, 1 + (uint32_t)em_test_rng_below(&rng, 40), 6, 200);
        assert_pull_matches(client, &l, &b.csr, combiner, round % 7 != 6);
        float *g = em_test_random_floats(&rng, em_csr_output_vectors(&b.csr, combiner) * DIM);
        assert_push_matches(client, &l, &b.csr, combiner, g);
        free(g);
        em_test_batch_free(&b);
    }
    em_test_batch all = em_test_random_batch(&rng, 64, 8, 200);
    assert_pull_matches(client, &l, &all.csr, EM_COMBINER_NONE, false);
    em_test_batch_free(&all);
    em_client_destroy(client);
    local_destroy(&l);
    stop_servers(servers, n);
}
END_TEST

START_TEST(empty_batches_round_trip)
{
    em_test_daemon *servers[2];
    char list[128];
    start_servers(servers, 2, NULL, list, sizeof(list));
    em_client *client = client_for(list, 8, 10000);
    const uint32_t offsets[] = {0, 0, 0};
    em_csr empty_rows = {.rows = 2, .nnz = 0, .offsets = offsets, .keys = NULL};
    float out[2 * DIM];
    memset(out, 0xff, sizeof(out));
    em_client_pull_args args = pull_args(&empty_rows, EM_COMBINER_SUM, true, out);
    em_client_pull_result result;
    em_error err;
    ck_assert_msg(em_client_pull(client, &args, &result, &err) == EM_OK, "%s", err.message);
    ck_assert_uint_eq(result.dim, DIM);
    ck_assert_uint_eq(result.unique_keys, 0);
    for (int i = 0; i < 2 * DIM; i++)
        ck_assert_float_eq(out[i], 0.0f);
    em_client_push_args push = {.table = "t", .batch = empty_rows,
                                .combiner = EM_COMBINER_NONE};
    em_client_push_result pushed;
    ck_assert_msg(em_client_push(client, &push, &pushed, &err) == EM_OK, "%s", err.message);
    ck_assert_uint_eq(pushed.updated, 0);
    em_client_destroy(client);
    stop_servers(servers, 2);
}
END_TEST

START_TEST(pipelined_calls_finish_in_any_order)
{
    em_test_daemon_options options = {.reverse_responses = true};
    em_test_daemon *servers[2];
    char list[128];
    start_servers(servers, 2, &options, list, sizeof(list));
    em_client *client = client_for(list, 3, 10000);
    local l = local_table();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() * 3);
    enum { CALLS = 24 };
    em_test_batch batches[CALLS];
    float *outs[CALLS];
    em_client_call *calls[CALLS];
    em_error err;
    /* more calls than the window: start waits for room, answers come last-first */
    for (int i = 0; i < CALLS; i++) {
        batches[i] = em_test_random_batch(&rng, 8, 5, 300);
        em_combiner combiner = (em_combiner)(i % 4);
        outs[i] = malloc((em_csr_output_vectors(&batches[i].csr, combiner) * DIM + 1) *
                         sizeof(float));
        em_client_pull_args args = pull_args(&batches[i].csr, combiner, true, outs[i]);
        ck_assert_msg(em_client_pull_start(client, &args, &calls[i], &err) == EM_OK, "%s",
                      err.message);
    }
    for (int i = CALLS - 1; i >= 0; i--) {
        em_client_pull_result result;
        ck_assert_msg(em_client_finish(client, calls[i], &result, &err) == EM_OK, "%s",
                      err.message);
        ck_assert_uint_eq(result.dim, DIM);
    }
    for (int i = 0; i < CALLS; i++) {
        em_combiner combiner = (em_combiner)(i % 4);
        em_pull_result ignored;
        float *expected = local_pull(&l, &batches[i].csr, combiner, true, &ignored);
        ck_assert_msg(memcmp(outs[i], expected,
                             em_csr_output_vectors(&batches[i].csr, combiner) * DIM *
                                 sizeof(float)) == 0,
                      "call %d", i);
        free(expected);
        free(outs[i]);
        em_test_batch_free(&batches[i]);
    }
    em_client_destroy(client);
    local_destroy(&l);
    stop_servers(servers, 2);
}
END_TEST

START_TEST(large_pipelined_requests_do_not_deadlock)
{
    em_test_daemon *servers[2];
    char list[128];
    start_servers(servers, 2, NULL, list, sizeof(list));
    em_client *client = client_for(list, 8, 60000);
    local l = local_table();
    /* 200k keys per call: ~8 MB of gradients and ~5 MB of vectors each way */
    enum { CALLS = 3, ROWS = 50000 };
    em_test_batch b = {0};
    b.offsets = malloc((ROWS + 1) * sizeof(uint32_t));
    b.keys = malloc(ROWS * 4 * sizeof(uint64_t));
    for (uint32_t r = 0; r <= ROWS; r++)
        b.offsets[r] = 4 * r;
    for (uint32_t k = 0; k < ROWS * 4; k++)
        b.keys[k] = (uint64_t)(k % 150000) * 7919;
    b.csr = (em_csr){.rows = ROWS, .nnz = ROWS * 4, .offsets = b.offsets, .keys = b.keys};
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    float *g = em_test_random_floats(&rng, (uint64_t)ROWS * 4 * DIM);
    float *outs[CALLS];
    em_client_call *pushes[CALLS], *pulls[CALLS];
    em_error err;
    for (int i = 0; i < CALLS; i++) {
        em_client_push_args push = {.table = "t", .batch = b.csr, .combiner = EM_COMBINER_NONE,
                                    .gradients = g, .gradient_count = (uint64_t)ROWS * 4 * DIM};
        ck_assert_msg(em_client_push_start(client, &push, &pushes[i], &err) == EM_OK, "%s",
                      err.message);
        outs[i] = malloc((uint64_t)ROWS * DIM * sizeof(float));
        em_client_pull_args pull = pull_args(&b.csr, EM_COMBINER_MEAN, true, outs[i]);
        ck_assert_msg(em_client_pull_start(client, &pull, &pulls[i], &err) == EM_OK, "%s",
                      err.message);
    }
    for (int i = 0; i < CALLS; i++) {
        ck_assert_msg(em_client_finish(client, pushes[i], NULL, &err) == EM_OK, "%s",
                      err.message);
        ck_assert_msg(em_client_finish(client, pulls[i], NULL, &err) == EM_OK, "%s",
                      err.message);
        em_push_result pushed;
        local_push(&l, &b.csr, EM_COMBINER_NONE, g, &pushed);
        em_pull_result pulled;
        float *expected = local_pull(&l, &b.csr, EM_COMBINER_MEAN, true, &pulled);
        ck_assert(memcmp(outs[i], expected, (uint64_t)ROWS * DIM * sizeof(float)) == 0);
        free(expected);
        free(outs[i]);
    }
    free(g);
    em_test_batch_free(&b);
    em_client_destroy(client);
    local_destroy(&l);
    stop_servers(servers, 2);
}
END_TEST

/* ---- argument and server errors --------------------------------------------------- */

START_TEST(bad_arguments_are_refused_before_sending)
{
    em_test_daemon *servers[1];
    char list[64];
    start_servers(servers, 1, NULL, list, sizeof(list));
    em_client *client = client_for(list, 8, 10000);
    em_error err;
    const uint32_t bad_offsets[] = {0, 3, 2};
    const uint64_t keys[] = {1, 2, 3};
    float out[3 * DIM];
    em_csr bad = {.rows = 2, .nnz = 2, .offsets = bad_offsets, .keys = keys};
    em_client_pull_args args = pull_args(&bad, EM_COMBINER_NONE, true, out);
    ck_assert_int_eq(em_client_pull(client, &args, NULL, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "offsets[2]=2 < offsets[1]=3");

    const uint32_t offsets[] = {0, 1, 3};
    em_csr good = {.rows = 2, .nnz = 3, .offsets = offsets, .keys = keys};
    args = pull_args(&good, EM_COMBINER_NONE, true, out);
    args.out_capacity = 2;
    ck_assert_int_eq(em_client_pull(client, &args, NULL, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "out_capacity 2 floats cannot hold 3 output vectors");
    args.combiner = (em_combiner)7;
    ck_assert_int_eq(em_client_pull(client, &args, NULL, &err), EM_INVALID_ARGUMENT);
    args = pull_args(&good, EM_COMBINER_NONE, true, out);
    args.table = "";
    ck_assert_int_eq(em_client_pull(client, &args, NULL, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "table name is empty");

    float g[3 * DIM] = {0};
    em_client_push_args push = {.table = "t", .batch = good, .combiner = EM_COMBINER_SUM,
                                .gradients = g, .gradient_count = 2 * DIM + 1};
    ck_assert_int_eq(em_client_push(client, &push, NULL, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "gradient_count 13 is not a positive multiple of the 2 "
                                  "gradient vectors of a sum push");
    push.gradient_count = 2 * DIM;
    g[DIM + 2] = NAN;
    ck_assert_int_eq(em_client_push(client, &push, NULL, &err), EM_INVALID_ARGUMENT);
    ck_assert(strstr(err.message, "NaN") != NULL);
    ck_assert_uint_eq(em_test_daemon_data_requests(servers[0]), 0);

    /* the dim is known only from the answer: out holds 3 vectors but not 3 x dim */
    args = pull_args(&good, EM_COMBINER_NONE, true, out);
    args.out_capacity = 3 * DIM - 1;
    ck_assert_int_eq(em_client_pull(client, &args, NULL, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "out_capacity 17 floats is less than 3 vectors x dim 6 = 18 "
                                  "floats");
    /* and the connection is still in step */
    args.out_capacity = 3 * DIM;
    ck_assert_msg(em_client_pull(client, &args, NULL, &err) == EM_OK, "%s", err.message);
    em_client_destroy(client);
    stop_servers(servers, 1);
}
END_TEST

START_TEST(server_errors_carry_status_server_and_message)
{
    em_test_daemon_options options = {.admin_token = "admin-secret"};
    em_test_daemon *server = em_test_daemon_start(&options);
    em_client_options client_options;
    em_client_options_init(&client_options);
    client_options.servers = em_test_daemon_admin_address(server);
    client_options.token = "wrong";
    em_client *client;
    em_error err;
    ck_assert_int_eq(em_client_create(&client_options, &client, &err), EM_OK);
    char expected[256];
    ck_assert_int_eq(em_client_create_table(client, TABLE_CONFIG, NULL, &err),
                     EM_UNAUTHENTICATED);
    snprintf(expected, sizeof(expected),
             "server %s: UNAUTHENTICATED: the token sent with CREATE_TABLE is not the admin "
             "token",
             em_test_daemon_admin_address(server));
    ck_assert_str_eq(err.message, expected);

    const uint32_t offsets[] = {0, 1};
    const uint64_t keys[] = {1};
    em_csr csr = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = keys};
    float out[DIM];
    em_client_pull_args args = pull_args(&csr, EM_COMBINER_SUM, true, out);
    args.table = "nope";
    ck_assert_int_eq(em_client_pull(client, &args, NULL, &err), EM_NOT_FOUND);
    snprintf(expected, sizeof(expected), "server %s: NOT_FOUND: no table 'nope' (tables: none)",
             em_test_daemon_admin_address(server));
    ck_assert_str_eq(err.message, expected);
    em_client_destroy(client);
    em_test_daemon_stop(server);
}
END_TEST

START_TEST(servers_that_disagree_on_dim_are_reported)
{
    em_test_daemon *a = em_test_daemon_start(NULL);
    em_test_daemon *b = em_test_daemon_start(NULL);
    create_table_on(a, "{\"name\":\"t\",\"dim\":4,\"capacity\":100}");
    create_table_on(b, "{\"name\":\"t\",\"dim\":8,\"capacity\":100}");
    char list[128];
    snprintf(list, sizeof(list), "%s,%s", em_test_daemon_address(a), em_test_daemon_address(b));
    em_client *client = client_for(list, 8, 10000);
    const uint32_t offsets[] = {0, 0};
    em_csr csr = {.rows = 1, .nnz = 0, .offsets = offsets, .keys = NULL};
    float out[8];
    em_client_pull_args args = {.table = "t", .batch = csr, .combiner = EM_COMBINER_SUM,
                                .out = out, .out_capacity = 8};
    em_error err;
    ck_assert_int_eq(em_client_pull(client, &args, NULL, &err), EM_INTERNAL);
    char expected[256];
    snprintf(expected, sizeof(expected),
             "servers %s and %s disagree on the table's dim: 4 vs 8", em_test_daemon_address(a),
             em_test_daemon_address(b));
    ck_assert_str_eq(err.message, expected);
    em_client_destroy(client);
    em_test_daemon_stop(a);
    em_test_daemon_stop(b);
}
END_TEST

/* ---- time and connections ------------------------------------------------------------ */

START_TEST(timeouts_name_the_call_and_late_answers_are_discarded)
{
    em_test_daemon *servers[1];
    char list[64];
    start_servers(servers, 1, NULL, list, sizeof(list));
    em_client *client = client_for(list, 8, 150);
    local l = local_table();
    const uint32_t offsets[] = {0, 2};
    const uint64_t keys[] = {10, 20};
    em_csr csr = {.rows = 1, .nnz = 2, .offsets = offsets, .keys = keys};
    float abandoned[2 * DIM];
    memset(abandoned, 0x7f, sizeof(abandoned));
    em_client_pull_args args = pull_args(&csr, EM_COMBINER_NONE, true, abandoned);
    em_test_daemon_set_delay(servers[0], 400);
    em_error err;
    double start = em_test_now();
    ck_assert_int_eq(em_client_pull(client, &args, NULL, &err), EM_DEADLINE_EXCEEDED);
    double waited = em_test_now() - start;
    ck_assert_msg(waited >= 0.14 && waited < 0.39, "waited %.3f s", waited);
    char expected[128];
    snprintf(expected, sizeof(expected), "server %s: PULL timed out after 150 ms", list);
    ck_assert_str_eq(err.message, expected);
    em_test_daemon_set_delay(servers[0], 0);
    /* the server did create the keys; the local table follows */
    em_pull_result created;
    free(local_pull(&l, &csr, EM_COMBINER_NONE, true, &created));
    /* the next call reads (and drops) the late answer first */
    usleep(400 * 1000);
    assert_pull_matches(client, &l, &csr, EM_COMBINER_SUM, true);
    float unchanged[2 * DIM];
    memset(unchanged, 0x7f, sizeof(unchanged));
    ck_assert(memcmp(abandoned, unchanged, sizeof(unchanged)) == 0);
    em_client_destroy(client);
    local_destroy(&l);
    stop_servers(servers, 1);
}
END_TEST

/* A call abandoned while its large frame is half written: the rest still goes out (the
 * server sees whole frames) and later calls on the connection work. */
START_TEST(abandoned_half_sent_requests_keep_the_stream_whole)
{
    em_test_daemon *servers[1];
    char list[64];
    start_servers(servers, 1, NULL, list, sizeof(list));
    em_client *client = client_for(list, 8, 100);
    local l = local_table();
    enum { KEYS = 300000 };
    em_test_batch b = {0};
    b.offsets = malloc(2 * sizeof(uint32_t));
    b.keys = malloc(KEYS * sizeof(uint64_t));
    b.offsets[0] = 0;
    b.offsets[1] = KEYS;
    for (uint32_t k = 0; k < KEYS; k++)
        b.keys[k] = k % 1000;
    b.csr = (em_csr){.rows = 1, .nnz = KEYS, .offsets = b.offsets, .keys = b.keys};
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    float *g[3];
    em_client_call *calls[3];
    em_error err;
    em_test_daemon_set_delay(servers[0], 250);
    for (int i = 0; i < 3; i++) {
        g[i] = em_test_random_floats(&rng, (uint64_t)KEYS * DIM);
        em_client_push_args push = {.table = "t", .batch = b.csr, .combiner = EM_COMBINER_NONE,
                                    .gradients = g[i], .gradient_count = (uint64_t)KEYS * DIM};
        ck_assert_msg(em_client_push_start(client, &push, &calls[i], &err) == EM_OK, "%s",
                      err.message);
    }
    for (int i = 0; i < 3; i++) {
        em_status status = em_client_finish(client, calls[i], NULL, &err);
        ck_assert_int_eq(status, EM_DEADLINE_EXCEEDED);
        /* the caller's gradients may go away now */
        memset(g[i], 0xff, (uint64_t)KEYS * DIM * sizeof(float));
    }
    em_test_daemon_set_delay(servers[0], 0);
    /* keep calling until the backlog has drained and a pull is answered in time */
    const uint32_t offsets[] = {0, 3};
    const uint64_t probe_keys[] = {0, 1, 999};
    em_csr probe = {.rows = 1, .nnz = 3, .offsets = offsets, .keys = probe_keys};
    float out[3 * DIM];
    em_client_pull_args args = pull_args(&probe, EM_COMBINER_NONE, false, out);
    em_status status = EM_DEADLINE_EXCEEDED;
    for (int attempt = 0; attempt < 100 && status == EM_DEADLINE_EXCEEDED; attempt++)
        status = em_client_pull(client, &args, NULL, &err);
    ck_assert_msg(status == EM_OK, "%s", err.message);
    /* every push that was started reaches the server whole and is answered (applied, or
     * refused for its deadline; one never started is never sent); a pull on another
     * connection may overtake one, so wait until no more answers come, then pull again */
    uint64_t answered = em_test_daemon_answered(servers[0], EMBER__METHOD__PUSH);
    for (int quiet_ms = 0, waited = 0; quiet_ms < 1000 && waited < 30000; waited += 10) {
        usleep(10000);
        uint64_t now = em_test_daemon_answered(servers[0], EMBER__METHOD__PUSH);
        quiet_ms = now == answered ? quiet_ms + 10 : 0;
        answered = now;
    }
    ck_assert_msg(em_client_pull(client, &args, NULL, &err) == EM_OK, "%s", err.message);
    /* the table equals the local one after the pushes that were applied, in order: which
     * ones depends on when each frame arrived against its deadline, so every ordered
     * choice of `reached` of the three is tried (none, on a loaded machine where every
     * frame took longer to arrive than its deadline) */
    uint64_t reached = em_test_daemon_succeeded(servers[0], EMBER__METHOD__PUSH);
    ck_assert_uint_le(reached, 3);
    float *replayed[3];
    em_test_rng_init(&rng, em_test_seed());
    for (int i = 0; i < 3; i++)
        replayed[i] = em_test_random_floats(&rng, (uint64_t)KEYS * DIM);
    bool matched = false;
    for (unsigned mask = 0; mask < 8 && !matched; mask++) {
        if ((uint64_t)__builtin_popcount(mask) != reached)
            continue;
        local replay = local_table();
        for (int i = 0; i < 3; i++) {
            em_push_result ignored;
            if (mask & (1u << i))
                local_push(&replay, &b.csr, EM_COMBINER_NONE, replayed[i], &ignored);
        }
        em_pull_result ignored;
        float *expected = local_pull(&replay, &probe, EM_COMBINER_NONE, false, &ignored);
        matched = memcmp(out, expected, sizeof(out)) == 0;
        free(expected);
        local_destroy(&replay);
    }
    ck_assert_msg(matched, "the table matches no ordered choice of %llu of the 3 pushes",
                  (unsigned long long)reached);
    for (int i = 0; i < 3; i++)
        free(replayed[i]);
    for (int i = 0; i < 3; i++)
        free(g[i]);
    em_test_batch_free(&b);
    em_client_destroy(client);
    local_destroy(&l);
    stop_servers(servers, 1);
}
END_TEST

START_TEST(lost_connections_fail_calls_and_reconnect)
{
    em_test_daemon *servers[1];
    char list[64];
    start_servers(servers, 1, NULL, list, sizeof(list));
    em_client *client = client_for(list, 8, 5000);
    local l = local_table();
    const uint32_t offsets[] = {0, 2};
    const uint64_t keys[] = {10, 20};
    em_csr csr = {.rows = 1, .nnz = 2, .offsets = offsets, .keys = keys};
    float out[DIM];
    em_client_pull_args args = pull_args(&csr, EM_COMBINER_MEAN, true, out);
    em_error err;
    em_test_daemon_close_after(servers[0], 1);
    ck_assert_int_eq(em_client_pull(client, &args, NULL, &err), EM_UNAVAILABLE);
    char expected[128];
    snprintf(expected, sizeof(expected), "server %s: connection closed by the server", list);
    ck_assert_str_eq(err.message, expected);
    assert_pull_matches(client, &l, &csr, EM_COMBINER_MEAN, true);
    /* the admin connection of start_servers, the first, and the reconnection */
    ck_assert_uint_eq(em_test_daemon_connections(servers[0]), 3);
    em_client_destroy(client);
    local_destroy(&l);
    stop_servers(servers, 1);
}
END_TEST

START_TEST(idle_connections_closed_by_the_server_are_reopened)
{
    em_test_daemon *servers[1];
    char list[64];
    start_servers(servers, 1, NULL, list, sizeof(list));
    em_client *client = client_for(list, 8, 5000);
    local l = local_table();
    const uint32_t offsets[] = {0, 1};
    const uint64_t keys[] = {10};
    em_csr csr = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = keys};
    assert_pull_matches(client, &l, &csr, EM_COMBINER_NONE, true);
    em_test_daemon_drop_connections(servers[0]);
    usleep(50 * 1000);
    /* no error: the closed connection is noticed before the call is sent */
    assert_pull_matches(client, &l, &csr, EM_COMBINER_NONE, true);
    ck_assert_uint_eq(em_test_daemon_connections(servers[0]), 3);
    em_client_destroy(client);
    local_destroy(&l);
    stop_servers(servers, 1);
}
END_TEST

START_TEST(unreachable_servers_are_unavailable_after_retries)
{
    /* a bound port nobody listens on refuses connections */
    int holder = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = 0};
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_int_eq(bind(holder, (struct sockaddr *)&address, sizeof(address)), 0);
    socklen_t length = sizeof(address);
    getsockname(holder, (struct sockaddr *)&address, &length);
    char list[64];
    snprintf(list, sizeof(list), "127.0.0.1:%u", ntohs(address.sin_port));
    em_client_options options;
    em_client_options_init(&options);
    options.servers = list;
    em_client *client = NULL;
    em_error err;
    double start = em_test_now();
    ck_assert_int_eq(em_client_create(&options, &client, &err), EM_UNAVAILABLE);
    double waited = em_test_now() - start;
    ck_assert_ptr_null(client);
    char expected[128];
    snprintf(expected, sizeof(expected), "server %s: cannot connect: Connection refused", list);
    ck_assert_str_eq(err.message, expected);
    /* three attempts, 100 ms and 200 ms apart */
    ck_assert_msg(waited >= 0.29 && waited < 2.0, "waited %.3f s", waited);

    options.servers = "127.0.0.1:7070,bad";
    ck_assert_int_eq(em_client_create(&options, &client, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "server list entry 2 'bad' has no port; expected host:port");
    close(holder);
}
END_TEST

/* ---- malformed answers --------------------------------------------------------------- */

typedef struct raw_server {
    int listener;
    char address[32];
    pthread_t thread;
    const uint8_t *reply;
    size_t reply_len;
} raw_server;

/* Accepts one connection, reads a request header, sends reply and closes. */
static void *raw_serve(void *arg)
{
    raw_server *raw = arg;
    int fd = accept(raw->listener, NULL, NULL);
    uint8_t header[EM_FRAME_HEADER_BYTES];
    if (fd >= 0 && recv(fd, header, sizeof(header), MSG_WAITALL) == (ssize_t)sizeof(header)) {
        ssize_t ignored = send(fd, raw->reply, raw->reply_len, MSG_NOSIGNAL);
        (void)ignored;
        usleep(100 * 1000);
    }
    if (fd >= 0)
        close(fd);
    return NULL;
}

static void raw_start(raw_server *raw, const uint8_t *reply, size_t reply_len)
{
    raw->listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = 0};
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_int_eq(bind(raw->listener, (struct sockaddr *)&address, sizeof(address)), 0);
    ck_assert_int_eq(listen(raw->listener, 1), 0);
    socklen_t length = sizeof(address);
    getsockname(raw->listener, (struct sockaddr *)&address, &length);
    snprintf(raw->address, sizeof(raw->address), "127.0.0.1:%u", ntohs(address.sin_port));
    raw->reply = reply;
    raw->reply_len = reply_len;
    pthread_create(&raw->thread, NULL, raw_serve, raw);
}

static em_status raw_ping(raw_server *raw, em_error *err)
{
    em_client *client = client_for(raw->address, 4, 2000);
    em_status status = em_client_ping(client, NULL, 0, NULL, err);
    em_client_destroy(client);
    pthread_join(raw->thread, NULL);
    close(raw->listener);
    return status;
}

START_TEST(malformed_answers_fail_the_connection)
{
    raw_server raw;
    const uint8_t garbage[EM_FRAME_HEADER_BYTES] = "HTTP/1.1 400 Bad Reques";
    raw_start(&raw, garbage, sizeof(garbage));
    em_error err;
    ck_assert_int_eq(raw_ping(&raw, &err), EM_INTERNAL);
    ck_assert_msg(strstr(err.message, ": bad response frame: bad frame magic 48 54 54 50") !=
                      NULL,
                  "%s", err.message);

    /* the server's "could not parse your frame" answer: correlation id 0, then EOF */
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.status = EMBER__STATUS__INVALID_ARGUMENT;
    meta.error = "undecodable RpcMeta";
    uint8_t *frame;
    size_t frame_len;
    ck_assert_int_eq(em_frame_pack(&meta, NULL, 0, &frame, &frame_len, &err), EM_OK);
    raw_start(&raw, frame, frame_len);
    ck_assert_int_eq(raw_ping(&raw, &err), EM_INVALID_ARGUMENT);
    char expected[128];
    snprintf(expected, sizeof(expected), "server %s: INVALID_ARGUMENT: undecodable RpcMeta",
             raw.address);
    ck_assert_str_eq(err.message, expected);
    free(frame);
}
END_TEST

/* ---- admin ----------------------------------------------------------------------------- */

START_TEST(admin_calls_return_json)
{
    em_test_daemon_options options = {.admin_token = "admin-secret"};
    em_test_daemon *server = em_test_daemon_start(&options);
    em_client_options client_options;
    em_client_options_init(&client_options);
    client_options.servers = em_test_daemon_admin_address(server);
    client_options.token = "admin-secret";
    em_client *client;
    em_error err;
    ck_assert_int_eq(em_client_create(&client_options, &client, &err), EM_OK);

    cJSON *info = NULL;
    ck_assert_msg(em_client_create_table(client, TABLE_CONFIG, &info, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_str_eq(cJSON_GetObjectItem(info, "name")->valuestring, "t");
    ck_assert_int_eq(cJSON_GetObjectItem(info, "dim")->valueint, DIM);
    ck_assert_str_eq(cJSON_GetObjectItem(info, "optimizer")->valuestring, "adagrad");
    const cJSON *config = cJSON_GetObjectItem(info, "config");
    ck_assert_int_eq(cJSON_GetObjectItem(config, "capacity")->valueint, 1000000);
    cJSON_Delete(info);
    ck_assert_int_eq(em_client_create_table(client, TABLE_CONFIG, NULL, &err),
                     EM_ALREADY_EXISTS);

    cJSON *tables = NULL;
    ck_assert_int_eq(em_client_list_tables(client, &tables, &err), EM_OK);
    ck_assert_int_eq(cJSON_GetArraySize(tables), 1);
    ck_assert_int_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(tables, 0), "shards")->valueint, 2);
    cJSON_Delete(tables);

    cJSON *stats = NULL;
    ck_assert_int_eq(em_client_stats(client, NULL, &stats, &err), EM_OK);
    const cJSON *server_stats = cJSON_GetObjectItem(stats, "server");
    ck_assert_str_eq(cJSON_GetObjectItem(server_stats, "state")->valuestring, "serving");
    ck_assert(cJSON_IsArray(cJSON_GetObjectItem(server_stats, "methods")));
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(stats, "tables")), 1);
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(stats, "pools")), 1);
    cJSON_Delete(stats);

    char version[8];
    uint64_t uptime = 0;
    ck_assert_int_eq(em_client_ping(client, version, sizeof(version), &uptime, &err), EM_OK);
    ck_assert_str_eq(version, EM_VERSION);
    em_client_health health;
    ck_assert_int_eq(em_client_health_check(client, &health, &err), EM_OK);
    ck_assert(health.ready);
    ck_assert_str_eq(health.state, "serving");
    ck_assert_str_eq(health.backend, "cpu");
    ck_assert_uint_eq(health.tables, 1);

    ck_assert_int_eq(em_client_drop_table(client, "t", &err), EM_OK);
    ck_assert_int_eq(em_client_drop_table(client, "t", &err), EM_NOT_FOUND);
    ck_assert_int_eq(em_client_list_tables(client, &tables, &err), EM_OK);
    ck_assert_int_eq(cJSON_GetArraySize(tables), 0);
    cJSON_Delete(tables);
    em_client_destroy(client);
    em_test_daemon_stop(server);
}
END_TEST

START_TEST(destroy_drops_unfinished_calls)
{
    em_test_daemon *servers[2];
    char list[128];
    start_servers(servers, 2, NULL, list, sizeof(list));
    em_client *client = client_for(list, 2, 5000);
    const uint32_t offsets[] = {0, 3};
    const uint64_t keys[] = {1, 2, 3};
    em_csr csr = {.rows = 1, .nnz = 3, .offsets = offsets, .keys = keys};
    float out[8][DIM];
    em_error err;
    for (int i = 0; i < 8; i++) {
        em_client_pull_args args = pull_args(&csr, EM_COMBINER_SUM, true, out[i]);
        em_client_call *call;
        ck_assert_int_eq(em_client_pull_start(client, &args, &call, &err), EM_OK);
    }
    em_client_destroy(client); /* leak-free under ASan */
    stop_servers(servers, 2);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("client");
    TCase *results = tcase_create("results");
    tcase_set_timeout(results, 120);
    tcase_add_loop_test(results, pulls_and_pushes_match_a_local_table, 0, MAX_SERVERS);
    tcase_add_test(results, empty_batches_round_trip);
    tcase_add_test(results, pipelined_calls_finish_in_any_order);
    tcase_add_test(results, large_pipelined_requests_do_not_deadlock);
    suite_add_tcase(suite, results);
    TCase *errors = tcase_create("errors");
    tcase_set_timeout(errors, 60);
    tcase_add_test(errors, bad_arguments_are_refused_before_sending);
    tcase_add_test(errors, server_errors_carry_status_server_and_message);
    tcase_add_test(errors, servers_that_disagree_on_dim_are_reported);
    tcase_add_test(errors, malformed_answers_fail_the_connection);
    suite_add_tcase(suite, errors);
    TCase *connections = tcase_create("connections");
    tcase_set_timeout(connections, 120);
    tcase_add_test(connections, timeouts_name_the_call_and_late_answers_are_discarded);
    tcase_add_test(connections, abandoned_half_sent_requests_keep_the_stream_whole);
    tcase_add_test(connections, lost_connections_fail_calls_and_reconnect);
    tcase_add_test(connections, idle_connections_closed_by_the_server_are_reopened);
    tcase_add_test(connections, unreachable_servers_are_unavailable_after_retries);
    tcase_add_test(connections, destroy_drops_unfinished_calls);
    suite_add_tcase(suite, connections);
    TCase *admin = tcase_create("admin");
    tcase_add_test(admin, admin_calls_return_json);
    suite_add_tcase(suite, admin);
    return em_test_run(suite);
}
