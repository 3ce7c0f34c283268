/*
 * DESIGN: eviction's shared vocabulary: the policies, the per-row access metadata a
 * shard keeps for them, and what a table asks a shard to evict (lib/device/device.h:
 * shard_touch, shard_evict; lib/table/table_config.h: the policies' rules).
 */
#ifndef EMBER_LIB_DEVICE_EVICTION_H
#define EMBER_LIB_DEVICE_EVICTION_H

#include <stdbool.h>
#include <stdint.h>

#include "lib/base/status.h"

typedef enum em_eviction_policy {
    EM_EVICTION_NONE,
    EM_EVICTION_LRU,
    EM_EVICTION_LFU,
    EM_EVICTION_AGE,
} em_eviction_policy;

/* Per-row access metadata, kept by shards that track access: 16 bytes a row. */
typedef struct em_row_access {
    uint64_t accessed;  /* the table's request clock at the row's last pull or push */
    uint32_t updated;   /* the table's push clock at its last push or creation, mod 2^32 */
    uint32_t frequency; /* pulls and pushes of the row (saturating) */
} em_row_access;

/* What shard_evict removes and how it chooses (lib/table/table_config.h: eviction). */
typedef struct em_evict_spec {
    int policy;            /* em_eviction_policy: LRU, LFU or AGE */
    uint32_t candidates;   /* map entries compared per row removed (table_config.h) */
    uint64_t count;        /* rows to remove */
    uint32_t update_clock; /* the table's push clock now, modulo 2^32 (AGE) */
    uint64_t random;       /* a pseudo-random number: where sampling starts */
    const uint64_t *kept;  /* rows that must stay (the request's own): host memory */
    uint64_t kept_count;
} em_evict_spec;

/* ---- choosing the rows to evict (eviction.c) ---- */

/* Map entries a backend reads and offers at a time, at most. */
#define EM_EVICT_BLOCK ((uint64_t)4096)

/* A row that may leave, with what the policy orders it by: the smaller rank goes
 * first. */
typedef struct em_evict_candidate {
    unsigned __int128 rank;
    uint64_t row;
    uint64_t key;
} em_evict_candidate;

/* Chooses spec->count rows by spec's policy among the entries of a map walk (the rule in
 * lib/table/table_config.h). A backend starts a walk of its map at spec->random (modulo
 * its positions), and while em_evict_chooser_want says a number above 0, reads at most
 * that many more entries and offers them in walk order with their access metadata; it
 * stops early only when the walk has gone round the whole map. Then finish writes the
 * chosen keys and rows. */
typedef struct em_evict_chooser {
    em_evict_spec spec;
    uint64_t window; /* entries to read at least: count x candidates */
    uint64_t seen, have, room;
    uint64_t *kept_slots; /* the spec's kept rows, as a set */
    uint64_t kept_mask;
    em_evict_candidate *pool;
    em_evict_candidate bar;
    bool barred;
} em_evict_chooser;

/* Errors: RESOURCE_EXHAUSTED (nothing to end then). */
em_status em_evict_chooser_begin(em_evict_chooser *c, const em_evict_spec *spec, em_error *err);
uint64_t em_evict_chooser_want(const em_evict_chooser *c);
void em_evict_chooser_offer(em_evict_chooser *c, const uint64_t *keys, const uint64_t *rows,
                            const em_row_access *access, uint64_t n);
/* keys and rows: spec.count each. INTERNAL when the walk found fewer rows outside the
 * kept ones. */
em_status em_evict_chooser_finish(em_evict_chooser *c, uint64_t *keys, uint64_t *rows,
                                  em_error *err);
void em_evict_chooser_end(em_evict_chooser *c);

/* Most evicted keys a table remembers (table_config: eviction.ring). */
#define EM_EVICTION_RING_MAX (UINT32_C(1) << 20)

#endif
