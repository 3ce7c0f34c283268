/*
 * DESIGN: the daemon's checkpoints (config "checkpoint"): restore at start, saves on
 * request (admin SAVE), every interval_s on a thread of their own, and at shutdown.
 *
 * Saves run off the event loop: SAVE on a worker, periodic saves on the checkpointer's
 * thread, the shutdown save after the loop has stopped. Two saves of one table never
 * overlap (the second gets FAILED_PRECONDITION: lib/checkpoint/checkpoint.h).
 */
#ifndef EMBER_DAEMON_CHECKPOINTER_H
#define EMBER_DAEMON_CHECKPOINTER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/daemon_config.h"
#include "daemon/stats.h"
#include "lib/base/log.h"
#include "lib/base/status.h"
#include "lib/checkpoint/checkpoint.h"
#include "lib/table/catalog.h"

typedef struct em_checkpointer em_checkpointer;

/* Starts the periodic saves when config->interval_s > 0. config, catalog, log and stats
 * (where the checkpoint_* counters go) are borrowed and outlive the checkpointer. */
em_status em_checkpointer_create(const em_checkpoint_config *config, em_catalog *catalog,
                                 const em_log *log, em_server_stats *stats,
                                 em_checkpointer **out, em_error *err);

/* Stops the periodic saves (waits for one that runs); there are none after it. */
void em_checkpointer_stop(em_checkpointer *checkpointer);

/* Stops the periodic saves (em_checkpointer_stop) and frees. NULL is ignored. */
void em_checkpointer_destroy(em_checkpointer *checkpointer);

/* Loads the latest checkpoint of every table under the checkpoint dir into the catalog
 * (before it serves). progress (nullable) hears "restoring table 't' (i of n)" as each
 * table starts, and then, as details, about every second of a long load, the rows
 * imported and the bytes read of the table's files. Errors:
 * those of em_checkpoint_load, naming the table; the first one stops the restore. */
em_status em_checkpointer_restore(em_checkpointer *checkpointer,
                                  void (*progress)(void *context, const char *line,
                                                   bool detail),
                                  void *context, em_error *err);

/* After em_checkpointer_restore, with checkpoint.restore a path: loads the tables that
 * the catalog does not hold yet (none of their own checkpoints) from there. The path is
 * a checkpoint root (each table's latest below it, as under dir) or a cluster
 * checkpoint (cluster.json: each table from every part, only the buckets this server
 * owns as server cluster_index of cluster_size). A seeded table's next save under dir
 * is a full one. progress as for em_checkpointer_restore. Errors: NOT_FOUND (nothing to
 * load there), FAILED_PRECONDITION (a cluster checkpoint without cluster_size), those of
 * the loads, naming the table. */
em_status em_checkpointer_seed(em_checkpointer *checkpointer,
                               void (*progress)(void *context, const char *line, bool detail),
                               void *context, em_error *err);

/* What a save writes: a full checkpoint, a delta (full without a parent: see
 * em_checkpoint_save), or as the schedule says (checkpoint.full_every: a delta unless
 * the table's chain already has full_every - 1 deltas). */
typedef enum em_save_mode { EM_SAVE_FULL, EM_SAVE_DELTA, EM_SAVE_SCHEDULED } em_save_mode;

/* The save at shutdown: the periodic saves stopped (em_checkpointer_stop, which waits
 * for one that runs), each table saved as scheduled, after any other save of it that
 * still runs (an admin SAVE, another process) is done, so that it holds the last
 * pushes. Errors: those of em_checkpointer_save. */
em_status em_checkpointer_save_at_exit(em_checkpointer *checkpointer, em_checkpoint_info **infos,
                                       size_t *count, em_error *err);

/* Saves the table called name, or every table when name is NULL or empty; *infos (a
 * malloc'ed array the caller frees) gets what was saved. Every table is tried; the
 * error is the first failure. Errors: NOT_FOUND, those of em_checkpoint_save. */
em_status em_checkpointer_save(em_checkpointer *checkpointer, const char *name,
                               em_save_mode mode, em_checkpoint_info **infos, size_t *count,
                               em_error *err);

/* Saves the table called name, or every table when name is NULL or empty, into dir as
 * full copies outside the tables' chains (em_checkpoint_options.detached): the parts of a
 * cluster checkpoint. Needs no checkpointer; the server's own checkpoints are left
 * alone. Errors: INVALID_ARGUMENT for a dir that is not absolute, those of
 * em_checkpointer_save. */
em_status em_checkpointer_save_into(em_catalog *catalog, const em_log *log,
                                    em_server_stats *stats, const char *dir, const char *name,
                                    em_checkpoint_info **infos, size_t *count, em_error *err);

/* What one load reads and how. */
typedef struct em_load_spec {
    const char *table;          /* the table it becomes (replacing one of that name) */
    const char *path;           /* a checkpoint; NULL or empty: sources, or else the latest
                                 * of table under the checkpoint dir */
    const char *const *sources; /* a cluster checkpoint's parts (em_checkpoint_load_sources) */
    size_t source_count;
    const uint64_t *manifests;  /* per source, its manifest checksum; NULL: not checked */
    bool weights_only;          /* keep the existing table's config, load only weights */
    uint32_t server_index, server_count; /* server_count > 0: only the buckets owned */
    uint32_t shards;            /* the loaded table's shards; 0: as saved */
} em_load_spec;

/* Loads as spec says, replacing the table of that name in one step. Nothing changes on
 * an error. Errors: those of em_checkpoint_load, _load_sources and _load_weights,
 * NOT_FOUND (weights_only without the table, or no checkpoint), FAILED_PRECONDITION
 * without a checkpoint dir and no path, INVALID_ARGUMENT for both a path and sources,
 * weights_only with sources or an owner, or manifests that do not match the sources. */
em_status em_checkpointer_load(em_catalog *catalog, const char *dir, const em_load_spec *spec,
                               em_checkpoint_info *info, em_error *err);

#endif
