/*
 * DESIGN: a host-memory allocator handle.
 *
 * Components that keep host-addressable arrays (the CPU hash map, CPU row storage)
 * take their memory through this pair of callbacks instead of calling malloc, so the
 * CPU backend can point them at its device pool and have every byte show in the pool
 * statistics and count against the pool limit. A zeroed em_allocator means malloc.
 */
#ifndef EMBER_LIB_ALLOCATOR_H
#define EMBER_LIB_ALLOCATOR_H

#include <stddef.h>

#include "lib/base/status.h"

typedef struct em_allocator {
    /* Stores a block of at least bytes (aligned to 64 bytes or more) in *out, or fails
     * with RESOURCE_EXHAUSTED and a message. */
    em_status (*alloc)(void *context, size_t bytes, void **out, em_error *err);
    void (*free)(void *context, void *pointer);
    void *context;
} em_allocator;

/* Allocates through allocator, or with aligned_alloc when allocator is NULL or zeroed.
 * Errors: RESOURCE_EXHAUSTED naming what (a short noun phrase) and the byte count. */
em_status em_allocator_alloc(const em_allocator *allocator, size_t bytes, const char *what,
                             void **out, em_error *err);

/* Frees a block from em_allocator_alloc with the same allocator. NULL is ignored. */
void em_allocator_free(const em_allocator *allocator, void *pointer);

#endif
