/*
 * DESIGN: the CPU concurrent hash map, u64 key -> row index.
 *
 * Open addressing with linear probing over 16-byte slots {key, value}; the home slot
 * of a key is em_hash_scale(em_mix64(key ^ seed), slot_count), so the slot count need
 * not be a power of two and a map can be sized for an exact load factor. A map filled
 * in the slot order of a map with the same seed meets long clusters (hashmap.c): give
 * it another seed.
 *
 * Every u64 is a valid key. Two key values are reserved in slots as markers
 * (EM_HASHMAP_EMPTY_KEY, EM_HASHMAP_TOMBSTONE_KEY); the keys equal to them are kept in
 * two side entries of the map instead of in slots, with the same API and semantics.
 *
 * The map hands out the values itself: they are row indices, dense from 0. A key
 * inserted for the first time gets a row index released by an earlier erase if there
 * is one, else the next never-used index. em_hashmap_row_limit() bounds every index
 * handed out so far, which is what row storage has to cover.
 *
 * Concurrency: any number of threads may call find, find_or_insert and erase at once.
 * Slots are claimed with compare-and-swap on the key; a claimed slot publishes its
 * value with a release store, and readers that meet a claimed slot whose value is not
 * yet published wait for it, so every key ends with exactly one row however many
 * threads insert it together. Growth (doubling, dropping tombstones) happens when
 * used slots would pass max_load_factor: it takes the map's lock exclusively while
 * batch operations hold it shared, one acquisition per batch call. A find racing an
 * erase of the same key may return the row index being released: callers that reuse
 * rows (tables) order erases against finds themselves.
 *
 * Slot arrays come from the em_allocator in the options (the CPU backend passes one
 * over its host pool, so they count in the device's memory statistics); a zeroed
 * allocator means malloc.
 */
#ifndef EMBER_LIB_HASHMAP_H
#define EMBER_LIB_HASHMAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lib/memory/allocator.h"
#include "lib/base/status.h"

#define EM_HASHMAP_EMPTY_KEY UINT64_MAX
#define EM_HASHMAP_TOMBSTONE_KEY (UINT64_MAX - 1)

/* Value reported for keys that are not in the map. */
#define EM_HASHMAP_NOT_FOUND UINT64_MAX

/* Growth keeps used slots (keys + tombstones) at or below this fraction by default. */
#define EM_HASHMAP_DEFAULT_MAX_LOAD 0.9

typedef struct em_hashmap em_hashmap;

typedef struct em_hashmap_options {
    size_t initial_slots;   /* slot count at create (>= 1; rounded up to a multiple of 16) */
    double max_load_factor; /* in (0, 0.95]; 0 means EM_HASHMAP_DEFAULT_MAX_LOAD */
    em_allocator allocator; /* slot arrays come from here; zeroed: malloc */
    uint64_t seed;          /* of the home hash; 0: EM_HASHMAP_SEED (em_hashmap_hash) */
} em_hashmap_options;

typedef struct em_hashmap_stats {
    uint64_t size;        /* keys in the map */
    uint64_t slots;       /* slot count of the current array */
    uint64_t tombstones;  /* erased slots not yet reclaimed by a rehash */
    uint64_t bytes;       /* bytes of the slot array */
    uint64_t row_limit;   /* see em_hashmap_row_limit */
    uint64_t free_rows;   /* released row indices waiting for reuse */
    uint64_t grow_count;  /* rehashes since create */
    uint64_t sweeps;      /* exclusive erases that went on by sweeps of the runs */
    double load_factor;   /* (keys in slots + tombstones) / slots; the two sentinel keys
                           * sit in side entries and use no slot */
} em_hashmap_stats;

/* Errors: INVALID_ARGUMENT for bad options, RESOURCE_EXHAUSTED if the slot array
 * cannot be allocated. */
em_status em_hashmap_create(const em_hashmap_options *options, em_hashmap **out, em_error *err);

/* Frees the map and its arrays. NULL is ignored. Not concurrent with other calls. */
void em_hashmap_destroy(em_hashmap *map);

/* values[i] = row index of keys[i], or EM_HASHMAP_NOT_FOUND. Returns how many of the n
 * keys were not found. */
size_t em_hashmap_find(em_hashmap *map, const uint64_t *keys, size_t n, uint64_t *values);

/* values[i] = row index of keys[i], inserting absent keys with a new row index.
 * inserted (nullable) gets 1 where this call inserted the key, else 0;
 * *inserted_count (nullable) gets how many keys this call inserted. A key repeated in
 * the batch is inserted once. Errors: RESOURCE_EXHAUSTED when growing fails; keys
 * before the failing one stay inserted (callers needing all-or-nothing call
 * em_hashmap_reserve first, after which this cannot fail for that many new keys). */
em_status em_hashmap_find_or_insert(em_hashmap *map, const uint64_t *keys, size_t n,
                                    uint64_t *values, uint8_t *inserted, size_t *inserted_count,
                                    em_error *err);

/* Grows now, if needed, so that additional_keys more keys fit under the maximum load
 * without another growth. Errors: RESOURCE_EXHAUSTED. */
em_status em_hashmap_reserve(em_hashmap *map, size_t additional_keys, em_error *err);

/* Removes the keys present among keys[0..n); values (nullable) gets the row index each
 * key had, or EM_HASHMAP_NOT_FOUND. Released row indices are reused by later inserts.
 * Returns how many keys were removed. */
size_t em_hashmap_erase(em_hashmap *map, const uint64_t *keys, size_t n, uint64_t *values);

/* Copies up to max entries into keys/values, continuing from *cursor (start with 0);
 * returns how many were copied and advances *cursor; 0 means the end. Entries
 * inserted or erased during an export may or may not be seen; the others are seen
 * exactly once as long as the map does not grow in between (tables export under their
 * own lock). */
size_t em_hashmap_export(em_hashmap *map, uint64_t *cursor, uint64_t *keys, uint64_t *values,
                         size_t max);

/* A walk over every entry once, in export order from a position chosen by random
 * (random modulo the positions), wrapping at the end: neighbouring entries, which linear
 * probing places by their keys' hashes, so any stretch of a walk is a sample of the
 * keys. The map must not grow or rehash during a walk (callers hold it alone). */
typedef struct em_hashmap_walk {
    uint64_t position; /* the next position to visit */
    uint64_t left;     /* positions not visited yet */
} em_hashmap_walk;

void em_hashmap_walk_begin(em_hashmap *map, uint64_t random, em_hashmap_walk *walk);

/* Copies up to max entries of the walk into keys/values and advances it; returns how
 * many were copied, 0 once every entry was visited. */
size_t em_hashmap_walk_next(em_hashmap *map, em_hashmap_walk *walk, uint64_t *keys,
                            uint64_t *values, size_t max);

/* Removes keys as em_hashmap_erase does, but moves the keys that follow an erased one on
 * its probe sequence back instead of leaving a tombstone, so erasing never lengthens a
 * probe nor brings on a rehash. No other call on the map may run meanwhile (tables
 * call it for evictions, which hold the shard alone), and entries move: a cursor or
 * walk taken before it may miss or repeat entries. */
size_t em_hashmap_erase_exclusive(em_hashmap *map, const uint64_t *keys, size_t n,
                                  uint64_t *values);

size_t em_hashmap_size(em_hashmap *map);

/* One past the highest row index handed out so far (0 for a new map). */
uint64_t em_hashmap_row_limit(em_hashmap *map);

void em_hashmap_get_stats(em_hashmap *map, em_hashmap_stats *out);

#endif
