/*
 * DESIGN: what the table's files share (lib/table/table.c: create, lock, pull, push,
 * stats; table_request.c: the request engine over shards and devices;
 * table_transfer.c: import and export). Not a public header: nothing outside
 * lib/table/ includes it.
 *
 * A request_context tracks every scratch buffer a request takes (freed at the end
 * whatever happens) and the plan of the request:
 *
 *   home device   stages the input, dedupes keys, partitions the unique keys by shard
 *   shard_start   prefix sums of keys per shard: shard s owns partitioned[start[s] ..
 *                 start[s+1])
 *   segments      one per device: the contiguous range of partitioned keys its shards
 *                 own, with that device's copies of keys / rows / vectors. A segment on
 *                 the home device aliases the home buffers; others are filled and
 *                 drained through the backend's exchange.
 */
#ifndef EMBER_LIB_TABLE_INTERNAL_H
#define EMBER_LIB_TABLE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "lib/base/aligned.h"
#include "lib/base/rwlock.h"
#include "lib/base/spread_lock.h"
#include "lib/table/table.h"

/* A request addresses keys with 32-bit positions (inverse, position arrays). */
#define MAX_KEYS_PER_REQUEST UINT32_MAX
/* (time, push clock) samples a table keeps for ages in seconds. */
#define EM_CLOCK_SAMPLES EM_TABLE_CLOCK_SAMPLES

/* Scratch buffers per request: a few at home plus a few per device segment. */
#define SCRATCH_FIXED 16u
#define SCRATCH_PER_DEVICE 4u

/* Per-shard words that requests on different threads write (a shard's lock, its
 * versions and creations): one a cache line, so that work on one shard does not move
 * another's line between cores (arrays of them: em_aligned_calloc). */
typedef struct em_shard_lock {
    _Alignas(64) pthread_rwlock_t lock;
} em_shard_lock;
typedef struct em_shard_word {
    _Alignas(64) uint64_t value;
} em_shard_word;
typedef struct em_shard_counter {
    _Alignas(64) _Atomic uint64_t value;
} em_shard_counter;

/* A table is allocated 64-byte aligned (em_aligned_calloc): the groups of fields that
 * requests write on every thread (counters, clocks, the change counts) each start a
 * cache line of their own, apart from the fields requests only read. */
struct em_table {
    em_table_config config;
    uint64_t hash_seed; /* of the shards' maps (em_table_create_seeded) */
    em_backend *backend;
    uint32_t shard_count;
    uint32_t row_floats;
    uint32_t nonnegative_from; /* em__nonnegative_run: imports' fast value check */
    em_shard **shards;
    uint32_t *shard_device; /* device index of each shard */
    uint32_t shards_device; /* the device index of every shard when they share one, else
                             * UINT32_MAX: the home of every request to the table
                             * (em__request_begin), which then gathers per-key pulls into
                             * the output and writes imported rows from where they
                             * arrived (targets), no copy between (em__shards_at_home) */
    em_spread_lock lock;
    em_shard_lock *shard_locks; /* readers gather or export, writers apply or write */
    em_shard_word *shard_versions; /* moved by every step and write of a shard (under
                                    * its write lock): 1 for a bounded step, more for
                                    * anything else; a push that checked a shard under
                                    * its read lock checks it again when its check no
                                    * longer holds (row_check.h) */
    /* Rows in the table, and rows + the rows that requests creating keys under the shared
     * lock have claimed (em__claim_rows; never above capacity). Both change together
     * through em__rows_added and em__rows_removed. */
    _Alignas(64) _Atomic uint64_t rows, rows_claimed;
    /* moved (under the shard's write lock) each time keys are created in a shard: a
     * request that found keys missing looks them up again before creating them when
     * their shard's count moved since (em__refind_created) */
    _Alignas(64) em_shard_counter *shard_creations;
    /* The snapshot being read (table_snapshot.c), set and cleared holding every shard's
     * write lock and snapshot_mutex; snapshot_room signals freed copies. */
    struct em_table_snapshot *snapshot;
    _Atomic bool saving; /* snapshot != NULL, for em__snapshot_wait_room's quick look */
    _Atomic bool dropped; /* em_table_mark_dropped */
    pthread_mutex_t snapshot_mutex;
    pthread_cond_t snapshot_room;
    _Alignas(64) _Atomic uint64_t pulls, pushes, imports, keys_pulled, keys_pushed, rows_created;
    /* eviction (tables with a policy): the clocks rows are stamped with (requests, and
     * pushes), the rows removed, and the state of the sampling's pseudo-random numbers
     * (under the exclusive lock) */
    _Alignas(64) _Atomic uint64_t access_clock, update_clock, rows_evicted, rows_expired,
        rows_erased;
    _Alignas(64) uint64_t evict_random;
    /* the last keys the policy removed (evicted or expired): key with sequence q (1, 2,
     * ... over removed_total) sits at evicted_keys[(q - 1) % ring]; under evicted_lock */
    pthread_mutex_t evicted_lock;
    uint64_t *evicted_keys;
    uint64_t removed_total;
    /* admission: the counter policy's sketch (under admission_lock: requests admit keys
     * under the shared table lock), and what was refused */
    pthread_mutex_t admission_lock;
    uint8_t *admission_counts;
    _Alignas(64) _Atomic uint64_t pulls_not_admitted, pushes_dropped;
    _Atomic uint64_t exclusive_retries; /* run_shared_then_exclusive's second attempts */
    /* Pulls (pushes) in a row that had to make room (table.c: run_shared_then_exclusive);
     * from ALONE_AFTER on, the next ones take the exclusive lock first */
    _Atomic uint32_t pulls_making_room, pushes_making_room;
    _Atomic uint64_t requests_alone_first; /* such requests */
    _Atomic uint64_t pulls_at_once, pushes_at_once; /* served with one wait for the GPU */
    _Atomic uint64_t pulls_found_again, pushes_found_again; /* table.c: go_again */
    /* A table of several shards: set when a pull (push) at once found keys missing, whose
     * work is then done again the general way; the next pulls (pushes) go the general way
     * from the start until one of them finds every key (table.c: pull_at_once). */
    _Atomic bool pulls_go_general, pushes_go_general;
    /* Set while the table's pulls create keys (a pull at once found some absent; a new
     * table), cleared by a pull at once that found every key: pulls at once then make room for every key of their
     * batch and create the absent ones there (table.c: pull_at_once). */
    _Atomic bool pulls_create, pushes_create; /* the same for pushes */
    /* A table over several devices: set when a pull (push) that did not wait for its
     * finds (table.c: may_find_later) found keys missing and went again; its next pulls
     * (pushes) wait for their finds until one of them finds every key. */
    _Atomic bool pulls_find_first, pushes_find_first;
    /* (time, push clock) samples, oldest first, for ages in seconds (table_request.c:
     * em__clock_at); under clock_lock */
    _Alignas(64) pthread_mutex_t clock_lock;
    uint64_t clock_ms[EM_CLOCK_SAMPLES];
    uint32_t clock_value[EM_CLOCK_SAMPLES];
    uint32_t clock_samples;
    uint64_t clock_spacing_ms;
    /* the expiry sweep's position: a shard and a cursor in its map (exclusive lock) */
    uint32_t expire_shard;
    uint64_t expire_cursor;
    /* The calls that may change what a checkpoint holds of the table (table.h:
     * em_table_changes): those returned, and those running now. */
    _Alignas(64) _Atomic uint64_t changes;
    _Atomic uint32_t changing;
    /* em_table_set_attachment */
    _Alignas(64) void *attachment;
    void (*free_attachment)(void *);
};

typedef struct scratch_item {
    em_device *device;
    void *pointer;
    bool block; /* a scratch block (em_device_scratch_take), given back to the device */
} scratch_item;

/* The slice of a request that one device handles. */
typedef struct segment {
    em_device *device;
    em_lane *lane;
    uint32_t first_shard, end_shard;
    uint64_t begin, count; /* range in the partitioned order */
    bool remote;           /* device is not the home device */
    bool settle_pending;   /* its inserts are enqueued, their settle waits for the
                            * request's last synchronisation (r->settle_later) */
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
    /* small scratch is carved from one block per device (em__request_alloc), so a
     * request of a few keys takes the device pool's lock once, not a dozen times */
    struct scratch_block {
        char *base;
        size_t used, size;
    } *blocks; /* by device index */
    em_device_batch batch;     /* offsets, inverse, position, counts at home */
    const uint64_t *keys;      /* the batch keys at home */
    uint64_t *partitioned;     /* unique keys grouped by shard, at home */
    uint32_t *first;           /* first position of each unique key in the batch, at home */
    uint32_t *targets;         /* direct pulls: output position per partitioned key */
    uint64_t *shard_start;     /* host, shard_count + 1 */
    uint64_t *shard_missing;   /* host, shard_count */
    uint64_t *shard_rejected;  /* host, shard_count: keys not admitted (EM_ROW_REJECTED) */
    uint64_t *shard_seen;      /* host, shard_count: shard_creations when the keys were found */
    uint64_t rows_claimed;     /* em__claim_rows: capacity held for the keys to create */
    uint64_t rejected;
    segment *segments;         /* one per device */
    uint64_t missing;          /* distinct keys not in the table */
    float gradient_bound;      /* push: a bound on the summed gradients' sizes, or -1 */
    uint64_t access_stamp;     /* the table's request clock for this request (eviction) */
    uint32_t update_stamp;     /* its push clock, once the request steps rows */
    bool has_update_stamp;
    bool rows_written_next;    /* an import: every created row is written next, nothing
                                * in between can fail, no one else reads (insert_missing's
                                * initialize) */
    bool stop_when_full;       /* the find may stop once more keys are missing than the
                                * table has room for (a shared attempt that would create
                                * every key it misses) */
    bool find_stopped;         /* it did: keys of later shards were not looked up, and
                                * the attempt must run again alone */
    bool alone;                /* it holds the table's lock exclusively: its shards' work
                                * may run on the backend's eviction threads */
    bool keys_absent;          /* an import into a table being built, none of whose keys
                                * it holds: shards on the host's memory skip the find */
    bool counts_later;         /* the find's missing counts may come back with a later
                                * wait (em__missing_found): a request that creates
                                * nothing, or one that goes again when keys were missing
                                * (table.c: finds_later, push_finds_later) */
    bool counts_pending;       /* they do: r->missing is known after the devices' next
                                * synchronisation */
    bool found_missing_late;   /* em__check_create_apply: the counts came back with the
                                * checks, some key was missing, and nothing was changed */
    bool needs_alone;          /* em__check_create_apply: keys found missing with the
                                * checks' wait, no room for them beside other requests:
                                * nothing was changed, the push runs again alone */
    bool made_room;            /* em__create_missing evicted rows to make room */
    struct unchecked_push *unchecked; /* a push's checks enqueued, their answers left to
                                       * its evictions' wait (table_request.c) */
    bool checked_at_once;      /* a push planned from its attempt at once (one shard),
                                * which checked every key's step there, those of the
                                * keys to create too, and found no problem, the shard at
                                * checked_version: em__check_create_apply takes that
                                * check (and checks again if the shard moved since) */
    uint64_t checked_version;
    bool settle_later;         /* a request alone with a table on GPUs: its inserts'
                                * settle (the maps' counts read back) waits for its last
                                * synchronisation (em__finish_devices), and the write
                                * locks of its shards are held until then
                                * (em__run_on_shards takes none) */
    const float **row_scratch; /* with row_sources: a shard's sources, n of them at most
                                * (taken before any key is created) */
    const float *const *row_sources; /* an import whose rows are where these point, by
                                      * the batch's order (shard_write_rows_from) */
} request_context;

/* After em__synchronize_devices of a request whose find counts came back with its
 * answer (counts_later): adds them up into r->missing. */
void em__missing_found(request_context *r);

/* What em__run_on_shards does on each shard. */
typedef enum shard_work { WORK_GATHER, WORK_APPLY, WORK_WRITE } shard_work;

/* A shard's lock is held for a few microseconds at a time: a thread that finds it taken
 * retries for about as long before it sleeps, since waking a sleeper costs more than
 * the wait (em_rwlock_*: lib/base/rwlock.h). */
static inline void em__shard_read_lock(em_table *table, uint32_t s)
{
    em_rwlock_read_lock(&table->shard_locks[s].lock);
}

static inline void em__shard_write_lock(em_table *table, uint32_t s)
{
    em_rwlock_write_lock(&table->shard_locks[s].lock);
}

/* Releases a shard's lock, read or write. */
static inline void em__shard_unlock(em_table *table, uint32_t s)
{
    pthread_rwlock_unlock(&table->shard_locks[s].lock);
}

/* Every shard's lock (write or read), in shard order, as every holder of several takes
 * them; em__unlock_all_shards releases them. */
static inline void em__lock_all_shards(em_table *table, bool write)
{
    for (uint32_t s = 0; s < table->shard_count; s++)
        if (write)
            em__shard_write_lock(table, s);
        else
            em__shard_read_lock(table, s);
}

static inline void em__unlock_all_shards(em_table *table)
{
    for (uint32_t s = 0; s < table->shard_count; s++)
        em__shard_unlock(table, s);
}

/* Claims capacity for the request's missing keys, to create them under the shared table
 * lock: false (nothing claimed) when the table cannot take them without evicting. The
 * claim is given back once the keys are created (em__create_missing) or the request
 * ends. */
bool em__claim_rows(request_context *r);

/* em__claim_rows of n rows; em__release_claim gives back what the request holds. */
bool em__claim_capacity(request_context *r, uint64_t n);
/* The rows the table may still get: capacity less the rows stored and claimed. */
uint64_t em__room_left(em_table *table);
void em__release_claim(request_context *r);

/* A call that may change what a checkpoint holds of the table runs between these
 * (em_table_changes); em__change_end returns status. */
void em__change_begin(em_table *table);
em_status em__change_end(em_table *table, em_status status);

/* The table gained or lost n rows (the caller holds the shards' write locks). */
void em__rows_added(em_table *table, uint64_t n);
void em__rows_removed(em_table *table, uint64_t n);

/* For every shard where the request creates keys (its write lock held by the caller):
 * when keys were created in the shard since the request found its keys, looks up again
 * those it found missing, and those now present take their rows (no longer missing).
 * stale (nullable, shard_count) gets true for each shard where that happened. */
em_status em__refind_created(request_context *r, bool *stale, em_error *err);

/* Where a row's floats that must be >= 0 begin, when they are one run to the end of
 * the row (true of every optimizer's state: em_optimizer_state_nonnegative); else
 * UINT32_MAX, and imports check every row float by float (table_transfer.c). */
uint32_t em__nonnegative_run(const em_table *table);

/* ---- the request engine (lib/table/table_request.c) --------------------------------- */

/* Sets up r for one request on table and takes a lane on every device. Always pair with
 * em__request_end, even when this fails. */
em_status em__request_begin(em_table *table, request_context *r, em_error *err);
/* em__request_begin for an attempt that goes again after one that changed nothing: it
 * stamps the rows it touches with that one's access stamp (stamp, or 0 for a new one),
 * so a request takes one value of the table's access clock however many attempts it
 * makes, as on a backend where it makes one. */
em_status em__request_begin_stamped(em_table *table, request_context *r, uint64_t stamp,
                                    em_error *err);

/* The rows a table's shards hold (with their write locks, or the table's lock held
 * exclusively). */
static inline uint64_t em__stored_rows(em_table *table)
{
    uint64_t rows = 0;
    for (uint32_t s = 0; s < table->shard_count; s++) {
        em_shard_stats stats;
        table->shards[s]->device->ops->shard_stats(table->shards[s], &stats);
        rows += stats.rows;
    }
    return rows;
}

/* Whether every shard of the request's table is on its home device (the home device
 * goes round the backend's devices, request by request). */
static inline bool em__shards_at_home(const request_context *r)
{
    return r->table->shards_device == r->home->index;
}

/* Releases the lanes (after synchronizing them) and every scratch buffer. */
void em__request_end(request_context *r);

/* Plans a one-shard request from what it found at once (pull_at_once, push_at_once:
 * the dedupe and find of its keys on the home device, their counts back on the host),
 * as em__plan_and_find would have left it, so that it goes on to create the missing
 * keys without finding them again. seen: the shard's creations when the keys were
 * found; want_targets as em__plan_and_find's. */
void em__plan_found(request_context *r, uint64_t nnz, uint64_t *unique, uint32_t *inverse,
                    uint32_t *first, uint64_t *rows, uint64_t unique_count, uint64_t missing,
                    uint64_t seen, bool want_targets);

/* The request's scratch at one point, to give back what it took since (on its home
 * device) once its lanes have synchronized: a first attempt that gives way to another
 * in the same request. */
typedef struct request_mark {
    uint32_t scratch_count;
    struct scratch_block home_block;
} request_mark;

request_mark em__request_mark(const request_context *r);
void em__request_rewind(request_context *r, const request_mark *mark);

/* A scratch buffer on device, freed by em__request_end. */
em_status em__request_alloc(request_context *r, em_device *device, size_t bytes,
                            const char *what, void **out, em_error *err);

/* Makes host data visible at home: aliased when the home device addresses host memory,
 * else copied into scratch. */
em_status em__stage_input(request_context *r, const void *host, size_t bytes,
                          const char *what, const void **out, em_error *err);

/* Stages the batch's row offsets at home (r->batch.offsets). */
em_status em__stage_offsets(request_context *r, const em_csr *batch, em_error *err);

/* Stages the batch keys, dedupes, partitions, sends each device its keys and finds
 * them. Changes nothing in the table. want_targets asks for the output position of
 * every partitioned key (for gathering straight into a per-key output). */
em_status em__plan_and_find(request_context *r, const uint64_t *host_keys, uint64_t nnz,
                            bool want_targets, em_error *err);

/* One slice of removing rows by age: up to scan map entries of one shard examined
 * from a cursor, those at least min_age pushes old removed (their keys and rows land in
 * keys/rows, scan entries of room each). The sweep (expiry) keeps its shard and cursor
 * in the table and counts in rows_expired and the ring; otherwise (ERASE by age) the
 * caller's shard and cursor are used and the rows count in rows_erased. Takes the
 * exclusive table lock for the slice. */
typedef struct em_age_slice {
    bool sweep;
    uint32_t shard;        /* not sweep */
    uint64_t cursor;       /* not sweep: 0 to start */
    uint32_t min_age;
    bool from_start;       /* min_age is as of push clock start_clock: rows pushed since
                            * (between slices) are younger by as many pushes */
    uint32_t start_clock;
    uint64_t scan;
    uint64_t *keys, *rows; /* host, scan entries each */
    uint64_t removed;      /* out */
    bool wrapped;          /* out: the shard's map was examined to its end */
} em_age_slice;

em_status em__age_slice(em_table *table, em_age_slice *slice, em_error *err);

/* Wall-clock time in milliseconds since 1970. */
uint64_t em__unix_ms(void);

/* Records that the table's push clock reads clock at unix_ms (kept when the last sample
 * is at least the spacing older). */
void em__clock_sample(em_table *table, uint64_t unix_ms, uint32_t clock);

/* The push clock of the last sample at or before unix_ms: every row whose last update
 * is older than that clock was last updated before unix_ms. False when no sample is
 * that old. */
bool em__clock_at(em_table *table, uint64_t unix_ms, uint32_t *clock);

/* The age in pushes at which a row expires now (max_age_steps + 1, and through the
 * samples the age of rows last updated before max_age_seconds ago, the smaller), or
 * false when no row can be old enough yet. */
bool em__expiry_age(em_table *table, uint64_t now_ms, uint32_t *min_age);

/* Admission (lib/table/table_config.h), before any key is created, under the shared or
 * the exclusive table lock: the missing keys the policy refuses get EM_ROW_REJECTED and
 * leave the missing counts (r->rejected, r->shard_rejected). With count_sightings,
 * counter admission counts each missing key's sighting (under admission_lock); without,
 * it only reads the counts (a request's second attempt, whose sightings its first
 * attempt counted). */
em_status em__admit_missing(request_context *r, bool count_sightings, em_error *err);

/* Keeps count keys the policy removed in the table's ring and counts them in counter
 * (rows_evicted or rows_expired). The ring numbers one call's keys in ascending order,
 * so that it does not depend on where a backend's map held them; keys is reordered.
 * later: the keys the caller records next, for the same request (its other shards):
 * only the keys the ring still holds after those are sorted (the largest, last), so an
 * EVICTED that reads between the two calls may see the others in the map's order. */
void em__record_evicted(em_table *table, uint64_t *keys, uint64_t count, uint64_t later,
                        _Atomic uint64_t *counter);

/* Erases the request's keys that were found (under the exclusive table lock; each
 * shard's write lock is taken here); *erased of them. */
em_status em__erase_found(request_context *r, uint64_t *erased, em_error *err);

/* Creates every missing key, or nothing: capacity and memory are settled first. The
 * write locks of the shards that get keys are taken here unless locks_held (the caller
 * holds them). */
em_status em__create_missing(request_context *r, bool locks_held, em_error *err);

/* A request alone with a table on GPUs (r->alone, every shard's inserts enqueued) that
 * is about to create keys: takes the write locks of its shards, held until
 * em__finish_devices, and leaves its inserts' settle to that last wait (then
 * em__create_missing(r, true, ...)). false, taking nothing, for any other request. */
bool em__hold_for_settle(request_context *r);

/* The request's last wait: synchronizes its devices (after an error, status, only when
 * inserts wait to settle), settles those inserts, and lets go of the shards held for
 * them. Returns the request's status: status, else what the wait or the settle found. */
em_status em__finish_devices(request_context *r, em_status status, em_error *err);

/* Runs one operation on every shard over its keys' rows and its part of the segment
 * payload (floats_per_key floats per key). */
/* Push: holding the write locks of every shard the push touches, checks that every
 * row's step keeps it finite (common/row_check.h), then creates the missing rows, then
 * applies the steps shard by shard, letting each shard go once stepped; on a problem
 * nothing is created or applied and the error names the key and the element
 * (INVALID_ARGUMENT). */
/* Before a write to rows of shard s (device memory, n of them) under its write lock:
 * copies aside the snapshot's rows it is the first to change (table_snapshot.c). */
em_status em__snapshot_preserve(em_table *table, uint32_t s, em_lane *lane, const uint64_t *rows,
                                uint64_t n, em_error *err);
/* Before taking a lane or any shard lock to write: waits while a snapshot's copies are
 * over their limit (the snapshot's reader takes a lane to free them). */
void em__snapshot_wait_room(em_table *table);
/* Before any row of the request is written: em__snapshot_preserve on every shard it
 * touches, holding each shard's write lock (take_locks) or with all of them held. */
em_status em__preserve_for_snapshot(request_context *r, bool take_locks, em_error *err);
/* A push's check, creation of its missing keys, and step, and the wait for its devices.
 * A push whose find counts are pending (counts_later) gets them with the checks' wait:
 * when some key was missing, with admission `always` it creates it (or, finding no room
 * beside other requests, stops there, r->needs_alone set, the table unchanged), under
 * another admission it stops there, r->found_missing_late set, the table unchanged. */
em_status em__check_create_apply(request_context *r, em_error *err);

em_status em__run_on_shards(request_context *r, shard_work work, uint32_t floats_per_key,
                            em_error *err);

/* Puts each segment's share of a home array (element_bytes per key, in partitioned
 * order) on the segment's device: aliased at home, sent through the exchange
 * elsewhere. Stores the device pointers through pointer_of. */
em_status em__scatter_to_segments(request_context *r, const void *home_array,
                                  size_t element_bytes, const char *what,
                                  void **(*pointer_of)(segment *), em_error *err);

/* The payload slot of a segment (a em__scatter_to_segments destination). */
void **em__segment_payload(segment *seg);

/* The reverse: remote segments' payloads come back into the home array. */
em_status em__gather_from_segments(request_context *r, void *home_array,
                                   size_t element_bytes, em_error *err);

/* Allocates the payload of every remote segment (local ones alias home_array). */
em_status em__prepare_payloads(request_context *r, float *home_array, uint32_t floats_per_key,
                               const char *what, em_error *err);

/* Waits for every lane of the request, in one wait where the devices can
 * (em_device_ops.synchronize_lanes). */
em_status em__synchronize_devices(request_context *r, em_error *err);

/* Joins the lanes of the request's other devices to its home lane (em_device_ops.lane_join),
 * so that the home lane's next synchronisation, the end of the output's copy, also
 * waits for them: a request over several GPUs then waits once at its end. */
em_status em__join_devices(request_context *r, em_error *err);

#endif
