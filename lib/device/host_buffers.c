/*
 * DESIGN: host buffers (contract in host_buffers.h). The pinned pool is an em_pool
 * whose provider is the backend's; this file wraps the provider to remember each region
 * it reserves, for the lock-free range check, and falls back to aligned_alloc.
 */
#include "lib/device/host_buffers.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct pinned_region {
    uintptr_t base;
    size_t bytes;
} pinned_region;

struct em_host_buffers {
    em_pool *pool;
    em_pool_region_provider provider; /* the backend's */
    size_t limit_bytes;
    /* regions[0..region_count): appended under the pool's lock (reserve runs with it
     * held), read without a lock */
    pinned_region regions[EM_HOST_BUFFER_REGIONS];
    _Atomic uint32_t region_count;
    _Atomic uint64_t pinned_allocations, unpinned_allocations;
    _Atomic uint64_t bytes_direct, bytes_staged;
};

static em_status remember_reserve(void *context, size_t bytes, uintptr_t *base, em_error *err)
{
    em_host_buffers *buffers = context;
    uint32_t count = atomic_load_explicit(&buffers->region_count, memory_order_relaxed);
    if (count == EM_HOST_BUFFER_REGIONS)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "pinned host buffers: %d regions",
                            EM_HOST_BUFFER_REGIONS);
    em_status status = buffers->provider.reserve(buffers->provider.context, bytes, base, err);
    if (status != EM_OK)
        return status;
    buffers->regions[count] = (pinned_region){*base, bytes};
    atomic_store_explicit(&buffers->region_count, count + 1, memory_order_release);
    return EM_OK;
}

static void remember_release(void *context, uintptr_t base, size_t bytes)
{
    em_host_buffers *buffers = context;
    /* only at destroy: the pool releases regions when it goes */
    buffers->provider.release(buffers->provider.context, base, bytes);
}

em_status em_host_buffers_create(const em_host_buffers_options *options, em_host_buffers **out,
                                 em_error *err)
{
    if (options->limit_bytes == 0 || options->provider.reserve == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "pinned host buffers: a limit above 0 and a provider are needed");
    em_host_buffers *buffers = calloc(1, sizeof(*buffers));
    if (buffers == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "pinned host buffers: out of memory");
    buffers->provider = options->provider;
    buffers->limit_bytes = options->limit_bytes;
    size_t region = options->region_bytes;
    size_t fewest = (options->limit_bytes + EM_HOST_BUFFER_REGIONS - 1) / EM_HOST_BUFFER_REGIONS;
    if (region < fewest)
        region = fewest;
    if (region > options->limit_bytes)
        region = options->limit_bytes;
    em_pool_options pool = {
        .name = options->name != NULL ? options->name : "pinned",
        .initial_bytes = 0,
        .growth_bytes = region,
        .limit_bytes = options->limit_bytes,
        .provider = {.reserve = remember_reserve, .release = remember_release,
                     .context = buffers},
    };
    em_status status = em_pool_create(&pool, &buffers->pool, err);
    if (status != EM_OK) {
        free(buffers);
        em_error_prefix(err, "pinned host buffers: ");
        return status;
    }
    *out = buffers;
    return EM_OK;
}

void em_host_buffers_destroy(em_host_buffers *buffers)
{
    if (buffers == NULL)
        return;
    em_pool_destroy(buffers->pool);
    free(buffers);
}

void *em_host_buffer_alloc(em_host_buffers *buffers, size_t bytes)
{
    size_t rounded = (bytes + EM_HOST_BUFFER_ALIGNMENT - 1) / EM_HOST_BUFFER_ALIGNMENT *
                     EM_HOST_BUFFER_ALIGNMENT;
    if (rounded == 0)
        rounded = EM_HOST_BUFFER_ALIGNMENT;
    if (buffers != NULL) {
        uintptr_t address = 0;
        if (em_pool_alloc(buffers->pool, rounded, &address, NULL) == EM_OK) {
            atomic_fetch_add_explicit(&buffers->pinned_allocations, 1, memory_order_relaxed);
            return (void *)address;
        }
        atomic_fetch_add_explicit(&buffers->unpinned_allocations, 1, memory_order_relaxed);
    }
    return aligned_alloc(EM_HOST_BUFFER_ALIGNMENT, rounded);
}

void em_host_buffer_free(em_host_buffers *buffers, void *pointer)
{
    if (pointer == NULL)
        return;
    if (em_host_buffer_pinned(buffers, pointer, 1))
        em_pool_free(buffers->pool, (uintptr_t)pointer, NULL);
    else
        free(pointer);
}

bool em_host_buffer_pinned(const em_host_buffers *buffers, const void *pointer, size_t bytes)
{
    if (buffers == NULL)
        return false;
    uintptr_t start = (uintptr_t)pointer;
    uint32_t count = atomic_load_explicit(&buffers->region_count, memory_order_acquire);
    for (uint32_t r = 0; r < count; r++) {
        const pinned_region *region = &buffers->regions[r];
        if (start >= region->base && start - region->base <= region->bytes &&
            bytes <= region->bytes - (start - region->base))
            return true;
    }
    return false;
}

void em_host_buffers_count_copy(em_host_buffers *buffers, bool direct, uint64_t bytes)
{
    if (buffers != NULL)
        atomic_fetch_add_explicit(direct ? &buffers->bytes_direct : &buffers->bytes_staged, bytes,
                                  memory_order_relaxed);
}

void em_host_buffers_get_stats(em_host_buffers *buffers, em_host_buffers_stats *out)
{
    memset(out, 0, sizeof(*out));
    if (buffers == NULL)
        return;
    em_pool_stats pool;
    em_pool_get_stats(buffers->pool, &pool);
    out->pinned_bytes_in_use = pool.bytes_in_use;
    out->pinned_bytes_reserved = pool.bytes_reserved;
    out->pinned_bytes_limit = buffers->limit_bytes;
    out->pinned_allocations =
        atomic_load_explicit(&buffers->pinned_allocations, memory_order_relaxed);
    out->unpinned_allocations =
        atomic_load_explicit(&buffers->unpinned_allocations, memory_order_relaxed);
    out->bytes_copied_directly = atomic_load_explicit(&buffers->bytes_direct, memory_order_relaxed);
    out->bytes_copied_staged = atomic_load_explicit(&buffers->bytes_staged, memory_order_relaxed);
}
