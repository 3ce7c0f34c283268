/*
 * The GPU kernels' per-element logic (kernels/kernel_logic.h), run on the host.
 *
 * Device operations: the CUDA device (lib/device/cuda_device.c over the emulated kernels of
 * tests/support/kernels_emulated.c, which call the same per-element functions as the
 * real kernels) against the CPU device, op by op, on random inputs: unique keys (order
 * of first appearance), partition (stable), gradient sums and pooling (bit for bit).
 *
 * Hash map protocol: the insert and lookup functions run from several host threads at
 * once on one map, with real atomics (GCC builtins stand in for CUDA's), so claims
 * race as they do on a GPU: every key must end with exactly one row, rows dense.
 *
 * The emulation's own timing of copies (tests/support/kernels_emulated.c): a copy into
 * pinned host memory lands only when the host waits for it, and a copy out of it that
 * finds its source changed when waited for stops the process.
 *
 * What this cannot cover: the GPU memory model, warp-level primitives, launch geometry
 * and CUB (see kernels/kernel_logic.h and tests/support/kernels_emulated.c).
 */
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernel_logic.h"
#include "lib/device/backend.h"
#include "lib/device/cuda_device.h"
#include "lib/memory/pool.h"
#include "kernels/ember_kernels.h"
#include "tests/support/kernels_emulated.h"
#include "tests/support/test_support.h"

#define MEBIBYTE (UINT64_C(1) << 20)

/* ---- the two devices ------------------------------------------------------------------ */

typedef struct devices {
    em_device *cpu, *gpu;
    em_lane *cpu_lane, *gpu_lane;
} devices;

static devices open_devices_staged(size_t staging_bytes)
{
    devices d;
    em_error err;
    em_cpu_backend_options cpu_options;
    em_cpu_backend_options_init(&cpu_options);
    cpu_options.pool_limit_bytes = 256 * MEBIBYTE;
    cpu_options.pool_initial_bytes = 64 * MEBIBYTE;
    cpu_options.pool_growth_bytes = 64 * MEBIBYTE;
    ck_assert_msg(em_cpu_device_create(0, &cpu_options, &d.cpu, &err) == EM_OK, "%s",
                  err.message);
    em__cuda_device_options gpu_options = {
        .ordinal = 0, .pool_bytes = 128 * MEBIBYTE, .lanes = 2, .staging_bytes = staging_bytes};
    ck_assert_msg(em__cuda_device_create(0, &gpu_options, &d.gpu, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_int_eq(d.cpu->ops->lane_acquire(d.cpu, &d.cpu_lane, &err), EM_OK);
    ck_assert_int_eq(d.gpu->ops->lane_acquire(d.gpu, &d.gpu_lane, &err), EM_OK);
    return d;
}

static devices open_devices(void)
{
    return open_devices_staged(4096);
}

static void close_devices(devices *d)
{
    d->cpu->ops->lane_release(d->cpu_lane);
    d->gpu->ops->lane_release(d->gpu_lane);
    d->cpu->ops->destroy(d->cpu);
    d->gpu->ops->destroy(d->gpu);
}

static void *device_buffer(em_device *device, size_t bytes)
{
    void *pointer = NULL;
    em_error err;
    ck_assert_msg(em_device_alloc(device, bytes, "test buffer", &pointer, &err) == EM_OK, "%s",
                  err.message);
    return pointer;
}

/* A copy of host bytes in the device's memory (a buffer of at least 8 bytes, so empty
 * inputs still have an address). */
static void *upload(em_device *device, em_lane *lane, const void *host, size_t bytes)
{
    void *pointer = device_buffer(device, bytes + 8);
    em_error err;
    ck_assert_int_eq(device->ops->copy_to_device(lane, pointer, host, bytes, &err), EM_OK);
    return pointer;
}

/* A malloc'ed host copy of device bytes. */
static void *download(em_device *device, em_lane *lane, const void *pointer, size_t bytes)
{
    void *host = malloc(bytes + 1);
    em_error err;
    ck_assert_int_eq(device->ops->synchronize(lane, &err), EM_OK);
    ck_assert_int_eq(device->ops->copy_to_host(lane, host, pointer, bytes, &err), EM_OK);
    return host;
}

static uint64_t random_key(em_test_rng *rng, uint64_t universe)
{
    static const uint64_t special[] = {0, UINT64_MAX, UINT64_MAX - 1, UINT64_MAX - 2};
    uint64_t pick = em_test_rng_below(rng, universe + 4);
    return pick < 4 ? special[pick] : (pick - 4) * 0x9e3779b97f4a7c15ull + 7;
}

/* ---- unique and partition --------------------------------------------------------------- */

typedef struct deduped {
    uint64_t count;
    uint64_t *unique;   /* host */
    uint32_t *inverse;  /* host */
    uint32_t *first;    /* host: first position of each unique key */
} deduped;

static deduped run_unique(em_device *device, em_lane *lane, const uint64_t *keys, uint64_t n)
{
    em_error err;
    const uint64_t *on_device = upload(device, lane, keys, n * sizeof(uint64_t));
    uint64_t *unique = device_buffer(device, (n + 1) * sizeof(uint64_t));
    uint32_t *inverse = device_buffer(device, (n + 1) * sizeof(uint32_t));
    uint32_t *first = device_buffer(device, (n + 1) * sizeof(uint32_t));
    deduped result;
    ck_assert_msg(device->ops->unique_keys(lane, on_device, n, unique, inverse, first,
                                           &result.count, &err) == EM_OK, "%s", err.message);
    result.unique = download(device, lane, unique, (n + 1) * sizeof(uint64_t));
    result.inverse = download(device, lane, inverse, (n + 1) * sizeof(uint32_t));
    result.first = download(device, lane, first, (n + 1) * sizeof(uint32_t));
    em_device_free(device, (void *)on_device);
    em_device_free(device, unique);
    em_device_free(device, inverse);
    em_device_free(device, first);
    return result;
}

/* Loop index picks the size and the key universe (many repeats or few). */
START_TEST(unique_keys_in_order_of_first_appearance_like_cpu)
{
    static const uint64_t sizes[] = {0, 1, 2, 7, 1000, 20000};
    uint64_t n = sizes[_i % 6];
    uint64_t universe = _i < 6 ? 50 : 1u << 30;
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + (uint64_t)_i);
    uint64_t *keys = malloc((n + 1) * sizeof(uint64_t));
    for (uint64_t i = 0; i < n; i++)
        keys[i] = random_key(&rng, universe);
    devices d = open_devices();
    deduped cpu = run_unique(d.cpu, d.cpu_lane, keys, n);
    deduped gpu = run_unique(d.gpu, d.gpu_lane, keys, n);
    ck_assert_uint_eq(gpu.count, cpu.count);
    ck_assert(memcmp(gpu.unique, cpu.unique, cpu.count * sizeof(uint64_t)) == 0);
    ck_assert(memcmp(gpu.inverse, cpu.inverse, n * sizeof(uint32_t)) == 0);
    ck_assert(memcmp(gpu.first, cpu.first, cpu.count * sizeof(uint32_t)) == 0);
    for (uint64_t i = 0; i < n; i++) {
        ck_assert(gpu.unique[gpu.inverse[i]] == keys[i]);
        ck_assert_uint_le(gpu.first[gpu.inverse[i]], i);
        ck_assert(keys[gpu.first[gpu.inverse[i]]] == keys[i]);
    }
    free(cpu.unique);
    free(cpu.inverse);
    free(cpu.first);
    free(gpu.unique);
    free(gpu.inverse);
    free(gpu.first);
    close_devices(&d);
    free(keys);
}
END_TEST

typedef struct partitioned {
    uint64_t *keys;
    uint32_t *position;
    uint32_t *targets;
    uint64_t *counts;
} partitioned;

/* first gives each unique key's "first position" (any values; the partition carries
 * them into targets). */
static partitioned run_partition(em_device *device, em_lane *lane, const uint64_t *unique,
                                 const uint32_t *first, uint64_t n, uint32_t shards)
{
    em_error err;
    const uint64_t *on_device = upload(device, lane, unique, n * sizeof(uint64_t));
    const uint32_t *first_on_device = upload(device, lane, first, n * sizeof(uint32_t));
    uint64_t *keys = device_buffer(device, (n + 1) * sizeof(uint64_t));
    uint32_t *position = device_buffer(device, (n + 1) * sizeof(uint32_t));
    uint32_t *targets = device_buffer(device, (n + 1) * sizeof(uint32_t));
    partitioned result = {.counts = calloc(shards, sizeof(uint64_t))};
    ck_assert_msg(device->ops->partition_keys(lane, on_device, n, shards, first_on_device, keys,
                                              position, targets, result.counts, &err) == EM_OK,
                  "%s", err.message);
    result.keys = download(device, lane, keys, (n + 1) * sizeof(uint64_t));
    result.position = download(device, lane, position, (n + 1) * sizeof(uint32_t));
    result.targets = download(device, lane, targets, (n + 1) * sizeof(uint32_t));
    em_device_free(device, (void *)on_device);
    em_device_free(device, (void *)first_on_device);
    em_device_free(device, keys);
    em_device_free(device, position);
    em_device_free(device, targets);
    return result;
}

/* Loop index picks the shard count; distinct keys, as unique gives them. */
START_TEST(partition_is_stable_like_cpu)
{
    static const uint32_t shard_counts[] = {1, 2, 3, 7, 64, 1024};
    uint32_t shards = shard_counts[_i];
    uint64_t n = 5000;
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 100 + (uint64_t)_i);
    uint64_t *unique = malloc(n * sizeof(uint64_t));
    for (uint64_t i = 0; i < n; i++)
        unique[i] = em_test_rng_next(&rng);
    unique[0] = UINT64_MAX;
    unique[1] = UINT64_MAX - 1;
    uint32_t *first = malloc(n * sizeof(uint32_t));
    for (uint64_t i = 0; i < n; i++)
        first[i] = (uint32_t)em_test_rng_below(&rng, 1u << 30);
    devices d = open_devices();
    partitioned cpu = run_partition(d.cpu, d.cpu_lane, unique, first, n, shards);
    partitioned gpu = run_partition(d.gpu, d.gpu_lane, unique, first, n, shards);
    ck_assert(memcmp(gpu.counts, cpu.counts, shards * sizeof(uint64_t)) == 0);
    ck_assert(memcmp(gpu.keys, cpu.keys, n * sizeof(uint64_t)) == 0);
    ck_assert(memcmp(gpu.position, cpu.position, n * sizeof(uint32_t)) == 0);
    ck_assert(memcmp(gpu.targets, cpu.targets, n * sizeof(uint32_t)) == 0);
    for (uint64_t u = 0; u < n; u++)
        ck_assert_uint_eq(cpu.targets[cpu.position[u]], first[u]);
    free(first);
    free(cpu.keys);
    free(cpu.position);
    free(cpu.targets);
    free(cpu.counts);
    free(gpu.keys);
    free(gpu.position);
    free(gpu.targets);
    free(gpu.counts);
    close_devices(&d);
    free(unique);
}
END_TEST

/* Loop index picks the shard count (and many repeats or few): the GPU's dedupe and
 * partition in one operation (unique_partition_keys, the count left on the GPU and the
 * partition run over every key position) give what the CPU's dedupe then partition give,
 * and wait for the GPU once (with fewer than 64 shards). */
START_TEST(unique_and_partition_with_one_wait_like_cpu)
{
    static const uint32_t shard_counts[] = {1, 2, 7, 64, 1024};
    uint32_t shards = shard_counts[_i % 5];
    uint64_t n = 3000, universe = _i < 5 ? 700 : 1u << 30;
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 300 + (uint64_t)_i);
    uint64_t *keys = malloc(n * sizeof(uint64_t));
    for (uint64_t i = 0; i < n; i++)
        keys[i] = random_key(&rng, universe);
    keys[n - 1] = UINT64_MAX;
    devices d = open_devices();
    deduped cpu_unique = run_unique(d.cpu, d.cpu_lane, keys, n);
    partitioned cpu = run_partition(d.cpu, d.cpu_lane, cpu_unique.unique, cpu_unique.first,
                                    cpu_unique.count, shards);
    em_error err;
    const uint64_t *on_device = upload(d.gpu, d.gpu_lane, keys, n * sizeof(uint64_t));
    void *buffers[6];
    for (int b = 0; b < 6; b++)
        buffers[b] = device_buffer(d.gpu, n * sizeof(uint64_t));
    uint64_t count = 0, *counts = calloc(shards, sizeof(uint64_t));
    uint64_t operations = 0, waits = 0, waits_after = 0;
    em_gpu_emulated_counts(&operations, &waits);
    ck_assert_msg(d.gpu->ops->unique_partition_keys(d.gpu_lane, on_device, n, shards, buffers[0],
                                                    buffers[1], buffers[2], buffers[3],
                                                    buffers[4], buffers[5], &count, counts,
                                                    &err) == EM_OK,
                  "%s", err.message);
    em_gpu_emulated_counts(&operations, &waits_after);
    if (shards < 64) /* more shards' starts than a count's read back come through staging */
        ck_assert_uint_eq(waits_after - waits, 1);
    ck_assert_uint_eq(count, cpu_unique.count);
    ck_assert(memcmp(counts, cpu.counts, shards * sizeof(uint64_t)) == 0);
    void *host[6];
    for (int b = 0; b < 6; b++)
        host[b] = download(d.gpu, d.gpu_lane, buffers[b], n * sizeof(uint64_t));
    ck_assert(memcmp(host[0], cpu_unique.unique, count * sizeof(uint64_t)) == 0);
    ck_assert(memcmp(host[1], cpu_unique.inverse, n * sizeof(uint32_t)) == 0);
    ck_assert(memcmp(host[2], cpu_unique.first, count * sizeof(uint32_t)) == 0);
    ck_assert(memcmp(host[3], cpu.keys, count * sizeof(uint64_t)) == 0);
    ck_assert(memcmp(host[4], cpu.position, count * sizeof(uint32_t)) == 0);
    ck_assert(memcmp(host[5], cpu.targets, count * sizeof(uint32_t)) == 0);
    for (int b = 0; b < 6; b++) {
        free(host[b]);
        em_device_free(d.gpu, buffers[b]);
    }
    em_device_free(d.gpu, (void *)on_device);
    free(counts);
    free(cpu_unique.unique);
    free(cpu_unique.inverse);
    free(cpu_unique.first);
    free(cpu.keys);
    free(cpu.position);
    free(cpu.targets);
    free(cpu.counts);
    close_devices(&d);
    free(keys);
}
END_TEST

/* ---- gradient sums and pooling --------------------------------------------------------- */

/* A random batch with its dedupe and partition (computed on the CPU device). */
typedef struct scenario {
    uint32_t rows;
    uint64_t nnz, unique_count;
    uint32_t *offsets, *inverse, *position, *first; /* host */
} scenario;

/* Fills the scenario's dedupe and partition from its keys (freed). */
static void dedupe_scenario(scenario *s_out, uint64_t *keys, devices *d);

static scenario random_scenario(em_test_rng *rng, devices *d)
{
    scenario s;
    s.rows = 200;
    s.offsets = malloc((s.rows + 1) * sizeof(uint32_t));
    uint64_t *keys = malloc((size_t)s.rows * 12 * sizeof(uint64_t) + 8);
    s.offsets[0] = 0;
    for (uint32_t r = 0; r < s.rows - 1; r++) {
        uint32_t length = (uint32_t)em_test_rng_below(rng, 12); /* empty rows included */
        for (uint32_t k = 0; k < length; k++)
            keys[s.offsets[r] + k] = random_key(rng, 150);
        s.offsets[r + 1] = s.offsets[r] + length;
    }
    /* The last row holds one key that appears nowhere else (see with_negative_zeros). */
    keys[s.offsets[s.rows - 1]] = 0x5eed5eedull;
    s.offsets[s.rows] = s.offsets[s.rows - 1] + 1;
    s.nnz = s.offsets[s.rows];
    dedupe_scenario(&s, keys, d);
    return s;
}

/* A batch whose hot keys occur 33, 64, 100 and 2,000 times (more than the 32 a chunk of
 * the gradient-sum tree holds), among ~1,000 ordinary occurrences of 150 keys, shuffled
 * and cut into rows of 0 to 20 keys. */
static scenario hot_scenario(em_test_rng *rng, devices *d)
{
    static const uint32_t hot_counts[] = {33, 64, 100, 2000};
    uint64_t nnz = 1000;
    for (size_t h = 0; h < 4; h++)
        nnz += hot_counts[h];
    uint64_t *keys = malloc(nnz * sizeof(uint64_t));
    uint64_t n = 0;
    for (; n < 1000; n++)
        keys[n] = random_key(rng, 150);
    for (size_t h = 0; h < 4; h++)
        for (uint32_t c = 0; c < hot_counts[h]; c++)
            keys[n++] = 0x407000ull + h;
    for (uint64_t i = nnz - 1; i > 0; i--) {
        uint64_t j = em_test_rng_below(rng, i + 1), swap = keys[i];
        keys[i] = keys[j];
        keys[j] = swap;
    }
    scenario s;
    s.offsets = malloc((nnz + 1) * sizeof(uint32_t));
    s.offsets[0] = 0;
    s.rows = 0;
    while (s.offsets[s.rows] < nnz) {
        uint64_t length = em_test_rng_below(rng, 21);
        uint64_t end = s.offsets[s.rows] + length < nnz ? s.offsets[s.rows] + length : nnz;
        s.offsets[++s.rows] = (uint32_t)end;
    }
    s.nnz = nnz;
    dedupe_scenario(&s, keys, d);
    return s;
}

static void dedupe_scenario(scenario *s_out, uint64_t *keys, devices *d)
{
    scenario s = *s_out;
    deduped u = run_unique(d->cpu, d->cpu_lane, keys, s.nnz);
    partitioned p = run_partition(d->cpu, d->cpu_lane, u.unique, u.first, u.count, 5);
    s.unique_count = u.count;
    s.inverse = u.inverse;
    s.position = p.position;
    s.first = u.first;
    free(u.unique);
    free(p.keys);
    free(p.targets);
    free(p.counts);
    free(keys);
    *s_out = s;
}

static void free_scenario(scenario *s)
{
    free(s->offsets);
    free(s->inverse);
    free(s->position);
    free(s->first);
}

typedef enum operation { SUM_GRADIENTS, COMBINE, COPY_REPEATS } operation;

/* Runs one operation on a device over copies of the scenario; returns the output. */
static float *run_operation(em_device *device, em_lane *lane, const scenario *s, operation op,
                            em_combiner combiner, uint32_t dim, const float *input,
                            uint64_t input_floats, uint64_t output_floats)
{
    em_error err;
    em_device_batch batch = {
        .rows = s->rows,
        .nnz = s->nnz,
        .offsets = upload(device, lane, s->offsets, (s->rows + 1) * sizeof(uint32_t)),
        .inverse = upload(device, lane, s->inverse, s->nnz * sizeof(uint32_t)),
        .position = upload(device, lane, s->position, s->unique_count * sizeof(uint32_t)),
        .unique_count = s->unique_count,
    };
    const float *in = upload(device, lane, input, input_floats * sizeof(float));
    float *out = device_buffer(device, (output_floats + 1) * sizeof(float));
    const uint32_t *first = upload(device, lane, s->first, s->unique_count * sizeof(uint32_t));
    em_status status = EM_OK;
    if (op == SUM_GRADIENTS)
        status = device->ops->sum_gradients(lane, &batch, combiner, dim, in, out, &err);
    else if (op == COMBINE)
        status = device->ops->combine(lane, &batch, combiner, dim, in, out, &err);
    else if ((status = device->ops->copy_to_device(lane, out, input, output_floats * sizeof(float),
                                                   &err)) == EM_OK)
        status = device->ops->copy_repeats(lane, &batch, first, dim, out, &err); /* in place */
    ck_assert_msg(status == EM_OK, "%s", err.message);
    em_device_free(device, (void *)first);
    float *result = download(device, lane, out, output_floats * sizeof(float));
    em_device_free(device, (void *)batch.offsets);
    em_device_free(device, (void *)batch.inverse);
    em_device_free(device, (void *)batch.position);
    em_device_free(device, (void *)in);
    em_device_free(device, out);
    return result;
}

static float *random_floats(em_test_rng *rng, uint64_t count)
{
    float *values = malloc((count + 1) * sizeof(float));
    for (uint64_t i = 0; i < count; i++)
        values[i] = (float)(2.0 * em_test_rng_unit(rng) - 1.0);
    return values;
}

/* The last vector (the last key's, or the last row's: the scenario's lone key) becomes
 * -0.0: its sum must stay -0.0, which only a sum starting from -0.0 gives. */
static void with_negative_zeros(float *vectors, uint64_t count, uint32_t dim)
{
    for (uint32_t j = 0; j < dim; j++)
        vectors[(count - 1) * dim + j] = -0.0f;
}

/* Loop index: combiner x dim (1, 13, 16, 33). Both operations, bit for bit. */
START_TEST(sums_and_pooling_bit_for_bit_like_cpu)
{
    static const uint32_t dims[] = {1, 13, 16, 33};
    em_combiner combiner = (em_combiner)(_i / 4);
    uint32_t dim = dims[_i % 4];
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 200 + (uint64_t)_i);
    devices d = open_devices();
    scenario s = random_scenario(&rng, &d);
    uint64_t vectors = combiner == EM_COMBINER_NONE ? s.nnz : s.rows;

    float *gradients = random_floats(&rng, vectors * dim);
    with_negative_zeros(gradients, vectors, dim);
    float *cpu_sums = run_operation(d.cpu, d.cpu_lane, &s, SUM_GRADIENTS, combiner, dim, gradients,
                                    vectors * dim, s.unique_count * dim);
    float *gpu_sums = run_operation(d.gpu, d.gpu_lane, &s, SUM_GRADIENTS, combiner, dim, gradients,
                                    vectors * dim, s.unique_count * dim);
    ck_assert(memcmp(gpu_sums, cpu_sums, s.unique_count * dim * sizeof(float)) == 0);

    float *unique_vectors = random_floats(&rng, s.unique_count * dim);
    float *cpu_out = run_operation(d.cpu, d.cpu_lane, &s, COMBINE, combiner, dim, unique_vectors,
                                   s.unique_count * dim, vectors * dim);
    float *gpu_out = run_operation(d.gpu, d.gpu_lane, &s, COMBINE, combiner, dim, unique_vectors,
                                   s.unique_count * dim, vectors * dim);
    ck_assert(memcmp(gpu_out, cpu_out, vectors * dim * sizeof(float)) == 0);

    /* A per-key output with vectors at their keys' first positions only: repeats copy. */
    float *firsts_only = random_floats(&rng, s.nnz * dim);
    float *cpu_repeats = run_operation(d.cpu, d.cpu_lane, &s, COPY_REPEATS, combiner, dim,
                                       firsts_only, s.nnz * dim, s.nnz * dim);
    float *gpu_repeats = run_operation(d.gpu, d.gpu_lane, &s, COPY_REPEATS, combiner, dim,
                                       firsts_only, s.nnz * dim, s.nnz * dim);
    ck_assert(memcmp(gpu_repeats, cpu_repeats, s.nnz * dim * sizeof(float)) == 0);
    for (uint64_t k = 0; k < s.nnz; k++)
        ck_assert(memcmp(cpu_repeats + k * dim, firsts_only + (uint64_t)s.first[s.inverse[k]] * dim,
                         dim * sizeof(float)) == 0);
    free(firsts_only);
    free(cpu_repeats);
    free(gpu_repeats);

    free(gradients);
    free(cpu_sums);
    free(gpu_sums);
    free(unique_vectors);
    free(cpu_out);
    free(gpu_out);
    free_scenario(&s);
    close_devices(&d);
}
END_TEST

/* Element j of unique key u's sum as common/gradient_sum.h defines it, written out here
 * level by level (new arrays, no sharing with the devices' code): the contributions in
 * key order, groups of 32 summed serially from -0.0, repeated on the group sums. */
static float tree_sum(const scenario *s, em_combiner combiner, uint32_t dim,
                      const float *gradients, uint64_t u, uint32_t j, float *serial)
{
    float *values = malloc(s->nnz * sizeof(float));
    uint64_t count = 0;
    for (uint32_t r = 0; r < s->rows; r++) {
        uint32_t length = s->offsets[r + 1] - s->offsets[r];
        for (uint32_t k = s->offsets[r]; k < s->offsets[r + 1]; k++) {
            if (s->inverse[k] != u)
                continue;
            if (combiner == EM_COMBINER_NONE) {
                values[count++] = gradients[(uint64_t)k * dim + j];
            } else {
                float divisor = em_combiner_divisor(combiner, length);
                float g = gradients[(uint64_t)r * dim + j];
                values[count++] = divisor == 1.0f ? g : g / divisor;
            }
        }
    }
    *serial = -0.0f;
    for (uint64_t i = 0; i < count; i++)
        *serial += values[i];
    while (count > 1) {
        uint64_t groups = (count + 31) / 32;
        float *next = malloc(groups * sizeof(float));
        for (uint64_t g = 0; g < groups; g++) {
            next[g] = -0.0f;
            for (uint64_t i = g * 32; i < count && i < g * 32 + 32; i++)
                next[g] += values[i];
        }
        free(values);
        values = next;
        count = groups;
    }
    float sum = values[0];
    free(values);
    return sum;
}

/* Loop index: combiner x dim (1, 33). Keys present up to 2,000 times are summed by the
 * chunk tree of common/gradient_sum.h on both devices, bit for bit; a plain serial sum
 * gives other bits for some of them (so the test tells the two apart). */
START_TEST(hot_keys_sum_by_the_chunk_tree_like_cpu)
{
    static const uint32_t dims[] = {1, 33};
    em_combiner combiner = (em_combiner)(_i / 2);
    uint32_t dim = dims[_i % 2];
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 300 + (uint64_t)_i);
    devices d = open_devices();
    scenario s = hot_scenario(&rng, &d);
    uint64_t vectors = combiner == EM_COMBINER_NONE ? s.nnz : s.rows;
    float *gradients = random_floats(&rng, vectors * dim);
    float *cpu_sums = run_operation(d.cpu, d.cpu_lane, &s, SUM_GRADIENTS, combiner, dim, gradients,
                                    vectors * dim, s.unique_count * dim);
    float *gpu_sums = run_operation(d.gpu, d.gpu_lane, &s, SUM_GRADIENTS, combiner, dim, gradients,
                                    vectors * dim, s.unique_count * dim);
    ck_assert(memcmp(gpu_sums, cpu_sums, s.unique_count * dim * sizeof(float)) == 0);
    uint64_t serial_differs = 0;
    for (uint64_t u = 0; u < s.unique_count; u++) {
        for (uint32_t j = 0; j < dim; j++) {
            float serial = 0.0f;
            float expected = tree_sum(&s, combiner, dim, gradients, u, j, &serial);
            float got = cpu_sums[(uint64_t)s.position[u] * dim + j];
            ck_assert_msg(memcmp(&got, &expected, sizeof(float)) == 0,
                          "unique key %" PRIu64 " element %u: %a, the tree gives %a", u, j, got,
                          expected);
            serial_differs += memcmp(&serial, &expected, sizeof(float)) != 0;
        }
    }
    ck_assert_uint_gt(serial_differs, 0);
    free(gradients);
    free(cpu_sums);
    free(gpu_sums);
    free_scenario(&s);
    close_devices(&d);
}
END_TEST

/* The kernels and the CPU device share one divisor (common/combiner.h); it must be the
 * README's formula in binary32: NONE and SUM 1, MEAN len, SQRTN sqrtf(len), empty 1. */
START_TEST(combiner_divisor_is_the_csr_formula)
{
    for (int combiner = 0; combiner < 4; combiner++)
        for (uint32_t length = 0; length < 70000; length += length < 100 ? 1 : 997) {
            float shared = em_combiner_divisor((em_combiner)combiner, length);
            float formula = 1.0f;
            if (length > 0 && combiner == EM_COMBINER_MEAN)
                formula = (float)length;
            if (length > 0 && combiner == EM_COMBINER_SQRTN)
                formula = sqrtf((float)length);
            ck_assert_msg(memcmp(&shared, &formula, sizeof(float)) == 0, "combiner %d length %u",
                          combiner, length);
        }
}
END_TEST

/* ---- index math --------------------------------------------------------------------------- */

START_TEST(segment_starts_cover_empty_segments)
{
    const uint32_t sorted[] = {1, 1, 3, 3, 3, 6};
    uint32_t starts[9];
    memset(starts, 0xff, sizeof(starts));
    for (uint64_t i = 0; i <= 6; i++)
        em_gpu_segment_start_item(sorted, 6, 8, i, starts);
    const uint32_t expected[9] = {0, 0, 2, 2, 5, 5, 5, 6, 6};
    ck_assert(memcmp(starts, expected, sizeof(expected)) == 0);
    memset(starts, 0xff, sizeof(starts));
    em_gpu_segment_start_item(sorted, 0, 3, 0, starts); /* no keys: every start is 0 */
    for (int s = 0; s < 4; s++)
        ck_assert_uint_eq(starts[s], 0);
}
END_TEST

/* The sums find each unique index's run of a sorted inverse themselves: from any of its
 * positions, the run's bounds; at its first position, that it begins and whether it is
 * longer than a chunk (runs of 1 to 70 positions, so 32 and 33 both occur). */
START_TEST(runs_of_a_sorted_inverse_are_found_from_any_position)
{
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 77);
    enum { MAX = 20000 };
    uint32_t *sorted = malloc(MAX * sizeof(uint32_t));
    uint64_t *run_begin = malloc(MAX * sizeof(uint64_t)), *run_end = malloc(MAX * sizeof(uint64_t));
    uint64_t n = 0;
    for (uint32_t u = 0; n < MAX - 70; u++) {
        uint64_t length = u % 8 == 0 ? 32 + u % 3 : 1 + em_test_rng_below(&rng, 70);
        for (uint64_t k = 0; k < length; k++) {
            sorted[n + k] = u;
            run_begin[n + k] = n;
            run_end[n + k] = n + length;
        }
        n += length;
    }
    uint64_t wrong = 0, hot = 0;
    for (uint64_t p = 0; p < n; p++) {
        uint64_t begin = 0, end = 0;
        em_gpu_run_bounds(sorted, n, p, &begin, &end);
        wrong += begin != run_begin[p] || end != run_end[p];
        wrong += em_gpu_run_begins(sorted, p) != (run_begin[p] == p);
        if (run_begin[p] == p) {
            int long_run = run_end[p] - p > EM_SUM_CHUNK;
            wrong += em_gpu_run_hot(sorted, n, p) != long_run;
            hot += long_run;
        }
    }
    ck_assert_uint_eq(wrong, 0);
    ck_assert_uint_gt(hot, 0);
    free(sorted);
    free(run_begin);
    free(run_end);
}
END_TEST

START_TEST(row_of_key_skips_empty_rows)
{
    const uint32_t offsets[] = {0, 0, 3, 3, 3, 4, 6, 6};
    const uint32_t expected[] = {1, 1, 1, 4, 5, 5};
    for (uint64_t k = 0; k < 6; k++)
        ck_assert_uint_eq(em_gpu_row_of_key(offsets, 7, k), expected[k]);
    const uint32_t single[] = {0, 5};
    for (uint64_t k = 0; k < 5; k++)
        ck_assert_uint_eq(em_gpu_row_of_key(single, 1, k), 0);
}
END_TEST

START_TEST(group_shift_covers_rows_within_a_block)
{
    ck_assert_uint_eq(em_gpu_group_shift(1), 0);
    ck_assert_uint_eq(em_gpu_group_shift(2), 1);
    ck_assert_uint_eq(em_gpu_group_shift(13), 4);
    ck_assert_uint_eq(em_gpu_group_shift(16), 4);
    ck_assert_uint_eq(em_gpu_group_shift(17), 5);
    ck_assert_uint_eq(em_gpu_group_shift(256), 8);
    ck_assert_uint_eq(em_gpu_group_shift(4096), 8);
}
END_TEST

/* Host row storage in two blocks of 4 rows, stride 20 floats (dim 16 + 4 padding). */
START_TEST(gather_by_quads_equals_gather_by_elements)
{
    enum { DIM = 16, STRIDE = 20, ROWS = 8, N = 6 };
    static _Alignas(16) float block0[4 * STRIDE], block1[4 * STRIDE];
    for (int i = 0; i < 4 * STRIDE; i++) {
        block0[i] = (float)i;
        block1[i] = (float)(1000 + i);
    }
    float *blocks[2] = {block0, block1};
    em_gpu_storage storage = {.blocks = blocks, .block_shift = 2, .block_mask = 3,
                              .stride = STRIDE, .dim = DIM, .row_floats = DIM,
                              .row_limit = ROWS};
    const uint64_t rows[N] = {5, 0, EM_GPU_ROW_NONE, 7, 3, 4};
    static _Alignas(16) float by_quads[N * DIM], by_elements[N * DIM];
    memset(by_quads, 0x7f, sizeof(by_quads));
    for (uint64_t i = 0; i < N; i++) {
        for (uint32_t q = 0; q < DIM / 4; q++)
            em_gpu_rows_gather_quad(storage, rows, NULL, by_quads, i, q);
        for (uint32_t j = 0; j < DIM; j++)
            em_gpu_rows_gather_element(storage, rows, NULL, by_elements, i, j);
    }
    ck_assert(memcmp(by_quads, by_elements, sizeof(by_quads)) == 0);
    /* with targets, vector i lands at targets[i] */
    const uint32_t targets[N] = {3, 5, 0, 1, 4, 2};
    static _Alignas(16) float placed_quads[N * DIM], placed_elements[N * DIM];
    for (uint64_t i = 0; i < N; i++) {
        for (uint32_t q = 0; q < DIM / 4; q++)
            em_gpu_rows_gather_quad(storage, rows, targets, placed_quads, i, q);
        for (uint32_t j = 0; j < DIM; j++)
            em_gpu_rows_gather_element(storage, rows, targets, placed_elements, i, j);
    }
    ck_assert(memcmp(placed_quads, placed_elements, sizeof(placed_quads)) == 0);
    for (uint64_t i = 0; i < N; i++)
        ck_assert(memcmp(placed_elements + targets[i] * DIM, by_elements + i * DIM,
                         DIM * sizeof(float)) == 0);
    ck_assert_float_eq(by_elements[0], 1000.0f + 1 * STRIDE); /* row 5: block 1, slot 1 */
    ck_assert_float_eq(by_elements[2 * DIM + 5], 0.0f);       /* ROW_NONE reads zeros */
    ck_assert_float_eq(by_elements[4 * DIM + 3], (float)(3 * STRIDE + 3));
}
END_TEST

/* ---- hash map protocol under concurrency --------------------------------------------------- */

#define MAP_THREADS 8
#define MAP_KEYS 6000
#define MAP_SLOTS 8192

typedef struct map_race {
    em_gpu_map map;
    const uint64_t *keys;
    uint64_t rows[MAP_THREADS][MAP_KEYS];
    uint64_t inserted[MAP_THREADS];
    int thread;
} map_race;

/* Each thread inserts every key, starting at its own offset, so claims collide. */
static void *map_inserter(void *argument)
{
    map_race *race = argument;
    int thread = __atomic_fetch_add(&race->thread, 1, __ATOMIC_RELAXED);
    for (uint64_t step = 0; step < MAP_KEYS; step++) {
        uint64_t i = (step + (uint64_t)thread * 997) % MAP_KEYS;
        int fresh = 0;
        race->rows[thread][i] = em_gpu_map_insert_key(race->map, race->keys[i], &fresh);
        race->inserted[thread] += (uint64_t)fresh;
    }
    return NULL;
}

START_TEST(map_claims_give_every_key_one_row_under_threads)
{
    uint64_t *keys = malloc(MAP_KEYS * sizeof(uint64_t));
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 300);
    for (uint64_t i = 0; i < MAP_KEYS; i++)
        keys[i] = i < 2 ? UINT64_MAX - i : em_test_rng_next(&rng) | 1; /* sentinels too */
    em_gpu_slot *slots = aligned_alloc(16, MAP_SLOTS * sizeof(em_gpu_slot));
    memset(slots, 0xff, MAP_SLOTS * sizeof(em_gpu_slot));
    em_gpu_map_header header = {.rows = 0, .side_rows = {EM_GPU_ROW_NONE, EM_GPU_ROW_NONE}};
    map_race *race = calloc(1, sizeof(*race));
    race->map = (em_gpu_map){.slots = slots, .slot_count = MAP_SLOTS, .header = &header};
    race->keys = keys;
    pthread_t threads[MAP_THREADS];
    for (int t = 0; t < MAP_THREADS; t++)
        pthread_create(&threads[t], NULL, map_inserter, race);
    for (int t = 0; t < MAP_THREADS; t++)
        pthread_join(threads[t], NULL);
    /* Only now: a thread's index in race (its turn to start) is not its place in threads */
    uint64_t inserted = 0;
    for (int t = 0; t < MAP_THREADS; t++)
        inserted += race->inserted[t];
    ck_assert_uint_eq(inserted, MAP_KEYS);
    ck_assert_uint_eq(header.rows, MAP_KEYS);
    ck_assert_uint_eq(header.overflow, 0);
    uint8_t *seen = calloc(MAP_KEYS, 1);
    for (uint64_t i = 0; i < MAP_KEYS; i++) {
        uint64_t row = race->rows[0][i];
        ck_assert_uint_lt(row, MAP_KEYS);
        ck_assert_msg(!seen[row], "row %llu handed out twice", (unsigned long long)row);
        seen[row] = 1;
        for (int t = 1; t < MAP_THREADS; t++)
            ck_assert_uint_eq(race->rows[t][i], row);
        ck_assert_uint_eq(em_gpu_map_lookup(race->map, keys[i]), row);
    }
    ck_assert_uint_eq(em_gpu_map_lookup(race->map, 2), EM_GPU_ROW_NONE);

    /* Rehash into a bigger map: same rows. */
    em_gpu_slot *bigger = aligned_alloc(16, 4 * MAP_SLOTS * sizeof(em_gpu_slot));
    memset(bigger, 0xff, 4 * MAP_SLOTS * sizeof(em_gpu_slot));
    em_gpu_map grown = {.slots = bigger, .slot_count = 4 * MAP_SLOTS, .header = &header};
    for (uint64_t s = 0; s < MAP_SLOTS; s++)
        em_gpu_map_rehash_item(slots, s, grown);
    for (uint64_t i = 0; i < MAP_KEYS; i++)
        ck_assert_uint_eq(em_gpu_map_lookup(grown, keys[i]), race->rows[0][i]);
    ck_assert_uint_eq(header.overflow, 0);
    free(bigger);
    free(seen);
    free(race);
    free(slots);
    free(keys);
}
END_TEST

START_TEST(map_full_sets_overflow_instead_of_looping)
{
    em_gpu_slot slots[16];
    memset(slots, 0xff, sizeof(slots));
    em_gpu_map_header header = {.rows = 0, .side_rows = {EM_GPU_ROW_NONE, EM_GPU_ROW_NONE}};
    em_gpu_map map = {.slots = slots, .slot_count = 16, .header = &header};
    int fresh = 0;
    for (uint64_t key = 1; key <= 16; key++)
        ck_assert_uint_eq(em_gpu_map_insert_key(map, key, &fresh), key - 1);
    ck_assert_uint_eq(header.overflow, 0);
    ck_assert_uint_eq(em_gpu_map_insert_key(map, 99, &fresh), EM_GPU_ROW_NONE);
    ck_assert_int_eq(fresh, 0);
    ck_assert_uint_eq(header.overflow, 1);
    ck_assert_uint_eq(em_gpu_map_lookup(map, 99), EM_GPU_ROW_NONE);
    ck_assert_uint_eq(em_gpu_map_lookup(map, 16), 15);
}
END_TEST

/* Walks in pieces (em_gpu_walk_piece) over chunks of flags scanned together: two walks
 * of one map, the first from slot 40 to the end then from slot 0 (wrapping), its first
 * range cut where the first chunk of 32 flags ends and going on in the second chunk
 * beside the second walk, each walk's entries in its own slot order, cut at want. Run
 * step by step as the launches go: flags, the chunk's scan, compaction, counts. */
START_TEST(walk_pieces_over_chunks_read_each_walk_in_slot_order)
{
    enum { SLOTS = 64, WINDOW = 32 };
    em_gpu_slot slots[SLOTS];
    em_gpu_row_access access[SLOTS];
    em_gpu_row_access *blocks[1] = {access};
    memset(slots, 0xff, sizeof(slots));
    for (uint64_t i = 0; i < SLOTS; i++) {
        if (i % 3 != 0) /* every third slot empty */
            slots[i] = (em_gpu_slot){.key = 1000 + i, .row = i};
        access[i] = (em_gpu_row_access){.accessed = 500 + i, .updated = 1, .frequency = 2};
    }
    slots[50].key = EM_GPU_TOMBSTONE_KEY;
    em_gpu_map map = {.slots = slots, .slot_count = SLOTS};
    em_gpu_storage storage = {.access = blocks, .block_shift = 20,
                              .block_mask = (UINT64_C(1) << 20) - 1};
    enum { WANT_A = 40, WANT_B = 5 };
    em_gpu_walk walks[2];
    memset(walks, 0x5a, sizeof(walks)); /* the first piece of each sets its counts */
    uint64_t keys_a[WANT_A], rows_a[WANT_A], keys_b[WANT_B], rows_b[WANT_B];
    em_gpu_row_access access_a[WANT_A], access_b[WANT_B];
    uint64_t kept_from[3] = {7, 8, 9}, kept_to[3] = {0};
    em_gpu_walk_piece a = {.map = map, .storage = storage, .want = WANT_A, .walk = &walks[0],
                           .keys = keys_a, .rows = rows_a, .access = access_a};
    em_gpu_walk_piece b = a;
    b.want = WANT_B;
    b.walk = &walks[1];
    b.keys = keys_b;
    b.rows = rows_b;
    b.access = access_b;
    /* chunk 0: walk a's slots [40, 64) then [0, 8); chunk 1: a's [8, 20), b's [10, 30) */
    em_gpu_walk_piece chunk0[2] = {a, a}, chunk1[2] = {a, b};
    chunk0[0].begin = 40, chunk0[0].count = 24, chunk0[0].first_flag = 0;
    chunk0[0].starts = 1, chunk0[0].wrap = 1;
    chunk0[0].kept_from = kept_from, chunk0[0].kept_to = kept_to, chunk0[0].kept_count = 3;
    chunk0[1].begin = 0, chunk0[1].count = 8, chunk0[1].first_flag = 24, chunk0[1].base_flag = 0;
    chunk1[0].begin = 8, chunk1[0].count = 12, chunk1[0].first_flag = 0;
    chunk1[1].begin = 10, chunk1[1].count = 20, chunk1[1].first_flag = 12;
    chunk1[1].base_flag = 12, chunk1[1].starts = 1;
    em_gpu_walk_piece *chunks[2] = {chunk0, chunk1};
    for (int c = 0; c < 2; c++) {
        em_gpu_walk_piece *pieces = chunks[c];
        uint32_t flags[WINDOW + 1], rank[WINDOW + 1];
        memset(flags, 0x77, sizeof(flags));
        for (uint32_t p = 0; p < 2; p++)
            for (uint64_t i = 0; i < WINDOW; i++)
                em_gpu_walks_flag_item(pieces, 2, p, i, flags);
        uint64_t slots_in = pieces[0].count + pieces[1].count;
        ck_assert_uint_eq(flags[slots_in], 0);
        for (uint64_t i = 0, sum = 0; i <= slots_in; i++) {
            rank[i] = (uint32_t)sum;
            sum += flags[i];
        }
        for (uint32_t p = 0; p < 2; p++)
            for (uint64_t i = 0; i < pieces[p].count; i++)
                em_gpu_walks_compact_item(&pieces[p], i, flags, rank);
        em_gpu_walks_advance_all(pieces, 2, rank);
    }
    ck_assert(memcmp(kept_to, kept_from, sizeof(kept_from)) == 0);
    /* walk a: occupied slots of 40..63 (slot 50 a tombstone), then of 0..19 */
    uint64_t expected[SLOTS], n = 0, before = 0;
    for (uint64_t i = 40; i < 64; i++)
        if (i % 3 != 0 && i != 50)
            expected[n++] = i;
    before = n;
    for (uint64_t i = 0; i < 20; i++)
        if (i % 3 != 0)
            expected[n++] = i;
    ck_assert_uint_eq(walks[0].taken, n);
    ck_assert_uint_eq(walks[0].before_wrap, before);
    ck_assert_uint_lt(n, WANT_A); /* not cut: no entry want - 1 met */
    ck_assert_uint_eq(walks[0].next_slot, UINT64_MAX);
    for (uint64_t e = 0; e < n; e++) {
        ck_assert_uint_eq(keys_a[e], 1000 + expected[e]);
        ck_assert_uint_eq(rows_a[e], expected[e]);
        ck_assert_uint_eq(access_a[e].accessed, 500 + expected[e]);
    }
    /* walk b: cut at its 5th entry; it met every occupied slot of 10..29 */
    uint64_t b_slots[WANT_B] = {10, 11, 13, 14, 16};
    for (uint64_t e = 0; e < WANT_B; e++)
        ck_assert_uint_eq(keys_b[e], 1000 + b_slots[e]);
    ck_assert_uint_eq(walks[1].next_slot, 17);
    ck_assert_uint_eq(walks[1].taken, 14);
    ck_assert_uint_eq(walks[1].before_wrap, 0);
}
END_TEST

/* A map's seed sets its home slots: keys inserted in the slot order of one seed's map
 * (as a loaded checkpoint's rows arrive) into a map with another seed go to other
 * homes, are all found, and probe runs stay short at load 0.5. */
START_TEST(map_seed_sets_the_home_slots)
{
    enum { SLOTS = 4096, KEYS = 2048 };
    em_gpu_slot *saved = malloc(SLOTS * sizeof(em_gpu_slot));
    em_gpu_slot *loaded = malloc(SLOTS * sizeof(em_gpu_slot));
    memset(saved, 0xff, SLOTS * sizeof(em_gpu_slot));
    memset(loaded, 0xff, SLOTS * sizeof(em_gpu_slot));
    em_gpu_map_header a = {.side_rows = {EM_GPU_ROW_NONE, EM_GPU_ROW_NONE}};
    em_gpu_map_header b = a;
    em_gpu_map first = {.slots = saved, .slot_count = SLOTS, .header = &a,
                        .seed = EM_HASHMAP_SEED};
    em_gpu_map second = {.slots = loaded, .slot_count = SLOTS, .header = &b,
                         .seed = em_mix64(42) | 1u};
    int fresh = 0;
    for (uint64_t key = 1; key <= KEYS; key++)
        em_gpu_map_insert_key(first, key * 0x9e3779b97f4a7c15ull, &fresh);
    /* the keys again, in the first map's slot order, into the second */
    for (uint64_t slot = 0; slot < SLOTS; slot++)
        if (saved[slot].key != EM_GPU_EMPTY_KEY)
            em_gpu_map_insert_key(second, saved[slot].key, &fresh);
    ck_assert_uint_eq(b.rows, KEYS);
    uint64_t moved = 0, longest = 0;
    for (uint64_t key = 1; key <= KEYS; key++) {
        uint64_t k = key * 0x9e3779b97f4a7c15ull;
        ck_assert_uint_ne(em_gpu_map_lookup(second, k), EM_GPU_ROW_NONE);
        em_gpu_probe in_second, in_first;
        uint64_t slot = em_gpu_probe_start(&in_second, k, second.seed, SLOTS);
        moved += slot != em_gpu_probe_start(&in_first, k, first.seed, SLOTS);
        uint64_t probe = 0;
        for (; loaded[slot].key != k; slot = em_gpu_probe_next(&in_second))
            probe++;
        longest = probe > longest ? probe : longest;
    }
    ck_assert_uint_gt(moved, KEYS * 9 / 10);
    ck_assert_uint_lt(longest, 64); /* load 0.5: short runs */
    free(saved);
    free(loaded);
}
END_TEST

/* A key's probe sequence visits every slot of the map once, in buckets of
 * EM_GPU_BUCKET_SLOTS (power-of-two bucket counts, as shards make them), linearly (other
 * bucket counts) or slot by slot (other sizes). */
START_TEST(probe_sequences_visit_every_slot_once)
{
    static const uint64_t sizes[] = {8, 16, 1024, 24, 13};
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint64_t slots = sizes[z];
        uint8_t *visits = malloc(slots);
        for (uint64_t key = 1; key < 200; key++) {
            memset(visits, 0, slots);
            em_gpu_probe probe;
            uint64_t slot = em_gpu_probe_start(&probe, key * 0x9e3779b97f4a7c15ull,
                                               EM_HASHMAP_SEED, slots);
            for (uint64_t seen = 0; seen < slots; seen++) {
                ck_assert_uint_lt(slot, slots);
                visits[slot]++;
                if (slots % EM_GPU_BUCKET_SLOTS == 0 && seen % EM_GPU_BUCKET_SLOTS != 0)
                    ck_assert_uint_eq(slot % EM_GPU_BUCKET_SLOTS, seen % EM_GPU_BUCKET_SLOTS);
                slot = em_gpu_probe_next(&probe);
            }
            for (uint64_t i = 0; i < slots; i++)
                ck_assert_msg(visits[i] == 1, "%" PRIu64 " slots, key %" PRIu64 ": slot %" PRIu64
                              " visited %u times", slots, key, i, visits[i]);
        }
        free(visits);
    }
}
END_TEST

/* A bucket's search stops where a search of its slots in order stops: at the first slot
 * holding the key or EMPTY, for every pair of masks a bucket can give. */
START_TEST(bucket_stop_is_where_slot_order_stops)
{
    for (uint32_t hits = 0; hits < 1u << EM_GPU_BUCKET_SLOTS; hits++)
        for (uint32_t empties = 0; empties < 1u << EM_GPU_BUCKET_SLOTS; empties++) {
            if ((hits & empties) != 0) /* a slot holds the key or is EMPTY, not both */
                continue;
            int expected = -1;
            for (uint32_t t = 0; t < EM_GPU_BUCKET_SLOTS && expected < 0; t++)
                if (((hits | empties) >> t & 1u) != 0)
                    expected = (int)t;
            ck_assert_int_eq(em_gpu_bucket_stop(hits, empties), expected);
        }
}
END_TEST

/* The search a bucket at a time (the GPU's finds) gives what the search slot by slot
 * gives, for every key of map, and for every absent key in [absent, absent + count). */
static void lookups_agree(em_gpu_map map, uint64_t keys, uint64_t absent, uint64_t count)
{
    for (uint64_t k = 0; k < keys; k++)
        ck_assert_uint_eq(em_gpu_map_lookup_buckets(map, em_mix64(k + 1)),
                          em_gpu_map_lookup(map, em_mix64(k + 1)));
    for (uint64_t a = 0; a < count; a++)
        ck_assert_uint_eq(em_gpu_map_lookup_buckets(map, em_mix64(absent + a)),
                          em_gpu_map_lookup(map, em_mix64(absent + a)));
    ck_assert_uint_eq(em_gpu_map_lookup_buckets(map, EM_GPU_EMPTY_KEY),
                      em_gpu_map_lookup(map, EM_GPU_EMPTY_KEY));
}

/* At the most a shard's map holds (load 0.9), every key is found at its row, no absent
 * key is, erased keys leave the others found, and their slots (tombstones) do not end
 * other keys' searches; searched a bucket at a time, the same. */
START_TEST(maps_at_load_0_9_find_every_key)
{
    enum { SLOTS = 1 << 14, KEYS = SLOTS / 10 * 9, ABSENT = 20000 };
    em_gpu_slot *slots = aligned_alloc(16, SLOTS * sizeof(em_gpu_slot));
    memset(slots, 0xff, SLOTS * sizeof(em_gpu_slot));
    uint64_t *free_rows = malloc(KEYS * sizeof(uint64_t));
    em_gpu_map_header header = {.side_rows = {EM_GPU_ROW_NONE, EM_GPU_ROW_NONE}};
    em_gpu_map map = {.slots = slots, .slot_count = SLOTS, .header = &header,
                      .seed = EM_HASHMAP_SEED, .free_rows = free_rows};
    for (uint64_t k = 0; k < KEYS; k++) {
        int fresh = 0;
        ck_assert_uint_eq(em_gpu_map_insert_key(map, em_mix64(k + 1), &fresh), k);
        ck_assert_int_eq(fresh, 1);
    }
    ck_assert_uint_eq(header.overflow, 0);
    for (uint64_t k = 0; k < KEYS; k++)
        ck_assert_uint_eq(em_gpu_map_lookup(map, em_mix64(k + 1)), k);
    for (uint64_t a = 0; a < ABSENT; a++)
        ck_assert_uint_eq(em_gpu_map_lookup(map, em_mix64(KEYS + 1 + a)), EM_GPU_ROW_NONE);
    lookups_agree(map, KEYS, KEYS + 1, ABSENT);
    for (uint64_t k = 0; k < KEYS; k += 3)
        ck_assert_uint_eq(em_gpu_map_erase_key(map, em_mix64(k + 1)), k);
    for (uint64_t k = 0; k < KEYS; k++)
        ck_assert_uint_eq(em_gpu_map_lookup(map, em_mix64(k + 1)),
                          k % 3 == 0 ? EM_GPU_ROW_NONE : k);
    lookups_agree(map, KEYS, KEYS + 1, ABSENT);
    free(slots);
    free(free_rows);
}
END_TEST

/* ---- unique claims under concurrency ------------------------------------------------------ */

#define CLAIM_THREADS 6
#define CLAIM_KEYS 20000

typedef struct claim_race {
    const uint64_t *keys;
    uint32_t *table, *slot_of;
    uint64_t slot_count;
    int thread;
} claim_race;

/* Thread t claims positions t, t + threads, ... from the last one down: later positions
 * of a key usually claim its slot first and must be lowered by the earlier ones. */
static void *claimer(void *argument)
{
    claim_race *race = argument;
    uint64_t thread = (uint64_t)__atomic_fetch_add(&race->thread, 1, __ATOMIC_RELAXED);
    for (uint64_t i = CLAIM_KEYS; i-- > 0;)
        if (i % CLAIM_THREADS == thread)
            em_gpu_unique_claim_item(race->keys, i, race->table, race->slot_count, race->slot_of);
    return NULL;
}

START_TEST(unique_claims_keep_first_positions_under_threads)
{
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + 400);
    uint64_t *keys = malloc(CLAIM_KEYS * sizeof(uint64_t));
    for (uint64_t i = 0; i < CLAIM_KEYS; i++)
        keys[i] = random_key(&rng, 3000);
    claim_race race = {.keys = keys, .slot_count = 65536};
    race.table = calloc(race.slot_count, sizeof(uint32_t));
    race.slot_of = calloc(CLAIM_KEYS, sizeof(uint32_t));
    pthread_t threads[CLAIM_THREADS];
    for (int t = 0; t < CLAIM_THREADS; t++)
        pthread_create(&threads[t], NULL, claimer, &race);
    for (int t = 0; t < CLAIM_THREADS; t++)
        pthread_join(threads[t], NULL);
    uint32_t *rank = calloc(CLAIM_KEYS + 1, sizeof(uint32_t));
    ck_assert_uint_eq(em_gpu_unique_first(race.table, race.slot_of, CLAIM_KEYS, CLAIM_KEYS), 0);
    for (uint64_t i = 1; i <= CLAIM_KEYS; i++)
        rank[i] = rank[i - 1] + em_gpu_unique_first(race.table, race.slot_of, CLAIM_KEYS, i - 1);
    uint64_t *unique = calloc(CLAIM_KEYS, sizeof(uint64_t));
    uint32_t *inverse = calloc(CLAIM_KEYS, sizeof(uint32_t));
    uint32_t *first_positions = calloc(CLAIM_KEYS, sizeof(uint32_t));
    for (uint64_t i = 0; i < CLAIM_KEYS; i++)
        em_gpu_unique_scatter_item(keys, i, race.table, race.slot_of, rank, unique, inverse,
                                   first_positions);
    devices d = open_devices();
    deduped cpu = run_unique(d.cpu, d.cpu_lane, keys, CLAIM_KEYS);
    ck_assert_uint_eq(rank[CLAIM_KEYS], cpu.count);
    ck_assert(memcmp(unique, cpu.unique, cpu.count * sizeof(uint64_t)) == 0);
    ck_assert(memcmp(inverse, cpu.inverse, CLAIM_KEYS * sizeof(uint32_t)) == 0);
    ck_assert(memcmp(first_positions, cpu.first, cpu.count * sizeof(uint32_t)) == 0);
    free(first_positions);
    free(cpu.unique);
    free(cpu.inverse);
    free(cpu.first);
    close_devices(&d);
    free(unique);
    free(inverse);
    free(rank);
    free(race.table);
    free(race.slot_of);
    free(keys);
}
END_TEST

/* ---- shard preconditions ------------------------------------------------------------------ */

/* Inserting without reserving first is a caller bug: it is reported, and the kernels
 * write nothing outside the shard's storage meanwhile. */
START_TEST(insert_without_reserve_is_reported)
{
    devices d = open_devices();
    em_shard_spec spec = {.table = "t", .index = 0, .dim = 8, .expected_rows = 100,
                          .optimizer = {.kind = EM_OPTIMIZER_ADAM},
                          .initializer = {.kind = EM_INIT_UNIFORM, .bound = 1.0f, .seed = 3}};
    em_shard *shard = NULL;
    em_error err;
    ck_assert_msg(d.gpu->ops->shard_create(d.gpu, &spec, &shard, &err) == EM_OK, "%s",
                  err.message);
    const uint64_t keys[3] = {11, 12, UINT64_MAX};
    const uint64_t none[3] = {EM_ROW_NONE, EM_ROW_NONE, EM_ROW_NONE};
    uint64_t *device_keys = upload(d.gpu, d.gpu_lane, keys, sizeof(keys));
    uint64_t *device_rows = upload(d.gpu, d.gpu_lane, none, sizeof(none));
    ck_assert_int_eq(d.gpu->ops->shard_insert_missing(shard, d.gpu_lane, device_keys, 3,
                                                      device_rows, true, &err),
                     EM_INTERNAL);
    ck_assert_msg(strstr(err.message, "insert without reserve") != NULL, "%s", err.message);
    em_device_free(d.gpu, device_keys);
    em_device_free(d.gpu, device_rows);
    d.gpu->ops->shard_destroy(shard);
    close_devices(&d);
}
END_TEST

/* ---- an eviction's walk of the map ------------------------------------------------------- */

/* A shard that tracks access, holding n keys (among them the two side keys EMPTY and
 * TOMBSTONE; salt varies the others) whose last accesses are all different, on a GPU
 * whose staging holds its whole walk (walked_make: devices of its own). */
typedef struct walked {
    devices d;
    em_shard *shard;
    uint64_t n, positions;
    uint64_t *keys, *device_keys; /* in insert order */
    bool own_devices;
} walked;

static walked walked_make_on(devices d, uint64_t n, uint64_t salt, bool own_devices)
{
    walked w = {.n = n, .d = d, .own_devices = own_devices};
    em_device *gpu = w.d.gpu;
    em_shard_spec spec = {.table = "t", .dim = 4, .expected_rows = n,
                          .optimizer = {.kind = EM_OPTIMIZER_SGD},
                          .initializer = {.kind = EM_INIT_UNIFORM, .bound = 1.0f, .seed = 3},
                          .track_access = true, .hash_seed = 5};
    em_error err;
    ck_assert_msg(gpu->ops->shard_create(gpu, &spec, &w.shard, &err) == EM_OK, "%s", err.message);
    w.keys = malloc(n * sizeof(uint64_t));
    uint64_t *none = malloc(n * sizeof(uint64_t));
    for (uint64_t i = 0; i < n; i++) {
        w.keys[i] = i == 0   ? UINT64_MAX
                    : i == 1 ? UINT64_MAX - 1
                             : i * 0x9e3779b97f4a7c15ull + 7 + salt;
        none[i] = EM_ROW_NONE;
    }
    w.device_keys = upload(gpu, w.d.gpu_lane, w.keys, n * sizeof(uint64_t));
    uint64_t *device_rows = upload(gpu, w.d.gpu_lane, none, n * sizeof(uint64_t));
    ck_assert_msg(gpu->ops->shard_reserve(w.shard, w.d.gpu_lane, n, 0, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_msg(gpu->ops->shard_insert_missing(w.shard, w.d.gpu_lane, w.device_keys, n,
                                                 device_rows, true, &err) == EM_OK,
                  "%s", err.message);
    uint64_t *rows = download(gpu, w.d.gpu_lane, device_rows, n * sizeof(uint64_t));
    em_row_access *access = calloc(n, sizeof(em_row_access));
    for (uint64_t i = 0; i < n; i++) /* 7919 is prime: a permutation of [0, n) */
        access[i] = (em_row_access){.accessed = 1000 + i * 7919 % n, .frequency = 1};
    ck_assert_msg(gpu->ops->shard_write_access(w.shard, w.d.gpu_lane, rows, n, access, &err) ==
                      EM_OK,
                  "%s", err.message);
    em_shard_stats stats;
    gpu->ops->shard_stats(w.shard, &stats);
    w.positions = 2 + stats.index_bytes / sizeof(em_gpu_slot);
    em_device_free(gpu, device_rows);
    free(rows);
    free(access);
    free(none);
    return w;
}

static walked walked_make(uint64_t n)
{
    return walked_make_on(open_devices_staged(4 * MEBIBYTE), n, 0, true);
}

static void walked_free(walked *w)
{
    em_device_free(w->d.gpu, w->device_keys);
    w->d.gpu->ops->shard_destroy(w->shard);
    if (w->own_devices)
        close_devices(&w->d);
    free(w->keys);
}

/* The map's entries in the order of a walk from position start: from start to the end
 * of the export positions, then from position 0. *count of them, with rows and access. */
static uint64_t *walk_order(walked *w, uint64_t start, uint64_t **rows, em_row_access **access,
                            uint64_t *count)
{
    em_device *gpu = w->d.gpu;
    em_error err;
    uint64_t *keys = malloc((w->n + 1) * 2 * sizeof(uint64_t));
    *rows = malloc((w->n + 1) * 2 * sizeof(uint64_t));
    uint64_t cursor = start, tail = 0, all = 0;
    ck_assert_int_eq(gpu->ops->shard_export(w->shard, w->d.gpu_lane, &cursor, keys, NULL, *rows,
                                            2 * w->n, &tail, &err), EM_OK);
    cursor = 0;
    ck_assert_int_eq(gpu->ops->shard_export(w->shard, w->d.gpu_lane, &cursor, keys + tail, NULL,
                                            *rows + tail, 2 * w->n, &all, &err), EM_OK);
    *count = all; /* the entries from start, then the first all - tail of the whole */
    *access = malloc(*count * sizeof(em_row_access));
    ck_assert_int_eq(gpu->ops->shard_read_access(w->shard, w->d.gpu_lane, *rows, *count, *access,
                                                 &err), EM_OK);
    return keys;
}

static int compare_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static bool row_in(const uint64_t *rows, uint64_t n, uint64_t row)
{
    for (uint64_t i = 0; i < n; i++)
        if (rows[i] == row)
            return true;
    return false;
}

/* The lru rule of lib/table/table_config.h: the chosen keys are the count oldest (all
 * accesses differ) among the entries outside kept of the walk's first `seen`, for some
 * seen from the window (count x candidates, or all) on. The walk's entries as they were
 * before the eviction. */
typedef struct walk_entries {
    uint64_t *keys, *rows, count;
    em_row_access *access;
} walk_entries;

static walk_entries walk_entries_take(walked *w, uint64_t start)
{
    walk_entries e;
    e.keys = walk_order(w, start, &e.rows, &e.access, &e.count);
    return e;
}

static void walk_entries_free(walk_entries *e)
{
    free(e->keys);
    free(e->rows);
    free(e->access);
}

static void assert_lru_rule(const walk_entries *e, const em_evict_spec *spec,
                            const uint64_t *chosen, uint64_t positions)
{
    const uint64_t *rows = e->rows, *order = e->keys;
    const em_row_access *access = e->access;
    uint64_t count = e->count;
    uint64_t *want = malloc((spec->count + 1) * sizeof(uint64_t));
    uint64_t *got = malloc((spec->count + 1) * sizeof(uint64_t));
    uint64_t *pool = malloc((count + 1) * 2 * sizeof(uint64_t));
    memcpy(got, chosen, spec->count * sizeof(uint64_t));
    qsort(got, spec->count, sizeof(uint64_t), compare_u64);
    uint64_t window = spec->count * spec->candidates;
    bool matched = false;
    for (uint64_t seen = window < count ? window : count; seen <= count && !matched; seen++) {
        uint64_t pooled = 0; /* (accessed, key) pairs outside kept */
        for (uint64_t i = 0; i < seen; i++)
            if (!row_in(spec->kept, spec->kept_count, rows[i])) {
                pool[2 * pooled] = access[i].accessed;
                pool[2 * pooled++ + 1] = order[i];
            }
        if (pooled < spec->count)
            continue;
        qsort(pool, pooled, 2 * sizeof(uint64_t), compare_u64);
        for (uint64_t v = 0; v < spec->count; v++)
            want[v] = pool[2 * v + 1];
        qsort(want, spec->count, sizeof(uint64_t), compare_u64);
        matched = memcmp(want, got, spec->count * sizeof(uint64_t)) == 0;
    }
    ck_assert_msg(matched, "evicted %" PRIu64 " keys from position %" PRIu64
                  " that no walk of at least %" PRIu64 " entries chooses",
                  spec->count, spec->random % positions, window);
    free(want);
    free(got);
    free(pool);
}

/* Allocates from the pool until `leave` bytes of it are free (within a granule);
 * returns the allocations, NULL-terminated, for balloon_free. */
static void **balloon_leaving(em_device *device, uint64_t leave)
{
    em_device_scratch_drop(device); /* the scratch blocks kept are room too */
    void **held = calloc(1024, sizeof(void *));
    for (int count = 0;;) {
        em_pool_stats stats;
        em_pool_get_stats(device->pool, &stats);
        if (stats.bytes_free <= leave + EM_POOL_ALIGNMENT)
            break;
        uint64_t take = stats.bytes_free - leave;
        take = take < stats.largest_free_block ? take : stats.largest_free_block;
        ck_assert_int_lt(count, 1023);
        held[count++] = device_buffer(device, take);
    }
    return held;
}

static void balloon_free(em_device *device, void **held)
{
    for (int i = 0; held[i] != NULL; i++)
        em_device_free(device, held[i]);
    free(held);
}

/* An eviction checked (evict_check_begin before it, evict_check_end after): makes room
 * for spec->count new keys after evicting as many (shard_reserve), as a table does;
 * after the eviction checks the rule, then that the map's header kept on the host (not
 * read back after an eviction) is the GPU's: the evicted keys are gone, the others
 * found, and the new keys fit into the rows they left without the storage growing. */
typedef struct evict_check {
    walk_entries entries;
    uint64_t row_limit;
    uint64_t *keys, *rows; /* the eviction's output */
} evict_check;

static evict_check evict_check_begin(walked *w, const em_evict_spec *spec)
{
    em_device *gpu = w->d.gpu;
    em_error err;
    evict_check c = {.keys = malloc((spec->count + 1) * sizeof(uint64_t)),
                     .rows = malloc((spec->count + 1) * sizeof(uint64_t))};
    c.entries = walk_entries_take(w, spec->random % w->positions);
    ck_assert_msg(gpu->ops->shard_reserve(w->shard, w->d.gpu_lane, spec->count, spec->count,
                                          &err) == EM_OK,
                  "%s", err.message);
    em_shard_stats stats;
    gpu->ops->shard_stats(w->shard, &stats);
    c.row_limit = stats.row_limit;
    return c;
}

static void evict_check_end(walked *w, const em_evict_spec *spec, evict_check *c)
{
    em_device *gpu = w->d.gpu;
    em_error err;
    const uint64_t *keys = c->keys, *rows = c->rows;
    assert_lru_rule(&c->entries, spec, keys, w->positions);
    walk_entries_free(&c->entries);
    for (uint64_t v = 0; v < spec->count; v++)
        ck_assert(!row_in(spec->kept, spec->kept_count, rows[v]));
    em_shard_stats stats;
    gpu->ops->shard_stats(w->shard, &stats);
    ck_assert_uint_eq(stats.rows, w->n - spec->count);

    uint64_t *found = device_buffer(gpu, w->n * sizeof(uint64_t));
    uint64_t missing = 0;
    ck_assert_int_eq(gpu->ops->shard_find(w->shard, w->d.gpu_lane, w->device_keys, w->n, found,
                                          &missing, &err), EM_OK);
    ck_assert_uint_eq(missing, spec->count);
    uint64_t *found_host = download(gpu, w->d.gpu_lane, found, w->n * sizeof(uint64_t));
    for (uint64_t i = 0; i < w->n; i++)
        ck_assert_msg(row_in(keys, spec->count, w->keys[i]) == (found_host[i] == EM_ROW_NONE),
                      "key %" PRIu64, w->keys[i]);
    uint64_t *fresh = malloc((spec->count + 1) * sizeof(uint64_t));
    uint64_t *none = malloc((spec->count + 1) * sizeof(uint64_t));
    for (uint64_t v = 0; v < spec->count; v++) {
        fresh[v] = (w->n + v) * 0x9e3779b97f4a7c15ull + 7;
        none[v] = EM_ROW_NONE;
    }
    uint64_t *device_fresh = upload(gpu, w->d.gpu_lane, fresh, spec->count * sizeof(uint64_t));
    uint64_t *device_none = upload(gpu, w->d.gpu_lane, none, spec->count * sizeof(uint64_t));
    ck_assert_msg(gpu->ops->shard_insert_missing(w->shard, w->d.gpu_lane, device_fresh,
                                                 spec->count, device_none, true, &err) == EM_OK,
                  "%s", err.message);
    gpu->ops->shard_stats(w->shard, &stats);
    ck_assert_uint_eq(stats.rows, w->n);
    ck_assert_uint_eq(stats.row_limit, c->row_limit);
    em_device_free(gpu, found);
    em_device_free(gpu, device_fresh);
    em_device_free(gpu, device_none);
    free(found_host);
    free(fresh);
    free(none);
    free(c->keys);
    free(c->rows);
}

/* An eviction by spec (shard_evict), checked. With kept_on_device the kept rows go to the
 * shard as a request's rows on the GPU (kept_device); with leave > 0 the eviction runs
 * with only that many bytes of the pool free. *waits: the eviction's host waits. */
static void evict_and_check(walked *w, const em_evict_spec *spec, bool kept_on_device,
                            uint64_t leave, uint64_t *waits)
{
    em_device *gpu = w->d.gpu;
    em_error err;
    evict_check check = evict_check_begin(w, spec);
    em_evict_spec given = *spec;
    uint64_t *device_kept = NULL;
    if (kept_on_device) { /* as a request's rows: with rows that are not stored between */
        uint64_t *request_rows = malloc((2 * spec->kept_count + 1) * sizeof(uint64_t));
        for (uint64_t i = 0; i < spec->kept_count; i++) {
            request_rows[2 * i] = spec->kept[i];
            request_rows[2 * i + 1] = i % 2 == 0 ? EM_ROW_NONE : EM_ROW_REJECTED;
        }
        device_kept = upload(gpu, w->d.gpu_lane, request_rows,
                             2 * spec->kept_count * sizeof(uint64_t));
        given.kept = NULL;
        given.kept_count = 0;
        given.kept_device = device_kept;
        given.kept_device_count = 2 * spec->kept_count;
        free(request_rows);
    }
    void **balloon = leave > 0 ? balloon_leaving(gpu, leave) : NULL;
    uint64_t operations = 0, before = 0, after = 0;
    em_gpu_emulated_counts(&operations, &before);
    ck_assert_msg(gpu->ops->shard_evict(w->shard, w->d.gpu_lane, &given, check.keys, check.rows,
                                        &err) == EM_OK,
                  "%s", err.message);
    em_gpu_emulated_counts(&operations, &after);
    if (balloon != NULL)
        balloon_free(gpu, balloon);
    if (device_kept != NULL)
        em_device_free(gpu, device_kept);
    *waits = after - before;
    evict_check_end(w, spec, &check);
}

/* The rows of the entries with the `count` oldest accesses (the kept rows of a request
 * that uses the eviction's best choices). */
static uint64_t *oldest_rows(walked *w, uint64_t count)
{
    uint64_t *rows, n;
    em_row_access *access;
    uint64_t *order = walk_order(w, 0, &rows, &access, &n);
    uint64_t *pairs = malloc((n + 1) * 2 * sizeof(uint64_t));
    for (uint64_t i = 0; i < n; i++) {
        pairs[2 * i] = access[i].accessed;
        pairs[2 * i + 1] = rows[i];
    }
    qsort(pairs, n, 2 * sizeof(uint64_t), compare_u64);
    uint64_t *kept = malloc((count + 1) * sizeof(uint64_t));
    for (uint64_t v = 0; v < count; v++)
        kept[v] = pairs[2 * v + 1];
    free(pairs);
    free(order);
    free(rows);
    free(access);
    return kept;
}

/* Loop index: where the walk starts (a side row's position, the first slots, the middle,
 * the last position) and what it removes: one row, 40 rows (a window of 160 entries),
 * half the rows (a window beyond every entry), 40 rows while the 300 oldest must stay,
 * 5 rows while all but 12 must stay, and 40 rows while the window's first 150 entries
 * must stay and the oldest rows are the ones right after the window (in both, the walk
 * goes on past its window). The kept rows are given in host memory, or (the last shape,
 * and the 300 oldest from odd starts) as a request's rows on the GPU. The GPU reads the
 * walk's window, and the request's rows with it, at once: the eviction waits for it
 * once (more when the walk goes on past it), and not after its erase. */
START_TEST(an_eviction_reads_its_window_at_once_and_follows_the_rule)
{
    enum { N = 1500, CANDIDATES = 4 };
    walked w = walked_make(N);
    uint64_t starts[] = {0, 1, 2, 3, w.positions / 2, w.positions - 1};
    uint64_t counts[] = {1, 40, N / 2, 40, 5, 40};
    uint64_t start = starts[_i % 6], shape = (uint64_t)_i / 6;
    em_evict_spec spec = {.policy = EM_EVICTION_LRU, .candidates = CANDIDATES,
                          .count = counts[shape], .random = start};
    uint64_t *kept = NULL;
    if (shape == 5) { /* the window's first 150 must stay; the oldest follow the window */
        em_error err;
        spec.count = 40;
        uint64_t window = spec.count * CANDIDATES;
        walk_entries e = walk_entries_take(&w, start);
        for (uint64_t i = 0; i < e.count; i++)
            e.access[i].accessed = 1000 + (i > window ? i - window : window - i);
        ck_assert_int_eq(w.d.gpu->ops->shard_write_access(w.shard, w.d.gpu_lane, e.rows, e.count,
                                                          e.access, &err), EM_OK);
        kept = malloc(150 * sizeof(uint64_t));
        memcpy(kept, e.rows, 150 * sizeof(uint64_t));
        spec.kept_count = 150;
        walk_entries_free(&e);
    } else if (shape == 3) {
        kept = oldest_rows(&w, 300);
        spec.kept_count = 300;
    } else if (shape == 4) { /* every row but the 12 newest */
        kept = oldest_rows(&w, N - 12);
        spec.kept_count = N - 12;
    }
    spec.kept = kept;
    uint64_t waits = 0;
    evict_and_check(&w, &spec, shape == 5 || (shape == 3 && start % 2 == 1), 0, &waits);
    ck_assert_uint_le(waits, shape >= 4 ? 8 : 1);
    free(kept);
    walked_free(&w);
}
END_TEST

/* Where the pool has no room for the window's buffers, an eviction reads the request's
 * rows, then its walk export by export (more waits), and chooses by the same rule. Loop
 * index: the start, as above. */
START_TEST(an_eviction_without_room_for_its_window_walks_export_by_export)
{
    enum { N = 1500 };
    walked w = walked_make(N);
    uint64_t starts[] = {0, 2, w.positions / 2};
    uint64_t *kept = oldest_rows(&w, 100);
    em_evict_spec spec = {.policy = EM_EVICTION_LRU, .candidates = 4, .count = N / 2,
                          .random = starts[_i], .kept = kept, .kept_count = 100};
    uint64_t waits = 0;
    evict_and_check(&w, &spec, true, 64 * 1024, &waits);
    ck_assert_uint_gt(waits, 1);
    free(kept);
    walked_free(&w);
}
END_TEST

/* shards_evict_begin, the lane synchronized, shards_evict_end. */
static void shards_evict(devices *d, em_shard_evict_part *parts, uint32_t count)
{
    void *pending = NULL;
    em_error err, sync_err;
    ck_assert_msg(d->gpu->ops->shards_evict_begin(d->gpu_lane, parts, count, &pending, &err) ==
                      EM_OK,
                  "%s", err.message);
    if (pending == NULL) /* no part evicts: nothing to wait for */
        return;
    em_status synchronized = d->gpu->ops->synchronize(d->gpu_lane, &sync_err);
    d->gpu->ops->shards_evict_end(pending, synchronized, &sync_err);
}

/* Two shards of one GPU evict together (shards_evict_*): one wait for both walks, each
 * shard by the rule. Loop index 1: with 64 KiB of the pool free, no room for both walks'
 * buffers at once: each shard evicts on its own (a wait each), by the rule too. A part
 * that evicts nothing (its shard only takes new keys) is answered without any work,
 * alone or beside others. */
START_TEST(shards_of_one_gpu_evict_together)
{
    devices d = open_devices_staged(4 * MEBIBYTE);
    walked a = walked_make_on(d, 1500, 0, false), b = walked_make_on(d, 1000, 1, false);
    em_evict_spec specs[2] = {
        {.policy = EM_EVICTION_LRU, .candidates = 4, .count = 200, .random = a.positions / 2},
        {.policy = EM_EVICTION_LRU, .candidates = 4, .count = 500, .random = 3},
    };
    evict_check checks[2] = {evict_check_begin(&a, &specs[0]), evict_check_begin(&b, &specs[1])};
    em_shard_evict_part parts[2];
    for (int i = 0; i < 2; i++)
        parts[i] = (em_shard_evict_part){.shard = i == 0 ? a.shard : b.shard,
                                         .spec = specs[i],
                                         .keys = checks[i].keys,
                                         .rows = checks[i].rows};
    void **balloon = _i == 1 ? balloon_leaving(d.gpu, 64 * 1024) : NULL;
    uint64_t operations = 0, before = 0, after = 0;
    em_error err; /* the shards' set-up (their row blocks' upload) is not the eviction's */
    ck_assert_int_eq(d.gpu->ops->synchronize(d.gpu_lane, &err), EM_OK);
    em_gpu_emulated_counts(&operations, &before);
    shards_evict(&d, parts, 2);
    em_gpu_emulated_counts(&operations, &after);
    if (balloon != NULL)
        balloon_free(d.gpu, balloon);
    for (int i = 0; i < 2; i++)
        ck_assert_msg(parts[i].status == EM_OK, "%s", parts[i].err.message);
    ck_assert_uint_eq(after - before, _i == 0 ? 1 : 2);
    em_shard_evict_part nothing = {.shard = a.shard,
                                   .spec = {.policy = EM_EVICTION_LRU, .candidates = 4},
                                   .status = EM_INTERNAL};
    em_gpu_emulated_counts(&operations, &before);
    shards_evict(&d, &nothing, 1);
    em_gpu_emulated_counts(&operations, &after);
    ck_assert_int_eq(nothing.status, EM_OK);
    ck_assert_uint_eq(after - before, 0);
    evict_check_end(&a, &specs[0], &checks[0]);
    evict_check_end(&b, &specs[1], &checks[1]);
    walked_free(&a);
    walked_free(&b);
    close_devices(&d);
}
END_TEST

/* ---- the emulation's copies ---------------------------------------------------------- */

/* A device buffer of 64 bytes and two pinned ones, on emulated device 0. */
typedef struct copy_setup {
    em_gpu_stream *stream;
    em_gpu_event *event;
    uint8_t *device, *pinned, *other;
} copy_setup;

static copy_setup copy_setup_make(void)
{
    copy_setup c;
    ck_assert_int_eq(em_gpu_stream_create(0, &c.stream).code, 0);
    ck_assert_int_eq(em_gpu_event_create(0, 0, &c.event).code, 0);
    ck_assert_int_eq(em_gpu_malloc(0, 64, (void **)&c.device).code, 0);
    ck_assert_int_eq(em_gpu_host_alloc(64, (void **)&c.pinned).code, 0);
    ck_assert_int_eq(em_gpu_host_alloc(64, (void **)&c.other).code, 0);
    return c;
}

static void copy_setup_free(copy_setup *c)
{
    em_gpu_host_free(c->pinned);
    em_gpu_host_free(c->other);
    em_gpu_free(0, c->device);
    em_gpu_event_destroy(c->event);
    em_gpu_stream_destroy(c->stream);
}

START_TEST(copies_into_pinned_memory_land_when_waited_for)
{
    copy_setup c = copy_setup_make();
    uint8_t pageable[64];
    memset(pageable, 7, sizeof(pageable));
    /* from pageable memory: synchronous, as CUDA makes it */
    ck_assert_int_eq(em_gpu_memcpy_async(c.stream, c.device, pageable, 64).code, 0);
    memset(c.pinned, 0, 64);
    memset(c.other, 0, 64);
    ck_assert_int_eq(em_gpu_memcpy_async(c.stream, c.pinned, c.device, 64).code, 0);
    ck_assert_int_eq(em_gpu_event_record(c.event, c.stream).code, 0);
    ck_assert_int_eq(em_gpu_memset_async(c.stream, c.device, 9, 64).code, 0);
    ck_assert_int_eq(em_gpu_memcpy_async(c.stream, c.other, c.device, 64).code, 0);
    ck_assert_uint_eq(c.pinned[0], 0); /* not waited for: the old bytes */
    ck_assert_uint_eq(c.other[63], 0);
    ck_assert_int_eq(em_gpu_event_synchronize(c.event).code, 0);
    ck_assert_uint_eq(c.pinned[0], 7); /* the copy before the event, as of its turn */
    ck_assert_uint_eq(c.pinned[63], 7);
    ck_assert_uint_eq(c.other[63], 0); /* the one after it: still pending */
    ck_assert_int_eq(em_gpu_stream_synchronize(c.stream).code, 0);
    ck_assert_uint_eq(c.other[0], 9);
    ck_assert_uint_eq(c.other[63], 9);
    /* into pageable memory: synchronous */
    ck_assert_int_eq(em_gpu_memcpy_async(c.stream, pageable, c.device, 64).code, 0);
    ck_assert_uint_eq(pageable[0], 9);
    /* out of pinned memory left alone until waited for: fine */
    memset(c.pinned, 3, 64);
    ck_assert_int_eq(em_gpu_memcpy_async(c.stream, c.device, c.pinned, 64).code, 0);
    ck_assert_int_eq(em_gpu_stream_synchronize(c.stream).code, 0);
    memset(c.pinned, 4, 64); /* waited for: the source may change */
    ck_assert_int_eq(em_gpu_memcpy_async(c.stream, pageable, c.device, 64).code, 0);
    ck_assert_uint_eq(pageable[10], 3);
    copy_setup_free(&c);
}
END_TEST

/* Each stops the process (SIGABRT): 0, a pinned source changed before the wait; 1, one
 * freed before it; 2, pinned memory freed with a copy into it pending. */
START_TEST(pinned_memory_misused_before_the_wait_stops_the_process)
{
    copy_setup c = copy_setup_make();
    memset(c.pinned, 1, 64);
    if (_i < 2)
        ck_assert_int_eq(em_gpu_memcpy_async(c.stream, c.device, c.pinned, 64).code, 0);
    else
        ck_assert_int_eq(em_gpu_memcpy_async(c.stream, c.pinned, c.device, 64).code, 0);
    if (_i == 0)
        c.pinned[5] = 2;
    if (_i >= 1)
        em_gpu_host_free(c.pinned);
    (void)em_gpu_stream_synchronize(c.stream);
}
END_TEST

/* ---- the emulation's order and timing ---------------------------------------------- */

/* A launch's items in every order: each of n items once (iota writes each index where
 * it visits it), for sizes round and odd, the smallest ones too. */
START_TEST(every_order_visits_each_item_once)
{
    static const char *const orders[3] = {"forward", "reverse", "scattered"};
    static const uint64_t sizes[] = {1, 2, 3, 7, 64, 1000, 4096, 65537};
    enum { MOST = 65537 };
    em_gpu_emulated_set_order(orders[_i]);
    em_gpu_stream *stream = NULL;
    uint32_t *device = NULL;
    ck_assert_int_eq(em_gpu_stream_create(0, &stream).code, 0);
    ck_assert_int_eq(em_gpu_malloc(0, MOST * sizeof(uint32_t), (void **)&device).code, 0);
    uint32_t *host = malloc(MOST * sizeof(uint32_t));
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        uint64_t n = sizes[s];
        ck_assert_int_eq(em_gpu_memset_async(stream, device, 0xff, n * sizeof(uint32_t)).code, 0);
        ck_assert_int_eq(em_gpu_iota_u32(stream, device, n).code, 0);
        ck_assert_int_eq(em_gpu_memcpy_async(stream, host, device, n * sizeof(uint32_t)).code, 0);
        for (uint64_t i = 0; i < n; i++)
            ck_assert_msg(host[i] == i, "%s order, %" PRIu64 " items: item %" PRIu64 " holds %u",
                          orders[_i], n, i, host[i]);
    }
    ck_assert(em_gpu_emulated_order_fixed() == (_i != 2));
    free(host);
    em_gpu_free(0, device);
    em_gpu_stream_destroy(stream);
    em_gpu_emulated_set_order(getenv("EMBER_EMULATED_ORDER")); /* as the process began */
}
END_TEST

/* With kernels run late (EMBER_EMULATED_LATE), a kernel (here the fill of memset_async)
 * runs when something needs it: not when another stream reads its memory without
 * waiting, but once that stream waits for an event recorded after it, once an operation
 * behind it on its own stream runs, once the host waits for its stream, and once device
 * memory is freed. */
START_TEST(kernels_run_late_run_when_waited_for)
{
    em_gpu_emulated_set_late(true);
    copy_setup c = copy_setup_make();
    em_gpu_stream *reader = NULL;
    ck_assert_int_eq(em_gpu_stream_create(0, &reader).code, 0);
    uint8_t host[64];
    memset(host, 1, sizeof(host));
    ck_assert_int_eq(em_gpu_memcpy_async(c.stream, c.device, host, 64).code, 0);
    /* another stream, without waiting: the bytes before the fill */
    ck_assert_int_eq(em_gpu_memset_async(c.stream, c.device, 5, 64).code, 0);
    ck_assert_int_eq(em_gpu_event_record(c.event, c.stream).code, 0);
    ck_assert_int_eq(em_gpu_memset_async(c.stream, c.device, 6, 64).code, 0);
    ck_assert_int_eq(em_gpu_memcpy_async(reader, host, c.device, 64).code, 0);
    ck_assert_uint_eq(host[0], 1);
    /* waiting for the event: the fill before it, not the one after */
    ck_assert_int_eq(em_gpu_stream_wait(reader, c.event).code, 0);
    ck_assert_int_eq(em_gpu_memcpy_async(reader, host, c.device, 64).code, 0);
    ck_assert_uint_eq(host[0], 5);
    ck_assert_uint_eq(host[63], 5);
    /* a copy behind it on its own stream */
    ck_assert_int_eq(em_gpu_memcpy_async(c.stream, host, c.device, 64).code, 0);
    ck_assert_uint_eq(host[0], 6);
    /* the host waiting for its stream */
    ck_assert_int_eq(em_gpu_memset_async(c.stream, c.device, 7, 64).code, 0);
    ck_assert_int_eq(em_gpu_stream_synchronize(c.stream).code, 0);
    ck_assert_int_eq(em_gpu_memcpy_async(reader, host, c.device, 64).code, 0);
    ck_assert_uint_eq(host[0], 7);
    /* an event synchronize */
    ck_assert_int_eq(em_gpu_memset_async(c.stream, c.device, 8, 64).code, 0);
    ck_assert_int_eq(em_gpu_event_record(c.event, c.stream).code, 0);
    ck_assert_int_eq(em_gpu_event_synchronize(c.event).code, 0);
    ck_assert_int_eq(em_gpu_memcpy_async(reader, host, c.device, 64).code, 0);
    ck_assert_uint_eq(host[0], 8);
    /* cudaFree of other memory waits for the device */
    uint8_t *spare = NULL;
    ck_assert_int_eq(em_gpu_malloc(0, 64, (void **)&spare).code, 0);
    ck_assert_int_eq(em_gpu_memset_async(c.stream, c.device, 9, 64).code, 0);
    em_gpu_free(0, spare);
    ck_assert_int_eq(em_gpu_memcpy_async(reader, host, c.device, 64).code, 0);
    ck_assert_uint_eq(host[0], 9);
    em_gpu_stream_destroy(reader);
    copy_setup_free(&c);
    em_gpu_emulated_set_late(false);
}
END_TEST

/* ---- runner ------------------------------------------------------------------------------ */

static Suite *kernel_logic_suite(void)
{
    Suite *suite = suite_create("kernel_logic");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, unique_keys_in_order_of_first_appearance_like_cpu, 0, 12);
    tcase_add_loop_test(tc, partition_is_stable_like_cpu, 0, 6);
    tcase_add_loop_test(tc, unique_and_partition_with_one_wait_like_cpu, 0, 10);
    tcase_add_loop_test(tc, sums_and_pooling_bit_for_bit_like_cpu, 0, 16);
    tcase_add_loop_test(tc, hot_keys_sum_by_the_chunk_tree_like_cpu, 0, 8);
    tcase_add_test(tc, runs_of_a_sorted_inverse_are_found_from_any_position);
    tcase_add_test(tc, combiner_divisor_is_the_csr_formula);
    tcase_add_test(tc, segment_starts_cover_empty_segments);
    tcase_add_test(tc, row_of_key_skips_empty_rows);
    tcase_add_test(tc, group_shift_covers_rows_within_a_block);
    tcase_add_test(tc, gather_by_quads_equals_gather_by_elements);
    tcase_add_test(tc, map_claims_give_every_key_one_row_under_threads);
    tcase_add_test(tc, map_full_sets_overflow_instead_of_looping);
    tcase_add_test(tc, map_seed_sets_the_home_slots);
    tcase_add_test(tc, probe_sequences_visit_every_slot_once);
    tcase_add_test(tc, bucket_stop_is_where_slot_order_stops);
    tcase_add_test(tc, maps_at_load_0_9_find_every_key);
    tcase_add_test(tc, unique_claims_keep_first_positions_under_threads);
    tcase_add_test(tc, insert_without_reserve_is_reported);
    tcase_add_test(tc, walk_pieces_over_chunks_read_each_walk_in_slot_order);
    tcase_add_loop_test(tc, an_eviction_reads_its_window_at_once_and_follows_the_rule, 0, 36);
    tcase_add_loop_test(tc, an_eviction_without_room_for_its_window_walks_export_by_export, 0, 3);
    tcase_add_loop_test(tc, shards_of_one_gpu_evict_together, 0, 2);
    tcase_add_test(tc, copies_into_pinned_memory_land_when_waited_for);
    tcase_add_loop_test_raise_signal(tc, pinned_memory_misused_before_the_wait_stops_the_process,
                                     SIGABRT, 0, 3);
    tcase_add_loop_test(tc, every_order_visits_each_item_once, 0, 3);
    tcase_add_test(tc, kernels_run_late_run_when_waited_for);
    suite_add_tcase(suite, tc);
    return suite;
}

int main(void)
{
    return em_test_run(kernel_logic_suite());
}
