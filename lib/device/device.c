#include "lib/device/device.h"

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

/* Row padding and the bounds of rows per block (see em_row_blocks_plan). */
#define ROW_ALIGN_FLOATS 4u
#define MIN_BLOCK_ROWS 16u
#define MAX_BLOCK_ROWS 65536u

em_row_blocks em_row_blocks_plan(uint32_t dim, int optimizer_kind, size_t target_block_bytes)
{
    em_row_blocks plan;
    plan.row_floats = dim + em_optimizer_state_floats(optimizer_kind, dim);
    plan.stride = (plan.row_floats + ROW_ALIGN_FLOATS - 1) / ROW_ALIGN_FLOATS * ROW_ALIGN_FLOATS;
    size_t row_bytes = (size_t)plan.stride * sizeof(float);
    uint32_t rows = MIN_BLOCK_ROWS;
    plan.block_shift = 4; /* log2(MIN_BLOCK_ROWS) */
    while (rows < MAX_BLOCK_ROWS && (size_t)rows * 2 * row_bytes <= target_block_bytes) {
        rows *= 2;
        plan.block_shift++;
    }
    plan.block_mask = rows - 1;
    plan.block_bytes = (size_t)rows * row_bytes;
    return plan;
}
