/*
 * DESIGN: durable checkpoints of tables (the format: docs/checkpoints.md).
 *
 * A checkpoint of a table is a directory <dir>/<table>/<id>/ holding
 *
 *   rows.emb       chunks: each a header and the keys and rows (weights and optimizer
 *                  state) of one virtual bucket of the key hash, checksummed (XXH3-64)
 *   index.emb      where each chunk is, its bucket, rows and checksum; checksummed
 *   tombstones.emb the keys a delta removes, by bucket; checksummed (empty in a full one)
 *   manifest.json  the table's config, rows, the key hash and buckets, each file's size
 *                  and checksum, the parent (none for a full checkpoint), the time and
 *                  the ember version; ends with the checksum of its own text
 *
 * and <dir>/<table>/LATEST names the newest complete one. A save writes a temporary
 * directory, fsyncs every file and the directory, renames it to its id, fsyncs the
 * table's directory, and only then replaces LATEST (write, fsync, rename, fsync): a
 * crash at any instant leaves the previous checkpoint current and whole. Checkpoints
 * beyond `keep` are set aside after LATEST moved, and removed (after the save answers,
 * given em_checkpoint_removals). A failed fsync fails the save; nothing retries it.
 *
 * A delta holds only what changed since its parent, the table's previous checkpoint:
 * the rows whose content differs from the parent's (new keys too) and, in
 * tombstones.emb, the keys the parent has and the table no longer does. To know what
 * changed, a table that tracks changes keeps the XXH3-64 digest of every row as of its
 * last checkpoint (em_table_set_attachment; about 21-43 bytes per row of host memory):
 * a delta reads the whole snapshot, as a full save does, and writes the rows whose
 * digest moved. The digests change only when a save succeeds, so a failed save leaves
 * the next delta complete. Each delta names its parent's id and manifest checksum; a
 * load follows the parents back to a full checkpoint and refuses a missing, repeated or
 * reordered link, or a parent whose checksum differs, naming the file.
 *
 * The rows come from a table snapshot (lib/table/table.h): one instant, while the table
 * goes on serving. Loading reads every byte once, checks every checksum and the counts
 * against the manifest, and fills a new table that the caller publishes only when the
 * whole load succeeded: a bad checkpoint is refused with DATA_LOSS naming the file, the
 * chunk and the expected and seen checksums, and nothing of it is used.
 */
#ifndef EMBER_LIB_CHECKPOINT_H
#define EMBER_LIB_CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/keyhash.h"
#include "lib/base/status.h"
#include "lib/device/backend.h"
#include "lib/table/table.h"

/* Version 2 added deltas and tombstones.emb; version 3 the access metadata of tables
 * whose eviction tracks it (each row's em_row_access after the chunk's floats, and the
 * table's clocks in the manifest); version 4 made the manifest's checksum of rows.emb
 * one of its chunks' checksums (checkpoint_format.h: em_rows_digest_add) instead of its
 * bytes. Versions 1 to 3 still load. */
#define EM_CHECKPOINT_FORMAT_VERSION 5u
/* Virtual buckets of the key hash (em_key_bucket): the buckets servers own. */
#define EM_CHECKPOINT_BUCKET_BITS EM_KEY_BUCKET_BITS
#define EM_CHECKPOINT_BUCKETS EM_KEY_BUCKETS
#define EM_CHECKPOINT_ID_DIGITS 20

/* Where saves remove the checkpoints they prune after they answer. A save sets each
 * aside first (renamed to .old-<id>, which nothing lists, loads or restores); given
 * removals, its files go on a thread of their own that removals counts, else before
 * the save answers. */
typedef struct em_checkpoint_removals em_checkpoint_removals;

em_status em_checkpoint_removals_create(em_checkpoint_removals **out, em_error *err);
/* Waits until every removal begun with removals ended. Thread-safe. */
void em_checkpoint_removals_wait(em_checkpoint_removals *removals);
/* Waits for the removals, then frees them (NULL: nothing). */
void em_checkpoint_removals_destroy(em_checkpoint_removals *removals);

typedef struct em_checkpoint_options {
    const char *dir;           /* the root: one folder per table below it */
    uint32_t keep;             /* complete checkpoints kept per table (0 means 1) */
    uint64_t copy_limit_bytes; /* rows changed during a save kept aside, at most */
    uint64_t buffer_bytes;     /* rows grouped by bucket before writing (three buffers: one
                                * staging, two for the writer thread), at most: a table of
                                * fewer rows takes what they need (at least 1 MiB) */
    bool delta;                /* save only what changed since the table's last checkpoint;
                                * a full save when there is no such parent (info->kind) */
    uint32_t max_depth;        /* with delta: a full save instead once the chain would have
                                * more deltas than this (0: no limit) */
    bool track_changes;        /* keep the row digests a later delta needs (delta implies it);
                                * without, a table's digests are dropped */
    bool detached;             /* a copy outside the table's chain (a cluster checkpoint's
                                * part): always full, and the table's digests stay as they
                                * are, for the next delta under its own dir */
    bool wait_for_lock;        /* another save of the table that runs (in this process or
                                * another) is waited for, instead of FAILED_PRECONDITION */
    bool skip_unchanged;       /* a save whose table the latest checkpoint under dir still
                                * holds is not written: that checkpoint was saved from the
                                * table or loaded into it whole and as saved, and no call
                                * that may change the table ran since
                                * (em_table_changed_since); nor, with delta, a delta that
                                * would change nothing (no row, no tombstone, the same
                                * clocks, no admission sketch). info->unchanged says so and
                                * names the latest checkpoint. Not with detached */
    /* Heard once the snapshot is taken (rows_read 0) and after each staging buffer
     * written: rows of the snapshot read so far, and its rows. NULL: not heard. */
    void (*progress)(void *context, uint64_t rows_read, uint64_t rows_total);
    void *progress_context;
    /* where the checkpoints this save prunes are removed after it answers (borrowed; it
     * outlives the save); the save first waits for the removals already begun there, so
     * a disk holds no more than without. NULL: they are removed before it answers */
    em_checkpoint_removals *removals;
} em_checkpoint_options;

/* Defaults: keep 3, copy limit 256 MiB, buffer 32 MiB, full saves, no tracking. */
void em_checkpoint_options_init(em_checkpoint_options *options, const char *dir);

typedef struct em_checkpoint_info {
    char table[160];
    char id[EM_CHECKPOINT_ID_DIGITS + 1];
    char path[4096];  /* the checkpoint's directory */
    char kind[8];     /* "full" or "delta" */
    char parent[EM_CHECKPOINT_ID_DIGITS + 1]; /* a delta's parent ("" for a full one) */
    uint32_t depth;   /* deltas between it and its full checkpoint */
    uint64_t rows;    /* rows written (a delta's: changed rows) */
    uint64_t tombstones; /* keys a delta removes */
    uint64_t table_rows; /* rows of the table it restores */
    uint64_t bytes;   /* of every file */
    uint64_t chunks;
    uint64_t created_unix_ms;
    uint64_t manifest_xxh3; /* the checksum of its manifest (what a child or a cluster
                             * checkpoint records of it) */
    bool unchanged;   /* a save with skip_unchanged that wrote nothing: id, path, kind and
                       * depth are the latest checkpoint's, rows and bytes 0 */
    bool busy;        /* a save refused (FAILED_PRECONDITION) because another save of the
                       * table held its lock */
    double seconds;   /* the save or the load */
} em_checkpoint_info;

/* Drops a table whose checkpoints live under dir, so that it stays dropped: holding the
 * table's save lock (waiting for a save of it that is running to end), calls drop
 * (which takes it out of the catalog and marks it, em_table_mark_dropped; its error is
 * returned as it is), then renames <dir>/<table> to <dir>/.dropped-<table>-<unix ms>,
 * which a restore passes over and a LOAD may still name, and fsyncs dir. *aside (size
 * bytes) gets that path, or "" for a table never saved. A rename that fails after the
 * drop is INTERNAL naming both paths: the table is dropped, and its checkpoints would be
 * restored at the next start. */
em_status em_checkpoint_drop_table(const char *dir, const char *table,
                                   em_status (*drop)(void *context, em_error *err),
                                   void *context, char *aside, size_t size, em_error *err);

/* Saves the table as a new checkpoint under options->dir and makes it the table's
 * latest: a delta when options->delta asks for one and the table's last checkpoint
 * (saved or loaded with tracking) is still the latest under dir, else a full one.
 * Errors: FAILED_PRECONDITION (a save of the table is running, or the table was
 * dropped or replaced: em_table_mark_dropped), INTERNAL naming
 * the step and the file for an I/O failure (the previous checkpoint stays current),
 * RESOURCE_EXHAUSTED. */
em_status em_checkpoint_save(em_table *table, const em_checkpoint_options *options,
                             em_checkpoint_info *info, em_error *err);

/* Reads every file of the checkpoint at path (a checkpoint's directory), and of every
 * checkpoint of its chain for a delta, and checks every checksum and count and every
 * row's values as a load does, without a table: what verify accepts, a load accepts.
 * Errors: DATA_LOSS naming the file (and the chunk, and for a value the row, its key
 * and the element), NOT_FOUND, INVALID_ARGUMENT for a manifest of another format or
 * version. */
em_status em_checkpoint_verify(const char *path, em_checkpoint_info *info, em_error *err);

typedef struct em_checkpoint_load_options {
    bool track_changes; /* the table keeps the row digests for a delta after this one (a
                         * load of one whole checkpoint only) */
    uint32_t shards;    /* the new table's shards; 0: as saved */
    /* owner_count > 0: only the rows of the buckets that em_bucket_server gives to server
     * owner_index of owner_count, reading only their chunks (each checked against its
     * header and the index; the index is checked to lay the chunks over the whole file) */
    uint32_t owner_index, owner_count;
    /* per checkpoint loaded, the checksum its manifest must have (as a cluster checkpoint
     * recorded it): another is refused with DATA_LOSS. NULL: any. */
    const uint64_t *manifest_xxh3;
    /* rows.emb is read this many bytes at a time (into a ring of four such blocks, two
     * of them read ahead; the rows are imported from where they lie); 0: 8 MiB. A block
     * grows to hold a larger chunk. */
    uint64_t read_block_bytes;
    /* Whether rows.emb is read ahead on a thread of its own, while the blocks before are
     * checked and imported: 0 decides by the CPUs and whether the file is in the page
     * cache (checkpoint_load.c read_ahead_start), 1 always, -1 never. */
    int read_ahead;
    /* Heard after every batch of rows imported (a block's, about 8 MiB): rows imported
     * and bytes of rows.emb read so far, of the whole chain, and those files' total
     * bytes. */
    void (*progress)(void *context, uint64_t rows, uint64_t bytes, uint64_t total_bytes);
    void *progress_context;
} em_checkpoint_load_options;

/* Creates a table on backend from the checkpoint at path (named as saved, or name when
 * not NULL) and fills it, a delta with its whole chain (each key from the newest link
 * that has it); *out is the caller's, to publish or destroy. options may be NULL (no
 * tracking, no progress). Errors: those of verify, and em_table_create's and
 * em_table_import's. */
em_status em_checkpoint_load(const char *path, em_backend *backend, const char *name,
                             const em_checkpoint_load_options *options, em_table **out,
                             em_checkpoint_info *info, em_error *err);

/* Fills one table (named name, or as the first checkpoint's table) from several
 * checkpoints of one table shape, each with its chain: the parts of a cluster checkpoint,
 * with options->owner_* choosing the buckets of one server of the new cluster. A key in
 * two of them is refused (DATA_LOSS), as are checkpoints of different table configs
 * (INVALID_ARGUMENT naming both; name, capacity and shards may differ). The table's
 * capacity is the first's, raised to the rows loaded. Errors: those of em_checkpoint_load. */
em_status em_checkpoint_load_sources(const char *const *paths, size_t count,
                                     em_backend *backend, const char *name,
                                     const em_checkpoint_load_options *options, em_table **out,
                                     em_checkpoint_info *info, em_error *err);

/* Verifies several checkpoints as em_checkpoint_load_sources would load them (every
 * checksum, each bucket in one of them only, each manifest's checksum as given when
 * manifest_xxh3 is not NULL), without a table. */
em_status em_checkpoint_verify_sources(const char *const *paths, size_t count,
                                       const uint64_t *manifest_xxh3, em_checkpoint_info *info,
                                       em_error *err);

/* Warm start: creates a table with config (its own optimizer) holding the checkpoint's
 * keys with their weights only; each row's optimizer state starts as a new row's.
 * Errors: those of load, and INVALID_ARGUMENT naming both dims when they differ. */
em_status em_checkpoint_load_weights(const char *path, em_backend *backend,
                                     const em_table_config *config, em_table **out,
                                     em_checkpoint_info *info, em_error *err);

/* Writes the table of the checkpoint at path (a checkpoint, a delta with its chain, or a
 * table's directory: its latest), every checksum checked as a load checks it, as NumPy
 * array files in out_dir (created, or empty): keys.npy (uint64), weights.npy (float32,
 * rows x dim), one file for each part of the optimizer state unless weights_only
 * (docs/checkpoints.md, "Export and import"), rows by ascending key, and export.json
 * (the table's config and the files) last. Needs memory for the table twice. info gets
 * the checkpoint's figures, rows the rows written. Errors: those of em_checkpoint_load,
 * FAILED_PRECONDITION for an out_dir that holds files, INTERNAL naming a file that
 * could not be written. */
em_status em_checkpoint_export(const char *path, const char *out_dir, bool weights_only,
                               em_checkpoint_info *info, em_error *err);

/* em_checkpoint_export of the table that the checkpoints at paths fill together (a
 * cluster checkpoint's parts, as em_checkpoint_load_sources loads them, each manifest's
 * checksum as given when manifest_xxh3 is not NULL): the whole table, every bucket once. */
em_status em_checkpoint_export_sources(const char *const *paths, size_t count,
                                       const uint64_t *manifest_xxh3, const char *out_dir,
                                       bool weights_only, em_checkpoint_info *info,
                                       em_error *err);

typedef struct em_checkpoint_import_options {
    const char *name;        /* the table's name; NULL: the config's */
    const char *config_json; /* the table's config (as CREATE_TABLE takes it); NULL: the
                              * config in the directory's export.json */
    bool weights_only;       /* every row's optimizer state as a new row's, even where the
                              * directory holds state files */
} em_checkpoint_import_options;

/* Defaults: the name and config of export.json, the state from the files where they
 * hold it. */
void em_checkpoint_import_options_init(em_checkpoint_import_options *options);

/* Writes the rows of the array files in in_dir (an export's layout: keys.npy and
 * weights.npy, with or without the state's files) as a new full checkpoint of the table
 * under root, its table's latest (the table's checkpoints already there are kept), for a
 * server to LOAD or restore. Nothing is written unless every row passed: the arrays'
 * types and shapes against the config, distinct keys within the capacity, every value
 * finite and every accumulator and second moment >= 0; without state files the state
 * is a new row's. Errors: INVALID_ARGUMENT naming the file and what is wrong (the row,
 * key and element for a value), NOT_FOUND for a missing keys.npy or weights.npy, and
 * those of em_checkpoint_save. */
em_status em_checkpoint_import(const char *in_dir, const char *root,
                               const em_checkpoint_import_options *options,
                               em_checkpoint_info *info, em_error *err);

/* The path of the latest complete checkpoint of table under dir. Errors: NOT_FOUND
 * when the table has none. */
em_status em_checkpoint_latest(const char *dir, const char *table, char *path, size_t capacity,
                               em_error *err);

/* The names of the tables under dir that have a latest checkpoint, sorted, in a
 * malloc'ed array of malloc'ed strings (em_checkpoint_free_names). */
em_status em_checkpoint_tables(const char *dir, char ***names, size_t *count, em_error *err);
void em_checkpoint_free_names(char **names, size_t count);

/* The complete checkpoints of a table under dir, oldest first, with the figures of their
 * manifests (each manifest read and checked by its checksum line; kind "?" for one that
 * does not read; the data files are not read: em_checkpoint_verify), in a malloc'ed
 * array. */
em_status em_checkpoint_list(const char *dir, const char *table, em_checkpoint_info **infos,
                             size_t *count, em_error *err);

#endif
