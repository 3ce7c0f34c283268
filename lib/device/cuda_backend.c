/*
 * DESIGN: assembling the CUDA backend: the exchange, then one device per GPU.
 *
 * Options are checked and resolved first (GPU list), so a bad option fails before any
 * GPU memory is taken. With several GPUs NCCL initialises first and opens its
 * connections, so its buffers come out of the free memory before the pools do; each
 * device then takes its whole pool at once (pool size from the free memory left when
 * not given). When NCCL cannot initialise (or the options ask for it) the host-staged
 * exchange serves, and the backend says why (exchange_fallback).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lib/device/backend.h"
#include "lib/device/cuda_device.h"

#define MEBIBYTE (UINT64_C(1) << 20)
#define DEFAULT_MEMORY_FRACTION 0.8
#define DEFAULT_LANES 2u
#define DEFAULT_STAGING_BYTES (16 * MEBIBYTE)
#define DEFAULT_PINNED_BUFFER_BYTES (1024 * MEBIBYTE)
/* Pinned buffers are reserved this much at a time, as requests need them. */
#define PINNED_REGION_BYTES (64 * MEBIBYTE)
/* Below this a pool cannot hold a useful table; also the staging floor. */
#define MIN_POOL_BYTES (16 * MEBIBYTE)
#define DEFAULT_MAP_SEGMENT_SLOTS ((uint64_t)1 << 22)
#define MIN_MAP_SEGMENT_SLOTS ((uint64_t)1 << 10)
#define MAX_MAP_SEGMENT_SLOTS ((uint64_t)1 << 30)
/* Entries of an eviction's windows from which the GPU chooses: about where its passes
 * cost what the host's choice does. The host took about 15 ns an entry (H200 host,
 * tests/bench/RESULTS.md), besides the copy of 32 bytes an entry back. The GPU's choice
 * is 9 to 16 counting launches (one a byte of the policy's order it reads) and about 6
 * more, some 15 to 22 at about 5.5 us each (the figure the first default of 16,384 was
 * set from, for 45): 80 to 120 us, the host's time for 5,500 to 8,000 entries. */
#define DEFAULT_GPU_CHOICE_ENTRIES ((uint64_t)8192)
#define MIN_STAGING_BYTES (UINT64_C(64) << 10)
#define MAX_STAGING_BYTES (UINT64_C(4) << 30)
/* Pools are whole mebibytes. */
#define POOL_GRANULE MEBIBYTE

void em_cuda_backend_options_init(em_cuda_backend_options *options)
{
    memset(options, 0, sizeof(*options));
    options->memory_fraction = DEFAULT_MEMORY_FRACTION;
    options->lanes = DEFAULT_LANES;
    options->staging_bytes = DEFAULT_STAGING_BYTES;
    options->map_segment_slots = DEFAULT_MAP_SEGMENT_SLOTS;
    options->pinned_buffer_bytes = DEFAULT_PINNED_BUFFER_BYTES;
}

/* Whether this machine has an NVIDIA kernel driver or an NVIDIA device node: with
 * neither, a missing driver means no GPU is there; with one, it means a broken or too
 * old installation. */
static bool nvidia_driver_installed(void)
{
    return access("/proc/driver/nvidia/version", F_OK) == 0 ||
           access("/dev/nvidiactl", F_OK) == 0 || access("/dev/nvidia0", F_OK) == 0;
}

/* Why em_gpu_device_count failed: NOT_FOUND when no GPU is visible (none there, or
 * hidden by CUDA_VISIBLE_DEVICES), UNAVAILABLE naming what is wrong when one is there
 * but cannot be used (driver older than the runtime, stub library). */
static em_status device_count_failed(em_gpu_status status, em_error *err)
{
    bool driver_missing = status.code == EM_GPU_ERROR_INSUFFICIENT_DRIVER ||
                          status.code == EM_GPU_ERROR_STUB_LIBRARY;
    if (status.code == EM_GPU_ERROR_NO_DEVICE)
        return em_error_set(err, EM_NOT_FOUND, "no GPU is visible: %s: %s (error %d)",
                            status.call, status.message, status.code);
    if (driver_missing && !nvidia_driver_installed())
        return em_error_set(err, EM_NOT_FOUND,
                            "no GPU is visible: no NVIDIA driver is installed (%s: %s, error %d)",
                            status.call, status.message, status.code);
    if (driver_missing) {
        int driver = 0, runtime = 0;
        (void)em_gpu_versions(&driver, &runtime);
        if (driver == 0)
            return em_error_set(err, EM_UNAVAILABLE,
                                "an NVIDIA driver is installed but unusable: %s: %s (error %d); "
                                "its libcuda.so.1 could not be loaded (this build needs CUDA "
                                "%d.%d)",
                                status.call, status.message, status.code, runtime / 1000,
                                runtime % 1000 / 10);
        return em_error_set(err, EM_UNAVAILABLE,
                            "an NVIDIA driver is installed but unusable: %s: %s (error %d); "
                            "the driver supports CUDA %d.%d, this build needs CUDA %d.%d",
                            status.call, status.message, status.code, driver / 1000,
                            driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
    }
    return em_error_set(err, EM_UNAVAILABLE, "no usable CUDA device: %s failed: %s (error %d)",
                        status.call, status.message, status.code);
}

/* The visible GPUs this build's kernels run on, in ordinal order (at most
 * EM_BACKEND_MAX_DEVICES); *visible gets every visible GPU. */
static em_status usable_gpus(uint32_t *ordinals, uint32_t *count, uint32_t *visible,
                             em_error *err)
{
    int found = 0;
    *count = *visible = 0;
    em_gpu_status status = em_gpu_device_count(&found);
    if (status.code != 0)
        return device_count_failed(status, err);
    if (found <= 0)
        return em_error_set(err, EM_NOT_FOUND, "no GPU is visible");
    *visible = (uint32_t)found;
    em_gpu_status refused = {0, 0, NULL, NULL, 0};
    for (int ordinal = 0; ordinal < found && *count < EM_BACKEND_MAX_DEVICES; ordinal++) {
        status = em_gpu_kernels_supported(ordinal);
        if (status.code == 0)
            ordinals[(*count)++] = (uint32_t)ordinal;
        else if (refused.code == 0)
            refused = status;
    }
    if (*count == 0) {
        em_gpu_device_info info;
        memset(&info, 0, sizeof(info));
        (void)em_gpu_device_info_get(0, &info);
        return em_error_set(err, EM_UNAVAILABLE,
                            "no usable CUDA device: %d visible (GPU 0: %s, sm_%u%u), but this "
                            "build's kernels run on none of them (%s: %s); rebuild with "
                            "-Dgpu_architectures naming it",
                            found, info.name, info.compute_major, info.compute_minor,
                            refused.call, refused.message);
    }
    return EM_OK;
}

em_status em_cuda_available(uint32_t *device_count, em_error *err)
{
    uint32_t ordinals[EM_BACKEND_MAX_DEVICES], visible = 0;
    return usable_gpus(ordinals, device_count, &visible, err);
}

static em_status check_device_list(const em_cuda_backend_options *options, uint32_t visible,
                                   em_error *err)
{
    if (options->device_count > EM_BACKEND_MAX_DEVICES)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "cuda backend: %u devices listed, at most %d",
                            options->device_count, EM_BACKEND_MAX_DEVICES);
    for (uint32_t i = 0; i < options->device_count; i++) {
        if (options->devices[i] >= visible)
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "cuda backend: devices[%u] = %u, but %u GPUs are visible", i,
                                options->devices[i], visible);
        for (uint32_t j = 0; j < i && !options->shared_gpus; j++)
            if (options->devices[j] == options->devices[i])
                return em_error_set(err, EM_INVALID_ARGUMENT,
                                    "cuda backend: GPU %u is listed twice (devices[%u] and "
                                    "devices[%u])", options->devices[i], j, i);
    }
    return EM_OK;
}

static em_status check_options(const em_cuda_backend_options *options, uint32_t visible,
                               em_error *err)
{
    em_status status = check_device_list(options, visible, err);
    if (status != EM_OK)
        return status;
    if (options->pool_bytes == 0 &&
        !(options->memory_fraction > 0.0 && options->memory_fraction <= 1.0))
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "cuda backend: memory_fraction %g must be in (0, 1]",
                            options->memory_fraction);
    if (options->pool_bytes != 0 && options->pool_bytes < MIN_POOL_BYTES)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "cuda backend: pool_bytes %llu is below the minimum %llu",
                            (unsigned long long)options->pool_bytes,
                            (unsigned long long)MIN_POOL_BYTES);
    if (options->lanes < 1 || options->lanes > EM_CUDA_MAX_LANES)
        return em_error_set(err, EM_INVALID_ARGUMENT, "cuda backend: lanes %u must be 1..%d",
                            options->lanes, EM_CUDA_MAX_LANES);
    if (options->staging_bytes < MIN_STAGING_BYTES || options->staging_bytes > MAX_STAGING_BYTES)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "cuda backend: staging_bytes %llu must be %llu .. %llu",
                            (unsigned long long)options->staging_bytes,
                            (unsigned long long)MIN_STAGING_BYTES,
                            (unsigned long long)MAX_STAGING_BYTES);
    uint64_t segment = options->map_segment_slots;
    if (segment < MIN_MAP_SEGMENT_SLOTS || segment > MAX_MAP_SEGMENT_SLOTS ||
        (segment & (segment - 1)) != 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "cuda backend: map_segment_slots %llu must be a power of two in "
                            "%llu .. %llu",
                            (unsigned long long)segment,
                            (unsigned long long)MIN_MAP_SEGMENT_SLOTS,
                            (unsigned long long)MAX_MAP_SEGMENT_SLOTS);
    return EM_OK;
}

/* The pool of GPU ordinal: as configured, or the fraction of its free memory now. */
static em_status pool_bytes_for(const em_cuda_backend_options *options, int ordinal,
                                uint64_t *bytes, em_error *err)
{
    if (options->pool_bytes != 0) {
        *bytes = options->pool_bytes;
        return EM_OK;
    }
    uint64_t free_bytes = 0, total_bytes = 0;
    char where[32];
    snprintf(where, sizeof(where), "cuda:%d", ordinal);
    em_status status = em__cuda_check(em_gpu_memory_info(ordinal, &free_bytes, &total_bytes),
                                      where, err);
    if (status != EM_OK)
        return status;
    *bytes = (uint64_t)((double)free_bytes * options->memory_fraction) / POOL_GRANULE *
             POOL_GRANULE;
    if (*bytes < MIN_POOL_BYTES)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "%s: %llu bytes free, memory_fraction %g gives a pool below the "
                            "minimum %llu bytes",
                            where, (unsigned long long)free_bytes, options->memory_fraction,
                            (unsigned long long)MIN_POOL_BYTES);
    return EM_OK;
}

/* Pinned host memory for the host buffers (cudaHostAlloc, portable: every GPU copies
 * it directly). The pool wants 256-byte aligned bases: the region starts inside the
 * allocation, and the word before it remembers where the allocation began. */
static em_status pinned_reserve(void *context, size_t bytes, uintptr_t *base, em_error *err)
{
    (void)context;
    void *raw = NULL;
    em_status status = em__cuda_check(em_gpu_host_alloc(bytes + 2 * EM_POOL_ALIGNMENT, &raw),
                                      "pinned host buffers", err);
    if (status != EM_OK) {
        em_error_prefix(err, "%zu bytes: ", bytes);
        return status;
    }
    uintptr_t start = ((uintptr_t)raw + sizeof(void *) + EM_POOL_ALIGNMENT - 1) /
                      EM_POOL_ALIGNMENT * EM_POOL_ALIGNMENT;
    memcpy((void *)(start - sizeof(void *)), &raw, sizeof(void *));
    *base = start;
    return EM_OK;
}

static void pinned_release(void *context, uintptr_t base, size_t bytes)
{
    (void)context;
    (void)bytes;
    void *raw = NULL;
    memcpy(&raw, (const void *)(base - sizeof(void *)), sizeof(void *));
    em_gpu_host_free(raw);
}

static em_status create_host_buffers(const em_cuda_backend_options *options,
                                     em_host_buffers **out, em_error *err)
{
    *out = NULL;
    if (options->pinned_buffer_bytes == 0)
        return EM_OK;
    em_host_buffers_options buffers = {
        .name = "pinned request buffers",
        .limit_bytes = options->pinned_buffer_bytes,
        .region_bytes = PINNED_REGION_BYTES,
        .provider = {.reserve = pinned_reserve, .release = pinned_release},
    };
    return em_host_buffers_create(&buffers, out, err);
}

/* Device index on GPU ordinals[index] (shared_gpus: the devices listed before it on the
 * same GPU make it cuda:<ordinal>#<n>). */
static em_status create_device(const em_cuda_backend_options *options, uint32_t index,
                               const uint32_t *ordinals, em_host_buffers *host_buffers,
                               em_device **out, em_error *err)
{
    int ordinal = (int)ordinals[index];
    uint32_t sharing = 0;
    for (uint32_t j = 0; j < index; j++)
        sharing += ordinals[j] == ordinals[index];
    em__cuda_device_options device_options = {
        .ordinal = ordinal,
        .sharing = sharing,
        .lanes = options->lanes,
        .staging_bytes = options->staging_bytes,
        .host_buffers = host_buffers,
        .map_segment_slots = options->map_segment_slots,
        .gpu_choice_entries = options->gpu_choice_entries != 0 ? options->gpu_choice_entries
                                                               : DEFAULT_GPU_CHOICE_ENTRIES,
    };
    em_status status = pool_bytes_for(options, ordinal, &device_options.pool_bytes, err);
    if (status == EM_OK)
        status = em__cuda_device_create(index, &device_options, out, err);
    return status;
}

static void destroy_devices(em_device **devices, uint32_t count)
{
    for (uint32_t i = 0; devices != NULL && i < count; i++)
        if (devices[i] != NULL)
            devices[i]->ops->destroy(devices[i]);
    free(devices);
}

/* The index of the first device listed before i on the same GPU; i when none is. */
static uint32_t first_on_gpu(const uint32_t *ordinals, uint32_t i)
{
    uint32_t j = 0;
    while (ordinals[j] != ordinals[i])
        j++;
    return j;
}

/* NCCL with several GPUs, created before the pools so that its buffers and
 * connections come out of the free memory first; *fallback gets why it could not be
 * had (then the host-staged exchange serves). */

static em_exchange *try_nccl(const em_cuda_backend_options *options, const uint32_t *ordinals,
                             uint32_t count, em_error *fallback)
{
    fallback->status = EM_OK;
    fallback->message[0] = '\0';
    if (count < 2 || options->host_staged_exchange)
        return NULL;
    for (uint32_t i = 1; i < count; i++)
        if (first_on_gpu(ordinals, i) != i) {
            em_error_set(fallback, EM_FAILED_PRECONDITION,
                         "GPU %u holds devices %u and %u (shared_gpus): NCCL takes one GPU "
                         "per rank", ordinals[i], first_on_gpu(ordinals, i), i);
            return NULL;
        }
    em_exchange *exchange = NULL;
    if (em_exchange_create_nccl(ordinals, count, &exchange, fallback) != EM_OK)
        return NULL;
    return exchange;
}

em_status em_backend_create_cuda(const em_cuda_backend_options *options, em_backend **out,
                                 em_error *err)
{
    uint32_t usable[EM_BACKEND_MAX_DEVICES], usable_count = 0, visible = 0;
    em_status status = usable_gpus(usable, &usable_count, &visible, err);
    if (status == EM_OK)
        status = check_options(options, visible, err);
    if (status != EM_OK)
        return status;
    /* No list: every GPU the kernels run on. A listed GPU they cannot run on fails
     * when its device is created, with its name and architecture. */
    uint32_t count = options->device_count == 0 ? usable_count : options->device_count;
    const uint32_t *ordinals = options->device_count == 0 ? usable : options->devices;
    em_error fallback;
    em_exchange *exchange = try_nccl(options, ordinals, count, &fallback);
    if (exchange == NULL && fallback.status == EM_UNAVAILABLE) {
        /* the GPU itself failed (a lost context), not NCCL: nothing can serve */
        *err = fallback;
        return EM_UNAVAILABLE;
    }
    em_host_buffers *host_buffers = NULL;
    em_device **devices = calloc(count, sizeof(*devices));
    if (devices == NULL)
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "cuda backend: out of host memory");
    if (status == EM_OK)
        status = create_host_buffers(options, &host_buffers, err);
    for (uint32_t i = 0; i < count && status == EM_OK; i++)
        status = create_device(options, i, ordinals, host_buffers, &devices[i], err);
    if (status == EM_OK && exchange == NULL)
        status = em_exchange_create_host_staged(&exchange, err);
    if (status == EM_OK)
        status = em_backend_assemble("cuda", devices, count, exchange, out, err);
    if (status != EM_OK) {
        em_exchange_destroy(exchange);
        destroy_devices(devices, count);
        em_host_buffers_destroy(host_buffers);
        return status;
    }
    (*out)->host_buffers = host_buffers;
    if (fallback.status != EM_OK)
        snprintf((*out)->exchange_fallback, sizeof((*out)->exchange_fallback), "%s",
                 fallback.message);
    return EM_OK;
}
