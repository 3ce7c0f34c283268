/*
 * The client's batch split, checked against the real engine: every "server" is its
 * own in-process em_table, fed the sub-batches the split produces, and the merged
 * results must be bit-identical to one em_table holding every key - pull outputs,
 * push counts, and finally every row's weights and optimizer state.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clients/client_split.h"
#include "lib/device/backend.h"
#include "common/keyhash.h"
#include "lib/table/table.h"
#include "tests/support/test_batches.h"
#include "tests/support/test_support.h"

#define MEBIBYTE (UINT64_C(1) << 20)
#define MAX_SERVERS 3
#define DIM 5

/* ---- fixtures ---------------------------------------------------------------------- */

static em_backend *make_backend(void)
{
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.pool_limit_bytes = 64 * MEBIBYTE;
    options.pool_initial_bytes = 8 * MEBIBYTE;
    options.pool_growth_bytes = 8 * MEBIBYTE;
    em_backend *backend = NULL;
    em_error err;
    ck_assert_msg(em_backend_create_cpu(&options, &backend, &err) == EM_OK, "%s", err.message);
    return backend;
}

static const em_optimizer_config optimizers[] = {
    {.kind = EM_OPTIMIZER_SGD, .learning_rate = 0.05f},
    {.kind = EM_OPTIMIZER_ADAGRAD, .learning_rate = 0.1f, .eps = 1e-10f,
     .initial_accumulator = 0.01f},
    {.kind = EM_OPTIMIZER_ROWWISE_ADAGRAD, .learning_rate = 0.1f, .eps = 1e-10f},
    {.kind = EM_OPTIMIZER_ADAM, .learning_rate = 0.01f, .eps = 1e-8f, .beta1 = 0.9f,
     .beta2 = 0.999f},
};

static em_table *make_table(em_backend *backend, int optimizer, uint32_t shards)
{
    em_table_config config;
    em_table_config_init(&config, "t", DIM, 100000);
    config.shards = shards;
    config.optimizer = optimizers[optimizer];
    config.initializer.kind = EM_INIT_UNIFORM;
    config.initializer.bound = 0.5f;
    config.initializer.seed = 99;
    em_table *table = NULL;
    em_error err;
    ck_assert_msg(em_table_create(backend, &config, &table, &err) == EM_OK, "%s", err.message);
    return table;
}

/* ---- one table against several --------------------------------------------------- */

typedef struct cluster {
    uint32_t servers;
    em_table *single;
    em_table *tables[MAX_SERVERS];
} cluster;

static void pull_single(cluster *c, const em_csr *csr, em_combiner combiner, bool create,
                        float *out, em_pull_result *result)
{
    em_pull_request request = {.batch = *csr,
                               .combiner = combiner,
                               .create_missing = create,
                               .out = out,
                               .out_capacity = em_csr_output_vectors(csr, combiner) * DIM};
    em_error err;
    ck_assert_msg(em_table_pull(c->single, &request, result, &err) == EM_OK, "%s", err.message);
}

/* Pull through the split: each server's table answers its NONE sub-request. */
static void pull_split(cluster *c, const em_csr *csr, em_combiner combiner, bool create,
                       float *out, em_pull_result *total)
{
    em__client_split split;
    em_error err;
    ck_assert_int_eq(em__client_split_pull(csr, c->servers, &split, &err), EM_OK);
    float *vectors[MAX_SERVERS];
    *total = (em_pull_result){0};
    for (uint32_t s = 0; s < c->servers; s++) {
        const em_csr *sub = &split.servers[s].batch;
        ck_assert_uint_eq(sub->rows, csr->rows);
        ck_assert_int_eq(em_csr_validate(sub, &err), EM_OK);
        for (uint64_t k = 0; k < sub->nnz; k++)
            ck_assert_int_eq(em_key_server(sub->keys[k], (int32_t)c->servers), (int32_t)s);
        vectors[s] = malloc((sub->nnz * DIM + 1) * sizeof(float));
        em_pull_request request = {.batch = *sub,
                                   .combiner = EM_COMBINER_NONE,
                                   .create_missing = create,
                                   .out = vectors[s],
                                   .out_capacity = sub->nnz * DIM};
        em_pull_result result;
        ck_assert_msg(em_table_pull(c->tables[s], &request, &result, &err) == EM_OK, "%s",
                      err.message);
        /* distinct keys only: the server sees each key once */
        ck_assert_uint_eq(result.unique_keys, sub->nnz);
        total->unique_keys += result.unique_keys;
        total->missing += result.missing;
        total->created += result.created;
    }
    em__client_split_merge_pull(&split, csr, combiner, DIM, (const float *const *)vectors, out);
    for (uint32_t s = 0; s < c->servers; s++)
        free(vectors[s]);
    em__client_split_deinit(&split);
}

static void push_single(cluster *c, const em_csr *csr, em_combiner combiner, const float *g,
                        em_push_result *result)
{
    em_push_request request = {.batch = *csr,
                               .combiner = combiner,
                               .gradients = g,
                               .gradient_count = em_csr_output_vectors(csr, combiner) * DIM};
    em_error err;
    ck_assert_msg(em_table_push(c->single, &request, result, &err) == EM_OK, "%s", err.message);
}

static void push_split(cluster *c, const em_csr *csr, em_combiner combiner, const float *g,
                       em_push_result *total)
{
    em__client_split split;
    em_error err;
    ck_assert_int_eq(em__client_split_push(csr, combiner, DIM, g, c->servers, &split, &err),
                     EM_OK);
    *total = (em_push_result){0};
    uint64_t keys = 0;
    for (uint32_t s = 0; s < c->servers; s++) {
        const em__client_sub_batch *sub = &split.servers[s];
        ck_assert_uint_eq(sub->batch.rows, csr->rows);
        ck_assert_uint_eq(sub->gradient_count, sub->batch.nnz * DIM);
        keys += sub->batch.nnz;
        em_push_request request = {.batch = sub->batch,
                                   .combiner = EM_COMBINER_NONE,
                                   .gradients = sub->gradients,
                                   .gradient_count = sub->gradient_count};
        em_push_result result;
        ck_assert_msg(em_table_push(c->tables[s], &request, &result, &err) == EM_OK, "%s",
                      err.message);
        total->updated += result.updated;
        total->created += result.created;
    }
    ck_assert_uint_eq(keys, csr->nnz); /* every occurrence goes to exactly one server */
    em__client_split_deinit(&split);
}

/* ---- snapshots --------------------------------------------------------------------- */

typedef struct snapshot {
    uint64_t count;
    uint32_t width;
    uint64_t *keys;
    float *values;
} snapshot;

static void snapshot_add(snapshot *s, em_table *table)
{
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    s->width = stats.row_floats;
    s->keys = realloc(s->keys, (s->count + stats.rows + 1) * sizeof(uint64_t));
    s->values = realloc(s->values, (s->count + stats.rows + 1) * s->width * sizeof(float));
    em_table_cursor cursor = {0};
    em_error err;
    uint64_t end = s->count + stats.rows;
    for (;;) {
        uint64_t got = 0;
        ck_assert_int_eq(em_table_export(table, &cursor, end - s->count + 1, s->keys + s->count,
                                         s->values + s->count * s->width, &got, &err),
                         EM_OK);
        if (got == 0)
            break;
        s->count += got;
    }
    ck_assert_uint_eq(s->count, end);
}

static const snapshot *sort_target;

static int compare_rows(const void *a, const void *b)
{
    uint64_t x = sort_target->keys[*(const uint64_t *)a];
    uint64_t y = sort_target->keys[*(const uint64_t *)b];
    return x < y ? -1 : x > y;
}

/* Key-sorted copy of s's rows (s is freed). */
static snapshot sorted(snapshot *s)
{
    uint64_t *order = malloc((s->count + 1) * sizeof(uint64_t));
    for (uint64_t i = 0; i < s->count; i++)
        order[i] = i;
    sort_target = s;
    qsort(order, s->count, sizeof(uint64_t), compare_rows);
    snapshot out = {.count = s->count, .width = s->width};
    out.keys = malloc((s->count + 1) * sizeof(uint64_t));
    out.values = malloc((s->count + 1) * s->width * sizeof(float));
    for (uint64_t i = 0; i < s->count; i++) {
        out.keys[i] = s->keys[order[i]];
        memcpy(out.values + i * s->width, s->values + order[i] * s->width,
               s->width * sizeof(float));
    }
    free(order);
    free(s->keys);
    free(s->values);
    return out;
}

static void assert_same_rows(cluster *c)
{
    snapshot one = {0}, many = {0};
    snapshot_add(&one, c->single);
    for (uint32_t s = 0; s < c->servers; s++)
        snapshot_add(&many, c->tables[s]);
    one = sorted(&one);
    many = sorted(&many);
    ck_assert_uint_eq(one.count, many.count);
    ck_assert_uint_eq(one.width, many.width);
    ck_assert(memcmp(one.keys, many.keys, one.count * sizeof(uint64_t)) == 0);
    ck_assert_msg(memcmp(one.values, many.values, one.count * one.width * sizeof(float)) == 0,
                  "rows (weights and optimizer state) differ between one table and %u",
                  c->servers);
    free(one.keys);
    free(one.values);
    free(many.keys);
    free(many.values);
}

/* ---- tests ------------------------------------------------------------------------- */

static void assert_pulls_identical(cluster *c, const em_csr *csr, em_combiner combiner,
                                   bool create, int round)
{
    uint64_t floats = em_csr_output_vectors(csr, combiner) * DIM;
    float *expected = malloc((floats + 1) * sizeof(float));
    float *got = malloc((floats + 1) * sizeof(float));
    memset(got, 0xff, (floats + 1) * sizeof(float));
    em_pull_result one, many;
    pull_single(c, csr, combiner, create, expected, &one);
    pull_split(c, csr, combiner, create, got, &many);
    ck_assert_msg(memcmp(expected, got, floats * sizeof(float)) == 0,
                  "round %d: %s pull over %u servers differs from one table", round,
                  em_combiner_name(combiner), c->servers);
    ck_assert_uint_eq(one.unique_keys, many.unique_keys);
    ck_assert_uint_eq(one.missing, many.missing);
    ck_assert_uint_eq(one.created, many.created);
    free(expected);
    free(got);
}

/* Loop index: (servers - 1) * 4 + combiner. The optimizer changes with the loop too. */
/* ---- routing ------------------------------------------------------------------------ */

/* Servers own whole buckets: a key goes where its bucket goes. The buckets spread
 * evenly enough, and growing the list by one moves only buckets onto the new server,
 * about 1/(n+1) of them. */
START_TEST(keys_route_by_bucket_evenly_and_growth_moves_few)
{
    for (uint64_t key = 0; key < 100000; key += 7)
        for (int32_t n = 1; n <= 9; n += 4)
            ck_assert_int_eq(em_key_server(key * 0x9e3779b97f4a7c15ull, n),
                             em_bucket_server(em_key_bucket(key * 0x9e3779b97f4a7c15ull), n));
    for (int32_t n = 1; n <= 32; n++) {
        uint32_t owned[33] = {0}, moved = 0;
        for (uint32_t b = 0; b < EM_KEY_BUCKETS; b++) {
            int32_t s = em_bucket_server(b, n), grown = em_bucket_server(b, n + 1);
            ck_assert(s >= 0 && s < n);
            owned[s]++;
            if (grown != s) {
                ck_assert_int_eq(grown, n); /* only ever onto the new server */
                moved++;
            }
        }
        uint32_t most = 0;
        for (int32_t s = 0; s < n; s++)
            most = owned[s] > most ? owned[s] : most;
        double mean = (double)EM_KEY_BUCKETS / n, excess = most / mean - 1.0;
        double moved_share = (double)moved / EM_KEY_BUCKETS, expected = 1.0 / (n + 1);
        if (n == 2 || n == 3 || n == 8 || n == 16 || n == 32)
            printf("%2d servers: the fullest holds %.1f%% more buckets than the mean; growing "
                   "to %d moves %.1f%% (1/(n+1) = %.1f%%)\n",
                   n, 100.0 * excess, n + 1, 100.0 * moved_share, 100.0 * expected);
        ck_assert_msg(excess < (n <= 16 ? 0.08 : 0.25), "%d servers: %.3f over the mean", n,
                      excess);
        ck_assert_msg(moved_share > 0.65 * expected && moved_share < 1.35 * expected,
                      "%d servers: %.3f moved", n, moved_share);
    }
}
END_TEST

/* Inside a daemon a key's shard is h(key) mod the shard count, whatever the count: the
 * mask taken for powers of two gives the same shard as the remainder, so checkpoints and
 * every kernel agree on it. */
START_TEST(a_keys_shard_is_its_hash_mod_the_shard_count)
{
    em_test_rng rng;
    em_test_rng_init(&rng, 77);
    for (int i = 0; i < 5000; i++) {
        uint64_t key = i < 4 ? (uint64_t)i - 2 : em_test_rng_next(&rng); /* -2, -1, 0, 1 first */
        uint64_t hash = em_key_hash(key);
        uint32_t wrong = 0; /* the first count whose shard is not the remainder */
        for (uint32_t count = 1; count <= 70 && wrong == 0; count++)
            wrong = em_key_shard(key, count) == hash % count ? 0 : count;
        for (uint32_t bit = 7; bit < 32 && wrong == 0; bit++) {
            uint32_t count = 1u << bit;
            wrong = em_key_shard(key, count) == hash % count ? 0 : count;
            if (wrong == 0 && em_key_shard(key, count - 1) != hash % (count - 1))
                wrong = count - 1;
        }
        if (wrong == 0 && em_key_shard(key, UINT32_MAX) != hash % UINT32_MAX)
            wrong = UINT32_MAX;
        ck_assert_msg(wrong == 0, "key %" PRIu64 ", %u shards: shard %u, remainder %" PRIu64, key,
                      wrong, em_key_shard(key, wrong), hash % (wrong == 0 ? 1 : wrong));
    }
}
END_TEST

START_TEST(split_over_servers_matches_one_table_bit_for_bit)
{
    em_combiner combiner = (em_combiner)(_i % 4);
    cluster c = {.servers = (uint32_t)(_i / 4) + 1};
    em_backend *backend = make_backend();
    int optimizer = (_i + _i / 4) % 4; /* each server count meets every optimizer */
    c.single = make_table(backend, optimizer, 3);
    for (uint32_t s = 0; s < c.servers; s++)
        c.tables[s] = make_table(backend, optimizer, s + 1); /* shard counts differ too */
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() * 17 + (uint64_t)_i);
    for (int round = 0; round < 20; round++) {
        em_test_batch b = em_test_random_batch(&rng, 1 + (uint32_t)em_test_rng_below(&rng, 30), 7, 120);
        bool create = round % 5 != 4;
        assert_pulls_identical(&c, &b.csr, combiner, create, round);
        uint64_t vectors = em_csr_output_vectors(&b.csr, combiner);
        float *g = em_test_random_floats(&rng, vectors * DIM);
        em_push_result one, many;
        push_single(&c, &b.csr, combiner, g, &one);
        push_split(&c, &b.csr, combiner, g, &many);
        ck_assert_uint_eq(one.updated, many.updated);
        ck_assert_uint_eq(one.created, many.created);
        free(g);
        em_test_batch_free(&b);
    }
    /* every key once more, then every row */
    em_test_batch all = em_test_random_batch(&rng, 40, 7, 120);
    assert_pulls_identical(&c, &all.csr, EM_COMBINER_NONE, false, -1);
    em_test_batch_free(&all);
    assert_same_rows(&c);
    em_table_destroy(c.single);
    for (uint32_t s = 0; s < c.servers; s++)
        em_table_destroy(c.tables[s]);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(pull_split_keeps_rows_and_sends_each_key_once)
{
    /* rows: [5 9 5] [] [9] [7 7] */
    const uint32_t offsets[] = {0, 3, 3, 4, 6};
    const uint64_t keys[] = {5, 9, 5, 9, 7, 7};
    em_csr csr = {.rows = 4, .nnz = 6, .offsets = offsets, .keys = keys};
    em__client_split split;
    em_error err;
    ck_assert_int_eq(em__client_split_pull(&csr, 2, &split, &err), EM_OK);
    uint64_t total = 0;
    for (uint32_t s = 0; s < 2; s++) {
        const em_csr *sub = &split.servers[s].batch;
        ck_assert_uint_eq(sub->rows, 4);
        ck_assert_ptr_null(split.servers[s].gradients);
        total += sub->nnz;
        /* a key sits in the row of its first occurrence */
        for (uint64_t k = 0; k < sub->nnz; k++) {
            uint32_t row = 0;
            while (sub->offsets[row + 1] <= k)
                row++;
            uint32_t expected_row = sub->keys[k] == 7 ? 3 : 0;
            ck_assert_uint_eq(row, expected_row);
        }
    }
    ck_assert_uint_eq(total, 3);
    for (uint64_t k = 0; k < 6; k++) {
        const em__client_sub_batch *sub = &split.servers[split.key_server[k]];
        ck_assert_uint_eq(sub->keys[split.key_index[k]], keys[k]);
    }
    em__client_split_deinit(&split);
    em__client_split_deinit(&split); /* safe twice */
}
END_TEST

START_TEST(push_split_spreads_row_gradients_over_the_full_row)
{
    /* one row of 4 keys with MEAN: every key gets g / 4 whichever server holds it */
    const uint32_t offsets[] = {0, 4};
    const uint64_t keys[] = {1, 2, 3, 4};
    const float g[2] = {1.0f, -3.0f};
    em_csr csr = {.rows = 1, .nnz = 4, .offsets = offsets, .keys = keys};
    em__client_split split;
    em_error err;
    ck_assert_int_eq(em__client_split_push(&csr, EM_COMBINER_MEAN, 2, g, 3, &split, &err), EM_OK);
    uint64_t total = 0;
    for (uint32_t s = 0; s < 3; s++) {
        const em__client_sub_batch *sub = &split.servers[s];
        total += sub->batch.nnz;
        for (uint64_t k = 0; k < sub->batch.nnz; k++) {
            ck_assert_float_eq(sub->gradients[2 * k], 0.25f);
            ck_assert_float_eq(sub->gradients[2 * k + 1], -0.75f);
        }
    }
    ck_assert_uint_eq(total, 4);
    em__client_split_deinit(&split);
}
END_TEST

START_TEST(empty_batches_split_to_empty_sub_batches)
{
    const uint32_t none[] = {0};
    const uint32_t empty_rows[] = {0, 0, 0};
    em_csr batches[] = {{.rows = 0, .nnz = 0, .offsets = none, .keys = NULL},
                        {.rows = 2, .nnz = 0, .offsets = empty_rows, .keys = NULL}};
    for (int i = 0; i < 2; i++) {
        em__client_split split;
        em_error err;
        ck_assert_int_eq(em__client_split_pull(&batches[i], 3, &split, &err), EM_OK);
        for (uint32_t s = 0; s < 3; s++) {
            ck_assert_uint_eq(split.servers[s].batch.rows, batches[i].rows);
            ck_assert_uint_eq(split.servers[s].batch.nnz, 0);
            ck_assert_int_eq(em_csr_validate(&split.servers[s].batch, &err), EM_OK);
        }
        float out[2 * DIM];
        memset(out, 0xff, sizeof(out));
        const float *vectors[3] = {NULL, NULL, NULL};
        em__client_split_merge_pull(&split, &batches[i], EM_COMBINER_SQRTN, DIM, vectors, out);
        for (uint32_t j = 0; j < batches[i].rows * DIM; j++)
            ck_assert_float_eq(out[j], 0.0f);
        em__client_split_deinit(&split);
        ck_assert_int_eq(em__client_split_push(&batches[i], EM_COMBINER_SUM, DIM, out, 3, &split,
                                               &err),
                         EM_OK);
        for (uint32_t s = 0; s < 3; s++)
            ck_assert_uint_eq(split.servers[s].gradient_count, 0);
        em__client_split_deinit(&split);
    }
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("client_split");
    TCase *engine = tcase_create("against_tables");
    tcase_set_timeout(engine, 120);
    tcase_add_loop_test(engine, split_over_servers_matches_one_table_bit_for_bit, 0,
                        4 * MAX_SERVERS);
    suite_add_tcase(suite, engine);
    TCase *shape = tcase_create("shape");
    tcase_add_test(shape, pull_split_keeps_rows_and_sends_each_key_once);
    tcase_add_test(shape, push_split_spreads_row_gradients_over_the_full_row);
    tcase_add_test(shape, empty_batches_split_to_empty_sub_batches);
    tcase_add_test(shape, keys_route_by_bucket_evenly_and_growth_moves_few);
    tcase_add_test(shape, a_keys_shard_is_its_hash_mod_the_shard_count);
    suite_add_tcase(suite, shape);
    return em_test_run(suite);
}
