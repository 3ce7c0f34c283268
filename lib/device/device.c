#include "lib/device/device.h"

#include "lib/base/aligned.h"
#include "lib/base/spread_lock.h"

#include <stdatomic.h>

em_status em_device_alloc(em_device *device, size_t bytes, const char *what, void **out,
                          em_error *err)
{
    uintptr_t address = 0;
    /* Zero-length buffers still get a distinct address so callers need no special case. */
    em_status status = em_pool_alloc(device->pool, bytes == 0 ? 1 : bytes, &address, err);
    if (status != EM_OK)
        return em_error_prefix(err, "%s on %s: ", what, device->name);
    *out = (void *)address;
    return EM_OK;
}

void em_device_free(em_device *device, void *pointer)
{
    if (pointer != NULL)
        em_pool_free(device->pool, (uintptr_t)pointer, NULL);
}

em_device *em_device_allocate(void)
{
    _Static_assert(_Alignof(em_device) <= EM_CACHE_LINE, "em_aligned_calloc aligns enough");
    return em_aligned_calloc(1, sizeof(em_device));
}

/* The slot a thread looks at first: threads numbered in the order they first ask, so
 * that a few threads each find a slot of their own. */
static uint32_t first_scratch_slot(void)
{
    return em_thread_number() % EM_DEVICE_SCRATCH_SLOTS;
}

em_status em_device_scratch_take(em_device *device, const char *what, void **out,
                                 em_error *err)
{
    uint32_t first = first_scratch_slot();
    for (uint32_t i = 0; i < EM_DEVICE_SCRATCH_SLOTS; i++) {
        em_scratch_slot *slot = &device->scratch[(first + i) % EM_DEVICE_SCRATCH_SLOTS];
        if (atomic_load_explicit(&slot->block, memory_order_relaxed) == NULL)
            continue;
        void *block = atomic_exchange_explicit(&slot->block, NULL, memory_order_acquire);
        if (block != NULL) {
            *out = block;
            return EM_OK;
        }
    }
    return em_device_alloc(device, EM_DEVICE_SCRATCH_BLOCK, what, out, err);
}

void em_device_scratch_give(em_device *device, void *block)
{
    uint32_t first = first_scratch_slot();
    for (uint32_t i = 0; i < EM_DEVICE_SCRATCH_SLOTS; i++) {
        em_scratch_slot *slot = &device->scratch[(first + i) % EM_DEVICE_SCRATCH_SLOTS];
        void *empty = NULL;
        if (atomic_load_explicit(&slot->block, memory_order_relaxed) == NULL &&
            atomic_compare_exchange_strong_explicit(&slot->block, &empty, block,
                                                    memory_order_release,
                                                    memory_order_relaxed))
            return;
    }
    em_device_free(device, block);
}

void em_device_scratch_drop(em_device *device)
{
    for (uint32_t i = 0; i < EM_DEVICE_SCRATCH_SLOTS; i++)
        em_device_free(device, atomic_exchange_explicit(&device->scratch[i].block, NULL,
                                                        memory_order_acquire));
}

/* Row padding and the bounds of rows per block (see em_row_blocks_plan). */
#define ROW_ALIGN_FLOATS 4u
#define MIN_BLOCK_ROWS 16u
#define MAX_BLOCK_ROWS 65536u

em_row_blocks em_row_blocks_plan(uint32_t dim, int optimizer_kind, size_t target_block_bytes,
                                 uint64_t expected_rows)
{
    em_row_blocks plan;
    plan.row_floats = dim + em_optimizer_state_floats(optimizer_kind, dim);
    plan.stride = (plan.row_floats + ROW_ALIGN_FLOATS - 1) / ROW_ALIGN_FLOATS * ROW_ALIGN_FLOATS;
    size_t row_bytes = (size_t)plan.stride * sizeof(float);
    uint32_t rows = MIN_BLOCK_ROWS;
    plan.block_shift = 4; /* log2(MIN_BLOCK_ROWS) */
    while (rows < MAX_BLOCK_ROWS && (size_t)rows * 2 * row_bytes <= target_block_bytes &&
           (expected_rows == 0 || rows < expected_rows)) {
        rows *= 2;
        plan.block_shift++;
    }
    plan.block_mask = rows - 1;
    plan.block_bytes = (size_t)rows * row_bytes;
    return plan;
}
