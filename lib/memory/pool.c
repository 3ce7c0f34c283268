/*
 * DESIGN: the pool allocator's data structures (the policy is described in pool.h).
 *
 * Chunks. Every region is tiled by chunks, each a run of EM_POOL_ALIGNMENT-multiple
 * bytes that is either free or one live allocation. A chunk is described by a record
 * in host memory (struct chunk) and never by a header inside the region: the managed
 * bytes may be GPU memory, and the pool must not read or write them. The records sit
 * in one growable array and refer to each other by 32-bit index, which keeps them
 * small and survives the array's realloc; released records go on a free list. Each
 * record keeps its address neighbours within the region (previous, next), so freeing
 * merges with free neighbours at once, and chunks never merge across regions because
 * the first and last chunk of a region have no neighbour on that side.
 *
 * Bins. Free chunks are filed by size class: bin i holds sizes in
 * [256 * 2^i, 256 * 2^(i+1)), the last bin everything above. A 64-bit bitmap marks the
 * non-empty bins, so the first bin that can hold a request is found with one
 * count-trailing-zeros instead of a scan. Inside a bin the chunks form a treap ordered
 * by (size, address): the request's own bin answers with a lower bound (the smallest
 * chunk that fits, lowest address among equal sizes), any higher bin with its minimum.
 * Every chunk of a higher bin is larger than every chunk of a lower one, so this is
 * exact best fit over the whole pool, in O(log n).
 *
 * Live chunks. free() receives only an address. Live chunks form one more treap,
 * ordered by address, so the lookup is O(log n) with no per-granule table (a 100 GB
 * pool would need 400 million entries) and no walk. A chunk is in exactly one tree at
 * a time (its bin's while free, the live tree while in use), so one pair of intrusive
 * links serves both.
 *
 * Why a treap: it is the shortest balanced search tree to write correctly (split and
 * merge, no rotation cases), and the expected depth is O(log n) whatever the order
 * of inserts, because each record draws a random heap priority from the pool's own
 * generator (deterministic, no global state).
 *
 * Statistics are counters updated on each operation; the largest free block is the
 * maximum of the highest non-empty bin, again found through the bitmap.
 */
#include "lib/memory/pool.h"

#include "lib/base/failpoint.h"

#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* log2(EM_POOL_ALIGNMENT): bin 0 starts at one granule. */
#define GRANULE_SHIFT 8
_Static_assert(EM_POOL_ALIGNMENT == ((size_t)1 << GRANULE_SHIFT),
               "GRANULE_SHIFT must match EM_POOL_ALIGNMENT");

/* Number of size-class bins. Bin BIN_COUNT - 1 starts at 2^(8 + 47) = 32 PiB, so every
 * bin below it is bounded and sizes up to 2^48 bytes (256 TiB, beyond any device)
 * land in a bounded bin. It must fit in the 64-bit non-empty-bins bitmap. */
#define BIN_COUNT 48
_Static_assert(BIN_COUNT <= 64, "the non-empty bins bitmap is a uint64_t");

/* A split leaves the remainder as a free chunk when it is at least this big. Every
 * remainder is a multiple of the granule, so the pool always splits: keeping an
 * unused tail inside a live chunk would hide it from every later request. */
#define MIN_SPLIT_REMAINDER EM_POOL_ALIGNMENT

/* Chunk records an allocation may need: one for a new region's chunk, one for the
 * remainder of a split. Reserved before anything changes, so an allocation that fails
 * for lack of host memory leaves the pool as it was. */
#define RECORDS_PER_ALLOCATION 2

/* First capacity of the chunk record array and of the region array; both double. */
#define INITIAL_RECORD_CAPACITY 64
#define INITIAL_REGION_CAPACITY 4

/* Index meaning "no chunk" in every link; record indices stay below it. */
#define NO_CHUNK UINT32_MAX

/* Seed of the treap priority generator (any non-zero value works). */
#define PRIORITY_SEED UINT64_C(0x9e3779b97f4a7c15)

typedef struct chunk {
    uintptr_t address;
    size_t size;      /* multiple of EM_POOL_ALIGNMENT */
    size_t requested; /* bytes the caller asked for; 0 while free */
    uint32_t region;
    uint32_t previous; /* neighbour at the lower address in the same region */
    uint32_t next;     /* neighbour at the higher address; free-list link when released */
    uint32_t left;     /* tree links: the bin's tree while free, the live tree in use */
    uint32_t right;
    uint32_t priority; /* treap heap order: a parent's priority >= its children's */
    bool in_use;
} chunk;

/* A treap of chunks, ordered by (size, address) or by address alone. */
typedef struct tree {
    uint32_t root;
    bool by_size;
} tree;

typedef struct chunk_key {
    size_t size; /* 0 in trees ordered by address alone */
    uintptr_t address;
} chunk_key;

typedef struct bin {
    tree chunks;
    uint64_t count;
} bin;

typedef struct region {
    uintptr_t base;
    size_t size;
    uint32_t first_chunk; /* the chunk at base; it never merges into another */
} region;

struct em_pool {
    pthread_mutex_t mutex;
    char *name;
    size_t growth_bytes; /* rounded up to the granule */
    size_t limit_bytes;
    em_pool_region_provider provider;

    chunk *records;
    uint32_t record_capacity;
    uint32_t records_used;    /* records ever handed out (high-water mark) */
    uint32_t released_head;   /* free list of released records, linked by next */
    uint32_t released_count;
    uint64_t priority_state;

    region *regions;
    uint32_t region_count;
    uint32_t region_capacity;

    bin bins[BIN_COUNT];
    uint64_t nonempty_bins; /* bit i set when bins[i] holds a chunk */
    tree live;

    uint64_t bytes_in_use;
    uint64_t peak_bytes_in_use;
    uint64_t bytes_reserved;
    uint64_t live_allocations;
    uint64_t total_allocations;
    uint64_t failed_allocations;
    uint64_t free_chunks;
};

/* ---- sizes and their text ------------------------------------------------ */

/* bytes rounded up to the granule, or 0 when that overflows size_t. */
static size_t round_up(size_t bytes)
{
    if (bytes > SIZE_MAX - (EM_POOL_ALIGNMENT - 1))
        return 0;
    return (bytes + EM_POOL_ALIGNMENT - 1) & ~(EM_POOL_ALIGNMENT - 1);
}

static size_t round_down(size_t bytes)
{
    return bytes & ~(EM_POOL_ALIGNMENT - 1);
}

typedef struct byte_text {
    char text[24];
} byte_text;

/* "512 B", "1.5 KiB", "63.0 MiB", ... */
static byte_text human_bytes(uint64_t bytes)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    byte_text out;
    if (bytes < 1024) {
        snprintf(out.text, sizeof(out.text), "%" PRIu64 " B", bytes);
        return out;
    }
    double value = (double)bytes;
    size_t unit = 0;
    while (value >= 1024.0 && unit + 1 < sizeof(units) / sizeof(units[0])) {
        value /= 1024.0;
        unit++;
    }
    snprintf(out.text, sizeof(out.text), "%.1f %s", value, units[unit]);
    return out;
}

/* ---- chunk records ------------------------------------------------------- */

static chunk *at(const em_pool *pool, uint32_t index)
{
    return &pool->records[index];
}

static bool is_free_chunk(const em_pool *pool, uint32_t index)
{
    return index != NO_CHUNK && !at(pool, index)->in_use;
}

/* xorshift64*: a cheap generator, good enough to balance treaps. */
static uint32_t next_priority(em_pool *pool)
{
    uint64_t x = pool->priority_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    pool->priority_state = x;
    return (uint32_t)((x * UINT64_C(0x2545f4914f6cdd1d)) >> 32);
}

/* Makes sure the next `needed` record_take calls succeed without reallocating. */
static bool records_reserve(em_pool *pool, uint32_t needed)
{
    uint32_t capacity = pool->record_capacity;
    while (capacity - pool->records_used + pool->released_count < needed) {
        if (capacity > UINT32_MAX / 2)
            return false;
        capacity = capacity == 0 ? INITIAL_RECORD_CAPACITY : capacity * 2;
    }
    if (capacity == pool->record_capacity)
        return true;
    chunk *grown = realloc(pool->records, (size_t)capacity * sizeof(chunk));
    if (grown == NULL)
        return false;
    pool->records = grown;
    pool->record_capacity = capacity;
    return true;
}

/* A fresh record with no links; records_reserve must have been called. */
static uint32_t record_take(em_pool *pool)
{
    uint32_t index;
    if (pool->released_count > 0) {
        index = pool->released_head;
        pool->released_head = at(pool, index)->next;
        pool->released_count--;
    } else {
        assert(pool->records_used < pool->record_capacity);
        index = pool->records_used++;
    }
    *at(pool, index) = (chunk){
        .previous = NO_CHUNK,
        .next = NO_CHUNK,
        .left = NO_CHUNK,
        .right = NO_CHUNK,
        .priority = next_priority(pool),
    };
    return index;
}

static void record_release(em_pool *pool, uint32_t index)
{
    at(pool, index)->next = pool->released_head;
    pool->released_head = index;
    pool->released_count++;
}

/* ---- treaps -------------------------------------------------------------- */

static chunk_key key_of(const em_pool *pool, const tree *t, uint32_t index)
{
    const chunk *c = at(pool, index);
    return (chunk_key){.size = t->by_size ? c->size : 0, .address = c->address};
}

static bool key_less(chunk_key a, chunk_key b)
{
    return a.size != b.size ? a.size < b.size : a.address < b.address;
}

/* Splits the subtree at node into the chunks ordered before key (*before) and the
 * others (*rest). */
static void tree_split(em_pool *pool, const tree *t, uint32_t node, chunk_key key,
                       uint32_t *before, uint32_t *rest)
{
    if (node == NO_CHUNK) {
        *before = NO_CHUNK;
        *rest = NO_CHUNK;
        return;
    }
    chunk *c = at(pool, node);
    if (key_less(key_of(pool, t, node), key)) {
        *before = node;
        tree_split(pool, t, c->right, key, &c->right, rest);
    } else {
        *rest = node;
        tree_split(pool, t, c->left, key, before, &c->left);
    }
}

/* Joins two subtrees where every key of low is ordered before every key of high. */
static uint32_t tree_merge(em_pool *pool, uint32_t low, uint32_t high)
{
    if (low == NO_CHUNK)
        return high;
    if (high == NO_CHUNK)
        return low;
    chunk *l = at(pool, low);
    chunk *h = at(pool, high);
    if (l->priority >= h->priority) {
        l->right = tree_merge(pool, l->right, high);
        return low;
    }
    h->left = tree_merge(pool, low, h->left);
    return high;
}

/* Address of the link (root or child field) that holds index's slot on its way down:
 * the first node with a lower priority than index's, or the empty link. */
static uint32_t *insertion_link(em_pool *pool, tree *t, uint32_t index)
{
    chunk_key key = key_of(pool, t, index);
    uint32_t priority = at(pool, index)->priority;
    uint32_t *link = &t->root;
    while (*link != NO_CHUNK && at(pool, *link)->priority >= priority) {
        chunk *c = at(pool, *link);
        link = key_less(key, key_of(pool, t, *link)) ? &c->left : &c->right;
    }
    return link;
}

static void tree_insert(em_pool *pool, tree *t, uint32_t index)
{
    uint32_t *link = insertion_link(pool, t, index);
    chunk *c = at(pool, index);
    tree_split(pool, t, *link, key_of(pool, t, index), &c->left, &c->right);
    *link = index;
}

/* index must be in t, with the key it was inserted under. */
static void tree_remove(em_pool *pool, tree *t, uint32_t index)
{
    chunk_key key = key_of(pool, t, index);
    uint32_t *link = &t->root;
    while (*link != index) {
        assert(*link != NO_CHUNK);
        chunk *c = at(pool, *link);
        link = key_less(key, key_of(pool, t, *link)) ? &c->left : &c->right;
    }
    chunk *c = at(pool, index);
    *link = tree_merge(pool, c->left, c->right);
    c->left = NO_CHUNK;
    c->right = NO_CHUNK;
}

/* The first chunk whose key is not ordered before key, or NO_CHUNK. */
static uint32_t tree_lower_bound(const em_pool *pool, const tree *t, chunk_key key)
{
    uint32_t found = NO_CHUNK;
    uint32_t node = t->root;
    while (node != NO_CHUNK) {
        if (key_less(key_of(pool, t, node), key)) {
            node = at(pool, node)->right;
        } else {
            found = node;
            node = at(pool, node)->left;
        }
    }
    return found;
}

static uint32_t tree_first(const em_pool *pool, const tree *t)
{
    uint32_t node = t->root;
    while (node != NO_CHUNK && at(pool, node)->left != NO_CHUNK)
        node = at(pool, node)->left;
    return node;
}

static uint32_t tree_last(const em_pool *pool, const tree *t)
{
    uint32_t node = t->root;
    while (node != NO_CHUNK && at(pool, node)->right != NO_CHUNK)
        node = at(pool, node)->right;
    return node;
}

/* ---- bins ---------------------------------------------------------------- */

static uint64_t bin_bit(unsigned index)
{
    return UINT64_C(1) << index;
}

static unsigned bin_of(size_t size)
{
    unsigned log2 = 63u - (unsigned)__builtin_clzll((unsigned long long)size);
    unsigned index = log2 - GRANULE_SHIFT;
    return index < BIN_COUNT ? index : BIN_COUNT - 1;
}

static void bin_insert(em_pool *pool, uint32_t index)
{
    unsigned b = bin_of(at(pool, index)->size);
    tree_insert(pool, &pool->bins[b].chunks, index);
    pool->bins[b].count++;
    pool->nonempty_bins |= bin_bit(b);
    pool->free_chunks++;
}

static void bin_remove(em_pool *pool, uint32_t index)
{
    unsigned b = bin_of(at(pool, index)->size);
    tree_remove(pool, &pool->bins[b].chunks, index);
    if (--pool->bins[b].count == 0)
        pool->nonempty_bins &= ~bin_bit(b);
    pool->free_chunks--;
}

/* The smallest free chunk of at least size bytes (lowest address among equals). */
static uint32_t find_best_fit(const em_pool *pool, size_t size)
{
    unsigned own = bin_of(size);
    if (pool->nonempty_bins & bin_bit(own)) {
        uint32_t found = tree_lower_bound(pool, &pool->bins[own].chunks,
                                          (chunk_key){.size = size, .address = 0});
        if (found != NO_CHUNK)
            return found;
    }
    uint64_t larger = pool->nonempty_bins & ~((bin_bit(own) << 1) - 1);
    if (larger == 0)
        return NO_CHUNK;
    return tree_first(pool, &pool->bins[__builtin_ctzll(larger)].chunks);
}

static uint64_t largest_free_block(const em_pool *pool)
{
    if (pool->nonempty_bins == 0)
        return 0;
    unsigned top = 63u - (unsigned)__builtin_clzll(pool->nonempty_bins);
    return at(pool, tree_last(pool, &pool->bins[top].chunks))->size;
}

/* ---- statistics ---------------------------------------------------------- */

static void stats_locked(const em_pool *pool, em_pool_stats *out)
{
    *out = (em_pool_stats){
        .bytes_in_use = pool->bytes_in_use,
        .peak_bytes_in_use = pool->peak_bytes_in_use,
        .bytes_reserved = pool->bytes_reserved,
        .bytes_limit = pool->limit_bytes,
        .bytes_free = pool->bytes_reserved - pool->bytes_in_use,
        .largest_free_block = largest_free_block(pool),
        .live_allocations = pool->live_allocations,
        .total_allocations = pool->total_allocations,
        .failed_allocations = pool->failed_allocations,
        .free_chunks = pool->free_chunks,
        .region_count = pool->region_count,
    };
    if (out->bytes_free > 0)
        out->fragmentation = 1.0 - (double)out->largest_free_block / (double)out->bytes_free;
}

int em_pool_format_stats(const em_pool_stats *stats, char *buffer, size_t capacity)
{
    return snprintf(buffer, capacity,
                    "in use %s of %s reserved (limit %s), peak %s, largest free block %s, "
                    "fragmentation %.2f, free chunks %" PRIu64 ", regions %" PRIu64
                    ", live allocations %" PRIu64 ", failed allocations %" PRIu64,
                    human_bytes(stats->bytes_in_use).text,
                    human_bytes(stats->bytes_reserved).text,
                    human_bytes(stats->bytes_limit).text,
                    human_bytes(stats->peak_bytes_in_use).text,
                    human_bytes(stats->largest_free_block).text, stats->fragmentation,
                    stats->free_chunks, stats->region_count, stats->live_allocations,
                    stats->failed_allocations);
}

void em_pool_get_stats(em_pool *pool, em_pool_stats *out)
{
    pthread_mutex_lock(&pool->mutex);
    stats_locked(pool, out);
    pthread_mutex_unlock(&pool->mutex);
}

const char *em_pool_name(const em_pool *pool)
{
    return pool->name;
}

/* ---- regions ------------------------------------------------------------- */

static bool regions_reserve_one(em_pool *pool)
{
    if (pool->region_count < pool->region_capacity)
        return true;
    if (pool->region_capacity >= UINT32_MAX / 2)
        return false;
    uint32_t capacity = pool->region_capacity == 0 ? INITIAL_REGION_CAPACITY
                                                   : pool->region_capacity * 2;
    region *grown = realloc(pool->regions, (size_t)capacity * sizeof(region));
    if (grown == NULL)
        return false;
    pool->regions = grown;
    pool->region_capacity = capacity;
    return true;
}

static em_status check_region_base(uintptr_t base, size_t bytes, em_error *err)
{
    if (base % EM_POOL_ALIGNMENT != 0)
        return em_error_set(err, EM_INTERNAL,
                            "the provider returned region base 0x%" PRIxPTR
                            ", not aligned to %zu bytes",
                            base, EM_POOL_ALIGNMENT);
    if (base == 0 || base > UINTPTR_MAX - bytes)
        return em_error_set(err, EM_INTERNAL,
                            "the provider returned region base 0x%" PRIxPTR
                            " for %zu bytes, which does not fit the address space",
                            base, bytes);
    return EM_OK;
}

/* Reserves a region of bytes (a granule multiple) and files it as one free chunk.
 * Messages do not name the pool: callers say what the region was for. */
static em_status add_region(em_pool *pool, size_t bytes, em_error *err)
{
    if (!regions_reserve_one(pool) || !records_reserve(pool, 1))
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "out of host memory for the bookkeeping of region %" PRIu32,
                            pool->region_count);
    uintptr_t base = 0;
    em_status status = pool->provider.reserve(pool->provider.context, bytes, &base, err);
    if (status != EM_OK)
        return em_error_prefix(err, "reserving a region of %zu bytes (%s): ", bytes,
                               human_bytes(bytes).text);
    status = check_region_base(base, bytes, err);
    if (status != EM_OK) {
        pool->provider.release(pool->provider.context, base, bytes);
        return status;
    }
    uint32_t index = record_take(pool);
    chunk *c = at(pool, index);
    c->address = base;
    c->size = bytes;
    c->region = pool->region_count;
    pool->regions[pool->region_count++] = (region){
        .base = base, .size = bytes, .first_chunk = index};
    pool->bytes_reserved += bytes;
    bin_insert(pool, index);
    return EM_OK;
}

/* Size of the region to reserve for a request of size bytes (a granule multiple), or
 * 0 when the growth policy forbids one. */
static size_t growth_region_size(const em_pool *pool, size_t size)
{
    size_t remaining = pool->limit_bytes - pool->bytes_reserved;
    if (pool->growth_bytes == 0 || size > remaining)
        return 0;
    size_t wanted = pool->growth_bytes > size ? pool->growth_bytes : size;
    return wanted <= remaining ? wanted : round_down(remaining);
}

/* ---- allocation ---------------------------------------------------------- */

/* Records a failed allocation and explains it with the pool's statistics; cause (may
 * be NULL) says what went wrong beyond "nothing fits". */
static em_status fail_allocation(em_pool *pool, em_status status, size_t bytes,
                                 const char *cause, em_error *err)
{
    pool->failed_allocations++;
    em_pool_stats stats;
    stats_locked(pool, &stats);
    char line[EM_ERROR_MESSAGE_MAX];
    em_pool_format_stats(&stats, line, sizeof(line));
    return em_error_set(err, status, "pool '%s': cannot allocate %zu bytes (%s): %s%s%s",
                        pool->name, bytes, human_bytes(bytes).text,
                        cause != NULL ? cause : "", cause != NULL ? "; " : "", line);
}

/* Cuts chunk index down to size bytes and files the remainder as a free chunk. */
static void split_off_remainder(em_pool *pool, uint32_t index, size_t size)
{
    size_t remainder = at(pool, index)->size - size;
    if (remainder < MIN_SPLIT_REMAINDER)
        return;
    uint32_t rest = record_take(pool);
    chunk *c = at(pool, index);
    chunk *r = at(pool, rest);
    r->address = c->address + size;
    r->size = remainder;
    r->region = c->region;
    r->previous = index;
    r->next = c->next;
    if (c->next != NO_CHUNK)
        at(pool, c->next)->previous = rest;
    c->next = rest;
    c->size = size;
    bin_insert(pool, rest);
}

static void hand_out(em_pool *pool, uint32_t index, size_t size, size_t requested)
{
    bin_remove(pool, index);
    split_off_remainder(pool, index, size);
    chunk *c = at(pool, index);
    c->in_use = true;
    c->requested = requested;
    tree_insert(pool, &pool->live, index);
    pool->bytes_in_use += c->size;
    if (pool->bytes_in_use > pool->peak_bytes_in_use)
        pool->peak_bytes_in_use = pool->bytes_in_use;
    pool->live_allocations++;
    pool->total_allocations++;
}

/* Adds a region big enough for size bytes and returns its free chunk in *found. */
static em_status grow_for(em_pool *pool, size_t size, size_t bytes, uint32_t *found,
                          em_error *err)
{
    size_t region_bytes = growth_region_size(pool, size);
    if (region_bytes == 0)
        return fail_allocation(pool, EM_RESOURCE_EXHAUSTED, bytes,
                               pool->growth_bytes == 0 ? "growth is disabled" : NULL, err);
    em_error cause;
    em_status status = add_region(pool, region_bytes, &cause);
    if (status != EM_OK)
        return fail_allocation(pool, status, bytes, cause.message, err);
    *found = pool->regions[pool->region_count - 1].first_chunk;
    return EM_OK;
}

static em_status allocate_locked(em_pool *pool, size_t bytes, uintptr_t *address, em_error *err)
{
    if (bytes == 0) {
        pool->failed_allocations++;
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "pool '%s': cannot allocate 0 bytes", pool->name);
    }
    size_t size = round_up(bytes);
    if (size == 0)
        return fail_allocation(pool, EM_RESOURCE_EXHAUSTED, bytes,
                               "the size overflows when rounded", err);
    if (!records_reserve(pool, RECORDS_PER_ALLOCATION))
        return fail_allocation(pool, EM_RESOURCE_EXHAUSTED, bytes,
                               "out of host memory for chunk records", err);
    uint32_t found = find_best_fit(pool, size);
    if (found == NO_CHUNK) {
        em_status status = grow_for(pool, size, bytes, &found, err);
        if (status != EM_OK)
            return status;
    }
    hand_out(pool, found, size, bytes);
    *address = at(pool, found)->address;
    return EM_OK;
}

em_status em_pool_alloc(em_pool *pool, size_t bytes, uintptr_t *address, em_error *err)
{
    if (em_failpoint_hit(EM_FAILPOINT_POOL_ALLOC, NULL))
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "pool '%s': allocation of %zu bytes failed (failpoint pool_alloc)",
                            pool->name, bytes);
    pthread_mutex_lock(&pool->mutex);
    em_status status = allocate_locked(pool, bytes, address, err);
    pthread_mutex_unlock(&pool->mutex);
    return status;
}

/* ---- free ---------------------------------------------------------------- */

static uint32_t find_live(const em_pool *pool, uintptr_t address)
{
    uint32_t found = tree_lower_bound(pool, &pool->live,
                                      (chunk_key){.size = 0, .address = address});
    return found != NO_CHUNK && at(pool, found)->address == address ? found : NO_CHUNK;
}

/* Merges the free chunk after index (already out of its bin) into index. */
static void absorb_next(em_pool *pool, uint32_t index)
{
    chunk *c = at(pool, index);
    uint32_t next = c->next;
    chunk *n = at(pool, next);
    c->size += n->size;
    c->next = n->next;
    if (c->next != NO_CHUNK)
        at(pool, c->next)->previous = index;
    record_release(pool, next);
}

/* Merges the free chunk index with its free neighbours; returns the merged chunk. */
static uint32_t coalesce(em_pool *pool, uint32_t index)
{
    uint32_t next = at(pool, index)->next;
    if (is_free_chunk(pool, next)) {
        bin_remove(pool, next);
        absorb_next(pool, index);
    }
    uint32_t previous = at(pool, index)->previous;
    if (is_free_chunk(pool, previous)) {
        bin_remove(pool, previous);
        absorb_next(pool, previous);
        index = previous;
    }
    return index;
}

static em_status free_locked(em_pool *pool, uintptr_t address, em_error *err)
{
    uint32_t index = find_live(pool, address);
    if (index == NO_CHUNK)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "pool '%s': address 0x%" PRIxPTR " is not a live allocation",
                            pool->name, address);
    tree_remove(pool, &pool->live, index);
    chunk *c = at(pool, index);
    c->in_use = false;
    c->requested = 0;
    pool->bytes_in_use -= c->size;
    pool->live_allocations--;
    bin_insert(pool, coalesce(pool, index));
    return EM_OK;
}

em_status em_pool_free(em_pool *pool, uintptr_t address, em_error *err)
{
    pthread_mutex_lock(&pool->mutex);
    em_status status = free_locked(pool, address, err);
    pthread_mutex_unlock(&pool->mutex);
    return status;
}

size_t em_pool_allocation_size(em_pool *pool, uintptr_t address)
{
    pthread_mutex_lock(&pool->mutex);
    uint32_t index = find_live(pool, address);
    size_t size = index == NO_CHUNK ? 0 : at(pool, index)->size;
    pthread_mutex_unlock(&pool->mutex);
    return size;
}

/* ---- create and destroy -------------------------------------------------- */

static em_status check_options(const em_pool_options *options, em_error *err)
{
    if (options == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT, "pool options are missing (NULL)");
    if (options->name == NULL || options->name[0] == '\0')
        return em_error_set(err, EM_INVALID_ARGUMENT, "pool name is %s",
                            options->name == NULL ? "missing (NULL)" : "empty");
    const char *name = options->name;
    if (options->provider.reserve == NULL || options->provider.release == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT, "pool '%s': provider.%s is NULL", name,
                            options->provider.reserve == NULL ? "reserve" : "release");
    if (options->limit_bytes < EM_POOL_ALIGNMENT)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "pool '%s': limit_bytes %zu is below one allocation (%zu bytes)",
                            name, options->limit_bytes, EM_POOL_ALIGNMENT);
    size_t initial = round_up(options->initial_bytes);
    if (initial > options->limit_bytes || (initial == 0 && options->initial_bytes != 0))
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "pool '%s': initial_bytes %zu (rounded up to %zu bytes) exceeds "
                            "limit_bytes %zu",
                            name, options->initial_bytes, initial, options->limit_bytes);
    if (options->growth_bytes != 0 && round_up(options->growth_bytes) == 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "pool '%s': growth_bytes %zu overflows when rounded to %zu bytes",
                            name, options->growth_bytes, EM_POOL_ALIGNMENT);
    return EM_OK;
}

static em_pool *pool_new(const em_pool_options *options)
{
    em_pool *pool = calloc(1, sizeof(*pool));
    if (pool == NULL)
        return NULL;
    pool->name = strdup(options->name);
    if (pool->name == NULL || pthread_mutex_init(&pool->mutex, NULL) != 0) {
        free(pool->name);
        free(pool);
        return NULL;
    }
    pool->growth_bytes = round_up(options->growth_bytes);
    pool->limit_bytes = options->limit_bytes;
    pool->provider = options->provider;
    pool->released_head = NO_CHUNK;
    pool->priority_state = PRIORITY_SEED;
    for (unsigned b = 0; b < BIN_COUNT; b++)
        pool->bins[b].chunks = (tree){.root = NO_CHUNK, .by_size = true};
    pool->live = (tree){.root = NO_CHUNK, .by_size = false};
    return pool;
}

em_status em_pool_create(const em_pool_options *options, em_pool **out, em_error *err)
{
    em_status status = check_options(options, err);
    if (status != EM_OK)
        return status;
    if (out == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT, "pool '%s': out is NULL", options->name);
    em_pool *pool = pool_new(options);
    if (pool == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "pool '%s': out of host memory for the pool itself", options->name);
    if (options->initial_bytes > 0) {
        status = add_region(pool, round_up(options->initial_bytes), err);
        if (status != EM_OK) {
            em_pool_destroy(pool);
            return em_error_prefix(err, "pool '%s': ", options->name);
        }
    }
    *out = pool;
    return EM_OK;
}

void em_pool_destroy(em_pool *pool)
{
    if (pool == NULL)
        return;
    for (uint32_t r = 0; r < pool->region_count; r++)
        pool->provider.release(pool->provider.context, pool->regions[r].base,
                               pool->regions[r].size);
    pthread_mutex_destroy(&pool->mutex);
    free(pool->regions);
    free(pool->records);
    free(pool->name);
    free(pool);
}

/* ---- walk and dump ------------------------------------------------------- */

static em_pool_chunk_info chunk_info(const em_pool *pool, uint32_t index)
{
    const chunk *c = at(pool, index);
    return (em_pool_chunk_info){
        .region = c->region,
        .address = c->address,
        .size = c->size,
        .requested = c->requested,
        .in_use = c->in_use,
    };
}

void em_pool_walk(em_pool *pool, void (*visit)(void *context, const em_pool_chunk_info *chunk),
                  void *context)
{
    pthread_mutex_lock(&pool->mutex);
    for (uint32_t r = 0; r < pool->region_count; r++) {
        for (uint32_t i = pool->regions[r].first_chunk; i != NO_CHUNK; i = at(pool, i)->next) {
            em_pool_chunk_info info = chunk_info(pool, i);
            visit(context, &info);
        }
    }
    pthread_mutex_unlock(&pool->mutex);
}

static void dump_region(const em_pool *pool, uint32_t r, FILE *out)
{
    const region *g = &pool->regions[r];
    fprintf(out, "region %" PRIu32 ": base 0x%" PRIxPTR ", %zu bytes (%s)\n", r, g->base,
            g->size, human_bytes(g->size).text);
    for (uint32_t i = g->first_chunk; i != NO_CHUNK; i = at(pool, i)->next) {
        const chunk *c = at(pool, i);
        if (c->in_use)
            fprintf(out, "  chunk 0x%" PRIxPTR " size %zu requested %zu in use\n", c->address,
                    c->size, c->requested);
        else
            fprintf(out, "  chunk 0x%" PRIxPTR " size %zu free\n", c->address, c->size);
    }
}

static void dump_bins(const em_pool *pool, FILE *out)
{
    fprintf(out, "bins:\n");
    for (unsigned b = 0; b < BIN_COUNT; b++) {
        if (pool->bins[b].count == 0)
            continue;
        uint64_t low = (uint64_t)EM_POOL_ALIGNMENT << b;
        if (b == BIN_COUNT - 1)
            fprintf(out, "  bin %u [%s, unbounded): free chunks %" PRIu64 "\n", b,
                    human_bytes(low).text, pool->bins[b].count);
        else
            fprintf(out, "  bin %u [%s, %s): free chunks %" PRIu64 "\n", b,
                    human_bytes(low).text, human_bytes(low * 2).text, pool->bins[b].count);
    }
}

void em_pool_dump(em_pool *pool, FILE *out)
{
    pthread_mutex_lock(&pool->mutex);
    fprintf(out, "pool '%s', regions: %" PRIu32 "\n", pool->name, pool->region_count);
    for (uint32_t r = 0; r < pool->region_count; r++)
        dump_region(pool, r, out);
    dump_bins(pool, out);
    em_pool_stats stats;
    stats_locked(pool, &stats);
    char line[EM_ERROR_MESSAGE_MAX];
    em_pool_format_stats(&stats, line, sizeof(line));
    fprintf(out, "stats: %s\n", line);
    pthread_mutex_unlock(&pool->mutex);
}

/* ---- host memory --------------------------------------------------------- */

static em_status host_reserve(void *context, size_t bytes, uintptr_t *base, em_error *err)
{
    (void)context;
    void *memory = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (memory == MAP_FAILED) {
        char reason[128];
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "mmap of %zu bytes (%s) failed: %s",
                            bytes, human_bytes(bytes).text,
                            strerror_r(errno, reason, sizeof(reason)));
    }
    /* Rows are written once per page as tables fill (a restore writes gigabytes):
     * transparent huge pages take one fault per 2 MiB instead of 512. Advice only: a
     * kernel without them, or with them off, faults page by page as before. */
    if (bytes >= (size_t)2 << 20)
        (void)madvise(memory, bytes, MADV_HUGEPAGE);
    *base = (uintptr_t)memory;
    return EM_OK;
}

static void host_release(void *context, uintptr_t base, size_t bytes)
{
    (void)context;
    munmap((void *)base, bytes);
}

em_pool_region_provider em_pool_host_provider(void)
{
    return (em_pool_region_provider){.reserve = host_reserve, .release = host_release};
}

/* em_allocator promises a block for any size, 0 included (as malloc does), so a
 * zero-byte request takes the smallest chunk instead of failing. */
static em_status host_allocator_alloc(void *context, size_t bytes, void **out, em_error *err)
{
    uintptr_t address = 0;
    em_status status = em_pool_alloc(context, bytes == 0 ? 1 : bytes, &address, err);
    if (status == EM_OK)
        *out = (void *)address;
    return status;
}

/* em_allocator's free cannot report an error: freeing a block that is not live is a
 * bug in the caller, caught here in debug builds; the pool stays unchanged. */
static void host_allocator_free(void *context, void *pointer)
{
    em_status status = em_pool_free(context, (uintptr_t)pointer, NULL);
    assert(status == EM_OK);
    (void)status;
}

em_allocator em_pool_host_allocator(em_pool *pool)
{
    return (em_allocator){
        .alloc = host_allocator_alloc, .free = host_allocator_free, .context = pool};
}
