/*
 * DESIGN: a table: its shards over the backend's devices, its locks, pull and push.
 *
 * Requests whose keys all exist share the table (each shard's rows are read or updated
 * under that shard's lock); one that must create keys runs again alone, because the
 * capacity check has to see the whole table. The request engine that runs a request
 * over shards and devices is lib/table/table_request.c; import and export are
 * lib/table/table_transfer.c.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/keyhash.h"
#include "common/row_check.h"
#include "lib/base/parallel.h"
#include "lib/table/table_internal.h"

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

/* What the shared attempt tells the exclusive one. */
typedef struct attempt_state {
    bool needs_create; /* it stopped: keys must be created */
    bool admission_run; /* its admission counted the missing keys' sightings */
    bool made_room;     /* the exclusive attempt evicted rows to make room */
    uint64_t access_stamp; /* the last attempt's (em__request_begin_stamped) */
} attempt_state;

/* One attempt at a request under the table lock the caller holds. Without may_create
 * (the shared lock), an attempt creates its missing keys only within the capacity it
 * could claim (em__claim_rows); one that could not claim it stops before changing
 * anything else and sets needs_create. Keys that admission refuses are never created. */
typedef em_status (*locked_attempt)(em_table *table, const void *request, void *result,
                                    bool may_create, attempt_state *state, em_error *err);

/* Requests share the table (each shard's rows are read, created or updated under that
 * shard's lock), those that create keys too while the table has room for them; one that
 * needs room made (eviction) or refused whole at capacity runs again alone, because
 * choosing what to evict, or answering that the table is full, has to see the whole
 * table. Once ALONE_AFTER requests of a kind in a row made room (making_room: the
 * table's pulls_making_room or pushes_making_room), the next ones take the exclusive
 * lock from the start, saving the attempt beside the others that would only find the
 * table full; the first of them that makes no room sends the next ones beside the
 * others again. Either way the request does the same. */
#define ALONE_AFTER 4

static em_status run_shared_then_exclusive(em_table *table, locked_attempt attempt,
                                           _Atomic uint32_t *making_room, const void *request,
                                           void *result, em_error *err)
{
    attempt_state state = {false, false, false, 0};
    bool alone_first = atomic_load_explicit(making_room, memory_order_relaxed) >= ALONE_AFTER;
    em_status status = EM_OK;
    if (alone_first) {
        atomic_fetch_add_explicit(&table->requests_alone_first, 1, memory_order_relaxed);
    } else {
        em_spread_lock_read(&table->lock);
        status = attempt(table, request, result, false, &state, err);
        em_spread_unlock_read(&table->lock);
        if (status == EM_OK && state.needs_create)
            atomic_fetch_add_explicit(&table->exclusive_retries, 1, memory_order_relaxed);
    }
    if (status == EM_OK && (alone_first || state.needs_create)) {
        em_spread_lock_write(&table->lock);
        status = attempt(table, request, result, true, &state, err);
        em_spread_unlock_write(&table->lock);
    }
    if (status == EM_OK && state.made_room) {
        uint32_t seen = atomic_load_explicit(making_room, memory_order_relaxed);
        if (seen < ALONE_AFTER) /* no further: it only says whether the next go alone */
            atomic_store_explicit(making_room, seen + 1, memory_order_relaxed);
    } else if (status == EM_OK && atomic_load_explicit(making_room, memory_order_relaxed) != 0) {
        atomic_store_explicit(making_room, 0, memory_order_relaxed); /* a write only then */
    }
    return status;
}

/* Admission of the missing keys, once per request: in the shared attempt, which counts
 * their sightings, or in the exclusive one when the shared attempt did not get that far
 * (it then only reads the counts, which already hold this request's sightings). Then,
 * in the shared attempt, keys left to create are created there when the table has room
 * for them (em__claim_rows); else the attempt stops, to run again alone (eviction, or
 * the capacity refusal, needs the whole table). */
static em_status admit(request_context *r, bool may_create, attempt_state *state,
                       em_error *err)
{
    em_status status = em__admit_missing(r, !state->admission_run, err);
    state->admission_run = true;
    if (status == EM_OK && r->missing > 0 && !may_create &&
        (r->find_stopped || !em__claim_rows(r)))
        state->needs_create = true;
    return status;
}

/* A shared attempt that would create every key it misses (admission always) stops its
 * find once more keys are missing than the table has room for: it runs again alone
 * whatever the other shards hold, so a full table's creating requests do not look up
 * every key twice. */
static void stop_finding_when_full(request_context *r, bool may_create, bool creates)
{
    r->stop_when_full = !may_create && creates &&
                        r->table->config.admission.policy == EM_ADMISSION_ALWAYS;
}

/* A shared attempt that found at once `absent` keys missing, every one of which it would
 * create (admission `always`), when the table has no room for them: it can only run
 * again alone, so it stops there (state->needs_create), before it looks its keys up
 * again the general way. */
static bool goes_alone(request_context *r, bool may_create, uint64_t absent,
                       attempt_state *state)
{
    if (may_create || absent == 0 ||
        r->table->config.admission.policy != EM_ADMISSION_ALWAYS ||
        absent <= em__room_left(r->table))
        return false;
    state->needs_create = true;
    return true;
}

/* ---- pull ------------------------------------------------------------------------ */

/* A pull's buffers, all taken before the pull creates any key, so that running out of
 * memory for them leaves the table as it was. */
typedef struct pull_buffers {
    float *out;     /* the output on the home device (request->out when host-addressable) */
    float *vectors; /* the gathered vectors, in partitioned order (not for direct pulls) */
} pull_buffers;

/* A per-key pull whose shards all live on the home device gathers every vector straight
 * into its place in the output (no intermediate buffer, no combine pass). */
static bool pull_is_direct(const request_context *r, const em_pull_request *request)
{
    return request->combiner == EM_COMBINER_NONE && em__shards_at_home(r);
}

static em_status take_pull_buffers(request_context *r, const em_pull_request *request,
                                   bool direct, float *out_ready, pull_buffers *b,
                                   em_error *err)
{
    em_device *home = r->home;
    uint32_t dim = r->table->config.dim;
    uint64_t out_floats = direct ? request->batch.nnz * dim
                                 : vector_floats(r->table, &request->batch, request->combiner);
    b->out = out_ready != NULL ? out_ready : request->out;
    b->vectors = NULL;
    em_status status = EM_OK;
    if (!home->host_addressable && out_ready == NULL)
        status = em__request_alloc(r, home, out_floats * sizeof(float), "pull output",
                                   (void **)&b->out, err);
    if (status == EM_OK && direct)
        for (uint32_t d = 0; d < r->table->backend->device_count; d++)
            r->segments[d].payload = b->out;
    if (status == EM_OK && !direct)
        status = em__request_alloc(r, home, r->batch.unique_count * dim * sizeof(float),
                                   "gathered vectors", (void **)&b->vectors, err);
    if (status == EM_OK && !direct)
        status = em__prepare_payloads(r, b->vectors, dim, "segment vectors", err);
    return status;
}

/* Gathers every vector straight into the output, repeats included. */
static em_status gather_direct(request_context *r, const em_pull_request *request,
                               const pull_buffers *b, em_error *err)
{
    em_device *home = r->home;
    uint32_t dim = r->table->config.dim;
    em_status status = em__run_on_shards(r, WORK_GATHER, dim, err);
    if (status == EM_OK && r->batch.unique_count < request->batch.nnz)
        status = home->ops->copy_repeats(r->home_lane, &r->batch, r->first, dim, b->out, err);
    return status;
}

/* Gathers the vectors of every unique key into home memory, in partitioned order, and
 * combines them into the output. */
static em_status gather_and_combine(request_context *r, const em_pull_request *request,
                                    const pull_buffers *b, em_error *err)
{
    uint32_t dim = r->table->config.dim;
    em_status status = em__run_on_shards(r, WORK_GATHER, dim, err);
    if (status == EM_OK)
        status = em__gather_from_segments(r, b->vectors, dim * sizeof(float), err);
    if (status == EM_OK)
        status = r->home->ops->combine(r->home_lane, &r->batch, request->combiner, dim,
                                       b->vectors, b->out, err);
    return status;
}

static em_status copy_output(request_context *r, const em_pull_request *request, bool direct,
                             const pull_buffers *b, em_error *err)
{
    em_device *home = r->home;
    if (home->host_addressable)
        return EM_OK;
    uint32_t dim = r->table->config.dim;
    uint64_t out_floats = direct ? request->batch.nnz * dim
                                 : vector_floats(r->table, &request->batch, request->combiner);
    return home->ops->copy_to_host(r->home_lane, request->out, b->out,
                                   out_floats * sizeof(float), err);
}

/* Whether a request of nnz keys goes at once (pull_at_once, push_at_once): a table whose
 * shards are all on the request's home device, a device that keeps counts on the GPU. */
static bool may_run_at_once(const request_context *r, uint64_t nnz)
{
    const em_device_ops *ops = r->home->ops;
    return em__shards_at_home(r) && nnz > 0 && ops->unique_keys_async != NULL &&
           ops->copy_to_host_later != NULL;
}

/* Whether requests of a table go at once now (em_table: pulls_go_general). */
static bool at_once_now(const em_table *table, _Atomic bool *go_general)
{
    return table->shard_count == 1 || !atomic_load_explicit(go_general, memory_order_relaxed);
}

/* A request that went the general way found missing keys or none: the next ones try at
 * once again when it found none. */
static void note_general_find(em_table *table, _Atomic bool *go_general, uint64_t missing)
{
    if (table->shard_count > 1 && missing == 0 &&
        atomic_load_explicit(go_general, memory_order_relaxed))
        atomic_store_explicit(go_general, false, memory_order_relaxed);
}

/* A request that went at once found `absent` of its keys missing: none, and the table's
 * requests of its kind stop creating keys at once (create); some that it could have
 * created but did not try to, and the next ones create at once; else, when may_go_general,
 * a table of several shards sends the next ones the general way from the start. */
static void note_at_once_find(em_table *table, _Atomic bool *create, _Atomic bool *go_general,
                              uint64_t absent, bool creatable, bool may_go_general)
{
    bool creating = atomic_load_explicit(create, memory_order_relaxed);
    if (absent == 0) {
        if (creating)
            atomic_store_explicit(create, false, memory_order_relaxed);
    } else if (creatable && !creating) {
        atomic_store_explicit(create, true, memory_order_relaxed);
    } else if (may_go_general && table->shard_count > 1) {
        atomic_store_explicit(go_general, true, memory_order_relaxed);
    }
}

static bool pull_may_run_at_once(const request_context *r, const em_pull_request *request)
{
    return r->home->ops->shards_pull_async != NULL && may_run_at_once(r, request->batch.nnz) &&
           at_once_now(r->table, &r->table->pulls_go_general);
}

/* What a request that goes at once dedupes its keys into, on the home device. */
typedef struct at_once_keys {
    uint64_t *unique;     /* nnz: the distinct keys, in order of first appearance */
    uint32_t *inverse;    /* nnz */
    uint32_t *first;      /* nnz: where each distinct key first appears */
    uint64_t *rows;       /* nnz: the find's rows */
    const uint32_t *count; /* device word: the distinct keys (unique_keys_async) */
} at_once_keys;

/* Stages a request's batch (offsets only to pool: r->batch.rows in any case), takes the
 * buffers of its dedupe and find, and enqueues the dedupe. */
static em_status dedupe_at_once(request_context *r, const em_csr *batch, em_combiner combiner,
                                at_once_keys *k, em_error *err)
{
    em_device *home = r->home;
    uint64_t nnz = batch->nnz;
    r->batch.rows = batch->rows;
    em_status status = combiner == EM_COMBINER_NONE ? EM_OK : em__stage_offsets(r, batch, err);
    if (status == EM_OK)
        status = em__stage_input(r, batch->keys, nnz * sizeof(uint64_t), "request keys",
                                 (const void **)&r->keys, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, nnz * sizeof(uint64_t), "unique keys",
                                   (void **)&k->unique, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, nnz * sizeof(uint32_t), "key inverse",
                                   (void **)&k->inverse, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, nnz * sizeof(uint32_t), "first positions",
                                   (void **)&k->first, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, nnz * sizeof(uint64_t), "key rows",
                                   (void **)&k->rows, err);
    if (status == EM_OK)
        status = home->ops->unique_keys_async(r->home_lane, r->keys, nnz, k->unique, k->inverse,
                                              k->first, &k->count, err);
    return status;
}

/* Whether a request that goes at once may create the keys it finds absent there
 * (pull_at_once, push_at_once): every key it creates is stored (admission `always`)
 * and its device can. */
static bool creates_at_once(const request_context *r)
{
    const em_device_ops *ops = r->home->ops;
    return r->table->config.admission.policy == EM_ADMISSION_ALWAYS &&
           ops->shard_reserve != NULL && ops->shard_insert_settle != NULL;
}

/* Room in each shard for the batch's keys that fall in it (make_room_at_once), on the
 * lane of the shard's device; the counts stay in r->shard_missing for settle_created. */
static bool reserve_at_once(request_context *r, const em_csr *batch)
{
    em_table *table = r->table;
    uint64_t *per_shard = r->shard_missing; /* host scratch of shard_count words */
    memset(per_shard, 0, table->shard_count * sizeof(uint64_t));
    if (table->shard_count == 1)
        per_shard[0] = batch->nnz;
    else
        for (uint64_t i = 0; i < batch->nnz; i++)
            per_shard[em_key_shard(batch->keys[i], table->shard_count)]++;
    em_error ignored;
    for (uint32_t s = 0; s < table->shard_count; s++) {
        em_lane *lane = r->lanes[table->shard_device[s]];
        if (per_shard[s] > 0 &&
            lane->device->ops->shard_reserve(table->shards[s], lane, per_shard[s], 0,
                                             &ignored) != EM_OK)
            return false;
    }
    return true;
}

/* Makes a request at once ready to create the keys it finds absent, before it enqueues
 * anything (growing a shard synchronizes the lane, which ends a dedupe's count):
 * takes every shard's write lock, claims capacity for every key of the batch from the
 * table without evicting (em__claim_capacity), and makes room in each shard for the
 * batch's keys that fall in it (shard_reserve). *rows_before gets the rows the shards
 * hold (settle_created). False, with nothing held, when there is not that much room or
 * the table is being saved (the request then only finds): a full table evicts, and
 * memory too short for the whole batch may still do for the keys actually absent, the
 * general way. */
static bool make_room_at_once(request_context *r, const em_csr *batch, uint64_t *rows_before)
{
    em_table *table = r->table;
    em__lock_all_shards(table, true);
    bool room = !atomic_load_explicit(&table->saving, memory_order_relaxed) &&
                em__claim_capacity(r, batch->nnz) && reserve_at_once(r, batch);
    if (!room) {
        em__release_claim(r);
        em__unlock_all_shards(table);
        return false;
    }
    *rows_before = em__stored_rows(table);
    return true;
}

/* Takes in what a request at once that created keys changed: each shard's counters
 * (shard_insert_settle, after the lane's synchronisation) and the table's rows, by the
 * shards' rows before (make_room_at_once) and after, which also holds when the request
 * failed on the way. Then releases the claim and the locks. */
static em_status settle_created(request_context *r, uint64_t rows_before, em_error *err)
{
    em_table *table = r->table;
    em_status status = EM_OK;
    for (uint32_t s = 0; s < table->shard_count; s++) { /* every shard's counters came back */
        em_error later;
        em_status settled = table->shards[s]->device->ops->shard_insert_settle(
            table->shards[s], status == EM_OK ? err : &later);
        if (status == EM_OK && settled != EM_OK)
            status = em_error_prefix(err, "table '%s' shard %u: ", table->config.name, s);
        if (r->shard_missing[s] != 0) /* make_room_at_once: keys of the batch fall there */
            atomic_fetch_add_explicit(&table->shard_creations[s].value, 1, memory_order_relaxed);
    }
    uint64_t rows = em__stored_rows(table);
    uint64_t created = rows > rows_before ? rows - rows_before : 0;
    if (created > 0) {
        em__rows_added(table, created);
        atomic_fetch_add_explicit(&table->rows_created, created, memory_order_relaxed);
    }
    em__release_claim(r);
    em__unlock_all_shards(table);
    return status;
}

/* A pull that found every key in its one wait: its answer, and the table's count. */
static em_status pull_served_at_once(em_table *table, uint32_t unique_count,
                                     em_pull_result *result, bool *done)
{
    result->unique_keys = unique_count;
    result->missing = 0;
    result->created = 0;
    atomic_fetch_add_explicit(&table->pulls_at_once, 1, memory_order_relaxed);
    *done = true;
    return EM_OK;
}

/* A pull starts at once: dedupe, find, output and touch are enqueued together, one
 * kernel of each over all of the table's shards, and the counts come back with the
 * output (device.h: shards_pull_async), so a pull of keys that are all stored, the
 * steady state of training, waits once for the GPU. A pull of a table whose pulls
 * create keys (pulls_create) creates them there too, with room made first for every
 * key of the batch (make_room_at_once), holding the shards' write locks until the
 * GPU is done. Otherwise, when some key is not stored (*done stays false), nothing was
 * touched, and the request goes on the general way, which creates the keys and writes
 * the whole output again: for a one-shard table it is planned from what was found
 * (em__plan_found; *out_ready is the output's buffer), for several shards it starts
 * again with the scratch given back. */
static em_status pull_at_once(request_context *r, const em_pull_request *request,
                              em_pull_result *result, bool *done, float **out_ready,
                              uint64_t *found_absent, em_error *err)
{
    em_table *table = r->table;
    em_device *home = r->home;
    const em_device_ops *ops = home->ops;
    uint64_t nnz = request->batch.nnz;
    uint64_t out_floats = vector_floats(table, &request->batch, request->combiner);
    request_mark mark = em__request_mark(r);
    at_once_keys k = {0};
    uint64_t *missing = NULL;
    float *out = NULL;
    uint64_t seen = 0;
    bool creatable = request->create_missing && creates_at_once(r);
    uint64_t rows_before = 0;
    bool create = creatable && atomic_load_explicit(&table->pulls_create, memory_order_relaxed) &&
                  make_room_at_once(r, &request->batch, &rows_before);
    *done = false;
    em_status status = dedupe_at_once(r, &request->batch, request->combiner, &k, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, sizeof(uint64_t), "missing count",
                                   (void **)&missing, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, out_floats * sizeof(float), "pull output",
                                   (void **)&out, err);
    if (status == EM_OK) {
        em_device_batch batch = {.rows = request->batch.rows,
                                 .nnz = nnz,
                                 .offsets = r->batch.offsets,
                                 .inverse = k.inverse};
        uint32_t updated =
            (uint32_t)atomic_load_explicit(&table->update_clock, memory_order_relaxed);
        if (!create) /* creating, every write lock is held until the shards are settled */
            em__lock_all_shards(table, false);
        seen = atomic_load_explicit(&table->shard_creations[0].value, memory_order_relaxed);
        status = ops->shards_pull_async(table->shards, table->shard_count, r->home_lane, &batch,
                                        request->combiner, k.unique, k.count, create, k.rows,
                                        missing, out, r->access_stamp, updated, err);
        if (!create)
            em__unlock_all_shards(table);
    }
    uint64_t absent = UINT64_MAX;
    uint32_t unique_count = 0;
    if (status == EM_OK)
        status = ops->copy_to_host_later(r->home_lane, &absent, missing, sizeof(absent), err);
    if (status == EM_OK)
        status = ops->copy_to_host_later(r->home_lane, &unique_count, k.count,
                                         sizeof(unique_count), err);
    if (status == EM_OK) /* ends with the lane's synchronisation: the counts are in */
        status = ops->copy_to_host(r->home_lane, request->out, out, out_floats * sizeof(float),
                                   err);
    if (create) { /* the keys created are in the shards, whatever else failed */
        em_error later;
        if (status != EM_OK)
            (void)ops->synchronize(r->home_lane, &later);
        em_status settled = settle_created(r, rows_before, status == EM_OK ? err : &later);
        if (status == EM_OK)
            status = settled;
    }
    if (status != EM_OK) { /* the counts' reads back land here, not in a later frame */
        em_error ignored;
        (void)ops->synchronize(r->home_lane, &ignored);
        return em_error_prefix(err, "table '%s': ", table->config.name);
    }
    if (create) { /* what it found absent it created */
        note_at_once_find(table, &table->pulls_create, &table->pulls_go_general, absent, false,
                          false);
        result->unique_keys = unique_count;
        result->missing = absent;
        result->created = absent;
        atomic_fetch_add_explicit(&table->pulls_at_once, 1, memory_order_relaxed);
        *done = true;
        return EM_OK;
    }
    note_at_once_find(table, &table->pulls_create, &table->pulls_go_general, absent, creatable,
                      true);
    *found_absent = absent;
    if (absent != 0 && table->shard_count > 1) {
        em__request_rewind(r, &mark);
        return EM_OK;
    }
    if (absent != 0) {
        em__plan_found(r, nnz, k.unique, k.inverse, k.first, k.rows, unique_count, absent, seen,
                       request->combiner == EM_COMBINER_NONE);
        *out_ready = out;
        return EM_OK;
    }
    return pull_served_at_once(table, unique_count, result, done);
}

/* A pull spread over the devices of a table (pull_spread) sends every device that is not
 * home a bucket of room for all of the request's keys, and gets back as many vectors,
 * since how many are its own is known only on the GPU (a push, push_spread, sends as
 * many gradient sums instead): at most this many bytes in all, else it goes the general
 * way, which sends each device its keys only. */
#define SPREAD_MAX_BYTES ((uint64_t)8 << 20)

/* The devices holding the table's shards, in device order (devices[i], backend indices),
 * and the shards each holds; 0 when there are more of them than a spread takes, or when
 * a device's shards do not number a key's shard as the table does. A device's kernels
 * take a key's shard among its own k to be em_key_shard(key, k), the hash mod k: the
 * table's shard (the hash mod shard_count) less the device's first shard f when k
 * divides both shard_count and f, as it does where the devices share the shards
 * evenly (em_backend_shard_device). */
static uint32_t spread_of(const em_table *table, em_spread *spread, uint32_t *devices)
{
    spread->count = 0;
    for (uint32_t s = 0; s < table->shard_count; s++) {
        uint32_t d = table->shard_device[s];
        if (spread->count > 0 && devices[spread->count - 1] == d)
            continue;
        if (spread->count == EM_SPREAD_MAX)
            return 0;
        devices[spread->count] = d;
        spread->first_shard[spread->count++] = s;
    }
    spread->first_shard[spread->count] = table->shard_count;
    for (uint32_t i = 0; i < spread->count; i++) {
        uint32_t first = spread->first_shard[i], k = spread->first_shard[i + 1] - first;
        if (table->shard_count % k != 0 || first % k != 0)
            return 0;
    }
    return spread->count;
}

/* Whether a request of nnz keys of a table over several devices goes spread
 * (pull_spread, push_spread): its devices can (push: the two halves of a spread push; a
 * pull of a table that tracks access: the touch after the devices' answers), its
 * table's requests of its kind find their keys lately (go_general clear), and its
 * buckets and vectors (push: gradient sums) stay within SPREAD_MAX_BYTES. */
static bool may_spread(const request_context *r, uint64_t nnz, _Atomic bool *go_general,
                       bool push)
{
    const em_table *table = r->table;
    const em_device_ops *ops = r->home->ops;
    bool can = push ? ops->shards_find_check_async != NULL && ops->shards_step_async != NULL
                    : ops->shards_pull_async != NULL &&
                          (r->access_stamp == 0 || ops->shards_touch_async != NULL);
    if (em__shards_at_home(r) || nnz == 0 || !can ||
        ops->spread_keys_async == NULL || ops->unique_keys_async == NULL ||
        ops->copy_to_host_later == NULL || ops->lane_join == NULL ||
        atomic_load_explicit(go_general, memory_order_relaxed))
        return false;
    em_spread spread;
    uint32_t devices[EM_SPREAD_MAX];
    uint32_t count = spread_of(table, &spread, devices), remote = 0;
    for (uint32_t i = 0; i < count; i++) {
        const em_device *device = table->backend->devices[devices[i]];
        if (device->ops != ops)
            return false;
        remote += device != r->home;
    }
    uint64_t key_bytes = sizeof(uint64_t) + (uint64_t)table->config.dim * sizeof(float);
    uint64_t bytes = remote * nnz * key_bytes;
    return count > 1 && count * nnz <= UINT32_MAX && bytes <= SPREAD_MAX_BYTES;
}

static bool pull_may_spread(const request_context *r, const em_pull_request *request)
{
    return may_spread(r, request->batch.nnz, &r->table->pulls_go_general, false);
}

/* Each spread device's part of a request: its keys (a bucket of room for every key of
 * the request) and their count, its rows, its keys' vectors (push: their gradient sums)
 * and its words: every device's answers (2 x count: device i's missing count at 2i, a
 * push's first problem at 2i + 1) as far as they were sent to it (spread_answers), on
 * that device. */
typedef struct spread_part {
    em_device *device;
    em_lane *lane;
    uint64_t *keys;
    uint32_t *count;
    uint64_t *rows;
    float *vectors;
    uint64_t *words;
} spread_part;

/* Where a spread request's parts are at home, all of them side by side: buckets (count x
 * nnz keys), their counts and the keys' positions in them (spread_keys_async), vectors or
 * sums (count x nnz x dim floats), and home's words (spread_part). */
typedef struct spread_home {
    uint64_t *buckets;
    uint32_t *counts;
    uint32_t *position; /* nnz: where each distinct key went in the buckets */
    float *vectors;
    uint64_t *words;
} spread_home;

/* The parts' buffers: at home, in h; elsewhere, in scratch of their own, with the
 * transfers that move keys there (to_remote: keys and count, and a push's sums), *sent
 * of them, and for a pull the vectors' back (to_home), *returned of them. */
static em_status spread_buffers(request_context *r, const em_spread *spread,
                                const uint32_t *devices, uint64_t nnz, bool push,
                                const spread_home *h, spread_part *parts,
                                em_transfer *to_remote, em_transfer *to_home, size_t *sent,
                                size_t *returned, em_error *err)
{
    em_table *table = r->table;
    uint32_t dim = table->config.dim, count = spread->count;
    size_t vector_bytes = nnz * dim * sizeof(float);
    size_t words = 2 * (size_t)count;
    *sent = *returned = 0;
    em_status status = EM_OK;
    for (uint32_t i = 0; status == EM_OK && i < count; i++) {
        spread_part *p = &parts[i];
        p->device = table->backend->devices[devices[i]];
        p->lane = r->lanes[devices[i]];
        if (p->device == r->home) {
            *p = (spread_part){p->device, p->lane, h->buckets + i * nnz, h->counts + i, NULL,
                               h->vectors + i * nnz * dim, h->words};
            status = em__request_alloc(r, p->device, nnz * sizeof(uint64_t), "spread rows",
                                       (void **)&p->rows, err);
            continue;
        }
        status = em__request_alloc(r, p->device, nnz * sizeof(uint64_t), "spread keys",
                                   (void **)&p->keys, err);
        if (status == EM_OK)
            status = em__request_alloc(r, p->device, sizeof(uint32_t), "spread count",
                                       (void **)&p->count, err);
        if (status == EM_OK)
            status = em__request_alloc(r, p->device, nnz * sizeof(uint64_t), "spread rows",
                                       (void **)&p->rows, err);
        if (status == EM_OK)
            status = em__request_alloc(r, p->device, vector_bytes,
                                       push ? "spread gradient sums" : "spread vectors",
                                       (void **)&p->vectors, err);
        if (status == EM_OK)
            status = em__request_alloc(r, p->device, words * sizeof(uint64_t),
                                       "spread answers", (void **)&p->words, err);
        if (status != EM_OK)
            break;
        to_remote[(*sent)++] = (em_transfer){r->home_lane, h->buckets + i * nnz, p->lane,
                                             p->keys, nnz * sizeof(uint64_t)};
        to_remote[(*sent)++] = (em_transfer){r->home_lane, h->counts + i, p->lane, p->count,
                                             sizeof(uint32_t)};
        if (push) {
            to_remote[(*sent)++] = (em_transfer){r->home_lane, h->vectors + i * nnz * dim,
                                                 p->lane, p->vectors, vector_bytes};
            continue;
        }
        to_home[(*returned)++] = (em_transfer){p->lane, p->vectors, r->home_lane,
                                               h->vectors + i * nnz * dim, vector_bytes};
    }
    return status;
}

/* The transfers of each part's answers (its words 2i and, a push's, 2i + 1: bytes of
 * them) to every other part (all), or to home's alone, appended to out at *n. */
static void spread_answers(const request_context *r, const spread_part *parts, uint32_t count,
                           bool all, size_t bytes, em_transfer *out, size_t *n)
{
    for (uint32_t i = 0; i < count; i++)
        for (uint32_t j = 0; j < count; j++)
            if (j != i && (all || parts[j].lane == r->home_lane))
                out[(*n)++] = (em_transfer){parts[i].lane, parts[i].words + 2 * i, parts[j].lane,
                                            parts[j].words + 2 * i, bytes};
}

/* The home device's buffers of a spread request (spread_home). */
static em_status spread_home_buffers(request_context *r, uint32_t count, uint64_t nnz,
                                     spread_home *h, em_error *err)
{
    em_device *home = r->home;
    uint32_t dim = r->table->config.dim;
    em_status status = em__request_alloc(r, home, count * nnz * sizeof(uint64_t),
                                         "key buckets", (void **)&h->buckets, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, count * sizeof(uint32_t), "bucket counts",
                                   (void **)&h->counts, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, nnz * sizeof(uint32_t), "bucket positions",
                                   (void **)&h->position, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, count * nnz * dim * sizeof(float),
                                   "spread vectors", (void **)&h->vectors, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, 2 * count * sizeof(uint64_t), "spread answers",
                                   (void **)&h->words, err);
    return status;
}

/* A pull of a table over several devices (pull_may_spread) with one wait, as a pull at
 * once is with one: the home device dedupes the keys and puts each device's into a
 * bucket (spread_keys_async), buckets go to the other devices whole (room for every key:
 * how many are a device's own is known only on the GPU), each device finds its keys and
 * writes their vectors in one pass over its shards (shards_pull_async per distinct key),
 * the vectors come back whole, and home combines them into the output, which comes back
 * with every device's missing count in one wait for all of them. A table that tracks
 * access has every device's missing count sent to every other, and each device touches
 * its rows only if none is missing anywhere (shards_touch_async), as a pull at once
 * touches only when it found every key. When some key is missing, *done stays false and
 * nothing was changed: the pull starts again the general way, with the scratch given
 * back, and the table's next pulls go that way until one finds every key
 * (pulls_go_general), or, where it could have created them (creates_at_once), the next
 * ones create their absent keys spread too (pulls_create): with room made first in every
 * shard of every device for every key of the batch (make_room_at_once, each shard on its
 * device's lane), each device inserts the keys it finds absent and writes their rows'
 * initial values in its pass (shards_pull_async creating), touching every row of its
 * own, and the pull waits once still. */
static em_status pull_spread(request_context *r, const em_pull_request *request,
                             em_pull_result *result, bool *done, em_error *err)
{
    em_table *table = r->table;
    em_device *home = r->home;
    const em_device_ops *ops = home->ops;
    uint64_t nnz = request->batch.nnz;
    uint32_t dim = table->config.dim;
    uint64_t out_floats = vector_floats(table, &request->batch, request->combiner);
    request_mark mark = em__request_mark(r);
    em_spread spread;
    uint32_t devices[EM_SPREAD_MAX];
    uint32_t count = spread_of(table, &spread, devices);
    at_once_keys k = {0};
    spread_home h = {0};
    float *out = NULL;
    spread_part parts[EM_SPREAD_MAX];
    em_transfer to_remote[3 * EM_SPREAD_MAX];
    size_t sent = 0, returned = 0;
    bool creatable = request->create_missing && creates_at_once(r);
    uint64_t rows_before = 0;
    bool create = creatable && atomic_load_explicit(&table->pulls_create, memory_order_relaxed) &&
                  make_room_at_once(r, &request->batch, &rows_before);
    /* a pull that creates touches every row; else only where no device found a key missing,
     * which each device learns from every other's answer */
    bool touch = r->access_stamp != 0, gated_touch = touch && !create;
    /* the vectors back, then the answers: every device's to every other when the rows
     * are touched after all answers, else to home */
    em_transfer *to_home = calloc(count + (size_t)count * (count - 1), sizeof(*to_home));
    *done = false;
    em_status status =
        to_home == NULL
            ? em_error_set(err, EM_RESOURCE_EXHAUSTED,
                           "out of host memory for a pull spread over %u devices", count)
            : dedupe_at_once(r, &request->batch, request->combiner, &k, err);
    if (status == EM_OK)
        status = spread_home_buffers(r, count, nnz, &h, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, out_floats * sizeof(float), "pull output",
                                   (void **)&out, err);
    if (status == EM_OK)
        status = spread_buffers(r, &spread, devices, nnz, false, &h, parts, to_remote, to_home,
                                &sent, &returned, err);
    if (status == EM_OK)
        spread_answers(r, parts, count, gated_touch, sizeof(uint64_t), to_home, &returned);
    if (status == EM_OK)
        status = ops->spread_keys_async(r->home_lane, k.unique, nnz, k.count, table->shard_count,
                                        &spread, h.buckets, h.counts, h.position, err);
    /* the distinct count's word lives until the home lane next synchronizes, which an
     * exchange through the host does: read back now, it lands at a wait before the end */
    uint32_t unique_count = 0;
    if (status == EM_OK)
        status = ops->copy_to_host_later(r->home_lane, &unique_count, k.count,
                                         sizeof(unique_count), err);
    if (status == EM_OK && sent > 0)
        status = em_exchange_run(table->backend->exchange, to_remote, sent, err);
    if (status == EM_OK) {
        em_device_batch distinct = {.rows = (uint32_t)nnz, .nnz = nnz};
        uint32_t updated =
            (uint32_t)atomic_load_explicit(&table->update_clock, memory_order_relaxed);
        if (!create) /* creating, every write lock is held until the shards are settled */
            em__lock_all_shards(table, false);
        for (uint32_t i = 0; status == EM_OK && i < count; i++) {
            uint32_t first = spread.first_shard[i];
            status = parts[i].device->ops->shards_pull_async(
                table->shards + first, spread.first_shard[i + 1] - first, parts[i].lane,
                &distinct, EM_COMBINER_NONE, parts[i].keys, parts[i].count, create,
                parts[i].rows, parts[i].words + 2 * i, parts[i].vectors,
                create ? r->access_stamp : 0, updated, err);
        }
        if (status == EM_OK && returned > 0) /* a touch's gate needs every device's answer */
            status = em_exchange_run(table->backend->exchange, to_home, returned, err);
        for (uint32_t i = 0; gated_touch && status == EM_OK && i < count; i++) {
            uint32_t first = spread.first_shard[i];
            status = parts[i].device->ops->shards_touch_async(
                table->shards + first, spread.first_shard[i + 1] - first, parts[i].lane,
                parts[i].rows, parts[i].count, nnz, parts[i].words, count, r->access_stamp,
                updated, err);
        }
        if (!create)
            em__unlock_all_shards(table);
    }
    free(to_home);
    if (status == EM_OK) {
        em_device_batch batch = {.rows = request->batch.rows,
                                 .nnz = nnz,
                                 .offsets = r->batch.offsets,
                                 .inverse = k.inverse,
                                 .position = h.position,
                                 .unique_count = nnz};
        status = ops->combine(r->home_lane, &batch, request->combiner, dim, h.vectors, out,
                              err);
    }
    uint64_t answers[2 * EM_SPREAD_MAX];
    if (status == EM_OK)
        status = ops->copy_to_host_later(r->home_lane, answers, h.words,
                                         2 * count * sizeof(uint64_t), err);
    for (uint32_t i = 0; status == EM_OK && i < count; i++) /* one wait for every device */
        if (parts[i].lane != r->home_lane)
            status = ops->lane_join(r->home_lane, parts[i].lane, err);
    if (status == EM_OK) /* ends with the lanes' synchronisation: the counts are in */
        status = ops->copy_to_host(r->home_lane, request->out, out, out_floats * sizeof(float),
                                   err);
    em_error ignored;
    if (status != EM_OK) /* every lane's work ends before its release frees scratch */
        (void)ops->synchronize(r->home_lane, &ignored);
    if (create) { /* the keys created are in the shards, whatever else failed */
        em_status settled = settle_created(r, rows_before, status == EM_OK ? err : &ignored);
        if (status == EM_OK)
            status = settled;
    }
    if (status != EM_OK)
        return em_error_prefix(err, "table '%s': ", table->config.name);
    uint64_t total = 0;
    for (uint32_t i = 0; i < count; i++)
        total += answers[2 * i];
    note_at_once_find(table, &table->pulls_create, &table->pulls_go_general, total, creatable,
                      !create);
    if (create) { /* what it found absent it created */
        result->unique_keys = unique_count;
        result->missing = total;
        result->created = total;
        atomic_fetch_add_explicit(&table->pulls_at_once, 1, memory_order_relaxed);
        *done = true;
        return EM_OK;
    }
    if (total != 0) {
        em__request_rewind(r, &mark);
        return EM_OK;
    }
    return pull_served_at_once(table, unique_count, result, done);
}

/* Whether a request of a table over several devices (the general way) may leave its
 * finds' counts for a later wait (counts_later), its table's requests of its kind
 * having found every key lately (find_first clear: note_waited_find). */
static bool may_find_later(const request_context *r, _Atomic bool *find_first)
{
    return !em__shards_at_home(r) && r->home->ops->copy_to_host_later != NULL &&
           !atomic_load_explicit(find_first, memory_order_relaxed);
}

/* A general request that waited for its finds found `missing` keys: none, and the
 * table's next requests of its kind need not wait (find_first: pulls_find_first,
 * pushes_find_first). */
static void note_waited_find(_Atomic bool *find_first, uint64_t missing)
{
    if (missing == 0 && atomic_load_explicit(find_first, memory_order_relaxed))
        atomic_store_explicit(find_first, false, memory_order_relaxed);
}

/* A request that did not wait for its finds found keys missing, and changed nothing: it
 * goes again (*again), and the table's next requests of its kind wait for their finds. */
static void go_again(_Atomic bool *find_first, _Atomic uint64_t *found_again, bool *again)
{
    atomic_store_explicit(find_first, true, memory_order_relaxed);
    atomic_fetch_add_explicit(found_again, 1, memory_order_relaxed);
    *again = true;
}

/* Whether a pull that may create keys, of a table over several devices (the general
 * way), goes without waiting for its finds, as a pull that creates nothing does: its
 * missing counts come back with its answer, and when some key was missing after all, it
 * created nothing and changed nothing, and is done again waiting for them (pull_locked).
 * So a pull of stored keys, the steady state of training, saves the finds' wait. Not
 * for a table that tracks access (a pull touches its rows: done twice, an lfu count would
 * move twice), nor while the table's pulls find keys missing (pulls_find_first). */
static bool finds_later(const request_context *r, const em_pull_request *request)
{
    return request->create_missing && r->access_stamp == 0 &&
           may_find_later(r, &r->table->pulls_find_first);
}

static em_status pull_attempt(em_table *table, const em_pull_request *request,
                              em_pull_result *result, bool may_create, bool find_first,
                              attempt_state *state, bool *again, em_error *err);

/* A pull attempt (locked_attempt): the general way's pull that did not wait for its
 * finds and found keys missing (finds_later) goes again, waiting for them. */
static em_status pull_locked(em_table *table, const void *untyped_request, void *untyped_result,
                             bool may_create, attempt_state *state, em_error *err)
{
    bool again = false;
    em_status status = pull_attempt(table, untyped_request, untyped_result, may_create, false,
                                    state, &again, err);
    if (status == EM_OK && again)
        status = pull_attempt(table, untyped_request, untyped_result, may_create, true, state,
                              &again, err);
    return status;
}

static em_status pull_attempt(em_table *table, const em_pull_request *request,
                              em_pull_result *result, bool may_create, bool find_first,
                              attempt_state *state, bool *again, em_error *err)
{
    request_context r;
    *again = false;
    /* going again (find_first), with the access stamp of the attempt before */
    em_status status = em__request_begin_stamped(table, &r, find_first ? state->access_stamp : 0,
                                                 err);
    state->access_stamp = r.access_stamp;
    r.alone = may_create; /* the exclusive attempt */
    bool later = status == EM_OK && !find_first && finds_later(&r, request);
    bool create = request->create_missing && !later;
    bool done = false, at_once = status == EM_OK && pull_may_run_at_once(&r, request);
    float *out_ready = NULL; /* at once, then planned the general way: the output's buffer */
    uint64_t absent = 0;     /* at once: the keys it found missing */
    if (at_once)
        status = pull_at_once(&r, request, result, &done, &out_ready, &absent, err);
    else if (status == EM_OK && pull_may_spread(&r, request))
        status = pull_spread(&r, request, result, &done, err);
    if (status != EM_OK || done || (create && goes_alone(&r, may_create, absent, state))) {
        em__request_end(&r);
        return status;
    }
    bool direct = pull_is_direct(&r, request);
    bool planned = out_ready != NULL; /* from what pull_at_once found */
    if (!planned)
        status = em__stage_offsets(&r, &request->batch, err);
    if (status == EM_OK && !planned) {
        stop_finding_when_full(&r, may_create, create);
        /* creating nothing, it needs the missing counts only for its answer */
        r.counts_later = !create;
        status = em__plan_and_find(&r, request->batch.keys, request->batch.nnz, direct, err);
        if (status == EM_OK && !r.counts_pending) {
            note_general_find(table, &table->pulls_go_general, r.missing);
            note_waited_find(&table->pulls_find_first, r.missing);
        }
    }
    uint64_t missing = r.missing;
    if (status == EM_OK && r.missing > 0 && create)
        status = admit(&r, may_create, state, err);
    if (status == EM_OK && state->needs_create && !may_create) {
        em__request_end(&r);
        return EM_OK;
    }
    pull_buffers buffers;
    if (status == EM_OK)
        status = take_pull_buffers(&r, request, direct, out_ready, &buffers, err);
    /* alone with a table on GPUs, its inserts settle with its last wait */
    if (status == EM_OK && create)
        status = em__create_missing(&r, r.missing > 0 && em__hold_for_settle(&r), err);
    state->made_room = state->made_room || r.made_room;
    if (status == EM_OK)
        status = direct ? gather_direct(&r, request, &buffers, err)
                        : gather_and_combine(&r, request, &buffers, err);
    if (status == EM_OK) /* the output's last wait covers the other devices too */
        status = em__join_devices(&r, err);
    if (status == EM_OK)
        status = copy_output(&r, request, direct, &buffers, err);
    status = em__finish_devices(&r, status, err);
    if (status == EM_OK && r.counts_pending) { /* the find's counts came back with it */
        em__missing_found(&r);
        missing = r.missing;
        note_general_find(table, &table->pulls_go_general, r.missing);
    }
    if (status == EM_OK && later && missing > 0) { /* it should have created them */
        go_again(&table->pulls_find_first, &table->pulls_found_again, again);
        em__request_end(&r);
        return EM_OK;
    }
    if (status == EM_OK) {
        result->unique_keys = r.batch.unique_count;
        result->missing = missing;
        result->created = create ? r.missing : 0;
        atomic_fetch_add_explicit(&table->pulls_not_admitted, r.rejected, memory_order_relaxed);
    }
    em__request_end(&r);
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

static em_status pull_rows(em_table *table, const em_pull_request *request,
                           em_pull_result *result, em_error *err)
{
    em_status status = check_pull(table, request, err);
    if (status != EM_OK)
        return em_error_prefix(err, "pull from table '%s': ", table->config.name);
    status = run_shared_then_exclusive(table, pull_locked, &table->pulls_making_room, request,
                                       result, err);
    if (status != EM_OK)
        return status;
    atomic_fetch_add_explicit(&table->pulls, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&table->keys_pulled, request->batch.nnz, memory_order_relaxed);
    return EM_OK;
}

/* Whether a pull may change what a checkpoint holds of its table: it may create keys,
 * its table tracks access (a pull moves the access clock and its rows' metadata), or
 * counts the sightings of keys not admitted yet. A pull of a serving table changes
 * nothing. */
static bool pull_changes_table(const em_table *table, const em_pull_request *request)
{
    return request->create_missing || em_eviction_tracks_access(&table->config.eviction) ||
           table->config.admission.policy == EM_ADMISSION_COUNTER;
}

em_status em_table_pull(em_table *table, const em_pull_request *request, em_pull_result *result,
                        em_error *err)
{
    if (!pull_changes_table(table, request))
        return pull_rows(table, request, result, err);
    em__change_begin(table);
    return em__change_end(table, pull_rows(table, request, result, err));
}

/* ---- push ------------------------------------------------------------------------ */

/* A push, and the largest gradient element size its input check found once it ran
 * (check_gradients). */
typedef struct push_call {
    const em_push_request *request;
    float largest;
    bool checked;
} push_call;

/* Checks, once per push, that its gradients are finite (em_csr_check_gradients, naming
 * the first element that is not), and keeps their largest size for the general way's
 * bounds. A push of one gradient per key going at once is not checked here unless it
 * goes on the general way: every gradient is then a term of one of the sums the GPU
 * checks before it steps anything (em_row_check), and a sum with a term that is not
 * finite is not finite either, so such a push steps nothing and goes the general way,
 * which runs this check and names the element as the CPU backend does, unless it holds
 * the table alone (gpu_checks_alone), whose general way leaves it to the GPU too. The
 * host then never reads the gradients of a push that steps at once or alone, unless the
 * GPU's check found a problem, which this check names. Every other push is checked
 * before it takes any lock (gpu_may_check), a push with a combiner among them: a gradient
 * of an empty row is no term of any sum. */
static em_status check_gradients(const em_table *table, push_call *call, bool alone,
                                 em_error *err)
{
    const em_push_request *request = call->request;
    /* a large push's pass over its gradients goes on several threads where the rows are
     * on GPUs (16 MiB of them, a push of 65,536 keys at dim 64, take about 1.5 ms on one,
     * while the host's CPUs have little else to do); on the CPU backend they serve the
     * requests themselves, one on each, except a push that holds the table alone or
     * will (alone: run_shared_then_exclusive), which then uses the backend's eviction
     * threads as it does for its shards' work: no other request could use them */
    uint32_t threads = 1;
    if (request->gradient_count >= 2 * EM_CSR_CHECK_FLOATS_PER_THREAD) {
        if (!table->backend->devices[0]->host_addressable)
            threads = em_parallel_cpus();
        else if (alone)
            threads = table->backend->eviction_threads;
    }
    em_status status = em_csr_check_gradients_on(&request->batch, request->combiner,
                                                 table->config.dim, request->gradients,
                                                 table->backend->workers, threads,
                                                 &call->largest, err);
    if (status != EM_OK)
        return em_error_prefix(err, "push to table '%s': ", table->config.name);
    call->checked = true;
    return EM_OK;
}

/* Whether a push may leave its gradients' check to the GPU (check_gradients): one
 * gradient per key, to a table whose shards share a device that pushes at once. Every
 * other push is checked before it takes any lock. */
static bool gpu_may_check(const em_table *table, const em_push_request *request)
{
    return request->combiner == EM_COMBINER_NONE && table->shards_device != UINT32_MAX &&
           table->backend->devices[table->shards_device]->ops->shards_push_async != NULL;
}

/* Whether a push that the GPU may check (gpu_may_check) leaves its gradients to the
 * GPU's check on the general way too, so the host never reads them: where it holds the
 * table alone (a full table's pushes that evict), under admission `always`. The general
 * way's check on the GPU then covers every gradient: each is a term of the sum of a key
 * that is stored or will be created (none is refused), and a sum with a term that is
 * not finite is not finite either. What it finds is named by the host's check after
 * all (push_attempt), in the CPU backend's words; nothing was changed by then. Holding
 * the table, no other push steps a shard between the check and the step, so its check
 * needs no bound on the gradients' sizes (sum_bound: -1). */
static bool gpu_checks_alone(const request_context *r, const push_call *call)
{
    return r->alone && gpu_may_check(r->table, call->request) &&
           r->table->config.admission.policy == EM_ADMISSION_ALWAYS;
}

/* A bound on the size of a sum of at most terms of the push's gradients, from their
 * largest size where the host checked them; else -1 (none known). */
static float sum_bound(const push_call *call, uint64_t terms)
{
    return call->checked ? em_row_sum_bound(call->largest, terms) : -1.0f;
}

/* Sums the batch's gradients per unique key at home (partitioned order) and hands each
 * segment its share. */
static em_status sum_and_send_gradients(request_context *r, const push_call *call,
                                        em_error *err)
{
    const em_push_request *request = call->request;
    em_device *home = r->home;
    uint32_t dim = r->table->config.dim;
    const float *gradients = NULL;
    float *sums = NULL;
    em_status status = em__stage_input(r, request->gradients,
                                       request->gradient_count * sizeof(float),
                                       "request gradients", (const void **)&gradients, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, r->batch.unique_count * dim * sizeof(float),
                                   "summed gradients", (void **)&sums, err);
    if (status == EM_OK)
        status = home->ops->sum_gradients(r->home_lane, &r->batch, request->combiner, dim,
                                          gradients, sums, err);
    /* a key occurs at most nnz - unique + 1 times, so its sum has at most that many terms */
    r->gradient_bound = sum_bound(call, r->batch.nnz - r->batch.unique_count + 1);
    if (status == EM_OK)
        status = em__scatter_to_segments(r, sums, dim * sizeof(float), "segment gradients",
                                         em__segment_payload, err);
    return status;
}

static bool push_may_run_at_once(const request_context *r, const em_push_request *request)
{
    return r->home->ops->shards_push_async != NULL && may_run_at_once(r, request->batch.nnz) &&
           at_once_now(r->table, &r->table->pushes_go_general);
}

/* A push starts at once: dedupe, gradient sums, find, check and step are enqueued
 * together, one kernel of each over all of the table's shards, the step gated on the
 * GPU by the find and the check (device.h: shards_push_async), and the counts come back
 * in one synchronisation, so a push to keys that are all stored with steps that keep
 * every row finite (the steady state of training) waits once for the GPU. While the
 * table's pushes create keys (pushes_create) a push makes room for every key of its
 * batch first (make_room_at_once) and the absent keys are inserted on the GPU when
 * every row checked, so that it creates them and waits once too. *done stays
 * false when a key is missing or a check failed: nothing was stepped, and the request
 * goes on the general way (which creates the keys, or names the problem as the CPU
 * does): a one-shard table's is planned from what was found, with the sums as its
 * gradients (em__plan_found, *planned), a table of several shards starts again with the
 * scratch given back (*planned stays false), as does every push while the table is
 * being saved, which finds nothing.
 * A table that tracks access stamps its pushed rows with the table's push clock, which
 * only a push that steps rows may move (the general way moves it as it steps, under the
 * shard's write lock): here the rows are stamped with the clock's next value and the
 * clock moves once the step is known to have happened, the write lock held until then
 * so that no other step takes that value meanwhile. */
static em_status push_at_once(request_context *r, push_call *call,
                              em_push_result *result, bool *done, bool *planned,
                              uint64_t *found_absent, em_error *err)
{
    const em_push_request *request = call->request;
    em_table *table = r->table;
    em_device *home = r->home;
    const em_device_ops *ops = home->ops;
    uint64_t nnz = request->batch.nnz;
    uint32_t dim = table->config.dim;
    request_mark mark = em__request_mark(r);
    const float *gradients = NULL;
    at_once_keys k = {0};
    uint64_t *words = NULL;
    float *sums = NULL;
    uint64_t seen = 0;
    bool creatable = creates_at_once(r);
    uint64_t rows_before = 0;
    bool create = creatable &&
                  atomic_load_explicit(&table->pushes_create, memory_order_relaxed) &&
                  make_room_at_once(r, &request->batch, &rows_before);
    *done = false;
    *planned = false;
    em_status status = dedupe_at_once(r, &request->batch, request->combiner, &k, err);
    if (status == EM_OK)
        status = em__stage_input(r, request->gradients, request->gradient_count * sizeof(float),
                                 "request gradients", (const void **)&gradients, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, 2 * sizeof(uint64_t), "push answers",
                                   (void **)&words, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, nnz * dim * sizeof(float), "summed gradients",
                                   (void **)&sums, err);
    if (status == EM_OK) { /* sums for every possible unique key: the count is on the GPU */
        em_device_batch batch = {.rows = request->batch.rows,
                                 .nnz = nnz,
                                 .offsets = r->batch.offsets,
                                 .inverse = k.inverse,
                                 .position = NULL,
                                 .unique_count = nnz};
        status = ops->sum_gradients(r->home_lane, &batch, request->combiner, dim, gradients, sums,
                                    err);
    }
    bool saving = false, locked = false;
    uint64_t checked_version = 0;
    bool stamps = r->access_stamp != 0; /* the table tracks access */
    uint32_t stamp = 0;
    if (status == EM_OK) {
        if (!create) /* creating, they are held from make_room_at_once until settled */
            em__lock_all_shards(table, true);
        locked = true;
        stamp = (uint32_t)atomic_load_explicit(&table->update_clock, memory_order_relaxed) + 1;
        seen = atomic_load_explicit(&table->shard_creations[0].value, memory_order_relaxed);
        saving = table->snapshot != NULL; /* its rows go aside first: the general way */
        if (!saving)
            status = ops->shards_push_async(table->shards, table->shard_count, r->home_lane,
                                            k.unique, k.count, nnz, sums, create, k.rows,
                                            &words[0], &words[1], r->access_stamp, stamp, err);
        /* whether it stepped is known later: checks before it look again */
        for (uint32_t s = 0; !saving && s < table->shard_count; s++)
            table->shard_versions[s].value += EM_ROW_BOUNDED_STEPS + 1;
        checked_version = table->shard_versions[0].value; /* what its own check saw */
        /* creating, the locks are held until the shards are settled */
        if (!create && (!stamps || saving || status != EM_OK)) {
            em__unlock_all_shards(table);
            locked = false;
        }
    }
    uint64_t answers[2] = {UINT64_MAX, 0};
    uint32_t updated = 0;
    if (status == EM_OK)
        status = ops->copy_to_host_later(r->home_lane, answers, words, sizeof(answers), err);
    if (status == EM_OK)
        status = ops->copy_to_host_later(r->home_lane, &updated, k.count, sizeof(updated), err);
    em_error ignored;
    em_status synchronized = ops->synchronize(r->home_lane, status == EM_OK ? err : &ignored);
    if (status == EM_OK)
        status = synchronized;
    bool stepped = status == EM_OK && !saving && (create || answers[0] == 0) &&
                   answers[1] == UINT64_MAX;
    if (locked && stamps && stepped) { /* the step happened with the clock's next value */
        atomic_fetch_add_explicit(&table->update_clock, 1, memory_order_relaxed);
        em__clock_sample(table, em__unix_ms(), stamp);
    }
    uint64_t created = create && stepped ? answers[0] : 0; /* a failed check inserts none */
    if (create) { /* the keys created are in the shards, whatever else failed */
        em_status settled = settle_created(r, rows_before, status == EM_OK ? err : &ignored);
        if (status == EM_OK)
            status = settled;
    } else if (locked) {
        em__unlock_all_shards(table);
    }
    /* bad input is named first; a push alone whose check on the GPU found no problem
     * leaves its gradients to the general way's check on the GPU (gpu_checks_alone) */
    bool named_later = status == EM_OK && answers[1] == UINT64_MAX && gpu_checks_alone(r, call);
    if ((status != EM_OK || !stepped) && !call->checked && !named_later) {
        em_error check_err;
        em_status refused = check_gradients(table, call, r->alone, &check_err);
        if (refused != EM_OK) {
            *err = check_err;
            return refused;
        }
    }
    if (status != EM_OK)
        return em_error_prefix(err, "table '%s': ", table->config.name);
    if (!saving)
        note_at_once_find(table, &table->pushes_create, &table->pushes_go_general, answers[0],
                          creatable && !create, !create && !stepped);
    if (!saving && !create && !stepped)
        *found_absent = answers[0];
    if (saving || (!stepped && table->shard_count > 1)) {
        em__request_rewind(r, &mark);
        return EM_OK;
    }
    if (!stepped) {
        em__plan_found(r, nnz, k.unique, k.inverse, k.first, k.rows, updated, answers[0], seen,
                       false);
        segment *home_segment = &r->segments[home->index];
        home_segment->payload = sums; /* the unique order is the shard's */
        /* a key occurs at most nnz - unique + 1 times, so its sum has at most that many
         * terms (as sum_and_send_gradients says) */
        r->gradient_bound = sum_bound(call, nnz - updated + 1);
        /* its check covered every key, the missing ones as created with their initial
         * values, which is what admission `always` does with them */
        r->checked_at_once = answers[1] == UINT64_MAX &&
                             table->config.admission.policy == EM_ADMISSION_ALWAYS;
        r->checked_version = checked_version;
        *planned = true;
        return EM_OK;
    }
    result->updated = updated;
    result->created = created;
    atomic_fetch_add_explicit(&table->pushes_at_once, 1, memory_order_relaxed);
    *done = true;
    return EM_OK;
}

/* Whether a push goes spread (push_spread): as a pull does (may_spread), with its
 * table's pushes finding their keys lately, and not while the table is being saved
 * (its rows then go aside before a push steps them: the general way). */
static bool push_may_spread(const request_context *r, const em_push_request *request)
{
    return !atomic_load_explicit(&r->table->saving, memory_order_relaxed) &&
           may_spread(r, request->batch.nnz, &r->table->pushes_go_general, true);
}

/* A push of a table over several devices (push_may_spread) with one wait, as a push at
 * once is with one: the home device dedupes the keys, puts each device's into a bucket
 * (spread_keys_async) and sums the gradients straight into the buckets' order (the sums
 * of every possible key, the count being on the GPU), buckets and sums go to the other
 * devices whole, each device finds and checks its keys (shards_find_check_async), every
 * device's answers go to every other, and each steps its rows only if no device found a
 * key missing or a step that would break a row (shards_step_async): all or nothing,
 * decided on every GPU alike. The answers come back in one wait for all of them. When
 * some key is missing or a check failed, *done stays false and nothing was stepped: the
 * push starts again the general way, with the scratch given back (which creates the
 * keys, or names the problem as the CPU does), and when keys were missing the table's
 * next pushes go that way until one finds every key (pushes_go_general), or, where it
 * could have created them (creates_at_once), the next ones create their absent keys
 * spread too (pushes_create): with room made first in every shard for every key of the
 * batch (make_room_at_once), each device's find and check see the absent keys as
 * created, and each device inserts them and steps them from their initial values
 * (shards_step_async with keys) only if no device's check found a problem, still in
 * one wait. The gradients were checked finite on the host first (gpu_may_check). A
 * table that tracks access stamps the rows stepped as push_at_once does, holding the
 * write locks until the wait has said whether the clock moves. */
static em_status push_spread(request_context *r, push_call *call, em_push_result *result,
                             bool *done, uint64_t *found_absent, em_error *err)
{
    const em_push_request *request = call->request;
    em_table *table = r->table;
    em_device *home = r->home;
    const em_device_ops *ops = home->ops;
    uint64_t nnz = request->batch.nnz;
    request_mark mark = em__request_mark(r);
    em_spread spread;
    uint32_t devices[EM_SPREAD_MAX];
    uint32_t count = spread_of(table, &spread, devices);
    at_once_keys k = {0};
    spread_home h = {0};
    const float *gradients = NULL;
    spread_part parts[EM_SPREAD_MAX];
    em_transfer to_remote[3 * EM_SPREAD_MAX];
    size_t sent = 0, returned = 0, shared = 0;
    /* each device's answers to every other device */
    em_transfer *answers_out = calloc((size_t)count * (count - 1), sizeof(*answers_out));
    bool creatable = creates_at_once(r);
    uint64_t rows_before = 0;
    bool create = answers_out != NULL && creatable &&
                  atomic_load_explicit(&table->pushes_create, memory_order_relaxed) &&
                  make_room_at_once(r, &request->batch, &rows_before);
    *done = false;
    em_status status =
        answers_out == NULL
            ? em_error_set(err, EM_RESOURCE_EXHAUSTED,
                           "out of host memory for a push spread over %u devices", count)
            : dedupe_at_once(r, &request->batch, request->combiner, &k, err);
    if (status == EM_OK)
        status = em__stage_input(r, request->gradients, request->gradient_count * sizeof(float),
                                 "request gradients", (const void **)&gradients, err);
    if (status == EM_OK)
        status = spread_home_buffers(r, count, nnz, &h, err);
    if (status == EM_OK)
        status = spread_buffers(r, &spread, devices, nnz, true, &h, parts, to_remote, NULL,
                                &sent, &returned, err);
    if (status == EM_OK)
        spread_answers(r, parts, count, true, 2 * sizeof(uint64_t), answers_out, &shared);
    if (status == EM_OK)
        status = ops->spread_keys_async(r->home_lane, k.unique, nnz, k.count, table->shard_count,
                                        &spread, h.buckets, h.counts, h.position, err);
    /* the distinct count's word lives until the home lane next synchronizes, which an
     * exchange through the host does: read back now, it lands at a wait before the end */
    uint32_t updated = 0;
    if (status == EM_OK)
        status = ops->copy_to_host_later(r->home_lane, &updated, k.count, sizeof(updated), err);
    if (status == EM_OK) { /* into the buckets' order, for every possible distinct key */
        em_device_batch batch = {.rows = request->batch.rows,
                                 .nnz = nnz,
                                 .offsets = r->batch.offsets,
                                 .inverse = k.inverse,
                                 .position = h.position,
                                 .unique_count = nnz};
        status = ops->sum_gradients(r->home_lane, &batch, request->combiner, table->config.dim,
                                    gradients, h.vectors, err);
    }
    if (status == EM_OK && sent > 0)
        status = em_exchange_run(table->backend->exchange, to_remote, sent, err);
    bool saving = false, locked = false;
    bool stamps = r->access_stamp != 0; /* the table tracks access */
    uint32_t stamp = 0;
    if (status == EM_OK) {
        if (!create) /* creating, they are held from make_room_at_once until settled */
            em__lock_all_shards(table, true);
        locked = true;
        stamp = (uint32_t)atomic_load_explicit(&table->update_clock, memory_order_relaxed) + 1;
        saving = table->snapshot != NULL; /* its rows go aside first: the general way */
        for (uint32_t i = 0; !saving && status == EM_OK && i < count; i++) {
            uint32_t first = spread.first_shard[i];
            status = parts[i].device->ops->shards_find_check_async(
                table->shards + first, spread.first_shard[i + 1] - first, parts[i].lane,
                parts[i].keys, parts[i].count, nnz, parts[i].vectors, parts[i].rows,
                parts[i].words + 2 * i, err);
        }
        if (!saving && status == EM_OK)
            status = em_exchange_run(table->backend->exchange, answers_out, shared, err);
        for (uint32_t i = 0; !saving && status == EM_OK && i < count; i++) {
            uint32_t first = spread.first_shard[i];
            status = parts[i].device->ops->shards_step_async(
                table->shards + first, spread.first_shard[i + 1] - first, parts[i].lane,
                create ? parts[i].keys : NULL, parts[i].rows, parts[i].count, nnz,
                parts[i].vectors, parts[i].words, count, r->access_stamp, stamp, err);
        }
        /* whether it stepped is known later: checks before it look again */
        for (uint32_t s = 0; !saving && s < table->shard_count; s++)
            table->shard_versions[s].value += EM_ROW_BOUNDED_STEPS + 1;
        if (!create && (!stamps || saving || status != EM_OK)) {
            em__unlock_all_shards(table);
            locked = false;
        }
    }
    free(answers_out);
    uint64_t answers[2 * EM_SPREAD_MAX];
    if (status == EM_OK && !saving)
        status = ops->copy_to_host_later(r->home_lane, answers, h.words,
                                         2 * count * sizeof(uint64_t), err);
    for (uint32_t i = 0; status == EM_OK && i < count; i++) /* one wait for all */
        if (parts[i].lane != r->home_lane)
            status = ops->lane_join(r->home_lane, parts[i].lane, err);
    em_error ignored; /* every lane's work ends before its release frees scratch */
    em_status synchronized = ops->synchronize(r->home_lane, status == EM_OK ? err : &ignored);
    if (status == EM_OK)
        status = synchronized;
    bool stepped = status == EM_OK && !saving;
    for (uint32_t i = 0; stepped && i < count; i++) /* creating, absent keys were created */
        stepped = (create || answers[2 * i] == 0) && answers[2 * i + 1] == UINT64_MAX;
    if (locked && stamps && stepped) { /* the step happened with the clock's next value */
        atomic_fetch_add_explicit(&table->update_clock, 1, memory_order_relaxed);
        em__clock_sample(table, em__unix_ms(), stamp);
    }
    if (create) { /* the keys created are in the shards, whatever else failed */
        em_status settled = settle_created(r, rows_before, status == EM_OK ? err : &ignored);
        if (status == EM_OK)
            status = settled;
    } else if (locked) {
        em__unlock_all_shards(table);
    }
    if (status != EM_OK)
        return em_error_prefix(err, "table '%s': ", table->config.name);
    if (saving) {
        em__request_rewind(r, &mark);
        return EM_OK;
    }
    uint64_t absent = 0;
    for (uint32_t i = 0; i < count; i++)
        absent += answers[2 * i];
    note_at_once_find(table, &table->pushes_create, &table->pushes_go_general, absent,
                      creatable && !create, !create && !stepped);
    if (!stepped) { /* creating, a check failed: nothing was inserted either */
        *found_absent = create ? 0 : absent;
        em__request_rewind(r, &mark);
        return EM_OK;
    }
    result->updated = updated;
    result->created = create ? absent : 0;
    atomic_fetch_add_explicit(&table->pushes_at_once, 1, memory_order_relaxed);
    *done = true;
    return EM_OK;
}

/* Whether a push of a table over several devices (the general way) goes without waiting
 * for its finds: their missing counts come back with its checks' wait, before it
 * changes anything (em__check_create_apply), and when some key was missing it goes again
 * waiting for them, to create them (push_locked). So a push of stored keys saves the
 * finds' wait. Not while the table's pushes find keys missing (pushes_find_first). */
static bool push_finds_later(const request_context *r)
{
    return may_find_later(r, &r->table->pushes_find_first);
}

static em_status push_attempt(em_table *table, push_call *call, em_push_result *result,
                              bool may_create, bool find_first, attempt_state *state,
                              bool *again, em_error *err);

/* A push attempt (locked_attempt): the general way's push that did not wait for its
 * finds and found keys missing (push_finds_later) goes again, waiting for them. */
static em_status push_locked(em_table *table, const void *untyped_request, void *untyped_result,
                             bool may_create, attempt_state *state, em_error *err)
{
    push_call *call = (push_call *)untyped_request; /* em_table_push's own: writable */
    bool again = false;
    em_status status = push_attempt(table, call, untyped_result, may_create, false, state,
                                    &again, err);
    if (status == EM_OK && again)
        status = push_attempt(table, call, untyped_result, may_create, true, state, &again, err);
    if (status != EM_OK && !call->checked) { /* left to the GPU (gpu_checks_alone) */
        em_error check_err; /* bad input is named first, as the CPU backend does */
        em_status refused = check_gradients(table, call, may_create, &check_err);
        if (refused != EM_OK) {
            *err = check_err;
            status = refused;
        }
    }
    return status;
}

static em_status push_attempt(em_table *table, push_call *call, em_push_result *result,
                              bool may_create, bool find_first, attempt_state *state,
                              bool *again, em_error *err)
{
    const em_push_request *request = call->request;
    request_context r;
    *again = false;
    /* a save's copies past their bound: wait for its reader before taking a lane, which
     * the reader needs too (lib/table/table_snapshot.c) */
    em__snapshot_wait_room(table);
    /* going again (find_first), with the access stamp of the attempt before */
    em_status status = em__request_begin_stamped(table, &r, find_first ? state->access_stamp : 0,
                                                 err);
    state->access_stamp = r.access_stamp;
    r.alone = may_create; /* the exclusive attempt */
    bool done = false, planned = false;
    uint64_t absent = 0; /* at once: the keys it found missing */
    bool at_once = status == EM_OK && push_may_run_at_once(&r, request);
    bool gpu_checks = gpu_checks_alone(&r, call);
    if (status == EM_OK && !call->checked && !gpu_checks &&
        (!at_once || request->combiner != EM_COMBINER_NONE))
        status = check_gradients(table, call, r.alone, err);
    if (status == EM_OK && at_once)
        status = push_at_once(&r, call, result, &done, &planned, &absent, err);
    else if (status == EM_OK && push_may_spread(&r, request))
        status = push_spread(&r, call, result, &done, &absent, err);
    if (status != EM_OK || done || goes_alone(&r, may_create, absent, state)) {
        em__request_end(&r);
        return status;
    }
    if (!planned) /* else planned from what push_at_once found, with its sums */
        status = em__stage_offsets(&r, &request->batch, err);
    if (status == EM_OK && !planned) {
        r.counts_later = !find_first && push_finds_later(&r);
        stop_finding_when_full(&r, may_create, !r.counts_later);
        status = em__plan_and_find(&r, request->batch.keys, request->batch.nnz, false, err);
        if (status == EM_OK && !r.counts_pending) {
            note_general_find(table, &table->pushes_go_general, r.missing);
            note_waited_find(&table->pushes_find_first, r.missing);
        }
    }
    if (status == EM_OK && r.missing > 0)
        status = admit(&r, may_create, state, err);
    if (status == EM_OK && state->needs_create && !may_create) {
        em__request_end(&r);
        return EM_OK;
    }
    if (status == EM_OK && !planned)
        status = sum_and_send_gradients(&r, call, err);
    if (status == EM_OK)
        status = em__check_create_apply(&r, err);
    if (status == EM_OK && r.counts_later) /* its finds' counts came with its checks' wait */
        note_general_find(table, &table->pushes_go_general, r.missing);
    state->made_room = state->made_room || r.made_room;
    if (status == EM_OK && r.needs_alone) { /* found missing with its checks, no room */
        state->needs_create = true;
        em__request_end(&r);
        return EM_OK;
    }
    if (status == EM_OK && r.found_missing_late) { /* it should have created them */
        go_again(&table->pushes_find_first, &table->pushes_found_again, again);
        em__request_end(&r);
        return EM_OK;
    }
    if (status == EM_OK) {
        result->updated = r.batch.unique_count - r.rejected;
        result->created = r.missing; /* with counts pending, known since the checks */
        atomic_fetch_add_explicit(&table->pushes_dropped, r.rejected, memory_order_relaxed);
    }
    em__request_end(&r);
    return status;
}

/* The push's shape; its gradients' values are checked later (check_gradients). */
static em_status check_push(const em_table *table, const em_push_request *request,
                            em_error *err)
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
    return EM_OK;
}

static em_status push_rows(em_table *table, const em_push_request *request,
                           em_push_result *result, em_error *err)
{
    push_call call = {request, -1.0f, false};
    em_status status = check_push(table, request, err);
    if (status != EM_OK)
        return em_error_prefix(err, "push to table '%s': ", table->config.name);
    if (!gpu_may_check(table, request)) {
        /* a push that will go alone (run_shared_then_exclusive) is checked as if it was */
        bool alone = atomic_load_explicit(&table->pushes_making_room, memory_order_relaxed) >=
                     ALONE_AFTER;
        status = check_gradients(table, &call, alone, err);
        if (status != EM_OK)
            return status;
    }
    status = run_shared_then_exclusive(table, push_locked, &table->pushes_making_room, &call,
                                       result, err);
    if (status != EM_OK)
        return status;
    atomic_fetch_add_explicit(&table->pushes, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&table->keys_pushed, request->batch.nnz, memory_order_relaxed);
    return EM_OK;
}

em_status em_table_push(em_table *table, const em_push_request *request, em_push_result *result,
                        em_error *err)
{
    em__change_begin(table);
    return em__change_end(table, push_rows(table, request, result, err));
}

/* ---- erase ---------------------------------------------------------------------------- */

static em_status erase_keys(em_table *table, const uint64_t *keys, uint64_t n, uint64_t *erased,
                             em_error *err)
{
    *erased = 0;
    if (n > MAX_KEYS_PER_REQUEST)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "erase from table '%s': %" PRIu64 " keys exceed %" PRIu32
                            " keys per request",
                            table->config.name, n, MAX_KEYS_PER_REQUEST);
    if (n > 0 && keys == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT, "erase from table '%s': keys are missing",
                            table->config.name);
    for (uint32_t d = 0; d < table->backend->device_count; d++)
        if (table->backend->devices[d]->ops->shard_erase == NULL)
            return em_error_set(err, EM_FAILED_PRECONDITION,
                                "erase from table '%s': the %s backend cannot erase keys",
                                table->config.name, table->backend->kind);
    if (n == 0)
        return EM_OK;
    request_context r;
    em_spread_lock_write(&table->lock);
    em_status status = em__request_begin(table, &r, err);
    if (status == EM_OK)
        status = em__plan_and_find(&r, keys, n, false, err);
    if (status == EM_OK)
        status = em__erase_found(&r, erased, err);
    if (status == EM_OK)
        status = em__synchronize_devices(&r, err);
    em__request_end(&r);
    em_spread_unlock_write(&table->lock);
    atomic_fetch_add_explicit(&table->rows_erased, *erased, memory_order_relaxed);
    if (status != EM_OK)
        return em_error_prefix(err, "erase from table '%s': ", table->config.name);
    return EM_OK;
}

em_status em_table_erase(em_table *table, const uint64_t *keys, uint64_t n, uint64_t *erased,
                         em_error *err)
{
    em__change_begin(table);
    return em__change_end(table, erase_keys(table, keys, n, erased, err));
}

static em_status expire_rows(em_table *table, uint64_t scan, uint64_t *expired, em_error *err)
{
    *expired = 0;
    const em_eviction_config *config = &table->config.eviction;
    if ((config->max_age_steps == 0 && config->max_age_seconds == 0) || scan == 0)
        return EM_OK;
    uint64_t now_ms = em__unix_ms();
    /* time passes without pushes too */
    em__clock_sample(table, now_ms,
                     (uint32_t)atomic_load_explicit(&table->update_clock, memory_order_relaxed));
    uint32_t min_age;
    if (!em__expiry_age(table, now_ms, &min_age))
        return EM_OK;
    em_age_slice slice = {.sweep = true,
                          .min_age = min_age,
                          .scan = scan,
                          .keys = malloc(scan * sizeof(uint64_t)),
                          .rows = malloc(scan * sizeof(uint64_t))};
    em_status status = slice.keys == NULL || slice.rows == NULL
                           ? em_error_set(err, EM_RESOURCE_EXHAUSTED, "expiry: out of memory")
                           : em__age_slice(table, &slice, err);
    *expired = slice.removed;
    free(slice.keys);
    free(slice.rows);
    if (status != EM_OK)
        return em_error_prefix(err, "expiry of table '%s': ", table->config.name);
    return EM_OK;
}

em_status em_table_expire(em_table *table, uint64_t scan, uint64_t *expired, em_error *err)
{
    em__change_begin(table);
    return em__change_end(table, expire_rows(table, scan, expired, err));
}

/* Erases every row at least min_age pushes old, shard by shard, a slice at a time
 * (requests run between the slices); counted in rows_erased. */
static em_status erase_by_min_age(em_table *table, uint32_t min_age, uint64_t *erased,
                                  em_error *err)
{
    *erased = 0;
    if (!em_eviction_tracks_access(&table->config.eviction))
        return em_error_set(err, EM_FAILED_PRECONDITION,
                            "erase from table '%s' by age: the table keeps no access "
                            "metadata (it needs an eviction policy, max_age_steps or "
                            "max_age_seconds)",
                            table->config.name);
    enum { SCAN = 65536 };
    /* ages as of now: a row pushed between two slices is not taken by the later one */
    em_age_slice slice = {.min_age = min_age,
                          .from_start = true,
                          .start_clock = (uint32_t)atomic_load_explicit(&table->update_clock,
                                                                        memory_order_relaxed),
                          .scan = SCAN,
                          .keys = malloc(SCAN * sizeof(uint64_t)),
                          .rows = malloc(SCAN * sizeof(uint64_t))};
    em_status status = slice.keys == NULL || slice.rows == NULL
                           ? em_error_set(err, EM_RESOURCE_EXHAUSTED, "erase: out of memory")
                           : EM_OK;
    for (uint32_t s = 0; status == EM_OK && s < table->shard_count; s++) {
        slice.shard = s;
        slice.cursor = 0;
        do {
            status = em__age_slice(table, &slice, err);
            *erased += slice.removed;
        } while (status == EM_OK && !slice.wrapped);
    }
    free(slice.keys);
    free(slice.rows);
    if (status != EM_OK)
        return em_error_prefix(err, "erase from table '%s' by age: ", table->config.name);
    return EM_OK;
}

static em_status erase_not_pushed_for(em_table *table, uint32_t not_pushed_for, uint64_t *erased,
                                       em_error *err)
{
    *erased = 0;
    if (not_pushed_for == 0) /* no row was pushed in the last 0 pushes */
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "erase from table '%s' by age: not_pushed_for is 0, which would "
                            "take every row; it must be at least 1 (DROP_TABLE removes a "
                            "whole table)", table->config.name);
    /* a row pushed by the table's last push has age 0, by the one before it 1, ... */
    return erase_by_min_age(table, not_pushed_for, erased, err);
}

em_status em_table_erase_older(em_table *table, uint32_t not_pushed_for, uint64_t *erased,
                               em_error *err)
{
    em__change_begin(table);
    return em__change_end(table, erase_not_pushed_for(table, not_pushed_for, erased, err));
}

static em_status erase_pushed_before(em_table *table, uint64_t unix_ms, uint64_t *erased,
                                     em_error *err)
{
    *erased = 0;
    if (!em_eviction_tracks_access(&table->config.eviction))
        return erase_by_min_age(table, 0, erased, err); /* its precondition error */
    uint32_t now = (uint32_t)atomic_load_explicit(&table->update_clock, memory_order_relaxed);
    uint64_t now_ms = em__unix_ms();
    if (unix_ms >= now_ms) /* every row was pushed before now */
        return erase_by_min_age(table, 0, erased, err);
    em__clock_sample(table, now_ms, now);
    uint32_t then;
    if (!em__clock_at(table, unix_ms, &then))
        return EM_OK; /* no push of the table is known to be that old */
    /* rows updated at or before push `then` were updated at or before unix_ms */
    return erase_by_min_age(table, now - then, erased, err);
}

em_status em_table_erase_before(em_table *table, uint64_t unix_ms, uint64_t *erased,
                                em_error *err)
{
    em__change_begin(table);
    return em__change_end(table, erase_pushed_before(table, unix_ms, erased, err));
}

em_status em_table_evicted(em_table *table, uint64_t after, uint64_t max, uint64_t *keys,
                           em_evicted_view *view, em_error *err)
{
    (void)err;
    memset(view, 0, sizeof(*view));
    uint32_t ring = table->evicted_keys != NULL ? table->config.eviction.ring : 0;
    pthread_mutex_lock(&table->evicted_lock);
    uint64_t total = table->removed_total;
    uint64_t oldest = total > ring ? total - ring + 1 : 1; /* sequence of the oldest kept */
    uint64_t first = after + 1 > oldest ? after + 1 : oldest;
    uint64_t count = first <= total ? total - first + 1 : 0;
    if (count > max)
        count = max;
    for (uint64_t i = 0; i < count; i++)
        keys[i] = table->evicted_keys[(first + i - 1) % ring];
    pthread_mutex_unlock(&table->evicted_lock);
    view->total = total;
    view->count = count;
    view->first = count > 0 ? first : 0;
    view->missed = first > after + 1 ? first - after - 1 : 0;
    return EM_OK;
}

static em_status restore_evicted_ring(em_table *table, uint64_t total, const uint64_t *keys,
                                      uint64_t count, em_error *err)
{
    if (count > total)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "evicted keys of table '%s': %" PRIu64 " keys given of %" PRIu64
                            " removed", table->config.name, count, total);
    uint32_t ring = table->evicted_keys != NULL ? table->config.eviction.ring : 0;
    pthread_mutex_lock(&table->evicted_lock);
    table->removed_total = total;
    uint64_t first = count > ring ? count - ring : 0; /* the newest the ring has room for */
    for (uint64_t i = first; i < count; i++) /* key i has sequence total - count + 1 + i */
        table->evicted_keys[(total - count + i) % ring] = keys[i];
    pthread_mutex_unlock(&table->evicted_lock);
    return EM_OK;
}

em_status em_table_restore_evicted(em_table *table, uint64_t total, const uint64_t *keys,
                                   uint64_t count, em_error *err)
{
    em__change_begin(table);
    return em__change_end(table, restore_evicted_ring(table, total, keys, count, err));
}

/* ---- lifecycle and stats --------------------------------------------------------- */

static em_status create_shards(em_table *table, em_error *err)
{
    table->shards = calloc(table->shard_count, sizeof(*table->shards));
    table->shard_device = calloc(table->shard_count, sizeof(*table->shard_device));
    table->shard_locks = em_aligned_calloc(table->shard_count, sizeof(*table->shard_locks));
    table->shard_versions = em_aligned_calloc(table->shard_count,
                                              sizeof(*table->shard_versions));
    table->shard_creations = em_aligned_calloc(table->shard_count,
                                               sizeof(*table->shard_creations));
    if (table->shards == NULL || table->shard_device == NULL || table->shard_locks == NULL ||
        table->shard_versions == NULL || table->shard_creations == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "table '%s': out of host memory",
                            table->config.name);
    for (uint32_t s = 0; s < table->shard_count; s++)
        pthread_rwlock_init(&table->shard_locks[s].lock, NULL);
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
            .track_access = em_eviction_tracks_access(&table->config.eviction),
            .hash_seed = table->hash_seed,
        };
        if (table->config.admission.policy != EM_ADMISSION_ALWAYS &&
            device->ops->shard_fill_initial == NULL)
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "table '%s': admission other than 'always' is not available on "
                                "the %s backend",
                                table->config.name, table->backend->kind);
        if (spec.track_access &&
            (device->ops->shard_evict == NULL || device->ops->shard_touch == NULL ||
             device->ops->shard_expire == NULL))
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "table '%s': eviction (policy '%s', max_age_steps %u) is not "
                                "available on the %s backend (its tables take policy 'none' "
                                "and no expiry)",
                                table->config.name,
                                em_eviction_policy_name(table->config.eviction.policy),
                                table->config.eviction.max_age_steps, table->backend->kind);
        table->shard_device[s] = d;
        em_status status = device->ops->shard_create(device, &spec, &table->shards[s], err);
        if (status != EM_OK)
            return em_error_prefix(err, "table '%s' shard %u on %s: ", table->config.name, s,
                                   device->name);
    }
    table->shards_device = table->shard_device[0];
    for (uint32_t s = 1; s < table->shard_count; s++)
        if (table->shard_device[s] != table->shards_device)
            table->shards_device = UINT32_MAX;
    /* a new table's first requests create its keys: at once where they can
     * (pulls_create, pushes_create) */
    atomic_store_explicit(&table->pulls_create, true, memory_order_relaxed);
    atomic_store_explicit(&table->pushes_create, true, memory_order_relaxed);
    atomic_store_explicit(&table->pulls_go_general, false, memory_order_relaxed);
    atomic_store_explicit(&table->pushes_go_general, false, memory_order_relaxed);
    return EM_OK;
}

em_status em_table_create(em_backend *backend, const em_table_config *config, em_table **out,
                          em_error *err)
{
    return em_table_create_seeded(backend, config, 0, out, err);
}

em_status em_table_create_seeded(em_backend *backend, const em_table_config *config,
                                 uint64_t hash_seed, em_table **out, em_error *err)
{
    em_status status = em_table_config_validate(config, err);
    if (status != EM_OK)
        return status;
    em_table *table = em_aligned_calloc(1, sizeof(*table));
    if (table == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "table '%s': out of host memory",
                            config->name);
    table->config = *config;
    table->hash_seed = hash_seed;
    table->backend = backend;
    if (table->config.shards == 0)
        table->config.shards = backend->device_count;
    table->shard_count = table->config.shards;
    table->row_floats =
        config->dim + em_optimizer_state_floats(config->optimizer.kind, config->dim);
    table->nonnegative_from = em__nonnegative_run(table);
    table->evict_random = em_mix64(config->initializer.seed ^ 0x65766963746564ull);
    /* writers (requests alone) come first: a steady stream of requests beside each
     * other cannot starve them (lib/base/spread_lock.h) */
    if (em_spread_lock_init(&table->lock) != 0) {
        free(table);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "table '%s': out of host memory",
                            config->name);
    }
    pthread_mutex_init(&table->snapshot_mutex, NULL);
    pthread_mutex_init(&table->evicted_lock, NULL);
    pthread_mutex_init(&table->clock_lock, NULL);
    pthread_mutex_init(&table->admission_lock, NULL);
    table->clock_spacing_ms = 1000;
    if (config->admission.policy == EM_ADMISSION_COUNTER) {
        table->admission_counts = calloc(config->admission.counters, 1);
        if (table->admission_counts == NULL) {
            em_table_destroy(table);
            return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                "table '%s': out of host memory for %u admission counters",
                                config->name, config->admission.counters);
        }
    }
    if (em_eviction_tracks_access(&config->eviction) && config->eviction.ring > 0) {
        table->evicted_keys = calloc(config->eviction.ring, sizeof(uint64_t));
        if (table->evicted_keys == NULL) {
            em_table_destroy(table);
            return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                "table '%s': out of host memory for the evicted-key ring",
                                config->name);
        }
    }
    pthread_cond_init(&table->snapshot_room, NULL);
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
        pthread_rwlock_destroy(&table->shard_locks[s].lock);
    free(table->shard_locks);
    free(table->shard_versions);
    free((void *)table->shard_creations);
    free(table->shards);
    free(table->shard_device);
    em_spread_lock_destroy(&table->lock);
    pthread_mutex_destroy(&table->snapshot_mutex);
    pthread_mutex_destroy(&table->evicted_lock);
    pthread_mutex_destroy(&table->clock_lock);
    pthread_mutex_destroy(&table->admission_lock);
    free(table->evicted_keys);
    free(table->admission_counts);
    pthread_cond_destroy(&table->snapshot_room);
    em_table_set_attachment(table, NULL, NULL);
    free(table);
}

void em_table_set_attachment(em_table *table, void *data, void (*free_data)(void *))
{
    if (table->attachment != NULL && table->free_attachment != NULL)
        table->free_attachment(table->attachment);
    table->attachment = data;
    table->free_attachment = free_data;
}

uint64_t em_table_hash_seed(const em_table *table)
{
    return table->hash_seed;
}

void *em_table_attachment(const em_table *table)
{
    return table->attachment;
}

void em__change_begin(em_table *table)
{
    atomic_fetch_add(&table->changing, 1);
}

em_status em__change_end(em_table *table, em_status status)
{
    /* counted before it stops running: a reader that saw none running (changing, read
     * first) and the count it had is sure nothing returned in between */
    atomic_fetch_add(&table->changes, 1);
    atomic_fetch_sub(&table->changing, 1);
    return status;
}

uint64_t em_table_changes(const em_table *table)
{
    return atomic_load(&table->changes);
}

bool em_table_changed_since(const em_table *table, uint64_t changes)
{
    return atomic_load(&table->changing) != 0 || atomic_load(&table->changes) != changes;
}

const em_table_config *em_table_get_config(const em_table *table)
{
    return &table->config;
}

const char *em_table_name(const em_table *table)
{
    return table->config.name;
}

void em_table_mark_dropped(em_table *table)
{
    atomic_store_explicit(&table->dropped, true, memory_order_release);
}

bool em_table_dropped(const em_table *table)
{
    return atomic_load_explicit(&table->dropped, memory_order_acquire);
}

uint32_t em_table_dim(const em_table *table)
{
    return table->config.dim;
}

void em_table_get_stats(em_table *table, em_table_stats *out)
{
    memset(out, 0, sizeof(*out));
    em_spread_lock_read(&table->lock);
    for (uint32_t s = 0; s < table->shard_count; s++) {
        em_shard_stats shard;
        /* the shard's counts and sizes change under its write lock (inserts, growth) */
        em__shard_read_lock(table, s);
        table->shards[s]->device->ops->shard_stats(table->shards[s], &shard);
        em__shard_unlock(table, s);
        out->row_bytes += shard.row_bytes;
        out->index_bytes += shard.index_bytes;
        out->access_bytes += shard.access_bytes;
        out->index_rehashes_through_host += shard.index_rehashes_through_host;
        out->rows_evicted_chosen_on_gpu += shard.rows_evicted_chosen_on_gpu;
    }
    out->rows = atomic_load_explicit(&table->rows, memory_order_relaxed);
    em_spread_unlock_read(&table->lock);
    if (out->rows > 0) {
        out->index_bytes_per_row = (double)out->index_bytes / (double)out->rows;
        out->access_bytes_per_row = (double)out->access_bytes / (double)out->rows;
    }
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
    out->rows_evicted = atomic_load_explicit(&table->rows_evicted, memory_order_relaxed);
    out->rows_expired = atomic_load_explicit(&table->rows_expired, memory_order_relaxed);
    out->rows_erased = atomic_load_explicit(&table->rows_erased, memory_order_relaxed);
    out->pulls_not_admitted = atomic_load_explicit(&table->pulls_not_admitted,
                                                   memory_order_relaxed);
    out->pushes_dropped = atomic_load_explicit(&table->pushes_dropped, memory_order_relaxed);
    out->exclusive_retries =
        atomic_load_explicit(&table->exclusive_retries, memory_order_relaxed);
    out->requests_alone_first =
        atomic_load_explicit(&table->requests_alone_first, memory_order_relaxed);
    out->pulls_at_once = atomic_load_explicit(&table->pulls_at_once, memory_order_relaxed);
    out->pulls_found_again = atomic_load_explicit(&table->pulls_found_again,
                                                  memory_order_relaxed);
    out->pushes_found_again = atomic_load_explicit(&table->pushes_found_again,
                                                   memory_order_relaxed);
    out->pushes_at_once = atomic_load_explicit(&table->pushes_at_once, memory_order_relaxed);
}


/* ---- access metadata and clocks (checkpoints) ------------------------------------------ */

void em_table_get_clocks(em_table *table, em_table_clocks *out)
{
    memset(out, 0, sizeof(*out));
    out->access_clock = atomic_load_explicit(&table->access_clock, memory_order_relaxed);
    out->update_clock = atomic_load_explicit(&table->update_clock, memory_order_relaxed);
    pthread_mutex_lock(&table->clock_lock);
    out->samples = table->clock_samples;
    out->sample_spacing_ms = table->clock_spacing_ms;
    memcpy(out->sample_ms, table->clock_ms, table->clock_samples * sizeof(uint64_t));
    memcpy(out->sample_clock, table->clock_value, table->clock_samples * sizeof(uint32_t));
    pthread_mutex_unlock(&table->clock_lock);
}

static void set_table_clocks(em_table *table, const em_table_clocks *clocks, bool replace)
{
    uint64_t access = replace ? 0 : atomic_load_explicit(&table->access_clock,
                                                         memory_order_relaxed);
    uint64_t update = replace ? 0 : atomic_load_explicit(&table->update_clock,
                                                         memory_order_relaxed);
    atomic_store_explicit(&table->access_clock,
                          access > clocks->access_clock ? access : clocks->access_clock,
                          memory_order_relaxed);
    atomic_store_explicit(&table->update_clock,
                          update > clocks->update_clock ? update : clocks->update_clock,
                          memory_order_relaxed);
    uint32_t n = clocks->samples < EM_CLOCK_SAMPLES ? clocks->samples : EM_CLOCK_SAMPLES;
    if (n == 0)
        return;
    pthread_mutex_lock(&table->clock_lock);
    memcpy(table->clock_ms, clocks->sample_ms, n * sizeof(uint64_t));
    memcpy(table->clock_value, clocks->sample_clock, n * sizeof(uint32_t));
    table->clock_samples = n;
    if (clocks->sample_spacing_ms > 0)
        table->clock_spacing_ms = clocks->sample_spacing_ms;
    pthread_mutex_unlock(&table->clock_lock);
}

void em_table_set_clocks(em_table *table, const em_table_clocks *clocks, bool replace)
{
    em__change_begin(table);
    set_table_clocks(table, clocks, replace);
    (void)em__change_end(table, EM_OK);
}

/* One shard's part of em_table_set_access: keys (host) that route to shard s. */
static em_status set_shard_access(em_table *table, uint32_t s, const uint64_t *keys,
                                  const em_row_access *access, uint64_t n, uint64_t *rows,
                                  em_error *err)
{
    em_shard *shard = table->shards[s];
    em_device *device = shard->device;
    const em_device_ops *ops = device->ops;
    if (ops->shard_write_access == NULL)
        return em_error_set(err, EM_FAILED_PRECONDITION,
                            "the %s backend keeps no access metadata", table->backend->kind);
    em_lane *lane = NULL;
    em_status status = ops->lane_acquire(device, &lane, err);
    if (status != EM_OK)
        return status;
    /* find takes keys and gives rows in device memory; write_access takes host memory */
    uint64_t *device_keys = (uint64_t *)keys, *device_rows = rows;
    if (!device->host_addressable) {
        status = em_device_alloc(device, n * sizeof(uint64_t), "access keys",
                                 (void **)&device_keys, err);
        if (status == EM_OK)
            status = em_device_alloc(device, n * sizeof(uint64_t), "access rows",
                                     (void **)&device_rows, err);
        if (status == EM_OK)
            status = ops->copy_to_device(lane, device_keys, keys, n * sizeof(uint64_t), err);
    }
    em__shard_write_lock(table, s);
    uint64_t missing = 0;
    if (status == EM_OK)
        status = ops->shard_find(shard, lane, device_keys, n, device_rows, &missing, err);
    if (status == EM_OK && !device->host_addressable) {
        status = ops->copy_to_host(lane, rows, device_rows, n * sizeof(uint64_t), err);
        if (status == EM_OK)
            status = ops->synchronize(lane, err);
    }
    for (uint64_t i = 0; status == EM_OK && missing > 0 && i < n; i++)
        if (!em_row_stored(rows[i]))
            status = em_error_set(err, EM_NOT_FOUND, "key %" PRIu64 " is not in the table",
                                  keys[i]);
    if (status == EM_OK)
        status = ops->shard_write_access(shard, lane, rows, n, access, err);
    em__shard_unlock(table, s);
    if (!device->host_addressable) {
        em_device_free(device, device_rows == rows ? NULL : device_rows);
        em_device_free(device, device_keys == keys ? NULL : device_keys);
    }
    ops->lane_release(lane);
    return status;
}

static em_status set_rows_access(em_table *table, const uint64_t *keys,
                                 const em_row_access *access, uint64_t n, em_error *err)
{
    if (!em_eviction_tracks_access(&table->config.eviction) || n == 0)
        return EM_OK;
    uint32_t shards = table->shard_count;
    uint64_t *start = calloc((size_t)shards + 1, sizeof(uint64_t));
    uint64_t *cursor = calloc(shards, sizeof(uint64_t));
    uint64_t *grouped = malloc(n * sizeof(uint64_t)), *rows = malloc(n * sizeof(uint64_t));
    em_row_access *grouped_access = malloc(n * sizeof(em_row_access));
    em_status status = EM_OK;
    if (start == NULL || cursor == NULL || grouped == NULL || rows == NULL ||
        grouped_access == NULL)
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
    for (uint64_t i = 0; status == EM_OK && i < n; i++)
        start[em_key_shard(keys[i], shards) + 1]++;
    for (uint32_t s = 0; status == EM_OK && s < shards; s++)
        start[s + 1] += start[s];
    for (uint64_t i = 0; status == EM_OK && i < n; i++) {
        uint32_t s = em_key_shard(keys[i], shards);
        uint64_t at = start[s] + cursor[s]++;
        grouped[at] = keys[i];
        grouped_access[at] = access[i];
    }
    bool locked = status == EM_OK;
    if (locked)
        em_spread_lock_read(&table->lock);
    for (uint32_t s = 0; status == EM_OK && s < shards; s++)
        if (start[s + 1] > start[s])
            status = set_shard_access(table, s, grouped + start[s], grouped_access + start[s],
                                      start[s + 1] - start[s], rows, err);
    if (locked)
        em_spread_unlock_read(&table->lock);
    free(start);
    free(cursor);
    free(grouped);
    free(rows);
    free(grouped_access);
    if (status != EM_OK)
        return em_error_prefix(err, "access metadata of table '%s': ", table->config.name);
    return EM_OK;
}

em_status em_table_set_access(em_table *table, const uint64_t *keys, const em_row_access *access,
                              uint64_t n, em_error *err)
{
    em__change_begin(table);
    return em__change_end(table, set_rows_access(table, keys, access, n, err));
}

/* ---- the admission sketch (checkpoints) ---------------------------------------------- */

uint64_t em_table_admission_bytes(const em_table *table)
{
    return table->admission_counts != NULL ? table->config.admission.counters : 0;
}

void em_table_get_admission(em_table *table, uint8_t *out)
{
    if (table->admission_counts == NULL)
        return;
    pthread_mutex_lock(&table->admission_lock); /* requests count sightings under it */
    memcpy(out, table->admission_counts, table->config.admission.counters);
    pthread_mutex_unlock(&table->admission_lock);
}

static em_status merge_admission_counts(em_table *table, const uint8_t *counts, uint64_t bytes,
                                        em_error *err)
{
    if (bytes != em_table_admission_bytes(table))
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "admission sketch of table '%s': %" PRIu64 " counters given, it has "
                            "%" PRIu64, table->config.name, bytes,
                            em_table_admission_bytes(table));
    pthread_mutex_lock(&table->admission_lock);
    for (uint64_t i = 0; i < bytes; i++)
        if (counts[i] > table->admission_counts[i])
            table->admission_counts[i] = counts[i];
    pthread_mutex_unlock(&table->admission_lock);
    return EM_OK;
}

em_status em_table_merge_admission(em_table *table, const uint8_t *counts, uint64_t bytes,
                                   em_error *err)
{
    em__change_begin(table);
    return em__change_end(table, merge_admission_counts(table, counts, bytes, err));
}
