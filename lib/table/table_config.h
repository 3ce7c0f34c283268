/*
 * DESIGN: what a table is made of, and its JSON form.
 *
 *   {"name": "clicks", "dim": 64, "capacity": 10000000, "shards": 8,
 *    "optimizer": {"type": "adagrad", "lr": 0.05, "eps": 1e-10, "initial_accumulator": 0},
 *    "initializer": {"type": "uniform", "bound": 0.01, "seed": 7},
 *    "eviction": {"policy": "lru", "candidates": 16, "ring": 1024}}
 *
 * name, dim and capacity are required. shards 0 (the default) means one shard per
 * device of the backend. Optimizer keys that do not apply to the chosen type are
 * errors, so a typo never silently falls back to a default. The same schema checks
 * configs built in code (em_table_config_validate serialises and re-parses them).
 *
 * eviction says what happens when a request would create keys in a full table:
 *   none  the request is refused (RESOURCE_EXHAUSTED), nothing changes: the default
 *   lru   rows whose last pull or push is the oldest make room
 *   lfu   rows pulled and pushed the fewest times make room (ties: the least recent)
 *   age   rows whose last push (or creation) is the oldest make room
 * The choice is approximate: a request that needs n rows of a shard compares the
 * n x `candidates` consecutive entries of the shard's hash map from a pseudo-random
 * position (a function of the table's initializer seed and its evictions so far), or
 * every entry when the shard holds fewer, and the n first by the policy among those the
 * request does not use go (ties: the smaller key first); when fewer than n of those
 * entries may go, the walk goes on until n may. On a GPU the choice is made there when
 * a request's windows are long (the same rows as on the host).
 * tests/bench/bench_eviction measures how close this comes to exact LRU and LFU. Fewer
 * candidates empty a larger share of each window they read, while new keys land all
 * over the map, so the runs of the map's slots grow where no window went lately: below
 * 8, a table that evicts for long gets slower (tests/bench/RESULTS.md).
 * `headroom` (0 to 0.5, default 0) makes an eviction free that share of the capacity
 * more than its request needs, from every shard in proportion to its rows (each by the
 * same rule, none from the request's own rows): requests that create keys need the
 * whole table to evict, so a full table runs each such request alone, after a shared
 * attempt that stops at the first shard where it finds more new keys than room; with
 * headroom, the requests after an eviction create keys beside each other into the room
 * it left until that is used up. The table then holds between capacity - headroom x
 * capacity and capacity rows once full. 0 evicts exactly what each request needs.
 * Expiry runs with or without a policy: with max_age_steps > 0, rows neither pushed nor
 * created in the table's last max_age_steps pushes are removed by a background sweep
 * (em_table_expire, in bounded slices); with max_age_seconds > 0, so are rows neither
 * pushed nor created in that many seconds. Rows carry push clocks, not times: the table
 * keeps a bounded history of (time, push clock) samples (one a second at most, thinned
 * to every other one when full) and a time becomes the clock of the last sample at or
 * before it, so a row may outlive its age by the samples' spacing, never expire early.
 * Nothing leaves silently: rows_evicted and rows_expired count every key removed, and
 * the last `ring` of them are kept, numbered, for em_table_evicted (the EVICTED admin
 * call).
 */
#ifndef EMBER_LIB_TABLE_CONFIG_H
#define EMBER_LIB_TABLE_CONFIG_H

#include <cJSON.h>
#include <stdbool.h>
#include <stdint.h>

#include "lib/base/config.h"
#include "lib/device/eviction.h"
#include "lib/device/initializer.h"
#include "lib/device/optimizer.h"
#include "lib/base/status.h"

#define EM_TABLE_NAME_MAX 128
#define EM_TABLE_DIM_MAX 4096
#define EM_TABLE_SHARDS_MAX 1024
/* Rows are indexed with 32 bits per shard; a table holds at most this many. */
#define EM_TABLE_CAPACITY_MAX (UINT64_C(1) << 40)

#define EM_EVICTION_CANDIDATES_MAX 1024

typedef struct em_eviction_config {
    int policy;          /* em_eviction_policy */
    uint32_t candidates; /* map entries compared per row removed */
    uint32_t ring;       /* the most recently evicted keys kept for EVICTED (0: none) */
    uint32_t max_age_steps; /* expiry: rows not pushed (nor created) in this many of the
                             * table's pushes are removed by the sweep (0: never) */
    uint64_t max_age_seconds; /* expiry: ... nor in this many seconds (0: never) */
    double headroom; /* share of the capacity an eviction frees beyond what its request
                      * needs, taken from every shard by its rows (0: only the need) */
} em_eviction_config;

/* Whether a table keeps per-row access metadata (an eviction policy or expiry). */
bool em_eviction_tracks_access(const em_eviction_config *config);

const char *em_eviction_policy_name(em_eviction_policy policy);

typedef enum em_admission_policy {
    EM_ADMISSION_ALWAYS,
    EM_ADMISSION_COUNTER,
    EM_ADMISSION_PROBABILITY,
} em_admission_policy;

/* Which new keys a table stores (a key not admitted reads as its initial value and its
 * pushes are dropped, both counted):
 *   always       every key: the default
 *   counter      a key seen `threshold` times by requests that would create it: counted
 *                in `counters` one-byte counters (a count-min sketch of 4 hashes with
 *                conservative update), so a key may be admitted early when its counters
 *                are shared with others (tests/bench/bench_eviction measures it)
 *   probability  a key with probability `probability`, decided by a hash of the
 *                initializer seed and the key: the same key is always decided the same */
typedef struct em_admission_config {
    int policy;           /* em_admission_policy */
    uint32_t threshold;   /* counter: sightings before a key is stored (1..255) */
    double probability;   /* probability: in [0, 1] */
    uint32_t counters;    /* counter: one-byte counters in the sketch */
} em_admission_config;

typedef struct em_table_config {
    char name[EM_TABLE_NAME_MAX + 1];
    uint32_t dim;
    uint64_t capacity; /* maximum rows */
    uint32_t shards;   /* 0: one per device */
    em_optimizer_config optimizer;
    em_initializer_config initializer;
    em_eviction_config eviction;
    em_admission_config admission;
} em_table_config;

extern const em_config_schema em_table_config_schema;

/* Checks a table name: 1..128 characters of [A-Za-z0-9_.-], not starting with '.'. The
 * message names the first bad character and its position. Errors: INVALID_ARGUMENT. */
em_status em_table_name_check(const char *name, em_error *err);

em_status em_table_config_parse(const cJSON *json, const char *path, em_table_config *out,
                                em_error *err);
em_status em_table_config_parse_text(const char *text, em_table_config *out, em_error *err);

/* Checks every field of a config built in code with the rules of the JSON schema. */
em_status em_table_config_validate(const em_table_config *config, em_error *err);

/* A config with the defaults and the given required values (for code and tests). */
void em_table_config_init(em_table_config *config, const char *name, uint32_t dim,
                          uint64_t capacity);

cJSON *em_table_config_to_json(const em_table_config *config);

#endif
