/*
 * DESIGN: the CUDA device's home-side operations: dedupe, partition, gradient sums,
 * pooling and repeat copies on the buffers of a request at its home GPU, each a short
 * chain of kernel launches on the request's lane (kernels/ember_kernels.h).
 */
#include "lib/device/cuda_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- home-side operations --------------------------------------------------------- */

/* Slots of the unique-keys table for n keys: a power of two >= 2n, at most 2^32 (slot
 * indices are 32-bit; n < 2^32 keeps one free). */
static uint64_t unique_table_slots(uint64_t n)
{
    uint64_t slots = MIN_SLOTS;
    while (slots < 2 * n && slots < ((uint64_t)1 << 32))
        slots <<= 1;
    return slots;
}


em_status em__cuda_take_scan_temp(scratch *s, cuda_lane *lane, uint64_t n, void **temp,
                                size_t *temp_bytes, em_error *err)
{
    em_status status = lane_check(lane, em_gpu_scan_temp_bytes(lane->stream, n, temp_bytes), err);
    if (status == EM_OK)
        status = scratch_take(s, *temp_bytes, "scan scratch", temp, err);
    return status;
}

static em_status take_sort_temp(scratch *s, cuda_lane *lane, uint64_t n, uint32_t end_bit,
                                void **temp, size_t *temp_bytes, em_error *err)
{
    em_status status =
        lane_check(lane, em_gpu_sort_temp_bytes(lane->stream, n, end_bit, temp_bytes), err);
    if (status == EM_OK)
        status = scratch_take(s, *temp_bytes, "sort scratch", temp, err);
    return status;
}

/* Enqueues the dedupe of keys[0..n) (n > 0); *rank_out: the exclusive scan of the
 * first-occurrence flags, n + 1 entries, so rank[n] is the unique count. The scratch
 * holds the buffers until the caller is done. */
static em_status enqueue_unique(cuda_lane *lane, scratch *s, const uint64_t *keys, uint64_t n,
                                uint64_t *unique, uint32_t *inverse, uint32_t *first_positions,
                                uint32_t **rank_out, em_error *err)
{
    uint64_t slots = unique_table_slots(n);
    uint32_t *table = NULL, *slot_of = NULL, *rank = NULL;
    void *temp = NULL;
    size_t temp_bytes = 0;
    em_status status = scratch_take(s, slots * sizeof(uint32_t), "unique table",
                                    (void **)&table, err);
    if (status == EM_OK)
        status = scratch_take(s, n * sizeof(uint32_t), "unique slots", (void **)&slot_of, err);
    if (status == EM_OK)
        status = scratch_take(s, (n + 1) * sizeof(uint32_t), "unique ranks", (void **)&rank, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_unique_rank_temp_bytes(lane->stream, n, &temp_bytes),
                            err);
    if (status == EM_OK)
        status = scratch_take(s, temp_bytes, "unique rank scratch", &temp, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_memset_async(lane->stream, table, 0,
                                                      slots * sizeof(uint32_t)), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_unique_claim(lane->stream, keys, n, table, slots, slot_of),
                            err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_unique_rank(lane->stream, temp, temp_bytes, table,
                                                     slot_of, n, rank), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_unique_scatter(lane->stream, keys, n, table, slot_of,
                                                        rank, unique, inverse, first_positions),
                            err);
    *rank_out = rank;
    return status;
}

em_status em__cuda_unique_keys(em_lane *base, const uint64_t *keys, uint64_t n,
                                  uint64_t *unique, uint32_t *inverse, uint32_t *first_positions,
                                  uint64_t *unique_count, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    *unique_count = 0;
    if (n == 0)
        return EM_OK;
    scratch s = {.device = base->device};
    uint32_t *rank = NULL;
    em_status status = enqueue_unique(lane, &s, keys, n, unique, inverse, first_positions, &rank,
                                      err);
    uint32_t count = 0;
    if (status == EM_OK)
        status = em__cuda_copy_to_host(base, &count, rank + n, sizeof(count), err);
    if (status != EM_OK)
        return em__cuda_finish_async(&s, lane, status, err);
    scratch_free_now(&s);
    *unique_count = count;
    return EM_OK;
}

em_status em__cuda_unique_keys_async(em_lane *base, const uint64_t *keys, uint64_t n,
                                     uint64_t *unique, uint32_t *inverse,
                                     uint32_t *first_positions, const uint32_t **count,
                                     em_error *err)
{
    cuda_lane *lane = lane_of(base);
    scratch s = {.device = base->device};
    uint32_t *rank = NULL;
    em_status status = n == 0 ? em_error_set(err, EM_INTERNAL, "dedupe of no keys")
                              : enqueue_unique(lane, &s, keys, n, unique, inverse,
                                               first_positions, &rank, err);
    *count = rank != NULL ? rank + n : NULL;
    /* freed once the lane has synchronized: after the kernels that read the count */
    return em__cuda_finish_async(&s, lane, status, err);
}

/* Reads the per-shard starts back and turns them into counts; *end (when not NULL)
 * gets where the last shard's keys end. */
static em_status shard_counts_from_starts(cuda_lane *lane, const uint32_t *starts,
                                          uint32_t shard_count, uint64_t *shard_counts,
                                          uint64_t *end, em_error *err)
{
    uint32_t *host = malloc(((size_t)shard_count + 1) * sizeof(*host));
    if (host == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "partition: out of host memory");
    em_status status = em__cuda_copy_to_host(&lane->base, host, starts,
                                             ((size_t)shard_count + 1) * sizeof(*host), err);
    for (uint32_t shard = 0; status == EM_OK && shard < shard_count; shard++)
        shard_counts[shard] = host[shard + 1] - host[shard];
    if (status == EM_OK && end != NULL)
        *end = host[shard_count];
    free(host);
    return status;
}

/* One shard: the partitioned order is the unique order. */
static em_status partition_single(cuda_lane *lane, const uint64_t *unique, uint64_t n,
                                  const uint32_t *first_positions, uint64_t *partitioned,
                                  uint32_t *position, uint32_t *targets, uint64_t *shard_counts,
                                  em_error *err)
{
    em_status status = lane_check(
        lane, em_gpu_memcpy_async(lane->stream, partitioned, unique, n * sizeof(uint64_t)), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_iota_u32(lane->stream, position, n), err);
    if (status == EM_OK && targets != NULL)
        status = lane_check(lane, em_gpu_memcpy_async(lane->stream, targets, first_positions,
                                                      n * sizeof(uint32_t)), err);
    shard_counts[0] = n;
    return status;
}

/* Enqueues the partition of unique[0..n) by owner shard (shard_count > 1), or, with
 * count (a device word), of its first *count entries, the others sorted after every
 * shard; *starts_out (scratch, shard_count + 1 words): where each shard's keys begin,
 * and where the keys end. */
static em_status enqueue_partition(cuda_lane *lane, scratch *s, const uint64_t *unique,
                                   uint64_t n, const uint32_t *count, uint32_t shard_count,
                                   const uint32_t *first_positions, uint64_t *partitioned,
                                   uint32_t *position, uint32_t *targets, uint32_t **starts_out,
                                   em_error *err)
{
    uint32_t *owner = NULL, *index = NULL, *sorted_owner = NULL, *sorted_index = NULL;
    uint32_t *starts = NULL;
    void *temp = NULL;
    size_t temp_bytes = 0;
    /* counted: the entries past the count carry owner shard_count */
    uint32_t end_bit = bits_for(count != NULL ? (uint64_t)shard_count + 1 : shard_count);
    size_t bytes = n * sizeof(uint32_t);
    em_status status = scratch_take(s, bytes, "partition owners", (void **)&owner, err);
    if (status == EM_OK)
        status = scratch_take(s, bytes, "partition indices", (void **)&index, err);
    if (status == EM_OK)
        status = scratch_take(s, bytes, "sorted owners", (void **)&sorted_owner, err);
    if (status == EM_OK)
        status = scratch_take(s, bytes, "sorted indices", (void **)&sorted_index, err);
    if (status == EM_OK)
        status = scratch_take(s, ((size_t)shard_count + 1) * sizeof(uint32_t), "shard starts",
                              (void **)&starts, err);
    if (status == EM_OK)
        status = take_sort_temp(s, lane, n, end_bit, &temp, &temp_bytes, err);
    if (status == EM_OK)
        status = lane_check(lane,
                            count != NULL
                                ? em_gpu_partition_owners_counted(lane->stream, unique, n, count,
                                                                  shard_count, owner, index)
                                : em_gpu_partition_owners(lane->stream, unique, n, shard_count,
                                                          owner, index),
                            err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_sort_pairs_u32(lane->stream, temp, temp_bytes, owner,
                                                        sorted_owner, index, sorted_index, n,
                                                        end_bit), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_partition_scatter(lane->stream, unique, sorted_index,
                                                           first_positions, n, partitioned,
                                                           position, targets), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_segment_starts(lane->stream, sorted_owner, n,
                                                        shard_count, starts), err);
    *starts_out = starts;
    return status;
}

em_status em__cuda_partition_keys(em_lane *base, const uint64_t *unique, uint64_t n,
                                     uint32_t shard_count, const uint32_t *first_positions,
                                     uint64_t *partitioned, uint32_t *position, uint32_t *targets,
                                     uint64_t *shard_counts, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    memset(shard_counts, 0, shard_count * sizeof(*shard_counts));
    if (n == 0)
        return EM_OK;
    if (shard_count == 1)
        return partition_single(lane, unique, n, first_positions, partitioned, position, targets,
                                shard_counts, err);
    scratch s = {.device = base->device};
    uint32_t *starts = NULL;
    em_status status = enqueue_partition(lane, &s, unique, n, NULL, shard_count, first_positions,
                                         partitioned, position, targets, &starts, err);
    if (status == EM_OK)
        status = shard_counts_from_starts(lane, starts, shard_count, shard_counts, NULL, err);
    if (status != EM_OK)
        return em__cuda_finish_async(&s, lane, status, err);
    scratch_free_now(&s);
    return EM_OK;
}

/* The dedupe and the partition of keys[0..n) (n > 0) with one wait (device.h:
 * unique_partition_keys): the partition runs over n entries with the dedupe's count
 * left on the GPU, and the count comes back with the shards' starts. */
em_status em__cuda_unique_partition_keys(em_lane *base, const uint64_t *keys, uint64_t n,
                                         uint32_t shard_count, uint64_t *unique,
                                         uint32_t *inverse, uint32_t *first_positions,
                                         uint64_t *partitioned, uint32_t *position,
                                         uint32_t *targets, uint64_t *unique_count,
                                         uint64_t *shard_counts, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    scratch s = {.device = base->device};
    memset(shard_counts, 0, shard_count * sizeof(*shard_counts));
    *unique_count = 0;
    uint32_t *rank = NULL, *starts = NULL;
    em_status status = n == 0 ? em_error_set(err, EM_INTERNAL, "dedupe of no keys")
                              : enqueue_unique(lane, &s, keys, n, unique, inverse,
                                               first_positions, &rank, err);
    const uint32_t *count = rank != NULL ? rank + n : NULL;
    if (status == EM_OK && shard_count == 1) { /* the unique order, every entry */
        uint64_t ignored;
        uint32_t host = 0;
        status = partition_single(lane, unique, n, first_positions, partitioned, position,
                                  targets, &ignored, err);
        if (status == EM_OK)
            status = em__cuda_copy_to_host(base, &host, count, sizeof(host), err);
        if (status == EM_OK)
            *unique_count = shard_counts[0] = host;
    } else if (status == EM_OK) {
        status = enqueue_partition(lane, &s, unique, n, count, shard_count, first_positions,
                                   partitioned, position, targets, &starts, err);
        if (status == EM_OK) /* the keys end where the entries past the count begin */
            status = shard_counts_from_starts(lane, starts, shard_count, shard_counts,
                                              unique_count, err);
    }
    if (status != EM_OK)
        return em__cuda_finish_async(&s, lane, status, err);
    scratch_free_now(&s);
    return EM_OK;
}

/* The dedupe and partition of keys[0..n) and the finds of the partitioned keys in their
 * shards, with no wait (device.h: unique_partition_find_async): the find reads the
 * dedupe's count on the GPU, and the shards' starts and missing counts come back at the
 * lane's next synchronisation. */
em_status em__cuda_unique_partition_find_async(em_shard *const *shards, uint32_t shard_count,
                                              em_lane *base, const uint64_t *keys, uint64_t n,
                                              uint64_t *unique, uint32_t *inverse,
                                              uint32_t *first_positions, uint64_t *partitioned,
                                              uint32_t *position, uint32_t *targets,
                                              uint64_t *rows, uint32_t *shard_starts,
                                              uint64_t *missing, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    scratch s = {.device = base->device};
    uint32_t *rank = NULL, *starts = NULL;
    uint64_t *counts = NULL;
    em_status status = n == 0 || shard_count < 2
                           ? em_error_set(err, EM_INTERNAL,
                                          "a find with the partition of %" PRIu64
                                          " keys over %u shard(s)", n, shard_count)
                           : enqueue_unique(lane, &s, keys, n, unique, inverse, first_positions,
                                            &rank, err);
    const uint32_t *count = rank != NULL ? rank + n : NULL;
    if (status == EM_OK)
        status = enqueue_partition(lane, &s, unique, n, count, shard_count, first_positions,
                                   partitioned, position, targets, &starts, err);
    if (status == EM_OK)
        status = scratch_take(&s, shard_count * sizeof(uint64_t), "missing counts",
                              (void **)&counts, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_memset_async(lane->stream, counts, 0,
                                                      shard_count * sizeof(uint64_t)), err);
    if (status == EM_OK)
        status = em__cuda_shards_find_local_async(shards, shard_count, lane, partitioned, n,
                                                  count, rows, counts, err);
    if (status == EM_OK)
        status = em__cuda_copy_to_host_later(base, shard_starts, starts,
                                             ((size_t)shard_count + 1) * sizeof(uint32_t), err);
    if (status == EM_OK)
        status = em__cuda_copy_to_host_later(base, missing, counts,
                                             shard_count * sizeof(uint64_t), err);
    /* the scratch is freed once the lane has synchronized, after the kernels that read it */
    return em__cuda_finish_async(&s, lane, status, err);
}

_Static_assert(EM_SPREAD_MAX == EM_GPU_SPREAD_MAX, "a spread is the same on both sides");

/* A counted partition by shard, then each device's keys into its bucket (device.h:
 * spread_keys_async). */
em_status em__cuda_spread_keys_async(em_lane *base, const uint64_t *unique, uint64_t n,
                                     const uint32_t *count, uint32_t shard_count,
                                     const em_spread *spread, uint64_t *buckets,
                                     uint32_t *bucket_counts, uint32_t *position,
                                     em_error *err)
{
    cuda_lane *lane = lane_of(base);
    scratch s = {.device = base->device};
    uint64_t *partitioned = NULL;
    uint32_t *starts = NULL;
    em_gpu_spread view = {.count = spread->count};
    memcpy(view.first_shard, spread->first_shard, sizeof(view.first_shard));
    em_status status = n == 0 || spread->count == 0 || spread->count > EM_SPREAD_MAX
                           ? em_error_set(err, EM_INTERNAL, "spread of %" PRIu64
                                          " keys over %u devices", n, spread->count)
                           : scratch_take(&s, n * sizeof(uint64_t), "partitioned keys",
                                          (void **)&partitioned, err);
    if (status == EM_OK)
        status = enqueue_partition(lane, &s, unique, n, count, shard_count, NULL, partitioned,
                                   position, NULL, &starts, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_spread_keys(lane->stream, partitioned, n, starts,
                                                     shard_count, &view, buckets, bucket_counts,
                                                     position), err);
    /* the scratch is freed once the lane has synchronized, after the kernels that read it */
    return em__cuda_finish_async(&s, lane, status, err);
}

static em_gpu_batch gpu_batch(const em_device_batch *batch, em_combiner combiner, uint32_t dim)
{
    return (em_gpu_batch){
        .rows = batch->rows,
        .nnz = batch->nnz,
        .offsets = batch->offsets,
        .inverse = batch->inverse,
        .position = batch->position,
        .unique_count = batch->unique_count,
        .combiner = combiner,
        .dim = dim,
    };
}

/* positions[k] = k for k < nnz: the lane's kept ones (grown, and written once, when a
 * push has more keys than they cover, up to IOTA_CACHE_MAX), else the request's own. */
static em_status key_positions(scratch *s, cuda_lane *lane, uint64_t nnz,
                               const uint32_t **positions, em_error *err)
{
    em_device *device = lane->base.device;
    if (nnz <= IOTA_CACHE_MAX && lane->iota_count < nnz) {
        uint64_t count = 1024;
        while (count < nnz)
            count <<= 1;
        uint32_t *grown = NULL;
        em_error no_room; /* then this push writes its own, as a larger one does */
        if (em_device_alloc(device, count * sizeof(uint32_t), "lane key positions",
                            (void **)&grown, &no_room) == EM_OK) {
            em_status status = lane_check(lane, em_gpu_iota_u32(lane->stream, grown, count), err);
            if (status != EM_OK) { /* the lane may have enqueued it: freed after its work */
                em_error ignored;
                (void)em__cuda_free_later(lane, grown, &ignored);
                return status;
            }
            uint32_t *old = lane->iota; /* may still be read by this lane's work in flight */
            lane->iota = grown;
            lane->iota_count = count;
            if (old != NULL) {
                status = em__cuda_free_later(lane, old, err);
                if (status != EM_OK)
                    return status;
            }
        }
    }
    if (nnz <= lane->iota_count) {
        *positions = lane->iota;
        return EM_OK;
    }
    uint32_t *own = NULL;
    em_status status = scratch_take(s, nnz * sizeof(uint32_t), "key positions", (void **)&own,
                                    err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_iota_u32(lane->stream, own, nnz), err);
    *positions = own;
    return status;
}

/* The batch's key positions grouped by unique index, in increasing position within a
 * group: sorted_inverse is the batch's inverse sorted, sorted_positions the positions in
 * that order (the sums find each unique index's run themselves). */
static em_status group_positions(scratch *s, cuda_lane *lane, const em_device_batch *batch,
                                 uint32_t **sorted_inverse, uint32_t **sorted_positions,
                                 em_error *err)
{
    uint64_t nnz = batch->nnz;
    uint32_t end_bit = bits_for(batch->unique_count);
    const uint32_t *positions = NULL;
    void *temp = NULL;
    size_t temp_bytes = 0;
    em_status status = key_positions(s, lane, nnz, &positions, err);
    if (status == EM_OK)
        status = scratch_take(s, nnz * sizeof(uint32_t), "sorted inverse",
                              (void **)sorted_inverse, err);
    if (status == EM_OK)
        status = scratch_take(s, nnz * sizeof(uint32_t), "sorted positions",
                              (void **)sorted_positions, err);
    if (status == EM_OK)
        status = take_sort_temp(s, lane, nnz, end_bit, &temp, &temp_bytes, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_sort_pairs_u32(lane->stream, temp, temp_bytes,
                                                        batch->inverse, *sorted_inverse,
                                                        positions, *sorted_positions, nnz,
                                                        end_bit), err);
    return status;
}

em_status em__cuda_sum_gradients(em_lane *base, const em_device_batch *batch,
                                    em_combiner combiner, uint32_t dim, const float *gradients,
                                    float *partitioned_gradients, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    if (batch->nnz == 0 || batch->unique_count == 0)
        return EM_OK;
    scratch s = {.device = base->device};
    uint32_t *sorted_inverse = NULL, *sorted_positions = NULL, *key_row = NULL;
    float *partials = NULL;
    uint64_t partial_floats = em_gpu_sum_partials_floats(batch->nnz, dim);
    em_status status = EM_OK;
    if (partial_floats != 0)
        status = scratch_take(&s, partial_floats * sizeof(float), "hot key chunk sums",
                              (void **)&partials, err);
    if (status == EM_OK)
        status = group_positions(&s, lane, batch, &sorted_inverse, &sorted_positions, err);
    if (status == EM_OK && combiner != EM_COMBINER_NONE) {
        status = scratch_take(&s, batch->nnz * sizeof(uint32_t), "key rows", (void **)&key_row,
                              err);
        if (status == EM_OK)
            status = lane_check(lane, em_gpu_key_rows(lane->stream, batch->offsets, batch->rows,
                                                      batch->nnz, key_row), err);
    }
    em_gpu_batch view = gpu_batch(batch, combiner, dim);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_sum_gradients(lane->stream, &view, sorted_inverse,
                                                       sorted_positions, key_row, gradients,
                                                       partials, partitioned_gradients), err);
    return em__cuda_finish_async(&s, lane, status, err);
}

em_status em__cuda_combine(em_lane *base, const em_device_batch *batch, em_combiner combiner,
                              uint32_t dim, const float *vectors, float *out, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    em_gpu_batch view = gpu_batch(batch, combiner, dim);
    return lane_check(lane, em_gpu_combine(lane->stream, &view, vectors, out), err);
}

em_status em__cuda_copy_repeats(em_lane *base, const em_device_batch *batch,
                                   const uint32_t *first_positions, uint32_t dim, float *out,
                                   em_error *err)
{
    cuda_lane *lane = lane_of(base);
    return lane_check(lane, em_gpu_copy_repeats(lane->stream, batch->inverse, batch->nnz,
                                                first_positions, dim, out), err);
}

