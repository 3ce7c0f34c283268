/*
 * DESIGN: what every GPU thread does, written once for the GPU and the host.
 *
 * Each kernel in kernels/ (the .cu files) is a loop over items (or over a row's elements) that
 * calls one function of this header per item; the functions are EM_HOST_DEVICE and
 * plain C, so the same text compiles three ways: into the kernels (nvcc, device),
 * into tests/support/kernels_emulated.c (a serial host implementation of
 * kernels/ember_kernels.h that runs the CUDA backend on machines without a GPU), and
 * into host unit tests that compare the results with the CPU device's.
 *
 * Atomics are wrappers: CUDA atomics on the device, GCC __atomic builtins on the host,
 * so the hash-map protocol can also be exercised by several host threads at once.
 *
 * Arithmetic follows the CPU device exactly: gradient sums add a key's contributions in
 * the fixed tree of common/gradient_sum.h (serially from -0.0 in increasing key position
 * for a key with at most 32 occurrences); pooled pulls start from +0.0 and add
 * in key order, then divide by em_combiner_divisor; divisors, initial values and
 * optimizer steps call the shared functions of common/ (combiner.h, initializer.h,
 * optimizer.h) that the CPU device calls too. The kernels are
 * compiled without fused multiply-add contraction (kernels/meson.build) so the
 * roundings are the CPU's too.
 *
 * Not covered by running this on the host: launch geometry, the GPU memory model,
 * warp shuffles (the rowwise reduction's tree order is emulated, see
 * em_gpu_rowwise_partial) and 16-byte vector accesses (em_gpu_copy4).
 */
#ifndef EMBER_KERNELS_KERNEL_LOGIC_H
#define EMBER_KERNELS_KERNEL_LOGIC_H

#include <stdint.h>

#ifndef __CUDACC__
#include <math.h>
#endif

#include "common/combiner.h"
#include "common/gradient_sum.h"
#include "common/initializer.h"
#include "common/keyhash.h"
#include "common/optimizer.h"
#include "common/row_check.h"
#include "kernels/ember_kernels.h"

/* Threads that cooperate on one row in the rowwise-adagrad and adam kernels (a warp):
 * rowwise adagrad's lanes are common/optimizer.h's, so its sums are the CPU's. */
#define EM_GPU_ROW_LANES EM_ROWWISE_LANES

/* ---- atomics and ordered accesses ---------------------------------------------------- */

EM_HOST_DEVICE uint64_t em_gpu_atomic_cas_u64(uint64_t *address, uint64_t expected,
                                              uint64_t desired)
{
#ifdef __CUDA_ARCH__
    return (uint64_t)atomicCAS((unsigned long long *)address, (unsigned long long)expected,
                               (unsigned long long)desired);
#else
    __atomic_compare_exchange_n(address, &expected, desired, 0, __ATOMIC_ACQ_REL,
                                __ATOMIC_ACQUIRE);
    return expected;
#endif
}

EM_HOST_DEVICE uint32_t em_gpu_atomic_cas_u32(uint32_t *address, uint32_t expected,
                                              uint32_t desired)
{
#ifdef __CUDA_ARCH__
    return (uint32_t)atomicCAS((unsigned int *)address, (unsigned int)expected,
                               (unsigned int)desired);
#else
    __atomic_compare_exchange_n(address, &expected, desired, 0, __ATOMIC_ACQ_REL,
                                __ATOMIC_ACQUIRE);
    return expected;
#endif
}

/* Returns the value before the addition. */
EM_HOST_DEVICE uint64_t em_gpu_atomic_add_u64(uint64_t *address, uint64_t value)
{
#ifdef __CUDA_ARCH__
    return (uint64_t)atomicAdd((unsigned long long *)address, (unsigned long long)value);
#else
    return __atomic_fetch_add(address, value, __ATOMIC_ACQ_REL);
#endif
}

EM_HOST_DEVICE void em_gpu_atomic_or_u64(uint64_t *address, uint64_t value)
{
#ifdef __CUDA_ARCH__
    atomicOr((unsigned long long *)address, (unsigned long long)value);
#else
    __atomic_fetch_or(address, value, __ATOMIC_ACQ_REL);
#endif
}

EM_HOST_DEVICE void em_gpu_atomic_min_u32(uint32_t *address, uint32_t value)
{
#ifdef __CUDA_ARCH__
    atomicMin((unsigned int *)address, (unsigned int)value);
#else
    uint32_t seen = __atomic_load_n(address, __ATOMIC_ACQUIRE);
    while (value < seen &&
           !__atomic_compare_exchange_n(address, &seen, value, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
    }
#endif
}

/* A load that sees stores of other threads of the same kernel (no stale cached copy). */
EM_HOST_DEVICE uint64_t em_gpu_load_u64(const uint64_t *address)
{
#ifdef __CUDA_ARCH__
    return *(const volatile uint64_t *)address;
#else
    return __atomic_load_n(address, __ATOMIC_ACQUIRE);
#endif
}

EM_HOST_DEVICE uint32_t em_gpu_load_u32(const uint32_t *address)
{
#ifdef __CUDA_ARCH__
    return *(const volatile uint32_t *)address;
#else
    return __atomic_load_n(address, __ATOMIC_ACQUIRE);
#endif
}

/* A store that other threads of the same kernel will see. */
EM_HOST_DEVICE void em_gpu_store_u64(uint64_t *address, uint64_t value)
{
#ifdef __CUDA_ARCH__
    atomicExch((unsigned long long *)address, (unsigned long long)value);
#else
    __atomic_store_n(address, value, __ATOMIC_RELEASE);
#endif
}

/* ---- launch geometry ------------------------------------------------------------------ */

/* log2 of the threads that share one row of width elements: the smallest power of two
 * covering the row, at most 256 (one block). */
EM_HOST_DEVICE uint32_t em_gpu_group_shift(uint32_t width)
{
    uint32_t shift = 0;
    while (shift < 8 && (UINT32_C(1) << shift) < width)
        shift++;
    return shift;
}

/* Slots of the unique-keys scratch table for n keys: a power of two >= 2n (at least
 * 16), at most 2^32 so a slot index fits 32 bits (n < 2^32 keeps a slot free). */
EM_HOST_DEVICE uint64_t em_gpu_unique_slot_count(uint64_t n)
{
    uint64_t slots = 16;
    while (slots < 2 * n && slots < (UINT64_C(1) << 32))
        slots <<= 1;
    return slots;
}

/* Bits that hold every value below count (0 for count <= 1): the radix sort's end_bit. */
EM_HOST_DEVICE uint32_t em_gpu_bits_for(uint64_t count)
{
    uint32_t bits = 0;
    while (bits < 64 && count > 1 && ((count - 1) >> bits) != 0)
        bits++;
    return bits;
}

/* ---- unique keys ------------------------------------------------------------------------ */

/* Finds or claims the scratch slot of keys[i]: a slot holds 1 + a position of its key,
 * lowered with atomic min to the key's first position. Distinct keys never share a
 * slot (linear probing compares the keys at the held positions). */
EM_HOST_DEVICE void em_gpu_unique_claim_item(const uint64_t *keys, uint64_t i, uint32_t *table,
                                             uint64_t slot_count, uint32_t *slot_of)
{
    uint64_t key = keys[i];
    uint64_t mask = slot_count - 1;
    uint64_t slot = em_hashmap_hash(key) & mask;
    uint32_t mine = (uint32_t)(i + 1);
    for (;;) {
        uint32_t held = em_gpu_load_u32(&table[slot]);
        if (held == 0) {
            held = em_gpu_atomic_cas_u32(&table[slot], 0, mine);
            if (held == 0) {
                slot_of[i] = (uint32_t)slot;
                return;
            }
        }
        if (keys[held - 1] == key) {
            em_gpu_atomic_min_u32(&table[slot], mine);
            slot_of[i] = (uint32_t)slot;
            return;
        }
        slot = (slot + 1) & mask;
    }
}

/* 1 where position i is its key's first, else 0 (i in 0..n; 0 at n, so that the
 * exclusive scan of these n + 1 flags ends with the unique count). The dedupe's scan
 * computes the flags as it reads them (kernels/home_ops.cu: em_gpu_unique_rank). */
EM_HOST_DEVICE uint32_t em_gpu_unique_first(const uint32_t *table, const uint32_t *slot_of,
                                             uint64_t n, uint64_t i)
{
    return (uint32_t)(i < n && (uint64_t)table[slot_of[i]] - 1 == i);
}

/* rank: the exclusive scan of em_gpu_unique_first over 0..n. */
EM_HOST_DEVICE void em_gpu_unique_scatter_item(const uint64_t *keys, uint64_t i,
                                               const uint32_t *table, const uint32_t *slot_of,
                                               const uint32_t *rank, uint64_t *unique,
                                               uint32_t *inverse, uint32_t *first_positions)
{
    uint32_t at = table[slot_of[i]] - 1; /* the key's first position */
    if (at == i) {
        unique[rank[i]] = keys[i];
        first_positions[rank[i]] = (uint32_t)i;
    }
    inverse[i] = rank[at];
}

/* ---- partition and segments ------------------------------------------------------------- */

EM_HOST_DEVICE void em_gpu_partition_owner_item(const uint64_t *unique, uint64_t u,
                                                uint32_t shard_count, uint32_t *owner,
                                                uint32_t *index)
{
    owner[u] = em_key_shard(unique[u], shard_count);
    index[u] = (uint32_t)u;
}

/* em_gpu_partition_owner_item over an upper bound: the entries at and past *count (the
 * dedupe's count, on the device) get owner shard_count, which sorts them after every
 * shard. */
EM_HOST_DEVICE void em_gpu_partition_owner_counted_item(const uint64_t *unique,
                                                        const uint32_t *count, uint64_t u,
                                                        uint32_t shard_count, uint32_t *owner,
                                                        uint32_t *index)
{
    owner[u] = u < *count ? em_key_shard(unique[u], shard_count) : shard_count;
    index[u] = (uint32_t)u;
}

EM_HOST_DEVICE void em_gpu_partition_scatter_item(const uint64_t *unique,
                                                  const uint32_t *sorted_index,
                                                  const uint32_t *first_positions, uint64_t i,
                                                  uint64_t *partitioned, uint32_t *position,
                                                  uint32_t *targets)
{
    uint32_t u = sorted_index[i];
    partitioned[i] = unique[u];
    position[u] = (uint32_t)i;
    if (targets != NULL)
        targets[i] = first_positions[u];
}

/* The device of spread whose shards hold partitioned entry i (below starts[shard count]). */
EM_HOST_DEVICE uint32_t em_gpu_spread_device(const em_gpu_spread *spread, const uint32_t *starts,
                                             uint64_t i)
{
    uint32_t d = 0;
    while (d + 1 < spread->count && i >= starts[spread->first_shard[d + 1]])
        d++;
    return d;
}

/* Item t of em_gpu_spread_keys (t below the larger of n and spread->count): partitioned
 * entry t into its device's bucket, unique key t's position moved to its bucket, and
 * device t's count. */
EM_HOST_DEVICE void em_gpu_spread_item(const em_gpu_spread *spread, const uint64_t *partitioned,
                                       uint64_t n, const uint32_t *starts, uint32_t shard_count,
                                       uint64_t t, uint64_t *buckets, uint32_t *bucket_counts,
                                       uint32_t *position)
{
    uint32_t end = starts[shard_count]; /* the counted keys end there */
    if (t < end) {
        uint32_t d = em_gpu_spread_device(spread, starts, t);
        buckets[d * n + t - starts[spread->first_shard[d]]] = partitioned[t];
    }
    if (t < n && position[t] < end) {
        uint32_t p = position[t], d = em_gpu_spread_device(spread, starts, p);
        position[t] = (uint32_t)(d * n + p - starts[spread->first_shard[d]]);
    }
    if (t < spread->count)
        bucket_counts[t] =
            starts[spread->first_shard[t + 1]] - starts[spread->first_shard[t]];
}

/* Item i in 0..n of em_gpu_segment_starts: the segments that begin at i are those above
 * the previous key up to the current one (the end counts as key `segments`). */
EM_HOST_DEVICE void em_gpu_segment_start_item(const uint32_t *sorted_keys, uint64_t n,
                                              uint32_t segments, uint64_t i, uint32_t *starts)
{
    uint64_t first = i == 0 ? 0 : (uint64_t)sorted_keys[i - 1] + 1;
    uint64_t last = i == n ? segments : sorted_keys[i];
    for (uint64_t s = first; s <= last && s <= segments; s++)
        starts[s] = (uint32_t)i;
}

/* The row holding key position k: the largest r < rows with offsets[r] <= k. */
EM_HOST_DEVICE uint32_t em_gpu_row_of_key(const uint32_t *offsets, uint32_t rows, uint64_t k)
{
    uint32_t low = 0, high = rows;
    while (high - low > 1) {
        uint32_t middle = low + (high - low) / 2;
        if (offsets[middle] <= k)
            low = middle;
        else
            high = middle;
    }
    return low;
}

/* ---- gradient sums and pooling ------------------------------------------------------- */

/* Gradient sums follow common/gradient_sum.h's tree. A key with at most EM_SUM_CHUNK
 * occurrences is summed whole by em_gpu_sum_run_element. A hot key (more) is summed
 * in two steps: em_gpu_sum_chunk_element writes each of its first-level chunk sums into
 * a slot of a partials buffer (one thread per chunk and element), then
 * em_gpu_sum_hot_element adds the chunk sums by the remaining levels. A hot key whose
 * positions start at s in the sorted order owns em_sum_chunks(count) consecutive slots
 * from s / EM_GPU_SUM_SLOT_SPACING: as count > 32 gives em_sum_chunks(count) <= count /
 * 16, they end below (s + count) / 16, where the next key's slots begin, so no two hot
 * keys share a slot and every slot is below em_gpu_sum_slots(nnz). */
/* Element j of key position k's contribution to its key's summed gradient. */
EM_HOST_DEVICE float em_gpu_gradient_contribution(const em_gpu_batch *batch,
                                                  const uint32_t *key_row, const float *gradients,
                                                  uint32_t k, uint32_t j)
{
    uint64_t dim = batch->dim;
    if (batch->combiner == EM_COMBINER_NONE)
        return gradients[k * dim + j];
    uint32_t row = key_row[k];
    float divisor =
        em_combiner_divisor(batch->combiner, batch->offsets[row + 1] - batch->offsets[row]);
    float gradient = gradients[row * dim + j];
    return divisor == 1.0f ? gradient : gradient / divisor;
}

/* Element j of the contributions of sorted positions [begin, end), serially from -0.0. */
EM_HOST_DEVICE float em_gpu_sum_positions(const em_gpu_batch *batch,
                                          const uint32_t *sorted_positions,
                                          const uint32_t *key_row, const float *gradients,
                                          uint32_t begin, uint32_t end, uint32_t j)
{
    float sum = -0.0f;
    for (uint32_t s = begin; s < end; s++)
        sum += em_gpu_gradient_contribution(batch, key_row, gradients, sorted_positions[s], j);
    return sum;
}

/* Where unique key u's vector goes: batch->position[u], or u when position is NULL (one
 * shard: the unique order is the shard's). */
EM_HOST_DEVICE uint64_t em_gpu_position(const em_gpu_batch *batch, uint64_t u)
{
    return batch->position != NULL ? (uint64_t)batch->position[u] : u;
}

/* The rows a gated kernel steps (em_gpu_gate): n, or the first *count of them, none when
 * a missing word of the gate is not 0 or a problem word was set. */
EM_HOST_DEVICE uint64_t em_gpu_gate_end(em_gpu_gate gate, uint64_t n)
{
    uint32_t parts = gate.parts > 1 ? gate.parts : 1;
    for (uint32_t p = 0; p < parts; p++)
        if ((gate.missing != NULL && gate.missing[2 * p] != 0) ||
            (gate.problem != NULL && gate.problem[2 * p] != UINT64_MAX))
            return 0;
    return gate.count != NULL && *gate.count < n ? *gate.count : n;
}

/* The sums read a push's key positions sorted by unique index: sorted_inverse ascending,
 * sorted_positions the positions in that order (increasing within a key), so each
 * unique key's positions are one run of equal values. A run's first position knows
 * itself (its value differs from the one before), and a run is found from any of its
 * positions by two binary searches: no array of run starts is needed, nor a launch to
 * write one. */

/* Whether sorted position p begins a run. */
EM_HOST_DEVICE int em_gpu_run_begins(const uint32_t *sorted_inverse, uint64_t p)
{
    return p == 0 || sorted_inverse[p - 1] != sorted_inverse[p];
}

/* Whether the run that begins at p is hot: more than EM_SUM_CHUNK positions. */
EM_HOST_DEVICE int em_gpu_run_hot(const uint32_t *sorted_inverse, uint64_t nnz, uint64_t p)
{
    return p + EM_SUM_CHUNK < nnz && sorted_inverse[p + EM_SUM_CHUNK] == sorted_inverse[p];
}

/* One past the last position of the run holding sorted position p. */
EM_HOST_DEVICE uint64_t em_gpu_run_end(const uint32_t *sorted_inverse, uint64_t nnz, uint64_t p)
{
    uint32_t value = sorted_inverse[p];
    uint64_t low = p + 1, high = nnz; /* the end is in [low, high] */
    while (low < high) {
        uint64_t middle = low + (high - low) / 2;
        if (sorted_inverse[middle] == value)
            low = middle + 1;
        else
            high = middle;
    }
    return low;
}

/* The run holding sorted position p: [*begin, *end). */
EM_HOST_DEVICE void em_gpu_run_bounds(const uint32_t *sorted_inverse, uint64_t nnz, uint64_t p,
                                      uint64_t *begin, uint64_t *end)
{
    uint32_t value = sorted_inverse[p];
    uint64_t low = 0, high = p; /* the run's first position is in [low, high] */
    while (low < high) {
        uint64_t middle = low + (high - low) / 2;
        if (sorted_inverse[middle] < value)
            low = middle + 1;
        else
            high = middle;
    }
    *begin = low;
    *end = em_gpu_run_end(sorted_inverse, nnz, p);
}

/* Element j of the summed gradient of the key whose run begins at sorted position p,
 * written at its partitioned position, when the run is not hot; nothing for any other
 * position (hot keys: the two functions below). */
EM_HOST_DEVICE void em_gpu_sum_run_element(const em_gpu_batch *batch,
                                           const uint32_t *sorted_inverse,
                                           const uint32_t *sorted_positions,
                                           const uint32_t *key_row, const float *gradients,
                                           float *out, uint64_t p, uint32_t j)
{
    uint64_t nnz = batch->nnz;
    if (!em_gpu_run_begins(sorted_inverse, p) || em_gpu_run_hot(sorted_inverse, nnz, p))
        return;
    uint32_t u = sorted_inverse[p];
    float sum = -0.0f; /* serially, in increasing position, as em_gpu_sum_positions */
    for (uint64_t s = p; s < nnz && sorted_inverse[s] == u; s++)
        sum += em_gpu_gradient_contribution(batch, key_row, gradients, sorted_positions[s], j);
    out[em_gpu_position(batch, u) * batch->dim + j] = sum;
}

/* Element j of the first-level chunk sum that partials slot `slot` holds, if a hot key
 * owns the slot; nothing otherwise. The only key that may own it is the one at sorted
 * position p = slot * EM_GPU_SUM_SLOT_SPACING + SPACING - 1 (or the last): every key
 * after it begins past p, so its first slot is past `slot`. A run longer than
 * EM_SUM_CHUNK holding p also holds p - 16 or p + 16, so the searches are made only
 * where one of them matches. */
EM_HOST_DEVICE void em_gpu_sum_chunk_element(const em_gpu_batch *batch,
                                             const uint32_t *sorted_inverse,
                                             const uint32_t *sorted_positions,
                                             const uint32_t *key_row, const float *gradients,
                                             float *partials, uint64_t slot, uint32_t j)
{
    uint64_t nnz = batch->nnz;
    uint64_t p = (slot + 1) * EM_GPU_SUM_SLOT_SPACING - 1;
    if (p >= nnz)
        p = nnz - 1;
    uint32_t u = sorted_inverse[p];
    uint64_t reach = EM_SUM_CHUNK / 2;
    if (!(p >= reach && sorted_inverse[p - reach] == u) &&
        !(p + reach < nnz && sorted_inverse[p + reach] == u))
        return;
    uint64_t begin = 0, end = 0;
    em_gpu_run_bounds(sorted_inverse, nnz, p, &begin, &end);
    uint32_t count = (uint32_t)(end - begin);
    uint64_t first = begin / EM_GPU_SUM_SLOT_SPACING;
    if (count <= EM_SUM_CHUNK || slot < first || slot - first >= em_sum_chunks(count))
        return;
    uint64_t chunk_begin = begin + (slot - first) * EM_SUM_CHUNK;
    uint64_t chunk_end = chunk_begin + EM_SUM_CHUNK < end ? chunk_begin + EM_SUM_CHUNK : end;
    partials[slot * batch->dim + j] =
        em_gpu_sum_positions(batch, sorted_positions, key_row, gradients, (uint32_t)chunk_begin,
                             (uint32_t)chunk_end, j);
}

/* Element j of the summed gradient of the hot key whose run begins at sorted position p,
 * from its chunk sums (the rest of the tree), written at its partitioned position;
 * nothing for any other position. */
EM_HOST_DEVICE void em_gpu_sum_hot_element(const em_gpu_batch *batch,
                                           const uint32_t *sorted_inverse, float *partials,
                                           float *out, uint64_t p, uint32_t j)
{
    uint64_t nnz = batch->nnz;
    if (!em_gpu_run_begins(sorted_inverse, p) || !em_gpu_run_hot(sorted_inverse, nnz, p))
        return;
    uint64_t end = em_gpu_run_end(sorted_inverse, nnz, p); /* the run begins at p */
    out[em_gpu_position(batch, sorted_inverse[p]) * batch->dim + j] =
        em_sum_chunk_levels(partials, p / EM_GPU_SUM_SLOT_SPACING,
                            em_sum_chunks((uint32_t)(end - p)), batch->dim, j);
}

/* NONE: element j of key k's vector. */
EM_HOST_DEVICE void em_gpu_combine_copy_element(const em_gpu_batch *batch, const float *vectors,
                                                float *out, uint64_t k, uint32_t j)
{
    uint64_t dim = batch->dim;
    out[k * dim + j] = vectors[em_gpu_position(batch, batch->inverse[k]) * dim + j];
}

/* Pooled: element j of row r. */
EM_HOST_DEVICE void em_gpu_combine_pool_element(const em_gpu_batch *batch, const float *vectors,
                                                float *out, uint64_t r, uint32_t j)
{
    uint64_t dim = batch->dim;
    uint32_t begin = batch->offsets[r], end = batch->offsets[r + 1];
    float sum = 0.0f;
    for (uint32_t k = begin; k < end; k++)
        sum += vectors[em_gpu_position(batch, batch->inverse[k]) * dim + j];
    float divisor = em_combiner_divisor(batch->combiner, end - begin);
    if (divisor != 1.0f)
        sum /= divisor;
    out[r * dim + j] = sum;
}

/* Element j of key position k of a per-key output whose distinct keys were gathered at
 * their first positions: later occurrences copy their first one. First occurrences are
 * never written here, so reads and writes never overlap. */
EM_HOST_DEVICE void em_gpu_copy_repeats_element(const uint32_t *inverse,
                                                const uint32_t *first_positions, uint32_t dim,
                                                float *out, uint64_t k, uint32_t j)
{
    uint64_t origin = first_positions[inverse[k]];
    if (origin != k)
        out[k * dim + j] = out[origin * dim + j];
}

/* ---- hash map ------------------------------------------------------------------------- */

/* A key's probe sequence: double hashing over buckets of EM_GPU_BUCKET_SLOTS slots (one
 * 128-byte line), each bucket's slots in order. The home bucket comes from the high bits
 * of the key's hash, the step between buckets from its low bits (odd, so that with a
 * power-of-two bucket count, which maps have, the sequence visits every bucket once).
 * Unlike slot-by-slot linear probing, keys whose homes are near do not share the rest of
 * their sequences, so runs of full buckets stay short: at load 0.9 a search for an
 * absent key reads about 2.9 lines instead of 7 (tests/bench/bench_gpu_map.c). A slot
 * goes only from EMPTY to a key (and to TOMBSTONE when erased), and inserts take the
 * first EMPTY slot of the sequence, so a key is found before the first EMPTY slot of its
 * own sequence. Maps of other sizes (tests) probe slot by slot, linearly. */
typedef struct em_gpu_probe {
    uint64_t bucket, step, bucket_count;
    uint32_t bucket_slots, offset;
} em_gpu_probe;

/* The first slot of key's sequence. */
EM_HOST_DEVICE uint64_t em_gpu_probe_start(em_gpu_probe *probe, uint64_t key, uint64_t seed,
                                           uint64_t slot_count)
{
    uint64_t hash = em_mix64(key ^ seed);
    probe->bucket_slots = slot_count % EM_GPU_BUCKET_SLOTS == 0 ? EM_GPU_BUCKET_SLOTS : 1;
    probe->bucket_count = slot_count / probe->bucket_slots;
    probe->bucket = em_hash_scale(hash, probe->bucket_count);
    int power_of_two = (probe->bucket_count & (probe->bucket_count - 1)) == 0;
    probe->step = power_of_two ? (hash & (probe->bucket_count - 1)) | 1u : 1u;
    probe->offset = 0;
    return probe->bucket * probe->bucket_slots;
}

/* The first slot of the sequence's next bucket. */
EM_HOST_DEVICE uint64_t em_gpu_probe_next_bucket(em_gpu_probe *probe)
{
    probe->offset = 0;
    probe->bucket += probe->step;
    if (probe->bucket >= probe->bucket_count)
        probe->bucket -= probe->bucket_count;
    return probe->bucket * probe->bucket_slots;
}

/* The next slot of the sequence (after slot_count of them it starts again). */
EM_HOST_DEVICE uint64_t em_gpu_probe_next(em_gpu_probe *probe)
{
    if (++probe->offset == probe->bucket_slots)
        return em_gpu_probe_next_bucket(probe);
    return probe->bucket * probe->bucket_slots + probe->offset;
}

/* Where a search stops in a bucket whose slots hold the key (bit t of hits for slot t)
 * or are EMPTY (bit t of empties): at the first of either, as a search of its slots in
 * order does; -1 when it goes on to the next bucket. */
EM_HOST_DEVICE int em_gpu_bucket_stop(uint32_t hits, uint32_t empties)
{
    uint32_t stops = hits | empties;
    if (stops == 0)
        return -1;
#ifdef __CUDA_ARCH__
    return __ffs(stops) - 1;
#else
    return __builtin_ctz(stops);
#endif
}

/* Slot i of the map, in its one array or in its segment (em_gpu_map). Buckets never
 * straddle two segments: a segment holds a power of two of slots, at least a bucket. */
EM_HOST_DEVICE em_gpu_slot *em_gpu_map_slot(em_gpu_map map, uint64_t i)
{
    if (map.segments == NULL)
        return map.slots + i;
    return map.segments[i >> map.segment_shift] + (i & (((uint64_t)1 << map.segment_shift) - 1));
}

/* 0 or 1 for the two keys kept in side rows, -1 for every other key. */
EM_HOST_DEVICE int em_gpu_side_index(uint64_t key)
{
    if (key == EM_GPU_EMPTY_KEY)
        return 0;
    if (key == EM_GPU_TOMBSTONE_KEY)
        return 1;
    return -1;
}

EM_HOST_DEVICE int em_gpu_slot_occupied(uint64_t key)
{
    return key != EM_GPU_EMPTY_KEY && key != EM_GPU_TOMBSTONE_KEY;
}

/* Row of key, or ROW_NONE. Lookups never run alongside inserts (tables order them:
 * inserts hold the table exclusively and complete before it is released), so plain
 * (cacheable) loads see published slots. */
EM_HOST_DEVICE uint64_t em_gpu_map_lookup(em_gpu_map map, uint64_t key)
{
    int side = em_gpu_side_index(key);
    if (side >= 0) {
        uint64_t row = map.header->side_rows[side];
        return row == EM_GPU_ROW_PENDING ? EM_GPU_ROW_NONE : row;
    }
    em_gpu_probe probe;
    uint64_t slot = em_gpu_probe_start(&probe, key, map.seed, map.slot_count);
    for (uint64_t seen = 0; seen < map.slot_count; seen++) {
        const em_gpu_slot *at = em_gpu_map_slot(map, slot);
        uint64_t held = at->key;
        if (held == key)
            return at->row;
        if (held == EM_GPU_EMPTY_KEY)
            return EM_GPU_ROW_NONE;
        slot = em_gpu_probe_next(&probe);
    }
    return EM_GPU_ROW_NONE;
}

/* Waits until another thread of the same kernel has published a row in place of
 * unpublished (only when one batch inserts a key twice; tables pass distinct keys). */
EM_HOST_DEVICE uint64_t em_gpu_wait_row(const uint64_t *address, uint64_t unpublished)
{
    for (;;) {
        uint64_t row = em_gpu_load_u64(address);
        if (row != unpublished)
            return row;
    }
}

/* A row for a new key: a released one from the top of the free list while there is
 * one (free_count does not change during an insert launch; the settle that follows
 * drops the ones taken), else the next never used. */
EM_HOST_DEVICE uint64_t em_gpu_take_row(em_gpu_map map)
{
    uint64_t free_count = map.header->free_count;
    if (free_count > 0) {
        uint64_t taken = em_gpu_atomic_add_u64(&map.header->free_taken, 1);
        if (taken < free_count)
            return map.free_rows[free_count - 1 - taken];
    }
    return em_gpu_atomic_add_u64(&map.header->rows, 1);
}

EM_HOST_DEVICE uint64_t em_gpu_claim_side(em_gpu_map map, int side, int *inserted)
{
    em_gpu_map_header *header = map.header;
    uint64_t held =
        em_gpu_atomic_cas_u64(&header->side_rows[side], EM_GPU_ROW_NONE, EM_GPU_ROW_PENDING);
    if (held != EM_GPU_ROW_NONE)
        return em_gpu_wait_row(&header->side_rows[side], EM_GPU_ROW_PENDING);
    uint64_t row = em_gpu_take_row(map);
    em_gpu_store_u64(&header->side_rows[side], row);
    *inserted = 1;
    return row;
}

/* Row of key, inserting it with the next row when absent (*inserted = 1 then). A slot
 * is claimed by compare-and-swap of its key from EMPTY; the claimer then takes a row
 * from the header's counter and publishes it. Returns ROW_NONE and sets the header's
 * overflow flag when every slot is taken (callers reserve room first). */
EM_HOST_DEVICE uint64_t em_gpu_map_insert_key(em_gpu_map map, uint64_t key, int *inserted)
{
    *inserted = 0;
    int side = em_gpu_side_index(key);
    if (side >= 0)
        return em_gpu_claim_side(map, side, inserted);
    em_gpu_probe probe;
    uint64_t slot = em_gpu_probe_start(&probe, key, map.seed, map.slot_count);
    for (uint64_t seen = 0; seen < map.slot_count; seen++) {
        em_gpu_slot *at = em_gpu_map_slot(map, slot);
        uint64_t held = em_gpu_load_u64(&at->key);
        if (held == EM_GPU_EMPTY_KEY) {
            held = em_gpu_atomic_cas_u64(&at->key, EM_GPU_EMPTY_KEY, key);
            if (held == EM_GPU_EMPTY_KEY) {
                uint64_t row = em_gpu_take_row(map);
                em_gpu_store_u64(&at->row, row);
                *inserted = 1;
                return row;
            }
        }
        if (held == key)
            return em_gpu_wait_row(&at->row, EM_GPU_ROW_NONE);
        slot = em_gpu_probe_next(&probe);
    }
    em_gpu_store_u64(&map.header->overflow, 1);
    return EM_GPU_ROW_NONE;
}

/* Whether em_gpu_map_lookup_buckets searches key a bucket at a time: a key kept in a
 * slot (not in a side row) of a map in buckets. Else it searches as em_gpu_map_lookup. */
EM_HOST_DEVICE int em_gpu_map_by_buckets(em_gpu_map map, uint64_t key)
{
    return em_gpu_side_index(key) < 0 && map.slot_count % EM_GPU_BUCKET_SLOTS == 0;
}

/* em_gpu_map_lookup a bucket at a time: each step reads all of a bucket's slots (one
 * line), then stops where a search of them in order would (em_gpu_bucket_stop). On the
 * GPU a group of EM_GPU_BUCKET_SLOTS threads reads a bucket in one step, a slot each
 * (kernels/shard_ops.cu: lookup_grouped); this is the same search done by one thread,
 * which the emulated kernels run. */
EM_HOST_DEVICE uint64_t em_gpu_map_lookup_buckets(em_gpu_map map, uint64_t key)
{
    if (!em_gpu_map_by_buckets(map, key))
        return em_gpu_map_lookup(map, key);
    em_gpu_probe probe;
    uint64_t first = em_gpu_probe_start(&probe, key, map.seed, map.slot_count);
    for (uint64_t b = 0; b < probe.bucket_count; b++) {
        const em_gpu_slot *bucket = em_gpu_map_slot(map, first);
        uint32_t hits = 0, empties = 0;
        for (uint32_t t = 0; t < EM_GPU_BUCKET_SLOTS; t++) {
            uint64_t held = bucket[t].key;
            hits |= (uint32_t)(held == key) << t;
            empties |= (uint32_t)(held == EM_GPU_EMPTY_KEY) << t;
        }
        int stop = em_gpu_bucket_stop(hits, empties);
        if (stop >= 0)
            return (hits >> stop & 1u) != 0 ? bucket[stop].row : EM_GPU_ROW_NONE;
        first = em_gpu_probe_next_bucket(&probe);
    }
    return EM_GPU_ROW_NONE;
}

EM_HOST_DEVICE int em_gpu_map_find_item(em_gpu_map map, const uint64_t *keys, uint64_t i,
                                        uint64_t *rows)
{
    rows[i] = em_gpu_map_lookup_buckets(map, keys[i]);
    return rows[i] == EM_GPU_ROW_NONE;
}

/* Row of shard s's map as a device's shards of one table number their rows (ROW_NONE
 * stays ROW_NONE). */
EM_HOST_DEVICE uint64_t em_gpu_shards_row(em_gpu_shards shards, uint32_t s, uint64_t row)
{
    return row == EM_GPU_ROW_NONE ? row : shards.row_base[s] + row;
}

/* em_gpu_map_find_item of keys[i] in its shard's map, the row as that shard numbers it;
 * *shard gets the shard. */
EM_HOST_DEVICE int em_gpu_shards_find_local_item(em_gpu_shards shards, const uint64_t *keys,
                                                 uint64_t i, uint64_t *rows, uint32_t *shard)
{
    *shard = em_key_shard(keys[i], shards.count);
    return em_gpu_map_find_item(shards.maps[*shard], keys, i, rows);
}

/* em_gpu_map_find_item over a device's shards of one table (em_gpu_shards). */
EM_HOST_DEVICE int em_gpu_shards_find_item(em_gpu_shards shards, const uint64_t *keys, uint64_t i,
                                           uint64_t *rows)
{
    uint32_t s = em_key_shard(keys[i], shards.count);
    rows[i] = em_gpu_shards_row(shards, s, em_gpu_map_lookup_buckets(shards.maps[s], keys[i]));
    return rows[i] == EM_GPU_ROW_NONE;
}

EM_HOST_DEVICE void em_gpu_map_insert_item(em_gpu_map map, const uint64_t *keys, uint64_t i,
                                           uint64_t *rows, uint8_t *inserted)
{
    int fresh = 0;
    if (rows[i] == EM_GPU_ROW_NONE)
        rows[i] = em_gpu_map_insert_key(map, keys[i], &fresh);
    inserted[i] = (uint8_t)fresh;
}

/* em_gpu_map_insert_item over a device's shards of one table (em_gpu_shards). */
EM_HOST_DEVICE void em_gpu_shards_insert_item(em_gpu_shards shards, const uint64_t *keys,
                                              uint64_t i, uint64_t *rows, uint8_t *inserted)
{
    inserted[i] = 0;
    if (rows[i] != EM_GPU_ROW_NONE)
        return;
    uint32_t s = em_key_shard(keys[i], shards.count);
    uint64_t end = s + 1 < shards.count ? shards.row_base[s + 1] : shards.row_limit;
    int fresh = 0;
    uint64_t row = em_gpu_map_insert_key(shards.maps[s], keys[i], &fresh);
    if (row == EM_GPU_ROW_NONE)
        return;
    if (row >= end - shards.row_base[s]) { /* no storage for it: the host reports it */
        em_gpu_store_u64(&shards.maps[s].header->overflow, 1);
        return;
    }
    rows[i] = shards.row_base[s] + row;
    inserted[i] = (uint8_t)fresh;
}

/* Puts a released row on the free list (erases run alone: no insert takes rows). */
EM_HOST_DEVICE void em_gpu_release_row(em_gpu_map map, uint64_t row)
{
    uint64_t at = em_gpu_atomic_add_u64(&map.header->free_count, 1);
    map.free_rows[at] = row;
}

/* Removes key (its slot becomes a tombstone, its row goes on the free list); returns
 * its row, or ROW_NONE when it was absent. Erases run with nothing else on the map. */
EM_HOST_DEVICE uint64_t em_gpu_map_erase_key(em_gpu_map map, uint64_t key)
{
    int side = em_gpu_side_index(key);
    if (side >= 0) {
        uint64_t row = map.header->side_rows[side];
        if (row == EM_GPU_ROW_NONE)
            return row;
        map.header->side_rows[side] = EM_GPU_ROW_NONE;
        em_gpu_release_row(map, row);
        return row;
    }
    em_gpu_probe probe;
    uint64_t slot = em_gpu_probe_start(&probe, key, map.seed, map.slot_count);
    for (uint64_t seen = 0; seen < map.slot_count; seen++) {
        em_gpu_slot *at = em_gpu_map_slot(map, slot);
        uint64_t held = at->key;
        if (held == key) {
            uint64_t row = at->row;
            at->key = EM_GPU_TOMBSTONE_KEY;
            em_gpu_atomic_add_u64(&map.header->tombstones, 1);
            em_gpu_release_row(map, row);
            return row;
        }
        if (held == EM_GPU_EMPTY_KEY)
            return EM_GPU_ROW_NONE;
        slot = em_gpu_probe_next(&probe);
    }
    return EM_GPU_ROW_NONE;
}

EM_HOST_DEVICE void em_gpu_map_erase_item(em_gpu_map map, const uint64_t *keys,
                                          const uint64_t *rows, uint64_t i)
{
    if (rows == NULL || rows[i] < EM_GPU_ROW_PENDING)
        em_gpu_map_erase_key(map, keys[i]);
}

EM_HOST_DEVICE void em_gpu_map_settle_item(em_gpu_map map)
{
    uint64_t taken = map.header->free_taken;
    uint64_t free_count = map.header->free_count;
    map.header->free_count = taken < free_count ? free_count - taken : 0;
    map.header->free_taken = 0;
}

/* Rehash: puts old slot i's key (with its row) into the new, empty map. */
EM_HOST_DEVICE void em_gpu_map_rehash_item(const em_gpu_slot *old_slots, uint64_t i,
                                           em_gpu_map map)
{
    uint64_t key = old_slots[i].key;
    if (!em_gpu_slot_occupied(key))
        return;
    em_gpu_probe probe;
    uint64_t slot = em_gpu_probe_start(&probe, key, map.seed, map.slot_count);
    for (uint64_t seen = 0; seen < map.slot_count; seen++) {
        em_gpu_slot *at = em_gpu_map_slot(map, slot);
        if (em_gpu_atomic_cas_u64(&at->key, EM_GPU_EMPTY_KEY, key) == EM_GPU_EMPTY_KEY) {
            at->row = old_slots[i].row;
            return;
        }
        slot = em_gpu_probe_next(&probe);
    }
    em_gpu_store_u64(&map.header->overflow, 1);
}

EM_HOST_DEVICE void em_gpu_map_export_flag_item(em_gpu_map map, uint64_t begin, uint64_t count,
                                                uint64_t i, uint32_t *flags)
{
    flags[i] =
        (uint32_t)(i < count && em_gpu_slot_occupied(em_gpu_map_slot(map, begin + i)->key));
}

EM_HOST_DEVICE void em_gpu_map_export_compact_item(em_gpu_map map, uint64_t begin, uint64_t i,
                                                   const uint32_t *flags, const uint32_t *rank,
                                                   uint64_t take, uint64_t offset,
                                                   uint64_t *keys, uint64_t *rows,
                                                   uint64_t *next_slot)
{
    if (!flags[i] || rank[i] >= take)
        return;
    const em_gpu_slot *at = em_gpu_map_slot(map, begin + i);
    keys[offset + rank[i]] = at->key;
    rows[offset + rank[i]] = at->row;
    if (rank[i] == take - 1)
        *next_slot = begin + i + 1;
}

/* ---- row storage ------------------------------------------------------------------------ */

EM_HOST_DEVICE float *em_gpu_row_address(em_gpu_storage storage, uint64_t row)
{
    return storage.blocks[row >> storage.block_shift] + (row & storage.block_mask) * storage.stride;
}

EM_HOST_DEVICE em_gpu_row_access *em_gpu_row_access_of(em_gpu_storage storage, uint64_t row)
{
    return storage.access[row >> storage.block_shift] + (row & storage.block_mask);
}

/* Element j (< dim + state floats) of a new row: the initializer's value for weights,
 * initial_accumulator for (rowwise) adagrad accumulators, 0 for adam's moments and
 * step. */
EM_HOST_DEVICE float em_gpu_initial_value(const em_initializer_config *initializer,
                                          const em_optimizer_config *optimizer, uint32_t dim,
                                          uint64_t key, uint32_t j)
{
    if (j < dim)
        return em_initializer_value(initializer, key, j);
    if (em_optimizer_has_accumulator(optimizer->kind))
        return optimizer->initial_accumulator;
    return 0.0f;
}

EM_HOST_DEVICE void em_gpu_rows_init_element(em_gpu_storage storage, const uint64_t *keys,
                                             const uint64_t *rows, const uint8_t *inserted,
                                             const em_initializer_config *initializer,
                                             const em_optimizer_config *optimizer, uint64_t i,
                                             uint32_t j)
{
    /* A row past the storage means insert ran without reserve: the host reports it
     * (from the map's row counter); nothing is written out of bounds meanwhile. */
    if (!inserted[i] || rows[i] >= storage.row_limit)
        return;
    em_gpu_row_address(storage, rows[i])[j] =
        em_gpu_initial_value(initializer, optimizer, storage.dim, keys[i], j);
    if (j == 0 && storage.access != NULL) {
        em_gpu_row_access *access = em_gpu_row_access_of(storage, rows[i]);
        access->accessed = 0;
        access->updated = 0;
        access->frequency = 0;
    }
}

/* Floats from, from + step, ... of row i when a push has just created it
 * (fresh->inserted[i]): their initial values, and the zeroed access metadata with float
 * 0, as em_gpu_rows_init_element; nothing for a row that was there. */
EM_HOST_DEVICE void em_gpu_fresh_row_floats(em_gpu_storage storage,
                                            const em_optimizer_config *optimizer,
                                            const uint64_t *rows, const em_gpu_fresh_rows *fresh,
                                            uint64_t i, uint32_t from, uint32_t step)
{
    if (fresh->inserted == NULL || !fresh->inserted[i])
        return;
    for (uint32_t f = from; f < storage.row_floats; f += step)
        em_gpu_rows_init_element(storage, fresh->keys, rows, fresh->inserted,
                                 &fresh->initializer, optimizer, i, f);
}

/* Whether row names a stored row (not ROW_NONE, nor a refused key's ROW_PENDING). */
EM_HOST_DEVICE int em_gpu_row_stored(uint64_t row)
{
    return row < EM_GPU_ROW_PENDING;
}

EM_HOST_DEVICE void em_gpu_rows_touch_item(em_gpu_storage storage, const uint64_t *rows,
                                           uint64_t i, uint64_t accessed, uint32_t updated,
                                           int pushed)
{
    if (!em_gpu_row_stored(rows[i]))
        return;
    em_gpu_row_access *access = em_gpu_row_access_of(storage, rows[i]);
    uint32_t frequency = access->frequency;
    access->accessed = accessed;
    if (frequency != UINT32_MAX)
        access->frequency = frequency + 1;
    if (pushed || frequency == 0) /* pushed, or created by this request */
        access->updated = updated;
}

EM_HOST_DEVICE void em_gpu_access_read_item(em_gpu_storage storage, const uint64_t *rows,
                                            uint64_t i, em_gpu_row_access *out)
{
    out[i] = *em_gpu_row_access_of(storage, rows[i]);
}

/* Slot begin + i of piece p flagged; the walk's start and the last piece's end flag by
 * thread 0 of their piece. */
EM_HOST_DEVICE void em_gpu_walks_flag_item(const em_gpu_walk_piece *pieces, uint32_t count,
                                           uint32_t p, uint64_t i, uint32_t *flags)
{
    const em_gpu_walk_piece *piece = &pieces[p];
    if (i < piece->count)
        flags[piece->first_flag + i] = (uint32_t)em_gpu_slot_occupied(
            em_gpu_map_slot(piece->map, piece->begin + i)->key);
    if (i < piece->kept_count)
        piece->kept_to[i] = piece->kept_from[i];
    if (i == 0 && p == count - 1)
        flags[piece->first_flag + piece->count] = 0;
    if (i == 0 && piece->starts) {
        piece->walk->taken = 0;
        piece->walk->before_wrap = 0;
        piece->walk->next_slot = UINT64_MAX;
        piece->walk->reserved = 0;
    }
}

EM_HOST_DEVICE void em_gpu_walks_compact_item(const em_gpu_walk_piece *piece, uint64_t i,
                                              const uint32_t *flags, const uint32_t *rank)
{
    uint64_t f = piece->first_flag + i;
    if (!flags[f])
        return;
    uint64_t at = piece->walk->taken + rank[f] - rank[piece->base_flag];
    if (at >= piece->want)
        return;
    const em_gpu_slot *slot = em_gpu_map_slot(piece->map, piece->begin + i);
    piece->keys[at] = slot->key;
    piece->rows[at] = slot->row;
    piece->access[at] = *em_gpu_row_access_of(piece->storage, slot->row);
    if (at == piece->want - 1)
        piece->walk->next_slot = piece->begin + i + 1;
}

/* One thread: every piece's occupied slots counted into its walk, in order. */
EM_HOST_DEVICE void em_gpu_walks_advance_all(const em_gpu_walk_piece *pieces, uint32_t count,
                                             const uint32_t *rank)
{
    for (uint32_t p = 0; p < count; p++) {
        const em_gpu_walk_piece *piece = &pieces[p];
        em_gpu_walk *walk = piece->walk;
        walk->taken += rank[piece->first_flag + piece->count] - rank[piece->first_flag];
        if (piece->wrap)
            walk->before_wrap = walk->taken;
    }
}

/* ---- eviction choices (em_gpu_choice) ------------------------------------------------ */

/* Window entry i's place in the policy's order (lib/device/eviction.c: candidate_of). */
EM_HOST_DEVICE em_gpu_rank em_gpu_choice_rank(const em_gpu_choice *c, uint64_t i)
{
    const em_gpu_row_access *access = &c->access[i];
    em_gpu_rank rank;
    rank.first = 0;
    if (c->policy == 2) /* lfu */
        rank.first = access->frequency;
    else if (c->policy == 3) /* age */
        rank.first = UINT32_MAX - (uint32_t)(c->update_clock - access->updated);
    rank.accessed = access->accessed;
    rank.key = c->keys[i];
    return rank;
}

/* Byte digit of rank (0: the top byte of first, 19: the low byte of key). */
EM_HOST_DEVICE uint32_t em_gpu_rank_digit(em_gpu_rank rank, uint32_t digit)
{
    if (digit < 4)
        return (rank.first >> (8 * (3 - digit))) & 0xffu;
    if (digit < 12)
        return (uint32_t)(rank.accessed >> (8 * (11 - digit))) & 0xffu;
    return (uint32_t)(rank.key >> (8 * (19 - digit))) & 0xffu;
}

/* rank's first `digits` bytes, the others 0. */
EM_HOST_DEVICE em_gpu_rank em_gpu_rank_top(em_gpu_rank rank, uint32_t digits)
{
    if (digits < 4) {
        rank.first = digits == 0 ? 0 : rank.first & ~(UINT32_MAX >> (8 * digits));
        rank.accessed = 0;
        rank.key = 0;
    } else if (digits < 12) {
        uint32_t bytes = digits - 4;
        rank.accessed = bytes == 0 ? 0 : rank.accessed & ~(UINT64_MAX >> (8 * bytes));
        rank.key = 0;
    } else if (digits < EM_GPU_RANK_DIGITS) {
        uint32_t bytes = digits - 12;
        rank.key = bytes == 0 ? 0 : rank.key & ~(UINT64_MAX >> (8 * bytes));
    }
    return rank;
}

/* rank with byte digit set to value (it was 0). */
EM_HOST_DEVICE em_gpu_rank em_gpu_rank_with_digit(em_gpu_rank rank, uint32_t digit,
                                                  uint32_t value)
{
    if (digit < 4)
        rank.first |= value << (8 * (3 - digit));
    else if (digit < 12)
        rank.accessed |= (uint64_t)value << (8 * (11 - digit));
    else
        rank.key |= (uint64_t)value << (8 * (19 - digit));
    return rank;
}

/* -1, 0 or 1 as a goes before, with or after b. */
EM_HOST_DEVICE int em_gpu_rank_compare(em_gpu_rank a, em_gpu_rank b)
{
    if (a.first != b.first)
        return a.first < b.first ? -1 : 1;
    if (a.accessed != b.accessed)
        return a.accessed < b.accessed ? -1 : 1;
    if (a.key != b.key)
        return a.key < b.key ? -1 : 1;
    return 0;
}

/* The window's entries: min(walk->taken, want). */
EM_HOST_DEVICE uint64_t em_gpu_choice_held(const em_gpu_choice *c)
{
    uint64_t taken = c->walk->taken;
    return taken < c->want ? taken : c->want;
}

/* Whether row is one of the request's (it must stay). */
EM_HOST_DEVICE int em_gpu_choice_kept(const em_gpu_choice *c, uint64_t row)
{
    return row < c->row_limit && ((c->kept_bits[row >> 6] >> (row & 63)) & 1u) != 0;
}

/* Kept row j of choice c into its bit set. */
EM_HOST_DEVICE void em_gpu_choice_mark_kept_item(em_gpu_choice *c, uint64_t j)
{
    uint64_t row = c->kept[j];
    if (row < c->row_limit)
        em_gpu_atomic_or_u64(&c->kept_bits[row >> 6], (uint64_t)1 << (row & 63));
}

/* The bin entry i (< held) of an open choice counts in at byte digit:
 * EM_GPU_CHOICE_BINS when it does not (a row of the request, or its bytes before digit
 * differ from the prefix). */
EM_HOST_DEVICE uint32_t em_gpu_choice_bin(const em_gpu_choice *c, uint64_t i, uint32_t digit)
{
    if (em_gpu_choice_kept(c, c->rows[i]))
        return EM_GPU_CHOICE_BINS;
    em_gpu_rank rank = em_gpu_choice_rank(c, i);
    if (em_gpu_rank_compare(em_gpu_rank_top(rank, digit), c->prefix) != 0)
        return EM_GPU_CHOICE_BINS;
    return em_gpu_rank_digit(rank, digit);
}

/* One thread a walk, once its count at byte digit is done (bins: that count, every
 * entry's): byte digit of the prefix becomes the bin holding the remaining-th entry. The
 * caller clears the walk's bins for the next digit. */
EM_HOST_DEVICE void em_gpu_choice_fix_item(em_gpu_choice *c, const uint32_t *bins,
                                           uint32_t digit)
{
    if (c->state != EM_GPU_CHOICE_OPEN)
        return;
    uint64_t total = 0;
    for (uint32_t b = 0; b < EM_GPU_CHOICE_BINS; b++)
        total += bins[b];
    if (digit == c->first_digit)
        c->taken = c->walk->taken;
    if (total < c->remaining) { /* fewer free entries than rows to choose */
        c->state = EM_GPU_CHOICE_SHORT;
    } else {
        uint64_t below = 0;
        uint32_t bin = 0;
        for (; bin + 1 < EM_GPU_CHOICE_BINS && below + bins[bin] < c->remaining; bin++)
            below += bins[bin];
        c->remaining -= below;
        c->prefix = em_gpu_rank_with_digit(c->prefix, digit, bin);
        c->digits = digit + 1;
        /* keys are distinct: at the last digit one entry is left in the bin */
        if (bins[bin] == c->remaining || digit + 1 == EM_GPU_RANK_DIGITS)
            c->state = EM_GPU_CHOICE_SETTLED;
    }
}

/* Whether window entry i (< want) was chosen. */
EM_HOST_DEVICE uint32_t em_gpu_choice_flag(const em_gpu_choice *c, uint64_t i)
{
    if (c->state != EM_GPU_CHOICE_SETTLED || i >= em_gpu_choice_held(c) ||
        em_gpu_choice_kept(c, c->rows[i]))
        return 0;
    em_gpu_rank top = em_gpu_rank_top(em_gpu_choice_rank(c, i), c->digits);
    return em_gpu_rank_compare(top, c->prefix) <= 0 ? 1u : 0u;
}

/* A chosen entry i's key and row to its place among the walk's chosen (rank, the scan
 * of the shared flags). */
EM_HOST_DEVICE void em_gpu_choice_write_item(em_gpu_choice *c, uint64_t i, const uint32_t *flags,
                                             const uint32_t *rank)
{
    uint64_t f = c->first_flag + i;
    if (!flags[f])
        return;
    uint64_t at = rank[f] - rank[c->first_flag];
    if (at < c->count) {
        c->out_keys[at] = c->keys[i];
        c->out_rows[at] = c->rows[i];
    }
}

EM_HOST_DEVICE void em_gpu_access_write_item(em_gpu_storage storage, const uint64_t *rows,
                                             uint64_t i, const em_gpu_row_access *in)
{
    *em_gpu_row_access_of(storage, rows[i]) = in[i];
}

/* Where gathered vector i goes: targets[i] when the gather scatters into a per-key
 * output, else i. */
EM_HOST_DEVICE uint64_t em_gpu_gather_target(const uint32_t *targets, uint64_t i)
{
    return targets != NULL ? (uint64_t)targets[i] : i;
}

EM_HOST_DEVICE void em_gpu_rows_gather_element(em_gpu_storage storage, const uint64_t *rows,
                                               const uint32_t *targets, float *vectors,
                                               uint64_t i, uint32_t j)
{
    uint64_t row = rows[i];
    vectors[em_gpu_gather_target(targets, i) * storage.dim + j] =
        row >= EM_GPU_ROW_PENDING ? 0.0f : em_gpu_row_address(storage, row)[j];
}

/* A pull straight from the rows (one shard: unique order is the shard's order), element
 * j of output vector k: with NONE, key position k's row (zeros when not stored); pooled,
 * row k's keys summed in key order from 0.0 and divided by the combiner's divisor, the
 * arithmetic of em_gpu_combine_pool_element over the gathered vectors. rows has one
 * entry per unique key (batch->inverse maps positions to them). */
EM_HOST_DEVICE float em_gpu_stored_value(em_gpu_storage storage, uint64_t row, uint32_t j)
{
    return row >= EM_GPU_ROW_PENDING ? 0.0f : em_gpu_row_address(storage, row)[j];
}

EM_HOST_DEVICE void em_gpu_rows_pull_element(em_gpu_storage storage, const em_gpu_batch *batch,
                                             const uint64_t *rows, float *out, uint64_t k,
                                             uint32_t j)
{
    uint64_t dim = batch->dim;
    if (batch->combiner == EM_COMBINER_NONE) {
        out[k * dim + j] = em_gpu_stored_value(storage, rows[batch->inverse[k]], j);
        return;
    }
    uint32_t begin = batch->offsets[k], end = batch->offsets[k + 1];
    float sum = 0.0f;
    for (uint32_t p = begin; p < end; p++)
        sum += em_gpu_stored_value(storage, rows[batch->inverse[p]], j);
    float divisor = em_combiner_divisor(batch->combiner, end - begin);
    if (divisor != 1.0f)
        sum /= divisor;
    out[k * dim + j] = sum;
}

EM_HOST_DEVICE void em_gpu_rows_fill_initial_element(em_gpu_storage storage,
                                                     const em_initializer_config *initializer,
                                                     const uint64_t *keys, const uint64_t *rows,
                                                     const uint32_t *targets, float *vectors,
                                                     uint64_t i, uint32_t j)
{
    if (rows[i] == EM_GPU_ROW_PENDING)
        vectors[em_gpu_gather_target(targets, i) * storage.dim + j] =
            em_initializer_value(initializer, keys[i], j);
}

/* Four floats at 16-byte aligned addresses, as one vector access on the GPU. */
EM_HOST_DEVICE void em_gpu_copy4(float *destination, const float *source)
{
#ifdef __CUDA_ARCH__
    *(float4 *)destination = *(const float4 *)source;
#else
    for (int e = 0; e < 4; e++)
        destination[e] = source[e];
#endif
}

EM_HOST_DEVICE void em_gpu_zero4(float *destination)
{
#ifdef __CUDA_ARCH__
    *(float4 *)destination = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#else
    for (int e = 0; e < 4; e++)
        destination[e] = 0.0f;
#endif
}

/* Gather with dim % 4 == 0: quad q (floats 4q .. 4q + 3) of vector i. */
EM_HOST_DEVICE void em_gpu_rows_gather_quad(em_gpu_storage storage, const uint64_t *rows,
                                            const uint32_t *targets, float *vectors, uint64_t i,
                                            uint32_t q)
{
    uint64_t row = rows[i];
    float *destination = vectors + em_gpu_gather_target(targets, i) * storage.dim + 4 * (uint64_t)q;
    if (row >= EM_GPU_ROW_PENDING)
        em_gpu_zero4(destination);
    else
        em_gpu_copy4(destination, em_gpu_row_address(storage, row) + 4 * (uint64_t)q);
}

EM_HOST_DEVICE void em_gpu_rows_read_element(em_gpu_storage storage, const uint64_t *rows,
                                             float *values, uint64_t i, uint32_t j)
{
    values[i * storage.row_floats + j] = em_gpu_row_address(storage, rows[i])[j];
}

EM_HOST_DEVICE void em_gpu_rows_write_element(em_gpu_storage storage, const uint64_t *rows,
                                              const uint32_t *sources, const float *values,
                                              uint64_t i, uint32_t j)
{
    uint64_t from = sources != NULL ? sources[i] : i;
    em_gpu_row_address(storage, rows[i])[j] = values[from * storage.row_floats + j];
}

/* ---- optimizer steps -------------------------------------------------------------------- */

/* The check of row i's step (common/row_check.h), before anything is applied: rows[i]
 * ROW_NONE is the row the push will create for keys[i]; a refused key's (ROW_PENDING)
 * takes no step. */
EM_HOST_DEVICE uint32_t em_gpu_rows_check_item(em_gpu_storage storage,
                                               const em_optimizer_config *optimizer,
                                               const em_initializer_config *initializer,
                                               const uint64_t *keys, const uint64_t *rows,
                                               const float *gradients, uint64_t i)
{
    if (rows[i] == EM_GPU_ROW_PENDING)
        return EM_ROW_CHECK_OK;
    const float *row = rows[i] == EM_GPU_ROW_NONE ? 0 : em_gpu_row_address(storage, rows[i]);
    return em_row_check(optimizer, initializer, storage.dim, row, keys[i],
                        gradients + i * storage.dim);
}

/* The first problem as the check reports it: the smallest item, then its code. */
EM_HOST_DEVICE uint64_t em_gpu_rows_check_result(uint64_t i, uint32_t code)
{
    return (i << 32) | code;
}

EM_HOST_DEVICE void em_gpu_sgd_element(em_gpu_storage storage, const em_optimizer_config *optimizer,
                                       const uint64_t *rows, const float *gradients, uint64_t i,
                                       uint32_t j)
{
    if (rows[i] == EM_GPU_ROW_PENDING)
        return;
    float *weights = em_gpu_row_address(storage, rows[i]);
    em_sgd_element(&weights[j], gradients[i * storage.dim + j], optimizer->learning_rate);
}

EM_HOST_DEVICE void em_gpu_adagrad_element(em_gpu_storage storage,
                                           const em_optimizer_config *optimizer,
                                           const uint64_t *rows, const float *gradients,
                                           uint64_t i, uint32_t j)
{
    if (rows[i] == EM_GPU_ROW_PENDING)
        return;
    float *weights = em_gpu_row_address(storage, rows[i]);
    em_adagrad_element(&weights[j], &weights[storage.dim + j], gradients[i * storage.dim + j],
                       optimizer->learning_rate, optimizer->eps);
}

/* Rowwise adagrad, lane `lane` of lanes: the sum of g*g over the elements j = lane,
 * lane + lanes, ... in increasing j. The lanes' partial sums are then added in a
 * butterfly (xor 16, 8, 4, 2, 1), which every lane ends with bit for bit. */
EM_HOST_DEVICE float em_gpu_rowwise_partial(const float *gradient, uint32_t dim, uint32_t lane,
                                            uint32_t lanes)
{
    float sum = 0.0f;
    for (uint32_t j = lane; j < dim; j += lanes)
        sum += gradient[j] * gradient[j];
    return sum;
}

/* The row's accumulator after the step (s += mean(g*g)), and the denominator
 * sqrt(s) + eps of every element (as lib/device/optimizer.c). */
EM_HOST_DEVICE float em_gpu_rowwise_denominator(float accumulator, float squares, uint32_t dim,
                                                float eps, float *updated)
{
    *updated = accumulator + squares / (float)dim;
    return sqrtf(*updated) + eps;
}

#endif
