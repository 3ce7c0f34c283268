/*
 * DESIGN: embedding tables - sharded, on a backend's devices.
 *
 * A table has a dim, a capacity, an optimizer, an initializer and N shards; key k
 * belongs to shard em_key_shard(k, N) (common/keyhash.h). Each shard lives on one device
 * of the backend (contiguous blocks of shards per device) and keeps its rows there.
 *
 * A request is checked whole before anything is touched (CSR shape, lengths,
 * non-finite gradients), then runs as: stage on a home device, dedupe, partition by
 * shard, exchange to the owners, find the keys, check capacity for the keys it would
 * create and reserve their memory, create, gather or apply, exchange back, combine.
 * Every failure happens before the first row is created or updated, so a request that
 * cannot be applied whole applies nothing.
 *
 * Concurrency: a table-wide read-write lock and one read-write lock per shard. Pulls and
 * pushes hold the table lock shared and run concurrently: finds and gathers read a
 * shard under its read lock, key creation and optimizer steps change it under its write
 * lock, so a pull never sees a row half-updated and a shard applies pushes one at a
 * time. A request that creates keys first claims capacity for them from a table-wide
 * count (never above capacity); under the shards' write locks it looks up again the keys
 * other requests created since it found them (they take those rows), then creates the
 * rest. Only a request that cannot claim its capacity (the table needs room made by
 * eviction, or the request is refused whole at capacity) runs again under the exclusive
 * table lock, as do imports, erases and expiry. Requests from one caller apply in the
 * order they are made.
 */
#ifndef EMBER_LIB_TABLE_H
#define EMBER_LIB_TABLE_H

#include <stdbool.h>
#include <stdint.h>

#include "lib/device/backend.h"
#include "lib/table/csr.h"
#include "lib/base/status.h"
#include "lib/table/table_config.h"

typedef struct em_table em_table;

typedef struct em_pull_request {
    em_csr batch;
    em_combiner combiner;
    bool create_missing;
    float *out;            /* em_csr_output_vectors() x dim floats, caller-owned */
    uint64_t out_capacity; /* floats available at out */
} em_pull_request;

typedef struct em_pull_result {
    uint64_t unique_keys; /* distinct keys in the batch */
    uint64_t missing;     /* distinct keys that were not in the table */
    uint64_t created;     /* of those, how many this request inserted (create_missing) */
} em_pull_result;

typedef struct em_push_request {
    em_csr batch;
    em_combiner combiner;
    const float *gradients;     /* em_csr_output_vectors() x dim floats */
    uint64_t gradient_count;    /* floats at gradients */
} em_push_request;

typedef struct em_push_result {
    uint64_t updated; /* distinct keys updated (one optimizer step each) */
    uint64_t created; /* of those, how many were new */
} em_push_result;

/* A table's numbers, declared once: X(type, name, kind, unit, help). kind is COUNTER
 * (only grows) or GAUGE; unit NONE, BYTES or RATIO. The struct below is generated from
 * this list, and so are the daemon's stats schema and wire rendering (daemon/stats.h). */
#define EM_TABLE_STATS(X)                                                                     \
    X(uint64_t, rows, GAUGE, NONE, "rows stored")                                             \
    X(uint64_t, capacity, GAUGE, NONE, "most rows the table may hold")                        \
    X(uint32_t, dim, GAUGE, NONE, "floats per embedding vector")                              \
    X(uint32_t, shards, GAUGE, NONE, "shards the table is split into")                        \
    X(uint32_t, row_floats, GAUGE, NONE, "floats per row: dim plus optimizer state")          \
    X(uint64_t, row_bytes, GAUGE, BYTES, "row storage over all shards")                       \
    X(uint64_t, index_bytes, GAUGE, BYTES, "hash maps over all shards")                       \
    X(uint64_t, access_bytes, GAUGE, BYTES,                                                   \
      "per-row access metadata for eviction over all shards (16 bytes a row)")                \
    X(double, index_bytes_per_row, GAUGE, BYTES,                                              \
      "hash map bytes per row stored (index_bytes / rows; 0 when empty)")                     \
    X(double, access_bytes_per_row, GAUGE, BYTES,                                             \
      "access metadata bytes per row stored (access_bytes / rows; 0 when empty)")             \
    X(uint64_t, pulls, COUNTER, NONE, "pull requests served")                                 \
    X(uint64_t, pushes, COUNTER, NONE, "push requests applied")                               \
    X(uint64_t, imports, COUNTER, NONE, "import batches applied")                             \
    X(uint64_t, keys_pulled, COUNTER, NONE, "keys read by pulls")                             \
    X(uint64_t, keys_pushed, COUNTER, NONE, "keys updated by pushes")                         \
    X(uint64_t, rows_created, COUNTER, NONE, "rows inserted")                                 \
    X(uint64_t, rows_evicted, COUNTER, NONE, "rows removed by the eviction policy to make room") \
    X(uint64_t, rows_expired, COUNTER, NONE,                                                  \
      "rows removed by the expiry sweep (eviction.max_age_steps)")                            \
    X(uint64_t, rows_erased, COUNTER, NONE, "rows removed by ERASE")                          \
    X(uint64_t, pulls_not_admitted, COUNTER, NONE,                                            \
      "keys pulled with create_missing that admission did not store (read as initial)")       \
    X(uint64_t, pushes_dropped, COUNTER, NONE,                                                \
      "keys whose pushed gradients were dropped: admission did not store them")             \
    X(uint64_t, exclusive_retries, COUNTER, NONE,                                             \
      "pulls and pushes run again under the exclusive table lock to make room for keys")     \
    X(uint64_t, requests_alone_first, COUNTER, NONE,                                          \
      "pulls and pushes run under the exclusive table lock from the start: the last ones "    \
      "of their kind each had to make room")                                                 \
    X(uint64_t, pulls_at_once, COUNTER, NONE,                                                 \
      "pulls served with one wait for the GPU (tables on one GPU; keys stored or created)")  \
    X(uint64_t, pushes_at_once, COUNTER, NONE,                                                \
      "pushes applied with one wait for the GPU (tables on one GPU; keys stored or created)")  \
    X(uint64_t, pulls_found_again, COUNTER, NONE,                                             \
      "pulls of a table over several GPUs that did not wait for their finds, found keys "    \
      "missing and went again, waiting for them, to create those")                          \
    X(uint64_t, pushes_found_again, COUNTER, NONE,                                            \
      "pushes of a table over several GPUs that did not wait for their finds, found keys "   \
      "missing and went again, waiting for them, to create those")                          \
    X(uint64_t, index_rehashes_through_host, COUNTER, NONE,                                   \
      "GPU hash map growths that went through host memory: the pool had no room for the "    \
      "old map beside the new one (only the slots added)")                                 \
    X(uint64_t, rows_evicted_chosen_on_gpu, COUNTER, NONE,                                    \
      "of rows_evicted, those the GPU chose (evictions whose windows were long enough); "    \
      "the host chose the others, by the same rule")

typedef struct em_table_stats {
#define EM_TABLE_STATS_FIELD(type, name, kind, unit, help) type name;
    EM_TABLE_STATS(EM_TABLE_STATS_FIELD)
#undef EM_TABLE_STATS_FIELD
} em_table_stats;

/* Position of an export in progress. Zero-initialise to start. */
typedef struct em_table_cursor {
    uint32_t shard;
    uint64_t position;
} em_table_cursor;

/* Creates a table on backend (borrowed; must outlive the table). The config is
 * validated (INVALID_ARGUMENT naming the field); shards 0 becomes the device count.
 * Errors: RESOURCE_EXHAUSTED if the shards cannot be set up. */
em_status em_table_create(em_backend *backend, const em_table_config *config, em_table **out,
                          em_error *err);

/* em_table_create, with hash_seed for the shards' hash maps (0: the default). A table
 * filled from another table's rows in that table's order (a checkpoint load) takes a
 * seed of its own, or its maps cluster (lib/memory/hashmap.h). */
em_status em_table_create_seeded(em_backend *backend, const em_table_config *config,
                                 uint64_t hash_seed, em_table **out, em_error *err);

/* The seed the table was created with. */
uint64_t em_table_hash_seed(const em_table *table);

/* Destroys the table and releases its device memory. No request may be running. */
void em_table_destroy(em_table *table);

/* The config as resolved at create (shards filled in). */
const em_table_config *em_table_get_config(const em_table *table);
const char *em_table_name(const em_table *table);

/* Marks the table dropped from the catalog that named it (lib/table/catalog.h): a
 * checkpoint save that still holds it refuses to write it (em_checkpoint_save). */
void em_table_mark_dropped(em_table *table);
bool em_table_dropped(const em_table *table);

/* One slot of state that a caller keeps with the table and that lives as long as it
 * (the checkpoint writer keeps the digests of the last checkpoint's rows there, for
 * deltas: lib/checkpoint/checkpoint.h). Setting it frees what it held with that data's
 * free function; em_table_destroy frees it too. The caller orders its own calls (one
 * save of a table at a time). */
void em_table_set_attachment(em_table *table, void *data, void (*free_data)(void *));
void *em_table_attachment(const em_table *table);

/* A count of the calls that may have changed what a checkpoint holds of the table: a
 * push; a pull that may create keys, or of a table that tracks access or counts
 * admission sightings; an erase, an expiry, an import, and the setting of access,
 * clocks, admission counts or the evicted ring. Each is counted when it returns.
 * Thread-safe. */
uint64_t em_table_changes(const em_table *table);
/* Whether such a call returned since em_table_changes gave `changes`, or one is running
 * now. A checkpoint that read the count before its snapshot holds every change it
 * counted, so a table not changed since is still held by that checkpoint. */
bool em_table_changed_since(const em_table *table, uint64_t changes);
uint32_t em_table_dim(const em_table *table);

/* Gathers the batch's vectors into request->out (pooled per row unless NONE).
 * Unseen keys: create_missing inserts them with their initial values, else they read
 * as zeros. Errors: INVALID_ARGUMENT (bad CSR, combiner, out too small),
 * RESOURCE_EXHAUSTED (capacity or memory; nothing created). Thread-safe. */
em_status em_table_pull(em_table *table, const em_pull_request *request, em_pull_result *result,
                        em_error *err);

/* Sums the gradients per distinct key and applies one optimizer step to each, creating
 * unseen keys first. Errors: INVALID_ARGUMENT (bad CSR, combiner, gradient count,
 * non-finite gradient), RESOURCE_EXHAUSTED; in every error case nothing is applied.
 * Thread-safe. */
em_status em_table_push(em_table *table, const em_push_request *request, em_push_result *result,
                        em_error *err);

/* Removes the listed keys that are present (n of them, repeats allowed); *erased says
 * how many were. A snapshot being read still sees them. Errors: INVALID_ARGUMENT,
 * FAILED_PRECONDITION for a backend that cannot erase, RESOURCE_EXHAUSTED. Thread-safe. */
em_status em_table_erase(em_table *table, const uint64_t *keys, uint64_t n, uint64_t *erased,
                         em_error *err);

/* One slice of the expiry sweep (eviction.max_age_steps > 0; otherwise nothing): up to
 * scan rows of one shard examined, from where the last slice stopped, and those
 * neither pushed nor created in the table's last max_age_steps pushes removed (counted
 * in rows_expired, kept in the evicted-key ring); *expired of them. Holds the table
 * exclusively for the slice only. Thread-safe. */
em_status em_table_expire(em_table *table, uint64_t scan, uint64_t *expired, em_error *err);

/* Removes every row neither pushed nor created in the table's last not_pushed_for
 * pushes (counted in rows_erased), slice by slice: with 1, every row but those of the
 * last push (a row created by a pull after it included). Errors: INVALID_ARGUMENT for 0
 * (every row), FAILED_PRECONDITION for a table without access metadata (no eviction
 * policy, no max_age_steps). Thread-safe. */
em_status em_table_erase_older(em_table *table, uint32_t not_pushed_for, uint64_t *erased,
                               em_error *err);

/* Removes every row neither pushed nor created since unix_ms (wall clock). Rows carry
 * push clocks: the table's (time, clock) samples turn the time into the clock of the
 * last sample at or before it, so a row updated shortly before unix_ms may stay (by at
 * most the samples' spacing), and none updated after it goes; a time not yet come takes
 * every row. Rows pushed while the erase runs are never taken (as for
 * em_table_erase_older, whose ages are as of its start). Errors: as
 * em_table_erase_older. Thread-safe. */
em_status em_table_erase_before(em_table *table, uint64_t unix_ms, uint64_t *erased,
                                em_error *err);

/* What em_table_evicted read. Every key the table evicts gets a sequence number, 1,
 * 2, ...; the table keeps the last eviction.ring of them. */
typedef struct em_evicted_view {
    uint64_t total;  /* keys evicted since the table was created: the last sequence */
    uint64_t first;  /* sequence of keys[0] (0 when count is 0) */
    uint64_t count;  /* keys copied */
    uint64_t missed; /* keys after `after` that the ring no longer holds */
} em_evicted_view;

/* Copies the evicted keys with sequence numbers above after, oldest first, at most max
 * of them, into keys. A reader that passes the last sequence it saw gets exactly what
 * it has not seen, and view->missed says how many of those the ring dropped first.
 * Thread-safe. */
em_status em_table_evicted(em_table *table, uint64_t after, uint64_t max, uint64_t *keys,
                           em_evicted_view *view, em_error *err);

/* Sets the evicted-key ring of a table no request has reached yet (a restore): total
 * keys removed by the policy so far, the last count of them oldest first (as
 * em_table_snapshot_take_evicted gives them; the ring keeps the newest it has room
 * for), so that EVICTED's sequence numbers go on from a checkpoint's. INVALID_ARGUMENT
 * when count exceeds total. */
em_status em_table_restore_evicted(em_table *table, uint64_t total, const uint64_t *keys,
                                   uint64_t count, em_error *err);

/* Copies up to max rows (key + em_table_stats.row_floats floats: weights then optimizer
 * state) from *cursor on; *count 0 means the export is complete. Rows created or
 * changed while an export is in progress may or may not be included. Thread-safe. */
em_status em_table_export(em_table *table, em_table_cursor *cursor, uint64_t max, uint64_t *keys,
                          float *values, uint64_t *count, em_error *err);

/* Writes n rows (weights and optimizer state, as export gives them), creating keys that
 * are absent and overwriting present ones. All-or-nothing: INVALID_ARGUMENT for a
 * repeated key or a bad value (non-finite, negative accumulator), RESOURCE_EXHAUSTED
 * for capacity. Thread-safe. */
em_status em_table_import(em_table *table, const uint64_t *keys, const float *values, uint64_t n,
                          em_error *err);

/* The value checks of em_table_import alone, changing nothing: INVALID_ARGUMENT naming
 * the first bad row (its index among the n, its key, the element and what is wrong). */
em_status em_table_check_rows(const em_table *table, const uint64_t *keys, const float *values,
                              uint64_t n, em_error *err);

/* em_table_check_rows for rows of a table of config (floats as em_table_export gives
 * them for it), without a table: what a checkpoint's verify checks. */
em_status em_table_config_check_rows(const em_table_config *config, const uint64_t *keys,
                                     const float *values, uint64_t n, em_error *err);

/* em_table_import of rows that em_table_check_rows passed (a loader checks each chunk
 * on its own thread while the rows before it are imported); the same otherwise. */
em_status em_table_import_checked(em_table *table, const uint64_t *keys, const float *values,
                                  uint64_t n, em_error *err);

/* em_table_import_checked into a table that holds none of the keys (a loader filling a
 * table it has just created): shards in host memory create the keys without looking
 * them up first. A key that was there fails the call with INVALID_ARGUMENT after its
 * batch's keys were created: the caller discards the table then. */
em_status em_table_import_new(em_table *table, const uint64_t *keys, const float *values,
                              uint64_t n, em_error *err);

/* em_table_import_new of rows that lie apart: key i's weights and optimizer state are
 * the floats at rows[i] (host memory). Shards in host memory write them from there;
 * others get them gathered into one array first. */
em_status em_table_import_new_from(em_table *table, const uint64_t *keys,
                                   const float *const *rows, uint64_t n, em_error *err);

/* Makes room in the shards' indexes and storage for rows more keys, spread over the
 * shards by their hash (each shard takes a share below its expected one, so that no map
 * ends larger than inserting the rows would have made it), so that a loader's imports
 * do not grow the maps again and again. Errors: RESOURCE_EXHAUSTED. */
em_status em_table_reserve(em_table *table, uint64_t rows, em_error *err);

void em_table_get_stats(em_table *table, em_table_stats *out);

/* The clocks that a table's access metadata is stamped with (tables whose eviction
 * tracks access): what a checkpoint keeps with the metadata. */
#define EM_TABLE_CLOCK_SAMPLES 1024u
typedef struct em_table_clocks {
    uint64_t access_clock; /* requests so far (em_row_access.accessed) */
    uint64_t update_clock; /* pushes so far (em_row_access.updated, mod 2^32) */
    uint64_t sample_spacing_ms;
    uint32_t samples;      /* (time, push clock) samples for ages in seconds, oldest first */
    uint64_t sample_ms[EM_TABLE_CLOCK_SAMPLES];
    uint32_t sample_clock[EM_TABLE_CLOCK_SAMPLES];
} em_table_clocks;

void em_table_get_clocks(em_table *table, em_table_clocks *out);

/* Restores clocks into a table that serves nothing yet (a load): each counter becomes
 * clocks' (replace: the loader set every row's metadata from what clocks counts in, and
 * its imports' own ticks mean nothing) or the larger of the table's and clocks', and
 * the samples are clocks' (when it has any). */
void em_table_set_clocks(em_table *table, const em_table_clocks *clocks, bool replace);

/* Sets the access metadata of the rows of keys (present keys; repeats allowed, the last
 * wins) to access[i]: what a load restores. Nothing for a table that does not track
 * access. Errors: NOT_FOUND naming a key the table lacks (the rows before it are set),
 * FAILED_PRECONDITION on a backend that keeps no access metadata. */
em_status em_table_set_access(em_table *table, const uint64_t *keys, const em_row_access *access,
                              uint64_t n, em_error *err);

/* The counter admission's sketch (lib/table/table_config.h: admission): its bytes, 0 for a
 * table with another admission policy. */
uint64_t em_table_admission_bytes(const em_table *table);

/* Copies the sketch as of now into out (em_table_admission_bytes bytes), holding its
 * lock for the copy (not the table's: requests go on). */
void em_table_get_admission(em_table *table, uint8_t *out);

/* Merges counts into the sketch, each counter the larger of the two (a load: the parts of
 * a cluster checkpoint merge, each key seen at least as often as in its own part).
 * Errors: INVALID_ARGUMENT when bytes is not the sketch's size. */
em_status em_table_merge_admission(em_table *table, const uint8_t *counts, uint64_t bytes,
                                   em_error *err);

/* A point-in-time view of a table, read while the table keeps serving (checkpoints;
 * lib/table/table_snapshot.c). */
typedef struct em_table_snapshot em_table_snapshot;

/* Fixes every row and its optimizer state as of now: pushes and imports that finish
 * before this call are in it, later ones are not, none in part. Holds every shard for
 * a moment while the table's index (16 bytes per row) is copied to the host. Rows
 * changed before they are read are copied aside first, up to copy_limit_bytes (writers
 * then wait for the reader to move on). Errors: FAILED_PRECONDITION if a snapshot of the
 * table is open, RESOURCE_EXHAUSTED. */
em_status em_table_snapshot_begin(em_table *table, uint64_t copy_limit_bytes,
                                  em_table_snapshot **out, em_error *err);

/* Rows in the snapshot. */
uint64_t em_table_snapshot_rows(const em_table_snapshot *snapshot);

/* The next up to max rows of the snapshot (keys, and row_floats floats each as export
 * gives them); *count 0 when every row has been read. access (nullable; for a table that
 * tracks access) gets each row's access metadata as the read finds it: metadata is not
 * held at the snapshot's instant (pulls change it and copy nothing aside). One reader
 * at a time. */
em_status em_table_snapshot_read(em_table_snapshot *snapshot, uint64_t max, uint64_t *keys,
                                 float *values, em_row_access *access, uint64_t *count,
                                 em_error *err);

/* The evicted-key ring at the snapshot's instant (em_table_evicted): *total keys removed
 * by the policy so far, and the last *count of them (all the ring holds), oldest first,
 * handed over (the caller frees them; a second call gets none). */
uint64_t *em_table_snapshot_take_evicted(em_table_snapshot *snapshot, uint64_t *total,
                                         uint64_t *count);

/* Closes the snapshot (read completely or not). NULL is ignored. */
void em_table_snapshot_end(em_table_snapshot *snapshot);

#endif
