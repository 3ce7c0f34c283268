/*
 * DESIGN: the CPU concurrent hash map (contract in hashmap.h).
 *
 * Layout. One flat array of 16-byte slots {key, value}, probed linearly from the home
 * slot em_hash_scale(em_mix64(key ^ seed), slot_count). A lookup of a present key
 * touches one or two cache lines, and the batch loops prefetch the home slot of a key
 * a few positions ahead so that the misses of neighbouring keys overlap. The
 * multiply-shift scaling works for any slot count, which lets a map be sized for an
 * exact load factor.
 *
 * Seeds. The home hash takes a seed (em_hashmap_options.seed). A map's slot order is
 * its keys sorted by home slot; keys inserted in the slot order of another map with the
 * same seed (a table restored from its checkpoint, whose rows come in snapshot order)
 * arrive concentrated in a part of the home range at many times the map's load, and
 * linear probing makes clusters as long as the batch. A map filled from another's order
 * needs a seed of its own; its creator picks it (tables: em_table_create_seeded).
 *
 * Slot life cycle. While an array lives, a slot only ever goes EMPTY -> key ->
 * TOMBSTONE, and its value only PENDING -> row:
 *   - an insert claims the first EMPTY slot on the key's probe sequence with a CAS on
 *     the key, then takes a row index and stores it into the value with release order;
 *     anyone who meets a claimed slot whose value is still PENDING waits (pause hint,
 *     then yield) and reads the value with acquire order;
 *   - erase waits for the value, CASes key -> TOMBSTONE and gives the row back.
 * Two threads inserting the same key walk the same sequence and stop at the same first
 * EMPTY slot (or at the key): one CAS wins, the loser reads the key in its failed CAS
 * and takes the winner's row. A second live copy of a key further along would mean its
 * inserter passed an earlier slot holding that key, where it would have stopped.
 * Inserts do not reuse tombstones: an insert filling a tombstone could race with a
 * second insert of the same key that passed that slot a moment before and claims an
 * EMPTY slot further on, leaving the key twice. Tombstones go at the next rehash.
 *
 * Exclusive erase. A caller that holds the map alone may erase by backward shift
 * instead: the erased slot becomes a hole, and each key further along the run (up to
 * the next EMPTY slot) whose probe sequence passes the hole moves back into it, its old
 * slot becoming the hole; the last hole goes EMPTY. Every key then still meets no EMPTY
 * slot between its home and itself. Tombstones met in the run stay where they are (they
 * are not keys, and probes pass over them as before).
 *
 * Memory orders. Keys are loaded and CASed relaxed: a key only says which slot belongs
 * to it, and a slot's value is the one thing published through it (release store,
 * acquire loads). The array and every plain field of the map are published by the
 * rwlock: they change only under the exclusive hold. The counters (used slots, next
 * row, tombstones) are relaxed budgets that are exact whenever no call is running.
 *
 * Room. used_slots counts claimed slots (keys and tombstones) plus reservations held.
 * An insert reserves before its CAS and gives the reservation back when it loses to
 * the same key, so claimed slots never pass max_used, which is below the slot count:
 * every probe meets an EMPTY slot. A batch takes reservations in small grants rather
 * than one by one, because a counter that every inserting thread bumps for every key
 * bounces its cache line between cores; next_row still takes one bump per new key,
 * since rows must stay dense. Sizes are derived from these counters, so while inserts
 * run they may include a few reservations not used yet.
 *
 * Growth. A batch holds the rwlock shared for the whole call. An insert that finds no
 * room drops its hold, takes the lock exclusively, checks the room again (another
 * thread may have grown meanwhile), and rehashes into a new array without tombstones:
 * the same count when the live keys fill at most three quarters of the budget (an
 * insert/erase churn at a steady size must not double the map, and a quarter of the
 * budget left over spreads the rehash over that many inserts), else twice the slots,
 * doubled further until the request fits. The new array is allocated before anything changes, so a
 * failed growth leaves the map as it was. The batch then takes the shared hold again
 * and goes on with the key it was on. The lock prefers writers where the C library
 * allows it, so a stream of find batches cannot starve a growth.
 *
 * Sentinel keys. The real keys EMPTY_KEY and TOMBSTONE_KEY live in two side entries,
 * one atomic value each (ABSENT, PENDING or a row) with the same claim, publish and
 * erase protocol as a slot. They use no slot, so they do not count in the load.
 *
 * Rows. A new key takes a row released by an erase (a mutex-protected stack; an atomic
 * count lets inserts skip the mutex while it is empty), else next_row++. Batch calls
 * move released rows in batches of ROW_BATCH, one lock each: an insert batch pops up to
 * that many at its first new key and gives back what it did not use when it ends, an
 * erase batch pushes its rows as they gather. One call at a time takes the rows in
 * exactly the stack's order; while a batch holds popped rows, a concurrent insert may
 * find the stack empty and take a new row, so row_limit can exceed the keys by up to
 * ROW_BATCH rows per inserting thread. The stack grows on erase, which has no way to
 * report an error: if that growth fails the rows are simply not recycled. They stay
 * below row_limit, so row storage still covers them; the cost is unused rows.
 */
#include "lib/memory/hashmap.h"

#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/keyhash.h"
#include "lib/base/rwlock.h"

/* Value of a claimed slot whose row is not stored yet; fresh slots start with it. */
#define VALUE_PENDING UINT64_MAX
/* Value of a side entry whose key is not in the map. Rows never get near either. */
#define SIDE_ABSENT (UINT64_MAX - 1)

/* Slot counts are multiples of this (and at least this): one slot array is then a
 * whole number of 64-byte cache lines. */
#define SLOT_GRANULE ((size_t)16)

/* How many keys ahead a batch prefetches the home slot: enough to cover a memory
 * latency with the work of the keys in between, few enough to stay in L1. */
#define PREFETCH_DISTANCE ((size_t)8)

/* Spins with a pause hint before a waiter yields its core: a publisher is normally a
 * few dozen instructions from its store, unless it was preempted. */
#define SPINS_BEFORE_YIELD 64u

/* Rounding slack when turning max_load_factor * slots into a slot budget, so that a
 * map sized as ceil(n / load) slots holds n keys despite the product's rounding. */
#define LOAD_ROUNDING_SLACK 1e-12

/* Most used-slot reservations one find_or_insert call takes from the shared counter at
 * once (see slot_grant): enough to make the counter's traffic small next to the slot
 * misses, small enough that threads holding spare reservations near the load limit do
 * not send each other into growth attempts for long. */
#define GRANT_SIZE ((uint64_t)64)

/* Capacity of the released-row stack when it first grows. */
#define FREE_ROWS_INITIAL 64

/* Released rows a batch call takes from, or gives back to, the free stack at once. */
#define ROW_BATCH 64

#define CACHE_LINE 64

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "the map needs lock-free 64-bit atomics");

typedef struct slot {
    _Atomic uint64_t key;
    _Atomic uint64_t value;
} slot;

_Static_assert(sizeof(slot) == 16, "slots are 16 bytes");

enum side_entry { SIDE_EMPTY_KEY, SIDE_TOMBSTONE_KEY, SIDE_COUNT };

struct em_hashmap {
    pthread_rwlock_t lock;

    /* Changed only under the exclusive hold of lock. */
    slot *slots;
    size_t slot_count;
    uint64_t seed;     /* the home hash's (em_hashmap_options.seed) */
    uint64_t max_used; /* budget for used_slots: floor(max_load_factor * slot_count) */
    uint64_t grow_count;
    _Atomic uint64_t sweeps; /* em_hashmap_stats */
    double max_load_factor;
    em_allocator allocator;

    /* Touched by every insert. */
    alignas(CACHE_LINE) _Atomic uint64_t used_slots;
    _Atomic uint64_t next_row;

    /* Touched by erases and by inserts of the two sentinel keys. */
    alignas(CACHE_LINE) _Atomic uint64_t tombstones;
    _Atomic uint64_t side_values[SIDE_COUNT];

    alignas(CACHE_LINE) pthread_mutex_t free_lock;
    _Atomic uint64_t free_count; /* written under free_lock, peeked without it */
    uint64_t *free_rows;
    size_t free_capacity;
};

/* ---- waiting for a publication ---- */

static void back_off(unsigned *spins)
{
    if (++*spins < SPINS_BEFORE_YIELD) {
        em_cpu_relax();
        return;
    }
    *spins = 0;
    sched_yield();
}

/* The first value of *value that is not VALUE_PENDING. */
static uint64_t wait_published(_Atomic uint64_t *value)
{
    unsigned spins = 0;
    uint64_t seen;
    while ((seen = atomic_load_explicit(value, memory_order_acquire)) == VALUE_PENDING)
        back_off(&spins);
    return seen;
}

/* ---- sizing ---- */

static bool is_sentinel(uint64_t key)
{
    return key == EM_HASHMAP_EMPTY_KEY || key == EM_HASHMAP_TOMBSTONE_KEY;
}

static uint64_t max_used_for(size_t slot_count, double max_load_factor)
{
    double budget = (double)slot_count * max_load_factor * (1.0 + LOAD_ROUNDING_SLACK);
    uint64_t limit = (uint64_t)budget;
    return limit < slot_count ? limit : slot_count - 1;
}

static size_t home_slot(const em_hashmap *map, uint64_t key, size_t slot_count)
{
    return (size_t)em_hash_scale(em_mix64(key ^ map->seed), slot_count);
}



static size_t next_slot(size_t position, size_t slot_count)
{
    return position + 1 == slot_count ? 0 : position + 1;
}

/* ---- slot arrays ---- */

static em_status slot_array_create(const em_hashmap *map, size_t slot_count, slot **out,
                                   em_error *err)
{
    if (slot_count > SIZE_MAX / sizeof(slot))
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "hash map slot array of %zu slots: more bytes than size_t holds",
                            slot_count);
    void *block = NULL;
    em_status status = em_allocator_alloc(&map->allocator, slot_count * sizeof(slot),
                                          "hash map slot array", &block, err);
    if (status != EM_OK)
        return status;
    slot *slots = block;
    for (size_t i = 0; i < slot_count; i++) {
        atomic_init(&slots[i].key, EM_HASHMAP_EMPTY_KEY);
        atomic_init(&slots[i].value, VALUE_PENDING);
    }
    *out = slots;
    return EM_OK;
}

/* Moves the live keys of the current array into fresh, which has slot_count slots
 * and is not shared yet. Exclusive hold only: no value is pending. */
static uint64_t rehash_into(em_hashmap *map, slot *fresh, size_t slot_count)
{
    uint64_t moved = 0;
    for (size_t i = 0; i < map->slot_count; i++) {
        uint64_t key = atomic_load_explicit(&map->slots[i].key, memory_order_relaxed);
        if (is_sentinel(key))
            continue;
        size_t position = home_slot(map, key, slot_count);
        while (atomic_load_explicit(&fresh[position].key, memory_order_relaxed) !=
               EM_HASHMAP_EMPTY_KEY)
            position = next_slot(position, slot_count);
        uint64_t value = atomic_load_explicit(&map->slots[i].value, memory_order_relaxed);
        atomic_store_explicit(&fresh[position].key, key, memory_order_relaxed);
        atomic_store_explicit(&fresh[position].value, value, memory_order_relaxed);
        moved++;
    }
    return moved;
}

/* Slot count for a rehash that makes room for needed more keys: the same count when
 * the live keys and the needed ones fill at most three quarters of the budget, so that
 * dropping the tombstones leaves a quarter of it for the next ones, else twice the
 * count, doubled on until the keys fit. 0 when no size_t can say it. */
static size_t grown_slot_count(const em_hashmap *map, uint64_t live, uint64_t needed)
{
    if (needed > UINT64_MAX - live)
        return 0;
    size_t count = map->slot_count;
    if (live + needed <= max_used_for(count, map->max_load_factor) / 4 * 3)
        return count;
    do {
        if (count > SIZE_MAX / 2 / sizeof(slot))
            return 0;
        count *= 2;
    } while (live + needed > max_used_for(count, map->max_load_factor));
    return count;
}

/* Makes room for needed more used slots. Exclusive hold: no reservation is held. */
static em_status grow_locked(em_hashmap *map, uint64_t needed, em_error *err)
{
    uint64_t used = atomic_load_explicit(&map->used_slots, memory_order_relaxed);
    if (needed <= map->max_used && used <= map->max_used - needed)
        return EM_OK;
    uint64_t tombstones = atomic_load_explicit(&map->tombstones, memory_order_relaxed);
    uint64_t live = used - tombstones;
    size_t count = grown_slot_count(map, live, needed);
    if (count == 0)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "growing hash map from %zu slots for %" PRIu64
                            " more keys: the slot array would not fit in memory",
                            map->slot_count, needed);
    slot *fresh = NULL;
    em_status status = slot_array_create(map, count, &fresh, err);
    if (status != EM_OK)
        return em_error_prefix(err, "%s hash map from %zu to %zu slots: ",
                               count > map->slot_count ? "growing" : "rehashing",
                               map->slot_count, count);
    uint64_t moved = rehash_into(map, fresh, count);
    em_allocator_free(&map->allocator, map->slots);
    map->slots = fresh;
    map->slot_count = count;
    map->max_used = max_used_for(count, map->max_load_factor);
    map->grow_count++;
    atomic_store_explicit(&map->used_slots, moved, memory_order_relaxed);
    atomic_store_explicit(&map->tombstones, 0, memory_order_relaxed);
    return EM_OK;
}

static em_status grow(em_hashmap *map, uint64_t needed, em_error *err)
{
    pthread_rwlock_wrlock(&map->lock);
    em_status status = grow_locked(map, needed, err);
    pthread_rwlock_unlock(&map->lock);
    return status;
}

/* ---- rows ---- */

/* Released rows one batch call holds: popped from the free stack ROW_BATCH at a time
 * for inserts, or gathered from erases before they are pushed, so that a call takes
 * free_lock once per ROW_BATCH rows rather than once per row. rows[count - 1] is the
 * next one an insert takes, as it was the stack's top. */
typedef struct row_batch {
    uint64_t rows[ROW_BATCH];
    uint32_t count;
} row_batch;

/* Moves up to want rows from the top of the free stack into batch (empty), in order. */
static void free_rows_pop(em_hashmap *map, row_batch *batch, size_t want)
{
    if (atomic_load_explicit(&map->free_count, memory_order_relaxed) == 0)
        return;
    pthread_mutex_lock(&map->free_lock);
    uint64_t count = atomic_load_explicit(&map->free_count, memory_order_relaxed);
    uint64_t taken = count < want ? count : want;
    memcpy(batch->rows, &map->free_rows[count - taken], taken * sizeof(uint64_t));
    batch->count = (uint32_t)taken;
    atomic_store_explicit(&map->free_count, count - taken, memory_order_relaxed);
    pthread_mutex_unlock(&map->free_lock);
}

/* Under free_lock. */
static bool free_rows_make_room(em_hashmap *map, size_t count)
{
    if (count <= map->free_capacity)
        return true;
    size_t capacity = map->free_capacity == 0 ? FREE_ROWS_INITIAL : map->free_capacity;
    while (capacity < count)
        capacity *= 2;
    uint64_t *grown = realloc(map->free_rows, capacity * sizeof(*grown));
    if (grown == NULL)
        return false;
    map->free_rows = grown;
    map->free_capacity = capacity;
    return true;
}

/* Pushes the batch's rows onto the free stack in order (the last on top) and empties
 * it. Rows that find no room are not recycled: they stay below row_limit, so row
 * storage still covers them, at the cost of unused rows. */
static void free_rows_push(em_hashmap *map, row_batch *batch)
{
    if (batch->count == 0)
        return;
    pthread_mutex_lock(&map->free_lock);
    uint64_t count = atomic_load_explicit(&map->free_count, memory_order_relaxed);
    if (free_rows_make_room(map, count + batch->count)) {
        memcpy(&map->free_rows[count], batch->rows, batch->count * sizeof(uint64_t));
        atomic_store_explicit(&map->free_count, count + batch->count, memory_order_relaxed);
    }
    pthread_mutex_unlock(&map->free_lock);
    batch->count = 0;
}

/* A row for a new key: a released one if there is any, else the next never used;
 * keys_left bounds the released rows worth taking at once. */
static uint64_t take_row(em_hashmap *map, row_batch *batch, size_t keys_left)
{
    if (batch->count == 0)
        free_rows_pop(map, batch, keys_left < ROW_BATCH ? keys_left : ROW_BATCH);
    if (batch->count > 0)
        return batch->rows[--batch->count];
    return atomic_fetch_add_explicit(&map->next_row, 1, memory_order_relaxed);
}

/* Gives a row back through the batch. */
static void release_row(em_hashmap *map, row_batch *batch, uint64_t row)
{
    if (batch->count == ROW_BATCH)
        free_rows_push(map, batch);
    batch->rows[batch->count++] = row;
}

/* ---- side entries: the keys equal to the slot markers ---- */

static _Atomic uint64_t *side_value(em_hashmap *map, uint64_t key)
{
    return &map->side_values[key == EM_HASHMAP_EMPTY_KEY ? SIDE_EMPTY_KEY : SIDE_TOMBSTONE_KEY];
}

static uint64_t side_find(em_hashmap *map, uint64_t key)
{
    uint64_t value = wait_published(side_value(map, key));
    return value == SIDE_ABSENT ? EM_HASHMAP_NOT_FOUND : value;
}

static uint64_t side_find_or_insert(em_hashmap *map, uint64_t key, row_batch *rows,
                                    bool *inserted)
{
    _Atomic uint64_t *entry = side_value(map, key);
    for (;;) {
        uint64_t value = wait_published(entry);
        if (value != SIDE_ABSENT) {
            *inserted = false;
            return value;
        }
        if (atomic_compare_exchange_strong_explicit(entry, &value, VALUE_PENDING,
                                                    memory_order_relaxed,
                                                    memory_order_relaxed)) {
            uint64_t row = take_row(map, rows, 1);
            atomic_store_explicit(entry, row, memory_order_release);
            *inserted = true;
            return row;
        }
    }
}

static uint64_t side_erase(em_hashmap *map, uint64_t key)
{
    _Atomic uint64_t *entry = side_value(map, key);
    for (;;) {
        uint64_t value = wait_published(entry);
        if (value == SIDE_ABSENT)
            return EM_HASHMAP_NOT_FOUND;
        if (atomic_compare_exchange_strong_explicit(entry, &value, SIDE_ABSENT,
                                                    memory_order_relaxed,
                                                    memory_order_relaxed))
            return value;
    }
}

static bool side_present(em_hashmap *map, enum side_entry entry)
{
    return atomic_load_explicit(&map->side_values[entry], memory_order_relaxed) != SIDE_ABSENT;
}

/* ---- slots (shared hold) ---- */

static uint64_t slots_find(em_hashmap *map, uint64_t key)
{
    size_t position = home_slot(map, key, map->slot_count);
    for (;;) {
        slot *current = &map->slots[position];
        uint64_t seen = atomic_load_explicit(&current->key, memory_order_relaxed);
        if (seen == key)
            return wait_published(&current->value);
        if (seen == EM_HASHMAP_EMPTY_KEY)
            return EM_HASHMAP_NOT_FOUND;
        position = next_slot(position, map->slot_count);
    }
}

/* Used-slot reservations held by one find_or_insert call. The call takes them from
 * used_slots up to GRANT_SIZE at a time, so that threads inserting together do not
 * bounce that counter's cache line for every key, and returns what it did not use
 * before it drops its shared hold. */
typedef struct slot_grant {
    uint64_t held;
    row_batch rows; /* released rows taken for the call's new keys */
} slot_grant;

/* Takes one reservation, refilling the grant with up to keys_left. False: no room. */
static bool grant_take(em_hashmap *map, slot_grant *grant, size_t keys_left)
{
    if (grant->held > 0) {
        grant->held--;
        return true;
    }
    uint64_t want = keys_left < GRANT_SIZE ? keys_left : GRANT_SIZE;
    uint64_t before = atomic_fetch_add_explicit(&map->used_slots, want, memory_order_relaxed);
    uint64_t room = before < map->max_used ? map->max_used - before : 0;
    if (room < want)
        atomic_fetch_sub_explicit(&map->used_slots, want - room, memory_order_relaxed);
    uint64_t kept = room < want ? room : want;
    if (kept == 0)
        return false;
    grant->held = kept - 1;
    return true;
}

/* Gives back a reservation that was not used for a new key. */
static void grant_put_back(slot_grant *grant)
{
    grant->held++;
}

/* Gives back the reservations and the released rows the call did not use. */
static void grant_release(em_hashmap *map, slot_grant *grant)
{
    if (grant->held > 0)
        atomic_fetch_sub_explicit(&map->used_slots, grant->held, memory_order_relaxed);
    grant->held = 0;
    free_rows_push(map, &grant->rows);
}

typedef enum insert_outcome { INSERT_FOUND, INSERT_DONE, INSERT_NO_ROOM } insert_outcome;

typedef enum claim_outcome { CLAIM_WON, CLAIM_SAME_KEY, CLAIM_OTHER_KEY } claim_outcome;

/* Claims current for key if it is still EMPTY and stores a fresh row in *value; when
 * another thread claimed it first for the same key, *value gets that thread's row. */
static claim_outcome claim_slot(em_hashmap *map, slot *current, uint64_t key, uint64_t *value,
                                slot_grant *grant, size_t keys_left)
{
    uint64_t expected = EM_HASHMAP_EMPTY_KEY;
    if (atomic_compare_exchange_strong_explicit(&current->key, &expected, key,
                                                memory_order_relaxed, memory_order_relaxed)) {
        *value = take_row(map, &grant->rows, keys_left);
        atomic_store_explicit(&current->value, *value, memory_order_release);
        return CLAIM_WON;
    }
    if (expected != key)
        return CLAIM_OTHER_KEY;
    *value = wait_published(&current->value);
    return CLAIM_SAME_KEY;
}

/* The reservation is taken at the first EMPTY slot met and kept while probing on past
 * slots other keys claimed first; it goes back if the key turns out present. */
static insert_outcome slots_find_or_insert(em_hashmap *map, uint64_t key, uint64_t *value,
                                           slot_grant *grant, size_t keys_left)
{
    size_t position = home_slot(map, key, map->slot_count);
    bool reserved = false;
    for (;; position = next_slot(position, map->slot_count)) {
        slot *current = &map->slots[position];
        uint64_t seen = atomic_load_explicit(&current->key, memory_order_relaxed);
        if (seen == key) {
            if (reserved)
                grant_put_back(grant);
            *value = wait_published(&current->value);
            return INSERT_FOUND;
        }
        if (seen != EM_HASHMAP_EMPTY_KEY)
            continue;
        if (!reserved && !grant_take(map, grant, keys_left))
            return INSERT_NO_ROOM;
        reserved = true;
        claim_outcome claim = claim_slot(map, current, key, value, grant, keys_left);
        if (claim == CLAIM_WON)
            return INSERT_DONE;
        if (claim == CLAIM_SAME_KEY) {
            grant_put_back(grant);
            return INSERT_FOUND;
        }
    }
}

static uint64_t slots_erase(em_hashmap *map, uint64_t key)
{
    size_t position = home_slot(map, key, map->slot_count);
    for (;;) {
        slot *current = &map->slots[position];
        uint64_t seen = atomic_load_explicit(&current->key, memory_order_relaxed);
        if (seen == EM_HASHMAP_EMPTY_KEY)
            return EM_HASHMAP_NOT_FOUND;
        if (seen == key) {
            uint64_t row = wait_published(&current->value);
            if (atomic_compare_exchange_strong_explicit(&current->key, &seen,
                                                        EM_HASHMAP_TOMBSTONE_KEY,
                                                        memory_order_relaxed,
                                                        memory_order_relaxed)) {
                atomic_fetch_add_explicit(&map->tombstones, 1, memory_order_relaxed);
                return row;
            }
            continue; /* another erase won: the slot is a tombstone now */
        }
        position = next_slot(position, map->slot_count);
    }
}

/* Slots from position from on to position to, wrapping (both below slot_count: no
 * division, as the walk of an erase asks it of every key it meets). */
static size_t slots_from(size_t from, size_t to, size_t slot_count)
{
    return to >= from ? to - from : to + slot_count - from;
}

/* Whether the key at position at, whose home slot is home, may move back to hole: the
 * hole lies on its probe sequence between its home and itself. */
static bool may_move_back(size_t home, size_t hole, size_t at, size_t slot_count)
{
    return slots_from(home, hole, slot_count) < slots_from(home, at, slot_count);
}

/* Where key's slot is, or SIZE_MAX. */
static size_t slots_position(const em_hashmap *map, uint64_t key)
{
    size_t count = map->slot_count;
    for (size_t at = home_slot(map, key, count);; at = next_slot(at, count)) {
        uint64_t seen = atomic_load_explicit(&map->slots[at].key, memory_order_relaxed);
        if (seen == key)
            return at;
        if (seen == EM_HASHMAP_EMPTY_KEY)
            return SIZE_MAX;
    }
}

/* Backward-shift erase; the caller holds the map alone, so no value is pending. */
static uint64_t slots_erase_exclusive(em_hashmap *map, uint64_t key, size_t *walked)
{
    size_t count = map->slot_count;
    size_t hole = slots_position(map, key);
    if (hole == SIZE_MAX)
        return EM_HASHMAP_NOT_FOUND;
    uint64_t row = atomic_load_explicit(&map->slots[hole].value, memory_order_relaxed);
    for (size_t at = next_slot(hole, count);; at = next_slot(at, count)) {
        uint64_t moving = atomic_load_explicit(&map->slots[at].key, memory_order_relaxed);
        (*walked)++;
        if (moving == EM_HASHMAP_EMPTY_KEY)
            break;
        if (moving == EM_HASHMAP_TOMBSTONE_KEY ||
            !may_move_back(home_slot(map, moving, count), hole, at, count))
            continue;
        uint64_t value = atomic_load_explicit(&map->slots[at].value, memory_order_relaxed);
        atomic_store_explicit(&map->slots[hole].key, moving, memory_order_relaxed);
        atomic_store_explicit(&map->slots[hole].value, value, memory_order_relaxed);
        hole = at;
    }
    atomic_store_explicit(&map->slots[hole].key, EM_HASHMAP_EMPTY_KEY, memory_order_relaxed);
    atomic_store_explicit(&map->slots[hole].value, VALUE_PENDING, memory_order_relaxed);
    atomic_fetch_sub_explicit(&map->used_slots, 1, memory_order_relaxed);
    return row;
}

/* ---- one key ---- */

static void prefetch_home(const em_hashmap *map, const uint64_t *keys, size_t i, size_t n,
                          int for_write)
{
    if (i + PREFETCH_DISTANCE >= n)
        return;
    size_t position = home_slot(map, keys[i + PREFETCH_DISTANCE], map->slot_count);
    const slot *home = &map->slots[position];
    if (for_write)
        __builtin_prefetch(home, 1);
    else
        __builtin_prefetch(home, 0);
}

static uint64_t find_one(em_hashmap *map, uint64_t key)
{
    return is_sentinel(key) ? side_find(map, key) : slots_find(map, key);
}

static insert_outcome find_or_insert_one(em_hashmap *map, uint64_t key, uint64_t *value,
                                         slot_grant *grant, size_t keys_left)
{
    if (!is_sentinel(key))
        return slots_find_or_insert(map, key, value, grant, keys_left);
    bool inserted = false;
    *value = side_find_or_insert(map, key, &grant->rows, &inserted);
    return inserted ? INSERT_DONE : INSERT_FOUND;
}

static uint64_t erase_one(em_hashmap *map, uint64_t key)
{
    return is_sentinel(key) ? side_erase(map, key) : slots_erase(map, key);
}

/* ---- create and destroy ---- */

static em_status validate_options(const em_hashmap_options *options, em_error *err)
{
    if (options == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT, "hash map options: NULL");
    if (options->initial_slots < 1)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "hash map option initial_slots is %zu, must be at least 1",
                            options->initial_slots);
    if (options->initial_slots > SIZE_MAX - SLOT_GRANULE)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "hash map option initial_slots is %zu, too large",
                            options->initial_slots);
    double load = options->max_load_factor;
    if (load != 0.0 && !(load > 0.0 && load <= 0.95))
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "hash map option max_load_factor is %g, must be in (0, 0.95] "
                            "(0 for the default %g)",
                            load, EM_HASHMAP_DEFAULT_MAX_LOAD);
    return EM_OK;
}

static size_t initial_slot_count(size_t requested)
{
    size_t rounded = (requested + SLOT_GRANULE - 1) / SLOT_GRANULE * SLOT_GRANULE;
    return rounded < SLOT_GRANULE ? SLOT_GRANULE : rounded;
}

static em_status init_locks(em_hashmap *map, em_error *err)
{
    pthread_rwlockattr_t attributes;
    pthread_rwlockattr_init(&attributes);
#ifdef __GLIBC__
    pthread_rwlockattr_setkind_np(&attributes, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
    int failed = pthread_rwlock_init(&map->lock, &attributes);
    pthread_rwlockattr_destroy(&attributes);
    if (failed != 0)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "hash map lock: error %d", failed);
    failed = pthread_mutex_init(&map->free_lock, NULL);
    if (failed != 0) {
        pthread_rwlock_destroy(&map->lock);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "hash map free-row lock: error %d",
                            failed);
    }
    return EM_OK;
}

static void init_fields(em_hashmap *map, const em_hashmap_options *options)
{
    map->slots = NULL;
    map->slot_count = initial_slot_count(options->initial_slots);
    map->max_load_factor =
        options->max_load_factor == 0.0 ? EM_HASHMAP_DEFAULT_MAX_LOAD : options->max_load_factor;
    map->max_used = max_used_for(map->slot_count, map->max_load_factor);
    map->grow_count = 0;
    atomic_init(&map->sweeps, 0);
    map->allocator = options->allocator;
    atomic_init(&map->used_slots, 0);
    atomic_init(&map->next_row, 0);
    atomic_init(&map->tombstones, 0);
    for (int i = 0; i < SIDE_COUNT; i++)
        atomic_init(&map->side_values[i], SIDE_ABSENT);
    atomic_init(&map->free_count, 0);
    map->free_rows = NULL;
    map->free_capacity = 0;
}

em_status em_hashmap_create(const em_hashmap_options *options, em_hashmap **out, em_error *err)
{
    em_status status = validate_options(options, err);
    if (status != EM_OK)
        return status;
    em_hashmap *map = aligned_alloc(alignof(em_hashmap), sizeof(em_hashmap));
    if (map == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "hash map header (%zu bytes)",
                            sizeof(em_hashmap));
    init_fields(map, options);
    map->seed = options->seed != 0 ? options->seed : EM_HASHMAP_SEED;
    status = slot_array_create(map, map->slot_count, &map->slots, err);
    if (status != EM_OK) {
        em_error_prefix(err, "creating hash map with %zu slots: ", map->slot_count);
        free(map);
        return status;
    }
    status = init_locks(map, err);
    if (status != EM_OK) {
        em_allocator_free(&map->allocator, map->slots);
        free(map);
        return status;
    }
    *out = map;
    return EM_OK;
}

void em_hashmap_destroy(em_hashmap *map)
{
    if (map == NULL)
        return;
    pthread_mutex_destroy(&map->free_lock);
    pthread_rwlock_destroy(&map->lock);
    em_allocator_free(&map->allocator, map->slots);
    free(map->free_rows);
    free(map);
}

/* ---- batch calls ---- */

size_t em_hashmap_find(em_hashmap *map, const uint64_t *keys, size_t n, uint64_t *values)
{
    size_t missing = 0;
    pthread_rwlock_rdlock(&map->lock);
    for (size_t i = 0; i < n; i++) {
        prefetch_home(map, keys, i, n, 0);
        values[i] = find_one(map, keys[i]);
        missing += values[i] == EM_HASHMAP_NOT_FOUND;
    }
    pthread_rwlock_unlock(&map->lock);
    return missing;
}

/* Marks keys[from..n) as not handled after a failed growth. */
static void mark_not_handled(uint64_t *values, uint8_t *inserted, size_t from, size_t n)
{
    for (size_t i = from; i < n; i++) {
        values[i] = EM_HASHMAP_NOT_FOUND;
        if (inserted != NULL)
            inserted[i] = 0;
    }
}

em_status em_hashmap_find_or_insert(em_hashmap *map, const uint64_t *keys, size_t n,
                                    uint64_t *values, uint8_t *inserted, size_t *inserted_count,
                                    em_error *err)
{
    em_status status = EM_OK;
    size_t count = 0;
    slot_grant grant = {.held = 0, .rows.count = 0};
    pthread_rwlock_rdlock(&map->lock);
    for (size_t i = 0; i < n;) {
        prefetch_home(map, keys, i, n, 1);
        insert_outcome outcome = find_or_insert_one(map, keys[i], &values[i], &grant, n - i);
        if (outcome == INSERT_NO_ROOM) {
            grant_release(map, &grant);
            pthread_rwlock_unlock(&map->lock);
            status = grow(map, 1, err);
            pthread_rwlock_rdlock(&map->lock);
            if (status != EM_OK) {
                mark_not_handled(values, inserted, i, n);
                break;
            }
            continue;
        }
        count += outcome == INSERT_DONE;
        if (inserted != NULL)
            inserted[i] = outcome == INSERT_DONE;
        i++;
    }
    grant_release(map, &grant);
    pthread_rwlock_unlock(&map->lock);
    if (inserted_count != NULL)
        *inserted_count = count;
    return status;
}

em_status em_hashmap_reserve(em_hashmap *map, size_t additional_keys, em_error *err)
{
    if (additional_keys == 0)
        return EM_OK;
    return grow(map, additional_keys, err);
}

/* An exclusive erase goes on by sweeps (erase_by_sweeps) once its backward shifts have
 * walked more than this many slots a key, over SWEEP_AFTER_KEYS keys at least: where
 * runs are short, a shift per key costs less than a sweep's bitmap of the map. */
#define SWEEP_WALK_PER_KEY ((size_t)32)
#define SWEEP_AFTER_KEYS ((size_t)32)

/* The first marked bit in [from, to), or SIZE_MAX. */
static size_t first_marked(const uint64_t *bits, size_t from, size_t to)
{
    for (size_t at = from; at < to;) {
        uint64_t word = bits[at / 64] >> (at % 64);
        if (word != 0) {
            size_t found = at + (size_t)__builtin_ctzll(word);
            return found < to ? found : SIZE_MAX;
        }
        at = (at / 64 + 1) * 64;
    }
    return SIZE_MAX;
}

/* A sweep's view of the map: positions count from just after an empty slot, so that no
 * run of occupied slots wraps around the end of the array; holes marks positions (bits). */
typedef struct sweep {
    em_hashmap *map;
    size_t count, empty;
    uint64_t *holes;
} sweep;

static slot *sweep_slot(const sweep *w, size_t position)
{
    return &w->map->slots[(w->empty + 1 + position) % w->count];
}

static size_t sweep_position(const sweep *w, size_t slot_index)
{
    return (slot_index + w->count - w->empty - 1) % w->count;
}

static bool sweep_marked(const sweep *w, size_t position)
{
    return (w->holes[position / 64] & UINT64_C(1) << position % 64) != 0;
}

static void sweep_mark(sweep *w, size_t position, bool hole)
{
    if (hole)
        w->holes[position / 64] |= UINT64_C(1) << position % 64;
    else
        w->holes[position / 64] &= ~(UINT64_C(1) << position % 64);
}

/* Marks the slots of keys as holes to be; the rows go to released and values as
 * em_hashmap_erase's (a key given twice is erased once). */
static void sweep_mark_keys(sweep *w, const uint64_t *keys, size_t n, uint64_t *values,
                            row_batch *released, size_t *removed)
{
    em_hashmap *map = w->map;
    for (size_t i = 0; i < n; i++) {
        prefetch_home(map, keys, i, n, 0);
        uint64_t row = EM_HASHMAP_NOT_FOUND;
        size_t at = is_sentinel(keys[i]) ? SIZE_MAX : slots_position(map, keys[i]);
        if (is_sentinel(keys[i])) {
            row = side_erase(map, keys[i]);
        } else if (at != SIZE_MAX && !sweep_marked(w, sweep_position(w, at))) {
            sweep_mark(w, sweep_position(w, at), true);
            row = atomic_load_explicit(&map->slots[at].value, memory_order_relaxed);
        }
        if (row != EM_HASHMAP_NOT_FOUND) {
            release_row(map, released, row);
            (*removed)++;
        }
        if (values != NULL)
            values[i] = row;
    }
}

/* Sweeps the run from its first hole, start: an erased key leaves a hole; a key that
 * stays moves to the first hole at or after its home slot (on its probe sequence, no
 * empty slot between), its old slot becoming a hole; the holes left at the run's end
 * become empty slots. Returns the run's end (its empty slot); *erased counts them. */
static size_t sweep_run(sweep *w, size_t start, size_t *erased)
{
    size_t at = start;
    for (;; at++) { /* the empty slot ends the run at the latest */
        slot *current = sweep_slot(w, at);
        uint64_t key = atomic_load_explicit(&current->key, memory_order_relaxed);
        if (key == EM_HASHMAP_EMPTY_KEY)
            break;
        if (sweep_marked(w, at) || key == EM_HASHMAP_TOMBSTONE_KEY)
            continue; /* to erase, or stays where it is */
        size_t home = sweep_position(w, home_slot(w->map, key, w->count));
        size_t hole = first_marked(w->holes, home, at);
        if (hole == SIZE_MAX)
            continue;
        slot *to = sweep_slot(w, hole);
        atomic_store_explicit(&to->key, key, memory_order_relaxed);
        atomic_store_explicit(&to->value,
                              atomic_load_explicit(&current->value, memory_order_relaxed),
                              memory_order_relaxed);
        sweep_mark(w, hole, false);
        sweep_mark(w, at, true);
    }
    for (size_t hole = first_marked(w->holes, start, at); hole != SIZE_MAX;
         hole = first_marked(w->holes, hole + 1, at)) {
        slot *emptied = sweep_slot(w, hole);
        atomic_store_explicit(&emptied->key, EM_HASHMAP_EMPTY_KEY, memory_order_relaxed);
        atomic_store_explicit(&emptied->value, VALUE_PENDING, memory_order_relaxed);
        sweep_mark(w, hole, false);
        (*erased)++;
    }
    return at;
}

/* The exclusive erase of many keys, one sweep per run of occupied slots that holds some
 * of them (sweep_run), instead of a backward shift per key: a shift walks to the end of
 * its key's run, so erasing m keys of a run of length L that way costs about m x L, and
 * a run only grows where evictions empty a stretch of the map and inserts pile up
 * elsewhere (choosing among few candidates a row: tests/bench/RESULTS.md). Every key
 * then still lies on its probe sequence with no empty slot before it, as a shift per
 * key would leave it (maybe in another order). The rows go to released and values as
 * em_hashmap_erase's. False, with nothing done, when the bitmap of holes cannot be had. */
static bool erase_by_sweeps(em_hashmap *map, const uint64_t *keys, size_t n, uint64_t *values,
                            row_batch *released, size_t *removed)
{
    sweep w = {.map = map, .count = map->slot_count};
    w.holes = calloc((w.count + 63) / 64, sizeof(uint64_t));
    if (w.holes == NULL)
        return false;
    while (atomic_load_explicit(&map->slots[w.empty].key, memory_order_relaxed) !=
           EM_HASHMAP_EMPTY_KEY)
        w.empty++; /* there is one: the load stays below 1 */
    sweep_mark_keys(&w, keys, n, values, released, removed);
    size_t erased = 0;
    for (size_t start = first_marked(w.holes, 0, w.count); start != SIZE_MAX;)
        start = first_marked(w.holes, sweep_run(&w, start, &erased), w.count);
    atomic_fetch_sub_explicit(&map->used_slots, erased, memory_order_relaxed);
    atomic_fetch_add_explicit(&map->sweeps, 1, memory_order_relaxed);
    free(w.holes);
    return true;
}

static size_t erase_batch(em_hashmap *map, const uint64_t *keys, size_t n, uint64_t *values,
                          bool exclusive)
{
    size_t removed = 0;
    row_batch released = {.count = 0};
    pthread_rwlock_rdlock(&map->lock);
    size_t walked = 0;
    for (size_t i = 0; i < n; i++) {
        if (exclusive && i >= SWEEP_AFTER_KEYS && walked > SWEEP_WALK_PER_KEY * i &&
            erase_by_sweeps(map, keys + i, n - i, values != NULL ? values + i : NULL, &released,
                            &removed))
            break; /* the rest went by sweeps */
        prefetch_home(map, keys, i, n, 1);
        uint64_t row = exclusive && !is_sentinel(keys[i])
                           ? slots_erase_exclusive(map, keys[i], &walked)
                           : erase_one(map, keys[i]);
        if (row != EM_HASHMAP_NOT_FOUND) {
            release_row(map, &released, row);
            removed++;
        }
        if (values != NULL)
            values[i] = row;
    }
    free_rows_push(map, &released);
    pthread_rwlock_unlock(&map->lock);
    return removed;
}

size_t em_hashmap_erase(em_hashmap *map, const uint64_t *keys, size_t n, uint64_t *values)
{
    return erase_batch(map, keys, n, values, false);
}

size_t em_hashmap_erase_exclusive(em_hashmap *map, const uint64_t *keys, size_t n,
                                  uint64_t *values)
{
    return erase_batch(map, keys, n, values, true);
}

/* ---- export: cursor positions are the side entries, then the slots ---- */

static bool export_position(em_hashmap *map, uint64_t position, uint64_t *key,
                            uint64_t *value)
{
    if (position < SIDE_COUNT) {
        *key = position == SIDE_EMPTY_KEY ? EM_HASHMAP_EMPTY_KEY : EM_HASHMAP_TOMBSTONE_KEY;
        *value = wait_published(&map->side_values[position]);
        return *value != SIDE_ABSENT;
    }
    slot *current = &map->slots[position - SIDE_COUNT];
    *key = atomic_load_explicit(&current->key, memory_order_relaxed);
    if (is_sentinel(*key))
        return false;
    *value = wait_published(&current->value);
    return true;
}

/* Copies the keys and values of the n slots from first that hold a key, packed, and
 * returns how many. Without a branch on the key: about half the slots of a map are
 * empty, at random, and their value reads as pending too. A key whose value is still
 * pending is only noted, and the slots are then copied again, waiting for it. keys and
 * values have room for n. */
static size_t copy_slots(slot *first, uint64_t n, uint64_t *keys, uint64_t *values)
{
    size_t copied = 0;
    uint64_t pending = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t key = atomic_load_explicit(&first[i].key, memory_order_relaxed);
        uint64_t value = atomic_load_explicit(&first[i].value, memory_order_acquire);
        uint64_t live = !is_sentinel(key);
        keys[copied] = key;
        values[copied] = value;
        copied += live;
        pending |= live & (value == VALUE_PENDING);
    }
    if (pending == 0)
        return copied;
    copied = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t key = atomic_load_explicit(&first[i].key, memory_order_relaxed);
        if (is_sentinel(key))
            continue;
        keys[copied] = key;
        values[copied++] = wait_published(&first[i].value);
    }
    return copied;
}

void em_hashmap_walk_begin(em_hashmap *map, uint64_t random, em_hashmap_walk *walk)
{
    pthread_rwlock_rdlock(&map->lock);
    uint64_t positions = SIDE_COUNT + (uint64_t)map->slot_count;
    walk->position = random % positions;
    walk->left = positions;
    pthread_rwlock_unlock(&map->lock);
}

size_t em_hashmap_walk_next(em_hashmap *map, em_hashmap_walk *walk, uint64_t *keys,
                            uint64_t *values, size_t max)
{
    size_t copied = 0;
    pthread_rwlock_rdlock(&map->lock);
    uint64_t positions = SIDE_COUNT + (uint64_t)map->slot_count;
    while (walk->left > 0 && copied < max) {
        if (walk->position == positions)
            walk->position = 0;
        if (walk->position < SIDE_COUNT) {
            copied += export_position(map, walk->position, &keys[copied], &values[copied]);
            walk->position++;
            walk->left--;
            continue;
        }
        uint64_t stretch = positions - walk->position;
        if (stretch > walk->left)
            stretch = walk->left;
        if (stretch > max - copied)
            stretch = max - copied;
        copied += copy_slots(&map->slots[walk->position - SIDE_COUNT], stretch, &keys[copied],
                             &values[copied]);
        walk->position += stretch;
        walk->left -= stretch;
    }
    pthread_rwlock_unlock(&map->lock);
    return copied;
}

size_t em_hashmap_export(em_hashmap *map, uint64_t *cursor, uint64_t *keys, uint64_t *values,
                         size_t max)
{
    size_t copied = 0;
    pthread_rwlock_rdlock(&map->lock);
    uint64_t end = SIDE_COUNT + (uint64_t)map->slot_count;
    uint64_t position = *cursor;
    for (; position < SIDE_COUNT && position < end && copied < max; position++)
        copied += export_position(map, position, &keys[copied], &values[copied]);
    while (position < end && copied < max) {
        uint64_t stretch = end - position < max - copied ? end - position : max - copied;
        copied += copy_slots(&map->slots[position - SIDE_COUNT], stretch, &keys[copied],
                             &values[copied]);
        position += stretch;
    }
    *cursor = position;
    pthread_rwlock_unlock(&map->lock);
    return copied;
}

/* ---- size and statistics ---- */

/* Keys in slots; shared hold. Reservations in flight may count for a moment. */
static uint64_t keys_in_slots(em_hashmap *map)
{
    uint64_t used = atomic_load_explicit(&map->used_slots, memory_order_relaxed);
    uint64_t tombstones = atomic_load_explicit(&map->tombstones, memory_order_relaxed);
    return used > tombstones ? used - tombstones : 0;
}

static uint64_t size_locked(em_hashmap *map)
{
    return keys_in_slots(map) + side_present(map, SIDE_EMPTY_KEY) +
           side_present(map, SIDE_TOMBSTONE_KEY);
}

size_t em_hashmap_size(em_hashmap *map)
{
    pthread_rwlock_rdlock(&map->lock);
    uint64_t size = size_locked(map);
    pthread_rwlock_unlock(&map->lock);
    return size;
}

uint64_t em_hashmap_row_limit(em_hashmap *map)
{
    return atomic_load_explicit(&map->next_row, memory_order_relaxed);
}

void em_hashmap_get_stats(em_hashmap *map, em_hashmap_stats *out)
{
    pthread_rwlock_rdlock(&map->lock);
    uint64_t tombstones = atomic_load_explicit(&map->tombstones, memory_order_relaxed);
    out->size = size_locked(map);
    out->slots = map->slot_count;
    out->tombstones = tombstones;
    out->bytes = (uint64_t)map->slot_count * sizeof(slot);
    out->row_limit = em_hashmap_row_limit(map);
    out->free_rows = atomic_load_explicit(&map->free_count, memory_order_relaxed);
    out->grow_count = map->grow_count;
    out->sweeps = atomic_load_explicit(&map->sweeps, memory_order_relaxed);
    out->load_factor = (double)(keys_in_slots(map) + tombstones) / (double)map->slot_count;
    pthread_rwlock_unlock(&map->lock);
}
