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

typedef struct soaker {
    const char *address;
    uint64_t seed;
    uint64_t key_base;
    double end;
    _Atomic uint64_t *requests;
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
        em_table_config_parse_text(TABLE_JSON, &config, &err) != EM_OK ||
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
    em_test_rng rng;
    em_test_rng_init(&rng, s->seed);
    for (uint64_t round = 0; now_seconds() < s->end && s->failure[0] == '\0'; round++) {
        em_combiner combiner = (em_combiner)(round % 4);
        em_test_batch b = em_test_random_batch(&rng, 64, 6, 20000);
        for (uint64_t i = 0; i < b.csr.nnz; i++)
            b.keys[i] = (b.keys[i] & ((UINT64_C(1) << 40) - 1)) | s->key_base;
        uint64_t floats = em_csr_output_vectors(&b.csr, combiner) * DIM;
        float *got = malloc((floats + 1) * sizeof(float));
        float *expected = malloc((floats + 1) * sizeof(float));
        em_client_pull_args pull = {"t", b.csr, combiner, true, got, floats};
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
        em_client_push_args push = {"t", b.csr, combiner, got, floats};
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
    em_table_destroy(local);
    em_backend_destroy(backend);
    return NULL;
}

START_TEST(answers_stay_right_and_memory_stays_flat_under_load)
{
    const char *text = getenv("EMBER_SOAK_SECONDS");
    double seconds = text != NULL && atof(text) > 0 ? atof(text) : 8.0;
    test_daemon *daemon = test_daemon_start("{\"tables\": [" TABLE_JSON "],"
                                            " \"log_level\": \"warning\"}");
    _Atomic uint64_t requests = 0;
    soaker soakers[THREADS];
    pthread_t threads[THREADS];
    double start = now_seconds();
    for (int i = 0; i < THREADS; i++) {
        soakers[i] = (soaker){.address = daemon->data, .seed = em_test_seed() + (uint64_t)i,
                              .key_base = (uint64_t)i << 40, .end = start + seconds,
                              .requests = &requests};
        ck_assert_int_eq(pthread_create(&threads[i], NULL, soak, &soakers[i]), 0);
    }
    uint64_t quarter_rss = 0, last_rss = 0, peak_rss = 0;
    for (double t = 0.5; now_seconds() < start + seconds; t += 0.5) {
        usleep(500000);
        last_rss = rss_bytes(daemon->pid);
        peak_rss = last_rss > peak_rss ? last_rss : peak_rss;
        if (quarter_rss == 0 && t >= seconds / 4)
            quarter_rss = last_rss;
        printf("soak t=%.1fs: %" PRIu64 " requests answered, emberd RSS %.1f MiB\n", t,
               (uint64_t)atomic_load(&requests), (double)last_rss / MIB);
        fflush(stdout);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(threads[i], NULL);
        ck_assert_msg(soakers[i].failure[0] == '\0', "thread %d: %s", i, soakers[i].failure);
    }
    ck_assert_uint_gt(atomic_load(&requests), 100);
    printf("soak: %" PRIu64 " requests in %.0f s, every answer checked; RSS at a quarter "
           "%.1f MiB, peak %.1f MiB, last %.1f MiB\n",
           (uint64_t)atomic_load(&requests), seconds, (double)quarter_rss / MIB,
           (double)peak_rss / MIB, (double)last_rss / MIB);
    bool sanitized = getenv("EMBER_SOAK_SANITIZED") != NULL;
    ck_assert_msg(sanitized || quarter_rss == 0 || last_rss <= quarter_rss + SOAK_GROWTH_BYTES,
                  "RSS grew from %" PRIu64 " to %" PRIu64 " bytes", quarter_rss, last_rss);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

static Suite *soak_suite(void)
{
    Suite *suite = suite_create("soak");
    TCase *tc = tcase_create("soak");
    tcase_set_timeout(tc, 0); /* bounded by EMBER_SOAK_SECONDS */
    tcase_add_test(tc, answers_stay_right_and_memory_stays_flat_under_load);
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
