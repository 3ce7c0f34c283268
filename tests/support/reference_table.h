/*
 * A float64 model of a table, written from README.md ("Wire protocol", "Semantics") without any of
 * the engine's code: pull (gather and pooling), push (duplicate sums, per-row gradient
 * spreading, optimizers). Tests compare the engine against it to 1e-5 relative.
 * Initial values come from em_initializer_value (the documented pure function), as
 * float, so both sides start from identical rows.
 */
#ifndef EMBER_TESTS_REFERENCE_TABLE_H
#define EMBER_TESTS_REFERENCE_TABLE_H

#include <stdbool.h>
#include <stdint.h>

#include "lib/table/csr.h"
#include "lib/table/table_config.h"

typedef struct reference_table reference_table;

reference_table *reference_table_create(const em_table_config *config);
void reference_table_destroy(reference_table *table);

uint64_t reference_table_rows(const reference_table *table);

/* out: em_csr_output_vectors x dim doubles. magnitude (nullable, same shape) gets the
 * same pooling over |value|: the scale a pooled sum's rounding error is relative to
 * (float summation error is bounded by n * eps * sum |x_i|, not by |sum x_i|).
 * Returns the distinct missing keys. */
uint64_t reference_pull(reference_table *table, const em_csr *batch, em_combiner combiner,
                        bool create_missing, double *out, double *magnitude);

void reference_push(reference_table *table, const em_csr *batch, em_combiner combiner,
                    const float *gradients);

/* Weights then optimizer state (dim + state floats) of key; false when absent. */
bool reference_row(const reference_table *table, uint64_t key, double *values);

/* One optimizer step in float64 on row (weights then state) with gradient g. */
void reference_apply_optimizer(const em_optimizer_config *optimizer, uint32_t dim, double *row,
                               const double *g);

/* Relative comparison used throughout: |got - expected| <= 1e-5 * max(|expected|, floor). */
bool reference_close(double got, double expected, double floor);

#endif
