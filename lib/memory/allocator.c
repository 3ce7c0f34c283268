#include "lib/memory/allocator.h"

#include <stdlib.h>

/* Default alignment: a cache line, enough for the 16-byte slots and SIMD rows. */
#define DEFAULT_ALIGNMENT ((size_t)64)

static int uses_callbacks(const em_allocator *allocator)
{
    return allocator != NULL && allocator->alloc != NULL;
}

em_status em_allocator_alloc(const em_allocator *allocator, size_t bytes, const char *what,
                             void **out, em_error *err)
{
    if (uses_callbacks(allocator)) {
        em_status status = allocator->alloc(allocator->context, bytes, out, err);
        if (status != EM_OK)
            return em_error_prefix(err, "%s (%zu bytes): ", what, bytes);
        return EM_OK;
    }
    size_t rounded = (bytes + DEFAULT_ALIGNMENT - 1) / DEFAULT_ALIGNMENT * DEFAULT_ALIGNMENT;
    void *block = aligned_alloc(DEFAULT_ALIGNMENT, rounded == 0 ? DEFAULT_ALIGNMENT : rounded);
    if (block == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "%s (%zu bytes): out of host memory",
                            what, bytes);
    *out = block;
    return EM_OK;
}

void em_allocator_free(const em_allocator *allocator, void *pointer)
{
    if (pointer == NULL)
        return;
    if (uses_callbacks(allocator))
        allocator->free(allocator->context, pointer);
    else
        free(pointer);
}
