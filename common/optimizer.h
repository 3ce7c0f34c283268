/*
 * DESIGN: the optimizers, declared once (README.md, "Semantics").
 *
 * EM_OPTIMIZERS is the one list of optimizers. Each row gives the kind, its
 * configuration name, the floats of state it keeps per weight element and per row,
 * the hyperparameters (config keys) that apply to it, and its default eps. The enum,
 * the names, the state sizes, the config validation (lib/table/table_config.c) and the
 * host dispatch (lib/device/optimizer.c) are generated from it; the switches that
 * remain (kernel launches, reference model) list every kind without a default, and
 * the tree builds with -Wswitch-enum, so a new row that one of them misses does not
 * compile.
 *
 * A row is its weights w[0..dim) followed by its optimizer state:
 *
 *   sgd              no state            w -= lr * g
 *   adagrad          s[0..dim)           s += g*g; w -= lr * g / (sqrt(s) + eps)
 *   rowwise_adagrad  s (one per row)     s += mean(g*g); w -= lr * g / (sqrt(s) + eps)
 *   adam             m[0..dim), v[0..dim), t   (lazy: t counts this row's own steps)
 *                    t += 1; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g
 *                    w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
 *
 * Arithmetic is binary32 per element; the per-row adam bias corrections are computed
 * in binary64 and rounded once. t is stored as a float: it counts exactly to 2^24, and
 * past that both corrections are 1 in binary32, so saturating there changes nothing.
 * The element formulas are EM_HOST_DEVICE so the CUDA kernels run the same code.
 */
#ifndef EMBER_COMMON_OPTIMIZER_H
#define EMBER_COMMON_OPTIMIZER_H

#include <stdint.h>

#ifndef __CUDACC__
#include <math.h>
#endif

#include "common/host_device.h"

/* Hyperparameters beyond lr (always taken), as bits of the keys column below. */
#define EM_OPTIMIZER_KEY_EPS 1u
#define EM_OPTIMIZER_KEY_INITIAL_ACCUMULATOR 2u
#define EM_OPTIMIZER_KEY_BETAS 4u /* beta1 and beta2 */

/* X(KIND, name, state per element, state per row, keys, default eps) */
#define EM_OPTIMIZERS(X)                                                                      \
    X(SGD, sgd, 0, 0, 0u, 0.0f)                                                               \
    X(ADAGRAD, adagrad, 1, 0, EM_OPTIMIZER_KEY_EPS | EM_OPTIMIZER_KEY_INITIAL_ACCUMULATOR,   \
      1e-10f)                                                                                 \
    X(ROWWISE_ADAGRAD, rowwise_adagrad, 0, 1,                                                 \
      EM_OPTIMIZER_KEY_EPS | EM_OPTIMIZER_KEY_INITIAL_ACCUMULATOR, 1e-10f)                    \
    X(ADAM, adam, 2, 1, EM_OPTIMIZER_KEY_EPS | EM_OPTIMIZER_KEY_BETAS, 1e-8f)

typedef enum em_optimizer_kind {
#define EM_OPTIMIZER_ENUM(KIND, name, per_element, per_row, keys, eps) EM_OPTIMIZER_##KIND,
    EM_OPTIMIZERS(EM_OPTIMIZER_ENUM)
#undef EM_OPTIMIZER_ENUM
    EM_OPTIMIZER_COUNT
} em_optimizer_kind;

typedef struct em_optimizer_config {
    em_optimizer_kind kind;
    float learning_rate;
    float eps;
    float initial_accumulator; /* adagrad, rowwise_adagrad */
    float beta1, beta2;        /* adam */
} em_optimizer_config;

/* Largest step count the float slot holds exactly. */
#define EM_ADAM_MAX_STEP 16777216.0f

/* Floats of optimizer state per row. */
EM_HOST_DEVICE uint32_t em_optimizer_state_floats(em_optimizer_kind kind, uint32_t dim)
{
    switch (kind) {
#define EM_OPTIMIZER_STATE(KIND, name, per_element, per_row, keys, eps)                        \
    case EM_OPTIMIZER_##KIND:                                                                  \
        return (per_element) * dim + (per_row);
        EM_OPTIMIZERS(EM_OPTIMIZER_STATE)
#undef EM_OPTIMIZER_STATE
    case EM_OPTIMIZER_COUNT:
        break;
    }
    return 0;
}

/* The config keys (EM_OPTIMIZER_KEY_*) that apply to kind. */
EM_HOST_DEVICE unsigned em_optimizer_keys(em_optimizer_kind kind)
{
    switch (kind) {
#define EM_OPTIMIZER_KEYS(KIND, name, per_element, per_row, keys, eps)                         \
    case EM_OPTIMIZER_##KIND:                                                                  \
        return (keys);
        EM_OPTIMIZERS(EM_OPTIMIZER_KEYS)
#undef EM_OPTIMIZER_KEYS
    case EM_OPTIMIZER_COUNT:
        break;
    }
    return 0;
}

/* Whether a new row's state starts at initial_accumulator (else at 0). */
EM_HOST_DEVICE int em_optimizer_has_accumulator(em_optimizer_kind kind)
{
    return (em_optimizer_keys(kind) & EM_OPTIMIZER_KEY_INITIAL_ACCUMULATOR) != 0;
}

EM_HOST_DEVICE void em_sgd_element(float *w, float g, float learning_rate)
{
    *w -= learning_rate * g;
}

EM_HOST_DEVICE void em_adagrad_element(float *w, float *s, float g, float learning_rate, float eps)
{
    *s += g * g;
    *w -= learning_rate * g / (sqrtf(*s) + eps);
}

/* Rowwise adagrad's sum of g*g over a row is taken in one order on every backend, the
 * GPU's: EM_ROWWISE_LANES partial sums, lane l adding the elements l, l + lanes, ... in
 * increasing order, then the partials pairwise, lane l adding lane l + k for k = 16, 8,
 * 4, 2, 1 (a warp's butterfly ends with this sum in every lane). */
#define EM_ROWWISE_LANES 32u

EM_HOST_DEVICE float em_rowwise_squares(const float *gradient, uint32_t dim)
{
    float partial[EM_ROWWISE_LANES];
    for (uint32_t lane = 0; lane < EM_ROWWISE_LANES; lane++) {
        float sum = 0.0f;
        for (uint32_t j = lane; j < dim; j += EM_ROWWISE_LANES)
            sum += gradient[j] * gradient[j];
        partial[lane] = sum;
    }
    for (uint32_t half = EM_ROWWISE_LANES / 2; half > 0; half /= 2)
        for (uint32_t lane = 0; lane < half; lane++)
            partial[lane] += partial[lane + half];
    return partial[0];
}

/* Rowwise adagrad: the row's accumulator has been advanced already; denominator is
 * sqrt(s) + eps for every element. */
EM_HOST_DEVICE void em_rowwise_adagrad_element(float *w, float g, float learning_rate,
                                               float denominator)
{
    *w -= learning_rate * g / denominator;
}

/* Per-row adam constants for step t (after the increment). */
typedef struct em_adam_row {
    float correction1; /* 1 - b1^t */
    float correction2; /* 1 - b2^t */
} em_adam_row;

EM_HOST_DEVICE em_adam_row em_adam_row_constants(float beta1, float beta2, float step)
{
    em_adam_row row;
    row.correction1 = (float)(1.0 - pow((double)beta1, (double)step));
    row.correction2 = (float)(1.0 - pow((double)beta2, (double)step));
    return row;
}

EM_HOST_DEVICE float em_adam_next_step(float step)
{
    return step < EM_ADAM_MAX_STEP ? step + 1.0f : step;
}

/* Hyperparameters as values (not through the config) so element loops can be
 * vectorised: nothing they write can alias them. */
typedef struct em_adam_constants {
    float beta1, beta2, learning_rate, eps;
    float correction1, correction2; /* 1 - b1^t, 1 - b2^t for the row's step */
} em_adam_constants;

EM_HOST_DEVICE em_adam_constants em_adam_row_setup(const em_optimizer_config *config, float step)
{
    em_adam_row row = em_adam_row_constants(config->beta1, config->beta2, step);
    em_adam_constants constants;
    constants.beta1 = config->beta1;
    constants.beta2 = config->beta2;
    constants.learning_rate = config->learning_rate;
    constants.eps = config->eps;
    constants.correction1 = row.correction1;
    constants.correction2 = row.correction2;
    return constants;
}

EM_HOST_DEVICE void em_adam_element(float *w, float *m, float *v, float g, em_adam_constants c)
{
    *m = c.beta1 * *m + (1.0f - c.beta1) * g;
    *v = c.beta2 * *v + (1.0f - c.beta2) * g * g;
    float m_hat = *m / c.correction1;
    float v_hat = *v / c.correction2;
    *w -= c.learning_rate * m_hat / (sqrtf(v_hat) + c.eps);
}

#endif
