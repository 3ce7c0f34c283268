/*
 * DESIGN: zeroed memory on cache-line boundaries, for structures whose fields are kept
 * on cache lines of their own (_Alignas(64)): malloc's 16-byte alignment would let
 * them straddle lines and break the types' alignment. free() frees it.
 */
#ifndef EMBER_LIB_BASE_ALIGNED_H
#define EMBER_LIB_BASE_ALIGNED_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EM_CACHE_LINE ((size_t)64)

/* count zeroed elements of size bytes, EM_CACHE_LINE aligned; NULL when out of memory
 * or when count x size overflows. */
static inline void *em_aligned_calloc(size_t count, size_t size)
{
    if (count == 0 || size > SIZE_MAX / count || count * size > SIZE_MAX - EM_CACHE_LINE)
        return NULL;
    size_t bytes = (count * size + EM_CACHE_LINE - 1) / EM_CACHE_LINE * EM_CACHE_LINE;
    void *memory = aligned_alloc(EM_CACHE_LINE, bytes);
    if (memory != NULL)
        memset(memory, 0, bytes);
    return memory;
}

#endif
