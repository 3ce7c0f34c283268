/*
 * DESIGN: the CPU backend's device.
 *
 * Device memory is host memory from the device's pool (mmap'ed regions), so device
 * pointers are plain pointers and copies are memcpy. A shard is a concurrent hash map
 * (key -> row index, slot arrays in the pool) plus row storage in fixed-size blocks
 * from the pool: row r lives in block r >> block_shift at slot r & block_mask, as its
 * weights followed by its optimizer state, padded to a multiple of 4 floats. Blocks
 * are added as rows are reserved and never move, so a row's address is stable and
 * growing never copies rows.
 *
 * The home-side operations (unique, partition, gradient sums, combine) are plain
 * loops in the order the interface defines; the unique step uses a scratch
 * open-addressing index of unique positions (no key sentinel needed).
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/device/backend.h"
#include "lib/memory/hashmap.h"
#include "common/gradient_sum.h"
#include "common/keyhash.h"
#include "common/row_check.h"

/* Row blocks aim at this many bytes (em_row_blocks_plan). */
#define TARGET_BLOCK_BYTES ((size_t)1 << 20)
/* Hash map slots a new shard starts with at most (it grows on demand). */
#define MAX_INITIAL_SLOTS ((size_t)1 << 16)

typedef struct cpu_shard {
    em_shard base;
    em_hashmap *map;
    uint32_t dim;
    uint32_t row_floats; /* dim + optimizer state: what export and import carry */
    uint32_t stride;     /* floats between consecutive rows of a block */
    em_optimizer_config optimizer;
    em_initializer_config initializer;
    /* Upper bounds on the size of every row's values: weights, accumulators and second
     * moments, first moments. While they are within the bounds of common/row_check.h, a
     * push of bounded gradients needs no look at the rows (shard_values_bounded). Set
     * from the initializer at create, widened by every step by what the step can move a
     * value (from the push's largest gradient) and by every write by what it wrote; they
     * never narrow. Read under the shard's lock, written under its write lock. */
    double weight_bound, state_bound, moment_bound;
    float **blocks;
    em_row_access **access_blocks; /* parallel to blocks when track_access */
    bool track_access;
    uint64_t block_count;
    uint64_t block_slots; /* capacity of the blocks array */
    uint32_t block_shift;
    uint64_t block_mask;
    size_t block_bytes;
} cpu_shard;

static cpu_shard *cpu_shard_of(em_shard *shard)
{
    return (cpu_shard *)shard;
}

/* The CPU device's lane: the calling thread does the work, so one stateless lane
 * serves every request at once. */
typedef struct cpu_device_state {
    em_lane lane;
} cpu_device_state;

/* ---- memory and lanes ---------------------------------------------------------------- */

static em_pool_region_provider cpu_region_provider(em_device *device)
{
    (void)device;
    return em_pool_host_provider();
}

static em_status cpu_lane_acquire(em_device *device, em_lane **out, em_error *err)
{
    (void)err;
    *out = &((cpu_device_state *)device->impl)->lane;
    return EM_OK;
}

static void cpu_lane_release(em_lane *lane)
{
    (void)lane;
}

static em_status cpu_copy(em_lane *lane, void *destination, const void *source, size_t bytes,
                          em_error *err)
{
    (void)lane;
    (void)err;
    if (bytes != 0 && destination != source)
        memcpy(destination, source, bytes);
    return EM_OK;
}

static em_status cpu_synchronize(em_lane *lane, em_error *err)
{
    (void)lane;
    (void)err;
    return EM_OK;
}

/* ---- home-side operations -------------------------------------------------------- */

static uint64_t power_of_two_at_least(uint64_t n)
{
    uint64_t power = 16;
    while (power < n)
        power <<= 1;
    return power;
}

/* Temporaries of a home-side operation: those that fit in the caller's local buffer
 * (LOCAL_TEMP_BYTES, enough for requests of a few hundred keys) take no pool lock; larger
 * ones come from the pool, where they count in the device's memory. */
#define LOCAL_TEMP_BYTES 4096

static em_status temp_alloc(em_device *device, size_t bytes, uint64_t *local, const char *what,
                            void **out, em_error *err)
{
    if (bytes <= LOCAL_TEMP_BYTES) {
        *out = local;
        return EM_OK;
    }
    return em_device_alloc(device, bytes, what, out, err);
}

static void temp_free(em_device *device, void *pointer, const uint64_t *local)
{
    if (pointer != local)
        em_device_free(device, pointer);
}

static em_status cpu_unique_keys(em_lane *lane, const uint64_t *keys, uint64_t n,
                                 uint64_t *unique, uint32_t *inverse, uint32_t *first,
                                 uint64_t *unique_count, em_error *err)
{
    em_device *device = lane->device;
    uint64_t slots = power_of_two_at_least(2 * n);
    uint32_t *index = NULL; /* slot -> unique position + 1, 0 when empty */
    uint64_t local[LOCAL_TEMP_BYTES / sizeof(uint64_t)];
    em_status status = temp_alloc(device, slots * sizeof(*index), local, "unique index",
                                  (void **)&index, err);
    if (status != EM_OK)
        return status;
    memset(index, 0, slots * sizeof(*index));
    uint64_t mask = slots - 1;
    uint32_t count = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t key = keys[i];
        uint64_t slot = em_hashmap_hash(key) & mask;
        while (index[slot] != 0 && unique[index[slot] - 1] != key)
            slot = (slot + 1) & mask;
        if (index[slot] == 0) {
            unique[count] = key;
            first[count] = (uint32_t)i;
            index[slot] = ++count;
        }
        inverse[i] = index[slot] - 1;
    }
    temp_free(device, index, local);
    *unique_count = count;
    return EM_OK;
}

static em_status cpu_partition_keys(em_lane *lane, const uint64_t *unique, uint64_t n,
                                    uint32_t shard_count, const uint32_t *first,
                                    uint64_t *partitioned, uint32_t *position, uint32_t *targets,
                                    uint64_t *shard_counts, em_error *err)
{
    em_device *device = lane->device;
    uint32_t *owner = NULL;
    uint64_t *cursor = NULL;
    uint64_t local_owner[LOCAL_TEMP_BYTES / sizeof(uint64_t)];
    uint64_t local_cursor[LOCAL_TEMP_BYTES / sizeof(uint64_t)];
    em_status status = temp_alloc(device, n * sizeof(*owner), local_owner, "partition owners",
                                  (void **)&owner, err);
    if (status != EM_OK)
        return status;
    memset(shard_counts, 0, shard_count * sizeof(*shard_counts));
    for (uint64_t u = 0; u < n; u++) {
        owner[u] = em_key_shard(unique[u], shard_count);
        shard_counts[owner[u]]++;
    }
    status = temp_alloc(device, shard_count * sizeof(*cursor), local_cursor,
                        "partition cursors", (void **)&cursor, err);
    if (status != EM_OK) {
        temp_free(device, owner, local_owner);
        return status;
    }
    uint64_t start = 0;
    for (uint32_t s = 0; s < shard_count; s++) {
        cursor[s] = start;
        start += shard_counts[s];
    }
    for (uint64_t u = 0; u < n; u++) {
        uint64_t slot = cursor[owner[u]]++;
        partitioned[slot] = unique[u];
        position[u] = (uint32_t)slot;
        if (targets != NULL)
            targets[slot] = first[u];
    }
    temp_free(device, cursor, local_cursor);
    temp_free(device, owner, local_owner);
    return EM_OK;
}

static void add_vector(float *destination, const float *source, uint32_t dim)
{
    for (uint32_t j = 0; j < dim; j++)
        destination[j] += source[j];
}

static void add_divided_vector(float *destination, const float *source, float divisor,
                               uint32_t dim)
{
    for (uint32_t j = 0; j < dim; j++)
        destination[j] += source[j] / divisor;
}

static float *vector_at(float *base, uint64_t index, uint32_t dim)
{
    return base + index * dim;
}

static const float *const_vector_at(const float *base, uint64_t index, uint32_t dim)
{
    return base + index * dim;
}

#define NOT_HOT UINT32_MAX

/* Adds row r's (or key position k's) gradient into sum. */
static inline void add_contribution(float *sum, const float *gradients, em_combiner combiner,
                                    float divisor, uint32_t r, uint32_t k, uint32_t dim)
{
    if (combiner == EM_COMBINER_NONE)
        add_vector(sum, const_vector_at(gradients, k, dim), dim);
    else if (divisor == 1.0f)
        add_vector(sum, const_vector_at(gradients, r, dim), dim);
    else
        add_divided_vector(sum, const_vector_at(gradients, r, dim), divisor, dim);
}

/* Every key's contributions added serially from -0.0 in key order, which is the tree of
 * common/gradient_sum.h for a key present at most EM_SUM_CHUNK times; counts[u] (when
 * not NULL) gets how often key u occurs. */
static void sum_serially(const em_device_batch *batch, em_combiner combiner, uint32_t dim,
                         const float *gradients, float *partitioned_gradients, uint32_t *counts)
{
    for (uint32_t r = 0; r < batch->rows; r++) {
        uint32_t begin = batch->offsets[r], end = batch->offsets[r + 1];
        float divisor = em_combiner_divisor(combiner, end - begin);
        for (uint32_t k = begin; k < end; k++) {
            uint32_t u = batch->inverse[k];
            if (counts != NULL)
                counts[u]++;
            add_contribution(vector_at(partitioned_gradients, batch->position[u], dim), gradients,
                             combiner, divisor, r, k, dim);
        }
    }
}

/* The keys present more than EM_SUM_CHUNK times again, by the tree: their first-level
 * chunk sums (key u's from slot first_chunk[u]; seen[u] counts its occurrences so far)
 * and then the rest of the tree. */
static void sum_hot_keys(const em_device_batch *batch, em_combiner combiner, uint32_t dim,
                         const float *gradients, float *partitioned_gradients,
                         const uint32_t *first_chunk, uint32_t *seen, float *chunk_sums)
{
    for (uint32_t r = 0; r < batch->rows; r++) {
        uint32_t begin = batch->offsets[r], end = batch->offsets[r + 1];
        float divisor = em_combiner_divisor(combiner, end - begin);
        for (uint32_t k = begin; k < end; k++) {
            uint32_t u = batch->inverse[k];
            if (first_chunk[u] == NOT_HOT)
                continue;
            add_contribution(vector_at(chunk_sums, first_chunk[u] + seen[u]++ / EM_SUM_CHUNK, dim),
                             gradients, combiner, divisor, r, k, dim);
        }
    }
    for (uint64_t u = 0; u < batch->unique_count; u++) {
        if (first_chunk[u] == NOT_HOT)
            continue;
        float *sum = vector_at(partitioned_gradients, batch->position[u], dim);
        for (uint32_t j = 0; j < dim; j++)
            sum[j] = em_sum_chunk_levels(chunk_sums, first_chunk[u], em_sum_chunks(seen[u]), dim,
                                         j);
    }
}

/* Sums in the order of common/gradient_sum.h: serially (counting each key's
 * occurrences on the way), then again by the tree for the keys present more than
 * EM_SUM_CHUNK times, when a push has any. */
static em_status cpu_sum_gradients(em_lane *lane, const em_device_batch *batch,
                                   em_combiner combiner, uint32_t dim, const float *gradients,
                                   float *partitioned_gradients, em_error *err)
{
    if (combiner == EM_COMBINER_NONE && batch->nnz == batch->unique_count) {
        /* every key once (imports): its sum is -0.0 + its gradient, the gradient itself */
        for (uint64_t k = 0; k < batch->nnz; k++)
            memcpy(vector_at(partitioned_gradients, batch->position[batch->inverse[k]], dim),
                   const_vector_at(gradients, k, dim), dim * sizeof(float));
        return EM_OK;
    }
    uint64_t total = batch->unique_count * dim;
    for (uint64_t i = 0; i < total; i++)
        partitioned_gradients[i] = -0.0f;
    if (batch->nnz <= EM_SUM_CHUNK) { /* no key can be hot */
        sum_serially(batch, combiner, dim, gradients, partitioned_gradients, NULL);
        return EM_OK;
    }
    em_device *device = lane->device;
    uint32_t *counts = NULL, *first_chunk = NULL, slots = 0;
    float *chunk_sums = NULL;
    uint64_t local[LOCAL_TEMP_BYTES / sizeof(uint64_t)];
    em_status status = temp_alloc(device, batch->unique_count * sizeof(*counts), local,
                                  "key occurrence counts", (void **)&counts, err);
    if (status != EM_OK)
        return status;
    memset(counts, 0, batch->unique_count * sizeof(*counts));
    sum_serially(batch, combiner, dim, gradients, partitioned_gradients, counts);
    for (uint64_t u = 0; u < batch->unique_count; u++)
        if (counts[u] > EM_SUM_CHUNK)
            slots += em_sum_chunks(counts[u]);
    if (slots > 0) /* a hot key: counts becomes the occurrences seen in the second pass */
        status = em_device_alloc(device, batch->unique_count * sizeof(*first_chunk),
                                 "hot key chunks", (void **)&first_chunk, err);
    if (status == EM_OK && slots > 0)
        status = em_device_alloc(device, (uint64_t)slots * dim * sizeof(float),
                                 "hot key chunk sums", (void **)&chunk_sums, err);
    if (status == EM_OK && slots > 0) {
        for (uint64_t u = 0, next = 0; u < batch->unique_count; u++) {
            first_chunk[u] = counts[u] > EM_SUM_CHUNK ? (uint32_t)next : NOT_HOT;
            if (counts[u] > EM_SUM_CHUNK)
                next += em_sum_chunks(counts[u]);
            counts[u] = 0;
        }
        for (uint64_t i = 0; i < (uint64_t)slots * dim; i++)
            chunk_sums[i] = -0.0f;
        sum_hot_keys(batch, combiner, dim, gradients, partitioned_gradients, first_chunk, counts,
                     chunk_sums);
    }
    em_device_free(device, chunk_sums);
    em_device_free(device, first_chunk);
    temp_free(device, counts, local);
    return status;
}

static void combine_row(const em_device_batch *batch, uint32_t row, em_combiner combiner,
                        uint32_t dim, const float *vectors, float *out)
{
    uint32_t begin = batch->offsets[row], end = batch->offsets[row + 1];
    memset(out, 0, dim * sizeof(float));
    for (uint32_t k = begin; k < end; k++)
        add_vector(out, const_vector_at(vectors, batch->position[batch->inverse[k]], dim), dim);
    float divisor = em_combiner_divisor(combiner, end - begin);
    if (divisor != 1.0f)
        for (uint32_t j = 0; j < dim; j++)
            out[j] /= divisor;
}

static em_status cpu_combine(em_lane *lane, const em_device_batch *batch,
                             em_combiner combiner, uint32_t dim, const float *vectors, float *out,
                             em_error *err)
{
    (void)lane;
    (void)err;
    if (combiner == EM_COMBINER_NONE) {
        for (uint64_t k = 0; k < batch->nnz; k++)
            memcpy(vector_at(out, k, dim),
                   const_vector_at(vectors, batch->position[batch->inverse[k]], dim),
                   dim * sizeof(float));
        return EM_OK;
    }
    for (uint32_t r = 0; r < batch->rows; r++)
        combine_row(batch, r, combiner, dim, vectors, vector_at(out, r, dim));
    return EM_OK;
}

static em_status cpu_copy_repeats(em_lane *lane, const em_device_batch *batch,
                                  const uint32_t *first, uint32_t dim, float *out, em_error *err)
{
    (void)lane;
    (void)err;
    for (uint64_t k = 0; k < batch->nnz; k++) {
        uint32_t origin = first[batch->inverse[k]];
        if (origin != k)
            memcpy(vector_at(out, k, dim), const_vector_at(out, origin, dim), dim * sizeof(float));
    }
    return EM_OK;
}

/* ---- shards: storage ------------------------------------------------------------- */

static float *row_address(const cpu_shard *shard, uint64_t row)
{
    return shard->blocks[row >> shard->block_shift] + (row & shard->block_mask) * shard->stride;
}

/* Rows are visited in key order, scattered over the blocks: the row this many steps
 * ahead is fetched while the current one is worked on. */
#define PREFETCH_AHEAD 8

static void prefetch_row(const cpu_shard *shard, uint64_t row)
{
    const char *address = (const char *)row_address(shard, row);
    size_t bytes = (size_t)shard->row_floats * sizeof(float);
    for (size_t offset = 0; offset < bytes; offset += 64)
        __builtin_prefetch(address + offset, 1);
}

static uint64_t storage_rows(const cpu_shard *shard)
{
    return shard->block_count << shard->block_shift;
}

static size_t access_block_bytes(const cpu_shard *shard)
{
    return ((size_t)1 << shard->block_shift) * sizeof(em_row_access);
}

static em_row_access *row_access(const cpu_shard *shard, uint64_t row)
{
    return shard->access_blocks[row >> shard->block_shift] + (row & shard->block_mask);
}

static em_status grow_block_array(cpu_shard *shard, em_error *err)
{
    uint64_t slots = shard->block_slots == 0 ? 16 : shard->block_slots * 2;
    float **grown = realloc(shard->blocks, slots * sizeof(*grown));
    if (grown == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "shard block table: out of host memory");
    shard->blocks = grown;
    em_row_access **access = realloc(shard->access_blocks, slots * sizeof(*access));
    if (access == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "shard block table: out of host memory");
    shard->access_blocks = access;
    shard->block_slots = slots;
    return EM_OK;
}

/* Adds blocks until the storage holds at least rows rows. Blocks added before a
 * failure stay: they are spare capacity, never half-written rows. */
static em_status ensure_storage(cpu_shard *shard, uint64_t rows, em_error *err)
{
    while (storage_rows(shard) < rows) {
        if (shard->block_count == shard->block_slots) {
            em_status status = grow_block_array(shard, err);
            if (status != EM_OK)
                return status;
        }
        void *access = NULL, *block = NULL;
        if (shard->track_access) {
            em_status status = em_device_alloc(shard->base.device, access_block_bytes(shard),
                                               "row access metadata", &access, err);
            if (status != EM_OK)
                return status;
        }
        em_status status = em_device_alloc(shard->base.device, shard->block_bytes,
                                           "row storage", &block, err);
        if (status != EM_OK) {
            em_device_free(shard->base.device, access);
            return status;
        }
        shard->access_blocks[shard->block_count] = access;
        shard->blocks[shard->block_count++] = block;
    }
    return EM_OK;
}

static void initialize_row(cpu_shard *shard, uint64_t key, uint64_t row)
{
    float *weights = row_address(shard, row);
    em_initializer_fill(&shard->initializer, key, shard->dim, weights);
    em_optimizer_init_state(&shard->optimizer, shard->dim, weights + shard->dim);
    if (shard->track_access)
        *row_access(shard, row) = (em_row_access){0};
}

/* ---- shards: operations ---------------------------------------------------------- */

static em_status cpu_shard_create(em_device *device, const em_shard_spec *spec, em_shard **out,
                                  em_error *err)
{
    cpu_shard *shard = calloc(1, sizeof(*shard));
    if (shard == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "shard %u: out of host memory",
                            spec->index);
    shard->base.device = device;
    shard->dim = spec->dim;
    shard->optimizer = spec->optimizer;
    shard->initializer = spec->initializer;
    shard->track_access = spec->track_access;
    /* the initializer's largest value: uniform(-a, a) stays within a; normal draws are
     * Box-Muller over 53-bit uniforms, within 8.6 standard deviations */
    shard->weight_bound = spec->initializer.kind == EM_INIT_UNIFORM  ? fabs(spec->initializer.bound)
                          : spec->initializer.kind == EM_INIT_NORMAL ? 9.0 * fabs(spec->initializer.stddev)
                                                                      : 0.0;
    shard->state_bound = em_optimizer_has_accumulator(spec->optimizer.kind)
                             ? spec->optimizer.initial_accumulator
                             : 0.0;
    em_row_blocks plan = em_row_blocks_plan(spec->dim, spec->optimizer.kind, TARGET_BLOCK_BYTES,
                                            spec->expected_rows);
    shard->row_floats = plan.row_floats;
    shard->stride = plan.stride;
    shard->block_shift = plan.block_shift;
    shard->block_mask = plan.block_mask;
    shard->block_bytes = plan.block_bytes;

    em_hashmap_options map_options = {
        .initial_slots = spec->expected_rows < MAX_INITIAL_SLOTS ? (size_t)spec->expected_rows + 16
                                                                 : MAX_INITIAL_SLOTS,
        .max_load_factor = EM_HASHMAP_DEFAULT_MAX_LOAD,
        .allocator = em_pool_host_allocator(device->pool),
        .seed = spec->hash_seed,
    };
    em_status status = em_hashmap_create(&map_options, &shard->map, err);
    if (status != EM_OK) {
        free(shard);
        return em_error_prefix(err, "table '%s' shard %u: ", spec->table, spec->index);
    }
    *out = &shard->base;
    return EM_OK;
}

static void cpu_shard_destroy(em_shard *base)
{
    if (base == NULL)
        return;
    cpu_shard *shard = cpu_shard_of(base);
    for (uint64_t b = 0; b < shard->block_count; b++) {
        em_device_free(base->device, shard->blocks[b]);
        em_device_free(base->device, shard->access_blocks[b]);
    }
    free(shard->blocks);
    free(shard->access_blocks);
    em_hashmap_destroy(shard->map);
    free(shard);
}

static em_status cpu_shard_find(em_shard *base, em_lane *lane, const uint64_t *keys, uint64_t n,
                                uint64_t *rows, uint64_t *missing, em_error *err)
{
    (void)lane;
    (void)err;
    *missing = em_hashmap_find(cpu_shard_of(base)->map, keys, n, rows);
    return EM_OK;
}

/* An evicted key's slot and row take a new key: evictions erase by backward shift, which
 * frees the slot, and the row goes on the free stack that inserts take from first. */
static em_status cpu_shard_reserve(em_shard *base, em_lane *lane, uint64_t new_keys,
                                   uint64_t evicted, em_error *err)
{
    (void)lane;
    cpu_shard *shard = cpu_shard_of(base);
    uint64_t fresh = new_keys > evicted ? new_keys - evicted : 0; /* headroom evicts more */
    em_status status = em_hashmap_reserve(shard->map, fresh, err);
    if (status != EM_OK)
        return status;
    return ensure_storage(shard, em_hashmap_row_limit(shard->map) + fresh, err);
}

/* Copies the keys whose row is missing into `missing` (n entries); returns the count. */
static uint64_t collect_missing(const uint64_t *keys, const uint64_t *rows, uint64_t n,
                                uint64_t *missing)
{
    uint64_t count = 0;
    for (uint64_t i = 0; i < n; i++)
        if (rows[i] == EM_ROW_NONE)
            missing[count++] = keys[i];
    return count;
}

static em_status cpu_shard_insert_missing(em_shard *base, em_lane *lane, const uint64_t *keys,
                                          uint64_t n, uint64_t *rows, bool initialize,
                                          em_error *err)
{
    (void)lane;
    cpu_shard *shard = cpu_shard_of(base);
    uint64_t *missing_keys = NULL, *new_rows = NULL;
    uint8_t *inserted = NULL;
    uint64_t local_keys[LOCAL_TEMP_BYTES / sizeof(uint64_t)];
    uint64_t local_rows[LOCAL_TEMP_BYTES / sizeof(uint64_t)];
    uint64_t local_flags[LOCAL_TEMP_BYTES / sizeof(uint64_t)];
    em_status status = temp_alloc(base->device, n * sizeof(uint64_t), local_keys, "insert keys",
                                  (void **)&missing_keys, err);
    if (status == EM_OK)
        status = temp_alloc(base->device, n * sizeof(uint64_t), local_rows, "insert rows",
                            (void **)&new_rows, err);
    if (status == EM_OK)
        status = temp_alloc(base->device, n, local_flags, "insert flags", (void **)&inserted,
                            err);
    if (status == EM_OK) {
        uint64_t count = collect_missing(keys, rows, n, missing_keys);
        memset(inserted, 0, count);
        status = em_hashmap_find_or_insert(shard->map, missing_keys, count, new_rows, inserted,
                                           NULL, err);
        /* Rows the map handed out are initialised even if a later key failed, so no
         * reader ever sees uninitialised memory (unless the caller writes them all). */
        for (uint64_t i = 0; i < count; i++)
            if (inserted[i] && initialize)
                initialize_row(shard, missing_keys[i], new_rows[i]);
            else if (inserted[i] && shard->track_access)
                *row_access(shard, new_rows[i]) = (em_row_access){0};
        for (uint64_t i = 0, next = 0; status == EM_OK && i < n; i++)
            if (rows[i] == EM_ROW_NONE)
                rows[i] = new_rows[next++];
    }
    temp_free(base->device, inserted, local_flags);
    temp_free(base->device, new_rows, local_rows);
    temp_free(base->device, missing_keys, local_keys);
    return status;
}

static em_status cpu_shard_gather(em_shard *base, em_lane *lane, const uint64_t *rows,
                                  uint64_t n, const uint32_t *targets, float *vectors,
                                  em_error *err)
{
    (void)lane;
    (void)err;
    cpu_shard *shard = cpu_shard_of(base);
    size_t vector_bytes = shard->dim * sizeof(float);
    for (uint64_t i = 0; i < n; i++) {
        float *destination = vector_at(vectors, targets != NULL ? targets[i] : i, shard->dim);
        if (!em_row_stored(rows[i]))
            memset(destination, 0, vector_bytes);
        else
            memcpy(destination, row_address(shard, rows[i]), vector_bytes);
    }
    return EM_OK;
}

/* ---- the bounds on a shard's values (cpu_shard.weight_bound) ---- */

/* Whether every row is within the bounds of common/row_check.h. */
static bool shard_values_bounded(const cpu_shard *shard)
{
    bool adam = shard->optimizer.kind == EM_OPTIMIZER_ADAM;
    double state_limit = adam ? (double)EM_ROW_BOUND_GRADIENT * EM_ROW_BOUND_GRADIENT
                              : (double)EM_ROW_BOUND_ACCUMULATOR;
    return shard->weight_bound <= EM_ROW_BOUND_WEIGHT && shard->state_bound <= state_limit &&
           shard->moment_bound <= EM_ROW_BOUND_GRADIENT;
}

/* After a step of n rows by gradients: each bound grows by the most the step can move
 * its values, from the largest gradient (row_check.h has the arithmetic: Adagrad moves a
 * weight by at most lr, row-wise Adagrad by lr * sqrt(dim), Adam by lr * m / ((1 - beta1)
 * * eps); accumulators grow by at most g * g; Adam's moments stay within the largest of
 * their old bound and the gradient's). A margin covers float rounding. */
static void widen_bounds(cpu_shard *shard, float largest)
{
    const em_optimizer_config *o = &shard->optimizer;
    double margin = 1.0 + 1e-5, g = (double)largest * margin;
    double lr = fabs((double)o->learning_rate) * margin;
    switch (o->kind) {
    case EM_OPTIMIZER_SGD:
        shard->weight_bound += lr * g;
        break;
    case EM_OPTIMIZER_ADAGRAD:
        shard->weight_bound += lr;
        shard->state_bound += g * g;
        break;
    case EM_OPTIMIZER_ROWWISE_ADAGRAD:
        shard->weight_bound += lr * sqrt((double)shard->dim);
        shard->state_bound += g * g;
        break;
    case EM_OPTIMIZER_ADAM:
        shard->moment_bound = fmax(shard->moment_bound, g);
        shard->state_bound = fmax(shard->state_bound, g * g);
        shard->weight_bound += lr * shard->moment_bound / ((1.0 - (double)o->beta1) * o->eps);
        break;
    case EM_OPTIMIZER_COUNT:
        shard->weight_bound = INFINITY;
        break;
    }
}

/* The largest |v[j]| (NaN ignored, as fmax does), without a libm call per element. It
 * compares bits: with the sign cleared, the bits of non-NaN floats order as their
 * magnitudes do, and a NaN's (above infinity's) count as 0. Integer maxima have no
 * NaN or signed-zero cases, so the loop runs on vector lanes (a float maximum would
 * be one compare after another). */
static float largest_magnitude(const float *v, uint32_t n)
{
    int32_t largest = 0;
    for (uint32_t j = 0; j < n; j++) {
        int32_t bits;
        memcpy(&bits, v + j, sizeof(bits));
        bits &= INT32_C(0x7fffffff);
        bits = bits > INT32_C(0x7f800000) ? 0 : bits;
        largest = bits > largest ? bits : largest;
    }
    float magnitude;
    memcpy(&magnitude, &largest, sizeof(magnitude));
    return magnitude;
}

/* After a row was written as given: the bounds take in its values. */
static void widen_bounds_to_row(cpu_shard *shard, const float *row)
{
    uint32_t dim = shard->dim;
    shard->weight_bound = fmax(shard->weight_bound, largest_magnitude(row, dim));
    switch (shard->optimizer.kind) {
    case EM_OPTIMIZER_ADAM:
        shard->moment_bound = fmax(shard->moment_bound, largest_magnitude(row + dim, dim));
        shard->state_bound = fmax(shard->state_bound, largest_magnitude(row + 2 * dim, dim));
        if (!(row[3 * dim] >= 0.0f && row[3 * dim] <= EM_ADAM_MAX_STEP))
            shard->weight_bound = INFINITY; /* a step count no step makes: check every row */
        break;
    case EM_OPTIMIZER_ADAGRAD:
    case EM_OPTIMIZER_ROWWISE_ADAGRAD:
        shard->state_bound =
            fmax(shard->state_bound, largest_magnitude(row + dim, shard->row_floats - dim));
        break;
    case EM_OPTIMIZER_SGD:
    case EM_OPTIMIZER_COUNT:
        break;
    }
}

static em_status cpu_shard_apply(em_shard *base, em_lane *lane, const uint64_t *rows,
                                 uint64_t n, const float *gradients, float largest, em_error *err)
{
    (void)lane;
    (void)err;
    cpu_shard *shard = cpu_shard_of(base);
    for (uint64_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n && em_row_stored(rows[i + PREFETCH_AHEAD]))
            prefetch_row(shard, rows[i + PREFETCH_AHEAD]);
        if (rows[i] == EM_ROW_REJECTED)
            continue;
        float *weights = row_address(shard, rows[i]);
        em_optimizer_apply_row(&shard->optimizer, shard->dim, weights, weights + shard->dim,
                               const_vector_at(gradients, i, shard->dim));
    }
    /* the check usually found the largest gradient already */
    widen_bounds(shard, largest >= 0.0f ? largest
                                        : em_row_largest_size(gradients, n * shard->dim));
    return EM_OK;
}

/* When every row of the shard is within the bounds of row_check.h (its bounds say so), only
 * the gradients are looked at: bounded gradients then step every row, new ones included,
 * to finite values. Otherwise rows within the bounds are passed in one branch-free look;
 * any other row (and every row the push creates) gets the exact check, which also finds
 * the first problem. */
static em_status cpu_shard_check_apply(em_shard *base, em_lane *lane, const uint64_t *keys,
                                       const uint64_t *rows, uint64_t n, const float *gradients,
                                       float gradient_bound, uint64_t *first_problem,
                                       int *bounded, float *largest, em_error *err)
{
    (void)lane;
    (void)err;
    cpu_shard *shard = cpu_shard_of(base);
    int steps_bounded = em_row_bound_step(&shard->optimizer, shard->dim);
    *first_problem = UINT64_MAX;
    *largest = -1.0f;
    if (steps_bounded && shard_values_bounded(shard)) {
        /* every row is within the bounds: the gradients decide (by the bound the push
         * found while checking its input, else their largest size), rows are not read;
         * the same bound serves the step (widen_bounds) */
        *largest = gradient_bound >= 0.0f ? gradient_bound
                                          : em_row_largest_size(gradients, n * shard->dim);
        if (*largest <= EM_ROW_BOUND_GRADIENT) {
            *bounded = 1;
            return EM_OK;
        }
        *largest = -1.0f;
    }
    int all_bounded = steps_bounded;
    for (uint64_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n && em_row_stored(rows[i + PREFETCH_AHEAD]))
            prefetch_row(shard, rows[i + PREFETCH_AHEAD]);
        if (rows[i] == EM_ROW_REJECTED)
            continue;
        const float *gradient = const_vector_at(gradients, i, shard->dim);
        const float *row = rows[i] == EM_ROW_NONE ? NULL : row_address(shard, rows[i]);
        if (steps_bounded && row != NULL &&
            em_row_bounded(&shard->optimizer, shard->dim, row, gradient))
            continue;
        all_bounded = 0;
        uint32_t code = em_row_check(&shard->optimizer, &shard->initializer, shard->dim, row,
                                     keys[i], gradient);
        if (code != EM_ROW_CHECK_OK) {
            *first_problem = (i << 32) | code;
            break;
        }
    }
    *bounded = all_bounded;
    return EM_OK;
}

static em_status cpu_shard_export(em_shard *base, em_lane *lane, uint64_t *cursor,
                                  uint64_t *keys, float *values, uint64_t *rows_out,
                                  uint64_t max, uint64_t *count, em_error *err)
{
    (void)lane;
    cpu_shard *shard = cpu_shard_of(base);
    uint64_t *rows = rows_out;
    if (rows == NULL) {
        em_status status = em_device_alloc(base->device, max * sizeof(*rows), "export rows",
                                           (void **)&rows, err);
        if (status != EM_OK)
            return status;
    }
    uint64_t exported = em_hashmap_export(shard->map, cursor, keys, rows, max);
    for (uint64_t i = 0; values != NULL && i < exported; i++)
        memcpy(vector_at(values, i, shard->row_floats), row_address(shard, rows[i]),
               shard->row_floats * sizeof(float));
    if (rows != rows_out)
        em_device_free(base->device, rows);
    *count = exported;
    return EM_OK;
}

static em_status cpu_shard_read_rows(em_shard *base, em_lane *lane, const uint64_t *rows,
                                     uint64_t n, float *values, em_error *err)
{
    (void)lane;
    (void)err;
    cpu_shard *shard = cpu_shard_of(base);
    for (uint64_t i = 0; i < n; i++)
        memcpy(vector_at(values, i, shard->row_floats), row_address(shard, rows[i]),
               shard->row_floats * sizeof(float));
    return EM_OK;
}

/* Overwrites a row with the floats at source, widening the bounds by them. */
static void write_row(cpu_shard *shard, uint64_t row, const float *source)
{
    float *to = row_address(shard, row);
    memcpy(to, source, shard->row_floats * sizeof(float));
    widen_bounds_to_row(shard, to);
}

static em_status cpu_shard_write_rows(em_shard *base, em_lane *lane, const uint64_t *rows,
                                      uint64_t n, const uint32_t *sources, const float *values,
                                      em_error *err)
{
    (void)lane;
    (void)err;
    cpu_shard *shard = cpu_shard_of(base);
    for (uint64_t i = 0; i < n; i++)
        write_row(shard, rows[i],
                  const_vector_at(values, sources != NULL ? sources[i] : i, shard->row_floats));
    return EM_OK;
}

static em_status cpu_shard_write_rows_from(em_shard *base, em_lane *lane, const uint64_t *rows,
                                           uint64_t n, const float *const *sources,
                                           em_error *err)
{
    (void)lane;
    (void)err;
    cpu_shard *shard = cpu_shard_of(base);
    for (uint64_t i = 0; i < n; i++)
        write_row(shard, rows[i], sources[i]);
    return EM_OK;
}

static void cpu_shard_stats(em_shard *base, em_shard_stats *out)
{
    cpu_shard *shard = cpu_shard_of(base);
    em_hashmap_stats map;
    em_hashmap_get_stats(shard->map, &map);
    *out = (em_shard_stats){0}; /* a map here never grows through the host */
    out->rows = map.size;
    out->row_bytes = shard->block_count * shard->block_bytes;
    out->index_bytes = map.bytes;
    out->row_limit = storage_rows(shard);
    out->access_bytes = shard->track_access ? shard->block_count * access_block_bytes(shard) : 0;
}

/* ---- shards: access and eviction ------------------------------------------------- */

static em_status cpu_shard_touch(em_shard *base, em_lane *lane, const uint64_t *rows, uint64_t n,
                                 uint64_t accessed, uint32_t updated, bool pushed, em_error *err)
{
    (void)lane;
    (void)err;
    cpu_shard *shard = cpu_shard_of(base);
    if (!shard->track_access)
        return EM_OK;
    /* pulls touch under the shard's read lock: relaxed atomic loads and stores, so two
     * touches of one row at once are no data race (one of their counts may be lost) */
    for (uint64_t i = 0; i < n; i++) {
        if (!em_row_stored(rows[i]))
            continue;
        em_row_access *access = row_access(shard, rows[i]);
        __atomic_store_n(&access->accessed, accessed, __ATOMIC_RELAXED);
        uint32_t frequency = __atomic_load_n(&access->frequency, __ATOMIC_RELAXED);
        if (frequency != UINT32_MAX)
            __atomic_store_n(&access->frequency, frequency + 1, __ATOMIC_RELAXED);
        if (pushed || frequency == 0) /* pushed, or created by this request */
            __atomic_store_n(&access->updated, updated, __ATOMIC_RELAXED);
    }
    return EM_OK;
}

static em_status cpu_shard_read_access(em_shard *base, em_lane *lane, const uint64_t *rows,
                                       uint64_t n, em_row_access *out, em_error *err)
{
    (void)lane;
    cpu_shard *shard = cpu_shard_of(base);
    if (!shard->track_access)
        return em_error_set(err, EM_FAILED_PRECONDITION, "shard keeps no access metadata");
    for (uint64_t i = 0; i < n; i++) { /* touches may run: relaxed atomic loads */
        const em_row_access *access = row_access(shard, rows[i]);
        out[i].accessed = __atomic_load_n(&access->accessed, __ATOMIC_RELAXED);
        out[i].updated = __atomic_load_n(&access->updated, __ATOMIC_RELAXED);
        out[i].frequency = __atomic_load_n(&access->frequency, __ATOMIC_RELAXED);
    }
    return EM_OK;
}

static em_status cpu_shard_write_access(em_shard *base, em_lane *lane, const uint64_t *rows,
                                        uint64_t n, const em_row_access *in, em_error *err)
{
    (void)lane;
    cpu_shard *shard = cpu_shard_of(base);
    if (!shard->track_access)
        return em_error_set(err, EM_FAILED_PRECONDITION, "shard keeps no access metadata");
    for (uint64_t i = 0; i < n; i++)
        *row_access(shard, rows[i]) = in[i];
    return EM_OK;
}

/* Pushes of the table since the row's last push or its creation. */
static uint32_t update_age(uint32_t update_clock, const em_row_access *access)
{
    return update_clock - access->updated;
}

/* How far ahead the walk prefetches an entry's access metadata. */
#define EVICT_PREFETCH ((uint64_t)64)

/* A walk of the shard's map for em_evict_choose. */
typedef struct cpu_evict_walk {
    cpu_shard *shard;
    em_hashmap_walk walk;
} cpu_evict_walk;

static em_status cpu_evict_walk_next(void *context, uint64_t max, uint64_t *keys, uint64_t *rows,
                                     em_row_access *access, uint64_t *got, em_error *err)
{
    (void)err;
    cpu_evict_walk *w = context;
    *got = em_hashmap_walk_next(w->shard->map, &w->walk, keys, rows, max);
    for (uint64_t i = 0; i < *got; i++) {
        if (i + EVICT_PREFETCH < *got)
            __builtin_prefetch(row_access(w->shard, rows[i + EVICT_PREFETCH]), 0);
        access[i] = *row_access(w->shard, rows[i]);
    }
    return EM_OK;
}

static em_status cpu_shard_evict(em_shard *base, em_lane *lane, const em_evict_spec *spec,
                                 uint64_t *keys, uint64_t *rows, em_error *err)
{
    (void)lane;
    cpu_shard *shard = cpu_shard_of(base);
    if (!shard->track_access)
        return em_error_set(err, EM_FAILED_PRECONDITION, "shard keeps no access metadata");
    cpu_evict_walk walk = {.shard = shard};
    em_hashmap_walk_begin(shard->map, spec->random, &walk.walk);
    em_status status = em_evict_choose(spec, cpu_evict_walk_next, &walk, keys, rows, err);
    if (status == EM_OK)
        em_hashmap_erase_exclusive(shard->map, keys, spec->count, NULL);
    return status;
}

static em_status cpu_shard_expire(em_shard *base, em_lane *lane, uint32_t update_clock,
                                  uint32_t min_age, uint64_t *cursor, uint64_t scan,
                                  uint64_t *keys, uint64_t *rows, uint64_t *count, em_error *err)
{
    (void)lane;
    cpu_shard *shard = cpu_shard_of(base);
    *count = 0;
    if (!shard->track_access)
        return em_error_set(err, EM_FAILED_PRECONDITION, "shard keeps no access metadata");
    /* the examined entries land in keys/rows, the expired ones are packed in front */
    uint64_t got = em_hashmap_export(shard->map, cursor, keys, rows, scan);
    if (got < scan) /* the export reached the end of the map */
        *cursor = 0;
    for (uint64_t i = 0; i < got; i++) {
        if (update_age(update_clock, row_access(shard, rows[i])) < min_age)
            continue;
        keys[*count] = keys[i];
        rows[*count] = rows[i];
        (*count)++;
    }
    em_hashmap_erase(shard->map, keys, *count, NULL);
    return EM_OK;
}

static em_status cpu_shard_fill_initial(em_shard *base, em_lane *lane, const uint64_t *keys,
                                        const uint64_t *rows, uint64_t n,
                                        const uint32_t *targets, float *vectors, em_error *err)
{
    (void)lane;
    (void)err;
    cpu_shard *shard = cpu_shard_of(base);
    for (uint64_t i = 0; i < n; i++)
        if (rows[i] == EM_ROW_REJECTED)
            em_initializer_fill(&shard->initializer, keys[i], shard->dim,
                                vector_at(vectors, targets != NULL ? targets[i] : i, shard->dim));
    return EM_OK;
}

static em_status cpu_shard_erase(em_shard *base, em_lane *lane, const uint64_t *keys,
                                 const uint64_t *rows, uint64_t n, em_error *err)
{
    (void)lane;
    cpu_shard *shard = cpu_shard_of(base);
    uint64_t *present = NULL;
    em_status status = em_device_alloc(base->device, (n + 1) * sizeof(uint64_t), "erase keys",
                                       (void **)&present, err);
    if (status != EM_OK)
        return status;
    uint64_t count = 0;
    for (uint64_t i = 0; i < n; i++)
        if (em_row_stored(rows[i]))
            present[count++] = keys[i];
    em_hashmap_erase(shard->map, present, count, NULL);
    em_device_free(base->device, present);
    return EM_OK;
}

/* ---- device ---------------------------------------------------------------------- */

static void cpu_device_destroy(em_device *device)
{
    em_pool_destroy(device->pool);
    free(device->impl);
    free(device);
}

static const em_device_ops cpu_device_ops = {
    .region_provider = cpu_region_provider,
    .lane_acquire = cpu_lane_acquire,
    .lane_release = cpu_lane_release,
    .copy_to_device = cpu_copy,
    .copy_to_host = cpu_copy,
    .synchronize = cpu_synchronize,
    .unique_keys = cpu_unique_keys,
    .partition_keys = cpu_partition_keys,
    .sum_gradients = cpu_sum_gradients,
    .combine = cpu_combine,
    .copy_repeats = cpu_copy_repeats,
    .shard_create = cpu_shard_create,
    .shard_destroy = cpu_shard_destroy,
    .shard_find = cpu_shard_find,
    .shard_reserve = cpu_shard_reserve,
    .shard_insert_missing = cpu_shard_insert_missing,
    .shard_gather = cpu_shard_gather,
    .shard_check_apply = cpu_shard_check_apply,
    .shard_apply = cpu_shard_apply,
    .shard_export = cpu_shard_export,
    .shard_read_rows = cpu_shard_read_rows,
    .shard_write_rows = cpu_shard_write_rows,
    .shard_write_rows_from = cpu_shard_write_rows_from,
    .shard_stats = cpu_shard_stats,
    .shard_touch = cpu_shard_touch,
    .shard_read_access = cpu_shard_read_access,
    .shard_write_access = cpu_shard_write_access,
    .shard_evict = cpu_shard_evict,
    .shard_erase = cpu_shard_erase,
    .shard_expire = cpu_shard_expire,
    .shard_fill_initial = cpu_shard_fill_initial,
    .destroy = cpu_device_destroy,
};

em_status em_cpu_device_create(uint32_t index, const em_cpu_backend_options *options,
                               em_device **out, em_error *err)
{
    em_device *device = em_device_allocate();
    cpu_device_state *state = calloc(1, sizeof(*state));
    if (device == NULL || state == NULL) {
        free(device);
        free(state);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "cpu device %u: out of memory", index);
    }
    state->lane.device = device;
    device->impl = state;
    device->ops = &cpu_device_ops;
    snprintf(device->name, sizeof(device->name), "cpu%u", index);
    device->kind = "cpu";
    device->index = index;
    device->host_addressable = true;
    em_pool_options pool_options = {
        .name = device->name,
        .initial_bytes = options->pool_initial_bytes,
        .growth_bytes = options->pool_growth_bytes,
        .limit_bytes = options->pool_limit_bytes,
        .provider = cpu_region_provider(device),
    };
    em_status status = em_pool_create(&pool_options, &device->pool, err);
    if (status != EM_OK) {
        free(state);
        free(device);
        return em_error_prefix(err, "cpu device %u: ", index);
    }
    *out = device;
    return EM_OK;
}
