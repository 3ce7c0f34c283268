#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/row_check.h"
#include "lib/device/backend.h"
#include "lib/device/optimizer.h"
#include "lib/table/table.h"
#include "tests/support/reference_table.h"
#include "tests/support/test_batches.h"
#include "tests/support/test_support.h"

#define MEBIBYTE (UINT64_C(1) << 20)

/* ---- fixtures ---------------------------------------------------------------------- */

static em_backend *make_backend(uint32_t devices, uint64_t limit_bytes)
{
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.devices = devices;
    options.pool_limit_bytes = limit_bytes;
    options.pool_initial_bytes = limit_bytes < 16 * MEBIBYTE ? limit_bytes / 4 : 16 * MEBIBYTE;
    options.pool_growth_bytes = limit_bytes < 16 * MEBIBYTE ? limit_bytes / 8 : 16 * MEBIBYTE;
    em_backend *backend = NULL;
    em_error err;
    ck_assert_msg(em_backend_create_cpu(&options, &backend, &err) == EM_OK, "%s", err.message);
    return backend;
}

static em_table_config table_config(uint32_t dim, uint64_t capacity, uint32_t shards,
                                    int optimizer)
{
    em_table_config config;
    em_table_config_init(&config, "t", dim, capacity);
    config.shards = shards;
    config.optimizer = em_test_optimizers[optimizer];
    config.initializer.kind = EM_INIT_UNIFORM;
    config.initializer.bound = 0.5f;
    config.initializer.seed = 1234;
    return config;
}

/* ---- agreement with the float64 reference ------------------------------------------ */

static void assert_rows_match_reference(em_table *table, reference_table *reference)
{
    em_test_snapshot s = em_test_snapshot_take(table, 7);
    ck_assert_uint_eq(s.count, reference_table_rows(reference));
    double *expected = malloc(s.width * sizeof(double));
    for (uint64_t i = 0; i < s.count; i++) {
        ck_assert(reference_row(reference, s.keys[i], expected));
        for (uint32_t j = 0; j < s.width; j++)
            ck_assert_msg(reference_close(s.values[i * s.width + j], expected[j], 1e-2),
                          "key %llu value %u: %.9g vs reference %.9g",
                          (unsigned long long)s.keys[i], j, (double)s.values[i * s.width + j],
                          expected[j]);
    }
    free(expected);
    em_test_snapshot_free(&s);
}

/* Loop index: optimizer * 4 + combiner. Pulls (creating), pushes, pulls again; every
 * output and finally every row (weights and optimizer state) against the reference. */
START_TEST(pull_and_push_match_float64_reference)
{
    int optimizer = _i / 4;
    em_combiner combiner = (em_combiner)(_i % 4);
    const uint32_t dim = 13;
    em_backend *backend = make_backend(1, 256 * MEBIBYTE);
    em_table_config config = table_config(dim, 100000, 3, optimizer);
    em_table *table = em_test_make_table(backend, &config);
    reference_table *reference = reference_table_create(&config);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() * 31 + (uint64_t)_i);
    em_error err;
    for (int round = 0; round < 25; round++) {
        em_test_batch b = em_test_random_batch(&rng, 24, 6, 150);
        uint64_t vectors = em_csr_output_vectors(&b.csr, combiner);
        float *out = malloc((vectors * dim + 1) * sizeof(float));
        double *expected = malloc((vectors * dim + 1) * sizeof(double));
        double *magnitude = malloc((vectors * dim + 1) * sizeof(double));
        em_pull_result result;
        ck_assert_msg(em_test_pull(table, &b.csr, combiner, true, out, &result, &err) == EM_OK, "%s",
                      err.message);
        uint64_t missing = reference_pull(reference, &b.csr, combiner, true, expected, magnitude);
        ck_assert_uint_eq(result.missing, missing);
        ck_assert_uint_eq(result.created, missing);
        /* 1e-5 relative to the pooled magnitudes (or 1e-2 for tiny values) */
        for (uint64_t i = 0; i < vectors * dim; i++)
            ck_assert_msg(reference_close(out[i], expected[i],
                                          magnitude[i] > 1e-2 ? magnitude[i] : 1e-2),
                          "round %d output %llu: %.9g vs %.9g", round, (unsigned long long)i,
                          (double)out[i], expected[i]);
        float *g = em_test_random_floats(&rng, vectors * dim);
        em_push_result pushed;
        ck_assert_msg(em_test_push(table, &b.csr, combiner, g, &pushed, &err) == EM_OK, "%s",
                      err.message);
        reference_push(reference, &b.csr, combiner, g);
        ck_assert_uint_eq(pushed.created, 0);
        free(g);
        free(out);
        free(expected);
        free(magnitude);
        em_test_batch_free(&b);
    }
    assert_rows_match_reference(table, reference);
    reference_table_destroy(reference);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* Pushes create keys they have not seen, then update them once. */
START_TEST(push_creates_and_updates_once_per_unique_key)
{
    em_backend *backend = make_backend(1, 64 * MEBIBYTE);
    em_table_config config = table_config(4, 1000, 2, 3 /* adam */);
    em_table *table = em_test_make_table(backend, &config);
    reference_table *reference = reference_table_create(&config);
    const uint32_t offsets[] = {0, 3, 5};
    const uint64_t keys[] = {9, 9, 5, 9, 5};
    em_csr csr = {.rows = 2, .nnz = 5, .offsets = offsets, .keys = keys};
    float g[5 * 4];
    for (int i = 0; i < 20; i++)
        g[i] = (float)(i % 7) - 3.0f;
    em_push_result result;
    em_error err;
    ck_assert_int_eq(em_test_push(table, &csr, EM_COMBINER_NONE, g, &result, &err), EM_OK);
    ck_assert_uint_eq(result.updated, 2);
    ck_assert_uint_eq(result.created, 2);
    reference_push(reference, &csr, EM_COMBINER_NONE, g);
    assert_rows_match_reference(table, reference);
    em_test_snapshot s = em_test_snapshot_take(table, 7);
    /* one adam step per unique key: the step counter (last state float) is 1 */
    for (uint64_t i = 0; i < s.count; i++)
        ck_assert_float_eq(s.values[i * s.width + s.width - 1], 1.0f);
    em_test_snapshot_free(&s);
    ck_assert_int_eq(em_test_push(table, &csr, EM_COMBINER_MEAN, g, &result, &err), EM_OK);
    ck_assert_uint_eq(result.created, 0);
    reference_push(reference, &csr, EM_COMBINER_MEAN, g);
    assert_rows_match_reference(table, reference);
    reference_table_destroy(reference);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(empty_rows_and_empty_batches)
{
    em_backend *backend = make_backend(1, 64 * MEBIBYTE);
    em_table_config config = table_config(3, 1000, 2, 0);
    em_table *table = em_test_make_table(backend, &config);
    em_error err;
    const uint32_t offsets[] = {0, 0, 2, 2};
    const uint64_t keys[] = {1, 2};
    em_csr csr = {.rows = 3, .nnz = 2, .offsets = offsets, .keys = keys};
    float out[9];
    memset(out, 0x7f, sizeof(out));
    ck_assert_int_eq(em_test_pull(table, &csr, EM_COMBINER_MEAN, true, out, NULL, &err), EM_OK);
    for (int j = 0; j < 3; j++) {
        ck_assert(out[j] == 0.0f && out[6 + j] == 0.0f);
        float a = em_initializer_value(&config.initializer, 1, (uint32_t)j);
        float b = em_initializer_value(&config.initializer, 2, (uint32_t)j);
        ck_assert_float_eq(out[3 + j], (a + b) / 2.0f);
    }
    const uint32_t none[] = {0};
    em_csr empty = {.rows = 0, .nnz = 0, .offsets = none, .keys = NULL};
    em_pull_result result;
    ck_assert_int_eq(em_test_pull(table, &empty, EM_COMBINER_SUM, true, out, &result, &err), EM_OK);
    ck_assert_uint_eq(result.unique_keys, 0);
    em_push_result pushed;
    ck_assert_int_eq(em_test_push(table, &empty, EM_COMBINER_NONE, NULL, &pushed, &err), EM_OK);
    ck_assert_uint_eq(pushed.updated, 0);
    const uint32_t all_empty[] = {0, 0, 0};
    em_csr no_keys = {.rows = 2, .nnz = 0, .offsets = all_empty, .keys = NULL};
    float zeros[6];
    memset(zeros, 0x7f, sizeof(zeros));
    ck_assert_int_eq(em_test_pull(table, &no_keys, EM_COMBINER_SQRTN, false, zeros, NULL, &err), EM_OK);
    for (int j = 0; j < 6; j++)
        ck_assert(zeros[j] == 0.0f);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(create_missing_off_reads_zeros_and_inserts_nothing)
{
    em_backend *backend = make_backend(1, 64 * MEBIBYTE);
    em_table_config config = table_config(5, 1000, 4, 1);
    em_table *table = em_test_make_table(backend, &config);
    em_error err;
    const uint32_t offsets[] = {0, 4};
    const uint64_t keys[] = {11, 12, 11, 13};
    em_csr csr = {.rows = 1, .nnz = 4, .offsets = offsets, .keys = keys};
    float out[20];
    em_pull_result result;
    ck_assert_int_eq(em_test_pull(table, &csr, EM_COMBINER_NONE, false, out, &result, &err), EM_OK);
    ck_assert_uint_eq(result.missing, 3);
    ck_assert_uint_eq(result.created, 0);
    for (int i = 0; i < 20; i++)
        ck_assert(out[i] == 0.0f);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, 0);
    ck_assert_int_eq(em_test_pull(table, &csr, EM_COMBINER_NONE, true, out, &result, &err), EM_OK);
    ck_assert_uint_eq(result.created, 3);
    for (int k = 0; k < 4; k++)
        for (uint32_t j = 0; j < 5; j++) {
            float expected = em_initializer_value(&config.initializer, keys[k], j);
            ck_assert(memcmp(&out[k * 5 + (int)j], &expected, sizeof(float)) == 0);
        }
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, 3);
    ck_assert_uint_eq(stats.rows_created, 3);
    ck_assert_int_eq(em_test_pull(table, &csr, EM_COMBINER_NONE, false, out, &result, &err), EM_OK);
    ck_assert_uint_eq(result.missing, 0);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* ---- determinism over shard and device counts ------------------------------------- */

typedef struct run_record {
    float *outputs;
    uint64_t output_count;
    em_test_snapshot final;
} run_record;

/* The same random workload on a given layout; records every pulled float. */
static run_record run_workload(uint32_t devices, uint32_t shards, int optimizer,
                               em_combiner combiner)
{
    em_backend *backend = make_backend(devices, 128 * MEBIBYTE);
    em_table_config config = table_config(7, 100000, shards, optimizer);
    em_table *table = em_test_make_table(backend, &config);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 77);
    run_record record = {.outputs = malloc(40 * 64 * 8 * 7 * sizeof(float))};
    em_error err;
    for (int round = 0; round < 40; round++) {
        em_test_batch b = em_test_random_batch(&rng, 64, 8, 2000);
        uint64_t floats = em_csr_output_vectors(&b.csr, combiner) * 7;
        ck_assert_int_eq(em_test_pull(table, &b.csr, combiner, round % 3 != 2,
                              record.outputs + record.output_count, NULL, &err),
                         EM_OK);
        record.output_count += floats;
        float *g = em_test_random_floats(&rng, floats);
        ck_assert_msg(em_test_push(table, &b.csr, combiner, g, NULL, &err) == EM_OK, "%s", err.message);
        free(g);
        em_test_batch_free(&b);
    }
    record.final = em_test_snapshot_take(table, 7);
    em_table_destroy(table);
    em_backend_destroy(backend);
    return record;
}

/* Loop index picks the optimizer and combiner; every layout must reproduce the
 * one-shard, one-device run bit for bit (outputs and every row's state). */
START_TEST(results_identical_for_any_shard_and_device_count)
{
    static const uint32_t layouts[][2] = {{1, 2}, {1, 3}, {1, 8}, {2, 2}, {2, 3},
                                          {3, 3}, {2, 8}, {3, 8}, {8, 8}};
    int optimizer = _i % 4;
    em_combiner combiner = (em_combiner)((_i + 1) % 4);
    run_record base = run_workload(1, 1, optimizer, combiner);
    for (size_t l = 0; l < sizeof(layouts) / sizeof(layouts[0]); l++) {
        run_record other = run_workload(layouts[l][0], layouts[l][1], optimizer, combiner);
        ck_assert_uint_eq(other.output_count, base.output_count);
        ck_assert_msg(memcmp(other.outputs, base.outputs, base.output_count * sizeof(float)) == 0,
                      "pulled values differ with %u devices, %u shards", layouts[l][0],
                      layouts[l][1]);
        em_test_assert_snapshots_identical(&base.final, &other.final);
        free(other.outputs);
        em_test_snapshot_free(&other.final);
    }
    free(base.outputs);
    em_test_snapshot_free(&base.final);
}
END_TEST

/* ---- all or nothing ------------------------------------------------------------------ */

static em_table *populated_table(em_backend *backend, uint64_t capacity, int optimizer,
                                 em_test_rng *rng)
{
    em_table_config config = table_config(6, capacity, 3, optimizer);
    em_table *table = em_test_make_table(backend, &config);
    em_error err;
    em_test_batch b = em_test_random_batch(rng, 20, 5, 60);
    float *g = em_test_random_floats(rng, b.csr.nnz * 6);
    ck_assert_int_eq(em_test_push(table, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    free(g);
    em_test_batch_free(&b);
    return table;
}

START_TEST(invalid_requests_apply_nothing)
{
    em_backend *backend = make_backend(2, 64 * MEBIBYTE);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = populated_table(backend, 10000, 3, &rng);
    em_test_snapshot before = em_test_snapshot_take(table, 7);
    em_error err;

    /* New and existing keys, a NaN in the last key's gradient. */
    const uint32_t offsets[] = {0, 2, 5};
    const uint64_t keys[] = {before.keys[0], 424242, before.keys[1], 515151, 616161};
    em_csr csr = {.rows = 2, .nnz = 5, .offsets = offsets, .keys = keys};
    float g[5 * 6];
    for (int i = 0; i < 30; i++)
        g[i] = 0.25f;
    g[4 * 6 + 3] = NAN;
    ck_assert_int_eq(em_test_push(table, &csr, EM_COMBINER_NONE, g, NULL, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "push to table 't': gradient of key 616161 (keys[4], row 1) "
                                  "element 3 is NaN");
    em_test_assert_table_unchanged(table, &before);

    g[4 * 6 + 3] = INFINITY;
    ck_assert_int_eq(em_test_push(table, &csr, EM_COMBINER_NONE, g, NULL, &err), EM_INVALID_ARGUMENT);
    em_test_assert_table_unchanged(table, &before);

    /* Bad CSR in a push and in a creating pull. */
    const uint32_t bad_offsets[] = {0, 3, 2};
    em_csr bad = {.rows = 2, .nnz = 2, .offsets = bad_offsets, .keys = keys};
    g[4 * 6 + 3] = 0.5f;
    ck_assert_int_eq(em_test_push(table, &bad, EM_COMBINER_SUM, g, NULL, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "push to table 't': offsets[2]=2 < offsets[1]=3");
    float out[5 * 6];
    ck_assert_int_eq(em_test_pull(table, &bad, EM_COMBINER_NONE, true, out, NULL, &err),
                     EM_INVALID_ARGUMENT);
    em_test_assert_table_unchanged(table, &before);

    /* Gradient count that does not match the combiner. */
    em_push_request wrong = {.batch = csr, .combiner = EM_COMBINER_SUM, .gradients = g,
                             .gradient_count = 30};
    em_push_result pushed;
    ck_assert_int_eq(em_table_push(table, &wrong, &pushed, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "push to table 't': push carries 30 gradient floats, "
                                  "expected 12 (2 rows x dim 6)");
    /* Output too small and unknown combiner. */
    em_pull_request small = {.batch = csr, .combiner = EM_COMBINER_NONE, .create_missing = true,
                             .out = out, .out_capacity = 29};
    em_pull_result pulled;
    ck_assert_int_eq(em_table_pull(table, &small, &pulled, &err), EM_INVALID_ARGUMENT);
    ck_assert(strstr(err.message, "output holds 29 floats, the pull needs 30") != NULL);
    small.out_capacity = 30;
    small.combiner = (em_combiner)9;
    ck_assert_int_eq(em_table_pull(table, &small, &pulled, &err), EM_INVALID_ARGUMENT);
    ck_assert(strstr(err.message, "combiner 9") != NULL);
    em_test_assert_table_unchanged(table, &before);
    em_test_snapshot_free(&before);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* A push whose summed gradient or whose step would leave a value non-finite is refused
 * whole, naming the key and the element, for every optimizer; new keys included. */
START_TEST(pushes_that_would_make_rows_non_finite_apply_nothing)
{
    int optimizer = _i;
    em_backend *backend = make_backend(2, 64 * MEBIBYTE);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = populated_table(backend, 10000, optimizer, &rng);
    em_test_snapshot before = em_test_snapshot_take(table, 7);
    em_error err;

    /* Two finite gradients of one key that add up past the float range. */
    const uint32_t offsets[] = {0, 1, 2, 3};
    const uint64_t keys[] = {before.keys[0], 777777, before.keys[0]};
    em_csr csr = {.rows = 3, .nnz = 3, .offsets = offsets, .keys = keys};
    float g[3 * 6];
    for (int i = 0; i < 18; i++)
        g[i] = 0.125f;
    g[0 * 6 + 2] = 3e38f;
    g[2 * 6 + 2] = 3e38f;
    ck_assert_int_eq(em_test_push(table, &csr, EM_COMBINER_NONE, g, NULL, &err),
                     EM_INVALID_ARGUMENT);
    char expected[256];
    snprintf(expected, sizeof(expected),
             "push to table 't': key %" PRIu64 ": element 2 of its summed gradient is inf",
             before.keys[0]);
    ck_assert_msg(strstr(err.message, expected) == err.message, "%s", err.message);
    em_test_assert_table_unchanged(table, &before);
    em_test_snapshot_free(&before);
    em_table_destroy(table);

    /* Finite gradients whose step overflows, on a key the push would create: it is
     * not created, and the existing key in the same push is not stepped. */
    em_table_config config = table_config(6, 1000, 3, optimizer);
    config.optimizer.learning_rate = 1e6f;
    table = em_test_make_table(backend, &config);
    const uint64_t first[] = {11};
    em_csr one = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = first};
    ck_assert_int_eq(em_test_push(table, &one, EM_COMBINER_NONE, g + 6, NULL, &err), EM_OK);
    before = em_test_snapshot_take(table, 7);
    const uint64_t mixed[] = {11, 888888};
    em_csr two = {.rows = 2, .nnz = 2, .offsets = offsets, .keys = mixed};
    float steep[2 * 6];
    for (int i = 0; i < 12; i++)
        steep[i] = 0.125f;
    steep[6 + 2] = 1e35f;
    ck_assert_int_eq(em_test_push(table, &two, EM_COMBINER_NONE, steep, NULL, &err),
                     EM_INVALID_ARGUMENT);
    static const char *const problems[4] = {
        "this sgd step would make weight element 2 non-finite",
        "this adagrad step would make its accumulator (state float 2) non-finite",
        "this rowwise_adagrad step would make its accumulator (state float 0) non-finite",
        "this adam step would make its second moment (state float 8) non-finite",
    };
    ck_assert_msg(strstr(err.message, "key 888888: ") != NULL &&
                      strstr(err.message, problems[config.optimizer.kind]) != NULL &&
                      strstr(err.message, "nothing was applied") != NULL,
                  "%s", err.message);
    em_test_assert_table_unchanged(table, &before);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, 1);
    em_test_snapshot_free(&before);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(capacity_exhaustion_fails_whole)
{
    em_backend *backend = make_backend(1, 64 * MEBIBYTE);
    em_table_config config = table_config(4, 50, 4, 2);
    em_table *table = em_test_make_table(backend, &config);
    em_error err;
    uint64_t keys[70];
    uint32_t offsets[71];
    for (uint32_t i = 0; i <= 70; i++)
        offsets[i] = i;
    for (uint64_t i = 0; i < 70; i++)
        keys[i] = 1000 + i;
    float g[70 * 4];
    for (int i = 0; i < 280; i++)
        g[i] = 1.0f;
    em_csr first = {.rows = 40, .nnz = 40, .offsets = offsets, .keys = keys};
    ck_assert_int_eq(em_test_push(table, &first, EM_COMBINER_SUM, g, NULL, &err), EM_OK);
    em_test_snapshot before = em_test_snapshot_take(table, 7);

    /* 5 existing keys and 20 new ones: 60 rows > 50. */
    em_csr over = {.rows = 25, .nnz = 25, .offsets = offsets, .keys = keys + 35};
    ck_assert_int_eq(em_test_push(table, &over, EM_COMBINER_SUM, g, NULL, &err), EM_RESOURCE_EXHAUSTED);
    ck_assert_msg(strstr(err.message, "table 't': capacity 50 rows would be exceeded: it holds "
                                      "40 rows and this request would create 20 new keys; "
                                      "nothing was applied (pool cpu0: ") != NULL,
                  "%s", err.message);
    em_test_assert_table_unchanged(table, &before);
    float out[25 * 4];
    ck_assert_int_eq(em_test_pull(table, &over, EM_COMBINER_NONE, true, out, NULL, &err),
                     EM_RESOURCE_EXHAUSTED);
    em_test_assert_table_unchanged(table, &before);

    /* Exactly up to the capacity works. */
    em_csr fits = {.rows = 10, .nnz = 10, .offsets = offsets, .keys = keys + 40};
    em_pull_result result;
    ck_assert_int_eq(em_test_pull(table, &fits, EM_COMBINER_NONE, true, out, &result, &err), EM_OK);
    ck_assert_uint_eq(result.created, 10);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, 50);
    em_test_snapshot_free(&before);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(pool_exhaustion_fails_whole_and_table_keeps_working)
{
    em_backend *backend = make_backend(1, 8 * MEBIBYTE);
    em_table_config config = table_config(256, 1000000, 1, 3);
    em_table *table = em_test_make_table(backend, &config);
    em_error err;
    uint32_t offsets[501];
    uint64_t keys[500];
    for (uint32_t i = 0; i <= 500; i++)
        offsets[i] = i;
    float *g = calloc(500 * 256, sizeof(float));
    for (int i = 0; i < 500 * 256; i++)
        g[i] = 0.1f;
    em_status status = EM_OK;
    uint64_t next_key = 1;
    em_test_snapshot before = {0};
    for (int round = 0; round < 100 && status == EM_OK; round++) {
        em_test_snapshot_free(&before);
        before = em_test_snapshot_take(table, 7);
        for (int i = 0; i < 500; i++)
            keys[i] = next_key++;
        em_csr csr = {.rows = 500, .nnz = 500, .offsets = offsets, .keys = keys};
        status = em_test_push(table, &csr, EM_COMBINER_NONE, g, NULL, &err);
    }
    ck_assert_int_eq(status, EM_RESOURCE_EXHAUSTED);
    ck_assert_msg(strstr(err.message, "table 't' shard 0: cannot make room for 500 new keys, "
                                      "nothing was applied") != NULL,
                  "%s", err.message);
    ck_assert_msg(strstr(err.message, "pool 'cpu0'") != NULL, "%s", err.message);
    em_test_assert_table_unchanged(table, &before);
    /* Existing keys still update. */
    em_csr old = {.rows = 10, .nnz = 10, .offsets = offsets, .keys = before.keys};
    ck_assert_int_eq(em_test_push(table, &old, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    em_test_snapshot_free(&before);
    free(g);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* Loop index: 0 per-key output, 1 pooled (sum) output, 2 pooled rows of 7 keys. Pulls
 * that create keys until the pool runs out: the pull that fails has created nothing
 * (its buffers are taken before any key is created), whatever ran out. */
START_TEST(pulls_that_run_out_of_pool_create_nothing)
{
    const uint32_t dim = 1024, per_pull = 400; /* 1.6 MiB of vectors, 1.6 blocks of rows */
    em_backend *backend = make_backend(1, 24 * MEBIBYTE);
    em_table_config config = table_config(dim, 1000000, 1, 0);
    em_table *table = em_test_make_table(backend, &config);
    uint32_t offsets[401];
    uint64_t keys[400];
    uint32_t per_row = _i == 2 ? 7 : 1, rows = _i == 0 ? per_pull : (per_pull + per_row - 1) / per_row;
    for (uint32_t r = 0; r <= rows; r++)
        offsets[r] = r * per_row < per_pull ? r * per_row : per_pull;
    float *out = malloc((size_t)per_pull * dim * sizeof(float));
    em_error err;
    em_status status = EM_OK;
    uint64_t next_key = 1, pulls = 0;
    em_test_snapshot before = {0};
    for (int round = 0; round < 200 && status == EM_OK; round++) {
        em_test_snapshot_free(&before);
        before = em_test_snapshot_take(table, 7);
        for (uint32_t i = 0; i < per_pull; i++)
            keys[i] = next_key++;
        em_csr csr = {.rows = rows, .nnz = per_pull, .offsets = offsets, .keys = keys};
        status = em_test_pull(table, &csr, _i == 0 ? EM_COMBINER_NONE : EM_COMBINER_SUM, true,
                              out, NULL, &err);
        pulls += status == EM_OK;
    }
    ck_assert_int_eq(status, EM_RESOURCE_EXHAUSTED);
    ck_assert_msg(strstr(err.message, "pool 'cpu0'") != NULL, "%s", err.message);
    ck_assert_uint_gt(pulls, 3);
    em_test_assert_table_unchanged(table, &before);
    em_test_snapshot_free(&before);
    free(out);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* ---- import / export --------------------------------------------------------------- */

START_TEST(export_import_round_trip_across_layouts)
{
    em_backend *a_backend = make_backend(1, 64 * MEBIBYTE);
    em_backend *b_backend = make_backend(2, 64 * MEBIBYTE);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 5);
    em_table *a = populated_table(a_backend, 10000, 1, &rng);
    em_table_config config = *em_table_get_config(a);
    config.shards = 5;
    em_table *b = em_test_make_table(b_backend, &config);
    em_test_snapshot source = em_test_snapshot_take(a, 7);
    em_error err;
    for (uint64_t start = 0; start < source.count; start += 9) {
        uint64_t n = source.count - start < 9 ? source.count - start : 9;
        ck_assert_msg(em_table_import(b, source.keys + start, source.values + start * source.width,
                                      n, &err) == EM_OK,
                      "%s", err.message);
    }
    em_test_snapshot copy = em_test_snapshot_take(b, 7);
    em_test_assert_snapshots_identical(&source, &copy);

    /* Importing over existing rows overwrites them. */
    ck_assert_int_eq(em_table_import(b, source.keys, source.values, source.count, &err), EM_OK);
    em_test_assert_table_unchanged(b, &source);

    /* Bad imports change nothing. */
    uint64_t dup_keys[3] = {source.keys[0], 999999, source.keys[0]};
    float *values = calloc(3 * source.width, sizeof(float));
    ck_assert_int_eq(em_table_import(b, dup_keys, values, 3, &err), EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "appears twice (rows 0 and 2)") != NULL, "%s", err.message);
    uint64_t fresh[2] = {777, 888};
    values[source.width + 6] = -1.0f; /* adagrad accumulator of the second row */
    ck_assert_int_eq(em_table_import(b, fresh, values, 2, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "import into table 't': row 1 (key 888): accumulator element "
                                  "0 is -1, must be >= 0");
    values[source.width + 6] = 0.0f;
    values[2] = NAN;
    ck_assert_int_eq(em_table_import(b, fresh, values, 2, &err), EM_INVALID_ARGUMENT);
    ck_assert(strstr(err.message, "weight element 2 is not finite") != NULL);
    em_test_assert_table_unchanged(b, &source);
    /* Values travel bit for bit, negative zero included. */
    uint64_t signed_zero_key = 31337;
    float *signed_zero = calloc(source.width, sizeof(float));
    signed_zero[0] = -0.0f;
    signed_zero[1] = 0x1p-140f; /* subnormal */
    ck_assert_int_eq(em_table_import(b, &signed_zero_key, signed_zero, 1, &err), EM_OK);
    em_test_snapshot with_zero = em_test_snapshot_take(b, 7);
    for (uint64_t i = 0; i < with_zero.count; i++)
        if (with_zero.keys[i] == signed_zero_key)
            ck_assert(memcmp(with_zero.values + i * with_zero.width, signed_zero,
                             source.width * sizeof(float)) == 0);
    em_test_snapshot_free(&with_zero);
    free(signed_zero);

    free(values);
    em_test_snapshot_free(&source);
    em_test_snapshot_free(&copy);
    em_table_destroy(a);
    em_table_destroy(b);
    em_backend_destroy(a_backend);
    em_backend_destroy(b_backend);
}
END_TEST

/* A loader's imports into a table it has just made: em_table_import_new and
 * em_table_import_new_from (rows where they lie) give the table em_table_import gives,
 * on one device (rows written from where they lie) and on two (gathered first); a key
 * that is there already fails the call naming how many; em_table_reserve first leaves
 * the index no larger than the imports alone make it. */
START_TEST(imports_into_a_new_table)
{
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 9);
    em_backend *source_backend = make_backend(1, 64 * MEBIBYTE);
    em_table *source = populated_table(source_backend, 10000, 1, &rng);
    em_test_snapshot rows = em_test_snapshot_take(source, 7);
    em_table_config config = *em_table_get_config(source);
    config.shards = 5;
    for (uint32_t devices = 1; devices <= 2; devices++) {
        em_backend *backend = make_backend(devices, 64 * MEBIBYTE);
        em_table *tables[3];
        em_error err;
        for (int k = 0; k < 3; k++)
            tables[k] = em_test_make_table(backend, &config);
        ck_assert_int_eq(em_table_reserve(tables[2], rows.count, &err), EM_OK);
        const float **pointers = malloc(rows.count * sizeof(*pointers));
        for (uint64_t start = 0; start < rows.count; start += 700) {
            uint64_t n = rows.count - start < 700 ? rows.count - start : 700;
            const float *values = rows.values + start * rows.width;
            for (uint64_t i = 0; i < n; i++) /* backwards through the batch: apart */
                pointers[i] = rows.values + (start + n - 1 - i) * rows.width;
            uint64_t *reversed = malloc(n * sizeof(uint64_t));
            for (uint64_t i = 0; i < n; i++)
                reversed[i] = rows.keys[start + n - 1 - i];
            ck_assert_int_eq(em_table_import(tables[0], rows.keys + start, values, n, &err),
                             EM_OK);
            ck_assert_msg(em_table_import_new(tables[1], rows.keys + start, values, n, &err) ==
                              EM_OK, "%s", err.message);
            ck_assert_msg(em_table_import_new_from(tables[2], reversed, pointers, n, &err) ==
                              EM_OK, "%s", err.message);
            free(reversed);
        }
        free(pointers);
        em_table_stats stats[3];
        for (int k = 0; k < 3; k++) {
            em_test_assert_table_unchanged(tables[k], &rows);
            em_table_get_stats(tables[k], &stats[k]);
            ck_assert_uint_eq(stats[k].rows, rows.count);
        }
        ck_assert_uint_eq(stats[2].index_bytes, stats[0].index_bytes);
        /* two new keys and one already there: refused, saying so */
        uint64_t keys[3] = {1u << 30, rows.keys[17], (1u << 30) + 1};
        ck_assert_int_eq(em_table_import_new(tables[1], keys, rows.values, 3, &err),
                         EM_INVALID_ARGUMENT);
        ck_assert_msg(strstr(err.message, "import into table 't': 1 of its 3 keys are in the "
                                          "table already") != NULL, "%s", err.message);
        for (int k = 0; k < 3; k++)
            em_table_destroy(tables[k]);
        em_backend_destroy(backend);
    }
    em_test_snapshot_free(&rows);
    em_table_destroy(source);
    em_backend_destroy(source_backend);
}
END_TEST

/* ---- concurrency ------------------------------------------------------------------- */

typedef struct torn_context {
    em_table *table;
    int thread;
    int iterations;
    int torn;
} torn_context;

#define TORN_KEYS 64
#define TORN_DIM 64

/* Pushers add the same value to every element of a row; a reader that ever sees a row
 * whose elements differ has seen a half-applied push. */
static void *torn_pusher(void *argument)
{
    torn_context *context = argument;
    uint32_t offsets[TORN_KEYS + 1];
    uint64_t keys[TORN_KEYS];
    float *g = malloc(TORN_KEYS * TORN_DIM * sizeof(float));
    for (int i = 0; i <= TORN_KEYS; i++)
        offsets[i] = (uint32_t)i;
    for (int i = 0; i < TORN_KEYS; i++)
        keys[i] = (uint64_t)i;
    for (int i = 0; i < TORN_KEYS * TORN_DIM; i++)
        g[i] = 1.0f;
    em_csr csr = {.rows = TORN_KEYS, .nnz = TORN_KEYS, .offsets = offsets, .keys = keys};
    em_error err;
    for (int n = 0; n < context->iterations; n++)
        if (em_test_push(context->table, &csr, EM_COMBINER_NONE, g, NULL, &err) != EM_OK)
            context->torn = -1;
    free(g);
    return NULL;
}

static void *torn_reader(void *argument)
{
    torn_context *context = argument;
    uint32_t offsets[] = {0, TORN_KEYS};
    uint64_t keys[TORN_KEYS];
    for (int i = 0; i < TORN_KEYS; i++)
        keys[i] = (uint64_t)i;
    em_csr csr = {.rows = 1, .nnz = TORN_KEYS, .offsets = offsets, .keys = keys};
    float *out = malloc(TORN_KEYS * TORN_DIM * sizeof(float));
    em_error err;
    for (int n = 0; n < context->iterations; n++) {
        if (em_test_pull(context->table, &csr, EM_COMBINER_NONE, true, out, NULL, &err) != EM_OK)
            context->torn = -1;
        for (int k = 0; k < TORN_KEYS; k++)
            for (int j = 1; j < TORN_DIM; j++)
                if (out[k * TORN_DIM + j] != out[k * TORN_DIM])
                    context->torn++;
    }
    free(out);
    return NULL;
}

/* The bounds of row_check.h: from a row at its bounds, EM_ROW_BOUNDED_STEPS + 1 steps
 * with gradients at their bound, all pushing the same way, with hyperparameters that
 * only just bound the step, leave every value finite. */
START_TEST(bounded_steps_stay_finite)
{
    const uint32_t dim = 64;
    em_optimizer_config optimizer = {.kind = (em_optimizer_kind)_i, .learning_rate = 1e6f,
                                     .eps = 1e-10f, .beta1 = 0.999999f, .beta2 = 0.999999f};
    ck_assert(em_row_bound_step(&optimizer, dim));
    optimizer.eps = 1e-12f;
    ck_assert(optimizer.kind != EM_OPTIMIZER_ADAM || !em_row_bound_step(&optimizer, dim));
    optimizer.eps = 1e-10f;
    uint32_t floats = dim + em_optimizer_state_floats(optimizer.kind, dim);
    float *row = calloc(floats, sizeof(float)), gradient[64];
    for (uint32_t j = 0; j < dim; j++) {
        row[j] = EM_ROW_BOUND_WEIGHT;
        gradient[j] = -EM_ROW_BOUND_GRADIENT;
    }
    if (optimizer.kind == EM_OPTIMIZER_ADAGRAD || optimizer.kind == EM_OPTIMIZER_ROWWISE_ADAGRAD)
        for (uint32_t j = dim; j < floats; j++)
            row[j] = EM_ROW_BOUND_ACCUMULATOR;
    if (optimizer.kind == EM_OPTIMIZER_ADAM)
        for (uint32_t j = 0; j < dim; j++)
            row[dim + j] = -EM_ROW_BOUND_GRADIENT; /* first moments; second moments 0 */
    ck_assert(em_row_bounded(&optimizer, dim, row, gradient));
    for (uint32_t step = 0; step <= EM_ROW_BOUNDED_STEPS; step++) {
        em_optimizer_apply_row(&optimizer, dim, row, row + dim, gradient);
        for (uint32_t j = 0; j < floats; j++)
            ck_assert_msg(isfinite(row[j]), "step %u, float %u: %g", step, j, (double)row[j]);
    }
    /* and the bounds mean something: beyond them a row is not bounded */
    row[0] = 2 * EM_ROW_BOUND_WEIGHT;
    ck_assert(!em_row_bounded(&optimizer, dim, row, gradient));
    row[0] = NAN;
    ck_assert(!em_row_bounded(&optimizer, dim, row, gradient));
    free(row);
}
END_TEST

/* The bound of a sum of n terms of size at most m covers every order of adding them. */
START_TEST(sum_bounds_cover_float_sums)
{
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    static const uint64_t counts[] = {1, 2, 3, 40, 1000, 1u << 16, 1u << 22};
    float *terms = malloc((1u << 22) * sizeof(float));
    for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
        uint64_t n = counts[c];
        float largest = 0.0f;
        for (uint64_t i = 0; i < n; i++) {
            /* mostly one sign, sizes near the largest, so the sum grows and rounds */
            terms[i] = (float)(em_test_rng_unit(&rng) * 0.25 + 0.75) * 1.0000001f;
            terms[i] = em_test_rng_below(&rng, 16) == 0 ? -terms[i] : terms[i];
            largest = fabsf(terms[i]) > largest ? fabsf(terms[i]) : largest;
        }
        ck_assert_float_eq(em_row_largest_size(terms, n), largest);
        float sum = -0.0f, bound = em_row_sum_bound(largest, n);
        for (uint64_t i = 0; i < n; i++) {
            sum += terms[i];
            ck_assert_msg(fabsf(sum) <= bound, "%" PRIu64 " terms: partial sum %g past %g", n,
                          (double)sum, (double)bound);
        }
        ck_assert(bound <= (double)largest * (double)n * 1.6); /* and stays useful */
    }
    free(terms);
    ck_assert_float_eq(em_row_sum_bound(FLT_MAX / 2, 3), INFINITY);
    ck_assert_float_eq(em_row_sum_bound(1.0f, (1u << 22) + 1), INFINITY);
    ck_assert_float_eq(em_row_sum_bound(NAN, 1), INFINITY);
    ck_assert_float_eq(em_row_sum_bound(INFINITY, 1), INFINITY);
    float inputs[] = {1.0f, -INFINITY, 3.0f};
    ck_assert_float_eq(em_row_largest_size(inputs, 3), INFINITY);
}
END_TEST

/* A key pushed many times in one push sums past the gradient bound though every pushed
 * gradient is within it: the push's bound counts the occurrences, so the rows are looked
 * at and a step past the float range is refused. (With the largest pushed gradient
 * alone as the bound, 25,000 occurrences of 9e14 would pass as bounded, and their sum,
 * 2.25e19, squared into the Adagrad accumulator, is past FLT_MAX.) */
START_TEST(repeated_keys_sum_past_the_gradient_bound)
{
    em_backend *backend = make_backend(1, 64 * MEBIBYTE);
    em_table_config config = table_config(4, 100, 2, EM_OPTIMIZER_ADAGRAD);
    config.initializer.kind = EM_INIT_ZEROS;
    em_table *table = em_test_make_table(backend, &config);
    enum { REPEATS = 25000 };
    uint32_t *offsets = malloc((REPEATS + 1) * sizeof(*offsets));
    uint64_t *keys = malloc(REPEATS * sizeof(*keys));
    float *g = malloc(REPEATS * 4 * sizeof(*g));
    for (int i = 0; i <= REPEATS; i++)
        offsets[i] = (uint32_t)i;
    for (int i = 0; i < REPEATS; i++)
        keys[i] = 5;
    for (int i = 0; i < REPEATS * 4; i++)
        g[i] = 9e14f;
    em_csr once = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = keys};
    em_csr csr = {.rows = REPEATS, .nnz = REPEATS, .offsets = offsets, .keys = keys};
    em_csr pooled = {.rows = 1, .nnz = REPEATS, .offsets = (uint32_t[]){0, REPEATS},
                     .keys = keys};
    em_error err;
    ck_assert_int_eq(em_test_push(table, &once, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    ck_assert_int_eq(em_test_push(table, &csr, EM_COMBINER_NONE, g, NULL, &err),
                     EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "key 5:") != NULL, "%s", err.message);
    ck_assert_int_eq(em_test_push(table, &pooled, EM_COMBINER_SUM, g, NULL, &err),
                     EM_INVALID_ARGUMENT);
    em_test_snapshot s = em_test_snapshot_take(table, 7);
    ck_assert_uint_eq(s.count, 1);
    for (uint64_t i = 0; i < s.count * s.width; i++)
        ck_assert_msg(isfinite(s.values[i]), "value %" PRIu64 ": %g", i, (double)s.values[i]);
    em_test_snapshot_free(&s);
    free(offsets);
    free(keys);
    free(g);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

typedef struct overflow_context {
    em_table *table;
    uint64_t seed;
    int applied, refused, failed;
} overflow_context;

#define OVERFLOW_KEYS 16
#define OVERFLOW_DIM 8

/* Pushes steps of 1.2e38, all of one push the same way, so weights walk between
 * -2.4e38 and 2.4e38 (a third step would overflow); each push is applied or refused
 * whole. */
static void *overflow_pusher(void *argument)
{
    overflow_context *context = argument;
    em_test_rng rng;
    em_test_rng_init(&rng, context->seed);
    uint32_t offsets[OVERFLOW_KEYS + 1];
    uint64_t keys[OVERFLOW_KEYS];
    float g[OVERFLOW_KEYS * OVERFLOW_DIM];
    for (int i = 0; i <= OVERFLOW_KEYS; i++)
        offsets[i] = (uint32_t)i;
    for (int i = 0; i < OVERFLOW_KEYS; i++)
        keys[i] = (uint64_t)i;
    em_csr csr = {.rows = OVERFLOW_KEYS, .nnz = OVERFLOW_KEYS, .offsets = offsets, .keys = keys};
    em_error err;
    for (int n = 0; n < 1000; n++) {
        float sign = em_test_rng_below(&rng, 2) ? 1.0f : -1.0f;
        for (int i = 0; i < OVERFLOW_KEYS * OVERFLOW_DIM; i++)
            g[i] = sign * 1.2e38f;
        em_status status = em_test_push(context->table, &csr, EM_COMBINER_NONE, g, NULL, &err);
        if (status == EM_OK)
            context->applied++;
        else if (status == EM_INVALID_ARGUMENT)
            context->refused++;
        else
            context->failed++;
    }
    return NULL;
}

/* Four pushers race rows toward overflow: a step checked while another push was
 * stepping the same rows is checked again before it applies, so no row ever becomes
 * infinite, however the two interleave. */
START_TEST(concurrent_pushes_near_the_float_range_keep_rows_finite)
{
    em_backend *backend = make_backend(2, 64 * MEBIBYTE);
    em_table_config config = table_config(OVERFLOW_DIM, 1000, 4, EM_OPTIMIZER_SGD);
    config.optimizer.learning_rate = 1.0f;
    config.initializer.kind = EM_INIT_ZEROS;
    em_table *table = em_test_make_table(backend, &config);
    pthread_t threads[4];
    overflow_context contexts[4];
    for (int t = 0; t < 4; t++) {
        contexts[t] = (overflow_context){.table = table, .seed = em_test_seed() + (uint64_t)t};
        pthread_create(&threads[t], NULL, overflow_pusher, &contexts[t]);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(threads[t], NULL);
        ck_assert_int_eq(contexts[t].failed, 0);
        ck_assert_int_gt(contexts[t].applied, 0);
    }
    ck_assert_int_gt(contexts[0].refused + contexts[1].refused + contexts[2].refused, 0);
    em_test_snapshot s = em_test_snapshot_take(table, 7);
    ck_assert_uint_eq(s.count, OVERFLOW_KEYS);
    for (uint64_t i = 0; i < s.count * s.width; i++)
        ck_assert_msg(isfinite(s.values[i]), "value %" PRIu64 ": %g", i, (double)s.values[i]);
    em_test_snapshot_free(&s);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

typedef struct snapshot_context {
    em_table *table;
    uint64_t first_key, key_count; /* pushes cover every key of the range in one push */
    bool pull;                     /* creates its keys by pulling them instead */
    _Atomic int *stop;
    int pushes, failed;
} snapshot_context;

#define SNAPSHOT_KEYS 2000
#define SNAPSHOT_DIM 4
#define SNAPSHOT_ROOM 1000000 /* the table's capacity */

/* Pushes gradient -1 to every key of its range at once (sgd, lr 1: every element of
 * every row goes up by 1 per push); with first_key beyond the table's keys, it creates
 * new keys instead. */
static void *snapshot_pusher(void *argument)
{
    snapshot_context *context = argument;
    uint64_t n = context->key_count;
    uint32_t *offsets = malloc((n + 1) * sizeof(uint32_t));
    uint64_t *keys = malloc(n * sizeof(uint64_t));
    float *g = malloc(n * SNAPSHOT_DIM * sizeof(float));
    for (uint64_t i = 0; i <= n; i++)
        offsets[i] = (uint32_t)i;
    for (uint64_t i = 0; i < n * SNAPSHOT_DIM; i++)
        g[i] = -1.0f;
    em_error err;
    do { /* at least once */
        for (uint64_t i = 0; i < n; i++)
            keys[i] = context->first_key + i;
        em_csr csr = {.rows = (uint32_t)n, .nnz = n, .offsets = offsets, .keys = keys};
        em_status status =
            context->pull ? em_test_pull(context->table, &csr, EM_COMBINER_NONE, true, g, NULL, &err)
                          : em_test_push(context->table, &csr, EM_COMBINER_NONE, g, NULL, &err);
        if (status != EM_OK)
            context->failed++;
        context->pushes++;
        if (context->first_key >= SNAPSHOT_KEYS) /* a creator: new keys every time */
            context->first_key = context->first_key + n < SNAPSHOT_ROOM / 2 ? context->first_key + n
                                                                             : SNAPSHOT_KEYS;
    } while (!atomic_load(context->stop));
    free(offsets);
    free(keys);
    free(g);
    return NULL;
}

/* A snapshot taken while pushes run is one instant: every push is wholly in it or
 * wholly absent (all rows equal), keys created after it are absent, and it is read in
 * small pieces with a copy limit small enough that pushes wait for the reader. */
START_TEST(snapshots_are_one_instant_while_pushes_run)
{
    em_backend *backend = make_backend(2, 256 * MEBIBYTE);
    em_table_config config = table_config(SNAPSHOT_DIM, SNAPSHOT_ROOM, 4, EM_OPTIMIZER_SGD);
    config.optimizer.learning_rate = 1.0f;
    config.initializer.kind = EM_INIT_ZEROS;
    em_table *table = em_test_make_table(backend, &config);
    _Atomic int stop = 0;
    snapshot_context contexts[4] = {
        {.table = table, .first_key = 0, .key_count = SNAPSHOT_KEYS, .stop = &stop},
        {.table = table, .first_key = 0, .key_count = SNAPSHOT_KEYS, .stop = &stop},
        {.table = table, .first_key = SNAPSHOT_KEYS, .key_count = 64, .stop = &stop},
        {.table = table, .first_key = SNAPSHOT_ROOM / 2, .key_count = 512, .pull = true,
         .stop = &stop},
    };
    /* the keys exist before the pushers start */
    _Atomic int stop_at_once = 1;
    contexts[0].stop = &stop_at_once;
    snapshot_pusher(&contexts[0]);
    contexts[0].stop = &stop;
    pthread_t threads[4];
    for (int t = 0; t < 4; t++)
        pthread_create(&threads[t], NULL, snapshot_pusher, &contexts[t]);
    em_error err;
    uint64_t *keys = malloc(SNAPSHOT_ROOM * sizeof(uint64_t));
    float *values = malloc(SNAPSHOT_ROOM * SNAPSHOT_DIM * sizeof(float));
    for (int round = 0; round < 20; round++) {
        em_table_snapshot *snapshot = NULL;
        ck_assert_int_eq(em_table_snapshot_begin(table, 4096, &snapshot, &err), EM_OK);
        em_table_snapshot *second = NULL;
        ck_assert_int_eq(em_table_snapshot_begin(table, 4096, &second, &err),
                         EM_FAILED_PRECONDITION);
        uint64_t total = 0, count = 0, created_seen = 0;
        float level = NAN;
        do {
            ck_assert_int_eq(em_table_snapshot_read(snapshot, 37, keys + total,
                                                    values + total * SNAPSHOT_DIM, NULL, &count, &err),
                             EM_OK);
            total += count;
            ck_assert_uint_le(total, SNAPSHOT_ROOM);
        } while (count > 0);
        for (uint64_t i = 0; i < total; i++) {
            if (keys[i] >= SNAPSHOT_KEYS) {
                created_seen++;
                continue;
            }
            if (isnan(level))
                level = values[i * SNAPSHOT_DIM];
            for (int j = 0; j < SNAPSHOT_DIM; j++)
                ck_assert_msg(values[i * SNAPSHOT_DIM + j] == level,
                              "round %d key %" PRIu64 ": %g, other rows %g", round, keys[i],
                              (double)values[i * SNAPSHOT_DIM + j], (double)level);
        }
        ck_assert_uint_eq(total - created_seen, SNAPSHOT_KEYS);
        ck_assert_uint_eq(total, em_table_snapshot_rows(snapshot));
        em_table_snapshot_end(snapshot);
    }
    atomic_store(&stop, 1);
    for (int t = 0; t < 4; t++) {
        pthread_join(threads[t], NULL);
        ck_assert_int_eq(contexts[t].failed, 0);
    }
    /* the snapshot ends: writes copy nothing more, and the table went on */
    ck_assert_int_gt(contexts[1].pushes, 0);
    free(keys);
    free(values);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(concurrent_pulls_never_see_torn_rows)
{
    em_backend *backend = make_backend(2, 64 * MEBIBYTE);
    em_table_config config = table_config(TORN_DIM, 1000, 4, 0);
    config.initializer.kind = EM_INIT_ZEROS;
    em_table *table = em_test_make_table(backend, &config);
    pthread_t threads[4];
    torn_context contexts[4];
    for (int t = 0; t < 4; t++) {
        contexts[t] = (torn_context){.table = table, .thread = t, .iterations = 400};
        pthread_create(&threads[t], NULL, t < 2 ? torn_pusher : torn_reader, &contexts[t]);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(threads[t], NULL);
        ck_assert_int_eq(contexts[t].torn, 0);
    }
    /* Every push applied exactly once: sgd with lr 0.05 and g = 1, 800 pushes. */
    em_test_snapshot s = em_test_snapshot_take(table, 7);
    ck_assert_uint_eq(s.count, TORN_KEYS);
    for (uint64_t i = 0; i < s.count * s.width; i++)
        ck_assert_float_eq_tol(s.values[i], -0.05f * 800, 1e-3f);
    em_test_snapshot_free(&s);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

typedef struct disjoint_context {
    em_table *table;
    reference_table *reference;
    uint64_t seed;
    int thread, threads;
    em_status status;
} disjoint_context;

/* Each thread owns the keys congruent to its index, so its keys see its pushes in its
 * own order whatever the interleaving. */
static void *disjoint_worker(void *argument)
{
    disjoint_context *context = argument;
    em_test_rng rng;
    em_test_rng_init(&rng, context->seed);
    em_error err;
    for (int round = 0; round < 60 && context->status == EM_OK; round++) {
        em_test_batch b = em_test_random_batch(&rng, 16, 4, 500);
        for (uint64_t k = 0; k < b.csr.nnz; k++)
            b.keys[k] = b.keys[k] * (uint64_t)context->threads + (uint64_t)context->thread;
        float *g = em_test_random_floats(&rng, b.csr.rows * 9);
        context->status = em_test_push(context->table, &b.csr, EM_COMBINER_SQRTN, g, NULL, &err);
        reference_push(context->reference, &b.csr, EM_COMBINER_SQRTN, g);
        free(g);
        em_test_batch_free(&b);
    }
    return NULL;
}

START_TEST(concurrent_disjoint_pushes_match_reference)
{
    const int threads = 4;
    em_backend *backend = make_backend(2, 64 * MEBIBYTE);
    em_table_config config = table_config(9, 100000, 6, 2);
    em_table *table = em_test_make_table(backend, &config);
    pthread_t handles[4];
    disjoint_context contexts[4];
    for (int t = 0; t < threads; t++) {
        contexts[t] = (disjoint_context){table, reference_table_create(&config),
                                         em_test_seed() + (uint64_t)t, t, threads, EM_OK};
        pthread_create(&handles[t], NULL, disjoint_worker, &contexts[t]);
    }
    for (int t = 0; t < threads; t++)
        pthread_join(handles[t], NULL);
    em_test_snapshot s = em_test_snapshot_take(table, 7);
    uint64_t expected_rows = 0;
    double values[9 + 1];
    for (int t = 0; t < threads; t++) {
        ck_assert_int_eq(contexts[t].status, EM_OK);
        expected_rows += reference_table_rows(contexts[t].reference);
    }
    ck_assert_uint_eq(s.count, expected_rows);
    for (uint64_t i = 0; i < s.count; i++) {
        reference_table *owner = contexts[s.keys[i] % (uint64_t)threads].reference;
        ck_assert(reference_row(owner, s.keys[i], values));
        for (uint32_t j = 0; j < s.width; j++)
            ck_assert(reference_close(s.values[i * s.width + j], values[j], 1e-2));
    }
    em_test_snapshot_free(&s);
    for (int t = 0; t < threads; t++)
        reference_table_destroy(contexts[t].reference);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

static uint64_t pool_in_use(em_device *device)
{
    em_pool_stats stats;
    em_pool_get_stats(device->pool, &stats);
    return stats.bytes_in_use;
}

/* Requests' scratch blocks: kept by the device between requests, up to its slots, the
 * rest back to the pool; what is kept counts in the pool and goes with the device. */
START_TEST(devices_keep_scratch_blocks_between_requests)
{
    em_backend *backend = make_backend(1, 64 * MEBIBYTE);
    em_device *device = backend->devices[0];
    uint64_t baseline = pool_in_use(device);
    enum { TAKEN = EM_DEVICE_SCRATCH_SLOTS + 3 };
    void *blocks[TAKEN];
    em_error err;
    for (int i = 0; i < TAKEN; i++)
        ck_assert_int_eq(em_device_scratch_take(device, "test scratch", &blocks[i], &err), EM_OK);
    ck_assert_uint_eq(pool_in_use(device), baseline + TAKEN * EM_DEVICE_SCRATCH_BLOCK);
    for (int i = 0; i < TAKEN; i++)
        em_device_scratch_give(device, blocks[i]);
    uint64_t kept = EM_DEVICE_SCRATCH_SLOTS * EM_DEVICE_SCRATCH_BLOCK;
    ck_assert_uint_eq(pool_in_use(device), baseline + kept);
    /* taken again: kept blocks, nothing more from the pool */
    void *again[EM_DEVICE_SCRATCH_SLOTS];
    for (int i = 0; i < EM_DEVICE_SCRATCH_SLOTS; i++) {
        ck_assert_int_eq(em_device_scratch_take(device, "test scratch", &again[i], &err), EM_OK);
        bool known = false;
        for (int j = 0; j < TAKEN; j++)
            known = known || again[i] == blocks[j];
        ck_assert_msg(known, "block %d was not one given back", i);
    }
    ck_assert_uint_eq(pool_in_use(device), baseline + kept);
    for (int i = 0; i < EM_DEVICE_SCRATCH_SLOTS; i++)
        em_device_scratch_give(device, again[i]);
    /* requests on several threads use what is kept: a table's memory plus at most the
     * kept blocks once they are done */
    em_table_config config = table_config(9, 100000, 6, 2);
    em_table *table = em_test_make_table(backend, &config);
    pthread_t handles[4];
    disjoint_context contexts[4];
    for (int t = 0; t < 4; t++) {
        contexts[t] = (disjoint_context){table, reference_table_create(&config),
                                         em_test_seed() + (uint64_t)t, t, 4, EM_OK};
        pthread_create(&handles[t], NULL, disjoint_worker, &contexts[t]);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(handles[t], NULL);
        ck_assert_int_eq(contexts[t].status, EM_OK);
        reference_table_destroy(contexts[t].reference);
    }
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    uint64_t with_table = pool_in_use(device);
    ck_assert_uint_le(with_table, baseline + kept + stats.row_bytes + stats.index_bytes +
                                      stats.access_bytes);
    em_table_destroy(table);
    ck_assert_uint_eq(pool_in_use(device), baseline + kept);
    em_device_scratch_drop(device);
    ck_assert_uint_eq(pool_in_use(device), baseline);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(stats_count_rows_memory_and_requests)
{
    em_backend *backend = make_backend(1, 64 * MEBIBYTE);
    em_table_config config = table_config(8, 1000, 2, 3);
    em_table *table = em_test_make_table(backend, &config);
    em_error err;
    const uint32_t offsets[] = {0, 3};
    const uint64_t keys[] = {1, 2, 2};
    em_csr csr = {.rows = 1, .nnz = 3, .offsets = offsets, .keys = keys};
    float out[24];
    ck_assert_int_eq(em_test_pull(table, &csr, EM_COMBINER_NONE, true, out, NULL, &err), EM_OK);
    float g[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    ck_assert_int_eq(em_test_push(table, &csr, EM_COMBINER_SUM, g, NULL, &err), EM_OK);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, 2);
    ck_assert_uint_eq(stats.capacity, 1000);
    ck_assert_uint_eq(stats.shards, 2);
    ck_assert_uint_eq(stats.row_floats, 8 + 17);
    ck_assert_uint_eq(stats.pulls, 1);
    ck_assert_uint_eq(stats.pushes, 1);
    ck_assert_uint_eq(stats.keys_pulled, 3);
    ck_assert_uint_eq(stats.keys_pushed, 3);
    ck_assert_uint_eq(stats.rows_created, 2);
    ck_assert_uint_gt(stats.row_bytes, 2 * 25 * sizeof(float));
    ck_assert_uint_gt(stats.index_bytes, 0);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(create_rejects_bad_config)
{
    em_backend *backend = make_backend(1, 16 * MEBIBYTE);
    em_table_config config = table_config(0, 10, 1, 0);
    em_table *table = NULL;
    em_error err;
    ck_assert_int_eq(em_table_create(backend, &config, &table, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "table.dim: must be between 1 and 4096, got 0");
    ck_assert_ptr_null(table);
    config = table_config(4, 10, 0, 0);
    table = em_test_make_table(backend, &config);
    ck_assert_uint_eq(em_table_get_config(table)->shards, 1);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* A push to keys 100.. of table, from its own thread (calls_that_may_change_...). */
typedef struct counted_pusher {
    em_table *table;
    const em_csr *batch;
    const float *gradients;
    int pushes;
} counted_pusher;

static void *push_repeatedly(void *argument)
{
    counted_pusher *p = argument;
    em_error err;
    for (int i = 0; i < p->pushes; i++)
        ck_assert_int_eq(em_test_push(p->table, p->batch, EM_COMBINER_NONE, p->gradients, NULL,
                                      &err),
                         EM_OK);
    return NULL;
}

/* em_table_changes counts each call that may change what a checkpoint holds of the
 * table, once it returns, and em_table_changed_since says whether one did since a
 * count: a pull that creates nothing of a table that tracks no access is not one (a
 * serving pull); a pull that may create keys, a push and an erase are, each once,
 * whatever they found; on a table that tracks access every pull is. Pushes from
 * several threads at once are each counted. */
START_TEST(calls_that_may_change_a_checkpoint_are_counted)
{
    em_backend *backend = make_backend(1, 64 * MEBIBYTE);
    em_table_config config = table_config(4, 10000, 2, 0);
    em_table *table = em_test_make_table(backend, &config);
    uint64_t keys[8];
    uint32_t offsets[9];
    for (uint32_t i = 0; i < 8; i++) {
        keys[i] = 100 + i;
        offsets[i] = i;
    }
    offsets[8] = 8;
    em_csr batch = {.rows = 8, .nnz = 8, .offsets = offsets, .keys = keys};
    float out[8 * 4], gradients[8 * 4];
    for (int i = 0; i < 8 * 4; i++)
        gradients[i] = 0.01f * (float)(i % 5);
    em_error err;
    uint64_t before = em_table_changes(table);
    ck_assert(!em_table_changed_since(table, before));
    ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, false, out, NULL, &err),
                     EM_OK);
    ck_assert(!em_table_changed_since(table, before));
    ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, true, out, NULL, &err),
                     EM_OK);
    ck_assert(em_table_changed_since(table, before));
    ck_assert_uint_eq(em_table_changes(table), before + 1);
    ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, true, out, NULL, &err),
                     EM_OK); /* every key stored already: it may have created some */
    ck_assert_uint_eq(em_table_changes(table), before + 2);
    ck_assert_int_eq(em_test_push(table, &batch, EM_COMBINER_NONE, gradients, NULL, &err),
                     EM_OK);
    uint64_t erased = 0, absent = 999;
    ck_assert_int_eq(em_table_erase(table, &absent, 1, &erased, &err), EM_OK);
    ck_assert_uint_eq(erased, 0);
    ck_assert_uint_eq(em_table_changes(table), before + 4);
    ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, false, out, NULL, &err),
                     EM_OK);
    ck_assert(!em_table_changed_since(table, before + 4));

    enum { THREADS = 4, PUSHES = 50 };
    pthread_t threads[THREADS];
    counted_pusher pushers[THREADS];
    for (int t = 0; t < THREADS; t++) {
        pushers[t] = (counted_pusher){table, &batch, gradients, PUSHES};
        ck_assert_int_eq(pthread_create(&threads[t], NULL, push_repeatedly, &pushers[t]), 0);
    }
    for (int t = 0; t < THREADS; t++)
        pthread_join(threads[t], NULL);
    ck_assert_uint_eq(em_table_changes(table), before + 4 + THREADS * PUSHES);
    em_table_destroy(table);

    config.eviction.policy = EM_EVICTION_LRU; /* a pull moves the rows' access metadata */
    table = em_test_make_table(backend, &config);
    ck_assert_int_eq(em_test_push(table, &batch, EM_COMBINER_NONE, gradients, NULL, &err),
                     EM_OK);
    before = em_table_changes(table);
    ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, false, out, NULL, &err),
                     EM_OK);
    ck_assert(em_table_changed_since(table, before));
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("table");
    TCase *reference = tcase_create("reference");
    tcase_set_timeout(reference, 120);
    tcase_add_loop_test(reference, pull_and_push_match_float64_reference, 0, 16);
    tcase_add_test(reference, push_creates_and_updates_once_per_unique_key);
    tcase_add_test(reference, empty_rows_and_empty_batches);
    tcase_add_test(reference, create_missing_off_reads_zeros_and_inserts_nothing);
    suite_add_tcase(suite, reference);

    TCase *layout = tcase_create("layout");
    tcase_set_timeout(layout, 240);
    tcase_add_loop_test(layout, results_identical_for_any_shard_and_device_count, 0, 4);
    suite_add_tcase(suite, layout);

    TCase *atomic = tcase_create("all-or-nothing");
    tcase_set_timeout(atomic, 120);
    tcase_add_test(atomic, invalid_requests_apply_nothing);
    tcase_add_loop_test(atomic, pushes_that_would_make_rows_non_finite_apply_nothing, 0, 4);
    tcase_add_loop_test(atomic, bounded_steps_stay_finite, 0, 4);
    tcase_add_test(atomic, sum_bounds_cover_float_sums);
    tcase_add_test(atomic, repeated_keys_sum_past_the_gradient_bound);
    tcase_add_test(atomic, capacity_exhaustion_fails_whole);
    tcase_add_test(atomic, pool_exhaustion_fails_whole_and_table_keeps_working);
    tcase_add_loop_test(atomic, pulls_that_run_out_of_pool_create_nothing, 0, 3);
    tcase_add_test(atomic, export_import_round_trip_across_layouts);
    tcase_add_test(atomic, imports_into_a_new_table);
    tcase_add_test(atomic, create_rejects_bad_config);
    suite_add_tcase(suite, atomic);

    TCase *concurrency = tcase_create("concurrency");
    tcase_set_timeout(concurrency, 240);
    tcase_add_test(concurrency, concurrent_pulls_never_see_torn_rows);
    tcase_add_test(concurrency, snapshots_are_one_instant_while_pushes_run);
    tcase_add_test(concurrency, concurrent_pushes_near_the_float_range_keep_rows_finite);
    tcase_add_test(concurrency, concurrent_disjoint_pushes_match_reference);
    tcase_add_test(concurrency, stats_count_rows_memory_and_requests);
    tcase_add_test(concurrency, devices_keep_scratch_blocks_between_requests);
    tcase_add_test(concurrency, calls_that_may_change_a_checkpoint_are_counted);
    suite_add_tcase(suite, concurrency);
    return em_test_run(suite);
}
