/*
 * DESIGN: internal interface of the CUDA device (lib/device/cuda_device.c) for the CUDA
 * backend and the NCCL exchange. Built only with the CUDA backend; it includes no
 * CUDA header (everything GPU goes through kernels/ember_kernels.h).
 */
#ifndef EMBER_LIB_CUDA_DEVICE_H
#define EMBER_LIB_CUDA_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ember_kernels.h"
#include "lib/device/device.h"
#include "lib/device/host_buffers.h"
#include "lib/base/status.h"

typedef struct em__cuda_device_options {
    int ordinal;            /* CUDA device ordinal */
    uint64_t pool_bytes;    /* reserved at start as one region; the pool never grows */
    uint32_t lanes;         /* streams (with their staging buffers) */
    uint64_t staging_bytes; /* pinned host memory per lane */
    em_host_buffers *host_buffers; /* buffers copied directly (NULL: none) */
    uint64_t map_segment_slots; /* slots per segment of a shard's large hash map */
    uint64_t gpu_choice_entries; /* evictions' windows chosen on the GPU from this many */
    uint32_t sharing;       /* devices listed before this one on the same GPU (shared_gpus):
                             * 0 names it "cuda:<ordinal>", n > 0 "cuda:<ordinal>#<n>" */
} em__cuda_device_options;

/* Creates the device for GPU options->ordinal as device `index` of its backend: its
 * pool (one cudaMalloc'ed region), its lanes (a stream, pinned staging, events each). */
em_status em__cuda_device_create(uint32_t index, const em__cuda_device_options *options,
                                 em_device **out, em_error *err);

int em__cuda_device_ordinal(const em_device *device);

/* The stream a lane issues its work on. */
em_gpu_stream *em__cuda_lane_stream(em_lane *lane);

/* Copies bytes between two lanes of one device, in order with the work already issued
 * on both (each waits for the other through an event). */
em_status em__cuda_lane_copy(em_lane *from, em_lane *to, void *destination, const void *source,
                             size_t bytes, em_error *err);

/* EM_OK, or the failed call with CUDA's message: RESOURCE_EXHAUSTED for allocation
 * failures, UNAVAILABLE for a lost context (status.fatal: recorded as the process's GPU
 * failure, see em_cuda_set_failure_handler), INTERNAL otherwise; `where` (a device
 * name) names the device in the message. */
em_status em__cuda_check(em_gpu_status status, const char *where, em_error *err);

#endif
