/*
 * Soak: a bounded load on a real emberd, every answer checked against its request.
 *
 * THREADS clients pull and push random batches (every combiner, pulls that create) for
 * EMBER_SOAK_SECONDS (8 by default; a long run by setting it), each on keys of its own,
 * so each thread's local table (the in-process CPU engine, same config) must give
 * exactly what the daemon answers. The daemon's RSS is sampled and printed over time;
 * after the warm-up it must stay flat (the last sample within SOAK_GROWTH_BYTES of the
 * one at a quarter of the run), except in a sanitizer build (EMBER_SOAK_SANITIZED),
 * whose quarantine holds freed memory on purpose.
 */
#include <check.h>
#include <cJSON.h>
#include <stdbool.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "clients/ember_client.h"
#include "lib/device/backend.h"
#include "lib/table/table.h"
#include "tests/integration/harness.h"
#include "tests/support/test_batches.h"
#include "tests/support/test_support.h"

#define DIM 8
#define THREADS 4
#define MIB (1024u * 1024u)
#define SOAK_GROWTH_BYTES (32u * MIB)

#define TABLE_JSON                                                                         \
    "{\"name\": \"t\", \"dim\": 8, \"capacity\": 4000000, \"shards\": 4,"                  \
    " \"optimizer\": {\"type\": \"adam\", \"lr\": 0.01},"                                  \
    " \"initializer\": {\"type\": \"normal\", \"stddev\": 0.1, \"seed\": 3}}"

/* A table of 6,000 rows that evicts by lru, for one client each (EVICTING_JSON's %d),
 * fed keys from a window of DRIFT_WINDOW ids that moves up by DRIFT every round: new ids
 * without end, old ones left behind. */
#define EVICTING_CAPACITY 6000
#define DRIFT 16
#define DRIFT_WINDOW 4000
#define EVICTING_JSON                                                                      \
    "{\"name\": \"e%d\", \"dim\": 8, \"capacity\": 6000, \"shards\": 2,"                   \
    " \"optimizer\": {\"type\": \"adam\", \"lr\": 0.01},"                                  \
    " \"initializer\": {\"type\": \"normal\", \"stddev\": 0.1, \"seed\": 3},"                \
    " \"eviction\": {\"policy\": \"lru\"}}"

typedef struct soaker {
    const char *address;
    char table[16];     /* on the daemon and in the local engine */
    char json[512];     /* the table's config */
    bool drift;         /* keys drift by DRIFT a round (EVICTING_JSON) */
    uint64_t seed;
    uint64_t key_base;
    double end;
    _Atomic uint64_t *requests;
    uint64_t rounds;    /* done, when the thread ends */
    em_backend *backend; /* the local engine, kept for the caller when keep_local */
    em_table *local;
    bool keep_local;
    char failure[1024];
} soaker;

static double now_seconds(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

static uint64_t rss_bytes(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *file = fopen(path, "r");
    uint64_t kib = 0;
    while (file != NULL && fgets(line, sizeof(line), file) != NULL)
        if (sscanf(line, "VmRSS: %" SCNu64 " kB", &kib) == 1)
            break;
    if (file != NULL)
        fclose(file);
    return kib * 1024u;
}

/* Records the first failure of a thread (Check's asserts belong to the main thread). */
#define SOAK_CHECK(s, condition, ...)                                                       \
    do {                                                                                    \
        if (!(condition) && (s)->failure[0] == '\0')                                        \
            snprintf((s)->failure, sizeof((s)->failure), __VA_ARGS__);                      \
    } while (0)

static void *soak(void *argument)
{
    soaker *s = argument;
    em_cpu_backend_options backend_options;
    em_cpu_backend_options_init(&backend_options);
    backend_options.pool_limit_bytes = 512u << 20;
    backend_options.pool_initial_bytes = 16u << 20;
    em_backend *backend = NULL;
    em_table *local = NULL;
    em_table_config config;
    em_error err;
    if (em_backend_create_cpu(&backend_options, &backend, &err) != EM_OK ||
        em_table_config_parse_text(s->json, &config, &err) != EM_OK ||
        em_table_create(backend, &config, &local, &err) != EM_OK) {
        SOAK_CHECK(s, false, "local table: %s", err.message);
        return NULL;
    }
    em_client_options options;
    em_client_options_init(&options);
    options.servers = s->address;
    em_client *client = NULL;
    if (em_client_create(&options, &client, &err) != EM_OK) {
        SOAK_CHECK(s, false, "client: %s", err.message);
        em_table_destroy(local);
        em_backend_destroy(backend);
        return NULL;
    }
    uint64_t round = 0;
    em_test_rng rng;
    em_test_rng_init(&rng, s->seed);
    for (; now_seconds() < s->end && s->failure[0] == '\0'; round++) {
        em_combiner combiner = (em_combiner)(round % 4);
        em_test_batch b = em_test_random_batch(&rng, 64, 6, 20000);
        for (uint64_t i = 0; i < b.csr.nnz; i++) /* drifting: the 4,000 ids from round x 16 */
            b.keys[i] = (s->drift ? em_test_rng_below(&rng, DRIFT_WINDOW) + round * DRIFT
                                  : b.keys[i] & ((UINT64_C(1) << 40) - 1)) |
                        s->key_base;
        uint64_t floats = em_csr_output_vectors(&b.csr, combiner) * DIM;
        float *got = malloc((floats + 1) * sizeof(float));
        float *expected = malloc((floats + 1) * sizeof(float));
        em_client_pull_args pull = {s->table, b.csr, combiner, true, got, floats};
        em_status status = em_client_pull(client, &pull, NULL, &err);
        SOAK_CHECK(s, status == EM_OK, "pull %" PRIu64 ": %s", round, err.message);
        em_pull_request local_pull = {b.csr, combiner, true, expected, floats};
        em_pull_result pulled;
        if (status == EM_OK && em_table_pull(local, &local_pull, &pulled, &err) == EM_OK)
            SOAK_CHECK(s, memcmp(got, expected, floats * sizeof(float)) == 0,
                       "pull %" PRIu64 " (combiner %s) differs from its request's answer on "
                       "the local table",
                       round, em_combiner_name(combiner));
        for (uint64_t i = 0; i < floats; i++)
            got[i] = (float)(em_test_rng_unit(&rng) - 0.5);
        em_client_push_args push = {s->table, b.csr, combiner, got, floats};
        status = em_client_push(client, &push, NULL, &err);
        SOAK_CHECK(s, status == EM_OK, "push %" PRIu64 ": %s", round, err.message);
        em_push_request local_push = {b.csr, combiner, got, floats};
        em_push_result pushed;
        if (status == EM_OK)
            em_table_push(local, &local_push, &pushed, &err);
        atomic_fetch_add(s->requests, 2);
        free(got);
        free(expected);
        em_test_batch_free(&b);
    }
    em_client_destroy(client);
    s->rounds = round;
    if (s->keep_local) {
        s->backend = backend;
        s->local = local;
        return NULL;
    }
    em_table_destroy(local);
    em_backend_destroy(backend);
    return NULL;
}

/* Samples the daemon's RSS every half second until start + seconds, joins the soakers
 * (each must have ended without a failure) and checks that the RSS stayed flat. */
static void watch_and_join(const test_daemon *daemon, pthread_t *threads, soaker *soakers,
                           double start, double seconds, _Atomic uint64_t *requests)
{
    uint64_t quarter_rss = 0, last_rss = 0, peak_rss = 0;
    for (double t = 0.5; now_seconds() < start + seconds; t += 0.5) {
        usleep(500000);
        last_rss = rss_bytes(daemon->pid);
        peak_rss = last_rss > peak_rss ? last_rss : peak_rss;
        if (quarter_rss == 0 && t >= seconds / 4)
            quarter_rss = last_rss;
        printf("soak t=%.1fs: %" PRIu64 " requests answered, emberd RSS %.1f MiB\n", t,
               (uint64_t)atomic_load(requests), (double)last_rss / MIB);
        fflush(stdout);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(threads[i], NULL);
        ck_assert_msg(soakers[i].failure[0] == '\0', "thread %d: %s", i, soakers[i].failure);
    }
    ck_assert_uint_gt(atomic_load(requests), 100);
    printf("soak: %" PRIu64 " requests in %.0f s, every answer checked; RSS at a quarter "
           "%.1f MiB, peak %.1f MiB, last %.1f MiB\n",
           (uint64_t)atomic_load(requests), seconds, (double)quarter_rss / MIB,
           (double)peak_rss / MIB, (double)last_rss / MIB);
    bool sanitized = getenv("EMBER_SOAK_SANITIZED") != NULL;
    ck_assert_msg(sanitized || quarter_rss == 0 || last_rss <= quarter_rss + SOAK_GROWTH_BYTES,
                  "RSS grew from %" PRIu64 " to %" PRIu64 " bytes", quarter_rss, last_rss);
}

static double soak_seconds(void)
{
    const char *text = getenv("EMBER_SOAK_SECONDS");
    return text != NULL && atof(text) > 0 ? atof(text) : 8.0;
}

START_TEST(answers_stay_right_and_memory_stays_flat_under_load)
{
    double seconds = soak_seconds();
    test_daemon *daemon = test_daemon_start("{\"tables\": [" TABLE_JSON "],"
                                            " \"log_level\": \"warning\"}");
    _Atomic uint64_t requests = 0;
    soaker soakers[THREADS];
    pthread_t threads[THREADS];
    double start = now_seconds();
    for (int i = 0; i < THREADS; i++) {
        soakers[i] = (soaker){.address = daemon->data, .table = "t", .json = TABLE_JSON,
                              .seed = em_test_seed() + (uint64_t)i,
                              .key_base = (uint64_t)i << 40, .end = start + seconds,
                              .requests = &requests};
        ck_assert_int_eq(pthread_create(&threads[i], NULL, soak, &soakers[i]), 0);
    }
    watch_and_join(daemon, threads, soakers, start, seconds, &requests);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

/* The server's STATS of table name (or its "server" part with name NULL): the number
 * called field. */
static double stat_of(em_client *admin, const char *name, const char *field)
{
    cJSON *stats = NULL;
    em_error err;
    ck_assert_msg(em_client_stats(admin, name, &stats, &err) == EM_OK, "%s", err.message);
    const cJSON *part = cJSON_GetObjectItem(stats, "server");
    if (name != NULL) {
        const cJSON *table = NULL;
        cJSON_ArrayForEach(table, cJSON_GetObjectItem(stats, "tables"))
            if (strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(table, "name")), name) == 0)
                part = table;
    }
    const cJSON *value = cJSON_GetObjectItem(part, field);
    ck_assert_msg(cJSON_IsNumber(value), "STATS has no %s for %s", field,
                  name != NULL ? name : "the server");
    double number = value->valuedouble;
    cJSON_Delete(stats);
    return number;
}

static em_client *admin_client(const test_daemon *daemon)
{
    em_client_options options;
    em_client_options_init(&options);
    options.servers = daemon->admin;
    options.token = TEST_ADMIN_TOKEN;
    em_client *client = NULL;
    em_error err;
    ck_assert_msg(em_client_create(&options, &client, &err) == EM_OK, "%s", err.message);
    return client;
}

/* Every key soaker s may have stored, pulled from the daemon without creating any, against
 * the same pull of its local engine: the same keys missing, the same rows. */
static void assert_same_as_local(em_client *admin, const soaker *s)
{
    uint64_t n = DRIFT_WINDOW + s->rounds * DRIFT;
    uint64_t *keys = malloc(n * sizeof(uint64_t));
    uint32_t *offsets = malloc((n + 1) * sizeof(uint32_t));
    float *got = malloc(n * DIM * sizeof(float)), *expected = malloc(n * DIM * sizeof(float));
    for (uint64_t i = 0; i < n; i++) {
        keys[i] = i | s->key_base;
        offsets[i] = (uint32_t)i;
    }
    offsets[n] = (uint32_t)n;
    em_csr csr = {(uint32_t)n, n, offsets, keys};
    em_error err;
    em_client_pull_result remote;
    em_client_pull_args pull = {s->table, csr, EM_COMBINER_NONE, false, got, n * DIM};
    ck_assert_msg(em_client_pull(admin, &pull, &remote, &err) == EM_OK, "%s", err.message);
    em_pull_request local_pull = {csr, EM_COMBINER_NONE, false, expected, n * DIM};
    em_pull_result local;
    ck_assert_msg(em_table_pull(s->local, &local_pull, &local, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_uint_eq(remote.missing, local.missing);
    ck_assert_uint_ge(local.missing, n - EVICTING_CAPACITY);
    ck_assert_uint_lt(local.missing, n); /* and it holds some of them */
    ck_assert_msg(memcmp(got, expected, n * DIM * sizeof(float)) == 0,
                  "table %s after the restart differs from its local engine", s->table);
    free(keys);
    free(offsets);
    free(got);
    free(expected);
}

/* Issue of a table that lives within its memory forever: a client a table, each full and
 * evicting (lru) as its keys drift on, saved every second (a full checkpoint every third
 * save, deltas between, two kept). Every answer is the local engine's (one connection a
 * table evicts the same keys as the engine), no table passes its capacity, the RSS stays
 * flat, and after SIGTERM (a shutdown save) and a restart every table holds exactly what
 * its engine holds. */
START_TEST(evicting_tables_saved_every_second_stay_within_their_memory)
{
    double seconds = soak_seconds();
    char dir[256];
    em_test_make_dir("ember-soak", dir, sizeof(dir));
    char json[4096];
    int used = snprintf(json, sizeof(json),
                        "{\"log_level\": \"warning\", \"checkpoint\": {\"dir\": \"%s\","
                        " \"interval_s\": 1, \"full_every\": 3, \"keep\": 2,"
                        " \"on_shutdown\": true}, \"tables\": [",
                        dir);
    for (int i = 0; i < THREADS; i++)
        used += snprintf(json + used, sizeof(json) - (size_t)used, "%s" EVICTING_JSON,
                         i > 0 ? ", " : "", i);
    snprintf(json + used, sizeof(json) - (size_t)used, "]}");
    test_daemon *daemon = test_daemon_start(json);
    _Atomic uint64_t requests = 0;
    soaker soakers[THREADS];
    pthread_t threads[THREADS];
    double start = now_seconds();
    for (int i = 0; i < THREADS; i++) {
        soakers[i] = (soaker){.address = daemon->data, .drift = true,
                              .seed = em_test_seed() + 100 + (uint64_t)i,
                              .key_base = (uint64_t)i << 40, .end = start + seconds,
                              .requests = &requests, .keep_local = true};
        snprintf(soakers[i].table, sizeof(soakers[i].table), "e%d", i);
        snprintf(soakers[i].json, sizeof(soakers[i].json), EVICTING_JSON, i);
        ck_assert_int_eq(pthread_create(&threads[i], NULL, soak, &soakers[i]), 0);
    }
    watch_and_join(daemon, threads, soakers, start, seconds, &requests);
    em_client *admin = admin_client(daemon);
    for (int i = 0; i < THREADS; i++) {
        double rows = stat_of(admin, soakers[i].table, "rows");
        double evicted = stat_of(admin, soakers[i].table, "rows_evicted");
        printf("soak: table %s: %" PRIu64 " rounds, %.0f rows, %.0f evicted\n",
               soakers[i].table, soakers[i].rounds, rows, evicted);
        ck_assert_double_le(rows, EVICTING_CAPACITY);
        ck_assert_double_gt(evicted, 0);
    }
    double saves = stat_of(admin, NULL, "checkpoint_saves");
    printf("soak: %.0f checkpoints saved (%.0f of them deltas), %.0f failed\n", saves,
           stat_of(admin, NULL, "checkpoint_deltas"),
           stat_of(admin, NULL, "checkpoint_save_failures"));
    ck_assert_double_eq(stat_of(admin, NULL, "checkpoint_save_failures"), 0);
    ck_assert_double_gt(saves, THREADS); /* more than one periodic save a table */
    em_client_destroy(admin);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 30000), 0);
    daemon = test_daemon_start(json);
    admin = admin_client(daemon);
    for (int i = 0; i < THREADS; i++) {
        assert_same_as_local(admin, &soakers[i]);
        em_table_destroy(soakers[i].local);
        em_backend_destroy(soakers[i].backend);
    }
    em_client_destroy(admin);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 30000), 0);
    em_test_remove_tree(dir);
}
END_TEST

static Suite *soak_suite(void)
{
    Suite *suite = suite_create("soak");
    TCase *tc = tcase_create("soak");
    tcase_set_timeout(tc, 0); /* bounded by EMBER_SOAK_SECONDS */
    tcase_add_test(tc, answers_stay_right_and_memory_stays_flat_under_load);
    tcase_add_test(tc, evicting_tables_saved_every_second_stay_within_their_memory);
    suite_add_tcase(suite, tc);
    return suite;
}

int main(void)
{
    SRunner *runner = srunner_create(soak_suite());
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
