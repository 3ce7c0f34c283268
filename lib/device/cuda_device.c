/*
 * DESIGN: the CUDA backend's device (one GPU), over kernels/ember_kernels.h.
 *
 * Memory. The device pool (lib/pool.h) carves one region that is cudaMalloc'ed when
 * the device is created; it never grows, so nothing on the request path calls
 * cudaMalloc or cudaFree. Every buffer below, per-request scratch and CUB's temporary
 * storage included, comes from that pool.
 *
 * Lanes. A lane is a CUDA stream, a pinned host staging buffer, a one-word device
 * counter and two events. Every operation of a lane is issued on its stream. Host to
 * device copies go through the staging buffer (so the caller may reuse its buffer at
 * once): a copy waits for the previous copy out of staging, fills it, enqueues the
 * transfer and records an event; larger copies go in staging-sized chunks. Device to
 * host copies are staged and synchronise the stream. Operations that return a count
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
#include "lib/device/cuda_device.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/keyhash.h"

/* Row blocks aim at this many bytes (em_row_blocks_plan). */
#define TARGET_BLOCK_BYTES ((size_t)4 << 20)
/* Hash map slots a new shard starts with at most (it grows on demand). */
#define MAX_INITIAL_SLOTS ((uint64_t)1 << 16)
#define MIN_SLOTS ((uint64_t)16)
/* Maps grow when keys in slots would pass this fraction of the slots (tenths). */
#define MAX_LOAD_TENTHS 9u
/* Export: slots examined per scan, and bytes of rows returned per call at most; both
 * halve (down to one row and MIN_EXPORT_WINDOW slots) while the pool cannot hold the
 * scratch, so a full pool can still be exported (checkpoints). */
#define EXPORT_WINDOW_SLOTS ((uint64_t)1 << 20)
#define MIN_EXPORT_WINDOW ((uint64_t)1 << 10)
#define EXPORT_MAX_BYTES ((uint64_t)64 << 20)
/* Pool buffers freed when their lane next synchronizes, at most (more forces a sync). */
#define DEFERRED_MAX 64u
/* Scratch buffers one operation takes at most. */
#define SCRATCH_MAX 8u

_Static_assert(EM_GPU_ROW_NONE == EM_ROW_NONE, "row marker shared with the kernels");

typedef struct cuda_lane {
    em_lane base;
    uint32_t index;
    bool held;
    em_gpu_stream *stream;
    uint8_t *staging; /* pinned */
    size_t staging_bytes;
    em_gpu_event *staging_done; /* recorded after the last copy out of staging */
    bool staging_in_flight;
    em_gpu_event *handoff;      /* same-device copies between lanes */
    uint64_t *counter;          /* device word for counts (find) */
    void *deferred[DEFERRED_MAX];
    uint32_t deferred_count;
} cuda_lane;

typedef struct cuda_state {
    int ordinal;
    em_gpu_device_info info;
    cuda_lane *lanes;
    uint32_t lane_count;
    pthread_mutex_t lock;
    pthread_cond_t lane_freed;
} cuda_state;

typedef struct cuda_shard {
    em_shard base;
    char table[136];
    uint32_t index;
    uint32_t dim;
    uint32_t row_floats; /* dim + optimizer state */
    uint32_t stride;     /* floats between rows */
    em_optimizer_config optimizer;
    em_initializer_config initializer;
    /* hash map */
    em_gpu_slot *slots;
    uint64_t slot_count;
    em_gpu_map_header *header;
    uint64_t size;         /* keys stored (= rows handed out) */
    uint64_t side_rows[2]; /* rows of the keys EMPTY and TOMBSTONE, host copy */
    /* row storage */
    float **blocks;        /* host table of device block pointers */
    float **device_blocks; /* the same table on the device */
    uint64_t block_count, block_capacity;
    uint32_t block_shift;
    uint64_t block_mask;
    size_t block_bytes;
    /* ordering between lanes */
    pthread_mutex_t order_lock;
    em_gpu_event *write_event;
    bool write_recorded;
    uint32_t write_lane;
    em_gpu_event **read_events; /* one per lane */
    bool *read_recorded;
} cuda_shard;

static cuda_state *state_of(const em_device *device)
{
    return (cuda_state *)device->impl;
}

static cuda_lane *lane_of(em_lane *lane)
{
    return (cuda_lane *)lane;
}

static cuda_shard *shard_of(em_shard *shard)
{
    return (cuda_shard *)shard;
}

/* ---- status ------------------------------------------------------------------------ */

em_status em__cuda_check(em_gpu_status status, const char *where, em_error *err)
{
    if (status.code == 0)
        return EM_OK;
    return em_error_set(err, status.out_of_memory ? EM_RESOURCE_EXHAUSTED : EM_INTERNAL,
                        "%s: %s failed: %s (error %d)", where, status.call, status.message,
                        status.code);
}

static em_status lane_check(const cuda_lane *lane, em_gpu_status status, em_error *err)
{
    return em__cuda_check(status, lane->base.device->name, err);
}

int em__cuda_device_ordinal(const em_device *device)
{
    return state_of(device)->ordinal;
}

em_gpu_stream *em__cuda_lane_stream(em_lane *lane)
{
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

/* Pool buffers of one operation, freed together. */
typedef struct scratch {
    em_device *device;
    void *pointers[SCRATCH_MAX];
    uint32_t count;
} scratch;

static em_status scratch_take(scratch *s, size_t bytes, const char *what, void **out,
                              em_error *err)
{
    if (s->count == SCRATCH_MAX)
        return em_error_set(err, EM_INTERNAL, "%s: scratch list full", what);
    em_status status = em_device_alloc(s->device, bytes, what, out, err);
    if (status == EM_OK)
        s->pointers[s->count++] = *out;
    return status;
}

/* Frees at once: only when the lane has synchronized since the buffers were used. */
static void scratch_free_now(scratch *s)
{
    for (uint32_t i = s->count; i > 0; i--)
        em_device_free(s->device, s->pointers[i - 1]);
    s->count = 0;
}

/* ---- lanes --------------------------------------------------------------------------- */

static void free_deferred(cuda_lane *lane)
{
    for (uint32_t i = 0; i < lane->deferred_count; i++)
        em_device_free(lane->base.device, lane->deferred[i]);
    lane->deferred_count = 0;
}

/* Waits for everything issued on the lane, then frees what was waiting for that. */
static em_status lane_sync(cuda_lane *lane, em_error *err)
{
    em_status status = lane_check(lane, em_gpu_stream_synchronize(lane->stream), err);
    lane->staging_in_flight = false;
    free_deferred(lane);
    return status;
}

/* Frees the scratch once the lane's work so far has completed. */
static em_status scratch_free_later(scratch *s, cuda_lane *lane, em_error *err)
{
    em_status status = EM_OK;
    if (lane->deferred_count + s->count > DEFERRED_MAX)
        status = lane_sync(lane, err);
    for (uint32_t i = 0; i < s->count; i++)
        lane->deferred[lane->deferred_count++] = s->pointers[i];
    s->count = 0;
    return status;
}

/* Ends an operation that may have enqueued work using its scratch. */
static em_status finish_async(scratch *s, cuda_lane *lane, em_status status, em_error *err)
{
    em_error ignored;
    em_status freed = scratch_free_later(s, lane, status == EM_OK ? err : &ignored);
    return status != EM_OK ? status : freed;
}

static em_status cuda_lane_acquire(em_device *device, em_lane **out, em_error *err)
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

static void cuda_lane_release(em_lane *base)
{
    cuda_lane *lane = lane_of(base);
    cuda_state *state = state_of(base->device);
    /* Deferred scratch goes back to the pool before another request takes the lane. */
    lane_sync(lane, NULL);
    pthread_mutex_lock(&state->lock);
    lane->held = false;
    pthread_cond_signal(&state->lane_freed);
    pthread_mutex_unlock(&state->lock);
}

static em_status wait_for_staging(cuda_lane *lane, em_error *err)
{
    if (!lane->staging_in_flight)
        return EM_OK;
    em_status status = lane_check(lane, em_gpu_event_synchronize(lane->staging_done), err);
    lane->staging_in_flight = false;
    return status;
}

static em_status cuda_copy_to_device(em_lane *base, void *destination, const void *host_source,
                                     size_t bytes, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    for (size_t done = 0; done < bytes;) {
        size_t chunk = bytes - done < lane->staging_bytes ? bytes - done : lane->staging_bytes;
        em_status status = wait_for_staging(lane, err);
        if (status != EM_OK)
            return status;
        memcpy(lane->staging, (const uint8_t *)host_source + done, chunk);
        status = lane_check(lane, em_gpu_memcpy_async(lane->stream, (uint8_t *)destination + done,
                                                      lane->staging, chunk),
                            err);
        if (status == EM_OK)
            status = lane_check(lane, em_gpu_event_record(lane->staging_done, lane->stream), err);
        if (status != EM_OK)
            return status;
        lane->staging_in_flight = true;
        done += chunk;
    }
    return EM_OK;
}

static em_status cuda_copy_to_host(em_lane *base, void *host_destination, const void *source,
                                   size_t bytes, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    for (size_t done = 0; done < bytes;) {
        size_t chunk = bytes - done < lane->staging_bytes ? bytes - done : lane->staging_bytes;
        /* Stream order puts this after any earlier copy out of staging. */
        em_status status = lane_check(
            lane,
            em_gpu_memcpy_async(lane->stream, lane->staging, (const uint8_t *)source + done, chunk),
            err);
        if (status == EM_OK)
            status = lane_sync(lane, err);
        if (status != EM_OK)
            return status;
        memcpy((uint8_t *)host_destination + done, lane->staging, chunk);
        done += chunk;
    }
    return EM_OK;
}

static em_status cuda_synchronize(em_lane *base, em_error *err)
{
    return lane_sync(lane_of(base), err);
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

/* ---- home-side operations --------------------------------------------------------- */

/* Slots of the unique-keys table for n keys: a power of two >= 2n, at most 2^32 (slot
 * indices are 32-bit; n < 2^32 keeps one free). */
static uint64_t unique_table_slots(uint64_t n)
{
    uint64_t slots = MIN_SLOTS;
    while (slots < 2 * n && slots < ((uint64_t)1 << 32))
        slots <<= 1;
    return slots;
}

/* Bits that hold every value below count: the radix sort's end_bit. */
static uint32_t bits_for(uint64_t count)
{
    uint32_t bits = 0;
    while (count > 1 && bits < 64 && ((count - 1) >> bits) != 0)
        bits++;
    return bits;
}

static em_status take_scan_temp(scratch *s, cuda_lane *lane, uint64_t n, void **temp,
                                size_t *temp_bytes, em_error *err)
{
    em_status status = lane_check(lane, em_gpu_scan_temp_bytes(lane->stream, n, temp_bytes), err);
    if (status == EM_OK)
        status = scratch_take(s, *temp_bytes, "scan scratch", temp, err);
    return status;
}

static em_status take_sort_temp(scratch *s, cuda_lane *lane, uint64_t n, uint32_t end_bit,
                                void **temp, size_t *temp_bytes, em_error *err)
{
    em_status status =
        lane_check(lane, em_gpu_sort_temp_bytes(lane->stream, n, end_bit, temp_bytes), err);
    if (status == EM_OK)
        status = scratch_take(s, *temp_bytes, "sort scratch", temp, err);
    return status;
}

static em_status cuda_unique_keys(em_lane *base, const uint64_t *keys, uint64_t n,
                                  uint64_t *unique, uint32_t *inverse, uint32_t *first_positions,
                                  uint64_t *unique_count, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    *unique_count = 0;
    if (n == 0)
        return EM_OK;
    scratch s = {.device = base->device};
    uint64_t slots = unique_table_slots(n);
    uint32_t *table = NULL, *slot_of = NULL, *first = NULL, *rank = NULL;
    void *temp = NULL;
    size_t temp_bytes = 0;
    em_status status = scratch_take(&s, slots * sizeof(uint32_t), "unique table",
                                    (void **)&table, err);
    if (status == EM_OK)
        status = scratch_take(&s, n * sizeof(uint32_t), "unique slots", (void **)&slot_of, err);
    if (status == EM_OK)
        status = scratch_take(&s, (n + 1) * sizeof(uint32_t), "unique flags", (void **)&first, err);
    if (status == EM_OK)
        status = scratch_take(&s, (n + 1) * sizeof(uint32_t), "unique ranks", (void **)&rank, err);
    if (status == EM_OK)
        status = take_scan_temp(&s, lane, n + 1, &temp, &temp_bytes, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_memset_async(lane->stream, table, 0,
                                                      slots * sizeof(uint32_t)), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_unique_claim(lane->stream, keys, n, table, slots, slot_of),
                            err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_unique_flags(lane->stream, table, slot_of, n, first), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_exclusive_scan_u32(lane->stream, temp, temp_bytes, first,
                                                            rank, n + 1), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_unique_scatter(lane->stream, keys, n, table, slot_of,
                                                        first, rank, unique, inverse,
                                                        first_positions), err);
    uint32_t count = 0;
    if (status == EM_OK)
        status = cuda_copy_to_host(base, &count, rank + n, sizeof(count), err);
    if (status != EM_OK)
        return finish_async(&s, lane, status, err);
    scratch_free_now(&s);
    *unique_count = count;
    return EM_OK;
}

/* Reads the per-shard starts back and turns them into counts. */
static em_status shard_counts_from_starts(cuda_lane *lane, const uint32_t *starts,
                                          uint32_t shard_count, uint64_t *shard_counts,
                                          em_error *err)
{
    uint32_t *host = malloc(((size_t)shard_count + 1) * sizeof(*host));
    if (host == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "partition: out of host memory");
    em_status status = cuda_copy_to_host(&lane->base, host, starts,
                                         ((size_t)shard_count + 1) * sizeof(*host), err);
    for (uint32_t shard = 0; status == EM_OK && shard < shard_count; shard++)
        shard_counts[shard] = host[shard + 1] - host[shard];
    free(host);
    return status;
}

/* One shard: the partitioned order is the unique order. */
static em_status partition_single(cuda_lane *lane, const uint64_t *unique, uint64_t n,
                                  const uint32_t *first_positions, uint64_t *partitioned,
                                  uint32_t *position, uint32_t *targets, uint64_t *shard_counts,
                                  em_error *err)
{
    em_status status = lane_check(
        lane, em_gpu_memcpy_async(lane->stream, partitioned, unique, n * sizeof(uint64_t)), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_iota_u32(lane->stream, position, n), err);
    if (status == EM_OK && targets != NULL)
        status = lane_check(lane, em_gpu_memcpy_async(lane->stream, targets, first_positions,
                                                      n * sizeof(uint32_t)), err);
    shard_counts[0] = n;
    return status;
}

static em_status cuda_partition_keys(em_lane *base, const uint64_t *unique, uint64_t n,
                                     uint32_t shard_count, const uint32_t *first_positions,
                                     uint64_t *partitioned, uint32_t *position, uint32_t *targets,
                                     uint64_t *shard_counts, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    memset(shard_counts, 0, shard_count * sizeof(*shard_counts));
    if (n == 0)
        return EM_OK;
    if (shard_count == 1)
        return partition_single(lane, unique, n, first_positions, partitioned, position, targets,
                                shard_counts, err);
    scratch s = {.device = base->device};
    uint32_t *owner = NULL, *index = NULL, *sorted_owner = NULL, *sorted_index = NULL;
    uint32_t *starts = NULL;
    void *temp = NULL;
    size_t temp_bytes = 0;
    uint32_t end_bit = bits_for(shard_count);
    size_t bytes = n * sizeof(uint32_t);
    em_status status = scratch_take(&s, bytes, "partition owners", (void **)&owner, err);
    if (status == EM_OK)
        status = scratch_take(&s, bytes, "partition indices", (void **)&index, err);
    if (status == EM_OK)
        status = scratch_take(&s, bytes, "sorted owners", (void **)&sorted_owner, err);
    if (status == EM_OK)
        status = scratch_take(&s, bytes, "sorted indices", (void **)&sorted_index, err);
    if (status == EM_OK)
        status = scratch_take(&s, ((size_t)shard_count + 1) * sizeof(uint32_t), "shard starts",
                              (void **)&starts, err);
    if (status == EM_OK)
        status = take_sort_temp(&s, lane, n, end_bit, &temp, &temp_bytes, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_partition_owners(lane->stream, unique, n, shard_count,
                                                          owner, index), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_sort_pairs_u32(lane->stream, temp, temp_bytes, owner,
                                                        sorted_owner, index, sorted_index, n,
                                                        end_bit), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_partition_scatter(lane->stream, unique, sorted_index,
                                                           first_positions, n, partitioned,
                                                           position, targets), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_segment_starts(lane->stream, sorted_owner, n,
                                                        shard_count, starts), err);
    if (status == EM_OK)
        status = shard_counts_from_starts(lane, starts, shard_count, shard_counts, err);
    if (status != EM_OK)
        return finish_async(&s, lane, status, err);
    scratch_free_now(&s);
    return EM_OK;
}

static em_gpu_batch gpu_batch(const em_device_batch *batch, em_combiner combiner, uint32_t dim)
{
    return (em_gpu_batch){
        .rows = batch->rows,
        .nnz = batch->nnz,
        .offsets = batch->offsets,
        .inverse = batch->inverse,
        .position = batch->position,
        .unique_count = batch->unique_count,
        .combiner = combiner,
        .dim = dim,
    };
}

/* The batch's key positions grouped by unique index, in increasing position within a
 * group: sorted_positions[starts[u] .. starts[u + 1]) are unique u's. */
static em_status group_positions(scratch *s, cuda_lane *lane, const em_device_batch *batch,
                                 uint32_t **sorted_positions, uint32_t **starts, em_error *err)
{
    uint64_t nnz = batch->nnz;
    uint32_t end_bit = bits_for(batch->unique_count);
    uint32_t *positions = NULL, *sorted_inverse = NULL;
    void *temp = NULL;
    size_t temp_bytes = 0;
    em_status status = scratch_take(s, nnz * sizeof(uint32_t), "key positions",
                                    (void **)&positions, err);
    if (status == EM_OK)
        status = scratch_take(s, nnz * sizeof(uint32_t), "sorted inverse",
                              (void **)&sorted_inverse, err);
    if (status == EM_OK)
        status = scratch_take(s, nnz * sizeof(uint32_t), "sorted positions",
                              (void **)sorted_positions, err);
    if (status == EM_OK)
        status = scratch_take(s, (batch->unique_count + 1) * sizeof(uint32_t), "unique starts",
                              (void **)starts, err);
    if (status == EM_OK)
        status = take_sort_temp(s, lane, nnz, end_bit, &temp, &temp_bytes, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_iota_u32(lane->stream, positions, nnz), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_sort_pairs_u32(lane->stream, temp, temp_bytes,
                                                        batch->inverse, sorted_inverse, positions,
                                                        *sorted_positions, nnz, end_bit), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_segment_starts(lane->stream, sorted_inverse, nnz,
                                                        (uint32_t)batch->unique_count, *starts),
                            err);
    return status;
}

static em_status cuda_sum_gradients(em_lane *base, const em_device_batch *batch,
                                    em_combiner combiner, uint32_t dim, const float *gradients,
                                    float *partitioned_gradients, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    if (batch->nnz == 0 || batch->unique_count == 0)
        return EM_OK;
    scratch s = {.device = base->device};
    uint32_t *sorted_positions = NULL, *starts = NULL, *key_row = NULL;
    em_status status = group_positions(&s, lane, batch, &sorted_positions, &starts, err);
    if (status == EM_OK && combiner != EM_COMBINER_NONE) {
        status = scratch_take(&s, batch->nnz * sizeof(uint32_t), "key rows", (void **)&key_row,
                              err);
        if (status == EM_OK)
            status = lane_check(lane, em_gpu_key_rows(lane->stream, batch->offsets, batch->rows,
                                                      batch->nnz, key_row), err);
    }
    em_gpu_batch view = gpu_batch(batch, combiner, dim);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_sum_gradients(lane->stream, &view, sorted_positions,
                                                       starts, key_row, gradients,
                                                       partitioned_gradients), err);
    return finish_async(&s, lane, status, err);
}

static em_status cuda_combine(em_lane *base, const em_device_batch *batch, em_combiner combiner,
                              uint32_t dim, const float *vectors, float *out, em_error *err)
{
    cuda_lane *lane = lane_of(base);
    em_gpu_batch view = gpu_batch(batch, combiner, dim);
    return lane_check(lane, em_gpu_combine(lane->stream, &view, vectors, out), err);
}

static em_status cuda_copy_repeats(em_lane *base, const em_device_batch *batch,
                                   const uint32_t *first_positions, uint32_t dim, float *out,
                                   em_error *err)
{
    cuda_lane *lane = lane_of(base);
    return lane_check(lane, em_gpu_copy_repeats(lane->stream, batch->inverse, batch->nnz,
                                                first_positions, dim, out), err);
}

/* ---- shards: ordering between lanes ------------------------------------------------- */

/* Before a write on lane: wait for the shard's last write and every read since. */
static em_status order_write(cuda_shard *shard, cuda_lane *lane, em_error *err)
{
    em_status status = EM_OK;
    pthread_mutex_lock(&shard->order_lock);
    if (shard->write_recorded && shard->write_lane != lane->index)
        status = lane_check(lane, em_gpu_stream_wait(lane->stream, shard->write_event), err);
    uint32_t lanes = state_of(shard->base.device)->lane_count;
    for (uint32_t l = 0; status == EM_OK && l < lanes; l++)
        if (shard->read_recorded[l] && l != lane->index)
            status = lane_check(lane, em_gpu_stream_wait(lane->stream, shard->read_events[l]), err);
    pthread_mutex_unlock(&shard->order_lock);
    return status;
}

static em_status record_write(cuda_shard *shard, cuda_lane *lane, em_error *err)
{
    pthread_mutex_lock(&shard->order_lock);
    em_status status = lane_check(lane, em_gpu_event_record(shard->write_event, lane->stream), err);
    if (status == EM_OK) {
        shard->write_recorded = true;
        shard->write_lane = lane->index;
        uint32_t lanes = state_of(shard->base.device)->lane_count;
        for (uint32_t l = 0; l < lanes; l++)
            shard->read_recorded[l] = false;
    }
    pthread_mutex_unlock(&shard->order_lock);
    return status;
}

/* Before a read on lane: wait for the shard's last write. */
static em_status order_read(cuda_shard *shard, cuda_lane *lane, em_error *err)
{
    em_status status = EM_OK;
    pthread_mutex_lock(&shard->order_lock);
    if (shard->write_recorded && shard->write_lane != lane->index)
        status = lane_check(lane, em_gpu_stream_wait(lane->stream, shard->write_event), err);
    pthread_mutex_unlock(&shard->order_lock);
    return status;
}

static em_status record_read(cuda_shard *shard, cuda_lane *lane, em_error *err)
{
    pthread_mutex_lock(&shard->order_lock);
    em_status status =
        lane_check(lane, em_gpu_event_record(shard->read_events[lane->index], lane->stream), err);
    if (status == EM_OK)
        shard->read_recorded[lane->index] = true;
    pthread_mutex_unlock(&shard->order_lock);
    return status;
}

/* ---- shards: views and sizes --------------------------------------------------------- */

static em_gpu_map map_view(const cuda_shard *shard)
{
    return (em_gpu_map){
        .slots = shard->slots, .slot_count = shard->slot_count, .header = shard->header};
}

static em_gpu_storage storage_view(const cuda_shard *shard)
{
    return (em_gpu_storage){
        .blocks = shard->device_blocks,
        .block_shift = shard->block_shift,
        .block_mask = shard->block_mask,
        .stride = shard->stride,
        .dim = shard->dim,
        .row_floats = shard->row_floats,
        .row_limit = shard->block_count << shard->block_shift,
    };
}

static uint64_t storage_rows(const cuda_shard *shard)
{
    return shard->block_count << shard->block_shift;
}

static uint64_t side_keys(const cuda_shard *shard)
{
    return (uint64_t)(shard->side_rows[0] != EM_ROW_NONE) +
           (uint64_t)(shard->side_rows[1] != EM_ROW_NONE);
}

/* Keys a map of slot_count slots holds before it must grow. */
static uint64_t max_slot_keys(uint64_t slot_count)
{
    return slot_count / 10 * MAX_LOAD_TENTHS + slot_count % 10 * MAX_LOAD_TENTHS / 10;
}

/* ---- shards: growth -------------------------------------------------------------------- */

/* Rehashes into a map of slot_count slots (synchronizes: the old slots go back to the
 * pool). */
static em_status rehash_map(cuda_shard *shard, cuda_lane *lane, uint64_t slot_count, em_error *err)
{
    em_device *device = shard->base.device;
    em_gpu_slot *slots = NULL;
    em_status status = em_device_alloc(device, slot_count * sizeof(em_gpu_slot), "hash map slots",
                                       (void **)&slots, err);
    if (status != EM_OK)
        return status;
    em_gpu_map grown = {.slots = slots, .slot_count = slot_count, .header = shard->header};
    status = lane_check(lane, em_gpu_map_clear(lane->stream, slots, slot_count), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_map_rehash(lane->stream, shard->slots, shard->slot_count,
                                                     grown), err);
    em_status synced = lane_sync(lane, status == EM_OK ? err : NULL);
    if (status == EM_OK)
        status = synced;
    if (status != EM_OK) {
        em_device_free(device, slots);
        return status;
    }
    em_device_free(device, shard->slots);
    shard->slots = slots;
    shard->slot_count = slot_count;
    return EM_OK;
}

/* Grows the map (doubling) so that new_keys more keys stay within the maximum load. */
static em_status reserve_map(cuda_shard *shard, cuda_lane *lane, uint64_t new_keys, em_error *err)
{
    uint64_t needed = shard->size - side_keys(shard) + new_keys;
    if (needed <= max_slot_keys(shard->slot_count))
        return EM_OK;
    uint64_t slot_count = shard->slot_count;
    while (max_slot_keys(slot_count) < needed)
        slot_count *= 2;
    return rehash_map(shard, lane, slot_count, err);
}

/* Makes the block tables hold `blocks` entries (a new device table; the old one is freed
 * by the caller after a synchronize, returned in *retired). */
static em_status grow_block_tables(cuda_shard *shard, uint64_t blocks, float ***retired,
                                   em_error *err)
{
    *retired = NULL;
    if (blocks <= shard->block_capacity)
        return EM_OK;
    uint64_t capacity = shard->block_capacity < 16 ? 16 : 2 * shard->block_capacity;
    if (capacity < blocks)
        capacity = blocks;
    float **device_table = NULL;
    em_status status = em_device_alloc(shard->base.device, capacity * sizeof(float *),
                                       "row block table", (void **)&device_table, err);
    if (status != EM_OK)
        return status;
    float **host_table = realloc(shard->blocks, capacity * sizeof(float *));
    if (host_table == NULL) {
        em_device_free(shard->base.device, device_table);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "row block table: out of host memory");
    }
    shard->blocks = host_table;
    *retired = shard->device_blocks;
    shard->device_blocks = device_table;
    shard->block_capacity = capacity;
    return EM_OK;
}

/* Adds row blocks until the storage holds `rows` rows. Blocks added before a failure
 * stay (spare capacity) and are published like the others. */
static em_status reserve_storage(cuda_shard *shard, cuda_lane *lane, uint64_t rows, em_error *err)
{
    if (storage_rows(shard) >= rows)
        return EM_OK;
    uint64_t rows_per = shard->block_mask + 1;
    uint64_t blocks = (rows + rows_per - 1) / rows_per;
    float **retired = NULL;
    em_status status = grow_block_tables(shard, blocks, &retired, err);
    if (status != EM_OK)
        return status;
    uint64_t before = shard->block_count;
    while (status == EM_OK && shard->block_count < blocks) {
        void *block = NULL;
        status = em_device_alloc(shard->base.device, shard->block_bytes, "row storage", &block,
                                 err);
        if (status == EM_OK)
            shard->blocks[shard->block_count++] = block;
    }
    em_error upload_error;
    em_status published = EM_OK;
    if (shard->block_count != before || retired != NULL)
        published = cuda_copy_to_device(&lane->base, shard->device_blocks, shard->blocks,
                                        shard->block_count * sizeof(float *), &upload_error);
    if (published == EM_OK)
        published = lane_sync(lane, &upload_error);
    em_device_free(shard->base.device, retired);
    if (status == EM_OK && published != EM_OK)
        return em_error_copy(err, &upload_error);
    return status;
}

/* ---- shards: operations ------------------------------------------------------------- */

static void destroy_shard_events(cuda_shard *shard, uint32_t lanes)
{
    em_gpu_event_destroy(shard->write_event);
    for (uint32_t l = 0; shard->read_events != NULL && l < lanes; l++)
        em_gpu_event_destroy(shard->read_events[l]);
    free(shard->read_events);
    free(shard->read_recorded);
}

static void cuda_shard_destroy(em_shard *base)
{
    if (base == NULL)
        return;
    cuda_shard *shard = shard_of(base);
    em_device *device = base->device;
    for (uint64_t b = 0; b < shard->block_count; b++)
        em_device_free(device, shard->blocks[b]);
    free(shard->blocks);
    em_device_free(device, shard->device_blocks);
    em_device_free(device, shard->slots);
    em_device_free(device, shard->header);
    destroy_shard_events(shard, state_of(device)->lane_count);
    pthread_mutex_destroy(&shard->order_lock);
    free(shard);
}

static em_status create_shard_events(cuda_shard *shard, em_error *err)
{
    cuda_state *state = state_of(shard->base.device);
    shard->read_events = calloc(state->lane_count, sizeof(*shard->read_events));
    shard->read_recorded = calloc(state->lane_count, sizeof(*shard->read_recorded));
    if (shard->read_events == NULL || shard->read_recorded == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "shard events: out of host memory");
    em_status status = em__cuda_check(em_gpu_event_create(state->ordinal, 0, &shard->write_event),
                                      shard->base.device->name, err);
    for (uint32_t l = 0; status == EM_OK && l < state->lane_count; l++)
        status = em__cuda_check(em_gpu_event_create(state->ordinal, 0, &shard->read_events[l]),
                                shard->base.device->name, err);
    return status;
}

/* An empty map: cleared slots and a header with no rows, set up on a lane of its own. */
static em_status create_map(cuda_shard *shard, uint64_t expected_rows, em_error *err)
{
    em_device *device = shard->base.device;
    uint64_t slots = expected_rows + 16;
    if (slots > MAX_INITIAL_SLOTS)
        slots = MAX_INITIAL_SLOTS;
    em_status status = em_device_alloc(device, slots * sizeof(em_gpu_slot), "hash map slots",
                                       (void **)&shard->slots, err);
    if (status == EM_OK)
        status = em_device_alloc(device, sizeof(em_gpu_map_header), "hash map header",
                                 (void **)&shard->header, err);
    if (status != EM_OK)
        return status;
    shard->slot_count = slots;
    shard->side_rows[0] = shard->side_rows[1] = EM_ROW_NONE;
    em_gpu_map_header header = {.rows = 0, .side_rows = {EM_ROW_NONE, EM_ROW_NONE}, .overflow = 0};
    em_lane *lane = NULL;
    status = cuda_lane_acquire(device, &lane, err);
    if (status != EM_OK)
        return status;
    status = lane_check(lane_of(lane), em_gpu_map_clear(lane_of(lane)->stream, shard->slots, slots),
                        err);
    if (status == EM_OK)
        status = cuda_copy_to_device(lane, shard->header, &header, sizeof(header), err);
    if (status == EM_OK)
        status = lane_sync(lane_of(lane), err);
    cuda_lane_release(lane);
    return status;
}

static void set_row_geometry(cuda_shard *shard, const em_shard_spec *spec)
{
    shard->dim = spec->dim;
    em_row_blocks plan = em_row_blocks_plan(spec->dim, spec->optimizer.kind, TARGET_BLOCK_BYTES);
    shard->row_floats = plan.row_floats;
    shard->stride = plan.stride;
    shard->block_shift = plan.block_shift;
    shard->block_mask = plan.block_mask;
    shard->block_bytes = plan.block_bytes;
}

static em_status cuda_shard_create(em_device *device, const em_shard_spec *spec, em_shard **out,
                                   em_error *err)
{
    cuda_shard *shard = calloc(1, sizeof(*shard));
    if (shard == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "shard %u: out of host memory",
                            spec->index);
    shard->base.device = device;
    snprintf(shard->table, sizeof(shard->table), "%s", spec->table);
    shard->index = spec->index;
    shard->optimizer = spec->optimizer;
    shard->initializer = spec->initializer;
    set_row_geometry(shard, spec);
    pthread_mutex_init(&shard->order_lock, NULL);
    em_status status = create_shard_events(shard, err);
    if (status == EM_OK)
        status = create_map(shard, spec->expected_rows, err);
    if (status != EM_OK) {
        cuda_shard_destroy(&shard->base);
        return em_error_prefix(err, "table '%s' shard %u: ", spec->table, spec->index);
    }
    *out = &shard->base;
    return EM_OK;
}

static em_status cuda_shard_find(em_shard *base, em_lane *lane_base, const uint64_t *keys,
                                 uint64_t n, uint64_t *rows, uint64_t *missing, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    *missing = 0;
    if (n == 0)
        return EM_OK;
    em_status status = lane_check(
        lane, em_gpu_memset_async(lane->stream, lane->counter, 0, sizeof(uint64_t)), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_map_find(lane->stream, map_view(shard), keys, n, rows,
                                                  lane->counter), err);
    if (status == EM_OK)
        status = cuda_copy_to_host(lane_base, missing, lane->counter, sizeof(uint64_t), err);
    return status;
}

static em_status cuda_shard_reserve(em_shard *base, em_lane *lane, uint64_t new_keys,
                                    em_error *err)
{
    cuda_shard *shard = shard_of(base);
    em_status status = reserve_map(shard, lane_of(lane), new_keys, err);
    if (status == EM_OK)
        status = reserve_storage(shard, lane_of(lane), shard->size + new_keys, err);
    return status;
}

/* Reads the map's header back into the host copies; INTERNAL if an insert overflowed
 * the slots or the storage (reserve was not called first). */
static em_status read_back_header(cuda_shard *shard, cuda_lane *lane, em_error *err)
{
    em_gpu_map_header header;
    em_status status = cuda_copy_to_host(&lane->base, &header, shard->header, sizeof(header), err);
    if (status != EM_OK)
        return status;
    shard->size = header.rows;
    shard->side_rows[0] = header.side_rows[0];
    shard->side_rows[1] = header.side_rows[1];
    if (header.overflow != 0 || header.rows > storage_rows(shard))
        return em_error_set(err, EM_INTERNAL,
                            "insert without reserve: %" PRIu64 " rows for %" PRIu64
                            " rows of storage, %" PRIu64 " slots%s",
                            header.rows, storage_rows(shard), shard->slot_count,
                            header.overflow != 0 ? ", no free slot" : "");
    return EM_OK;
}

static em_status cuda_shard_insert_missing(em_shard *base, em_lane *lane_base,
                                           const uint64_t *keys, uint64_t n, uint64_t *rows,
                                           em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    if (n == 0)
        return EM_OK;
    scratch s = {.device = base->device};
    uint8_t *inserted = NULL;
    em_status status = scratch_take(&s, n, "insert flags", (void **)&inserted, err);
    if (status == EM_OK)
        status = order_write(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_map_insert(lane->stream, map_view(shard), keys, n, rows,
                                                    inserted), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_init(lane->stream, storage_view(shard), keys, rows,
                                                   inserted, n, shard->initializer,
                                                   shard->optimizer), err);
    if (status == EM_OK)
        status = record_write(shard, lane, err);
    if (status == EM_OK)
        status = read_back_header(shard, lane, err);
    if (status != EM_OK)
        return finish_async(&s, lane, status, err);
    scratch_free_now(&s);
    return EM_OK;
}

static em_status cuda_shard_gather(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                   uint64_t n, const uint32_t *targets, float *vectors,
                                   em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    em_status status = order_read(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_gather(lane->stream, storage_view(shard), rows, n,
                                                     targets, vectors), err);
    if (status == EM_OK)
        status = record_read(shard, lane, err);
    return status;
}

static em_status cuda_shard_apply(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                  uint64_t n, const float *gradients, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    em_status status = order_write(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_apply(lane->stream, storage_view(shard),
                                                    shard->optimizer, rows, n, gradients), err);
    if (status == EM_OK)
        status = record_write(shard, lane, err);
    return status;
}

static em_status cuda_shard_write_rows(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                       uint64_t n, const float *values, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    em_status status = order_write(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_write(lane->stream, storage_view(shard), rows, n,
                                                    values), err);
    if (status == EM_OK)
        status = record_write(shard, lane, err);
    return status;
}

/* ---- shards: export ---------------------------------------------------------------- */

/*
 * Export positions: 0 and 1 are the side rows (keys EMPTY and TOMBSTONE), 2 + s is slot
 * s. A call collects up to `limit` entries from *cursor on into device arrays of keys
 * and rows (side entries from the host copies, slots a window at a time: flags of
 * occupied slots, a scan for their ranks, a compaction of the first ones), then reads
 * the rows and copies keys and values to the host.
 */
typedef struct export_buffers {
    uint64_t *keys, *rows, *next_slot;
    float *values;
    uint32_t *flags, *rank;
    void *temp;
    size_t temp_bytes;
    uint64_t window;
} export_buffers;

static em_status take_export_buffers(scratch *s, cuda_shard *shard, cuda_lane *lane,
                                     uint64_t limit, export_buffers *b, em_error *err)
{
    em_status status = scratch_take(s, limit * sizeof(uint64_t), "export keys",
                                    (void **)&b->keys, err);
    if (status == EM_OK)
        status = scratch_take(s, limit * sizeof(uint64_t), "export rows", (void **)&b->rows, err);
    if (status == EM_OK)
        status = scratch_take(s, sizeof(uint64_t), "export cursor", (void **)&b->next_slot, err);
    if (status == EM_OK)
        status = scratch_take(s, limit * shard->row_floats * sizeof(float), "export values",
                              (void **)&b->values, err);
    if (status == EM_OK)
        status = scratch_take(s, (b->window + 1) * sizeof(uint32_t), "export flags",
                              (void **)&b->flags, err);
    if (status == EM_OK)
        status = scratch_take(s, (b->window + 1) * sizeof(uint32_t), "export ranks",
                              (void **)&b->rank, err);
    if (status == EM_OK)
        status = take_scan_temp(s, lane, b->window + 1, &b->temp, &b->temp_bytes, err);
    return status;
}

/* Side entries at positions *cursor < 2, into the first device entries. */
static em_status export_side_rows(cuda_shard *shard, cuda_lane *lane, uint64_t *cursor,
                                  uint64_t limit, const export_buffers *b, uint64_t *taken,
                                  em_error *err)
{
    static const uint64_t side_keys_by_position[2] = {EM_GPU_EMPTY_KEY, EM_GPU_TOMBSTONE_KEY};
    uint64_t keys[2], rows[2], count = 0;
    for (; *cursor < 2 && count < limit; (*cursor)++) {
        if (shard->side_rows[*cursor] == EM_ROW_NONE)
            continue;
        keys[count] = side_keys_by_position[*cursor];
        rows[count++] = shard->side_rows[*cursor];
    }
    *taken = count;
    if (count == 0)
        return EM_OK;
    em_status status = cuda_copy_to_device(&lane->base, b->keys, keys, count * sizeof(uint64_t),
                                           err);
    if (status == EM_OK)
        status = cuda_copy_to_device(&lane->base, b->rows, rows, count * sizeof(uint64_t), err);
    return status;
}

/* One window of slots from *cursor: appends up to limit - *taken entries. */
static em_status export_window(cuda_shard *shard, cuda_lane *lane, uint64_t *cursor,
                               uint64_t limit, const export_buffers *b, uint64_t *taken,
                               em_error *err)
{
    em_gpu_map map = map_view(shard);
    uint64_t begin = *cursor - 2;
    uint64_t count = shard->slot_count - begin < b->window ? shard->slot_count - begin : b->window;
    uint32_t occupied = 0;
    em_status status =
        lane_check(lane, em_gpu_map_export_flags(lane->stream, map, begin, count, b->flags), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_exclusive_scan_u32(lane->stream, b->temp, b->temp_bytes,
                                                            b->flags, b->rank, count + 1), err);
    if (status == EM_OK)
        status = cuda_copy_to_host(&lane->base, &occupied, b->rank + count, sizeof(occupied), err);
    if (status != EM_OK)
        return status;
    uint64_t take = occupied < limit - *taken ? occupied : limit - *taken;
    status = lane_check(lane, em_gpu_map_export_compact(lane->stream, map, begin, count, b->flags,
                                                        b->rank, take, *taken, b->keys, b->rows,
                                                        b->next_slot), err);
    uint64_t next_slot = begin + count;
    if (status == EM_OK && take < occupied)
        status = cuda_copy_to_host(&lane->base, &next_slot, b->next_slot, sizeof(next_slot), err);
    *cursor = 2 + next_slot;
    *taken += take;
    return status;
}

/* Reads the collected rows and copies keys and values to the host. */
static em_status export_rows(cuda_shard *shard, cuda_lane *lane, uint64_t taken,
                             const export_buffers *b, uint64_t *keys, float *values,
                             em_error *err)
{
    em_status status = order_read(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_read(lane->stream, storage_view(shard), b->rows,
                                                   taken, b->values), err);
    if (status == EM_OK)
        status = record_read(shard, lane, err);
    if (status == EM_OK)
        status = cuda_copy_to_host(&lane->base, keys, b->keys, taken * sizeof(uint64_t), err);
    if (status == EM_OK)
        status = cuda_copy_to_host(&lane->base, values, b->values,
                                   taken * shard->row_floats * sizeof(float), err);
    return status;
}

static em_status cuda_shard_export(em_shard *base, em_lane *lane_base, uint64_t *cursor,
                                   uint64_t *keys, float *values, uint64_t max, uint64_t *count,
                                   em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    *count = 0;
    uint64_t end = 2 + shard->slot_count;
    uint64_t entry_bytes = shard->row_floats * sizeof(float) + 2 * sizeof(uint64_t);
    uint64_t limit = EXPORT_MAX_BYTES / entry_bytes;
    limit = limit < 1 ? 1 : limit;
    limit = max < limit ? max : limit;
    if (limit == 0 || *cursor >= end)
        return EM_OK;
    scratch s = {.device = base->device};
    export_buffers b = {.window = shard->slot_count < EXPORT_WINDOW_SLOTS ? shard->slot_count
                                                                           : EXPORT_WINDOW_SLOTS};
    uint64_t taken = 0;
    em_status status = take_export_buffers(&s, shard, lane, limit, &b, err);
    while (status == EM_RESOURCE_EXHAUSTED && (limit > 1 || b.window > MIN_EXPORT_WINDOW)) {
        scratch_free_now(&s); /* nothing was enqueued yet */
        limit = (limit + 1) / 2;
        b.window = b.window / 2 > MIN_EXPORT_WINDOW ? b.window / 2 : MIN_EXPORT_WINDOW;
        status = take_export_buffers(&s, shard, lane, limit, &b, err);
    }
    if (status == EM_OK)
        status = export_side_rows(shard, lane, cursor, limit, &b, &taken, err);
    while (status == EM_OK && taken < limit && *cursor < end)
        status = export_window(shard, lane, cursor, limit, &b, &taken, err);
    if (status == EM_OK && taken > 0)
        status = export_rows(shard, lane, taken, &b, keys, values, err);
    if (status != EM_OK)
        return finish_async(&s, lane, status, err);
    scratch_free_now(&s);
    *count = taken;
    return EM_OK;
}

static void cuda_shard_stats(em_shard *base, em_shard_stats *out)
{
    cuda_shard *shard = shard_of(base);
    out->rows = shard->size;
    out->row_bytes = shard->block_count * shard->block_bytes;
    out->index_bytes = shard->slot_count * sizeof(em_gpu_slot);
    out->row_limit = storage_rows(shard);
}

/* ---- device ---------------------------------------------------------------------------- */

static void destroy_lane(em_device *device, cuda_lane *lane)
{
    if (lane->stream != NULL)
        lane_sync(lane, NULL);
    em_device_free(device, lane->counter);
    em_gpu_event_destroy(lane->staging_done);
    em_gpu_event_destroy(lane->handoff);
    em_gpu_stream_destroy(lane->stream);
    em_gpu_host_free(lane->staging);
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
    if (status == EM_OK)
        status = em__cuda_check(em_gpu_event_create(ordinal, 0, &lane->staging_done),
                                device->name, err);
    if (status == EM_OK)
        status = em__cuda_check(em_gpu_event_create(ordinal, 0, &lane->handoff), device->name,
                                err);
    if (status == EM_OK)
        status = em__cuda_check(em_gpu_host_alloc(staging_bytes, (void **)&lane->staging),
                                device->name, err);
    if (status == EM_OK)
        status = em_device_alloc(device, sizeof(uint64_t), "lane counter",
                                 (void **)&lane->counter, err);
    return status;
}

static const em_device_ops cuda_device_ops = {
    .region_provider = cuda_region_provider,
    .lane_acquire = cuda_lane_acquire,
    .lane_release = cuda_lane_release,
    .copy_to_device = cuda_copy_to_device,
    .copy_to_host = cuda_copy_to_host,
    .synchronize = cuda_synchronize,
    .unique_keys = cuda_unique_keys,
    .partition_keys = cuda_partition_keys,
    .sum_gradients = cuda_sum_gradients,
    .combine = cuda_combine,
    .copy_repeats = cuda_copy_repeats,
    .shard_create = cuda_shard_create,
    .shard_destroy = cuda_shard_destroy,
    .shard_find = cuda_shard_find,
    .shard_reserve = cuda_shard_reserve,
    .shard_insert_missing = cuda_shard_insert_missing,
    .shard_gather = cuda_shard_gather,
    .shard_apply = cuda_shard_apply,
    .shard_export = cuda_shard_export,
    .shard_write_rows = cuda_shard_write_rows,
    .shard_stats = cuda_shard_stats,
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
    em_device *device = calloc(1, sizeof(*device));
    cuda_state *state = calloc(1, sizeof(*state));
    if (device == NULL || state == NULL) {
        free(device);
        free(state);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "cuda device %d: out of host memory",
                            options->ordinal);
    }
    state->ordinal = options->ordinal;
    pthread_mutex_init(&state->lock, NULL);
    pthread_cond_init(&state->lane_freed, NULL);
    device->impl = state;
    device->ops = &cuda_device_ops;
    snprintf(device->name, sizeof(device->name), "cuda:%d", options->ordinal);
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
