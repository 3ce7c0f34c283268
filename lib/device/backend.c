#include "lib/device/backend.h"

#include <stdlib.h>
#include <unistd.h>

#include "lib/base/parallel.h"

#define MEBIBYTE (UINT64_C(1) << 20)
#define DEFAULT_INITIAL_BYTES (64 * MEBIBYTE)
#define DEFAULT_GROWTH_BYTES (256 * MEBIBYTE)
/* A request evicts from 8 shards at once at most by default: beyond that, memory
 * bandwidth, not threads, limits the walks. */
#define DEFAULT_EVICTION_THREADS_MAX 8u

static uint64_t physical_memory_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES);
    long page_size = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page_size <= 0)
        return UINT64_C(4) << 30;
    return (uint64_t)pages * (uint64_t)page_size;
}

void em_cpu_backend_options_init(em_cpu_backend_options *options)
{
    options->devices = 1;
    options->pool_limit_bytes = 0;
    options->pool_initial_bytes = DEFAULT_INITIAL_BYTES;
    options->pool_growth_bytes = DEFAULT_GROWTH_BYTES;
    options->eviction_threads = 0;
}

static em_status resolve_cpu_options(const em_cpu_backend_options *given,
                                     em_cpu_backend_options *resolved, em_error *err)
{
    *resolved = *given;
    if (given->devices < 1 || given->devices > EM_BACKEND_MAX_DEVICES)
        return em_error_set(err, EM_INVALID_ARGUMENT, "cpu backend: devices must be 1..%d, got %u",
                            EM_BACKEND_MAX_DEVICES, given->devices);
    if (resolved->pool_limit_bytes == 0)
        resolved->pool_limit_bytes = physical_memory_bytes() / 2 / given->devices;
    if (resolved->pool_initial_bytes > resolved->pool_limit_bytes)
        resolved->pool_initial_bytes = resolved->pool_limit_bytes;
    if (resolved->eviction_threads == 0) {
        uint32_t cpus = em_parallel_cpus();
        resolved->eviction_threads = cpus < DEFAULT_EVICTION_THREADS_MAX
                                         ? cpus
                                         : DEFAULT_EVICTION_THREADS_MAX;
    }
    return EM_OK;
}

em_status em_backend_assemble(const char *kind, em_device **devices, uint32_t count,
                              em_exchange *exchange, em_backend **out, em_error *err)
{
    em_backend *backend = calloc(1, sizeof(*backend));
    if (backend == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "%s backend: out of memory", kind);
    backend->kind = kind;
    backend->devices = devices;
    backend->device_count = count;
    backend->exchange = exchange;
    atomic_init(&backend->next_home, 0);
    backend->workers = em_parallel_pool_create(UINT32_MAX); /* as many as runs ask */
    *out = backend;
    return EM_OK;
}

static void destroy_devices(em_device **devices, uint32_t count)
{
    for (uint32_t i = 0; i < count; i++)
        if (devices[i] != NULL)
            devices[i]->ops->destroy(devices[i]);
    free(devices);
}

em_status em_backend_create_cpu(const em_cpu_backend_options *options, em_backend **out,
                                em_error *err)
{
    em_cpu_backend_options resolved;
    em_status status = resolve_cpu_options(options, &resolved, err);
    if (status != EM_OK)
        return status;
    em_device **devices = calloc(resolved.devices, sizeof(*devices));
    if (devices == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "cpu backend: out of memory");
    for (uint32_t i = 0; i < resolved.devices && status == EM_OK; i++)
        status = em_cpu_device_create(i, &resolved, &devices[i], err);
    em_exchange *exchange = NULL;
    if (status == EM_OK)
        status = em_exchange_create_host_staged(&exchange, err);
    if (status == EM_OK)
        status = em_backend_assemble("cpu", devices, resolved.devices, exchange, out, err);
    if (status != EM_OK) {
        em_exchange_destroy(exchange);
        destroy_devices(devices, resolved.devices);
        return status;
    }
    (*out)->eviction_threads = resolved.eviction_threads;
    return EM_OK;
}

void em_backend_destroy(em_backend *backend)
{
    if (backend == NULL)
        return;
    em_exchange_destroy(backend->exchange);
    for (uint32_t i = 0; i < backend->device_count; i++)
        em_device_scratch_drop(backend->devices[i]);
    destroy_devices(backend->devices, backend->device_count);
    em_host_buffers_destroy(backend->host_buffers);
    em_parallel_pool_destroy(backend->workers);
    free(backend);
}

em_device *em_backend_home_device(em_backend *backend)
{
    if (backend->device_count == 1)
        return backend->devices[0];
    uint32_t turn = atomic_fetch_add_explicit(&backend->next_home, 1, memory_order_relaxed);
    return backend->devices[turn % backend->device_count];
}

uint32_t em_backend_shard_device(const em_backend *backend, uint32_t shard, uint32_t shard_count)
{
    return (uint32_t)((uint64_t)shard * backend->device_count / shard_count);
}
