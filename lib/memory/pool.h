/*
 * DESIGN: the per-device pool allocator (best fit with coalescing).
 *
 * Each device owns one pool. The pool sub-allocates a few large regions that its
 * region provider hands it (host memory for the CPU backend, cudaMalloc'ed device
 * memory for the CUDA backend). It deals only in addresses: it never reads or writes
 * the bytes it manages, so the same code serves both kinds of memory, and all of its
 * bookkeeping lives in host memory.
 *
 * Every allocation is rounded up to EM_POOL_ALIGNMENT bytes and starts on such a
 * boundary. Free chunks sit in size-class bins (powers of two from 256 bytes, as in
 * TensorFlow's BFC allocator); inside a bin they are ordered by (size, address), so
 * allocation takes the smallest free chunk that fits (best fit; lowest address among
 * equals), splitting off the remainder, and a freed chunk merges at once with free
 * neighbours in the same region. Neither operation walks the list of free chunks:
 * both cost O(log n) in the number of chunks. When no free chunk fits, the pool asks
 * its provider for another region (at least growth_bytes, at least the request),
 * until bytes_reserved would pass limit_bytes; then the allocation fails with
 * EM_RESOURCE_EXHAUSTED and a message carrying the pool's statistics.
 *
 * All functions are thread-safe (one mutex per pool; the provider's reserve is called
 * with it held, so a provider must not call back into the pool).
 */
#ifndef EMBER_LIB_POOL_H
#define EMBER_LIB_POOL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "lib/memory/allocator.h"
#include "lib/base/status.h"

/* Alignment and rounding granule of every allocation, and of region bases. */
#define EM_POOL_ALIGNMENT ((size_t)256)

typedef struct em_pool em_pool;

/* Supplies the large regions a pool carves up. reserve must return a base aligned to
 * EM_POOL_ALIGNMENT or fail with a status and message; release gets back exactly
 * what reserve gave. context is passed to both untouched. */
typedef struct em_pool_region_provider {
    em_status (*reserve)(void *context, size_t bytes, uintptr_t *base, em_error *err);
    void (*release)(void *context, uintptr_t base, size_t bytes);
    void *context;
} em_pool_region_provider;

typedef struct em_pool_options {
    const char *name;      /* used in messages, e.g. "cpu0" or "cuda:1"; copied */
    size_t initial_bytes;  /* first region, reserved by em_pool_create (0: none yet) */
    size_t growth_bytes;   /* minimum size of each later region (0: growth disabled) */
    size_t limit_bytes;    /* bytes_reserved never exceeds this (>= initial_bytes) */
    em_pool_region_provider provider;
} em_pool_options;

/* A pool's numbers, declared once: X(type, name, kind, unit, help) (kind COUNTER or
 * GAUGE; unit NONE, BYTES or RATIO). The struct below is generated from this list, and
 * so are the daemon's stats schema and wire rendering (daemon/stats.h). */
#define EM_POOL_STATS(X)                                                                      \
    X(uint64_t, bytes_in_use, GAUGE, BYTES, "sum of live allocations, rounded sizes")         \
    X(uint64_t, peak_bytes_in_use, GAUGE, BYTES, "highest bytes_in_use since start")          \
    X(uint64_t, bytes_reserved, GAUGE, BYTES, "sum of region sizes")                          \
    X(uint64_t, bytes_limit, GAUGE, BYTES, "most bytes the pool may reserve")                 \
    X(uint64_t, bytes_free, GAUGE, BYTES, "bytes_reserved - bytes_in_use")                    \
    X(uint64_t, largest_free_block, GAUGE, BYTES, "biggest single free chunk")                \
    X(uint64_t, live_allocations, GAUGE, NONE, "allocations not yet freed")                   \
    X(uint64_t, total_allocations, COUNTER, NONE, "successful allocations since start")       \
    X(uint64_t, failed_allocations, COUNTER, NONE, "allocations that returned an error")      \
    X(uint64_t, free_chunks, GAUGE, NONE, "free chunks over all regions")                     \
    X(uint64_t, region_count, GAUGE, NONE, "regions reserved")                                \
    X(double, fragmentation, GAUGE, RATIO,                                                    \
      "1 - largest_free_block / bytes_free; 0 when nothing is free")

typedef struct em_pool_stats {
#define EM_POOL_STATS_FIELD(type, name, kind, unit, help) type name;
    EM_POOL_STATS(EM_POOL_STATS_FIELD)
#undef EM_POOL_STATS_FIELD
} em_pool_stats;

/* One chunk, as the walk and the dump report it. */
typedef struct em_pool_chunk_info {
    uint32_t region;   /* index of the region, in reservation order */
    uintptr_t address;
    size_t size;       /* bytes, a multiple of EM_POOL_ALIGNMENT */
    size_t requested;  /* bytes the caller asked for (0 for free chunks) */
    int in_use;
} em_pool_chunk_info;

/* Host memory regions (mmap), for the CPU backend and tests. context is unused. */
em_pool_region_provider em_pool_host_provider(void);

/* An em_allocator over a pool whose regions are host memory (the CPU backend's): blocks
 * are pool allocations, so they count in the pool statistics. The pool is borrowed and
 * must outlive every block. */
em_allocator em_pool_host_allocator(em_pool *pool);

/* Creates a pool and reserves its initial region. Errors: INVALID_ARGUMENT for
 * inconsistent options (named in the message), whatever the provider returns. */
em_status em_pool_create(const em_pool_options *options, em_pool **out, em_error *err);

/* Releases every region, live allocations included. NULL is ignored. */
void em_pool_destroy(em_pool *pool);

/* Allocates bytes (> 0) and stores the chunk's address in *address. Errors:
 * INVALID_ARGUMENT for 0 bytes; RESOURCE_EXHAUSTED when neither a free chunk nor a new
 * region within the limit can hold the request, with the pool name, the request and
 * the statistics in the message. */
em_status em_pool_alloc(em_pool *pool, size_t bytes, uintptr_t *address, em_error *err);

/* Returns an allocation to the pool. Errors: INVALID_ARGUMENT when address is not the
 * start of a live allocation (double free, foreign pointer); the pool is unchanged. */
em_status em_pool_free(em_pool *pool, uintptr_t address, em_error *err);

/* Rounded size of the live allocation at address, or 0 if there is none. */
size_t em_pool_allocation_size(em_pool *pool, uintptr_t address);

void em_pool_get_stats(em_pool *pool, em_pool_stats *out);

/* Name given at create (owned by the pool). */
const char *em_pool_name(const em_pool *pool);

/* Writes the statistics as one line ("in use 1.5 MiB of 64.0 MiB reserved (limit
 * 1.0 GiB), peak ..., largest free block ..., fragmentation 0.12, ...") into buffer,
 * always NUL-terminated. Returns the length snprintf would have written. */
int em_pool_format_stats(const em_pool_stats *stats, char *buffer, size_t capacity);

/* Calls visit once per chunk in address order, region by region, with the pool
 * locked: visit must not call into the pool. */
void em_pool_walk(em_pool *pool, void (*visit)(void *context, const em_pool_chunk_info *chunk),
                  void *context);

/* Human-readable chunk map (one line per region and per chunk, then the bins and the
 * statistics) for debugging. */
void em_pool_dump(em_pool *pool, FILE *out);

#endif
