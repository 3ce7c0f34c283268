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
    uint64_t access_clock; /* the table's request clock now: rows were last accessed at
                            * or before it (a GPU's choice for LRU starts below the bytes
                            * it has as 0) */
    uint64_t random;       /* a pseudo-random number: where sampling starts */
    const uint64_t *kept;  /* rows that must stay (the request's own): host memory */
    uint64_t kept_count;
    /* Or, on a device whose memory the host cannot read (kept then NULL): the request's
     * rows of the shard in device memory, values that are not stored rows among them
     * (em_row_stored), which the backend reads back with its walk. */
    const uint64_t *kept_device;
    uint64_t kept_device_count;
} em_evict_spec;

/* ---- choosing the rows to evict (eviction.c) ---- */

/* Map entries a backend reads and offers at a time, at most. */
#define EM_EVICT_BLOCK ((uint64_t)4096)

/* Reads the next entries of a backend's map walk: up to max of them, with their access
 * metadata, into keys, rows and access; *got 0 once the walk has gone round the map. */
typedef em_status (*em_evict_walk)(void *context, uint64_t max, uint64_t *keys, uint64_t *rows,
                                   em_row_access *access, uint64_t *got, em_error *err);

/* The map entries a choice reads at least (the rule's window): count x candidates, a
 * candidate a row when candidates is 0, UINT64_MAX when that does not fit. */
uint64_t em_evict_window(const em_evict_spec *spec);

/* What an eviction keeps of its request's rows: the stored ones among rows[0..n) (the
 * values of keys missing or refused are not rows: device.h em_row_stored), copied into
 * kept in their order (kept may be rows itself); returns how many. */
uint64_t em_evict_kept_rows(const uint64_t *rows, uint64_t n, uint64_t *kept);

/* Chooses spec->count rows by spec's policy among the entries of a map walk (the rule in
 * lib/table/table_config.h): the backend's walk starts at spec->random (modulo its map's
 * positions) and is read block by block (EM_EVICT_BLOCK entries at most) until enough
 * entries were seen. Writes the chosen keys and rows (spec->count each); the backend
 * then erases them. Errors: the walk's, RESOURCE_EXHAUSTED, and INTERNAL when the whole
 * walk found fewer rows outside spec->kept. */
em_status em_evict_choose(const em_evict_spec *spec, em_evict_walk walk, void *context,
                          uint64_t *keys, uint64_t *rows, em_error *err);

/* Most evicted keys a table remembers (table_config: eviction.ring). */
#define EM_EVICTION_RING_MAX (UINT32_C(1) << 20)

#endif
