/*
 * DESIGN: moving a request's per-shard segments between devices.
 *
 * When a table's shards live on several devices, the home device of a request sends
 * each owner device its keys (and gradients), and the owners send gathered vectors
 * back. An exchange runs one such round: a list of transfers, each a byte range from a
 * buffer on one device to a buffer on another, executed as one group (for NCCL,
 * grouped send/recv between the devices' ranks, i.e. an all-to-all). Two
 * implementations share this interface: host-staged (below), used by the CPU backend
 * and whenever NCCL is unavailable, and NCCL in the CUDA backend. Table code only
 * builds transfer lists, so the routing is the same with either.
 */
#ifndef EMBER_LIB_EXCHANGE_H
#define EMBER_LIB_EXCHANGE_H

#include <stddef.h>

#include "lib/device/device.h"
#include "lib/base/status.h"

typedef struct em_transfer {
    em_lane *from;      /* the request's lane on the sending device */
    const void *source; /* in that device's memory */
    em_lane *to;        /* the request's lane on the receiving device */
    void *destination;  /* in that device's memory */
    size_t bytes;
} em_transfer;

typedef struct em_exchange em_exchange;

typedef struct em_exchange_ops {
    /* Runs every transfer; when it returns OK all destinations hold their bytes.
     * Thread-safe. */
    em_status (*run)(em_exchange *exchange, const em_transfer *transfers, size_t count,
                     em_error *err);
    void (*destroy)(em_exchange *exchange);
} em_exchange_ops;

struct em_exchange {
    const em_exchange_ops *ops;
    const char *name; /* "host-staged", "nccl" */
    void *impl;
};

/* Host-staged exchange: direct copies where a side is host-addressable, else through a
 * host staging buffer (grown on demand, one per exchange, guarded by a mutex). */
em_status em_exchange_create_host_staged(em_exchange **out, em_error *err);

/* NCCL exchange between CUDA devices (lib/device/exchange_nccl.c; exists only in builds with
 * the CUDA backend): one communicator per GPU, rank i on GPU ordinals[i], which must be
 * the backend's devices in order, with every connection opened (so NCCL has taken its
 * memory: create it before the device pools). Errors: whatever NCCL reports at
 * initialisation or while connecting. */
em_status em_exchange_create_nccl(const uint32_t *ordinals, uint32_t count, em_exchange **out,
                                  em_error *err);

void em_exchange_destroy(em_exchange *exchange);

static inline em_status em_exchange_run(em_exchange *exchange, const em_transfer *transfers,
                                        size_t count, em_error *err)
{
    return exchange->ops->run(exchange, transfers, count, err);
}

#endif
