/*
 * DESIGN: the optimizers, applied in place per unique key (README.md, "Semantics").
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
#ifndef EMBER_LIB_OPTIMIZER_H
#define EMBER_LIB_OPTIMIZER_H

#include <stdint.h>

#ifndef __CUDACC__
#include <math.h>
#endif

#include "lib/keyhash.h"

typedef enum em_optimizer_kind {
    EM_OPTIMIZER_SGD = 0,
    EM_OPTIMIZER_ADAGRAD = 1,
    EM_OPTIMIZER_ROWWISE_ADAGRAD = 2,
    EM_OPTIMIZER_ADAM = 3,
} em_optimizer_kind;

typedef struct em_optimizer_config {
    int kind; /* em_optimizer_kind */
    float learning_rate;
    float eps;
    float initial_accumulator; /* adagrad, rowwise_adagrad */
    float beta1, beta2;        /* adam */
} em_optimizer_config;

/* Largest step count the float slot holds exactly. */
#define EM_ADAM_MAX_STEP 16777216.0f

/* Floats of optimizer state per row. */
EM_HOST_DEVICE uint32_t em_optimizer_state_floats(int kind, uint32_t dim)
{
    switch (kind) {
    case EM_OPTIMIZER_ADAGRAD:
        return dim;
    case EM_OPTIMIZER_ROWWISE_ADAGRAD:
        return 1;
    case EM_OPTIMIZER_ADAM:
        return 2 * dim + 1;
    default:
        return 0;
    }
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

#ifndef __CUDACC__
/* Initial optimizer state of a new row (accumulators at initial_accumulator, adam
 * moments and step at 0). */
void em_optimizer_init_state(const em_optimizer_config *config, uint32_t dim, float *state);

/* One step on one row: weights[0..dim), state as above, gradient[0..dim). */
void em_optimizer_apply_row(const em_optimizer_config *config, uint32_t dim, float *weights,
                            float *state, const float *gradient);

/* "sgd", "adagrad", "rowwise_adagrad", "adam". */
const char *em_optimizer_name(int kind);
#endif

#endif
