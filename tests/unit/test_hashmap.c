/*
 * The CPU hash map against a plain reference map (random operation sequences), plus
 * growth, reservation, load, allocator failure and multi-threaded checks.
 * EMBER_TEST_QUICK=1 shrinks the large tests (for slow sanitizer runs).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/memory/hashmap.h"
#include "common/keyhash.h"
#include "tests/support/test_support.h"

/* ck_assert records every check that passes (a write to the test runner), far too slow
 * for loops over a million keys; these report failures only. */
#define require(condition, ...)              \
    do {                                     \
        if (!(condition))                    \
            ck_abort_msg(__VA_ARGS__);       \
    } while (0)
#define require_u64(left, op, right)                                                    \
    do {                                                                                \
        uint64_t left_value = (left), right_value = (right);                            \
        if (!(left_value op right_value))                                               \
            ck_abort_msg("%s %s %s: %" PRIu64 " vs %" PRIu64, #left, #op, #right,        \
                         left_value, right_value);                                      \
    } while (0)

static const uint64_t special_keys[] = {
    0, 1, EM_HASHMAP_EMPTY_KEY, EM_HASHMAP_TOMBSTONE_KEY, UINT64_MAX - 2,
};
#define SPECIAL_KEY_COUNT (sizeof(special_keys) / sizeof(special_keys[0]))

static size_t scaled(size_t full, size_t quick)
{
    const char *text = getenv("EMBER_TEST_QUICK");
    return text != NULL && *text != '\0' && strcmp(text, "0") != 0 ? quick : full;
}

/* Distinct keys for index i (an odd multiplier is a bijection on u64). */
static uint64_t key_at(uint64_t i)
{
    return i * UINT64_C(0x9e3779b97f4a7c15) + UINT64_C(0x1234);
}

/* The index whose key_at is key: the multiplier's inverse modulo 2^64 (Newton's
 * iteration doubles the correct low bits each step). */
static uint64_t index_of_key(uint64_t key)
{
    uint64_t multiplier = UINT64_C(0x9e3779b97f4a7c15), inverse = multiplier;
    for (int step = 0; step < 6; step++)
        inverse *= 2 - multiplier * inverse;
    return (key - UINT64_C(0x1234)) * inverse;
}

static em_hashmap *create_map(size_t initial_slots, double max_load_factor)
{
    em_hashmap_options options = {.initial_slots = initial_slots,
                                  .max_load_factor = max_load_factor};
    em_hashmap *map = NULL;
    em_error err = {0};
    require(em_hashmap_create(&options, &map, &err) == EM_OK, "create: %s",
                  err.message);
    return map;
}

static em_hashmap_stats stats_of(em_hashmap *map)
{
    em_hashmap_stats stats;
    em_hashmap_get_stats(map, &stats);
    return stats;
}

/* Inserts keys [first, first + count) of key_at in batches; returns how many were new. */
static size_t insert_range(em_hashmap *map, uint64_t first, size_t count, size_t batch)
{
    uint64_t *keys = malloc(batch * sizeof(*keys));
    uint64_t *values = malloc(batch * sizeof(*values));
    size_t total = 0;
    for (size_t done = 0; done < count; done += batch) {
        size_t n = count - done < batch ? count - done : batch;
        for (size_t i = 0; i < n; i++)
            keys[i] = key_at(first + done + i);
        size_t inserted = 0;
        em_error err = {0};
        require(em_hashmap_find_or_insert(map, keys, n, values, NULL, &inserted, &err) ==
                          EM_OK,
                      "insert: %s", err.message);
        total += inserted;
    }
    free(keys);
    free(values);
    return total;
}

/* Checks that keys [first, first + count) of key_at have rows first_row + i. */
static void check_sequential_rows(em_hashmap *map, uint64_t first, size_t count,
                                  uint64_t first_row)
{
    enum { BATCH = 1024 };
    uint64_t keys[BATCH], values[BATCH];
    for (size_t done = 0; done < count; done += BATCH) {
        size_t n = count - done < BATCH ? count - done : BATCH;
        for (size_t i = 0; i < n; i++)
            keys[i] = key_at(first + done + i);
        require_u64(em_hashmap_find(map, keys, n, values), ==, 0);
        for (size_t i = 0; i < n; i++)
            require_u64(values[i], ==, first_row + done + i);
    }
}

/* ---- reference map: open addressing with explicit states, never shared ---- */

enum ref_state { REF_EMPTY, REF_LIVE, REF_ERASED };

typedef struct ref_map {
    uint64_t *keys;
    uint64_t *rows;
    uint8_t *states;
    size_t capacity; /* power of two */
    size_t live;
    size_t used; /* live + erased */
    /* rows */
    uint8_t *row_free; /* per row below row_limit: released and not reused yet */
    uint8_t *row_live;
    size_t row_capacity;
    uint64_t row_limit;
    size_t free_count;
    size_t reused;
} ref_map;

static size_t ref_home(const ref_map *ref, uint64_t key)
{
    return (size_t)(em_mix64(key) & (ref->capacity - 1));
}

/* Position of key, or of the first EMPTY slot on its sequence. */
static size_t ref_position(const ref_map *ref, uint64_t key)
{
    size_t position = ref_home(ref, key);
    while (ref->states[position] != REF_EMPTY &&
           !(ref->states[position] == REF_LIVE && ref->keys[position] == key))
        position = (position + 1) & (ref->capacity - 1);
    return position;
}

static void ref_alloc_slots(ref_map *ref, size_t capacity)
{
    ref->capacity = capacity;
    ref->keys = calloc(capacity, sizeof(uint64_t));
    ref->rows = calloc(capacity, sizeof(uint64_t));
    ref->states = calloc(capacity, 1);
    ref->used = ref->live;
}

static void ref_init(ref_map *ref)
{
    memset(ref, 0, sizeof(*ref));
    ref_alloc_slots(ref, 1024);
}

static void ref_free(ref_map *ref)
{
    free(ref->keys);
    free(ref->rows);
    free(ref->states);
    free(ref->row_free);
    free(ref->row_live);
}

static void ref_rebuild(ref_map *ref)
{
    ref_map old = *ref;
    size_t capacity = old.capacity;
    while (old.live * 4 > capacity)
        capacity *= 2;
    ref_alloc_slots(ref, capacity);
    for (size_t i = 0; i < old.capacity; i++) {
        if (old.states[i] != REF_LIVE)
            continue;
        size_t position = ref_position(ref, old.keys[i]);
        ref->keys[position] = old.keys[i];
        ref->rows[position] = old.rows[i];
        ref->states[position] = REF_LIVE;
    }
    free(old.keys);
    free(old.rows);
    free(old.states);
}

static uint64_t ref_find(const ref_map *ref, uint64_t key)
{
    size_t position = ref_position(ref, key);
    return ref->states[position] == REF_LIVE ? ref->rows[position] : EM_HASHMAP_NOT_FOUND;
}

/* Accepts row for a newly inserted key: a released row if any, else the next one. */
static void ref_take_row(ref_map *ref, uint64_t row)
{
    if (ref->free_count > 0) {
        require(row < ref->row_limit && ref->row_free[row],
                      "new key got row %" PRIu64 ", not a released one", row);
        ref->row_free[row] = 0;
        ref->free_count--;
        ref->reused++;
    } else {
        require_u64(row, ==, ref->row_limit);
        if (ref->row_limit == ref->row_capacity) {
            ref->row_capacity = ref->row_capacity == 0 ? 1024 : ref->row_capacity * 2;
            ref->row_free = realloc(ref->row_free, ref->row_capacity);
            ref->row_live = realloc(ref->row_live, ref->row_capacity);
        }
        ref->row_free[row] = 0;
        ref->row_live[row] = 0;
        ref->row_limit++;
    }
    require(!ref->row_live[row], "row %" PRIu64 " handed to two live keys", row);
    ref->row_live[row] = 1;
}

static void ref_insert(ref_map *ref, uint64_t key, uint64_t row)
{
    if ((ref->used + 1) * 2 > ref->capacity)
        ref_rebuild(ref);
    ref_take_row(ref, row);
    size_t position = ref_position(ref, key);
    ref->keys[position] = key;
    ref->rows[position] = row;
    ref->states[position] = REF_LIVE;
    ref->live++;
    ref->used++;
}

static uint64_t ref_erase(ref_map *ref, uint64_t key)
{
    size_t position = ref_position(ref, key);
    if (ref->states[position] != REF_LIVE)
        return EM_HASHMAP_NOT_FOUND;
    uint64_t row = ref->rows[position];
    ref->states[position] = REF_ERASED;
    ref->live--;
    ref->row_live[row] = 0;
    ref->row_free[row] = 1;
    ref->free_count++;
    return row;
}

/* ---- random operation sequences against the reference ---- */

enum { RECENT_KEYS = 64, MAX_BATCH = 48 };

typedef struct key_source {
    em_test_rng rng;
    uint64_t recent[RECENT_KEYS]; /* random u64 keys drawn lately, to draw again */
} key_source;

static uint64_t draw_key(key_source *source)
{
    uint64_t kind = em_test_rng_below(&source->rng, 100);
    if (kind < 30)
        return em_test_rng_below(&source->rng, 64);
    if (kind < 50)
        return em_test_rng_below(&source->rng, 4096);
    if (kind < 65)
        return special_keys[em_test_rng_below(&source->rng, SPECIAL_KEY_COUNT)];
    if (kind < 80)
        return source->recent[em_test_rng_below(&source->rng, RECENT_KEYS)];
    uint64_t key = em_test_rng_next(&source->rng);
    source->recent[em_test_rng_below(&source->rng, RECENT_KEYS)] = key;
    return key;
}

static void random_find(em_hashmap *map, const ref_map *ref, const uint64_t *keys, size_t n)
{
    uint64_t values[MAX_BATCH];
    size_t expected_missing = 0;
    size_t missing = em_hashmap_find(map, keys, n, values);
    for (size_t i = 0; i < n; i++) {
        uint64_t expected = ref_find(ref, keys[i]);
        expected_missing += expected == EM_HASHMAP_NOT_FOUND;
        require(values[i] == expected, "find key %" PRIu64 ": %" PRIu64 ", want %" PRIu64,
                      keys[i], values[i], expected);
    }
    require_u64(missing, ==, expected_missing);
}

static void random_find_or_insert(em_hashmap *map, ref_map *ref, const uint64_t *keys,
                                  size_t n)
{
    uint64_t values[MAX_BATCH];
    uint8_t inserted[MAX_BATCH];
    size_t inserted_count = 0, expected_count = 0;
    em_error err = {0};
    ck_assert_int_eq(
        em_hashmap_find_or_insert(map, keys, n, values, inserted, &inserted_count, &err), EM_OK);
    for (size_t i = 0; i < n; i++) {
        uint64_t expected = ref_find(ref, keys[i]);
        if (expected == EM_HASHMAP_NOT_FOUND) {
            require(inserted[i] == 1, "key %" PRIu64 " was new", keys[i]);
            ref_insert(ref, keys[i], values[i]);
            expected_count++;
        } else {
            require(inserted[i] == 0 && values[i] == expected,
                          "key %" PRIu64 ": row %" PRIu64 " inserted %d, want row %" PRIu64,
                          keys[i], values[i], inserted[i], expected);
        }
    }
    require_u64(inserted_count, ==, expected_count);
}

/* exclusive: by backward shift, which must leave no tombstone */
static void random_erase(em_hashmap *map, ref_map *ref, const uint64_t *keys, size_t n,
                         bool exclusive)
{
    uint64_t values[MAX_BATCH];
    size_t expected_removed = 0;
    uint64_t tombstones = stats_of(map).tombstones;
    size_t removed = exclusive ? em_hashmap_erase_exclusive(map, keys, n, values)
                               : em_hashmap_erase(map, keys, n, values);
    if (exclusive)
        require_u64(stats_of(map).tombstones, ==, tombstones);
    for (size_t i = 0; i < n; i++) {
        uint64_t expected = ref_erase(ref, keys[i]);
        expected_removed += expected != EM_HASHMAP_NOT_FOUND;
        require(values[i] == expected, "erase key %" PRIu64 ": %" PRIu64 ", want %" PRIu64,
                      keys[i], values[i], expected);
    }
    require_u64(removed, ==, expected_removed);
}

/* Exports in chunks of chunk entries; every reference key exactly once, nothing else. */
static void check_export(em_hashmap *map, ref_map *ref, size_t chunk)
{
    uint64_t keys[MAX_BATCH], values[MAX_BATCH];
    uint8_t *seen = calloc(ref->capacity, 1);
    uint64_t cursor = 0;
    size_t total = 0, copied;
    while ((copied = em_hashmap_export(map, &cursor, keys, values, chunk)) > 0) {
        require_u64(copied, <=, chunk);
        for (size_t i = 0; i < copied; i++) {
            size_t position = ref_position(ref, keys[i]);
            require(ref->states[position] == REF_LIVE,
                          "export gave key %" PRIu64 " that is not in the map", keys[i]);
            require_u64(values[i], ==, ref->rows[position]);
            require(!seen[position], "export gave key %" PRIu64 " twice", keys[i]);
            seen[position] = 1;
        }
        total += copied;
    }
    require_u64(total, ==, ref->live);
    require_u64(em_hashmap_export(map, &cursor, keys, values, chunk), ==, 0);
    free(seen);
}

/* Walks from a position chosen by random, chunk entries at a time: every reference key
 * exactly once, nothing else. */
static void check_walk(em_hashmap *map, ref_map *ref, uint64_t random, size_t chunk)
{
    uint64_t keys[MAX_BATCH], values[MAX_BATCH];
    uint8_t *seen = calloc(ref->capacity, 1);
    em_hashmap_walk walk;
    em_hashmap_walk_begin(map, random, &walk);
    size_t total = 0, copied;
    while ((copied = em_hashmap_walk_next(map, &walk, keys, values, chunk)) > 0) {
        require_u64(copied, <=, chunk);
        for (size_t i = 0; i < copied; i++) {
            size_t position = ref_position(ref, keys[i]);
            require(ref->states[position] == REF_LIVE,
                    "walk gave key %" PRIu64 " that is not in the map", keys[i]);
            require_u64(values[i], ==, ref->rows[position]);
            require(!seen[position], "walk gave key %" PRIu64 " twice", keys[i]);
            seen[position] = 1;
        }
        total += copied;
    }
    require_u64(total, ==, ref->live);
    require_u64(em_hashmap_walk_next(map, &walk, keys, values, chunk), ==, 0);
    free(seen);
}

static void check_counts(em_hashmap *map, const ref_map *ref, double max_load_factor)
{
    em_hashmap_stats stats = stats_of(map);
    require_u64(em_hashmap_size(map), ==, ref->live);
    require_u64(stats.size, ==, ref->live);
    require_u64(em_hashmap_row_limit(map), ==, ref->row_limit);
    require_u64(stats.row_limit, ==, ref->row_limit);
    require_u64(stats.free_rows, ==, ref->free_count);
    require_u64(stats.bytes, ==, stats.slots * 16);
    require(stats.load_factor <= max_load_factor + 1e-9, "load %f above %f",
                  stats.load_factor, max_load_factor);
}

static void run_random_sequence(uint64_t seed, double max_load_factor, size_t operations)
{
    em_hashmap *map = create_map(16, max_load_factor);
    ref_map ref;
    ref_init(&ref);
    key_source source;
    em_test_rng_init(&source.rng, seed);
    for (size_t i = 0; i < RECENT_KEYS; i++)
        source.recent[i] = em_test_rng_next(&source.rng);
    uint64_t keys[MAX_BATCH];
    for (size_t op = 0; op < operations; op++) {
        size_t n = 1 + em_test_rng_below(&source.rng, MAX_BATCH);
        for (size_t i = 0; i < n; i++)
            keys[i] = draw_key(&source);
        uint64_t kind = em_test_rng_below(&source.rng, 100);
        if (kind < 30)
            random_find(map, &ref, keys, n);
        else if (kind < 68)
            random_find_or_insert(map, &ref, keys, n);
        else if (kind < 84)
            random_erase(map, &ref, keys, n, false);
        else if (kind < 99)
            random_erase(map, &ref, keys, n, true);
        else if (op % 2 == 0)
            check_export(map, &ref, n);
        else
            check_walk(map, &ref, em_test_rng_next(&source.rng), n);
        check_counts(map, &ref, max_load_factor == 0 ? EM_HASHMAP_DEFAULT_MAX_LOAD
                                                     : max_load_factor);
    }
    check_export(map, &ref, MAX_BATCH);
    check_walk(map, &ref, em_test_rng_next(&source.rng), MAX_BATCH);
    require_u64(ref.reused, >, 0);
    require_u64(stats_of(map).grow_count, >, 0);
    ref_free(&ref);
    em_hashmap_destroy(map);
}

START_TEST(random_operations_match_reference)
{
    static const double loads[] = {0, 0.5, 0.95};
    size_t operations = scaled(40000, 10000);
    for (size_t i = 0; i < sizeof(loads) / sizeof(loads[0]); i++)
        run_random_sequence(em_test_seed() + i, loads[i], operations);
}
END_TEST

/* ---- single-threaded behaviour ---- */

START_TEST(sentinel_keys_are_ordinary_keys)
{
    em_hashmap *map = create_map(16, 0);
    uint64_t values[SPECIAL_KEY_COUNT];
    uint8_t inserted[SPECIAL_KEY_COUNT];
    size_t count = 0;
    em_error err = {0};
    require_u64(em_hashmap_find(map, special_keys, SPECIAL_KEY_COUNT, values), ==, SPECIAL_KEY_COUNT);
    for (size_t i = 0; i < SPECIAL_KEY_COUNT; i++)
        require_u64(values[i], ==, EM_HASHMAP_NOT_FOUND);
    ck_assert_int_eq(em_hashmap_find_or_insert(map, special_keys, SPECIAL_KEY_COUNT, values,
                                               inserted, &count, &err),
                     EM_OK);
    require_u64(count, ==, SPECIAL_KEY_COUNT);
    for (size_t i = 0; i < SPECIAL_KEY_COUNT; i++) {
        require_u64(values[i], ==, i);
        require_u64(inserted[i], ==, 1);
    }
    require_u64(em_hashmap_size(map), ==, SPECIAL_KEY_COUNT);
    ck_assert_double_eq_tol(stats_of(map).load_factor, 3.0 / 16.0, 1e-12);

    uint64_t erase_keys[] = {EM_HASHMAP_EMPTY_KEY, EM_HASHMAP_TOMBSTONE_KEY,
                             EM_HASHMAP_EMPTY_KEY};
    uint64_t erased[3];
    require_u64(em_hashmap_erase(map, erase_keys, 3, erased), ==, 2);
    require_u64(erased[0], ==, 2);
    require_u64(erased[1], ==, 3);
    require_u64(erased[2], ==, EM_HASHMAP_NOT_FOUND);
    require_u64(em_hashmap_size(map), ==, SPECIAL_KEY_COUNT - 2);
    require_u64(em_hashmap_find(map, special_keys, SPECIAL_KEY_COUNT, values), ==, 2);
    require_u64(values[2], ==, EM_HASHMAP_NOT_FOUND);
    require_u64(values[3], ==, EM_HASHMAP_NOT_FOUND);

    /* Re-inserted sentinels reuse the released rows and are exported. */
    ck_assert_int_eq(em_hashmap_find_or_insert(map, erase_keys, 2, values, inserted, &count,
                                               &err),
                     EM_OK);
    require_u64(count, ==, 2);
    require(values[0] <= 3 && values[0] >= 2 && values[1] <= 3 && values[1] >= 2, "%s", "values[0] <= 3 && values[0] >= 2 && values[1] <= 3 && values[1] >= 2");
    require_u64(values[0], !=, values[1]);
    require_u64(em_hashmap_row_limit(map), ==, SPECIAL_KEY_COUNT);
    uint64_t cursor = 0, keys[8], rows[8];
    require_u64(em_hashmap_export(map, &cursor, keys, rows, 8), ==, SPECIAL_KEY_COUNT);
    require_u64(em_hashmap_export(map, &cursor, keys, rows, 8), ==, 0);
    em_hashmap_destroy(map);
}
END_TEST

START_TEST(repeated_key_in_batch_is_inserted_once)
{
    em_hashmap *map = create_map(16, 0);
    uint64_t keys[] = {7, 9, 7, EM_HASHMAP_EMPTY_KEY, 9, EM_HASHMAP_EMPTY_KEY, 7};
    uint64_t values[7];
    uint8_t inserted[7];
    size_t count = 0;
    em_error err = {0};
    ck_assert_int_eq(em_hashmap_find_or_insert(map, keys, 7, values, inserted, &count, &err),
                     EM_OK);
    require_u64(count, ==, 3);
    uint64_t want_values[] = {0, 1, 0, 2, 1, 2, 0};
    uint8_t want_inserted[] = {1, 1, 0, 1, 0, 0, 0};
    for (size_t i = 0; i < 7; i++) {
        require_u64(values[i], ==, want_values[i]);
        require_u64(inserted[i], ==, want_inserted[i]);
    }
    require_u64(em_hashmap_size(map), ==, 3);
    /* Nullable outputs and empty batches. */
    ck_assert_int_eq(em_hashmap_find_or_insert(map, keys, 7, values, NULL, NULL, &err), EM_OK);
    ck_assert_int_eq(em_hashmap_find_or_insert(map, NULL, 0, NULL, NULL, &count, &err), EM_OK);
    require_u64(count, ==, 0);
    require_u64(em_hashmap_find(map, NULL, 0, NULL), ==, 0);
    require_u64(em_hashmap_erase(map, keys, 7, NULL), ==, 3);
    require_u64(em_hashmap_size(map), ==, 0);
    em_hashmap_destroy(map);
}
END_TEST

START_TEST(export_visits_each_entry_once_in_chunks)
{
    em_hashmap *map = create_map(64, 0);
    size_t n = 1000;
    require_u64(insert_range(map, 0, n, 100), ==, n);
    uint8_t *seen = calloc(n, 1);
    uint64_t cursor = 0, key, row;
    size_t total = 0;
    while (em_hashmap_export(map, &cursor, &key, &row, 1) == 1) {
        require_u64(row, <, n);
        require_u64(key, ==, key_at(row));
        require(!seen[row], "%s", "!seen[row]");
        seen[row] = 1;
        total++;
    }
    require_u64(total, ==, n);
    require_u64(cursor, ==, stats_of(map).slots + 2);
    free(seen);
    em_hashmap_destroy(map);
}
END_TEST

/* A key alone in a map sits at its home slot, em_hash_scale(em_mix64(key ^ seed)), with
 * EM_HASHMAP_SEED (em_hashmap_hash) for seed 0; and a map with another seed, filled in a
 * first map's slot order, holds every key in an order of its own. */
START_TEST(the_seed_sets_the_home_slot)
{
    const uint64_t seeds[2] = {0, UINT64_C(0x5eed)};
    for (int k = 0; k < 2; k++) {
        em_hashmap_options options = {.initial_slots = 4096, .seed = seeds[k]};
        em_hashmap *map = NULL;
        em_error err = {0};
        require(em_hashmap_create(&options, &map, &err) == EM_OK, "create: %s", err.message);
        require_u64(insert_range(map, 7, 1, 1), ==, 1);
        uint64_t cursor = 0, key = 0, row = 0;
        require_u64(em_hashmap_export(map, &cursor, &key, &row, 1), ==, 1);
        uint64_t hash = seeds[k] == 0 ? em_hashmap_hash(key) : em_mix64(key ^ seeds[k]);
        /* the cursor counts the two side entries first, and stops after the entry */
        require_u64(cursor - 3, ==, em_hash_scale(hash, stats_of(map).slots));
        em_hashmap_destroy(map);
    }

    size_t n = 20000;
    em_hashmap *first = create_map(64, 0);
    require_u64(insert_range(first, 0, n, 1000), ==, n);
    uint64_t *order = malloc(n * sizeof(uint64_t)), *rows = malloc(n * sizeof(uint64_t));
    uint64_t cursor = 0;
    size_t exported = 0, got;
    while ((got = em_hashmap_export(first, &cursor, order + exported, rows + exported,
                                    n - exported)) > 0)
        exported += got;
    require_u64(exported, ==, n);
    em_hashmap_options options = {.initial_slots = 64, .seed = UINT64_C(0x5eed)};
    em_hashmap *second = NULL;
    em_error err = {0};
    require(em_hashmap_create(&options, &second, &err) == EM_OK, "create: %s", err.message);
    uint8_t *inserted = malloc(n);
    size_t count = 0;
    require(em_hashmap_find_or_insert(second, order, n, rows, inserted, &count, &err) == EM_OK,
            "insert: %s", err.message);
    require_u64(count, ==, n);
    require_u64(em_hashmap_find(second, order, n, rows), ==, 0);
    uint64_t *reordered = malloc(n * sizeof(uint64_t));
    cursor = 0;
    exported = 0;
    while ((got = em_hashmap_export(second, &cursor, reordered + exported, rows + exported,
                                    n - exported)) > 0)
        exported += got;
    require_u64(exported, ==, n);
    size_t same_place = 0;
    for (size_t i = 0; i < n; i++)
        same_place += order[i] == reordered[i];
    require_u64(same_place, <, n / 100);
    free(order);
    free(rows);
    free(inserted);
    free(reordered);
    em_hashmap_destroy(first);
    em_hashmap_destroy(second);
}
END_TEST

START_TEST(options_are_validated)
{
    static const double bad_loads[] = {-0.5, 0.96, 1.0, 2.0};
    em_hashmap *map = NULL;
    em_error err = {0};
    em_hashmap_options options = {.initial_slots = 16};
    for (size_t i = 0; i < sizeof(bad_loads) / sizeof(bad_loads[0]); i++) {
        options.max_load_factor = bad_loads[i];
        ck_assert_int_eq(em_hashmap_create(&options, &map, &err), EM_INVALID_ARGUMENT);
        ck_assert_ptr_nonnull(strstr(err.message, "max_load_factor"));
    }
    options.max_load_factor = 0.96;
    em_hashmap_create(&options, &map, &err);
    ck_assert_ptr_nonnull(strstr(err.message, "0.96"));
    options.max_load_factor = __builtin_nan("");
    ck_assert_int_eq(em_hashmap_create(&options, &map, &err), EM_INVALID_ARGUMENT);
    options.max_load_factor = 0;
    options.initial_slots = 0;
    ck_assert_int_eq(em_hashmap_create(&options, &map, &err), EM_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(err.message, "initial_slots is 0"));
    ck_assert_int_eq(em_hashmap_create(NULL, &map, &err), EM_INVALID_ARGUMENT);

    static const size_t requested[] = {1, 16, 17, 100};
    static const size_t granted[] = {16, 16, 32, 112};
    for (size_t i = 0; i < 4; i++) {
        map = create_map(requested[i], 0.95);
        require_u64(stats_of(map).slots, ==, granted[i]);
        require_u64(stats_of(map).bytes, ==, granted[i] * 16);
        em_hashmap_destroy(map);
    }
    em_hashmap_destroy(NULL);
}
END_TEST

START_TEST(default_load_limit_is_point_nine)
{
    em_hashmap *map = create_map(16, 0);
    require_u64(insert_range(map, 0, 14, 1), ==, 14); /* floor(0.9 * 16) */
    require_u64(stats_of(map).grow_count, ==, 0);
    require_u64(insert_range(map, 14, 1, 1), ==, 1);
    require_u64(stats_of(map).grow_count, ==, 1);
    require_u64(stats_of(map).slots, ==, 32);
    check_sequential_rows(map, 0, 15, 0);
    em_hashmap_destroy(map);
}
END_TEST

START_TEST(growth_from_sixteen_slots_to_a_million_keys)
{
    size_t n = scaled(1000000, 200000), batch = 1000;
    em_hashmap *map = create_map(16, 0);
    uint64_t grows = 0;
    for (size_t done = 0; done < n; done += batch) {
        require_u64(insert_range(map, done, batch, batch), ==, batch);
        em_hashmap_stats stats = stats_of(map);
        require(stats.load_factor <= EM_HASHMAP_DEFAULT_MAX_LOAD,
                      "load %f after %zu keys", stats.load_factor, done + batch);
        require_u64(stats.size, ==, done + batch);
        require_u64(stats.grow_count, >=, grows);
        grows = stats.grow_count;
    }
    em_hashmap_stats stats = stats_of(map);
    require_u64(stats.slots, ==, (uint64_t)16 << stats.grow_count);
    require((double)n > 0.9 * (double)(stats.slots / 2),
                  "%" PRIu64 " slots for %zu keys: grew more than needed", stats.slots, n);
    require_u64(stats.tombstones, ==, 0);
    require_u64(stats.row_limit, ==, n);
    check_sequential_rows(map, 0, n, 0);
    em_hashmap_destroy(map);
}
END_TEST

START_TEST(reserve_prevents_growth)
{
    em_hashmap *map = create_map(16, 0);
    em_error err = {0};
    require_u64(insert_range(map, 0, 1000, 64), ==, 1000);
    uint64_t erase_keys[300];
    for (size_t i = 0; i < 300; i++)
        erase_keys[i] = key_at(i);
    require_u64(em_hashmap_erase(map, erase_keys, 300, NULL), ==, 300);
    require_u64(stats_of(map).tombstones, ==, 300);

    size_t additional = scaled(50000, 20000);
    ck_assert_int_eq(em_hashmap_reserve(map, additional, &err), EM_OK);
    em_hashmap_stats reserved = stats_of(map);
    require_u64(reserved.tombstones, ==, 0);
    require_u64(insert_range(map, 1000, additional, 4096), ==, additional);
    em_hashmap_stats after = stats_of(map);
    require_u64(after.grow_count, ==, reserved.grow_count);
    require_u64(after.slots, ==, reserved.slots);
    require_u64(after.size, ==, 700 + additional);
    /* Room already there: nothing happens. */
    ck_assert_int_eq(em_hashmap_reserve(map, 0, &err), EM_OK);
    ck_assert_int_eq(em_hashmap_reserve(map, 1, &err), EM_OK);
    require_u64(stats_of(map).grow_count, ==, reserved.grow_count);
    /* The 300 released rows went to the first new keys. */
    require_u64(after.row_limit, ==, 1000 + additional - 300);
    check_sequential_rows(map, 300, 700, 300);
    em_hashmap_destroy(map);
}
END_TEST

START_TEST(erase_churn_does_not_grow_without_bound)
{
    em_hashmap *map = create_map(1024, 0);
    uint64_t keys[256], values[256];
    for (uint64_t round = 0; round < 400; round++) {
        for (size_t i = 0; i < 256; i++)
            keys[i] = key_at(round * 256 + i);
        em_error err = {0};
        ck_assert_int_eq(em_hashmap_find_or_insert(map, keys, 256, values, NULL, NULL, &err),
                         EM_OK);
        require_u64(em_hashmap_erase(map, keys, 256, NULL), ==, 256);
    }
    em_hashmap_stats stats = stats_of(map);
    require_u64(stats.size, ==, 0);
    require_u64(stats.slots, ==, 1024);
    require_u64(stats.grow_count, >, 0);
    require_u64(stats.row_limit, <=, 256);
    em_hashmap_destroy(map);
}
END_TEST

/* A map holding 60% of its budget while keys come and go (erased with tombstones) is
 * rehashed in place to drop them, never doubled. */
START_TEST(churn_at_a_steady_size_keeps_the_slot_count)
{
    em_hashmap *map = create_map(4096, 0);
    uint64_t budget = (uint64_t)(4096 * EM_HASHMAP_DEFAULT_MAX_LOAD);
    uint64_t live = budget * 6 / 10;
    require_u64(insert_range(map, 0, live, 256), ==, live);
    uint64_t key, value;
    for (uint64_t i = 0; i < 20 * budget; i++) {
        key = key_at(i);
        require_u64(em_hashmap_erase(map, &key, 1, NULL), ==, 1);
        key = key_at(live + i);
        em_error err = {0};
        ck_assert_int_eq(em_hashmap_find_or_insert(map, &key, 1, &value, NULL, NULL, &err),
                         EM_OK);
    }
    em_hashmap_stats stats = stats_of(map);
    require_u64(stats.size, ==, live);
    require_u64(stats.slots, ==, 4096);
    require_u64(stats.grow_count, >=, 20 * budget / (budget - live) - 1);
    require_u64(stats.row_limit, ==, live);
    for (uint64_t i = 0; i < live; i++) {
        key = key_at(20 * budget + i);
        require_u64(em_hashmap_find(map, &key, 1, &value), ==, 0);
    }
    em_hashmap_destroy(map);
}
END_TEST

/* Erasing by backward shift in a full map (long runs, wrapping at the end) keeps every
 * other key where a probe finds it, leaves no tombstone and never rehashes: a key at a
 * time (batches below 32 keys), and by sweeps of the runs (larger ones), of keys at
 * random and, every other round of the larger batches, of a whole stretch of the map as
 * an eviction's window empties it. */
START_TEST(exclusive_erase_keeps_a_full_map_whole)
{
    em_hashmap *map = create_map(1024, 0.95);
    uint64_t budget = (uint64_t)(1024 * 0.95);
    enum { ROUNDS = 300, LARGEST = 400 };
    const uint64_t most = _i == 0 ? 31 : LARGEST;
    uint8_t *present = calloc(budget + ROUNDS * LARGEST, 1);
    require_u64(insert_range(map, 0, budget, 64), ==, budget);
    memset(present, 1, budget);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    uint64_t next = budget, live = budget;
    for (int round = 1; round <= ROUNDS; round++) {
        uint64_t keys[LARGEST], values[LARGEST];
        uint64_t n = 1 + em_test_rng_below(&rng, most), expected = 0;
        if (_i == 1 && round % 2 == 0) { /* a stretch of the map: every key of a walk */
            em_hashmap_walk walk;
            em_hashmap_walk_begin(map, em_test_rng_next(&rng), &walk);
            n = em_hashmap_walk_next(map, &walk, keys, values, n);
            for (uint64_t i = 0; i < n; i++) {
                uint64_t index = index_of_key(keys[i]);
                require_u64(key_at(index), ==, keys[i]);
                expected += present[index];
                present[index] = 0;
            }
        } else {
            for (uint64_t i = 0; i < n; i++) {
                uint64_t index = em_test_rng_below(&rng, next);
                keys[i] = key_at(index);
                expected += present[index]; /* a key twice in the batch goes once */
                present[index] = 0;
            }
        }
        require_u64(em_hashmap_erase_exclusive(map, keys, n, values), ==, expected);
        live -= expected;
        require_u64(insert_range(map, next, budget - live, 64), ==, budget - live);
        memset(present + next, 1, budget - live);
        next += budget - live;
        live = budget;
        if (round % 25 == 0)
            for (uint64_t index = 0; index < next; index++) {
                uint64_t key = key_at(index), row;
                require_u64(em_hashmap_find(map, &key, 1, &row) == 0, ==, present[index]);
            }
    }
    em_hashmap_stats stats = stats_of(map);
    require_u64(stats.size, ==, budget);
    require_u64(stats.tombstones, ==, 0);
    require_u64(stats.grow_count, ==, 0);
    if (_i == 0)
        require_u64(stats.sweeps, ==, 0); /* too few keys a batch */
    else
        require_u64(stats.sweeps, >=, ROUNDS / 4); /* the runs of a full map are long */
    require_u64(stats.slots, ==, 1024);
    require_u64(stats.row_limit, ==, budget);
    free(present);
    em_hashmap_destroy(map);
}
END_TEST

static void check_exact_load(size_t keys, double max_load_factor)
{
    size_t slots = (size_t)((double)keys / max_load_factor);
    while ((double)slots * max_load_factor < (double)keys)
        slots++;
    slots = (slots + 15) / 16 * 16;
    em_hashmap *map = create_map(slots, max_load_factor);
    require_u64(insert_range(map, 0, keys, 4096), ==, keys);
    em_hashmap_stats stats = stats_of(map);
    require_u64(stats.grow_count, ==, 0);
    require_u64(stats.slots, ==, slots);
    ck_assert_double_eq_tol(stats.load_factor, (double)keys / (double)slots, 1e-12);
    ck_assert_double_ge(stats.load_factor, max_load_factor - 16.0 / (double)slots);
    check_sequential_rows(map, 0, keys, 0);
    uint64_t absent[1024], values[1024];
    for (size_t i = 0; i < 1024; i++)
        absent[i] = key_at(keys + i);
    require_u64(em_hashmap_find(map, absent, 1024, values), ==, 1024);
    em_hashmap_destroy(map);
}

START_TEST(holds_keys_at_the_maximum_load)
{
    check_exact_load(scaled(900000, 180000), 0.9);
    check_exact_load(1520, 0.95); /* exactly 1600 slots */
    em_hashmap *map = create_map(1600, 0.95);
    require_u64(insert_range(map, 0, 1521, 1521), ==, 1521);
    require_u64(stats_of(map).grow_count, ==, 1);
    em_hashmap_destroy(map);
}
END_TEST

/* ---- allocator failure ---- */

enum { BUDGET_BLOCKS = 8 };

typedef struct budget_allocator {
    size_t limit;
    size_t in_use;
    void *blocks[BUDGET_BLOCKS];
    size_t sizes[BUDGET_BLOCKS];
} budget_allocator;

static em_status budget_alloc(void *context, size_t bytes, void **out, em_error *err)
{
    budget_allocator *budget = context;
    if (budget->in_use + bytes > budget->limit)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "budget of %zu bytes with %zu in use",
                            budget->limit, budget->in_use);
    for (size_t i = 0; i < BUDGET_BLOCKS; i++) {
        if (budget->blocks[i] != NULL)
            continue;
        budget->blocks[i] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        ck_assert_ptr_nonnull(budget->blocks[i]);
        budget->sizes[i] = bytes;
        budget->in_use += bytes;
        *out = budget->blocks[i];
        return EM_OK;
    }
    return em_error_set(err, EM_RESOURCE_EXHAUSTED, "no block records left");
}

static void budget_free(void *context, void *pointer)
{
    budget_allocator *budget = context;
    for (size_t i = 0; i < BUDGET_BLOCKS; i++) {
        if (budget->blocks[i] == pointer) {
            free(pointer);
            budget->blocks[i] = NULL;
            budget->in_use -= budget->sizes[i];
            return;
        }
    }
    ck_abort_msg("freed a block the budget never gave");
}

static em_hashmap_options budget_options(budget_allocator *budget, size_t slots)
{
    em_hashmap_options options = {.initial_slots = slots};
    options.allocator.alloc = budget_alloc;
    options.allocator.free = budget_free;
    options.allocator.context = budget;
    return options;
}

START_TEST(create_fails_cleanly_over_budget)
{
    budget_allocator budget = {.limit = 4096};
    em_hashmap_options options = budget_options(&budget, 1024);
    em_hashmap *map = NULL;
    em_error err = {0};
    ck_assert_int_eq(em_hashmap_create(&options, &map, &err), EM_RESOURCE_EXHAUSTED);
    ck_assert_int_eq(err.status, EM_RESOURCE_EXHAUSTED);
    require(strstr(err.message, "1024 slots") != NULL &&
                      strstr(err.message, "16384 bytes") != NULL &&
                      strstr(err.message, "budget of 4096 bytes") != NULL,
                  "message: %s", err.message);
    require_u64(budget.in_use, ==, 0);
}
END_TEST

START_TEST(failed_growth_leaves_map_usable_and_unchanged)
{
    /* Room for the 16- and 32-slot arrays together, not for the 64-slot one. */
    budget_allocator budget = {.limit = 16 * 16 + 32 * 16};
    em_hashmap_options options = budget_options(&budget, 16);
    em_hashmap *map = NULL;
    em_error err = {0};
    ck_assert_int_eq(em_hashmap_create(&options, &map, &err), EM_OK);
    require_u64(insert_range(map, 0, 20, 1), ==, 20); /* grows to 32 slots */
    require_u64(budget.in_use, ==, 32 * 16);

    uint64_t keys[20], values[20];
    uint8_t inserted[20];
    size_t count = 0;
    for (size_t i = 0; i < 20; i++)
        keys[i] = key_at(20 + i);
    ck_assert_int_eq(em_hashmap_find_or_insert(map, keys, 20, values, inserted, &count, &err),
                     EM_RESOURCE_EXHAUSTED);
    require(strstr(err.message, "from 32 to 64 slots") != NULL &&
                      strstr(err.message, "1024 bytes") != NULL,
                  "message: %s", err.message);
    require_u64(count, ==, 8); /* floor(0.9 * 32) = 28 keys fit */
    for (size_t i = 0; i < 20; i++) {
        require_u64(inserted[i], ==, i < 8);
        require_u64(values[i], ==, i < 8 ? 20 + i : EM_HASHMAP_NOT_FOUND);
    }
    em_hashmap_stats stats = stats_of(map);
    require_u64(stats.slots, ==, 32);
    require_u64(stats.size, ==, 28);
    require_u64(stats.grow_count, ==, 1);
    ck_assert_int_eq(em_hashmap_reserve(map, 10, &err), EM_RESOURCE_EXHAUSTED);
    ck_assert_ptr_nonnull(strstr(err.message, "from 32 to 64 slots"));
    require_u64(stats_of(map).slots, ==, 32);

    /* Still usable: present keys are found and re-inserted, erase works. */
    check_sequential_rows(map, 0, 28, 0);
    ck_assert_int_eq(em_hashmap_find_or_insert(map, keys, 8, values, NULL, &count, &err), EM_OK);
    require_u64(count, ==, 0);
    require_u64(em_hashmap_erase(map, keys, 4, NULL), ==, 4);
    require_u64(em_hashmap_size(map), ==, 24);

    /* With more budget the same batch goes through. */
    budget.limit = 1 << 20;
    ck_assert_int_eq(em_hashmap_find_or_insert(map, keys, 20, values, inserted, &count, &err),
                     EM_OK);
    require_u64(count, ==, 16);
    require_u64(em_hashmap_size(map), ==, 40);
    check_sequential_rows(map, 0, 20, 0);
    em_hashmap_destroy(map);
    require_u64(budget.in_use, ==, 0);
}
END_TEST

/* ---- threads ---- */

typedef struct thread_failure {
    pthread_mutex_t lock;
    char message[EM_ERROR_MESSAGE_MAX + 128];
} thread_failure;

static void fail_once(thread_failure *failure, const char *what, uint64_t key, uint64_t got,
                      uint64_t want)
{
    pthread_mutex_lock(&failure->lock);
    if (failure->message[0] == '\0')
        snprintf(failure->message, sizeof(failure->message),
                 "%s: key %" PRIu64 " got %" PRIu64 ", want %" PRIu64, what, key, got, want);
    pthread_mutex_unlock(&failure->lock);
}

static void shuffle(uint64_t *items, size_t n, em_test_rng *rng)
{
    for (size_t i = n; i > 1; i--) {
        size_t j = em_test_rng_below(rng, i);
        uint64_t swap = items[i - 1];
        items[i - 1] = items[j];
        items[j] = swap;
    }
}

enum { OVERLAP_THREADS = 4 };

typedef struct overlap_worker {
    em_hashmap *map;
    pthread_barrier_t *start;
    uint64_t seed;
    uint64_t *keys;   /* index i of the shared numbering, shuffled; specials at the end */
    uint64_t *values; /* row seen for keys[i] */
    size_t n;
    size_t inserted;
    em_status status;
} overlap_worker;

static uint64_t overlap_key(uint64_t index, size_t specials_from)
{
    return index < specials_from ? key_at(index) : special_keys[index - specials_from];
}

static void *overlap_run(void *argument)
{
    overlap_worker *worker = argument;
    em_test_rng rng;
    em_test_rng_init(&rng, worker->seed);
    uint64_t *keys = malloc(worker->n * sizeof(*keys));
    for (size_t i = 0; i < worker->n; i++)
        keys[i] = worker->keys[i];
    pthread_barrier_wait(worker->start);
    for (size_t done = 0; done < worker->n && worker->status == EM_OK;) {
        size_t n = 1 + em_test_rng_below(&rng, 4096);
        n = n < worker->n - done ? n : worker->n - done;
        size_t inserted = 0;
        em_error err = {0};
        worker->status = em_hashmap_find_or_insert(worker->map, keys + done, n,
                                                   worker->values + done, NULL, &inserted, &err);
        worker->inserted += inserted;
        done += n;
    }
    free(keys);
    return NULL;
}

START_TEST(threads_inserting_overlapping_keys_agree)
{
    size_t per_thread = scaled(200000, 50000), half = per_thread / 2;
    size_t distinct = half * (OVERLAP_THREADS + 1), total = distinct + SPECIAL_KEY_COUNT;
    em_hashmap *map = create_map(16, 0);
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, OVERLAP_THREADS);
    overlap_worker workers[OVERLAP_THREADS];
    pthread_t threads[OVERLAP_THREADS];
    for (size_t t = 0; t < OVERLAP_THREADS; t++) {
        overlap_worker *worker = &workers[t];
        *worker = (overlap_worker){.map = map, .start = &start, .seed = em_test_seed() + t,
                                   .n = per_thread + SPECIAL_KEY_COUNT, .status = EM_OK};
        worker->keys = malloc(worker->n * sizeof(uint64_t));
        worker->values = malloc(worker->n * sizeof(uint64_t));
        for (size_t i = 0; i < worker->n; i++) {
            uint64_t index = i < per_thread ? t * half + i : distinct + (i - per_thread);
            worker->keys[i] = overlap_key(index, distinct);
        }
        em_test_rng rng;
        em_test_rng_init(&rng, em_test_seed() ^ (t + 100));
        shuffle(worker->keys, worker->n, &rng);
        pthread_create(&threads[t], NULL, overlap_run, worker);
    }
    for (size_t t = 0; t < OVERLAP_THREADS; t++)
        pthread_join(threads[t], NULL);
    pthread_barrier_destroy(&start);

    size_t inserted = 0;
    for (size_t t = 0; t < OVERLAP_THREADS; t++) {
        ck_assert_int_eq(workers[t].status, EM_OK);
        inserted += workers[t].inserted;
    }
    require_u64(inserted, ==, total);
    require_u64(em_hashmap_size(map), ==, total);
    require_u64(em_hashmap_row_limit(map), ==, total);
    require_u64(stats_of(map).grow_count, >, 10);

    /* The map's rows, by shared index: a permutation of 0..total-1. */
    uint64_t *keys = malloc(total * sizeof(uint64_t));
    uint64_t *rows = malloc(total * sizeof(uint64_t));
    uint8_t *row_taken = calloc(total, 1);
    for (size_t i = 0; i < total; i++)
        keys[i] = overlap_key(i, distinct);
    require_u64(em_hashmap_find(map, keys, total, rows), ==, 0);
    for (size_t i = 0; i < total; i++) {
        require_u64(rows[i], <, total);
        require(!row_taken[rows[i]], "row %" PRIu64 " given twice", rows[i]);
        row_taken[rows[i]] = 1;
    }
    /* Every thread saw the map's row for each of its keys. */
    uint64_t *found = malloc((per_thread + SPECIAL_KEY_COUNT) * sizeof(uint64_t));
    for (size_t t = 0; t < OVERLAP_THREADS; t++) {
        overlap_worker *worker = &workers[t];
        em_hashmap_find(map, worker->keys, worker->n, found);
        for (size_t i = 0; i < worker->n; i++)
            require(worker->values[i] == found[i],
                          "thread %zu saw row %" PRIu64 " for key %" PRIu64 ", map has %" PRIu64,
                          t, worker->values[i], worker->keys[i], found[i]);
        free(worker->keys);
        free(worker->values);
    }
    free(found);
    free(keys);
    free(rows);
    free(row_taken);
    em_hashmap_destroy(map);
}
END_TEST

typedef struct race_worker {
    em_hashmap *map;
    pthread_barrier_t *start;
    const uint64_t *keys;
    size_t n;
    uint64_t *values;
    size_t inserted;
} race_worker;

static void *race_run(void *argument)
{
    race_worker *worker = argument;
    enum { BATCH = 64 };
    pthread_barrier_wait(worker->start);
    for (size_t done = 0; done < worker->n; done += BATCH) {
        size_t n = worker->n - done < BATCH ? worker->n - done : BATCH, inserted = 0;
        em_error err = {0};
        if (em_hashmap_find_or_insert(worker->map, worker->keys + done, n, worker->values + done,
                                      NULL, &inserted, &err) != EM_OK)
            return NULL;
        worker->inserted += inserted;
    }
    return NULL;
}

/* Every thread inserts the same keys in the same order: most inserts race on a CAS. */
START_TEST(threads_racing_on_the_same_keys_agree)
{
    enum { THREADS = 4 };
    size_t n = scaled(200000, 50000);
    uint64_t *keys = malloc(n * sizeof(uint64_t));
    for (size_t i = 0; i < n; i++)
        keys[i] = i % 1000 == 0 ? special_keys[(i / 1000) % SPECIAL_KEY_COUNT] : key_at(i);
    size_t distinct = n - (n + 999) / 1000 + SPECIAL_KEY_COUNT;
    em_hashmap *map = create_map(16, 0);
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, THREADS);
    race_worker workers[THREADS];
    pthread_t threads[THREADS];
    for (size_t t = 0; t < THREADS; t++) {
        workers[t] = (race_worker){.map = map, .start = &start, .keys = keys, .n = n,
                                   .values = malloc(n * sizeof(uint64_t))};
        pthread_create(&threads[t], NULL, race_run, &workers[t]);
    }
    size_t inserted = 0;
    for (size_t t = 0; t < THREADS; t++) {
        pthread_join(threads[t], NULL);
        inserted += workers[t].inserted;
    }
    pthread_barrier_destroy(&start);
    require_u64(inserted, ==, distinct);
    require_u64(em_hashmap_size(map), ==, distinct);
    require_u64(em_hashmap_row_limit(map), ==, distinct);
    uint64_t *rows = malloc(n * sizeof(uint64_t));
    require_u64(em_hashmap_find(map, keys, n, rows), ==, 0);
    for (size_t t = 0; t < THREADS; t++) {
        for (size_t i = 0; i < n; i++)
            require(workers[t].values[i] == rows[i], "thread %zu: key %" PRIu64 " row %" PRIu64
                    ", map has %" PRIu64, t, keys[i], workers[t].values[i], rows[i]);
        free(workers[t].values);
    }
    free(rows);
    free(keys);
    em_hashmap_destroy(map);
}
END_TEST

typedef struct reader_writer_shared {
    em_hashmap *map;
    size_t present; /* keys [0, present) of key_at, row i */
    uint64_t absent_from;
    atomic_int writers_left;
    thread_failure failure;
} reader_writer_shared;

typedef struct reader_writer_worker {
    reader_writer_shared *shared;
    uint64_t seed;
    uint64_t first; /* writers: keys [first, first + count) */
    size_t count;
    size_t rounds;
} reader_writer_worker;

static void *reader_run(void *argument)
{
    reader_writer_worker *worker = argument;
    reader_writer_shared *shared = worker->shared;
    em_test_rng rng;
    em_test_rng_init(&rng, worker->seed);
    enum { BATCH = 256 };
    uint64_t keys[BATCH], want[BATCH], values[BATCH];
    do {
        for (size_t i = 0; i < BATCH; i++) {
            bool absent = i % 8 == 7;
            uint64_t index = absent ? shared->absent_from + em_test_rng_below(&rng, 1u << 20)
                                    : em_test_rng_below(&rng, shared->present);
            keys[i] = key_at(index);
            want[i] = absent ? EM_HASHMAP_NOT_FOUND : index;
        }
        em_hashmap_find(shared->map, keys, BATCH, values);
        for (size_t i = 0; i < BATCH; i++)
            if (values[i] != want[i])
                fail_once(&shared->failure, "find during inserts", keys[i], values[i], want[i]);
        worker->rounds++;
    } while (atomic_load(&shared->writers_left) > 0);
    return NULL;
}

static void *writer_run(void *argument)
{
    reader_writer_worker *worker = argument;
    reader_writer_shared *shared = worker->shared;
    size_t inserted = insert_range(shared->map, worker->first, worker->count, 512);
    if (inserted != worker->count)
        fail_once(&shared->failure, "writer inserted", worker->first, inserted, worker->count);
    atomic_fetch_sub(&shared->writers_left, 1);
    return NULL;
}

enum { READERS = 2, WRITERS = 2 };

/* Fills shared->map with keys [0, shared->present), then runs READERS threads of
 * `reader` beside WRITERS writers, each inserting per_writer keys after those, until the
 * writers are done; checks that no thread failed, that every reader ran at least one
 * round, that the map grew, and that it holds every key. */
static void run_beside_writers(reader_writer_shared *shared, size_t per_writer,
                               void *(*reader)(void *))
{
    shared->map = create_map(16, 0);
    shared->absent_from = shared->present + WRITERS * per_writer;
    pthread_mutex_init(&shared->failure.lock, NULL);
    atomic_init(&shared->writers_left, WRITERS);
    require_u64(insert_range(shared->map, 0, shared->present, 4096), ==, shared->present);
    uint64_t grows_before = stats_of(shared->map).grow_count;

    reader_writer_worker workers[READERS + WRITERS];
    pthread_t threads[READERS + WRITERS];
    for (size_t t = 0; t < READERS + WRITERS; t++) {
        workers[t] = (reader_writer_worker){.shared = shared, .seed = em_test_seed() + t};
        if (t >= READERS) {
            workers[t].first = shared->present + (t - READERS) * per_writer;
            workers[t].count = per_writer;
        }
        pthread_create(&threads[t], NULL, t < READERS ? reader : writer_run, &workers[t]);
    }
    for (size_t t = 0; t < READERS + WRITERS; t++)
        pthread_join(threads[t], NULL);
    require(shared->failure.message[0] == '\0', "%s", shared->failure.message);
    for (size_t t = 0; t < READERS; t++)
        require_u64(workers[t].rounds, >, 0);
    require_u64(stats_of(shared->map).grow_count, >, grows_before);
    require_u64(em_hashmap_size(shared->map), ==, shared->present + WRITERS * per_writer);
    pthread_mutex_destroy(&shared->failure.lock);
}

START_TEST(finds_are_right_while_others_insert)
{
    reader_writer_shared shared = {.present = scaled(100000, 20000)};
    run_beside_writers(&shared, scaled(300000, 60000), reader_run);
    check_sequential_rows(shared.map, 0, shared.present, 0);
    em_hashmap_destroy(shared.map);
}
END_TEST

/* Walks (or exports, every other round) the map chunk by chunk until the writers are
 * done: each entry given must carry the row the map holds for its key, never a value
 * not yet published (a slot whose key landed before its row). */
static void *walker_run(void *argument)
{
    reader_writer_worker *worker = argument;
    reader_writer_shared *shared = worker->shared;
    em_test_rng rng;
    em_test_rng_init(&rng, worker->seed);
    enum { CHUNK = 500 };
    uint64_t keys[CHUNK], values[CHUNK], rows[CHUNK];
    do {
        bool exporting = worker->rounds % 2 == 1;
        em_hashmap_walk walk;
        em_hashmap_walk_begin(shared->map, em_test_rng_next(&rng), &walk);
        uint64_t cursor = 0;
        size_t got;
        while ((got = exporting ? em_hashmap_export(shared->map, &cursor, keys, values, CHUNK)
                                : em_hashmap_walk_next(shared->map, &walk, keys, values,
                                                       CHUNK)) > 0) {
            em_hashmap_find(shared->map, keys, got, rows);
            for (size_t i = 0; i < got; i++)
                if (values[i] != rows[i])
                    fail_once(&shared->failure, exporting ? "export during inserts"
                                                          : "walk during inserts",
                              keys[i], values[i], rows[i]);
        }
        worker->rounds++;
    } while (atomic_load(&shared->writers_left) > 0);
    return NULL;
}

START_TEST(walks_and_exports_give_published_rows_while_others_insert)
{
    reader_writer_shared shared = {.present = scaled(50000, 10000)};
    run_beside_writers(&shared, scaled(200000, 40000), walker_run);
    em_hashmap_destroy(shared.map);
}
END_TEST

/* Threads insert, erase and find their own keys (rows come from the shared pool). */
enum { CHURN_THREADS = 3, CHURN_KEYS = 2000 };

typedef struct churn_worker {
    em_hashmap *map;
    uint64_t seed;
    size_t thread;
    size_t operations;
    uint64_t rows[CHURN_KEYS + SPECIAL_KEY_COUNT]; /* reference: row or NOT_FOUND */
    thread_failure *failure;
} churn_worker;

static uint64_t churn_key(size_t thread, size_t index)
{
    if (index >= CHURN_KEYS)
        return special_keys[index - CHURN_KEYS];
    return ((uint64_t)(thread + 1) << 40) + index;
}

static size_t churn_key_count(size_t thread)
{
    return thread == 0 ? CHURN_KEYS + SPECIAL_KEY_COUNT : CHURN_KEYS;
}

/* Checks one result against the thread's reference and updates the reference. */
static void churn_check(churn_worker *worker, int kind, uint64_t key, uint64_t value,
                        uint8_t inserted, uint64_t *row)
{
    static const char *names[] = {"find", "erase", "find_or_insert"};
    bool was_present = *row != EM_HASHMAP_NOT_FOUND;
    if (kind == 2 && !was_present && !inserted)
        fail_once(worker->failure, "find_or_insert did not insert", key, value, *row);
    else if ((kind != 2 || was_present) && (value != *row || inserted))
        fail_once(worker->failure, names[kind], key, value, *row);
    if (kind == 1)
        *row = EM_HASHMAP_NOT_FOUND;
    else if (kind == 2)
        *row = value;
}

static void churn_step(churn_worker *worker, em_test_rng *rng)
{
    enum { BATCH = 32 };
    size_t indices[BATCH];
    uint64_t keys[BATCH], values[BATCH];
    uint8_t inserted[BATCH] = {0};
    size_t n = 1 + em_test_rng_below(rng, BATCH);
    for (size_t i = 0; i < n; i++) {
        indices[i] = em_test_rng_below(rng, churn_key_count(worker->thread));
        keys[i] = churn_key(worker->thread, indices[i]);
    }
    int kind = (int)em_test_rng_below(rng, 3);
    em_error err = {0};
    if (kind == 0)
        em_hashmap_find(worker->map, keys, n, values);
    else if (kind == 1)
        em_hashmap_erase(worker->map, keys, n, values);
    else if (em_hashmap_find_or_insert(worker->map, keys, n, values, inserted, NULL, &err) !=
             EM_OK)
        fail_once(worker->failure, err.message, 0, 0, 0);
    for (size_t i = 0; i < n; i++)
        churn_check(worker, kind, keys[i], values[i], inserted[i], &worker->rows[indices[i]]);
}

static void *churn_run(void *argument)
{
    churn_worker *worker = argument;
    em_test_rng rng;
    em_test_rng_init(&rng, worker->seed);
    for (size_t i = 0; i < CHURN_KEYS + SPECIAL_KEY_COUNT; i++)
        worker->rows[i] = EM_HASHMAP_NOT_FOUND;
    for (size_t op = 0; op < worker->operations; op++)
        churn_step(worker, &rng);
    return NULL;
}

START_TEST(threads_inserting_and_erasing_keep_rows_unique)
{
    thread_failure failure = {.message = ""};
    pthread_mutex_init(&failure.lock, NULL);
    em_hashmap *map = create_map(16, 0);
    static churn_worker workers[CHURN_THREADS];
    pthread_t threads[CHURN_THREADS];
    for (size_t t = 0; t < CHURN_THREADS; t++) {
        workers[t] = (churn_worker){.map = map, .seed = em_test_seed() + t, .thread = t,
                                    .operations = scaled(30000, 8000), .failure = &failure};
        pthread_create(&threads[t], NULL, churn_run, &workers[t]);
    }
    for (size_t t = 0; t < CHURN_THREADS; t++)
        pthread_join(threads[t], NULL);
    require(failure.message[0] == '\0', "%s", failure.message);

    /* Live rows are unique, and every row ever handed out is live or free. */
    em_hashmap_stats stats = stats_of(map);
    uint8_t *row_taken = calloc(stats.row_limit, 1);
    size_t live = 0;
    for (size_t t = 0; t < CHURN_THREADS; t++) {
        for (size_t i = 0; i < churn_key_count(t); i++) {
            uint64_t row = workers[t].rows[i], found;
            uint64_t key = churn_key(t, i);
            em_hashmap_find(map, &key, 1, &found);
            require_u64(found, ==, row);
            if (row == EM_HASHMAP_NOT_FOUND)
                continue;
            require_u64(row, <, stats.row_limit);
            require(!row_taken[row], "row %" PRIu64 " is live twice", row);
            row_taken[row] = 1;
            live++;
        }
    }
    require_u64(stats.size, ==, live);
    require_u64(stats.size + stats.free_rows, ==, stats.row_limit);
    free(row_taken);
    pthread_mutex_destroy(&failure.lock);
    em_hashmap_destroy(map);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("hashmap");
    TCase *basics = tcase_create("basics");
    tcase_add_test(basics, sentinel_keys_are_ordinary_keys);
    tcase_add_test(basics, repeated_key_in_batch_is_inserted_once);
    tcase_add_test(basics, export_visits_each_entry_once_in_chunks);
    tcase_add_test(basics, the_seed_sets_the_home_slot);
    tcase_add_test(basics, options_are_validated);
    tcase_add_test(basics, default_load_limit_is_point_nine);
    tcase_add_test(basics, create_fails_cleanly_over_budget);
    tcase_add_test(basics, failed_growth_leaves_map_usable_and_unchanged);
    suite_add_tcase(suite, basics);

    TCase *large = tcase_create("large");
    tcase_set_timeout(large, 120);
    tcase_add_test(large, random_operations_match_reference);
    tcase_add_test(large, growth_from_sixteen_slots_to_a_million_keys);
    tcase_add_test(large, reserve_prevents_growth);
    tcase_add_test(large, erase_churn_does_not_grow_without_bound);
    tcase_add_test(large, churn_at_a_steady_size_keeps_the_slot_count);
    tcase_add_loop_test(large, exclusive_erase_keeps_a_full_map_whole, 0, 2);
    tcase_add_test(large, holds_keys_at_the_maximum_load);
    suite_add_tcase(suite, large);

    TCase *threads = tcase_create("threads");
    tcase_set_timeout(threads, 120);
    tcase_add_test(threads, threads_inserting_overlapping_keys_agree);
    tcase_add_test(threads, threads_racing_on_the_same_keys_agree);
    tcase_add_test(threads, finds_are_right_while_others_insert);
    tcase_add_test(threads, walks_and_exports_give_published_rows_while_others_insert);
    tcase_add_test(threads, threads_inserting_and_erasing_keep_rows_unique);
    suite_add_tcase(suite, threads);
    return em_test_run(suite);
}
