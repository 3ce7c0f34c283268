/*
 * DESIGN: choosing the rows a shard evicts (the rule in lib/table/table_config.h), the
 * same for every backend: em_evict_choose reads the backend's walk of its hash map (from
 * the spec's pseudo-random position) block by block, with each entry's access metadata,
 * keeps the best entries by the policy, and stops the walk once it has gone far enough.
 *
 * The pool holds the best count rows offered so far and up to three times as many more
 * (a block at least) before it is cut back to count by a quickselect: cuts cost about
 * their size, so their total stays a small multiple of the entries walked. After a
 * cut, an entry that does not go before the worst of the count kept (the bar) cannot
 * be among the final count and is not pooled at all.
 */
#include "lib/device/eviction.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/keyhash.h"
#include "lib/device/device.h"

/* A row that may leave, with what the policy orders it by: the smaller rank goes
 * first, then the smaller key (keys are distinct, so the order is total: the rows
 * chosen from a window do not depend on the order the walk gave them in, and the GPU's
 * choice, kernels/ember_kernels.h em_gpu_choice, is the same). */
typedef struct em_evict_candidate {
    unsigned __int128 rank;
    uint64_t row;
    uint64_t key;
} em_evict_candidate;

/* The choice in progress: the best rows of the walk so far. */
typedef struct em_evict_chooser {
    em_evict_spec spec;
    uint64_t window; /* entries to read at least: count x candidates */
    uint64_t seen, have, room;
    uint64_t *kept_slots; /* the spec's kept rows, as a set */
    uint64_t kept_mask;
    em_evict_candidate *pool;
    em_evict_candidate bar; /* what an entry has to go before to be pooled */
} em_evict_chooser;

/* ---- the request's own rows ------------------------------------------------------------ */

/* Open addressing over a power-of-two array at most half full; rows are never
 * EM_ROW_NONE. */
static em_status row_set_make(em_evict_chooser *c, const uint64_t *rows, uint64_t n,
                              em_error *err)
{
    uint64_t slots = 16;
    while (slots < 2 * n + 2)
        slots <<= 1;
    c->kept_slots = malloc(slots * sizeof(uint64_t));
    c->kept_mask = slots - 1;
    if (c->kept_slots == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    memset(c->kept_slots, 0xff, slots * sizeof(uint64_t));
    for (uint64_t i = 0; i < n; i++) {
        uint64_t slot = em_mix64(rows[i]) & c->kept_mask;
        while (c->kept_slots[slot] != EM_ROW_NONE && c->kept_slots[slot] != rows[i])
            slot = (slot + 1) & c->kept_mask;
        c->kept_slots[slot] = rows[i];
    }
    return EM_OK;
}

static bool row_kept(const em_evict_chooser *c, uint64_t row)
{
    for (uint64_t slot = em_mix64(row) & c->kept_mask;; slot = (slot + 1) & c->kept_mask) {
        if (c->kept_slots[slot] == row)
            return true;
        if (c->kept_slots[slot] == EM_ROW_NONE)
            return false;
    }
}

/* ---- ranks ------------------------------------------------------------------------------- */

/* lru: the oldest last access; lfu: the fewest accesses, then the oldest last access;
 * age: the most pushes since the last push or creation, then the oldest last access. */
static em_evict_candidate candidate_of(const em_evict_spec *spec, const em_row_access *access,
                                       uint64_t key, uint64_t row)
{
    uint64_t first = 0;
    if (spec->policy == EM_EVICTION_LFU)
        first = access->frequency;
    else if (spec->policy == EM_EVICTION_AGE)
        first = UINT32_MAX - (uint32_t)(spec->update_clock - access->updated);
    return (em_evict_candidate){
        .rank = (unsigned __int128)first << 64 | access->accessed,
        .row = row,
        .key = key,
    };
}

/* (evaluated whole, without a branch on its parts: the walk offers its entries in a
 * random order) */
static bool goes_first(const em_evict_candidate *a, const em_evict_candidate *b)
{
    return (a->rank < b->rank) | ((a->rank == b->rank) & (a->key < b->key));
}

/* What keep_first orders by: the rank, or (among equal ranks) the key. */
static unsigned __int128 order_of(const em_evict_candidate *c, bool by_key)
{
    return by_key ? c->key : c->rank;
}

/* Moves the entries of c[0..n) whose order (order_of) is below pivot, or at most pivot
 * with or_equal, to the front, and returns how many there are: one pass that swaps every
 * entry whatever it holds (the comparisons decide only how far the front has grown), so
 * that entries in a random order cost no mispredicted branch each. */
static uint64_t move_to_front(em_evict_candidate *c, uint64_t n, unsigned __int128 pivot,
                              bool by_key, bool or_equal)
{
    /* entries move as two 16-byte halves, loaded as they were stored: a load of bytes
     * written by several narrower stores just before waits for them to land */
    typedef uint64_t half __attribute__((vector_size(16)));
    _Static_assert(sizeof(em_evict_candidate) == 2 * sizeof(half), "an entry is two halves");
    uint64_t front = 0;
    for (uint64_t i = 0; i < n; i++) {
        half entry[2], other[2];
        memcpy(entry, &c[i], sizeof(entry));
        memcpy(other, &c[front], sizeof(other));
        unsigned __int128 order = order_of(&c[i], by_key);
        memcpy(&c[i], other, sizeof(other));
        memcpy(&c[front], entry, sizeof(entry));
        front += or_equal ? order <= pivot : order < pivot;
    }
    return front;
}

static unsigned __int128 median_of_three(unsigned __int128 a, unsigned __int128 b,
                                         unsigned __int128 c)
{
    if (a > b) {
        unsigned __int128 t = a;
        a = b;
        b = t;
    }
    return c <= a ? a : c >= b ? b : c;
}

/* Reorders c[0..n) so that its k first by the policy come first (goes_first): a
 * quickselect by rank (by_key false) with a median-of-three pivot and a three-way
 * partition in up to two passes (move_to_front: below the pivot, then equal to it),
 * since many rows share a rank (every row of one request has the same last access);
 * where the k-th lies among rows of one rank, the same by key over those (by_key true;
 * keys are distinct) picks the smaller keys of them. Ordering every tie by key would
 * cost about as much again; only the one run of equal ranks that the k-th falls in
 * needs it. */
static void keep_first(em_evict_candidate *c, uint64_t n, uint64_t k, bool by_key)
{
    uint64_t low = 0, high = n; /* the k-th lies in [low, high) */
    while (k > low && k < high && high - low > 1) {
        unsigned __int128 pivot = median_of_three(order_of(&c[low], by_key),
                                                  order_of(&c[low + (high - low) / 2], by_key),
                                                  order_of(&c[high - 1], by_key));
        /* [low, before) go first, [before, after) equal the pivot, [after, high) go after */
        uint64_t before = low + move_to_front(c + low, high - low, pivot, by_key, false);
        if (k <= before) {
            high = before;
            continue;
        }
        uint64_t after = before + move_to_front(c + before, high - before, pivot, by_key, true);
        if (k >= after) {
            low = after;
        } else { /* the k-th is among the equal ones: by key, the smaller of them */
            if (!by_key)
                keep_first(c + before, after - before, k - before, true);
            return;
        }
    }
}

/* ---- the chooser ------------------------------------------------------------------------- */

uint64_t em_evict_window(const em_evict_spec *spec)
{
    uint64_t per_row = spec->candidates > 0 ? spec->candidates : 1;
    return spec->count > UINT64_MAX / per_row ? UINT64_MAX : spec->count * per_row;
}

uint64_t em_evict_kept_rows(const uint64_t *rows, uint64_t n, uint64_t *kept)
{
    uint64_t count = 0;
    for (uint64_t i = 0; i < n; i++)
        if (em_row_stored(rows[i]))
            kept[count++] = rows[i];
    return count;
}

static void em_evict_chooser_end(em_evict_chooser *c);

static em_status em_evict_chooser_begin(em_evict_chooser *c, const em_evict_spec *spec, em_error *err)
{
    memset(c, 0, sizeof(*c));
    c->spec = *spec;
    c->window = em_evict_window(spec);
    c->room = spec->count + (spec->count > EM_EVICT_BLOCK / 3 ? 3 * spec->count : EM_EVICT_BLOCK);
    c->bar.rank = ~(unsigned __int128)0; /* above every rank (candidate_of): no bar yet */
    em_status status = row_set_make(c, spec->kept, spec->kept_count, err);
    if (status != EM_OK)
        return status;
    c->pool = malloc(c->room * sizeof(em_evict_candidate));
    if (c->pool == NULL) {
        em_evict_chooser_end(c);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    }
    return EM_OK;
}

static uint64_t em_evict_chooser_want(const em_evict_chooser *c)
{
    if (c->seen < c->window)
        return c->window - c->seen < EM_EVICT_BLOCK ? c->window - c->seen : EM_EVICT_BLOCK;
    return c->have < c->spec.count ? EM_EVICT_BLOCK : 0;
}

static void em_evict_chooser_offer(em_evict_chooser *c, const uint64_t *keys, const uint64_t *rows,
                            const em_row_access *access, uint64_t n)
{
    c->seen += n;
    if (c->have + n > c->room) { /* keep the best count so far, make room for the block */
        keep_first(c->pool, c->have, c->spec.count, false);
        c->have = c->spec.count;
        c->bar = c->pool[0];
        for (uint64_t i = 1; i < c->have; i++)
            if (goes_first(&c->bar, &c->pool[i]))
                c->bar = c->pool[i];
    }
    /* every entry is written past the pool's end, which then grows over those that go
     * before the bar (room holds the block) */
    if (c->spec.kept_count == 0) {
        for (uint64_t i = 0; i < n; i++) {
            c->pool[c->have] = candidate_of(&c->spec, &access[i], keys[i], rows[i]);
            c->have += goes_first(&c->pool[c->have], &c->bar);
        }
        return;
    }
    for (uint64_t i = 0; i < n; i++) {
        c->pool[c->have] = candidate_of(&c->spec, &access[i], keys[i], rows[i]);
        if (goes_first(&c->pool[c->have], &c->bar) && !row_kept(c, rows[i]))
            c->have++;
    }
}

static em_status em_evict_chooser_finish(em_evict_chooser *c, uint64_t *keys, uint64_t *rows,
                                  em_error *err)
{
    if (c->have < c->spec.count)
        return em_error_set(err, EM_INTERNAL,
                            "eviction found only %" PRIu64 " of %" PRIu64
                            " rows outside the request",
                            c->have, c->spec.count);
    keep_first(c->pool, c->have, c->spec.count, false);
    for (uint64_t v = 0; v < c->spec.count; v++) {
        keys[v] = c->pool[v].key;
        rows[v] = c->pool[v].row;
    }
    return EM_OK;
}

static void em_evict_chooser_end(em_evict_chooser *c)
{
    free(c->kept_slots);
    free(c->pool);
    c->kept_slots = NULL;
    c->pool = NULL;
}

em_status em_evict_choose(const em_evict_spec *spec, em_evict_walk walk, void *context,
                          uint64_t *keys, uint64_t *rows, em_error *err)
{
    em_evict_chooser chooser;
    em_status status = em_evict_chooser_begin(&chooser, spec, err);
    if (status != EM_OK)
        return status;
    uint64_t *walk_keys = malloc(EM_EVICT_BLOCK * sizeof(uint64_t));
    uint64_t *walk_rows = malloc(EM_EVICT_BLOCK * sizeof(uint64_t));
    em_row_access *walk_access = malloc(EM_EVICT_BLOCK * sizeof(em_row_access));
    if (walk_keys == NULL || walk_rows == NULL || walk_access == NULL)
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "eviction: out of host memory");
    for (uint64_t want; status == EM_OK && (want = em_evict_chooser_want(&chooser)) > 0;) {
        uint64_t got = 0;
        status = walk(context, want, walk_keys, walk_rows, walk_access, &got, err);
        if (status != EM_OK || got == 0)
            break; /* an error, or every entry seen */
        em_evict_chooser_offer(&chooser, walk_keys, walk_rows, walk_access, got);
    }
    if (status == EM_OK)
        status = em_evict_chooser_finish(&chooser, keys, rows, err);
    em_evict_chooser_end(&chooser);
    free(walk_keys);
    free(walk_rows);
    free(walk_access);
    return status;
}
