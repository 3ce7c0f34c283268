/*
 * DESIGN: the host side of the optimizers: whole rows on the CPU device. The list of
 * optimizers, the row layout and the element formulas are in common/optimizer.h,
 * shared with the kernels.
 */
#ifndef EMBER_LIB_OPTIMIZER_H
#define EMBER_LIB_OPTIMIZER_H

#include <stdbool.h>

#include "common/optimizer.h"

/* Initial optimizer state of a new row (accumulators at initial_accumulator, adam
 * moments and step at 0). */
void em_optimizer_init_state(const em_optimizer_config *config, uint32_t dim, float *state);

/* One step on one row: weights[0..dim), state as above, gradient[0..dim). */
void em_optimizer_apply_row(const em_optimizer_config *config, uint32_t dim, float *weights,
                            float *state, const float *gradient);

/* "sgd", "adagrad", "rowwise_adagrad", "adam"; "unknown" for a value outside the enum. */
const char *em_optimizer_name(em_optimizer_kind kind);

/* The kind named name; false when there is none. */
bool em_optimizer_from_name(const char *name, em_optimizer_kind *out);

/* What state float index (0-based, after the weights) of a row of kind holds:
 * "accumulator", "first moment", "second moment", "step". */
const char *em_optimizer_state_name(em_optimizer_kind kind, uint32_t dim, uint32_t index);

/* Whether state float index must be >= 0 (accumulators, second moments, steps): a
 * negative one would make later steps NaN. */
bool em_optimizer_state_nonnegative(em_optimizer_kind kind, uint32_t dim, uint32_t index);

/* The default eps of kind (torch.optim's). */
float em_optimizer_default_eps(em_optimizer_kind kind);

#endif
