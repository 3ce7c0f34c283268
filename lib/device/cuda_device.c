/*
 * DESIGN: the CUDA backend's device (one GPU), over kernels/ember_kernels.h.
 *
 * Memory. The device pool (lib/memory/pool.h) carves one region that is cudaMalloc'ed when
 * the device is created; it never grows, so nothing on the request path calls
 * cudaMalloc or cudaFree. Every buffer below, per-request scratch and CUB's temporary
 * storage included, comes from that pool.
 *
 * Lanes. A lane is a CUDA stream, a pinned host staging buffer (two halves, and a few
 * words for small reads back), a one-word device counter and events. Every operation
 * of a lane is issued on its stream. Host to device copies go through a staging half
 * (so the caller may reuse its buffer at once): a copy waits for the previous copy out
 * of that half, fills it, enqueues the transfer and records an event; larger copies go
 * in half-sized chunks, two in flight. Host buffers in the backend's pinned host
 * buffers are copied directly both ways (host_buffers.h). Device to host copies are
 * staged and synchronise the stream; one of a few words (a count) goes through the
 * words kept for it, so it waits once, for itself. A lane counts what it issues, so
 * synchronising a lane with nothing issued since its last synchronisation (the end of
 * a request right after its answer came back) costs no round trip. Operations that
 * return a count
 * (unique, partition, find, insert, export) synchronise too; the others (sums,
 * pooling, gather, apply, writes) return as soon as their kernels are enqueued.
 * Scratch an asynchronous operation still uses is freed once its lane synchronizes
 * (the pool hands memory out again at once, so nothing in flight may use it).
 *
 * Home-side operations, as the CPU device defines them, without atomics in any sum:
 *   unique     a scratch table of first positions (claim with CAS, lower with atomic
 *              min), flags of first positions, a CUB scan for their ranks: unique keys
 *              come out in order of first appearance
 *   partition  owner shards, a stable CUB radix sort of the unique indices by owner,
 *              segment starts for the per-shard counts
 *   sums       a stable sort of key positions by unique index: each output element
 *              is one thread adding its key's contributions in position order
 *   combine    one thread per output element, in key order
 *
 * Shards. A hash map (kernels/shard_ops.cu) of slot_count 16-byte slots in the pool
 * plus a device header (row counter, the rows of the two keys that mark slots); it
 * grows (doubling, rehash into a new allocation) in shard_reserve when keys would
 * pass MAX_LOAD of the slots. Rows live in fixed-size blocks from the pool, like the
 * CPU device's: row r at block r >> block_shift, padded to 4 floats; blocks never
 * move, so growing storage never copies rows and never needs twice the memory. The
 * block pointer table is kept on the host and uploaded to the device when blocks are
 * added. The host mirrors the row count and the side rows (read back after inserts).
 *
 * Ordering between lanes. Tables hold a shard's lock only while they issue an
 * operation, but kernels run later; so each shard remembers an event recorded after
 * its last write (apply, write_rows, insert) and one per lane after that lane's last
 * read (gather, export). A write first makes its stream wait for the last write and
 * every read since; a read waits for the last write. Hash map changes need no events:
 * they happen only under the table's exclusive lock, after every other request has
 * synchronized its lanes.
 */
#include "lib/device/cuda_internal.h"

#include "lib/device/backend.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- status ------------------------------------------------------------------------ */

/* The process's first GPU failure (a lost context) and who is told about it. */
static pthread_mutex_t failure_lock = PTHREAD_MUTEX_INITIALIZER;
static bool failure_seen;
static bool failure_told;
static char failure_cause[EM_ERROR_MESSAGE_MAX];
static em_gpu_failure_handler failure_handler;
static void *failure_context;

/* Tells the handler about the failure once (outside the lock: it may call back). */
static void tell_failure(void)
{
    pthread_mutex_lock(&failure_lock);
    em_gpu_failure_handler handler = NULL;
    void *context = NULL;
    char cause[EM_ERROR_MESSAGE_MAX];
    if (failure_seen && !failure_told && failure_handler != NULL) {
        failure_told = true;
        handler = failure_handler;
        context = failure_context;
        snprintf(cause, sizeof(cause), "%s", failure_cause);
    }
    pthread_mutex_unlock(&failure_lock);
    if (handler != NULL)
        handler(context, cause);
}

void em_cuda_set_failure_handler(em_gpu_failure_handler handler, void *context)
{
    pthread_mutex_lock(&failure_lock);
    failure_handler = handler;
    failure_context = context;
    pthread_mutex_unlock(&failure_lock);
    tell_failure();
}

bool em_cuda_failed(char *cause, size_t size)
{
    pthread_mutex_lock(&failure_lock);
    bool failed = failure_seen;
    if (cause != NULL && size > 0)
        snprintf(cause, size, "%s", failed ? failure_cause : "");
    pthread_mutex_unlock(&failure_lock);
    return failed;
}

static void record_failure(const char *cause)
{
    pthread_mutex_lock(&failure_lock);
    if (!failure_seen) {
        failure_seen = true;
        snprintf(failure_cause, sizeof(failure_cause), "%s", cause);
    }
    pthread_mutex_unlock(&failure_lock);
    tell_failure();
}

em_status em__cuda_check(em_gpu_status status, const char *where, em_error *err)
{
    if (status.code == 0)
        return EM_OK;
    if (status.fatal) { /* recorded even when the caller wants no message (err NULL) */
        em_error lost;
        em_error_set(&lost, EM_UNAVAILABLE, "%s: %s failed: %s (error %d)", where, status.call,
                     status.message, status.code);
        record_failure(lost.message);
        return em_error_set(err, EM_UNAVAILABLE,
                            "GPU context lost (only a new process can use it): %s",
                            lost.message);
    }
    return em_error_set(err, status.out_of_memory ? EM_RESOURCE_EXHAUSTED : EM_INTERNAL,
                        "%s: %s failed: %s (error %d)", where, status.call, status.message,
                        status.code);
}

int em__cuda_device_ordinal(const em_device *device)
{
    return state_of(device)->ordinal;
}

em_gpu_stream *em__cuda_lane_stream(em_lane *lane)
{
    lane_of(lane)->issued++; /* the caller enqueues on it */
    return lane_of(lane)->stream;
}

/* ---- memory --------------------------------------------------------------------------- */

static em_status region_reserve(void *context, size_t bytes, uintptr_t *base, em_error *err)
{
    em_device *device = context;
    void *pointer = NULL;
    em_status status =
        em__cuda_check(em_gpu_malloc(state_of(device)->ordinal, bytes, &pointer), device->name,
                       err);
    if (status != EM_OK)
        return status;
    *base = (uintptr_t)pointer;
    return EM_OK;
}

static void region_release(void *context, uintptr_t base, size_t bytes)
{
    (void)bytes;
    em_device *device = context;
    em_gpu_free(state_of(device)->ordinal, (void *)base);
}

static em_pool_region_provider cuda_region_provider(em_device *device)
{
    return (em_pool_region_provider){
        .reserve = region_reserve, .release = region_release, .context = device};
}

/* ---- lanes --------------------------------------------------------------------------- */

static void free_deferred(cuda_lane *lane)
{
    em_device *device = lane->base.device;
    bool fill = lane->deferred_count > 0 && em_gpu_fills_freed();
    for (uint32_t i = 0; i < lane->deferred_count; i++) {
        if (fill)
            em_gpu_fill_freed(lane->deferred[i],
                              em_pool_allocation_size(device->pool,
                                                      (uintptr_t)lane->deferred[i]));
        em_device_free(device, lane->deferred[i]);
    }
    lane->deferred_count = 0;
}

static uint64_t monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}

/* Counts one wait of the host for the lane's device, begun at began_ns (em_device's
 * waits and wait_ns). */
static void count_wait(cuda_lane *lane, uint64_t began_ns)
{
    em_device *device = lane->base.device;
    atomic_fetch_add_explicit(&device->waits, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&device->wait_ns, monotonic_ns() - began_ns, memory_order_relaxed);
}

/* Waits for everything issued on the lane, then frees what was waiting for that. */
/* The reads back of copy_to_host_later reach their host memory once the lane has
 * synchronized (or are dropped when the synchronisation failed). */
static void land_later(cuda_lane *lane, bool synchronized)
{
    const uint8_t *words = lane->staging + lane->staging_bytes + READBACK_BYTES;
    for (uint32_t i = 0; synchronized && i < lane->later_count; i++)
        memcpy(lane->later[i].host, words + lane->later[i].offset, lane->later[i].bytes);
    lane->later_count = 0;
    lane->later_used = 0;
}

/* After a wait for the lane (synchronized: it succeeded): its staging is free, its
 * deferred scratch goes back to the pool, its reads back land. */
static void lane_waited(cuda_lane *lane, bool synchronized)
{
    if (synchronized)
        lane->synced = lane->issued;
    lane->staging_in_flight[0] = lane->staging_in_flight[1] = false;
    lane->staging_used[0] = lane->staging_used[1] = 0;
    free_deferred(lane);
    land_later(lane, synchronized);
}

static em_status lane_sync_alone(cuda_lane *lane, em_error *err)
{
    em_status status = EM_OK;
    if (lane->issued != lane->synced) { /* else nothing can be running: no round trip */
        uint64_t began = monotonic_ns();
        status = lane_check(lane, em_gpu_stream_synchronize(lane->stream), err);
        count_wait(lane, began);
    }
    lane_waited(lane, status == EM_OK);
    return status;
}

/* Waits once for every lane of lanes[0..count) that has work in flight, lanes of
 * several GPUs polled together (em_gpu_streams_synchronize), then does for each what a
 * synchronisation does after its wait. When one GPU fails, the others are waited for
 * alone, so that no scratch goes back to a pool while a GPU may still use it. */
static em_status lanes_sync(cuda_lane *const *lanes, uint32_t count, em_error *err)
{
    cuda_lane *busy[EM_BACKEND_MAX_DEVICES];
    em_gpu_stream *streams[EM_BACKEND_MAX_DEVICES];
    uint32_t n = 0;
    for (uint32_t i = 0; i < count; i++)
        if (lanes[i]->issued != lanes[i]->synced) {
            busy[n] = lanes[i];
            streams[n++] = lanes[i]->stream;
        }
    if (n <= 1) {
        em_status status = EM_OK;
        for (uint32_t i = 0; i < count; i++) {
            em_error later;
            em_status synced = lane_sync_alone(lanes[i], status == EM_OK ? err : &later);
            if (status == EM_OK)
                status = synced;
        }
        return status;
    }
    uint64_t began = monotonic_ns();
    int failed = -1;
    em_gpu_status waited = em_gpu_streams_synchronize(streams, (int)n, &failed);
    cuda_lane *culprit = busy[failed >= 0 && (uint32_t)failed < n ? (uint32_t)failed : 0];
    em_status status = em__cuda_check(waited, culprit->base.device->name, err);
    count_wait(busy[0], began); /* one wait of the host, however many GPUs it covered */
    for (uint32_t i = 0; i < count; i++) {
        em_error ignored;
        if (status == EM_OK || lanes[i] == culprit)
            lane_waited(lanes[i], status == EM_OK);
        else
            (void)lane_sync_alone(lanes[i], &ignored);
    }
    return status;
}

/* Waits for the lane and, in the same round trip, the lanes joined to it
 * (em__cuda_lane_join) since its last synchronisation. */
em_status em__cuda_lane_sync(cuda_lane *lane, em_error *err)
{
    if (lane->joined_count == 0)
        return lane_sync_alone(lane, err);
    cuda_lane *lanes[EM_BACKEND_MAX_DEVICES];
    uint32_t count = 0;
    lanes[count++] = lane;
    for (uint32_t i = 0; i < lane->joined_count && count < EM_BACKEND_MAX_DEVICES; i++)
        lanes[count++] = lane->joined[i];
    lane->joined_count = 0;
    return lanes_sync(lanes, count, err);
}

static em_status cuda_synchronize_lanes(em_lane *const *bases, uint32_t count, em_error *err)
{
    cuda_lane *lanes[EM_BACKEND_MAX_DEVICES];
    uint32_t n = 0;
    for (uint32_t i = 0; i < count; i++) {
        cuda_lane *lane = lane_of(bases[i]);
        for (uint32_t j = 0; j <= lane->joined_count && n < EM_BACKEND_MAX_DEVICES; j++) {
            cuda_lane *next = j == 0 ? lane : lane->joined[j - 1];
            bool listed = false;
            for (uint32_t k = 0; k < n && !listed; k++)
                listed = lanes[k] == next;
            if (!listed)
                lanes[n++] = next;
        }
        lane->joined_count = 0;
    }
    return lanes_sync(lanes, n, err);
}

static em_status cuda_lane_join(em_lane *base, em_lane *companion_base, em_error *err)
{
    cuda_lane *lane = lane_of(base), *companion = lane_of(companion_base);
    if (companion == lane)
        return EM_OK;
    for (uint32_t i = 0; i < lane->joined_count; i++)
        if (lane->joined[i] == companion)
            return EM_OK;
    if (lane->joined_count == EM_BACKEND_MAX_DEVICES - 1)
        return em_error_set(err, EM_INTERNAL, "%s: a lane joins at most %d others",
                            base->device->name, EM_BACKEND_MAX_DEVICES - 1);
    lane->joined[lane->joined_count++] = companion;
    return EM_OK;
}

/* Enqueues a read back of a few bytes into the words after the readback bytes; they
 * reach host_destination when the lane next synchronizes (em__cuda_lane_sync), so
 * counts that a request needs only at its end come back with its answer, one wait. A
 * read back those words have no room for is made at once (copy_to_host, which waits). */
em_status em__cuda_copy_to_host_later(em_lane *base, void *host_destination, const void *source,
                                      size_t bytes, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    size_t offset = (lane->later_used + 7) & ~(size_t)7;
    if (lane->later_count == LATER_MAX || offset + bytes > LATER_BYTES)
        return em__cuda_copy_to_host(base, host_destination, source, bytes, err);
    uint8_t *words = lane->staging + lane->staging_bytes + READBACK_BYTES;
    em_status status = lane_check(lane, em_gpu_memcpy_async(lane->stream, words + offset, source,
                                                            bytes),
                                  err);
    if (status != EM_OK)
        return status;
    lane->later[lane->later_count].host = host_destination;
    lane->later[lane->later_count].offset = offset;
    lane->later[lane->later_count].bytes = bytes;
    lane->later_count++;
    lane->later_used = offset + bytes;
    return EM_OK;
}

em_status em__cuda_lane_readback(cuda_lane *lane, size_t bytes, uint8_t **out, em_error *err)
{
    if (bytes > LANE_READBACK_MAX)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "%s: %zu bytes to read back, over the lane's %zu of pinned memory",
                            lane->base.device->name, bytes, LANE_READBACK_MAX);
    if (bytes > lane->readback_bytes) {
        size_t grown = lane->readback_bytes * 2 > bytes ? lane->readback_bytes * 2 : bytes;
        grown = grown < LANE_READBACK_MAX ? grown : LANE_READBACK_MAX;
        uint8_t *memory = NULL;
        em_status status = em__cuda_check(em_gpu_host_alloc(grown, (void **)&memory),
                                          lane->base.device->name, err);
        if (status != EM_OK)
            return status;
        em_gpu_host_free(lane->readback);
        lane->readback = memory;
        lane->readback_bytes = grown;
    }
    *out = lane->readback;
    return EM_OK;
}

/* Frees the scratch once the lane's work so far has completed. */
static em_status scratch_free_later(scratch *s, cuda_lane *lane, em_error *err)
{
    em_status status = EM_OK;
    if (lane->deferred_count + s->count > DEFERRED_MAX)
        status = em__cuda_lane_sync(lane, err);
    for (uint32_t i = 0; i < s->count; i++)
        lane->deferred[lane->deferred_count++] = s->pointers[i];
    s->count = 0;
    return status;
}

em_status em__cuda_free_later(cuda_lane *lane, void *pointer, em_error *err)
{
    scratch s = {.device = lane->base.device, .pointers = {pointer}, .count = 1};
    return scratch_free_later(&s, lane, err);
}

em_status em__cuda_free_one_later(scratch *s, cuda_lane *lane, void *pointer, em_error *err)
{
    for (uint32_t i = 0; i < s->count; i++) {
        if (s->pointers[i] != pointer)
            continue;
        memmove(&s->pointers[i], &s->pointers[i + 1], (s->count - i - 1) * sizeof(void *));
        s->count--;
        return em__cuda_free_later(lane, pointer, err);
    }
    return EM_OK;
}

/* Ends an operation that may have enqueued work using its scratch. */
em_status em__cuda_finish_async(scratch *s, cuda_lane *lane, em_status status, em_error *err)
{
    em_error ignored;
    em_status freed = scratch_free_later(s, lane, status == EM_OK ? err : &ignored);
    return status != EM_OK ? status : freed;
}

em_status em__cuda_lane_acquire(em_device *device, em_lane **out, em_error *err)
{
    (void)err;
    cuda_state *state = state_of(device);
    pthread_mutex_lock(&state->lock);
    for (;;) {
        for (uint32_t l = 0; l < state->lane_count; l++) {
            if (!state->lanes[l].held) {
                state->lanes[l].held = true;
                pthread_mutex_unlock(&state->lock);
                *out = &state->lanes[l].base;
                return EM_OK;
            }
        }
        pthread_cond_wait(&state->lane_freed, &state->lock);
    }
}

void em__cuda_lane_release(em_lane *base)
{
    cuda_lane *lane = lane_of(base);
    cuda_state *state = state_of(base->device);
    /* Deferred scratch goes back to the pool before another request takes the lane;
     * the lanes joined to it are synchronized when they are released themselves. */
    lane->joined_count = 0;
    em__cuda_lane_sync(lane, NULL);
    pthread_mutex_lock(&state->lock);
    lane->held = false;
    pthread_cond_signal(&state->lane_freed);
    pthread_mutex_unlock(&state->lock);
}

/* Waits until the copy of staging half h has completed. */
static em_status wait_for_staging(cuda_lane *lane, uint32_t h, em_error *err)
{
    if (!lane->staging_in_flight[h])
        return EM_OK;
    uint64_t began = monotonic_ns();
    em_status status = lane_check(lane, em_gpu_event_synchronize(lane->staging_done[h]), err);
    count_wait(lane, began);
    lane->staging_in_flight[h] = false;
    return status;
}

static uint8_t *staging_half(cuda_lane *lane, uint32_t h)
{
    return lane->staging + h * (lane->staging_bytes / 2);
}

/* Whether a host buffer is pinned memory of the backend's host buffers, which the GPU
 * copies by DMA at the bus's speed with no host copy through staging. */
static bool copies_directly(cuda_lane *lane, const void *host, size_t bytes)
{
    cuda_state *state = state_of(lane->base.device);
    bool direct = bytes > 0 && em_host_buffer_pinned(state->host_buffers, host, bytes);
    em_host_buffers_count_copy(state->host_buffers, direct, bytes);
    return direct;
}

/* A pinned source (copies_directly) is copied by one DMA, which reads it after the
 * call returns (the contract in device.h). Any other goes chunk by chunk through the
 * two staging halves in turn: the host copies a chunk into one half while the previous
 * chunk goes from the other half to the GPU, and the call returns once the source may
 * be reused (the last chunks may still be on their way: stream order puts them before
 * later work on the lane). */
em_status em__cuda_copy_to_device(em_lane *base, void *destination, const void *host_source,
                                     size_t bytes, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    if (copies_directly(lane, host_source, bytes))
        return lane_check(lane, em_gpu_memcpy_async(lane->stream, destination, host_source,
                                                    bytes),
                          err);
    size_t half = lane->staging_bytes / 2;
    for (size_t done = 0; done < bytes;) {
        size_t left = bytes - done;
        uint32_t h = lane->staging_next;
        size_t offset = lane->staging_used[h];
        em_status status = EM_OK;
        if (offset > 0 && half - offset < (left < half ? left : half)) {
            h = 1 - h; /* no room here: the other half, once its copies are done */
            offset = 0;
        }
        if (offset == 0) /* a half taken afresh: its last copies may still read it */
            status = wait_for_staging(lane, h, err);
        if (status != EM_OK)
            return status;
        /* The bytes past offset are no copy's: they are written while the half's earlier
         * copies may still be reading the bytes before. */
        size_t chunk = left < half - offset ? left : half - offset;
        uint8_t *slot = staging_half(lane, h) + offset;
        memcpy(slot, (const uint8_t *)host_source + done, chunk);
        status = lane_check(lane, em_gpu_memcpy_async(lane->stream, (uint8_t *)destination + done,
                                                      slot, chunk),
                            err);
        if (status == EM_OK)
            status = lane_check(lane, em_gpu_event_record(lane->staging_done[h], lane->stream),
                                err);
        if (status != EM_OK)
            return status;
        lane->staging_in_flight[h] = true;
        /* the next copy starts 256-byte aligned, in this half while there is room */
        lane->staging_used[h] = (offset + chunk + 255) & ~(size_t)255;
        if (lane->staging_used[h] >= half) {
            lane->staging_used[h] = half;
            h = 1 - h;
        }
        lane->staging_next = h;
        done += chunk;
    }
    return EM_OK;
}

/* Starts the copy of the chunk at done (of bytes) into staging half h. */
static em_status stage_from_device(cuda_lane *lane, uint32_t h, const void *source, size_t done,
                                   size_t bytes, em_error *err)
{
    size_t half = lane->staging_bytes / 2;
    size_t chunk = bytes - done < half ? bytes - done : half;
    /* A copy to the device still reading the half was issued on this stream before: the
     * stream runs this one after it, so the host need not wait. The half's event then
     * marks this copy, the later of the two. */
    em_status status = lane_check(lane, em_gpu_memcpy_async(lane->stream, staging_half(lane, h),
                                                            (const uint8_t *)source + done,
                                                            chunk),
                                  err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_event_record(lane->staging_done[h], lane->stream), err);
    if (status == EM_OK)
        lane->staging_in_flight[h] = true;
    lane->staging_used[h] = half; /* the GPU writes it: no copy to the device shares it */
    return status;
}

/* The reverse: a pinned destination takes one DMA; any other, chunk by chunk, is
 * copied out of one staging half while the next chunk is already coming from the GPU
 * into the other. Returns with every byte in host memory. */
em_status em__cuda_copy_to_host(em_lane *base, void *host_destination, const void *source,
                                   size_t bytes, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    if (copies_directly(lane, host_destination, bytes)) {
        em_status status = lane_check(lane, em_gpu_memcpy_async(lane->stream, host_destination,
                                                                source, bytes),
                                      err);
        return status == EM_OK ? em__cuda_lane_sync(lane, err) : status;
    }
    if (bytes <= READBACK_BYTES) { /* a count: not behind a staging half's copy */
        uint8_t *words = lane->staging + lane->staging_bytes;
        em_status status = lane_check(lane, em_gpu_memcpy_async(lane->stream, words, source,
                                                                bytes),
                                      err);
        if (status == EM_OK)
            status = em__cuda_lane_sync(lane, err);
        if (status == EM_OK)
            memcpy(host_destination, words, bytes);
        return status;
    }
    size_t half = lane->staging_bytes / 2;
    uint32_t h = lane->staging_next;
    em_status status = bytes > 0 ? stage_from_device(lane, h, source, 0, bytes, err) : EM_OK;
    for (size_t done = 0; status == EM_OK && done < bytes;) {
        size_t chunk = bytes - done < half ? bytes - done : half;
        if (done + chunk < bytes)
            status = stage_from_device(lane, 1 - h, source, done + chunk, bytes, err);
        /* the last chunk is the lane's last work: waiting for the lane waits for it, and
         * leaves the lane known idle (a synchronisation right after costs nothing) */
        if (status == EM_OK)
            status = done + chunk < bytes ? wait_for_staging(lane, h, err)
                                          : em__cuda_lane_sync(lane, err);
        if (status != EM_OK)
            break;
        memcpy((uint8_t *)host_destination + done, staging_half(lane, h), chunk);
        done += chunk;
        h = 1 - h;
    }
    lane->staging_next = h;
    return status;
}

static em_status cuda_synchronize(em_lane *base, em_error *err)
{
    return em__cuda_lane_sync(lane_of(base), err);
}

em_status em__cuda_lane_copy(em_lane *from_base, em_lane *to_base, void *destination,
                             const void *source, size_t bytes, em_error *err)
{
    cuda_lane *from = lane_of(from_base), *to = lane_of(to_base);
    if (bytes == 0)
        return EM_OK;
    if (from == to)
        return lane_check(from, em_gpu_memcpy_async(from->stream, destination, source, bytes), err);
    /* to waits for from's work (the source is ready), copies, then from waits for the
     * copy (the source may be reused afterwards). */
    em_status status = lane_check(from, em_gpu_event_record(from->handoff, from->stream), err);
    if (status == EM_OK)
        status = lane_check(to, em_gpu_stream_wait(to->stream, from->handoff), err);
    if (status == EM_OK)
        status = lane_check(to, em_gpu_memcpy_async(to->stream, destination, source, bytes), err);
    if (status == EM_OK)
        status = lane_check(to, em_gpu_event_record(to->handoff, to->stream), err);
    if (status == EM_OK)
        status = lane_check(from, em_gpu_stream_wait(from->stream, to->handoff), err);
    return status;
}

/* ---- device ---------------------------------------------------------------------------- */

static void destroy_lane(em_device *device, cuda_lane *lane)
{
    if (lane->stream != NULL)
        em__cuda_lane_sync(lane, NULL);
    for (uint32_t v = 0; v < VIEW_CACHE; v++) {
        em_device_free(device, lane->views[v].device);
        free(lane->views[v].host);
    }
    em_device_free(device, lane->counter);
    em_device_free(device, lane->iota);
    em_gpu_event_destroy(lane->staging_done[0]);
    em_gpu_event_destroy(lane->staging_done[1]);
    em_gpu_event_destroy(lane->handoff);
    em_gpu_stream_destroy(lane->stream);
    em_gpu_host_free(lane->staging);
    em_gpu_host_free(lane->readback);
}

static void cuda_device_destroy(em_device *device)
{
    cuda_state *state = state_of(device);
    for (uint32_t l = 0; state->lanes != NULL && l < state->lane_count; l++)
        destroy_lane(device, &state->lanes[l]);
    free(state->lanes);
    em_pool_destroy(device->pool);
    pthread_cond_destroy(&state->lane_freed);
    pthread_mutex_destroy(&state->lock);
    free(state);
    free(device);
}

static em_status create_lane(em_device *device, uint32_t index, size_t staging_bytes,
                             cuda_lane *lane, em_error *err)
{
    int ordinal = state_of(device)->ordinal;
    lane->base.device = device;
    lane->index = index;
    lane->staging_bytes = staging_bytes;
    em_status status = em__cuda_check(em_gpu_stream_create(ordinal, &lane->stream), device->name,
                                      err);
    for (int h = 0; h < 2 && status == EM_OK; h++)
        status = em__cuda_check(em_gpu_event_create(ordinal, 0, &lane->staging_done[h]),
                                device->name, err);
    if (status == EM_OK)
        status = em__cuda_check(em_gpu_event_create(ordinal, 0, &lane->handoff), device->name,
                                err);
    if (status == EM_OK)
        status = em__cuda_check(em_gpu_host_alloc(staging_bytes + READBACK_BYTES + LATER_BYTES,
                                                  (void **)&lane->staging),
                                device->name, err);
    if (status == EM_OK)
        status = em_device_alloc(device, sizeof(uint64_t), "lane counter",
                                 (void **)&lane->counter, err);
    return status;
}

static const em_device_ops cuda_device_ops = {
    .region_provider = cuda_region_provider,
    .lane_acquire = em__cuda_lane_acquire,
    .lane_release = em__cuda_lane_release,
    .copy_to_device = em__cuda_copy_to_device,
    .copy_to_host = em__cuda_copy_to_host,
    .copy_to_host_later = em__cuda_copy_to_host_later,
    .synchronize = cuda_synchronize,
    .synchronize_lanes = cuda_synchronize_lanes,
    .lane_join = cuda_lane_join,
    .unique_keys = em__cuda_unique_keys,
    .unique_keys_async = em__cuda_unique_keys_async,
    .spread_keys_async = em__cuda_spread_keys_async,
    .partition_keys = em__cuda_partition_keys,
    .unique_partition_keys = em__cuda_unique_partition_keys,
    .unique_partition_find_async = em__cuda_unique_partition_find_async,
    .sum_gradients = em__cuda_sum_gradients,
    .combine = em__cuda_combine,
    .copy_repeats = em__cuda_copy_repeats,
    .shard_create = em__cuda_shard_create,
    .shard_destroy = em__cuda_shard_destroy,
    .shard_find = em__cuda_shard_find,
    .shard_find_async = em__cuda_shard_find_async,
    .shards_find_async = em__cuda_shards_find_async,
    .shard_reserve = em__cuda_shard_reserve,
    .shard_insert_missing = em__cuda_shard_insert_missing,
    .shard_insert_missing_async = em__cuda_shard_insert_missing_async,
    .shards_insert_missing_async = em__cuda_shards_insert_missing_async,
    .shard_insert_settle = em__cuda_shard_insert_settle,
    .shard_gather = em__cuda_shard_gather,
    .shards_gather = em__cuda_shards_gather,
    .shards_pull_async = em__cuda_shards_pull_async,
    .shards_push_async = em__cuda_shards_push_async,
    .shards_find_check_async = em__cuda_shards_find_check_async,
    .shards_step_async = em__cuda_shards_step_async,
    .shards_touch_async = em__cuda_shards_touch_async,
    .shard_check_apply = em__cuda_shard_check_apply,
    .shard_check_apply_async = em__cuda_shard_check_apply_async,
    .shards_check_async = em__cuda_shards_check_async,
    .shard_apply = em__cuda_shard_apply,
    .shards_apply = em__cuda_shards_apply,
    .shard_export = em__cuda_shard_export,
    .shard_read_rows = em__cuda_shard_read_rows,
    .shard_write_rows = em__cuda_shard_write_rows,
    .shard_stats = em__cuda_shard_stats,
    .shard_erase = em__cuda_shard_erase,
    .shard_fill_initial = em__cuda_shard_fill_initial,
    .shard_touch = em__cuda_shard_touch,
    .shard_read_access = em__cuda_shard_read_access,
    .shard_write_access = em__cuda_shard_write_access,
    .shard_evict = em__cuda_shard_evict,
    .shards_evict_begin = em__cuda_shards_evict_begin,
    .shards_evict_end = em__cuda_shards_evict_end,
    .shard_expire = em__cuda_shard_expire,
    .destroy = cuda_device_destroy,
};

static em_status create_pool(em_device *device, uint64_t pool_bytes, em_error *err)
{
    size_t bytes = (size_t)(pool_bytes / EM_POOL_ALIGNMENT * EM_POOL_ALIGNMENT);
    em_pool_options options = {
        .name = device->name,
        .initial_bytes = bytes,
        .growth_bytes = 0,
        .limit_bytes = bytes,
        .provider = cuda_region_provider(device),
    };
    return em_pool_create(&options, &device->pool, err);
}

static em_status create_lanes(em_device *device, const em__cuda_device_options *options,
                              em_error *err)
{
    cuda_state *state = state_of(device);
    state->lanes = calloc(options->lanes, sizeof(*state->lanes));
    if (state->lanes == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "%s: lanes: out of host memory",
                            device->name);
    state->lane_count = options->lanes;
    em_status status = EM_OK;
    for (uint32_t l = 0; status == EM_OK && l < options->lanes; l++)
        status = create_lane(device, l, (size_t)options->staging_bytes, &state->lanes[l], err);
    return status;
}

/* UNAVAILABLE when this build has no kernels for the GPU's architecture. */
static em_status check_kernels(em_device *device, em_error *err)
{
    const cuda_state *state = state_of(device);
    em_gpu_status status = em_gpu_kernels_supported(state->ordinal);
    if (status.code == 0)
        return EM_OK;
    return em_error_set(err, EM_UNAVAILABLE,
                        "%s (%s, compute capability %u.%u): the kernels cannot run on it: %s "
                        "failed: %s",
                        device->name, state->info.name, state->info.compute_major,
                        state->info.compute_minor, status.call, status.message);
}

em_status em__cuda_device_create(uint32_t index, const em__cuda_device_options *options,
                                 em_device **out, em_error *err)
{
    em_device *device = em_device_allocate();
    cuda_state *state = calloc(1, sizeof(*state));
    if (device == NULL || state == NULL) {
        free(device);
        free(state);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "cuda device %d: out of host memory",
                            options->ordinal);
    }
    state->ordinal = options->ordinal;
    state->host_buffers = options->host_buffers;
    state->map_segment_slots = options->map_segment_slots;
    state->gpu_choice_entries = options->gpu_choice_entries;
    pthread_mutex_init(&state->lock, NULL);
    pthread_cond_init(&state->lane_freed, NULL);
    device->impl = state;
    device->ops = &cuda_device_ops;
    if (options->sharing == 0)
        snprintf(device->name, sizeof(device->name), "cuda:%d", options->ordinal);
    else
        snprintf(device->name, sizeof(device->name), "cuda:%d#%u", options->ordinal,
                 options->sharing);
    device->kind = "cuda";
    device->index = index;
    device->host_addressable = false;
    em_status status = em__cuda_check(em_gpu_device_info_get(options->ordinal, &state->info),
                                      device->name, err);
    if (status == EM_OK)
        status = check_kernels(device, err);
    if (status == EM_OK)
        status = create_pool(device, options->pool_bytes, err);
    if (status == EM_OK)
        status = create_lanes(device, options, err);
    if (status != EM_OK) {
        cuda_device_destroy(device);
        return status;
    }
    *out = device;
    return EM_OK;
}
