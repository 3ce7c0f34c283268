/*
 * The C client against real emberd processes: results against the in-process engine,
 * every admin method, a thousand calls in flight, 64 concurrent connections, and three
 * daemons giving exactly what one gives.
 */
#include <cJSON.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "clients/client_split.h"
#include "clients/ember_client.h"
#include "lib/device/backend.h"
#include "lib/table/table.h"
#include "tests/integration/harness.h"
#include "tests/support/test_batches.h"
#include "tests/support/test_support.h"

#define DIM 6
#define TABLE_JSON                                                                         \
    "{\"name\": \"t\", \"dim\": 6, \"capacity\": 1000000, \"shards\": 4,"                  \
    " \"optimizer\": {\"type\": \"rowwise_adagrad\", \"lr\": 0.1},"                        \
    " \"initializer\": {\"type\": \"uniform\", \"bound\": 0.5, \"seed\": 9}}"

static const char *with_table = "{\"tables\": [" TABLE_JSON "]}";

static em_client *client_for(const char *servers, const char *token, uint32_t window)
{
    em_client_options options;
    em_client_options_init(&options);
    options.servers = servers;
    options.token = token;
    options.window = window;
    em_client *client = NULL;
    em_error err;
    ck_assert_msg(em_client_create(&options, &client, &err) == EM_OK, "%s", err.message);
    return client;
}

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

static uint64_t floats_of(const em_csr *csr, em_combiner combiner)
{
    return em_csr_output_vectors(csr, combiner) * DIM;
}

static void client_pull(em_client *client, const em_csr *csr, em_combiner combiner, bool create,
                        float *out)
{
    em_client_pull_args args = {"t", *csr, combiner, create, out, floats_of(csr, combiner)};
    em_client_pull_result result;
    em_error err;
    ck_assert_msg(em_client_pull(client, &args, &result, &err) == EM_OK, "%s", err.message);
    ck_assert_uint_eq(result.dim, DIM);
}

static void client_push(em_client *client, const em_csr *csr, em_combiner combiner,
                        const float *g)
{
    em_client_push_args args = {"t", *csr, combiner, g, floats_of(csr, combiner)};
    em_client_push_result result;
    em_error err;
    ck_assert_msg(em_client_push(client, &args, &result, &err) == EM_OK, "%s", err.message);
}

/* Pulls and pushes a random workload through client, and the same through the local
 * table (when given); every pulled float must be identical. Returns all pulled floats. */
static float *run_workload(em_client *client, em_table *local, uint64_t seed, int rounds,
                           uint64_t *count)
{
    em_test_rng rng;
    em_test_rng_init(&rng, seed);
    float *all = malloc((size_t)rounds * 48 * 5 * DIM * sizeof(float));
    *count = 0;
    em_error err;
    for (int round = 0; round < rounds; round++) {
        em_combiner combiner = (em_combiner)(round % 4);
        em_test_batch b = em_test_random_batch(&rng, 48, 5, 400);
        uint64_t floats = floats_of(&b.csr, combiner);
        float *out = all + *count;
        client_pull(client, &b.csr, combiner, true, out);
        if (local != NULL) {
            float *expected = malloc((floats + 1) * sizeof(float));
            em_pull_request request = {b.csr, combiner, true, expected, floats};
            em_pull_result result;
            ck_assert_int_eq(em_table_pull(local, &request, &result, &err), EM_OK);
            test_assert_floats_match(out, expected, floats, "pull through the client");
            free(expected);
        }
        *count += floats;
        float *g = malloc((floats + 1) * sizeof(float));
        for (uint64_t i = 0; i < floats; i++)
            g[i] = (float)(em_test_rng_unit(&rng) - 0.5);
        client_push(client, &b.csr, combiner, g);
        if (local != NULL) {
            em_push_request request = {b.csr, combiner, g, floats};
            em_push_result result;
            ck_assert_int_eq(em_table_push(local, &request, &result, &err), EM_OK);
        }
        free(g);
        em_test_batch_free(&b);
    }
    return all;
}

START_TEST(client_results_equal_the_engine)
{
    test_daemon *daemon = test_daemon_start(with_table);
    em_client *client = client_for(daemon->data, NULL, 64);
    em_backend *backend = NULL;
    em_table *local = local_table(&backend);
    uint64_t count = 0;
    free(run_workload(client, local, em_test_seed(), 40, &count));
    ck_assert_uint_gt(count, 0);
    em_client_destroy(client);
    em_table_destroy(local);
    em_backend_destroy(backend);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* The same workload on one daemon and split by the client over three: identical. */
START_TEST(three_daemons_give_what_one_gives)
{
    test_daemon *one = test_daemon_start(with_table);
    test_daemon *three[3];
    char list[256] = "";
    for (int i = 0; i < 3; i++) {
        three[i] = test_daemon_start(with_table);
        strcat(list, three[i]->data);
        if (i < 2)
            strcat(list, ",");
    }
    em_client *single = client_for(one->data, NULL, 64);
    em_client *split = client_for(list, NULL, 64);
    ck_assert_uint_eq(em_client_server_count(split), 3);
    uint64_t single_count = 0, split_count = 0;
    float *a = run_workload(single, NULL, em_test_seed() + 3, 40, &single_count);
    float *b = run_workload(split, NULL, em_test_seed() + 3, 40, &split_count);
    ck_assert_uint_eq(single_count, split_count);
    ck_assert_msg(memcmp(a, b, single_count * sizeof(float)) == 0,
                  "three daemons answered differently from one");
    /* the keys really are spread: every daemon holds rows */
    for (int i = 0; i < 3; i++) {
        em_client *admin = client_for(three[i]->admin, TEST_ADMIN_TOKEN, 4);
        cJSON *tables = NULL;
        em_error err;
        ck_assert_int_eq(em_client_list_tables(admin, &tables, &err), EM_OK);
        double rows = cJSON_GetNumberValue(cJSON_GetObjectItem(cJSON_GetArrayItem(tables, 0),
                                                               "rows"));
        ck_assert_msg(rows > 50, "daemon %d holds %g rows", i, rows);
        cJSON_Delete(tables);
        em_client_destroy(admin);
    }
    free(a);
    free(b);
    em_client_destroy(single);
    em_client_destroy(split);
    ck_assert_int_eq(test_daemon_stop(one, SIGTERM, 10000), 0);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(test_daemon_stop(three[i], SIGTERM, 10000), 0);
}
END_TEST

/* The server (of server_count) that the client sends key to. */
static uint32_t server_of(uint64_t key, uint32_t server_count)
{
    const uint32_t offsets[] = {0, 1};
    em_csr one = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = &key};
    em__client_split split;
    em_error err;
    ck_assert_int_eq(em__client_split_pull(&one, server_count, &split, &err), EM_OK);
    uint32_t server = split.key_server[0];
    em__client_split_deinit(&split);
    return server;
}

/* A pull of keys, with the status and error it got. */
static em_status pull_keys(em_client *client, const uint64_t *keys, uint32_t n, em_error *err)
{
    uint32_t offsets[65];
    for (uint32_t i = 0; i <= n; i++)
        offsets[i] = i;
    em_csr batch = {.rows = n, .nnz = n, .offsets = offsets, .keys = keys};
    float out[64 * DIM];
    em_client_pull_args args = {"t", batch, EM_COMBINER_NONE, true, out, (uint64_t)n * DIM};
    return em_client_pull(client, &args, NULL, err);
}

START_TEST(one_of_three_servers_killed_mid_call)
{
    test_daemon *daemons[3];
    char list[256] = "";
    for (int i = 0; i < 3; i++) {
        daemons[i] = test_daemon_start(with_table);
        strcat(list, daemons[i]->data);
        if (i < 2)
            strcat(list, ",");
    }
    em_client *client = client_for(list, NULL, 64);
    /* keys of every server, and keys of servers 0 and 2 only */
    uint64_t all[48], healthy[32];
    uint32_t all_count = 0, healthy_count = 0;
    for (uint64_t key = 1; all_count < 48 || healthy_count < 32; key++) {
        uint32_t server = server_of(key, 3);
        if (all_count < 48)
            all[all_count++] = key;
        if (server != 1 && healthy_count < 32)
            healthy[healthy_count++] = key;
    }
    em_error err;
    ck_assert_msg(pull_keys(client, all, 48, &err) == EM_OK, "%s", err.message);

    /* Server 1 dies while a call to every server is in flight on it. */
    char dead[64];
    snprintf(dead, sizeof(dead), "%s", daemons[1]->data);
    const uint32_t offsets[] = {0, 48};
    em_csr batch = {.rows = 1, .nnz = 48, .offsets = offsets, .keys = all};
    float *gradients = calloc(48 * DIM, sizeof(float));
    em_client_push_args push = {"t", batch, EM_COMBINER_NONE, gradients, 48 * DIM};
    em_client_call *call = NULL;
    ck_assert_int_eq(em_client_push_start(client, &push, &call, &err), EM_OK);
    ck_assert_int_eq(kill(daemons[1]->pid, SIGKILL), 0);
    ck_assert_int_eq(test_daemon_stop(daemons[1], SIGKILL, 10000), 128 + SIGKILL);
    em_status status = em_client_finish(client, call, NULL, &err);
    if (status != EM_OK) { /* the push may have been answered before the kill */
        ck_assert_int_eq(status, EM_UNAVAILABLE);
        ck_assert_msg(strstr(err.message, dead) != NULL, "'%s' does not name %s", err.message,
                      dead);
    }
    free(gradients);
    /* Calls that need it fail naming it; calls to the others go on. */
    ck_assert_int_eq(pull_keys(client, all, 48, &err), EM_UNAVAILABLE);
    ck_assert_msg(strstr(err.message, dead) != NULL, "'%s' does not name %s", err.message, dead);
    ck_assert_msg(pull_keys(client, healthy, 32, &err) == EM_OK, "%s", err.message);

    /* It comes back on the same address: the client reconnects on the next call. */
    char overrides[512];
    snprintf(overrides, sizeof(overrides),
             "{\"tables\": [" TABLE_JSON "], \"listen\": {\"data\": \"%s\","
             " \"admin\": \"127.0.0.1:0\", \"metrics\": \"\"}}",
             dead);
    daemons[1] = test_daemon_start(overrides);
    ck_assert_msg(pull_keys(client, all, 48, &err) == EM_OK, "%s", err.message);
    em_client_destroy(client);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(test_daemon_stop(daemons[i], SIGTERM, 10000), 0);
}
END_TEST

START_TEST(thousand_calls_in_flight_through_the_client)
{
    enum { CALLS = 1000 };
    test_daemon *daemon = test_daemon_start(with_table);
    em_client *client = client_for(daemon->data, NULL, CALLS);
    em_backend *backend = NULL;
    em_table *local = local_table(&backend);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 5);
    static em_test_batch batches[CALLS];
    static float *outs[CALLS];
    static em_client_call *calls[CALLS];
    em_error err;
    for (int i = 0; i < CALLS; i++) {
        batches[i] = em_test_random_batch(&rng, 4, 4, 100000);
        outs[i] = malloc((floats_of(&batches[i].csr, EM_COMBINER_SQRTN) + 1) * sizeof(float));
        em_client_pull_args args = {"t", batches[i].csr, EM_COMBINER_SQRTN, true, outs[i],
                                    floats_of(&batches[i].csr, EM_COMBINER_SQRTN)};
        ck_assert_msg(em_client_pull_start(client, &args, &calls[i], &err) == EM_OK, "%s",
                      err.message);
    }
    /* finish in reverse order; creation order does not change initial values */
    for (int i = CALLS - 1; i >= 0; i--) {
        em_client_pull_result result;
        ck_assert_msg(em_client_finish(client, calls[i], &result, &err) == EM_OK, "%s",
                      err.message);
        uint64_t floats = floats_of(&batches[i].csr, EM_COMBINER_SQRTN);
        float *expected = malloc((floats + 1) * sizeof(float));
        em_pull_request request = {batches[i].csr, EM_COMBINER_SQRTN, true, expected, floats};
        em_pull_result local_result;
        ck_assert_int_eq(em_table_pull(local, &request, &local_result, &err), EM_OK);
        test_assert_floats_match(outs[i], expected, floats, "pipelined pull");
        free(expected);
        free(outs[i]);
        em_test_batch_free(&batches[i]);
    }
    em_client_destroy(client);
    em_table_destroy(local);
    em_backend_destroy(backend);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

typedef struct connection_worker {
    const char *address;
    int index;
    int failures;
} connection_worker;

/* Each connection pushes to its own keys and checks them afterwards (sgd, zeros). */
static void *connection_main(void *argument)
{
    connection_worker *w = argument;
    em_client *client = client_for(w->address, NULL, 8);
    uint32_t offsets[] = {0, 4};
    uint64_t keys[4];
    for (int k = 0; k < 4; k++)
        keys[k] = (uint64_t)w->index * 1000 + (uint64_t)k;
    em_csr csr = {1, 4, offsets, keys};
    float g[DIM];
    for (int j = 0; j < DIM; j++)
        g[j] = 1.0f;
    em_error err;
    for (int n = 0; n < 20; n++) {
        em_client_push_args args = {"z", csr, EM_COMBINER_SUM, g, DIM};
        em_client_push_result result;
        if (em_client_push(client, &args, &result, &err) != EM_OK)
            w->failures++;
    }
    float out[4 * DIM];
    em_client_pull_args args = {"z", csr, EM_COMBINER_NONE, false, out, 4 * DIM};
    em_client_pull_result result;
    if (em_client_pull(client, &args, &result, &err) != EM_OK || result.missing != 0)
        w->failures++;
    for (int i = 0; i < 4 * DIM; i++)
        if (out[i] != -0.5f * 20)
            w->failures++;
    em_client_destroy(client);
    return NULL;
}

START_TEST(sixty_four_concurrent_connections)
{
    enum { CONNECTIONS = 64 };
    test_daemon *daemon = test_daemon_start(
        "{\"tables\": [{\"name\": \"z\", \"dim\": 6, \"capacity\": 100000, \"shards\": 4,"
        " \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.5}, \"initializer\": {\"type\": \"zeros\"}}]}");
    pthread_t threads[CONNECTIONS];
    connection_worker workers[CONNECTIONS];
    for (int i = 0; i < CONNECTIONS; i++) {
        workers[i] = (connection_worker){daemon->data, i, 0};
        pthread_create(&threads[i], NULL, connection_main, &workers[i]);
    }
    for (int i = 0; i < CONNECTIONS; i++) {
        pthread_join(threads[i], NULL);
        ck_assert_msg(workers[i].failures == 0, "connection %d saw %d failures", i,
                      workers[i].failures);
    }
    em_client *admin = client_for(daemon->admin, TEST_ADMIN_TOKEN, 4);
    cJSON *stats = NULL;
    em_error err;
    ck_assert_int_eq(em_client_stats(admin, "z", &stats, &err), EM_OK);
    cJSON *server = cJSON_GetObjectItem(stats, "server");
    ck_assert_double_ge(cJSON_GetNumberValue(cJSON_GetObjectItem(server, "connections_total")),
                        CONNECTIONS);
    cJSON *table = cJSON_GetArrayItem(cJSON_GetObjectItem(stats, "tables"), 0);
    ck_assert_double_eq(cJSON_GetNumberValue(cJSON_GetObjectItem(table, "rows")),
                        CONNECTIONS * 4);
    ck_assert_double_eq(cJSON_GetNumberValue(cJSON_GetObjectItem(table, "pushes")),
                        CONNECTIONS * 20);
    cJSON_Delete(stats);
    em_client_destroy(admin);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(every_admin_method_through_the_client)
{
    test_daemon *daemon = test_daemon_start(NULL);
    em_client *admin = client_for(daemon->admin, TEST_ADMIN_TOKEN, 4);
    em_error err;
    char version[32];
    uint64_t uptime = 0;
    ck_assert_int_eq(em_client_ping(admin, version, sizeof(version), &uptime, &err), EM_OK);
    ck_assert_str_eq(version, "0.1.0");
    em_client_health health;
    ck_assert_int_eq(em_client_health_check(admin, &health, &err), EM_OK);
    ck_assert(health.ready);
    ck_assert_str_eq(health.backend, test_backend_name());
    ck_assert_uint_eq(health.tables, 0);
    cJSON *info = NULL;
    ck_assert_int_eq(em_client_create_table(admin, TABLE_JSON, &info, &err), EM_OK);
    ck_assert_str_eq(cJSON_GetStringValue(cJSON_GetObjectItem(info, "optimizer")),
                     "rowwise_adagrad");
    cJSON_Delete(info);
    ck_assert_int_eq(em_client_create_table(admin, TABLE_JSON, NULL, &err), EM_ALREADY_EXISTS);
    ck_assert_msg(strstr(err.message, "table 't' already exists") != NULL, "%s", err.message);
    cJSON *tables = NULL;
    ck_assert_int_eq(em_client_list_tables(admin, &tables, &err), EM_OK);
    ck_assert_int_eq(cJSON_GetArraySize(tables), 1);
    cJSON_Delete(tables);
    cJSON *stats = NULL;
    ck_assert_int_eq(em_client_stats(admin, NULL, &stats, &err), EM_OK);
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(stats, "pools")), 1);
    cJSON_Delete(stats);
    ck_assert_int_eq(em_client_drop_table(admin, "t", &err), EM_OK);
    ck_assert_int_eq(em_client_drop_table(admin, "t", &err), EM_NOT_FOUND);
    em_client_destroy(admin);

    /* wrong token, and admin methods on the data listener */
    em_client *wrong = client_for(daemon->admin, "nope", 4);
    ck_assert_int_eq(em_client_list_tables(wrong, &tables, &err), EM_UNAUTHENTICATED);
    em_client_destroy(wrong);
    em_client *data = client_for(daemon->data, TEST_ADMIN_TOKEN, 4);
    ck_assert_int_eq(em_client_list_tables(data, &tables, &err), EM_PERMISSION_DENIED);
    em_client_destroy(data);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* emberctl against a real daemon: what README shows, and its exit codes. */
START_TEST(emberctl_against_a_real_daemon)
{
    test_daemon *daemon = test_daemon_start(with_table);
    char *ctl = getenv("EMBERCTL");
    ck_assert_ptr_nonnull(ctl);
    char *out = NULL;
    char *ping[] = {ctl, "--server", daemon->admin, "ping", NULL};
    ck_assert_int_eq(test_run_program(ping, TEST_ADMIN_TOKEN, &out), 0);
    ck_assert_msg(strstr(out, "version 0.1.0") != NULL, "%s", out);
    free(out);
    char *list[] = {ctl, "--server", daemon->admin, "tables", "list", "--json", NULL};
    ck_assert_int_eq(test_run_program(list, TEST_ADMIN_TOKEN, &out), 0);
    cJSON *tables = cJSON_Parse(out);
    ck_assert_msg(tables != NULL && cJSON_GetArraySize(tables) == 1, "%s", out);
    cJSON_Delete(tables);
    free(out);
    char *create[] = {ctl, "--server", daemon->admin, "tables", "create", "--name", "extra",
                      "--dim", "8", "--capacity", "100", "--optimizer", "adam", NULL};
    ck_assert_int_eq(test_run_program(create, TEST_ADMIN_TOKEN, &out), 0);
    free(out);
    ck_assert_int_eq(test_run_program(create, TEST_ADMIN_TOKEN, &out), 1);
    ck_assert_msg(strstr(out, "ALREADY_EXISTS: table 'extra' already exists") != NULL, "%s", out);
    free(out);
    char *stats[] = {ctl, "--server", daemon->admin, "stats", NULL};
    ck_assert_int_eq(test_run_program(stats, TEST_ADMIN_TOKEN, &out), 0);
    ck_assert_msg(strstr(out, "CREATE_TABLE") != NULL && strstr(out, "extra") != NULL, "%s", out);
    free(out);
    char *drop[] = {ctl, "--server", daemon->admin, "tables", "drop", "extra", NULL};
    ck_assert_int_eq(test_run_program(drop, "wrong-token", &out), 1);
    ck_assert_msg(strstr(out, "UNAUTHENTICATED") != NULL, "%s", out);
    free(out);
    ck_assert_int_eq(test_run_program(drop, TEST_ADMIN_TOKEN, &out), 0);
    free(out);
    char *usage[] = {ctl, "--server", daemon->admin, "tables", "frobnicate", NULL};
    ck_assert_int_eq(test_run_program(usage, TEST_ADMIN_TOKEN, &out), 2);
    free(out);
    char admin[sizeof(daemon->admin)];
    snprintf(admin, sizeof(admin), "%s", daemon->admin); /* stop frees daemon */
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
    char *gone[] = {ctl, "--server", admin, "ping", NULL};
    int gone_rc = test_run_program(gone, TEST_ADMIN_TOKEN, &out);
    ck_assert_msg(gone_rc == 3, "exit %d: %s", gone_rc, out);
    free(out);
}
END_TEST

/* The example trainer learns through a real daemon: its loss falls. */
START_TEST(example_trainer_loss_falls)
{
    test_daemon *daemon = test_daemon_start(NULL);
    char *trainer = getenv("TRAIN_LOGREG");
    ck_assert_ptr_nonnull(trainer);
    char *out = NULL;
    char *argv[] = {trainer, "--server", daemon->data, "--admin", daemon->admin, "--token",
                    TEST_ADMIN_TOKEN, NULL};
    ck_assert_int_eq(test_run_program(argv, NULL, &out), 0);
    double first = 0, last = 0;
    const char *summary = strstr(out, "loss went from ");
    ck_assert_msg(summary != NULL && sscanf(summary, "loss went from %lf to %lf", &first,
                                            &last) == 2, "%s", out);
    ck_assert_msg(first > 0.6 && last < first - 0.15, "loss %g -> %g", first, last);
    free(out);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

int main(void)
{
    test_skip_without_backend();
    Suite *suite = suite_create("client_daemon");
    TCase *tc = tcase_create("client_daemon");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, client_results_equal_the_engine);
    tcase_add_test(tc, three_daemons_give_what_one_gives);
    tcase_add_test(tc, one_of_three_servers_killed_mid_call);
    tcase_add_test(tc, thousand_calls_in_flight_through_the_client);
    tcase_add_test(tc, sixty_four_concurrent_connections);
    tcase_add_test(tc, every_admin_method_through_the_client);
    tcase_add_test(tc, emberctl_against_a_real_daemon);
    tcase_add_test(tc, example_trainer_loss_falls);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
