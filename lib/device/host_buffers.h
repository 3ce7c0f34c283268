/*
 * DESIGN: host buffers for request data that a device copies straight from or into.
 *
 * The daemon reads a request's attachment (keys, offsets, gradients) into a host
 * buffer, and a pull's answer is gathered into another. A GPU copies pinned (page-
 * locked) host memory by DMA, at the bus's full speed and without the host copy through
 * a lane's staging buffer; pageable memory has to go through staging. So a backend with
 * GPUs gives the daemon a pool of pinned memory to take those buffers from
 * (em_host_buffers), and its devices copy buffers that lie in it directly.
 *
 * Pinned memory is scarce (it is taken out of the kernel's paging), so the pool has a
 * limit; a buffer it cannot hold comes from malloc instead and takes the staged path,
 * which is slower but never fails for that reason. Without a pool (the CPU backend, or
 * a limit of 0) every buffer comes from malloc. em_host_buffer_free takes either kind.
 *
 * Thread-safe: the pool has its own lock, and the pinned regions are only ever added
 * (up to EM_HOST_BUFFER_REGIONS) and published with release order, so the range check
 * takes no lock.
 */
#ifndef EMBER_LIB_DEVICE_HOST_BUFFERS_H
#define EMBER_LIB_DEVICE_HOST_BUFFERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lib/base/status.h"
#include "lib/memory/pool.h"

/* Alignment of every buffer, pinned or not (rows of floats and keys are read with
 * vector loads). */
#define EM_HOST_BUFFER_ALIGNMENT ((size_t)64)

/* Most pinned regions a pool reserves. */
#define EM_HOST_BUFFER_REGIONS 64

typedef struct em_host_buffers em_host_buffers;

typedef struct em_host_buffers_options {
    const char *name;        /* for messages, e.g. "pinned" */
    size_t limit_bytes;      /* most pinned bytes reserved (> 0) */
    size_t region_bytes;     /* each pinned region (the limit is reached in at most
                              * EM_HOST_BUFFER_REGIONS regions: larger ones if needed) */
    em_pool_region_provider provider; /* pinned host memory (256-byte aligned bases) */
} em_host_buffers_options;

typedef struct em_host_buffers_stats {
    uint64_t pinned_bytes_in_use;
    uint64_t pinned_bytes_reserved;
    uint64_t pinned_bytes_limit;
    uint64_t pinned_allocations;   /* buffers served from pinned memory since create */
    uint64_t unpinned_allocations; /* buffers that found the pool full: malloc */
    uint64_t bytes_copied_directly; /* host <-> device copies of pinned buffers (DMA) */
    uint64_t bytes_copied_staged;   /* of other host memory, through staging */
} em_host_buffers_stats;

/* Reserves nothing yet: regions come as buffers need them. Errors: INVALID_ARGUMENT,
 * RESOURCE_EXHAUSTED. */
em_status em_host_buffers_create(const em_host_buffers_options *options, em_host_buffers **out,
                                 em_error *err);

/* Releases the pinned regions; every pinned buffer must have been freed. NULL is
 * ignored. */
void em_host_buffers_destroy(em_host_buffers *buffers);

/* A buffer of bytes (0 allowed), aligned to EM_HOST_BUFFER_ALIGNMENT: pinned when
 * buffers is not NULL and its pool has room, else from malloc. NULL when out of memory. */
void *em_host_buffer_alloc(em_host_buffers *buffers, size_t bytes);

/* Frees a buffer of em_host_buffer_alloc from the same buffers, or any malloc'ed
 * pointer; NULL is ignored. */
void em_host_buffer_free(em_host_buffers *buffers, void *pointer);

/* Whether [pointer, pointer + bytes) lies in one pinned region of buffers (false for
 * NULL buffers). */
bool em_host_buffer_pinned(const em_host_buffers *buffers, const void *pointer, size_t bytes);

/* Counts a host <-> device copy a device made directly (a pinned buffer) or through
 * its staging; NULL buffers is ignored. */
void em_host_buffers_count_copy(em_host_buffers *buffers, bool direct, uint64_t bytes);

/* Zeroes for NULL buffers. */
void em_host_buffers_get_stats(em_host_buffers *buffers, em_host_buffers_stats *out);

#endif
