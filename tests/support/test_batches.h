/*
 * Random CSR batches, gradients and whole-table snapshots shared by the suites that
 * drive tables (directly, through a daemon, or through the client).
 */
#ifndef EMBER_TESTS_TEST_BATCHES_H
#define EMBER_TESTS_TEST_BATCHES_H

#include <stdint.h>

#include "lib/table/csr.h"
#include "lib/table/table.h"
#include "tests/support/test_support.h"

typedef struct em_test_batch {
    em_csr csr; /* points into offsets and keys */
    uint32_t *offsets;
    uint64_t *keys;
} em_test_batch;

/* A key drawn from `universe` values spread over the u64 range, or (4 times in
 * universe + 4) one of 0, UINT64_MAX, UINT64_MAX - 1, UINT64_MAX - 2: the values hash
 * maps reserve as markers. */
uint64_t em_test_draw_key(em_test_rng *rng, uint64_t universe);

/* rows rows of 0..max_length keys each (empty rows included), keys from
 * em_test_draw_key, so keys repeat within and across rows. */
em_test_batch em_test_random_batch(em_test_rng *rng, uint32_t rows, uint32_t max_length,
                                   uint64_t universe);

/* One key per row: keys[0..n). */
em_test_batch em_test_key_batch(const uint64_t *keys, uint32_t n);

void em_test_batch_free(em_test_batch *batch);

/* count floats uniform in [-1, 1) (malloc'ed, one spare element so count 0 is fine). */
float *em_test_random_floats(em_test_rng *rng, uint64_t count);

/* The four optimizers with the hyperparameters the table suites use, by
 * em_optimizer_kind: sgd, adagrad, rowwise_adagrad, adam. */
extern const em_optimizer_config em_test_optimizers[4];

/* em_table_create, failing the test on an error. */
em_table *em_test_make_table(em_backend *backend, const em_table_config *config);

/* em_table_pull / em_table_push with the output or gradient size the batch, combiner and
 * table dim call for; result may be NULL. */
em_status em_test_pull(em_table *table, const em_csr *batch, em_combiner combiner, bool create,
                       float *out, em_pull_result *result, em_error *err);
em_status em_test_push(em_table *table, const em_csr *batch, em_combiner combiner,
                       const float *gradients, em_push_result *result, em_error *err);

/* Every row of a table (key, weights, optimizer state), sorted by key. */
typedef struct em_test_snapshot {
    uint64_t count;
    uint32_t width; /* floats per row */
    uint64_t *keys;
    float *values;
} em_test_snapshot;

/* Exports in chunks of `chunk` rows (small chunks exercise the cursor); checks that the
 * export holds every row once. */
em_test_snapshot em_test_snapshot_take(em_table *table, uint64_t chunk);
void em_test_snapshot_free(em_test_snapshot *snapshot);

void em_test_assert_snapshots_identical(const em_test_snapshot *a, const em_test_snapshot *b);

/* Same keys, every value within 1e-5 relative of expected's (reference_close, floor). */
void em_test_assert_snapshots_close(const em_test_snapshot *got,
                                    const em_test_snapshot *expected, double floor);

/* The table's rows equal before's, bit for bit. */
void em_test_assert_table_unchanged(em_table *table, const em_test_snapshot *before);

#endif
