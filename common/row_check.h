/*
 * DESIGN: whether one optimizer step keeps a row finite, decided before anything is
 * written.
 *
 * A push is applied only when, for every row it touches, the summed gradient is finite
 * and the step would leave every weight and every optimizer state value finite. This
 * function computes the step element by element into locals, from the row's current
 * values (or, for a row the push would create, from its initializer and initial state),
 * and never writes the row. The CPU device, the CUDA check kernel and its host emulation
 * all call it, so the three decide alike; the arithmetic is the optimizers' own element
 * functions (common/optimizer.h) in the same order as the apply paths.
 *
 * Header-only (EM_HOST_DEVICE); includes nothing of the project but common/.
 */
#ifndef EMBER_COMMON_ROW_CHECK_H
#define EMBER_COMMON_ROW_CHECK_H

#include <float.h>
#include <stdint.h>
#include <string.h>

#include "common/host_device.h"
#include "common/initializer.h"
#include "common/optimizer.h"

/* What the check found, encoded in 32 bits: the kind in the top 4, the element (an
 * index into the row's floats: weights 0..dim-1, then optimizer state) below. */
#define EM_ROW_CHECK_OK 0u
#define EM_ROW_CHECK_GRADIENT 1u /* the summed gradient's element is not finite */
#define EM_ROW_CHECK_VALUE 2u    /* the step would make the row's element non-finite */
#define EM_ROW_CHECK_KIND(code) ((code) >> 28)
#define EM_ROW_CHECK_ELEMENT(code) ((code) & 0x0fffffffu)
#define EM_ROW_CHECK_CODE(kind, element) (((uint32_t)(kind) << 28) | (uint32_t)(element))

EM_HOST_DEVICE int em_row_check_finite(float value)
{
    return isfinite(value) ? 1 : 0;
}

/* The row's current value of float index (weights, then state), or its initial value
 * when row is NULL (the push creates it). */
EM_HOST_DEVICE float em_row_check_value(const float *row, const em_optimizer_config *optimizer,
                                        const em_initializer_config *initializer, uint64_t key,
                                        uint32_t dim, uint32_t index)
{
    if (row != 0)
        return row[index];
    if (index < dim)
        return em_initializer_value(initializer, key, index);
    return em_optimizer_has_accumulator(optimizer->kind) ? optimizer->initial_accumulator : 0.0f;
}

/* The first problem of the step on the values returned by EM_ROW_CHECK_AT(index) (a
 * row's float index: weights, then state), written once for both kinds of row below. */
#define EM_ROW_CHECK_BODY(EM_ROW_CHECK_AT)                                                    \
    switch (optimizer->kind) {                                                                \
    case EM_OPTIMIZER_SGD:                                                                    \
        for (uint32_t j = 0; j < dim; j++) {                                                  \
            float w = EM_ROW_CHECK_AT(j);                                                     \
            em_sgd_element(&w, gradient[j], optimizer->learning_rate);                        \
            if (!em_row_check_finite(w))                                                      \
                return EM_ROW_CHECK_CODE(EM_ROW_CHECK_VALUE, j);                              \
        }                                                                                     \
        break;                                                                                \
    case EM_OPTIMIZER_ADAGRAD:                                                                \
        for (uint32_t j = 0; j < dim; j++) {                                                  \
            float w = EM_ROW_CHECK_AT(j), s = EM_ROW_CHECK_AT(dim + j);                       \
            em_adagrad_element(&w, &s, gradient[j], optimizer->learning_rate, optimizer->eps); \
            if (!em_row_check_finite(s))                                                      \
                return EM_ROW_CHECK_CODE(EM_ROW_CHECK_VALUE, dim + j);                        \
            if (!em_row_check_finite(w))                                                      \
                return EM_ROW_CHECK_CODE(EM_ROW_CHECK_VALUE, j);                              \
        }                                                                                     \
        break;                                                                                \
    case EM_OPTIMIZER_ROWWISE_ADAGRAD: {                                                      \
        float squares = em_rowwise_squares(gradient, dim);                                    \
        float accumulator = EM_ROW_CHECK_AT(dim) + squares / (float)dim;                      \
        if (!em_row_check_finite(accumulator))                                                \
            return EM_ROW_CHECK_CODE(EM_ROW_CHECK_VALUE, dim);                                \
        float denominator = sqrtf(accumulator) + optimizer->eps;                              \
        for (uint32_t j = 0; j < dim; j++) {                                                  \
            float w = EM_ROW_CHECK_AT(j);                                                     \
            em_rowwise_adagrad_element(&w, gradient[j], optimizer->learning_rate, denominator); \
            if (!em_row_check_finite(w))                                                      \
                return EM_ROW_CHECK_CODE(EM_ROW_CHECK_VALUE, j);                              \
        }                                                                                     \
        break;                                                                                \
    }                                                                                         \
    case EM_OPTIMIZER_ADAM: {                                                                 \
        /* state: first moments, second moments, then the step */                             \
        float step = em_adam_next_step(EM_ROW_CHECK_AT(3 * dim));                             \
        em_adam_constants constants = em_adam_row_setup(optimizer, step);                     \
        for (uint32_t j = 0; j < dim; j++) {                                                  \
            float w = EM_ROW_CHECK_AT(j), m = EM_ROW_CHECK_AT(dim + j),                       \
                  v = EM_ROW_CHECK_AT(2 * dim + j);                                           \
            em_adam_element(&w, &m, &v, gradient[j], constants);                              \
            if (!em_row_check_finite(m))                                                      \
                return EM_ROW_CHECK_CODE(EM_ROW_CHECK_VALUE, dim + j);                        \
            if (!em_row_check_finite(v))                                                      \
                return EM_ROW_CHECK_CODE(EM_ROW_CHECK_VALUE, 2 * dim + j);                    \
            if (!em_row_check_finite(w))                                                      \
                return EM_ROW_CHECK_CODE(EM_ROW_CHECK_VALUE, j);                              \
        }                                                                                     \
        break;                                                                                \
    }                                                                                         \
    case EM_OPTIMIZER_COUNT:                                                                  \
        break;                                                                                \
    }                                                                                         \
    return EM_ROW_CHECK_OK;

EM_HOST_DEVICE uint32_t em_row_check_gradient(uint32_t dim, const float *gradient)
{
    for (uint32_t j = 0; j < dim; j++)
        if (!em_row_check_finite(gradient[j]))
            return EM_ROW_CHECK_CODE(EM_ROW_CHECK_GRADIENT, j);
    return EM_ROW_CHECK_OK;
}

/* The step on an existing row: plain loads, the hot path of every push. */
EM_HOST_DEVICE uint32_t em_row_check_existing(const em_optimizer_config *optimizer, uint32_t dim,
                                              const float *row, const float *gradient)
{
#define EM_ROW_CHECK_EXISTING_AT(index) row[index]
    EM_ROW_CHECK_BODY(EM_ROW_CHECK_EXISTING_AT)
#undef EM_ROW_CHECK_EXISTING_AT
}

/* The step on the row the push will create for key: its initial values. */
EM_HOST_DEVICE uint32_t em_row_check_new(const em_optimizer_config *optimizer,
                                         const em_initializer_config *initializer, uint32_t dim,
                                         uint64_t key, const float *gradient)
{
#define EM_ROW_CHECK_NEW_AT(index) em_row_check_value(0, optimizer, initializer, key, dim, index)
    EM_ROW_CHECK_BODY(EM_ROW_CHECK_NEW_AT)
#undef EM_ROW_CHECK_NEW_AT
}

/* EM_ROW_CHECK_OK, or the first problem of the step of gradient (dim floats) on row
 * (dim weights then the optimizer's state; NULL for a row to be created for key). */
EM_HOST_DEVICE uint32_t em_row_check(const em_optimizer_config *optimizer,
                                     const em_initializer_config *initializer, uint32_t dim,
                                     const float *row, uint64_t key, const float *gradient)
{
    uint32_t code = em_row_check_gradient(dim, gradient);
    if (code != EM_ROW_CHECK_OK)
        return code;
    return row != 0 ? em_row_check_existing(optimizer, dim, row, gradient)
                    : em_row_check_new(optimizer, initializer, dim, key, gradient);
}

/* ---- bounded steps ---------------------------------------------------------------------
 *
 * A push checks its rows before it holds their write locks, so other pushes may step the
 * same rows between its check and its own step. A check that found every row "bounded"
 * stays true across up to EM_ROW_BOUNDED_STEPS bounded steps by others:
 *
 * - a row is bounded for a gradient when every gradient element is at most
 *   EM_ROW_BOUND_GRADIENT in size, every weight at most EM_ROW_BOUND_WEIGHT, and the
 *   optimizer state within the bounds below (accumulators and second moments in
 *   [0, EM_ROW_BOUND_ACCUMULATOR], first moments at most the gradient bound, Adam's step
 *   count at least 0);
 * - the table's hyperparameters bound every step (em_row_bound_step): the change of a
 *   weight, and every intermediate value of the formulas in common/optimizer.h, is at
 *   most EM_ROW_BOUND_STEP. SGD moves a weight by lr*|g|; Adagrad by at most lr (|g| is at
 *   most the square root of its accumulator, eps > 0); row-wise Adagrad by at most
 *   lr*sqrt(dim); Adam by at most lr*G/((1-beta1)*eps), since its first moment stays
 *   within the gradient bound G and 1-beta1^t >= 1-beta1;
 * - a bounded step adds at most G*G to an accumulator and keeps Adam's moments within
 *   their bounds (they are convex combinations of values within them).
 *
 * So after k <= EM_ROW_BOUNDED_STEPS bounded steps by others and its own, a weight is at
 * most EM_ROW_BOUND_WEIGHT + (k + 1) * EM_ROW_BOUND_STEP = 1e38 and an accumulator at
 * most 1e37 + 9e30: both far inside FLT_MAX (3.4e38). A step that was not bounded moves
 * its shards' version by more than EM_ROW_BOUNDED_STEPS, so pushes that checked before
 * it check again.
 */
#define EM_ROW_BOUND_GRADIENT 1e15f
#define EM_ROW_BOUND_WEIGHT 1e37f
#define EM_ROW_BOUND_ACCUMULATOR 1e37f
#define EM_ROW_BOUND_STEP 1e37f
#define EM_ROW_BOUNDED_STEPS 8u

/* The largest size of count floats: the largest of their bit patterns without the sign,
 * which order as the sizes do (infinity above every finite size, NaN above infinity),
 * so one integer max finds it, and vectorises (signed: SSE2 compares signed integers). */
EM_HOST_DEVICE float em_row_largest_size(const float *values, uint64_t count)
{
    int32_t largest_bits = 0;
    for (uint64_t i = 0; i < count; i++) {
        int32_t bits;
        memcpy(&bits, &values[i], sizeof(bits));
        bits &= 0x7fffffff;
        largest_bits = bits > largest_bits ? bits : largest_bits;
    }
    float largest;
    memcpy(&largest, &largest_bits, sizeof(largest));
    return largest;
}

/* A bound on the size of a float sum of at most terms values, each of size at most
 * largest, added in any order: terms * largest, grown by what the additions can round
 * up ((1 + 2^-24)^terms <= 1 + terms * 2^-23 for terms up to 2^22) and by the
 * conversion to float; infinity past that or past the float range. A push's summed
 * gradients are such sums: a key occurring k times sums k terms, each the size of a
 * pushed gradient or less (combiner divisors are at least 1). */
EM_HOST_DEVICE float em_row_sum_bound(float largest, uint64_t terms)
{
    if (terms > (1u << 22) || !(largest <= FLT_MAX))
        return INFINITY;
    double bound = (double)largest * (double)terms * (1.0 + (double)terms * 0x1p-23);
    bound *= 1.0 + 0x1p-22; /* float(bound) may round down by 2^-24 */
    return bound <= (double)FLT_MAX ? (float)bound : INFINITY;
}

/* 1 when the hyperparameters bound every step as above (dim floats per row). */
EM_HOST_DEVICE int em_row_bound_step(const em_optimizer_config *optimizer, uint32_t dim)
{
    double lr = fabs((double)optimizer->learning_rate), eps = (double)optimizer->eps;
    double gradient = (double)EM_ROW_BOUND_GRADIENT, limit = (double)EM_ROW_BOUND_STEP;
    double squares = gradient * gradient * (double)dim;
    switch (optimizer->kind) {
    case EM_OPTIMIZER_SGD:
        return lr * gradient <= limit;
    case EM_OPTIMIZER_ADAGRAD:
        return eps > 0.0 && lr * gradient <= limit;
    case EM_OPTIMIZER_ROWWISE_ADAGRAD:
        return eps > 0.0 && lr * gradient <= limit && squares <= limit &&
               lr * sqrt((double)dim) <= limit;
    case EM_OPTIMIZER_ADAM: {
        double beta1 = (double)optimizer->beta1, beta2 = (double)optimizer->beta2;
        if (!(eps > 0.0) || !(beta1 >= 0.0 && beta1 < 1.0) || !(beta2 >= 0.0 && beta2 < 1.0))
            return 0;
        double moment = gradient / (1.0 - beta1); /* the largest bias-corrected m */
        return lr * moment <= limit && lr * moment / eps <= limit &&
               gradient * gradient / (1.0 - beta2) <= limit;
    }
    case EM_OPTIMIZER_COUNT:
        break;
    }
    return 0;
}

EM_HOST_DEVICE int em_row_bound_within(float value, float bound)
{
    return fabsf(value) <= bound; /* false for NaN */
}

EM_HOST_DEVICE int em_row_bound_between(float value, float low, float high)
{
    return (value >= low) & (value <= high); /* false for NaN */
}

/* 1 when every element of a gradient (dim floats) is within its bound. */
EM_HOST_DEVICE int em_row_bound_gradient(uint32_t dim, const float *gradient)
{
    int bounded = 1;
    for (uint32_t j = 0; j < dim; j++)
        bounded &= em_row_bound_within(gradient[j], EM_ROW_BOUND_GRADIENT);
    return bounded;
}

/* 1 when a row's values (weights, then optimizer state) are within the bounds above.
 * Every element is looked at without an early exit, so the loops vectorise. */
EM_HOST_DEVICE int em_row_values_bounded(const em_optimizer_config *optimizer, uint32_t dim,
                                         const float *row)
{
    const float g_max = EM_ROW_BOUND_GRADIENT, w_max = EM_ROW_BOUND_WEIGHT,
                a_max = EM_ROW_BOUND_ACCUMULATOR;
    int bounded = 1;
    for (uint32_t j = 0; j < dim; j++)
        bounded &= em_row_bound_within(row[j], w_max);
    switch (optimizer->kind) {
    case EM_OPTIMIZER_SGD:
        break;
    case EM_OPTIMIZER_ADAGRAD:
        for (uint32_t j = 0; j < dim; j++)
            bounded &= em_row_bound_between(row[dim + j], 0.0f, a_max);
        break;
    case EM_OPTIMIZER_ROWWISE_ADAGRAD:
        bounded &= em_row_bound_between(row[dim], 0.0f, a_max);
        break;
    case EM_OPTIMIZER_ADAM:
        for (uint32_t j = 0; j < dim; j++)
            bounded &= em_row_bound_within(row[dim + j], g_max) &
                       em_row_bound_between(row[2 * dim + j], 0.0f, g_max * g_max);
        bounded &= em_row_bound_between(row[3 * dim], 0.0f, EM_ADAM_MAX_STEP);
        break;
    case EM_OPTIMIZER_COUNT:
        bounded = 0;
        break;
    }
    return bounded;
}

/* 1 when an existing row and its gradient are bounded as above. */
EM_HOST_DEVICE int em_row_bounded(const em_optimizer_config *optimizer, uint32_t dim,
                                  const float *row, const float *gradient)
{
    return em_row_bound_gradient(dim, gradient) & em_row_values_bounded(optimizer, dim, row);
}

#endif
