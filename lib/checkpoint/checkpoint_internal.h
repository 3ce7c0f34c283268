/*
 * DESIGN: what the checkpoint writer and reader share besides the format.
 */
#ifndef EMBER_LIB_CHECKPOINT_INTERNAL_H
#define EMBER_LIB_CHECKPOINT_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "lib/base/status.h"
#include "lib/checkpoint/checkpoint.h"

/* The virtual bucket of a key (checkpoint.h). */
uint32_t em__checkpoint_bucket(uint64_t key);

/* The order of tombstones.emb: by bucket, then key (<0, 0, >0 as strcmp). */
int em__checkpoint_key_order(uint64_t x, uint64_t y);

/* Whether name is a checkpoint id: exactly EM_CHECKPOINT_ID_DIGITS decimal digits. */
bool em__checkpoint_is_id(const char *name);

/* Whether item is a JSON number holding a whole number from 0 to 2^53, as every count a
 * manifest or a cluster record holds is; *out gets it. Larger, fractional, negative or
 * non-finite numbers are not counts (nor converted: that would be undefined). */
struct cJSON;
bool em__json_count(const struct cJSON *item, uint64_t *out);

/* Removes a directory of plain files, best effort. */
void em__checkpoint_remove_dir(const char *path);

/* What a table's directory calls a checkpoint, or a leftover, that a save set aside to
 * be removed: .old-<id> (checkpoint_prune.c). */
#define EM__CHECKPOINT_OLD ".old-"

/* Sets aside, with the table's save lock held, the published checkpoints beyond keep
 * (the oldest) that no kept delta builds on and what saves that never finished left
 * (temporaries, directories newer than LATEST), and removes them, and any set aside
 * before: on a thread of its own counted in removals, or before it returns where
 * removals is NULL (checkpoint_prune.c). */
void em__checkpoint_prune(const char *table_dir, const char *dir, const char *table,
                          uint32_t keep, em_checkpoint_removals *removals);

/* ---- the worker thread of saves and loads (checkpoint_pipe.c) --------------------------- */

/* One item at a time goes to work(context, item) on a thread of its own; the caller
 * fills the next meanwhile. Every call returns the first failure of any item (items
 * after it are skipped). */
typedef struct em__pipe {
    pthread_t thread;
    bool running;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    void *item; /* handed over and not done yet; NULL: the worker is idle */
    bool stop;
    em_status status;
    em_error err;
    em_status (*work)(void *context, void *item, em_error *err);
    void *context;
} em__pipe;

em_status em__pipe_start(em__pipe *pipe, em_status (*work)(void *context, void *item,
                                                          em_error *err),
                         void *context, em_error *err);
/* Waits until the item before is done, then hands item over (it stays the caller's
 * memory, untouched by the caller until the next put, wait or finish returns). */
em_status em__pipe_put(em__pipe *pipe, void *item, em_error *err);
/* Waits until the item handed over is done. */
em_status em__pipe_wait(em__pipe *pipe, em_error *err);
/* Waits, then stops the thread (nothing when it never started). */
em_status em__pipe_finish(em__pipe *pipe, em_error *err);

/* ---- deltas ---------------------------------------------------------------------------- */

/* A u64 -> u64 map (checkpoint_digests.c): a key and its value share a slot, so a
 * lookup costs one cache line. */
typedef struct em__key_slot {
    uint64_t key, value;
} em__key_slot;

typedef struct em__key_map {
    em__key_slot *slot;
    uint64_t slots, used;
    bool has_empty_key; /* the key UINT64_MAX, the slots' marker, is kept aside */
    uint64_t empty_key_value;
} em__key_map;

/* The key of a slot that holds none. */
#define EM__KEY_MAP_EMPTY UINT64_MAX

/* False when out of memory (get: when key is absent). */
bool em__key_map_init(em__key_map *map, uint64_t expected);
void em__key_map_free(em__key_map *map);
bool em__key_map_get(const em__key_map *map, uint64_t key, uint64_t *value);
bool em__key_map_put(em__key_map *map, uint64_t key, uint64_t value);
/* Asks for the line where key's search starts, a few keys before it is looked up: a
 * map of millions of keys is far larger than the caches, and the keys come in no order
 * of its. */
void em__key_map_prefetch(const em__key_map *map, uint64_t key);
/* How many keys ahead of a lookup its prefetch goes: a row's digest, or the check of a
 * key, takes long enough that a few of them cover a memory latency. */
#define EM__KEY_PREFETCH 8

/* The digest a delta compares rows by: XXH3-64 of the row's floats, and, for a table
 * that tracks access, of its access metadata (NULL: none) as the file holds it, so that
 * a row only pulled since the parent goes into the delta with its new metadata. */
uint64_t em__row_digest(const float *row, uint32_t floats, const void *access);

/* What a table keeps (em_table_set_attachment) after a save or a load, so that its next
 * save can be a delta: which checkpoint its rows were last written as, and each key's
 * row digest as of that checkpoint's instant. */
typedef struct em__delta_base {
    char path[4096];                        /* the checkpoint's directory */
    char id[EM_CHECKPOINT_ID_DIGITS + 1];
    char base_id[EM_CHECKPOINT_ID_DIGITS + 1]; /* the full checkpoint its chain starts at */
    uint32_t depth;                         /* 0 for a full checkpoint */
    uint64_t manifest_xxh3;                 /* the checksum line of its manifest */
    uint32_t row_floats;
    bool tracked;          /* digests hold every row as the checkpoint has it (deltas) */
    em__key_map digests;
    bool holds_table;      /* the checkpoint holds the table as it was when
                            * em_table_changes gave `changes` (before a save's snapshot,
                            * after a load of the table as saved) */
    uint64_t changes;
    bool clocks_known;    /* clocks hold the table's clocks as the checkpoint has them (a
                           * save of a table that tracks access; not a load) */
    em_table_clocks clocks;
} em__delta_base;

void em__delta_base_free(void *base);

/* What a manifest says about a checkpoint's place in its chain. */
typedef struct em__chain_link {
    char id[EM_CHECKPOINT_ID_DIGITS + 1];
    bool delta;
    char parent_id[EM_CHECKPOINT_ID_DIGITS + 1];
    uint64_t parent_manifest_xxh3;
    char base_id[EM_CHECKPOINT_ID_DIGITS + 1];
    uint32_t depth;
    uint64_t manifest_xxh3;                 /* its own checksum line */
} em__chain_link;

/* Reads (and checks the checksum of) the manifest of the checkpoint at path. Errors:
 * those of em_checkpoint_verify for the manifest. */
em_status em__checkpoint_read_link(const char *path, em__chain_link *link, em_error *err);

#endif
