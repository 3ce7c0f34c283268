#include "tests/support/test_batches.h"

#include <stdlib.h>
#include <string.h>

#include "tests/support/reference_table.h"

uint64_t em_test_draw_key(em_test_rng *rng, uint64_t universe)
{
    static const uint64_t special[] = {0, UINT64_MAX, UINT64_MAX - 1, UINT64_MAX - 2};
    uint64_t pick = em_test_rng_below(rng, universe + 4);
    return pick < 4 ? special[pick] : (pick - 4) * 0x9e3779b97f4a7c15ull + 1;
}

em_test_batch em_test_random_batch(em_test_rng *rng, uint32_t rows, uint32_t max_length,
                                   uint64_t universe)
{
    em_test_batch b;
    b.offsets = malloc((rows + 1) * sizeof(uint32_t));
    b.keys = malloc(((size_t)rows * max_length + 1) * sizeof(uint64_t));
    b.offsets[0] = 0;
    for (uint32_t r = 0; r < rows; r++) {
        uint32_t length = (uint32_t)em_test_rng_below(rng, max_length + 1);
        for (uint32_t k = 0; k < length; k++)
            b.keys[b.offsets[r] + k] = em_test_draw_key(rng, universe);
        b.offsets[r + 1] = b.offsets[r] + length;
    }
    b.csr = (em_csr){.rows = rows, .nnz = b.offsets[rows], .offsets = b.offsets, .keys = b.keys};
    return b;
}

em_test_batch em_test_key_batch(const uint64_t *keys, uint32_t n)
{
    em_test_batch b;
    b.offsets = malloc((n + 1) * sizeof(uint32_t));
    b.keys = malloc((n + 1) * sizeof(uint64_t));
    for (uint32_t i = 0; i <= n; i++)
        b.offsets[i] = i;
    memcpy(b.keys, keys, n * sizeof(uint64_t));
    b.csr = (em_csr){.rows = n, .nnz = n, .offsets = b.offsets, .keys = b.keys};
    return b;
}

void em_test_batch_free(em_test_batch *batch)
{
    free(batch->offsets);
    free(batch->keys);
    batch->offsets = NULL;
    batch->keys = NULL;
}

float *em_test_random_floats(em_test_rng *rng, uint64_t count)
{
    float *values = malloc((count + 1) * sizeof(float));
    for (uint64_t i = 0; i < count; i++)
        values[i] = (float)(2.0 * em_test_rng_unit(rng) - 1.0);
    return values;
}

const em_optimizer_config em_test_optimizers[4] = {
    {.kind = EM_OPTIMIZER_SGD, .learning_rate = 0.05f},
    {.kind = EM_OPTIMIZER_ADAGRAD, .learning_rate = 0.1f, .eps = 1e-10f,
     .initial_accumulator = 0.01f},
    {.kind = EM_OPTIMIZER_ROWWISE_ADAGRAD, .learning_rate = 0.1f, .eps = 1e-10f,
     .initial_accumulator = 0.0f},
    {.kind = EM_OPTIMIZER_ADAM, .learning_rate = 0.01f, .eps = 1e-8f, .beta1 = 0.9f,
     .beta2 = 0.999f},
};

em_table *em_test_make_table(em_backend *backend, const em_table_config *config)
{
    em_table *table = NULL;
    em_error err;
    ck_assert_msg(em_table_create(backend, config, &table, &err) == EM_OK, "%s", err.message);
    return table;
}

em_status em_test_pull(em_table *table, const em_csr *batch, em_combiner combiner, bool create,
                       float *out, em_pull_result *result, em_error *err)
{
    em_pull_request request = {
        .batch = *batch,
        .combiner = combiner,
        .create_missing = create,
        .out = out,
        .out_capacity = em_csr_output_vectors(batch, combiner) * em_table_dim(table),
    };
    em_pull_result ignored;
    return em_table_pull(table, &request, result != NULL ? result : &ignored, err);
}

em_status em_test_push(em_table *table, const em_csr *batch, em_combiner combiner,
                       const float *gradients, em_push_result *result, em_error *err)
{
    em_push_request request = {
        .batch = *batch,
        .combiner = combiner,
        .gradients = gradients,
        .gradient_count = em_csr_output_vectors(batch, combiner) * em_table_dim(table),
    };
    em_push_result ignored;
    return em_table_push(table, &request, result != NULL ? result : &ignored, err);
}

typedef struct keyed_row {
    uint64_t key;
    uint64_t index;
} keyed_row;

static int compare_keyed_rows(const void *a, const void *b)
{
    uint64_t x = ((const keyed_row *)a)->key, y = ((const keyed_row *)b)->key;
    return x < y ? -1 : x > y;
}

em_test_snapshot em_test_snapshot_take(em_table *table, uint64_t chunk)
{
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    em_test_snapshot s = {.width = stats.row_floats};
    uint64_t capacity = stats.rows + chunk;
    uint64_t *keys = malloc(capacity * sizeof(uint64_t));
    float *values = malloc(capacity * s.width * sizeof(float));
    em_table_cursor cursor = {0};
    em_error err;
    for (;;) {
        uint64_t got = 0;
        ck_assert_msg(em_table_export(table, &cursor, chunk, keys + s.count,
                                      values + s.count * s.width, &got, &err) == EM_OK,
                      "%s", err.message);
        if (got == 0)
            break;
        ck_assert_uint_le(got, chunk);
        s.count += got;
        ck_assert_uint_le(s.count, stats.rows);
    }
    ck_assert_uint_eq(s.count, stats.rows);
    keyed_row *order = malloc((s.count + 1) * sizeof(*order));
    for (uint64_t i = 0; i < s.count; i++)
        order[i] = (keyed_row){keys[i], i};
    qsort(order, s.count, sizeof(*order), compare_keyed_rows);
    s.keys = malloc((s.count + 1) * sizeof(uint64_t));
    s.values = malloc((s.count + 1) * s.width * sizeof(float));
    for (uint64_t i = 0; i < s.count; i++) {
        ck_assert_msg(i == 0 || order[i].key != order[i - 1].key, "key %llu exported twice",
                      (unsigned long long)order[i].key);
        s.keys[i] = order[i].key;
        memcpy(s.values + i * s.width, values + order[i].index * s.width, s.width * sizeof(float));
    }
    free(order);
    free(keys);
    free(values);
    return s;
}

void em_test_snapshot_free(em_test_snapshot *snapshot)
{
    free(snapshot->keys);
    free(snapshot->values);
    snapshot->keys = NULL;
    snapshot->values = NULL;
}

static void assert_same_keys(const em_test_snapshot *a, const em_test_snapshot *b)
{
    ck_assert_uint_eq(a->count, b->count);
    ck_assert_uint_eq(a->width, b->width);
    for (uint64_t i = 0; i < a->count; i++)
        ck_assert_msg(a->keys[i] == b->keys[i], "row %llu: key %llu vs %llu",
                      (unsigned long long)i, (unsigned long long)a->keys[i],
                      (unsigned long long)b->keys[i]);
}

void em_test_assert_snapshots_identical(const em_test_snapshot *a, const em_test_snapshot *b)
{
    assert_same_keys(a, b);
    for (uint64_t i = 0; i < a->count * a->width; i++)
        ck_assert_msg(memcmp(&a->values[i], &b->values[i], sizeof(float)) == 0,
                      "key %llu value %llu: %a vs %a",
                      (unsigned long long)a->keys[i / a->width],
                      (unsigned long long)(i % a->width), (double)a->values[i],
                      (double)b->values[i]);
}

void em_test_assert_snapshots_close(const em_test_snapshot *got,
                                    const em_test_snapshot *expected, double floor)
{
    assert_same_keys(got, expected);
    for (uint64_t i = 0; i < expected->count * expected->width; i++)
        ck_assert_msg(reference_close(got->values[i], expected->values[i], floor),
                      "key %llu value %llu: %.9g vs %.9g",
                      (unsigned long long)expected->keys[i / expected->width],
                      (unsigned long long)(i % expected->width), (double)got->values[i],
                      (double)expected->values[i]);
}

void em_test_assert_table_unchanged(em_table *table, const em_test_snapshot *before)
{
    em_test_snapshot after = em_test_snapshot_take(table, 1000);
    em_test_assert_snapshots_identical(before, &after);
    em_test_snapshot_free(&after);
}
