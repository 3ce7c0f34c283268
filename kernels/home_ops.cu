/*
 * DESIGN: kernels of the home-side request operations (dedupe, partition, gradient
 * sums, pooling). Each kernel is a loop around one function of kernels/kernel_logic.h;
 * lib/device/cuda_device.c puts them in order with the primitives of primitives.cu. The
 * dedupe's rank is a CUB scan (as in primitives.cu) whose input is computed as it is
 * read, so that the first-occurrence flags cost no launch and no array of their own.
 *
 * Gradient sums and pooling are deterministic without atomics: one thread per output
 * element walks that element's contributions in key order, exactly as the CPU device
 * does, so both backends produce the same bits.
 */
#include <cub/device/device_scan.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include "kernels/kernel_logic.h"
#include "kernels/launch.cuh"

__global__ void unique_claim_kernel(const uint64_t *keys, uint64_t n, uint32_t *table,
                                    uint64_t slot_count, uint32_t *slot_of)
{
    EM_GPU_FOR_EACH(i, n)
    em_gpu_unique_claim_item(keys, i, table, slot_count, slot_of);
}

__global__ void unique_scatter_kernel(const uint64_t *keys, uint64_t n, const uint32_t *table,
                                      const uint32_t *slot_of, const uint32_t *rank,
                                      uint64_t *unique, uint32_t *inverse,
                                      uint32_t *first_positions)
{
    EM_GPU_FOR_EACH(i, n)
    em_gpu_unique_scatter_item(keys, i, table, slot_of, rank, unique, inverse, first_positions);
}

/* Position i's first-occurrence flag, as CUB's scan reads input i: the flags are never
 * stored, and the scan is the only launch that computes them. */
struct unique_first_flag {
    const uint32_t *table;
    const uint32_t *slot_of;
    uint64_t n;
    __host__ __device__ uint32_t operator()(uint64_t i) const
    {
        return em_gpu_unique_first(table, slot_of, n, i);
    }
};

typedef thrust::transform_iterator<unique_first_flag, thrust::counting_iterator<uint64_t>>
    unique_first_flags;

static unique_first_flags first_flags(const uint32_t *table, const uint32_t *slot_of, uint64_t n)
{
    return unique_first_flags(thrust::counting_iterator<uint64_t>(0),
                              unique_first_flag{table, slot_of, n});
}

__global__ void partition_owners_kernel(const uint64_t *unique, uint64_t n, uint32_t shard_count,
                                        uint32_t *owner, uint32_t *index)
{
    EM_GPU_FOR_EACH(u, n)
    em_gpu_partition_owner_item(unique, u, shard_count, owner, index);
}

__global__ void partition_owners_counted_kernel(const uint64_t *unique, uint64_t n,
                                                const uint32_t *count, uint32_t shard_count,
                                                uint32_t *owner, uint32_t *index)
{
    EM_GPU_FOR_EACH(u, n)
    em_gpu_partition_owner_counted_item(unique, count, u, shard_count, owner, index);
}

__global__ void partition_scatter_kernel(const uint64_t *unique, const uint32_t *sorted_index,
                                         const uint32_t *first_positions, uint64_t n,
                                         uint64_t *partitioned, uint32_t *position,
                                         uint32_t *targets)
{
    EM_GPU_FOR_EACH(i, n)
    em_gpu_partition_scatter_item(unique, sorted_index, first_positions, i, partitioned,
                                  position, targets);
}

__global__ void spread_keys_kernel(em_gpu_spread spread, const uint64_t *partitioned, uint64_t n,
                                   const uint32_t *starts, uint32_t shard_count, uint64_t items,
                                   uint64_t *buckets, uint32_t *bucket_counts, uint32_t *position)
{
    EM_GPU_FOR_EACH(t, items)
    em_gpu_spread_item(&spread, partitioned, n, starts, shard_count, t, buckets, bucket_counts,
                       position);
}

__global__ void key_rows_kernel(const uint32_t *offsets, uint32_t rows, uint64_t nnz,
                                uint32_t *key_row)
{
    EM_GPU_FOR_EACH(k, nnz)
    key_row[k] = em_gpu_row_of_key(offsets, rows, k);
}

/* One thread per (item, element): items below nnz are sorted positions (the sums of the
 * keys that are not hot, by the threads at their runs' first positions), the others the
 * slots of the partials buffer (the first level of hot keys' trees). */
__global__ void sum_runs_kernel(em_gpu_batch batch, const uint32_t *sorted_inverse,
                                const uint32_t *sorted_positions, const uint32_t *key_row,
                                const float *gradients, float *partials, uint64_t slots,
                                float *out, uint32_t shift)
{
    EM_GPU_FOR_EACH_ELEMENT(item, j, batch.nnz + slots, batch.dim, shift)
    {
        if (item < batch.nnz)
            em_gpu_sum_run_element(&batch, sorted_inverse, sorted_positions, key_row, gradients,
                                   out, item, j);
        else
            em_gpu_sum_chunk_element(&batch, sorted_inverse, sorted_positions, key_row,
                                     gradients, partials, item - batch.nnz, j);
    }
}

/* The rest of hot keys' trees, by the threads at their runs' first positions. */
__global__ void sum_hot_kernel(em_gpu_batch batch, const uint32_t *sorted_inverse,
                               float *partials, float *out, uint32_t shift)
{
    EM_GPU_FOR_EACH_ELEMENT(p, j, batch.nnz, batch.dim, shift)
    em_gpu_sum_hot_element(&batch, sorted_inverse, partials, out, p, j);
}

__global__ void combine_copy_kernel(em_gpu_batch batch, const float *vectors, float *out,
                                    uint32_t shift)
{
    EM_GPU_FOR_EACH_ELEMENT(k, j, batch.nnz, batch.dim, shift)
    em_gpu_combine_copy_element(&batch, vectors, out, k, j);
}

__global__ void combine_pool_kernel(em_gpu_batch batch, const float *vectors, float *out,
                                    uint32_t shift)
{
    EM_GPU_FOR_EACH_ELEMENT(r, j, batch.rows, batch.dim, shift)
    em_gpu_combine_pool_element(&batch, vectors, out, r, j);
}

__global__ void copy_repeats_kernel(const uint32_t *inverse, uint64_t nnz,
                                    const uint32_t *first_positions, uint32_t dim, float *out,
                                    uint32_t shift)
{
    EM_GPU_FOR_EACH_ELEMENT(k, j, nnz, dim, shift)
    em_gpu_copy_repeats_element(inverse, first_positions, dim, out, k, j);
}

extern "C" em_gpu_status em_gpu_unique_claim(em_gpu_stream *stream, const uint64_t *keys,
                                             uint64_t n, uint32_t *table, uint64_t slot_count,
                                             uint32_t *slot_of)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(unique_claim_kernel, n, stream, keys, n, table, slot_count, slot_of);
}

extern "C" em_gpu_status em_gpu_unique_rank_temp_bytes(em_gpu_stream *stream, uint64_t n,
                                                       size_t *bytes)
{
    *bytes = 0;
    EM_GPU_TRY(em_gpu_use(stream));
    size_t needed = 0;
    EM_GPU_CALL(cub::DeviceScan::ExclusiveSum,
                (NULL, needed, first_flags(NULL, NULL, n), (uint32_t *)NULL, (int64_t)(n + 1),
                 stream->stream));
    *bytes = needed;
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_unique_rank(em_gpu_stream *stream, void *temp, size_t temp_bytes,
                                            const uint32_t *table, const uint32_t *slot_of,
                                            uint64_t n, uint32_t *rank)
{
    EM_GPU_TRY(em_gpu_use(stream));
    EM_GPU_CALL(cub::DeviceScan::ExclusiveSum,
                (temp, temp_bytes, first_flags(table, slot_of, n), rank, (int64_t)(n + 1),
                 stream->stream));
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_unique_scatter(em_gpu_stream *stream, const uint64_t *keys,
                                               uint64_t n, const uint32_t *table,
                                               const uint32_t *slot_of, const uint32_t *rank,
                                               uint64_t *unique, uint32_t *inverse,
                                               uint32_t *first_positions)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(unique_scatter_kernel, n, stream, keys, n, table, slot_of, rank, unique,
                         inverse, first_positions);
}

extern "C" em_gpu_status em_gpu_partition_owners(em_gpu_stream *stream, const uint64_t *unique,
                                                 uint64_t n, uint32_t shard_count,
                                                 uint32_t *owner, uint32_t *index)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(partition_owners_kernel, n, stream, unique, n, shard_count, owner,
                         index);
}

extern "C" em_gpu_status em_gpu_partition_owners_counted(em_gpu_stream *stream,
                                                         const uint64_t *unique, uint64_t n,
                                                         const uint32_t *count,
                                                         uint32_t shard_count, uint32_t *owner,
                                                         uint32_t *index)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(partition_owners_counted_kernel, n, stream, unique, n, count,
                         shard_count, owner, index);
}

extern "C" em_gpu_status em_gpu_spread_keys(em_gpu_stream *stream, const uint64_t *partitioned,
                                            uint64_t n, const uint32_t *starts,
                                            uint32_t shard_count, const em_gpu_spread *spread,
                                            uint64_t *buckets, uint32_t *bucket_counts,
                                            uint32_t *position)
{
    uint64_t items = n > spread->count ? n : spread->count;
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(spread_keys_kernel, items, stream, *spread, partitioned, n, starts,
                         shard_count, items, buckets, bucket_counts, position);
}

extern "C" em_gpu_status em_gpu_partition_scatter(em_gpu_stream *stream, const uint64_t *unique,
                                                  const uint32_t *sorted_index,
                                                  const uint32_t *first_positions, uint64_t n,
                                                  uint64_t *partitioned, uint32_t *position,
                                                  uint32_t *targets)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(partition_scatter_kernel, n, stream, unique, sorted_index,
                         first_positions, n, partitioned, position, targets);
}

extern "C" em_gpu_status em_gpu_key_rows(em_gpu_stream *stream, const uint32_t *offsets,
                                         uint32_t rows, uint64_t nnz, uint32_t *key_row)
{
    if (nnz == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(key_rows_kernel, nnz, stream, offsets, rows, nnz, key_row);
}

extern "C" em_gpu_status em_gpu_sum_gradients(em_gpu_stream *stream, const em_gpu_batch *batch,
                                              const uint32_t *sorted_inverse,
                                              const uint32_t *sorted_positions,
                                              const uint32_t *key_row, const float *gradients,
                                              float *partials, float *out)
{
    if (batch->nnz == 0 || batch->unique_count == 0 || batch->dim == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    uint32_t shift = em_gpu_group_shift(batch->dim);
    bool hot = em_gpu_sum_partials_floats(batch->nnz, batch->dim) != 0; /* a key may be hot */
    uint64_t slots = hot ? em_gpu_sum_slots(batch->nnz) : 0;
    EM_GPU_TRY(EM_GPU_LAUNCH(sum_runs_kernel, em_gpu_element_threads(batch->nnz + slots, shift),
                             stream, *batch, sorted_inverse, sorted_positions, key_row, gradients,
                             partials, slots, out, shift));
    if (!hot)
        return em_gpu_ok();
    return EM_GPU_LAUNCH(sum_hot_kernel, em_gpu_element_threads(batch->nnz, shift), stream,
                         *batch, sorted_inverse, partials, out, shift);
}

extern "C" em_gpu_status em_gpu_combine(em_gpu_stream *stream, const em_gpu_batch *batch,
                                        const float *vectors, float *out)
{
    uint64_t outputs = batch->combiner == EM_COMBINER_NONE ? batch->nnz : batch->rows;
    if (outputs == 0 || batch->dim == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    uint32_t shift = em_gpu_group_shift(batch->dim);
    uint64_t threads = em_gpu_element_threads(outputs, shift);
    if (batch->combiner == EM_COMBINER_NONE)
        return EM_GPU_LAUNCH(combine_copy_kernel, threads, stream, *batch, vectors, out, shift);
    return EM_GPU_LAUNCH(combine_pool_kernel, threads, stream, *batch, vectors, out, shift);
}

extern "C" em_gpu_status em_gpu_copy_repeats(em_gpu_stream *stream, const uint32_t *inverse,
                                             uint64_t nnz, const uint32_t *first_positions,
                                             uint32_t dim, float *out)
{
    if (nnz == 0 || dim == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    uint32_t shift = em_gpu_group_shift(dim);
    return EM_GPU_LAUNCH(copy_repeats_kernel, em_gpu_element_threads(nnz, shift), stream, inverse,
                         nnz, first_positions, dim, out, shift);
}
