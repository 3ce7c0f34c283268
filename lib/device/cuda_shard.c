/*
 * DESIGN: the CUDA device's shards: a GPU hash map and block-allocated row storage per
 * shard, grown within the pool; the ordering of lanes that read and write one shard
 * (events), and find, insert, gather, apply, write and export over them.
 */
#include "lib/device/cuda_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/keyhash.h"

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

/* The shard's map over the slot arrays a, of slot_count slots. */
static em_gpu_map map_view_of(const cuda_shard *shard, const cuda_map_arrays *a,
                              uint64_t slot_count)
{
    return (em_gpu_map){.slots = a->count == 1 ? a->segments[0] : NULL,
                        .segments = (em_gpu_slot *const *)a->device_segments,
                        .segment_shift = a->shift,
                        .slot_count = slot_count,
                        .header = shard->header,
                        .seed = shard->hash_seed,
                        .free_rows = shard->free_rows};
}

static em_gpu_map map_view(const cuda_shard *shard)
{
    return map_view_of(shard, &shard->arrays, shard->slot_count);
}

static em_gpu_storage storage_view(const cuda_shard *shard)
{
    return (em_gpu_storage){
        .blocks = shard->device_blocks,
        .access = shard->track_access ? shard->device_access : NULL,
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

/* ---- shards: the map's slot arrays ------------------------------------------------------ */

/* Slots of each array of a map of slot_count slots (a power of two). */
static uint64_t array_slots_for(const cuda_shard *shard, uint64_t slot_count)
{
    uint64_t most = state_of(shard->base.device)->map_segment_slots;
    return most == 0 || slot_count <= most ? slot_count : most;
}

/* Frees a's arrays from the keep-th on (the first keep belong to another map), its
 * device table and its host table. */
static void arrays_free(em_device *device, cuda_map_arrays *a, uint64_t keep)
{
    for (uint64_t s = keep; a->segments != NULL && s < a->count; s++)
        em_device_free(device, a->segments[s]);
    em_device_free(device, a->device_segments);
    free(a->segments);
    memset(a, 0, sizeof(*a));
}

/* The arrays of a map of slot_count slots: the first `reuse` are kept's (of the same
 * size), the others allocated, and with several a device table for them (filled by
 * arrays_prepare). */
static em_status arrays_create(cuda_shard *shard, uint64_t slot_count, const cuda_map_arrays *kept,
                               uint64_t reuse, cuda_map_arrays *out, em_error *err)
{
    em_device *device = shard->base.device;
    uint64_t each = array_slots_for(shard, slot_count);
    memset(out, 0, sizeof(*out));
    out->segments = calloc(slot_count / each, sizeof(*out->segments));
    if (out->segments == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "hash map of %" PRIu64 " slots: out of host memory", slot_count);
    out->count = slot_count / each;
    out->shift = bits_for(each);
    em_status status = EM_OK;
    if (out->count > 1)
        status = em_device_alloc(device, out->count * sizeof(em_gpu_slot *),
                                 "hash map segment table", (void **)&out->device_segments, err);
    for (uint64_t s = 0; s < out->count && s < reuse; s++)
        out->segments[s] = kept->segments[s];
    for (uint64_t s = reuse; status == EM_OK && s < out->count; s++)
        status = em_device_alloc(device, each * sizeof(em_gpu_slot), "hash map slots",
                                 (void **)&out->segments[s], err);
    if (status != EM_OK)
        arrays_free(device, out, reuse < out->count ? reuse : out->count);
    return status;
}

/* Empties every slot of a (a map of slot_count slots) and uploads its device table. */
static em_status arrays_prepare(cuda_lane *lane, const cuda_map_arrays *a, uint64_t slot_count,
                                em_error *err)
{
    uint64_t each = slot_count / a->count;
    em_status status = EM_OK;
    for (uint64_t s = 0; status == EM_OK && s < a->count; s++)
        status = lane_check(lane, em_gpu_map_clear(lane->stream, a->segments[s], each), err);
    if (status == EM_OK && a->device_segments != NULL)
        status = em__cuda_copy_to_device(&lane->base, a->device_segments, a->segments,
                                         a->count * sizeof(*a->segments), err);
    return status;
}

/* ---- shards: growth -------------------------------------------------------------------- */

/* Slots a rehash through host memory brings back to the GPU per copy, at most. */
#define RELOAD_CHUNK_SLOTS ((uint64_t)1 << 20)

/* Whether the pool has bytes free, in all. A map in segments is allocated segment by
 * segment: asking first keeps a growth that cannot fit from taking the pool's last
 * bytes one segment at a time (and failing other lanes' requests meanwhile). */
static bool pool_has_free(em_device *device, uint64_t bytes, uint64_t *free_bytes)
{
    em_pool_stats stats;
    em_pool_get_stats(device->pool, &stats);
    *free_bytes = stats.bytes_free;
    return stats.bytes_free >= bytes;
}

/* The shard's map becomes the arrays a, of slot_count slots; the old ones, from the
 * keep-th on, go back to the pool. */
static void adopt_arrays(cuda_shard *shard, cuda_map_arrays *a, uint64_t keep, uint64_t slot_count)
{
    arrays_free(shard->base.device, &shard->arrays, keep);
    shard->arrays = *a;
    shard->slot_count = slot_count;
    shard->tombstones = 0;
}

/* Rehash with the new map beside the old: grown (of slot_count slots) is filled from
 * the old arrays on the GPU, then the old ones go back to the pool. */
static em_status rehash_beside(cuda_shard *shard, cuda_lane *lane, cuda_map_arrays *grown,
                               uint64_t slot_count, em_error *err)
{
    em_status status = arrays_prepare(lane, grown, slot_count, err);
    em_gpu_map view = map_view_of(shard, grown, slot_count);
    uint64_t each = shard->slot_count / shard->arrays.count;
    for (uint64_t s = 0; status == EM_OK && s < shard->arrays.count; s++)
        status = lane_check(lane, em_gpu_map_rehash(lane->stream, shard->arrays.segments[s], each,
                                                     view), err);
    if (status == EM_OK) /* the rehash left the tombstones behind */
        status = lane_check(lane, em_gpu_memset_async(lane->stream, &shard->header->tombstones, 0,
                                                      sizeof(uint64_t)), err);
    em_status synced = em__cuda_lane_sync(lane, status == EM_OK ? err : NULL);
    if (status == EM_OK)
        status = synced;
    if (status != EM_OK) {
        arrays_free(shard->base.device, grown, 0);
        return status;
    }
    adopt_arrays(shard, grown, 0, slot_count);
    return EM_OK;
}

/* Puts the old map back after a failed rehash through host memory: its slots from
 * host, and the header's tombstone count. */
static em_status restore_arrays(cuda_shard *shard, cuda_lane *lane, const em_gpu_slot *host,
                                em_error *err)
{
    const cuda_map_arrays *a = &shard->arrays;
    uint64_t each = shard->slot_count / a->count;
    em_status status = EM_OK;
    for (uint64_t s = 0; status == EM_OK && s < a->count; s++)
        status = em__cuda_copy_to_device(&lane->base, a->segments[s], host + s * each,
                                         each * sizeof(em_gpu_slot), err);
    if (status == EM_OK)
        status = em__cuda_copy_to_device(&lane->base, &shard->header->tombstones,
                                         &shard->tombstones, sizeof(uint64_t), err);
    if (status == EM_OK)
        status = em__cuda_lane_sync(lane, err);
    return status;
}

/* Rehash of a map that keeps its arrays (they are the first of the new map's, of the
 * same size): the old slots are copied to host memory, the new map gets only the
 * arrays it adds and is emptied, and the keys come back from host memory a chunk at a
 * time. The pool holds the new map and one chunk, never the old map beside the new.
 * Until the first slot is overwritten nothing has changed; a failure after puts the
 * old slots back from host memory. */
static em_status rehash_through_host(cuda_shard *shard, cuda_lane *lane, uint64_t slot_count,
                                     em_error *err)
{
    em_device *device = shard->base.device;
    const cuda_map_arrays *old = &shard->arrays;
    uint64_t old_slots = shard->slot_count, each = old_slots / old->count, free_bytes = 0;
    uint64_t added = (slot_count - old_slots) * sizeof(em_gpu_slot);
    if (!pool_has_free(device, added, &free_bytes))
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "the %" PRIu64 " bytes of slots it adds do not fit in pool '%s' "
                            "(%" PRIu64 " bytes free)", added, device->name, free_bytes);
    cuda_map_arrays grown;
    em_status status = arrays_create(shard, slot_count, old, old->count, &grown, err);
    if (status != EM_OK)
        return status;
    uint64_t chunk = each < RELOAD_CHUNK_SLOTS ? each : RELOAD_CHUNK_SLOTS;
    em_gpu_slot *staged = NULL;
    for (;;) { /* as large as the pool has room for, down to one bucket */
        status = em_device_alloc(device, chunk * sizeof(em_gpu_slot), "hash map reload chunk",
                                 (void **)&staged, err);
        if (status == EM_OK || status != EM_RESOURCE_EXHAUSTED || chunk <= EM_GPU_BUCKET_SLOTS)
            break;
        chunk /= 2;
    }
    em_gpu_slot *host = NULL;
    if (status == EM_OK) {
        host = malloc(old_slots * sizeof(em_gpu_slot));
        if (host == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                  "out of host memory for the %" PRIu64 " bytes of its slots",
                                  old_slots * (uint64_t)sizeof(em_gpu_slot));
    }
    for (uint64_t s = 0; status == EM_OK && s < old->count; s++)
        status = em__cuda_copy_to_host(&lane->base, host + s * each, old->segments[s],
                                       each * sizeof(em_gpu_slot), err);
    bool overwritten = status == EM_OK;
    if (status == EM_OK)
        status = arrays_prepare(lane, &grown, slot_count, err);
    em_gpu_map view = map_view_of(shard, &grown, slot_count);
    for (uint64_t done = 0; status == EM_OK && done < old_slots; done += chunk) {
        uint64_t n = old_slots - done < chunk ? old_slots - done : chunk;
        status = em__cuda_copy_to_device(&lane->base, staged, host + done,
                                         n * sizeof(em_gpu_slot), err);
        if (status == EM_OK)
            status = lane_check(lane, em_gpu_map_rehash(lane->stream, staged, n, view), err);
    }
    if (status == EM_OK) /* the rehash left the tombstones behind */
        status = lane_check(lane, em_gpu_memset_async(lane->stream, &shard->header->tombstones, 0,
                                                      sizeof(uint64_t)), err);
    if (overwritten) {
        em_status synced = em__cuda_lane_sync(lane, status == EM_OK ? err : NULL);
        if (status == EM_OK)
            status = synced;
    }
    if (status != EM_OK && overwritten) {
        em_error lost;
        if (restore_arrays(shard, lane, host, &lost) != EM_OK) {
            em_error first;
            em_error_copy(&first, err);
            em_error_set(err, first.status, "%s; putting the old slots back failed too: %s",
                         first.message, lost.message);
        }
    }
    free(host);
    em_device_free(device, staged);
    if (status != EM_OK) {
        arrays_free(device, &grown, old->count);
        return status;
    }
    adopt_arrays(shard, &grown, old->count, slot_count);
    return EM_OK;
}

/* Rehashes into a map of slot_count slots (synchronizes). The new map is built beside
 * the old one when the pool has room for both; when it has not and the map keeps its
 * arrays (its arrays are segments already, or a rehash in place), through host memory,
 * so that growth needs room for the slots it adds, not for the whole new map. */
static em_status rehash_map(cuda_shard *shard, cuda_lane *lane, uint64_t slot_count, em_error *err)
{
    em_device *device = shard->base.device;
    bool keeps_arrays = slot_count >= shard->slot_count &&
                        array_slots_for(shard, slot_count) ==
                            shard->slot_count / shard->arrays.count;
    uint64_t bytes = slot_count * sizeof(em_gpu_slot), free_bytes = 0;
    em_status status = EM_RESOURCE_EXHAUSTED;
    if (!keeps_arrays || pool_has_free(device, bytes, &free_bytes)) {
        cuda_map_arrays grown;
        status = arrays_create(shard, slot_count, NULL, 0, &grown, err);
        if (status == EM_OK)
            return rehash_beside(shard, lane, &grown, slot_count, err);
        if (status != EM_RESOURCE_EXHAUSTED || !keeps_arrays)
            return status;
    } else {
        em_error_set(err, EM_RESOURCE_EXHAUSTED,
                     "the new map's %" PRIu64 " bytes do not fit beside the old one in pool "
                     "'%s' (%" PRIu64 " bytes free)", bytes, device->name, free_bytes);
    }
    em_error beside;
    em_error_copy(&beside, err);
    status = rehash_through_host(shard, lane, slot_count, err);
    if (status == EM_OK)
        shard->rehashes_through_host++;
    else if (status == EM_RESOURCE_EXHAUSTED)
        em_error_prefix(err, "%s; nor through host memory: ", beside.message);
    return status;
}

/* Makes room for new_keys more keys within the maximum load, counting tombstones as
 * used: a rehash in place drops them while the live keys fill at most three quarters
 * of the budget (as the CPU map does), else the map doubles until they fit. */
static em_status reserve_map(cuda_shard *shard, cuda_lane *lane, uint64_t new_keys, em_error *err)
{
    uint64_t live = shard->size - side_keys(shard) + new_keys;
    if (live + shard->tombstones <= max_slot_keys(shard->slot_count))
        return EM_OK;
    uint64_t slot_count = shard->slot_count;
    if (live > max_slot_keys(slot_count) / 4 * 3)
        while (max_slot_keys(slot_count) < live)
            slot_count *= 2;
    return rehash_map(shard, lane, slot_count, err);
}

/* A new device table of capacity pointers (the caller uploads it), and *host_table
 * grown to capacity, keeping its entries. */
static em_status grow_table(cuda_shard *shard, void ***host_table, uint64_t capacity,
                            void ***device_table, const char *what, em_error *err)
{
    em_status status = em_device_alloc(shard->base.device, capacity * sizeof(void *), what,
                                       (void **)device_table, err);
    if (status != EM_OK)
        return status;
    void **grown = realloc(*host_table, capacity * sizeof(void *));
    if (grown == NULL) {
        em_device_free(shard->base.device, *device_table);
        *device_table = NULL;
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "%s: out of host memory", what);
    }
    *host_table = grown;
    return EM_OK;
}

/* Makes the block tables (rows, and access metadata where kept) hold `blocks` entries:
 * new device tables, the old ones returned in retired[0..1] for the caller to free
 * after a synchronize. */
static em_status grow_block_tables(cuda_shard *shard, uint64_t blocks, void *retired[2],
                                   em_error *err)
{
    retired[0] = retired[1] = NULL;
    if (blocks <= shard->block_capacity)
        return EM_OK;
    uint64_t capacity = shard->block_capacity < 16 ? 16 : 2 * shard->block_capacity;
    if (capacity < blocks)
        capacity = blocks;
    void **device_rows = NULL, **device_access = NULL;
    em_status status = grow_table(shard, (void ***)&shard->blocks, capacity, &device_rows,
                                  "row block table", err);
    if (status == EM_OK && shard->track_access)
        status = grow_table(shard, (void ***)&shard->access, capacity, &device_access,
                            "access block table", err);
    if (status != EM_OK) {
        em_device_free(shard->base.device, device_rows);
        return status;
    }
    retired[0] = shard->device_blocks;
    shard->device_blocks = (float **)device_rows;
    retired[1] = shard->device_access;
    shard->device_access = (em_gpu_row_access **)device_access;
    shard->block_capacity = capacity;
    return EM_OK;
}

static size_t access_block_bytes(const cuda_shard *shard)
{
    return (size_t)(shard->block_mask + 1) * sizeof(em_gpu_row_access);
}

/* One more block of rows (and of access metadata). */
static em_status add_block(cuda_shard *shard, em_error *err)
{
    void *block = NULL, *access = NULL;
    em_status status = em_device_alloc(shard->base.device, shard->block_bytes, "row storage",
                                       &block, err);
    if (status == EM_OK && shard->track_access)
        status = em_device_alloc(shard->base.device, access_block_bytes(shard),
                                 "row access metadata", &access, err);
    if (status != EM_OK) {
        em_device_free(shard->base.device, block);
        return status;
    }
    if (shard->track_access)
        shard->access[shard->block_count] = access;
    shard->blocks[shard->block_count++] = block;
    return EM_OK;
}

/* After an upload of a shard's tables on lane (the caller ordered the lane after every
 * read and write of the shard on the others, order_write): the tables it replaced go
 * back to the pool once the lane has synchronized, and the upload is recorded as the
 * shard's last write, so that other lanes' work with the new tables waits for it
 * (order_read) while this lane goes on without waiting. */
static em_status retire_after_upload(cuda_shard *shard, cuda_lane *lane, void *const *retired,
                                     uint32_t count, em_error *err)
{
    em_status status = record_write(shard, lane, err);
    for (uint32_t i = 0; i < count; i++) {
        if (retired[i] == NULL)
            continue;
        em_error later;
        em_status freed = status == EM_OK ? em__cuda_free_later(lane, retired[i], err)
                                          : em__cuda_free_later(lane, retired[i], &later);
        if (status == EM_OK)
            status = freed;
    }
    return status;
}

/* Adds row blocks until the storage holds `rows` rows. Blocks added before a failure
 * stay (spare capacity) and are published like the others. The caller ordered the lane
 * after the shard's work on other lanes (order_write). */
static em_status reserve_storage(cuda_shard *shard, cuda_lane *lane, uint64_t rows, em_error *err)
{
    if (storage_rows(shard) >= rows)
        return EM_OK;
    uint64_t rows_per = shard->block_mask + 1;
    uint64_t blocks = (rows + rows_per - 1) / rows_per;
    void *retired[2];
    em_status status = grow_block_tables(shard, blocks, retired, err);
    if (status != EM_OK)
        return status;
    uint64_t before = shard->block_count;
    while (status == EM_OK && shard->block_count < blocks)
        status = add_block(shard, err);
    em_error upload_error;
    em_status published = EM_OK;
    if (shard->block_count != before || retired[0] != NULL)
        published = em__cuda_copy_to_device(&lane->base, shard->device_blocks, shard->blocks,
                                            shard->block_count * sizeof(float *), &upload_error);
    if (published == EM_OK && shard->track_access &&
        (shard->block_count != before || retired[1] != NULL))
        published = em__cuda_copy_to_device(&lane->base, shard->device_access, shard->access,
                                            shard->block_count * sizeof(void *), &upload_error);
    em_error retire_error;
    em_status retired_status = retire_after_upload(shard, lane, retired, 2, &retire_error);
    if (published == EM_OK && retired_status != EM_OK) {
        published = retired_status;
        upload_error = retire_error;
    }
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

void em__cuda_shard_destroy(em_shard *base)
{
    if (base == NULL)
        return;
    cuda_shard *shard = shard_of(base);
    em_device *device = base->device;
    for (uint64_t b = 0; b < shard->block_count; b++) {
        em_device_free(device, shard->blocks[b]);
        if (shard->track_access)
            em_device_free(device, shard->access[b]);
    }
    free(shard->blocks);
    free(shard->access);
    em_device_free(device, shard->device_blocks);
    em_device_free(device, shard->device_access);
    em_device_free(device, shard->free_rows);
    arrays_free(device, &shard->arrays, 0);
    em_device_free(device, shard->header);
    em_gpu_host_free(shard->header_host);
    em_gpu_host_free(shard->headers_host);
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
    uint64_t slots = MIN_SLOTS; /* a power of two: kernel_logic.h, em_gpu_probe */
    while (slots < expected_rows + 16 && slots < MAX_INITIAL_SLOTS)
        slots *= 2;
    em_status status = arrays_create(shard, slots, NULL, 0, &shard->arrays, err);
    if (status == EM_OK)
        status = em_device_alloc(device, sizeof(em_gpu_map_header), "hash map header",
                                 (void **)&shard->header, err);
    if (status != EM_OK)
        return status;
    shard->slot_count = slots;
    shard->side_rows[0] = shard->side_rows[1] = EM_ROW_NONE;
    em_gpu_map_header header = {.rows = 0, .side_rows = {EM_ROW_NONE, EM_ROW_NONE}, .overflow = 0};
    em_lane *lane = NULL;
    status = em__cuda_lane_acquire(device, &lane, err);
    if (status != EM_OK)
        return status;
    status = arrays_prepare(lane_of(lane), &shard->arrays, slots, err);
    if (status == EM_OK)
        status = em__cuda_copy_to_device(lane, shard->header, &header, sizeof(header), err);
    if (status == EM_OK)
        status = em__cuda_lane_sync(lane_of(lane), err);
    em__cuda_lane_release(lane);
    return status;
}

static void set_row_geometry(cuda_shard *shard, const em_shard_spec *spec)
{
    shard->dim = spec->dim;
    em_row_blocks plan = em_row_blocks_plan(spec->dim, spec->optimizer.kind, TARGET_BLOCK_BYTES,
                                            spec->expected_rows);
    shard->row_floats = plan.row_floats;
    shard->stride = plan.stride;
    shard->block_shift = plan.block_shift;
    shard->block_mask = plan.block_mask;
    shard->block_bytes = plan.block_bytes;
}

em_status em__cuda_shard_create(em_device *device, const em_shard_spec *spec, em_shard **out,
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
    shard->track_access = spec->track_access;
    /* a loaded table's map hashes with a seed of its own: its rows arrive in the saved
     * map's order, which would crowd the home slots of a map with the same seed */
    shard->hash_seed = spec->hash_seed != 0 ? spec->hash_seed : EM_HASHMAP_SEED;
    set_row_geometry(shard, spec);
    pthread_mutex_init(&shard->order_lock, NULL);
    em_status status = create_shard_events(shard, err);
    if (status == EM_OK)
        status = em__cuda_check(em_gpu_host_alloc(sizeof(em_gpu_map_header),
                                                  (void **)&shard->header_host),
                                device->name, err);
    if (status == EM_OK)
        status = create_map(shard, spec->expected_rows, err);
    if (status != EM_OK) {
        em__cuda_shard_destroy(&shard->base);
        return em_error_prefix(err, "table '%s' shard %u: ", spec->table, spec->index);
    }
    *out = &shard->base;
    return EM_OK;
}

em_status em__cuda_shard_find(em_shard *base, em_lane *lane_base, const uint64_t *keys,
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
        status = em__cuda_copy_to_host(lane_base, missing, lane->counter, sizeof(uint64_t), err);
    return status;
}

/* The map may grow (and its old slots go back to the pool) once this find is done: the
 * read it records makes the growing lane wait for it (order_write). */
em_status em__cuda_shard_find_async(em_shard *base, em_lane *lane_base, const uint64_t *keys,
                                    uint64_t n, uint64_t *rows, uint64_t *missing, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    em_status status =
        lane_check(lane, em_gpu_memset_async(lane->stream, missing, 0, sizeof(uint64_t)), err);
    if (status == EM_OK && n > 0)
        status = lane_check(lane, em_gpu_map_find(lane->stream, map_view(shard), keys, n, rows,
                                                  missing), err);
    if (status == EM_OK && n > 0)
        status = record_read(shard, lane, err);
    return status;
}

/* A launch over several shards of a device (shards_find_async, shards_check_async): the
 * shards' parts (host memory, bytes) go to the GPU with one copy, into s. */
static em_status send_parts(cuda_lane *lane, scratch *s, const void *parts, size_t bytes,
                            void **device, em_error *err)
{
    em_status status = scratch_take(s, bytes, "shard parts", device, err);
    if (status == EM_OK)
        status = em__cuda_copy_to_device(&lane->base, *device, parts, bytes, err);
    return status;
}

/* order_read (or record_read, with record) of every shard i that has keys there
 * (offsets[i + 1] > offsets[i]). */
static em_status order_parts(em_shard *const *shards, uint32_t count, const uint64_t *offsets,
                             cuda_lane *lane, bool record, em_error *err)
{
    em_status status = EM_OK;
    for (uint32_t i = 0; status == EM_OK && i < count; i++)
        if (offsets[i + 1] > offsets[i])
            status = record ? record_read(shard_of(shards[i]), lane, err)
                            : order_read(shard_of(shards[i]), lane, err);
    return status;
}

/* The parts go to the GPU with one copy, and one launch finds every shard's keys. */
em_status em__cuda_shards_find_async(em_shard *const *shards, uint32_t count,
                                     em_lane *lane_base, const uint64_t *keys,
                                     const uint64_t *offsets, uint64_t *rows, uint64_t *missing,
                                     em_error *err)
{
    cuda_lane *lane = lane_of(lane_base);
    em_gpu_map_part *parts = malloc((count > 0 ? count : 1) * sizeof(*parts));
    if (parts == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "find: out of host memory");
    uint32_t used = 0;
    uint64_t most = 0;
    for (uint32_t i = 0; i < count; i++) {
        uint64_t n = offsets[i + 1] - offsets[i];
        if (n == 0)
            continue;
        parts[used++] = (em_gpu_map_part){.map = map_view(shard_of(shards[i])),
                                          .keys = keys + offsets[i], .n = n,
                                          .rows = rows + offsets[i], .missing = &missing[i]};
        most = n > most ? n : most;
    }
    scratch s = {.device = lane_base->device};
    em_gpu_map_part *device_parts = NULL;
    em_status status = lane_check(
        lane, em_gpu_memset_async(lane->stream, missing, 0, count * sizeof(uint64_t)), err);
    if (status == EM_OK && used > 0)
        status = send_parts(lane, &s, parts, used * sizeof(*parts), (void **)&device_parts, err);
    if (status == EM_OK && used > 0)
        status = lane_check(lane, em_gpu_maps_find(lane->stream, device_parts, used, most,
                                                   offsets[count] - offsets[0]),
                            err);
    if (status == EM_OK)
        status = order_parts(shards, count, offsets, lane, true, err);
    free(parts);
    return em__cuda_finish_async(&s, lane, status, err);
}

static em_status reserve_free_rows(cuda_shard *shard, cuda_lane *lane, uint64_t count,
                                   em_error *err);

/* An evicted key's slot stays a tombstone until a rehash, so the map makes room for
 * every new key; its row goes on the free list (which has room for it from here on),
 * and inserts take rows from there first. */
em_status em__cuda_shard_reserve(em_shard *base, em_lane *lane, uint64_t new_keys, uint64_t evicted,
                                    em_error *err)
{
    cuda_shard *shard = shard_of(base);
    /* Growth frees the old slots and block tables once this lane has synchronized. Keys
     * are created while other requests share the table: their lanes may still be
     * running gathers or steps of this shard, launched with the old tables, so this lane
     * first waits for every read and write of the shard on the other lanes. */
    em_status status = order_write(shard, lane_of(lane), err);
    if (status == EM_OK)
        status = reserve_map(shard, lane_of(lane), new_keys, err);
    /* released rows take new keys first */
    uint64_t released = shard->free_count + evicted;
    uint64_t fresh = new_keys > released ? new_keys - released : 0;
    if (status == EM_OK)
        status = reserve_storage(shard, lane_of(lane), shard->row_limit + fresh, err);
    if (status == EM_OK && evicted > 0)
        status = reserve_free_rows(shard, lane_of(lane), shard->free_count + evicted, err);
    return status;
}

/* Takes the map's header (read back) into the host copies; INTERNAL if an insert
 * overflowed the slots or the storage (reserve was not called first). */
static em_status take_header(cuda_shard *shard, em_gpu_map_header header, em_error *err)
{
    shard->size = header.rows - header.free_count;
    shard->row_limit = header.rows;
    shard->free_count = header.free_count;
    shard->tombstones = header.tombstones;
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

static em_status read_back_header(cuda_shard *shard, cuda_lane *lane, em_error *err)
{
    em_gpu_map_header header;
    em_status status =
        em__cuda_copy_to_host(&lane->base, &header, shard->header, sizeof(header), err);
    return status == EM_OK ? take_header(shard, header, err) : status;
}

/* Enqueues the copy of the map's header into header_host (shard_insert_settle). */
static em_status copy_header_back(cuda_shard *shard, cuda_lane *lane, em_error *err)
{
    shard->settle_from = NULL; /* the settle takes this copy */
    return lane_check(lane, em_gpu_memcpy_async(lane->stream, shard->header_host, shard->header,
                                                sizeof(em_gpu_map_header)),
                      err);
}

/* Enqueues the insert of the keys whose rows are EM_ROW_NONE, their rows' initial
 * values, and (with header_copy) the copy of the map's header into header_host. Rows
 * are always initialised here: the insert kernel writes them as it claims them. */
static em_status enqueue_insert(cuda_shard *shard, cuda_lane *lane, const uint64_t *keys,
                                uint64_t n, uint64_t *rows, bool header_copy, em_error *err)
{
    scratch s = {.device = shard->base.device};
    uint8_t *inserted = NULL;
    em_status status = scratch_take(&s, n, "insert flags", (void **)&inserted, err);
    if (status == EM_OK)
        status = order_write(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_map_insert(lane->stream, map_view(shard), keys, n, rows,
                                                    inserted), err);
    em_gpu_settle settle = {.map = map_view(shard)};
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_init(lane->stream, storage_view(shard), keys, rows,
                                                   inserted, n, shard->initializer,
                                                   shard->optimizer, settle), err);
    if (status == EM_OK)
        status = record_write(shard, lane, err);
    if (status == EM_OK && header_copy)
        status = copy_header_back(shard, lane, err);
    /* the flags go back to the pool once the lane has synchronized */
    return em__cuda_finish_async(&s, lane, status, err);
}

em_status em__cuda_shard_insert_missing(em_shard *base, em_lane *lane_base,
                                           const uint64_t *keys, uint64_t n, uint64_t *rows,
                                           bool initialize, em_error *err)
{
    (void)initialize;
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    if (n == 0)
        return EM_OK;
    em_status status = enqueue_insert(shard, lane, keys, n, rows, false, err);
    return status == EM_OK ? read_back_header(shard, lane, err) : status;
}

em_status em__cuda_shard_insert_missing_async(em_shard *base, em_lane *lane_base,
                                             const uint64_t *keys, uint64_t n, uint64_t *rows,
                                             bool initialize, em_error *err)
{
    (void)initialize;
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    if (n == 0) /* nothing to insert: the header still comes back for the settle */
        return copy_header_back(shard, lane, err);
    return enqueue_insert(shard, lane, keys, n, rows, true, err);
}

em_status em__cuda_shard_insert_settle(em_shard *base, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    const em_gpu_map_header *header =
        shard->settle_from != NULL ? shard->settle_from : shard->header_host;
    shard->settle_from = NULL;
    return take_header(shard, *header, err);
}

/* Makes holder's pinned headers_host room for the headers of count shards settled
 * together (its last copy was settled: the caller holds holder's write lock). */
static em_status headers_room(cuda_shard *holder, uint32_t count, em_error *err)
{
    if (holder->headers_capacity >= count)
        return EM_OK;
    em_gpu_map_header *grown = NULL;
    em_gpu_status allocated = em_gpu_host_alloc(count * sizeof(em_gpu_map_header),
                                                (void **)&grown);
    if (allocated.code != 0)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "table '%s': no pinned memory for %u map headers: %s",
                            holder->table, count, allocated.message);
    em_gpu_host_free(holder->headers_host);
    holder->headers_host = grown;
    holder->headers_capacity = count;
    return EM_OK;
}

/* Whether shards[i] has a part in a launch over several shards: keys there
 * (offsets[i + 1] > offsets[i]) and, with `only` given, only[i] > 0. */
static bool has_part(const uint64_t *offsets, const uint64_t *only, uint32_t i)
{
    return offsets[i + 1] > offsets[i] && (only == NULL || only[i] > 0);
}

/* The parts of shards[i] (has_part) for a launch over several shards (em_gpu_shard_part: map, storage, keys, rows,
 * n, and gradients where given); *used of them, *most the keys of the largest, *total
 * the keys of all. NULL when out of host memory. */
static em_gpu_shard_part *shard_parts(em_shard *const *shards, uint32_t count,
                                      const uint64_t *keys, const uint64_t *offsets,
                                      const uint64_t *only, uint64_t *rows,
                                      const float *gradients, uint32_t *used, uint64_t *most,
                                      uint64_t *total)
{
    em_gpu_shard_part *parts = malloc((count > 0 ? count : 1) * sizeof(*parts));
    *used = 0;
    *most = 0;
    *total = 0;
    for (uint32_t i = 0; parts != NULL && i < count; i++) {
        const cuda_shard *shard = shard_of(shards[i]);
        uint64_t n = offsets[i + 1] - offsets[i];
        if (!has_part(offsets, only, i))
            continue;
        parts[(*used)++] = (em_gpu_shard_part){
            .map = map_view(shard),
            .storage = storage_view(shard),
            .keys = keys != NULL ? keys + offsets[i] : NULL,
            .rows = rows + offsets[i],
            .n = n,
            .gradients = gradients != NULL ? gradients + offsets[i] * shard->dim : NULL,
        };
        *most = n > *most ? n : *most;
        *total += n;
    }
    return parts;
}

/* order_write (or record_write, with record) of every shard i with a part (has_part). */
static em_status order_part_writes(em_shard *const *shards, uint32_t count,
                                   const uint64_t *offsets, const uint64_t *only,
                                   cuda_lane *lane, bool record, em_error *err)
{
    em_status status = EM_OK;
    for (uint32_t i = 0; status == EM_OK && i < count; i++)
        if (has_part(offsets, only, i))
            status = record ? record_write(shard_of(shards[i]), lane, err)
                            : order_write(shard_of(shards[i]), lane, err);
    return status;
}

/* The inserts of several shards in one set of launches: the parts' flags and headers
 * from one scratch, the parts sent with one copy, one launch inserting, one writing the
 * new rows and settling the maps, and the headers back with one copy into the pinned
 * headers of the first shard that inserts, where each shard's settle_from points. */
em_status em__cuda_shards_insert_missing_async(em_shard *const *shards, uint32_t count,
                                               em_lane *lane_base, const uint64_t *keys,
                                               const uint64_t *offsets, const uint64_t *missing,
                                               uint64_t *rows, em_error *err)
{
    cuda_lane *lane = lane_of(lane_base);
    uint32_t used = 0;
    uint64_t most = 0, total = 0;
    em_gpu_shard_part *parts = shard_parts(shards, count, keys, offsets, missing, rows, NULL,
                                           &used, &most, &total);
    if (parts == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "insert: out of host memory");
    if (used == 0) {
        free(parts);
        return EM_OK;
    }
    cuda_shard *holder = NULL;
    for (uint32_t i = 0; holder == NULL && i < count; i++)
        if (has_part(offsets, missing, i))
            holder = shard_of(shards[i]);
    scratch s = {.device = lane_base->device};
    uint8_t *inserted = NULL;
    em_gpu_map_header *headers = NULL;
    em_gpu_shard_part *device_parts = NULL;
    em_status status = headers_room(holder, used, err);
    if (status == EM_OK)
        status = scratch_take(&s, total, "insert flags", (void **)&inserted, err);
    if (status == EM_OK)
        status = scratch_take(&s, used * sizeof(em_gpu_map_header), "map headers",
                              (void **)&headers, err);
    for (uint64_t k = 0, at = 0; status == EM_OK && k < used; at += parts[k].n, k++) {
        parts[k].inserted = inserted + at;
        parts[k].header = &headers[k];
    }
    if (status == EM_OK)
        status = order_part_writes(shards, count, offsets, missing, lane, false, err);
    if (status == EM_OK)
        status = send_parts(lane, &s, parts, used * sizeof(*parts), (void **)&device_parts, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_parts_insert(lane->stream, device_parts, used, most),
                            err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_parts_init(lane->stream, device_parts, used, most,
                                                    holder->row_floats, holder->initializer,
                                                    holder->optimizer),
                            err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_memcpy_async(lane->stream, holder->headers_host,
                                                      headers,
                                                      used * sizeof(em_gpu_map_header)),
                            err);
    for (uint32_t i = 0, k = 0; status == EM_OK && i < count; i++)
        if (has_part(offsets, missing, i))
            shard_of(shards[i])->settle_from = &holder->headers_host[k++];
    if (status == EM_OK)
        status = order_part_writes(shards, count, offsets, missing, lane, true, err);
    free(parts);
    return em__cuda_finish_async(&s, lane, status, err);
}

/* Makes the free list hold count rows, keeping the ones on it. It grows to half as much
 * again as asked at least: a full table's requests each evict about as many rows as the
 * one before, a few more or less. The list's copy is ordered after the shard's work on
 * other lanes (order_write), and the old list goes back once the lane has synchronized. */
static em_status reserve_free_rows(cuda_shard *shard, cuda_lane *lane, uint64_t count,
                                   em_error *err)
{
    if (count <= shard->free_capacity)
        return EM_OK;
    em_status ordered = order_write(shard, lane, err);
    if (ordered != EM_OK)
        return ordered;
    uint64_t capacity = shard->free_capacity < 1024 ? 1024 : 2 * shard->free_capacity;
    if (capacity < count + count / 2)
        capacity = count + count / 2;
    uint64_t *grown = NULL;
    em_status status = em_device_alloc(shard->base.device, capacity * sizeof(uint64_t),
                                       "free row list", (void **)&grown, err);
    if (status != EM_OK)
        return status;
    if (shard->free_count > 0)
        status = lane_check(lane, em_gpu_memcpy_async(lane->stream, grown, shard->free_rows,
                                                      shard->free_count * sizeof(uint64_t)), err);
    if (status != EM_OK) { /* the copy may still be enqueued: the new list too goes later */
        em_error later;
        (void)em__cuda_free_later(lane, grown, &later);
        return status;
    }
    void *retired = shard->free_rows;
    shard->free_rows = grown;
    shard->free_capacity = capacity;
    return retire_after_upload(shard, lane, &retired, 1, err);
}

/* Enqueues the erase of keys[0..n) where rows is NULL or rows[i] is stored (keys and
 * rows on the device), with room on the free list for every row. */
static em_status enqueue_erase(cuda_shard *shard, cuda_lane *lane, const uint64_t *keys,
                               const uint64_t *rows, uint64_t n, em_error *err)
{
    em_status status = reserve_free_rows(shard, lane, shard->free_count + n, err);
    if (status == EM_OK)
        status = order_write(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_map_erase(lane->stream, map_view(shard), keys, rows, n),
                            err);
    if (status == EM_OK)
        status = record_write(shard, lane, err);
    return status;
}

/* Tombstones the keys' slots and puts their rows on the free list (keys and rows on
 * the device). */
em_status em__cuda_shard_erase(em_shard *base, em_lane *lane_base, const uint64_t *keys,
                               const uint64_t *rows, uint64_t n, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    if (n == 0)
        return EM_OK;
    em_status status = enqueue_erase(shard, lane, keys, rows, n, err);
    return status == EM_OK ? read_back_header(shard, lane, err) : status;
}

em_status em__cuda_shard_gather(em_shard *base, em_lane *lane_base, const uint64_t *rows,
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

/* ---- requests over all of a table's shards at once ------------------------------------- */

/* What the kernels of a request that goes at once see of a device's shards of one table:
 * one shard as it is; several as one (em_gpu_shards: their maps, and one storage whose
 * blocks are every shard's in turn), a view copied to scratch on the lane. */
typedef struct shards_seen {
    uint32_t count;
    em_gpu_map map;        /* count 1 */
    em_gpu_shards shards;  /* count > 1 */
    em_gpu_storage storage;
} shards_seen;

/* The GPU copy of a view built on the host (host, bytes; taken over): a copy the lane
 * keeps of a view byte for byte the same, or a new one, copied through the lane's
 * staging, that replaces the lane's oldest (whose buffer is freed once the lane's work
 * so far is done). A view holds the maps' descriptors and the block pointers, so an
 * equal view is an equally valid one: whatever changed in a shard since (a growth, new
 * blocks) changes its bytes. */
static em_status view_on_gpu(cuda_lane *lane, uint8_t *host, size_t bytes, uint8_t **device,
                             em_error *err)
{
    for (uint32_t v = 0; v < VIEW_CACHE; v++)
        if (lane->views[v].bytes == bytes && memcmp(lane->views[v].host, host, bytes) == 0) {
            free(host);
            *device = lane->views[v].device;
            return EM_OK;
        }
    em_status status = em_device_alloc(lane->base.device, bytes, "shards view", (void **)device,
                                       err);
    if (status == EM_OK)
        status = em__cuda_copy_to_device(&lane->base, *device, host, bytes, err);
    if (status != EM_OK) {
        if (*device != NULL)
            (void)em__cuda_free_later(lane, *device, NULL);
        free(host);
        return status;
    }
    uint32_t v = lane->next_view;
    lane->next_view = (v + 1) % VIEW_CACHE;
    if (lane->views[v].device != NULL)
        status = em__cuda_free_later(lane, lane->views[v].device, err);
    free(lane->views[v].host);
    lane->views[v].host = host;
    lane->views[v].device = *device;
    lane->views[v].bytes = bytes;
    return status;
}

/* The view of shards[0..count) (shards_seen), on the GPU: one the lane keeps
 * (view_on_gpu). The shards' block tables do not change meanwhile: the caller holds
 * every shard's lock. */
static em_status see_shards(em_shard *const *bases, uint32_t count, cuda_lane *lane,
                            shards_seen *seen, em_error *err)
{
    const cuda_shard *first = shard_of(bases[0]);
    seen->count = count;
    seen->storage = storage_view(first);
    if (count == 1) {
        seen->map = map_view(first);
        return EM_OK;
    }
    uint64_t blocks = 0;
    for (uint32_t i = 0; i < count; i++) {
        const cuda_shard *shard = shard_of(bases[i]);
        if (shard->block_shift != first->block_shift || shard->stride != first->stride ||
            shard->track_access != first->track_access)
            return em_error_set(err, EM_INTERNAL,
                                "table '%s': shards %u and %u store rows differently",
                                first->table, first->index, shard->index);
        blocks += shard->block_count;
    }
    uint32_t tables = first->track_access ? 2 : 1; /* block pointers, access pointers */
    size_t bytes = count * (sizeof(em_gpu_map) + sizeof(uint64_t)) +
                   tables * blocks * sizeof(void *);
    uint8_t *host = malloc(bytes);
    if (host == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "table '%s': out of host memory for a view of %u shards",
                            first->table, count);
    em_gpu_map *maps = (em_gpu_map *)host;
    uint64_t *row_base = (uint64_t *)(maps + count);
    float **block_table = (float **)(row_base + count);
    em_gpu_row_access **access_table = (em_gpu_row_access **)(block_table + blocks);
    uint64_t at = 0;
    for (uint32_t i = 0; i < count; i++) {
        const cuda_shard *shard = shard_of(bases[i]);
        maps[i] = map_view(shard);
        row_base[i] = at << first->block_shift;
        if (shard->block_count == 0) /* a shard with no rows yet has no block tables */
            continue;
        memcpy(block_table + at, shard->blocks, shard->block_count * sizeof(float *));
        if (first->track_access)
            memcpy(access_table + at, shard->access,
                   shard->block_count * sizeof(em_gpu_row_access *));
        at += shard->block_count;
    }
    uint8_t *device = NULL;
    em_status status = view_on_gpu(lane, host, bytes, &device, err);
    if (status != EM_OK)
        return status;
    size_t maps_bytes = count * sizeof(em_gpu_map);
    size_t blocks_at = maps_bytes + count * sizeof(uint64_t);
    seen->shards = (em_gpu_shards){.maps = (const em_gpu_map *)device,
                                   .row_base = (const uint64_t *)(device + maps_bytes),
                                   .count = count,
                                   .row_limit = blocks << first->block_shift};
    seen->storage.blocks = (float *const *)(device + blocks_at);
    seen->storage.access =
        first->track_access
            ? (em_gpu_row_access *const *)(device + blocks_at + blocks * sizeof(void *))
            : NULL;
    seen->storage.row_limit = blocks << first->block_shift;
    return EM_OK;
}

/* Finds unique[0..*count) in the shards seen (rows as the view numbers them). */
static em_status find_seen(const shards_seen *seen, cuda_lane *lane, const uint64_t *unique,
                           uint64_t n, const uint32_t *count, uint64_t *rows, uint64_t *missing,
                           em_error *err)
{
    em_gpu_status found =
        seen->count == 1
            ? em_gpu_map_find_counted(lane->stream, seen->map, unique, n, count, rows, missing)
            : em_gpu_shards_find_counted(lane->stream, seen->shards, unique, n, count, rows,
                                         missing);
    return lane_check(lane, found, err);
}

/* A push's find and check of unique[0..*count) in the shards seen, in one kernel. */
static em_status find_check_seen(const shards_seen *seen, const cuda_shard *first,
                                 cuda_lane *lane, const uint64_t *unique, uint64_t n,
                                 const uint32_t *count, const float *gradients, uint64_t *rows,
                                 uint64_t *missing, uint64_t *problem, em_error *err)
{
    em_gpu_status done =
        seen->count == 1
            ? em_gpu_map_find_check_counted(lane->stream, seen->map, seen->storage,
                                            first->optimizer, first->initializer, unique, n,
                                            count, gradients, rows, missing, problem)
            : em_gpu_shards_find_check_counted(lane->stream, seen->shards, seen->storage,
                                               first->optimizer, first->initializer, unique, n,
                                               count, gradients, rows, missing, problem);
    return lane_check(lane, done, err);
}

/* Where the settle of several shards' maps leaves their headers: on the GPU (*headers,
 * from the scratch), then in the first shard's pinned copies, which shard_insert_settle
 * reads once the lane has synchronized. The caller holds every shard's write lock until
 * then. */
static em_status settle_headers(em_shard *const *bases, const shards_seen *seen, scratch *s,
                                em_gpu_map_header **headers, em_error *err)
{
    em_status status = headers_room(shard_of(bases[0]), seen->count, err);
    if (status == EM_OK)
        status = scratch_take(s, seen->count * sizeof(em_gpu_map_header), "map headers",
                              (void **)headers, err);
    return status;
}

/* Sends the settled headers back (after the launch that settled them). */
static em_status send_headers_back(em_shard *const *bases, const shards_seen *seen,
                                   cuda_lane *lane, const em_gpu_map_header *headers,
                                   em_error *err)
{
    cuda_shard *first = shard_of(bases[0]);
    em_status status = lane_check(lane, em_gpu_memcpy_async(lane->stream, first->headers_host,
                                                            headers,
                                                            seen->count *
                                                                sizeof(em_gpu_map_header)),
                                  err);
    for (uint32_t i = 0; status == EM_OK && i < seen->count; i++)
        shard_of(bases[i])->settle_from = &first->headers_host[i];
    return status;
}

/* Inserts the keys of unique[0..n) the gate leaves (em_gpu_gate_end: the first *count,
 * none when a problem word is set then) whose rows are ROW_NONE into the shards seen.
 * *fresh gets what the launch that writes the new rows needs (em_gpu_rows_init, or a
 * push's step): their flags and the settle of the maps, after which settled_back sends
 * the maps' headers back. */
static em_status insert_seen(em_shard *const *bases, const shards_seen *seen, cuda_lane *lane,
                             scratch *s, const uint64_t *unique, uint64_t n, em_gpu_gate gate,
                             uint64_t *rows, em_gpu_fresh_rows *fresh, em_error *err)
{
    const cuda_shard *first = shard_of(bases[0]);
    uint8_t *inserted = NULL;
    em_status status = scratch_take(s, n, "insert flags", (void **)&inserted, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_memset_async(lane->stream, inserted, 0, n), err);
    if (status == EM_OK)
        status = lane_check(lane,
                            seen->count == 1
                                ? em_gpu_map_insert_counted(lane->stream, seen->map, unique, n,
                                                            gate, rows, inserted)
                                : em_gpu_shards_insert_counted(lane->stream, seen->shards, unique,
                                                               n, gate, rows, inserted),
                            err);
    *fresh = (em_gpu_fresh_rows){.keys = unique,
                                 .inserted = inserted,
                                 .initializer = first->initializer,
                                 .settle = {.map = seen->map}};
    if (seen->count > 1) {
        fresh->settle = (em_gpu_settle){.shards = seen->shards};
        if (status == EM_OK)
            status = settle_headers(bases, seen, s, &fresh->settle.headers, err);
    }
    return status;
}

/* After the launch that wrote the new rows and settled the maps: the maps' headers back
 * (shard_insert_settle takes them in once the lane has synchronized). */
static em_status settled_back(em_shard *const *bases, const shards_seen *seen, cuda_lane *lane,
                              const em_gpu_fresh_rows *fresh, em_error *err)
{
    if (seen->count == 1)
        return copy_header_back(shard_of(bases[0]), lane, err);
    return send_headers_back(bases, seen, lane, fresh->settle.headers, err);
}

/* Orders the lane after the shards' writes (and, to write, their reads) on other lanes,
 * or records the lane's read or write of them. */
static em_status order_shards(em_shard *const *bases, uint32_t count, cuda_lane *lane,
                              bool write, em_error *err)
{
    em_status status = EM_OK;
    for (uint32_t i = 0; status == EM_OK && i < count; i++)
        status = write ? order_write(shard_of(bases[i]), lane, err)
                       : order_read(shard_of(bases[i]), lane, err);
    return status;
}

static em_status record_shards(em_shard *const *bases, uint32_t count, cuda_lane *lane,
                               bool write, em_error *err)
{
    em_status status = EM_OK;
    for (uint32_t i = 0; status == EM_OK && i < count; i++)
        status = write ? record_write(shard_of(bases[i]), lane, err)
                       : record_read(shard_of(bases[i]), lane, err);
    return status;
}

em_status em__cuda_shards_find_local_async(em_shard *const *shards, uint32_t count,
                                           cuda_lane *lane, const uint64_t *keys, uint64_t n,
                                           const uint32_t *unique_count, uint64_t *rows,
                                           uint64_t *missing, em_error *err)
{
    shards_seen seen;
    em_status status = count > 1 ? see_shards(shards, count, lane, &seen, err)
                                 : em_error_set(err, EM_INTERNAL, "a find over %u shard(s) "
                                                "as one", count);
    if (status == EM_OK)
        status = order_shards(shards, count, lane, false, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_shards_find_local(lane->stream, seen.shards, keys, n,
                                                           unique_count, rows, missing),
                            err);
    if (status == EM_OK)
        status = record_shards(shards, count, lane, false, err);
    return status;
}

/* The pull of a table in a single pass of the GPU (device.h: shards_pull_async): find,
 * the insert of the absent keys when creating, the output straight from the rows, and
 * the touch (without creating, only when every key was found, decided on the GPU); the
 * caller reads *missing back with the output. */
em_status em__cuda_shards_pull_async(em_shard *const *bases, uint32_t shard_count,
                                     em_lane *lane_base, const em_device_batch *batch,
                                     em_combiner combiner, const uint64_t *unique,
                                     const uint32_t *count, bool create, uint64_t *rows,
                                     uint64_t *missing, float *out, uint64_t accessed,
                                     uint32_t updated, em_error *err)
{
    cuda_shard *first = shard_of(bases[0]);
    cuda_lane *lane = lane_of(lane_base);
    scratch s = {.device = lane_base->device};
    shards_seen seen;
    em_gpu_batch view = {.rows = batch->rows,
                         .nnz = batch->nnz,
                         .offsets = batch->offsets,
                         .inverse = batch->inverse,
                         .position = NULL,
                         .unique_count = batch->nnz, /* at most; the kernels read *count */
                         .combiner = combiner,
                         .dim = first->dim};
    em_status status = see_shards(bases, shard_count, lane, &seen, err);
    if (status == EM_OK && batch->inverse == NULL) { /* per distinct key: rows past the
                                                      * count stay absent, their vectors 0 */
        uint32_t *identity = NULL;
        status = scratch_take(&s, batch->nnz * sizeof(uint32_t), "identity inverse",
                              (void **)&identity, err);
        if (status == EM_OK)
            status = lane_check(lane, em_gpu_iota_u32(lane->stream, identity, batch->nnz), err);
        if (status == EM_OK)
            status = lane_check(lane, em_gpu_memset_async(lane->stream, rows, 0xff,
                                                          batch->nnz * sizeof(uint64_t)),
                                err);
        view.inverse = identity;
    }
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_memset_async(lane->stream, missing, 0, sizeof(uint64_t)),
                            err);
    if (status == EM_OK) /* keys created by a request before this one are in; creating,
                          * after every read of the shards on other lanes too */
        status = order_shards(bases, shard_count, lane, create, err);
    if (status == EM_OK)
        status = find_seen(&seen, lane, unique, batch->nnz, count, rows, missing, err);
    if (status == EM_OK && create) {
        em_gpu_fresh_rows fresh;
        em_gpu_gate all = {.count = count};
        status = insert_seen(bases, &seen, lane, &s, unique, batch->nnz, all, rows, &fresh, err);
        if (status == EM_OK)
            status = lane_check(lane, em_gpu_rows_init(lane->stream, seen.storage, unique, rows,
                                                       fresh.inserted, batch->nnz,
                                                       first->initializer, first->optimizer,
                                                       fresh.settle),
                                err);
        if (status == EM_OK)
            status = settled_back(bases, &seen, lane, &fresh, err);
    }
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_pull(lane->stream, seen.storage, &view, rows, out),
                            err);
    em_gpu_gate found = {.count = count, .missing = create ? NULL : missing, .problem = NULL};
    if (status == EM_OK && first->track_access && accessed != 0)
        status = lane_check(lane, em_gpu_rows_touch_gated(lane->stream, seen.storage, rows,
                                                          batch->nnz, found, accessed, updated,
                                                          0),
                            err);
    if (status == EM_OK)
        status = record_shards(bases, shard_count, lane, create, err);
    return em__cuda_finish_async(&s, lane, status, err);
}

/* A push's find and check of unique[0..*count) in the shards seen, into *missing (the
 * keys absent) and *problem (the first row its step would break, UINT64_MAX for none),
 * ordered after every read and write of the shards on other lanes. */
static em_status find_check_words(em_shard *const *bases, uint32_t shard_count,
                                  const shards_seen *seen, cuda_lane *lane,
                                  const uint64_t *unique, const uint32_t *count, uint64_t n,
                                  const float *gradients, uint64_t *rows, uint64_t *missing,
                                  uint64_t *problem, em_error *err)
{
    em_status status = lane_check(lane, em_gpu_memset_async(lane->stream, missing, 0,
                                                            sizeof(uint64_t)), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_memset_async(lane->stream, problem, 0xff,
                                                      sizeof(uint64_t)), err);
    if (status == EM_OK)
        status = order_shards(bases, shard_count, lane, true, err);
    if (status == EM_OK)
        status = find_check_seen(seen, shard_of(bases[0]), lane, unique, n, count, gradients,
                                 rows, missing, problem, err);
    return status;
}

/* A push's step of rows[0..n) in the shards seen, as the gate says: creating (keys
 * given), the insert of the keys found absent first, whose rows the step's launch gives
 * their initial values, and the maps' headers back; then the touch, and the write
 * recorded. */
static em_status step_seen(em_shard *const *bases, uint32_t shard_count, const shards_seen *seen,
                           cuda_lane *lane, scratch *s, const uint64_t *keys, uint64_t *rows,
                           uint64_t n, const float *gradients, em_gpu_gate gate,
                           uint64_t accessed, uint32_t updated, em_error *err)
{
    const cuda_shard *first = shard_of(bases[0]);
    em_gpu_fresh_rows fresh = {0};
    em_status status = EM_OK;
    if (keys != NULL)
        status = insert_seen(bases, seen, lane, s, keys, n, gate, rows, &fresh, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_apply_gated(lane->stream, seen->storage,
                                                          first->optimizer, rows, n, gradients,
                                                          gate, fresh),
                            err);
    if (status == EM_OK && keys != NULL)
        status = settled_back(bases, seen, lane, &fresh, err);
    if (status == EM_OK && first->track_access && accessed != 0)
        status = lane_check(lane, em_gpu_rows_touch_gated(lane->stream, seen->storage, rows, n,
                                                          gate, accessed, updated, 1),
                            err);
    if (status == EM_OK)
        status = record_shards(bases, shard_count, lane, true, err);
    return status;
}

/* The push to a table in a single pass of the GPU (device.h: shards_push_async): find,
 * check, when creating the insert of the absent keys, and the step (and the touch) only
 * when every row checked (and, without creating, every key was found), decided on the
 * GPU; the step's launch writes the new rows' initial values before stepping them. The
 * caller reads the words back once. */
em_status em__cuda_shards_push_async(em_shard *const *bases, uint32_t shard_count,
                                     em_lane *lane_base, const uint64_t *unique,
                                     const uint32_t *count, uint64_t n, const float *gradients,
                                     bool create, uint64_t *rows, uint64_t *missing,
                                     uint64_t *problem, uint64_t accessed, uint32_t updated,
                                     em_error *err)
{
    cuda_lane *lane = lane_of(lane_base);
    scratch s = {.device = lane_base->device};
    shards_seen seen;
    em_gpu_gate gate = {.count = count, .missing = create ? NULL : missing, .problem = problem};
    em_status status = see_shards(bases, shard_count, lane, &seen, err);
    if (status == EM_OK)
        status = find_check_words(bases, shard_count, &seen, lane, unique, count, n, gradients,
                                  rows, missing, problem, err);
    if (status == EM_OK)
        status = step_seen(bases, shard_count, &seen, lane, &s, create ? unique : NULL, rows, n,
                           gradients, gate, accessed, updated, err);
    return em__cuda_finish_async(&s, lane, status, err);
}

/* The first half of a push spread over several devices (device.h:
 * shards_find_check_async): shards_push_async's find and check, into the device's pair of
 * answers, ordered as the write that the step on the same lane makes of it (the caller
 * holds the shards' write locks in between, so that no other lane comes between them). */
em_status em__cuda_shards_find_check_async(em_shard *const *bases, uint32_t shard_count,
                                           em_lane *lane_base, const uint64_t *unique,
                                           const uint32_t *count, uint64_t n,
                                           const float *gradients, uint64_t *rows,
                                           uint64_t *answers, em_error *err)
{
    cuda_lane *lane = lane_of(lane_base);
    shards_seen seen;
    em_status status = see_shards(bases, shard_count, lane, &seen, err);
    if (status == EM_OK)
        status = find_check_words(bases, shard_count, &seen, lane, unique, count, n, gradients,
                                  rows, &answers[0], &answers[1], err);
    return status;
}

/* The second half (device.h: shards_step_async): creating (keys given), the insert of
 * the keys found absent, gated on every device's checks; the step, whose launch writes
 * the new rows' initial values first, and the touch, gated on every device's answers
 * (creating, on their checks only), on the lane of the first half, which ordered it. */
em_status em__cuda_shards_step_async(em_shard *const *bases, uint32_t shard_count,
                                     em_lane *lane_base, const uint64_t *keys, uint64_t *rows,
                                     const uint32_t *count, uint64_t n, const float *gradients,
                                     const uint64_t *answers, uint32_t parts, uint64_t accessed,
                                     uint32_t updated, em_error *err)
{
    cuda_lane *lane = lane_of(lane_base);
    scratch s = {.device = lane_base->device};
    shards_seen seen;
    em_gpu_gate gate = {.count = count, .missing = keys != NULL ? NULL : &answers[0],
                        .problem = &answers[1], .parts = parts};
    em_status status = see_shards(bases, shard_count, lane, &seen, err);
    if (status == EM_OK)
        status = step_seen(bases, shard_count, &seen, lane, &s, keys, rows, n, gradients, gate,
                           accessed, updated, err);
    return em__cuda_finish_async(&s, lane, status, err);
}

/* The touch of a pull spread over several devices (device.h: shards_touch_async), gated
 * on every device's missing count, on the lane of the pull, which ordered it; recorded
 * as a read again, after it. */
em_status em__cuda_shards_touch_async(em_shard *const *bases, uint32_t shard_count,
                                      em_lane *lane_base, const uint64_t *rows,
                                      const uint32_t *count, uint64_t n, const uint64_t *answers,
                                      uint32_t parts, uint64_t accessed, uint32_t updated,
                                      em_error *err)
{
    cuda_lane *lane = lane_of(lane_base);
    shards_seen seen;
    em_gpu_gate found = {.count = count, .missing = answers, .problem = NULL, .parts = parts};
    em_status status = see_shards(bases, shard_count, lane, &seen, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_touch_gated(lane->stream, seen.storage, rows, n,
                                                          found, accessed, updated, 0),
                            err);
    if (status == EM_OK) /* a later write of the shards waits for the touch too */
        status = record_shards(bases, shard_count, lane, false, err);
    return status;
}

em_status em__cuda_shard_check_apply_async(em_shard *base, em_lane *lane_base,
                                           const uint64_t *keys, const uint64_t *rows, uint64_t n,
                                           const float *gradients, float gradient_bound,
                                           uint64_t *first_problem, int *bounded, float *largest,
                                           em_error *err)
{
    (void)gradient_bound; /* the check kernel reads every gradient anyway */
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    *bounded = 0; /* not computed here: a moved shard is always checked again */
    *largest = -1.0f;
    em_status status = lane_check(lane, em_gpu_memset_async(lane->stream, first_problem, 0xff,
                                                            sizeof(uint64_t)), err);
    if (status != EM_OK || n == 0)
        return status;
    status = order_read(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_check(lane->stream, storage_view(shard),
                                                    shard->optimizer, shard->initializer, keys,
                                                    rows, n, gradients, first_problem), err);
    if (status == EM_OK)
        status = record_read(shard, lane, err);
    return status;
}

/* The parts go to the GPU with one copy, and one launch checks every shard's rows. */
em_status em__cuda_shards_check_async(em_shard *const *shards, uint32_t count,
                                     em_lane *lane_base, const uint64_t *keys,
                                     const uint64_t *offsets, const uint64_t *rows,
                                     const float *gradients, uint64_t *first_problems,
                                     em_error *err)
{
    cuda_lane *lane = lane_of(lane_base);
    em_gpu_check_part *parts = malloc((count > 0 ? count : 1) * sizeof(*parts));
    if (parts == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "push: out of host memory");
    uint32_t used = 0;
    uint64_t most = 0;
    for (uint32_t i = 0; i < count; i++) {
        cuda_shard *shard = shard_of(shards[i]);
        uint64_t n = offsets[i + 1] - offsets[i];
        if (n == 0)
            continue;
        parts[used++] = (em_gpu_check_part){
            .storage = storage_view(shard),
            .optimizer = shard->optimizer,
            .initializer = shard->initializer,
            .keys = keys + offsets[i],
            .rows = rows + offsets[i],
            .n = n,
            .gradients = gradients + offsets[i] * shard->dim,
            .first = &first_problems[i],
        };
        most = n > most ? n : most;
    }
    scratch s = {.device = lane_base->device};
    em_gpu_check_part *device_parts = NULL;
    em_status status = lane_check(lane, em_gpu_memset_async(lane->stream, first_problems, 0xff,
                                                            count * sizeof(uint64_t)),
                                  err);
    if (status == EM_OK)
        status = order_parts(shards, count, offsets, lane, false, err);
    if (status == EM_OK && used > 0)
        status = send_parts(lane, &s, parts, used * sizeof(*parts), (void **)&device_parts, err);
    if (status == EM_OK && used > 0)
        status = lane_check(lane, em_gpu_rows_check_parts(lane->stream, device_parts, used, most),
                            err);
    if (status == EM_OK)
        status = order_parts(shards, count, offsets, lane, true, err);
    free(parts);
    return em__cuda_finish_async(&s, lane, status, err);
}

em_status em__cuda_shard_check_apply(em_shard *base, em_lane *lane_base, const uint64_t *keys,
                                     const uint64_t *rows, uint64_t n, const float *gradients,
                                     float gradient_bound, uint64_t *first_problem, int *bounded,
                                     float *largest, em_error *err)
{
    cuda_lane *lane = lane_of(lane_base);
    *first_problem = UINT64_MAX;
    *bounded = 0;
    *largest = -1.0f;
    if (n == 0)
        return EM_OK;
    em_status status = em__cuda_shard_check_apply_async(base, lane_base, keys, rows, n, gradients,
                                                        gradient_bound, lane->counter, bounded,
                                                        largest, err);
    if (status == EM_OK)
        status = em__cuda_copy_to_host(lane_base, first_problem, lane->counter, sizeof(uint64_t),
                                       err);
    return status;
}

em_status em__cuda_shard_apply(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                  uint64_t n, const float *gradients, float largest,
                                  em_error *err)
{
    (void)largest;
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

/* The steps (apply, with gradients) or the gathers (into targets and vectors as
 * shards_gather says) of several shards in one launch, and their touches in one more:
 * the parts sent with one copy. */
static em_status step_parts(em_shard *const *shards, uint32_t count, cuda_lane *lane,
                            const uint64_t *offsets, const uint64_t *rows, bool apply,
                            const float *gradients, const uint32_t *targets, float *vectors,
                            uint64_t accessed, uint32_t updated, em_error *err)
{
    uint32_t used = 0;
    uint64_t most = 0, total = 0;
    /* the parts' rows are only read by these launches */
    em_gpu_shard_part *parts = shard_parts(shards, count, NULL, offsets, NULL, (uint64_t *)rows,
                                           gradients, &used, &most, &total);
    if (parts == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "%s: out of host memory",
                            apply ? "push" : "pull");
    const cuda_shard *first = shard_of(shards[0]);
    int quads = first->dim % 4 == 0;
    for (uint32_t i = 0, k = 0; !apply && i < count; i++) {
        if (!has_part(offsets, NULL, i))
            continue;
        em_gpu_shard_part *part = &parts[k++];
        part->targets = targets != NULL ? targets + offsets[i] : NULL;
        part->vectors = targets != NULL ? vectors : vectors + offsets[i] * first->dim;
        quads = quads && ((uintptr_t)part->vectors & 15u) == 0;
    }
    scratch s = {.device = lane->base.device};
    em_gpu_shard_part *device_parts = NULL;
    em_status status = EM_OK;
    if (used > 0) /* a step writes; a gather reads, and its touch is ordered as a read */
        status = apply ? order_part_writes(shards, count, offsets, NULL, lane, false, err)
                       : order_parts(shards, count, offsets, lane, false, err);
    if (status == EM_OK && used > 0)
        status = send_parts(lane, &s, parts, used * sizeof(*parts), (void **)&device_parts, err);
    if (status == EM_OK && used > 0)
        status = lane_check(lane,
                            apply ? em_gpu_parts_apply(lane->stream, device_parts, used, most,
                                                       first->dim, first->optimizer)
                                  : em_gpu_parts_gather(lane->stream, device_parts, used, most,
                                                        first->dim, quads),
                            err);
    if (status == EM_OK && used > 0 && first->track_access && accessed != 0)
        status = lane_check(lane, em_gpu_parts_touch(lane->stream, device_parts, used, most,
                                                     accessed, updated, apply ? 1 : 0),
                            err);
    if (status == EM_OK && used > 0)
        status = apply ? order_part_writes(shards, count, offsets, NULL, lane, true, err)
                       : order_parts(shards, count, offsets, lane, true, err);
    free(parts);
    return em__cuda_finish_async(&s, lane, status, err);
}

em_status em__cuda_shards_apply(em_shard *const *shards, uint32_t count, em_lane *lane_base,
                                const uint64_t *offsets, const uint64_t *rows,
                                const float *gradients, uint64_t accessed, uint32_t updated,
                                em_error *err)
{
    return step_parts(shards, count, lane_of(lane_base), offsets, rows, true, gradients, NULL,
                      NULL, accessed, updated, err);
}

em_status em__cuda_shards_gather(em_shard *const *shards, uint32_t count, em_lane *lane_base,
                                 const uint64_t *offsets, const uint64_t *rows,
                                 const uint32_t *targets, float *vectors, uint64_t accessed,
                                 uint32_t updated, em_error *err)
{
    return step_parts(shards, count, lane_of(lane_base), offsets, rows, false, NULL, targets,
                      vectors, accessed, updated, err);
}

em_status em__cuda_shard_write_rows(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                    uint64_t n, const uint32_t *sources, const float *values,
                                    em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    em_status status = order_write(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_write(lane->stream, storage_view(shard), rows, n,
                                                    sources, values), err);
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
                                     uint64_t limit, bool with_values, export_buffers *b,
                                     em_error *err)
{
    em_status status = scratch_take(s, limit * sizeof(uint64_t), "export keys",
                                    (void **)&b->keys, err);
    if (status == EM_OK)
        status = scratch_take(s, limit * sizeof(uint64_t), "export rows", (void **)&b->rows, err);
    if (status == EM_OK)
        status = scratch_take(s, sizeof(uint64_t), "export cursor", (void **)&b->next_slot, err);
    if (status == EM_OK && with_values)
        status = scratch_take(s, limit * shard->row_floats * sizeof(float), "export values",
                              (void **)&b->values, err);
    if (status == EM_OK)
        status = scratch_take(s, (b->window + 1) * sizeof(uint32_t), "export flags",
                              (void **)&b->flags, err);
    if (status == EM_OK)
        status = scratch_take(s, (b->window + 1) * sizeof(uint32_t), "export ranks",
                              (void **)&b->rank, err);
    if (status == EM_OK)
        status = em__cuda_take_scan_temp(s, lane, b->window + 1, &b->temp, &b->temp_bytes, err);
    return status;
}

/* The keys of the side rows at export positions 0 and 1. */
static const uint64_t side_keys_by_position[2] = {EM_GPU_EMPTY_KEY, EM_GPU_TOMBSTONE_KEY};

/* Side entries at positions *cursor < 2 (and < end), into the first device entries. */
static em_status export_side_rows(cuda_shard *shard, cuda_lane *lane, uint64_t *cursor,
                                  uint64_t end, uint64_t limit, const export_buffers *b,
                                  uint64_t *taken, em_error *err)
{
    uint64_t keys[2], rows[2], count = 0;
    for (; *cursor < 2 && *cursor < end && count < limit; (*cursor)++) {
        if (shard->side_rows[*cursor] == EM_ROW_NONE)
            continue;
        keys[count] = side_keys_by_position[*cursor];
        rows[count++] = shard->side_rows[*cursor];
    }
    *taken = count;
    if (count == 0)
        return EM_OK;
    em_status status = em__cuda_copy_to_device(&lane->base, b->keys, keys, count * sizeof(uint64_t),
                                               err);
    if (status == EM_OK)
        status = em__cuda_copy_to_device(&lane->base, b->rows, rows, count * sizeof(uint64_t), err);
    return status;
}

/* One window of slots from *cursor (up to position end): appends up to limit - *taken
 * entries. */
static em_status export_window(cuda_shard *shard, cuda_lane *lane, uint64_t *cursor,
                               uint64_t end, uint64_t limit, const export_buffers *b,
                               uint64_t *taken, em_error *err)
{
    em_gpu_map map = map_view(shard);
    uint64_t begin = *cursor - 2;
    uint64_t count = end - *cursor < b->window ? end - *cursor : b->window;
    uint32_t occupied = 0;
    em_status status =
        lane_check(lane, em_gpu_map_export_flags(lane->stream, map, begin, count, b->flags), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_exclusive_scan_u32(lane->stream, b->temp, b->temp_bytes,
                                                            b->flags, b->rank, count + 1), err);
    if (status == EM_OK)
        status = em__cuda_copy_to_host(&lane->base, &occupied, b->rank + count, sizeof(occupied),
                                       err);
    if (status != EM_OK)
        return status;
    uint64_t take = occupied < limit - *taken ? occupied : limit - *taken;
    status = lane_check(lane, em_gpu_map_export_compact(lane->stream, map, begin, count, b->flags,
                                                        b->rank, take, *taken, b->keys, b->rows,
                                                        b->next_slot), err);
    uint64_t next_slot = begin + count;
    if (status == EM_OK && take < occupied)
        status = em__cuda_copy_to_host(&lane->base, &next_slot, b->next_slot, sizeof(next_slot),
                                       err);
    *cursor = 2 + next_slot;
    *taken += take;
    return status;
}

em_status em__cuda_shard_read_rows(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                   uint64_t n, float *values, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    em_status status = order_read(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_read(lane->stream, storage_view(shard), rows, n,
                                                   values), err);
    if (status == EM_OK)
        status = record_read(shard, lane, err);
    return status;
}

/* Copies the collected keys (and rows, and the rows' values, where asked) to the host. */
static em_status export_rows(cuda_shard *shard, cuda_lane *lane, uint64_t taken,
                             const export_buffers *b, uint64_t *keys, float *values,
                             uint64_t *rows, em_error *err)
{
    em_status status = EM_OK;
    if (values != NULL)
        status = em__cuda_shard_read_rows(&shard->base, &lane->base, b->rows, taken, b->values,
                                          err);
    if (status == EM_OK)
        status = em__cuda_copy_to_host(&lane->base, keys, b->keys, taken * sizeof(uint64_t), err);
    if (status == EM_OK && rows != NULL)
        status = em__cuda_copy_to_host(&lane->base, rows, b->rows, taken * sizeof(uint64_t), err);
    if (status == EM_OK && values != NULL)
        status = em__cuda_copy_to_host(&lane->base, values, b->values,
                                       taken * shard->row_floats * sizeof(float), err);
    return status;
}

/* The export of positions [*cursor, end) (end at most 2 + slot_count). */
static em_status export_range(cuda_shard *shard, cuda_lane *lane, uint64_t *cursor, uint64_t end,
                              uint64_t *keys, float *values, uint64_t *rows, uint64_t max,
                              uint64_t *count, em_error *err)
{
    em_shard *base = &shard->base;
    *count = 0;
    uint64_t entry_bytes =
        (values != NULL ? shard->row_floats * sizeof(float) : 0) + 2 * sizeof(uint64_t);
    uint64_t limit = EXPORT_MAX_BYTES / entry_bytes;
    limit = limit < 1 ? 1 : limit;
    limit = max < limit ? max : limit;
    if (limit == 0 || *cursor >= end)
        return EM_OK;
    scratch s = {.device = base->device};
    export_buffers b = {.window = shard->slot_count < EXPORT_WINDOW_SLOTS ? shard->slot_count
                                                                           : EXPORT_WINDOW_SLOTS};
    uint64_t taken = 0;
    em_status status = take_export_buffers(&s, shard, lane, limit, values != NULL, &b, err);
    while (status == EM_RESOURCE_EXHAUSTED && (limit > 1 || b.window > MIN_EXPORT_WINDOW)) {
        scratch_free_now(&s); /* nothing was enqueued yet */
        limit = (limit + 1) / 2;
        b.window = b.window / 2 > MIN_EXPORT_WINDOW ? b.window / 2 : MIN_EXPORT_WINDOW;
        status = take_export_buffers(&s, shard, lane, limit, values != NULL, &b, err);
    }
    if (status == EM_OK)
        status = export_side_rows(shard, lane, cursor, end, limit, &b, &taken, err);
    while (status == EM_OK && taken < limit && *cursor < end)
        status = export_window(shard, lane, cursor, end, limit, &b, &taken, err);
    if (status == EM_OK && taken > 0)
        status = export_rows(shard, lane, taken, &b, keys, values, rows, err);
    if (status != EM_OK)
        return em__cuda_finish_async(&s, lane, status, err);
    scratch_free_now(&s);
    *count = taken;
    return EM_OK;
}

em_status em__cuda_shard_export(em_shard *base, em_lane *lane_base, uint64_t *cursor,
                                   uint64_t *keys, float *values, uint64_t *rows, uint64_t max,
                                   uint64_t *count, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    return export_range(shard, lane_of(lane_base), cursor, 2 + shard->slot_count, keys, values,
                        rows, max, count, err);
}

void em__cuda_shard_stats(em_shard *base, em_shard_stats *out)
{
    cuda_shard *shard = shard_of(base);
    *out = (em_shard_stats){0};
    out->rows = shard->size;
    out->row_bytes = shard->block_count * shard->block_bytes;
    out->index_bytes = shard->slot_count * sizeof(em_gpu_slot);
    out->index_rehashes_through_host = shard->rehashes_through_host;
    out->rows_evicted_chosen_on_gpu = shard->rows_chosen_on_gpu;
    out->row_limit = storage_rows(shard);
    out->access_bytes = shard->track_access ? shard->block_count * access_block_bytes(shard) : 0;
}


/* ---- shards: capacity policies ------------------------------------------------------- */

_Static_assert(sizeof(em_gpu_row_access) == sizeof(em_row_access) &&
                   offsetof(em_gpu_row_access, updated) == offsetof(em_row_access, updated) &&
                   offsetof(em_gpu_row_access, frequency) == offsetof(em_row_access, frequency),
               "the GPU keeps access metadata as em_row_access");

em_status em__cuda_shard_fill_initial(em_shard *base, em_lane *lane_base, const uint64_t *keys,
                                      const uint64_t *rows, uint64_t n, const uint32_t *targets,
                                      float *vectors, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    return lane_check(lane_of(lane_base),
                      em_gpu_rows_fill_initial(lane_of(lane_base)->stream, storage_view(shard),
                                               shard->initializer, keys, rows, n, targets,
                                               vectors),
                      err);
}

/* Touches write access metadata only, which no gather reads: they are ordered as reads,
 * so that an eviction (a write) waits for them. */
em_status em__cuda_shard_touch(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                               uint64_t n, uint64_t accessed, uint32_t updated, bool pushed,
                               em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    if (!shard->track_access || n == 0)
        return EM_OK;
    em_status status = order_read(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_rows_touch(lane->stream, storage_view(shard), rows, n,
                                                    accessed, updated, pushed ? 1 : 0), err);
    if (status == EM_OK)
        status = record_read(shard, lane, err);
    return status;
}

/* out[i] = the access metadata of rows[i], all in host memory. */
static em_status read_access_host(cuda_shard *shard, cuda_lane *lane, const uint64_t *rows,
                                  uint64_t n, em_row_access *out, em_error *err)
{
    if (n == 0)
        return EM_OK;
    scratch s = {.device = shard->base.device};
    uint64_t *device_rows = NULL;
    em_gpu_row_access *device_out = NULL;
    em_status status = scratch_take(&s, n * sizeof(uint64_t), "access rows",
                                    (void **)&device_rows, err);
    if (status == EM_OK)
        status = scratch_take(&s, n * sizeof(em_gpu_row_access), "access metadata",
                              (void **)&device_out, err);
    if (status == EM_OK)
        status = em__cuda_copy_to_device(&lane->base, device_rows, rows, n * sizeof(uint64_t), err);
    if (status == EM_OK)
        status = order_read(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_access_read(lane->stream, storage_view(shard),
                                                     device_rows, n, device_out), err);
    if (status == EM_OK)
        status = record_read(shard, lane, err);
    if (status == EM_OK) /* synchronizes */
        status = em__cuda_copy_to_host(&lane->base, out, device_out,
                                       n * sizeof(em_gpu_row_access), err);
    if (status != EM_OK)
        return em__cuda_finish_async(&s, lane, status, err);
    scratch_free_now(&s);
    return EM_OK;
}

em_status em__cuda_shard_read_access(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                     uint64_t n, em_row_access *out, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    if (!shard->track_access)
        return em_error_set(err, EM_FAILED_PRECONDITION, "shard keeps no access metadata");
    return read_access_host(shard, lane_of(lane_base), rows, n, out, err);
}

em_status em__cuda_shard_write_access(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                      uint64_t n, const em_row_access *in, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    if (!shard->track_access)
        return em_error_set(err, EM_FAILED_PRECONDITION, "shard keeps no access metadata");
    if (n == 0)
        return EM_OK;
    scratch s = {.device = base->device};
    uint64_t *device_rows = NULL;
    em_gpu_row_access *device_in = NULL;
    em_status status = scratch_take(&s, n * sizeof(uint64_t), "access rows",
                                    (void **)&device_rows, err);
    if (status == EM_OK)
        status = scratch_take(&s, n * sizeof(em_gpu_row_access), "access metadata",
                              (void **)&device_in, err);
    if (status == EM_OK)
        status = em__cuda_copy_to_device(lane_base, device_rows, rows, n * sizeof(uint64_t), err);
    if (status == EM_OK)
        status = em__cuda_copy_to_device(lane_base, device_in, in, n * sizeof(em_row_access), err);
    if (status == EM_OK)
        status = order_write(shard, lane, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_access_write(lane->stream, storage_view(shard),
                                                      device_rows, n, device_in), err);
    if (status == EM_OK)
        status = record_write(shard, lane, err);
    if (status == EM_OK)
        status = em__cuda_lane_sync(lane, err);
    if (status != EM_OK)
        return em__cuda_finish_async(&s, lane, status, err);
    scratch_free_now(&s);
    return EM_OK;
}

/* The host copies of the map's header after the erase of keys[0..n), present and
 * distinct: each key's slot a tombstone (or its side row gone), its row on the free
 * list, as em_gpu_map_erase_key does. */
static void take_erase(cuda_shard *shard, const uint64_t *keys, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) {
        if (keys[i] == EM_GPU_EMPTY_KEY)
            shard->side_rows[0] = EM_ROW_NONE;
        else if (keys[i] == EM_GPU_TOMBSTONE_KEY)
            shard->side_rows[1] = EM_ROW_NONE;
        else
            shard->tombstones++;
    }
    shard->size -= n;
    shard->free_count += n;
}

/* Erases keys[0..n) (host memory; present and distinct). With read_back the host waits
 * for the GPU's header; without, the erase is only enqueued and the host copies take
 * its known effect (take_erase), which the next header read back confirms: an eviction
 * does this, its table held alone, so that it does not wait before its inserts. */
static em_status erase_host_keys(cuda_shard *shard, cuda_lane *lane, const uint64_t *keys,
                                 uint64_t n, bool read_back, em_error *err)
{
    if (n == 0)
        return EM_OK;
    scratch s = {.device = shard->base.device};
    uint64_t *device_keys = NULL;
    em_status status = scratch_take(&s, n * sizeof(uint64_t), "erased keys",
                                    (void **)&device_keys, err);
    if (status == EM_OK)
        status = em__cuda_copy_to_device(&lane->base, device_keys, keys, n * sizeof(uint64_t),
                                         err);
    if (status == EM_OK)
        status = enqueue_erase(shard, lane, device_keys, NULL, n, err);
    if (status == EM_OK && read_back) /* synchronizes */
        status = read_back_header(shard, lane, err);
    else if (status == EM_OK)
        take_erase(shard, keys, n);
    return em__cuda_finish_async(&s, lane, status, err);
}

/* Entries an eviction's walk reads from the GPU ahead of the chooser, at most. */
#define EVICT_READ_AHEAD ((uint64_t)1 << 20)
/* The same where the GPU is to choose (the window long enough for gpu_choice_entries):
 * only the choice comes back, so the read ahead may cover a request that evicts 262,144
 * rows of a shard at 16 candidates (128 MiB of the pool a shard while it runs). */
#define EVICT_READ_AHEAD_ON_GPU ((uint64_t)1 << 22)

/* A walk for em_evict_choose over the map's export positions from a start: [start, end)
 * then [0, start). Its first `ahead` entries (the chooser's window: count x candidates)
 * are read from the GPU at once, keys, rows and access metadata, so that an eviction
 * waits for the GPU a few times however many rows it removes (a block at a time, it
 * waited about 4 times per 4,096 entries); they are handed to the chooser in the pieces
 * the block-by-block walk gave (a block, or less where the range ends), which the
 * chooser's cuts follow. Entries beyond them are read a block at a time. */
typedef struct cuda_evict_walk {
    cuda_shard *shard;
    cuda_lane *lane;
    uint64_t start, cursor, end;
    bool wrapped;
    uint64_t ahead;                 /* entries to read ahead (at the first call) */
    uint64_t *keys, *rows;          /* read ahead: held, of which served are handed out */
    em_row_access *access;
    uint64_t held, served;
    uint64_t before_wrap;           /* of them, read before the walk wrapped to 0 */
    const uint64_t *kept_device;    /* the spec's kept_device, read back with the walk */
    uint64_t kept_device_count;
    uint64_t *kept, kept_count;     /* of them, the stored rows (host memory) */
    /* the read ahead's plan (plan_window): the side rows, the span of slots [first,
     * first + before) then [0, after), and the walk's part of the shared region */
    uint64_t side, side_keys[2], side_rows[2];
    uint64_t first, span, before, after, offset, bytes;
    /* what it chooses for; whether the GPU chooses (plan_choices), and where its choice
     * lies among the lane's (choice_index, answer_offset: its chosen keys then rows) */
    em_evict_spec spec;
    bool on_gpu;
    uint32_t choice_index;
    uint64_t answer_offset;
    const uint8_t *device_part; /* its part of the read ahead's region, on the GPU */
    uint8_t *answers_device;    /* the GPU's answers region (on_gpu), which holds its
                                 * chosen keys at answer_offset */
    bool gpu_chose;             /* finished: the keys to erase are where the GPU wrote
                                 * them; else in host memory */
} cuda_evict_walk;

/* The walk's next entries from the GPU, up to max, without their metadata; they end where
 * the range [start, end) ends. *got 0: every entry was seen. */
static em_status walk_export(cuda_evict_walk *w, uint64_t max, uint64_t *keys, uint64_t *rows,
                             uint64_t *got, em_error *err)
{
    *got = 0;
    for (;;) {
        while (w->cursor >= w->end) {
            if (w->wrapped)
                return EM_OK; /* every entry seen */
            w->wrapped = true;
            w->cursor = 0;
            w->end = w->start;
        }
        em_status status = export_range(w->shard, w->lane, &w->cursor, w->end, keys, NULL, rows,
                                        max, got, err);
        if (status != EM_OK || *got > 0)
            return status;
    }
}

/* The side rows (keys EMPTY and TOMBSTONE) the shard holds, as entries. */
static uint64_t side_entries(const cuda_shard *shard, uint64_t *keys, uint64_t *rows)
{
    uint64_t n = 0;
    for (uint64_t p = 0; p < 2; p++)
        if (shard->side_rows[p] != EM_ROW_NONE) {
            keys[n] = side_keys_by_position[p];
            rows[n++] = shard->side_rows[p];
        }
    return n;
}

/* The read ahead's device region (and its host copy): the walk's counts, then want
 * entries (keys, rows, access metadata), the side rows' metadata and the request's rows
 * of the shard (kept, kept_count of them). */
typedef struct window_region {
    em_gpu_walk *walk;
    uint64_t *keys, *rows;
    em_gpu_row_access *access, *side_access;
    uint64_t *kept;
} window_region;

static size_t region_bytes(uint64_t want, uint64_t kept_count)
{
    return sizeof(em_gpu_walk) + want * (2 * sizeof(uint64_t) + sizeof(em_gpu_row_access)) +
           2 * sizeof(em_gpu_row_access) + kept_count * sizeof(uint64_t);
}

static window_region region_layout(uint8_t *base, uint64_t want)
{
    window_region r = {.walk = (em_gpu_walk *)base,
                       .keys = (uint64_t *)(base + sizeof(em_gpu_walk))};
    r.rows = r.keys + want;
    r.access = (em_gpu_row_access *)(r.rows + want);
    r.side_access = r.access + want;
    r.kept = (uint64_t *)(r.side_access + 2);
    return r;
}

/* The stored rows among the request's rows read back (rows[0..n)), as the walk's kept
 * rows. */
static em_status take_kept(cuda_evict_walk *w, const uint64_t *rows, uint64_t n, em_error *err)
{
    w->kept = malloc((n + 1) * sizeof(uint64_t));
    if (w->kept == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    w->kept_count = em_evict_kept_rows(rows, n, w->kept);
    return EM_OK;
}

/* Slots the read ahead walks at first: enough to hold `want` entries at the map's load
 * and more (the map's keys are spread by their hash), or all. Each eviction empties
 * 1 / candidates of the entries of its window, so a window that falls where others
 * were holds fewer: a quarter more covers that from 8 candidates a row on, twice the
 * slots from 2 on, four times below (1 candidate: the last window there left none). A
 * span that holds fewer than want sends the rest of the walk to the host, with waits. */
static uint64_t window_span(const cuda_shard *shard, uint64_t want, uint64_t side,
                            uint32_t candidates)
{
    uint64_t in_slots = shard->size > side ? shard->size - side : 0;
    if (in_slots <= want)
        return shard->slot_count;
    uint64_t span = want * shard->slot_count / in_slots;
    span += (candidates >= 8 ? span / 4 : candidates >= 2 ? span : 3 * span) + MIN_EXPORT_WINDOW;
    return span < shard->slot_count ? span : shard->slot_count;
}

/* Appends n entries (the device's metadata layout is em_row_access's) to the held ones. */
static void hold_entries(cuda_evict_walk *w, const uint64_t *keys, const uint64_t *rows,
                         const em_gpu_row_access *access, uint64_t n)
{
    memcpy(w->keys + w->held, keys, n * sizeof(uint64_t));
    memcpy(w->rows + w->held, rows, n * sizeof(uint64_t));
    memcpy(w->access + w->held, access, n * sizeof(em_row_access));
    w->held += n;
}

/* The side rows at export positions [from, to) (the plan's side_entries), held. */
static void hold_side(cuda_evict_walk *w, const window_region *r, uint64_t from, uint64_t to)
{
    for (uint64_t p = 0, i = 0; p < 2; p++) {
        if (w->shard->side_rows[p] == EM_ROW_NONE)
            continue;
        if (p >= from && p < to)
            hold_entries(w, &w->side_keys[i], &w->side_rows[i], &r->side_access[i], 1);
        i++;
    }
}

/* Holds a read window's entries (r, in host memory) in the walk's order and sets the
 * walk to go on after them. The span was slots [first, first + before), then [0, after)
 * (plan_window); the compaction cut it at its want-th entry when it held more. */
static em_status hold_window(cuda_evict_walk *w, const window_region *r, em_error *err)
{
    uint64_t want = w->ahead, slot_count = w->shard->slot_count, start = w->start;
    uint64_t side = w->side, first = w->first, before = w->before, after = w->after;
    const em_gpu_walk *walk = r->walk;
    bool cut = walk->taken >= want;
    uint64_t taken = cut ? want : walk->taken;
    /* of the entries taken, those before the span went on from slot 0 */
    uint64_t wrap_at = after > 0 && walk->before_wrap < taken ? walk->before_wrap : taken;
    w->keys = malloc((taken + side + 1) * sizeof(uint64_t));
    w->rows = malloc((taken + side + 1) * sizeof(uint64_t));
    w->access = malloc((taken + side + 1) * sizeof(em_row_access));
    if (w->keys == NULL || w->rows == NULL || w->access == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    w->before_wrap = UINT64_MAX;
    if (start >= 2) {
        /* the walk passed the map's end: it went on with the side rows, then slot 0 */
        bool passed = cut ? after > 0 && want > walk->before_wrap
                          : first + before == slot_count;
        hold_entries(w, r->keys, r->rows, r->access, wrap_at);
        if (passed) {
            w->before_wrap = w->held;
            hold_side(w, r, 0, 2);
        }
        hold_entries(w, r->keys + wrap_at, r->rows + wrap_at, r->access + wrap_at,
                     taken - wrap_at);
        w->wrapped = passed;
        w->end = passed ? start : 2 + slot_count;
        w->cursor = cut ? 2 + walk->next_slot : passed ? 2 + after : 2 + first + before;
    } else { /* from a side row: every slot, then the side rows before the start */
        hold_side(w, r, start, 2);
        hold_entries(w, r->keys, r->rows, r->access, taken);
        bool whole = !cut && before == slot_count;
        if (whole) {
            w->before_wrap = w->held;
            hold_side(w, r, 0, start);
        }
        w->wrapped = whole;
        w->end = whole ? start : 2 + slot_count;
        w->cursor = cut ? 2 + walk->next_slot : whole ? start : 2 + before;
    }
    if (w->before_wrap == UINT64_MAX)
        w->before_wrap = w->held;
    return EM_OK;
}

/* The read ahead in one wait (export_range waits about three times an export, and an
 * export stops where the walk wraps): the entries of a span of slots that should hold
 * `ahead` of them (window_span) are compacted on the GPU with their access metadata
 * (enqueue_walk), the side rows' metadata and the request's rows of the shard read
 * beside them, and all of it copied back at once. The held entries are the walk's
 * order: from the start position to the end of the map, then positions 0 and 1 (the
 * side rows), then the slots before the start. When the span held fewer, the walk goes
 * on after it export by export. Several shards' walks on one lane share the buffers and
 * the copy (em__cuda_shards_evict_begin): plan_window sizes a walk's part of them,
 * enqueue_window fills it, take_window takes it in. */
static void plan_window(cuda_evict_walk *w, uint64_t offset)
{
    cuda_shard *shard = w->shard;
    uint64_t slot_count = shard->slot_count;
    w->side = side_entries(shard, w->side_keys, w->side_rows);
    /* the walk from position start: slots [first, first + before), then [0, after) */
    w->first = w->start >= 2 ? w->start - 2 : 0;
    w->span = window_span(shard, w->ahead, w->side, w->spec.candidates);
    w->before = w->span < slot_count - w->first ? w->span : slot_count - w->first;
    w->after = w->span - w->before;
    w->offset = offset;
    w->bytes = region_bytes(w->ahead, w->kept_device_count);
}

/* The pieces of a lane's walks (em_gpu_walk_piece), in chunks of at most a window of
 * slots whose flags are scanned together; chunk c is pieces [chunks[c], chunks[c + 1]). */
typedef struct walk_plan {
    em_gpu_walk_piece *pieces; /* host memory */
    uint32_t piece_count, chunk_count;
    uint32_t *chunks;          /* chunk_count + 1 */
    em_gpu_walk_piece *device; /* the pieces on the GPU */
} walk_plan;

/* Buffers the enqueued walks share: flags and ranks of a window of slots, the scan's
 * temporary storage, the side rows, the region all walks' parts come back in, and the
 * walks' pieces. */
typedef struct window_buffers {
    export_buffers b;
    uint64_t *side_rows; /* two per walk */
    uint8_t *region;
    size_t bytes;
    walk_plan plan;
} window_buffers;

/* Appends a piece of slots [begin, begin + n) of walk w (device: its part of the region)
 * to the plan, at flag `at` of the current chunk; the walk's earlier piece in the chunk,
 * if any, is the one before. */
static void plan_piece(walk_plan *p, const cuda_evict_walk *w, const window_region *device,
                       uint64_t begin, uint64_t n, uint64_t at, bool starts, bool wrap)
{
    em_gpu_walk_piece *piece = &p->pieces[p->piece_count];
    const em_gpu_walk_piece *previous = p->piece_count > p->chunks[p->chunk_count - 1]
                                            ? piece - 1
                                            : NULL;
    bool same_walk = previous != NULL && previous->walk == device->walk;
    *piece = (em_gpu_walk_piece){
        .map = map_view(w->shard),
        .storage = storage_view(w->shard),
        .begin = begin,
        .count = n,
        .first_flag = at,
        .base_flag = same_walk ? previous->base_flag : at,
        .want = w->ahead,
        .walk = device->walk,
        .keys = device->keys,
        .rows = device->rows,
        .access = device->access,
        .kept_from = starts ? w->kept_device : NULL,
        .kept_to = starts ? device->kept : NULL,
        .kept_count = starts ? w->kept_device_count : 0,
        .starts = starts,
        .wrap = wrap,
    };
    p->piece_count++;
}

/* Plans the pieces of walks[0..count) (planned, their parts at region), each walk's span
 * ([first, first + before), then [0, after)) cut where a chunk of `window` slots ends.
 * Every walk has a piece, if only an empty one that starts it. */
static em_status plan_walks(cuda_evict_walk *walks, uint32_t count, uint8_t *region,
                            uint64_t window, walk_plan *p, em_error *err)
{
    uint64_t slots = 0;
    for (uint32_t i = 0; i < count; i++)
        slots += walks[i].span;
    uint64_t most = 2 * (uint64_t)count + slots / window + 2;
    *p = (walk_plan){.pieces = malloc(most * sizeof(*p->pieces)),
                     .chunks = malloc((most + 1) * sizeof(uint32_t))};
    if (p->pieces == NULL || p->chunks == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    p->chunks[0] = 0;
    p->chunk_count = 1;
    uint64_t used = 0; /* slots of the current chunk */
    for (uint32_t i = 0; i < count; i++) {
        const cuda_evict_walk *w = &walks[i];
        window_region device = region_layout(region + w->offset, w->ahead);
        const uint64_t begins[2] = {w->first, 0}, lengths[2] = {w->before, w->after};
        bool starts = true;
        for (int r = 0; r < 2; r++) {
            for (uint64_t done = 0; done < lengths[r];) {
                if (used == window) { /* the chunk is full */
                    p->chunks[p->chunk_count++] = p->piece_count;
                    used = 0;
                }
                uint64_t n = lengths[r] - done < window - used ? lengths[r] - done
                                                               : window - used;
                plan_piece(p, w, &device, begins[r] + done, n, used, starts,
                           r == 0 && done + n == lengths[r] && w->after > 0);
                starts = false;
                done += n;
                used += n;
            }
        }
        if (starts) /* no slots: a piece that only starts the walk */
            plan_piece(p, w, &device, 0, 0, used, true, false);
    }
    p->chunks[p->chunk_count] = p->piece_count;
    return EM_OK;
}

static void walk_plan_free(walk_plan *p)
{
    free(p->pieces);
    free(p->chunks);
    memset(p, 0, sizeof(*p));
}

/* Takes the buffers for walks[0..count) (planned) and plans their pieces;
 * RESOURCE_EXHAUSTED when the pool has no room for them. The flags cover the walks'
 * spans together, up to EXPORT_WINDOW_SLOTS. */
static em_status take_window_buffers(scratch *s, cuda_lane *lane, cuda_evict_walk *walks,
                                     uint32_t count, window_buffers *out, em_error *err)
{
    uint64_t window = 0;
    out->bytes = 0;
    for (uint32_t i = 0; i < count; i++) {
        window += walks[i].span;
        out->bytes = walks[i].offset + walks[i].bytes > out->bytes
                         ? walks[i].offset + walks[i].bytes
                         : out->bytes;
    }
    window = window < 1 ? 1 : window;
    out->b = (export_buffers){.window = window < EXPORT_WINDOW_SLOTS ? window
                                                                      : EXPORT_WINDOW_SLOTS};
    memset(&out->plan, 0, sizeof(out->plan));
    em_status status = scratch_take(s, out->bytes, "eviction walk", (void **)&out->region, err);
    if (status == EM_OK)
        status = plan_walks(walks, count, out->region, out->b.window, &out->plan, err);
    if (status == EM_OK)
        status = scratch_take(s, out->plan.piece_count * sizeof(em_gpu_walk_piece),
                              "eviction walk pieces", (void **)&out->plan.device, err);
    if (status == EM_OK)
        status = scratch_take(s, 2 * count * sizeof(uint64_t), "eviction side rows",
                              (void **)&out->side_rows, err);
    if (status == EM_OK)
        status = scratch_take(s, (out->b.window + 1) * sizeof(uint32_t), "eviction flags",
                              (void **)&out->b.flags, err);
    if (status == EM_OK)
        status = scratch_take(s, (out->b.window + 1) * sizeof(uint32_t), "eviction ranks",
                              (void **)&out->b.rank, err);
    if (status == EM_OK)
        status = em__cuda_take_scan_temp(s, lane, out->b.window + 1, &out->b.temp,
                                         &out->b.temp_bytes, err);
    return status;
}

/* Enqueues walk i's reads beside the walk itself, once the shard's writes are done: the
 * side rows' metadata. */
static em_status enqueue_side(cuda_evict_walk *w, uint32_t i, const window_buffers *buffers,
                              em_error *err)
{
    cuda_lane *lane = w->lane;
    window_region device = region_layout(buffers->region + w->offset, w->ahead);
    uint64_t *device_side = buffers->side_rows + 2 * i;
    em_status status = order_read(w->shard, lane, err);
    if (status == EM_OK && w->side > 0)
        status = em__cuda_copy_to_device(&lane->base, device_side, w->side_rows,
                                         w->side * sizeof(uint64_t), err);
    if (status == EM_OK && w->side > 0)
        status = lane_check(lane, em_gpu_access_read(lane->stream, storage_view(w->shard),
                                                     device_side, w->side, device.side_access),
                            err);
    return status;
}

/* Enqueues every walk of the lane (the plan's pieces), a few launches a chunk: flags,
 * their scan, the compaction, the counts. */
static em_status enqueue_walks(cuda_lane *lane, const window_buffers *buffers, em_error *err)
{
    const walk_plan *p = &buffers->plan;
    const export_buffers *b = &buffers->b;
    em_status status = em__cuda_copy_to_device(&lane->base, p->device, p->pieces,
                                               p->piece_count * sizeof(em_gpu_walk_piece), err);
    for (uint32_t c = 0; status == EM_OK && c < p->chunk_count; c++) {
        uint32_t first = p->chunks[c], n = p->chunks[c + 1] - first;
        if (n == 0)
            continue;
        uint64_t most = 1, slots = 0;
        for (uint32_t k = first; k < first + n; k++) {
            const em_gpu_walk_piece *piece = &p->pieces[k];
            most = piece->count > most ? piece->count : most;
            most = piece->kept_count > most ? piece->kept_count : most;
            slots += piece->count;
        }
        const em_gpu_walk_piece *pieces = p->device + first;
        status = lane_check(lane, em_gpu_walks_flags(lane->stream, pieces, n, most, b->flags),
                            err);
        if (status == EM_OK && slots > 0)
            status = lane_check(lane, em_gpu_exclusive_scan_u32(lane->stream, b->temp,
                                                                b->temp_bytes, b->flags, b->rank,
                                                                slots + 1), err);
        if (status == EM_OK && slots > 0)
            status = lane_check(lane, em_gpu_walks_compact(lane->stream, pieces, n, most,
                                                           b->flags, b->rank), err);
        if (status == EM_OK && slots > 0)
            status = lane_check(lane, em_gpu_walks_advance(lane->stream, pieces, n, b->rank),
                                err);
    }
    return status;
}

/* Takes in walk w's part of the region, copied back to host memory at host_part. */
static em_status take_window(cuda_evict_walk *w, const uint8_t *host_part, em_error *err)
{
    window_region part = region_layout((uint8_t *)host_part, w->ahead);
    em_status status = hold_window(w, &part, err);
    return status == EM_OK ? take_kept(w, part.kept, w->kept_device_count, err) : status;
}

/* ---- choices on the GPU ------------------------------------------------------------ */

/* Whether the GPU may choose walk w's rows (planned): its window holds no side rows and
 * is the read ahead (ahead == window) or every entry of the map (the span covers every
 * slot), and the request's rows are on the GPU. Whether the read ahead held that window
 * is known once the GPU has walked: take_choice. */
static bool gpu_may_choose(const cuda_evict_walk *w)
{
    uint64_t window = em_evict_window(&w->spec);
    return w->side == 0 && w->spec.kept_count == 0 &&
           (w->ahead == window || w->span == w->shard->slot_count);
}

/* The buffers of the choices a lane's walks leave to the GPU: the answers region (the
 * choices, then each walk's chosen keys and rows), which comes back to the host; the
 * flags over every such walk's read ahead and their scan; the bit sets of the request's
 * rows, a bit for each row of the shard's storage. */
typedef struct choice_buffers {
    uint32_t walks;
    uint8_t *answers;
    size_t answers_bytes;
    uint32_t *flags, *rank;
    void *temp;
    size_t temp_bytes;
    uint64_t *bits;
    uint64_t bit_words, flag_count, most_want, most_kept;
    uint32_t first_digit;
} choice_buffers;

/* em_gpu_choice.policy takes the policies' numbers (the kernels see no eviction.h) */
_Static_assert(EM_EVICTION_LRU == 1 && EM_EVICTION_LFU == 2 && EM_EVICTION_AGE == 3,
               "em_gpu_choice's policy numbers");

static size_t aligned_256(size_t bytes)
{
    return (bytes + 255) & ~(size_t)255;
}

/* The first byte of the order a GPU's choice for spec counts: for lru the top bytes of
 * the last access that the table's request clock has as 0 (first is 0 for lru), which
 * every entry has as 0 unless a restored row's last access is later. An entry with such
 * a byte set goes after every entry without, so it is never among the chosen; a walk
 * whose window holds fewer entries without it than rows to choose comes back SHORT and
 * the host chooses. Else 0. */
static uint32_t choice_first_digit(const em_evict_spec *spec)
{
    if (spec->policy != EM_EVICTION_LRU)
        return 0;
    uint32_t zero = 0; /* top bytes of the clock that are 0 */
    while (zero < 8 && (spec->access_clock >> (56 - 8 * zero) & 0xffu) == 0)
        zero++;
    return 4 + zero;
}

/* Marks the walks (planned) whose rows the GPU chooses and lays out their answers: those
 * it may choose for, where their windows together are long enough to pay for the
 * choice's passes (the device's gpu_choice_entries; the host's choice costs about their
 * length, the GPU's about its launches). */
static void plan_choices(cuda_evict_walk *walks, uint32_t count, choice_buffers *c)
{
    memset(c, 0, sizeof(*c));
    c->first_digit = EM_GPU_RANK_DIGITS;
    uint64_t entries = 0;
    for (uint32_t i = 0; i < count; i++)
        if (gpu_may_choose(&walks[i]))
            entries += walks[i].ahead;
    bool pays = count > 0 && entries >= state_of(walks[0].shard->base.device)->gpu_choice_entries;
    for (uint32_t i = 0; i < count; i++) {
        walks[i].on_gpu = pays && gpu_may_choose(&walks[i]);
        if (walks[i].on_gpu)
            walks[i].choice_index = c->walks++;
    }
    size_t at = aligned_256(c->walks * sizeof(em_gpu_choice));
    for (uint32_t i = 0; i < count; i++) {
        cuda_evict_walk *w = &walks[i];
        if (!w->on_gpu)
            continue;
        w->answer_offset = at;
        at += aligned_256(2 * w->spec.count * sizeof(uint64_t));
        c->flag_count += w->ahead;
        c->bit_words += (storage_rows(w->shard) + 63) / 64;
        c->most_want = w->ahead > c->most_want ? w->ahead : c->most_want;
        c->most_kept = w->kept_device_count > c->most_kept ? w->kept_device_count : c->most_kept;
        uint32_t first = choice_first_digit(&w->spec);
        c->first_digit = first < c->first_digit ? first : c->first_digit;
    }
    c->answers_bytes = c->walks > 0 ? at : 0;
}

static em_status take_choice_buffers(scratch *s, cuda_lane *lane, choice_buffers *c,
                                     em_error *err)
{
    if (c->walks == 0)
        return EM_OK;
    em_status status = scratch_take(s, c->answers_bytes, "eviction choices",
                                    (void **)&c->answers, err);
    if (status == EM_OK)
        status = scratch_take(s, (c->flag_count + 1) * sizeof(uint32_t), "eviction choice flags",
                              (void **)&c->flags, err);
    if (status == EM_OK)
        status = scratch_take(s, (c->flag_count + 1) * sizeof(uint32_t), "eviction choice ranks",
                              (void **)&c->rank, err);
    if (status == EM_OK)
        status = scratch_take(s, c->bit_words * sizeof(uint64_t), "eviction kept rows",
                              (void **)&c->bits, err);
    if (status == EM_OK)
        status = em__cuda_take_scan_temp(s, lane, c->flag_count + 1, &c->temp, &c->temp_bytes,
                                         err);
    return status;
}

/* Enqueues the choices of the walks the GPU chooses for (after their walks): the
 * request's rows into bit sets, a count for each byte of the order from the first that
 * differs between entries (its launch also fixes the byte), then the chosen entries
 * flagged, scanned and written out (kernels/ember_kernels.h: em_gpu_choice). */
static em_status enqueue_choices(cuda_evict_walk *walks, uint32_t count, const choice_buffers *c,
                                 em_error *err)
{
    cuda_lane *lane = walks[0].lane;
    em_gpu_choice *host = calloc(c->walks, sizeof(*host));
    if (host == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    uint64_t flag = 0, word = 0;
    for (uint32_t i = 0; i < count; i++) {
        const cuda_evict_walk *w = &walks[i];
        if (!w->on_gpu)
            continue;
        window_region device = region_layout((uint8_t *)w->device_part, w->ahead);
        em_gpu_choice *h = &host[w->choice_index];
        *h = (em_gpu_choice){
            .keys = device.keys,
            .rows = device.rows,
            .access = device.access,
            .walk = device.walk,
            .want = w->ahead,
            .count = w->spec.count,
            .kept = w->kept_device,
            .kept_count = w->kept_device_count,
            .kept_bits = c->bits + word,
            .row_limit = storage_rows(w->shard),
            .first_flag = flag,
            .out_keys = (uint64_t *)(c->answers + w->answer_offset),
            .out_rows = (uint64_t *)(c->answers + w->answer_offset) + w->spec.count,
            .policy = w->spec.policy,
            .update_clock = w->spec.update_clock,
            .first_digit = choice_first_digit(&w->spec),
            .state = EM_GPU_CHOICE_OPEN,
            .digits = choice_first_digit(&w->spec),
            .remaining = w->spec.count,
        };
        word += (h->row_limit + 63) / 64;
        flag += w->ahead;
    }
    em_gpu_choice *choices = (em_gpu_choice *)c->answers;
    em_status status = em__cuda_copy_to_device(&lane->base, choices, host,
                                               c->walks * sizeof(em_gpu_choice), err);
    free(host);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_memset_async(lane->stream, c->bits, 0,
                                                      c->bit_words * sizeof(uint64_t)), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_choice_mark_kept(lane->stream, choices, c->walks,
                                                          c->most_kept), err);
    for (uint32_t digit = c->first_digit; status == EM_OK && digit < EM_GPU_RANK_DIGITS; digit++)
        status = lane_check(lane, em_gpu_choice_count(lane->stream, choices, c->walks,
                                                      c->most_want, digit), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_memset_async(lane->stream, c->flags, 0,
                                                      (c->flag_count + 1) * sizeof(uint32_t)),
                            err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_choice_flags(lane->stream, choices, c->walks,
                                                      c->most_want, c->flags), err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_exclusive_scan_u32(lane->stream, c->temp, c->temp_bytes,
                                                            c->flags, c->rank, c->flag_count + 1),
                            err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_choice_write(lane->stream, choices, c->walks,
                                                      c->most_want, c->flags, c->rank), err);
    return status;
}

/* Whether the GPU's choice for walk w holds (answers: the answers region in host
 * memory): its read ahead held the chooser's window (cut at `ahead` when that is the
 * window, or every entry of the map) and at least as many entries outside the request
 * as rows to choose; then keys and rows get the chosen ones, in window order. */
static bool take_choice(const cuda_evict_walk *w, const uint8_t *answers, uint64_t *keys,
                        uint64_t *rows)
{
    const em_gpu_choice *c = (const em_gpu_choice *)answers + w->choice_index;
    uint64_t window = em_evict_window(&w->spec);
    bool whole = c->taken >= w->ahead ? w->ahead == window : w->span == w->shard->slot_count;
    if (c->state != EM_GPU_CHOICE_SETTLED || !whole)
        return false;
    const uint64_t *chosen = (const uint64_t *)(answers + w->answer_offset);
    memcpy(keys, chosen, w->spec.count * sizeof(uint64_t));
    memcpy(rows, chosen + w->spec.count, w->spec.count * sizeof(uint64_t));
    return true;
}

/* Plans walks[0..count) (one lane, count > 0), takes their shared buffers into s and
 * enqueues their reads, the choices the GPU makes (plan_choices), and the copy back into
 * the lane's pinned readback memory (*host, filled once the lane synchronizes) of the
 * region of the walks the host chooses for (at *host) and of the GPU's answers (at
 * *host + *answers_at). *read false: the pool (or the readback memory,
 * LANE_READBACK_MAX) has no room, and nothing was enqueued. */
static em_status enqueue_reads(cuda_evict_walk *walks, uint32_t count, scratch *s,
                               uint8_t **host, size_t *answers_at, bool *read, em_error *err)
{
    cuda_lane *lane = walks[0].lane;
    uint64_t offset = 0;
    for (uint32_t i = 0; i < count; i++) {
        plan_window(&walks[i], offset);
        offset += (walks[i].bytes + 255) & ~(uint64_t)255; /* each part 256-byte aligned */
    }
    choice_buffers choices;
    plan_choices(walks, count, &choices);
    window_buffers buffers;
    em_error room_err;
    em_status status = take_window_buffers(s, lane, walks, count, &buffers, &room_err);
    if (status == EM_OK)
        status = take_choice_buffers(s, lane, &choices, &room_err);
    size_t region_back = choices.walks < count ? buffers.bytes : 0; /* the host's walks */
    *answers_at = aligned_256(region_back);
    if (status == EM_OK)
        status = em__cuda_lane_readback(lane, *answers_at + choices.answers_bytes, host,
                                        &room_err);
    *read = status == EM_OK;
    if (status != EM_OK) { /* no room (else a failure, which is the caller's) */
        scratch_free_now(s);
        walk_plan_free(&buffers.plan);
        if (status != EM_RESOURCE_EXHAUSTED)
            *err = room_err;
        return status == EM_RESOURCE_EXHAUSTED ? EM_OK : status;
    }
    for (uint32_t i = 0; i < count; i++) {
        walks[i].device_part = buffers.region + walks[i].offset;
        walks[i].answers_device = walks[i].on_gpu ? choices.answers : NULL;
    }
    for (uint32_t i = 0; status == EM_OK && i < count; i++)
        status = enqueue_side(&walks[i], i, &buffers, err);
    if (status == EM_OK)
        status = enqueue_walks(lane, &buffers, err);
    for (uint32_t i = 0; status == EM_OK && i < count; i++)
        status = record_read(walks[i].shard, lane, err);
    walk_plan_free(&buffers.plan);
    if (status == EM_OK && choices.walks > 0)
        status = enqueue_choices(walks, count, &choices, err);
    if (status == EM_OK && region_back > 0)
        status = lane_check(lane, em_gpu_memcpy_async(lane->stream, *host, buffers.region,
                                                      region_back),
                            err);
    if (status == EM_OK && choices.walks > 0)
        status = lane_check(lane, em_gpu_memcpy_async(lane->stream, *host + *answers_at,
                                                      choices.answers, choices.answers_bytes),
                            err);
    return status;
}

static em_status choose_on_host(cuda_evict_walk *w, const em_evict_spec *spec, uint64_t *keys,
                                uint64_t *rows, em_error *err);

/* The keys the GPU chose for walk w, where it wrote them (its answers region). */
static const uint64_t *chosen_keys(const cuda_evict_walk *w)
{
    return (const uint64_t *)(w->answers_device + w->answer_offset);
}

/* After the walks of a lane: the erases of the rows chosen for walks[0..count) (each with
 * rows to give up; keys[k]: walks[k]'s keys, in host memory), in one launch (a walk's
 * shard each): from where the GPU wrote the keys it chose, and from one copy of the keys
 * the host chose; then each shard's counts. */
static em_status erase_chosen(cuda_evict_walk *const *walks, uint64_t *const *keys,
                              uint32_t count, em_error *err)
{
    if (count == 1 && !walks[0]->gpu_chose)
        return erase_host_keys(walks[0]->shard, walks[0]->lane, keys[0], walks[0]->spec.count,
                               false, err);
    if (count == 1) {
        const cuda_evict_walk *w = walks[0];
        em_status status = enqueue_erase(w->shard, w->lane, chosen_keys(w), NULL, w->spec.count,
                                         err);
        if (status == EM_OK)
            take_erase(w->shard, keys[0], w->spec.count);
        return status;
    }
    cuda_lane *lane = walks[0]->lane;
    uint64_t host_keys = 0; /* the keys the host chose, sent together */
    for (uint32_t k = 0; k < count; k++)
        host_keys += walks[k]->gpu_chose ? 0 : walks[k]->spec.count;
    em_gpu_shard_part *parts = calloc(count, sizeof(*parts));
    uint64_t *packed = malloc((host_keys > 0 ? host_keys : 1) * sizeof(uint64_t));
    scratch s = {.device = lane->base.device};
    uint64_t *sent = NULL;
    em_status status = parts != NULL && packed != NULL
                           ? EM_OK
                           : em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                          "eviction: out of host memory");
    if (status == EM_OK && host_keys > 0)
        status = scratch_take(&s, host_keys * sizeof(uint64_t), "erased keys", (void **)&sent,
                              err);
    uint64_t most = 0, at = 0;
    for (uint32_t k = 0; status == EM_OK && k < count; k++) {
        cuda_shard *shard = walks[k]->shard;
        uint64_t n = walks[k]->spec.count;
        /* the view after the room: a grown free list moves */
        status = reserve_free_rows(shard, lane, shard->free_count + n, err);
        if (status == EM_OK)
            status = order_write(shard, lane, err);
        parts[k] = (em_gpu_shard_part){.map = map_view(shard), .n = n};
        parts[k].keys = walks[k]->gpu_chose ? chosen_keys(walks[k]) : sent + at;
        if (!walks[k]->gpu_chose) {
            memcpy(packed + at, keys[k], n * sizeof(uint64_t));
            at += n;
        }
        most = n > most ? n : most;
    }
    em_gpu_shard_part *device_parts = NULL;
    if (status == EM_OK && host_keys > 0)
        status = em__cuda_copy_to_device(&lane->base, sent, packed,
                                         host_keys * sizeof(uint64_t), err);
    if (status == EM_OK)
        status = send_parts(lane, &s, parts, count * sizeof(*parts), (void **)&device_parts, err);
    if (status == EM_OK)
        status = lane_check(lane, em_gpu_parts_erase(lane->stream, device_parts, count, most),
                            err);
    for (uint32_t k = 0; status == EM_OK && k < count; k++)
        status = record_write(walks[k]->shard, lane, err);
    for (uint32_t k = 0; status == EM_OK && k < count; k++)
        take_erase(walks[k]->shard, keys[k], walks[k]->spec.count);
    free(parts);
    free(packed);
    return em__cuda_finish_async(&s, lane, status, err);
}

/* After the lane synchronized over walk w's reads (host: the readback memory): its
 * choice, the GPU's (answers at host + answers_at) where that holds, its erase left to
 * erase_chosen (*erase set), else the host's over the read ahead (copied back now where
 * the GPU chose), and the erase of the chosen rows, enqueued. The walk's scratch is
 * still the lane's. */
static em_status finish_walk(cuda_evict_walk *w, scratch *s, const uint8_t *host,
                             size_t answers_at, uint64_t *keys, uint64_t *rows, bool *erase,
                             em_error *err)
{
    *erase = false;
    if (w->on_gpu && take_choice(w, host + answers_at, keys, rows)) {
        /* the chosen keys are erased where the GPU wrote them: their region outlives the
         * walk's other scratch, until the lane's work so far is done */
        w->shard->rows_chosen_on_gpu += w->spec.count;
        w->gpu_chose = true;
        *erase = w->spec.count > 0;
        return em__cuda_free_one_later(s, w->lane, w->answers_device, err);
    }
    const uint8_t *part = host + w->offset;
    uint8_t *copy = NULL;
    em_status status = EM_OK;
    if (w->on_gpu) { /* the read ahead was not the window, or too few of it may go */
        copy = malloc(w->bytes);
        status = copy != NULL ? em__cuda_copy_to_host(&w->lane->base, copy, w->device_part,
                                                      w->bytes, err)
                              : em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                             "eviction: out of host memory");
        part = copy;
    }
    if (status == EM_OK)
        status = take_window(w, part, err);
    free(copy);
    if (status == EM_OK)
        status = choose_on_host(w, &w->spec, keys, rows, err);
    *erase = status == EM_OK && w->spec.count > 0;
    return status;
}

/* Reads one walk's window at once (enqueue_reads, then a wait), chooses and erases
 * (finish_walk). *read false: no room, nothing was enqueued or chosen. */
static em_status read_window_and_choose(cuda_evict_walk *w, uint64_t *keys, uint64_t *rows,
                                        bool *read, em_error *err)
{
    scratch s = {.device = w->lane->base.device};
    uint8_t *host = NULL;
    size_t answers_at = 0;
    em_status status = enqueue_reads(w, 1, &s, &host, &answers_at, read, err);
    if (status == EM_OK && *read)
        status = em__cuda_lane_sync(w->lane, err);
    if (status != EM_OK)
        return em__cuda_finish_async(&s, w->lane, status, err);
    if (!*read)
        return EM_OK;
    bool erase = false;
    status = finish_walk(w, &s, host, answers_at, keys, rows, &erase, err);
    if (status == EM_OK && erase)
        status = erase_chosen(&w, &keys, 1, err);
    scratch_free_now(&s); /* the lane synchronized: nothing it runs reads them */
    return status;
}

/* The read ahead export by export (each waits a few times), where the pool has no room
 * for the read ahead's buffers. */
static em_status read_ahead_by_exports(cuda_evict_walk *w, em_error *err)
{
    w->keys = malloc(w->ahead * sizeof(uint64_t));
    w->rows = malloc(w->ahead * sizeof(uint64_t));
    w->access = malloc(w->ahead * sizeof(em_row_access));
    if (w->keys == NULL || w->rows == NULL || w->access == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    w->before_wrap = UINT64_MAX;
    while (w->held < w->ahead) {
        bool wrapped = w->wrapped;
        uint64_t got = 0;
        em_status status = walk_export(w, w->ahead - w->held, w->keys + w->held,
                                       w->rows + w->held, &got, err);
        if (status != EM_OK)
            return status;
        if (got == 0)
            break;
        if (!wrapped && w->wrapped)
            w->before_wrap = w->held;
        w->held += got;
    }
    if (w->before_wrap == UINT64_MAX)
        w->before_wrap = w->held;
    return read_access_host(w->shard, w->lane, w->rows, w->held, w->access, err);
}

/* The request's rows read back on their own (read_ahead_by_exports). */
static em_status read_kept(cuda_evict_walk *w, em_error *err)
{
    uint64_t n = w->kept_device_count;
    uint64_t *rows = malloc((n + 1) * sizeof(uint64_t));
    if (rows == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    em_status status = n == 0 ? EM_OK
                              : em__cuda_copy_to_host(&w->lane->base, rows, w->kept_device,
                                                      n * sizeof(uint64_t), err);
    if (status == EM_OK)
        status = take_kept(w, rows, n, err);
    free(rows);
    return status;
}

/* Without room for the read ahead's buffers: the request's rows and the walk's first
 * entries read back export by export, before the host's choice. */
static em_status read_ahead_without_room(cuda_evict_walk *w, em_error *err)
{
    em_status status = read_kept(w, err);
    if (status == EM_OK)
        status = read_ahead_by_exports(w, err);
    return status;
}

static em_status cuda_evict_walk_next(void *context, uint64_t max, uint64_t *keys,
                                      uint64_t *rows, em_row_access *access, uint64_t *got,
                                      em_error *err)
{
    cuda_evict_walk *w = context;
    *got = 0;
    if (w->served < w->held) {
        uint64_t end = w->served < w->before_wrap ? w->before_wrap : w->held;
        uint64_t n = end - w->served < max ? end - w->served : max;
        memcpy(keys, w->keys + w->served, n * sizeof(uint64_t));
        memcpy(rows, w->rows + w->served, n * sizeof(uint64_t));
        memcpy(access, w->access + w->served, n * sizeof(em_row_access));
        w->served += n;
        *got = n;
        return EM_OK;
    }
    em_status status = walk_export(w, max, keys, rows, got, err);
    if (status == EM_OK)
        status = read_access_host(w->shard, w->lane, rows, *got, access, err);
    return status;
}

/* A walk for spec over shard's map (not yet read). */
static cuda_evict_walk evict_walk(cuda_shard *shard, cuda_lane *lane, const em_evict_spec *spec)
{
    uint64_t positions = 2 + shard->slot_count;
    uint64_t window = em_evict_window(spec);
    bool on_gpu = window >= state_of(shard->base.device)->gpu_choice_entries &&
                  spec->kept_count == 0 && side_keys(shard) == 0;
    uint64_t most = on_gpu ? EVICT_READ_AHEAD_ON_GPU : EVICT_READ_AHEAD;
    window = window < most ? window : most;
    return (cuda_evict_walk){.shard = shard,
                             .lane = lane,
                             .spec = *spec,
                             .start = spec->random % positions,
                             .cursor = spec->random % positions,
                             .end = positions,
                             .ahead = window < shard->size + 2 ? window : shard->size + 2,
                             .kept_device = spec->kept_device,
                             .kept_device_count = spec->kept_device_count};
}

static void evict_walk_free(cuda_evict_walk *w)
{
    free(w->keys);
    free(w->rows);
    free(w->access);
    free(w->kept);
}

/* After the walk's read ahead: the choice by spec over the walk, and the erase of the
 * chosen rows (enqueued). */
static em_status choose_on_host(cuda_evict_walk *w, const em_evict_spec *spec, uint64_t *keys,
                                uint64_t *rows, em_error *err)
{
    em_evict_spec choice = *spec;
    if (w->kept_device_count > 0) {
        choice.kept = w->kept;
        choice.kept_count = w->kept_count;
    }
    return em_evict_choose(&choice, cuda_evict_walk_next, w, keys, rows, err);
}

static em_status choose_and_erase(cuda_evict_walk *w, const em_evict_spec *spec, uint64_t *keys,
                                  uint64_t *rows, em_error *err)
{
    em_status status = choose_on_host(w, spec, keys, rows, err);
    if (status == EM_OK)
        status = erase_host_keys(w->shard, w->lane, keys, spec->count, false, err);
    return status;
}

em_status em__cuda_shard_evict(em_shard *base, em_lane *lane_base, const em_evict_spec *spec,
                               uint64_t *keys, uint64_t *rows, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    if (!shard->track_access)
        return em_error_set(err, EM_FAILED_PRECONDITION, "shard keeps no access metadata");
    if (spec->count == 0) /* a shard that only takes the request's new keys */
        return EM_OK;
    cuda_evict_walk walk = evict_walk(shard, lane_of(lane_base), spec);
    bool read = false;
    em_status status = read_window_and_choose(&walk, keys, rows, &read, err);
    if (status == EM_OK && !read)
        status = read_ahead_without_room(&walk, err);
    if (status == EM_OK && !read)
        status = choose_and_erase(&walk, spec, keys, rows, err);
    evict_walk_free(&walk);
    return status;
}

/* shards_evict_begin's work in flight, for shards_evict_end. */
typedef struct evict_batch {
    cuda_lane *lane;
    em_shard_evict_part *parts;
    uint32_t count, reading;
    cuda_evict_walk *walks; /* the parts that evict, in order */
    uint32_t *part_of;      /* walks[r] is parts[part_of[r]]'s */
    bool read;              /* the walks were enqueued; else each part evicts at the end */
    scratch s;
    uint8_t *host;          /* the lane's readback: the walks once the lane synchronized */
    size_t answers_at;      /* where the GPU's choices are in it */
} evict_batch;

static void evict_batch_free(evict_batch *batch)
{
    for (uint32_t r = 0; r < batch->reading; r++)
        evict_walk_free(&batch->walks[r]);
    free(batch->walks);
    free(batch->part_of);
    free(batch);
}

em_status em__cuda_shards_evict_begin(em_lane *lane_base, em_shard_evict_part *parts,
                                      uint32_t count, void **pending, em_error *err)
{
    cuda_lane *lane = lane_of(lane_base);
    *pending = NULL;
    evict_batch *batch = calloc(1, sizeof(*batch));
    if (batch != NULL) {
        batch->walks = calloc(count > 0 ? count : 1, sizeof(*batch->walks));
        batch->part_of = calloc(count > 0 ? count : 1, sizeof(*batch->part_of));
    }
    if (batch == NULL || batch->walks == NULL || batch->part_of == NULL) {
        if (batch != NULL)
            evict_batch_free(batch);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    }
    *batch = (evict_batch){.lane = lane, .parts = parts, .count = count,
                           .walks = batch->walks, .part_of = batch->part_of,
                           .s = {.device = lane->base.device}};
    for (uint32_t i = 0; i < count; i++) {
        cuda_shard *shard = shard_of(parts[i].shard);
        parts[i].status = EM_OK;
        if (!shard->track_access)
            parts[i].status = em_error_set(&parts[i].err, EM_FAILED_PRECONDITION,
                                           "shard keeps no access metadata");
        else if (parts[i].spec.count > 0) {
            batch->part_of[batch->reading] = i;
            batch->walks[batch->reading++] = evict_walk(shard, lane, &parts[i].spec);
        }
    }
    if (batch->reading == 0) { /* every part only takes new keys, or failed */
        evict_batch_free(batch);
        return EM_OK;
    }
    /* without room, nothing is enqueued and the parts evict a shard at a time at the end */
    em_status status = enqueue_reads(batch->walks, batch->reading, &batch->s, &batch->host,
                                     &batch->answers_at, &batch->read, err);
    if (status != EM_OK) {
        em__cuda_finish_async(&batch->s, lane, status, err);
        evict_batch_free(batch);
        return status;
    }
    *pending = batch;
    return EM_OK;
}

void em__cuda_shards_evict_end(void *pending, em_status synchronized, const em_error *sync_err)
{
    evict_batch *batch = pending;
    if (batch == NULL)
        return;
    em_lane *lane_base = &batch->lane->base;
    /* the walks whose rows the GPU chose, erased together at the end */
    cuda_evict_walk **erasing = calloc(batch->reading + 1, sizeof(*erasing));
    uint64_t **erased_keys = calloc(batch->reading + 1, sizeof(*erased_keys));
    uint32_t *erasing_part = calloc(batch->reading + 1, sizeof(*erasing_part));
    bool room = erasing != NULL && erased_keys != NULL && erasing_part != NULL;
    uint32_t erases = 0;
    for (uint32_t r = 0; r < batch->reading; r++) {
        em_shard_evict_part *part = &batch->parts[batch->part_of[r]];
        bool erase = false;
        if (synchronized != EM_OK) {
            part->status = synchronized;
            part->err = *sync_err;
        } else if (batch->read && !room) {
            part->status = em_error_set(&part->err, EM_RESOURCE_EXHAUSTED,
                                        "eviction: out of host memory");
        } else if (batch->read) {
            part->status = finish_walk(&batch->walks[r], &batch->s, batch->host,
                                       batch->answers_at, part->keys, part->rows, &erase,
                                       &part->err);
        } else { /* no room for every walk's buffers at once */
            part->status = em__cuda_shard_evict(part->shard, lane_base, &part->spec,
                                                part->keys, part->rows, &part->err);
        }
        if (part->status == EM_OK && erase) {
            erasing[erases] = &batch->walks[r];
            erased_keys[erases] = part->keys;
            erasing_part[erases++] = batch->part_of[r];
        }
    }
    em_error erase_err;
    em_status erased = erases > 0 ? erase_chosen(erasing, erased_keys, erases, &erase_err)
                                  : EM_OK;
    for (uint32_t k = 0; erased != EM_OK && k < erases; k++) {
        batch->parts[erasing_part[k]].status = erased;
        batch->parts[erasing_part[k]].err = erase_err;
    }
    free(erasing);
    free(erased_keys);
    free(erasing_part);
    /* the walks' scratch: the lane synchronized, so nothing it runs reads it (the erases
     * enqueued above have their own); where the lane failed, once it is waited for */
    if (batch->read && synchronized == EM_OK)
        scratch_free_now(&batch->s);
    else if (batch->read)
        em__cuda_finish_async(&batch->s, batch->lane, synchronized, NULL);
    evict_batch_free(batch);
}

em_status em__cuda_shard_expire(em_shard *base, em_lane *lane_base, uint32_t update_clock,
                                uint32_t min_age, uint64_t *cursor, uint64_t scan,
                                uint64_t *keys, uint64_t *rows, uint64_t *count, em_error *err)
{
    cuda_shard *shard = shard_of(base);
    cuda_lane *lane = lane_of(lane_base);
    *count = 0;
    if (!shard->track_access)
        return em_error_set(err, EM_FAILED_PRECONDITION, "shard keeps no access metadata");
    /* the examined entries land in keys/rows, the expired ones are packed in front */
    uint64_t end = 2 + shard->slot_count, got = 0;
    em_status status = export_range(shard, lane, cursor, end, keys, NULL, rows, scan, &got, err);
    em_row_access *access = got > 0 ? malloc(got * sizeof(em_row_access)) : NULL;
    if (status == EM_OK && got > 0 && access == NULL)
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "expiry: out of host memory");
    if (status == EM_OK)
        status = read_access_host(shard, lane, rows, got, access, err);
    if (status == EM_OK) {
        if (*cursor >= end) /* the export reached the end of the map */
            *cursor = 0;
        for (uint64_t i = 0; i < got; i++) {
            if ((uint32_t)(update_clock - access[i].updated) < min_age)
                continue;
            keys[*count] = keys[i];
            rows[*count] = rows[i];
            (*count)++;
        }
        status = erase_host_keys(shard, lane, keys, *count, true, err);
    }
    if (status != EM_OK)
        *count = 0;
    free(access);
    return status;
}
