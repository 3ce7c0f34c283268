/*
 * DESIGN: a table as of one instant, read while it keeps serving (for checkpoints).
 *
 * Begin holds every shard's write lock for a moment and copies each shard's index (key
 * and row of every key: 16 bytes per row) to the host: that instant is the snapshot.
 * From then on, the first time a push or an import writes a row of the snapshot that
 * has not been read yet, the row's value is copied aside first (under that shard's
 * write lock, in em__snapshot_preserve), so the reader sees every row as it was:
 *
 *   - a row never written since: read live (nothing wrote it, so it is the old value);
 *   - a row written since: read from its copy;
 *   - a row created since: not in the captured index, never read.
 *
 * Every push holds the write locks of all its shards while it steps them, so each push
 * is wholly before the instant (its steps are in the live rows when begin copies the
 * index) or wholly after it (every row it touches was copied aside before it wrote).
 *
 * The reader goes shard by shard; once a shard has been read its copies are freed and
 * writes to it copy nothing more. The copies are bounded: past copy_limit bytes, pushes
 * and imports wait (before they take a lane or any shard lock) until the reader has
 * freed a shard's copies; the reader needs only a lane and shards' read locks, so it
 * always gets there. Begin, like every request, takes its lanes before the shards'
 * locks. The memory a save needs is therefore the captured index (16 bytes per row)
 * plus at most copy_limit plus what the pushes in flight at that moment copy.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/keyhash.h"
#include "lib/table/table_internal.h"

/* Row -> position of its copy, open addressing (rows are never UINT64_MAX). */
typedef struct copy_index {
    uint64_t *rows;
    uint64_t *positions;
    uint64_t slots, used;
} copy_index;

typedef struct snapshot_shard {
    uint64_t count;         /* rows in the snapshot */
    uint64_t *keys, *rows;  /* the captured index (host) */
    uint64_t span;          /* 1 + the largest captured row */
    uint64_t *captured;     /* bit per row < span: in the snapshot */
    uint64_t *preserved;    /* bit per row < span: its old value is in copies */
    float *copies;          /* row_floats floats per copy */
    uint64_t copy_count, copy_capacity;
    copy_index index;
    bool done;              /* read completely: copies freed, writes copy nothing */
} snapshot_shard;

struct em_table_snapshot {
    em_table *table;
    snapshot_shard *shards;
    uint64_t rows;
    /* the evicted-key ring at the instant: keys removed by the policy so far, and the
     * last evicted_count of them, oldest first */
    uint64_t evicted_total, evicted_count;
    uint64_t *evicted;
    uint64_t copy_limit;
    uint64_t copy_bytes; /* under table->snapshot_mutex */
    uint32_t shard;      /* the reader's position */
    uint64_t position;
};

static bool bit_get(const uint64_t *bits, uint64_t i)
{
    return (bits[i >> 6] >> (i & 63)) & 1u;
}

static void bit_set(uint64_t *bits, uint64_t i)
{
    bits[i >> 6] |= UINT64_C(1) << (i & 63);
}

/* ---- the copy index ---------------------------------------------------------------- */

static uint64_t copy_slot(const copy_index *index, uint64_t row)
{
    return em_mix64(row) & (index->slots - 1);
}

static uint64_t copy_find(const copy_index *index, uint64_t row)
{
    for (uint64_t slot = copy_slot(index, row);; slot = (slot + 1) & (index->slots - 1)) {
        if (index->rows[slot] == row)
            return index->positions[slot];
        if (index->rows[slot] == UINT64_MAX)
            return UINT64_MAX;
    }
}

static void copy_put(copy_index *index, uint64_t row, uint64_t position)
{
    uint64_t slot = copy_slot(index, row);
    while (index->rows[slot] != UINT64_MAX)
        slot = (slot + 1) & (index->slots - 1);
    index->rows[slot] = row;
    index->positions[slot] = position;
    index->used++;
}

/* Room for `more` entries at a load of at most one half. */
static bool copy_reserve(copy_index *index, uint64_t more)
{
    if (2 * (index->used + more) <= index->slots)
        return true;
    uint64_t slots = index->slots < 64 ? 64 : index->slots;
    while (2 * (index->used + more) > slots)
        slots *= 2;
    copy_index grown = {.rows = malloc(slots * sizeof(uint64_t)),
                        .positions = malloc(slots * sizeof(uint64_t)),
                        .slots = slots};
    if (grown.rows == NULL || grown.positions == NULL) {
        free(grown.rows);
        free(grown.positions);
        return false;
    }
    memset(grown.rows, 0xff, slots * sizeof(uint64_t));
    for (uint64_t slot = 0; slot < index->slots; slot++)
        if (index->rows[slot] != UINT64_MAX)
            copy_put(&grown, index->rows[slot], index->positions[slot]);
    free(index->rows);
    free(index->positions);
    *index = grown;
    return true;
}

/* ---- reading rows to the host ------------------------------------------------------- */

/* values[i] = row rows[i] of shard s (host arrays), on the shard's device. */
static em_status read_rows(em_table *table, uint32_t s, em_lane *lane, const uint64_t *rows,
                           uint64_t n, float *values, em_error *err)
{
    em_shard *shard = table->shards[s];
    em_device *device = shard->device;
    const em_device_ops *ops = device->ops;
    size_t row_bytes = table->row_floats * sizeof(float);
    if (n == 0)
        return EM_OK;
    if (device->host_addressable)
        return ops->shard_read_rows(shard, lane, rows, n, values, err);
    uint64_t *device_rows = NULL;
    float *device_values = NULL;
    em_status status = em_device_alloc(device, n * sizeof(uint64_t), "snapshot rows",
                                       (void **)&device_rows, err);
    if (status == EM_OK)
        status = em_device_alloc(device, n * row_bytes, "snapshot values",
                                 (void **)&device_values, err);
    if (status == EM_OK)
        status = ops->copy_to_device(lane, device_rows, rows, n * sizeof(uint64_t), err);
    if (status == EM_OK)
        status = ops->shard_read_rows(shard, lane, device_rows, n, device_values, err);
    if (status == EM_OK)
        status = ops->copy_to_host(lane, values, device_values, n * row_bytes, err);
    if (status == EM_OK)
        status = ops->synchronize(lane, err);
    em_device_free(device, device_values);
    em_device_free(device, device_rows);
    return status;
}

/* ---- begin and end ----------------------------------------------------------------- */

static void free_shard(snapshot_shard *shard)
{
    free(shard->keys);
    free(shard->rows);
    free(shard->captured);
    free(shard->preserved);
    free(shard->copies);
    free(shard->index.rows);
    free(shard->index.positions);
    memset(shard, 0, sizeof(*shard));
    shard->done = true;
}

/* Copies shard s's index (every key and its row) to the host through a lane of its
 * device; its write lock is held. */
static em_status capture_shard(em_table *table, uint32_t s, em_lane *lane, snapshot_shard *out,
                               em_error *err)
{
    em_shard *shard = table->shards[s];
    const em_device_ops *ops = shard->device->ops;
    em_shard_stats stats;
    ops->shard_stats(shard, &stats);
    uint64_t capacity = stats.rows + 1;
    out->keys = malloc(capacity * sizeof(uint64_t));
    out->rows = malloc(capacity * sizeof(uint64_t));
    if (out->keys == NULL || out->rows == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "snapshot of table '%s': out of host memory for the index of "
                            "shard %u (%" PRIu64 " rows)", table->config.name, s, stats.rows);
    em_status status = EM_OK;
    uint64_t cursor = 0, count = 1;
    while (status == EM_OK && count > 0) {
        status = ops->shard_export(shard, lane, &cursor, out->keys + out->count, NULL,
                                   out->rows + out->count, capacity - out->count, &count, err);
        out->count += count;
        if (status == EM_OK && count > 0 && out->count == capacity)
            status = em_error_set(err, EM_INTERNAL,
                                  "snapshot of table '%s': shard %u holds more rows than it "
                                  "counts (%" PRIu64 ")", table->config.name, s, stats.rows);
    }
    if (status != EM_OK)
        return status;
    for (uint64_t i = 0; i < out->count; i++)
        out->span = out->rows[i] + 1 > out->span ? out->rows[i] + 1 : out->span;
    size_t words = (size_t)((out->span + 63) / 64) + 1;
    out->captured = calloc(words, sizeof(uint64_t));
    out->preserved = calloc(words, sizeof(uint64_t));
    if (out->captured == NULL || out->preserved == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "snapshot of table '%s': out of host memory", table->config.name);
    for (uint64_t i = 0; i < out->count; i++)
        bit_set(out->captured, out->rows[i]);
    return EM_OK;
}

/* Takes a lane on each device the table's shards live on, in device order, before any
 * shard lock, as requests take theirs (table_request.c: acquire_lanes): a request holds
 * its lanes while it waits for shard locks, so a holder of the shards' locks that then
 * waited for a lane could wait for good. lanes[d] stays NULL for the other devices. */
static em_status take_lanes(em_table *table, em_lane **lanes, em_error *err)
{
    em_backend *backend = table->backend;
    for (uint32_t d = 0; d < backend->device_count; d++) {
        bool hosts = false;
        for (uint32_t s = 0; s < table->shard_count && !hosts; s++)
            hosts = table->shard_device[s] == d;
        em_device *device = backend->devices[d];
        em_status status = hosts ? device->ops->lane_acquire(device, &lanes[d], err) : EM_OK;
        if (status != EM_OK)
            return em_error_prefix(err, "snapshot of table '%s': lane on %s: ",
                                   table->config.name, device->name);
    }
    return EM_OK;
}

static void give_lanes(em_table *table, em_lane **lanes)
{
    for (uint32_t d = 0; d < table->backend->device_count; d++)
        if (lanes[d] != NULL)
            table->backend->devices[d]->ops->lane_release(lanes[d]);
}

/* Room for the evicted-key ring, taken before the shards are held. */
static uint32_t ring_size(const em_table *table)
{
    return table->evicted_keys != NULL ? table->config.eviction.ring : 0;
}

/* The evicted-key ring as of now, into the snapshot's room for it (em_table_evicted's
 * keys, all of those the ring holds). */
static em_status capture_evicted(em_table *table, em_table_snapshot *snapshot, em_error *err)
{
    em_evicted_view view;
    em_status status = em_table_evicted(table, 0, ring_size(table), snapshot->evicted, &view,
                                        err);
    snapshot->evicted_total = view.total;
    snapshot->evicted_count = view.count;
    return status;
}

em_status em_table_snapshot_begin(em_table *table, uint64_t copy_limit_bytes,
                                  em_table_snapshot **out, em_error *err)
{
    em_table_snapshot *snapshot = calloc(1, sizeof(*snapshot));
    if (snapshot != NULL) {
        snapshot->shards = calloc(table->shard_count, sizeof(*snapshot->shards));
        snapshot->evicted = malloc(((size_t)ring_size(table) + 1) * sizeof(uint64_t));
    }
    if (snapshot == NULL || snapshot->shards == NULL || snapshot->evicted == NULL) {
        if (snapshot != NULL) {
            free(snapshot->shards);
            free(snapshot->evicted);
        }
        free(snapshot);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "snapshot of table '%s': out of memory",
                            table->config.name);
    }
    snapshot->table = table;
    snapshot->copy_limit = copy_limit_bytes;
    em_lane *lanes[EM_BACKEND_MAX_DEVICES] = {NULL};
    em_status status = take_lanes(table, lanes, err);
    em__lock_all_shards(table, true);
    if (status == EM_OK && table->snapshot != NULL)
        status = em_error_set(err, EM_FAILED_PRECONDITION,
                              "table '%s' is being saved already", table->config.name);
    for (uint32_t s = 0; status == EM_OK && s < table->shard_count; s++) {
        status = capture_shard(table, s, lanes[table->shard_device[s]], &snapshot->shards[s],
                               err);
        snapshot->rows += snapshot->shards[s].count;
    }
    if (status == EM_OK) /* every removal records its keys before its shard lock goes */
        status = capture_evicted(table, snapshot, err);
    if (status == EM_OK) {
        pthread_mutex_lock(&table->snapshot_mutex);
        table->snapshot = snapshot;
        atomic_store_explicit(&table->saving, true, memory_order_release);
        pthread_mutex_unlock(&table->snapshot_mutex);
    }
    em__unlock_all_shards(table);
    give_lanes(table, lanes);
    if (status != EM_OK) {
        for (uint32_t s = 0; s < table->shard_count; s++)
            free_shard(&snapshot->shards[s]);
        free(snapshot->shards);
        free(snapshot->evicted);
        free(snapshot);
        return status;
    }
    *out = snapshot;
    return EM_OK;
}

uint64_t *em_table_snapshot_take_evicted(em_table_snapshot *snapshot, uint64_t *total,
                                         uint64_t *count)
{
    uint64_t *keys = snapshot->evicted;
    *total = snapshot->evicted_total;
    *count = snapshot->evicted_count;
    snapshot->evicted = NULL;
    snapshot->evicted_count = 0;
    return keys;
}

void em_table_snapshot_end(em_table_snapshot *snapshot)
{
    if (snapshot == NULL)
        return;
    em_table *table = snapshot->table;
    em__lock_all_shards(table, true);
    pthread_mutex_lock(&table->snapshot_mutex);
    table->snapshot = NULL;
    atomic_store_explicit(&table->saving, false, memory_order_release);
    pthread_cond_broadcast(&table->snapshot_room);
    pthread_mutex_unlock(&table->snapshot_mutex);
    em__unlock_all_shards(table);
    for (uint32_t s = 0; s < table->shard_count; s++)
        free_shard(&snapshot->shards[s]);
    free(snapshot->shards);
    free(snapshot->evicted);
    free(snapshot);
}

uint64_t em_table_snapshot_rows(const em_table_snapshot *snapshot)
{
    return snapshot->rows;
}

/* ---- the writers' side ------------------------------------------------------------- */

void em__snapshot_wait_room(em_table *table)
{
    /* no save running: nothing to wait for (one that begins meanwhile counts this
     * request's copies among those in flight as it began) */
    if (!atomic_load_explicit(&table->saving, memory_order_acquire))
        return;
    pthread_mutex_lock(&table->snapshot_mutex);
    while (table->snapshot != NULL && table->snapshot->copy_bytes > table->snapshot->copy_limit)
        pthread_cond_wait(&table->snapshot_room, &table->snapshot_mutex);
    pthread_mutex_unlock(&table->snapshot_mutex);
}

em_status em__snapshot_preserve(em_table *table, uint32_t s, em_lane *lane, const uint64_t *rows,
                                uint64_t n, em_error *err)
{
    em_table_snapshot *snapshot = table->snapshot;
    if (snapshot == NULL || snapshot->shards[s].done || n == 0)
        return EM_OK;
    snapshot_shard *shard = &snapshot->shards[s];
    em_device *device = table->shards[s]->device;
    uint64_t *host_rows = (uint64_t *)rows, *fresh = malloc(n * sizeof(uint64_t));
    em_status status = EM_OK;
    if (fresh == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "snapshot: out of host memory");
    if (!device->host_addressable) {
        host_rows = malloc(n * sizeof(uint64_t));
        status = host_rows == NULL ? em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                                  "snapshot: out of host memory")
                                   : device->ops->copy_to_host(lane, host_rows, rows,
                                                               n * sizeof(uint64_t), err);
        if (status == EM_OK)
            status = device->ops->synchronize(lane, err);
    }
    /* the rows of the snapshot this write is the first to touch */
    uint64_t count = 0;
    for (uint64_t i = 0; status == EM_OK && i < n; i++) {
        uint64_t row = host_rows[i];
        if (row < shard->span && bit_get(shard->captured, row) && !bit_get(shard->preserved, row))
            fresh[count++] = row;
    }
    size_t row_bytes = table->row_floats * sizeof(float);
    if (status == EM_OK && count > 0 && shard->copy_count + count > shard->copy_capacity) {
        uint64_t capacity = shard->copy_capacity < 256 ? 256 : shard->copy_capacity;
        while (capacity < shard->copy_count + count)
            capacity *= 2;
        float *copies = realloc(shard->copies, capacity * row_bytes);
        if (copies == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                  "snapshot: out of host memory for copies of changed rows");
        else {
            shard->copies = copies;
            shard->copy_capacity = capacity;
        }
    }
    if (status == EM_OK && count > 0 && !copy_reserve(&shard->index, count))
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "snapshot: out of host memory");
    if (status == EM_OK && count > 0)
        status = read_rows(table, s, lane, fresh, count,
                           shard->copies + shard->copy_count * table->row_floats, err);
    if (status == EM_OK && count > 0) {
        for (uint64_t i = 0; i < count; i++) {
            copy_put(&shard->index, fresh[i], shard->copy_count + i);
            bit_set(shard->preserved, fresh[i]);
        }
        shard->copy_count += count;
        pthread_mutex_lock(&table->snapshot_mutex);
        snapshot->copy_bytes += count * row_bytes;
        pthread_mutex_unlock(&table->snapshot_mutex);
    }
    if (host_rows != rows)
        free(host_rows);
    free(fresh);
    if (status != EM_OK)
        return em_error_prefix(err, "table '%s' shard %u: ", table->config.name, s);
    return EM_OK;
}

/* ---- the reader -------------------------------------------------------------------- */

/* Frees shard s's copies once it has been read; writes to it copy nothing more. */
static void finish_shard(em_table_snapshot *snapshot, uint32_t s)
{
    em_table *table = snapshot->table;
    snapshot_shard *shard = &snapshot->shards[s];
    em__shard_write_lock(table, s); /* a push may still be copying rows of it */
    uint64_t bytes = shard->copy_count * table->row_floats * sizeof(float);
    free_shard(shard);
    em__shard_unlock(table, s);
    pthread_mutex_lock(&table->snapshot_mutex);
    snapshot->copy_bytes -= bytes;
    pthread_cond_broadcast(&table->snapshot_room);
    pthread_mutex_unlock(&table->snapshot_mutex);
}

em_status em_table_snapshot_read(em_table_snapshot *snapshot, uint64_t max, uint64_t *keys,
                                 float *values, em_row_access *access, uint64_t *count,
                                 em_error *err)
{
    em_table *table = snapshot->table;
    uint32_t floats = table->row_floats;
    *count = 0;
    while (snapshot->shard < table->shard_count && *count < max) {
        uint32_t s = snapshot->shard;
        snapshot_shard *shard = &snapshot->shards[s];
        if (snapshot->position == shard->count) {
            finish_shard(snapshot, s);
            snapshot->shard++;
            snapshot->position = 0;
            continue;
        }
        uint64_t take = shard->count - snapshot->position;
        take = take < max - *count ? take : max - *count;
        const uint64_t *rows = shard->rows + snapshot->position;
        float *out = values + *count * floats;
        em_device *device = table->shards[s]->device;
        em_lane *lane = NULL;
        em_status status = device->ops->lane_acquire(device, &lane, err);
        if (status != EM_OK)
            return status;
        em__shard_read_lock(table, s);
        status = read_rows(table, s, lane, rows, take, out, err);
        for (uint64_t i = 0; status == EM_OK && i < take; i++)
            if (bit_get(shard->preserved, rows[i]))
                memcpy(out + i * floats,
                       shard->copies + copy_find(&shard->index, rows[i]) * floats,
                       floats * sizeof(float));
        if (status == EM_OK && access != NULL) {
            if (device->ops->shard_read_access == NULL)
                status = em_error_set(err, EM_FAILED_PRECONDITION,
                                      "the %s backend keeps no access metadata",
                                      table->backend->kind);
            else
                status = device->ops->shard_read_access(table->shards[s], lane, rows, take,
                                                        access + *count, err);
        }
        em__shard_unlock(table, s);
        device->ops->lane_release(lane);
        if (status != EM_OK)
            return em_error_prefix(err, "snapshot of table '%s' shard %u: ", table->config.name,
                                   s);
        memcpy(keys + *count, shard->keys + snapshot->position, take * sizeof(uint64_t));
        snapshot->position += take;
        *count += take;
    }
    return EM_OK;
}
