/*
 * DESIGN: the request engine: how one request runs over a table's shards and devices.
 *
 * Everything here is orchestration: the work itself is done by device operations
 * (lib/device/device.h) on buffers from the devices' pools, so this file is the same
 * for the CPU and CUDA backends. The plan of a request (home device, shard ranges,
 * per-device segments) is described in lib/table/table_internal.h.
 *
 * All-or-nothing: validation, dedupe, partition, exchange and find change nothing;
 * then every row's step is checked to keep its values finite (common/row_check.h),
 * shard by shard under read locks; then, holding the write locks of every shard a push
 * touches, the shards whose check no longer holds are checked again (another push
 * stepped them since, and the check was not bounded or too many steps came: shard
 * versions and row_check.h),
 * the keys to create are counted, checked against the capacity, and their index and
 * storage reserved on every shard; only after all of that succeeds does any shard
 * create a row or apply a gradient, and each shard's lock goes as soon as it has been
 * stepped.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/keyhash.h"
#include "common/row_check.h"
#include "lib/base/parallel.h"
#include "lib/base/zeroed.h"
#include "lib/table/table_internal.h"

/* A push's checks enqueued on its devices, their answers not yet waited for: a push
 * alone that will evict on GPUs leaves that wait to its evictions' walks. */
typedef struct unchecked_push {
    uint64_t *problems[EM_BACKEND_MAX_DEVICES]; /* host, a word per shard of the device */
    bool pending[EM_BACKEND_MAX_DEVICES];       /* the words come with the device's wait */
} unchecked_push;

static em_status take_checks(request_context *r, unchecked_push *u, em_status status,
                             em_error *err);
static em_status settle_unchecked(request_context *r, em_error *err);

/* ---- scratch and staging ----------------------------------------------------------- */

/* Scratch of at most SCRATCH_SMALL bytes comes from a block of SCRATCH_BLOCK bytes per
 * device, aligned as the pool aligns (EM_POOL_ALIGNMENT); larger scratch straight from
 * the pool. A pool that cannot give a block fails the request as it would have failed
 * for the buffer (before anything is created: callers take scratch first). */
#define SCRATCH_SMALL ((size_t)8 << 10)
#define SCRATCH_BLOCK EM_DEVICE_SCRATCH_BLOCK

/* bytes of scratch, or a scratch block when block (the device may have one kept). */
static em_status track_scratch(request_context *r, em_device *device, size_t bytes, bool block,
                               const char *what, void **out, em_error *err)
{
    if (r->scratch_count == r->scratch_capacity)
        return em_error_set(err, EM_INTERNAL, "request scratch list full (%u buffers)",
                            r->scratch_capacity);
    em_status status = block ? em_device_scratch_take(device, what, out, err)
                             : em_device_alloc(device, bytes, what, out, err);
    if (status != EM_OK)
        return status;
    r->scratch[r->scratch_count++] = (scratch_item){device, *out, block};
    return EM_OK;
}

static void release_scratch(const scratch_item *item)
{
    if (item->block)
        em_device_scratch_give(item->device, item->pointer);
    else
        em_device_free(item->device, item->pointer);
}

em_status em__request_alloc(request_context *r, em_device *device, size_t bytes,
                               const char *what, void **out, em_error *err)
{
    size_t rounded = (bytes + EM_POOL_ALIGNMENT - 1) / EM_POOL_ALIGNMENT * EM_POOL_ALIGNMENT;
    if (rounded == 0)
        rounded = EM_POOL_ALIGNMENT;
    if (rounded > SCRATCH_SMALL)
        return track_scratch(r, device, bytes, false, what, out, err);
    struct scratch_block *block = &r->blocks[device->index];
    if (block->size - block->used < rounded) {
        void *base = NULL;
        em_status status = track_scratch(r, device, SCRATCH_BLOCK, true, what, &base, err);
        if (status != EM_OK)
            return status;
        *block = (struct scratch_block){base, 0, SCRATCH_BLOCK};
    }
    *out = block->base + block->used;
    block->used += rounded;
    return EM_OK;
}

request_mark em__request_mark(const request_context *r)
{
    return (request_mark){r->scratch_count, r->blocks[r->home->index]};
}

void em__request_rewind(request_context *r, const request_mark *mark)
{
    for (uint32_t i = r->scratch_count; i > mark->scratch_count; i--) {
        const scratch_item *item = &r->scratch[i - 1];
        struct scratch_block *block = &r->blocks[item->device->index];
        if (item->block && block->base == item->pointer) /* another device's block */
            *block = (struct scratch_block){0};
        release_scratch(item);
    }
    r->scratch_count = mark->scratch_count;
    r->blocks[r->home->index] = mark->home_block;
}

/* Whether a shard of the table lives on device d (a table's shards are contiguous
 * blocks per device, in device order). */
static bool hosts_a_shard(const em_table *table, uint32_t d)
{
    for (uint32_t s = 0; s < table->shard_count; s++)
        if (table->shard_device[s] == d)
            return true;
    return false;
}

/* Takes a lane on the home device and on every device the table has a shard on, in
 * device order (so two requests never wait on each other's lanes crosswise); the
 * backend's other devices stay free for other tables' requests (their segments are
 * empty and their lanes NULL). */
static em_status acquire_lanes(request_context *r, em_error *err)
{
    em_backend *backend = r->table->backend;
    for (uint32_t d = 0; d < backend->device_count; d++) {
        em_device *device = backend->devices[d];
        if (device != r->home && !hosts_a_shard(r->table, d))
            continue;
        em_status status = device->ops->lane_acquire(device, &r->lanes[d], err);
        if (status != EM_OK)
            return em_error_prefix(err, "table '%s': lane on %s: ", r->table->config.name,
                                   device->name);
        if (device == r->home)
            r->home_lane = r->lanes[d];
    }
    return EM_OK;
}

em_status em__request_begin(em_table *table, request_context *r, em_error *err)
{
    return em__request_begin_stamped(table, r, 0, err);
}

em_status em__request_begin_stamped(em_table *table, request_context *r, uint64_t stamp,
                                    em_error *err)
{
    memset(r, 0, sizeof(*r));
    r->table = table;
    /* a table on one device is served there: no exchange, and its requests may go at
     * once; a table over several takes the backend's homes in turn */
    r->home = table->shards_device != UINT32_MAX ? table->backend->devices[table->shards_device]
                                                 : em_backend_home_device(table->backend);
    r->gradient_bound = -1.0f;
    if (em_eviction_tracks_access(&table->config.eviction))
        r->access_stamp = stamp != 0 ? stamp
                                     : atomic_fetch_add_explicit(&table->access_clock, 1,
                                                                 memory_order_relaxed) + 1;
    /* the bookkeeping arrays, per shard and per device, in one allocation */
    _Static_assert(_Alignof(scratch_item) <= 8 && _Alignof(segment) <= 8 &&
                       _Alignof(struct scratch_block) <= 8 && sizeof(scratch_item) % 8 == 0 &&
                       sizeof(segment) % 8 == 0,
                   "request bookkeeping arrays follow each other 8-byte aligned");
    size_t devices = table->backend->device_count, shards = table->shard_count;
    r->scratch_capacity = SCRATCH_FIXED + SCRATCH_PER_DEVICE * (uint32_t)devices;
    size_t bytes = r->scratch_capacity * sizeof(*r->scratch) +
                   (4 * shards + 1) * sizeof(uint64_t) +
                   devices * (sizeof(*r->segments) + sizeof(*r->lanes) + sizeof(*r->blocks));
    char *books = em_zeroed(1, bytes);
    if (books == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "table '%s': request bookkeeping: "
                            "out of host memory", table->config.name);
    r->scratch = (scratch_item *)books;
    r->shard_start = (uint64_t *)(r->scratch + r->scratch_capacity);
    r->shard_missing = r->shard_start + shards + 1;
    r->shard_rejected = r->shard_missing + shards;
    r->shard_seen = r->shard_rejected + shards;
    r->segments = (segment *)(r->shard_seen + shards);
    r->lanes = (em_lane **)(r->segments + devices);
    r->blocks = (struct scratch_block *)(r->lanes + devices);
    return acquire_lanes(r, err);
}

static void release_lanes(request_context *r)
{
    em_backend *backend = r->table->backend;
    for (uint32_t d = 0; r->lanes != NULL && d < backend->device_count; d++) {
        if (r->lanes[d] == NULL)
            continue;
        /* Scratch is freed next: releasing waits until nothing reads or writes it. */
        r->lanes[d]->device->ops->lane_release(r->lanes[d]);
    }
}

/* Gives back what em__claim_rows claimed and was not used. */
void em__release_claim(request_context *r)
{
    if (r->rows_claimed > 0)
        atomic_fetch_sub_explicit(&r->table->rows_claimed, r->rows_claimed,
                                  memory_order_relaxed);
    r->rows_claimed = 0;
}

void em__request_end(request_context *r)
{
    if (r->table != NULL)
        em__release_claim(r);
    release_lanes(r);
    for (uint32_t i = r->scratch_count; r->scratch != NULL && i > 0; i--)
        release_scratch(&r->scratch[i - 1]);
    free(r->scratch); /* every bookkeeping array (em__request_begin) */
}

/* Makes host data visible at home: aliased when the home device addresses host memory,
 * else copied into scratch. */
em_status em__stage_input(request_context *r, const void *host, size_t bytes,
                             const char *what, const void **out, em_error *err)
{
    if (r->home->host_addressable) {
        *out = host;
        return EM_OK;
    }
    void *staged = NULL;
    em_status status = em__request_alloc(r, r->home, bytes, what, &staged, err);
    if (status == EM_OK)
        status = r->home->ops->copy_to_device(r->home_lane, staged, host, bytes, err);
    *out = staged;
    return status;
}

em_status em__stage_offsets(request_context *r, const em_csr *batch, em_error *err)
{
    r->batch.rows = batch->rows;
    return em__stage_input(r, batch->offsets, ((size_t)batch->rows + 1) * sizeof(uint32_t),
                           "request offsets", (const void **)&r->batch.offsets, err);
}

/* ---- planning: dedupe, partition, segments ---------------------------------------- */

/* Stages the batch keys and takes the dedupe's buffers (nnz entries each): *unique,
 * *inverse (also r->batch.inverse), r->first. */
static em_status dedupe_buffers(request_context *r, const uint64_t *host_keys, uint64_t nnz,
                                uint64_t **unique, uint32_t **inverse, em_error *err)
{
    em_device *home = r->home;
    em_status status = em__stage_input(r, host_keys, nnz * sizeof(uint64_t), "request keys",
                                       (const void **)&r->keys, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, nnz * sizeof(uint64_t), "unique keys", (void **)unique,
                                   err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, nnz * sizeof(uint32_t), "key inverse",
                                   (void **)inverse, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, nnz * sizeof(uint32_t), "first positions",
                                   (void **)&r->first, err);
    r->batch.inverse = *inverse;
    r->batch.nnz = nnz;
    return status;
}

/* Takes the partition's buffers for n keys: r->partitioned, *position (also
 * r->batch.position) and, with want_targets, r->targets. */
static em_status partition_buffers(request_context *r, uint64_t n, bool want_targets,
                                   uint32_t **position, em_error *err)
{
    em_device *home = r->home;
    em_status status = em__request_alloc(r, home, n * sizeof(uint64_t), "partitioned keys",
                                         (void **)&r->partitioned, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, n * sizeof(uint32_t), "key positions",
                                   (void **)position, err);
    if (status == EM_OK && want_targets)
        status = em__request_alloc(r, home, n * sizeof(uint32_t), "output targets",
                                   (void **)&r->targets, err);
    r->batch.position = *position;
    return status;
}

/* r->shard_start[s + 1] held shard s's key count: now where each shard's keys begin. */
static void shard_starts_from_counts(request_context *r)
{
    r->shard_start[0] = 0;
    for (uint32_t s = 0; s < r->table->shard_count; s++)
        r->shard_start[s + 1] += r->shard_start[s];
}

static em_status dedupe_keys(request_context *r, const uint64_t *host_keys, uint64_t nnz,
                             uint64_t **unique, em_error *err)
{
    uint32_t *inverse = NULL;
    em_status status = dedupe_buffers(r, host_keys, nnz, unique, &inverse, err);
    if (status == EM_OK)
        status = r->home->ops->unique_keys(r->home_lane, r->keys, nnz, *unique, inverse, r->first,
                                           &r->batch.unique_count, err);
    return status;
}

static em_status partition_keys(request_context *r, const uint64_t *unique, bool want_targets,
                                em_error *err)
{
    uint64_t count = r->batch.unique_count;
    uint32_t *position = NULL;
    em_status status = partition_buffers(r, count, want_targets, &position, err);
    if (status == EM_OK)
        status = r->home->ops->partition_keys(r->home_lane, unique, count, r->table->shard_count,
                                              r->first, r->partitioned, position, r->targets,
                                              r->shard_start + 1, err);
    if (status == EM_OK)
        shard_starts_from_counts(r);
    return status;
}

static void plan_segments(request_context *r)
{
    em_table *table = r->table;
    em_backend *backend = table->backend;
    uint32_t shard = 0;
    for (uint32_t d = 0; d < backend->device_count; d++) {
        segment *seg = &r->segments[d];
        seg->device = backend->devices[d];
        seg->lane = r->lanes[d];
        seg->remote = seg->device != r->home;
        seg->first_shard = shard;
        while (shard < table->shard_count && table->shard_device[shard] == d)
            shard++;
        seg->end_shard = shard;
        seg->begin = r->shard_start[seg->first_shard];
        seg->count = r->shard_start[seg->end_shard] - seg->begin;
        seg->targets = r->targets != NULL ? r->targets + seg->begin : NULL;
    }
}

/* Puts each segment's share of a home array (element_bytes per key, in partitioned
 * order) on the segment's device: aliased at home, sent through the exchange
 * elsewhere. Stores the device pointers through pointer_of. */
em_status em__scatter_to_segments(request_context *r, const void *home_array,
                                     size_t element_bytes, const char *what,
                                     void **(*pointer_of)(segment *), em_error *err)
{
    em_backend *backend = r->table->backend;
    em_transfer *transfers = em_zeroed(backend->device_count, sizeof(*transfers));
    if (transfers == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "%s: out of host memory", what);
    size_t transfer_count = 0;
    em_status status = EM_OK;
    for (uint32_t d = 0; d < backend->device_count && status == EM_OK; d++) {
        segment *seg = &r->segments[d];
        const char *source = (const char *)home_array + seg->begin * element_bytes;
        size_t bytes = seg->count * element_bytes;
        if (!seg->remote || seg->count == 0) {
            *pointer_of(seg) = (void *)source;
            continue;
        }
        status = em__request_alloc(r, seg->device, bytes, what, pointer_of(seg), err);
        if (status != EM_OK)
            break;
        transfers[transfer_count++] = (em_transfer){r->home_lane, source, seg->lane,
                                                    *pointer_of(seg), bytes};
    }
    if (status == EM_OK && transfer_count > 0)
        status = em_exchange_run(backend->exchange, transfers, transfer_count, err);
    free(transfers);
    return status;
}

/* The reverse: remote segments' payloads come back into the home array. */
em_status em__gather_from_segments(request_context *r, void *home_array,
                                      size_t element_bytes, em_error *err)
{
    em_backend *backend = r->table->backend;
    em_transfer *transfers = em_zeroed(backend->device_count, sizeof(*transfers));
    if (transfers == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "gather: out of host memory");
    size_t transfer_count = 0;
    for (uint32_t d = 0; d < backend->device_count; d++) {
        segment *seg = &r->segments[d];
        if (!seg->remote || seg->count == 0)
            continue;
        transfers[transfer_count++] =
            (em_transfer){seg->lane, seg->payload, r->home_lane,
                          (char *)home_array + seg->begin * element_bytes,
                          seg->count * element_bytes};
    }
    em_status status = EM_OK;
    if (transfer_count > 0)
        status = em_exchange_run(backend->exchange, transfers, transfer_count, err);
    free(transfers);
    return status;
}

static void **segment_keys(segment *seg)
{
    return (void **)&seg->keys;
}

void **em__segment_payload(segment *seg)
{
    return &seg->payload;
}

/* Offset of shard s's keys within its segment. */
static uint64_t shard_offset(const request_context *r, const segment *seg, uint32_t s)
{
    return r->shard_start[s] - seg->begin;
}

static uint64_t shard_key_count(const request_context *r, uint32_t s)
{
    return r->shard_start[s + 1] - r->shard_start[s];
}

/* Rows the table may still create beside the claims of requests sharing it (a snapshot
 * of a count others change). */
uint64_t em__room_left(em_table *table)
{
    uint64_t claimed = atomic_load_explicit(&table->rows_claimed, memory_order_relaxed);
    return claimed < table->config.capacity ? table->config.capacity - claimed : 0;
}

/* A request that holds the table alone looks up its keys in the shards of a device in
 * host memory, and does its shards' work (run_on_shards), a shard on each of the
 * backend's eviction threads when it has this many keys: nothing else could use them. */
#define ALONE_PARALLEL_KEYS (UINT64_C(1) << 12)

static bool finds_beside(const request_context *r, const segment *seg)
{
    return r->alone && !r->stop_when_full && r->table->backend->eviction_threads > 1 &&
           seg->device->host_addressable && seg->end_shard - seg->first_shard > 1 &&
           seg->count >= ALONE_PARALLEL_KEYS;
}

/* The keys a segment's shards found missing (r->shard_missing, once they have come
 * back). */
static uint64_t segment_missing(const request_context *r, const segment *seg)
{
    uint64_t missing = 0;
    for (uint32_t s = seg->first_shard; s < seg->end_shard; s++)
        missing += r->shard_missing[s];
    return missing;
}

typedef struct find_job {
    request_context *r;
    segment *seg;
    em_status *status;
    em_error *errors;
} find_job;

static void run_find_job(void *context, uint64_t i)
{
    find_job *job = context;
    request_context *r = job->r;
    em_table *table = r->table;
    segment *seg = job->seg;
    uint32_t s = seg->first_shard + (uint32_t)i;
    uint64_t offset = shard_offset(r, seg, s), n = shard_key_count(r, s);
    em__shard_read_lock(table, s);
    r->shard_seen[s] = atomic_load_explicit(&table->shard_creations[s].value, memory_order_relaxed);
    job->status[i] = seg->device->ops->shard_find(table->shards[s], seg->lane, seg->keys + offset,
                                                  n, seg->rows + offset, &r->shard_missing[s],
                                                  &job->errors[i]);
    em__shard_unlock(table, s);
}

/* find_on_device's lookups a shard on each thread (finds_beside); a failure is that of
 * the first shard that failed. */
static em_status find_beside(request_context *r, segment *seg, em_error *err)
{
    uint32_t shards = seg->end_shard - seg->first_shard;
    em_status *status = malloc(shards * sizeof(*status));
    em_error *errors = malloc(shards * sizeof(*errors));
    em_status failed = EM_OK;
    if (status == NULL || errors == NULL)
        failed = em_error_set(err, EM_RESOURCE_EXHAUSTED, "table '%s': out of host memory",
                              r->table->config.name);
    if (failed == EM_OK) {
        find_job job = {r, seg, status, errors};
        em_parallel_pool_run(r->table->backend->workers, shards,
                             r->table->backend->eviction_threads, run_find_job, &job);
    }
    for (uint32_t i = 0; failed == EM_OK && i < shards; i++)
        if (status[i] != EM_OK) {
            failed = status[i];
            *err = errors[i];
        }
    if (failed == EM_OK)
        r->missing += segment_missing(r, seg);
    free(status);
    free(errors);
    return failed;
}

/* Where each shard of the segment starts among its keys, and where the last ends (host
 * memory, end_shard - first_shard + 1 entries, the caller frees them); NULL with err set
 * when out of host memory. */
static uint64_t *shard_offsets(const request_context *r, const segment *seg, em_error *err)
{
    uint64_t *offsets = malloc((seg->end_shard - seg->first_shard + 1) * sizeof(uint64_t));
    if (offsets == NULL) {
        em_error_set(err, EM_RESOURCE_EXHAUSTED, "table '%s': out of host memory",
                     r->table->config.name);
        return NULL;
    }
    for (uint32_t s = seg->first_shard; s <= seg->end_shard; s++)
        offsets[s - seg->first_shard] = shard_offset(r, seg, s);
    return offsets;
}

/* find_on_device's finds a shard at a time: into counts (device words) where the device
 * has them, else into r->shard_missing, stopping as find_on_device says. */
static em_status find_shard_by_shard(request_context *r, segment *seg, uint64_t *counts,
                                     uint64_t found_missing, em_error *err)
{
    em_table *table = r->table;
    const em_device_ops *ops = seg->device->ops;
    em_status status = EM_OK;
    for (uint32_t s = seg->first_shard; status == EM_OK && s < seg->end_shard; s++) {
        uint64_t offset = shard_offset(r, seg, s), n = shard_key_count(r, s);
        /* keys are created (and maps grow) under the shard's write lock */
        em__shard_read_lock(table, s);
        r->shard_seen[s] = atomic_load_explicit(&table->shard_creations[s].value,
                                                memory_order_relaxed);
        status = counts != NULL
                     ? ops->shard_find_async(table->shards[s], seg->lane, seg->keys + offset, n,
                                             seg->rows + offset, &counts[s - seg->first_shard],
                                             err)
                     : ops->shard_find(table->shards[s], seg->lane, seg->keys + offset, n,
                                       seg->rows + offset, &r->shard_missing[s], err);
        em__shard_unlock(table, s);
        if (status == EM_OK && counts == NULL && r->stop_when_full) {
            found_missing += r->shard_missing[s];
            if (found_missing > em__room_left(table)) {
                r->missing = found_missing; /* at least */
                r->find_stopped = true;
                return EM_OK;
            }
        }
    }
    return status;
}

/* find_on_device's finds of every shard of the device in one go (shards_find_async), their
 * missing counts into counts (device words), under every shard's read lock. */
static em_status find_shards_at_once(request_context *r, segment *seg, uint64_t *counts,
                                     em_error *err)
{
    em_table *table = r->table;
    uint32_t shards = seg->end_shard - seg->first_shard;
    uint64_t *offsets = shard_offsets(r, seg, err);
    if (offsets == NULL)
        return EM_RESOURCE_EXHAUSTED;
    /* keys are created (and maps grow) under the shard's write lock */
    for (uint32_t s = seg->first_shard; s < seg->end_shard; s++) {
        em__shard_read_lock(table, s);
        r->shard_seen[s] = atomic_load_explicit(&table->shard_creations[s].value,
                                                memory_order_relaxed);
    }
    em_status status = seg->device->ops->shards_find_async(&table->shards[seg->first_shard],
                                                           shards, seg->lane, seg->keys,
                                                           offsets, seg->rows, counts, err);
    for (uint32_t s = seg->first_shard; s < seg->end_shard; s++)
        em__shard_unlock(table, s);
    free(offsets);
    return status;
}

/* Finds the keys of every shard of a device. Where the device can (shard_find_async),
 * the shards' missing counts land in device words and come back together, one wait for
 * the device instead of one per shard, and where it finds several shards in one go
 * (shards_find_async), a few operations for all of them instead of a few each; where it
 * can also read them back later
 * (copy_to_host_later), *pending is set and the counts arrive when the caller
 * synchronizes the lane, so that the finds of several devices run at once. Else, with
 * r->stop_when_full, it stops after the shard where more keys than the table's room are
 * missing (r->find_stopped). */
static em_status find_on_device(request_context *r, segment *seg, bool *pending, em_error *err)
{
    *pending = false;
    em_table *table = r->table;
    const em_device_ops *ops = seg->device->ops;
    uint32_t shards = seg->end_shard - seg->first_shard;
    uint64_t *counts = NULL; /* device words, one per shard */
    uint64_t found_missing = r->missing; /* on earlier devices and shards */
    em_status status = em__request_alloc(r, seg->device, seg->count * sizeof(uint64_t),
                                         "key rows", (void **)&seg->rows, err);
    if (status == EM_OK && ops->shard_find_async != NULL)
        status = em__request_alloc(r, seg->device, shards * sizeof(uint64_t), "missing counts",
                                   (void **)&counts, err);
    if (status == EM_OK && r->keys_absent && seg->device->host_addressable) {
        /* the caller vouches that none is there: every key is missing, and
         * em_table_import_new checks that each was created */
        for (uint64_t i = 0; i < seg->count; i++)
            seg->rows[i] = EM_ROW_NONE;
        for (uint32_t s = seg->first_shard; s < seg->end_shard; s++) {
            r->shard_seen[s] = atomic_load_explicit(&table->shard_creations[s].value,
                                                    memory_order_relaxed);
            r->shard_missing[s] = shard_key_count(r, s);
            r->missing += r->shard_missing[s];
        }
        return EM_OK;
    }
    if (status != EM_OK)
        return status;
    if (counts == NULL && finds_beside(r, seg))
        return find_beside(r, seg, err);
    status = counts != NULL && ops->shards_find_async != NULL && shards > 1
                 ? find_shards_at_once(r, seg, counts, err)
                 : find_shard_by_shard(r, seg, counts, found_missing, err);
    if (status != EM_OK || r->find_stopped)
        return status;
    if (counts != NULL && ops->copy_to_host_later != NULL) {
        status = ops->copy_to_host_later(seg->lane, &r->shard_missing[seg->first_shard], counts,
                                         shards * sizeof(uint64_t), err);
        *pending = status == EM_OK;
        return status;
    }
    if (status == EM_OK && counts != NULL)
        status = ops->copy_to_host(seg->lane, &r->shard_missing[seg->first_shard], counts,
                                   shards * sizeof(uint64_t), err);
    if (status == EM_OK)
        r->missing += segment_missing(r, seg);
    return status;
}

/* Waits for the lanes of the devices marked in `which`: in one wait where their kind
 * can (synchronize_lanes: the host polls GPUs that work at once together), else one after
 * the other. */
static em_status synchronize_marked(request_context *r, const bool *which, em_error *err)
{
    em_lane *lanes[EM_BACKEND_MAX_DEVICES];
    uint32_t count = 0;
    for (uint32_t d = 0; d < r->table->backend->device_count; d++)
        if (which[d] && r->lanes[d] != NULL)
            lanes[count++] = r->lanes[d];
    if (count == 0)
        return EM_OK;
    const em_device_ops *ops = lanes[0]->device->ops;
    if (ops->synchronize_lanes != NULL)
        return ops->synchronize_lanes(lanes, count, err);
    em_status status = EM_OK;
    for (uint32_t i = 0; i < count; i++) {
        em_error later;
        em_status synchronized = ops->synchronize(lanes[i], status == EM_OK ? err : &later);
        if (status == EM_OK)
            status = synchronized;
    }
    return status;
}

/* Finds the keys on every device: the finds of all devices are enqueued before any is
 * waited for (find_on_device's pending counts), then their lanes are synchronized in one
 * wait and the counts added, so a table over several GPUs looks its keys up on all of
 * them at once. A request with r->counts_later does not wait for them: they come back
 * with its next wait (em__missing_found), a pull's answer or a push's checks. */
static em_status find_keys(request_context *r, em_error *err)
{
    em_table *table = r->table;
    uint32_t devices = table->backend->device_count;
    bool pending[EM_BACKEND_MAX_DEVICES] = {false};
    em_status status = EM_OK;
    r->missing = 0;
    for (uint32_t d = 0; status == EM_OK && d < devices && !r->find_stopped; d++)
        if (r->segments[d].count > 0)
            status = find_on_device(r, &r->segments[d], &pending[d], err);
    for (uint32_t d = 0; status == EM_OK && r->counts_later && d < devices; d++)
        r->counts_pending = r->counts_pending || pending[d];
    if (r->counts_pending) /* em__missing_found adds every device's up at the end */
        return EM_OK;
    em_error later;
    em_status synchronized = synchronize_marked(r, pending, status == EM_OK ? err : &later);
    if (status == EM_OK)
        status = synchronized;
    for (uint32_t d = 0; status == EM_OK && d < devices; d++)
        if (pending[d])
            r->missing += segment_missing(r, &r->segments[d]);
    return status;
}

void em__missing_found(request_context *r)
{
    if (!r->counts_pending)
        return;
    r->counts_pending = false;
    r->missing = 0;
    for (uint32_t d = 0; d < r->table->backend->device_count; d++)
        if (r->segments[d].count > 0)
            r->missing += segment_missing(r, &r->segments[d]);
}

void em__plan_found(request_context *r, uint64_t nnz, uint64_t *unique, uint32_t *inverse,
                    uint32_t *first, uint64_t *rows, uint64_t unique_count, uint64_t missing,
                    uint64_t seen, bool want_targets)
{
    r->batch.nnz = nnz;
    r->batch.inverse = inverse;
    r->batch.unique_count = unique_count;
    r->batch.position = NULL; /* one shard: the partitioned order is the unique order */
    r->first = first;
    r->partitioned = unique;
    r->targets = want_targets ? first : NULL;
    r->shard_start[0] = 0;
    r->shard_start[1] = unique_count;
    plan_segments(r);
    for (uint32_t d = 0; d < r->table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        seg->keys = r->partitioned + seg->begin; /* the one shard is at home */
        seg->rows = seg->count > 0 ? rows : NULL;
    }
    r->shard_seen[0] = seen;
    r->shard_missing[0] = missing;
    r->missing = missing;
}

/* dedupe_keys and partition_keys in one operation of the home device, which waits for
 * it once (unique_partition_keys): its buffers hold nnz entries, the unique count not
 * being known before. */
static em_status dedupe_and_partition(request_context *r, const uint64_t *host_keys,
                                      uint64_t nnz, bool want_targets, em_error *err)
{
    uint64_t *unique = NULL;
    uint32_t *inverse = NULL, *position = NULL;
    em_status status = dedupe_buffers(r, host_keys, nnz, &unique, &inverse, err);
    if (status == EM_OK)
        status = partition_buffers(r, nnz, want_targets, &position, err);
    if (status == EM_OK)
        status = r->home->ops->unique_partition_keys(r->home_lane, r->keys, nnz,
                                                     r->table->shard_count, unique, inverse,
                                                     r->first, r->partitioned, position,
                                                     r->targets, &r->batch.unique_count,
                                                     r->shard_start + 1, err);
    if (status == EM_OK)
        shard_starts_from_counts(r);
    return status;
}

/* Whether the dedupe, partition and find of a request's nnz keys go in one operation of
 * the home device with one wait (unique_partition_find_async): its table has two shards
 * or more, all at home, and the keys are to be found. */
static bool finds_with_partition(const request_context *r, uint64_t nnz)
{
    return r->home->ops->unique_partition_find_async != NULL && nnz > 0 &&
           r->table->shard_count > 1 && em__shards_at_home(r) && !r->keys_absent;
}

/* em__plan_and_find in one operation of the home device and one wait
 * (finds_with_partition), under every shard's read lock while it is enqueued. */
static em_status dedupe_partition_and_find(request_context *r, const uint64_t *host_keys,
                                           uint64_t nnz, bool want_targets, em_error *err)
{
    em_table *table = r->table;
    uint32_t shards = table->shard_count;
    uint64_t *unique = NULL, *rows = NULL;
    uint32_t *inverse = NULL, *position = NULL;
    uint32_t *starts = malloc(((size_t)shards + 1) * sizeof(*starts));
    em_status status = starts != NULL ? dedupe_buffers(r, host_keys, nnz, &unique, &inverse, err)
                                      : em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                                     "table '%s': out of host memory",
                                                     table->config.name);
    if (status == EM_OK)
        status = partition_buffers(r, nnz, want_targets, &position, err);
    if (status == EM_OK)
        status = em__request_alloc(r, r->home, nnz * sizeof(uint64_t), "key rows",
                                   (void **)&rows, err);
    if (status == EM_OK) { /* keys are created (and maps grow) under the write locks */
        em__lock_all_shards(table, false);
        for (uint32_t s = 0; s < shards; s++)
            r->shard_seen[s] = atomic_load_explicit(&table->shard_creations[s].value,
                                                    memory_order_relaxed);
        status = r->home->ops->unique_partition_find_async(
            table->shards, shards, r->home_lane, r->keys, nnz, unique, inverse, r->first,
            r->partitioned, position, r->targets, rows, starts, r->shard_missing, err);
        em__unlock_all_shards(table);
    }
    if (starts != NULL) { /* what was enqueued is done before its buffers go back */
        em_error later;
        em_status synchronized =
            r->home->ops->synchronize(r->home_lane, status == EM_OK ? err : &later);
        if (status == EM_OK)
            status = synchronized;
    }
    if (status == EM_OK) {
        for (uint32_t s = 0; s <= shards; s++)
            r->shard_start[s] = starts[s];
        r->batch.unique_count = starts[shards];
        plan_segments(r);
        r->missing = 0;
        for (uint32_t d = 0; d < table->backend->device_count; d++) {
            segment *seg = &r->segments[d]; /* the home one holds every key */
            seg->keys = r->partitioned + seg->begin;
            seg->rows = seg->count > 0 ? rows + seg->begin : NULL;
            r->missing += segment_missing(r, seg);
        }
    }
    free(starts);
    return status;
}

/* Stages the batch keys, dedupes, partitions, sends each device its keys and finds
 * them. Changes nothing in the table. want_targets asks for the output position of
 * every partitioned key (for gathering straight into a per-key output). */
em_status em__plan_and_find(request_context *r, const uint64_t *host_keys, uint64_t nnz,
                               bool want_targets, em_error *err)
{
    uint64_t *unique = NULL;
    em_status status = EM_OK;
    if (finds_with_partition(r, nnz))
        return dedupe_partition_and_find(r, host_keys, nnz, want_targets, err);
    if (r->home->ops->unique_partition_keys != NULL && nnz > 0) {
        status = dedupe_and_partition(r, host_keys, nnz, want_targets, err);
    } else {
        status = dedupe_keys(r, host_keys, nnz, &unique, err);
        if (status == EM_OK)
            status = partition_keys(r, unique, want_targets, err);
    }
    if (status != EM_OK)
        return status;
    plan_segments(r);
    status = em__scatter_to_segments(r, r->partitioned, sizeof(uint64_t), "segment keys",
                                     segment_keys, err);
    if (status != EM_OK)
        return status;
    return find_keys(r, err);
}

/* ---- creating keys ----------------------------------------------------------------- */

static void describe_pools(const em_backend *backend, char *buffer, size_t capacity)
{
    size_t used = 0;
    buffer[0] = '\0';
    for (uint32_t d = 0; d < backend->device_count && used < capacity; d++) {
        em_pool_stats stats;
        em_pool_get_stats(backend->devices[d]->pool, &stats);
        int written = snprintf(buffer + used, capacity - used,
                               "%spool %s: %" PRIu64 " of %" PRIu64 " bytes in use (limit %"
                               PRIu64 ")", d == 0 ? "" : "; ", backend->devices[d]->name,
                               stats.bytes_in_use, stats.bytes_reserved, stats.bytes_limit);
        if (written < 0)
            break;
        used += (size_t)written;
    }
}

bool em__claim_capacity(request_context *r, uint64_t n)
{
    em_table *table = r->table;
    uint64_t claimed = atomic_load_explicit(&table->rows_claimed, memory_order_relaxed);
    do {
        if (claimed > table->config.capacity || n > table->config.capacity - claimed)
            return false;
    } while (!atomic_compare_exchange_weak_explicit(&table->rows_claimed, &claimed, claimed + n,
                                                    memory_order_relaxed,
                                                    memory_order_relaxed));
    r->rows_claimed += n;
    return true;
}

bool em__claim_rows(request_context *r)
{
    return em__claim_capacity(r, r->missing);
}

void em__rows_added(em_table *table, uint64_t n)
{
    atomic_fetch_add_explicit(&table->rows, n, memory_order_relaxed);
    atomic_fetch_add_explicit(&table->rows_claimed, n, memory_order_relaxed);
}

void em__rows_removed(em_table *table, uint64_t n)
{
    atomic_fetch_sub_explicit(&table->rows, n, memory_order_relaxed);
    atomic_fetch_sub_explicit(&table->rows_claimed, n, memory_order_relaxed);
}

/* Rows in the table (exact under the exclusive lock). */
static uint64_t table_rows(const em_table *table)
{
    return atomic_load_explicit(&((em_table *)table)->rows, memory_order_relaxed);
}

static em_status check_capacity(const request_context *r, em_error *err)
{
    const em_table *table = r->table;
    if (r->missing <= table->config.capacity - table_rows(table))
        return EM_OK;
    char pools[256];
    describe_pools(table->backend, pools, sizeof(pools));
    return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                        "table '%s': capacity %" PRIu64 " rows would be exceeded: it holds %"
                        PRIu64 " rows and this request would create %" PRIu64
                        " new keys; nothing was applied (%s)",
                        table->config.name, table->config.capacity, table_rows(table),
                        r->missing, pools);
}

/* Reserves index and storage for the keys each shard creates, after the rows it evicts
 * first (evict: per shard, or NULL). */
static em_status reserve_missing(request_context *r, const uint64_t *evict, em_error *err)
{
    em_table *table = r->table;
    for (uint32_t s = 0; s < table->shard_count; s++) {
        if (r->shard_missing[s] == 0 && (evict == NULL || evict[s] == 0))
            continue;
        em_device *device = table->shards[s]->device;
        em_lane *lane = r->lanes[table->shard_device[s]];
        em_status status = device->ops->shard_reserve(table->shards[s], lane, r->shard_missing[s],
                                                      evict != NULL ? evict[s] : 0, err);
        if (status != EM_OK)
            return em_error_prefix(err, "table '%s' shard %u: cannot make room for %" PRIu64
                                   " new keys, nothing was applied: ",
                                   table->config.name, s, r->shard_missing[s]);
    }
    return EM_OK;
}

static bool segment_creates(const request_context *r, const segment *seg)
{
    for (uint32_t s = seg->first_shard; s < seg->end_shard; s++)
        if (r->shard_missing[s] != 0)
            return true;
    return false;
}

/* How many shards of the segment have keys (wanting missing ones too: keys to insert). */
static uint32_t shards_with_keys(const request_context *r, const segment *seg, bool missing)
{
    uint32_t busy = 0;
    for (uint32_t s = seg->first_shard; s < seg->end_shard; s++)
        busy += missing ? r->shard_missing[s] > 0 : shard_key_count(r, s) > 0;
    return busy;
}

/* enqueue_inserts of a device's shards in one go (shards_insert_missing_async); on an
 * error none of them inserted (*failed: the first). */
static em_status insert_shards_at_once(request_context *r, segment *seg, uint32_t *failed,
                                       em_error *err)
{
    em_table *table = r->table;
    *failed = seg->first_shard;
    uint64_t *offsets = shard_offsets(r, seg, err);
    if (offsets == NULL)
        return EM_RESOURCE_EXHAUSTED;
    em_status status = seg->device->ops->shards_insert_missing_async(
        &table->shards[seg->first_shard], seg->end_shard - seg->first_shard, seg->lane,
        seg->keys, offsets, &r->shard_missing[seg->first_shard], seg->rows, err);
    free(offsets);
    if (status != EM_OK)
        return em_error_prefix(err, "table '%s' shards %u to %u: ", table->config.name,
                               seg->first_shard, seg->end_shard - 1);
    *failed = seg->end_shard;
    return EM_OK;
}

/* Inserts the missing keys of a device's shards (their write locks held): enqueued where
 * the device can (shard_insert_missing_async), to be waited for with the other devices',
 * and where it inserts several shards in one go (shards_insert_missing_async) and two
 * shards or more lack keys, a few operations for all of them instead of a few each.
 * *failed: the shard whose insert failed (seg->end_shard: none). */
static em_status enqueue_inserts(request_context *r, segment *seg, uint32_t *failed,
                                 em_error *err)
{
    em_table *table = r->table;
    const em_device_ops *ops = seg->device->ops;
    bool async = ops->shard_insert_missing_async != NULL;
    if (async && ops->shards_insert_missing_async != NULL && shards_with_keys(r, seg, true) >= 2)
        return insert_shards_at_once(r, seg, failed, err);
    em_status status = EM_OK;
    *failed = seg->end_shard;
    for (uint32_t s = seg->first_shard; status == EM_OK && s < seg->end_shard; s++) {
        if (r->shard_missing[s] == 0)
            continue;
        uint64_t offset = shard_offset(r, seg, s);
        status = (async ? ops->shard_insert_missing_async : ops->shard_insert_missing)(
            table->shards[s], seg->lane, seg->keys + offset, shard_key_count(r, s),
            seg->rows + offset, !r->rows_written_next, err);
        if (status != EM_OK) {
            em_error_prefix(err, "table '%s' shard %u: ", table->config.name, s);
            *failed = s;
        }
    }
    return status;
}

/* Once a device's inserts are done: the shards before a failed one have their keys, and
 * they are taken in (shard_insert_settle, for inserts enqueued) and counted. */
static em_status settle_inserts(request_context *r, segment *seg, uint32_t failed,
                                em_error *err)
{
    em_table *table = r->table;
    const em_device_ops *ops = seg->device->ops;
    bool async = ops->shard_insert_missing_async != NULL;
    for (uint32_t s = seg->first_shard; s < failed; s++) {
        if (r->shard_missing[s] == 0)
            continue;
        if (async && ops->shard_insert_settle(table->shards[s], err) != EM_OK)
            return em_error_prefix(err, "table '%s' shard %u: ", table->config.name, s);
        em__rows_added(table, r->shard_missing[s]);
        atomic_fetch_add_explicit(&table->shard_creations[s].value, 1, memory_order_relaxed);
    }
    return EM_OK;
}

/* Inserts the missing keys on every device: every device's inserts are enqueued, up to
 * the first that fails, and then waited for together (one wait for a table over several
 * GPUs), and what each device inserted is taken in, every device's even after one
 * failed (the first failure is the request's). */
static em_status insert_missing(request_context *r, em_error *err)
{
    uint32_t devices = r->table->backend->device_count;
    bool enqueued[EM_BACKEND_MAX_DEVICES] = {false}, waits[EM_BACKEND_MAX_DEVICES] = {false};
    uint32_t failed[EM_BACKEND_MAX_DEVICES];
    em_status status = settle_unchecked(r, err); /* a push's checks come first */
    if (status != EM_OK)
        return status;
    for (uint32_t d = 0; status == EM_OK && d < devices; d++) {
        segment *seg = &r->segments[d];
        if (!segment_creates(r, seg))
            continue;
        enqueued[d] = true;
        waits[d] = seg->device->ops->shard_insert_missing_async != NULL;
        status = enqueue_inserts(r, seg, &failed[d], err);
    }
    if (status == EM_OK && r->settle_later) { /* settle_later_inserts */
        for (uint32_t d = 0; d < devices; d++)
            r->segments[d].settle_pending = enqueued[d];
        return EM_OK;
    }
    em_error later;
    em_status synchronized = synchronize_marked(r, waits, status == EM_OK ? err : &later);
    em_status settled = synchronized;
    for (uint32_t d = 0; synchronized == EM_OK && d < devices; d++) {
        if (!enqueued[d])
            continue;
        bool first = status == EM_OK && settled == EM_OK;
        em_status taken = settle_inserts(r, &r->segments[d], failed[d], first ? err : &later);
        if (settled == EM_OK)
            settled = taken;
    }
    if (status == EM_OK && settled == EM_OK)
        atomic_fetch_add_explicit(&r->table->rows_created, r->missing, memory_order_relaxed);
    return status != EM_OK ? status : settled;
}

/* After the request's devices synchronized (synchronized: how that went), the inserts
 * insert_missing left to settle later are taken in and counted. */
static em_status settle_later_inserts(request_context *r, em_status synchronized, em_error *err)
{
    em_status settled = synchronized;
    bool pending = false;
    em_error later;
    for (uint32_t d = 0; d < r->table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        if (!seg->settle_pending)
            continue;
        seg->settle_pending = false;
        pending = true;
        if (synchronized != EM_OK)
            continue;
        em_status taken = settle_inserts(r, seg, seg->end_shard, settled == EM_OK ? err : &later);
        if (settled == EM_OK)
            settled = taken;
    }
    if (pending && settled == EM_OK)
        atomic_fetch_add_explicit(&r->table->rows_created, r->missing, memory_order_relaxed);
    return settled;
}

/* Takes or releases, in shard order, the write locks of the shards the request touches. */
static void lock_shards(request_context *r, bool lock)
{
    em_table *table = r->table;
    for (uint32_t s = 0; s < table->shard_count; s++) {
        if (r->shard_start[s + 1] == r->shard_start[s])
            continue;
        if (lock)
            em__shard_write_lock(table, s);
        else
            em__shard_unlock(table, s);
    }
}

/* Whether every shard of the table inserts on its device's lane without waiting
 * (shard_insert_missing_async: the GPUs). */
static bool inserts_enqueued(const em_table *table)
{
    for (uint32_t s = 0; s < table->shard_count; s++)
        if (table->shards[s]->device->ops->shard_insert_missing_async == NULL)
            return false;
    return true;
}

/* Whether the request's inserts settle with its last wait, its shards' write locks held
 * until then (r->settle_later: alone with a table on GPUs). */
static bool settles_later(request_context *r)
{
    r->settle_later = r->alone && inserts_enqueued(r->table);
    return r->settle_later;
}

bool em__hold_for_settle(request_context *r)
{
    if (!settles_later(r))
        return false;
    lock_shards(r, true);
    return true;
}

em_status em__finish_devices(request_context *r, em_status status, em_error *err)
{
    bool pending = false;
    for (uint32_t d = 0; d < r->table->backend->device_count; d++)
        pending = pending || r->segments[d].settle_pending;
    em_error later;
    em_status synchronized = status;
    if (status == EM_OK || pending)
        synchronized = em__synchronize_devices(r, status == EM_OK ? err : &later);
    em_status settled = settle_later_inserts(r, synchronized, status == EM_OK ? err : &later);
    if (r->settle_later) {
        lock_shards(r, false);
        r->settle_later = false;
    }
    return status != EM_OK ? status : settled;
}

/* ---- eviction ------------------------------------------------------------------------ */

static em_status read_device_value(const segment *seg, void *host, const void *device_value,
                                   size_t bytes, em_error *err);

/* n words of a segment's device memory on the host, for the caller to read and change:
 * the memory itself where the device is host memory, else a copy, which host_words_end
 * writes back (when asked) and frees. */
static em_status host_words(const segment *seg, uint64_t *words, uint64_t n, uint64_t **host,
                            em_error *err)
{
    *host = words;
    if (seg->device->host_addressable)
        return EM_OK;
    *host = malloc(n * sizeof(uint64_t));
    em_status status = *host == NULL
                           ? em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                          "out of host memory for %" PRIu64 " keys' rows", n)
                           : read_device_value(seg, *host, words, n * sizeof(uint64_t), err);
    if (status != EM_OK) {
        free(*host);
        *host = NULL;
    }
    return status;
}

static em_status host_words_end(const segment *seg, uint64_t *words, uint64_t *host, uint64_t n,
                                bool write_back, em_error *err)
{
    if (host == NULL || host == words)
        return EM_OK;
    em_status status = EM_OK;
    if (write_back) {
        status = seg->device->ops->copy_to_device(seg->lane, words, host, n * sizeof(uint64_t),
                                                  err);
        if (status == EM_OK)
            status = seg->device->ops->synchronize(seg->lane, err);
    }
    free(host);
    return status;
}

/* How many rows each shard gives up so that the request's new keys fit (evict[s]),
 * never a row the request reads or writes: first in the shards that get new keys, as
 * many rows as each gets, in shard order until need is met; then, when those shards
 * hold too few other rows, from any shard in shard order. Changes nothing;
 * RESOURCE_EXHAUSTED when the whole table holds too few other rows. */
static em_status plan_evictions(request_context *r, uint64_t need, uint64_t *evict,
                                em_error *err)
{
    em_table *table = r->table;
    uint64_t remaining = need, evictable_total = 0;
    uint64_t *spare = em_zeroed(table->shard_count, sizeof(*spare));
    if (spare == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    for (uint32_t s = 0; s < table->shard_count; s++) {
        em_shard_stats stats;
        table->shards[s]->device->ops->shard_stats(table->shards[s], &stats);
        /* the request's rows: its keys less the missing and the refused ones */
        uint64_t own = shard_key_count(r, s) - r->shard_missing[s] - r->shard_rejected[s];
        spare[s] = stats.rows > own ? stats.rows - own : 0;
        evictable_total += spare[s];
    }
    /* first in the shards the new keys go to, as many as each creates */
    for (uint32_t s = 0; s < table->shard_count; s++) {
        uint64_t take = r->shard_missing[s] < spare[s] ? r->shard_missing[s] : spare[s];
        evict[s] = take < remaining ? take : remaining;
        remaining -= evict[s];
    }
    /* then from any shard's other rows; the shards that create more keys than they
     * give up grow by the difference, the table stays within its capacity */
    for (uint32_t s = 0; remaining > 0 && s < table->shard_count; s++) {
        uint64_t more = spare[s] - evict[s];
        more = more < remaining ? more : remaining;
        evict[s] += more;
        remaining -= more;
    }
    free(spare);
    if (remaining == 0)
        return EM_OK;
    return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                        "table '%s': full (capacity %" PRIu64 ", %" PRIu64 " rows): this request "
                        "creates %" PRIu64 " keys and the table holds only %" PRIu64
                        " rows it does not use, %" PRIu64 " short of making room; nothing was "
                        "applied",
                        table->config.name, table->config.capacity, table_rows(table),
                        r->missing, evictable_total, remaining);
}

/* The rows shard s holds beyond the request's own keys and those it evicts already. */
static uint64_t shard_spare(request_context *r, uint32_t s, const uint64_t *evict,
                            uint64_t *rows)
{
    em_table *table = r->table;
    em_shard_stats stats;
    table->shards[s]->device->ops->shard_stats(table->shards[s], &stats);
    uint64_t own = shard_key_count(r, s) - r->shard_missing[s] - r->shard_rejected[s];
    uint64_t keep = own + evict[s];
    *rows = stats.rows;
    return stats.rows > keep ? stats.rows - keep : 0;
}

/* Adds to evict[] the table's headroom (table_config.h): floor(headroom x capacity)
 * rows more, from every shard in proportion to its rows (the remainder one row each from
 * the first shards that have one to give), never the request's own rows nor more than a
 * shard holds beside the rows it gives up already. What the shards cannot give is not
 * taken: headroom never fails a request. */
static void plan_headroom(request_context *r, uint64_t *evict)
{
    em_table *table = r->table;
    uint64_t extra = (uint64_t)(table->config.eviction.headroom *
                                (double)table->config.capacity);
    uint64_t total = table_rows(table);
    if (extra == 0 || total == 0)
        return;
    uint64_t given = 0, rows = 0;
    for (uint32_t s = 0; s < table->shard_count; s++) {
        uint64_t spare = shard_spare(r, s, evict, &rows);
        uint64_t share = (uint64_t)((unsigned __int128)extra * rows / total);
        share = share < spare ? share : spare;
        evict[s] += share;
        given += share;
    }
    for (uint32_t s = 0; given < extra && s < table->shard_count; s++)
        if (shard_spare(r, s, evict, &rows) > 0) { /* the shares' rounding: one more row */
            evict[s]++;
            given++;
        }
}

/* The request's rows of shard s (rows it reads or writes, which eviction must keep) for
 * its eviction's spec: read into host memory where the device's memory is the host's;
 * elsewhere left on the device (kept_device), for the device to read back with its walk
 * instead of waiting for them here. */
static em_status kept_rows(request_context *r, segment *seg, uint32_t s, em_evict_spec *spec,
                           uint64_t **out, em_error *err)
{
    uint64_t n = shard_key_count(r, s);
    /* a shard the request has no keys in gives rows to headroom only: none to keep (and
     * its segment may have no rows array at all) */
    if (n > 0 && !seg->device->host_addressable) {
        spec->kept_device = seg->rows + shard_offset(r, seg, s);
        spec->kept_device_count = n;
        return EM_OK;
    }
    uint64_t *rows = malloc((n + 1) * sizeof(uint64_t));
    if (rows == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    em_status status = n == 0 ? EM_OK
                              : read_device_value(seg, rows, seg->rows + shard_offset(r, seg, s),
                                                  n * sizeof(uint64_t), err);
    if (status != EM_OK) {
        free(rows);
        return status;
    }
    *out = rows;
    spec->kept = rows;
    spec->kept_count = em_evict_kept_rows(rows, n, rows);
    return EM_OK;
}

/* ---- the push clock over time ------------------------------------------------------------ */

uint64_t em__unix_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u;
}

void em__clock_sample(em_table *table, uint64_t unix_ms, uint32_t clock)
{
    pthread_mutex_lock(&table->clock_lock);
    uint32_t n = table->clock_samples;
    /* samples stay in time order: a wall clock set back adds none until it catches up */
    if (n == 0 || unix_ms >= table->clock_ms[n - 1] + table->clock_spacing_ms) {
        if (n == EM_CLOCK_SAMPLES) { /* full: keep every other sample, twice as far apart */
            for (uint32_t i = 0; i < n / 2; i++) {
                table->clock_ms[i] = table->clock_ms[2 * i + 1];
                table->clock_value[i] = table->clock_value[2 * i + 1];
            }
            n /= 2;
            table->clock_spacing_ms *= 2;
        }
        table->clock_ms[n] = unix_ms;
        table->clock_value[n] = clock;
        table->clock_samples = n + 1;
    }
    pthread_mutex_unlock(&table->clock_lock);
}

bool em__clock_at(em_table *table, uint64_t unix_ms, uint32_t *clock)
{
    pthread_mutex_lock(&table->clock_lock);
    uint32_t low = 0, high = table->clock_samples; /* first sample after unix_ms */
    while (low < high) {
        uint32_t middle = low + (high - low) / 2;
        if (table->clock_ms[middle] <= unix_ms)
            low = middle + 1;
        else
            high = middle;
    }
    bool found = low > 0;
    if (found)
        *clock = table->clock_value[low - 1];
    pthread_mutex_unlock(&table->clock_lock);
    return found;
}

bool em__expiry_age(em_table *table, uint64_t now_ms, uint32_t *min_age)
{
    const em_eviction_config *config = &table->config.eviction;
    uint32_t now = (uint32_t)atomic_load_explicit(&table->update_clock, memory_order_relaxed);
    bool any = config->max_age_steps > 0;
    *min_age = config->max_age_steps; /* a row of the last push has age 0 */
    uint32_t then;
    if (config->max_age_seconds > 0 && now_ms >= config->max_age_seconds * 1000u &&
        em__clock_at(table, now_ms - config->max_age_seconds * 1000u, &then)) {
        /* the push stamped `then` came at or before that time, and so did every row
         * updated at or before it: age >= now - then */
        uint32_t by_time = now - then;
        *min_age = any && *min_age < by_time ? *min_age : by_time;
        any = true;
    }
    return any;
}

/* ---- admission ------------------------------------------------------------------------ */

#define SKETCH_HASHES 4

/* Counter admission: counts a sighting of key in the sketch (conservative update: only
 * the smallest of its counters grow) and says whether it has now been seen threshold
 * times. */
static bool count_sighting(em_table *table, uint64_t key, bool count)
{
    const em_admission_config *config = &table->config.admission;
    uint64_t seed = em_mix64(table->config.initializer.seed ^ 0x736b65746368ull);
    uint8_t *counts = table->admission_counts;
    uint64_t slots[SKETCH_HASHES];
    uint8_t smallest = UINT8_MAX;
    for (int h = 0; h < SKETCH_HASHES; h++) {
        slots[h] = em_mix64(key ^ em_mix64(seed + (uint64_t)h)) % config->counters;
        smallest = counts[slots[h]] < smallest ? counts[slots[h]] : smallest;
    }
    if (!count) /* the sighting was counted by the request's first attempt */
        return smallest >= config->threshold;
    uint8_t seen = smallest == UINT8_MAX ? UINT8_MAX : (uint8_t)(smallest + 1);
    for (int h = 0; h < SKETCH_HASHES; h++)
        if (counts[slots[h]] < seen)
            counts[slots[h]] = seen;
    return seen >= config->threshold;
}

/* Probability admission: a pure function of the table's seed and the key. */
static bool admitted_by_chance(const em_table *table, uint64_t key)
{
    double p = table->config.admission.probability;
    uint64_t draw = em_mix64(key ^ em_mix64(table->config.initializer.seed ^ 0x61646d6974ull));
    return (double)(draw >> 11) * 0x1.0p-53 < p;
}

em_status em__admit_missing(request_context *r, bool count_sightings, em_error *err)
{
    em_table *table = r->table;
    int policy = table->config.admission.policy;
    if (policy == EM_ADMISSION_ALWAYS || r->missing == 0)
        return EM_OK;
    for (uint32_t d = 0; d < table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        if (seg->count == 0)
            continue;
        /* the segment's keys and rows on the host */
        uint64_t *keys = NULL, *rows = NULL;
        em_status status = host_words(seg, seg->keys, seg->count, &keys, err);
        if (status == EM_OK)
            status = host_words(seg, seg->rows, seg->count, &rows, err);
        if (status != EM_OK) {
            host_words_end(seg, seg->keys, keys, seg->count, false, NULL);
            return em_error_prefix(err, "admission: ");
        }
        /* requests admit under the shared table lock: the sketch is theirs one at a time */
        if (policy == EM_ADMISSION_COUNTER)
            pthread_mutex_lock(&table->admission_lock);
        for (uint32_t s = seg->first_shard; s < seg->end_shard; s++) {
            uint64_t offset = shard_offset(r, seg, s), n = shard_key_count(r, s);
            for (uint64_t i = offset; i < offset + n; i++) {
                if (rows[i] != EM_ROW_NONE)
                    continue;
                bool admit = policy == EM_ADMISSION_COUNTER
                                 ? count_sighting(table, keys[i], count_sightings)
                                 : admitted_by_chance(table, keys[i]);
                if (admit)
                    continue;
                rows[i] = EM_ROW_REJECTED;
                r->shard_missing[s]--;
                r->shard_rejected[s]++;
                r->missing--;
                r->rejected++;
            }
        }
        if (policy == EM_ADMISSION_COUNTER)
            pthread_mutex_unlock(&table->admission_lock);
        host_words_end(seg, seg->keys, keys, seg->count, false, NULL);
        status = host_words_end(seg, seg->rows, rows, seg->count, true, err);
        if (status != EM_OK)
            return status;
    }
    return EM_OK;
}

/* em__snapshot_preserve for rows of shard s given in host memory. */
static em_status preserve_host_rows(request_context *r, uint32_t s, em_lane *lane,
                                    const uint64_t *rows, uint64_t count, em_error *err)
{
    em_table *table = r->table;
    em_device *device = table->shards[s]->device;
    if (table->snapshot == NULL || count == 0)
        return EM_OK;
    const uint64_t *device_rows = rows;
    if (!device->host_addressable) {
        void *copy = NULL;
        em_status status = em__request_alloc(r, device, count * sizeof(uint64_t),
                                             "removed rows", &copy, err);
        if (status == EM_OK)
            status = device->ops->copy_to_device(lane, copy, rows, count * sizeof(uint64_t),
                                                 err);
        if (status != EM_OK)
            return status;
        device_rows = copy;
    }
    return em__snapshot_preserve(table, s, lane, device_rows, count, err);
}

em_status em__age_slice(em_table *table, em_age_slice *slice, em_error *err)
{
    slice->removed = 0;
    request_context r;
    em__snapshot_wait_room(table);
    em_spread_lock_write(&table->lock);
    em_status status = em__request_begin(table, &r, err);
    uint32_t s = slice->sweep ? table->expire_shard : slice->shard;
    uint64_t *cursor = slice->sweep ? &table->expire_cursor : &slice->cursor;
    if (status == EM_OK && s < table->shard_count) {
        em_lane *lane = r.lanes[table->shard_device[s]];
        em_device *device = table->shards[s]->device;
        uint32_t clock = (uint32_t)atomic_load_explicit(&table->update_clock,
                                                        memory_order_relaxed);
        uint32_t min_age = slice->min_age;
        if (slice->from_start) { /* the pushes since the start count too, never past 2^32 */
            uint64_t aged = (uint64_t)min_age + (uint32_t)(clock - slice->start_clock);
            min_age = aged > UINT32_MAX ? UINT32_MAX : (uint32_t)aged;
        }
        em__shard_write_lock(table, s);
        status = device->ops->shard_expire(table->shards[s], lane, clock, min_age, cursor,
                                           slice->scan, slice->keys, slice->rows,
                                           &slice->removed, err);
        if (status == EM_OK)
            status = preserve_host_rows(&r, s, lane, slice->rows, slice->removed, err);
        if (status == EM_OK && slice->removed > 0) {
            em__rows_removed(table, slice->removed);
            table->shard_versions[s].value += EM_ROW_BOUNDED_STEPS + 1;
            if (slice->sweep)
                em__record_evicted(table, slice->keys, slice->removed, 0, &table->rows_expired);
            else
                atomic_fetch_add_explicit(&table->rows_erased, slice->removed,
                                          memory_order_relaxed);
        }
        em__shard_unlock(table, s);
        slice->wrapped = *cursor == 0;
        if (slice->sweep && slice->wrapped)
            table->expire_shard = (s + 1) % table->shard_count;
        if (status != EM_OK)
            em_error_prefix(err, "table '%s' shard %u: ", table->config.name, s);
    }
    em__request_end(&r);
    em_spread_unlock_write(&table->lock);
    return status;
}

static void swap_keys(uint64_t *keys, uint64_t a, uint64_t b)
{
    uint64_t key = keys[a];
    keys[a] = keys[b];
    keys[b] = key;
}

/* Puts the largest `last` keys of keys[0..count) at its end, in no order (a
 * three-way quickselect, so repeated keys cost no more). */
static void largest_last(uint64_t *keys, uint64_t count, uint64_t last)
{
    uint64_t low = 0, high = count, target = count - last;
    while (high - low > 1) {
        /* [low, less) < pivot, [less, i) == pivot, [more, high) > pivot */
        uint64_t pivot = keys[low + (high - low) / 2];
        uint64_t less = low, more = high, i = low;
        while (i < more) {
            if (keys[i] < pivot)
                swap_keys(keys, i++, less++);
            else if (keys[i] > pivot)
                swap_keys(keys, i, --more);
            else
                i++;
        }
        if (target < less)
            high = less;
        else if (target >= more)
            low = more;
        else
            return;
    }
}

static int compare_keys(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Sorts keys[0..n) ascending: by insertion for a few, else by their bytes from the
 * least significant, a pass for each byte where they differ (qsort only when there is
 * no memory for the passes' second array). A request's evictions sort up to a ring's
 * worth of keys a shard, which qsort made a fifth of a full table's insert cost. */
static void sort_keys(uint64_t *keys, uint64_t n)
{
    if (n <= 32) {
        for (uint64_t i = 1; i < n; i++) {
            uint64_t key = keys[i], j = i;
            for (; j > 0 && keys[j - 1] > key; j--)
                keys[j] = keys[j - 1];
            keys[j] = key;
        }
        return;
    }
    uint64_t *other = malloc(n * sizeof(uint64_t));
    if (other == NULL) {
        qsort(keys, n, sizeof(uint64_t), compare_keys);
        return;
    }
    uint32_t counts[8][256];
    memset(counts, 0, sizeof(counts));
    for (uint64_t i = 0; i < n; i++)
        for (uint32_t b = 0; b < 8; b++)
            counts[b][(keys[i] >> (8 * b)) & 0xff]++;
    uint64_t *from = keys, *to = other;
    for (uint32_t b = 0; b < 8; b++) {
        if (counts[b][(from[0] >> (8 * b)) & 0xff] == n)
            continue; /* every key has this byte */
        uint32_t start[256], sum = 0;
        for (uint32_t v = 0; v < 256; v++) {
            start[v] = sum;
            sum += counts[b][v];
        }
        for (uint64_t i = 0; i < n; i++)
            to[start[(from[i] >> (8 * b)) & 0xff]++] = from[i];
        uint64_t *swap = from;
        from = to;
        to = swap;
    }
    if (from != keys)
        memcpy(keys, from, n * sizeof(uint64_t));
    free(other);
}

void em__record_evicted(em_table *table, uint64_t *keys, uint64_t count, uint64_t later,
                        _Atomic uint64_t *counter)
{
    uint32_t ring = table->evicted_keys != NULL ? table->config.eviction.ring : 0;
    /* what the ring keeps of these keys once the later ones are in, in ascending order:
     * the same whatever order the shard's map (or a GPU's choice) gave them in */
    uint64_t room = later < ring ? ring - later : 0;
    uint64_t kept = count < room ? count : room;
    if (kept > 0) {
        if (kept < count)
            largest_last(keys, count, kept);
        sort_keys(keys + count - kept, kept);
    }
    pthread_mutex_lock(&table->evicted_lock);
    uint64_t total = table->removed_total;
    for (uint64_t i = count - kept; i < count; i++)
        table->evicted_keys[(total + i) % ring] = keys[i];
    for (uint64_t i = count - (count < ring ? count : ring); i < count - kept; i++)
        table->evicted_keys[(total + i) % ring] = keys[i]; /* replaced by the later ones */
    table->removed_total = total + count;
    atomic_fetch_add_explicit(counter, count, memory_order_relaxed);
    pthread_mutex_unlock(&table->evicted_lock);
}

/* A request's evictions run a shard on each of the backend's eviction threads once they
 * walk this many map entries in all (each shard n x candidates for n rows): far more
 * work than starting a thread. */
#define EVICT_PARALLEL_ENTRIES (UINT64_C(1) << 16)

/* One shard's part of a request's eviction. It is prepared in shard order (the rows the
 * request keeps, the walk's pseudo-random start, which follows the table's evictions so
 * far), chosen and erased beside the other shards' parts, then counted and recorded in
 * shard order: which keys go, and the order the ring keeps them in, do not depend on
 * the threads. */
typedef struct shard_eviction {
    segment *seg;
    uint32_t shard;
    em_shard_evict_part evict; /* its shard, spec, chosen keys and rows, status and error */
    uint64_t *kept;
    bool evicted; /* its rows are out of the map */
} shard_eviction;

typedef struct eviction_run {
    em_table *table;
    shard_eviction *parts;
} eviction_run;

static em_status prepare_eviction(request_context *r, shard_eviction *part, uint64_t count,
                                  uint64_t evicted_before, em_error *err)
{
    em_table *table = r->table;
    part->evict.keys = malloc(count * sizeof(uint64_t));
    part->evict.rows = malloc(count * sizeof(uint64_t));
    if (part->evict.keys == NULL || part->evict.rows == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    part->evict.spec = (em_evict_spec){
        .policy = table->config.eviction.policy,
        .candidates = table->config.eviction.candidates,
        .count = count,
        .update_clock = (uint32_t)atomic_load_explicit(&table->update_clock,
                                                       memory_order_relaxed),
        .access_clock = atomic_load_explicit(&table->access_clock, memory_order_relaxed),
    };
    em_status status = kept_rows(r, part->seg, part->shard, &part->evict.spec, &part->kept, err);
    if (status != EM_OK)
        return status;
    table->evict_random = em_mix64(table->evict_random ^ (evicted_before + part->shard));
    part->evict.spec.random = table->evict_random;
    return EM_OK;
}

/* Shard part->shard gives up its rows by the table's policy (em_parallel_item). */
static void run_eviction(void *context, uint64_t i)
{
    eviction_run *run = context;
    shard_eviction *part = &run->parts[i];
    em_shard_evict_part *evict = &part->evict;
    evict->status = part->seg->device->ops->shard_evict(evict->shard, part->seg->lane,
                                                        &evict->spec, evict->keys, evict->rows,
                                                        &evict->err);
}

/* The rows a shard gave up leave the counts and join the ring; a snapshot being read
 * keeps their values (the request's inserts reuse the rows). */
static em_status account_eviction(request_context *r, shard_eviction *part, uint64_t later,
                                  em_error *err)
{
    em_table *table = r->table;
    uint64_t count = part->evict.spec.count;
    em__rows_removed(table, count);
    em__record_evicted(table, part->evict.keys, count, later, &table->rows_evicted);
    return preserve_host_rows(r, part->shard, part->seg->lane, part->evict.rows, count, err);
}

/* Threads for a request's evictions: the backend's, when the walks are long enough. */
static uint32_t eviction_threads(const em_table *table, const shard_eviction *parts,
                                 uint32_t count)
{
    uint64_t entries = 0;
    for (uint32_t i = 0; i < count; i++) {
        uint64_t walk = em_evict_window(&parts[i].evict.spec);
        entries += walk < EVICT_PARALLEL_ENTRIES ? walk : EVICT_PARALLEL_ENTRIES;
    }
    return entries >= EVICT_PARALLEL_ENTRIES ? table->backend->eviction_threads : 1;
}

/* The parts of a request's evictions, prepared in shard order: a part for every shard
 * s with evict[s] > 0, and with inserts also one (evicting nothing) for every other
 * shard where the request creates keys. On an error nothing was evicted; the parts are
 * for parts_free either way. */
static em_status prepare_parts(request_context *r, const uint64_t *evict, bool inserts,
                               shard_eviction **out, uint32_t *count, em_error *err)
{
    em_table *table = r->table;
    shard_eviction *parts = em_zeroed(table->shard_count, sizeof(*parts));
    *out = parts;
    *count = 0;
    if (parts == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    uint64_t evicted = atomic_load_explicit(&table->rows_evicted, memory_order_relaxed);
    for (uint32_t d = 0; d < table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        for (uint32_t s = seg->first_shard; s < seg->end_shard; s++) {
            if (evict[s] == 0 && !(inserts && r->shard_missing[s] > 0))
                continue;
            shard_eviction *part = &parts[(*count)++];
            *part = (shard_eviction){.seg = seg, .shard = s, .evict.shard = table->shards[s]};
            if (evict[s] == 0)
                continue;
            em_status status = prepare_eviction(r, part, evict[s], evicted, err);
            evicted += evict[s];
            if (status != EM_OK)
                return em_error_prefix(err, "table '%s' shard %u: eviction: ",
                                       table->config.name, s);
        }
    }
    return EM_OK;
}

static void parts_free(shard_eviction *parts, uint32_t count)
{
    for (uint32_t i = 0; parts != NULL && i < count; i++) {
        free(parts[i].kept);
        free(parts[i].evict.keys);
        free(parts[i].evict.rows);
    }
    free(parts);
}

/* Where the devices evict several shards at once (shards_evict_begin and _end, the GPUs),
 * each device's parts go together on its lane, and every device's walks come back in one
 * wait for all of them; returns false where they do not (the parts then run a shard at a
 * time, on threads). */
static bool evict_device_by_device(request_context *r, shard_eviction *parts, uint32_t count,
                                   em_status *checked, em_error *check_err)
{
    em_table *table = r->table;
    for (uint32_t i = 0; i < count; i++)
        if (parts[i].seg->device->ops->shards_evict_begin == NULL)
            return false;
    em_shard_evict_part *batch = em_zeroed(count > 0 ? count : 1, sizeof(*batch));
    if (batch == NULL)
        return false;
    void *pending[EM_BACKEND_MAX_DEVICES] = {NULL};
    bool begun[EM_BACKEND_MAX_DEVICES] = {false};
    for (uint32_t first = 0, end; first < count; first = end) {
        segment *seg = parts[first].seg; /* the parts are in device order */
        uint32_t d = (uint32_t)(seg - r->segments);
        for (end = first; end < count && parts[end].seg == seg; end++)
            batch[end] = parts[end].evict;
        em_error err;
        em_status status = seg->device->ops->shards_evict_begin(seg->lane, batch + first,
                                                                end - first, &pending[d], &err);
        for (uint32_t i = first; status != EM_OK && i < end; i++) {
            batch[i].status = status;
            batch[i].err = err;
        }
        begun[d] = status == EM_OK && pending[d] != NULL;
    }
    /* a push's checks left to this wait (r->unchecked) come back with the walks */
    bool waits[EM_BACKEND_MAX_DEVICES] = {false};
    for (uint32_t d = 0; d < table->backend->device_count; d++)
        waits[d] = begun[d] || (r->unchecked != NULL && r->unchecked->pending[d]);
    em_error sync_err;
    em_status synchronized = synchronize_marked(r, waits, &sync_err);
    *checked = EM_OK;
    if (r->unchecked != NULL) { /* a problem found: no shard erases anything */
        *checked = take_checks(r, r->unchecked, synchronized, check_err);
        r->unchecked = NULL;
        if (synchronized == EM_OK && *checked != EM_OK)
            synchronized = *checked;
        else
            *checked = EM_OK; /* the wait's own failure is the parts' */
    }
    const em_error *ended_err = *checked != EM_OK ? check_err : &sync_err;
    for (uint32_t d = 0; d < table->backend->device_count; d++)
        if (begun[d])
            r->segments[d].device->ops->shards_evict_end(pending[d], synchronized, ended_err);
    for (uint32_t i = 0; i < count; i++)
        parts[i].evict = batch[i];
    free(batch);
    return true;
}

/* Every part's shard gives up its spec.count rows (each part evicts); a shard whose
 * eviction fails makes the request fail, after the other shards' evictions are
 * counted. */
static em_status evict_rows(request_context *r, shard_eviction *parts, uint32_t count,
                            bool *refused, em_error *err)
{
    em_table *table = r->table;
    eviction_run run = {.table = table, .parts = parts};
    em_status checked = EM_OK;
    *refused = false;
    if (!evict_device_by_device(r, parts, count, &checked, err)) {
        em_status status = settle_unchecked(r, err); /* a push's checks come first */
        if (status != EM_OK) {
            *refused = true;
            return status;
        }
        em_parallel_pool_run(table->backend->workers, count,
                             eviction_threads(table, parts, count), run_eviction, &run);
    } else if (checked != EM_OK) { /* the push's checks found a problem: nothing evicted */
        *refused = true;
        return checked;
    }
    uint64_t later = 0; /* keys the parts after this one put in the ring */
    for (uint32_t i = 0; i < count; i++)
        later += parts[i].evict.status == EM_OK ? parts[i].evict.spec.count : 0;
    em_status status = EM_OK;
    for (uint32_t i = 0; i < count; i++) {
        shard_eviction *part = &parts[i];
        if (part->evict.status == EM_OK) {
            later -= part->evict.spec.count;
            part->evict.status = account_eviction(r, part, later, &part->evict.err);
        }
        if (part->evict.status != EM_OK && status == EM_OK) {
            status = part->evict.status;
            *err = part->evict.err;
            em_error_prefix(err, "table '%s' shard %u: eviction: ", table->config.name,
                            part->shard);
        }
    }
    return status;
}

/* ---- evictions and inserts on threads, a shard each ---------------------------------- */

/* Whether every shard of the table is in host memory: its operations finish as they
 * return and need no lane of their own, so shards can go on threads side by side. */
static bool shards_in_host_memory(const em_table *table)
{
    for (uint32_t s = 0; s < table->shard_count; s++)
        if (!table->shards[s]->device->host_addressable)
            return false;
    return true;
}

/* Whether a request that evicts can make room and create its keys a shard on each of
 * the backend's eviction threads: every shard in host memory (their inserts finish as
 * they return, and need no lane of their own), and walks long enough to be worth the
 * threads. The request holds the table alone, so nothing else would use them. */
static bool creates_beside(const request_context *r, const shard_eviction *parts,
                           uint32_t count)
{
    const em_table *table = r->table;
    return shards_in_host_memory(table) && table->backend->eviction_threads > 1 &&
           eviction_threads(table, parts, count) > 1;
}

/* One shard's part: its eviction (spec.count rows, 0 for none), then its new keys. */
typedef struct creation_run {
    request_context *r;
    shard_eviction *parts;
} creation_run;

/* Shard part->shard gives up its rows, keeps their old values for a snapshot being
 * read, and creates its new keys in the room (em_parallel_item). */
static void run_creation(void *context, uint64_t i)
{
    creation_run *run = context;
    request_context *r = run->r;
    em_table *table = r->table;
    shard_eviction *part = &run->parts[i];
    em_shard_evict_part *evict = &part->evict; /* its status: the eviction's, then the inserts' */
    uint32_t s = part->shard;
    segment *seg = part->seg;
    const em_device_ops *ops = seg->device->ops;
    evict->status = EM_OK;
    if (evict->spec.count > 0) {
        evict->status = ops->shard_evict(evict->shard, seg->lane, &evict->spec, evict->keys,
                                         evict->rows, &evict->err);
        part->evicted = evict->status == EM_OK;
        if (evict->status == EM_OK)
            evict->status = preserve_host_rows(r, s, seg->lane, evict->rows, evict->spec.count,
                                               &evict->err);
        if (evict->status != EM_OK) {
            em_error_prefix(&evict->err, "eviction: ");
            return;
        }
    }
    if (r->shard_missing[s] == 0)
        return;
    uint64_t offset = shard_offset(r, seg, s);
    evict->status = ops->shard_insert_missing(table->shards[s], seg->lane, seg->keys + offset,
                                              shard_key_count(r, s), seg->rows + offset,
                                              !r->rows_written_next, &evict->err);
}

/* evict_rows then insert_missing, a shard on each eviction thread: the same rows, keys
 * and values, since each shard's eviction and inserts read and write only that shard.
 * Which rows go is prepared in shard order before and counted in shard order after, as
 * evict_rows does. A shard that fails makes the request fail; the other shards' work is
 * counted, as insert_missing counts the shards before a failed one. */
static em_status evict_and_insert(request_context *r, shard_eviction *parts, uint32_t count,
                                  em_error *err)
{
    em_table *table = r->table;
    creation_run run = {.r = r, .parts = parts};
    em_parallel_pool_run(table->backend->workers, count, table->backend->eviction_threads,
                         run_creation, &run);
    uint64_t later = 0; /* keys the parts after this one put in the ring */
    for (uint32_t i = 0; i < count; i++)
        later += parts[i].evicted ? parts[i].evict.spec.count : 0;
    em_status status = EM_OK;
    for (uint32_t i = 0; i < count; i++) {
        shard_eviction *part = &parts[i];
        uint32_t s = part->shard;
        if (part->evicted) {
            uint64_t evicted = part->evict.spec.count;
            later -= evicted;
            em__rows_removed(table, evicted);
            em__record_evicted(table, part->evict.keys, evicted, later, &table->rows_evicted);
        }
        if (part->evict.status == EM_OK && r->shard_missing[s] > 0) {
            em__rows_added(table, r->shard_missing[s]);
            atomic_fetch_add_explicit(&table->shard_creations[s].value, 1, memory_order_relaxed);
        }
        if (part->evict.status != EM_OK && status == EM_OK) {
            status = part->evict.status;
            *err = part->evict.err;
            em_error_prefix(err, "table '%s' shard %u: ", table->config.name, s);
        }
    }
    if (status == EM_OK)
        atomic_fetch_add_explicit(&table->rows_created, r->missing, memory_order_relaxed);
    return status;
}

/* Evicts what evict[] says, then creates the request's keys: on the eviction threads a
 * shard each where creates_beside says so, else the evictions (on those threads) and
 * then the inserts, shard after shard. */
static em_status make_room_and_insert(request_context *r, const uint64_t *evict, em_error *err)
{
    shard_eviction *parts = NULL;
    uint32_t count = 0;
    uint64_t random = r->table->evict_random; /* prepare_parts draws from it */
    em_status status = prepare_parts(r, evict, true, &parts, &count, err);
    if (status != EM_OK) {
        parts_free(parts, count);
        return status;
    }
    if (creates_beside(r, parts, count)) {
        status = evict_and_insert(r, parts, count, err);
        parts_free(parts, count);
        return status;
    }
    /* only the evicting parts, in shard order */
    uint32_t evicting = 0;
    for (uint32_t i = 0; i < count; i++)
        if (parts[i].evict.spec.count > 0)
            parts[evicting++] = parts[i];
    bool refused = false;
    status = evict_rows(r, parts, evicting, &refused, err);
    parts_free(parts, evicting);
    if (refused) /* the push's checks said no: as if it had not planned these evictions */
        r->table->evict_random = random;
    if (status == EM_OK)
        status = insert_missing(r, err);
    return status;
}

em_status em__erase_found(request_context *r, uint64_t *erased, em_error *err)
{
    em_table *table = r->table;
    *erased = 0;
    for (uint32_t d = 0; d < table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        for (uint32_t s = seg->first_shard; s < seg->end_shard; s++) {
            uint64_t n = shard_key_count(r, s), found = n - r->shard_missing[s];
            if (found == 0)
                continue;
            uint64_t offset = shard_offset(r, seg, s);
            em__shard_write_lock(table, s);
            /* a snapshot being read keeps the rows' values: later inserts reuse them */
            em_status status = em__snapshot_preserve(table, s, seg->lane, seg->rows + offset, n,
                                                     err);
            if (status == EM_OK)
                status = seg->device->ops->shard_erase(table->shards[s], seg->lane,
                                                       seg->keys + offset, seg->rows + offset, n,
                                                       err);
            if (status == EM_OK) {
                table->shard_versions[s].value += EM_ROW_BOUNDED_STEPS + 1;
                em__rows_removed(table, found);
                *erased += found;
            }
            em__shard_unlock(table, s);
            if (status != EM_OK)
                return em_error_prefix(err, "table '%s' shard %u: ", table->config.name, s);
        }
    }
    return EM_OK;
}

em_status em__refind_created(request_context *r, bool *stale, em_error *err)
{
    em_table *table = r->table;
    for (uint32_t d = 0; d < table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        for (uint32_t s = seg->first_shard; s < seg->end_shard; s++) {
            uint64_t now = atomic_load_explicit(&table->shard_creations[s].value, memory_order_relaxed);
            if (r->shard_missing[s] == 0 || now == r->shard_seen[s])
                continue;
            r->shard_seen[s] = now;
            uint64_t offset = shard_offset(r, seg, s), n = shard_key_count(r, s), missing = 0;
            uint64_t *found = NULL, *rows = seg->rows + offset, *host_found = NULL;
            uint64_t *host_rows = NULL;
            em_status status = em__request_alloc(r, seg->device, n * sizeof(uint64_t),
                                                 "rows found again", (void **)&found, err);
            if (status == EM_OK)
                status = seg->device->ops->shard_find(table->shards[s], seg->lane,
                                                      seg->keys + offset, n, found, &missing,
                                                      err);
            if (status != EM_OK)
                return status;
            if (missing == r->shard_missing[s] + r->shard_rejected[s])
                continue; /* none of them was created */
            /* on the host, a key the request found missing and admitted (EM_ROW_NONE)
             * takes the row it has now */
            status = host_words(seg, found, n, &host_found, err);
            if (status == EM_OK)
                status = host_words(seg, rows, n, &host_rows, err);
            for (uint64_t i = 0; status == EM_OK && i < n; i++) {
                if (host_rows[i] != EM_ROW_NONE || host_found[i] == EM_ROW_NONE)
                    continue;
                host_rows[i] = host_found[i];
                r->shard_missing[s]--;
                r->missing--;
                if (stale != NULL)
                    stale[s] = true;
            }
            host_words_end(seg, found, host_found, n, false, NULL);
            em_status ended = host_words_end(seg, rows, host_rows, n, status == EM_OK, err);
            if (status == EM_OK)
                status = ended;
            if (status != EM_OK)
                return em_error_prefix(err, "creating keys: ");
        }
    }
    return EM_OK;
}

/* Creates every missing key, or nothing: capacity and memory are settled first, and a
 * full table with an eviction policy makes room (plan_evictions). Under the shared
 * table lock (r->rows_claimed: the capacity is the request's), keys other requests
 * created since this one found them are looked up again first, under the shards' write
 * locks (locks_held: the caller has done that, holding them). */
em_status em__create_missing(request_context *r, bool locks_held, em_error *err)
{
    if (r->missing == 0) {
        em__release_claim(r);
        return EM_OK;
    }
    em_table *table = r->table;
    bool shared = r->rows_claimed > 0;
    uint64_t room = table->config.capacity - table_rows(table);
    uint64_t need = !shared && r->missing > room ? r->missing - room : 0;
    if (need > 0 && table->config.eviction.policy == EM_EVICTION_NONE)
        return check_capacity(r, err);
    uint64_t *evict = NULL;
    if (need > 0) {
        evict = em_zeroed(table->shard_count, sizeof(*evict));
        if (evict == NULL)
            return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
        em_status status = plan_evictions(r, need, evict, err);
        if (status != EM_OK) {
            free(evict);
            return status;
        }
        plan_headroom(r, evict);
        r->made_room = true;
    }
    /* Growing a shard's storage or index moves them: the shards' write locks keep out a
     * snapshot reader, which holds only shard locks (table_snapshot.c), and the finds
     * of requests sharing the table. Which shards: those the request creates keys in or
     * evicts from. */
    bool *creating = NULL;
    em_status status = EM_OK;
    if (!locks_held) {
        creating = em_zeroed(table->shard_count, sizeof(*creating));
        if (creating == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "creating keys: out of host memory");
        for (uint32_t s = 0; status == EM_OK && s < table->shard_count; s++)
            if ((creating[s] = r->shard_missing[s] != 0 || (evict != NULL && evict[s] != 0)))
                em__shard_write_lock(table, s);
        if (status == EM_OK && shared)
            status = em__refind_created(r, NULL, err);
    } else if (evict != NULL) {
        /* the caller holds the locks of the shards with the request's keys; headroom may
         * evict from others too (table_snapshot.c's reader holds one shard at a time) */
        creating = em_zeroed(table->shard_count, sizeof(*creating));
        if (creating == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "creating keys: out of host memory");
        for (uint32_t s = 0; status == EM_OK && s < table->shard_count; s++)
            if ((creating[s] = evict[s] != 0 && r->shard_start[s + 1] == r->shard_start[s]))
                em__shard_write_lock(table, s);
    }
    if (status == EM_OK)
        status = reserve_missing(r, evict, err);
    if (status == EM_OK && evict != NULL)
        status = make_room_and_insert(r, evict, err);
    else if (status == EM_OK)
        status = insert_missing(r, err);
    for (uint32_t s = 0; creating != NULL && s < table->shard_count; s++)
        if (creating[s])
            em__shard_unlock(table, s);
    free(creating);
    free(evict);
    em__release_claim(r);
    return status;
}

/* ---- per-shard work ---------------------------------------------------------------- */

typedef enum shard_locking {
    SHARDS_LOCK_EACH,    /* take each shard's lock around its work */
    SHARDS_HELD,         /* the caller holds the locks */
    SHARDS_RELEASE_EACH, /* the caller holds the locks; each goes once its shard is done */
} shard_locking;

/* What a push's check found for one shard. */
typedef struct shard_check {
    uint64_t version; /* the shard's version when it was checked */
    int bounded;      /* every row was bounded (row_check.h) */
    float largest;    /* the largest gradient element size, or -1 when not found */
} shard_check;

static em_status run_on_shards(request_context *r, shard_work work, uint32_t floats_per_key,
                               shard_locking locking, const shard_check *checks, em_error *err);

/* A device value of a segment as a host value (copied when the device is not host
 * memory). */
static em_status read_device_value(const segment *seg, void *host, const void *device_value,
                                   size_t bytes, em_error *err)
{
    if (seg->device->host_addressable) {
        memcpy(host, device_value, bytes);
        return EM_OK;
    }
    return seg->device->ops->copy_to_host(seg->lane, host, device_value, bytes, err);
}

/* The push's error for the first problem a shard's check found (row_check.h). */
static em_status describe_problem(request_context *r, const segment *seg, uint64_t offset,
                                  uint64_t problem, em_error *err)
{
    const em_table *table = r->table;
    uint64_t i = offset + (problem >> 32);
    uint32_t code = (uint32_t)problem, element = EM_ROW_CHECK_ELEMENT(code);
    uint32_t dim = table->config.dim;
    uint64_t key = 0;
    em_status status = read_device_value(seg, &key, seg->keys + i, sizeof(key), err);
    if (status != EM_OK)
        return status;
    const em_optimizer_config *optimizer = &table->config.optimizer;
    if (EM_ROW_CHECK_KIND(code) == EM_ROW_CHECK_GRADIENT) {
        float value = 0.0f;
        status = read_device_value(seg, &value, (const float *)seg->payload + i * dim + element,
                                   sizeof(value), err);
        if (status != EM_OK)
            return status;
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "key %" PRIu64 ": element %u of its summed gradient is %s (its "
                            "gradients in this push add up past the float range); nothing was "
                            "applied",
                            key, element, isnan(value) ? "nan" : value > 0 ? "inf" : "-inf");
    }
    if (element < dim)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "key %" PRIu64 ": this %s step would make weight element %u "
                            "non-finite; nothing was applied",
                            key, em_optimizer_name(optimizer->kind), element);
    return em_error_set(err, EM_INVALID_ARGUMENT,
                        "key %" PRIu64 ": this %s step would make its %s (state float %u) "
                        "non-finite; nothing was applied",
                        key, em_optimizer_name(optimizer->kind),
                        em_optimizer_state_name(optimizer->kind, dim, element - dim),
                        element - dim);
}

/* Asks shard s (of segment seg) whether its rows' steps keep them finite: *problem
 * (host, or a device word where `async`) as shard_check_apply says. */
static em_status check_shard(request_context *r, segment *seg, uint32_t s, bool async,
                             uint64_t *problem, shard_check *check, em_error *err)
{
    em_table *table = r->table;
    const em_device_ops *ops = seg->device->ops;
    uint64_t offset = shard_offset(r, seg, s), n = shard_key_count(r, s);
    const float *gradients = (const float *)seg->payload + offset * table->config.dim;
    check->version = table->shard_versions[s].value;
    if (async)
        return ops->shard_check_apply_async(table->shards[s], seg->lane, seg->keys + offset,
                                            seg->rows + offset, n, gradients, r->gradient_bound,
                                            problem, &check->bounded, &check->largest, err);
    return ops->shard_check_apply(table->shards[s], seg->lane, seg->keys + offset,
                                  seg->rows + offset, n, gradients, r->gradient_bound, problem,
                                  &check->bounded, &check->largest, err);
}

/* The push's error when a shard's check found a problem (UINT64_MAX: none). */
static em_status problem_error(request_context *r, const segment *seg, uint32_t s,
                               uint64_t problem, em_error *err)
{
    if (problem == UINT64_MAX)
        return EM_OK;
    em_status status = describe_problem(r, seg, shard_offset(r, seg, s), problem, err);
    if (status == EM_INVALID_ARGUMENT)
        em_error_prefix(err, "push to table '%s': ", r->table->config.name);
    return status;
}

/* check_on_device's checks of every shard of the device in one go (shards_check_async),
 * their answers into device_problems, under every shard's read lock. */
static em_status check_shards_at_once(request_context *r, segment *seg, shard_check *checks,
                                      uint64_t *device_problems, em_error *err)
{
    em_table *table = r->table;
    uint32_t shards = seg->end_shard - seg->first_shard;
    uint64_t *offsets = shard_offsets(r, seg, err);
    if (offsets == NULL)
        return EM_RESOURCE_EXHAUSTED;
    for (uint32_t s = seg->first_shard; s < seg->end_shard; s++) {
        em__shard_read_lock(table, s);
        checks[s] = (shard_check){.version = table->shard_versions[s].value, .largest = -1.0f};
    }
    em_status status = seg->device->ops->shards_check_async(
        &table->shards[seg->first_shard], shards, seg->lane, seg->keys, offsets, seg->rows,
        (const float *)seg->payload, device_problems, err);
    for (uint32_t s = seg->first_shard; s < seg->end_shard; s++)
        em__shard_unlock(table, s);
    free(offsets);
    return status;
}

/* Checks every shard of a device under its read lock, so pushes check side by side;
 * where the device can (shard_check_apply_async), the shards' answers come back
 * together, one wait for the device (and where it checks several shards in one go,
 * shards_check_async, a few operations for all of them), into *problems (host memory,
 * one word per shard of the device, the caller frees it); where it can also read them
 * back later, *pending is set and they arrive when the caller synchronizes the lane. */
static em_status check_on_device(request_context *r, segment *seg, shard_check *checks,
                                 uint64_t **problems, bool *pending, em_error *err)
{
    em_table *table = r->table;
    const em_device_ops *ops = seg->device->ops;
    uint32_t shards = seg->end_shard - seg->first_shard;
    bool async = ops->shard_check_apply_async != NULL;
    uint64_t *device_problems = NULL;
    *pending = false;
    *problems = malloc((shards + 1) * sizeof(uint64_t));
    em_status status = *problems == NULL ? em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                                        "push: out of host memory")
                       : async ? em__request_alloc(r, seg->device, shards * sizeof(uint64_t),
                                                   "check answers", (void **)&device_problems,
                                                   err)
                               : EM_OK;
    bool at_once = async && ops->shards_check_async != NULL && shards > 1;
    if (status == EM_OK && at_once)
        status = check_shards_at_once(r, seg, checks, device_problems, err);
    for (uint32_t s = seg->first_shard; status == EM_OK && !at_once && s < seg->end_shard; s++) {
        uint64_t *problem = async ? &device_problems[s - seg->first_shard]
                                  : &(*problems)[s - seg->first_shard];
        if (shard_key_count(r, s) == 0)
            continue; /* its answer is not read */
        em__shard_read_lock(table, s);
        status = check_shard(r, seg, s, async, problem, &checks[s], err);
        em__shard_unlock(table, s);
    }
    if (status == EM_OK && async && ops->copy_to_host_later != NULL) {
        status = ops->copy_to_host_later(seg->lane, *problems, device_problems,
                                         shards * sizeof(uint64_t), err);
        *pending = status == EM_OK;
    } else if (status == EM_OK && async) {
        status = ops->copy_to_host(seg->lane, *problems, device_problems,
                                   shards * sizeof(uint64_t), err);
    }
    return status;
}

/* Checks every device's shards: all devices' checks are enqueued before any is waited
 * for, so a table over several GPUs checks on all of them at once (enqueue_checks), and
 * their answers come back in one wait; then each device's answers are read, in device
 * and shard order (take_checks: the first problem is the request's). A push that will
 * evict on GPUs leaves that wait to its evictions' walks (r->unchecked). */
static em_status enqueue_checks(request_context *r, shard_check *checks, unchecked_push *u,
                                em_error *err)
{
    em_status status = EM_OK;
    for (uint32_t d = 0; status == EM_OK && d < r->table->backend->device_count; d++)
        if (r->segments[d].count > 0)
            status = check_on_device(r, &r->segments[d], checks, &u->problems[d],
                                     &u->pending[d], err);
    return status;
}

/* Once the devices with answers pending synchronized (status: the request's so far):
 * the first problem found, as the request's error; frees the answers. */
static em_status take_checks(request_context *r, unchecked_push *u, em_status status,
                             em_error *err)
{
    for (uint32_t d = 0; d < r->table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        for (uint32_t s = seg->first_shard; status == EM_OK && u->problems[d] != NULL &&
                                            s < seg->end_shard; s++)
            if (shard_key_count(r, s) != 0)
                status = problem_error(r, seg, s, u->problems[d][s - seg->first_shard], err);
        free(u->problems[d]);
        u->problems[d] = NULL;
        u->pending[d] = false;
    }
    return status;
}

/* Waits for the answers of enqueue_checks (status: how enqueueing went) and takes them. */
static em_status wait_for_checks(request_context *r, unchecked_push *u, em_status status,
                                 em_error *err)
{
    em_error later;
    em_status synchronized = synchronize_marked(r, u->pending, status == EM_OK ? err : &later);
    return take_checks(r, u, status == EM_OK ? synchronized : status, err);
}

static em_status check_shards(request_context *r, shard_check *checks, em_error *err)
{
    unchecked_push u = {0};
    em_status status = enqueue_checks(r, checks, &u, err);
    return wait_for_checks(r, &u, status, err);
}

/* Before the first change of a push whose checks were left to its evictions' walks
 * (r->unchecked) that did not take them: waits for them now. */
static em_status settle_unchecked(request_context *r, em_error *err)
{
    unchecked_push *u = r->unchecked;
    if (u == NULL)
        return EM_OK;
    r->unchecked = NULL;
    return wait_for_checks(r, u, EM_OK, err);
}

/* A push planned from its attempt at once (one shard), which checked there every key's
 * step and found no problem (r->checked_at_once): that check stands for check_shards',
 * as of the shard's version then, so recheck_stale_shards looks again if another push
 * stepped the shard since. */
static em_status take_check_at_once(request_context *r, shard_check *checks)
{
    checks[0] = (shard_check){.version = r->checked_version, .bounded = 0, .largest = -1.0f};
    return EM_OK;
}

/* Whether the check of a shard no longer holds: another push stepped it since, and the
 * check was not bounded or more steps came than a bounded check covers (row_check.h). */
static bool check_stale(const shard_check *check, uint64_t version)
{
    uint64_t moved = version - check->version;
    return moved != 0 && (!check->bounded || moved > EM_ROW_BOUNDED_STEPS);
}

/* With every write lock held: checks again the shards whose check went stale. */
static em_status recheck_stale_shards(request_context *r, shard_check *checks, em_error *err)
{
    em_table *table = r->table;
    for (uint32_t d = 0; d < table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        for (uint32_t s = seg->first_shard; s < seg->end_shard; s++) {
            if (shard_key_count(r, s) == 0)
                continue;
            if (check_stale(&checks[s], table->shard_versions[s].value)) {
                uint64_t problem = UINT64_MAX;
                em_status status = check_shard(r, seg, s, false, &problem, &checks[s], err);
                if (status == EM_OK)
                    status = problem_error(r, seg, s, problem, err);
                if (status != EM_OK)
                    return status;
            }
        }
    }
    return EM_OK;
}

/* With every write lock held, before the step: moves each shard's version by what the
 * step will be, 1 for a bounded step and more than a bounded check covers for any other,
 * so the pushes that checked before it know what to check again. */
static void advance_versions(request_context *r, const shard_check *checks)
{
    em_table *table = r->table;
    for (uint32_t s = 0; s < table->shard_count; s++)
        if (shard_key_count(r, s) != 0)
            table->shard_versions[s].value += checks[s].bounded ? 1 : EM_ROW_BOUNDED_STEPS + 1;
}

em_status em__preserve_for_snapshot(request_context *r, bool take_locks, em_error *err)
{
    em_table *table = r->table;
    if (table->snapshot == NULL && !take_locks)
        return EM_OK; /* read under the write locks held */
    for (uint32_t d = 0; d < table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        for (uint32_t s = seg->first_shard; s < seg->end_shard; s++) {
            uint64_t n = shard_key_count(r, s);
            if (n == 0)
                continue;
            if (take_locks)
                em__shard_write_lock(table, s);
            em_status status = em__snapshot_preserve(table, s, seg->lane,
                                                     seg->rows + shard_offset(r, seg, s), n, err);
            if (take_locks)
                em__shard_unlock(table, s);
            if (status != EM_OK)
                return status;
        }
    }
    return EM_OK;
}

/* Whether a push leaves its checks' wait to the walks of its evictions (r->unchecked):
 * alone with a full table whose every device evicts several shards at once (the GPUs:
 * shards_evict_begin), with its keys' counts known and more keys missing than there is
 * room for. Nothing changes before that wait: a problem found stops the push there. */
static bool checks_wait_for_walks(const request_context *r)
{
    const em_table *table = r->table;
    if (!r->alone || r->counts_pending || r->missing == 0 ||
        table->config.eviction.policy == EM_EVICTION_NONE ||
        r->missing <= table->config.capacity - table_rows(table))
        return false;
    for (uint32_t d = 0; d < table->backend->device_count; d++)
        if (table->backend->devices[d]->ops->shards_evict_begin == NULL)
            return false;
    return true;
}

em_status em__check_create_apply(request_context *r, em_error *err)
{
    em_table *table = r->table;
    shard_check *checks = em_zeroed(table->shard_count, sizeof(*checks));
    if (checks == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "table '%s': push: out of memory",
                            table->config.name);
    /* the heavy part, side by side with other pushes; then, holding every lock, only
     * the shards whose check no longer holds are checked again */
    unchecked_push unchecked = {0};
    bool later = !r->checked_at_once && checks_wait_for_walks(r);
    em_status status = r->checked_at_once ? take_check_at_once(r, checks)
                       : later            ? enqueue_checks(r, checks, &unchecked, err)
                                          : check_shards(r, checks, err);
    if (later && status != EM_OK)
        status = wait_for_checks(r, &unchecked, status, err);
    else if (later)
        r->unchecked = &unchecked; /* taken by the evictions' wait, or before any change */
    /* The finds' counts came back with the checks' wait (which a problem found also
     * means): with keys missing, the checks saw them as created (their initial values
     * stepped), which is what admission `always` does with them, so the push goes on to
     * create them, claiming the room beside other requests (or, without room, running
     * again alone: r->needs_alone); under another admission the checks did not see what
     * admission makes of them, and the push goes again, finding first. */
    if (r->counts_pending && (status == EM_OK || status == EM_INVALID_ARGUMENT)) {
        em__missing_found(r);
        bool always = table->config.admission.policy == EM_ADMISSION_ALWAYS;
        r->found_missing_late = r->missing > 0 && (status != EM_OK || !always);
        if (r->found_missing_late)
            status = EM_OK;
        else if (status == EM_OK && r->missing > 0 && !r->alone && !em__claim_rows(r))
            r->needs_alone = true;
    }
    /* only a push that creates keys beside other requests may find some created since */
    bool *refound = r->rows_claimed > 0 && !r->needs_alone
                        ? em_zeroed(table->shard_count, sizeof(*refound))
                        : NULL;
    if (status == EM_OK && r->rows_claimed > 0 && !r->needs_alone && refound == NULL)
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "table '%s': push: out of memory",
                              table->config.name);
    if (status == EM_OK && r->needs_alone) {
        free(checks);
        return EM_OK;
    }
    if (status == EM_OK && !r->found_missing_late) {
        lock_shards(r, true);
        /* keys created by others since they were found take their rows now, and a shard
         * where that happened is checked again with them */
        if (refound != NULL)
            status = em__refind_created(r, refound, err);
        for (uint32_t s = 0; status == EM_OK && refound != NULL && s < table->shard_count; s++)
            if (refound[s]) {
                checks[s].bounded = 0;
                checks[s].version = table->shard_versions[s].value - 1;
            }
        if (status == EM_OK)
            status = recheck_stale_shards(r, checks, err);
        if (status == EM_OK)
            status = em__preserve_for_snapshot(r, false, err);
        /* alone with the table on GPUs, the inserts settle with the push's last wait,
         * the shards held until then */
        if (status == EM_OK)
            (void)settles_later(r);
        if (status == EM_OK)
            status = em__create_missing(r, true, err);
        if (status == EM_OK)
            advance_versions(r, checks);
        else if (!r->settle_later) /* else em__finish_devices lets them go */
            lock_shards(r, false);
    }
    /* Every step is known to keep its rows finite: each shard is stepped and let go at
     * once, so pushes behind this one follow it shard by shard (or all together once
     * their inserts settle). */
    if (r->unchecked != NULL) { /* not taken yet: nothing was changed */
        em_error check_err;
        em_status checked = settle_unchecked(r, &check_err);
        /* a problem the checks found is the push's error before the table's room or
         * memory, as where the checks are waited for first (a device's failure stays) */
        bool first = status == EM_OK ||
                     (status == EM_RESOURCE_EXHAUSTED && checked == EM_INVALID_ARGUMENT);
        if (checked != EM_OK && first) {
            status = checked;
            *err = check_err;
        }
    }
    if (status == EM_OK && !r->found_missing_late)
        status = run_on_shards(r, WORK_APPLY, table->config.dim,
                               r->settle_later ? SHARDS_HELD : SHARDS_RELEASE_EACH, checks, err);
    if (!r->found_missing_late)
        status = em__finish_devices(r, status, err);
    free(refound);
    free(checks);
    return status;
}

/* An import's write from its row pointers (r->row_sources): the shard's rows[i] take the
 * floats of the batch's key targets[i]. */
static em_status write_rows_from(request_context *r, em_shard *shard, em_lane *lane,
                                 const uint64_t *rows, uint64_t n, const uint32_t *targets,
                                 em_error *err)
{
    for (uint64_t i = 0; i < n; i++)
        r->row_scratch[i] = r->row_sources[targets[i]];
    return shard->device->ops->shard_write_rows_from(shard, lane, rows, n, r->row_scratch, err);
}

/* The request's push clock, taken by the first shard it writes (eviction). */
static void take_update_stamp(request_context *r)
{
    if (r->has_update_stamp)
        return;
    em_table *table = r->table;
    r->update_stamp = (uint32_t)(atomic_fetch_add_explicit(&table->update_clock, 1,
                                                           memory_order_relaxed) + 1);
    r->has_update_stamp = true;
    em__clock_sample(table, em__unix_ms(), r->update_stamp);
}

/* Stamps the rows a request read or wrote with the table's clocks (eviction). */
static em_status touch_rows(request_context *r, segment *seg, uint32_t s, const uint64_t *rows,
                            uint64_t n, shard_work work, em_error *err)
{
    em_table *table = r->table;
    if (work != WORK_GATHER)
        take_update_stamp(r);
    uint32_t updated = work == WORK_GATHER
                           ? (uint32_t)atomic_load_explicit(&table->update_clock,
                                                            memory_order_relaxed)
                           : r->update_stamp;
    return seg->device->ops->shard_touch(table->shards[s], seg->lane, rows, n, r->access_stamp,
                                         updated, work != WORK_GATHER, err);
}

/* One shard's part of run_on_shards: the operation on its keys' rows, the initial
 * values of keys not admitted, and the rows' access stamps. */
static em_status shard_step(request_context *r, shard_work work, uint32_t floats_per_key,
                            const shard_check *checks, segment *seg, uint32_t s, em_error *err)
{
    em_table *table = r->table;
    const em_device_ops *ops = seg->device->ops;
    uint64_t offset = shard_offset(r, seg, s), n = shard_key_count(r, s);
    /* direct gathers place each vector by its target; others fill in order */
    const uint32_t *targets = seg->targets != NULL ? seg->targets + offset : NULL;
    float *payload = targets != NULL ? (float *)seg->payload
                                     : (float *)seg->payload + offset * floats_per_key;
    const uint64_t *rows = seg->rows + offset;
    em_status status;
    if (work == WORK_GATHER)
        status = ops->shard_gather(table->shards[s], seg->lane, rows, n, targets, payload, err);
    else if (work == WORK_APPLY)
        status = ops->shard_apply(table->shards[s], seg->lane, rows, n, payload,
                                  checks != NULL ? checks[s].largest : -1.0f, err);
    else if (r->row_sources != NULL)
        status = write_rows_from(r, table->shards[s], seg->lane, rows, n, targets, err);
    else
        status = ops->shard_write_rows(table->shards[s], seg->lane, rows, n, targets, payload,
                                       err);
    if (work == WORK_WRITE) /* what pushes checked before this is stale */
        table->shard_versions[s].value += EM_ROW_BOUNDED_STEPS + 1;
    if (status == EM_OK && work == WORK_GATHER && r->shard_rejected[s] > 0)
        status = ops->shard_fill_initial(table->shards[s], seg->lane, seg->keys + offset, rows, n,
                                         targets, payload, err);
    if (status == EM_OK && r->access_stamp != 0)
        status = touch_rows(r, seg, s, rows, n, work, err);
    return status;
}

/* Whether run_on_shards goes a shard on each thread: a request alone with the table,
 * large enough, over at least two shards, all in host memory (their operations finish
 * as they return, and need no lane of their own). */
static bool runs_beside(const request_context *r)
{
    em_table *table = r->table;
    if (!r->alone || table->backend->eviction_threads < 2 ||
        r->shard_start[table->shard_count] < ALONE_PARALLEL_KEYS)
        return false;
    uint32_t busy = 0;
    for (uint32_t s = 0; s < table->shard_count; s++)
        busy += shard_key_count(r, s) > 0;
    return busy >= 2 && shards_in_host_memory(table);
}

typedef struct shard_job {
    request_context *r;
    shard_work work;
    uint32_t floats_per_key;
    bool lock; /* each takes its shard's lock */
    const shard_check *checks;
    uint32_t *shards;
    segment **segments;
    em_status *status;
    em_error *errors;
} shard_job;

static void run_shard_job(void *context, uint64_t i)
{
    shard_job *job = context;
    em_table *table = job->r->table;
    uint32_t s = job->shards[i];
    if (job->lock && job->work == WORK_GATHER)
        em__shard_read_lock(table, s);
    else if (job->lock)
        em__shard_write_lock(table, s);
    job->status[i] = shard_step(job->r, job->work, job->floats_per_key, job->checks,
                                job->segments[i], s, &job->errors[i]);
    if (job->lock)
        em__shard_unlock(table, s);
}

/* run_on_shards a shard on each thread (runs_beside); the locks the caller holds are
 * released once every shard is done, and a failure is that of the first shard, in shard
 * order, that failed (the others did their work). */
static em_status run_beside(request_context *r, shard_work work, uint32_t floats_per_key,
                            shard_locking locking, const shard_check *checks, em_error *err)
{
    em_table *table = r->table;
    uint32_t count = 0, *shards = malloc(table->shard_count * sizeof(*shards));
    segment **segments = malloc(table->shard_count * sizeof(*segments));
    em_status *status = malloc(table->shard_count * sizeof(*status));
    em_error *errors = malloc(table->shard_count * sizeof(*errors));
    em_status failed = EM_OK;
    if (shards == NULL || segments == NULL || status == NULL || errors == NULL)
        failed = em_error_set(err, EM_RESOURCE_EXHAUSTED, "table '%s': out of host memory",
                              table->config.name);
    for (uint32_t d = 0; failed == EM_OK && d < table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        for (uint32_t s = seg->first_shard; s < seg->end_shard; s++)
            if (shard_key_count(r, s) > 0) {
                shards[count] = s;
                segments[count++] = seg;
            }
    }
    if (failed == EM_OK) {
        if (work != WORK_GATHER && r->access_stamp != 0)
            take_update_stamp(r); /* before the threads, which all stamp with it */
        shard_job job = {r, work, floats_per_key, locking == SHARDS_LOCK_EACH, checks, shards,
                         segments, status, errors};
        em_parallel_pool_run(table->backend->workers, count,
                             table->backend->eviction_threads, run_shard_job, &job);
    }
    for (uint32_t i = 0; failed == EM_OK && i < count; i++)
        if (status[i] != EM_OK) {
            failed = status[i];
            *err = errors[i];
            em_error_prefix(err, "table '%s' shard %u: ", table->config.name, shards[i]);
        }
    if (locking == SHARDS_RELEASE_EACH) /* every shard with keys, whatever happened */
        for (uint32_t s = 0; s < table->shard_count; s++)
            if (shard_key_count(r, s) > 0)
                em__shard_unlock(table, s);
    free(shards);
    free(segments);
    free(status);
    free(errors);
    return failed;
}

/* Whether run_on_shards does a device's shards in one go: a push's steps (shards_apply,
 * its gradients in key order) or a pull's gathers (shards_gather, none of its keys
 * refused), where the device can, for two shards or more with keys. */
static bool runs_at_once(const request_context *r, const segment *seg, shard_work work)
{
    const em_device_ops *ops = seg->device->ops;
    if (work == WORK_APPLY && (ops->shards_apply == NULL || seg->targets != NULL))
        return false;
    if (work == WORK_GATHER && ops->shards_gather == NULL)
        return false;
    if (work != WORK_APPLY && work != WORK_GATHER)
        return false;
    for (uint32_t s = seg->first_shard; work == WORK_GATHER && s < seg->end_shard; s++)
        if (r->shard_rejected[s] > 0)
            return false;
    return shards_with_keys(r, seg, false) >= 2;
}

/* run_on_shards' work (and touches) on a device's shards in one go (runs_at_once), their
 * locks taken and released as `locking` says, whatever happened. */
static em_status run_at_once(request_context *r, segment *seg, shard_work work,
                             shard_locking locking, em_error *err)
{
    em_table *table = r->table;
    const em_device_ops *ops = seg->device->ops;
    uint64_t *offsets = shard_offsets(r, seg, err);
    em_status status = offsets != NULL ? EM_OK : EM_RESOURCE_EXHAUSTED;
    for (uint32_t s = seg->first_shard; locking == SHARDS_LOCK_EACH && s < seg->end_shard; s++)
        if (shard_key_count(r, s) > 0 && work == WORK_GATHER)
            em__shard_read_lock(table, s);
        else if (shard_key_count(r, s) > 0)
            em__shard_write_lock(table, s);
    em_shard *const *shards = &table->shards[seg->first_shard];
    uint32_t count = seg->end_shard - seg->first_shard;
    if (status == EM_OK && work == WORK_APPLY) {
        if (r->access_stamp != 0)
            take_update_stamp(r);
        status = ops->shards_apply(shards, count, seg->lane, offsets, seg->rows, seg->payload,
                                   r->access_stamp, r->update_stamp, err);
    } else if (status == EM_OK) {
        uint32_t updated = (uint32_t)atomic_load_explicit(&table->update_clock,
                                                          memory_order_relaxed);
        status = ops->shards_gather(shards, count, seg->lane, offsets, seg->rows, seg->targets,
                                    seg->payload, r->access_stamp, updated, err);
    }
    for (uint32_t s = seg->first_shard; locking != SHARDS_HELD && s < seg->end_shard; s++)
        if (shard_key_count(r, s) > 0)
            em__shard_unlock(table, s);
    free(offsets);
    if (status != EM_OK)
        em_error_prefix(err, "table '%s' shards %u to %u: ", table->config.name,
                        seg->first_shard, seg->end_shard - 1);
    return status;
}

static em_status run_on_shards(request_context *r, shard_work work, uint32_t floats_per_key,
                               shard_locking locking, const shard_check *checks, em_error *err)
{
    if (runs_beside(r))
        return run_beside(r, work, floats_per_key, locking, checks, err);
    bool lock = locking == SHARDS_LOCK_EACH;
    em_status failed = EM_OK;
    em_table *table = r->table;
    for (uint32_t d = 0; d < table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        if (failed == EM_OK && runs_at_once(r, seg, work)) {
            failed = run_at_once(r, seg, work, locking, err);
            if (failed != EM_OK && locking != SHARDS_RELEASE_EACH)
                return failed;
            continue;
        }
        for (uint32_t s = seg->first_shard; s < seg->end_shard; s++) {
            if (shard_key_count(r, s) == 0)
                continue;
            if (failed != EM_OK) {
                em__shard_unlock(table, s); /* SHARDS_RELEASE_EACH */
                continue;
            }
            if (lock && work == WORK_GATHER)
                em__shard_read_lock(table, s);
            else if (lock)
                em__shard_write_lock(table, s);
            em_status status = shard_step(r, work, floats_per_key, checks, seg, s, err);
            if (locking != SHARDS_HELD)
                em__shard_unlock(table, s);
            if (status != EM_OK) {
                em_error_prefix(err, "table '%s' shard %u: ", table->config.name, s);
                if (locking != SHARDS_RELEASE_EACH)
                    return status;
                failed = status;
            }
        }
    }
    return failed;
}

/* One operation on every shard over its keys' rows and its part of the segment payload
 * (floats_per_key floats per key), taking each shard's lock around it, with the locks
 * already held, or releasing each held lock once its shard is done (on an error, the
 * shards not reached are only released). */
em_status em__run_on_shards(request_context *r, shard_work work, uint32_t floats_per_key,
                            em_error *err)
{
    return run_on_shards(r, work, floats_per_key,
                         r->settle_later ? SHARDS_HELD : SHARDS_LOCK_EACH, NULL, err);
}


/* The devices a request has work on: its home and every device with keys of it. */
static void devices_at_work(const request_context *r, bool *which)
{
    em_backend *backend = r->table->backend;
    for (uint32_t d = 0; d < backend->device_count; d++)
        which[d] = backend->devices[d] == r->home || r->segments[d].count > 0;
}

em_status em__synchronize_devices(request_context *r, em_error *err)
{
    bool which[EM_BACKEND_MAX_DEVICES] = {false};
    devices_at_work(r, which);
    return synchronize_marked(r, which, err);
}

em_status em__join_devices(request_context *r, em_error *err)
{
    const em_device_ops *ops = r->home->ops;
    if (ops->lane_join == NULL)
        return EM_OK;
    bool which[EM_BACKEND_MAX_DEVICES] = {false};
    devices_at_work(r, which);
    for (uint32_t d = 0; d < r->table->backend->device_count; d++) {
        if (!which[d] || r->lanes[d] == NULL || r->lanes[d] == r->home_lane)
            continue;
        em_status status = ops->lane_join(r->home_lane, r->lanes[d], err);
        if (status != EM_OK)
            return status;
    }
    return EM_OK;
}

/* Allocates the payload of every remote segment (local ones alias home_array). */
em_status em__prepare_payloads(request_context *r, float *home_array, uint32_t floats_per_key,
                                  const char *what, em_error *err)
{
    em_backend *backend = r->table->backend;
    for (uint32_t d = 0; d < backend->device_count; d++) {
        segment *seg = &r->segments[d];
        if (!seg->remote || seg->count == 0) {
            seg->payload = home_array + seg->begin * floats_per_key;
            continue;
        }
        em_status status = em__request_alloc(r, seg->device,
                                             seg->count * floats_per_key * sizeof(float), what,
                                             &seg->payload, err);
        if (status != EM_OK)
            return status;
    }
    return EM_OK;
}

