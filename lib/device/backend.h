/*
 * DESIGN: a backend is the set of devices tables live on, plus the exchange between
 * them.
 *
 * The CPU backend has one or more host "devices", each with its own pool, so that
 * several-device routing and the host-staged exchange run (and are tested) on any
 * machine; the CUDA backend (lib/device/cuda_backend.c, built with the cuda feature) has one
 * device per GPU and an NCCL exchange. A table's shards are spread over the devices in
 * contiguous blocks (shard s of S lives on device s * D / S), so the keys a request
 * sends to one device form one contiguous range of its partitioned keys.
 */
#ifndef EMBER_LIB_BACKEND_H
#define EMBER_LIB_BACKEND_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "lib/base/parallel.h"
#include "lib/device/device.h"
#include "lib/device/exchange.h"
#include "lib/device/host_buffers.h"
#include "lib/base/status.h"

#define EM_BACKEND_MAX_DEVICES 64

typedef struct em_backend {
    const char *kind; /* "cpu", "cuda" */
    em_device **devices;
    uint32_t device_count;
    em_exchange *exchange;
    _Atomic uint32_t next_home; /* round-robin choice of home devices */
    /* Why the host-staged exchange serves several GPUs instead of NCCL, which could not
     * initialise ("" when it does not: one device, NCCL, or host staging asked for). */
    char exchange_fallback[EM_ERROR_MESSAGE_MAX];
    /* Pinned host memory for request data the devices copy directly (host_buffers.h);
     * NULL where host buffers come from malloc (the CPU backend). Owned. */
    em_host_buffers *host_buffers;
    /* Threads that a request holding a table alone (one that evicts) may use for its
     * evictions, the inserts of its new keys and its other work on each shard, a shard's
     * each (lib/table/table_request.c: make_room_and_insert, run_beside); 0 or 1: one
     * shard after another, as on the GPUs, whose shards share the request's lane. */
    uint32_t eviction_threads;
    /* The threads those runs, and a large push's check of its gradients, take besides
     * the request's own (em_parallel_pool_run): as many as the runs ask for at once (at
     * most 64), started as first needed and kept. NULL when it could not be made: runs
     * start their own. Owned. */
    em_parallel_pool *workers;
} em_backend;

typedef struct em_cpu_backend_options {
    uint32_t devices;            /* host devices (>= 1) */
    uint64_t pool_limit_bytes;   /* per device; 0: half of the physical memory / devices */
    uint64_t pool_initial_bytes; /* per device, reserved at start (<= limit) */
    uint64_t pool_growth_bytes;  /* per device, each later region */
    uint32_t eviction_threads;   /* for one request's evictions over its shards (1: one
                                  * at a time); 0: the CPUs online, at most 8 */
} em_cpu_backend_options;

/* Defaults: 1 device, limit half of physical memory, 64 MiB initial, 256 MiB growth,
 * eviction threads 0 (the CPUs online, at most 8). */
void em_cpu_backend_options_init(em_cpu_backend_options *options);

em_status em_backend_create_cpu(const em_cpu_backend_options *options, em_backend **out,
                                em_error *err);

/* Takes ownership of devices[0..count) (allocated with malloc) and exchange. */
em_status em_backend_assemble(const char *kind, em_device **devices, uint32_t count,
                              em_exchange *exchange, em_backend **out, em_error *err);

/* Destroys the devices and the exchange. Tables must be destroyed first. */
void em_backend_destroy(em_backend *backend);

/* The device a request runs its home-side work on (round robin), for a table over
 * several devices (a table on one is served there). Thread-safe. */
em_device *em_backend_home_device(em_backend *backend);

/* Device index of shard `shard` of a table with shard_count shards. */
uint32_t em_backend_shard_device(const em_backend *backend, uint32_t shard, uint32_t shard_count);

/* A CPU device with its own host-memory pool (used by em_backend_create_cpu). */
em_status em_cpu_device_create(uint32_t index, const em_cpu_backend_options *options,
                               em_device **out, em_error *err);

/* ---- CUDA backend -------------------------------------------------------------------
 * The declarations below exist only in builds with the CUDA backend (EM_HAVE_CUDA in
 * ember_config.h); lib/device/cuda_backend.c defines them. */

#define EM_CUDA_MAX_LANES 16

typedef struct em_cuda_backend_options {
    uint32_t devices[EM_BACKEND_MAX_DEVICES]; /* GPU ordinals to use, in this order */
    uint32_t device_count;     /* 0: every usable GPU (see em_cuda_available) */
    uint64_t pool_bytes;       /* device pool per GPU, reserved at start; 0: memory_fraction
                                * of the GPU's free memory at start */
    double memory_fraction;    /* in (0, 1]; used when pool_bytes is 0 */
    uint32_t lanes;            /* streams per GPU: requests that run at once (1..16) */
    uint64_t staging_bytes;    /* pinned host staging per lane; larger copies are chunked */
    uint64_t pinned_buffer_bytes; /* pinned host memory for request data, which the GPUs
                                   * copy directly (host_buffers.h); 0: none, all staged */
    bool host_staged_exchange; /* skip NCCL even with several GPUs (tests, debugging) */
    bool shared_gpus;          /* devices may list one GPU more than once, each listing a
                                * device of its own (pool, lanes, streams) on it: tests of
                                * the multi-device paths on a host with one GPU. NCCL
                                * takes one GPU per rank, so the exchange is host-staged. */
    uint64_t map_segment_slots; /* a shard's hash map larger than this many slots is kept
                                 * in segments of this many, so that it grows by the
                                 * slots it adds (a power of two, 1024 .. 2^30) */
    uint64_t gpu_choice_entries; /* a request's evictions on a GPU whose windows hold this
                                  * many map entries together are chosen on the GPU, fewer
                                  * on the host (the same rows either way); 0: the default,
                                  * 8,192; UINT64_MAX: always on the host */
} em_cuda_backend_options;

/* Defaults: every usable GPU, pool 0.8 of free memory, 2 lanes, 16 MiB staging, 1 GiB
 * of pinned buffers for request data, map segments of 2^22 slots (64 MiB), evictions
 * chosen on the GPU from windows of 16,384 entries. */
void em_cuda_backend_options_init(em_cuda_backend_options *options);

/* Whether a usable GPU is visible (one this build's kernels run on; they are compiled
 * for the gpu_architectures build option, with PTX for later GPUs): *device_count gets
 * how many. Errors: NOT_FOUND when no GPU is visible (no NVIDIA driver and no device
 * node, or none left visible by CUDA_VISIBLE_DEVICES); UNAVAILABLE naming the cause
 * when GPUs or a driver are there but cannot be used (a driver older than this build's
 * runtime with both versions, no kernel image for the GPU). Never crashes on a machine
 * without a GPU. */
em_status em_cuda_available(uint32_t *device_count, em_error *err);

/* Called once per process, on the thread that saw it, when a GPU's context is lost:
 * a sticky CUDA error (a kernel fault, an uncorrectable ECC error) or an NCCL
 * asynchronous error (the communicators are then aborted). From then on every CUDA
 * call of the process fails, so the CUDA backend serves nothing until the process is
 * restarted; the request that met the failure fails with UNAVAILABLE naming it.
 * cause: "<device>: <call> failed: <message> (error <n>)". */
typedef void (*em_gpu_failure_handler)(void *context, const char *cause);

/* One handler per process; NULL removes it. A failure before any handler was set is
 * still recorded (em_cuda_failed) and handed to the next handler set. */
void em_cuda_set_failure_handler(em_gpu_failure_handler handler, void *context);

/* Whether a GPU failed in this process; cause (nullable, size bytes) gets the first
 * failure. */
bool em_cuda_failed(char *cause, size_t size);

/* A backend with one device per GPU (each with its own pool and lanes) and the NCCL
 * exchange when it has several GPUs and NCCL initialises, else the host-staged one
 * (backend->exchange->name says which). Errors: UNAVAILABLE without a GPU,
 * INVALID_ARGUMENT for bad options (named), RESOURCE_EXHAUSTED when a pool or the
 * staging memory cannot be had, INTERNAL for other CUDA failures. */
em_status em_backend_create_cuda(const em_cuda_backend_options *options, em_backend **out,
                                 em_error *err);

#endif
