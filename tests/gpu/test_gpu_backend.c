/*
 * The CUDA backend against the CPU backend: the same workloads on tables of both, with
 * initial values bit for bit equal (zeros, uniform), pulls and final rows within 1e-5
 * relative, the hash map grown far past its first size, pool exhaustion failing whole,
 * import/export, checkpoints moving between the backends, concurrent requests, and
 * (with several GPUs) every layout identical to one GPU.
 *
 * Built twice from this file: against the real kernels (suite 'gpu'; exits 77, i.e.
 * skipped, only when no GPU is visible, and fails naming the cause when a GPU or a
 * driver is there but unusable) and against tests/support/kernels_emulated.c (suite
 * 'unit'), where the CUDA backend's C code runs with the kernels emulated on the host.
 *
 * CUDA must not be initialised in a process that forks afterwards, and every Check
 * test runs in a forked child: the parent asks whether a GPU is there from a child of
 * its own.
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/keyhash.h"
#include "kernels/ember_kernels.h"
#include "lib/base/failpoint.h"
#include "lib/checkpoint/checkpoint.h"
#include "lib/device/backend.h"
#include "lib/device/device.h"
#include "lib/memory/pool.h"
#include "lib/table/table.h"
#include "tests/support/reference_table.h"
#ifdef EM_CUDA_EMULATED
#include "tests/support/kernels_emulated.h"
#endif
#include "tests/support/test_batches.h"
#include "tests/support/test_support.h"

#define MEBIBYTE (UINT64_C(1) << 20)
#define GPU_POOL_BYTES (256 * MEBIBYTE)
#define SKIP 77

/* ---- fixtures ---------------------------------------------------------------------- */

static em_backend *cpu_backend(void)
{
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.pool_limit_bytes = 512 * MEBIBYTE;
    options.pool_initial_bytes = 16 * MEBIBYTE;
    options.pool_growth_bytes = 64 * MEBIBYTE;
    em_backend *backend = NULL;
    em_error err;
    ck_assert_msg(em_backend_create_cpu(&options, &backend, &err) == EM_OK, "%s", err.message);
    return backend;
}

/* Slots per segment of the hash maps of the backends gpu_backend makes (0: the
 * backend's default, 2^22): small, so that a test's maps are kept in many segments. */
static uint64_t map_segment_slots;

/* The gpu_choice_entries of the backends gpu_backend makes (0: the backend's default):
 * 1 has the GPU choose every eviction it may, UINT64_MAX the host. */
static uint64_t gpu_choice_entries;

/* devices 0: every visible GPU; else the first `devices` GPUs. */
static em_backend *gpu_backend(uint32_t devices, uint64_t pool_bytes, bool host_staged)
{
    em_cuda_backend_options options;
    em_cuda_backend_options_init(&options);
    options.device_count = devices;
    for (uint32_t d = 0; d < devices; d++)
        options.devices[d] = d;
    options.pool_bytes = pool_bytes;
    options.staging_bytes = 1 * MEBIBYTE; /* small, so big copies are chunked */
    options.host_staged_exchange = host_staged;
    if (map_segment_slots != 0)
        options.map_segment_slots = map_segment_slots;
    options.gpu_choice_entries = gpu_choice_entries;
    em_backend *backend = NULL;
    em_error err;
    ck_assert_msg(em_backend_create_cuda(&options, &backend, &err) == EM_OK, "%s", err.message);
    ck_assert_str_eq(backend->kind, "cuda");
    return backend;
}

static uint32_t visible_gpus(void)
{
    uint32_t count = 0;
    em_error err;
    ck_assert_msg(em_cuda_available(&count, &err) == EM_OK, "%s", err.message);
    return count;
}

static em_table_config table_config(uint32_t dim, uint64_t capacity, uint32_t shards,
                                    int optimizer, int initializer)
{
    em_table_config config;
    em_table_config_init(&config, "t", dim, capacity);
    config.shards = shards;
    config.optimizer = em_test_optimizers[optimizer];
    config.initializer.kind = initializer;
    config.initializer.bound = 0.5f;
    config.initializer.stddev = 0.25f;
    config.initializer.seed = 1234;
    return config;
}

/* ---- initial values ----------------------------------------------------------------- */

/* Loop index: initializer (zeros, uniform, normal) x dim (13: scalar gather; 16: vector
 * gather). Freshly created rows, pulled and exported, equal the CPU's bit for bit;
 * normal (log and cos may round differently on a GPU) within 1e-6 relative. */
/* Every row of the GPU table equals the CPU table's: bit for bit when tolerance is 0,
 * else within it (relative); snapshots read batch rows at a time. */
static void assert_tables_alike(em_table *cpu_table, em_table *gpu_table, uint64_t batch,
                                double tolerance)
{
    em_test_snapshot cpu_rows = em_test_snapshot_take(cpu_table, batch);
    em_test_snapshot gpu_rows = em_test_snapshot_take(gpu_table, batch);
    if (tolerance == 0)
        em_test_assert_snapshots_identical(&gpu_rows, &cpu_rows);
    else
        em_test_assert_snapshots_close(&gpu_rows, &cpu_rows, tolerance);
    em_test_snapshot_free(&cpu_rows);
    em_test_snapshot_free(&gpu_rows);
}

START_TEST(initial_values_match_cpu_bit_for_bit)
{
    int initializer = _i / 2;
    uint32_t dim = _i % 2 == 0 ? 13 : 16;
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(dim, 100000, 3, 3 /* adam */, initializer);
    em_table *cpu_table = em_test_make_table(cpu, &config);
    em_table *gpu_table = em_test_make_table(gpu, &config);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + (uint64_t)_i);
    em_error err;
    for (int round = 0; round < 6; round++) {
        em_test_batch b = em_test_random_batch(&rng, 40, 6, 500);
        uint64_t floats = b.csr.nnz * dim;
        float *expected = malloc((floats + 1) * sizeof(float));
        float *got = malloc((floats + 1) * sizeof(float));
        em_pull_result cpu_result, gpu_result;
        ck_assert_int_eq(em_test_pull(cpu_table, &b.csr, EM_COMBINER_NONE, true, expected, &cpu_result,
                              &err), EM_OK);
        ck_assert_msg(em_test_pull(gpu_table, &b.csr, EM_COMBINER_NONE, true, got, &gpu_result, &err) ==
                          EM_OK, "%s", err.message);
        ck_assert_uint_eq(gpu_result.unique_keys, cpu_result.unique_keys);
        ck_assert_uint_eq(gpu_result.missing, cpu_result.missing);
        ck_assert_uint_eq(gpu_result.created, cpu_result.created);
        for (uint64_t i = 0; i < floats; i++) {
            if (initializer == EM_INIT_NORMAL)
                ck_assert_msg(fabs((double)got[i] - (double)expected[i]) <=
                                  1e-6 * fabs((double)expected[i]) + 1e-30,
                              "value %llu: %.9g vs %.9g", (unsigned long long)i, (double)got[i],
                              (double)expected[i]);
            else
                ck_assert_msg(memcmp(&got[i], &expected[i], sizeof(float)) == 0,
                              "round %d value %llu (key %llu): gpu %a cpu %a", round,
                              (unsigned long long)i, (unsigned long long)b.keys[i / dim],
                              (double)got[i], (double)expected[i]);
        }
        free(expected);
        free(got);
        em_test_batch_free(&b);
    }
    assert_tables_alike(cpu_table, gpu_table, 7, initializer == EM_INIT_NORMAL ? 1e-3 : 0);
    em_table_destroy(cpu_table);
    em_table_destroy(gpu_table);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* ---- workloads ---------------------------------------------------------------------- */

typedef struct workload {
    uint32_t dim;
    uint32_t shards;
    int optimizer;
    em_combiner combiner;
    int rounds;
} workload;

/* Pulls (creating on two rounds of three), pushes; outputs and results compared. */
static void run_both(em_table *cpu_table, em_table *gpu_table, const workload *w)
{
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() * 17 + (uint64_t)w->optimizer * 4 + w->combiner);
    em_error err;
    for (int round = 0; round < w->rounds; round++) {
        em_test_batch b = em_test_random_batch(&rng, 48, 8, 400);
        uint64_t floats = em_csr_output_vectors(&b.csr, w->combiner) * w->dim;
        float *expected = malloc((floats + 1) * sizeof(float));
        float *got = malloc((floats + 1) * sizeof(float));
        bool create = round % 3 != 2;
        em_pull_result cpu_pulled, gpu_pulled;
        ck_assert_int_eq(em_test_pull(cpu_table, &b.csr, w->combiner, create, expected, &cpu_pulled, &err),
                         EM_OK);
        ck_assert_msg(em_test_pull(gpu_table, &b.csr, w->combiner, create, got, &gpu_pulled, &err) ==
                          EM_OK, "%s", err.message);
        ck_assert_uint_eq(gpu_pulled.missing, cpu_pulled.missing);
        ck_assert_uint_eq(gpu_pulled.created, cpu_pulled.created);
        ck_assert_uint_eq(gpu_pulled.unique_keys, cpu_pulled.unique_keys);
        /* Outputs are O(0.5): 1e-5 relative, 1e-6 absolute near zero. */
        for (uint64_t i = 0; i < floats; i++)
            ck_assert_msg(reference_close(got[i], expected[i], 0.1),
                          "round %d output %llu: gpu %.9g vs cpu %.9g", round,
                          (unsigned long long)i, (double)got[i], (double)expected[i]);
        float *g = em_test_random_floats(&rng, floats);
        em_push_result cpu_pushed, gpu_pushed;
        ck_assert_int_eq(em_test_push(cpu_table, &b.csr, w->combiner, g, &cpu_pushed, &err), EM_OK);
        ck_assert_msg(em_test_push(gpu_table, &b.csr, w->combiner, g, &gpu_pushed, &err) == EM_OK, "%s",
                      err.message);
        ck_assert_uint_eq(gpu_pushed.updated, cpu_pushed.updated);
        ck_assert_uint_eq(gpu_pushed.created, cpu_pushed.created);
        free(g);
        free(expected);
        free(got);
        em_test_batch_free(&b);
    }
}

/* Loop index: optimizer * 4 + combiner; dim 13 or 16 alternately; every other pair with
 * the GPU's hash maps in segments of 1,024 slots. Every pull and every final row
 * (weights and optimizer state) of the GPU table is within 1e-5 relative of the CPU
 * table's. */
START_TEST(workloads_match_cpu)
{
    map_segment_slots = _i / 2 % 2 == 1 ? 1024 : 0;
    workload w = {
        .dim = _i % 2 == 0 ? 13 : 16,
        .shards = 3,
        .optimizer = _i / 4,
        .combiner = (em_combiner)(_i % 4),
        .rounds = 12,
    };
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(w.dim, 100000, w.shards, w.optimizer, EM_INIT_UNIFORM);
    em_table *cpu_table = em_test_make_table(cpu, &config);
    em_table *gpu_table = em_test_make_table(gpu, &config);
    run_both(cpu_table, gpu_table, &w);
    assert_tables_alike(cpu_table, gpu_table, 7, 1e-2);
    em_table_destroy(cpu_table);
    em_table_destroy(gpu_table);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* Loop index: optimizer x dim (3, 33, 100). Every optimizer's step is the CPU's bit for
 * bit: pushes of gradients divided by their rows' lengths (mean, so not sums of a few
 * binary digits), of keys repeated across rows; rowwise adagrad sums each row's g*g in
 * the lanes' order on both (common/optimizer.h em_rowwise_squares), which a sum in
 * element order does not match for some rows. */
START_TEST(optimizer_steps_match_cpu_bit_for_bit)
{
    static const uint32_t dims[] = {3, 33, 100};
    const uint32_t dim = dims[_i % 3];
    const int optimizer = _i / 3;
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(dim, 10000, 2, optimizer, EM_INIT_UNIFORM);
    em_table *tables[2] = {em_test_make_table(cpu, &config), em_test_make_table(gpu, &config)};
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 300 + (uint64_t)_i);
    em_error err;
    for (int round = 0; round < 6; round++) {
        em_test_batch b = em_test_random_batch(&rng, 40, 6, 200);
        float *g = em_test_random_floats(&rng, (uint64_t)b.csr.rows * dim);
        for (int t = 0; t < 2; t++)
            ck_assert_msg(em_test_push(tables[t], &b.csr, EM_COMBINER_MEAN, g, NULL, &err) ==
                              EM_OK,
                          "%s", err.message);
        free(g);
        em_test_batch_free(&b);
    }
    assert_tables_alike(tables[0], tables[1], 64, 0);
    for (int t = 0; t < 2; t++)
        em_table_destroy(tables[t]);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* Tables of several shards take turns on one GPU, so requests at once on the same lane
 * meet views of other tables' shards (the lane keeps the last few it copied) and views
 * of their own table from before it grew: each table's pulls, pushes and final rows
 * match its CPU twin's, through growths of its maps and storage between turns. */
START_TEST(tables_taking_turns_on_a_lane_match_cpu)
{
    enum { TABLES = 4, TURNS = 4 };
    const uint32_t shards[TABLES] = {4, 5, 4, 8};
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table *cpu_tables[TABLES], *gpu_tables[TABLES];
    workload w[TABLES];
    for (int t = 0; t < TABLES; t++) {
        w[t] = (workload){.dim = 16, .shards = shards[t], .optimizer = t % 4,
                          .combiner = (em_combiner)(t % 4), .rounds = 2};
        em_table_config config = table_config(16, 200000, shards[t], t % 4, EM_INIT_UNIFORM);
        cpu_tables[t] = em_test_make_table(cpu, &config);
        gpu_tables[t] = em_test_make_table(gpu, &config);
    }
    uint64_t *keys = malloc(2048 * sizeof(uint64_t));
    float *out = malloc(2048 * 16 * sizeof(float));
    em_error err;
    for (int turn = 0; turn < TURNS; turn++) {
        for (int t = 0; t < TABLES; t++) {
            run_both(cpu_tables[t], gpu_tables[t], &w[t]);
            if ((turn + t) % 3 != 0)
                continue;
            /* new keys: the table's maps and storage grow before its next turn */
            for (uint32_t i = 0; i < 2048; i++)
                keys[i] = ((uint64_t)turn << 40) + (uint64_t)t * 1000003u + i * 7919u + 1;
            em_test_batch b = em_test_key_batch(keys, 2048);
            ck_assert_int_eq(em_test_pull(cpu_tables[t], &b.csr, EM_COMBINER_NONE, true, out,
                                          NULL, &err), EM_OK);
            ck_assert_msg(em_test_pull(gpu_tables[t], &b.csr, EM_COMBINER_NONE, true, out, NULL,
                                       &err) == EM_OK, "%s", err.message);
            em_test_batch_free(&b);
        }
    }
    for (int t = 0; t < TABLES; t++) {
        assert_tables_alike(cpu_tables[t], gpu_tables[t], 7, 1e-2);
        em_table_destroy(cpu_tables[t]);
        em_table_destroy(gpu_tables[t]);
    }
    free(keys);
    free(out);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* Keys that repeat within a push are summed first, in key order: a push whose keys are
 * all the same key gives exactly the CPU's row (sgd; sums of the same floats in the
 * same order). */
START_TEST(duplicate_keys_sum_like_cpu)
{
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(5, 1000, 2, 0, EM_INIT_UNIFORM);
    em_table *cpu_table = em_test_make_table(cpu, &config);
    em_table *gpu_table = em_test_make_table(gpu, &config);
    const uint32_t offsets[] = {0, 4, 4, 9};
    const uint64_t keys[] = {7, 7, 3, 7, 3, 3, 7, UINT64_MAX, 7};
    em_csr csr = {.rows = 3, .nnz = 9, .offsets = offsets, .keys = keys};
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_error err;
    for (int combiner = 0; combiner < 4; combiner++) {
        float *g = em_test_random_floats(&rng, 9 * 5);
        ck_assert_int_eq(em_test_push(cpu_table, &csr, (em_combiner)combiner, g, NULL, &err), EM_OK);
        ck_assert_msg(em_test_push(gpu_table, &csr, (em_combiner)combiner, g, NULL, &err) == EM_OK, "%s",
                      err.message);
        free(g);
    }
    em_test_snapshot cpu_rows = em_test_snapshot_take(cpu_table, 2);
    em_test_snapshot gpu_rows = em_test_snapshot_take(gpu_table, 2);
    ck_assert_uint_eq(cpu_rows.count, 3);
    em_test_assert_snapshots_identical(&gpu_rows, &cpu_rows);
    em_test_snapshot_free(&cpu_rows);
    em_test_snapshot_free(&gpu_rows);
    em_table_destroy(cpu_table);
    em_table_destroy(gpu_table);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

START_TEST(empty_rows_and_batches)
{
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(3, 1000, 2, 0, EM_INIT_UNIFORM);
    em_table *table = em_test_make_table(gpu, &config);
    em_error err;
    const uint32_t offsets[] = {0, 0, 2, 2};
    const uint64_t keys[] = {1, 2};
    em_csr csr = {.rows = 3, .nnz = 2, .offsets = offsets, .keys = keys};
    float out[9];
    memset(out, 0x7f, sizeof(out));
    ck_assert_msg(em_test_pull(table, &csr, EM_COMBINER_MEAN, true, out, NULL, &err) == EM_OK, "%s",
                  err.message);
    for (uint32_t j = 0; j < 3; j++) {
        ck_assert(out[j] == 0.0f && out[6 + j] == 0.0f);
        float a = em_initializer_value(&config.initializer, 1, j);
        float b = em_initializer_value(&config.initializer, 2, j);
        ck_assert_float_eq(out[3 + j], (a + b) / 2.0f);
    }
    const uint32_t none[] = {0};
    em_csr empty = {.rows = 0, .nnz = 0, .offsets = none, .keys = NULL};
    em_pull_result result;
    ck_assert_int_eq(em_test_pull(table, &empty, EM_COMBINER_SUM, true, out, &result, &err), EM_OK);
    ck_assert_uint_eq(result.unique_keys, 0);
    ck_assert_int_eq(em_test_push(table, &empty, EM_COMBINER_NONE, NULL, NULL, &err), EM_OK);
    const uint32_t all_empty[] = {0, 0, 0};
    em_csr no_keys = {.rows = 2, .nnz = 0, .offsets = all_empty, .keys = NULL};
    float zeros[6];
    memset(zeros, 0x7f, sizeof(zeros));
    ck_assert_int_eq(em_test_pull(table, &no_keys, EM_COMBINER_SQRTN, false, zeros, NULL, &err), EM_OK);
    for (int j = 0; j < 6; j++)
        ck_assert(zeros[j] == 0.0f);
    em_table_destroy(table);
    em_backend_destroy(gpu);
}
END_TEST

/* ---- hash map growth ------------------------------------------------------------------ */

/* Many keys through one shard: the map grows (rehash) again and again; after every
 * batch the load stays at or below 0.9, and it gets close to 0.9 before growing. Every
 * key keeps its row (value) across the rehashes. */
/* Every one of keys[0..total) is found (pulls of per_pull, nothing created) with its
 * initial vector, bit for bit. */
static void assert_initial_vectors(em_table *table, const em_table_config *config,
                                   const uint64_t *keys, uint64_t total, uint32_t per_pull)
{
    uint32_t dim = config->dim;
    float *out = malloc((size_t)per_pull * dim * sizeof(float));
    for (uint64_t start = 0; start < total; start += per_pull) {
        uint32_t n = total - start < per_pull ? (uint32_t)(total - start) : per_pull;
        em_test_batch b = em_test_key_batch(keys + start, n);
        em_pull_result result;
        em_error err;
        ck_assert_int_eq(em_test_pull(table, &b.csr, EM_COMBINER_NONE, false, out, &result, &err),
                         EM_OK);
        ck_assert_uint_eq(result.missing, 0);
        for (uint32_t i = 0; i < n; i++)
            for (uint32_t j = 0; j < dim; j++) {
                float expected = em_initializer_value(&config->initializer, keys[start + i], j);
                ck_assert_msg(memcmp(&out[i * dim + j], &expected, sizeof(float)) == 0,
                              "key %llu element %u", (unsigned long long)keys[start + i], j);
            }
        em_test_batch_free(&b);
    }
    free(out);
}

START_TEST(hash_map_grows_at_load_0_9)
{
    const uint32_t dim = 4, per_batch = 2000;
    const uint64_t total = 300000;
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(dim, 1000000, 1, 0, EM_INIT_UNIFORM);
    em_table *table = em_test_make_table(gpu, &config);
    uint64_t *keys = malloc(total * sizeof(uint64_t));
    for (uint64_t i = 0; i < total; i++)
        keys[i] = i < 3 ? UINT64_MAX - i : i * 0x9e3779b97f4a7c15ull;
    float *out = malloc((size_t)per_batch * dim * sizeof(float));
    double highest_load = 0.0;
    uint64_t last_index_bytes = 0;
    int growths = 0;
    em_error err;
    for (uint64_t start = 0; start < total; start += per_batch) {
        em_test_batch b = em_test_key_batch(keys + start, per_batch);
        em_pull_result result;
        ck_assert_msg(em_test_pull(table, &b.csr, EM_COMBINER_NONE, true, out, &result, &err) == EM_OK,
                      "%s", err.message);
        ck_assert_uint_eq(result.created, per_batch);
        em_test_batch_free(&b);
        em_table_stats stats;
        em_table_get_stats(table, &stats);
        ck_assert_uint_eq(stats.rows, start + per_batch);
        double slots = (double)stats.index_bytes / 16.0;
        double load = (double)stats.rows / slots;
        ck_assert_msg(load <= 0.9 + 3.0 / slots, "load %.4f after %llu keys", load,
                      (unsigned long long)stats.rows);
        highest_load = load > highest_load ? load : highest_load;
        growths += last_index_bytes != 0 && stats.index_bytes != last_index_bytes;
        last_index_bytes = stats.index_bytes;
    }
    ck_assert_msg(highest_load > 0.85, "highest load %.4f", highest_load);
    ck_assert_int_ge(growths, 2);
    /* Every key is found with its initial vector; none is created again. */
    assert_initial_vectors(table, &config, keys, total, per_batch);
    em_test_snapshot rows = em_test_snapshot_take(table, 65536);
    ck_assert_uint_eq(rows.count, total);
    em_test_snapshot_free(&rows);
    free(out);
    free(keys);
    em_table_destroy(table);
    em_backend_destroy(gpu);
}
END_TEST

/* Allocates from the GPU's pool until exactly `leave` bytes of it are free (within a
 * granule); returns the allocations, a NULL-terminated list for balloon_free. */
static void **balloon_leaving(em_device *device, uint64_t leave)
{
    void **held = calloc(1024, sizeof(void *));
    int count = 0;
    for (;;) {
        em_pool_stats stats;
        em_pool_get_stats(device->pool, &stats);
        if (stats.bytes_free <= leave + EM_POOL_ALIGNMENT)
            break;
        uint64_t take = stats.bytes_free - leave;
        if (take > stats.largest_free_block)
            take = stats.largest_free_block;
        ck_assert_int_lt(count, 1023);
        em_error err;
        ck_assert_msg(em_device_alloc(device, take, "balloon", &held[count++], &err) == EM_OK, "%s",
                      err.message);
    }
    return held;
}

static void balloon_free(em_device *device, void **held)
{
    for (int i = 0; held[i] != NULL; i++)
        em_device_free(device, held[i]);
    free(held);
}

/* Pulls that create keys[from..to), per_pull at a time. */
static void create_keys(em_table *table, const uint64_t *keys, uint64_t from, uint64_t to,
                        uint32_t per_pull, uint32_t dim)
{
    float *out = malloc((size_t)per_pull * dim * sizeof(float));
    for (uint64_t start = from; start < to; start += per_pull) {
        uint32_t n = to - start < per_pull ? (uint32_t)(to - start) : per_pull;
        em_test_batch b = em_test_key_batch(keys + start, n);
        em_error err;
        ck_assert_msg(em_test_pull(table, &b.csr, EM_COMBINER_NONE, true, out, NULL, &err) == EM_OK,
                      "%s", err.message);
        em_test_batch_free(&b);
    }
    free(out);
}

/* A hash map in segments grows by the slots it adds. The map of 2^18 slots (4 MiB) must
 * double; the pool is filled until 3 MiB are free: neither the new map of 8 MiB beside
 * the old nor the 4 MiB it adds fit, and the pull fails whole, the table unchanged. With
 * 7 MiB free, less than the 8 MiB of the new map, the pull succeeds through host memory
 * (index_rehashes_through_host), and every key keeps its row. */
START_TEST(segmented_map_grows_by_the_slots_it_adds)
{
    const uint32_t dim = 4, per_pull = 2000;
    const uint64_t slots = (uint64_t)1 << 18, before_growth = slots / 10 * 9 - per_pull / 2;
    map_segment_slots = 1024;
    em_backend *gpu = gpu_backend(1, 48 * MEBIBYTE, false);
    em_device *device = gpu->devices[0];
    em_table_config config = table_config(dim, 10000000, 1, 0, EM_INIT_UNIFORM);
    em_table *table = em_test_make_table(gpu, &config);
    uint64_t total = before_growth + per_pull;
    uint64_t *keys = malloc(total * sizeof(uint64_t));
    for (uint64_t i = 0; i < total; i++)
        keys[i] = i * 0x9e3779b97f4a7c15ull + 11;
    create_keys(table, keys, 0, before_growth, per_pull, dim);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, before_growth);
    ck_assert_uint_eq(stats.index_bytes, slots * sizeof(em_gpu_slot));
    ck_assert_uint_eq(stats.index_rehashes_through_host, 0);

    em_test_snapshot before = em_test_snapshot_take(table, 65536);
    void **balloon = balloon_leaving(device, 3 * MEBIBYTE);
    em_test_batch b = em_test_key_batch(keys + before_growth, per_pull);
    float *out = malloc((size_t)per_pull * dim * sizeof(float));
    em_error err;
    ck_assert_int_eq(em_test_pull(table, &b.csr, EM_COMBINER_NONE, true, out, NULL, &err),
                     EM_RESOURCE_EXHAUSTED);
    ck_assert_msg(strstr(err.message, "nor through host memory") != NULL, "%s", err.message);
    em_test_assert_table_unchanged(table, &before);
    em_test_snapshot_free(&before);
    balloon_free(device, balloon);

    balloon = balloon_leaving(device, 7 * MEBIBYTE);
    ck_assert_msg(em_test_pull(table, &b.csr, EM_COMBINER_NONE, true, out, NULL, &err) == EM_OK,
                  "%s", err.message);
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, total);
    ck_assert_uint_eq(stats.index_bytes, 2 * slots * sizeof(em_gpu_slot));
    ck_assert_uint_eq(stats.index_rehashes_through_host, 1);
    balloon_free(device, balloon);
    assert_initial_vectors(table, &config, keys, total, per_pull);
    em_test_batch_free(&b);
    free(out);
    free(keys);
    em_table_destroy(table);
    em_backend_destroy(gpu);
    map_segment_slots = 0;
}
END_TEST

/* ---- pool exhaustion -------------------------------------------------------------------- */

START_TEST(pool_exhaustion_fails_whole_and_table_keeps_working)
{
    em_backend *gpu = gpu_backend(1, 24 * MEBIBYTE, false);
    em_table_config config = table_config(256, 1000000, 1, 3, EM_INIT_UNIFORM);
    em_table *table = em_test_make_table(gpu, &config);
    em_error err;
    uint64_t keys[500];
    float *g = malloc(500 * 256 * sizeof(float));
    for (int i = 0; i < 500 * 256; i++)
        g[i] = 0.1f;
    em_status status = EM_OK;
    uint64_t next_key = 1;
    em_test_snapshot before = {0};
    for (int round = 0; round < 200 && status == EM_OK; round++) {
        em_test_snapshot_free(&before);
        before = em_test_snapshot_take(table, 1000);
        for (int i = 0; i < 500; i++)
            keys[i] = next_key++;
        em_test_batch b = em_test_key_batch(keys, 500);
        status = em_test_push(table, &b.csr, EM_COMBINER_NONE, g, NULL, &err);
        em_test_batch_free(&b);
    }
    ck_assert_int_eq(status, EM_RESOURCE_EXHAUSTED);
    ck_assert_msg(strstr(err.message, "pool 'cuda:0'") != NULL, "%s", err.message);
    ck_assert_msg(strstr(err.message, "largest free block") != NULL ||
                      strstr(err.message, "in use") != NULL, "%s", err.message);
    em_test_assert_table_unchanged(table, &before);
    /* Existing keys still update, and the update shows. */
    em_test_batch old = em_test_key_batch(before.keys, 10);
    ck_assert_msg(em_test_push(table, &old.csr, EM_COMBINER_NONE, g, NULL, &err) == EM_OK, "%s",
                  err.message);
    em_test_snapshot after = em_test_snapshot_take(table, 1000);
    ck_assert_uint_eq(after.count, before.count);
    ck_assert(memcmp(after.values, before.values, after.width * sizeof(float)) != 0);
    em_test_snapshot_free(&after);
    em_test_batch_free(&old);
    em_test_snapshot_free(&before);
    free(g);
    em_table_destroy(table);
    em_backend_destroy(gpu);
}
END_TEST

/* Loop index: per-key or pooled (sum) output. Pulls that create keys until the pool runs
 * out: the pull that fails has created nothing (its output and vector buffers are taken
 * before any key is created). */
START_TEST(pulls_that_run_out_of_pool_create_nothing)
{
    enum { DIM = 1024, PER_PULL = 400 }; /* 1.6 MiB of vectors and of output a pull */
    em_backend *gpu = gpu_backend(1, 24 * MEBIBYTE, false);
    em_table_config config = table_config(DIM, 1000000, 1, 0, EM_INIT_UNIFORM);
    em_table *table = em_test_make_table(gpu, &config);
    uint64_t keys[PER_PULL];
    float *out = malloc((size_t)PER_PULL * DIM * sizeof(float));
    em_error err;
    em_status status = EM_OK;
    uint64_t next_key = 1, pulls = 0;
    em_test_snapshot before = {0};
    for (int round = 0; round < 200 && status == EM_OK; round++) {
        em_test_snapshot_free(&before);
        before = em_test_snapshot_take(table, 1000);
        for (int i = 0; i < PER_PULL; i++)
            keys[i] = next_key++;
        em_test_batch b = em_test_key_batch(keys, PER_PULL);
        status = em_test_pull(table, &b.csr, _i == 0 ? EM_COMBINER_NONE : EM_COMBINER_SUM, true,
                              out, NULL, &err);
        em_test_batch_free(&b);
        pulls += status == EM_OK;
    }
    ck_assert_int_eq(status, EM_RESOURCE_EXHAUSTED);
    ck_assert_msg(strstr(err.message, "pool 'cuda:0'") != NULL, "%s", err.message);
    ck_assert_uint_gt(pulls, 3);
    em_test_assert_table_unchanged(table, &before);
    em_test_snapshot_free(&before);
    free(out);
    em_table_destroy(table);
    em_backend_destroy(gpu);
}
END_TEST

/* ---- import / export ------------------------------------------------------------------- */

START_TEST(import_export_round_trip_bit_for_bit)
{
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(6, 10000, 2, 1, EM_INIT_UNIFORM);
    em_table *source = em_test_make_table(cpu, &config);
    config.shards = 5;
    em_table *copy = em_test_make_table(gpu, &config);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 9);
    em_error err;
    em_test_batch b = em_test_random_batch(&rng, 30, 5, 80);
    float *g = em_test_random_floats(&rng, b.csr.nnz * 6);
    ck_assert_int_eq(em_test_push(source, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    free(g);
    em_test_batch_free(&b);
    em_test_snapshot rows = em_test_snapshot_take(source, 1000);
    rows.values[1] = -0.0f;       /* a signed zero and a subnormal travel unchanged */
    rows.values[2] = 0x1p-140f;
    for (uint64_t start = 0; start < rows.count; start += 9) {
        uint64_t n = rows.count - start < 9 ? rows.count - start : 9;
        ck_assert_msg(em_table_import(copy, rows.keys + start, rows.values + start * rows.width,
                                      n, &err) == EM_OK, "%s", err.message);
    }
    em_test_snapshot copied = em_test_snapshot_take(copy, 5);
    em_test_assert_snapshots_identical(&copied, &rows);
    /* Importing over existing rows overwrites them. */
    ck_assert_int_eq(em_table_import(copy, rows.keys, rows.values, rows.count, &err), EM_OK);
    em_test_assert_table_unchanged(copy, &rows);
    /* A repeated key is refused and nothing changes. */
    uint64_t twice[3] = {rows.keys[0], 4242, rows.keys[0]};
    float *values = calloc(3 * rows.width, sizeof(float));
    ck_assert_int_eq(em_table_import(copy, twice, values, 3, &err), EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "appears twice (rows 0 and 2)") != NULL, "%s", err.message);
    em_test_assert_table_unchanged(copy, &rows);
    free(values);
    em_test_snapshot_free(&rows);
    em_test_snapshot_free(&copied);
    em_table_destroy(source);
    em_table_destroy(copy);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* ---- checkpoints ------------------------------------------------------------------------ */

/* A checkpoint written from a GPU table (full, then a delta) loads on the CPU backend bit
 * for bit, one written from the CPU table loads back onto the GPU, and a GPU server of
 * a cluster of 2 loads only its buckets with another shard count. */
START_TEST(checkpoints_move_between_gpu_and_cpu_bit_for_bit)
{
    char dir[256], cpu_dir[300];
    em_test_make_dir("ember-gpu-checkpoint", dir, sizeof(dir));
    snprintf(cpu_dir, sizeof(cpu_dir), "%s/from-cpu", dir);
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(16, 100000, 3, 3 /* adam */, EM_INIT_UNIFORM);
    em_table *trained = em_test_make_table(gpu, &config);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 21);
    em_error err;
    for (int round = 0; round < 4; round++) {
        em_test_batch b = em_test_random_batch(&rng, 200, 4, 3000);
        float *g = em_test_random_floats(&rng, b.csr.nnz * 16);
        ck_assert_int_eq(em_test_push(trained, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
        free(g);
        em_test_batch_free(&b);
        if (round == 1) { /* the full checkpoint; the delta after two more rounds */
            em_checkpoint_options options;
            em_checkpoint_options_init(&options, dir);
            options.track_changes = true;
            em_checkpoint_info full;
            ck_assert_msg(em_checkpoint_save(trained, &options, &full, &err) == EM_OK, "%s",
                          err.message);
        }
    }
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.delta = true;
    options.buffer_bytes = 1; /* several runs: the snapshot is read in pieces */
    em_checkpoint_info delta;
    ck_assert_msg(em_checkpoint_save(trained, &options, &delta, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_str_eq(delta.kind, "delta");
    em_test_snapshot on_gpu = em_test_snapshot_take(trained, 1000);

    em_table *on_cpu = NULL;
    ck_assert_msg(em_checkpoint_load(delta.path, cpu, NULL, NULL, &on_cpu, NULL, &err) == EM_OK,
                  "%s", err.message);
    em_test_assert_table_unchanged(on_cpu, &on_gpu);
    em_checkpoint_options cpu_options;
    em_checkpoint_options_init(&cpu_options, cpu_dir);
    em_checkpoint_info from_cpu;
    ck_assert_int_eq(em_checkpoint_save(on_cpu, &cpu_options, &from_cpu, &err), EM_OK);
    em_table *back = NULL;
    ck_assert_msg(em_checkpoint_load(from_cpu.path, gpu, NULL, NULL, &back, NULL, &err) == EM_OK,
                  "%s", err.message);
    em_test_assert_table_unchanged(back, &on_gpu);

    /* server 1 of 2, 4 shards, on the GPU */
    em_checkpoint_load_options owner = {.owner_index = 1, .owner_count = 2, .shards = 4};
    const char *one[1] = {from_cpu.path};
    em_table *part = NULL;
    ck_assert_msg(em_checkpoint_load_sources(one, 1, gpu, NULL, &owner, &part, NULL, &err) ==
                      EM_OK, "%s", err.message);
    ck_assert_uint_eq(em_table_get_config(part)->shards, 4);
    em_test_snapshot own = em_test_snapshot_take(part, 1000);
    uint64_t expected = 0;
    for (uint64_t r = 0, o = 0; r < on_gpu.count; r++) {
        if (em_key_server(on_gpu.keys[r], 2) != 1)
            continue;
        expected++;
        ck_assert_uint_lt(o, own.count);
        ck_assert_uint_eq(own.keys[o], on_gpu.keys[r]);
        ck_assert_mem_eq(own.values + o * own.width, on_gpu.values + r * on_gpu.width,
                         own.width * sizeof(float));
        o++;
    }
    ck_assert_uint_eq(own.count, expected);
    em_test_snapshot_free(&own);
    em_table_destroy(part);
    em_table_destroy(back);
    em_table_destroy(on_cpu);
    em_test_snapshot_free(&on_gpu);
    em_table_destroy(trained);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
    em_test_remove_tree(dir);
}
END_TEST

/* Every row's access metadata, in key order (the snapshot gives rows in map order). */
static uint64_t access_by_key(em_table *table, uint64_t *keys, em_row_access *access,
                              uint64_t max)
{
    em_table_snapshot *snapshot = NULL;
    em_error err;
    ck_assert_msg(em_table_snapshot_begin(table, 1 << 20, &snapshot, &err) == EM_OK, "%s",
                  err.message);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    float *values = malloc(64 * stats.row_floats * sizeof(float));
    uint64_t got = 0, count = 1;
    while (count > 0) {
        ck_assert_uint_le(got + 64, max);
        ck_assert_msg(em_table_snapshot_read(snapshot, 64, keys + got, values, access + got,
                                             &count, &err) == EM_OK,
                      "%s", err.message);
        got += count;
    }
    em_table_snapshot_end(snapshot);
    free(values);
    for (uint64_t i = 1; i < got; i++) /* insertion sort: a few hundred rows */
        for (uint64_t j = i; j > 0 && keys[j] < keys[j - 1]; j--) {
            uint64_t k = keys[j];
            keys[j] = keys[j - 1];
            keys[j - 1] = k;
            em_row_access a = access[j];
            access[j] = access[j - 1];
            access[j - 1] = a;
        }
    return got;
}

/* One-key pulls and pushes (one in three) drawn from rng over keys below 1600. */
static void run_single_keys(em_table *table, em_test_rng *rng, int steps)
{
    float values[8], gradient[8];
    em_error err;
    for (int step = 0; step < steps; step++) {
        uint64_t key = em_test_rng_below(rng, 1600);
        bool push = em_test_rng_below(rng, 3) == 0;
        for (uint32_t j = 0; j < 8; j++)
            gradient[j] = 0.01f * (float)(step % 11) - 0.04f;
        em_test_batch b = em_test_key_batch(&key, 1);
        em_status status =
            push ? em_test_push(table, &b.csr, EM_COMBINER_NONE, gradient, NULL, &err)
                 : em_test_pull(table, &b.csr, EM_COMBINER_NONE, true, values, NULL, &err);
        ck_assert_msg(status == EM_OK, "step %d: %s", step, err.message);
        em_test_batch_free(&b);
    }
}

/* The two tables (a few hundred rows each) hold the same keys with the same access
 * metadata. */
static void assert_access_equal(em_table *expected, em_table *got)
{
    enum { MAX = 2000 };
    uint64_t *keys = malloc(2 * MAX * sizeof(uint64_t));
    em_row_access *access = malloc(2 * MAX * sizeof(em_row_access));
    uint64_t count = access_by_key(expected, keys, access, MAX);
    ck_assert_uint_eq(access_by_key(got, keys + MAX, access + MAX, MAX), count);
    for (uint64_t i = 0; i < count; i++) {
        ck_assert_uint_eq(keys[MAX + i], keys[i]);
        ck_assert_mem_eq(&access[MAX + i], &access[i], sizeof(em_row_access));
    }
    free(keys);
    free(access);
}

/* The host's waits for the GPU so far, as the emulation counts them (0 on a GPU). */
#ifdef EM_CUDA_EMULATED
static const bool emulated = true;
static uint64_t emulated_waits(void)
{
    uint64_t operations = 0, waits = 0;
    em_gpu_emulated_counts(&operations, &waits);
    return waits;
}

/* The emulation's waits for several GPUs at once so far (0 on GPUs). */
static uint64_t emulated_joint_waits(void)
{
    return em_gpu_emulated_joint_waits();
}
#else
static const bool emulated = false;
static uint64_t emulated_waits(void)
{
    return 0;
}

static uint64_t emulated_joint_waits(void)
{
    return 0;
}
#endif

/* Loop index: combiner (none, sum, mean, sqrtn) x dim (12, 64) x tracking access (lru or
 * none) on one shard, then combiner x tracking access, dim 12, on 5 shards. A table
 * pulls keys that are all stored in one pass
 * and one wait, one kernel of each kind over all of its shards (device.h:
 * shards_pull_async): outputs equal the CPU's bit for bit, batches with repeated keys,
 * pooled or not; a pull with absent keys goes on the general way and creates them, and
 * the next one, the table's pulls now creating keys (pulls_create), creates them at
 * once; the rows and their access metadata end equal. On the emulation the pulls of
 * stored keys and those that create at once are seen to wait once. */
START_TEST(pulls_at_once_match_cpu)
{
    const uint32_t shards = _i >= 16 ? 5 : 1;
    const em_combiner combiner = (em_combiner)(_i % 4);
    const uint32_t dim = shards == 1 && (_i / 4) % 2 == 1 ? 64 : 12;
    const bool lru = shards == 1 ? (_i / 8) % 2 == 1 : (_i / 4) % 2 == 1;
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, 64 * MEBIBYTE, false);
    em_table_config config = table_config(dim, 100000, shards, 1, EM_INIT_UNIFORM);
    if (lru)
        config.eviction.policy = EM_EVICTION_LRU;
    em_table *tables[2] = {em_test_make_table(cpu, &config), em_test_make_table(gpu, &config)};
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 40 + (uint64_t)_i);
    enum { UNIVERSE = 300 };
    uint64_t all[UNIVERSE];
    for (uint64_t k = 0; k < UNIVERSE; k++) /* the map's marker keys among them */
        all[k] = k < 3 ? UINT64_MAX - k : 5 * k + 2;
    em_test_batch every = em_test_key_batch(all, UNIVERSE);
    float *out[2];
    for (int t = 0; t < 2; t++)
        out[t] = malloc(UNIVERSE * 8 * dim * sizeof(float));
    em_error err;
    for (int t = 0; t < 2; t++) /* create, then a pull that finds every key */
        for (int pass = 0; pass < 2; pass++)
            ck_assert_msg(em_test_pull(tables[t], &every.csr, EM_COMBINER_NONE, true, out[t],
                                       NULL, &err) == EM_OK, "%s", err.message);
    bool last_created = false; /* the pull before created keys: the table's pulls create */
    for (int step = 0; step < 40; step++) {
        em_test_batch b = em_test_random_batch(&rng, 1 + (uint32_t)em_test_rng_below(&rng, 60), 6,
                                               UNIVERSE);
        /* some keys the table lacks, twice in a row: the first pull finds them absent
         * and goes on the general way, the second creates them at once (where the first,
         * a batch of no keys, found none absent, the second is the first) */
        bool fresh = step % 10 >= 8, created_at_once = step % 10 == 9 && last_created;
        for (uint64_t k = 0; k < b.csr.nnz; k++) /* the table's keys, repeated */
            b.keys[k] = fresh && k % 3 == 0 ? 100000 + 1000 * (uint64_t)step + k
                                            : all[em_test_rng_below(&rng, UNIVERSE)];
        uint64_t outputs = combiner == EM_COMBINER_NONE ? b.csr.nnz : b.csr.rows;
        em_pull_result results[2];
        uint64_t waits[2] = {0, 0};
        for (int t = 0; t < 2; t++) {
            waits[t] = emulated_waits();
            ck_assert_msg(em_test_pull(tables[t], &b.csr, combiner, true, out[t], &results[t],
                                       &err) == EM_OK, "step %d: %s", step, err.message);
            waits[t] = emulated_waits() - waits[t];
        }
        ck_assert_mem_eq(out[1], out[0], outputs * dim * sizeof(float));
        ck_assert_uint_eq(results[1].unique_keys, results[0].unique_keys);
        ck_assert_uint_eq(results[1].missing, results[0].missing);
        ck_assert_uint_eq(results[1].created, results[0].created);
        if (fresh && b.csr.nnz > 0)
            ck_assert_msg(results[0].created > 0, "step %d", step);
        if (emulated && (!fresh || created_at_once))
            ck_assert_msg(waits[1] == 1, "step %d: %" PRIu64 " waits", step, waits[1]);
        if (emulated && fresh && !created_at_once && b.csr.nnz > 0)
            ck_assert_msg(waits[1] > 1, "step %d: %" PRIu64 " wait", step, waits[1]);
        last_created = results[0].created > 0;
        em_test_batch_free(&b);
    }
    em_test_snapshot a = em_test_snapshot_take(tables[0], 64);
    em_test_snapshot g = em_test_snapshot_take(tables[1], 64);
    em_test_assert_snapshots_identical(&a, &g);
    em_test_snapshot_free(&a);
    em_test_snapshot_free(&g);
    if (lru)
        assert_access_equal(tables[0], tables[1]);
    em_test_batch_free(&every);
    for (int t = 0; t < 2; t++) {
        free(out[t]);
        em_table_destroy(tables[t]);
    }
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* Loop index: 1 or 5 shards. Pulls of 400,000 keys, more than the groups of a find fit
 * in a GPU of today at once (an H200 holds 132 x 2,048 threads: 33,792 keys' groups),
 * so their finds search a thread a key (em_gpu_find_form): the keys found and missed,
 * the rows created and every value are the CPU's; pulls of the same keys once they are
 * all stored go at once. */
START_TEST(large_pulls_match_cpu)
{
    enum { KEYS = 400000, DIM = 4 };
    const uint32_t shards = _i == 0 ? 1 : 5;
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(DIM, 2 * KEYS, shards, 1, EM_INIT_UNIFORM);
    em_table *tables[2] = {em_test_make_table(cpu, &config), em_test_make_table(gpu, &config)};
    uint64_t *keys = malloc(KEYS * sizeof(uint64_t));
    float *out[2] = {malloc((size_t)KEYS * DIM * sizeof(float)),
                     malloc((size_t)KEYS * DIM * sizeof(float))};
    ck_assert(keys != NULL && out[0] != NULL && out[1] != NULL);
    for (uint64_t k = 0; k < KEYS; k++) /* the map's marker keys among them */
        keys[k] = k < 3 ? UINT64_MAX - k : k * 0x9e3779b97f4a7c15ull + 7;
    em_test_batch every = em_test_key_batch(keys, KEYS);
    em_test_batch half = em_test_key_batch(keys, KEYS / 2);
    em_error err;
    for (int t = 0; t < 2; t++) /* half of them stored */
        ck_assert_msg(em_test_pull(tables[t], &half.csr, EM_COMBINER_NONE, true, out[t], NULL,
                                   &err) == EM_OK, "%s", err.message);
    em_pull_result results[2];
    for (int pass = 0; pass < 4; pass++) {
        /* 0: half of the keys missing, not created; 1: created; 2, 3: every key stored
         * (a table of several shards whose last pull missed keys pulls the general way
         * once more, 2, and at once again after one that missed none, 3) */
        bool create = pass > 0;
        uint64_t pulls_at_once = 0;
        for (int t = 0; t < 2; t++) {
            em_table_stats before;
            em_table_get_stats(tables[t], &before);
            ck_assert_msg(em_test_pull(tables[t], &every.csr, EM_COMBINER_NONE, create, out[t],
                                       &results[t], &err) == EM_OK, "pass %d: %s", pass,
                          err.message);
            em_table_stats after;
            em_table_get_stats(tables[t], &after);
            if (t == 1)
                pulls_at_once = after.pulls_at_once - before.pulls_at_once;
        }
        ck_assert_mem_eq(out[1], out[0], (size_t)KEYS * DIM * sizeof(float));
        ck_assert_uint_eq(results[1].missing, results[0].missing);
        ck_assert_uint_eq(results[1].created, results[0].created);
        ck_assert_uint_eq(results[0].missing, pass >= 2 ? 0 : KEYS / 2);
        if (pass == 3 || (pass == 2 && shards == 1))
            ck_assert_msg(pulls_at_once == 1, "pass %d", pass);
    }
    em_test_snapshot a = em_test_snapshot_take(tables[0], 4096);
    em_test_snapshot g = em_test_snapshot_take(tables[1], 4096);
    em_test_assert_snapshots_identical(&a, &g);
    em_test_snapshot_free(&a);
    em_test_snapshot_free(&g);
    em_test_batch_free(&every);
    em_test_batch_free(&half);
    for (int t = 0; t < 2; t++) {
        free(out[t]);
        em_table_destroy(tables[t]);
    }
    free(keys);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* A table of 8 shards whose keys are in a few of them (the others hold no rows, and no
 * row blocks yet) pulls and pushes its keys at once, one wait each on the emulation (the
 * first pull, which creates them, also waits for row blocks), and ends equal to the
 * CPU's. */
START_TEST(tables_with_empty_shards_go_at_once)
{
    enum { KEYS = 2, DIM = 16 };
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, 64 * MEBIBYTE, false);
    em_table_config config = table_config(DIM, 1000, 8, 3, EM_INIT_UNIFORM);
    em_table *tables[2] = {em_test_make_table(cpu, &config), em_test_make_table(gpu, &config)};
    uint64_t keys[KEYS] = {5, 6};
    em_test_batch b = em_test_key_batch(keys, KEYS);
    float out[2][KEYS * DIM], gradients[KEYS * DIM];
    for (int i = 0; i < KEYS * DIM; i++)
        gradients[i] = 0.25f * (float)(i % 7) - 0.5f;
    em_error err;
    for (int t = 0; t < 2; t++) {
        /* the first pull creates the keys at once (a new table's pulls create keys; it
         * also waits for the shards' first row blocks), the next ones find them */
        for (int pass = 0; pass < 3; pass++) {
            uint64_t waits = emulated_waits();
            ck_assert_msg(em_test_pull(tables[t], &b.csr, EM_COMBINER_NONE, true, out[t], NULL,
                                       &err) == EM_OK, "%s", err.message);
            if (emulated && t == 1 && pass > 0)
                ck_assert_uint_eq(emulated_waits() - waits, 1);
        }
        for (int pass = 0; pass < 3; pass++) {
            uint64_t waits = emulated_waits();
            ck_assert_msg(em_test_push(tables[t], &b.csr, EM_COMBINER_NONE, gradients, NULL,
                                       &err) == EM_OK, "%s", err.message);
            if (emulated && t == 1 && pass > 0)
                ck_assert_uint_eq(emulated_waits() - waits, 1);
        }
    }
    ck_assert_mem_eq(out[1], out[0], sizeof(out[0]));
    em_table_stats stats;
    em_table_get_stats(tables[1], &stats);
    ck_assert_uint_eq(stats.pulls_at_once, 3);
    ck_assert_uint_eq(stats.pushes_at_once, 3);
    em_test_snapshot a = em_test_snapshot_take(tables[0], 64);
    em_test_snapshot g = em_test_snapshot_take(tables[1], 64);
    em_test_assert_snapshots_identical(&a, &g);
    em_test_snapshot_free(&a);
    em_test_snapshot_free(&g);
    em_test_batch_free(&b);
    for (int t = 0; t < 2; t++)
        em_table_destroy(tables[t]);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* Loop index: combiner (none, sum, mean, sqrtn) x optimizer (sgd, adagrad, rowwise
 * adagrad, adam) x tracking access (none, lru) on one shard, then combiner x optimizer
 * on 5 shards, tracking access with rowwise adagrad and adam, dim 24. With lru the
 * rows' access metadata and the table's clocks end equal too (a refused push moves no
 * clock). A table pushes to keys that are all stored in one pass and one wait, one
 * kernel of each kind over all of its shards (device.h: shards_push_async), the step
 * gated on the GPU: after
 * batches with repeated keys, rows equal the CPU's bit for bit (for the optimizers with a
 * per-row reduction, within 1e-5 relative or 1e-7: wide_rows_match_cpu_value_by_value);
 * a push with absent keys goes the general way and creates them, and the next ones,
 * the table's pushes now creating keys (pushes_create), create them at once; a push the
 * CPU refuses (a step that would make a row non-finite), one that would create keys at
 * once among them, is refused with the same message and changes nothing, creating no
 * key. On the emulation the steady pushes and those that create at once are seen to
 * wait once. */
START_TEST(pushes_at_once_match_cpu)
{
    const em_combiner combiner = (em_combiner)(_i % 4);
    const int optimizer = (_i / 4) % 4;
    const uint32_t shards = _i >= 32 ? 5 : 1;
    const bool lru = shards == 1 ? (_i / 16) % 2 == 1 : optimizer >= 2;
    const uint32_t dim = 24;
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, 64 * MEBIBYTE, false);
    em_table_config config = table_config(dim, 100000, shards, optimizer, EM_INIT_UNIFORM);
    if (lru)
        config.eviction.policy = EM_EVICTION_LRU;
    em_table *tables[2] = {em_test_make_table(cpu, &config), em_test_make_table(gpu, &config)};
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 60 + (uint64_t)_i);
    enum { UNIVERSE = 200 };
    uint64_t all[UNIVERSE];
    for (uint64_t k = 0; k < UNIVERSE; k++) /* the map's marker keys among them */
        all[k] = k < 3 ? UINT64_MAX - k : 11 * k + 4;
    em_test_batch every = em_test_key_batch(all, UNIVERSE);
    float *ones = malloc(UNIVERSE * dim * sizeof(float));
    for (uint64_t i = 0; i < UNIVERSE * dim; i++)
        ones[i] = 0.5f;
    em_error err, errors[2];
    for (int t = 0; t < 2; t++) /* create, then a push that finds every key */
        for (int pass = 0; pass < 2; pass++)
            ck_assert_msg(em_test_push(tables[t], &every.csr, EM_COMBINER_NONE, ones, NULL,
                                       &err) == EM_OK, "%s", err.message);
    int refusals = 0;
    bool last_created = false; /* the push before created keys: the table's pushes create */
    for (int step = 0; step < 30; step++) {
        em_test_batch b = em_test_random_batch(&rng, 1 + (uint32_t)em_test_rng_below(&rng, 50), 6,
                                               UNIVERSE);
        /* some keys the table lacks three times in a row: the first push finds them
         * absent and goes on the general way, the next ones create them at once (the
         * table's pushes now create keys), the third with sums that break rows; where
         * the one before created none (a batch of no keys, or refused), a push is the
         * first again */
        bool fresh = step % 10 >= 7, created_at_once = step % 10 >= 8 && last_created;
        bool broken = step % 10 == 4 || step % 10 == 9;
        for (uint64_t k = 0; k < b.csr.nnz; k++) /* the table's keys, repeated */
            b.keys[k] = fresh && k % 3 == 0 ? 200000 + 1000 * (uint64_t)step + k
                                            : all[em_test_rng_below(&rng, UNIVERSE)];
        uint64_t vectors = combiner == EM_COMBINER_NONE ? b.csr.nnz : b.csr.rows;
        float *gradients = em_test_random_floats(&rng, vectors * dim);
        for (uint64_t v = 0; broken && v < vectors; v++) /* sums that overflow: repeats */
            gradients[v * dim + 5] = 3e38f;
        em_push_result results[2];
        uint64_t waits[2] = {0, 0};
        em_status statuses[2];
        bool refused = false;
        for (int t = 0; t < 2; t++) { /* the CPU first: it says whether the push is refused */
            em_test_snapshot before = em_test_snapshot_take(tables[t], 64);
            waits[t] = emulated_waits();
            statuses[t] = em_test_push(tables[t], &b.csr, combiner, gradients, &results[t],
                                       &errors[t]);
            waits[t] = emulated_waits() - waits[t];
            if (t == 0)
                refused = statuses[0] == EM_INVALID_ARGUMENT;
            if (refused)
                em_test_assert_table_unchanged(tables[t], &before);
            em_test_snapshot_free(&before);
        }
        refusals += refused;
        ck_assert_msg(statuses[1] == statuses[0], "step %d: %s against the cpu's %s", step,
                      errors[1].message, statuses[0] == EM_OK ? "success" : errors[0].message);
        if (refused) {
            ck_assert_str_eq(errors[1].message, errors[0].message);
        } else {
            ck_assert_uint_eq(results[1].updated, results[0].updated);
            ck_assert_uint_eq(results[1].created, results[0].created);
        }
        if (fresh && !refused && b.csr.nnz > 0)
            ck_assert_msg(results[0].created > 0, "step %d", step);
        if (emulated && ((!fresh && !broken) || (created_at_once && !refused)))
            ck_assert_msg(waits[1] == 1, "step %d: %" PRIu64 " waits", step, waits[1]);
        if (emulated && fresh && !created_at_once && !refused && b.csr.nnz > 0)
            ck_assert_msg(waits[1] > 1, "step %d: %" PRIu64 " wait", step, waits[1]);
        last_created = !refused && results[0].created > 0;
        free(gradients);
        em_test_batch_free(&b);
    }
    ck_assert_int_gt(refusals, 0);
    if (lru) {
        assert_access_equal(tables[0], tables[1]);
        em_table_clocks clocks[2];
        for (int t = 0; t < 2; t++)
            em_table_get_clocks(tables[t], &clocks[t]);
        ck_assert_uint_eq(clocks[1].access_clock, clocks[0].access_clock);
        ck_assert_uint_eq(clocks[1].update_clock, clocks[0].update_clock);
    }
    em_test_snapshot a = em_test_snapshot_take(tables[0], 64);
    em_test_snapshot g = em_test_snapshot_take(tables[1], 64);
    if (optimizer == EM_OPTIMIZER_SGD || optimizer == EM_OPTIMIZER_ADAGRAD)
        em_test_assert_snapshots_identical(&a, &g);
    else
        em_test_assert_snapshots_close(&g, &a, 0.01); /* 30 steps of drift: 1e-7 absolute */
    em_test_snapshot_free(&a);
    em_test_snapshot_free(&g);
    em_test_batch_free(&every);
    free(ones);
    for (int t = 0; t < 2; t++)
        em_table_destroy(tables[t]);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* An LRU table trained on the GPU is saved and loaded on the CPU: every row's access
 * metadata comes across, and the same requests then evict the same keys on both. */
START_TEST(access_metadata_moves_between_gpu_and_cpu)
{
    char dir[256];
    em_test_make_dir("ember-gpu-access", dir, sizeof(dir));
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, 64 * MEBIBYTE, false);
    em_table_config config = table_config(8, 400, 2, 1, EM_INIT_UNIFORM);
    config.eviction.policy = EM_EVICTION_LRU;
    config.eviction.candidates = 1024;
    em_table *on_gpu = em_test_make_table(gpu, &config);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 5);
    run_single_keys(on_gpu, &rng, 700);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    em_checkpoint_info saved;
    em_error err;
    ck_assert_msg(em_checkpoint_save(on_gpu, &options, &saved, &err) == EM_OK, "%s", err.message);
    em_table *on_cpu = NULL;
    ck_assert_msg(em_checkpoint_load(saved.path, cpu, NULL, NULL, &on_cpu, NULL, &err) == EM_OK,
                  "%s", err.message);
    uint64_t keys[2][600];
    em_row_access access[2][600];
    uint64_t count = access_by_key(on_gpu, keys[0], access[0], 600);
    ck_assert_uint_eq(count, 400);
    ck_assert_uint_eq(access_by_key(on_cpu, keys[1], access[1], 600), count);
    uint64_t touched = 0;
    for (uint64_t i = 0; i < count; i++) {
        ck_assert_uint_eq(keys[1][i], keys[0][i]);
        ck_assert_uint_eq(access[1][i].accessed, access[0][i].accessed);
        ck_assert_uint_eq(access[1][i].updated, access[0][i].updated);
        ck_assert_uint_eq(access[1][i].frequency, access[0][i].frequency);
        touched += access[0][i].frequency > 1;
    }
    ck_assert_uint_gt(touched, 10);
    /* and back onto the GPU from the CPU's own save */
    char cpu_dir[300];
    snprintf(cpu_dir, sizeof(cpu_dir), "%s/from-cpu", dir);
    em_checkpoint_options_init(&options, cpu_dir);
    ck_assert_int_eq(em_checkpoint_save(on_cpu, &options, &saved, &err), EM_OK);
    em_table *back = NULL;
    ck_assert_msg(em_checkpoint_load(saved.path, gpu, "back", NULL, &back, NULL, &err) == EM_OK,
                  "%s", err.message);
    ck_assert_uint_eq(access_by_key(back, keys[1], access[1], 600), count);
    for (uint64_t i = 0; i < count; i++) {
        ck_assert_uint_eq(keys[1][i], keys[0][i]);
        ck_assert_mem_eq(&access[1][i], &access[0][i], sizeof(em_row_access));
    }
    em_table_destroy(back);
    em_test_rng twin = rng;
    run_single_keys(on_gpu, &rng, 400);
    run_single_keys(on_cpu, &twin, 400);
    em_test_snapshot a = em_test_snapshot_take(on_gpu, 37);
    em_test_snapshot b = em_test_snapshot_take(on_cpu, 37);
    em_test_assert_snapshots_identical(&a, &b);
    em_test_snapshot_free(&a);
    em_test_snapshot_free(&b);
    em_table_destroy(on_cpu);
    em_table_destroy(on_gpu);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
    em_test_remove_tree(dir);
}
END_TEST

/* ---- concurrency ------------------------------------------------------------------------ */

typedef struct busy_table {
    em_table *table;
    const uint64_t *keys;
    uint32_t key_count;
    _Atomic int stop;
    _Atomic int failures;
    _Atomic uint64_t requests;
} busy_table;

/* Pulls and pushes the context's keys until told to stop. */
static void *busy_client(void *argument)
{
    busy_table *context = argument;
    em_test_batch b = em_test_key_batch(context->keys, context->key_count);
    float *values = malloc((size_t)context->key_count * 8 * sizeof(float));
    for (uint32_t i = 0; i < context->key_count * 8; i++)
        values[i] = 0.01f;
    em_error err;
    for (uint64_t n = 0; !atomic_load(&context->stop); n++) {
        em_status status =
            n % 2 == 0
                ? em_test_pull(context->table, &b.csr, EM_COMBINER_NONE, false, values, NULL, &err)
                : em_test_push(context->table, &b.csr, EM_COMBINER_NONE, values, NULL, &err);
        if (status != EM_OK)
            atomic_fetch_add(&context->failures, 1);
        atomic_fetch_add(&context->requests, 1);
        for (uint32_t i = 0; i < context->key_count * 8; i++)
            values[i] = 0.01f;
    }
    free(values);
    em_test_batch_free(&b);
    return NULL;
}

typedef struct save_run {
    em_table *table;
    const char *dir;
    int saves;
    uint64_t copy_limit_bytes; /* 0: the default */
    _Atomic int done;
    em_status status;
    em_error err;
} save_run;

static void *save_repeatedly(void *argument)
{
    save_run *run = argument;
    run->status = EM_OK;
    for (int i = 0; run->status == EM_OK && i < run->saves; i++) {
        em_checkpoint_options options;
        em_checkpoint_options_init(&options, run->dir);
        options.keep = 2;
        if (run->copy_limit_bytes != 0)
            options.copy_limit_bytes = run->copy_limit_bytes;
        em_checkpoint_info info;
        run->status = em_checkpoint_save(run->table, &options, &info, &run->err);
    }
    atomic_store(&run->done, 1);
    return NULL;
}

/* Loop index: the save's copies within the default bound, or bounded to 1 byte (every
 * push during a save waits for its reader). Saves while more threads than the GPU has
 * lanes pull and push: a save takes its lanes before the shards' locks, as requests do,
 * and a push waits for the save's reader before it takes a lane, so neither waits for
 * the other for good. (A save that took the shards' write locks and then waited for a
 * lane, which requests held while waiting for those locks, stopped the table for good;
 * so did pushes that held every lane while they waited for the reader, which needs
 * one.) */
START_TEST(saves_while_requests_fill_every_lane_finish)
{
    enum { CLIENTS = 6, KEYS = 64, SAVES = 6, DEADLINE_S = 60 };
    char dir[256];
    em_test_make_dir("ember-gpu-busy-save", dir, sizeof(dir));
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false); /* 2 lanes */
    em_table_config config = table_config(8, 10000, 2, 0, EM_INIT_ZEROS);
    em_table *table = em_test_make_table(gpu, &config);
    uint64_t keys[KEYS];
    for (int i = 0; i < KEYS; i++)
        keys[i] = 500 + 3 * (uint64_t)i;
    em_test_batch b = em_test_key_batch(keys, KEYS);
    float out[KEYS * 8];
    em_error err;
    ck_assert_int_eq(em_test_pull(table, &b.csr, EM_COMBINER_NONE, true, out, NULL, &err), EM_OK);
    em_test_batch_free(&b);
    busy_table busy = {.table = table, .keys = keys, .key_count = KEYS};
    pthread_t clients[CLIENTS];
    for (int t = 0; t < CLIENTS; t++)
        pthread_create(&clients[t], NULL, busy_client, &busy);
    save_run run = {.table = table, .dir = dir, .saves = SAVES,
                    .copy_limit_bytes = _i == 1 ? 1 : 0};
    pthread_t saver;
    pthread_create(&saver, NULL, save_repeatedly, &run);
    double began = em_test_now();
    while (!atomic_load(&run.done) && em_test_now() - began < DEADLINE_S)
        usleep(10000);
    ck_assert_msg(atomic_load(&run.done), "%d saves beside %d clients did not end in %d s "
                  "(%" PRIu64 " requests answered): the save and the requests wait on each other",
                  SAVES, CLIENTS, DEADLINE_S, atomic_load(&busy.requests));
    pthread_join(saver, NULL);
    atomic_store(&busy.stop, 1);
    for (int t = 0; t < CLIENTS; t++)
        pthread_join(clients[t], NULL);
    ck_assert_msg(run.status == EM_OK, "%s", run.err.message);
    ck_assert_int_eq(atomic_load(&busy.failures), 0);
    ck_assert_uint_gt(atomic_load(&busy.requests), 0);
    em_table_destroy(table);
    em_backend_destroy(gpu);
    em_test_remove_tree(dir);
}
END_TEST

#define RACE_KEYS 64
#define RACE_DIM 32
#define RACE_PUSHES 40
#define RACE_PUSHERS 4

typedef struct race {
    em_table *table;
    const uint64_t *keys; /* what each pusher pushes */
    uint32_t key_count;
    int pushes;
    int torn;
    int failures;
} race;

/* Pushes the context's keys `pushes` times with gradient 1 (RACE_DIM floats a key):
 * with sgd and lr 0.5 each push subtracts 0.5 per occurrence of a key from every
 * element of its row (exact in binary32), so rows stay uniform. */
static void *race_pusher(void *argument)
{
    race *context = argument;
    em_test_batch b = em_test_key_batch(context->keys, context->key_count);
    float *g = malloc((size_t)context->key_count * RACE_DIM * sizeof(float));
    for (uint64_t i = 0; i < (uint64_t)context->key_count * RACE_DIM; i++)
        g[i] = 1.0f;
    em_error err;
    for (int p = 0; p < context->pushes; p++)
        if (em_test_push(context->table, &b.csr, EM_COMBINER_NONE, g, NULL, &err) != EM_OK)
            __atomic_fetch_add(&context->failures, 1, __ATOMIC_RELAXED);
    free(g);
    em_test_batch_free(&b);
    return NULL;
}

static void *race_reader(void *argument)
{
    race *context = argument;
    uint64_t keys[RACE_KEYS];
    for (int i = 0; i < RACE_KEYS; i++)
        keys[i] = 1000 + (uint64_t)i;
    em_test_batch b = em_test_key_batch(keys, RACE_KEYS);
    float *out = malloc(RACE_KEYS * RACE_DIM * sizeof(float));
    em_error err;
    for (int p = 0; p < RACE_PUSHES; p++) {
        if (em_test_pull(context->table, &b.csr, EM_COMBINER_NONE, false, out, NULL, &err) != EM_OK)
            __atomic_fetch_add(&context->failures, 1, __ATOMIC_RELAXED);
        for (int i = 0; i < RACE_KEYS; i++)
            for (int j = 1; j < RACE_DIM; j++)
                if (out[i * RACE_DIM + j] != out[i * RACE_DIM])
                    __atomic_fetch_add(&context->torn, 1, __ATOMIC_RELAXED);
    }
    free(out);
    em_test_batch_free(&b);
    return NULL;
}

/* Loop index: 2 shards on 2 GPUs (where 2 are visible: pulls and pushes of stored keys
 * go spread over both, with one wait for both), 1 shard, 3 shards on one GPU (pulls and
 * pushes of stored keys go at once, with one wait for the GPU). Pushes on several lanes
 * at once never lose an update (the shards' events order them) and readers never see a
 * half-applied push. */
START_TEST(concurrent_pushes_lose_no_update)
{
    const uint32_t gpus = _i == 0 ? 2 : 1, shards = _i == 0 ? 2 : _i == 1 ? 1 : 3;
    if (visible_gpus() < gpus)
        return;
    em_backend *gpu = gpu_backend(gpus, GPU_POOL_BYTES, false);
    em_table_config config = table_config(RACE_DIM, 10000, shards, 0, EM_INIT_ZEROS);
    config.optimizer.learning_rate = 0.5f;
    em_table *table = em_test_make_table(gpu, &config);
    /* Create the keys first so every later push shares the table lock. */
    uint64_t keys[RACE_KEYS];
    for (int i = 0; i < RACE_KEYS; i++)
        keys[i] = 1000 + (uint64_t)i;
    race context = {.table = table, .keys = keys, .key_count = RACE_KEYS, .pushes = RACE_PUSHES};
    em_test_batch b = em_test_key_batch(keys, RACE_KEYS);
    float *out = malloc(RACE_KEYS * RACE_DIM * sizeof(float));
    em_error err;
    ck_assert_int_eq(em_test_pull(table, &b.csr, EM_COMBINER_NONE, true, out, NULL, &err), EM_OK);
    pthread_t threads[RACE_PUSHERS + 2];
    for (int t = 0; t < RACE_PUSHERS; t++)
        pthread_create(&threads[t], NULL, race_pusher, &context);
    for (int t = RACE_PUSHERS; t < RACE_PUSHERS + 2; t++)
        pthread_create(&threads[t], NULL, race_reader, &context);
    for (int t = 0; t < RACE_PUSHERS + 2; t++)
        pthread_join(threads[t], NULL);
    ck_assert_int_eq(context.failures, 0);
    ck_assert_int_eq(context.torn, 0);
    ck_assert_int_eq(em_test_pull(table, &b.csr, EM_COMBINER_NONE, false, out, NULL, &err), EM_OK);
    for (int i = 0; i < RACE_KEYS * RACE_DIM; i++)
        ck_assert_msg(out[i] == -0.5f * RACE_PUSHERS * RACE_PUSHES, "value %d: %g", i,
                      (double)out[i]);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    if (_i == 1) { /* the keys were there: every one went at once, and so did the pull
                    * that created them (a new table's pulls create keys) */
        ck_assert_uint_eq(stats.pushes_at_once, RACE_PUSHERS * RACE_PUSHES);
        ck_assert_uint_eq(stats.pulls_at_once, 2 * RACE_PUSHES + 2);
    } else if (_i == 2) { /* the creating pull went at once; after it, each pusher's
                           * first push may go the general way (pushes_go_general), and
                           * none after it */
        ck_assert_uint_ge(stats.pushes_at_once, RACE_PUSHERS * RACE_PUSHES - RACE_PUSHERS);
        ck_assert_uint_eq(stats.pulls_at_once, 2 * RACE_PUSHES + 2);
    } else { /* pushes of stored keys go spread over both GPUs (table.c: push_spread),
              * every one (the keys were created by a pull); so do the pulls
              * (pull_spread), the one that created the keys among them (a new table's
              * pulls create keys) */
        ck_assert_uint_eq(stats.pushes_at_once, RACE_PUSHERS * RACE_PUSHES);
        ck_assert_uint_eq(stats.pulls_at_once, 2 * RACE_PUSHES + 2);
    }
    free(out);
    em_test_batch_free(&b);
    em_table_destroy(table);
    em_backend_destroy(gpu);
}
END_TEST

#define SAME_KEYS 200
#define SAME_THREADS 6
#define SAME_PUSHES 10

/* What each thread of threads_pulling_new_keys_create_each_once pulls: rounds of 64
 * keys, half of them shared by every thread (the marker values among them) and half
 * its own, every round's keys new to the table; each pull's output is checked against
 * the CPU's table, which created the same keys first. */
typedef struct new_keys_puller {
    em_table *table, *reference;
    int thread, rounds;
    int failures, wrong;
} new_keys_puller;

#define NEW_KEYS_BATCH 64

static uint64_t new_key(int thread, int round, int i)
{
    if (i % 2 == 0) { /* shared */
        if (round == 0 && i < 6)
            return UINT64_MAX - (uint64_t)i / 2;
        return ((uint64_t)round * NEW_KEYS_BATCH + (uint64_t)i) * 0x9e3779b97f4a7c15ull;
    }
    return 1000000 + ((uint64_t)thread * 1000 + (uint64_t)round) * NEW_KEYS_BATCH + (uint64_t)i;
}

static void *new_keys_pull(void *argument)
{
    new_keys_puller *p = argument;
    uint64_t keys[NEW_KEYS_BATCH];
    float got[NEW_KEYS_BATCH * RACE_DIM], expected[NEW_KEYS_BATCH * RACE_DIM];
    em_error err;
    for (int round = 0; round < p->rounds; round++) {
        for (int i = 0; i < NEW_KEYS_BATCH; i++)
            keys[i] = new_key(p->thread, round, i);
        em_test_batch b = em_test_key_batch(keys, NEW_KEYS_BATCH);
        if (em_test_pull(p->table, &b.csr, EM_COMBINER_NONE, true, got, NULL, &err) != EM_OK ||
            em_test_pull(p->reference, &b.csr, EM_COMBINER_NONE, false, expected, NULL, &err) !=
                EM_OK)
            p->failures++;
        else if (memcmp(got, expected, sizeof(got)) != 0)
            p->wrong++;
        em_test_batch_free(&b);
    }
    return NULL;
}

/* Loop index: 3 shards, then 1. Threads whose pulls create keys at once, many of them
 * the same keys at the same time: each key is created once (rows and rows_created count
 * the distinct keys), every pull answers the key's initial value, the table ends equal
 * to the CPU's bit for bit, and pulls went at once while creating. (It caught room
 * made for the batch after the dedupe was enqueued: a shard's growth synchronized the
 * lane, which ended the dedupe's count, and another buffer took its place.) */
START_TEST(threads_pulling_new_keys_create_each_once)
{
    enum { THREADS = 4, ROUNDS = 12 };
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(RACE_DIM, 100000, _i == 0 ? 3 : 1, 1,
                                          EM_INIT_UNIFORM);
    em_table *table = em_test_make_table(gpu, &config);
    em_table *reference = em_test_make_table(cpu, &config);
    uint64_t distinct = 0;
    em_error err;
    for (int round = 0; round < ROUNDS; round++) /* the reference first, one thread */
        for (int t = 0; t < THREADS; t++) {
            uint64_t keys[NEW_KEYS_BATCH];
            for (int i = 0; i < NEW_KEYS_BATCH; i++)
                keys[i] = new_key(t, round, i);
            em_test_batch b = em_test_key_batch(keys, NEW_KEYS_BATCH);
            em_pull_result result;
            float out[NEW_KEYS_BATCH * RACE_DIM];
            ck_assert_int_eq(em_test_pull(reference, &b.csr, EM_COMBINER_NONE, true, out, &result,
                                          &err), EM_OK);
            distinct += result.created;
            em_test_batch_free(&b);
        }
    ck_assert_uint_eq(distinct, ROUNDS * NEW_KEYS_BATCH / 2 * (THREADS + 1));
    new_keys_puller pullers[THREADS];
    pthread_t threads[THREADS];
    for (int t = 0; t < THREADS; t++) {
        pullers[t] = (new_keys_puller){.table = table, .reference = reference, .thread = t,
                                       .rounds = ROUNDS};
        pthread_create(&threads[t], NULL, new_keys_pull, &pullers[t]);
    }
    for (int t = 0; t < THREADS; t++) {
        pthread_join(threads[t], NULL);
        ck_assert_int_eq(pullers[t].failures, 0);
        ck_assert_int_eq(pullers[t].wrong, 0);
    }
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, distinct);
    ck_assert_uint_eq(stats.rows_created, distinct);
    ck_assert_uint_gt(stats.pulls_at_once, 0);
    em_test_snapshot a = em_test_snapshot_take(reference, 64);
    em_test_snapshot g = em_test_snapshot_take(table, 64);
    em_test_assert_snapshots_identical(&a, &g);
    em_test_snapshot_free(&a);
    em_test_snapshot_free(&g);
    em_table_destroy(table);
    em_table_destroy(reference);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* Loop index: 3 shards, then 1. Threads that create the same keys at once (the marker
 * values too, each twice per push) create each key once and lose no update: every row
 * ends at -0.5 * 2 * (threads * pushes). */
START_TEST(threads_creating_the_same_keys_create_each_once)
{
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(RACE_DIM, 10000, _i == 0 ? 3 : 1, 0, EM_INIT_ZEROS);
    config.optimizer.learning_rate = 0.5f;
    em_table *table = em_test_make_table(gpu, &config);
    /* the same keys twice per push, among them the four values the hash maps reserve as
     * markers: UINT64_MAX, UINT64_MAX - 1, UINT64_MAX - 2 and (i = 3) 0 */
    uint64_t keys[2 * SAME_KEYS];
    for (int i = 0; i < SAME_KEYS; i++) {
        uint64_t key =
            i < 3 ? UINT64_MAX - (uint64_t)i : (uint64_t)(i - 3) * 0x9e3779b97f4a7c15ull;
        keys[i] = keys[2 * SAME_KEYS - 1 - i] = key;
    }
    race context = {.table = table, .keys = keys, .key_count = 2 * SAME_KEYS,
                    .pushes = SAME_PUSHES};
    pthread_t threads[SAME_THREADS];
    for (int t = 0; t < SAME_THREADS; t++)
        pthread_create(&threads[t], NULL, race_pusher, &context);
    for (int t = 0; t < SAME_THREADS; t++)
        pthread_join(threads[t], NULL);
    ck_assert_int_eq(context.failures, 0);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, SAME_KEYS);
    if (_i == 1) /* once the keys were there, pushes went at once beside the creating ones */
        ck_assert_uint_gt(stats.pushes_at_once, 0);
    em_test_snapshot rows = em_test_snapshot_take(table, 64);
    ck_assert_uint_eq(rows.count, SAME_KEYS);
    for (uint64_t i = 0; i < rows.count * rows.width; i++)
        ck_assert_msg(rows.values[i] == -1.0f * SAME_THREADS * SAME_PUSHES, "value %llu: %g",
                      (unsigned long long)i, (double)rows.values[i]);
    em_test_snapshot_free(&rows);
    em_table_destroy(table);
    em_backend_destroy(gpu);
}
END_TEST

/* ---- wide rows and alignment -------------------------------------------------------------- */

/* Loop index: optimizer x dim (129, 200). Rows wider than a warp: every pulled value
 * and every final row value checked one by one, bit for bit for sgd and adagrad (one
 * rounding per element on both devices), within 1e-5 relative for the optimizers with a
 * per-row reduction (rowwise adagrad, adam). */
START_TEST(wide_rows_match_cpu_value_by_value)
{
    static const uint32_t dims[] = {129, 200};
    int optimizer = _i / 2;
    uint32_t dim = dims[_i % 2];
    bool exact = optimizer == EM_OPTIMIZER_SGD || optimizer == EM_OPTIMIZER_ADAGRAD;
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(dim, 10000, 2, optimizer, EM_INIT_UNIFORM);
    em_table *cpu_table = em_test_make_table(cpu, &config);
    em_table *gpu_table = em_test_make_table(gpu, &config);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 500 + (uint64_t)_i);
    em_error err;
    for (int round = 0; round < 4; round++) {
        em_test_batch b = em_test_random_batch(&rng, 40, 6, 300);
        uint64_t floats = b.csr.nnz * dim;
        float *expected = malloc((floats + 1) * sizeof(float));
        float *got = malloc((floats + 1) * sizeof(float));
        ck_assert_int_eq(em_test_pull(cpu_table, &b.csr, EM_COMBINER_NONE, true, expected, NULL,
                                      &err), EM_OK);
        ck_assert_msg(em_test_pull(gpu_table, &b.csr, EM_COMBINER_NONE, true, got, NULL, &err) ==
                          EM_OK, "%s", err.message);
        for (uint64_t i = 0; i < floats; i++)
            ck_assert_msg(exact ? memcmp(&got[i], &expected[i], sizeof(float)) == 0
                                : reference_close(got[i], expected[i], 0.1),
                          "round %d value %llu (element %llu): gpu %a, cpu %a", round,
                          (unsigned long long)i, (unsigned long long)(i % dim), (double)got[i],
                          (double)expected[i]);
        float *g = em_test_random_floats(&rng, floats);
        ck_assert_int_eq(em_test_push(cpu_table, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
        ck_assert_msg(em_test_push(gpu_table, &b.csr, EM_COMBINER_NONE, g, NULL, &err) == EM_OK,
                      "%s", err.message);
        free(g);
        free(expected);
        free(got);
        em_test_batch_free(&b);
    }
    assert_tables_alike(cpu_table, gpu_table, 50, exact ? 0 : 1e-2);
    em_table_destroy(cpu_table);
    em_table_destroy(gpu_table);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* Loop index: dim (1, 3, 13, 33). Pulls into output buffers 4, 8 and 12 bytes past a
 * 16-byte boundary, per key and pooled, give the same values as into an aligned one
 * (the GPU gathers rows with 16-byte accesses where it can). */
START_TEST(outputs_at_any_alignment)
{
    static const uint32_t dims[] = {1, 3, 13, 33};
    uint32_t dim = dims[_i];
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(dim, 10000, 2, 0, EM_INIT_UNIFORM);
    em_table *table = em_test_make_table(gpu, &config);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 600 + (uint64_t)_i);
    em_test_batch b = em_test_random_batch(&rng, 30, 5, 200);
    em_error err;
    for (int pooled = 0; pooled < 2; pooled++) {
        em_combiner combiner = pooled ? EM_COMBINER_MEAN : EM_COMBINER_NONE;
        uint64_t floats = em_csr_output_vectors(&b.csr, combiner) * dim;
        size_t bytes = (floats + 8) / 4 * 16; /* room for a shift of 3 floats; a multiple of 16 */
        float *aligned = aligned_alloc(16, bytes);
        ck_assert_msg(em_test_pull(table, &b.csr, combiner, true, aligned, NULL, &err) == EM_OK,
                      "%s", err.message);
        for (uint32_t shift = 1; shift < 4; shift++) {
            float *buffer = aligned_alloc(16, bytes);
            ck_assert_msg(em_test_pull(table, &b.csr, combiner, false, buffer + shift, NULL,
                                       &err) == EM_OK, "%s", err.message);
            ck_assert_msg(memcmp(buffer + shift, aligned, floats * sizeof(float)) == 0,
                          "dim %u, %s, output %u bytes past 16", dim, pooled ? "mean" : "none",
                          shift * 4);
            free(buffer);
        }
        free(aligned);
    }
    em_test_batch_free(&b);
    em_table_destroy(table);
    em_backend_destroy(gpu);
}
END_TEST

/* A copy of n bytes in a buffer of em_host_buffer_alloc (pinned when the pool has room),
 * starting `shift` bytes in. */
static void *host_buffer_copy(em_host_buffers *buffers, const void *source, size_t n,
                             size_t shift)
{
    uint8_t *buffer = em_host_buffer_alloc(buffers, n + shift);
    ck_assert_ptr_nonnull(buffer);
    memcpy(buffer + shift, source, n);
    return buffer;
}

/* Loop index: pinned buffer limit (1 GiB, 64 KiB: big buffers find the pool full, 0: no
 * pool). Pulls and pushes whose keys, offsets, gradients and output lie in the
 * backend's host buffers (the daemon's attachments and answers) give the same rows and
 * outputs, bit for bit, as the same requests from malloc'ed memory, into a second table;
 * buffers in pinned memory are copied by DMA (bytes_copied_directly), the others
 * through staging, and with no room or no pool every buffer still works. */
START_TEST(requests_in_pinned_buffers_match_pageable_ones)
{
    static const uint64_t limits[] = {1024 * MEBIBYTE, 64 << 10, 0};
    em_cuda_backend_options options;
    em_cuda_backend_options_init(&options);
    options.device_count = 1;
    options.pool_bytes = GPU_POOL_BYTES;
    options.staging_bytes = 1 * MEBIBYTE;
    options.pinned_buffer_bytes = limits[_i];
    em_backend *gpu = NULL;
    em_error err;
    ck_assert_msg(em_backend_create_cuda(&options, &gpu, &err) == EM_OK, "%s", err.message);
    ck_assert(_i == 2 ? gpu->host_buffers == NULL : gpu->host_buffers != NULL);
    em_host_buffers *buffers = gpu->host_buffers;
    const uint32_t dim = 24;
    em_table_config config = table_config(dim, 200000, 3, EM_OPTIMIZER_ADAGRAD, EM_INIT_UNIFORM);
    em_table *pageable = em_test_make_table(gpu, &config);
    em_table *pinned = em_test_make_table(gpu, &config);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 700 + (uint64_t)_i);
    for (int round = 0; round < 6; round++) {
        /* up to 40,000 keys: 320 KB of keys, 3.8 MB of gradients, several staging chunks */
        em_test_batch b = em_test_random_batch(&rng, round % 2 ? 8000 : 50, 5, 60000);
        em_combiner combiner = round % 3 == 2 ? EM_COMBINER_SUM : EM_COMBINER_NONE;
        uint64_t floats = em_csr_output_vectors(&b.csr, combiner) * dim;
        size_t shift = (size_t)round * 4; /* the keys at any 4-byte offset, as in a frame */
        uint64_t *keys = host_buffer_copy(buffers, b.keys, b.csr.nnz * sizeof(uint64_t), 0);
        uint32_t *offsets = host_buffer_copy(buffers, b.offsets,
                                             (b.csr.rows + 1) * sizeof(uint32_t), shift);
        em_csr in_buffers = b.csr;
        in_buffers.keys = keys;
        in_buffers.offsets = (const uint32_t *)((const uint8_t *)offsets + shift);
        float *expected = malloc((floats + 1) * sizeof(float));
        float *got = em_host_buffer_alloc(buffers, (floats + 1) * sizeof(float));
        ck_assert_msg(em_test_pull(pageable, &b.csr, combiner, true, expected, NULL, &err) ==
                          EM_OK, "%s", err.message);
        ck_assert_msg(em_test_pull(pinned, &in_buffers, combiner, true, got, NULL, &err) == EM_OK,
                      "%s", err.message);
        ck_assert_msg(memcmp(got, expected, floats * sizeof(float)) == 0, "round %d: outputs differ",
                      round);
        float *g = em_test_random_floats(&rng, floats);
        float *g_pinned = host_buffer_copy(buffers, g, floats * sizeof(float), 0);
        ck_assert_int_eq(em_test_push(pageable, &b.csr, combiner, g, NULL, &err), EM_OK);
        ck_assert_msg(em_test_push(pinned, &in_buffers, combiner, g_pinned, NULL, &err) == EM_OK,
                      "%s", err.message);
        free(g);
        free(expected);
        em_host_buffer_free(buffers, g_pinned);
        em_host_buffer_free(buffers, got);
        em_host_buffer_free(buffers, keys);
        em_host_buffer_free(buffers, offsets);
        em_test_batch_free(&b);
    }
    assert_tables_alike(pageable, pinned, 500, 0);
    em_host_buffers_stats stats;
    em_host_buffers_get_stats(buffers, &stats);
    ck_assert_uint_eq(stats.pinned_bytes_in_use, 0);
    if (_i == 0) { /* every buffer pinned: the second table's inputs and outputs by DMA */
        ck_assert_uint_eq(stats.unpinned_allocations, 0);
        ck_assert_uint_gt(stats.bytes_copied_directly, 3 * MEBIBYTE);
        ck_assert_uint_gt(stats.bytes_copied_staged, 3 * MEBIBYTE);
    } else if (_i == 1) { /* the big buffers did not fit: staged, and counted */
        ck_assert_uint_gt(stats.unpinned_allocations, 0);
        ck_assert_uint_gt(stats.pinned_allocations, 0);
        ck_assert_uint_gt(stats.bytes_copied_directly, 0);
        ck_assert_uint_le(stats.pinned_bytes_reserved, 64 << 10);
    } else {
        ck_assert_uint_eq(stats.pinned_allocations + stats.bytes_copied_directly, 0);
    }
    em_table_destroy(pageable);
    em_table_destroy(pinned);
    em_backend_destroy(gpu);
}
END_TEST

/* A table of more than 2^31 floats (34.6 million rows of dim 64, 8.9 GB), when the GPU
 * has the room: row indexes and element offsets past 32 bits. The last keys created
 * read their initial values (bit-identical to the CPU's for uniform), and a push to
 * them lands on them alone. Skipped, saying so, on a GPU with less than 12 GiB free. */
START_TEST(a_table_beyond_2_31_floats)
{
    uint64_t free_bytes = 0, total_bytes = 0;
    ck_assert_int_eq(em_gpu_memory_info(0, &free_bytes, &total_bytes).code, 0); /* GPU 0 */
    if (free_bytes < (UINT64_C(12) << 30)) {
        printf("a_table_beyond_2_31_floats: %.1f GiB free on the GPU, 12 needed: not run\n",
               (double)free_bytes / (double)(1u << 30));
        return;
    }
    /* 34.6 million rows: 8.9 GB of rows and about 1 GB of hash map in an 11 GiB pool */
    enum { DIM = 64, PER_ROW = 1024, ROWS_PER_PULL = 1024 };
    uint64_t keys_needed = (UINT64_C(1) << 31) / DIM + PER_ROW * ROWS_PER_PULL;
    em_backend *gpu = gpu_backend(1, UINT64_C(11) << 30, false);
    em_table_config config = table_config(DIM, keys_needed, 1, 0, EM_INIT_UNIFORM);
    em_table *table = em_test_make_table(gpu, &config);
    uint64_t per_pull = (uint64_t)PER_ROW * ROWS_PER_PULL;
    uint64_t *keys = malloc(per_pull * sizeof(uint64_t));
    uint32_t *offsets = malloc((ROWS_PER_PULL + 1) * sizeof(uint32_t));
    for (uint32_t r = 0; r <= ROWS_PER_PULL; r++)
        offsets[r] = r * PER_ROW;
    float *sums = malloc((uint64_t)ROWS_PER_PULL * DIM * sizeof(float));
    em_error err;
    uint64_t next = 0;
    while (next < keys_needed) {
        for (uint64_t i = 0; i < per_pull; i++)
            keys[i] = (next + i) * 0x9e3779b97f4a7c15ull + 7;
        em_csr csr = {.rows = ROWS_PER_PULL, .nnz = per_pull, .offsets = offsets, .keys = keys};
        ck_assert_msg(em_test_pull(table, &csr, EM_COMBINER_SUM, true, sums, NULL, &err) == EM_OK,
                      "after %llu keys: %s", (unsigned long long)next, err.message);
        next += per_pull;
    }
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_ge(stats.rows * DIM, UINT64_C(1) << 31);
    /* The last 16 keys: initial values as on the CPU, then one push on them alone. */
    uint64_t last[16];
    for (int i = 0; i < 16; i++)
        last[i] = (next - 16 + (uint64_t)i) * 0x9e3779b97f4a7c15ull + 7;
    em_test_batch b = em_test_key_batch(last, 16);
    em_backend *cpu = cpu_backend();
    em_table *cpu_table = em_test_make_table(cpu, &config);
    float got[16 * DIM], expected[16 * DIM], g[16 * DIM];
    ck_assert_int_eq(em_test_pull(table, &b.csr, EM_COMBINER_NONE, false, got, NULL, &err), EM_OK);
    ck_assert_int_eq(em_test_pull(cpu_table, &b.csr, EM_COMBINER_NONE, true, expected, NULL, &err),
                     EM_OK);
    ck_assert(memcmp(got, expected, sizeof(got)) == 0);
    for (int i = 0; i < 16 * DIM; i++)
        g[i] = 1.0f;
    ck_assert_int_eq(em_test_push(table, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    ck_assert_int_eq(em_test_push(cpu_table, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    ck_assert_int_eq(em_test_pull(table, &b.csr, EM_COMBINER_NONE, false, got, NULL, &err), EM_OK);
    ck_assert_int_eq(em_test_pull(cpu_table, &b.csr, EM_COMBINER_NONE, false, expected, NULL, &err),
                     EM_OK);
    ck_assert(memcmp(got, expected, sizeof(got)) == 0);
    em_test_batch_free(&b);
    em_table_destroy(cpu_table);
    em_backend_destroy(cpu);
    free(sums);
    free(offsets);
    free(keys);
    em_table_destroy(table);
    em_backend_destroy(gpu);
}
END_TEST

/* ---- several GPUs ------------------------------------------------------------------------ */

typedef struct record {
    float *outputs;
    uint64_t output_count;
    em_test_snapshot final;
} record;

static record run_layout(em_backend *backend, uint32_t shards, int optimizer, em_combiner combiner)
{
    const uint32_t dim = 8;
    em_table_config config = table_config(dim, 100000, shards, optimizer, EM_INIT_UNIFORM);
    em_table *table = em_test_make_table(backend, &config);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 77);
    record r = {.outputs = malloc(20 * 64 * 8 * dim * sizeof(float))};
    em_error err;
    for (int round = 0; round < 20; round++) {
        em_test_batch b = em_test_random_batch(&rng, 64, 8, 2000);
        uint64_t floats = em_csr_output_vectors(&b.csr, combiner) * dim;
        ck_assert_msg(em_test_pull(table, &b.csr, combiner, round % 3 != 2, r.outputs + r.output_count,
                           NULL, &err) == EM_OK, "%s", err.message);
        r.output_count += floats;
        float *g = em_test_random_floats(&rng, floats);
        ck_assert_msg(em_test_push(table, &b.csr, combiner, g, NULL, &err) == EM_OK, "%s", err.message);
        free(g);
        em_test_batch_free(&b);
    }
    r.final = em_test_snapshot_take(table, 100);
    em_table_destroy(table);
    return r;
}

/* run_layout on backend with shards shards gives base's outputs and rows, bit for bit. */
static void assert_layout_as_base(em_backend *backend, uint32_t shards, int optimizer,
                                  em_combiner combiner, const record *base)
{
    record other = run_layout(backend, shards, optimizer, combiner);
    ck_assert_uint_eq(other.output_count, base->output_count);
    ck_assert_msg(memcmp(other.outputs, base->outputs, base->output_count * sizeof(float)) == 0,
                  "pulls differ with %u devices, %u shards, %s exchange", backend->device_count,
                  shards, backend->exchange->name);
    em_test_assert_snapshots_identical(&other.final, &base->final);
    free(other.outputs);
    em_test_snapshot_free(&other.final);
}

/* Loop index: optimizer. With every visible GPU (NCCL and host-staged exchanges) and
 * several shard counts, outputs and rows equal the one-GPU, one-shard run bit for bit. */
START_TEST(layouts_over_gpus_identical_to_one_gpu)
{
    uint32_t gpus = visible_gpus();
    if (gpus < 2) {
        printf("one GPU visible: multi-GPU layouts not run\n");
        return;
    }
    em_combiner combiner = (em_combiner)((_i + 1) % 4);
    em_backend *one = gpu_backend(1, GPU_POOL_BYTES, false);
    record base = run_layout(one, 1, _i, combiner);
    em_backend_destroy(one);
    /* 1: a table on GPU 0 only; 40: more shards per GPU than a lane reads back later (and
     * fewer than the 64 locks ThreadSanitizer follows at once) */
    static const uint32_t shard_counts[] = {1, 2, 3, 8, 40};
    for (int staged = 0; staged < 2; staged++) {
        em_backend *all = gpu_backend(0, GPU_POOL_BYTES, staged != 0);
        ck_assert_uint_eq(all->device_count, gpus);
        ck_assert_str_eq(all->exchange->name, staged ? "host-staged" : "nccl");
        for (size_t s = 0; s < sizeof(shard_counts) / sizeof(shard_counts[0]); s++)
            assert_layout_as_base(all, shard_counts[s], _i, combiner, &base);
        em_backend_destroy(all);
    }
    free(base.outputs);
    em_test_snapshot_free(&base.final);
}
END_TEST

/* Two devices on GPU 0 (shared_gpus: each its own pool, lanes and streams, the exchange
 * host-staged). */
static em_backend *two_devices_on_one_gpu(void)
{
    em_cuda_backend_options options;
    em_cuda_backend_options_init(&options);
    options.device_count = 2;
    options.devices[0] = options.devices[1] = 0;
    options.shared_gpus = true;
    options.pool_bytes = GPU_POOL_BYTES;
    options.staging_bytes = 1 * MEBIBYTE; /* small, so big copies are chunked */
    em_backend *shared = NULL;
    em_error err;
    ck_assert_msg(em_backend_create_cuda(&options, &shared, &err) == EM_OK, "%s", err.message);
    return shared;
}

/* Loop index: optimizer. Two devices on one GPU (shared_gpus: each its own pool, lanes
 * and streams, the exchange host-staged), so that a host with one GPU runs the paths of
 * a table spread over several devices (the exchange, the finds and checks on both
 * devices before any wait): outputs and rows equal the one-device, one-shard run bit
 * for bit. */
START_TEST(two_devices_sharing_one_gpu_match_one_device)
{
    em_combiner combiner = (em_combiner)((_i + 1) % 4);
    em_backend *one = gpu_backend(1, GPU_POOL_BYTES, false);
    record base = run_layout(one, 1, _i, combiner);
    em_backend_destroy(one);
    em_backend *shared = two_devices_on_one_gpu();
    ck_assert_uint_eq(shared->device_count, 2);
    ck_assert_str_eq(shared->devices[0]->name, "cuda:0");
    ck_assert_str_eq(shared->devices[1]->name, "cuda:0#1");
    ck_assert_str_eq(shared->exchange->name, "host-staged");
    ck_assert_msg(strstr(shared->exchange_fallback, "shared_gpus") != NULL, "%s",
                  shared->exchange_fallback);
    static const uint32_t shard_counts[] = {2, 3, 8, 40};
    for (size_t s = 0; s < sizeof(shard_counts) / sizeof(shard_counts[0]); s++)
        assert_layout_as_base(shared, shard_counts[s], _i, combiner, &base);
    em_backend_destroy(shared);
    free(base.outputs);
    em_test_snapshot_free(&base.final);
}
END_TEST

/* ---- options ------------------------------------------------------------------------------ */

START_TEST(bad_options_are_named)
{
    em_cuda_backend_options options;
    em_backend *backend = NULL;
    em_error err;
    em_cuda_backend_options_init(&options);
    options.device_count = 1;
    options.devices[0] = 99;
    ck_assert_int_eq(em_backend_create_cuda(&options, &backend, &err), EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "devices[0] = 99") != NULL, "%s", err.message);
    em_cuda_backend_options_init(&options);
    options.lanes = 0;
    ck_assert_int_eq(em_backend_create_cuda(&options, &backend, &err), EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "lanes 0") != NULL, "%s", err.message);
    em_cuda_backend_options_init(&options);
    options.memory_fraction = 1.5;
    ck_assert_int_eq(em_backend_create_cuda(&options, &backend, &err), EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "memory_fraction 1.5") != NULL, "%s", err.message);
    em_cuda_backend_options_init(&options); /* without shared_gpus */
    options.device_count = 2;
    options.devices[0] = options.devices[1] = 0;
    ck_assert_int_eq(em_backend_create_cuda(&options, &backend, &err), EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "listed twice") != NULL, "%s", err.message);
}
END_TEST

/* With several GPUs NCCL comes up before the pools; when it cannot, the host-staged
 * exchange serves and the backend says why. Only the emulation can make NCCL fail on
 * cue (failpoint nccl_init_fail); on GPUs the first half runs. */
START_TEST(nccl_first_and_a_fallback_that_says_why)
{
    if (visible_gpus() < 2)
        return;
    em_backend *backend = gpu_backend(2, GPU_POOL_BYTES, false);
    ck_assert_str_eq(backend->exchange->name, "nccl");
    ck_assert_str_eq(backend->exchange_fallback, "");
    em_backend_destroy(backend);
    backend = gpu_backend(2, GPU_POOL_BYTES, true); /* host staging asked for: no fallback */
    ck_assert_str_eq(backend->exchange->name, "host-staged");
    ck_assert_str_eq(backend->exchange_fallback, "");
    em_backend_destroy(backend);
#ifdef EM_CUDA_EMULATED
    em_error err;
    ck_assert_int_eq(em_failpoints_arm("nccl_init_fail*1", &err), EM_OK);
    backend = gpu_backend(2, GPU_POOL_BYTES, false);
    ck_assert_str_eq(backend->exchange->name, "host-staged");
    ck_assert_msg(strstr(backend->exchange_fallback, "ncclCommInitAll failed: unhandled system "
                                                     "error (emulated)") != NULL,
                  "%s", backend->exchange_fallback);
    em_backend_destroy(backend);
#endif
}
END_TEST

/* A push over 8 shards whose step would overflow a row of one of them is refused whole
 * with the CPU's message (the GPU checks every shard, then reads the answers back
 * together); nothing changes on either backend. */
START_TEST(a_push_refused_in_one_shard_of_eight_says_what_the_cpu_says)
{
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(6, 10000, 8, EM_OPTIMIZER_SGD, EM_INIT_UNIFORM);
    config.optimizer.learning_rate = 1e6f;
    em_table *tables[2] = {em_test_make_table(cpu, &config), em_test_make_table(gpu, &config)};
    enum { KEYS = 400 };
    uint64_t keys[KEYS];
    uint32_t offsets[KEYS + 1];
    float g[KEYS * 6];
    for (uint32_t i = 0; i < KEYS; i++)
        keys[i] = 1000 + 31 * (uint64_t)i;
    for (uint32_t i = 0; i <= KEYS; i++)
        offsets[i] = i;
    for (uint32_t i = 0; i < KEYS * 6; i++)
        g[i] = 0.125f;
    em_csr batch = {.rows = KEYS, .nnz = KEYS, .offsets = offsets, .keys = keys};
    em_error err, errors[2];
    for (int b = 0; b < 2; b++)
        ck_assert_int_eq(em_test_push(tables[b], &batch, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    g[(KEYS - 3) * 6 + 4] = 1e35f; /* key KEYS - 3: its weight element 4 overflows */
    for (int b = 0; b < 2; b++) {
        em_test_snapshot before = em_test_snapshot_take(tables[b], 64);
        ck_assert_int_eq(em_test_push(tables[b], &batch, EM_COMBINER_NONE, g, NULL, &errors[b]),
                         EM_INVALID_ARGUMENT);
        em_test_assert_table_unchanged(tables[b], &before);
        em_test_snapshot_free(&before);
    }
    char expected[128];
    snprintf(expected, sizeof(expected), "key %" PRIu64 ": this sgd step would make weight "
             "element 4 non-finite", keys[KEYS - 3]);
    ck_assert_msg(strstr(errors[1].message, expected) != NULL, "%s", errors[1].message);
    ck_assert_str_eq(errors[1].message, errors[0].message);
    for (int b = 0; b < 2; b++)
        em_table_destroy(tables[b]);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

#ifdef EM_CUDA_EMULATED
/* What one request asks of the GPU, counted by the emulation: operations enqueued
 * (copies, fills, kernels) and host waits (stream and event synchronisations; a lane
 * known idle is not synchronised). Printed, and held at or
 * below the ceilings measured when this test was written, so a change that adds work
 * to a request fails here and one that removes some lowers the ceilings. 1,000 keys,
 * dim 16, adagrad, batches in malloc'ed memory, the table's shards on one GPU or spread
 * over two (a request of stored keys goes spread, as does one that creates them, once
 * the table's requests of its kind create: 34 operations and 1 wait for a pull, 31 and
 * 1 for a push, measured, against 65 and 4, and 84 and 4, the general way; the ceilings
 * leave room for the copy of the shards' view to each GPU, 2 operations). The first
 * request of a new table of several
 * shards copies its shards' view to the GPU; a lane that kept a view with the same
 * bytes (an earlier table's, at the same addresses) skips that copy, so the ceilings of
 * the fresh shapes of several shards count it. A table's first request that creates
 * keys adds its shards' first row blocks: it waited 2 times (1 shard) and 9 (8 shards)
 * while each shard's upload of its block tables was waited for. */
typedef struct request_shape {
    const char *what;
    uint32_t gpus, shards;
    bool push, fresh; /* fresh: keys not in the table yet (created) */
    bool again;       /* fresh, in a table where a pull of as many keys created them before */
    uint64_t operations, waits; /* ceilings */
    bool serve; /* a pull that creates nothing (create_missing false) */
} request_shape;

START_TEST(host_waits_and_operations_per_request)
{
    static const request_shape shapes[] = {
        {"pull, present keys", 1, 1, false, false, false, 11, 1, false},
        {"pull, creating", 1, 1, false, true, false, 16, 1, false},
        {"pull, creating again", 1, 1, false, true, true, 15, 1, false},
        {"push, present keys", 1, 1, true, false, false, 14, 1, false},
        {"push, creating", 1, 1, true, true, false, 18, 1, false},
        {"push, creating again", 1, 1, true, true, true, 17, 1, false},
        {"pull, present keys", 1, 8, false, false, false, 11, 1, false},
        {"pull, creating", 1, 8, false, true, false, 24, 1, false},
        {"pull, creating again", 1, 8, false, true, true, 15, 1, false},
        {"push, present keys", 1, 8, true, false, false, 14, 1, false},
        {"push, creating", 1, 8, true, true, false, 25, 1, false},
        {"push, creating again", 1, 8, true, true, true, 17, 1, false},
        {"pull, present keys", 2, 8, false, false, false, 28, 1, false},
        {"push, present keys", 2, 8, true, false, false, 29, 1, false},
        {"serve, present keys", 2, 8, false, false, false, 28, 1, true},
        {"pull, creating again", 2, 8, false, true, true, 36, 1, false},
        {"push, creating again", 2, 8, true, true, true, 33, 1, false},
    };
    enum { KEYS = 1000, DIM = 16 };
    em_backend *gpus[2] = {gpu_backend(1, GPU_POOL_BYTES, false),
                           gpu_backend(2, GPU_POOL_BYTES, false)};
    uint64_t *keys = malloc(KEYS * sizeof(uint64_t));
    uint32_t *offsets = malloc((KEYS + 1) * sizeof(uint32_t));
    float *vectors = malloc(KEYS * DIM * sizeof(float));
    for (uint32_t i = 0; i <= KEYS; i++)
        offsets[i] = i;
    for (uint32_t i = 0; i < KEYS * DIM; i++)
        vectors[i] = 0.01f;
    em_csr batch = {.rows = KEYS, .nnz = KEYS, .offsets = offsets, .keys = keys};
    em_error err;
    for (size_t k = 0; k < sizeof(shapes) / sizeof(shapes[0]); k++) {
        const request_shape *shape = &shapes[k];
        em_table_config config = table_config(DIM, 100000, shape->shards, EM_OPTIMIZER_ADAGRAD,
                                              EM_INIT_UNIFORM);
        em_table *table = em_test_make_table(gpus[shape->gpus - 1], &config);
        for (uint32_t i = 0; i < KEYS; i++)
            keys[i] = 7 * (uint64_t)i + 1;
        if (!shape->fresh) { /* the keys present first, then a request of the kind that
                              * finds them all (the steady state) */
            for (int warm = 0; warm < 2; warm++)
                ck_assert_int_eq(em_test_push(table, &batch, EM_COMBINER_NONE, vectors, NULL,
                                              &err),
                                 EM_OK);
            ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, false, vectors, NULL,
                                          &err),
                             EM_OK);
        }
        if (shape->again) { /* other keys created first by a request of the same kind:
                             * the table's pulls (pushes) create keys */
            for (uint32_t i = 0; i < KEYS; i++)
                keys[i] = 7 * (uint64_t)i + 2;
            ck_assert_int_eq(shape->push ? em_test_push(table, &batch, EM_COMBINER_NONE, vectors,
                                                        NULL, &err)
                                         : em_test_pull(table, &batch, EM_COMBINER_NONE, true,
                                                        vectors, NULL, &err),
                             EM_OK);
            for (uint32_t i = 0; i < KEYS; i++)
                keys[i] = 7 * (uint64_t)i + 1;
        }
        uint64_t operations = 0, waits = 0, operations_after = 0, waits_after = 0;
        em_gpu_emulated_counts(&operations, &waits);
        uint64_t transfers = em_gpu_emulated_transfers();
        em_status status =
            shape->push ? em_test_push(table, &batch, EM_COMBINER_NONE, vectors, NULL, &err)
                        : em_test_pull(table, &batch, EM_COMBINER_NONE, !shape->serve, vectors,
                                       NULL, &err);
        ck_assert_msg(status == EM_OK, "%s", err.message);
        em_gpu_emulated_counts(&operations_after, &waits_after);
        operations = operations_after - operations;
        waits = waits_after - waits;
        transfers = em_gpu_emulated_transfers() - transfers;
        printf("%-20s %u GPU(s), %u shard(s): %3" PRIu64 " operations (%2" PRIu64 " kernels, %2" PRIu64
               " copies and fills), %2" PRIu64 " host waits\n",
               shape->what, shape->gpus, shape->shards, operations, operations - transfers, transfers, waits);
        ck_assert_msg(operations <= shape->operations && waits <= shape->waits,
                      "%s, %u GPU(s), %u shard(s): %" PRIu64 " operations and %" PRIu64
                      " waits, more than the %" PRIu64 " and %" PRIu64 " measured before",
                      shape->what, shape->gpus, shape->shards, operations, waits, shape->operations,
                      shape->waits);
        em_table_destroy(table);
    }
    free(keys);
    free(offsets);
    free(vectors);
    em_backend_destroy(gpus[0]);
    em_backend_destroy(gpus[1]);
}
END_TEST

/* A request that evicts many rows reads the eviction's window of the GPU map (count x
 * candidates entries) with its access metadata in one pass (the walks of all of a
 * device's shards in the same few launches), erases the chosen rows without waiting
 * (where the GPU chose them, from where it wrote them), and its inserts settle with its
 * last wait: it waits for the GPU a few
 * times, not about 4 times per 4,096 entries. Here 8,192 new keys into a full lru table
 * of 32,768 rows on one shard, candidates 16 (the whole shard's 32,768 entries walked):
 * the push waits 4 times in all: its attempt beside other requests, which finds keys
 * missing and the table full; alone, the at-once attempt's find and check (of every
 * key, the missing ones as created), the window's 1 MiB (with the request's own rows,
 * which the eviction keeps) coming back into pinned memory, and the end, which the
 * inserts' settle waits for too. (50 when the walk was read a block at a time; 14 when
 * the window was read export by export, the request's rows on their own and the erase
 * waited; 6 while the inserts waited on their own, 5 while the general way checked the
 * rows again.) The rows left are the ones the rule keeps: the 8,192 keys pushed first, which no
 * request touched since, are the ones gone. Loop index 1: the table in 8 shards, whose
 * walks come back together, and whose attempt beside other requests stops once its find
 * at once says the table has no room for its keys: 6 waits (80 when each shard read its
 * walk export by export, 8 while that attempt looked its keys up again the general way);
 * each shard gives up its oldest rows, as many as its share of the room. Loop index 2:
 * the 8 shards over two GPUs, both GPUs' walks waited for at once, the finds' counts
 * coming back with the checks: 6 waits. Loop indices
 * 3 to 5: the same three tables, the new keys created by pulls instead, which have no
 * checks to wait for: 4, 5 and 7 waits (5, 8 and 7 before their inserts settled with
 * the last wait and the shared attempt stopped at its find at once; over two GPUs 6
 * before the pulls that fill the table created their keys spread, in one wait each:
 * the first that finds the table full tries spread too, and only finds). Four more such
 * requests follow; after 4 in a row that made room, the last goes alone first, without
 * the attempt beside other requests: 3, 4 and 4 waits for the pushes (the 8 shards'
 * checks come back with the walks), 3, 4 and 4 for the pulls. The first eviction of a
 * table also grows its shards' free row lists: one wait more on 8 shards. */
START_TEST(a_large_eviction_waits_a_few_times)
{
    enum { CAPACITY = 32768, BATCH = 8192, DIM = 8 };
    const uint32_t shards = _i % 3 == 0 ? 1 : 8, gpus = _i % 3 == 2 ? 2 : 1;
    const bool pulls = _i >= 3;
    if (visible_gpus() < gpus)
        return;
    em_backend *gpu = gpu_backend(gpus, GPU_POOL_BYTES, false);
    em_table_config config = table_config(DIM, CAPACITY, shards, EM_OPTIMIZER_SGD,
                                          EM_INIT_UNIFORM);
    config.eviction.policy = EM_EVICTION_LRU;
    config.eviction.candidates = 16;
    em_table *table = em_test_make_table(gpu, &config);
    uint64_t *keys = malloc(BATCH * sizeof(uint64_t));
    uint32_t *offsets = malloc((BATCH + 1) * sizeof(uint32_t));
    float *gradients = malloc((size_t)BATCH * DIM * sizeof(float));
    for (uint32_t i = 0; i <= BATCH; i++)
        offsets[i] = i;
    for (uint32_t i = 0; i < BATCH * DIM; i++)
        gradients[i] = 0.01f;
    em_csr batch = {.rows = BATCH, .nnz = BATCH, .offsets = offsets, .keys = keys};
    em_error err;
    enum { FULL_ROUND = CAPACITY / BATCH, ROUNDS = FULL_ROUND + 5 };
    uint64_t waits = 0, waits_first = 0, operations_alone = 0;
    for (uint64_t round = 0; round < ROUNDS; round++) {
        for (uint32_t i = 0; i < BATCH; i++)
            keys[i] = round * BATCH + i + 1;
        uint64_t operations = 0, before = 0, after = 0;
        uint64_t operations_before = 0;
        em_gpu_emulated_counts(&operations_before, &before);
        em_status status =
            pulls ? em_test_pull(table, &batch, EM_COMBINER_NONE, true, gradients, NULL, &err)
                  : em_test_push(table, &batch, EM_COMBINER_NONE, gradients, NULL, &err);
        ck_assert_msg(status == EM_OK, "%s", err.message);
        em_gpu_emulated_counts(&operations, &after);
        waits = after - before;
        operations_alone = operations - operations_before;
        if (round == FULL_ROUND)
            waits_first = waits;
        if (pulls) /* the pull wrote its rows there */
            for (uint32_t i = 0; i < BATCH * DIM; i++)
                gradients[i] = 0.01f;
    }
    printf("a %s of %d new keys evicting %d rows in %u shard(s) on %u GPU(s): %" PRIu64
           " host waits, %" PRIu64 " alone first (%" PRIu64 " operations)\n",
           pulls ? "pull" : "push", BATCH, BATCH, shards, gpus, waits_first, waits,
           operations_alone);
    /* by loop index: the first eviction, and one that goes alone first (its waits and
     * operations; the operations 72, 224, 229, 70, 205 and 210 while each shard's walk,
     * find and check took their own launches and the host copied the GPU's chosen keys
     * back to erase them; 66, 115, 135, 64, 109 and 126 while each byte of the GPU's
     * choice took a count and a fix; 50, 99, 119, 48, 93 and 110 while each shard's
     * erase, insert, step or gather and touch took launches of its own; 50, 60, 91, 48,
     * 54 and 82 while an lru choice counted every byte of the last accesses, where the
     * table's request clock, below 256 here, leaves 7 of them 0; 84 and 75 on two GPUs
     * while the rows the host chose took a copy and an erase a shard; 79 and 70 on two
     * GPUs while the host chose the second GPU's rows, whose windows held 16,340 entries,
     * under the 16,384 from which the GPU chose: it now chooses from 8,192, so every row
     * is chosen on the GPU, its passes there beside the first GPU's. The waits 3, 4, 4,
     * 3, 4 and 4 alone while a table of several shards on one GPU waited for its
     * partition's counts and then for its finds' (now unique_partition_find_async)) */
    static const uint64_t first_ceiling[6] = {4, 4, 5, 4, 4, 7};
    static const uint64_t alone_ceiling[6] = {3, 3, 4, 3, 3, 4};
    static const uint64_t alone_operations[6] = {43, 53, 94, 41, 47, 85};
    ck_assert_uint_le(waits_first, first_ceiling[_i]);
    ck_assert_uint_le(waits, alone_ceiling[_i]);
    ck_assert_uint_le(operations_alone, alone_operations[_i]);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, CAPACITY);
    ck_assert_uint_eq(stats.rows_evicted, (ROUNDS - FULL_ROUND) * BATCH);
    ck_assert_uint_eq(stats.rows_evicted_chosen_on_gpu, stats.rows_evicted);
    ck_assert_uint_eq(stats.exclusive_retries, 4);
    ck_assert_uint_eq(stats.requests_alone_first, 1);
    em_test_snapshot left = em_test_snapshot_take(table, 4096);
    ck_assert_uint_eq(left.count, CAPACITY);
    for (uint64_t i = 0; shards == 1 && i < left.count; i++)
        ck_assert_msg(left.keys[i] > (ROUNDS - FULL_ROUND) * BATCH, "key %" PRIu64 " stayed",
                      left.keys[i]);
    em_test_snapshot_free(&left);
    free(keys);
    free(offsets);
    free(gradients);
    em_table_destroy(table);
    em_backend_destroy(gpu);
}
END_TEST

/* A table of 2 shards over two GPUs (lru, capacity 64) filled with keys of shard 1 only:
 * a push of keys of shard 0 evicts the oldest rows of shard 1 (shard 0 holds none to
 * give), so the first GPU only takes the new keys while the second evicts (its
 * shards_evict_begin with one part). The rows left are the CPU backend's. */
START_TEST(a_gpu_that_only_takes_new_keys_while_another_evicts)
{
    enum { CAPACITY = 64, DIM = 4 };
    if (visible_gpus() < 2)
        return;
    em_backend *backends[2] = {cpu_backend(), gpu_backend(2, GPU_POOL_BYTES, false)};
    em_table_config config = table_config(DIM, CAPACITY, 2, EM_OPTIMIZER_SGD, EM_INIT_UNIFORM);
    config.eviction.policy = EM_EVICTION_LRU;
    config.eviction.candidates = 16;
    em_table *tables[2];
    uint64_t shard1[CAPACITY], shard0[8];
    uint32_t found1 = 0, found0 = 0;
    for (uint64_t key = 1; found1 < CAPACITY || found0 < 8; key++) {
        if (em_key_shard(key, 2) == 1 && found1 < CAPACITY)
            shard1[found1++] = key;
        else if (em_key_shard(key, 2) == 0 && found0 < 8)
            shard0[found0++] = key;
    }
    float gradients[CAPACITY * DIM];
    for (uint32_t i = 0; i < CAPACITY * DIM; i++)
        gradients[i] = 0.01f;
    em_error err;
    for (int k = 0; k < 2; k++) {
        tables[k] = em_test_make_table(backends[k], &config);
        for (uint32_t i = 0; i < CAPACITY; i++) { /* one a request: each its own access */
            em_test_batch one = em_test_key_batch(&shard1[i], 1);
            ck_assert_msg(em_test_push(tables[k], &one.csr, EM_COMBINER_NONE, gradients, NULL,
                                       &err) == EM_OK,
                          "%s", err.message);
            em_test_batch_free(&one);
        }
        em_test_batch b = em_test_key_batch(shard0, 8);
        ck_assert_msg(em_test_push(tables[k], &b.csr, EM_COMBINER_NONE, gradients, NULL, &err) ==
                          EM_OK,
                      "%s", err.message);
        em_test_batch_free(&b);
        em_table_stats stats;
        em_table_get_stats(tables[k], &stats);
        ck_assert_uint_eq(stats.rows, CAPACITY);
        ck_assert_uint_eq(stats.rows_evicted, 8);
    }
    em_test_snapshot left[2] = {em_test_snapshot_take(tables[0], 64),
                                em_test_snapshot_take(tables[1], 64)};
    ck_assert_uint_eq(left[0].count, left[1].count);
    ck_assert(memcmp(left[0].keys, left[1].keys, left[0].count * sizeof(uint64_t)) == 0);
    for (uint64_t i = 0; i < left[1].count; i++) /* the 8 oldest of shard 1 went */
        for (uint32_t v = 0; v < 8; v++)
            ck_assert_uint_ne(left[1].keys[i], shard1[v]);
    for (int k = 0; k < 2; k++) {
        em_test_snapshot_free(&left[k]);
        em_table_destroy(tables[k]);
        em_backend_destroy(backends[k]);
    }
}
END_TEST

#endif

/* A CPU table and a GPU table (on a backend of two GPUs) of the same config, n keys
 * created in both by one push, for requests compared side by side (twin_request). On a
 * machine with one GPU the GPU table's two devices share it (two_gpu_backend), so that
 * the requests of a table over two GPUs run on a GPU; only the emulation counts their
 * host waits. */
typedef struct twin {
    em_backend *cpu, *gpu;
    em_table *tables[2]; /* the CPU's, the GPU's */
    uint32_t n, dim;
    uint64_t *keys;
    float *gradients, *out[2];
    em_test_batch batch;
} twin;

/* A pull (into out[k]) or a push of every key on table k. */
static void twin_request(twin *t, int k, bool push)
{
    em_error err;
    em_status status =
        push ? em_test_push(t->tables[k], &t->batch.csr, EM_COMBINER_NONE, t->gradients, NULL,
                            &err)
             : em_test_pull(t->tables[k], &t->batch.csr, EM_COMBINER_NONE, false, t->out[k], NULL,
                            &err);
    ck_assert_msg(status == EM_OK, "%s", err.message);
}

/* A backend of two GPUs: GPUs 0 and 1, or, where one GPU is visible, two devices sharing
 * it (shared_gpus, with the host-staged exchange between them). */
static em_backend *two_gpu_backend(void)
{
    return visible_gpus() >= 2 ? gpu_backend(2, GPU_POOL_BYTES, false) : two_devices_on_one_gpu();
}

/* Whether a twin's host waits are counted and held to the counts of two GPUs that
 * exchange directly: on the emulated kernels with two GPUs visible, not on GPUs nor
 * where the twin's devices share one (its host-staged exchange waits for each copy). */
static bool waits_counted(void)
{
    return emulated && visible_gpus() >= 2;
}

/* A twin whose tables store a new key with that probability (admission `probability`;
 * a negative one: admission `always`) and evict by policy (none: no access tracked). */
static twin twin_make_with(uint32_t shards, uint32_t n, uint32_t dim, double probability,
                           em_eviction_policy policy)
{
    twin t = {.cpu = cpu_backend(), .gpu = two_gpu_backend(), .n = n, .dim = dim};
    em_table_config config = table_config(dim, 100000, shards, EM_OPTIMIZER_ADAGRAD,
                                          EM_INIT_UNIFORM);
    if (probability >= 0) {
        config.admission.policy = EM_ADMISSION_PROBABILITY;
        config.admission.probability = probability;
    }
    config.eviction.policy = policy;
    t.tables[0] = em_test_make_table(t.cpu, &config);
    t.tables[1] = em_test_make_table(t.gpu, &config);
    t.keys = malloc(n * sizeof(uint64_t));
    for (uint32_t i = 0; i < n; i++)
        t.keys[i] = 13 * (uint64_t)i + 5;
    t.gradients = malloc((size_t)n * dim * sizeof(float));
    for (uint32_t i = 0; i < n * dim; i++)
        t.gradients[i] = 0.001f * (float)(i % 97) - 0.04f;
    for (int k = 0; k < 2; k++)
        t.out[k] = malloc((size_t)n * dim * sizeof(float));
    t.batch = em_test_key_batch(t.keys, n);
    for (int k = 0; k < 2; k++) /* the keys created */
        twin_request(&t, k, true);
    return t;
}

static twin twin_make_admitting(uint32_t shards, uint32_t n, uint32_t dim, double probability)
{
    return twin_make_with(shards, n, dim, probability, EM_EVICTION_NONE);
}

static twin twin_make(uint32_t shards, uint32_t n, uint32_t dim)
{
    return twin_make_admitting(shards, n, dim, -1.0);
}

/* The last pulls of both tables gave the same bits. */
static void twin_assert_pulls_equal(const twin *t)
{
    ck_assert(memcmp(t->out[0], t->out[1], (size_t)t->n * t->dim * sizeof(float)) == 0);
}

static void twin_free(twin *t)
{
    em_test_batch_free(&t->batch);
    free(t->out[0]);
    free(t->out[1]);
    free(t->gradients);
    free(t->keys);
    em_table_destroy(t->tables[0]);
    em_table_destroy(t->tables[1]);
    em_backend_destroy(t->cpu);
    em_backend_destroy(t->gpu);
}

#ifdef EM_CUDA_EMULATED
/* A table whose shards all live on one GPU of several is served on that GPU: every
 * request, whichever GPU the backend's turn would make its home, finds and steps its
 * keys there with one host wait and no exchange (before, every other request was homed
 * on the other GPU and went the general way: 4 waits for a pull). Its answers match
 * a CPU table's. */
START_TEST(a_table_on_one_gpu_of_two_is_served_there)
{
    twin t = twin_make(1, 500, 8);
    for (int request = 0; request < 6; request++) { /* the steady state */
        bool push = request % 2 == 1;
        uint64_t operations = 0, waits = 0, waits_after = 0;
        twin_request(&t, 0, push);
        em_gpu_emulated_counts(&operations, &waits);
        twin_request(&t, 1, push);
        em_gpu_emulated_counts(&operations, &waits_after);
        ck_assert_msg(waits_after - waits == 1, "request %d (%s): %" PRIu64 " host waits", request,
                      push ? "push" : "pull", waits_after - waits);
        if (!push)
            twin_assert_pulls_equal(&t);
    }
    em_table_stats stats;
    em_table_get_stats(t.tables[1], &stats);
    ck_assert_uint_eq(stats.rows, t.n);
    twin_free(&t);
}
END_TEST

/* A table whose shards are on two GPUs: a request looks its keys up (and a push checks
 * its steps) on both GPUs before it waits, and then waits for both in one round trip
 * (em_gpu_streams_synchronize). A pull or a push of stored keys goes spread (table.c:
 * pull_spread, push_spread): the home GPU puts each GPU's keys in a bucket on the GPU,
 * and the request waits once, for both GPUs, the pull with its output. Counted by the
 * emulation: a pull's 1 wait and a push's 1 are for both GPUs at once, a pull that
 * creates nothing waits as a pull does (the general way's push:
 * pushes_spread_over_two_gpus_match_cpu). The answers equal the CPU's, the missing
 * count of a pull that creates nothing (which comes back with the answer) too. */
START_TEST(a_table_over_two_gpus_finds_and_checks_on_both_at_once)
{
    static const char *const kinds[] = {"pull", "push", "pull creating nothing"};
    static const uint64_t joint_waits[] = {1, 1, 1}, all_waits[] = {1, 1, 1};
    twin t = twin_make(8, 800, 8);
    for (int k = 0; k < 2; k++) /* a push that finds every key: the next need not find first */
        twin_request(&t, k, true);
    for (int request = 0; request < 6; request++) {
        int kind = request % 3;
        bool push = kind == 1;
        twin_request(&t, 0, push);
        uint64_t joint = em_gpu_emulated_joint_waits(), waits = 0, operations = 0;
        em_gpu_emulated_counts(&operations, &waits);
        uint64_t waits_before = waits;
        em_error err;
        em_status status = kind == 0 ? em_test_pull(t.tables[1], &t.batch.csr, EM_COMBINER_NONE,
                                                    true, t.out[1], NULL, &err)
                           : push    ? em_test_push(t.tables[1], &t.batch.csr, EM_COMBINER_NONE,
                                                    t.gradients, NULL, &err)
                                     : em_test_pull(t.tables[1], &t.batch.csr, EM_COMBINER_NONE,
                                                    false, t.out[1], NULL, &err);
        ck_assert_msg(status == EM_OK, "%s", err.message);
        joint = em_gpu_emulated_joint_waits() - joint;
        em_gpu_emulated_counts(&operations, &waits);
        waits -= waits_before;
        printf("two GPUs, %s of present keys: %" PRIu64 " host waits, %" PRIu64 " of them for "
               "both GPUs at once\n", kinds[kind], waits, joint);
        ck_assert_msg(joint == joint_waits[kind] && waits == all_waits[kind],
                      "request %d (%s): %" PRIu64 " waits, %" PRIu64 " for both GPUs at once",
                      request, kinds[kind], waits, joint);
        if (!push)
            twin_assert_pulls_equal(&t);
    }
    /* a pull that creates nothing, of keys half of which are absent: its missing count
     * comes back with its answer, and absent keys read as zeros */
    uint64_t *mixed = malloc(t.n * sizeof(uint64_t));
    for (uint32_t i = 0; i < t.n; i++)
        mixed[i] = i % 2 == 0 ? t.keys[i] : 1000003 * (uint64_t)i + 7;
    em_test_batch half = em_test_key_batch(mixed, t.n);
    em_pull_result results[2];
    em_error err;
    for (int k = 0; k < 2; k++)
        ck_assert_msg(em_test_pull(t.tables[k], &half.csr, EM_COMBINER_NONE, false, t.out[k],
                                   &results[k], &err) == EM_OK,
                      "%s", err.message);
    ck_assert_uint_eq(results[0].missing, t.n / 2);
    ck_assert_uint_eq(results[1].missing, results[0].missing);
    ck_assert_uint_eq(results[1].unique_keys, results[0].unique_keys);
    twin_assert_pulls_equal(&t);
    em_test_batch_free(&half);
    free(mixed);
    assert_tables_alike(t.tables[0], t.tables[1], 64, 0);
    twin_free(&t);
}
END_TEST
#endif

/* Pulls (creating nothing) of keys[0..nnz) in rows of row_length[i] keys on both twin
 * tables with combiner; the same bits out of both, and the GPU table's host waits and
 * pulls at once come back. */
static void twin_pull_rows(const twin *t, const uint64_t *keys, uint64_t nnz,
                           const uint32_t *offsets, uint32_t rows, em_combiner combiner,
                           uint64_t *waits, uint64_t *at_once)
{
    em_csr batch = {.rows = rows, .nnz = nnz, .offsets = offsets, .keys = keys};
    uint64_t floats = (combiner == EM_COMBINER_NONE ? nnz : rows) * t->dim;
    float *out[2] = {malloc(floats * sizeof(float)), malloc(floats * sizeof(float))};
    em_table_stats before, after;
    em_table_get_stats(t->tables[1], &before);
    uint64_t waits_before = 0;
    em_pull_result results[2];
    for (int k = 0; k < 2; k++) {
        if (k == 1)
            waits_before = emulated_waits();
        em_error err;
        em_status status = em_test_pull(t->tables[k], &batch, combiner, false, out[k],
                                        &results[k], &err);
        ck_assert_msg(status == EM_OK, "%s", err.message);
        ck_assert_uint_eq(results[k].missing, 0);
    }
    ck_assert_uint_eq(results[1].unique_keys, results[0].unique_keys);
    *waits = emulated_waits() - waits_before;
    em_table_get_stats(t->tables[1], &after);
    *at_once = after.pulls_at_once - before.pulls_at_once;
    for (uint64_t i = 0; i < floats; i++)
        ck_assert_msg(memcmp(&out[0][i], &out[1][i], sizeof(float)) == 0,
                      "combiner %d, float %" PRIu64 ": %a on the CPU, %a over two GPUs",
                      (int)combiner, i, (double)out[0][i], (double)out[1][i]);
    free(out[0]);
    free(out[1]);
}

/* rows rows of 0 to 5 of the twin's keys (row i: i mod 6 of them), with repeats within
 * and across rows, into keys and offsets; returns their count. */
static uint64_t rows_with_repeats(const twin *t, uint32_t rows, uint64_t *keys,
                                  uint32_t *offsets)
{
    uint64_t nnz = 0;
    offsets[0] = 0;
    for (uint32_t i = 0; i < rows; i++) {
        for (uint32_t j = 0; j < i % 6; j++)
            keys[nnz++] = t->keys[(7 * i + 13 * j) % 97];
        offsets[i + 1] = (uint32_t)nnz;
    }
    return nnz;
}

/* The twin's keys on the second GPU's shards (4 to 7 of 8), a row each; returns their
 * count. */
static uint64_t second_gpu_keys(const twin *t, uint64_t *keys, uint32_t *offsets)
{
    uint64_t nnz = 0;
    for (uint32_t i = 0; i < t->n; i++)
        if (em_key_shard(t->keys[i], 8) >= 4)
            keys[nnz++] = t->keys[i];
    for (uint64_t i = 0; i <= nnz; i++)
        offsets[i] = (uint32_t)i;
    return nnz;
}

/* Pulls of stored keys spread over two GPUs (table.c: pull_spread) answer what the CPU
 * answers, bit for bit, and wait once: rows of 0 to 5 keys with repeats, with each
 * combiner; keys all on the second GPU's shards, twice (so that each GPU is home once,
 * one of them with an empty bucket of its own); a single key (fewer keys than GPUs). A
 * pull whose buckets and vectors would pass the spread's bound (250,000 keys of dim 8:
 * 10 MB) goes the general way, and answers the same. */
START_TEST(pulls_spread_over_two_gpus_match_cpu)
{
    twin t = twin_make(8, 800, 8);
    enum { ROWS = 300, LARGE = 250000 };
    uint64_t *keys = malloc(LARGE * sizeof(uint64_t));
    uint32_t *offsets = malloc((LARGE + 1) * sizeof(uint32_t));
    uint64_t nnz = rows_with_repeats(&t, ROWS, keys, offsets), waits = 0, at_once = 0;
    for (int c = EM_COMBINER_NONE; c <= EM_COMBINER_SQRTN; c++) {
        twin_pull_rows(&t, keys, nnz, offsets, ROWS, (em_combiner)c, &waits, &at_once);
        ck_assert(!waits_counted() || waits == 1);
        ck_assert_uint_eq(at_once, 1);
    }
    nnz = second_gpu_keys(&t, keys, offsets);
    for (int home = 0; home < 2; home++) {
        twin_pull_rows(&t, keys, nnz, offsets, (uint32_t)nnz, EM_COMBINER_NONE, &waits,
                       &at_once);
        ck_assert(!waits_counted() || waits == 1);
        ck_assert_uint_eq(at_once, 1);
    }
    twin_pull_rows(&t, &t.keys[5], 1, offsets, 1, EM_COMBINER_SUM, &waits, &at_once);
    ck_assert(!waits_counted() || waits == 1);
    ck_assert_uint_eq(at_once, 1);
    for (uint32_t i = 0; i < LARGE; i++) {
        keys[i] = t.keys[(uint64_t)i * 31 % t.n];
        offsets[i + 1] = i + 1;
    }
    twin_pull_rows(&t, keys, LARGE, offsets, LARGE, EM_COMBINER_NONE, &waits, &at_once);
    ck_assert(!waits_counted() || waits > 1);
    ck_assert_uint_eq(at_once, 0);
    free(keys);
    free(offsets);
    twin_free(&t);
}
END_TEST

/* Pushes of keys[0..nnz) in rows of row_length[i] keys to both twin tables with
 * combiner (gradients a row's or a key's, by the combiner); the GPU table's host waits
 * and pushes at once come back, and its answer equals the CPU's. */
static void twin_push_rows(const twin *t, const uint64_t *keys, uint64_t nnz,
                           const uint32_t *offsets, uint32_t rows, em_combiner combiner,
                           uint64_t *waits, uint64_t *at_once)
{
    em_csr batch = {.rows = rows, .nnz = nnz, .offsets = offsets, .keys = keys};
    uint64_t floats = (combiner == EM_COMBINER_NONE ? nnz : rows) * t->dim;
    float *gradients = malloc(floats * sizeof(float));
    for (uint64_t i = 0; i < floats; i++)
        gradients[i] = 0.001f * (float)(i % 89) - 0.043f;
    em_table_stats before, after;
    em_table_get_stats(t->tables[1], &before);
    uint64_t waits_before = 0;
    em_push_result results[2];
    for (int k = 0; k < 2; k++) {
        if (k == 1)
            waits_before = emulated_waits();
        em_error err;
        em_status status = em_test_push(t->tables[k], &batch, combiner, gradients, &results[k],
                                        &err);
        ck_assert_msg(status == EM_OK, "%s", err.message);
    }
    *waits = emulated_waits() - waits_before;
    em_table_get_stats(t->tables[1], &after);
    *at_once = after.pushes_at_once - before.pushes_at_once;
    ck_assert_uint_eq(results[1].updated, results[0].updated);
    ck_assert_uint_eq(results[1].created, results[0].created);
    free(gradients);
}

/* Pushes of stored keys spread over two GPUs (table.c: push_spread) step what the CPU
 * steps, bit for bit, and wait once: rows of 0 to 5 keys with repeats (a key's gradients
 * summed on the home GPU), with each combiner; keys all on the second GPU's shards,
 * twice (each GPU home once, one of them with an empty bucket of its own); a single key.
 * A push with a key missing steps nothing on either GPU and goes the general way, which
 * creates it; one whose step would break a row on the second GPU steps nothing on the
 * first either, and is refused with the CPU's message. A push past the spread's bound
 * goes the general way. The rows of both tables agree throughout. */
START_TEST(pushes_spread_over_two_gpus_match_cpu)
{
    twin t = twin_make(8, 800, 8);
    for (int k = 0; k < 2; k++) /* a push that finds every key: the next go spread */
        twin_request(&t, k, true);
    enum { ROWS = 300, LARGE = 250000 };
    uint64_t *keys = malloc(LARGE * sizeof(uint64_t));
    uint32_t *offsets = malloc((LARGE + 1) * sizeof(uint32_t));
    uint64_t nnz = rows_with_repeats(&t, ROWS, keys, offsets), waits = 0, at_once = 0;
    for (int c = EM_COMBINER_NONE; c <= EM_COMBINER_SQRTN; c++) {
        twin_push_rows(&t, keys, nnz, offsets, ROWS, (em_combiner)c, &waits, &at_once);
        ck_assert(!waits_counted() || waits == 1);
        ck_assert_uint_eq(at_once, 1);
    }
    assert_tables_alike(t.tables[0], t.tables[1], 64, 0);
    nnz = second_gpu_keys(&t, keys, offsets);
    for (int home = 0; home < 2; home++) {
        twin_push_rows(&t, keys, nnz, offsets, (uint32_t)nnz, EM_COMBINER_NONE, &waits,
                       &at_once);
        ck_assert(!waits_counted() || waits == 1);
        ck_assert_uint_eq(at_once, 1);
    }
    twin_push_rows(&t, &t.keys[5], 1, offsets, 1, EM_COMBINER_SUM, &waits, &at_once);
    ck_assert(!waits_counted() || waits == 1);
    ck_assert_uint_eq(at_once, 1);
    assert_tables_alike(t.tables[0], t.tables[1], 64, 0);
    /* one key new, on the first GPU's shards: nothing stepped there or on the second;
     * the general way creates it. The table's pushes create since (pushes_create): a
     * push with a key new on the second GPU's shards creates it spread, in one wait; so
     * does the next push of stored keys (room made, nothing absent), which stops the
     * creating; and the next goes spread, creating nothing. */
    for (int pass = 0; pass < 4; pass++) {
        nnz = 0;
        for (uint64_t k = 1000003 + 1000 * (uint64_t)pass; pass < 2 && nnz == 0; k += 2)
            if ((em_key_shard(k, 8) < 4) == (pass == 0))
                keys[nnz++] = k;
        for (uint32_t i = 0; i < 200; i++)
            keys[nnz++] = t.keys[i];
        em_table_stats before, after;
        em_table_get_stats(t.tables[1], &before);
        uint64_t joint = emulated_joint_waits();
        twin_push_rows(&t, keys, nnz, offsets, (uint32_t)nnz, EM_COMBINER_NONE, &waits,
                       &at_once);
        joint = emulated_joint_waits() - joint;
        em_table_get_stats(t.tables[1], &after);
        ck_assert_uint_eq(at_once, pass > 0);
        ck_assert_uint_eq(after.rows_created - before.rows_created, pass < 2);
        ck_assert(!waits_counted() || pass == 0 || (waits == 1 && joint == 1));
        assert_tables_alike(t.tables[0], t.tables[1], 64, 0);
    }
    /* a step that would overflow a row on the second GPU's shards only */
    uint32_t victim = 0;
    while (em_key_shard(t.keys[victim], 8) < 4)
        victim++;
    em_csr batch = {.rows = 100, .nnz = 100, .offsets = offsets, .keys = t.keys};
    float *g = calloc(100 * t.dim, sizeof(float));
    ck_assert_uint_lt(victim, 100);
    g[victim * t.dim + 3] = 3e38f;
    em_error errors[2];
    for (int k = 0; k < 2; k++) {
        em_test_snapshot before = em_test_snapshot_take(t.tables[k], 64);
        em_table_stats stats;
        em_table_get_stats(t.tables[k], &stats);
        uint64_t pushed_at_once = stats.pushes_at_once;
        ck_assert_int_eq(em_test_push(t.tables[k], &batch, EM_COMBINER_NONE, g, NULL, &errors[k]),
                         EM_INVALID_ARGUMENT);
        em_test_assert_table_unchanged(t.tables[k], &before);
        em_test_snapshot_free(&before);
        em_table_get_stats(t.tables[k], &stats);
        ck_assert_uint_eq(stats.pushes_at_once, pushed_at_once);
    }
    ck_assert_str_eq(errors[1].message, errors[0].message);
    free(g);
    for (uint32_t i = 0; i < LARGE; i++) {
        keys[i] = t.keys[(uint64_t)i * 31 % t.n];
        offsets[i + 1] = i + 1;
    }
    twin_push_rows(&t, keys, LARGE, offsets, LARGE, EM_COMBINER_NONE, &waits, &at_once);
    ck_assert(!waits_counted() || waits > 1);
    ck_assert_uint_eq(at_once, 0);
    assert_tables_alike(t.tables[0], t.tables[1], 64, 0);
    free(keys);
    free(offsets);
    twin_free(&t);
}
END_TEST

/* A table over two GPUs that tracks access (eviction lru): pulls and pushes of stored
 * keys go spread too, with one wait, every GPU's missing count (and a push's checks)
 * sent to every other, each touching (a push: stepping) its rows only if no GPU found a
 * key missing. The rows' access metadata (last access, last update, frequency) equals
 * the CPU table's after each kind of request: so a spread request that found a key
 * missing on one GPU touched nothing on the other before going the general way (which
 * touches once: a second touch would count twice in the frequency). */
START_TEST(spread_requests_touch_rows_as_the_cpu_does)
{
    twin t = twin_make_with(8, 600, 8, -1.0, EM_EVICTION_LRU);
    twin_request(&t, 0, true);
    twin_request(&t, 1, true); /* finds every key: the next go spread */
    uint64_t nnz = 0, waits = 0, at_once = 0;
    uint64_t *keys = malloc(t.n * sizeof(uint64_t));
    uint32_t *offsets = malloc((t.n + 1) * sizeof(uint32_t));
    for (uint32_t i = 0; i <= t.n; i++)
        offsets[i] = i;
    for (uint32_t i = 0; i < t.n; i += 3)
        keys[nnz++] = t.keys[i];
    for (int round = 0; round < 3; round++) {
        twin_pull_rows(&t, t.keys, t.n, offsets, t.n, EM_COMBINER_NONE, &waits, &at_once);
        ck_assert(!waits_counted() || waits == 1);
        ck_assert_uint_eq(at_once, 1);
        twin_push_rows(&t, keys, nnz, offsets, (uint32_t)nnz, EM_COMBINER_SUM, &waits,
                       &at_once);
        ck_assert(!waits_counted() || waits == 1);
        ck_assert_uint_eq(at_once, 1);
        twin_pull_rows(&t, keys, nnz, offsets, (uint32_t)nnz, EM_COMBINER_MEAN, &waits,
                       &at_once);
        ck_assert(!waits_counted() || waits == 1);
        ck_assert_uint_eq(at_once, 1);
        assert_access_equal(t.tables[0], t.tables[1]);
    }
    /* a key missing, on the first GPU's shards: a pull that creates nothing, then a push
     * (which creates it) */
    uint64_t absent = 5000001;
    while (em_key_shard(absent, 8) >= 4)
        absent += 2;
    keys[0] = absent;
    for (int push = 0; push < 2; push++) {
        em_csr batch = {.rows = (uint32_t)nnz, .nnz = nnz, .offsets = offsets, .keys = keys};
        for (int k = 0; k < 2; k++) {
            em_error err;
            em_status status =
                push ? em_test_push(t.tables[k], &batch, EM_COMBINER_NONE, t.gradients, NULL,
                                    &err)
                     : em_test_pull(t.tables[k], &batch, EM_COMBINER_NONE, false, t.out[k], NULL,
                                    &err);
            ck_assert_msg(status == EM_OK, "%s", err.message);
        }
        assert_access_equal(t.tables[0], t.tables[1]);
    }
    assert_tables_alike(t.tables[0], t.tables[1], 64, 0);
    free(keys);
    free(offsets);
    twin_free(&t);
}
END_TEST

/* Which keys rows_of_new_keys puts in its rows. */
typedef enum new_keys {
    A_THIRD_NEW,    /* about a third new (from fresh, repeated), the rest the twin's */
    SECOND_GPU_NEW, /* all new, repeated, on the second GPU's shards (4 to 7 of 8) */
    NONE_NEW,       /* the twin's keys only */
} new_keys;

/* rows rows of 0 to 5 keys (row i: i mod 6 of them), with repeats within and across
 * rows, into keys and offsets; returns their count. */
static uint64_t rows_of_new_keys(const twin *t, uint32_t rows, new_keys which, uint64_t fresh,
                                 uint64_t *keys, uint32_t *offsets)
{
    uint64_t nnz = 0;
    offsets[0] = 0;
    for (uint32_t i = 0; i < rows; i++) {
        for (uint32_t j = 0; j < i % 6; j++) {
            uint64_t key = t->keys[(7 * i + 13 * j) % t->n];
            if (which == SECOND_GPU_NEW) {
                key = fresh + (i * 7 + j) % 97;
                while (em_key_shard(key, 8) < 4)
                    key += 1000;
            } else if (which == A_THIRD_NEW && (i + j) % 3 == 0) {
                key = fresh + (i * 7 + j) % 97;
            }
            keys[nnz++] = key;
        }
        offsets[i + 1] = (uint32_t)nnz;
    }
    return nnz;
}

/* The twin's tables hold as many rows, created as many, and (access) their rows' access
 * metadata is the same; gpu: the GPU table's stats. */
static void twin_assert_counts_alike(const twin *t, const em_table_stats *gpu, bool access)
{
    em_table_stats cpu;
    em_table_get_stats(t->tables[0], &cpu);
    ck_assert_uint_eq(gpu->rows, cpu.rows);
    ck_assert_uint_eq(gpu->rows_created, cpu.rows_created);
    if (access)
        assert_access_equal(t->tables[0], t->tables[1]);
}

/* Pulls that create keys, of a table over two GPUs (table.c: pull_spread creating): a
 * new table's pulls, and a table's pulls once one found keys absent that it could have
 * created, create theirs spread, each GPU inserting the keys of its own shards, in one
 * wait. Rows of 0 to 5 keys with repeats, about a third of them new: the first pull,
 * then one with each combiner; then new keys on the second GPU's shards only (the first
 * GPU's bucket empty); stored keys only, which stops the creating (absent none); so a
 * third new again goes spread only to find them (changing nothing), then the general
 * way, which creates them (or, not waiting for its finds, goes again, creating spread),
 * and the next pulls create spread again. Every answer
 * (output bits, distinct, missing and created counts), the rows and their values equal
 * the CPU table's. Loop index 1: a table that tracks access (lru), whose creating pulls
 * touch every row on each GPU without waiting for the other's answer; the access
 * metadata equals the CPU's too. */
START_TEST(pulls_creating_spread_over_two_gpus_match_cpu)
{
    twin t = twin_make_with(8, 600, 8, -1.0, _i == 1 ? EM_EVICTION_LRU : EM_EVICTION_NONE);
    enum { ROWS = 400 };
    uint64_t *keys = malloc(6 * ROWS * sizeof(uint64_t));
    uint32_t *offsets = malloc((ROWS + 1) * sizeof(uint32_t));
    uint64_t fresh = 7000001;
    for (int pass = 0; pass < 9; pass++) {
        /* passes 0-4: a third new (1-4: each combiner); 5: new keys of the second GPU
         * only; 6: stored keys only; 7 and 8: a third new again */
        em_combiner combiner = pass >= 1 && pass <= 4 ? (em_combiner)(pass - 1)
                                                      : EM_COMBINER_NONE;
        bool spread = pass != 7; /* at once, in one wait */
        new_keys which = pass == 5 ? SECOND_GPU_NEW : pass == 6 ? NONE_NEW : A_THIRD_NEW;
        uint64_t nnz = rows_of_new_keys(&t, ROWS, which, fresh, keys, offsets);
        fresh += 100000;
        em_csr batch = {.rows = ROWS, .nnz = nnz, .offsets = offsets, .keys = keys};
        uint64_t floats = (combiner == EM_COMBINER_NONE ? nnz : ROWS) * t.dim;
        float *out[2] = {malloc(floats * sizeof(float)), malloc(floats * sizeof(float))};
        em_pull_result results[2];
        em_table_stats before, after;
        em_table_get_stats(t.tables[1], &before);
        uint64_t waits = 0;
        for (int k = 0; k < 2; k++) {
            uint64_t waits_before = emulated_waits();
            em_error err;
            ck_assert_msg(em_test_pull(t.tables[k], &batch, combiner, true, out[k], &results[k],
                                       &err) == EM_OK,
                          "%s", err.message);
            waits = emulated_waits() - waits_before;
        }
        em_table_get_stats(t.tables[1], &after);
        printf("two GPUs, creating pull %d: %" PRIu64 " created, %" PRIu64 " host waits, %"
               PRIu64 " at once\n", pass, results[1].created, waits,
               after.pulls_at_once - before.pulls_at_once);
        ck_assert_uint_eq(results[1].unique_keys, results[0].unique_keys);
        ck_assert_uint_eq(results[1].missing, results[0].missing);
        ck_assert_uint_eq(results[1].created, results[0].created);
        ck_assert(pass == 6 ? results[0].created == 0 : results[0].created > 0);
        /* pass 7's general way, not waiting for its finds where the table tracks no
         * access, finds keys missing and goes again: spread, creating */
        ck_assert_uint_eq(after.pulls_at_once - before.pulls_at_once, spread || _i == 0);
        ck_assert(!waits_counted() || !spread || waits == 1);
        for (uint64_t i = 0; i < floats; i++)
            ck_assert_msg(memcmp(&out[0][i], &out[1][i], sizeof(float)) == 0,
                          "pass %d, float %" PRIu64 ": %a on the CPU, %a over two GPUs", pass, i,
                          (double)out[0][i], (double)out[1][i]);
        free(out[0]);
        free(out[1]);
        twin_assert_counts_alike(&t, &after, _i == 1);
    }
    assert_tables_alike(t.tables[0], t.tables[1], 64, 0);
    free(keys);
    free(offsets);
    twin_free(&t);
}
END_TEST

/* Pushes that create keys, of a table over two GPUs (table.c: push_spread creating): a
 * new table's pushes, and a table's pushes once one found keys absent that it could have
 * created, create theirs spread: each GPU finds and checks its keys (the absent ones as
 * created), every GPU's answers go to every other, and each inserts its absent keys and
 * steps them from their initial values only if no GPU's check found a problem; one
 * wait. Rows of 0 to 5 keys with repeats, about a third of them new, with each combiner;
 * then a push whose step would break a stored row on the second GPU, beside new keys
 * on both: refused with the CPU's words, nothing created or stepped on either GPU (the
 * rows and their count unchanged); then the same push put right. Every answer, the rows
 * and their values equal the CPU table's. Loop index 1: a table that tracks access
 * (lru); the access metadata equals the CPU's too, after the refused push as well,
 * whose general way, not waiting for its finds, goes again on the GPUs (a request's
 * attempts take one value of the access clock: em__request_begin_stamped). */
START_TEST(pushes_creating_spread_over_two_gpus_match_cpu)
{
    twin t = twin_make_with(8, 600, 8, -1.0, _i == 1 ? EM_EVICTION_LRU : EM_EVICTION_NONE);
    enum { ROWS = 400 };
    uint64_t *keys = malloc(6 * ROWS * sizeof(uint64_t));
    uint32_t *offsets = malloc((ROWS + 1) * sizeof(uint32_t));
    float *g = malloc(6 * ROWS * t.dim * sizeof(float));
    uint64_t fresh = 9000001;
    for (int pass = 0; pass < 6; pass++) {
        /* passes 0-3: each combiner; 4: a step that breaks a row; 5: put right */
        em_combiner combiner = pass < 4 ? (em_combiner)pass : EM_COMBINER_NONE;
        uint64_t nnz = rows_of_new_keys(&t, ROWS, A_THIRD_NEW, fresh, keys, offsets);
        if (pass != 4)
            fresh += 100000;
        uint64_t floats = (combiner == EM_COMBINER_NONE ? nnz : ROWS) * t.dim;
        for (uint64_t i = 0; i < floats; i++)
            g[i] = 0.001f * (float)(i % 89) - 0.043f;
        uint64_t victim = 0; /* a stored key on the second GPU's shards */
        while (keys[victim] >= 9000001 || em_key_shard(keys[victim], 8) < 4)
            victim++;
        if (pass == 4)
            g[victim * t.dim + 3] = 3e38f; /* its adagrad state would overflow */
        em_csr batch = {.rows = ROWS, .nnz = nnz, .offsets = offsets, .keys = keys};
        em_push_result results[2];
        em_error errors[2];
        em_table_stats before, after;
        em_table_get_stats(t.tables[1], &before);
        uint64_t waits = 0;
        for (int k = 0; k < 2; k++) {
            em_test_snapshot rows = em_test_snapshot_take(t.tables[k], 64);
            uint64_t waits_before = emulated_waits();
            em_status status = em_test_push(t.tables[k], &batch, combiner, g, &results[k],
                                            &errors[k]);
            waits = emulated_waits() - waits_before;
            if (pass == 4) {
                ck_assert_int_eq(status, EM_INVALID_ARGUMENT);
                em_test_assert_table_unchanged(t.tables[k], &rows);
            } else {
                ck_assert_msg(status == EM_OK, "%s", errors[k].message);
            }
            em_test_snapshot_free(&rows);
        }
        em_table_get_stats(t.tables[1], &after);
        printf("two GPUs, creating push %d: %" PRIu64 " created, %" PRIu64 " host waits, %"
               PRIu64 " at once\n", pass, pass == 4 ? 0 : results[1].created, waits,
               after.pushes_at_once - before.pushes_at_once);
        if (pass == 4) {
            ck_assert_str_eq(errors[1].message, errors[0].message);
        } else {
            ck_assert_uint_eq(results[1].updated, results[0].updated);
            ck_assert_uint_eq(results[1].created, results[0].created);
            ck_assert_uint_gt(results[0].created, 0);
            ck_assert_uint_eq(after.pushes_at_once - before.pushes_at_once, 1);
            ck_assert(!waits_counted() || waits == 1);
        }
        twin_assert_counts_alike(&t, &after, _i == 1);
    }
    assert_tables_alike(t.tables[0], t.tables[1], 64, 0);
    free(g);
    free(keys);
    free(offsets);
    twin_free(&t);
}
END_TEST

/* A table of 3 shards over two GPUs holds shards 0 and 1 on the first, 2 on the second:
 * the first GPU's kernels would take a key's shard to be its hash mod 2, which is not
 * the table's (mod 3), so its requests never go spread (table.c: spread_of), where
 * they would find keys missing every time and go again: pulls and pushes of stored
 * keys go the general way, each waiting as the one before, and answer as the CPU. */
START_TEST(a_table_of_three_shards_over_two_gpus_goes_the_general_way)
{
    twin t = twin_make(3, 600, 8);
    uint64_t waits[2][4], at_once = 0;
    for (int request = 0; request < 4; request++)
        for (int push = 0; push < 2; push++) {
            twin_request(&t, 0, push);
            uint64_t before = emulated_waits();
            twin_request(&t, 1, push);
            waits[push][request] = emulated_waits() - before;
            if (!push)
                twin_assert_pulls_equal(&t);
            if (request > 0)
                ck_assert_uint_eq(waits[push][request], waits[push][request - 1]);
        }
    em_table_stats stats;
    em_table_get_stats(t.tables[1], &stats);
    at_once = stats.pulls_at_once + stats.pushes_at_once;
    ck_assert_uint_eq(at_once, 0);
    assert_tables_alike(t.tables[0], t.tables[1], 64, 0);
    twin_free(&t);
}
END_TEST

/* A pull (create_missing) or a push of batch on both twin tables, into pulls[k] or
 * pushes[k]; returns the host waits of the GPU table's request. */
static uint64_t twin_counted(twin *t, const em_csr *batch, bool push, em_pull_result *pulls,
                             em_push_result *pushes)
{
    em_error err;
    uint64_t before = 0;
    for (int k = 0; k < 2; k++) {
        if (k == 1)
            before = emulated_waits();
        em_status status =
            push ? em_test_push(t->tables[k], batch, EM_COMBINER_NONE, t->gradients, &pushes[k],
                                &err)
                 : em_test_pull(t->tables[k], batch, EM_COMBINER_NONE, true, t->out[k],
                                &pulls[k], &err);
        ck_assert_msg(status == EM_OK, "%s", err.message);
    }
    return emulated_waits() - before;
}

/* The GPU table's count of requests that went again is `again`, and its request took
 * `waits` host waits when that is not 0. */
static void assert_went_again(const twin *t, bool push, int pass, uint64_t waits,
                              uint64_t again, uint64_t expected_waits)
{
    em_table_stats stats;
    em_table_get_stats(t->tables[1], &stats);
    uint64_t counted = push ? stats.pushes_found_again : stats.pulls_found_again;
    printf("two GPUs, %s %d: %" PRIu64 " host waits, %s found again %" PRIu64 "\n",
           push ? "push" : "pull", pass, waits, push ? "pushes" : "pulls", counted);
    ck_assert_uint_eq(counted, again);
    if (waits_counted() && expected_waits != 0)
        ck_assert_uint_eq(waits, expected_waits);
}

/* Loop index: admission `always` (0) or `probability` 1 (1: every key stored, but the
 * admission is not `always`). Under `always`, a pull that may create keys, of a table
 * over two GPUs, goes spread and creates the keys it finds absent there, in one wait
 * (a new table's pulls create), and goes again never. Under the other
 * admission it goes the general way, and does not wait for its finds (the table tracks
 * no access); when it finds keys missing after all it changed nothing, and goes again
 * waiting for them, which creates them (STATS pulls_found_again). The table's next
 * pulls wait for their finds until one finds every key. A push's finds come back with
 * its checks, before it changes anything: with
 * admission `always` the checks saw the missing keys as created, and the push creates
 * them there; under another admission it goes again, and the same holds
 * (pushes_found_again). Each request's answer and counts, and the rows left, equal the
 * CPU's. */
START_TEST(a_request_over_two_gpus_that_finds_keys_missing_goes_again)
{
    const bool always = _i == 0;
    twin t = twin_make_admitting(8, 800, 8, always ? -1.0 : 1.0);
    uint64_t *mixed = malloc(t.n * sizeof(uint64_t));
    /* pulls, in turn: a third of the keys new (not `always`: spread first, which finds
     * keys missing and changes nothing); new keys again (the general way from the
     * start); stored keys (finds them all, waiting); stored keys (spread: one wait) */
    static const uint64_t again_after[2][4] = {{0, 0, 0, 0}, {1, 1, 1, 1}};
    static const uint64_t waits_of[2][4] = {{1, 1, 1, 1}, {0, 0, 3, 1}}; /* 0: not counted */
    for (int pass = 0; pass < 4; pass++) {
        for (uint32_t i = 0; i < t.n; i++)
            mixed[i] = pass >= 2 || i % 3 != 0 ? t.keys[i]
                                               : 1000003 * (uint64_t)(i + t.n * pass) + 11;
        em_test_batch batch = em_test_key_batch(mixed, t.n);
        em_pull_result results[2];
        uint64_t waits = twin_counted(&t, &batch.csr, false, results, NULL);
        twin_assert_pulls_equal(&t);
        ck_assert_uint_eq(results[1].missing, results[0].missing);
        ck_assert_uint_eq(results[1].created, results[0].created);
        ck_assert_uint_eq(results[1].unique_keys, results[0].unique_keys);
        ck_assert_uint_eq(results[0].created, pass < 2 ? (t.n + 2) / 3 : 0);
        assert_went_again(&t, false, pass, waits, again_after[_i][pass], waits_of[_i][pass]);
        em_test_batch_free(&batch);
    }
    /* the same for pushes, whose finds' counts come back with their checks: the push of
     * twin_make went again (it created every key); in turn, stored keys (the general
     * way, twin_make's push having found keys missing; waiting for the finds, which find
     * every key), a third of the keys new (spread first, which finds keys missing and
     * steps nothing; then not waiting, so again), new keys again (waiting), stored keys
     * (waiting), stored keys (spread: one wait). With admission `always` none goes
     * again: twin_make's push created its keys spread (a new table's pushes create), so
     * the first push, of stored keys, goes spread (room made, nothing absent: one wait)
     * and stops the creating; the push of a third new finds them spread, creating
     * nothing, and the general way creates them (not waiting for its finds: the checks
     * saw them as created; it waits for their inserts); the table's pushes create again
     * since, spread: new keys again, then stored keys (which stops the creating) and
     * stored keys, one wait each. */
    static const bool push_new[] = {false, true, true, false, false};
    static const uint64_t pushes_again_after[2][5] = {{0, 0, 0, 0, 0}, {1, 2, 2, 2, 2}};
    static const uint64_t push_waits[2][5] = {{1, 5, 1, 1, 1},
                                              {4, 0, 0, 4, 1}}; /* 0: not counted */
    for (int pass = 0; pass < 5; pass++) {
        for (uint32_t i = 0; i < t.n; i++)
            mixed[i] = !push_new[pass] || i % 3 != 1
                           ? t.keys[i]
                           : 2000003 * (uint64_t)(i + t.n * pass) + 13;
        em_test_batch batch = em_test_key_batch(mixed, t.n);
        em_push_result results[2];
        uint64_t waits = twin_counted(&t, &batch.csr, true, NULL, results);
        ck_assert_uint_eq(results[1].created, results[0].created);
        ck_assert_uint_eq(results[1].updated, results[0].updated);
        ck_assert_uint_eq(results[0].created, push_new[pass] ? (t.n + 1) / 3 : 0);
        assert_went_again(&t, true, pass, waits, pushes_again_after[_i][pass],
                          push_waits[_i][pass]);
        em_test_batch_free(&batch);
    }
    /* a push whose step would overflow a stored key's row is refused as on the CPU,
     * nothing changed, whether it goes without waiting for its finds (every key stored)
     * or finds a new key too (and goes again, whatever the admission: the second refusal
     * is the waiting one's) */
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t i = 0; i < t.n; i++)
            mixed[i] = pass == 1 && i == 5 ? 3000017 : t.keys[i];
        em_test_batch batch = em_test_key_batch(mixed, t.n);
        float *huge = malloc((size_t)t.n * t.dim * sizeof(float));
        memcpy(huge, t.gradients, (size_t)t.n * t.dim * sizeof(float));
        huge[(t.n - 7) * t.dim + 3] = 1e35f; /* its adagrad state would overflow */
        em_error errors[2];
        for (int k = 0; k < 2; k++) {
            em_test_snapshot before = em_test_snapshot_take(t.tables[k], 64);
            ck_assert_int_eq(em_test_push(t.tables[k], &batch.csr, EM_COMBINER_NONE, huge, NULL,
                                          &errors[k]),
                             EM_INVALID_ARGUMENT);
            em_test_assert_table_unchanged(t.tables[k], &before);
            em_test_snapshot_free(&before);
        }
        ck_assert_str_eq(errors[1].message, errors[0].message);
        em_table_stats stats;
        em_table_get_stats(t.tables[1], &stats);
        ck_assert_uint_eq(stats.pushes_found_again, (always ? 0 : 2) + (uint64_t)pass);
        free(huge);
        em_test_batch_free(&batch);
    }
    free(mixed);
    assert_tables_alike(t.tables[0], t.tables[1], 64, 0);
    twin_free(&t);
}
END_TEST

/* The rows the GPU chooses to evict are the ones the host chooses from the same window:
 * the same stream of requests into two GPU tables, one whose evictions the GPU chooses
 * (gpu_choice_entries 1), one whose evictions the host chooses (UINT64_MAX), evict the
 * same keys request by request and keep the same rows. Requests of 512 keys, about half
 * new and half stored (rows the eviction must keep), pushes and creating pulls in turn,
 * into a full table of 4,096 rows; lru ties (every row a request touches has the same
 * last access) go by key on both. Loop index: the policy (lru, lfu, age), then the same
 * on 4 shards, whose walks go through each launch together; candidates 1,024, so that
 * each window is its whole shard. Loop indexes 6 to 11, on the emulated kernels only:
 * the same with candidates 4, so that a shard's window is a part of its map, cut on the
 * GPU where the walk has taken enough entries. A GPU's concurrent inserts place keys in
 * an order of their own within a bucket (and beyond, where a bucket is full), so two
 * tables there hold the same keys at different slots and cut windows differ; the
 * emulation inserts in one order, unless told to scatter it (EMBER_EMULATED_ORDER), when
 * it differs as a GPU's does and these loops return at once. Loop indexes 9 to 11:
 * candidates 1, one shard of
 * 32,768 rows and requests of 4,096 new keys: each eviction empties its window, so a
 * later window that falls there holds few entries, and the walk reads ahead far enough
 * that the GPU still chooses every time (with the request's own rows in a window that
 * short, the rule walks on past it, and the host does). */
static int compare_keys(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The keys the table evicted since *seen (the ring's total then; *seen moves on), at
 * most max of them, into keys, sorted; their count. The ring must have dropped none. */
static uint64_t evicted_since(em_table *table, uint64_t *seen, uint64_t max, uint64_t *keys)
{
    em_evicted_view view;
    em_error err;
    ck_assert_int_eq(em_table_evicted(table, *seen, max, keys, &view, &err), EM_OK);
    ck_assert_uint_eq(view.missed, 0);
    *seen = view.total;
    qsort(keys, view.count, sizeof(uint64_t), compare_keys);
    return view.count;
}

/* Two tables evicted the same keys in a round (evicted_since's, of tables named a and b). */
static void assert_same_evicted(int round, const char *a, const char *b,
                                uint64_t *const evicted[2], const uint64_t count[2])
{
    ck_assert_uint_eq(count[0], count[1]);
    for (uint64_t i = 0; i < count[0]; i++)
        ck_assert_msg(evicted[0][i] == evicted[1][i],
                      "round %d: the %s evicted key %" PRIu64 ", the %s %" PRIu64, round, a,
                      evicted[0][i], b, evicted[1][i]);
}

/* Two GPU backends: gpus[0] chooses every eviction on the GPU (gpu_choice_entries 1),
 * gpus[1] none (UINT64_MAX). */
static void choosing_backends(em_backend *gpus[2])
{
    gpu_choice_entries = 1;
    gpus[0] = gpu_backend(1, GPU_POOL_BYTES, false);
    gpu_choice_entries = UINT64_MAX;
    gpus[1] = gpu_backend(1, GPU_POOL_BYTES, false);
    gpu_choice_entries = 0;
}

START_TEST(evictions_chosen_on_the_gpu_are_the_hosts)
{
    enum { DIM = 4, ROUNDS = 24, MOST = 4096 };
    static const em_eviction_policy policies[3] = {EM_EVICTION_LRU, EM_EVICTION_LFU,
                                                   EM_EVICTION_AGE};
    const bool cut = _i >= 6, fresh = _i >= 9;
    const uint64_t capacity = fresh ? 32768 : 4096;
    const uint32_t batch = fresh ? MOST : 512;
#ifdef EM_CUDA_EMULATED
    if (cut && !em_gpu_emulated_order_fixed())
        return;
#else
    if (cut)
        return;
#endif
    em_backend *gpus[2];
    choosing_backends(gpus);
    em_table_config config = table_config(DIM, capacity, _i % 6 < 3 || fresh ? 1 : 4,
                                          EM_OPTIMIZER_ADAGRAD, EM_INIT_UNIFORM);
    config.eviction.policy = policies[_i % 3];
    config.eviction.candidates = !cut ? 1024 : _i < 9 ? 4 : 1;
    config.eviction.ring = EM_EVICTION_RING_MAX;
    em_table *tables[2] = {em_test_make_table(gpus[0], &config),
                           em_test_make_table(gpus[1], &config)};
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + (uint64_t)_i);
    uint64_t keys[MOST], next_key = 1, seen[2] = {0, 0};
    float values[MOST * DIM], gradients[MOST * DIM];
    uint64_t *evicted[2] = {malloc(capacity * 2 * sizeof(uint64_t)),
                            malloc(capacity * 2 * sizeof(uint64_t))};
    em_error err;
    for (int round = 0; round < ROUNDS; round++) {
        for (uint32_t i = 0; i < batch; i++) /* stored keys are those of the last rounds */
            keys[i] = em_test_rng_below(&rng, 2) == 0 || next_key < capacity || fresh
                          ? next_key++
                          : next_key - capacity / 2 + em_test_rng_below(&rng, capacity / 2);
        for (uint32_t j = 0; j < batch * DIM; j++)
            gradients[j] = 0.001f * (float)((round + j) % 7) - 0.003f;
        em_test_batch b = em_test_key_batch(keys, batch);
        uint64_t count[2];
        for (int t = 0; t < 2; t++) {
            em_status status =
                round % 2 == 0
                    ? em_test_push(tables[t], &b.csr, EM_COMBINER_NONE, gradients, NULL, &err)
                    : em_test_pull(tables[t], &b.csr, EM_COMBINER_NONE, true, values, NULL, &err);
            ck_assert_msg(status == EM_OK, "%s, round %d: %s", t == 0 ? "gpu choice" : "host choice",
                          round, err.message);
            count[t] = evicted_since(tables[t], &seen[t], capacity * 2, evicted[t]);
        }
        em_test_batch_free(&b);
        assert_same_evicted(round, "gpu", "host", evicted, count);
    }
    em_test_snapshot a = em_test_snapshot_take(tables[0], 1024);
    em_test_snapshot b = em_test_snapshot_take(tables[1], 1024);
    em_test_assert_snapshots_identical(&a, &b);
    em_table_stats stats[2];
    for (int t = 0; t < 2; t++)
        em_table_get_stats(tables[t], &stats[t]);
    ck_assert_uint_gt(stats[0].rows_evicted, capacity / 2);
    ck_assert_uint_eq(stats[0].rows_evicted, stats[1].rows_evicted);
    ck_assert_uint_eq(stats[0].rows_evicted_chosen_on_gpu, stats[0].rows_evicted);
    ck_assert_uint_eq(stats[1].rows_evicted_chosen_on_gpu, 0);
    em_test_snapshot_free(&a);
    em_test_snapshot_free(&b);
    free(evicted[0]);
    free(evicted[1]);
    for (int t = 0; t < 2; t++) {
        em_table_destroy(tables[t]);
        em_backend_destroy(gpus[t]);
    }
}
END_TEST

/* A GPU's lru choice counts the bytes of a row's last access from the first that the
 * table's request clock has set (lib/device/cuda_shard.c: choice_first_digit): a row last
 * accessed later than the clock (as a restored one may be) goes after every other, and
 * where the window holds fewer other rows than the request evicts, the host chooses. Two
 * full tables as in evictions_chosen_on_the_gpu_are_the_hosts (4,096 rows, one shard,
 * candidates 1,024: the window is the whole map), their rows' last accesses set alike:
 * loop index 0, a quarter of them far past the clock (2^40 + key), and the GPU chooses;
 * 1, all but 100, and the host does. Both tables evict the same keys. */
START_TEST(rows_accessed_past_the_clock_are_chosen_as_the_host_does)
{
    enum { DIM = 4, CAPACITY = 4096, BATCH = 512, KEPT = 100 };
    em_backend *gpus[2];
    choosing_backends(gpus);
    em_table_config config = table_config(DIM, CAPACITY, 1, EM_OPTIMIZER_SGD, EM_INIT_UNIFORM);
    config.eviction.policy = EM_EVICTION_LRU;
    config.eviction.candidates = 1024;
    config.eviction.ring = EM_EVICTION_RING_MAX;
    em_table *tables[2] = {em_test_make_table(gpus[0], &config),
                           em_test_make_table(gpus[1], &config)};
    uint64_t *keys = malloc(CAPACITY * sizeof(uint64_t));
    em_row_access *access = malloc(CAPACITY * sizeof(em_row_access));
    float gradients[BATCH * DIM];
    for (uint32_t j = 0; j < BATCH * DIM; j++)
        gradients[j] = 0.01f;
    em_error err;
    for (uint64_t k = 0; k < CAPACITY; k++) {
        keys[k] = k + 1;
        bool past = _i == 0 ? keys[k] % 4 == 0 : keys[k] > KEPT;
        access[k] = (em_row_access){.accessed = past ? (UINT64_C(1) << 40) + keys[k]
                                                     : keys[k] % 7 + 1,
                                    .updated = 1,
                                    .frequency = 1};
    }
    uint64_t evicted[2][BATCH];
    for (int t = 0; t < 2; t++) {
        for (uint64_t first = 0; first < CAPACITY; first += BATCH) {
            em_test_batch b = em_test_key_batch(keys + first, BATCH);
            ck_assert_int_eq(em_test_push(tables[t], &b.csr, EM_COMBINER_NONE, gradients, NULL,
                                          &err), EM_OK);
            em_test_batch_free(&b);
        }
        ck_assert_int_eq(em_table_set_access(tables[t], keys, access, CAPACITY, &err), EM_OK);
        uint64_t fresh[BATCH];
        for (uint64_t i = 0; i < BATCH; i++)
            fresh[i] = CAPACITY + 1000 + i;
        em_test_batch b = em_test_key_batch(fresh, BATCH);
        ck_assert_msg(em_test_push(tables[t], &b.csr, EM_COMBINER_NONE, gradients, NULL,
                                   &err) == EM_OK, "%s", err.message);
        em_test_batch_free(&b);
        em_evicted_view view;
        ck_assert_int_eq(em_table_evicted(tables[t], 0, BATCH, evicted[t], &view, &err), EM_OK);
        ck_assert_uint_eq(view.count, BATCH);
        qsort(evicted[t], BATCH, sizeof(uint64_t), compare_keys);
    }
    for (uint64_t i = 0; i < BATCH; i++) {
        ck_assert_uint_eq(evicted[0][i], evicted[1][i]);
        if (_i == 0) /* rows past the clock stay while others can go */
            ck_assert_uint_ne(evicted[0][i] % 4, 0);
    }
    em_table_stats stats;
    em_table_get_stats(tables[0], &stats);
    ck_assert_uint_eq(stats.rows_evicted, BATCH);
    ck_assert_uint_eq(stats.rows_evicted_chosen_on_gpu, (_i == 0 ? BATCH : 0));
    free(keys);
    free(access);
    for (int t = 0; t < 2; t++) {
        em_table_destroy(tables[t]);
        em_backend_destroy(gpus[t]);
    }
}
END_TEST

/* A table of several shards on one GPU dedupes, partitions and finds its keys in one
 * go (device.h: unique_partition_find_async): each shard's missing keys counted on the
 * GPU, a warp's keys often in two shards. Requests of 700 keys, with repeats, about half
 * of them stored and half new, pushes and creating pulls in turn, into a full lru table
 * of 4,096 rows over 8 or 5 shards (loop index), candidates 1,024 (each window its whole
 * shard, so the choice does not depend on the order of the map's slots): request by
 * request the CPU backend and the GPU evict the same keys, create as many and return the
 * same vectors, and their rows end the same bit for bit. */
START_TEST(several_shards_count_missing_keys_as_the_cpu)
{
    enum { DIM = 4, ROUNDS = 16, BATCH = 700, CAPACITY = 4096 };
    em_backend *backends[2] = {cpu_backend(), gpu_backend(1, GPU_POOL_BYTES, false)};
    em_table_config config = table_config(DIM, CAPACITY, _i == 0 ? 8 : 5,
                                          EM_OPTIMIZER_ADAGRAD, EM_INIT_UNIFORM);
    config.eviction.policy = EM_EVICTION_LRU;
    config.eviction.candidates = 1024;
    config.eviction.ring = EM_EVICTION_RING_MAX;
    em_table *tables[2] = {em_test_make_table(backends[0], &config),
                           em_test_make_table(backends[1], &config)};
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + (uint64_t)_i);
    uint64_t keys[BATCH], next_key = 1, seen[2] = {0, 0}, count[2];
    static float values[2][BATCH * DIM];
    float gradients[BATCH * DIM];
    uint64_t *evicted[2] = {malloc(CAPACITY * 2 * sizeof(uint64_t)),
                            malloc(CAPACITY * 2 * sizeof(uint64_t))};
    em_error err;
    for (int round = 0; round < ROUNDS; round++) {
        for (uint32_t i = 0; i < BATCH; i++) {
            uint64_t pick = em_test_rng_below(&rng, 8);
            keys[i] = i > 0 && pick == 0  ? keys[em_test_rng_below(&rng, i)] /* a repeat */
                      : pick < 4 || next_key < CAPACITY ? next_key++
                      : next_key - CAPACITY / 2 + em_test_rng_below(&rng, CAPACITY / 2);
        }
        for (uint32_t j = 0; j < BATCH * DIM; j++)
            gradients[j] = 0.002f * (float)((round + j) % 5) - 0.004f;
        em_test_batch b = em_test_key_batch(keys, BATCH);
        uint64_t created[2];
        for (int t = 0; t < 2; t++) {
            em_table_stats before;
            em_table_get_stats(tables[t], &before);
            em_status status =
                round % 2 == 0
                    ? em_test_push(tables[t], &b.csr, EM_COMBINER_NONE, gradients, NULL, &err)
                    : em_test_pull(tables[t], &b.csr, EM_COMBINER_NONE, true, values[t], NULL,
                                   &err);
            ck_assert_msg(status == EM_OK, "%s, round %d: %s", t == 0 ? "cpu" : "gpu", round,
                          err.message);
            em_table_stats after;
            em_table_get_stats(tables[t], &after);
            created[t] = after.rows_created - before.rows_created;
            count[t] = evicted_since(tables[t], &seen[t], CAPACITY * 2, evicted[t]);
        }
        em_test_batch_free(&b);
        ck_assert_msg(created[0] == created[1], "round %d: the cpu created %" PRIu64
                      " keys, the gpu %" PRIu64, round, created[0], created[1]);
        assert_same_evicted(round, "cpu", "gpu", evicted, count);
        if (round % 2 == 1)
            ck_assert_mem_eq(values[1], values[0], sizeof(values[0]));
    }
    em_table_stats stats;
    em_table_get_stats(tables[1], &stats);
    ck_assert_uint_eq(stats.rows, CAPACITY);
    ck_assert_uint_gt(stats.rows_evicted, 0);
    em_test_snapshot a = em_test_snapshot_take(tables[0], 1024);
    em_test_snapshot g = em_test_snapshot_take(tables[1], 1024);
    em_test_assert_snapshots_identical(&a, &g);
    em_test_snapshot_free(&a);
    em_test_snapshot_free(&g);
    for (int t = 0; t < 2; t++) {
        free(evicted[t]);
        em_table_destroy(tables[t]);
        em_backend_destroy(backends[t]);
    }
}
END_TEST

/* A shard of more than a million rows, full, and a push of 8,192 new keys with 256
 * candidates a row: a window of 2,097,152 entries, which is the whole shard. The GPU
 * chooses from a read ahead of up to 4 Mi entries (the host's stops at 1 Mi, and the rest
 * of the walk would come back export by export), and the rows gone are the rule's: the
 * least recent are the first push's 65,536 keys, equal in last access, and of those the
 * smaller keys go first, 1 to 8,192. */
START_TEST(a_shard_of_over_a_million_rows_evicts_on_the_gpu)
{
    enum { BATCH = 65536, NEW = 8192 };
    const uint64_t capacity = ((uint64_t)1 << 20) + BATCH;
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(1, capacity, 1, EM_OPTIMIZER_SGD, EM_INIT_ZEROS);
    config.eviction.policy = EM_EVICTION_LRU;
    config.eviction.candidates = 256;
    config.eviction.ring = NEW;
    em_table *table = em_test_make_table(gpu, &config);
    uint64_t *keys = malloc(BATCH * sizeof(uint64_t));
    float *gradients = calloc(BATCH, sizeof(float));
    em_error err;
    for (uint64_t done = 0; done < capacity + NEW; done += BATCH) {
        uint32_t n = done < capacity ? BATCH : NEW;
        for (uint32_t i = 0; i < n; i++)
            keys[i] = done + i + 1;
        em_test_batch b = em_test_key_batch(keys, n);
        ck_assert_msg(em_test_push(table, &b.csr, EM_COMBINER_NONE, gradients, NULL, &err) ==
                          EM_OK,
                      "%s", err.message);
        em_test_batch_free(&b);
    }
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, capacity);
    ck_assert_uint_eq(stats.rows_evicted, NEW);
    ck_assert_uint_eq(stats.rows_evicted_chosen_on_gpu, NEW);
    em_evicted_view view;
    ck_assert_int_eq(em_table_evicted(table, 0, NEW, keys, &view, &err), EM_OK);
    ck_assert_uint_eq(view.count, NEW);
    qsort(keys, NEW, sizeof(uint64_t), compare_keys);
    for (uint32_t i = 0; i < NEW; i++)
        ck_assert_uint_eq(keys[i], i + 1);
    free(keys);
    free(gradients);
    em_table_destroy(table);
    em_backend_destroy(gpu);
}
END_TEST


/* Loop index: the capacity policy (lru, lfu, age, expiry, counter admission,
 * probability admission). The same stream of one-key pulls and pushes over a key space
 * of four times the capacity on both backends, every row compared at each eviction
 * (candidates above the shard's rows): the rows kept match bit for bit, and so do the
 * counters of what left or was refused. The GPU's maps are in segments of 1,024 slots
 * for lfu, expiry and probability admission (odd loop indexes). Loop indexes 6 to 8:
 * lru, lfu and age again with every eviction chosen on the GPU (gpu_choice_entries 1;
 * below the default, a one-row eviction is chosen on the host). */
START_TEST(capacity_policies_match_cpu)
{
    const int which = _i % 6;
    gpu_choice_entries = _i >= 6 ? 1 : 0;
    map_segment_slots = which % 2 == 1 ? 1024 : 0;
    const uint64_t capacity = 120;
    const uint32_t dim = 8;
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, 64 * MEBIBYTE, false);
    em_table_config config = table_config(dim, capacity, 2, 1, EM_INIT_UNIFORM);
    config.eviction.candidates = 1024;
    config.eviction.headroom = which == 0 ? 0.1 : 0.0; /* lru: evictions leave room behind */
    if (which < 3)
        config.eviction.policy = which == 0 ? EM_EVICTION_LRU
                                 : which == 1 ? EM_EVICTION_LFU
                                           : EM_EVICTION_AGE;
    if (which >= 3)
        config.capacity = 100000;
    if (which == 3)
        config.eviction.max_age_steps = 40;
    if (which == 4) {
        config.admission.policy = EM_ADMISSION_COUNTER;
        config.admission.threshold = 3;
    }
    if (which == 5) {
        config.admission.policy = EM_ADMISSION_PROBABILITY;
        config.admission.probability = 0.5;
    }
    em_table *tables[2] = {em_test_make_table(cpu, &config), em_test_make_table(gpu, &config)};
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + (uint64_t)which);
    float values[8], gradient[8];
    em_error err;
    for (int step = 0; step < 700; step++) {
        /* half the requests go to the first 20 keys */
        uint64_t key = em_test_rng_below(&rng, 2) == 0 ? em_test_rng_below(&rng, 20)
                                                       : em_test_rng_below(&rng, 4 * capacity);
        bool push = em_test_rng_below(&rng, 3) == 0;
        for (uint32_t j = 0; j < dim; j++)
            gradient[j] = 0.01f * (float)(step % 13) - 0.05f;
        em_test_batch b = em_test_key_batch(&key, 1);
        for (int t = 0; t < 2; t++) {
            em_status status =
                push ? em_test_push(tables[t], &b.csr, EM_COMBINER_NONE, gradient, NULL, &err)
                     : em_test_pull(tables[t], &b.csr, EM_COMBINER_NONE, true, values, NULL, &err);
            ck_assert_msg(status == EM_OK, "%s backend, step %d: %s", t == 0 ? "cpu" : "cuda",
                          step, err.message);
            uint64_t expired = 0;
            if (which == 3 && step % 50 == 49)
                for (int slice = 0; slice < 4; slice++)
                    ck_assert_int_eq(em_table_expire(tables[t], 64, &expired, &err), EM_OK);
        }
        em_test_batch_free(&b);
    }
    em_test_snapshot a = em_test_snapshot_take(tables[0], 31);
    em_test_snapshot b = em_test_snapshot_take(tables[1], 31);
    em_test_assert_snapshots_identical(&a, &b);
    em_table_stats stats[2];
    for (int t = 0; t < 2; t++)
        em_table_get_stats(tables[t], &stats[t]);
    ck_assert_uint_eq(stats[1].rows, stats[0].rows);
    ck_assert_uint_eq(stats[1].rows_evicted, stats[0].rows_evicted);
    ck_assert_uint_eq(stats[1].rows_expired, stats[0].rows_expired);
    ck_assert_uint_eq(stats[1].pulls_not_admitted, stats[0].pulls_not_admitted);
    ck_assert_uint_eq(stats[1].pushes_dropped, stats[0].pushes_dropped);
    if (which < 3)
        ck_assert_uint_gt(stats[1].rows_evicted, 100);
    /* the GPU chose every eviction where told to, none of these short ones by default */
    ck_assert_uint_eq(stats[1].rows_evicted_chosen_on_gpu, _i >= 6 ? stats[1].rows_evicted : 0);
    if (which == 3)
        ck_assert_uint_gt(stats[1].rows_expired, 50);
    if (which >= 4)
        ck_assert_uint_gt(stats[1].pushes_dropped + stats[1].pulls_not_admitted, 50);
    ck_assert_uint_ge(stats[1].access_bytes, which < 4 ? stats[1].rows * 16 : 0);
    em_test_snapshot_free(&a);
    em_test_snapshot_free(&b);
    for (int t = 0; t < 2; t++)
        em_table_destroy(tables[t]);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* ---- erase -------------------------------------------------------------------------------- */

/* Pushes keys[0..n) once each with gradient 0.125 * (i % 7 + 1). */
static void push_keys(em_table *table, const uint64_t *keys, uint32_t n, uint32_t dim)
{
    float *gradients = malloc((size_t)n * dim * sizeof(float));
    for (uint64_t i = 0; i < (uint64_t)n * dim; i++)
        gradients[i] = 0.125f * (float)(i / dim % 7 + 1);
    em_test_batch b = em_test_key_batch(keys, n);
    em_error err;
    ck_assert_msg(em_test_push(table, &b.csr, EM_COMBINER_NONE, gradients, NULL, &err) == EM_OK,
                  "%s", err.message);
    em_test_batch_free(&b);
    free(gradients);
}

/* Rounds of erasing listed keys (the two sentinel keys among them) and pushing new ones
 * on both backends: the rows left match bit for bit, erased rows are reused (the
 * storage, one block of 8,192 rows of dim 64, does not grow while 8,500 keys come and
 * go) and the tombstones are dropped by rehashes in place (the map does not grow
 * either). The GPU's map is in segments of 1,024 slots. */
START_TEST(erase_matches_cpu_and_reuses_rows)
{
    map_segment_slots = 1024;
    const uint32_t dim = 64, live = 600, churn = 250;
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(dim, 1000, 1, 1, EM_INIT_UNIFORM);
    em_table *cpu_table = em_test_make_table(cpu, &config);
    em_table *gpu_table = em_test_make_table(gpu, &config);
    uint64_t keys[1000];
    for (uint32_t i = 0; i < live; i++)
        keys[i] = i < 2 ? UINT64_MAX - i : (uint64_t)i * 0x9e3779b97f4a7c15ull;
    push_keys(cpu_table, keys, live, dim);
    push_keys(gpu_table, keys, live, dim);
    em_table_stats first, after_first;
    em_table_get_stats(gpu_table, &first);
    uint64_t next = live;
    em_error err;
    const int rounds = 34;
    for (int round = 0; round < rounds; round++) {
        /* erase churn keys from a rotating place (the sentinel keys in round 0), plus
         * an absent one */
        uint64_t gone[260], erased_cpu = 0, erased_gpu = 0;
        for (uint32_t i = 0; i < churn; i++)
            gone[i] = keys[(round * churn + i) % live];
        gone[churn] = 12345;
        ck_assert_int_eq(em_table_erase(cpu_table, gone, churn + 1, &erased_cpu, &err), EM_OK);
        ck_assert_msg(em_table_erase(gpu_table, gone, churn + 1, &erased_gpu, &err) == EM_OK,
                      "%s", err.message);
        ck_assert_uint_eq(erased_gpu, erased_cpu);
        ck_assert_uint_eq(erased_gpu, churn);
        for (uint32_t i = 0; i < churn; i++)
            keys[(round * churn + i) % live] = (next++) * 0x9e3779b97f4a7c15ull + 1;
        push_keys(cpu_table, keys, live, dim);
        push_keys(gpu_table, keys, live, dim);
        if (round == 0) /* a push creating at once makes room for its whole batch: the
                         * index grows once, to hold the live keys and one batch */
            em_table_get_stats(gpu_table, &after_first);
        if (round % 10 != 0 && round != rounds - 1)
            continue;
        em_test_snapshot a = em_test_snapshot_take(cpu_table, 97);
        em_test_snapshot b = em_test_snapshot_take(gpu_table, 97);
        ck_assert_uint_eq(b.count, live);
        em_test_assert_snapshots_identical(&a, &b);
        em_test_snapshot_free(&a);
        em_test_snapshot_free(&b);
    }
    em_table_stats stats;
    em_table_get_stats(gpu_table, &stats);
    ck_assert_uint_eq(stats.rows, live);
    ck_assert_uint_eq(stats.rows_erased, (uint64_t)rounds * churn);
    ck_assert_uint_eq(stats.row_bytes, first.row_bytes);
    ck_assert_uint_eq(stats.index_bytes, after_first.index_bytes);
    ck_assert_uint_le(stats.index_bytes, 2 * first.index_bytes);
    em_table_destroy(cpu_table);
    em_table_destroy(gpu_table);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* A push of 2 Mi gradient floats (32,768 keys at dim 64) with a non-finite one, to a
 * table on a GPU, is checked on the host's CPUs in parts (lib/table/table.c
 * check_gradients) once the GPU's check has stopped it: an infinity in the second part
 * and a NaN in the last, and the infinity is named, in the CPU backend's words (which
 * checks on one thread); nothing changes. Loop index: 1 and 8 shards. */
START_TEST(a_large_push_with_a_non_finite_gradient_is_refused_like_the_cpu)
{
    enum { KEYS = 32768, DIM = 64 };
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(DIM, 100000, _i == 0 ? 1 : 8, EM_OPTIMIZER_SGD,
                                          EM_INIT_UNIFORM);
    em_table *tables[2] = {em_test_make_table(cpu, &config), em_test_make_table(gpu, &config)};
    uint64_t *keys = malloc(KEYS * sizeof(uint64_t));
    float *g = malloc((size_t)KEYS * DIM * sizeof(float));
    for (uint32_t i = 0; i < KEYS; i++)
        keys[i] = 11 + 7 * (uint64_t)i;
    for (size_t i = 0; i < (size_t)KEYS * DIM; i++)
        g[i] = 0.001f * (float)(i % 11) - 0.005f;
    em_test_batch b = em_test_key_batch(keys, KEYS);
    em_error err, errors[2];
    for (int t = 0; t < 2; t++) /* the keys stored */
        ck_assert_msg(em_test_push(tables[t], &b.csr, EM_COMBINER_NONE, g, NULL, &err) == EM_OK,
                      "%s", err.message);
    g[(size_t)20000 * DIM + 9] = INFINITY;
    g[(size_t)KEYS * DIM - 2] = NAN;
    for (int t = 0; t < 2; t++) {
        em_test_snapshot before = em_test_snapshot_take(tables[t], 4096);
        ck_assert_int_eq(em_test_push(tables[t], &b.csr, EM_COMBINER_NONE, g, NULL, &errors[t]),
                         EM_INVALID_ARGUMENT);
        em_test_assert_table_unchanged(tables[t], &before);
        em_test_snapshot_free(&before);
    }
    ck_assert_msg(strstr(errors[0].message, "gradient of key 140011 (keys[20000], row 20000) "
                                            "element 9 is +inf") != NULL,
                  "%s", errors[0].message);
    ck_assert_str_eq(errors[1].message, errors[0].message);
    em_test_batch_free(&b);
    free(keys);
    free(g);
    for (int t = 0; t < 2; t++)
        em_table_destroy(tables[t]);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* A push that must evict holds the table alone, and there the host leaves its gradients
 * to the GPU's check (lib/table/table.c gpu_checks_alone): a gradient that is not finite
 * is still refused in the CPU backend's words, before anything is evicted or created.
 * A full lru table of 512 rows takes 128 new keys a push; the second push has a NaN (loop
 * index bit 0: in a new key's gradient, else in a stored key's) or, bit 1 set, two
 * occurrences of one key whose finite gradients add up past the float range, which
 * both backends name as a summed gradient. Bit 2: 8 shards, else 1. Then the same push
 * with the gradient put right evicts, and the tables agree row for row. */
START_TEST(a_full_tables_push_with_a_bad_gradient_evicts_nothing)
{
    enum { CAPACITY = 512, KEYS = 128, DIM = 4 };
    const bool in_new_key = (_i & 1) != 0, overflow = (_i & 2) != 0;
    const uint32_t shards = _i & 4 ? 8 : 1;
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(DIM, CAPACITY, shards, EM_OPTIMIZER_SGD,
                                          EM_INIT_UNIFORM);
    config.eviction.policy = EM_EVICTION_LRU;
    em_table *tables[2] = {em_test_make_table(cpu, &config), em_test_make_table(gpu, &config)};
    uint64_t keys[KEYS] = {0};
    float g[KEYS * DIM];
    em_test_batch b = em_test_key_batch(keys, KEYS);
    em_error err, errors[2];
    for (uint32_t i = 0; i < KEYS * DIM; i++)
        g[i] = 0.01f * (float)(i % 5) - 0.02f;
    for (uint32_t round = 0; round < CAPACITY / KEYS; round++) { /* the table filled */
        for (uint32_t i = 0; i < KEYS; i++)
            b.keys[i] = 1 + round * KEYS + i;
        for (int t = 0; t < 2; t++)
            ck_assert_msg(em_test_push(tables[t], &b.csr, EM_COMBINER_NONE, g, NULL, &err) ==
                          EM_OK, "%s", err.message);
    }
    for (uint32_t i = 0; i < KEYS; i++) /* half stored (the newest), half new */
        b.keys[i] = i < KEYS / 2 ? CAPACITY - i : 100000 + i;
    uint32_t bad = in_new_key ? KEYS / 2 + 7 : 5;
    float kept = g[bad * DIM + 2];
    if (overflow) {
        b.keys[bad + 1] = b.keys[bad];
        g[bad * DIM + 2] = 3e38f;
        g[(bad + 1) * DIM + 2] = 3e38f;
    } else {
        g[bad * DIM + 2] = NAN;
    }
    for (int t = 0; t < 2; t++) {
        em_test_snapshot before = em_test_snapshot_take(tables[t], 4096);
        em_table_stats stats;
        ck_assert_int_eq(em_test_push(tables[t], &b.csr, EM_COMBINER_NONE, g, NULL, &errors[t]),
                         EM_INVALID_ARGUMENT);
        em_test_assert_table_unchanged(tables[t], &before);
        em_table_get_stats(tables[t], &stats);
        ck_assert_uint_eq(stats.rows, CAPACITY);
        ck_assert_uint_eq(stats.rows_evicted, 0);
        em_test_snapshot_free(&before);
    }
    ck_assert_msg(strstr(errors[0].message, overflow ? "summed gradient" : "is NaN") != NULL,
                  "%s", errors[0].message);
    ck_assert_str_eq(errors[1].message, errors[0].message);
    g[bad * DIM + 2] = kept;
    g[(bad + 1) * DIM + 2] = kept;
    em_push_result results[2];
    for (int t = 0; t < 2; t++)
        ck_assert_msg(em_test_push(tables[t], &b.csr, EM_COMBINER_NONE, g, &results[t], &err) ==
                      EM_OK, "%s", err.message);
    ck_assert_uint_eq(results[1].created, results[0].created);
    ck_assert_uint_eq(results[1].updated, results[0].updated);
    em_test_snapshot rows[2] = {em_test_snapshot_take(tables[0], 4096),
                                em_test_snapshot_take(tables[1], 4096)};
    ck_assert_uint_eq(rows[0].count, CAPACITY);
    em_test_assert_snapshots_identical(&rows[0], &rows[1]);
    for (int t = 0; t < 2; t++) {
        em_test_snapshot_free(&rows[t]);
        em_table_destroy(tables[t]);
    }
    em_test_batch_free(&b);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* A gradient that is not finite, in a push that goes at once (the host does not read its
 * gradients) or, with a combiner, is checked first: refused with the CPU backend's words,
 * nothing stepped or created, in tables of 1 and 8 shards, to stored keys and to keys the
 * push would create (the table's pushes already creating at once). Variants: NaN, +inf,
 * and +inf and -inf on two occurrences of one key (their sum is NaN); then a NaN in the
 * gradient of an empty row of a mean-pooled push, which no sum on the GPU holds. */
START_TEST(non_finite_gradients_are_refused_like_the_cpu)
{
    const uint32_t dim = 5, shards = _i & 1 ? 8 : 1;
    const bool fresh = (_i & 2) != 0;
    const int kind = _i / 4; /* 0 NaN, 1 +inf, 2 +inf and -inf on one key, 3 empty row */
    em_backend *cpu = cpu_backend();
    em_backend *gpu = gpu_backend(1, GPU_POOL_BYTES, false);
    em_table_config config = table_config(dim, 100000, shards, EM_OPTIMIZER_ADAGRAD,
                                          EM_INIT_UNIFORM);
    em_table *tables[2] = {em_test_make_table(cpu, &config), em_test_make_table(gpu, &config)};
    enum { KEYS = 300 };
    uint64_t keys[KEYS];
    uint32_t offsets[KEYS + 1];
    float g[KEYS * 5];
    for (uint32_t i = 0; i <= KEYS; i++)
        offsets[i] = i;
    for (uint32_t i = 0; i < KEYS * dim; i++)
        g[i] = 0.01f * (float)(i % 7) - 0.03f;
    em_csr batch = {.rows = KEYS, .nnz = KEYS, .offsets = offsets, .keys = keys};
    em_error err, errors[2];
    for (int round = 0; round < 2; round++) { /* stored keys; then new keys, created at once */
        for (uint32_t i = 0; i < KEYS; i++)
            keys[i] = 7 + 13 * (uint64_t)i + (uint64_t)round * 100000;
        for (int b = 0; b < 2; b++)
            ck_assert_msg(em_test_push(tables[b], &batch, EM_COMBINER_NONE, g, NULL, &err) ==
                          EM_OK, "%s", err.message);
    }
    for (uint32_t i = 0; i < KEYS; i++)
        keys[i] = fresh ? 5000000 + 3 * (uint64_t)i : 7 + 13 * (uint64_t)i;
    em_combiner combiner = EM_COMBINER_NONE;
    if (kind == 0) {
        g[123 * dim + 2] = NAN;
    } else if (kind == 1) {
        g[7 * dim + 4] = INFINITY;
    } else if (kind == 2) {
        keys[250] = keys[40]; /* one key twice: +inf and -inf, finite apart */
        g[40 * dim + 1] = INFINITY;
        g[250 * dim + 1] = -INFINITY;
    } else {
        combiner = EM_COMBINER_MEAN; /* rows of one key, and row 200 empty */
        for (uint32_t r = 0; r <= KEYS; r++)
            offsets[r] = r <= 200 ? r : r - 1;
        batch.nnz = KEYS - 1;
        g[200 * dim + 3] = NAN;
    }
    for (int b = 0; b < 2; b++) {
        em_table_stats stats_before, stats_after;
        em_table_get_stats(tables[b], &stats_before);
        em_test_snapshot before = em_test_snapshot_take(tables[b], 64);
        ck_assert_int_eq(em_test_push(tables[b], &batch, combiner, g, NULL, &errors[b]),
                         EM_INVALID_ARGUMENT);
        em_test_assert_table_unchanged(tables[b], &before);
        em_test_snapshot_free(&before);
        em_table_get_stats(tables[b], &stats_after);
        ck_assert_uint_eq(stats_after.rows, stats_before.rows);
        ck_assert_uint_eq(stats_after.pushes, stats_before.pushes);
    }
    ck_assert_msg(strstr(errors[0].message, kind == 3 ? "gradient of row 200" : "gradient of key")
                  != NULL, "%s", errors[0].message);
    ck_assert_str_eq(errors[1].message, errors[0].message);
    for (int b = 0; b < 2; b++) { /* and the tables go on alike */
        for (uint32_t i = 0; i < KEYS * dim; i++)
            g[i] = 0.02f;
        ck_assert_msg(em_test_push(tables[b], &batch, combiner, g, NULL, &err) == EM_OK, "%s",
                      err.message);
    }
    em_test_snapshot a = em_test_snapshot_take(tables[0], 64);
    em_test_snapshot c = em_test_snapshot_take(tables[1], 64);
    em_test_assert_snapshots_identical(&a, &c);
    em_test_snapshot_free(&a);
    em_test_snapshot_free(&c);
    for (int b = 0; b < 2; b++)
        em_table_destroy(tables[b]);
    em_backend_destroy(cpu);
    em_backend_destroy(gpu);
}
END_TEST

/* ---- runner ---------------------------------------------------------------------------- */

static Suite *gpu_backend_suite(void)
{
    Suite *suite = suite_create("gpu_backend");
    /* a case of its own, which CK_RUN_CASE=eviction_choice runs alone */
    TCase *choice = tcase_create("eviction_choice");
    tcase_set_timeout(choice, 600);
    tcase_add_loop_test(choice, evictions_chosen_on_the_gpu_are_the_hosts, 0, 12);
    tcase_add_test(choice, a_shard_of_over_a_million_rows_evicts_on_the_gpu);
    tcase_add_loop_test(choice, several_shards_count_missing_keys_as_the_cpu,
                        0, 2);
    tcase_add_loop_test(choice, rows_accessed_past_the_clock_are_chosen_as_the_host_does, 0, 2);
    suite_add_tcase(suite, choice);
    /* requests of tables over two GPUs, a case of its own, which CK_RUN_CASE=spread runs
     * alone (with one GPU visible, over two devices sharing it) */
    TCase *spread = tcase_create("spread");
    tcase_set_timeout(spread, 600);
    tcase_add_test(spread, pulls_spread_over_two_gpus_match_cpu);
    tcase_add_test(spread, pushes_spread_over_two_gpus_match_cpu);
    tcase_add_loop_test(spread, pulls_creating_spread_over_two_gpus_match_cpu, 0, 2);
    tcase_add_loop_test(spread, pushes_creating_spread_over_two_gpus_match_cpu, 0, 2);
    tcase_add_test(spread, a_table_of_three_shards_over_two_gpus_goes_the_general_way);
    tcase_add_test(spread, spread_requests_touch_rows_as_the_cpu_does);
    tcase_add_loop_test(spread, a_request_over_two_gpus_that_finds_keys_missing_goes_again, 0,
                        2);
    suite_add_tcase(suite, spread);
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 600);
    tcase_add_loop_test(tc, initial_values_match_cpu_bit_for_bit, 0, 6);
    tcase_add_loop_test(tc, workloads_match_cpu, 0, 16);
    tcase_add_loop_test(tc, optimizer_steps_match_cpu_bit_for_bit, 0, 12);
    tcase_add_test(tc, tables_taking_turns_on_a_lane_match_cpu);
    tcase_add_test(tc, duplicate_keys_sum_like_cpu);
    tcase_add_test(tc, empty_rows_and_batches);
    tcase_add_test(tc, hash_map_grows_at_load_0_9);
    tcase_add_test(tc, segmented_map_grows_by_the_slots_it_adds);
    tcase_add_test(tc, pool_exhaustion_fails_whole_and_table_keeps_working);
    tcase_add_loop_test(tc, pulls_that_run_out_of_pool_create_nothing, 0, 2);
    tcase_add_test(tc, import_export_round_trip_bit_for_bit);
    tcase_add_test(tc, checkpoints_move_between_gpu_and_cpu_bit_for_bit);
    tcase_add_loop_test(tc, concurrent_pushes_lose_no_update, 0, 3);
    tcase_add_loop_test(tc, saves_while_requests_fill_every_lane_finish, 0, 2);
    tcase_add_loop_test(tc, threads_creating_the_same_keys_create_each_once, 0, 2);
    tcase_add_loop_test(tc, threads_pulling_new_keys_create_each_once, 0, 2);
    tcase_add_loop_test(tc, wide_rows_match_cpu_value_by_value, 0, 8);
    tcase_add_loop_test(tc, outputs_at_any_alignment, 0, 4);
    tcase_add_test(tc, a_table_beyond_2_31_floats);
    tcase_add_loop_test(tc, requests_in_pinned_buffers_match_pageable_ones, 0, 3);
    tcase_add_test(tc, a_push_refused_in_one_shard_of_eight_says_what_the_cpu_says);
    tcase_add_loop_test(tc, non_finite_gradients_are_refused_like_the_cpu, 0, 16);
    tcase_add_loop_test(tc, a_large_push_with_a_non_finite_gradient_is_refused_like_the_cpu, 0, 2);
    tcase_add_loop_test(tc, a_full_tables_push_with_a_bad_gradient_evicts_nothing, 0, 8);
#ifdef EM_CUDA_EMULATED
    tcase_add_test(tc, host_waits_and_operations_per_request);
    tcase_add_loop_test(tc, a_large_eviction_waits_a_few_times, 0, 6);
    tcase_add_test(tc, a_gpu_that_only_takes_new_keys_while_another_evicts);
    tcase_add_test(tc, a_table_on_one_gpu_of_two_is_served_there);
    tcase_add_test(tc, a_table_over_two_gpus_finds_and_checks_on_both_at_once);
#endif
    tcase_add_loop_test(tc, layouts_over_gpus_identical_to_one_gpu, 0, 4);
    tcase_add_loop_test(tc, two_devices_sharing_one_gpu_match_one_device, 0, 4);
    tcase_add_test(tc, bad_options_are_named);
    tcase_add_test(tc, nccl_first_and_a_fallback_that_says_why);
    tcase_add_loop_test(tc, capacity_policies_match_cpu, 0, 9);
    tcase_add_test(tc, access_metadata_moves_between_gpu_and_cpu);
    tcase_add_loop_test(tc, pulls_at_once_match_cpu, 0, 24);
    tcase_add_loop_test(tc, large_pulls_match_cpu, 0, 2);
    tcase_add_test(tc, tables_with_empty_shards_go_at_once);
    tcase_add_loop_test(tc, pushes_at_once_match_cpu, 0, 48);
    tcase_add_test(tc, erase_matches_cpu_and_reuses_rows);
    suite_add_tcase(suite, tc);
    return suite;
}

/* Asks in a child process, so this one never initialises CUDA before forking tests:
 * 0 when a usable GPU is there, SKIP when none is visible, 1 when one is there but
 * cannot be used (an old driver, no kernel image for it): a failure, never a skip. */
static int gpu_probe(void)
{
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        uint32_t count = 0;
        em_error err;
        em_status status = em_cuda_available(&count, &err);
        if (status == EM_NOT_FOUND)
            printf("the suite is skipped: %s\n", err.message);
        else if (status != EM_OK)
            printf("FAILED: a GPU or a driver is there but cannot be used: %s\n", err.message);
        else
            printf("%u GPU(s) visible\n", count);
        fflush(stdout);
        _exit(status == EM_NOT_FOUND ? SKIP : status == EM_OK ? 0 : 1);
    }
    int status = 0;
    if (child < 0 || waitpid(child, &status, 0) != child) {
        printf("FAILED: the GPU probe did not run\n");
        return 1;
    }
    if (!WIFEXITED(status)) {
        printf("FAILED: the GPU probe was killed by signal %d\n", WTERMSIG(status));
        return 1;
    }
    return WEXITSTATUS(status);
}

int main(void)
{
    int probe = gpu_probe();
    if (probe != 0)
        return probe;
    return em_test_run(gpu_backend_suite());
}
