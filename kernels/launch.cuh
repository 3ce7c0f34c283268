/*
 * DESIGN: what the .cu files share and nothing outside kernels/ sees: the layout of
 * the opaque stream and event handles, status conversion, and the two loop shapes
 * every kernel uses.
 *
 * Launch geometry: blocks of 256 threads, at most 65536 blocks; kernels loop with a
 * grid stride over whatever the grid does not cover, so any n works with one launch.
 * Item kernels give each thread items i, i + grid, ...; element kernels give each row
 * a group of 2^shift threads (shift from em_gpu_group_shift, so a group never spans
 * two blocks) and each thread of the group the elements j = lane, lane + group, ...:
 * consecutive threads touch consecutive floats of a row (coalesced).
 */
#ifndef EMBER_KERNELS_LAUNCH_CUH
#define EMBER_KERNELS_LAUNCH_CUH

#include <cuda_runtime.h>

#include "kernels/ember_kernels.h"

struct em_gpu_stream {
    cudaStream_t stream;
    int ordinal;
};

struct em_gpu_event {
    cudaEvent_t event;
    int ordinal;
};

#define EM_GPU_BLOCK_THREADS 256u
#define EM_GPU_MAX_BLOCKS 65536u

static inline em_gpu_status em_gpu_ok(void)
{
    em_gpu_status status = {0, 0, NULL, NULL, 0};
    return status;
}

/* The errors after which "the process must be terminated and relaunched" (the CUDA
 * runtime's documentation of each): the context is lost for good. */
static inline bool em_gpu_error_sticky(cudaError_t error)
{
    switch ((int)error) {
    case 214: /* cudaErrorECCUncorrectable */
    case 226: /* cudaErrorContained */
    case 700: /* cudaErrorIllegalAddress */
    case 702: /* cudaErrorLaunchTimeout */
    case 710: /* cudaErrorAssert */
    case 714: /* cudaErrorHardwareStackError */
    case 715: /* cudaErrorIllegalInstruction */
    case 716: /* cudaErrorMisalignedAddress */
    case 717: /* cudaErrorInvalidAddressSpace */
    case 718: /* cudaErrorInvalidPc */
    case 719: /* cudaErrorLaunchFailure */
    case 721: /* cudaErrorTensorMemoryLeak */
    case 810: /* cudaErrorMpsClientTerminated */
    case 911: /* cudaErrorExternalDevice */
        return true;
    default:
        return false;
    }
}

/* A kind outside EM_OPTIMIZERS reached a launcher (a corrupted config): refused, never
 * run as some other optimizer. */
static inline em_gpu_status em_gpu_invalid_optimizer(void)
{
    em_gpu_status status = {(int)cudaErrorInvalidValue, 0, "em_gpu_rows_apply",
                            "optimizer kind outside EM_OPTIMIZERS", 0};
    return status;
}

static inline em_gpu_status em_gpu_cuda_status(cudaError_t error, const char *call)
{
    em_gpu_status status = em_gpu_ok();
    if (error == cudaSuccess)
        return status;
    status.code = (int)error;
    status.out_of_memory = error == cudaErrorMemoryAllocation;
    status.fatal = em_gpu_error_sticky(error);
    status.call = call;
    status.message = cudaGetErrorString(error);
    return status;
}

/* Returns from the enclosing function when the status is an error. */
#define EM_GPU_TRY(expression)                          \
    do {                                                \
        em_gpu_status em_gpu_try_status = (expression); \
        if (em_gpu_try_status.code != 0)                \
            return em_gpu_try_status;                   \
    } while (0)

/* EM_GPU_CALL(cudaMalloc, (&pointer, bytes)): the call, named in its error. */
#define EM_GPU_CALL(function, arguments) \
    EM_GPU_TRY(em_gpu_cuda_status(function arguments, #function))

/* Makes the stream's GPU current for this host thread (launchers run on any thread). */
static inline em_gpu_status em_gpu_use(const em_gpu_stream *stream)
{
    return em_gpu_cuda_status(cudaSetDevice(stream->ordinal), "cudaSetDevice");
}

static inline unsigned int em_gpu_blocks(uint64_t threads)
{
    uint64_t blocks = (threads + EM_GPU_BLOCK_THREADS - 1) / EM_GPU_BLOCK_THREADS;
    if (blocks > EM_GPU_MAX_BLOCKS)
        blocks = EM_GPU_MAX_BLOCKS;
    return blocks == 0 ? 1u : (unsigned int)blocks;
}

/* Enqueues kernel(arguments) on the stream with enough threads for `threads` items and
 * returns this launch's own status (configuration, missing image, a sticky error from
 * earlier work). cudaLaunchKernelEx reports the launch it was asked for; reading
 * cudaGetLastError after a <<<>>> launch would also return an earlier, unrelated
 * failure of any runtime call on this thread. */
template <typename... Parameters, typename... Arguments>
static inline em_gpu_status em_gpu_launch(void (*kernel)(Parameters...), const char *name,
                                          uint64_t threads, const em_gpu_stream *stream,
                                          Arguments &&...arguments)
{
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(em_gpu_blocks(threads));
    config.blockDim = dim3(EM_GPU_BLOCK_THREADS);
    config.dynamicSmemBytes = 0;
    config.stream = stream->stream;
    return em_gpu_cuda_status(
        cudaLaunchKernelEx(&config, kernel, static_cast<Arguments &&>(arguments)...), name);
}

/* em_gpu_launch with a row of blocks for each of `rows` (blockIdx.y): kernels over
 * several walks or segments at once, `threads` items in the longest. */
template <typename... Parameters, typename... Arguments>
static inline em_gpu_status em_gpu_launch_rows(void (*kernel)(Parameters...), const char *name,
                                               uint64_t threads, uint32_t rows,
                                               const em_gpu_stream *stream,
                                               Arguments &&...arguments)
{
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(em_gpu_blocks(threads), rows);
    config.blockDim = dim3(EM_GPU_BLOCK_THREADS);
    config.dynamicSmemBytes = 0;
    config.stream = stream->stream;
    return em_gpu_cuda_status(
        cudaLaunchKernelEx(&config, kernel, static_cast<Arguments &&>(arguments)...), name);
}

#define EM_GPU_LAUNCH_ROWS(kernel, threads, rows, stream, ...) \
    em_gpu_launch_rows(kernel, #kernel, (threads), (rows), (stream), __VA_ARGS__)

/* kernel(arguments) on the stream with enough threads for `threads` items, evaluating
 * to the launch status. */
#define EM_GPU_LAUNCH(kernel, threads, stream, ...) \
    em_gpu_launch(kernel, #kernel, (threads), (stream), __VA_ARGS__)

#define EM_GPU_THREAD_INDEX ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x)
#define EM_GPU_THREAD_COUNT ((uint64_t)gridDim.x * blockDim.x)

/* Item loop: i over [0, n). */
#define EM_GPU_FOR_EACH(i, n) \
    for (uint64_t i = EM_GPU_THREAD_INDEX; i < (uint64_t)(n); i += EM_GPU_THREAD_COUNT)

/* Element loop: row i over [0, n), element j over [0, width), 2^shift threads a row. */
#define EM_GPU_FOR_EACH_ELEMENT(i, j, n, width, shift)                                     \
    for (uint64_t i = EM_GPU_THREAD_INDEX >> (shift); i < (uint64_t)(n);                   \
         i += EM_GPU_THREAD_COUNT >> (shift))                                              \
        for (uint32_t j = threadIdx.x & ((1u << (shift)) - 1); j < (uint32_t)(width);       \
             j += 1u << (shift))

/* Threads an element kernel needs for n rows of width elements. */
static inline uint64_t em_gpu_element_threads(uint64_t n, uint32_t shift)
{
    return n << shift;
}

#endif
