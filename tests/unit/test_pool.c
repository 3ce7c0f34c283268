/*
 * Tests of the pool allocator. Most tests run the pool over a fake provider that
 * hands out address ranges without memory behind them (the pool never touches the
 * bytes), so layouts and addresses are exact and limits can be large; the host
 * provider is used where blocks are written to.
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/memory/pool.h"
#include "tests/support/test_support.h"

#define KiB ((size_t)1024)
#define MiB (1024 * KiB)
#define GiB (1024 * MiB)

/* ---- a provider of address ranges ---------------------------------------- */

/* Regions come back to back from this address, so a pool that merged chunks across
 * regions would show it. */
#define FAKE_FIRST_BASE ((uintptr_t)1 << 40)
#define FAKE_MAX_REGIONS 64

typedef struct fake_region {
    uintptr_t base;
    size_t size;
    bool released;
} fake_region;

typedef struct fake_provider {
    fake_region regions[FAKE_MAX_REGIONS];
    size_t count;
    size_t released;
    uintptr_t next_base;
    uintptr_t misalign_by; /* added to each base handed out */
    bool fail;             /* reserve fails like a full device */
} fake_provider;

static em_status fake_reserve(void *context, size_t bytes, uintptr_t *base, em_error *err)
{
    fake_provider *fake = context;
    if (fake->fail)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "fake device is full (asked %zu bytes)",
                            bytes);
    ck_assert_uint_lt(fake->count, FAKE_MAX_REGIONS);
    if (fake->next_base == 0)
        fake->next_base = FAKE_FIRST_BASE;
    *base = fake->next_base + fake->misalign_by;
    fake->regions[fake->count++] = (fake_region){.base = *base, .size = bytes};
    fake->next_base += bytes;
    return EM_OK;
}

static void fake_release(void *context, uintptr_t base, size_t bytes)
{
    fake_provider *fake = context;
    for (size_t i = 0; i < fake->count; i++) {
        if (fake->regions[i].base == base) {
            ck_assert(!fake->regions[i].released);
            ck_assert_uint_eq(fake->regions[i].size, bytes);
            fake->regions[i].released = true;
            fake->released++;
            return;
        }
    }
    ck_abort_msg("release of unknown region 0x%" PRIxPTR, base);
}

static em_pool_options fake_options(fake_provider *fake, size_t initial, size_t growth,
                                    size_t limit)
{
    return (em_pool_options){
        .name = "cpu0",
        .initial_bytes = initial,
        .growth_bytes = growth,
        .limit_bytes = limit,
        .provider = {.reserve = fake_reserve, .release = fake_release, .context = fake},
    };
}

static em_pool *fake_pool(fake_provider *fake, size_t initial, size_t growth, size_t limit)
{
    em_pool_options options = fake_options(fake, initial, growth, limit);
    em_pool *pool = NULL;
    em_error err;
    em_status status = em_pool_create(&options, &pool, &err);
    ck_assert_msg(status == EM_OK, "create: %s", err.message);
    return pool;
}

/* ---- helpers ------------------------------------------------------------- */

static size_t rounded(size_t bytes)
{
    return (bytes + EM_POOL_ALIGNMENT - 1) / EM_POOL_ALIGNMENT * EM_POOL_ALIGNMENT;
}

static uintptr_t must_alloc(em_pool *pool, size_t bytes)
{
    uintptr_t address = 0;
    em_error err;
    em_status status = em_pool_alloc(pool, bytes, &address, &err);
    ck_assert_msg(status == EM_OK, "alloc %zu: %s", bytes, err.message);
    return address;
}

static void must_free(em_pool *pool, uintptr_t address)
{
    em_error err;
    em_status status = em_pool_free(pool, address, &err);
    ck_assert_msg(status == EM_OK, "free 0x%" PRIxPTR ": %s", address, err.message);
}

static em_pool_stats stats_of(em_pool *pool)
{
    em_pool_stats stats;
    em_pool_get_stats(pool, &stats);
    return stats;
}

typedef struct chunk_list {
    em_pool_chunk_info items[4096];
    size_t count;
} chunk_list;

static void collect_chunk(void *context, const em_pool_chunk_info *chunk)
{
    chunk_list *list = context;
    ck_assert_uint_lt(list->count, sizeof(list->items) / sizeof(list->items[0]));
    list->items[list->count++] = *chunk;
}

/* Heap-allocated: the list is too big for a thread's stack. */
static chunk_list *walk(em_pool *pool)
{
    chunk_list *list = calloc(1, sizeof(*list));
    ck_assert_ptr_nonnull(list);
    em_pool_walk(pool, collect_chunk, list);
    return list;
}

static void assert_chunk(const chunk_list *list, size_t i, uintptr_t address, size_t size,
                         int in_use)
{
    ck_assert_uint_lt(i, list->count);
    ck_assert_msg(list->items[i].address == address, "chunk %zu at 0x%" PRIxPTR
                  ", expected 0x%" PRIxPTR, i, list->items[i].address, address);
    ck_assert_uint_eq(list->items[i].size, size);
    ck_assert_int_eq(list->items[i].in_use, in_use);
}

static void assert_stats_equal(const em_pool_stats *a, const em_pool_stats *b)
{
    ck_assert_uint_eq(a->bytes_in_use, b->bytes_in_use);
    ck_assert_uint_eq(a->peak_bytes_in_use, b->peak_bytes_in_use);
    ck_assert_uint_eq(a->bytes_reserved, b->bytes_reserved);
    ck_assert_uint_eq(a->bytes_limit, b->bytes_limit);
    ck_assert_uint_eq(a->bytes_free, b->bytes_free);
    ck_assert_uint_eq(a->largest_free_block, b->largest_free_block);
    ck_assert_uint_eq(a->live_allocations, b->live_allocations);
    ck_assert_uint_eq(a->total_allocations, b->total_allocations);
    ck_assert_uint_eq(a->failed_allocations, b->failed_allocations);
    ck_assert_uint_eq(a->free_chunks, b->free_chunks);
    ck_assert_uint_eq(a->region_count, b->region_count);
    ck_assert_double_eq(a->fragmentation, b->fragmentation);
}

/* Every region is one free chunk that spans it. */
static void assert_fully_coalesced(em_pool *pool)
{
    em_pool_stats stats = stats_of(pool);
    chunk_list *list = walk(pool);
    ck_assert_uint_eq(list->count, stats.region_count);
    uint64_t largest = 0;
    for (size_t i = 0; i < list->count; i++) {
        ck_assert_uint_eq(list->items[i].region, i);
        ck_assert_int_eq(list->items[i].in_use, 0);
        if (list->items[i].size > largest)
            largest = list->items[i].size;
    }
    ck_assert_uint_eq(stats.bytes_in_use, 0);
    ck_assert_uint_eq(stats.live_allocations, 0);
    ck_assert_uint_eq(stats.bytes_free, stats.bytes_reserved);
    ck_assert_uint_eq(stats.free_chunks, stats.region_count);
    ck_assert_uint_eq(stats.largest_free_block, largest);
    free(list);
}

/* ---- basics -------------------------------------------------------------- */

START_TEST(create_reserves_the_initial_region)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 1000 * KiB + 1, 4 * MiB, 64 * MiB);
    ck_assert_uint_eq(fake.count, 1);
    ck_assert_uint_eq(fake.regions[0].size, 1000 * KiB + 256);
    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.bytes_reserved, 1000 * KiB + 256);
    ck_assert_uint_eq(stats.bytes_limit, 64 * MiB);
    ck_assert_uint_eq(stats.bytes_free, 1000 * KiB + 256);
    ck_assert_uint_eq(stats.largest_free_block, 1000 * KiB + 256);
    ck_assert_uint_eq(stats.free_chunks, 1);
    ck_assert_uint_eq(stats.region_count, 1);
    ck_assert_uint_eq(stats.bytes_in_use, 0);
    ck_assert_double_eq(stats.fragmentation, 0.0);
    ck_assert_str_eq(em_pool_name(pool), "cpu0");
    em_pool_destroy(pool);
    ck_assert_uint_eq(fake.released, 1);
    em_pool_destroy(NULL);
}
END_TEST

START_TEST(allocations_are_rounded_and_aligned)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 1 * MiB, 0, 1 * MiB);
    uintptr_t one = must_alloc(pool, 1);
    uintptr_t odd = must_alloc(pool, 257);
    uintptr_t exact = must_alloc(pool, 512);
    ck_assert_uint_eq(one, FAKE_FIRST_BASE);
    ck_assert_uint_eq(odd, FAKE_FIRST_BASE + 256);
    ck_assert_uint_eq(exact, FAKE_FIRST_BASE + 768);
    ck_assert_uint_eq(em_pool_allocation_size(pool, one), 256);
    ck_assert_uint_eq(em_pool_allocation_size(pool, odd), 512);
    ck_assert_uint_eq(em_pool_allocation_size(pool, exact), 512);
    ck_assert_uint_eq(em_pool_allocation_size(pool, odd + 256), 0);
    ck_assert_uint_eq(em_pool_allocation_size(pool, FAKE_FIRST_BASE + 1 * MiB - 256), 0);
    chunk_list *list = walk(pool);
    ck_assert_uint_eq(list->count, 4);
    ck_assert_uint_eq(list->items[0].requested, 1);
    ck_assert_uint_eq(list->items[1].requested, 257);
    ck_assert_uint_eq(list->items[2].requested, 512);
    ck_assert_uint_eq(list->items[3].requested, 0);
    free(list);
    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.bytes_in_use, 256 + 512 + 512);
    ck_assert_uint_eq(stats.live_allocations, 3);
    ck_assert_uint_eq(stats.total_allocations, 3);
    ck_assert_uint_eq(stats.bytes_free, 1 * MiB - 1280);
    em_pool_destroy(pool);
}
END_TEST

START_TEST(peak_tracks_the_highest_use)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 8 * MiB, 0, 8 * MiB);
    uintptr_t big = must_alloc(pool, 3 * MiB);
    uintptr_t small = must_alloc(pool, 1 * MiB);
    must_free(pool, big);
    uintptr_t again = must_alloc(pool, 2 * MiB);
    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.peak_bytes_in_use, 4 * MiB);
    ck_assert_uint_eq(stats.bytes_in_use, 3 * MiB);
    ck_assert_uint_eq(stats.total_allocations, 3);
    ck_assert_uint_eq(stats.live_allocations, 2);
    must_free(pool, small);
    must_free(pool, again);
    ck_assert_uint_eq(stats_of(pool).peak_bytes_in_use, 4 * MiB);
    assert_fully_coalesced(pool);
    em_pool_destroy(pool);
}
END_TEST

/* ---- best fit ------------------------------------------------------------ */

/* Allocates the sizes in order, each followed by a 256-byte separator that stays live,
 * then frees the ones marked as holes. */
static void make_holes(em_pool *pool, const size_t *sizes, const bool *hole, size_t count,
                       uintptr_t *addresses)
{
    for (size_t i = 0; i < count; i++) {
        addresses[i] = must_alloc(pool, sizes[i]);
        must_alloc(pool, 256);
    }
    for (size_t i = 0; i < count; i++)
        if (hole[i])
            must_free(pool, addresses[i]);
}

START_TEST(best_fit_takes_the_smallest_hole_that_fits)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 1 * MiB, 0, 1 * MiB);
    const size_t sizes[] = {4 * KiB, 1 * KiB, 2 * KiB};
    const bool hole[] = {true, true, true};
    uintptr_t at[3];
    make_holes(pool, sizes, hole, 3, at);
    ck_assert_uint_eq(stats_of(pool).free_chunks, 4);

    ck_assert_uint_eq(must_alloc(pool, 1536), at[2]);   /* the 2 KiB hole, split */
    ck_assert_uint_eq(must_alloc(pool, 1 * KiB), at[1]); /* exact fit */
    ck_assert_uint_eq(must_alloc(pool, 512), at[2] + 1536); /* the 512-byte remainder */
    ck_assert_uint_eq(must_alloc(pool, 4 * KiB), at[0]);
    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.free_chunks, 1); /* only the region's tail is left */
    ck_assert_uint_eq(stats.largest_free_block, 1 * MiB - 3 * 256 - 7 * KiB);
    em_pool_destroy(pool);
}
END_TEST

START_TEST(equal_holes_go_lowest_address_first)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 1 * MiB, 0, 1 * MiB);
    const size_t sizes[] = {1 * KiB, 768, 1 * KiB, 1 * KiB};
    const bool hole[] = {true, true, true, true};
    uintptr_t at[4];
    make_holes(pool, sizes, hole, 4, at);
    ck_assert_uint_eq(must_alloc(pool, 1000), at[0]);
    ck_assert_uint_eq(must_alloc(pool, 700), at[1]);
    ck_assert_uint_eq(must_alloc(pool, 1 * KiB), at[2]);
    ck_assert_uint_eq(must_alloc(pool, 800), at[3]);
    ck_assert_uint_eq(em_pool_allocation_size(pool, at[3]), 1 * KiB); /* 800 rounds up */
    em_pool_destroy(pool);
}
END_TEST

START_TEST(best_fit_inside_one_bin)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 1 * MiB, 0, 1 * MiB);
    /* All four holes are in bin [1, 2) KiB. */
    const size_t sizes[] = {1792, 1280, 1536, 1536};
    const bool hole[] = {true, true, true, true};
    uintptr_t at[4];
    make_holes(pool, sizes, hole, 4, at);
    ck_assert_uint_eq(must_alloc(pool, 1400), at[2]);
    ck_assert_uint_eq(must_alloc(pool, 1331), at[3]);
    ck_assert_uint_eq(must_alloc(pool, 1100), at[1]);
    ck_assert_uint_eq(must_alloc(pool, 1700), at[0]);
    ck_assert_uint_eq(stats_of(pool).free_chunks, 1);
    em_pool_destroy(pool);
}
END_TEST

START_TEST(no_fit_in_its_bin_takes_the_smallest_of_the_next_bin)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 1 * MiB, 0, 1 * MiB);
    /* bins: 3 KiB in [2, 4) KiB, 9 KiB in [8, 16) KiB, 5 and 6 KiB in [4, 8) KiB. */
    const size_t sizes[] = {3 * KiB, 9 * KiB, 6 * KiB, 5 * KiB, 200 * KiB};
    const bool hole[] = {true, true, true, true, false};
    uintptr_t at[5];
    make_holes(pool, sizes, hole, 5, at);
    /* 3.5 KiB belongs to bin [2, 4) KiB, whose 3 KiB hole is too small. */
    ck_assert_uint_eq(must_alloc(pool, 3 * KiB + 512), at[3]);
    ck_assert_uint_eq(must_alloc(pool, 3 * KiB), at[0]);
    ck_assert_uint_eq(must_alloc(pool, 7 * KiB), at[1]);
    ck_assert_uint_eq(must_alloc(pool, 5 * KiB), at[2]);
    em_pool_destroy(pool);
}
END_TEST

/* ---- split and coalesce -------------------------------------------------- */

START_TEST(free_coalesces_with_left_right_and_both_neighbours)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 64 * KiB, 0, 64 * KiB);
    const uintptr_t base = FAKE_FIRST_BASE;
    uintptr_t block[5];
    for (int i = 0; i < 5; i++)
        block[i] = must_alloc(pool, 1 * KiB);
    chunk_list *list = walk(pool);
    ck_assert_uint_eq(list->count, 6);
    for (int i = 0; i < 5; i++)
        assert_chunk(list, (size_t)i, base + (uintptr_t)i * KiB, 1 * KiB, 1);
    assert_chunk(list, 5, base + 5 * KiB, 59 * KiB, 0);
    free(list);

    must_free(pool, block[0]); /* no free neighbour */
    list = walk(pool);
    ck_assert_uint_eq(list->count, 6);
    assert_chunk(list, 0, base, 1 * KiB, 0);
    free(list);

    must_free(pool, block[1]); /* left neighbour free */
    list = walk(pool);
    ck_assert_uint_eq(list->count, 5);
    assert_chunk(list, 0, base, 2 * KiB, 0);
    assert_chunk(list, 1, block[2], 1 * KiB, 1);
    free(list);

    must_free(pool, block[4]); /* right neighbour (the tail) free */
    list = walk(pool);
    ck_assert_uint_eq(list->count, 4);
    assert_chunk(list, 3, block[4], 60 * KiB, 0);
    free(list);

    must_free(pool, block[3]); /* right again, left still live */
    list = walk(pool);
    ck_assert_uint_eq(list->count, 3);
    assert_chunk(list, 1, block[2], 1 * KiB, 1);
    assert_chunk(list, 2, block[3], 61 * KiB, 0);
    ck_assert_uint_eq(stats_of(pool).free_chunks, 2);
    free(list);

    must_free(pool, block[2]); /* both neighbours free */
    list = walk(pool);
    ck_assert_uint_eq(list->count, 1);
    assert_chunk(list, 0, base, 64 * KiB, 0);
    free(list);
    assert_fully_coalesced(pool);
    em_pool_destroy(pool);
}
END_TEST

START_TEST(exact_fit_leaves_no_remainder)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 4 * KiB, 0, 4 * KiB);
    uintptr_t whole = must_alloc(pool, 4 * KiB);
    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.free_chunks, 0);
    ck_assert_uint_eq(stats.bytes_free, 0);
    ck_assert_uint_eq(stats.largest_free_block, 0);
    ck_assert_double_eq(stats.fragmentation, 0.0);
    must_free(pool, whole);
    assert_fully_coalesced(pool);
    em_pool_destroy(pool);
}
END_TEST

/* ---- growth and the limit ------------------------------------------------ */

START_TEST(growth_adds_regions_up_to_the_limit)
{
    fake_provider fake = {0};
    const size_t limit = 11 * MiB + 100; /* not a granule multiple */
    em_pool *pool = fake_pool(&fake, 1 * MiB, 4 * MiB, limit);

    ck_assert_uint_eq(must_alloc(pool, 1 * MiB), fake.regions[0].base);
    ck_assert_uint_eq(fake.count, 1);

    uintptr_t small = must_alloc(pool, 1 * KiB); /* a growth_bytes region */
    ck_assert_uint_eq(fake.count, 2);
    ck_assert_uint_eq(fake.regions[1].size, 4 * MiB);
    ck_assert_uint_eq(small, fake.regions[1].base);

    uintptr_t large = must_alloc(pool, 5 * MiB); /* above growth_bytes: its own size */
    ck_assert_uint_eq(fake.count, 3);
    ck_assert_uint_eq(fake.regions[2].size, 5 * MiB);
    ck_assert_uint_eq(large, fake.regions[2].base);
    ck_assert_uint_eq(stats_of(pool).free_chunks, 1); /* region 1's tail */

    ck_assert_uint_eq(must_alloc(pool, 4 * MiB - 1 * KiB), small + 1 * KiB); /* no growth */
    ck_assert_uint_eq(fake.count, 3);

    /* 1 MiB + 100 bytes remain under the limit: a 2 MiB request cannot fit. */
    uintptr_t address = 0;
    em_error err;
    ck_assert_int_eq(em_pool_alloc(pool, 2 * MiB, &address, &err), EM_RESOURCE_EXHAUSTED);
    ck_assert_uint_eq(fake.count, 3);

    /* growth_bytes is more than remains: the region takes what remains, rounded down. */
    uintptr_t tail = must_alloc(pool, 512 * KiB);
    ck_assert_uint_eq(fake.count, 4);
    ck_assert_uint_eq(fake.regions[3].size, 1 * MiB);
    ck_assert_uint_eq(tail, fake.regions[3].base);
    ck_assert_uint_eq(must_alloc(pool, 512 * KiB), tail + 512 * KiB);

    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.bytes_reserved, 11 * MiB);
    ck_assert_uint_eq(stats.bytes_in_use, 11 * MiB);
    ck_assert_uint_eq(stats.bytes_free, 0);
    ck_assert_uint_eq(stats.region_count, 4);
    ck_assert_int_eq(em_pool_alloc(pool, 1, &address, &err), EM_RESOURCE_EXHAUSTED);
    ck_assert_uint_eq(fake.count, 4);
    ck_assert_uint_eq(stats_of(pool).failed_allocations, 2);
    em_pool_destroy(pool);
    ck_assert_uint_eq(fake.released, 4);
}
END_TEST

START_TEST(first_region_comes_on_demand)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 0, 2 * MiB, 2 * MiB);
    ck_assert_uint_eq(fake.count, 0);
    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.region_count, 0);
    ck_assert_uint_eq(stats.bytes_reserved, 0);
    ck_assert_double_eq(stats.fragmentation, 0.0);
    ck_assert_uint_eq(must_alloc(pool, 100), FAKE_FIRST_BASE);
    ck_assert_uint_eq(fake.count, 1);
    ck_assert_uint_eq(fake.regions[0].size, 2 * MiB);
    em_pool_destroy(pool);
}
END_TEST

START_TEST(limit_is_usable_to_the_last_byte)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 0, 1 * MiB, 2 * MiB + 256);
    uintptr_t blocks[3];
    blocks[0] = must_alloc(pool, 1 * MiB);
    blocks[1] = must_alloc(pool, 1 * MiB);
    blocks[2] = must_alloc(pool, 200); /* the last 256 bytes */
    ck_assert_uint_eq(fake.count, 3);
    ck_assert_uint_eq(fake.regions[2].size, 256);
    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.bytes_reserved, stats.bytes_limit);
    ck_assert_uint_eq(stats.bytes_in_use, stats.bytes_limit);
    uintptr_t address;
    em_error err;
    ck_assert_int_eq(em_pool_alloc(pool, 1, &address, &err), EM_RESOURCE_EXHAUSTED);
    for (int i = 0; i < 3; i++)
        must_free(pool, blocks[i]);
    assert_fully_coalesced(pool);
    em_pool_destroy(pool);
}
END_TEST

START_TEST(disabled_growth_fails_when_full)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 1 * MiB, 0, 64 * MiB);
    uintptr_t address;
    em_error err;
    ck_assert_int_eq(em_pool_alloc(pool, 1 * MiB + 1, &address, &err), EM_RESOURCE_EXHAUSTED);
    ck_assert_ptr_nonnull(strstr(err.message, "growth is disabled"));
    ck_assert_uint_eq(fake.count, 1);
    ck_assert_uint_eq(must_alloc(pool, 1 * MiB), FAKE_FIRST_BASE);
    em_pool_destroy(pool);
}
END_TEST

/* ---- failures ------------------------------------------------------------ */

START_TEST(out_of_memory_reports_the_statistics)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 64 * MiB, 1 * MiB, 64 * MiB); /* at the limit */
    uintptr_t blocks[64];
    for (int i = 0; i < 64; i++)
        blocks[i] = must_alloc(pool, 1 * MiB);
    for (int i = 0; i < 64; i += 2)
        must_free(pool, blocks[i]);

    uintptr_t address = 0;
    em_error err;
    ck_assert_int_eq(em_pool_alloc(pool, 2 * MiB, &address, &err), EM_RESOURCE_EXHAUSTED);
    ck_assert_int_eq(err.status, EM_RESOURCE_EXHAUSTED);
    ck_assert_str_eq(err.message,
                     "pool 'cpu0': cannot allocate 2097152 bytes (2.0 MiB): in use 32.0 MiB of "
                     "64.0 MiB reserved (limit 64.0 MiB), peak 64.0 MiB, largest free block "
                     "1.0 MiB, fragmentation 0.97, free chunks 32, regions 1, live allocations "
                     "32, failed allocations 1");
    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.failed_allocations, 1);
    ck_assert_uint_eq(stats.total_allocations, 64);
    ck_assert_double_eq_tol(stats.fragmentation, 1.0 - 1.0 / 32.0, 1e-12);

    /* Still works: a 1 MiB hole fits, and freeing everything coalesces. */
    ck_assert_uint_eq(must_alloc(pool, 1 * MiB), blocks[0]);
    must_free(pool, blocks[0]);
    for (int i = 1; i < 64; i += 2)
        must_free(pool, blocks[i]);
    assert_fully_coalesced(pool);
    ck_assert_uint_eq(must_alloc(pool, 64 * MiB), FAKE_FIRST_BASE);
    em_pool_destroy(pool);
}
END_TEST

START_TEST(huge_requests_fail_cleanly)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 1 * MiB, 1 * MiB, 4 * MiB);
    const size_t sizes[] = {SIZE_MAX, SIZE_MAX - 100, 4 * MiB + 1, (size_t)1 << 48};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        uintptr_t address = 0;
        em_error err;
        ck_assert_int_eq(em_pool_alloc(pool, sizes[i], &address, &err), EM_RESOURCE_EXHAUSTED);
        ck_assert_ptr_nonnull(strstr(err.message, "cannot allocate"));
    }
    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.failed_allocations, 4);
    ck_assert_uint_eq(stats.region_count, 1);
    ck_assert_uint_eq(fake.count, 1);
    em_pool_destroy(pool);
}
END_TEST

START_TEST(zero_bytes_is_an_invalid_argument)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 1 * MiB, 0, 1 * MiB);
    uintptr_t address = 12345;
    em_error err;
    ck_assert_int_eq(em_pool_alloc(pool, 0, &address, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "pool 'cpu0': cannot allocate 0 bytes");
    ck_assert_uint_eq(address, 12345);
    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.failed_allocations, 1);
    ck_assert_uint_eq(stats.total_allocations, 0);
    ck_assert_uint_eq(stats.bytes_in_use, 0);
    em_pool_destroy(pool);
}
END_TEST

static void assert_invalid_free(em_pool *pool, uintptr_t address)
{
    em_pool_stats before = stats_of(pool);
    chunk_list *chunks_before = walk(pool);
    em_error err;
    ck_assert_int_eq(em_pool_free(pool, address, &err), EM_INVALID_ARGUMENT);
    char expected[128];
    snprintf(expected, sizeof(expected), "pool 'cpu0': address 0x%" PRIxPTR
             " is not a live allocation", address);
    ck_assert_str_eq(err.message, expected);
    em_pool_stats after = stats_of(pool);
    assert_stats_equal(&before, &after);
    chunk_list *chunks_after = walk(pool);
    ck_assert_uint_eq(chunks_before->count, chunks_after->count);
    for (size_t i = 0; i < chunks_before->count; i++) {
        const em_pool_chunk_info *b = &chunks_before->items[i], *a = &chunks_after->items[i];
        ck_assert_uint_eq(a->region, b->region);
        ck_assert_uint_eq(a->address, b->address);
        ck_assert_uint_eq(a->size, b->size);
        ck_assert_uint_eq(a->requested, b->requested);
        ck_assert_int_eq(a->in_use, b->in_use);
    }
    free(chunks_before);
    free(chunks_after);
}

START_TEST(invalid_and_double_free_change_nothing)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 1 * MiB, 0, 1 * MiB);
    uintptr_t a = must_alloc(pool, 1 * KiB);
    uintptr_t b = must_alloc(pool, 1 * KiB);
    must_alloc(pool, 1 * KiB);
    must_free(pool, b);
    assert_invalid_free(pool, b);            /* double free */
    assert_invalid_free(pool, a + 256);      /* inside a live allocation */
    assert_invalid_free(pool, 0);            /* null */
    assert_invalid_free(pool, a + 12345);    /* unaligned */
    assert_invalid_free(pool, FAKE_FIRST_BASE + 512 * KiB); /* inside the free tail */
    assert_invalid_free(pool, (uintptr_t)&fake); /* foreign */
    must_free(pool, a);
    assert_invalid_free(pool, a);
    em_pool_destroy(pool);
}
END_TEST

typedef struct invalid_options_case {
    const char *label;
    em_pool_options options;
    const char *message;
} invalid_options_case;

START_TEST(invalid_options_are_rejected)
{
    fake_provider fake = {0};
    em_pool_options valid = fake_options(&fake, 1 * MiB, 1 * MiB, 4 * MiB);
    invalid_options_case cases[] = {
        {"no name", valid, "pool name is missing (NULL)"},
        {"empty name", valid, "pool name is empty"},
        {"no reserve", valid, "pool 'cpu0': provider.reserve is NULL"},
        {"no release", valid, "pool 'cpu0': provider.release is NULL"},
        {"zero limit", valid, "pool 'cpu0': limit_bytes 0 is below one allocation (256 bytes)"},
        {"initial above limit", valid,
         "pool 'cpu0': initial_bytes 8388608 (rounded up to 8388608 bytes) exceeds "
         "limit_bytes 4194304"},
        {"rounded initial above limit", valid,
         "pool 'cpu0': initial_bytes 1000 (rounded up to 1024 bytes) exceeds limit_bytes 1000"},
        {"growth overflows", valid,
         "pool 'cpu0': growth_bytes 18446744073709551615 overflows when rounded to 256 bytes"},
    };
    cases[0].options.name = NULL;
    cases[1].options.name = "";
    cases[2].options.provider.reserve = NULL;
    cases[3].options.provider.release = NULL;
    cases[4].options.limit_bytes = 0;
    cases[5].options.initial_bytes = 8 * MiB;
    cases[6].options.initial_bytes = 1000;
    cases[6].options.limit_bytes = 1000;
    cases[7].options.growth_bytes = SIZE_MAX;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        em_pool *pool = NULL;
        em_error err;
        em_status status = em_pool_create(&cases[i].options, &pool, &err);
        ck_assert_msg(status == EM_INVALID_ARGUMENT, "%s: status %d", cases[i].label, status);
        ck_assert_msg(strcmp(err.message, cases[i].message) == 0, "%s: message '%s'",
                      cases[i].label, err.message);
        ck_assert_ptr_null(pool);
    }
    em_pool *pool = NULL;
    em_error err;
    ck_assert_int_eq(em_pool_create(NULL, &pool, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "pool options are missing (NULL)");
    ck_assert_uint_eq(fake.count, 0);
}
END_TEST

START_TEST(provider_failures_are_reported)
{
    fake_provider fake = {.fail = true};
    em_pool_options options = fake_options(&fake, 1 * MiB, 1 * MiB, 4 * MiB);
    em_pool *pool = NULL;
    em_error err;
    ck_assert_int_eq(em_pool_create(&options, &pool, &err), EM_RESOURCE_EXHAUSTED);
    ck_assert_str_eq(err.message, "pool 'cpu0': reserving a region of 1048576 bytes (1.0 MiB): "
                                  "fake device is full (asked 1048576 bytes)");
    ck_assert_ptr_null(pool);

    fake.fail = false;
    pool = fake_pool(&fake, 1 * MiB, 1 * MiB, 4 * MiB);
    fake.fail = true;
    uintptr_t address = 0;
    ck_assert_int_eq(em_pool_alloc(pool, 2 * MiB, &address, &err), EM_RESOURCE_EXHAUSTED);
    const char *expected = "pool 'cpu0': cannot allocate 2097152 bytes (2.0 MiB): reserving a "
                           "region of 2097152 bytes (2.0 MiB): fake device is full (asked "
                           "2097152 bytes); in use 0 B of 1.0 MiB reserved (limit 4.0 MiB)";
    ck_assert(strncmp(err.message, expected, strlen(expected)) == 0);
    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.failed_allocations, 1);
    ck_assert_uint_eq(stats.region_count, 1);
    ck_assert_uint_eq(stats.bytes_reserved, 1 * MiB);
    fake.fail = false;
    ck_assert_uint_eq(must_alloc(pool, 2 * MiB), fake.regions[1].base);
    em_pool_destroy(pool);
}
END_TEST

START_TEST(misaligned_region_bases_are_refused)
{
    fake_provider fake = {.misalign_by = 64};
    em_pool_options options = fake_options(&fake, 1 * MiB, 1 * MiB, 4 * MiB);
    em_pool *pool = NULL;
    em_error err;
    ck_assert_int_eq(em_pool_create(&options, &pool, &err), EM_INTERNAL);
    char expected[160];
    snprintf(expected, sizeof(expected),
             "pool 'cpu0': the provider returned region base 0x%" PRIxPTR
             ", not aligned to 256 bytes", FAKE_FIRST_BASE + 64);
    ck_assert_str_eq(err.message, expected);
    ck_assert_ptr_null(pool);
    ck_assert_uint_eq(fake.count, 1);
    ck_assert_uint_eq(fake.released, 1); /* handed back */
}
END_TEST

START_TEST(destroy_releases_every_region)
{
    fake_provider fake = {0};
    em_pool *pool = fake_pool(&fake, 1 * MiB, 1 * MiB, 16 * MiB);
    for (int i = 0; i < 5; i++)
        must_alloc(pool, 700 * KiB);
    ck_assert_uint_eq(fake.count, 5); /* 700 KiB each: one per region */
    em_pool_destroy(pool); /* live allocations included */
    ck_assert_uint_eq(fake.released, 5);
    for (size_t i = 0; i < fake.count; i++)
        ck_assert(fake.regions[i].released);
}
END_TEST

/* ---- random sequences against a model ------------------------------------ */

#define MODEL_MAX_LIVE 256
#define MODEL_TARGET_LIVE 60
#define MODEL_OPERATIONS 5000
#define MODEL_MAX_BYTES (8 * MiB)

typedef struct live_block {
    uintptr_t address;
    size_t requested;
} live_block;

/* What the pool must look like, kept independently of it. */
typedef struct model {
    em_pool *pool;
    fake_provider *fake;
    size_t growth;
    size_t limit;
    live_block live[MODEL_MAX_LIVE];
    size_t live_count;
    uint64_t total;
    uint64_t failed;
    uint64_t in_use;
    uint64_t peak;
} model;

static int compare_blocks(const void *a, const void *b)
{
    const live_block *x = a, *y = b;
    return x->address < y->address ? -1 : x->address > y->address;
}

/* Sizes log-uniform from 1 byte to MODEL_MAX_BYTES, a quarter of them exact granules. */
static size_t random_size(em_test_rng *rng, size_t max_bytes)
{
    double exponent = em_test_rng_unit(rng) * log((double)max_bytes);
    size_t bytes = (size_t)exp(exponent);
    if (bytes == 0)
        bytes = 1;
    if (em_test_rng_below(rng, 4) == 0)
        bytes = rounded(bytes);
    return bytes;
}

/* The live blocks never overlap and lie inside regions the provider handed out. */
static void check_blocks_against_regions(const model *m)
{
    live_block sorted[MODEL_MAX_LIVE];
    memcpy(sorted, m->live, m->live_count * sizeof(live_block));
    qsort(sorted, m->live_count, sizeof(live_block), compare_blocks);
    for (size_t i = 0; i < m->live_count; i++) {
        ck_assert_uint_eq(sorted[i].address % EM_POOL_ALIGNMENT, 0);
        if (i > 0)
            ck_assert_uint_le(sorted[i - 1].address + rounded(sorted[i - 1].requested),
                              sorted[i].address);
        bool inside = false;
        for (size_t r = 0; r < m->fake->count; r++) {
            const fake_region *g = &m->fake->regions[r];
            inside |= sorted[i].address >= g->base &&
                      sorted[i].address + rounded(sorted[i].requested) <= g->base + g->size;
        }
        ck_assert_msg(inside, "block 0x%" PRIxPTR " is outside every region", sorted[i].address);
    }
}

/* The walk tiles every region exactly, free neighbours are merged, and the live
 * chunks are the model's blocks. */
static void check_walk(const model *m, const chunk_list *list)
{
    live_block sorted[MODEL_MAX_LIVE];
    memcpy(sorted, m->live, m->live_count * sizeof(live_block));
    qsort(sorted, m->live_count, sizeof(live_block), compare_blocks);
    size_t next_live = 0;
    size_t i = 0;
    for (uint32_t r = 0; r < m->fake->count; r++) {
        uintptr_t expected_address = m->fake->regions[r].base;
        bool previous_free = false;
        for (; i < list->count && list->items[i].region == r; i++) {
            const em_pool_chunk_info *c = &list->items[i];
            ck_assert_uint_eq(c->address, expected_address);
            ck_assert_uint_eq(c->size % EM_POOL_ALIGNMENT, 0);
            ck_assert_uint_gt(c->size, 0);
            ck_assert_msg(c->in_use || !previous_free, "free chunks not merged at 0x%" PRIxPTR,
                          c->address);
            if (c->in_use) {
                ck_assert_uint_lt(next_live, m->live_count);
                ck_assert_uint_eq(c->address, sorted[next_live].address);
                ck_assert_uint_eq(c->requested, sorted[next_live].requested);
                ck_assert_uint_eq(c->size, rounded(sorted[next_live].requested));
                next_live++;
            }
            previous_free = !c->in_use;
            expected_address += c->size;
        }
        ck_assert_uint_eq(expected_address, m->fake->regions[r].base + m->fake->regions[r].size);
    }
    ck_assert_uint_eq(i, list->count);
    ck_assert_uint_eq(next_live, m->live_count);
}

static void check_stats(const model *m, const chunk_list *list)
{
    uint64_t free_bytes = 0, free_chunks = 0, largest = 0, reserved = 0;
    for (size_t i = 0; i < list->count; i++) {
        if (list->items[i].in_use)
            continue;
        free_bytes += list->items[i].size;
        free_chunks++;
        if (list->items[i].size > largest)
            largest = list->items[i].size;
    }
    for (size_t r = 0; r < m->fake->count; r++)
        reserved += m->fake->regions[r].size;
    em_pool_stats stats = stats_of(m->pool);
    ck_assert_uint_eq(stats.bytes_in_use, m->in_use);
    ck_assert_uint_eq(stats.peak_bytes_in_use, m->peak);
    ck_assert_uint_eq(stats.live_allocations, m->live_count);
    ck_assert_uint_eq(stats.total_allocations, m->total);
    ck_assert_uint_eq(stats.failed_allocations, m->failed);
    ck_assert_uint_eq(stats.bytes_reserved, reserved);
    ck_assert_uint_le(stats.bytes_reserved, m->limit);
    ck_assert_uint_eq(stats.region_count, m->fake->count);
    ck_assert_uint_eq(stats.bytes_free, free_bytes);
    ck_assert_uint_eq(stats.bytes_free, reserved - m->in_use);
    ck_assert_uint_eq(stats.free_chunks, free_chunks);
    ck_assert_uint_eq(stats.largest_free_block, largest);
    double fragmentation = free_bytes == 0 ? 0.0 : 1.0 - (double)largest / (double)free_bytes;
    ck_assert_double_eq_tol(stats.fragmentation, fragmentation, 1e-12);
}

/* Best fit over the whole pool: the smallest free chunk that fits, lowest address
 * among equals; 0 when none fits. */
static uintptr_t predicted_fit(const chunk_list *list, size_t size)
{
    const em_pool_chunk_info *best = NULL;
    for (size_t i = 0; i < list->count; i++) {
        const em_pool_chunk_info *c = &list->items[i];
        if (c->in_use || c->size < size)
            continue;
        if (best == NULL || c->size < best->size ||
            (c->size == best->size && c->address < best->address))
            best = c;
    }
    return best == NULL ? 0 : best->address;
}

/* Region size the growth policy asks for, or 0 when the request must fail. */
static size_t predicted_region(const model *m, size_t size)
{
    uint64_t reserved = 0;
    for (size_t r = 0; r < m->fake->count; r++)
        reserved += m->fake->regions[r].size;
    size_t remaining = m->limit - reserved;
    if (m->growth == 0 || size > remaining)
        return 0;
    size_t wanted = m->growth > size ? m->growth : size;
    return wanted <= remaining ? wanted : remaining / EM_POOL_ALIGNMENT * EM_POOL_ALIGNMENT;
}

static void model_alloc(model *m, const chunk_list *list, size_t bytes)
{
    size_t size = rounded(bytes);
    uintptr_t expected = predicted_fit(list, size);
    size_t region_size = expected == 0 ? predicted_region(m, size) : 0;
    size_t regions_before = m->fake->count;
    uintptr_t address = 0;
    em_error err;
    em_status status = em_pool_alloc(m->pool, bytes, &address, &err);
    if (expected == 0 && region_size == 0) {
        ck_assert_msg(status == EM_RESOURCE_EXHAUSTED, "alloc %zu: status %d", bytes, status);
        m->failed++;
        return;
    }
    ck_assert_msg(status == EM_OK, "alloc %zu: %s", bytes, err.message);
    if (expected == 0) {
        ck_assert_uint_eq(m->fake->count, regions_before + 1);
        ck_assert_uint_eq(m->fake->regions[regions_before].size, region_size);
        expected = m->fake->regions[regions_before].base;
    }
    ck_assert_msg(address == expected, "alloc %zu at 0x%" PRIxPTR ", best fit 0x%" PRIxPTR,
                  bytes, address, expected);
    ck_assert_uint_lt(m->live_count, MODEL_MAX_LIVE);
    m->live[m->live_count++] = (live_block){.address = address, .requested = bytes};
    m->total++;
    m->in_use += size;
    if (m->in_use > m->peak)
        m->peak = m->in_use;
}

static void model_free(model *m, size_t which)
{
    live_block block = m->live[which];
    must_free(m->pool, block.address);
    m->live[which] = m->live[--m->live_count];
    m->in_use -= rounded(block.requested);
}

static void model_check(const model *m)
{
    chunk_list *list = walk(m->pool);
    check_blocks_against_regions(m);
    check_walk(m, list);
    check_stats(m, list);
    free(list);
}

static void model_step(model *m, em_test_rng *rng)
{
    chunk_list *list = walk(m->pool);
    double alloc_share = m->live_count < MODEL_TARGET_LIVE ? 0.7 : 0.3;
    if (m->live_count == 0 || em_test_rng_unit(rng) < alloc_share) {
        model_alloc(m, list, random_size(rng, MODEL_MAX_BYTES));
    } else if (em_test_rng_below(rng, 50) == 0) {
        /* Interior address of a live block: must be refused without effect. */
        live_block block = m->live[em_test_rng_below(rng, m->live_count)];
        uintptr_t inside = block.address + EM_POOL_ALIGNMENT;
        em_error err;
        if (rounded(block.requested) > EM_POOL_ALIGNMENT)
            ck_assert_int_eq(em_pool_free(m->pool, inside, &err), EM_INVALID_ARGUMENT);
    } else {
        model_free(m, em_test_rng_below(rng, m->live_count));
    }
    free(list);
    model_check(m);
}

START_TEST(random_sequences_match_the_model)
{
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    fake_provider fake = {0};
    model *m = calloc(1, sizeof(*m));
    ck_assert_ptr_nonnull(m);
    m->fake = &fake;
    m->growth = 16 * MiB;
    m->limit = 48 * MiB + 12345; /* reached: the last region is the rest */
    m->pool = fake_pool(&fake, 4 * MiB, m->growth, m->limit);
    for (int step = 0; step < MODEL_OPERATIONS; step++)
        model_step(m, &rng);
    ck_assert_uint_gt(m->total, MODEL_OPERATIONS / 3);
    ck_assert_uint_gt(fake.count, 1);
    ck_assert_uint_gt(m->failed, 0); /* the limit was reached */

    /* A request for the whole limit must fail while anything is reserved. */
    chunk_list *list = walk(m->pool);
    model_alloc(m, list, m->limit);
    free(list);
    model_check(m);

    while (m->live_count > 0) {
        model_free(m, em_test_rng_below(&rng, m->live_count));
        model_check(m);
    }
    assert_fully_coalesced(m->pool);
    em_pool_destroy(m->pool);
    ck_assert_uint_eq(fake.released, fake.count);
    free(m);
}
END_TEST

/* ---- threads ------------------------------------------------------------- */

#define STRESS_THREADS 4
#define STRESS_OPERATIONS_PER_THREAD 50000
#define STRESS_MAX_LIVE 64
#define STRESS_MAX_BYTES (16 * KiB)

typedef struct stress_block {
    unsigned char *bytes;
    size_t size;
    uint64_t tag;
} stress_block;

typedef struct stress_thread {
    em_pool *pool;
    unsigned id;
    uint64_t seed;
    uint64_t allocations;
    char failure[EM_ERROR_MESSAGE_MAX + 64]; /* empty while everything checks out */
} stress_thread;

static unsigned char tag_byte(uint64_t tag)
{
    return (unsigned char)((tag * UINT64_C(0x9e3779b97f4a7c15)) >> 56);
}

static void fill_block(const stress_block *block)
{
    memset(block->bytes, tag_byte(block->tag), block->size);
    if (block->size >= sizeof(block->tag))
        memcpy(block->bytes, &block->tag, sizeof(block->tag));
}

static bool block_intact(const stress_block *block)
{
    size_t start = 0;
    if (block->size >= sizeof(block->tag)) {
        if (memcmp(block->bytes, &block->tag, sizeof(block->tag)) != 0)
            return false;
        start = sizeof(block->tag);
    }
    unsigned char expected = tag_byte(block->tag);
    for (size_t i = start; i < block->size; i++)
        if (block->bytes[i] != expected)
            return false;
    return true;
}

static bool stress_release(stress_thread *self, const stress_block *block)
{
    if (!block_intact(block)) {
        snprintf(self->failure, sizeof(self->failure), "thread %u: block %p (tag %" PRIx64
                 ") was overwritten", self->id, (void *)block->bytes, block->tag);
        return false;
    }
    em_error err;
    if (em_pool_free(self->pool, (uintptr_t)block->bytes, &err) != EM_OK) {
        snprintf(self->failure, sizeof(self->failure), "thread %u: %s", self->id, err.message);
        return false;
    }
    return true;
}

static bool stress_allocate(stress_thread *self, em_test_rng *rng, stress_block *block)
{
    size_t size = random_size(rng, STRESS_MAX_BYTES);
    uintptr_t address = 0;
    em_error err;
    if (em_pool_alloc(self->pool, size, &address, &err) != EM_OK) {
        snprintf(self->failure, sizeof(self->failure), "thread %u: %s", self->id, err.message);
        return false;
    }
    *block = (stress_block){
        .bytes = (unsigned char *)address,
        .size = size,
        .tag = ((uint64_t)self->id << 32) | self->allocations++,
    };
    fill_block(block);
    return true;
}

static void *stress_run(void *argument)
{
    stress_thread *self = argument;
    em_test_rng rng;
    em_test_rng_init(&rng, self->seed);
    stress_block live[STRESS_MAX_LIVE];
    size_t live_count = 0;
    bool ok = true;
    for (int op = 0; ok && op < STRESS_OPERATIONS_PER_THREAD; op++) {
        bool allocate = live_count == 0 ||
                        (live_count < STRESS_MAX_LIVE && em_test_rng_below(&rng, 2) == 0);
        if (allocate) {
            ok = stress_allocate(self, &rng, &live[live_count]);
            live_count += ok;
        } else {
            size_t which = em_test_rng_below(&rng, live_count);
            ok = stress_release(self, &live[which]);
            live[which] = live[--live_count];
        }
    }
    while (ok && live_count > 0)
        ok = stress_release(self, &live[--live_count]);
    return NULL;
}

START_TEST(threads_share_a_pool)
{
    em_pool_options options = {
        .name = "cpu0",
        .initial_bytes = 8 * MiB,
        .growth_bytes = 8 * MiB,
        .limit_bytes = 1 * GiB,
        .provider = em_pool_host_provider(),
    };
    em_pool *pool = NULL;
    em_error err;
    ck_assert_int_eq(em_pool_create(&options, &pool, &err), EM_OK);
    stress_thread threads[STRESS_THREADS];
    pthread_t handles[STRESS_THREADS];
    for (unsigned t = 0; t < STRESS_THREADS; t++) {
        threads[t] = (stress_thread){.pool = pool, .id = t, .seed = em_test_seed() + t};
        ck_assert_int_eq(pthread_create(&handles[t], NULL, stress_run, &threads[t]), 0);
    }
    uint64_t allocations = 0;
    for (unsigned t = 0; t < STRESS_THREADS; t++) {
        ck_assert_int_eq(pthread_join(handles[t], NULL), 0);
        ck_assert_msg(threads[t].failure[0] == '\0', "%s", threads[t].failure);
        allocations += threads[t].allocations;
    }
    em_pool_stats stats = stats_of(pool);
    ck_assert_uint_eq(stats.total_allocations, allocations);
    ck_assert_uint_gt(allocations, STRESS_THREADS * STRESS_OPERATIONS_PER_THREAD / 3);
    ck_assert_uint_eq(stats.failed_allocations, 0);
    ck_assert_uint_gt(stats.peak_bytes_in_use, 0);
    assert_fully_coalesced(pool);
    em_pool_destroy(pool);
}
END_TEST

/* ---- host memory, the allocator handle, text output ---------------------- */

START_TEST(host_allocator_round_trip)
{
    em_pool_options options = {
        .name = "cpu0",
        .initial_bytes = 1 * MiB,
        .growth_bytes = 0,
        .limit_bytes = 1 * MiB,
        .provider = em_pool_host_provider(),
    };
    em_pool *pool = NULL;
    em_error err;
    ck_assert_int_eq(em_pool_create(&options, &pool, &err), EM_OK);
    em_allocator allocator = em_pool_host_allocator(pool);

    void *rows = NULL;
    ck_assert_int_eq(em_allocator_alloc(&allocator, 1000, "rows", &rows, &err), EM_OK);
    ck_assert_uint_eq((uintptr_t)rows % EM_POOL_ALIGNMENT, 0);
    memset(rows, 0xab, 1000);
    ck_assert_uint_eq(em_pool_allocation_size(pool, (uintptr_t)rows), 1024);
    ck_assert_uint_eq(stats_of(pool).bytes_in_use, 1024);

    void *empty = NULL;
    ck_assert_int_eq(em_allocator_alloc(&allocator, 0, "empty", &empty, &err), EM_OK);
    ck_assert_ptr_nonnull(empty);
    ck_assert_uint_eq(em_pool_allocation_size(pool, (uintptr_t)empty), 256);

    void *too_big = NULL;
    ck_assert_int_eq(em_allocator_alloc(&allocator, 2 * MiB, "slots", &too_big, &err),
                     EM_RESOURCE_EXHAUSTED);
    ck_assert(strncmp(err.message, "slots (2097152 bytes): pool 'cpu0': cannot allocate", 51)
              == 0);
    ck_assert_ptr_null(too_big);

    em_allocator_free(&allocator, rows);
    em_allocator_free(&allocator, empty);
    em_allocator_free(&allocator, NULL);
    assert_fully_coalesced(pool);
    em_pool_destroy(pool);
}
END_TEST

START_TEST(host_provider_failure_names_the_size)
{
    em_pool_region_provider provider = em_pool_host_provider();
    uintptr_t base = 0;
    em_error err;
    size_t absurd = (size_t)1 << 62;
    ck_assert_int_eq(provider.reserve(provider.context, absurd, &base, &err),
                     EM_RESOURCE_EXHAUSTED);
    ck_assert(strncmp(err.message, "mmap of 4611686018427387904 bytes (4.0 EiB) failed: ", 52)
              == 0);
    ck_assert_uint_gt(strlen(err.message), 52);
    ck_assert_int_eq(provider.reserve(provider.context, 1 * MiB, &base, &err), EM_OK);
    ck_assert_uint_eq(base % EM_POOL_ALIGNMENT, 0);
    memset((void *)base, 1, 1 * MiB);
    provider.release(provider.context, base, 1 * MiB);
}
END_TEST

START_TEST(dump_lists_regions_chunks_bins_and_stats)
{
    fake_provider fake = {0};
    em_pool_options options = fake_options(&fake, 64 * KiB, 0, 1 * MiB);
    options.name = "dumped";
    em_pool *pool = NULL;
    em_error err;
    ck_assert_int_eq(em_pool_create(&options, &pool, &err), EM_OK);
    uintptr_t first = must_alloc(pool, 1000);
    must_alloc(pool, 3000);
    must_free(pool, first);

    char *text = NULL;
    size_t length = 0;
    FILE *out = open_memstream(&text, &length);
    ck_assert_ptr_nonnull(out);
    em_pool_dump(pool, out);
    fclose(out);
    ck_assert_str_eq(text,
                     "pool 'dumped', regions: 1\n"
                     "region 0: base 0x10000000000, 65536 bytes (64.0 KiB)\n"
                     "  chunk 0x10000000000 size 1024 free\n"
                     "  chunk 0x10000000400 size 3072 requested 3000 in use\n"
                     "  chunk 0x10000001000 size 61440 free\n"
                     "bins:\n"
                     "  bin 2 [1.0 KiB, 2.0 KiB): free chunks 1\n"
                     "  bin 7 [32.0 KiB, 64.0 KiB): free chunks 1\n"
                     "stats: in use 3.0 KiB of 64.0 KiB reserved (limit 1.0 MiB), peak 4.0 KiB, "
                     "largest free block 60.0 KiB, fragmentation 0.02, free chunks 2, regions 1, "
                     "live allocations 1, failed allocations 0\n");
    free(text);
    em_pool_destroy(pool);
}
END_TEST

START_TEST(format_stats_writes_one_line)
{
    em_pool_stats stats = {
        .bytes_in_use = 1536 * KiB,
        .peak_bytes_in_use = 2 * GiB,
        .bytes_reserved = 64 * MiB,
        .bytes_limit = 1 * GiB,
        .bytes_free = 64 * MiB - 1536 * KiB,
        .largest_free_block = 100,
        .live_allocations = 7,
        .failed_allocations = 3,
        .free_chunks = 5,
        .region_count = 2,
        .fragmentation = 0.25,
    };
    char line[512];
    int length = em_pool_format_stats(&stats, line, sizeof(line));
    const char *expected = "in use 1.5 MiB of 64.0 MiB reserved (limit 1.0 GiB), peak 2.0 GiB, "
                           "largest free block 100 B, fragmentation 0.25, free chunks 5, "
                           "regions 2, live allocations 7, failed allocations 3";
    ck_assert_str_eq(line, expected);
    ck_assert_int_eq(length, (int)strlen(expected));
    char small[10];
    ck_assert_int_eq(em_pool_format_stats(&stats, small, sizeof(small)), length);
    ck_assert_str_eq(small, "in use 1.");
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("pool");
    TCase *basics = tcase_create("basics");
    tcase_add_test(basics, create_reserves_the_initial_region);
    tcase_add_test(basics, allocations_are_rounded_and_aligned);
    tcase_add_test(basics, peak_tracks_the_highest_use);
    tcase_add_test(basics, best_fit_takes_the_smallest_hole_that_fits);
    tcase_add_test(basics, equal_holes_go_lowest_address_first);
    tcase_add_test(basics, best_fit_inside_one_bin);
    tcase_add_test(basics, no_fit_in_its_bin_takes_the_smallest_of_the_next_bin);
    tcase_add_test(basics, free_coalesces_with_left_right_and_both_neighbours);
    tcase_add_test(basics, exact_fit_leaves_no_remainder);
    tcase_add_test(basics, growth_adds_regions_up_to_the_limit);
    tcase_add_test(basics, first_region_comes_on_demand);
    tcase_add_test(basics, limit_is_usable_to_the_last_byte);
    tcase_add_test(basics, disabled_growth_fails_when_full);
    suite_add_tcase(suite, basics);

    TCase *failures = tcase_create("failures");
    tcase_add_test(failures, out_of_memory_reports_the_statistics);
    tcase_add_test(failures, huge_requests_fail_cleanly);
    tcase_add_test(failures, zero_bytes_is_an_invalid_argument);
    tcase_add_test(failures, invalid_and_double_free_change_nothing);
    tcase_add_test(failures, invalid_options_are_rejected);
    tcase_add_test(failures, provider_failures_are_reported);
    tcase_add_test(failures, misaligned_region_bases_are_refused);
    tcase_add_test(failures, destroy_releases_every_region);
    suite_add_tcase(suite, failures);

    TCase *random = tcase_create("random");
    tcase_set_timeout(random, 120);
    tcase_add_test(random, random_sequences_match_the_model);
    tcase_add_test(random, threads_share_a_pool);
    suite_add_tcase(suite, random);

    TCase *host = tcase_create("host");
    tcase_add_test(host, host_allocator_round_trip);
    tcase_add_test(host, host_provider_failure_names_the_size);
    tcase_add_test(host, dump_lists_regions_chunks_bins_and_stats);
    tcase_add_test(host, format_stats_writes_one_line);
    suite_add_tcase(suite, host);
    return em_test_run(suite);
}
