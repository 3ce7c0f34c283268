/*
 * Eviction (lib/table/table_config.h): each policy against an exact model of its rule,
 * the request's own rows kept, all-or-nothing when no room can be made, determinism
 * across runs and shard counts, snapshots seeing evicted rows as they were, and the
 * counters adding up under concurrent pushes.
 *
 * With `candidates` at least the rows of a shard, a shard compares every row, so the
 * table follows its policy exactly and the model must agree key for key.
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/keyhash.h"
#include "lib/device/backend.h"
#include "lib/table/table.h"
#include "tests/support/test_batches.h"
#include "tests/support/test_support.h"

#define MEBIBYTE (UINT64_C(1) << 20)
#define DIM 4

#ifdef EMBER_TEST_CUDA_BACKEND
#include "tests/support/kernels_emulated.h"

/* The same suite on the CUDA backend (tests/unit/meson.build: eviction_emulated_cuda
 * runs it over the emulated kernels). */
static em_backend *make_backend(uint32_t devices)
{
    em_cuda_backend_options options;
    em_cuda_backend_options_init(&options);
    options.device_count = devices;
    for (uint32_t d = 0; d < devices; d++)
        options.devices[d] = d;
    /* small: the emulation protects the whole pool around every kernel */
    options.pool_bytes = 16 * MEBIBYTE;
    options.staging_bytes = 1 * MEBIBYTE;
    em_backend *backend = NULL;
    em_error err;
    ck_assert_msg(em_backend_create_cuda(&options, &backend, &err) == EM_OK, "%s", err.message);
    return backend;
}
#else
static em_backend *make_backend(uint32_t devices)
{
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.devices = devices;
    options.pool_limit_bytes = 256 * MEBIBYTE;
    options.pool_initial_bytes = 16 * MEBIBYTE;
    options.pool_growth_bytes = 16 * MEBIBYTE;
    em_backend *backend = NULL;
    em_error err;
    ck_assert_msg(em_backend_create_cpu(&options, &backend, &err) == EM_OK, "%s", err.message);
    return backend;
}
#endif

static em_table_config policy_config(uint64_t capacity, uint32_t shards,
                                     em_eviction_policy policy, uint32_t candidates)
{
    em_table_config config;
    em_table_config_init(&config, "t", DIM, capacity);
    config.shards = shards;
    config.optimizer = em_test_optimizers[1];
    config.initializer.seed = 99;
    config.eviction.policy = policy;
    config.eviction.candidates = candidates;
    return config;
}

static em_table *make_table(em_backend *backend, uint64_t capacity, uint32_t shards,
                            em_eviction_policy policy, uint32_t candidates)
{
    em_table_config config = policy_config(capacity, shards, policy, candidates);
    return em_test_make_table(backend, &config);
}

/* One request of the streams below: its keys (distinct), pull or push. */
static em_status run_request(em_table *table, const uint64_t *keys, uint32_t n, bool push,
                             em_error *err)
{
    uint32_t offsets[65];
    float values[64 * DIM];
    ck_assert_uint_le(n, 64);
    for (uint32_t i = 0; i <= n; i++)
        offsets[i] = i;
    for (uint32_t i = 0; i < n * DIM; i++)
        values[i] = 0.01f;
    em_csr batch = {.rows = n, .nnz = n, .offsets = offsets, .keys = keys};
    if (push)
        return em_test_push(table, &batch, EM_COMBINER_NONE, values, NULL, err);
    return em_test_pull(table, &batch, EM_COMBINER_NONE, true, values, NULL, err);
}

/* ---- the exact model ------------------------------------------------------------------ */

typedef struct model_row {
    uint64_t key;
    uint64_t accessed;
    uint64_t frequency;
    uint64_t updated; /* push clock of the last push, or at creation */
} model_row;

typedef struct model {
    em_eviction_policy policy;
    uint64_t capacity, count, clock, push_clock, evicted;
    uint64_t headroom;       /* rows an eviction frees beyond the need (one shard) */
    uint64_t evicting_requests; /* requests that evicted */
    model_row *rows;
} model;

static model model_make(em_eviction_policy policy, uint64_t capacity)
{
    model m = {.policy = policy, .capacity = capacity};
    m.rows = calloc(capacity, sizeof(*m.rows));
    return m;
}

static int64_t model_find(const model *m, uint64_t key)
{
    for (uint64_t i = 0; i < m->count; i++)
        if (m->rows[i].key == key)
            return (int64_t)i;
    return -1;
}

/* The documented rule: whether a goes before b. */
static bool model_goes_first(const model *m, const model_row *a, const model_row *b)
{
    if (m->policy == EM_EVICTION_LFU && a->frequency != b->frequency)
        return a->frequency < b->frequency;
    if (m->policy == EM_EVICTION_AGE) {
        uint64_t age_a = m->push_clock - a->updated, age_b = m->push_clock - b->updated;
        if (age_a != age_b)
            return age_a > age_b;
    }
    return a->accessed < b->accessed;
}

static bool in_request(const uint64_t *keys, uint32_t n, uint64_t key)
{
    for (uint32_t i = 0; i < n; i++)
        if (keys[i] == key)
            return true;
    return false;
}

static void model_request(model *m, const uint64_t *keys, uint32_t n, bool push)
{
    m->clock++;
    uint64_t fresh = 0;
    for (uint32_t i = 0; i < n; i++)
        fresh += model_find(m, keys[i]) < 0;
    uint64_t need = m->count + fresh > m->capacity ? m->count + fresh - m->capacity : 0;
    if (need > 0) {
        m->evicting_requests++;
        need += m->headroom; /* as far as rows outside the request go */
    }
    for (uint64_t gone = 0; gone < need; gone++) {
        int64_t victim = -1;
        for (uint64_t i = 0; i < m->count; i++)
            if (!in_request(keys, n, m->rows[i].key) &&
                (victim < 0 || model_goes_first(m, &m->rows[i], &m->rows[victim])))
                victim = (int64_t)i;
        if (victim < 0 && gone >= need - m->headroom)
            break; /* headroom takes only what there is */
        ck_assert_int_ge(victim, 0);
        m->rows[victim] = m->rows[--m->count];
        m->evicted++;
    }
    if (push)
        m->push_clock++;
    for (uint32_t i = 0; i < n; i++) {
        int64_t at = model_find(m, keys[i]);
        if (at < 0) {
            at = (int64_t)m->count++;
            m->rows[at] = (model_row){.key = keys[i], .updated = m->push_clock};
        }
        m->rows[at].accessed = m->clock;
        m->rows[at].frequency++;
        if (push)
            m->rows[at].updated = m->push_clock;
    }
}

static int compare_keys(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void assert_keys_match_model(em_table *table, const model *m, uint64_t step)
{
    em_test_snapshot s = em_test_snapshot_take(table, 64);
    uint64_t *expected = malloc((m->count + 1) * sizeof(uint64_t));
    for (uint64_t i = 0; i < m->count; i++)
        expected[i] = m->rows[i].key;
    qsort(expected, m->count, sizeof(uint64_t), compare_keys);
    ck_assert_msg(s.count == m->count, "after request %" PRIu64 ": %" PRIu64 " rows, model %" PRIu64,
                  step, s.count, m->count);
    for (uint64_t i = 0; i < s.count; i++)
        ck_assert_msg(s.keys[i] == expected[i],
                      "after request %" PRIu64 ": row %" PRIu64 " is key %" PRIu64
                      ", the model has %" PRIu64,
                      step, i, s.keys[i], expected[i]);
    free(expected);
    em_test_snapshot_free(&s);
}

/* 1,500 one-key pulls and pushes (a third pushes) over three times the model's capacity,
 * half of them to the first 16 keys, into the table and the model, the rows compared
 * every 50. One key a request gives every row a last access of its own: no ties. */
static void run_skewed_stream(em_table *table, model *m, uint64_t seed)
{
    em_test_rng rng;
    em_test_rng_init(&rng, seed);
    em_error err;
    for (uint64_t step = 1; step <= 1500; step++) {
        uint64_t key = em_test_rng_below(&rng, 2) == 0 ? em_test_rng_below(&rng, 16)
                                                       : em_test_rng_below(&rng, 3 * m->capacity);
        bool push = em_test_rng_below(&rng, 3) == 0;
        ck_assert_msg(run_request(table, &key, 1, push, &err) == EM_OK, "%s", err.message);
        model_request(m, &key, 1, push);
        if (step % 50 == 0)
            assert_keys_match_model(table, m, step);
    }
}

/* ---- tests ------------------------------------------------------------------------------ */

static const em_eviction_policy policies[] = {EM_EVICTION_LRU, EM_EVICTION_LFU, EM_EVICTION_AGE};

/* Loop index: the policy. Single-key pulls and pushes over a skewed universe of three
 * times the capacity, every row compared (candidates 1024), against the model. */
START_TEST(each_policy_follows_its_rule_exactly)
{
    em_eviction_policy policy = policies[_i];
    const uint64_t capacity = 48;
    em_backend *backend = make_backend(1);
    em_table *table = make_table(backend, capacity, 1, policy, 1024);
    model m = model_make(policy, capacity);
    run_skewed_stream(table, &m, em_test_seed() + (uint64_t)_i);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, capacity);
    ck_assert_uint_eq(stats.rows_evicted, m.evicted);
    ck_assert_uint_eq(stats.rows_created, stats.rows + stats.rows_evicted);
    ck_assert_uint_eq(stats.access_bytes % 16, 0);
    ck_assert_uint_ge(stats.access_bytes, capacity * 16);
    ck_assert_double_eq_tol(stats.access_bytes_per_row,
                            (double)stats.access_bytes / (double)stats.rows, 1e-9);
    ck_assert_double_eq_tol(stats.index_bytes_per_row,
                            (double)stats.index_bytes / (double)stats.rows, 1e-9);
    ck_assert_double_ge(stats.access_bytes_per_row, 16.0);
    /* blocks of rows no larger than the table needs: 64 rows hold its 48 */
    ck_assert_uint_le(stats.access_bytes, 64 * 16);
    ck_assert_uint_eq(stats.index_rehashes_through_host, 0); /* never on these backends */
    free(m.rows);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* Loop index: the policy. The stream of each_policy_follows_its_rule_exactly into a
 * table with headroom 0.125: an eviction frees the 6 rows next by the rule too (one
 * shard), so only the requests that evict run again alone (exclusive_retries), and the
 * ones between them create their keys in the room left. */
START_TEST(headroom_frees_the_next_rows_by_the_rule_too)
{
    em_eviction_policy policy = policies[_i];
    const uint64_t capacity = 48;
    em_backend *backend = make_backend(1);
    em_table_config config;
    em_table_config_init(&config, "t", DIM, capacity);
    config.shards = 1;
    config.optimizer = em_test_optimizers[1];
    config.initializer.seed = 99;
    config.eviction.policy = policy;
    config.eviction.candidates = 1024;
    config.eviction.headroom = 0.125;
    em_table *table = em_test_make_table(backend, &config);
    model m = model_make(policy, capacity);
    m.headroom = 6;
    run_skewed_stream(table, &m, em_test_seed() + 10 + (uint64_t)_i);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, m.count);
    ck_assert_uint_eq(stats.rows_evicted, m.evicted);
    ck_assert_uint_eq(stats.rows_created, stats.rows + stats.rows_evicted);
    ck_assert_uint_gt(m.evicting_requests, 10);
    ck_assert_uint_eq(stats.exclusive_retries, m.evicting_requests);
    free(m.rows);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* An lru table of `shards` (candidates above its rows, headroom as given) filled with the
 * keys 1 to capacity, a request each (pushes, or pulls that create). */
static em_table *filled_lru_table(em_backend *backend, uint64_t capacity, uint32_t shards,
                                  double headroom, bool push)
{
    em_table_config config = policy_config(capacity, shards, EM_EVICTION_LRU, 1024);
    config.eviction.headroom = headroom;
    em_table *table = em_test_make_table(backend, &config);
    em_error err;
    for (uint64_t key = 1; key <= capacity; key++)
        ck_assert_int_eq(run_request(table, &key, 1, push, &err), EM_OK);
    return table;
}

/* Loop index: pulls (0) or pushes (1). Once 4 requests of a kind in a row made room,
 * the next ones take the table alone from the start (requests_alone_first) instead of
 * trying beside the others first (exclusive_retries), evicting the same rows: with one
 * shard and candidates above the capacity the oldest go, one each time. The first of
 * them that makes no room sends the next ones beside the others again; requests of the
 * other kind keep their own count. */
START_TEST(requests_that_keep_making_room_go_alone_first)
{
    const bool push = _i == 1;
    const uint64_t capacity = 32;
    em_backend *backend = make_backend(1);
    em_table *table = filled_lru_table(backend, capacity, 1, 0.0, push);
    em_error err;
    em_table_stats stats;
    uint64_t fresh = 1000;
    for (uint32_t i = 1; i <= 6; i++, fresh++) {
        ck_assert_msg(run_request(table, &fresh, 1, push, &err) == EM_OK, "%s", err.message);
        em_table_get_stats(table, &stats);
        ck_assert_uint_eq(stats.rows_evicted, i);
        ck_assert_uint_eq(stats.exclusive_retries, i < 4 ? i : 4);
        ck_assert_uint_eq(stats.requests_alone_first, i < 4 ? 0 : i - 4);
    }
    /* the other kind tries beside the others first: it finds its key stored */
    uint64_t stored = capacity;
    ck_assert_int_eq(run_request(table, &stored, 1, !push, &err), EM_OK);
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.requests_alone_first, 2);
    /* alone first, it makes no room: the next one goes beside the others */
    for (uint32_t i = 0; i < 2; i++)
        ck_assert_int_eq(run_request(table, &stored, 1, push, &err), EM_OK);
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.requests_alone_first, 3);
    ck_assert_uint_eq(stats.exclusive_retries, 4);
    ck_assert_int_eq(run_request(table, &fresh, 1, push, &err), EM_OK);
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.exclusive_retries, 5);
    ck_assert_uint_eq(stats.rows, capacity);
    /* the 7 oldest keys went, in that order */
    uint64_t evicted[16];
    em_evicted_view view;
    ck_assert_int_eq(em_table_evicted(table, 0, 16, evicted, &view, &err), EM_OK);
    ck_assert_uint_eq(view.count, 7);
    for (uint64_t i = 0; i < view.count; i++)
        ck_assert_uint_eq(evicted[i], i + 1);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* Rows of each of a table's shards, by its keys' shard (common/keyhash.h). */
static void rows_per_shard(em_table *table, uint32_t shards, uint64_t *rows)
{
    em_test_snapshot s = em_test_snapshot_take(table, 5);
    memset(rows, 0, shards * sizeof(*rows));
    for (uint64_t i = 0; i < s.count; i++)
        rows[em_key_shard(s.keys[i], shards)]++;
    em_test_snapshot_free(&s);
}

/* Headroom over several shards: each gives its share by its rows, the table holds
 * capacity - headroom x capacity rows after an eviction, and the next keys fill that
 * room beside each other, no request running alone until the table is full again. */
START_TEST(headroom_comes_from_every_shard_by_its_rows)
{
    const uint64_t capacity = 400;
    em_backend *backend = make_backend(2);
    em_table *table = filled_lru_table(backend, capacity, 4, 0.1, true);
    em_error err;
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, capacity);
    ck_assert_uint_eq(stats.exclusive_retries, 0);
    uint64_t before[4], after[4];
    rows_per_shard(table, 4, before);
    uint64_t fresh = 100000;
    ck_assert_msg(run_request(table, &fresh, 1, true, &err) == EM_OK, "%s", err.message);
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, capacity - 40);
    ck_assert_uint_eq(stats.rows_evicted, 41);
    ck_assert_uint_eq(stats.exclusive_retries, 1);
    /* the new key's shard gave one row for it; every shard its share of the 40 */
    uint32_t home = em_key_shard(fresh, 4);
    rows_per_shard(table, 4, after);
    uint64_t evicted[64], evicted_from[4] = {0};
    em_evicted_view view;
    ck_assert_int_eq(em_table_evicted(table, 0, 64, evicted, &view, &err), EM_OK);
    ck_assert_uint_eq(view.count, 41);
    for (uint64_t i = 0; i < view.count; i++)
        evicted_from[em_key_shard(evicted[i], 4)]++;
    uint64_t given = 0;
    for (uint32_t s = 0; s < 4; s++) {
        /* the home shard: one row more (the new key) and one less (made room for it) */
        uint64_t share = before[s] - after[s];
        ck_assert_uint_eq(evicted_from[s], share + (s == home));
        ck_assert_msg(share >= 40 * before[s] / capacity && share <= 40 * before[s] / capacity + 1,
                      "shard %u (%" PRIu64 " rows) gave %" PRIu64, s, before[s], share);
        given += share;
    }
    ck_assert_uint_eq(given, 40);
    /* the room is filled beside other requests: no one runs alone */
    for (uint64_t key = 200000; key < 200040; key++)
        ck_assert_int_eq(run_request(table, &key, 1, key % 2 == 0, &err), EM_OK);
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, capacity);
    ck_assert_uint_eq(stats.exclusive_retries, 1);
    ck_assert_uint_eq(stats.rows_evicted, 41);
    uint64_t last = 300000;
    ck_assert_int_eq(run_request(table, &last, 1, true, &err), EM_OK);
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.exclusive_retries, 2);
    ck_assert_uint_eq(stats.rows, capacity - 40);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* Loop index: the table's shards (1 or 4). A push into a full table whose step would
 * overflow a row (an adagrad accumulator past the float range) is refused whole,
 * naming the key: nothing is evicted, created or stepped, whether it tried beside the
 * others first or, after requests that kept making room, went alone first, and whether
 * the row is a stored key's or a new key's (its initial value stepped). */
START_TEST(a_refused_push_into_a_full_table_evicts_nothing)
{
    const uint32_t shards = _i == 0 ? 1 : 4;
    const uint64_t capacity = 32;
    em_backend *backend = make_backend(1);
    em_table *table = filled_lru_table(backend, capacity, shards, 0.0, true);
    em_error err;
    uint64_t fresh = 1000;
    for (int round = 0; round < 2; round++) {
        /* round 1: after 4 pushes that made room, the refused ones go alone first */
        for (int i = 0; round == 1 && i < 4; i++, fresh++)
            ck_assert_int_eq(run_request(table, &fresh, 1, true, &err), EM_OK);
        em_table_stats before_stats;
        em_table_get_stats(table, &before_stats);
        for (int bad = 0; bad < 2; bad++) {
            /* a new key and a stored one; the huge gradient is the stored key's (bad 0)
             * or the new key's (bad 1) */
            uint64_t keys[2] = {fresh + 100, round == 0 ? 7 : fresh - 1};
            uint32_t offsets[3] = {0, 1, 2};
            float gradients[2 * DIM];
            for (uint32_t i = 0; i < 2 * DIM; i++)
                gradients[i] = 0.01f;
            gradients[(bad == 0 ? 1 : 0) * DIM + 2] = 1e35f;
            em_csr batch = {.rows = 2, .nnz = 2, .offsets = offsets, .keys = keys};
            em_test_snapshot before = em_test_snapshot_take(table, 7);
            ck_assert_int_eq(em_test_push(table, &batch, EM_COMBINER_NONE, gradients, NULL, &err),
                             EM_INVALID_ARGUMENT);
            char expected[160]; /* the same words on every backend */
            snprintf(expected, sizeof(expected),
                     "push to table 't': key %" PRIu64 ": this adagrad step would make its "
                     "accumulator (state float 2) non-finite; nothing was applied",
                     keys[bad == 0 ? 1 : 0]);
            ck_assert_str_eq(err.message, expected);
            em_test_assert_table_unchanged(table, &before);
            em_test_snapshot_free(&before);
        }
        em_table_stats stats;
        em_table_get_stats(table, &stats);
        ck_assert_uint_eq(stats.rows, capacity);
        ck_assert_uint_eq(stats.rows_evicted, before_stats.rows_evicted);
        ck_assert_uint_eq(stats.rows_created, before_stats.rows_created);
        ck_assert_uint_eq(stats.requests_alone_first,
                          before_stats.requests_alone_first + (round == 1 ? 2 : 0));
    }
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(a_request_never_evicts_its_own_rows)
{
    em_backend *backend = make_backend(1);
    em_table *table = make_table(backend, 8, 1, EM_EVICTION_LRU, 1024);
    em_error err;
    for (uint64_t key = 1; key <= 8; key++)
        ck_assert_int_eq(run_request(table, &key, 1, false, &err), EM_OK);
    /* key 1 is the least recent row, but this request reads it: key 2 goes instead */
    uint64_t keys[] = {1, 100};
    ck_assert_msg(run_request(table, keys, 2, true, &err) == EM_OK, "%s", err.message);
    em_test_snapshot s = em_test_snapshot_take(table, 3);
    const uint64_t expected[] = {1, 3, 4, 5, 6, 7, 8, 100};
    ck_assert_uint_eq(s.count, 8);
    for (int i = 0; i < 8; i++)
        ck_assert_uint_eq(s.keys[i], expected[i]);
    em_test_snapshot_free(&s);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* Loop index: the policy. One request that creates ten keys evicts, in one call, the
 * ten rows first by the policy among those it does not use (the window of 10 x 64 map
 * entries covers the shard). Keys 1..48 are pushed one by one, then 5..14 again: keys
 * 1..4 and 15..48 are older, less frequent and less recently pushed than 5..14. */
START_TEST(a_request_evicts_the_rows_first_by_the_policy_at_once)
{
    em_eviction_policy policy = policies[_i];
    em_backend *backend = make_backend(1);
    em_table *table = make_table(backend, 48, 1, policy, 64);
    em_error err;
    for (uint64_t key = 1; key <= 48; key++)
        ck_assert_int_eq(run_request(table, &key, 1, true, &err), EM_OK);
    for (uint64_t key = 5; key <= 14; key++)
        ck_assert_int_eq(run_request(table, &key, 1, true, &err), EM_OK);
    uint64_t keys[12] = {1, 2};
    for (int i = 0; i < 10; i++)
        keys[2 + i] = 100 + (uint64_t)i;
    ck_assert_msg(run_request(table, keys, 12, true, &err) == EM_OK, "%s", err.message);
    /* gone: 3, 4 and 15..22 */
    uint64_t expected[48], count = 0;
    expected[count++] = 1;
    expected[count++] = 2;
    for (uint64_t key = 5; key <= 14; key++)
        expected[count++] = key;
    for (uint64_t key = 23; key <= 48; key++)
        expected[count++] = key;
    for (uint64_t key = 100; key < 110; key++)
        expected[count++] = key;
    em_test_snapshot s = em_test_snapshot_take(table, 7);
    ck_assert_uint_eq(s.count, count);
    for (uint64_t i = 0; i < count; i++)
        ck_assert_msg(s.keys[i] == expected[i], "row %" PRIu64 ": key %" PRIu64 ", want %" PRIu64,
                      i, s.keys[i], expected[i]);
    uint64_t evicted[16];
    em_evicted_view view;
    ck_assert_int_eq(em_table_evicted(table, 0, 16, evicted, &view, &err), EM_OK);
    ck_assert_uint_eq(view.count, 10);
    qsort(evicted, view.count, sizeof(uint64_t), compare_keys);
    const uint64_t gone[10] = {3, 4, 15, 16, 17, 18, 19, 20, 21, 22};
    for (int i = 0; i < 10; i++)
        ck_assert_uint_eq(evicted[i], gone[i]);
    em_test_snapshot_free(&s);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* ---- the chooser alone (lib/device/eviction.h em_evict_choose) ------------------------- */

/* A walk over entries made up here: entry i has key keys[i], row i and access[i]. */
typedef struct made_walk {
    const uint64_t *keys;
    const em_row_access *access;
    uint64_t n, next;
} made_walk;

static em_status made_walk_next(void *context, uint64_t max, uint64_t *keys, uint64_t *rows,
                                em_row_access *access, uint64_t *got, em_error *err)
{
    (void)err;
    made_walk *w = context;
    *got = 0;
    for (; *got < max && w->next < w->n; w->next++, (*got)++) {
        keys[*got] = w->keys[w->next];
        rows[*got] = w->next;
        access[*got] = w->access[w->next];
    }
    return EM_OK;
}

/* The documented order (table_config.h), written out: whether entry a goes before b. */
static const em_evict_spec *order_spec;
static const uint64_t *order_keys;
static const em_row_access *order_access;

static int compare_by_rule(const void *pa, const void *pb)
{
    uint64_t a = *(const uint64_t *)pa, b = *(const uint64_t *)pb;
    const em_row_access *x = &order_access[a], *y = &order_access[b];
    uint64_t first_x = 0, first_y = 0; /* larger goes later */
    if (order_spec->policy == EM_EVICTION_LFU) {
        first_x = x->frequency;
        first_y = y->frequency;
    } else if (order_spec->policy == EM_EVICTION_AGE) { /* the older push goes first */
        first_x = UINT32_MAX - (uint32_t)(order_spec->update_clock - x->updated);
        first_y = UINT32_MAX - (uint32_t)(order_spec->update_clock - y->updated);
    }
    if (first_x != first_y)
        return first_x < first_y ? -1 : 1;
    if (x->accessed != y->accessed)
        return x->accessed < y->accessed ? -1 : 1;
    return order_keys[a] < order_keys[b] ? -1 : order_keys[a] > order_keys[b] ? 1 : 0;
}

/* Loop index: the policy, and how many distinct ranks the entries have. The chooser's
 * choice over windows small and large (pools cut several times, the k-th row among many
 * equal ranks or among distinct ones), with some rows kept (rows a request uses), is
 * the count first by the rule among the rows of the window it does not keep, where the
 * window is count x candidates entries, going on a block at a time while fewer than
 * count of them may go. */
START_TEST(the_chooser_takes_the_rows_first_by_the_rule_in_its_window)
{
    static const uint64_t spreads[3] = {3, 40, UINT64_C(1) << 40};
    const uint64_t n = 120000;
    uint64_t *keys = malloc(n * sizeof(uint64_t));
    em_row_access *access = malloc(n * sizeof(em_row_access));
    uint64_t *order = malloc(n * sizeof(uint64_t));
    uint64_t *chosen_keys = malloc(n * sizeof(uint64_t)), *chosen_rows = malloc(n * sizeof(uint64_t));
    uint64_t *kept = malloc(n * sizeof(uint64_t));
    uint8_t *is_kept = calloc(n, 1);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + (uint64_t)_i);
    uint64_t spread = spreads[_i % 3];
    for (uint64_t i = 0; i < n; i++) {
        keys[i] = em_mix64(i + 1); /* distinct */
        access[i].accessed = em_test_rng_next(&rng) % spread;
        access[i].updated = (uint32_t)(em_test_rng_next(&rng) % spread);
        access[i].frequency = (uint32_t)(em_test_rng_next(&rng) % spread);
    }
    static const struct {
        uint64_t count;
        uint32_t candidates;
        uint64_t kept;
    } shapes[] = {{1, 16, 0}, {7, 4, 3}, {1000, 16, 0}, {1365, 8, 200}, {6000, 16, 0},
                  {6000, 4, 5000}, {20000, 2, 0}, {20000, 1, 15000}, {30000, 16, 1000}};
    for (size_t t = 0; t < sizeof(shapes) / sizeof(shapes[0]); t++) {
        memset(is_kept, 0, n);
        for (uint64_t i = 0; i < shapes[t].kept; i++) {
            kept[i] = em_test_rng_next(&rng) % (n / 2); /* repeats allowed */
            is_kept[kept[i]] = 1;
        }
        em_evict_spec spec = {.policy = policies[_i / 3],
                              .candidates = shapes[t].candidates,
                              .count = shapes[t].count,
                              .update_clock = (uint32_t)spread + 5,
                              .kept = kept,
                              .kept_count = shapes[t].kept};
        made_walk walk = {keys, access, n, 0};
        em_error err;
        ck_assert_msg(em_evict_choose(&spec, made_walk_next, &walk, chosen_keys, chosen_rows,
                                      &err) == EM_OK, "%s", err.message);
        /* the window: count x candidates entries, then blocks while too few may go */
        uint64_t window = spec.count * spec.candidates, may_go = 0; /* every entry at most */
        window = window < n ? window : n;
        for (uint64_t i = 0; i < window; i++)
            may_go += !is_kept[i];
        while (may_go < spec.count) {
            uint64_t end = window + EM_EVICT_BLOCK < n ? window + EM_EVICT_BLOCK : n;
            for (uint64_t i = window; i < end; i++)
                may_go += !is_kept[i];
            window = end;
        }
        uint64_t m = 0;
        for (uint64_t i = 0; i < window; i++)
            if (!is_kept[i])
                order[m++] = i;
        order_spec = &spec;
        order_keys = keys;
        order_access = access;
        qsort(order, m, sizeof(uint64_t), compare_by_rule);
        for (uint64_t v = 0; v < spec.count; v++)
            ck_assert_uint_eq(chosen_keys[v], keys[chosen_rows[v]]);
        qsort(chosen_rows, spec.count, sizeof(uint64_t), compare_keys);
        qsort(order, spec.count, sizeof(uint64_t), compare_keys);
        for (uint64_t v = 0; v < spec.count; v++) {
            ck_assert_msg(chosen_rows[v] == order[v],
                          "shape %zu: chosen row %" PRIu64 " of %" PRIu64 " is %" PRIu64
                          ", the rule's %" PRIu64, t, v, spec.count, chosen_rows[v], order[v]);
        }
    }
    free(keys);
    free(access);
    free(order);
    free(chosen_keys);
    free(chosen_rows);
    free(kept);
    free(is_kept);
}
END_TEST

/* A full table takes its new keys' rows from the ones it evicts: its storage stays that
 * of its capacity (one block of 32,768 rows here) however many keys come through. */
START_TEST(a_full_table_keeps_the_storage_of_its_capacity)
{
    enum { CAPACITY = 32768, BATCH = 4096 };
    em_backend *backend = make_backend(1);
    em_table *table = make_table(backend, CAPACITY, 1, EM_EVICTION_LRU, 16);
    uint64_t *keys = malloc(BATCH * sizeof(uint64_t));
    uint32_t *offsets = malloc((BATCH + 1) * sizeof(uint32_t));
    float *values = malloc((size_t)BATCH * DIM * sizeof(float));
    for (uint32_t i = 0; i <= BATCH; i++)
        offsets[i] = i;
    for (size_t i = 0; i < (size_t)BATCH * DIM; i++)
        values[i] = 0.01f;
    em_table_stats full = {0}, stats;
    em_error err;
    for (uint64_t batch = 0; batch < 2 * CAPACITY / BATCH; batch++) {
        for (uint64_t i = 0; i < BATCH; i++)
            keys[i] = batch * BATCH + i;
        em_csr csr = {.rows = BATCH, .nnz = BATCH, .offsets = offsets, .keys = keys};
        ck_assert_msg(em_test_push(table, &csr, EM_COMBINER_NONE, values, NULL, &err) == EM_OK,
                      "%s", err.message);
        if (batch + 1 == CAPACITY / BATCH)
            em_table_get_stats(table, &full);
    }
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, CAPACITY);
    ck_assert_uint_eq(stats.rows_evicted, CAPACITY);
    ck_assert_uint_eq(stats.row_bytes, full.row_bytes);
    ck_assert_uint_eq(stats.access_bytes, full.access_bytes);
    ck_assert_uint_ge(stats.access_bytes, CAPACITY * 16);
    free(keys);
    free(offsets);
    free(values);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(no_room_to_make_fails_whole)
{
    em_backend *backend = make_backend(1);
    em_table *table = make_table(backend, 4, 1, EM_EVICTION_LRU, 16);
    em_error err;
    uint64_t full[] = {1, 2, 3, 4};
    ck_assert_int_eq(run_request(table, full, 4, true, &err), EM_OK);
    em_test_snapshot before = em_test_snapshot_take(table, 2);
    /* five new keys cannot fit a table of four, whatever leaves */
    uint64_t five[] = {10, 11, 12, 13, 14};
    ck_assert_int_eq(run_request(table, five, 5, false, &err), EM_RESOURCE_EXHAUSTED);
    ck_assert_msg(strstr(err.message, "table 't': full (capacity 4, 4 rows): this request creates "
                                      "5 keys and the table holds only 4 rows it "
                                      "does not use, 1 short of making room; nothing was "
                                      "applied") != NULL,
                  "%s", err.message);
    em_test_assert_table_unchanged(table, &before);
    /* three of its rows in use and two new keys: one row may leave, two must */
    uint64_t mixed[] = {1, 2, 3, 20, 21};
    ck_assert_int_eq(run_request(table, mixed, 5, true, &err), EM_RESOURCE_EXHAUSTED);
    em_test_assert_table_unchanged(table, &before);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows_evicted, 0);
    /* one new key with three in use: key 4 leaves */
    uint64_t fits[] = {1, 2, 3, 30};
    ck_assert_int_eq(run_request(table, fits, 4, true, &err), EM_OK);
    em_test_snapshot after = em_test_snapshot_take(table, 2);
    ck_assert_uint_eq(after.count, 4);
    ck_assert_uint_eq(after.keys[3], 30);
    em_test_snapshot_free(&after);
    em_test_snapshot_free(&before);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* New keys that all fall in one shard, more of them than that shard holds: the shard
 * gives up every row it has, the others the rest, in shard order; the table stays at
 * its capacity, and every row evicted is counted and in the ring. */
START_TEST(room_comes_from_other_shards_when_the_keys_shard_holds_too_few)
{
    enum { CAPACITY = 64, SHARDS = 4, NEW = 30 };
    em_backend *backend = make_backend(2);
    em_table *table = make_table(backend, CAPACITY, SHARDS, EM_EVICTION_LRU, 16);
    em_error err;
    for (uint64_t key = 1; key <= CAPACITY; key += 8) {
        uint64_t keys[8];
        for (uint32_t i = 0; i < 8; i++)
            keys[i] = key + i;
        ck_assert_int_eq(run_request(table, keys, 8, true, &err), EM_OK);
    }
    uint64_t before[SHARDS], after[SHARDS];
    rows_per_shard(table, SHARDS, before);
    uint32_t target = 0; /* the fullest shard holds fewer than NEW rows */
    ck_assert_uint_lt(before[target], NEW);
    uint64_t fresh[NEW];
    uint32_t n = 0;
    for (uint64_t key = 1000; n < NEW; key++)
        if (em_key_shard(key, SHARDS) == target)
            fresh[n++] = key;
    ck_assert_msg(run_request(table, fresh, NEW, true, &err) == EM_OK, "%s", err.message);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, CAPACITY);
    ck_assert_uint_eq(stats.rows_evicted, NEW);
    ck_assert_uint_eq(stats.rows_created, CAPACITY + NEW);
    rows_per_shard(table, SHARDS, after);
    /* the target shard gave up every old row; the shards after it, in order, the rest */
    ck_assert_uint_eq(after[target], NEW);
    uint64_t rest = NEW - before[target];
    for (uint32_t s = 1; s < SHARDS; s++) {
        uint64_t given = before[s] - after[s];
        uint64_t expect = rest < before[s] ? rest : before[s];
        ck_assert_uint_eq(given, expect);
        rest -= expect;
    }
    uint64_t evicted[NEW];
    em_evicted_view view;
    ck_assert_int_eq(em_table_evicted(table, 0, NEW, evicted, &view, &err), EM_OK);
    ck_assert_uint_eq(view.count, NEW);
    for (uint32_t i = 0; i < NEW; i++)
        ck_assert_uint_le(evicted[i], CAPACITY); /* only old keys left */
    /* every new key reads back as stored */
    float out[NEW * DIM];
    uint32_t offsets[NEW + 1];
    for (uint32_t i = 0; i <= NEW; i++)
        offsets[i] = i;
    em_csr batch = {.rows = NEW, .nnz = NEW, .offsets = offsets, .keys = fresh};
    em_pull_result result;
    ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, false, out, &result, &err),
                     EM_OK);
    ck_assert_uint_eq(result.missing, 0);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* The keys left after a sampled (candidates 4) stream, sorted. */
static em_test_snapshot sampled_run(uint32_t shards, uint64_t *evicted)
{
    em_backend *backend = make_backend(shards > 1 ? 2 : 1);
    em_table *table = make_table(backend, 100, shards, EM_EVICTION_LFU, 4);
    em_test_rng rng;
    em_test_rng_init(&rng, 4242);
    em_error err;
    for (int step = 0; step < 600; step++) {
        uint64_t keys[8];
        uint32_t n = 1 + (uint32_t)em_test_rng_below(&rng, 8);
        for (uint32_t i = 0; i < n; i++)
            keys[i] = 1000 * (uint64_t)step + i; /* distinct */
        if (step % 3 == 0)
            keys[0] = em_test_rng_below(&rng, 50); /* a few keys come back often */
        ck_assert_msg(run_request(table, keys, n, step % 2 == 0, &err) == EM_OK, "%s",
                      err.message);
    }
    em_test_snapshot s = em_test_snapshot_take(table, 64);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    *evicted = stats.rows_evicted;
    ck_assert_uint_le(stats.rows, 100);
    em_table_destroy(table);
    em_backend_destroy(backend);
    return s;
}

START_TEST(the_same_requests_evict_the_same_keys)
{
#ifdef EMBER_TEST_CUDA_BACKEND
    /* Windows of 4 candidates a row are parts of a shard's map, and which keys they hold
     * depends on the slots the inserts claimed: on a GPU (and in the emulation's
     * scattered order) in the order the threads got there, not the same in two runs. */
    if (!em_gpu_emulated_order_fixed())
        return;
#endif
    const uint32_t shard_counts[] = {1, 2, 4};
    for (int c = 0; c < 3; c++) {
        uint64_t evicted_a = 0, evicted_b = 0;
        em_test_snapshot a = sampled_run(shard_counts[c], &evicted_a);
        em_test_snapshot b = sampled_run(shard_counts[c], &evicted_b);
        ck_assert_uint_gt(evicted_a, 1000);
        ck_assert_uint_eq(evicted_a, evicted_b);
        em_test_assert_snapshots_identical(&a, &b);
        em_test_snapshot_free(&a);
        em_test_snapshot_free(&b);
    }
}
END_TEST

#ifndef EMBER_TEST_CUDA_BACKEND
/* A CPU backend whose requests alone with a table use eviction_threads, and on it a
 * full-size lru table of 8 shards (candidates 16) that the threaded tests fill. */
static em_table *threaded_table(uint32_t eviction_threads, uint64_t capacity, int optimizer,
                                uint32_t ring, em_backend **backend)
{
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.pool_limit_bytes = 256 * MEBIBYTE;
    options.pool_initial_bytes = 16 * MEBIBYTE;
    options.eviction_threads = eviction_threads;
    em_error err;
    ck_assert_int_eq(em_backend_create_cpu(&options, backend, &err), EM_OK);
    ck_assert_uint_eq((*backend)->eviction_threads, eviction_threads);
    em_table_config config;
    em_table_config_init(&config, "t", DIM, capacity);
    config.shards = 8;
    config.initializer.seed = 5;
    config.optimizer = em_test_optimizers[optimizer];
    config.eviction.policy = EM_EVICTION_LRU;
    config.eviction.candidates = 16;
    config.eviction.ring = ring;
    return em_test_make_table(*backend, &config);
}

/* A batch of n one-key rows and its values, all `value`. */
typedef struct threaded_batch {
    uint64_t *keys;
    uint32_t *offsets;
    float *values;
    em_csr batch;
} threaded_batch;

static threaded_batch threaded_batch_make(uint32_t n, float value)
{
    threaded_batch b = {
        .keys = malloc(n * sizeof(uint64_t)),
        .offsets = malloc((n + 1) * sizeof(uint32_t)),
        .values = malloc((size_t)n * DIM * sizeof(float)),
    };
    for (uint32_t i = 0; i <= n; i++)
        b.offsets[i] = i;
    for (uint32_t i = 0; i < n * DIM; i++)
        b.values[i] = value;
    b.batch = (em_csr){.rows = n, .nnz = n, .offsets = b.offsets, .keys = b.keys};
    return b;
}

static void threaded_batch_free(threaded_batch *b)
{
    free(b->keys);
    free(b->offsets);
    free(b->values);
}

typedef struct threaded_run {
    em_test_snapshot rows;
    float *pulled; /* what the pulls of rounds 5 and 7 answered, one after the other */
    uint64_t evicted;
    uint64_t ring_count;
    uint64_t *ring;
} threaded_run;

/* The keys, rows and ring of a full lru table of 8 shards after requests that each evict
 * 4,096 rows over them (walks of 16 entries a row: long enough for the backend's
 * eviction threads), on a CPU backend with eviction_threads threads. */
static threaded_run evict_on_threads(uint32_t eviction_threads)
{
    enum { CAPACITY = 16384, BATCH = 4096, RING = 1 << 16 };
    em_backend *backend = NULL;
    em_error err;
    em_table *table = threaded_table(eviction_threads, CAPACITY, 0, RING, &backend);
    threaded_batch b = threaded_batch_make(BATCH, 0.01f);
    uint64_t *keys = b.keys;
    uint32_t *offsets = b.offsets;
    float *values = b.values;
    float *pulled = malloc(2 * BATCH * DIM * sizeof(float));
    em_csr batch = b.batch;
    /* 4 batches fill the table; then every request pulls back a third of an old batch
     * (so the oldest rows are not all the oldest created) and pushes a new batch, or in
     * rounds 5 and 7 pulls it, creating its keys */
    for (uint64_t round = 0; round < 10; round++) {
        for (uint32_t i = 0; i < BATCH; i++)
            keys[i] = (round * BATCH + i) * 0x9e3779b97f4a7c15ull + 3;
        if (round == 5 || round == 7) {
            ck_assert_msg(em_test_pull(table, &batch, EM_COMBINER_NONE, true, values, NULL,
                                       &err) == EM_OK,
                          "%s", err.message);
            memcpy(pulled + (round == 7) * BATCH * DIM, values, BATCH * DIM * sizeof(float));
        } else
            ck_assert_msg(em_test_push(table, &batch, EM_COMBINER_NONE, values, NULL, &err) ==
                              EM_OK,
                          "%s", err.message);
        for (uint32_t i = 0; i < BATCH * DIM; i++)
            values[i] = 0.01f;
        if (round < 3)
            continue;
        uint32_t n = 0;
        for (uint32_t i = 0; i < BATCH; i += 3)
            keys[n++] = ((round - 2) * BATCH + i) * 0x9e3779b97f4a7c15ull + 3;
        em_csr again = {.rows = n, .nnz = n, .offsets = offsets, .keys = keys};
        ck_assert_msg(em_test_pull(table, &again, EM_COMBINER_NONE, false, values, NULL, &err) ==
                          EM_OK,
                      "%s", err.message);
    }
    threaded_run run = {.rows = em_test_snapshot_take(table, 64), .pulled = pulled};
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    run.evicted = stats.rows_evicted;
    run.ring = malloc(RING * sizeof(uint64_t));
    em_evicted_view view;
    ck_assert_int_eq(em_table_evicted(table, 0, RING, run.ring, &view, &err), EM_OK);
    run.ring_count = view.count;
    threaded_batch_free(&b);
    em_table_destroy(table);
    em_backend_destroy(backend);
    return run;
}

/* Requests that evict from several shards at once do it, create their keys and step or
 * read their rows on several threads, a shard each: the same keys go, the ring keeps
 * them in the same order, the pulls that create keys answer the same, and every row
 * left is the same as with one thread. */
START_TEST(evictions_on_several_threads_match_one_thread)
{
    threaded_run one = evict_on_threads(1);
    threaded_run four = evict_on_threads(4);
    ck_assert_uint_eq(one.evicted, 6 * 4096);
    ck_assert_uint_eq(four.evicted, one.evicted);
    ck_assert_uint_eq(four.ring_count, one.ring_count);
    ck_assert(memcmp(four.ring, one.ring, one.ring_count * sizeof(uint64_t)) == 0);
    em_test_assert_snapshots_identical(&four.rows, &one.rows);
    ck_assert(memcmp(four.pulled, one.pulled, 2 * 4096 * DIM * sizeof(float)) == 0);
    threaded_run *runs[2] = {&one, &four};
    for (int r = 0; r < 2; r++) {
        em_test_snapshot_free(&runs[r]->rows);
        free(runs[r]->pulled);
        free(runs[r]->ring);
    }
}
END_TEST

/* Sorts a snapshot's rows by key, as em_test_snapshot_take gives them. */
typedef struct keyed_row {
    uint64_t key, at;
} keyed_row;

static int compare_keyed_rows(const void *a, const void *b)
{
    uint64_t x = ((const keyed_row *)a)->key, y = ((const keyed_row *)b)->key;
    return (x > y) - (x < y);
}

static void sort_by_key(em_test_snapshot *rows)
{
    keyed_row *order = malloc(rows->count * sizeof(*order));
    float *values = malloc(rows->count * rows->width * sizeof(float));
    for (uint64_t i = 0; i < rows->count; i++)
        order[i] = (keyed_row){rows->keys[i], i};
    qsort(order, rows->count, sizeof(*order), compare_keyed_rows);
    for (uint64_t i = 0; i < rows->count; i++) {
        rows->keys[i] = order[i].key;
        memcpy(values + i * rows->width, rows->values + order[i].at * rows->width,
               rows->width * sizeof(float));
    }
    free(rows->values);
    rows->values = values;
    free(order);
}

/* Pushes that evict and create keys on several threads, a shard each, while a snapshot
 * is read: the snapshot sees every row as it was when it began, though the new keys
 * reuse the evicted rows. */
START_TEST(a_snapshot_sees_rows_evicted_on_several_threads)
{
    enum { CAPACITY = 16384, BATCH = 4096 };
    em_backend *backend = NULL;
    em_error err;
    em_table *table = threaded_table(4, CAPACITY, 3, 0, &backend);
    threaded_batch b = threaded_batch_make(BATCH, 0.25f);
    em_test_snapshot before = {0};
    em_table_snapshot *snapshot = NULL;
    for (uint64_t round = 0; round < 6; round++) {
        if (round == 4) { /* full: every push from here evicts a batch */
            before = em_test_snapshot_take(table, 64);
            ck_assert_int_eq(em_table_snapshot_begin(table, 64 * MEBIBYTE, &snapshot, &err),
                             EM_OK);
        }
        for (uint32_t i = 0; i < BATCH; i++)
            b.keys[i] = (round * BATCH + i) * 0x9e3779b97f4a7c15ull + 11;
        ck_assert_msg(em_test_push(table, &b.batch, EM_COMBINER_NONE, b.values, NULL, &err) ==
                          EM_OK,
                      "%s", err.message);
    }
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows_evicted, 2 * BATCH);
    ck_assert_uint_eq(before.count, CAPACITY);
    uint64_t *seen_keys = malloc(CAPACITY * sizeof(uint64_t));
    float *seen = malloc((size_t)CAPACITY * before.width * sizeof(float));
    uint64_t total = 0, count = 0;
    do {
        ck_assert_int_eq(em_table_snapshot_read(snapshot, CAPACITY - total, seen_keys + total,
                                                seen + total * before.width, NULL, &count, &err),
                         EM_OK);
        total += count;
    } while (count > 0 && total < CAPACITY);
    em_table_snapshot_end(snapshot);
    ck_assert_uint_eq(total, CAPACITY);
    em_test_snapshot got = {.count = total, .width = before.width, .keys = seen_keys,
                            .values = seen};
    sort_by_key(&got);
    em_test_assert_snapshots_identical(&got, &before);
    em_test_snapshot_free(&got);
    em_test_snapshot_free(&before);
    threaded_batch_free(&b);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* A push into a table whose pushes kept making room goes alone from the start, and one of
 * 2^21 gradients or more is then checked on the backend's eviction threads (two parts
 * here): a NaN late in it is still named by its key and element, and refuses the push
 * before anything changes; the same push with the NaN gone evicts and steps. */
START_TEST(a_large_push_that_goes_alone_is_checked_whole)
{
    enum { CAPACITY = 64, PUSH = 1 << 19 }; /* x DIM 4: 2^21 gradients */
    em_backend *backend = NULL;
    em_table *table = threaded_table(4, CAPACITY, 0, 0, &backend);
    threaded_batch b = threaded_batch_make(PUSH, 0.01f);
    em_error err;
    em_push_result result;
    for (uint32_t r = 0; r < 5; r++) { /* full, then four that make room */
        b.batch.rows = b.batch.nnz = r == 0 ? CAPACITY : 8;
        for (uint32_t i = 0; i < b.batch.nnz; i++)
            b.keys[i] = (r == 0 ? 0 : CAPACITY + 8 * (r - 1)) + i + 1;
        ck_assert_msg(em_test_push(table, &b.batch, EM_COMBINER_NONE, b.values, NULL, &err) ==
                          EM_OK, "%s", err.message);
    }
    em_table_stats before;
    em_table_get_stats(table, &before);
    ck_assert_uint_eq(before.rows_evicted, 32);
    b.batch.rows = b.batch.nnz = PUSH;
    for (uint32_t i = 0; i < PUSH; i++)
        b.keys[i] = 1000 + i % 8; /* eight new keys, many times each */
    b.values[(size_t)(PUSH - 3) * DIM + 2] = NAN;
    ck_assert_int_eq(em_test_push(table, &b.batch, EM_COMBINER_NONE, b.values, NULL, &err),
                     EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "gradient of key 1005 (keys[524285], row 524285) "
                                      "element 2 is NaN") != NULL,
                  "%s", err.message);
    em_table_stats after;
    em_table_get_stats(table, &after);
    ck_assert_uint_eq(after.rows_evicted, before.rows_evicted);
    ck_assert_uint_eq(after.rows, CAPACITY);
    ck_assert_uint_eq(after.pushes, before.pushes);
    b.values[(size_t)(PUSH - 3) * DIM + 2] = 0.01f;
    ck_assert_msg(em_test_push(table, &b.batch, EM_COMBINER_NONE, b.values, &result, &err) ==
                      EM_OK, "%s", err.message);
    em_table_get_stats(table, &after);
    ck_assert_uint_eq(after.rows_evicted, before.rows_evicted + 8);
    ck_assert_uint_eq(after.requests_alone_first, before.requests_alone_first + 1);
    ck_assert_uint_eq(result.created, 8);
    threaded_batch_free(&b);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST
#endif

START_TEST(a_snapshot_sees_evicted_rows_as_they_were)
{
    em_backend *backend = make_backend(1);
    em_table *table = make_table(backend, 32, 2, EM_EVICTION_LRU, 8);
    em_error err;
    for (uint64_t key = 0; key < 32; key++)
        ck_assert_int_eq(run_request(table, &key, 1, true, &err), EM_OK);
    em_test_snapshot before = em_test_snapshot_take(table, 5);
    em_table_snapshot *snapshot = NULL;
    ck_assert_int_eq(em_table_snapshot_begin(table, 1 << 20, &snapshot, &err), EM_OK);
    /* 32 new keys: every old row is evicted and its row reused */
    for (uint64_t key = 100; key < 132; key++)
        ck_assert_msg(run_request(table, &key, 1, true, &err) == EM_OK, "%s", err.message);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows_evicted, 32);
    uint64_t keys[32], total = 0, count = 0;
    float values[32 * 8];
    do {
        ck_assert_int_eq(em_table_snapshot_read(snapshot, 32 - total, keys + total,
                                                values + total * before.width, NULL, &count, &err),
                         EM_OK);
        total += count;
    } while (count > 0 && total < 32);
    ck_assert_uint_eq(total, 32);
    em_table_snapshot_end(snapshot);
    for (uint64_t i = 0; i < total; i++) {
        uint64_t at = 0;
        while (at < before.count && before.keys[at] != keys[i])
            at++;
        ck_assert_uint_lt(at, before.count);
        ck_assert_int_eq(memcmp(values + i * before.width, before.values + at * before.width,
                                before.width * sizeof(float)),
                         0);
    }
    em_test_snapshot_free(&before);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(erase_removes_listed_keys_and_a_snapshot_still_sees_them)
{
    em_backend *backend = make_backend(2);
    /* erase needs no eviction policy */
    em_table *table = make_table(backend, 100, 3, EM_EVICTION_NONE, 16);
    em_error err;
    uint64_t keys[10];
    for (uint64_t i = 0; i < 10; i++)
        keys[i] = i + 1;
    ck_assert_int_eq(run_request(table, keys, 10, true, &err), EM_OK);
    em_test_snapshot before = em_test_snapshot_take(table, 4);
    em_table_snapshot *snapshot = NULL;
    ck_assert_int_eq(em_table_snapshot_begin(table, 1 << 20, &snapshot, &err), EM_OK);
    const uint64_t doomed[] = {2, 3, 3, 99, 7};
    uint64_t erased = 0;
    ck_assert_int_eq(em_table_erase(table, doomed, 5, &erased, &err), EM_OK);
    ck_assert_uint_eq(erased, 3);
    /* new keys take the erased rows: the snapshot still reads the old values */
    uint64_t fresh[] = {50, 51, 52};
    ck_assert_int_eq(run_request(table, fresh, 3, true, &err), EM_OK);
    uint64_t snap_keys[16], total = 0, count = 0;
    float values[16 * 16];
    do {
        ck_assert_int_eq(em_table_snapshot_read(snapshot, 16 - total, snap_keys + total,
                                                values + total * before.width, NULL, &count, &err),
                         EM_OK);
        total += count;
    } while (count > 0 && total < 16);
    em_table_snapshot_end(snapshot);
    ck_assert_uint_eq(total, 10);
    for (uint64_t i = 0; i < total; i++) {
        uint64_t at = snap_keys[i] - 1; /* before holds keys 1..10 in order */
        ck_assert_uint_eq(before.keys[at], snap_keys[i]);
        ck_assert_int_eq(memcmp(values + i * before.width, before.values + at * before.width,
                                before.width * sizeof(float)),
                         0);
    }
    em_test_snapshot after = em_test_snapshot_take(table, 4);
    const uint64_t expected[] = {1, 4, 5, 6, 8, 9, 10, 50, 51, 52};
    ck_assert_uint_eq(after.count, 10);
    for (int i = 0; i < 10; i++)
        ck_assert_uint_eq(after.keys[i], expected[i]);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows_erased, 3);
    ck_assert_uint_eq(stats.rows, 10);
    ck_assert_uint_eq(stats.rows_created, stats.rows + stats.rows_erased);
    /* nothing listed is present: nothing erased; an empty list is fine */
    ck_assert_int_eq(em_table_erase(table, doomed, 4, &erased, &err), EM_OK);
    ck_assert_uint_eq(erased, 0);
    ck_assert_int_eq(em_table_erase(table, NULL, 0, &erased, &err), EM_OK);
    ck_assert_int_eq(em_table_erase(table, NULL, 3, &erased, &err), EM_INVALID_ARGUMENT);
    em_test_snapshot_free(&after);
    em_test_snapshot_free(&before);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(the_ring_keeps_the_last_evicted_keys_in_order)
{
    em_backend *backend = make_backend(1);
    em_table_config config;
    em_table_config_init(&config, "t", DIM, 4);
    config.shards = 1;
    config.eviction.policy = EM_EVICTION_LRU;
    config.eviction.candidates = 64;
    config.eviction.ring = 3;
    em_table *table = em_test_make_table(backend, &config);
    em_error err;
    for (uint64_t key = 1; key <= 9; key++)
        ck_assert_int_eq(run_request(table, &key, 1, false, &err), EM_OK);
    /* keys 1..5 left, in that order; the ring holds the last three */
    uint64_t keys[8];
    em_evicted_view view;
    ck_assert_int_eq(em_table_evicted(table, 0, 8, keys, &view, &err), EM_OK);
    ck_assert_uint_eq(view.total, 5);
    ck_assert_uint_eq(view.count, 3);
    ck_assert_uint_eq(view.first, 3);
    ck_assert_uint_eq(view.missed, 2);
    ck_assert_uint_eq(keys[0], 3);
    ck_assert_uint_eq(keys[1], 4);
    ck_assert_uint_eq(keys[2], 5);
    /* a reader that saw up to sequence 4 gets key 5 and missed nothing */
    ck_assert_int_eq(em_table_evicted(table, 4, 8, keys, &view, &err), EM_OK);
    ck_assert_uint_eq(view.count, 1);
    ck_assert_uint_eq(view.first, 5);
    ck_assert_uint_eq(view.missed, 0);
    ck_assert_uint_eq(keys[0], 5);
    ck_assert_int_eq(em_table_evicted(table, 5, 8, keys, &view, &err), EM_OK);
    ck_assert_uint_eq(view.count, 0);
    ck_assert_uint_eq(view.total, 5);
    /* max limits the copy, oldest first */
    ck_assert_int_eq(em_table_evicted(table, 0, 2, keys, &view, &err), EM_OK);
    ck_assert_uint_eq(view.count, 2);
    ck_assert_uint_eq(keys[1], 4);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* One request's evictions from a shard are numbered in ascending key order, whatever
 * order the shard's map holds them in (so the ring reads the same on every backend):
 * 40 keys scattered over 1..101 are pulled one by one, then requests of new keys evict
 * the least recent. With a ring shorter than an eviction, it keeps the largest keys. */
START_TEST(the_ring_numbers_a_requests_evicted_keys_in_ascending_order)
{
    em_backend *backend = make_backend(1);
    em_table_config config = policy_config(40, 1, EM_EVICTION_LRU, 1024);
    config.eviction.ring = 16;
    em_table *table = em_test_make_table(backend, &config);
    em_error err;
    uint64_t filled[40];
    for (uint64_t i = 0; i < 40; i++) {
        filled[i] = i * 37 % 101 + 1;
        ck_assert_int_eq(run_request(table, &filled[i], 1, false, &err), EM_OK);
    }
    /* ten new keys: the ten oldest go, ascending */
    uint64_t fresh[10];
    for (uint64_t i = 0; i < 10; i++)
        fresh[i] = 1000 + i;
    ck_assert_int_eq(run_request(table, fresh, 10, true, &err), EM_OK);
    uint64_t expected[10], keys[16];
    memcpy(expected, filled, sizeof(expected));
    qsort(expected, 10, sizeof(uint64_t), compare_keys);
    em_evicted_view view;
    ck_assert_int_eq(em_table_evicted(table, 0, 16, keys, &view, &err), EM_OK);
    ck_assert_uint_eq(view.total, 10);
    ck_assert_uint_eq(view.count, 10);
    for (int i = 0; i < 10; i++)
        ck_assert_uint_eq(keys[i], expected[i]);
    /* twenty more: the next twenty oldest go, and the ring of 16 keeps the largest 16 of
     * them, ascending, after the four that it no longer holds */
    uint64_t more[20];
    for (uint64_t i = 0; i < 20; i++)
        more[i] = 2000 + i;
    ck_assert_int_eq(run_request(table, more, 20, true, &err), EM_OK);
    uint64_t next[20];
    memcpy(next, filled + 10, sizeof(next));
    qsort(next, 20, sizeof(uint64_t), compare_keys);
    ck_assert_int_eq(em_table_evicted(table, 10, 16, keys, &view, &err), EM_OK);
    ck_assert_uint_eq(view.total, 30);
    ck_assert_uint_eq(view.count, 16);
    ck_assert_uint_eq(view.missed, 4);
    ck_assert_uint_eq(view.first, 15);
    for (int i = 0; i < 16; i++)
        ck_assert_uint_eq(keys[i], next[4 + i]);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* A push that brings a bad step and more new keys than its table can make room for is
 * refused for the step, on every backend and path (over two devices, a GPU's checks
 * come back after the room was planned): a table of 8 rows over 2 devices, empty or
 * full, and a push of 9 new keys, one with a gradient too large for its accumulator. */
START_TEST(a_push_refused_for_its_step_and_its_room_is_refused_for_its_step)
{
    em_backend *backend = make_backend(2);
    em_table *table = make_table(backend, 8, 4, EM_EVICTION_AGE, 1024);
    em_error err;
    for (int full = 0; full < 2; full++) {
        if (full == 1)
            for (uint64_t key = 100; key < 108; key++)
                ck_assert_int_eq(run_request(table, &key, 1, true, &err), EM_OK);
        uint64_t keys[9];
        uint32_t offsets[10];
        float gradients[9 * DIM];
        for (uint32_t i = 0; i < 9; i++) {
            keys[i] = 1 + i;
            offsets[i + 1] = i + 1;
        }
        offsets[0] = 0;
        for (uint32_t i = 0; i < 9 * DIM; i++)
            gradients[i] = 0.01f;
        gradients[4 * DIM + 1] = 1e35f;
        em_csr batch = {.rows = 9, .nnz = 9, .offsets = offsets, .keys = keys};
        em_test_snapshot before = em_test_snapshot_take(table, 7);
        ck_assert_int_eq(em_test_push(table, &batch, EM_COMBINER_NONE, gradients, NULL, &err),
                         EM_INVALID_ARGUMENT);
        ck_assert_str_eq(err.message, "push to table 't': key 5: this adagrad step would make its "
                                      "accumulator (state float 1) non-finite; nothing was "
                                      "applied");
        em_test_assert_table_unchanged(table, &before);
        em_test_snapshot_free(&before);
    }
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

static em_table *expiring_table(em_backend *backend, em_eviction_policy policy, uint32_t max_age)
{
    em_table_config config;
    em_table_config_init(&config, "t", DIM, 100);
    config.shards = 2;
    config.eviction.policy = policy;
    config.eviction.max_age_steps = max_age;
    return em_test_make_table(backend, &config);
}

/* Sweeps until every shard has been examined once more (slices of scan entries). */
static uint64_t sweep(em_table *table, uint64_t scan, int slices)
{
    uint64_t total = 0, expired = 0;
    em_error err;
    for (int i = 0; i < slices; i++) {
        ck_assert_msg(em_table_expire(table, scan, &expired, &err) == EM_OK, "%s", err.message);
        ck_assert_uint_le(expired, scan);
        total += expired;
    }
    return total;
}

static void assert_keys(em_table *table, const uint64_t *expected, uint64_t n)
{
    em_test_snapshot s = em_test_snapshot_take(table, 16);
    ck_assert_uint_eq(s.count, n);
    for (uint64_t i = 0; i < n; i++)
        ck_assert_uint_eq(s.keys[i], expected[i]);
    em_test_snapshot_free(&s);
}

START_TEST(the_sweep_expires_rows_not_pushed_in_max_age_steps)
{
    em_backend *backend = make_backend(1);
    em_table *table = expiring_table(backend, EM_EVICTION_NONE, 5);
    em_error err;
    /* key k is pushed by the table's k-th push */
    for (uint64_t key = 1; key <= 10; key++)
        ck_assert_int_eq(run_request(table, &key, 1, true, &err), EM_OK);
    /* a pull creates key 50 at push clock 10 */
    uint64_t pulled = 50;
    ck_assert_int_eq(run_request(table, &pulled, 1, false, &err), EM_OK);
    /* ages are 10 - k: keys 1..5 were not pushed in the last 5 pushes (6..10); slices
     * of 3 entries, the shards in turn, until both were swept whole */
    ck_assert_uint_eq(sweep(table, 3, 12), 5);
    const uint64_t left[] = {6, 7, 8, 9, 10, 50};
    assert_keys(table, left, 6);
    /* four more pushes of key 10: keys 6..9 (ages 8..5) go, key 50 (created after push
     * 10, age 4) stays */
    uint64_t ten = 10;
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(run_request(table, &ten, 1, true, &err), EM_OK);
    ck_assert_uint_eq(sweep(table, 100, 4), 4);
    const uint64_t later[] = {10, 50};
    assert_keys(table, later, 2);
    /* a fifth: key 50 was neither pushed nor created in the last 5 pushes (11..15) */
    ck_assert_int_eq(run_request(table, &ten, 1, true, &err), EM_OK);
    ck_assert_uint_eq(sweep(table, 100, 4), 1);
    assert_keys(table, &ten, 1);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows_expired, 10);
    ck_assert_uint_eq(stats.rows_evicted, 0);
    ck_assert_uint_eq(stats.rows_created, stats.rows + stats.rows_expired);
    /* the ring holds what expired, numbered */
    uint64_t keys[16];
    em_evicted_view view;
    ck_assert_int_eq(em_table_evicted(table, 0, 16, keys, &view, &err), EM_OK);
    ck_assert_uint_eq(view.total, 10);
    ck_assert_uint_eq(view.count, 10);
    uint64_t sum = 0;
    for (int i = 0; i < 10; i++)
        sum += keys[i];
    ck_assert_uint_eq(sum, 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9 + 50);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(the_sweep_expires_rows_by_seconds_never_early)
{
    em_backend *backend = make_backend(1);
    em_table_config config;
    em_table_config_init(&config, "t", DIM, 100);
    config.shards = 2;
    config.eviction.max_age_seconds = 1;
    em_table *table = em_test_make_table(backend, &config);
    em_error err;
    for (uint64_t key = 1; key <= 5; key++)
        ck_assert_int_eq(run_request(table, &key, 1, true, &err), EM_OK);
    ck_assert_uint_eq(sweep(table, 100, 4), 0); /* nothing is a second old */
    usleep(1200 * 1000);
    uint64_t six = 6;
    ck_assert_int_eq(run_request(table, &six, 1, true, &err), EM_OK);
    /* the clock's only sample over a second old says push 1: key 1 goes; keys 2..5,
     * pushed after that sample, stay until a later sample proves their age */
    ck_assert_uint_eq(sweep(table, 100, 4), 1);
    const uint64_t left[] = {2, 3, 4, 5, 6};
    assert_keys(table, left, 5);
    usleep(1200 * 1000);
    /* a sample taken after push 6 is now over a second old: every row goes */
    ck_assert_uint_eq(sweep(table, 100, 4), 5);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, 0);
    ck_assert_uint_eq(stats.rows_expired, 6);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(erase_by_time_never_takes_a_row_pushed_after_it)
{
    em_backend *backend = make_backend(1);
    em_table *table = expiring_table(backend, EM_EVICTION_LRU, 0);
    em_error err;
    for (uint64_t key = 1; key <= 3; key++)
        ck_assert_int_eq(run_request(table, &key, 1, true, &err), EM_OK);
    usleep(1100 * 1000);
    uint64_t four = 4;
    ck_assert_int_eq(run_request(table, &four, 1, true, &err), EM_OK);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t now_ms = (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u;
    /* before key 4's push: the only older sample is push 1's, so key 1 goes and keys 2
     * and 3 (pushed after that sample) stay; key 4 is never taken */
    uint64_t erased = 0;
    ck_assert_int_eq(em_table_erase_before(table, now_ms - 50, &erased, &err), EM_OK);
    ck_assert_uint_eq(erased, 1);
    const uint64_t left[] = {2, 3, 4};
    assert_keys(table, left, 3);
    /* a time before any push erases nothing */
    ck_assert_int_eq(em_table_erase_before(table, now_ms - 60000, &erased, &err), EM_OK);
    ck_assert_uint_eq(erased, 0);
    usleep(1100 * 1000);
    clock_gettime(CLOCK_REALTIME, &now);
    now_ms = (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u;
    ck_assert_int_eq(em_table_erase_before(table, now_ms, &erased, &err), EM_OK);
    ck_assert_uint_eq(erased, 3);
    /* a time to come: every row was pushed before it, also those pushed since the last
     * sample (keys 7 and 8, within a second of it) */
    for (uint64_t key = 7; key <= 8; key++)
        ck_assert_int_eq(run_request(table, &key, 1, true, &err), EM_OK);
    ck_assert_int_eq(em_table_erase_before(table, now_ms + 3600 * 1000, &erased, &err), EM_OK);
    ck_assert_uint_eq(erased, 2);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(erase_by_age_removes_rows_not_pushed_recently)
{
    em_backend *backend = make_backend(1);
    em_table *table = expiring_table(backend, EM_EVICTION_LRU, 0);
    em_error err;
    for (uint64_t key = 1; key <= 10; key++)
        ck_assert_int_eq(run_request(table, &key, 1, true, &err), EM_OK);
    /* a pull does not update: key 2 stays as old as its push */
    uint64_t two = 2;
    ck_assert_int_eq(run_request(table, &two, 1, false, &err), EM_OK);
    uint64_t erased = 0;
    /* 0 would take every row */
    ck_assert_int_eq(em_table_erase_older(table, 0, &erased, &err), EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "at least 1") != NULL, "%s", err.message);
    /* the last 3 pushes were of keys 8, 9 and 10 */
    ck_assert_int_eq(em_table_erase_older(table, 3, &erased, &err), EM_OK);
    ck_assert_uint_eq(erased, 7);
    const uint64_t left[] = {8, 9, 10};
    assert_keys(table, left, 3);
    /* expiry was not configured: the sweep does nothing */
    ck_assert_uint_eq(sweep(table, 100, 4), 0);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows_erased, 7);
    ck_assert_uint_eq(stats.rows_expired, 0);
    em_table_destroy(table);
    /* without access metadata there is no age to go by */
    table = expiring_table(backend, EM_EVICTION_NONE, 0);
    ck_assert_int_eq(em_table_erase_older(table, 3, &erased, &err), EM_FAILED_PRECONDITION);
    ck_assert_msg(strstr(err.message, "keeps no access metadata") != NULL, "%s", err.message);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* ---- admission -------------------------------------------------------------------------- */

static em_table *admitting_table(em_backend *backend, em_admission_policy policy,
                                 uint32_t threshold, double probability)
{
    em_table_config config;
    em_table_config_init(&config, "t", DIM, 100000);
    config.shards = 3;
    config.optimizer = em_test_optimizers[0];
    config.initializer.seed = 99;
    config.initializer.bound = 0.5;
    config.admission.policy = policy;
    config.admission.threshold = threshold;
    config.admission.probability = probability;
    return em_test_make_table(backend, &config);
}

/* The initial weights of key under the tables' initializer (a table that stores all). */
static void initial_weights(em_backend *backend, uint64_t key, float *out)
{
    em_table *plain = admitting_table(backend, EM_ADMISSION_ALWAYS, 1, 1.0);
    uint32_t offsets[2] = {0, 1};
    em_csr batch = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = &key};
    em_error err;
    ck_assert_int_eq(em_test_pull(plain, &batch, EM_COMBINER_NONE, true, out, NULL, &err), EM_OK);
    em_table_destroy(plain);
}

START_TEST(counter_admission_stores_a_key_on_its_threshold_sighting)
{
    em_backend *backend = make_backend(2);
    em_table *table = admitting_table(backend, EM_ADMISSION_COUNTER, 3, 1.0);
    em_error err;
    uint64_t key = 4242;
    uint32_t offsets[2] = {0, 1};
    em_csr batch = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = &key};
    float out[DIM], expected[DIM], gradient[DIM] = {1, 1, 1, 1};
    initial_weights(backend, key, expected);
    em_pull_result pulled;
    /* sightings 1 and 2 (a pull, then a push whose gradient is dropped): not stored */
    ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, true, out, &pulled, &err),
                     EM_OK);
    ck_assert_uint_eq(pulled.missing, 1);
    ck_assert_uint_eq(pulled.created, 0);
    ck_assert_int_eq(memcmp(out, expected, sizeof(out)), 0);
    em_push_result pushed;
    ck_assert_int_eq(em_test_push(table, &batch, EM_COMBINER_NONE, gradient, &pushed, &err), EM_OK);
    ck_assert_uint_eq(pushed.created, 0);
    ck_assert_uint_eq(pushed.updated, 0);
    /* a pull that creates nothing does not count: still two sightings */
    ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, false, out, NULL, &err), EM_OK);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, 0);
    ck_assert_uint_eq(stats.pulls_not_admitted, 1);
    ck_assert_uint_eq(stats.pushes_dropped, 1);
    /* the third: stored, with its initial value untouched by the dropped push */
    ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, true, out, &pulled, &err),
                     EM_OK);
    ck_assert_uint_eq(pulled.created, 1);
    ck_assert_int_eq(memcmp(out, expected, sizeof(out)), 0);
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, 1);
    ck_assert_uint_eq(stats.pulls_not_admitted, 1);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

#define SIGHTING_THREADS 4
#define SIGHTED_KEYS 64

typedef struct sighting_run {
    em_table *table;
    int thread;
    int failures;
} sighting_run;

/* Thread t pushes (gradient 1) every key of A = [0, 64) once and, when t < 2, every key
 * of B = [64, 128) once, each key in a request of its own. */
static void *push_sightings(void *argument)
{
    sighting_run *run = argument;
    uint32_t offsets[2] = {0, 1};
    float gradient[DIM] = {1, 1, 1, 1};
    em_error err;
    for (uint64_t i = 0; i < 2 * SIGHTED_KEYS; i++) {
        uint64_t key = 7000 + i;
        if (i >= SIGHTED_KEYS && run->thread >= 2)
            break;
        em_csr batch = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = &key};
        if (em_test_push(run->table, &batch, EM_COMBINER_NONE, gradient, NULL, &err) != EM_OK)
            __atomic_fetch_add(&run->failures, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

/* Requests count sightings under the shared table lock, side by side, and create the keys
 * admission lets in there too; no sighting is lost or counted twice: with threshold
 * 3, the keys of A (4 sightings each) are stored at their third and their fourth push is
 * applied to them too (sgd, lr 0.5: every element -1.0 from zeros), the keys of B (2
 * sightings) are never stored, and every refused push is counted. */
START_TEST(counter_admission_counts_every_sighting_under_concurrent_pushes)
{
    em_backend *backend = make_backend(2);
    em_table_config config;
    em_table_config_init(&config, "t", DIM, 100000);
    config.shards = 3;
    config.optimizer.kind = EM_OPTIMIZER_SGD;
    config.optimizer.learning_rate = 0.5f;
    config.initializer.kind = EM_INIT_ZEROS;
    config.admission.policy = EM_ADMISSION_COUNTER;
    config.admission.threshold = 3;
    em_table *table = em_test_make_table(backend, &config);
    sighting_run runs[SIGHTING_THREADS];
    pthread_t threads[SIGHTING_THREADS];
    for (int t = 0; t < SIGHTING_THREADS; t++) {
        runs[t] = (sighting_run){table, t, 0};
        pthread_create(&threads[t], NULL, push_sightings, &runs[t]);
    }
    for (int t = 0; t < SIGHTING_THREADS; t++) {
        pthread_join(threads[t], NULL);
        ck_assert_int_eq(runs[t].failures, 0);
    }
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, SIGHTED_KEYS);
    ck_assert_uint_eq(stats.pushes_dropped, 2 * SIGHTED_KEYS + 2 * SIGHTED_KEYS);
    /* the table has room: the pushes that create keys do so under the shared lock
     * too (the third and fourth sightings of a key may both find it missing; the one
     * that creates it second finds it again and steps it), and none runs again alone */
    ck_assert_uint_eq(stats.exclusive_retries, 0);
    em_test_snapshot rows = em_test_snapshot_take(table, 16);
    ck_assert_uint_eq(rows.count, SIGHTED_KEYS);
    for (uint64_t r = 0; r < rows.count; r++) {
        ck_assert_uint_lt(rows.keys[r], 7000 + SIGHTED_KEYS); /* A only */
        for (uint32_t j = 0; j < DIM; j++)
            ck_assert_float_eq(rows.values[r * rows.width + j], -1.0f);
    }
    em_test_snapshot_free(&rows);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(a_refused_key_drops_only_its_own_gradient)
{
    em_backend *backend = make_backend(1);
    em_table *table = admitting_table(backend, EM_ADMISSION_COUNTER, 2, 1.0);
    em_error err;
    uint64_t keys[2] = {7, 8};
    uint32_t offsets[3] = {0, 1, 2};
    float out[2 * DIM], gradients[2 * DIM];
    for (int i = 0; i < 2 * DIM; i++)
        gradients[i] = 0.5f;
    em_csr one = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = keys};
    /* key 7 seen twice: stored; then a push of 7 (stored) and 8 (first sighting) */
    ck_assert_int_eq(em_test_pull(table, &one, EM_COMBINER_NONE, true, out, NULL, &err), EM_OK);
    ck_assert_int_eq(em_test_pull(table, &one, EM_COMBINER_NONE, true, out, NULL, &err), EM_OK);
    float before[DIM];
    memcpy(before, out, sizeof(before));
    em_csr both = {.rows = 2, .nnz = 2, .offsets = offsets, .keys = keys};
    em_push_result pushed;
    ck_assert_int_eq(em_test_push(table, &both, EM_COMBINER_NONE, gradients, &pushed, &err), EM_OK);
    ck_assert_uint_eq(pushed.updated, 1);
    ck_assert_uint_eq(pushed.created, 0);
    ck_assert_int_eq(em_test_pull(table, &both, EM_COMBINER_NONE, false, out, NULL, &err), EM_OK);
    /* sgd, lr 0.01 (em_test_optimizers[0]): 7 moved by -lr * 0.5; 8 reads zeros */
    for (int j = 0; j < DIM; j++) {
        ck_assert_float_eq_tol(out[j], before[j] - em_test_optimizers[0].learning_rate * 0.5f,
                               1e-6f);
        ck_assert_float_eq(out[DIM + j], 0.0f);
    }
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(probability_admission_is_a_fixed_choice_per_key)
{
    em_backend *backend = make_backend(1);
    em_table *table = admitting_table(backend, EM_ADMISSION_PROBABILITY, 2, 0.3);
    em_error err;
    enum { N = 2000 };
    uint64_t *keys = malloc(N * sizeof(uint64_t));
    uint32_t *offsets = malloc((N + 1) * sizeof(uint32_t));
    float *out = malloc((size_t)N * DIM * sizeof(float));
    for (uint32_t i = 0; i <= N; i++)
        offsets[i] = i;
    for (uint64_t i = 0; i < N; i++)
        keys[i] = 1000 + i * 7919;
    em_csr batch = {.rows = N, .nnz = N, .offsets = offsets, .keys = keys};
    em_pull_result first, second;
    ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, true, out, &first, &err), EM_OK);
    /* about 30% stored (binomial: 600 +- 4.5 standard deviations) */
    ck_assert_uint_ge(first.created, 510);
    ck_assert_uint_le(first.created, 690);
    /* asked again, the refused keys are refused again and nothing new is stored */
    ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, true, out, &second, &err),
                     EM_OK);
    ck_assert_uint_eq(second.missing, N - first.created);
    ck_assert_uint_eq(second.created, 0);
    /* a refused key reads as its initial value */
    em_test_snapshot s = em_test_snapshot_take(table, 256);
    uint64_t refused = 0;
    for (uint64_t i = 0; i < N && refused == 0; i++) {
        bool stored = false;
        for (uint64_t j = 0; j < s.count && !stored; j++)
            stored = s.keys[j] == keys[i];
        if (!stored)
            refused = i + 1;
    }
    ck_assert_uint_gt(refused, 0);
    float expected[DIM];
    initial_weights(backend, keys[refused - 1], expected);
    ck_assert_int_eq(memcmp(out + (refused - 1) * DIM, expected, sizeof(expected)), 0);
    em_test_snapshot_free(&s);
    em_table_destroy(table);
    /* the same table config decides the same keys */
    table = admitting_table(backend, EM_ADMISSION_PROBABILITY, 2, 0.3);
    ck_assert_int_eq(em_test_pull(table, &batch, EM_COMBINER_NONE, true, out, &second, &err),
                     EM_OK);
    ck_assert_uint_eq(second.created, first.created);
    em_table_destroy(table);
    free(keys);
    free(offsets);
    free(out);
    em_backend_destroy(backend);
}
END_TEST

typedef struct pusher {
    em_table *table;
    uint64_t seed;
    int failures;
} pusher;

static void *push_random_keys(void *argument)
{
    pusher *p = argument;
    em_test_rng rng;
    em_test_rng_init(&rng, p->seed);
    em_error err;
    for (int step = 0; step < 400; step++) {
        uint64_t keys[16];
        uint32_t n = 1 + (uint32_t)em_test_rng_below(&rng, 16);
        for (uint32_t i = 0; i < n; i++)
            keys[i] = p->seed * 100000 + em_test_rng_below(&rng, 2000) * 16 + i; /* distinct */
        if (run_request(p->table, keys, n, step % 4 != 0, &err) != EM_OK)
            p->failures++;
    }
    return NULL;
}

/* Pulls (creating nothing) and erases of the pushers' keys while they push: a pulled
 * key reads as zeros (missing) or as its stored row, never anything else (a row being
 * reused for another key would show as a vector that is neither). */
typedef struct bystander {
    em_table *table;
    atomic_bool stop;
    uint64_t erased, pulls, failures;
} bystander;

static void *pull_and_erase(void *argument)
{
    bystander *b = argument;
    em_test_rng rng;
    em_test_rng_init(&rng, 777);
    em_error err;
    while (!atomic_load(&b->stop)) {
        uint64_t key = (1 + em_test_rng_below(&rng, 4)) * 100000 +
                       em_test_rng_below(&rng, 2000) * 16 + em_test_rng_below(&rng, 16);
        uint32_t offsets[2] = {0, 1};
        float out[DIM];
        em_csr batch = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = &key};
        em_pull_result result;
        if (em_test_pull(b->table, &batch, EM_COMBINER_NONE, false, out, &result, &err) != EM_OK)
            b->failures++;
        bool zeros = true;
        for (int j = 0; j < DIM; j++)
            zeros &= out[j] == 0.0f;
        if (result.missing == 1 && !zeros)
            b->failures++; /* a missing key must read as zeros */
        b->pulls++;
        if (b->pulls % 8 == 0) {
            uint64_t erased = 0;
            if (em_table_erase(b->table, &key, 1, &erased, &err) != EM_OK)
                b->failures++;
            b->erased += erased;
        }
        uint64_t expired = 0;
        if (em_table_expire(b->table, 64, &expired, &err) != EM_OK)
            b->failures++;
    }
    return NULL;
}

/* Loop index 1: with headroom, so that keys are also created beside each other into the
 * room evictions leave, while the bystander reads and erases. */
START_TEST(concurrent_pushes_at_capacity_fail_nothing_and_counters_add_up)
{
    em_backend *backend = make_backend(2);
    em_table_config config;
    em_table_config_init(&config, "t", DIM, 300);
    config.shards = 4;
    config.eviction.policy = EM_EVICTION_LRU;
    config.eviction.max_age_steps = 10;
    config.eviction.headroom = _i == 1 ? 0.05 : 0.0; /* 1: evictions leave room behind */
    em_table *table = em_test_make_table(backend, &config);
    pusher pushers[4];
    pthread_t threads[4];
    /* full before the threads start: 25 pushes of 16 new keys evict 100 rows */
    em_error err;
    for (uint64_t push = 0; push < 25; push++) {
        uint64_t keys[16];
        for (uint64_t i = 0; i < 16; i++)
            keys[i] = 900000000 + push * 16 + i;
        ck_assert_int_eq(run_request(table, keys, 16, true, &err), EM_OK);
    }
    bystander watcher = {.table = table};
    pthread_t watcher_thread;
    ck_assert_int_eq(pthread_create(&watcher_thread, NULL, pull_and_erase, &watcher), 0);
    for (int t = 0; t < 4; t++) {
        pushers[t] = (pusher){.table = table, .seed = (uint64_t)t + 1};
        ck_assert_int_eq(pthread_create(&threads[t], NULL, push_random_keys, &pushers[t]), 0);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(threads[t], NULL);
        ck_assert_int_eq(pushers[t].failures, 0);
    }
    atomic_store(&watcher.stop, true);
    pthread_join(watcher_thread, NULL);
    ck_assert_uint_eq(watcher.failures, 0);
    ck_assert_uint_gt(watcher.pulls, 0);
    /* a last sweep of every shard: rows of all but the last 10 pushes are gone */
    sweep(table, 1000, 8);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_le(stats.rows, 300);
    ck_assert_uint_gt(stats.rows_evicted, 0);
    ck_assert_uint_gt(stats.rows_expired, 0);
    ck_assert_uint_eq(stats.rows_erased, watcher.erased);
    /* every row created is stored, or left by one of the three ways */
    ck_assert_uint_eq(stats.rows_created,
                      stats.rows + stats.rows_evicted + stats.rows_expired + stats.rows_erased);
    em_test_snapshot s = em_test_snapshot_take(table, 64);
    ck_assert_uint_eq(s.count, stats.rows);
    em_test_snapshot_free(&s);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* ---- keys created side by side ---------------------------------------------------------- */

#define CREATOR_THREADS 4
#define CREATOR_KEYS 512

typedef struct creator_run {
    em_table *table;
    int thread;
    _Atomic uint32_t *applied; /* per key: gradients of successful pushes (all threads) */
    _Atomic uint8_t *stored;   /* per key: a successful request created or used it */
    uint64_t pushes_refused, failures;
} creator_run;

/* Requests of 12 keys from a space of 512 (repeats within a request are summed), two
 * pushes (gradient 1 per occurrence) to every pull that creates its missing keys. */
static void *create_side_by_side(void *argument)
{
    creator_run *run = argument;
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + (uint64_t)run->thread);
    uint64_t keys[12];
    uint32_t offsets[13];
    float ones[12 * DIM], out[12 * DIM];
    for (int i = 0; i <= 12; i++)
        offsets[i] = (uint32_t)i;
    for (int i = 0; i < 12 * DIM; i++)
        ones[i] = 1.0f;
    em_error err;
    for (int round = 0; round < 150; round++) {
        for (int i = 0; i < 12; i++)
            keys[i] = 50000 + em_test_rng_below(&rng, CREATOR_KEYS);
        em_csr batch = {.rows = 12, .nnz = 12, .offsets = offsets, .keys = keys};
        em_status status = round % 3 == 2
                               ? em_test_pull(run->table, &batch, EM_COMBINER_NONE, true, out,
                                              NULL, &err)
                               : em_test_push(run->table, &batch, EM_COMBINER_NONE, ones, NULL,
                                              &err);
        if (status == EM_RESOURCE_EXHAUSTED && round % 3 != 2) {
            run->pushes_refused++;
            continue;
        }
        if (status == EM_RESOURCE_EXHAUSTED)
            continue;
        if (status != EM_OK) {
            run->failures++;
            continue;
        }
        for (int i = 0; i < 12; i++) {
            atomic_store(&run->stored[keys[i] - 50000], 1);
            if (round % 3 != 2)
                atomic_fetch_add(&run->applied[keys[i] - 50000], 1);
        }
    }
    return NULL;
}

/* Requests that create keys while the table has room do it side by side under the
 * shared table lock, racing each other for the same new keys: every key ends with one
 * row holding exactly the gradients of the successful pushes (sgd, lr 1, from zeros:
 * each element is minus their count), none runs again alone, and with a capacity below
 * the key space the pushes that do not fit are refused whole (nothing of them is
 * applied) and the table never holds more rows than its capacity. */
START_TEST(keys_created_side_by_side_get_one_row_each)
{
    uint64_t capacity = _i == 0 ? 100000 : 300;
    em_backend *backend = make_backend(2);
    em_table_config config;
    em_table_config_init(&config, "t", DIM, capacity);
    config.shards = 3;
    config.optimizer.kind = EM_OPTIMIZER_SGD;
    config.optimizer.learning_rate = 1.0f;
    config.initializer.kind = EM_INIT_ZEROS;
    em_table *table = em_test_make_table(backend, &config);
    _Atomic uint32_t applied[CREATOR_KEYS] = {0};
    _Atomic uint8_t stored[CREATOR_KEYS] = {0};
    creator_run runs[CREATOR_THREADS];
    pthread_t threads[CREATOR_THREADS];
    for (int t = 0; t < CREATOR_THREADS; t++) {
        runs[t] = (creator_run){table, t, applied, stored, 0, 0};
        pthread_create(&threads[t], NULL, create_side_by_side, &runs[t]);
    }
    uint64_t refused = 0;
    for (int t = 0; t < CREATOR_THREADS; t++) {
        pthread_join(threads[t], NULL);
        ck_assert_uint_eq(runs[t].failures, 0);
        refused += runs[t].pushes_refused;
    }
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    uint64_t expected_rows = 0;
    for (int k = 0; k < CREATOR_KEYS; k++)
        expected_rows += atomic_load(&stored[k]);
    ck_assert_uint_eq(stats.rows, expected_rows);
    ck_assert_uint_le(stats.rows, capacity);
    ck_assert_uint_eq(stats.rows_created, stats.rows);
    if (_i == 0) {
        ck_assert_uint_eq(refused, 0);
        ck_assert_uint_eq(stats.exclusive_retries, 0);
    } else {
        ck_assert_uint_gt(refused, 0); /* 512 keys do not fit in 300 rows */
    }
    em_test_snapshot rows = em_test_snapshot_take(table, 16);
    ck_assert_uint_eq(rows.count, expected_rows);
    for (uint64_t r = 0; r < rows.count; r++) {
        uint64_t k = rows.keys[r] - 50000;
        ck_assert_uint_lt(k, CREATOR_KEYS);
        ck_assert(atomic_load(&stored[k]));
        for (uint32_t j = 0; j < DIM; j++)
            ck_assert_msg(rows.values[r * rows.width + j] == -(float)atomic_load(&applied[k]),
                          "key %" PRIu64 ": %g, expected %g", rows.keys[r],
                          (double)rows.values[r * rows.width + j],
                          -(double)atomic_load(&applied[k]));
    }
    em_test_snapshot_free(&rows);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("eviction");
    TCase *rules = tcase_create("rules");
    tcase_add_loop_test(rules, each_policy_follows_its_rule_exactly, 0, 3);
    tcase_add_loop_test(rules, the_chooser_takes_the_rows_first_by_the_rule_in_its_window, 0, 9);
    tcase_add_loop_test(rules, headroom_frees_the_next_rows_by_the_rule_too, 0, 3);
    tcase_add_test(rules, headroom_comes_from_every_shard_by_its_rows);
    tcase_add_loop_test(rules, requests_that_keep_making_room_go_alone_first, 0, 2);
    tcase_add_loop_test(rules, a_refused_push_into_a_full_table_evicts_nothing, 0, 2);
    tcase_add_test(rules, a_request_never_evicts_its_own_rows);
    tcase_add_loop_test(rules, a_request_evicts_the_rows_first_by_the_policy_at_once, 0, 3);
    tcase_add_test(rules, no_room_to_make_fails_whole);
    tcase_add_test(rules, room_comes_from_other_shards_when_the_keys_shard_holds_too_few);
    tcase_add_test(rules, a_full_table_keeps_the_storage_of_its_capacity);
    tcase_add_test(rules, the_same_requests_evict_the_same_keys);
#ifndef EMBER_TEST_CUDA_BACKEND
    tcase_add_test(rules, evictions_on_several_threads_match_one_thread);
    tcase_add_test(rules, a_snapshot_sees_rows_evicted_on_several_threads);
    tcase_add_test(rules, a_large_push_that_goes_alone_is_checked_whole);
#endif
    tcase_add_test(rules, a_snapshot_sees_evicted_rows_as_they_were);
    tcase_add_test(rules, erase_removes_listed_keys_and_a_snapshot_still_sees_them);
    tcase_add_test(rules, the_ring_keeps_the_last_evicted_keys_in_order);
    tcase_add_test(rules, the_ring_numbers_a_requests_evicted_keys_in_ascending_order);
    tcase_add_test(rules, a_push_refused_for_its_step_and_its_room_is_refused_for_its_step);
    tcase_add_test(rules, the_sweep_expires_rows_not_pushed_in_max_age_steps);
    tcase_add_test(rules, erase_by_age_removes_rows_not_pushed_recently);
    tcase_add_test(rules, the_sweep_expires_rows_by_seconds_never_early);
    tcase_add_test(rules, erase_by_time_never_takes_a_row_pushed_after_it);
    tcase_add_test(rules, counter_admission_stores_a_key_on_its_threshold_sighting);
    tcase_add_test(rules, counter_admission_counts_every_sighting_under_concurrent_pushes);
    tcase_add_test(rules, a_refused_key_drops_only_its_own_gradient);
    tcase_add_test(rules, probability_admission_is_a_fixed_choice_per_key);
    /* long streams of requests; the emulated kernels take their time */
#ifdef EMBER_TEST_CUDA_BACKEND
    tcase_set_timeout(rules, 240);
#else
    tcase_set_timeout(rules, 60);
#endif
    suite_add_tcase(suite, rules);
    TCase *concurrency = tcase_create("concurrency");
    tcase_set_timeout(concurrency, 120);
    tcase_add_loop_test(concurrency, concurrent_pushes_at_capacity_fail_nothing_and_counters_add_up,
                        0, 2);
    tcase_add_loop_test(concurrency, keys_created_side_by_side_get_one_row_each, 0, 2);
    suite_add_tcase(suite, concurrency);
    return em_test_run(suite);
}
