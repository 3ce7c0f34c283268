#include "lib/device.h"

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
