/*
 * DESIGN: thin wrappers over the CUDA runtime and NCCL (kernels/ember_kernels.h).
 *
 * Each wrapper makes the right GPU current, makes one or two calls, and reports the
 * first failure with the call's name. Nothing here is on the request path except the
 * asynchronous copies, stream and event operations and the NCCL group.
 */
#include <nccl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/launch.cuh"

struct em_gpu_comm {
    ncclComm_t comm; /* NULL once aborted */
};

/* The live communicators, so that every wait can read their asynchronous errors. */
#define MAX_LIVE_COMMS 64
static pthread_mutex_t live_comms_lock = PTHREAD_MUTEX_INITIALIZER;
static em_gpu_comm *live_comms[MAX_LIVE_COMMS];
static int live_comm_count;

static em_gpu_status nccl_status(ncclResult_t result, const char *call)
{
    em_gpu_status status = em_gpu_ok();
    if (result == ncclSuccess)
        return status;
    status.code = (int)result;
    status.call = call;
    status.message = ncclGetErrorString(result);
    return status;
}

#define EM_GPU_NCCL(function, arguments) EM_GPU_TRY(nccl_status(function arguments, #function))

static em_gpu_status use_device(int ordinal)
{
    return em_gpu_cuda_status(cudaSetDevice(ordinal), "cudaSetDevice");
}

/* ---- devices and memory ------------------------------------------------------------ */

extern "C" em_gpu_status em_gpu_device_count(int *count)
{
    *count = 0;
    EM_GPU_CALL(cudaGetDeviceCount, (count));
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_versions(int *driver, int *runtime)
{
    *driver = *runtime = 0;
    EM_GPU_CALL(cudaRuntimeGetVersion, (runtime));
    EM_GPU_CALL(cudaDriverGetVersion, (driver));
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_device_info_get(int ordinal, em_gpu_device_info *out)
{
    cudaDeviceProp properties;
    EM_GPU_CALL(cudaGetDeviceProperties, (&properties, ordinal));
    memset(out, 0, sizeof(*out));
    snprintf(out->name, sizeof(out->name), "%s", properties.name);
    out->total_bytes = properties.totalGlobalMem;
    out->multiprocessors = (uint32_t)properties.multiProcessorCount;
    out->compute_major = (uint32_t)properties.major;
    out->compute_minor = (uint32_t)properties.minor;
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_memory_info(int ordinal, uint64_t *free_bytes,
                                            uint64_t *total_bytes)
{
    size_t free_memory = 0, total_memory = 0;
    EM_GPU_TRY(use_device(ordinal));
    EM_GPU_CALL(cudaMemGetInfo, (&free_memory, &total_memory));
    *free_bytes = free_memory;
    *total_bytes = total_memory;
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_malloc(int ordinal, size_t bytes, void **out)
{
    *out = NULL;
    EM_GPU_TRY(use_device(ordinal));
    EM_GPU_CALL(cudaMalloc, (out, bytes));
    return em_gpu_ok();
}

extern "C" void em_gpu_free(int ordinal, void *pointer)
{
    if (pointer == NULL || cudaSetDevice(ordinal) != cudaSuccess)
        return;
    cudaFree(pointer);
}

extern "C" int em_gpu_fills_freed(void)
{
    return 0;
}

extern "C" void em_gpu_fill_freed(void *pointer, size_t bytes)
{
    (void)pointer;
    (void)bytes;
}

extern "C" em_gpu_status em_gpu_host_alloc(size_t bytes, void **out)
{
    *out = NULL;
    EM_GPU_CALL(cudaHostAlloc, (out, bytes, cudaHostAllocPortable));
    return em_gpu_ok();
}

extern "C" void em_gpu_host_free(void *pointer)
{
    if (pointer != NULL)
        cudaFreeHost(pointer);
}

/* ---- streams and events ---------------------------------------------------------------- */

extern "C" em_gpu_status em_gpu_stream_create(int ordinal, em_gpu_stream **out)
{
    *out = NULL;
    em_gpu_stream *stream = (em_gpu_stream *)calloc(1, sizeof(*stream));
    if (stream == NULL)
        return em_gpu_cuda_status(cudaErrorMemoryAllocation, "calloc (stream handle)");
    stream->ordinal = ordinal;
    em_gpu_status status = use_device(ordinal);
    if (status.code == 0)
        status = em_gpu_cuda_status(cudaStreamCreateWithFlags(&stream->stream,
                                                              cudaStreamNonBlocking),
                                    "cudaStreamCreateWithFlags");
    if (status.code != 0) {
        free(stream);
        return status;
    }
    *out = stream;
    return status;
}

extern "C" void em_gpu_stream_destroy(em_gpu_stream *stream)
{
    if (stream == NULL)
        return;
    if (cudaSetDevice(stream->ordinal) == cudaSuccess)
        cudaStreamDestroy(stream->stream);
    free(stream);
}

/* ---- waits ---------------------------------------------------------------------------- */

/* The first asynchronous error of a live communicator (a peer failed, a network or CUDA
 * error inside NCCL): every communicator is then aborted, which ends the operations they
 * left unfinished, and the error is returned as fatal. */
static em_gpu_status comms_async_error(void)
{
    em_gpu_status status = em_gpu_ok();
    pthread_mutex_lock(&live_comms_lock);
    for (int i = 0; i < live_comm_count && status.code == 0; i++) {
        if (live_comms[i]->comm == NULL)
            continue;
        ncclResult_t async = ncclSuccess;
        ncclResult_t asked = ncclCommGetAsyncError(live_comms[i]->comm, &async);
        if (asked != ncclSuccess)
            status = nccl_status(asked, "ncclCommGetAsyncError");
        else if (async != ncclSuccess && async != ncclInProgress)
            status = nccl_status(async, "ncclCommGetAsyncError");
    }
    if (status.code != 0) {
        status.fatal = 1;
        for (int i = 0; i < live_comm_count; i++) {
            if (live_comms[i]->comm != NULL)
                (void)ncclCommAbort(live_comms[i]->comm);
            live_comms[i]->comm = NULL;
        }
    }
    pthread_mutex_unlock(&live_comms_lock);
    return status;
}

static uint64_t monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}

/* Waits until query() stops answering cudaErrorNotReady, polling instead of blocking in
 * cudaStreamSynchronize or cudaEventSynchronize, which never return when a collective
 * hangs on a failed peer: between polls the communicators' asynchronous errors are read
 * (every 64 polls). The wait yields the CPU for its first millisecond and then sleeps
 * 20 us between polls. */
template <typename Query>
static em_gpu_status wait_until_done(Query query, const char *call)
{
    uint64_t started = 0;
    for (uint64_t polls = 0;; polls++) {
        cudaError_t error = query();
        if (error != cudaErrorNotReady)
            return em_gpu_cuda_status(error, call);
        if (polls % 64 == 63) {
            EM_GPU_TRY(comms_async_error());
        }
        uint64_t now = monotonic_ns();
        if (started == 0)
            started = now;
        if (now - started < 1000000u) {
            sched_yield();
        } else {
            struct timespec pause = {0, 20000};
            nanosleep(&pause, NULL);
        }
    }
}

extern "C" em_gpu_status em_gpu_stream_synchronize(em_gpu_stream *stream)
{
    cudaStream_t raw = stream->stream;
    return wait_until_done([raw] { return cudaStreamQuery(raw); }, "cudaStreamQuery");
}

extern "C" em_gpu_status em_gpu_streams_synchronize(em_gpu_stream *const *streams, int count,
                                                    int *failed)
{
    *failed = -1;
    if (count < 0 || count > 64)
        return em_gpu_cuda_status(cudaErrorInvalidValue, "em_gpu_streams_synchronize (count)");
    uint64_t waiting = count == 64 ? UINT64_MAX : (UINT64_C(1) << count) - 1;
    return wait_until_done(
        [&] {
            for (int i = 0; i < count; i++) {
                if ((waiting >> i & 1) == 0)
                    continue;
                /* each query from its stream's device, as every other call here is made */
                cudaError_t error = cudaSetDevice(streams[i]->ordinal);
                if (error == cudaSuccess)
                    error = cudaStreamQuery(streams[i]->stream);
                if (error == cudaSuccess) {
                    waiting &= ~(UINT64_C(1) << i);
                } else if (error != cudaErrorNotReady) {
                    *failed = i;
                    return error;
                }
            }
            return waiting == 0 ? cudaSuccess : cudaErrorNotReady;
        },
        "cudaStreamQuery");
}

extern "C" em_gpu_status em_gpu_event_create(int ordinal, int timing, em_gpu_event **out)
{
    *out = NULL;
    em_gpu_event *event = (em_gpu_event *)calloc(1, sizeof(*event));
    if (event == NULL)
        return em_gpu_cuda_status(cudaErrorMemoryAllocation, "calloc (event handle)");
    event->ordinal = ordinal;
    em_gpu_status status = use_device(ordinal);
    if (status.code == 0)
        status = em_gpu_cuda_status(
            cudaEventCreateWithFlags(&event->event,
                                     timing ? cudaEventDefault : cudaEventDisableTiming),
            "cudaEventCreateWithFlags");
    if (status.code != 0) {
        free(event);
        return status;
    }
    *out = event;
    return status;
}

extern "C" void em_gpu_event_destroy(em_gpu_event *event)
{
    if (event == NULL)
        return;
    if (cudaSetDevice(event->ordinal) == cudaSuccess)
        cudaEventDestroy(event->event);
    free(event);
}

extern "C" em_gpu_status em_gpu_event_record(em_gpu_event *event, em_gpu_stream *stream)
{
    EM_GPU_TRY(em_gpu_use(stream));
    EM_GPU_CALL(cudaEventRecord, (event->event, stream->stream));
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_stream_wait(em_gpu_stream *stream, em_gpu_event *event)
{
    EM_GPU_TRY(em_gpu_use(stream));
    EM_GPU_CALL(cudaStreamWaitEvent, (stream->stream, event->event, 0));
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_event_synchronize(em_gpu_event *event)
{
    cudaEvent_t raw = event->event;
    return wait_until_done([raw] { return cudaEventQuery(raw); }, "cudaEventQuery");
}

extern "C" em_gpu_status em_gpu_event_elapsed_ms(em_gpu_event *start, em_gpu_event *end,
                                                 float *ms)
{
    EM_GPU_CALL(cudaEventElapsedTime, (ms, start->event, end->event));
    return em_gpu_ok();
}

/* ---- copies ------------------------------------------------------------------------------ */

extern "C" em_gpu_status em_gpu_memcpy_async(em_gpu_stream *stream, void *destination,
                                             const void *source, size_t bytes)
{
    if (bytes == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    EM_GPU_CALL(cudaMemcpyAsync,
                (destination, source, bytes, cudaMemcpyDefault, stream->stream));
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_memset_async(em_gpu_stream *stream, void *destination, int value,
                                             size_t bytes)
{
    if (bytes == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    EM_GPU_CALL(cudaMemsetAsync, (destination, value, bytes, stream->stream));
    return em_gpu_ok();
}

/* ---- NCCL ---------------------------------------------------------------------------------- */

extern "C" em_gpu_status em_gpu_comm_init_all(const int *ordinals, int count, em_gpu_comm **comms)
{
    ncclComm_t *raw = (ncclComm_t *)calloc((size_t)count, sizeof(*raw));
    if (raw == NULL)
        return em_gpu_cuda_status(cudaErrorMemoryAllocation, "calloc (communicators)");
    for (int i = 0; i < count; i++)
        comms[i] = NULL;
    em_gpu_status status = nccl_status(ncclCommInitAll(raw, count, ordinals), "ncclCommInitAll");
    for (int i = 0; status.code == 0 && i < count; i++) {
        comms[i] = (em_gpu_comm *)calloc(1, sizeof(**comms));
        if (comms[i] == NULL)
            status = em_gpu_cuda_status(cudaErrorMemoryAllocation, "calloc (communicator)");
        else
            comms[i]->comm = raw[i];
    }
    pthread_mutex_lock(&live_comms_lock);
    if (status.code == 0 && live_comm_count + count > MAX_LIVE_COMMS)
        status = nccl_status(ncclInvalidUsage, "ncclCommInitAll (more than 64 communicators)");
    for (int i = 0; status.code == 0 && i < count; i++)
        live_comms[live_comm_count++] = comms[i];
    pthread_mutex_unlock(&live_comms_lock);
    if (status.code != 0) {
        for (int i = 0; i < count; i++) {
            free(comms[i]);
            comms[i] = NULL;
            if (raw[i] != NULL)
                ncclCommDestroy(raw[i]);
        }
    }
    free(raw);
    return status;
}

/* The warm-up's group: every ordered pair of ranks sends one byte. */
static em_gpu_status warm_transfers(em_gpu_comm *const *comms, int count, uint8_t *const *buffers,
                                    const cudaStream_t *streams)
{
    for (int i = 0; i < count; i++) {
        for (int j = 0; j < count; j++) {
            if (i == j)
                continue;
            EM_GPU_NCCL(ncclSend, (buffers[i] + j, 1, ncclUint8, j, comms[i]->comm, streams[i]));
            EM_GPU_NCCL(ncclRecv, (buffers[i] + count + j, 1, ncclUint8, j, comms[i]->comm,
                                   streams[i]));
        }
    }
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_comm_warm(em_gpu_comm *const *comms, const int *ordinals,
                                          int count)
{
    uint8_t **buffers = (uint8_t **)calloc((size_t)count, sizeof(*buffers));
    cudaStream_t *streams = (cudaStream_t *)calloc((size_t)count, sizeof(*streams));
    em_gpu_status status = em_gpu_ok();
    if (buffers == NULL || streams == NULL)
        status = em_gpu_cuda_status(cudaErrorMemoryAllocation, "calloc (warm-up)");
    for (int i = 0; status.code == 0 && i < count; i++) {
        status = use_device(ordinals[i]);
        if (status.code == 0)
            status = em_gpu_cuda_status(
                cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking),
                "cudaStreamCreateWithFlags");
        if (status.code == 0)
            status = em_gpu_cuda_status(cudaMalloc((void **)&buffers[i], 2 * (size_t)count),
                                        "cudaMalloc");
        if (status.code == 0)
            status = em_gpu_cuda_status(cudaMemset(buffers[i], 0, 2 * (size_t)count),
                                        "cudaMemset");
    }
    if (status.code == 0) {
        status = nccl_status(ncclGroupStart(), "ncclGroupStart");
        if (status.code == 0) {
            status = warm_transfers(comms, count, buffers, streams);
            em_gpu_status ended = nccl_status(ncclGroupEnd(), "ncclGroupEnd");
            if (status.code == 0)
                status = ended;
        }
    }
    for (int i = 0; status.code == 0 && i < count; i++) {
        cudaStream_t raw = streams[i];
        status = wait_until_done([raw] { return cudaStreamQuery(raw); }, "cudaStreamQuery");
    }
    for (int i = 0; i < count && buffers != NULL && streams != NULL; i++) {
        if (cudaSetDevice(ordinals[i]) != cudaSuccess)
            continue;
        if (buffers[i] != NULL)
            cudaFree(buffers[i]);
        if (streams[i] != NULL)
            cudaStreamDestroy(streams[i]);
    }
    free(buffers);
    free(streams);
    return status;
}

extern "C" void em_gpu_comm_destroy(em_gpu_comm *comm)
{
    if (comm == NULL)
        return;
    pthread_mutex_lock(&live_comms_lock);
    for (int i = 0; i < live_comm_count; i++) {
        if (live_comms[i] == comm) {
            live_comms[i] = live_comms[--live_comm_count];
            break;
        }
    }
    if (comm->comm != NULL)
        ncclCommDestroy(comm->comm);
    pthread_mutex_unlock(&live_comms_lock);
    free(comm);
}

static em_gpu_status enqueue_transfers(em_gpu_comm *const *comms, const em_gpu_send_recv *transfers,
                                       size_t count)
{
    for (size_t i = 0; i < count; i++) {
        const em_gpu_send_recv *t = &transfers[i];
        EM_GPU_NCCL(ncclSend, (t->source, t->bytes, ncclUint8, t->destination_rank,
                               comms[t->source_rank]->comm, t->source_stream->stream));
        EM_GPU_NCCL(ncclRecv, (t->destination, t->bytes, ncclUint8, t->source_rank,
                               comms[t->destination_rank]->comm, t->destination_stream->stream));
    }
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_comm_exchange(em_gpu_comm *const *comms,
                                              const em_gpu_send_recv *transfers, size_t count)
{
    EM_GPU_NCCL(ncclGroupStart, ());
    em_gpu_status status = enqueue_transfers(comms, transfers, count);
    /* The group is closed even after a failed enqueue. */
    em_gpu_status ended = nccl_status(ncclGroupEnd(), "ncclGroupEnd");
    return status.code != 0 ? status : ended;
}
