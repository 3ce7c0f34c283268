/*
 * DESIGN: zeroed buffers that a request allocates and frees, through malloc. glibc's
 * calloc takes no chunk from the thread's cache of freed chunks that free fills
 * (tcache), so a request that callocs its small buffers finds that cache full of them
 * and frees the next ones into the shared bins, whose upkeep (malloc_consolidate) cost
 * about a tenth of a one-key push. malloc and a memset reuse the cache. free() frees it.
 */
#ifndef EMBER_LIB_BASE_ZEROED_H
#define EMBER_LIB_BASE_ZEROED_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* count zeroed elements of size bytes; NULL when out of memory or when count x size
 * overflows (a count of 0 gets a buffer of one byte). */
static inline void *em_zeroed(size_t count, size_t size)
{
    if (size != 0 && count > SIZE_MAX / size)
        return NULL;
    size_t bytes = count * size > 0 ? count * size : 1;
    void *memory = malloc(bytes);
    /* hidden from the compiler, which would otherwise make the two a calloc again */
    __asm__("" : "+r"(memory));
    if (memory != NULL)
        memset(memory, 0, bytes);
    return memory;
}

#endif
