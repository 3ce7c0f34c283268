/*
 * DESIGN: eviction's shared vocabulary: the policies, the per-row access metadata a
 * shard keeps for them, and what a table asks a shard to evict (lib/device/device.h:
 * shard_touch, shard_evict; lib/table/table_config.h: the policies' rules).
 */
#ifndef EMBER_LIB_DEVICE_EVICTION_H
#define EMBER_LIB_DEVICE_EVICTION_H

#include <stdint.h>

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

/* Most evicted keys a table remembers (table_config: eviction.ring). */
#define EM_EVICTION_RING_MAX (UINT32_C(1) << 20)

#endif
