/*
 * DESIGN: the data-parallel building blocks the device operations are made of.
 *
 * Scans and stable sorts come from CUB (part of the CUDA toolkit): they are the only
 * cross-thread algorithms in the kernels, and CUB's are tested far beyond what this
 * project could test without a GPU. Each is instantiated once (uint32 values, 64-bit
 * counts) to keep compile time down; the one other instantiation is the dedupe's rank
 * (kernels/home_ops.cu), a scan over flags computed as it reads them. Temporary
 * storage is the caller's (a pool allocation), sized by the *_temp_bytes queries.
 */
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "kernels/kernel_logic.h"
#include "kernels/launch.cuh"

__global__ void iota_kernel(uint32_t *out, uint64_t n)
{
    EM_GPU_FOR_EACH(i, n)
    out[i] = (uint32_t)i;
}

__global__ void segment_starts_kernel(const uint32_t *sorted_keys, uint64_t n, uint32_t segments,
                                      uint32_t *starts)
{
    EM_GPU_FOR_EACH(i, n + 1)
    em_gpu_segment_start_item(sorted_keys, n, segments, i, starts);
}

extern "C" em_gpu_status em_gpu_kernels_supported(int ordinal)
{
    cudaFuncAttributes attributes;
    EM_GPU_CALL(cudaSetDevice, (ordinal));
    EM_GPU_CALL(cudaFuncGetAttributes, (&attributes, iota_kernel));
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_iota_u32(em_gpu_stream *stream, uint32_t *out, uint64_t n)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(iota_kernel, n, stream, out, n);
}

extern "C" em_gpu_status em_gpu_scan_temp_bytes(em_gpu_stream *stream, uint64_t n, size_t *bytes)
{
    *bytes = 0;
    EM_GPU_TRY(em_gpu_use(stream));
    size_t needed = 0;
    EM_GPU_CALL(cub::DeviceScan::ExclusiveSum,
                (NULL, needed, (const uint32_t *)NULL, (uint32_t *)NULL, (int64_t)n,
                 stream->stream));
    *bytes = needed;
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_exclusive_scan_u32(em_gpu_stream *stream, void *temp,
                                                   size_t temp_bytes, const uint32_t *in,
                                                   uint32_t *out, uint64_t n)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    EM_GPU_CALL(cub::DeviceScan::ExclusiveSum,
                (temp, temp_bytes, in, out, (int64_t)n, stream->stream));
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_sort_temp_bytes(em_gpu_stream *stream, uint64_t n,
                                                uint32_t end_bit, size_t *bytes)
{
    *bytes = 0;
    if (end_bit == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    size_t needed = 0;
    EM_GPU_CALL(cub::DeviceRadixSort::SortPairs,
                (NULL, needed, (const uint32_t *)NULL, (uint32_t *)NULL,
                 (const uint32_t *)NULL, (uint32_t *)NULL, (int64_t)n, 0, (int)end_bit,
                 stream->stream));
    *bytes = needed;
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_sort_pairs_u32(em_gpu_stream *stream, void *temp,
                                               size_t temp_bytes, const uint32_t *keys_in,
                                               uint32_t *keys_out, const uint32_t *values_in,
                                               uint32_t *values_out, uint64_t n, uint32_t end_bit)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    if (end_bit == 0) {
        /* Every key is 0: the stable order is the input order. */
        EM_GPU_CALL(cudaMemcpyAsync, (keys_out, keys_in, n * sizeof(uint32_t),
                                      cudaMemcpyDeviceToDevice, stream->stream));
        EM_GPU_CALL(cudaMemcpyAsync, (values_out, values_in, n * sizeof(uint32_t),
                                      cudaMemcpyDeviceToDevice, stream->stream));
        return em_gpu_ok();
    }
    EM_GPU_CALL(cub::DeviceRadixSort::SortPairs,
                (temp, temp_bytes, keys_in, keys_out, values_in, values_out, (int64_t)n, 0,
                 (int)end_bit, stream->stream));
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_segment_starts(em_gpu_stream *stream, const uint32_t *sorted_keys,
                                               uint64_t n, uint32_t segments, uint32_t *starts)
{
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(segment_starts_kernel, n + 1, stream, sorted_keys, n, segments, starts);
}
