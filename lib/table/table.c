/*
 * DESIGN: how a table runs a request over its shards and devices.
 *
 * Everything here is orchestration: the work itself is done by device operations
 * (lib/device.h) on buffers from the devices' pools, so this file is the same for the
 * CPU and CUDA backends. A request_context tracks every scratch buffer it takes (freed
 * at the end whatever happens) and the plan of the request:
 *
 *   home device   stages the input, dedupes keys, partitions the unique keys by shard
 *   shard_start   prefix sums of keys per shard: shard s owns partitioned[start[s] ..
 *                 start[s+1])
 *   segments      one per device: the contiguous range of partitioned keys its shards
 *                 own, with that device's copies of keys / rows / vectors. A segment on
 *                 the home device aliases the home buffers; others are filled and
 *                 drained through the backend's exchange.
 *
 * All-or-nothing: validation, dedupe, partition, exchange and find change nothing;
 * then the keys to create are counted, checked against the capacity, and their index
 * and storage reserved on every shard; only after all of that succeeds does any shard
 * create a row or apply a gradient.
 */
#include "lib/table/table.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* A request addresses keys with 32-bit positions (inverse, position arrays). */
#define MAX_KEYS_PER_REQUEST UINT32_MAX
/* Scratch buffers per request: a few at home plus a few per device segment. */
#define SCRATCH_FIXED 16u
#define SCRATCH_PER_DEVICE 4u

struct em_table {
    em_table_config config;
    em_backend *backend;
    uint32_t shard_count;
    uint32_t row_floats;
    em_shard **shards;
    uint32_t *shard_device; /* device index of each shard */
    pthread_rwlock_t lock;
    pthread_rwlock_t *shard_locks; /* readers gather or export, writers apply or write */
    uint64_t rows; /* written under the exclusive lock */
    _Atomic uint64_t pulls, pushes, imports, keys_pulled, keys_pushed, rows_created;
};

typedef struct scratch_item {
    em_device *device;
    void *pointer;
} scratch_item;

/* The slice of a request that one device handles. */
typedef struct segment {
    em_device *device;
    em_lane *lane;
    uint32_t first_shard, end_shard;
    uint64_t begin, count; /* range in the partitioned order */
    bool remote;           /* device is not the home device */
    uint64_t *keys;        /* count keys in device memory */
    const uint32_t *targets; /* direct pulls: where each key's vector goes in the output */
    uint64_t *rows;        /* count rows from find / insert */
    void *payload;         /* gradients, vectors or import values for the keys */
} segment;

typedef struct request_context {
    em_table *table;
    em_device *home;
    em_lane *home_lane;
    em_lane **lanes;           /* the request's lane on every device, by device index */
    scratch_item *scratch;
    uint32_t scratch_count, scratch_capacity;
    em_device_batch batch;     /* offsets, inverse, position, counts at home */
    const uint64_t *keys;      /* the batch keys at home */
    uint64_t *partitioned;     /* unique keys grouped by shard, at home */
    uint32_t *first;           /* first position of each unique key in the batch, at home */
    uint32_t *targets;         /* direct pulls: output position per partitioned key */
    uint64_t *shard_start;     /* host, shard_count + 1 */
    uint64_t *shard_missing;   /* host, shard_count */
    segment *segments;         /* one per device */
    uint64_t missing;          /* distinct keys not in the table */
} request_context;

/* ---- scratch and staging ----------------------------------------------------------- */

static em_status request_alloc(request_context *r, em_device *device, size_t bytes,
                               const char *what, void **out, em_error *err)
{
    if (r->scratch_count == r->scratch_capacity)
        return em_error_set(err, EM_INTERNAL, "request scratch list full (%u buffers)",
                            r->scratch_capacity);
    em_status status = em_device_alloc(device, bytes, what, out, err);
    if (status != EM_OK)
        return status;
    r->scratch[r->scratch_count++] = (scratch_item){device, *out};
    return EM_OK;
}

/* Takes a lane on every device, in device order (so two requests never wait on each
 * other's lanes crosswise). */
static em_status acquire_lanes(request_context *r, em_error *err)
{
    em_backend *backend = r->table->backend;
    for (uint32_t d = 0; d < backend->device_count; d++) {
        em_device *device = backend->devices[d];
        em_status status = device->ops->lane_acquire(device, &r->lanes[d], err);
        if (status != EM_OK)
            return em_error_prefix(err, "table '%s': lane on %s: ", r->table->config.name,
                                   device->name);
        if (device == r->home)
            r->home_lane = r->lanes[d];
    }
    return EM_OK;
}

static em_status request_begin(em_table *table, request_context *r, em_error *err)
{
    memset(r, 0, sizeof(*r));
    r->table = table;
    r->home = em_backend_home_device(table->backend);
    uint32_t devices = table->backend->device_count;
    r->scratch_capacity = SCRATCH_FIXED + SCRATCH_PER_DEVICE * devices;
    r->scratch = calloc(r->scratch_capacity, sizeof(*r->scratch));
    r->shard_start = calloc(table->shard_count + 1, sizeof(*r->shard_start));
    r->shard_missing = calloc(table->shard_count, sizeof(*r->shard_missing));
    r->segments = calloc(devices, sizeof(*r->segments));
    r->lanes = calloc(devices, sizeof(*r->lanes));
    if (r->scratch == NULL || r->shard_start == NULL || r->shard_missing == NULL ||
        r->segments == NULL || r->lanes == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "table '%s': request bookkeeping: "
                            "out of host memory", table->config.name);
    return acquire_lanes(r, err);
}

static void release_lanes(request_context *r)
{
    em_backend *backend = r->table->backend;
    for (uint32_t d = 0; r->lanes != NULL && d < backend->device_count; d++) {
        if (r->lanes[d] == NULL)
            continue;
        /* Scratch is freed next: nothing may still be reading or writing it. */
        r->lanes[d]->device->ops->synchronize(r->lanes[d], NULL);
        r->lanes[d]->device->ops->lane_release(r->lanes[d]);
    }
    free(r->lanes);
}

static void request_end(request_context *r)
{
    release_lanes(r);
    for (uint32_t i = r->scratch_count; i > 0; i--)
        em_device_free(r->scratch[i - 1].device, r->scratch[i - 1].pointer);
    free(r->scratch);
    free(r->shard_start);
    free(r->shard_missing);
    free(r->segments);
}

/* Makes host data visible at home: aliased when the home device addresses host memory,
 * else copied into scratch. */
static em_status stage_input(request_context *r, const void *host, size_t bytes,
                             const char *what, const void **out, em_error *err)
{
    if (r->home->host_addressable) {
        *out = host;
        return EM_OK;
    }
    void *staged = NULL;
    em_status status = request_alloc(r, r->home, bytes, what, &staged, err);
    if (status == EM_OK)
        status = r->home->ops->copy_to_device(r->home_lane, staged, host, bytes, err);
    *out = staged;
    return status;
}

/* ---- planning: dedupe, partition, segments ---------------------------------------- */

static em_status dedupe_keys(request_context *r, const uint64_t *host_keys, uint64_t nnz,
                             uint64_t **unique, em_error *err)
{
    em_device *home = r->home;
    uint32_t *inverse = NULL;
    em_status status = stage_input(r, host_keys, nnz * sizeof(uint64_t), "request keys",
                                   (const void **)&r->keys, err);
    if (status == EM_OK)
        status = request_alloc(r, home, nnz * sizeof(uint64_t), "unique keys", (void **)unique,
                               err);
    if (status == EM_OK)
        status = request_alloc(r, home, nnz * sizeof(uint32_t), "key inverse",
                               (void **)&inverse, err);
    if (status == EM_OK)
        status = request_alloc(r, home, nnz * sizeof(uint32_t), "first positions",
                               (void **)&r->first, err);
    if (status == EM_OK)
        status = home->ops->unique_keys(r->home_lane, r->keys, nnz, *unique, inverse, r->first,
                                        &r->batch.unique_count, err);
    r->batch.inverse = inverse;
    r->batch.nnz = nnz;
    return status;
}

static em_status partition_keys(request_context *r, const uint64_t *unique, bool want_targets,
                                em_error *err)
{
    em_device *home = r->home;
    uint64_t count = r->batch.unique_count;
    uint32_t *position = NULL;
    em_status status = request_alloc(r, home, count * sizeof(uint64_t), "partitioned keys",
                                      (void **)&r->partitioned, err);
    if (status == EM_OK)
        status = request_alloc(r, home, count * sizeof(uint32_t), "key positions",
                               (void **)&position, err);
    if (status == EM_OK && want_targets)
        status = request_alloc(r, home, count * sizeof(uint32_t), "output targets",
                               (void **)&r->targets, err);
    if (status == EM_OK)
        status = home->ops->partition_keys(r->home_lane, unique, count, r->table->shard_count,
                                           r->first, r->partitioned, position, r->targets,
                                           r->shard_start + 1, err);
    r->batch.position = position;
    if (status != EM_OK)
        return status;
    r->shard_start[0] = 0;
    for (uint32_t s = 0; s < r->table->shard_count; s++)
        r->shard_start[s + 1] += r->shard_start[s];
    return EM_OK;
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
static em_status scatter_to_segments(request_context *r, const void *home_array,
                                     size_t element_bytes, const char *what,
                                     void **(*pointer_of)(segment *), em_error *err)
{
    em_backend *backend = r->table->backend;
    em_transfer *transfers = calloc(backend->device_count, sizeof(*transfers));
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
        status = request_alloc(r, seg->device, bytes, what, pointer_of(seg), err);
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
static em_status gather_from_segments(request_context *r, void *home_array,
                                      size_t element_bytes, em_error *err)
{
    em_backend *backend = r->table->backend;
    em_transfer *transfers = calloc(backend->device_count, sizeof(*transfers));
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

static void **segment_payload(segment *seg)
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

static em_status find_keys(request_context *r, em_error *err)
{
    em_table *table = r->table;
    r->missing = 0;
    for (uint32_t d = 0; d < table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        if (seg->count == 0)
            continue;
        em_status status = request_alloc(r, seg->device, seg->count * sizeof(uint64_t),
                                         "key rows", (void **)&seg->rows, err);
        for (uint32_t s = seg->first_shard; status == EM_OK && s < seg->end_shard; s++) {
            uint64_t offset = shard_offset(r, seg, s);
            status = seg->device->ops->shard_find(table->shards[s], seg->lane, seg->keys + offset,
                                                  shard_key_count(r, s), seg->rows + offset,
                                                  &r->shard_missing[s], err);
            r->missing += r->shard_missing[s];
        }
        if (status != EM_OK)
            return status;
    }
    return EM_OK;
}

/* Stages the batch keys, dedupes, partitions, sends each device its keys and finds
 * them. Changes nothing in the table. want_targets asks for the output position of
 * every partitioned key (for gathering straight into a per-key output). */
static em_status plan_and_find(request_context *r, const uint64_t *host_keys, uint64_t nnz,
                               bool want_targets, em_error *err)
{
    uint64_t *unique = NULL;
    em_status status = dedupe_keys(r, host_keys, nnz, &unique, err);
    if (status == EM_OK)
        status = partition_keys(r, unique, want_targets, err);
    if (status != EM_OK)
        return status;
    plan_segments(r);
    status = scatter_to_segments(r, r->partitioned, sizeof(uint64_t), "segment keys",
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

static em_status check_capacity(const request_context *r, em_error *err)
{
    const em_table *table = r->table;
    if (r->missing <= table->config.capacity - table->rows)
        return EM_OK;
    char pools[256];
    describe_pools(table->backend, pools, sizeof(pools));
    return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                        "table '%s': capacity %" PRIu64 " rows would be exceeded: it holds %"
                        PRIu64 " rows and this request would create %" PRIu64
                        " new keys; nothing was applied (%s)",
                        table->config.name, table->config.capacity, table->rows, r->missing,
                        pools);
}

static em_status reserve_missing(request_context *r, em_error *err)
{
    em_table *table = r->table;
    for (uint32_t s = 0; s < table->shard_count; s++) {
        if (r->shard_missing[s] == 0)
            continue;
        em_device *device = table->shards[s]->device;
        em_lane *lane = r->lanes[table->shard_device[s]];
        em_status status = device->ops->shard_reserve(table->shards[s], lane, r->shard_missing[s],
                                                      err);
        if (status != EM_OK)
            return em_error_prefix(err, "table '%s' shard %u: cannot make room for %" PRIu64
                                   " new keys, nothing was applied: ",
                                   table->config.name, s, r->shard_missing[s]);
    }
    return EM_OK;
}

static em_status insert_missing(request_context *r, em_error *err)
{
    em_table *table = r->table;
    for (uint32_t d = 0; d < table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        for (uint32_t s = seg->first_shard; s < seg->end_shard; s++) {
            if (r->shard_missing[s] == 0)
                continue;
            uint64_t offset = shard_offset(r, seg, s);
            em_status status = seg->device->ops->shard_insert_missing(
                table->shards[s], seg->lane, seg->keys + offset, shard_key_count(r, s),
                seg->rows + offset, err);
            if (status != EM_OK)
                return em_error_prefix(err, "table '%s' shard %u: ", table->config.name, s);
            table->rows += r->shard_missing[s];
        }
    }
    atomic_fetch_add_explicit(&table->rows_created, r->missing, memory_order_relaxed);
    return EM_OK;
}

/* Creates every missing key, or nothing: capacity and memory are settled first. */
static em_status create_missing(request_context *r, em_error *err)
{
    if (r->missing == 0)
        return EM_OK;
    em_status status = check_capacity(r, err);
    if (status == EM_OK)
        status = reserve_missing(r, err);
    if (status == EM_OK)
        status = insert_missing(r, err);
    return status;
}

/* ---- per-shard work ---------------------------------------------------------------- */

typedef enum shard_work { WORK_GATHER, WORK_APPLY, WORK_WRITE } shard_work;

/* Runs one operation on every shard over its keys' rows and its part of the segment
 * payload (floats_per_key floats per key). */
static em_status run_on_shards(request_context *r, shard_work work, uint32_t floats_per_key,
                               em_error *err)
{
    em_table *table = r->table;
    for (uint32_t d = 0; d < table->backend->device_count; d++) {
        segment *seg = &r->segments[d];
        const em_device_ops *ops = seg->device->ops;
        for (uint32_t s = seg->first_shard; s < seg->end_shard; s++) {
            uint64_t offset = shard_offset(r, seg, s), n = shard_key_count(r, s);
            if (n == 0)
                continue;
            /* direct gathers place each vector by its target; others fill in order */
            const uint32_t *targets = seg->targets != NULL ? seg->targets + offset : NULL;
            float *payload = targets != NULL ? (float *)seg->payload
                                             : (float *)seg->payload + offset * floats_per_key;
            const uint64_t *rows = seg->rows + offset;
            em_status status = EM_OK;
            if (work == WORK_GATHER)
                pthread_rwlock_rdlock(&table->shard_locks[s]);
            else
                pthread_rwlock_wrlock(&table->shard_locks[s]);
            if (work == WORK_GATHER)
                status = ops->shard_gather(table->shards[s], seg->lane, rows, n, targets, payload,
                                           err);
            else if (work == WORK_APPLY)
                status = ops->shard_apply(table->shards[s], seg->lane, rows, n, payload, err);
            else
                status = ops->shard_write_rows(table->shards[s], seg->lane, rows, n, payload, err);
            pthread_rwlock_unlock(&table->shard_locks[s]);
            if (status != EM_OK)
                return em_error_prefix(err, "table '%s' shard %u: ", table->config.name, s);
        }
    }
    return EM_OK;
}

static em_status synchronize_devices(request_context *r, em_error *err)
{
    em_backend *backend = r->table->backend;
    for (uint32_t d = 0; d < backend->device_count; d++) {
        em_device *device = backend->devices[d];
        if (device != r->home && r->segments[d].count == 0)
            continue;
        em_status status = device->ops->synchronize(r->lanes[d], err);
        if (status != EM_OK)
            return status;
    }
    return EM_OK;
}

/* Allocates the payload of every remote segment (local ones alias home_array). */
static em_status prepare_payloads(request_context *r, float *home_array, uint32_t floats_per_key,
                                  const char *what, em_error *err)
{
    em_backend *backend = r->table->backend;
    for (uint32_t d = 0; d < backend->device_count; d++) {
        segment *seg = &r->segments[d];
        if (!seg->remote || seg->count == 0) {
            seg->payload = home_array + seg->begin * floats_per_key;
            continue;
        }
        em_status status = request_alloc(r, seg->device,
                                         seg->count * floats_per_key * sizeof(float), what,
                                         &seg->payload, err);
        if (status != EM_OK)
            return status;
    }
    return EM_OK;
}

/* ---- validation -------------------------------------------------------------------- */

static em_status check_batch(const em_csr *batch, em_combiner combiner, em_error *err)
{
    em_status status = em_combiner_check((int)combiner, err);
    if (status != EM_OK)
        return status;
    if (batch->nnz > MAX_KEYS_PER_REQUEST)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "batch of %" PRIu64 " keys exceeds %" PRIu32 " keys per request",
                            batch->nnz, MAX_KEYS_PER_REQUEST);
    if ((batch->offsets == NULL) || (batch->nnz > 0 && batch->keys == NULL))
        return em_error_set(err, EM_INVALID_ARGUMENT, "batch arrays are missing");
    return em_csr_validate(batch, err);
}

static uint64_t vector_floats(const em_table *table, const em_csr *batch, em_combiner combiner)
{
    return em_csr_output_vectors(batch, combiner) * table->config.dim;
}

/* ---- locking ---------------------------------------------------------------------- */

/* One attempt at a request under the table lock the caller holds. Without may_create, an
 * attempt that would create keys stops before changing anything and sets
 * *needs_create. */
typedef em_status (*locked_attempt)(em_table *table, const void *request, void *result,
                                    bool may_create, bool *needs_create, em_error *err);

/* Requests whose keys all exist share the table (each shard's rows are read or updated
 * under that shard's lock); one that must create keys runs again alone, because the
 * capacity check has to see the whole table. */
static em_status run_shared_then_exclusive(em_table *table, locked_attempt attempt,
                                           const void *request, void *result, em_error *err)
{
    bool needs_create = false;
    pthread_rwlock_rdlock(&table->lock);
    em_status status = attempt(table, request, result, false, &needs_create, err);
    pthread_rwlock_unlock(&table->lock);
    if (status == EM_OK && needs_create) {
        pthread_rwlock_wrlock(&table->lock);
        status = attempt(table, request, result, true, &needs_create, err);
        pthread_rwlock_unlock(&table->lock);
    }
    return status;
}

/* ---- pull ------------------------------------------------------------------------ */

static em_status stage_offsets(request_context *r, const em_csr *batch, em_error *err)
{
    r->batch.rows = batch->rows;
    return stage_input(r, batch->offsets, ((size_t)batch->rows + 1) * sizeof(uint32_t),
                       "request offsets", (const void **)&r->batch.offsets, err);
}

/* Gathers the vectors of every unique key into home memory, in partitioned order. */
static em_status gather_vectors(request_context *r, float **vectors, em_error *err)
{
    uint32_t dim = r->table->config.dim;
    em_status status = request_alloc(r, r->home, r->batch.unique_count * dim * sizeof(float),
                                     "gathered vectors", (void **)vectors, err);
    if (status == EM_OK)
        status = prepare_payloads(r, *vectors, dim, "segment vectors", err);
    if (status == EM_OK)
        status = run_on_shards(r, WORK_GATHER, dim, err);
    if (status == EM_OK)
        status = gather_from_segments(r, *vectors, dim * sizeof(float), err);
    return status;
}

/* A per-key pull whose shards all live on the home device gathers every vector straight
 * into its place in the output (no intermediate buffer, no combine pass). */
static bool pull_is_direct(const em_table *table, const request_context *r,
                           const em_pull_request *request)
{
    if (request->combiner != EM_COMBINER_NONE)
        return false;
    for (uint32_t s = 0; s < table->shard_count; s++)
        if (table->backend->devices[table->shard_device[s]] != r->home)
            return false;
    return true;
}

static em_status gather_direct(request_context *r, const em_pull_request *request, em_error *err)
{
    em_device *home = r->home;
    uint32_t dim = r->table->config.dim;
    size_t out_bytes = request->batch.nnz * dim * sizeof(float);
    float *out = request->out;
    em_status status = EM_OK;
    if (!home->host_addressable)
        status = request_alloc(r, home, out_bytes, "pull output", (void **)&out, err);
    for (uint32_t d = 0; status == EM_OK && d < r->table->backend->device_count; d++)
        r->segments[d].payload = out;
    if (status == EM_OK)
        status = run_on_shards(r, WORK_GATHER, dim, err);
    if (status == EM_OK && r->batch.unique_count < request->batch.nnz)
        status = home->ops->copy_repeats(r->home_lane, &r->batch, r->first, dim, out, err);
    if (status == EM_OK && !home->host_addressable)
        status = home->ops->copy_to_host(r->home_lane, request->out, out, out_bytes, err);
    return status;
}

static em_status combine_output(request_context *r, const em_pull_request *request,
                                const float *vectors, em_error *err)
{
    em_device *home = r->home;
    uint32_t dim = r->table->config.dim;
    size_t out_bytes = vector_floats(r->table, &request->batch, request->combiner) * sizeof(float);
    float *out = request->out;
    em_status status = EM_OK;
    if (!home->host_addressable)
        status = request_alloc(r, home, out_bytes, "pull output", (void **)&out, err);
    if (status == EM_OK)
        status = home->ops->combine(r->home_lane, &r->batch, request->combiner, dim, vectors, out,
                                    err);
    if (status == EM_OK && !home->host_addressable)
        status = home->ops->copy_to_host(r->home_lane, request->out, out, out_bytes, err);
    return status;
}

/* A pull attempt (locked_attempt). */
static em_status pull_locked(em_table *table, const void *untyped_request, void *untyped_result,
                             bool may_create, bool *needs_create, em_error *err)
{
    const em_pull_request *request = untyped_request;
    em_pull_result *result = untyped_result;
    request_context r;
    float *vectors = NULL;
    em_status status = request_begin(table, &r, err);
    bool direct = status == EM_OK && pull_is_direct(table, &r, request);
    if (status == EM_OK)
        status = stage_offsets(&r, &request->batch, err);
    if (status == EM_OK)
        status = plan_and_find(&r, request->batch.keys, request->batch.nnz, direct, err);
    if (status == EM_OK && r.missing > 0 && request->create_missing && !may_create) {
        *needs_create = true;
        request_end(&r);
        return EM_OK;
    }
    uint64_t missing = r.missing;
    if (status == EM_OK && request->create_missing)
        status = create_missing(&r, err);
    if (status == EM_OK && direct)
        status = gather_direct(&r, request, err);
    if (status == EM_OK && !direct)
        status = gather_vectors(&r, &vectors, err);
    if (status == EM_OK && !direct)
        status = combine_output(&r, request, vectors, err);
    if (status == EM_OK)
        status = synchronize_devices(&r, err);
    if (status == EM_OK) {
        result->unique_keys = r.batch.unique_count;
        result->missing = missing;
        result->created = request->create_missing ? missing : 0;
    }
    request_end(&r);
    return status;
}

static em_status check_pull(const em_table *table, const em_pull_request *request, em_error *err)
{
    em_status status = check_batch(&request->batch, request->combiner, err);
    if (status != EM_OK)
        return status;
    uint64_t needed = vector_floats(table, &request->batch, request->combiner);
    if (request->out == NULL || request->out_capacity < needed)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "output holds %" PRIu64 " floats, the pull needs %" PRIu64
                            " (%" PRIu64 " vectors x dim %u)",
                            request->out == NULL ? 0 : request->out_capacity, needed,
                            em_csr_output_vectors(&request->batch, request->combiner),
                            table->config.dim);
    return EM_OK;
}

em_status em_table_pull(em_table *table, const em_pull_request *request, em_pull_result *result,
                        em_error *err)
{
    em_status status = check_pull(table, request, err);
    if (status != EM_OK)
        return em_error_prefix(err, "pull from table '%s': ", table->config.name);
    status = run_shared_then_exclusive(table, pull_locked, request, result, err);
    if (status != EM_OK)
        return status;
    atomic_fetch_add_explicit(&table->pulls, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&table->keys_pulled, request->batch.nnz, memory_order_relaxed);
    return EM_OK;
}

/* ---- push ------------------------------------------------------------------------ */

/* Sums the batch's gradients per unique key at home (partitioned order) and hands each
 * segment its share. */
static em_status sum_and_send_gradients(request_context *r, const em_push_request *request,
                                        em_error *err)
{
    em_device *home = r->home;
    uint32_t dim = r->table->config.dim;
    const float *gradients = NULL;
    float *sums = NULL;
    em_status status = stage_input(r, request->gradients, request->gradient_count * sizeof(float),
                                   "request gradients", (const void **)&gradients, err);
    if (status == EM_OK)
        status = request_alloc(r, home, r->batch.unique_count * dim * sizeof(float),
                               "summed gradients", (void **)&sums, err);
    if (status == EM_OK)
        status = home->ops->sum_gradients(r->home_lane, &r->batch, request->combiner, dim,
                                          gradients, sums, err);
    if (status == EM_OK)
        status = scatter_to_segments(r, sums, dim * sizeof(float), "segment gradients",
                                     segment_payload, err);
    return status;
}

/* A push attempt (locked_attempt). */
static em_status push_locked(em_table *table, const void *untyped_request, void *untyped_result,
                             bool may_create, bool *needs_create, em_error *err)
{
    const em_push_request *request = untyped_request;
    em_push_result *result = untyped_result;
    request_context r;
    em_status status = request_begin(table, &r, err);
    if (status == EM_OK)
        status = stage_offsets(&r, &request->batch, err);
    if (status == EM_OK)
        status = plan_and_find(&r, request->batch.keys, request->batch.nnz, false, err);
    if (status == EM_OK && r.missing > 0 && !may_create) {
        *needs_create = true;
        request_end(&r);
        return EM_OK;
    }
    if (status == EM_OK)
        status = sum_and_send_gradients(&r, request, err);
    uint64_t missing = r.missing;
    if (status == EM_OK)
        status = create_missing(&r, err);
    if (status == EM_OK)
        status = run_on_shards(&r, WORK_APPLY, table->config.dim, err);
    if (status == EM_OK)
        status = synchronize_devices(&r, err);
    if (status == EM_OK) {
        result->updated = r.batch.unique_count;
        result->created = missing;
    }
    request_end(&r);
    return status;
}

static em_status check_push(const em_table *table, const em_push_request *request, em_error *err)
{
    em_status status = check_batch(&request->batch, request->combiner, err);
    if (status != EM_OK)
        return status;
    uint64_t expected = vector_floats(table, &request->batch, request->combiner);
    if (request->gradient_count != expected || (expected > 0 && request->gradients == NULL))
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "push carries %" PRIu64 " gradient floats, expected %" PRIu64
                            " (%" PRIu64 " %s x dim %u)",
                            request->gradient_count, expected,
                            em_csr_output_vectors(&request->batch, request->combiner),
                            request->combiner == EM_COMBINER_NONE ? "keys" : "rows",
                            table->config.dim);
    return em_csr_check_gradients(&request->batch, request->combiner, table->config.dim,
                                  request->gradients, err);
}

em_status em_table_push(em_table *table, const em_push_request *request, em_push_result *result,
                        em_error *err)
{
    em_status status = check_push(table, request, err);
    if (status != EM_OK)
        return em_error_prefix(err, "push to table '%s': ", table->config.name);
    status = run_shared_then_exclusive(table, push_locked, request, result, err);
    if (status != EM_OK)
        return status;
    atomic_fetch_add_explicit(&table->pushes, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&table->keys_pushed, request->batch.nnz, memory_order_relaxed);
    return EM_OK;
}

/* ---- import / export ------------------------------------------------------------- */

static em_status check_import_row(const em_table *table, uint64_t key, uint64_t index,
                                  const float *row, em_error *err)
{
    uint32_t dim = table->config.dim;
    em_optimizer_kind kind = table->config.optimizer.kind;
    for (uint32_t j = 0; j < table->row_floats; j++) {
        bool weight = j < dim;
        uint32_t state_index = j - dim;
        const char *what = weight ? "weight" : em_optimizer_state_name(kind, dim, state_index);
        if (!isfinite(row[j]))
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "row %" PRIu64 " (key %" PRIu64 "): %s element %u is not finite",
                                index, key, what, weight ? j : state_index);
        if (!weight && row[j] < 0 && em_optimizer_state_nonnegative(kind, dim, state_index))
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "row %" PRIu64 " (key %" PRIu64 "): %s element %u is %g, must "
                                "be >= 0", index, key, what, state_index, (double)row[j]);
    }
    return EM_OK;
}

static em_status check_import(const em_table *table, const uint64_t *keys, const float *values,
                              uint64_t n, em_error *err)
{
    if (n > MAX_KEYS_PER_REQUEST)
        return em_error_set(err, EM_INVALID_ARGUMENT, "import of %" PRIu64 " rows exceeds %"
                            PRIu32 " rows per call", n, MAX_KEYS_PER_REQUEST);
    for (uint64_t i = 0; i < n; i++) {
        em_status status =
            check_import_row(table, keys[i], i, values + i * table->row_floats, err);
        if (status != EM_OK)
            return status;
    }
    return EM_OK;
}

/* Keys of an import are distinct; inverse[i] == i for all i exactly then (unique keeps
 * the order of first appearance). */
static em_status check_distinct(request_context *r, const uint64_t *keys, uint64_t n,
                                em_error *err)
{
    if (r->batch.unique_count == n)
        return EM_OK;
    const uint32_t *inverse = r->batch.inverse;
    uint32_t *host_inverse = NULL;
    if (!r->home->host_addressable) {
        host_inverse = malloc(n * sizeof(*host_inverse));
        if (host_inverse == NULL)
            return em_error_set(err, EM_RESOURCE_EXHAUSTED, "import: out of host memory");
        em_status status = r->home->ops->copy_to_host(r->home_lane, host_inverse, inverse,
                                                      n * sizeof(*host_inverse), err);
        if (status != EM_OK) {
            free(host_inverse);
            return status;
        }
        inverse = host_inverse;
    }
    uint64_t i = 0;
    while (i < n && inverse[i] == i)
        i++;
    em_status status = em_error_set(err, EM_INVALID_ARGUMENT,
                                    "key %" PRIu64 " appears twice (rows %u and %" PRIu64 ")",
                                    keys[i], inverse[i], i);
    free(host_inverse);
    return status;
}

/* Identity offsets (one key per row) so the gradient-sum operation places import rows
 * in partitioned order; sums start at -0.0, so single values are copied bit for bit. */
static em_status stage_identity_offsets(request_context *r, uint64_t n, em_error *err)
{
    uint32_t *offsets = malloc((n + 1) * sizeof(*offsets));
    if (offsets == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "import: out of host memory");
    for (uint64_t i = 0; i <= n; i++)
        offsets[i] = (uint32_t)i;
    em_csr identity = {.rows = (uint32_t)n, .nnz = n, .offsets = offsets};
    em_status status = EM_OK;
    if (r->home->host_addressable) {
        /* Aliased staging would outlive this buffer: copy into scratch instead. */
        void *copy = NULL;
        status = request_alloc(r, r->home, (n + 1) * sizeof(uint32_t), "import offsets", &copy,
                               err);
        if (status == EM_OK)
            memcpy(copy, offsets, (n + 1) * sizeof(uint32_t));
        r->batch.rows = (uint32_t)n;
        r->batch.offsets = copy;
    } else {
        status = stage_offsets(r, &identity, err);
    }
    free(offsets);
    return status;
}

static em_status send_import_rows(request_context *r, const float *values, uint64_t n,
                                  em_error *err)
{
    em_device *home = r->home;
    uint32_t width = r->table->row_floats;
    const float *staged = NULL;
    float *ordered = NULL;
    em_status status = stage_identity_offsets(r, n, err);
    if (status == EM_OK)
        status = stage_input(r, values, n * width * sizeof(float), "import values",
                             (const void **)&staged, err);
    if (status == EM_OK)
        status = request_alloc(r, home, n * width * sizeof(float), "ordered import values",
                               (void **)&ordered, err);
    if (status == EM_OK)
        status = home->ops->sum_gradients(r->home_lane, &r->batch, EM_COMBINER_NONE, width,
                                          staged, ordered, err);
    if (status == EM_OK)
        status = scatter_to_segments(r, ordered, width * sizeof(float), "segment import values",
                                     segment_payload, err);
    return status;
}

static em_status import_locked(em_table *table, const uint64_t *keys, const float *values,
                               uint64_t n, em_error *err)
{
    request_context r;
    em_status status = request_begin(table, &r, err);
    if (status == EM_OK)
        status = plan_and_find(&r, keys, n, false, err);
    if (status == EM_OK)
        status = check_distinct(&r, keys, n, err);
    if (status == EM_OK)
        status = send_import_rows(&r, values, n, err);
    if (status == EM_OK)
        status = create_missing(&r, err);
    if (status == EM_OK)
        status = run_on_shards(&r, WORK_WRITE, table->row_floats, err);
    if (status == EM_OK)
        status = synchronize_devices(&r, err);
    request_end(&r);
    return status;
}

em_status em_table_import(em_table *table, const uint64_t *keys, const float *values, uint64_t n,
                          em_error *err)
{
    em_status status = check_import(table, keys, values, n, err);
    if (status == EM_OK) {
        pthread_rwlock_wrlock(&table->lock);
        status = import_locked(table, keys, values, n, err);
        pthread_rwlock_unlock(&table->lock);
    }
    if (status != EM_OK)
        return em_error_prefix(err, "import into table '%s': ", table->config.name);
    atomic_fetch_add_explicit(&table->imports, 1, memory_order_relaxed);
    return EM_OK;
}

em_status em_table_export(em_table *table, em_table_cursor *cursor, uint64_t max, uint64_t *keys,
                          float *values, uint64_t *count, em_error *err)
{
    *count = 0;
    em_status status = EM_OK;
    pthread_rwlock_rdlock(&table->lock);
    while (status == EM_OK && *count == 0 && cursor->shard < table->shard_count && max > 0) {
        em_shard *shard = table->shards[cursor->shard];
        const em_device_ops *ops = shard->device->ops;
        em_lane *lane = NULL;
        status = ops->lane_acquire(shard->device, &lane, err);
        if (status != EM_OK)
            break;
        pthread_rwlock_rdlock(&table->shard_locks[cursor->shard]);
        status = ops->shard_export(shard, lane, &cursor->position, keys, values, max, count, err);
        pthread_rwlock_unlock(&table->shard_locks[cursor->shard]);
        ops->lane_release(lane);
        if (status == EM_OK && *count == 0) {
            cursor->shard++;
            cursor->position = 0;
        }
    }
    pthread_rwlock_unlock(&table->lock);
    if (status != EM_OK)
        return em_error_prefix(err, "export of table '%s' shard %u: ", table->config.name,
                               cursor->shard);
    return EM_OK;
}

/* ---- lifecycle and stats --------------------------------------------------------- */

static em_status create_shards(em_table *table, em_error *err)
{
    table->shards = calloc(table->shard_count, sizeof(*table->shards));
    table->shard_device = calloc(table->shard_count, sizeof(*table->shard_device));
    table->shard_locks = calloc(table->shard_count, sizeof(*table->shard_locks));
    if (table->shards == NULL || table->shard_device == NULL || table->shard_locks == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "table '%s': out of host memory",
                            table->config.name);
    for (uint32_t s = 0; s < table->shard_count; s++)
        pthread_rwlock_init(&table->shard_locks[s], NULL);
    for (uint32_t s = 0; s < table->shard_count; s++) {
        uint32_t d = em_backend_shard_device(table->backend, s, table->shard_count);
        em_device *device = table->backend->devices[d];
        em_shard_spec spec = {
            .table = table->config.name,
            .index = s,
            .dim = table->config.dim,
            .expected_rows = table->config.capacity / table->shard_count,
            .optimizer = table->config.optimizer,
            .initializer = table->config.initializer,
        };
        table->shard_device[s] = d;
        em_status status = device->ops->shard_create(device, &spec, &table->shards[s], err);
        if (status != EM_OK)
            return em_error_prefix(err, "table '%s' shard %u on %s: ", table->config.name, s,
                                   device->name);
    }
    return EM_OK;
}

em_status em_table_create(em_backend *backend, const em_table_config *config, em_table **out,
                          em_error *err)
{
    em_status status = em_table_config_validate(config, err);
    if (status != EM_OK)
        return status;
    em_table *table = calloc(1, sizeof(*table));
    if (table == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "table '%s': out of host memory",
                            config->name);
    table->config = *config;
    table->backend = backend;
    if (table->config.shards == 0)
        table->config.shards = backend->device_count;
    table->shard_count = table->config.shards;
    table->row_floats =
        config->dim + em_optimizer_state_floats(config->optimizer.kind, config->dim);
    pthread_rwlockattr_t attributes;
    pthread_rwlockattr_init(&attributes);
    /* Writers (pushes) must not starve behind a steady stream of pulls. */
    pthread_rwlockattr_setkind_np(&attributes, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&table->lock, &attributes);
    pthread_rwlockattr_destroy(&attributes);
    status = create_shards(table, err);
    if (status != EM_OK) {
        em_table_destroy(table);
        return status;
    }
    *out = table;
    return EM_OK;
}

void em_table_destroy(em_table *table)
{
    if (table == NULL)
        return;
    for (uint32_t s = 0; table->shards != NULL && s < table->shard_count; s++)
        if (table->shards[s] != NULL)
            table->shards[s]->device->ops->shard_destroy(table->shards[s]);
    for (uint32_t s = 0; table->shard_locks != NULL && s < table->shard_count; s++)
        pthread_rwlock_destroy(&table->shard_locks[s]);
    free(table->shard_locks);
    free(table->shards);
    free(table->shard_device);
    pthread_rwlock_destroy(&table->lock);
    free(table);
}

const em_table_config *em_table_get_config(const em_table *table)
{
    return &table->config;
}

const char *em_table_name(const em_table *table)
{
    return table->config.name;
}

uint32_t em_table_dim(const em_table *table)
{
    return table->config.dim;
}

void em_table_get_stats(em_table *table, em_table_stats *out)
{
    memset(out, 0, sizeof(*out));
    pthread_rwlock_rdlock(&table->lock);
    for (uint32_t s = 0; s < table->shard_count; s++) {
        em_shard_stats shard;
        table->shards[s]->device->ops->shard_stats(table->shards[s], &shard);
        out->row_bytes += shard.row_bytes;
        out->index_bytes += shard.index_bytes;
    }
    out->rows = table->rows;
    pthread_rwlock_unlock(&table->lock);
    out->capacity = table->config.capacity;
    out->dim = table->config.dim;
    out->shards = table->shard_count;
    out->row_floats = table->row_floats;
    out->pulls = atomic_load_explicit(&table->pulls, memory_order_relaxed);
    out->pushes = atomic_load_explicit(&table->pushes, memory_order_relaxed);
    out->imports = atomic_load_explicit(&table->imports, memory_order_relaxed);
    out->keys_pulled = atomic_load_explicit(&table->keys_pulled, memory_order_relaxed);
    out->keys_pushed = atomic_load_explicit(&table->keys_pushed, memory_order_relaxed);
    out->rows_created = atomic_load_explicit(&table->rows_created, memory_order_relaxed);
}
