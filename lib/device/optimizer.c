#include "lib/device/optimizer.h"

#include <stdbool.h>
#include <string.h>

const char *em_optimizer_name(em_optimizer_kind kind)
{
    switch (kind) {
#define OPTIMIZER_NAME(KIND, name, per_element, per_row, keys, eps)                            \
    case EM_OPTIMIZER_##KIND:                                                                  \
        return #name;
        EM_OPTIMIZERS(OPTIMIZER_NAME)
#undef OPTIMIZER_NAME
    case EM_OPTIMIZER_COUNT:
        break;
    }
    return "unknown";
}

bool em_optimizer_from_name(const char *name, em_optimizer_kind *out)
{
    for (int kind = 0; kind < EM_OPTIMIZER_COUNT; kind++) {
        if (strcmp(name, em_optimizer_name((em_optimizer_kind)kind)) == 0) {
            *out = (em_optimizer_kind)kind;
            return true;
        }
    }
    return false;
}

const char *em_optimizer_state_name(em_optimizer_kind kind, uint32_t dim, uint32_t index)
{
    switch (kind) {
    case EM_OPTIMIZER_ADAM:
        return index < dim ? "first moment" : index < 2 * dim ? "second moment" : "step";
    case EM_OPTIMIZER_ADAGRAD:
    case EM_OPTIMIZER_ROWWISE_ADAGRAD:
        return "accumulator";
    case EM_OPTIMIZER_SGD:
    case EM_OPTIMIZER_COUNT:
        break;
    }
    return "state";
}

bool em_optimizer_state_nonnegative(em_optimizer_kind kind, uint32_t dim, uint32_t index)
{
    switch (kind) {
    case EM_OPTIMIZER_ADAM:
        return index >= dim; /* the first moment takes the gradient's sign */
    case EM_OPTIMIZER_ADAGRAD:
    case EM_OPTIMIZER_ROWWISE_ADAGRAD:
        return true;
    case EM_OPTIMIZER_SGD:
    case EM_OPTIMIZER_COUNT:
        break;
    }
    return false;
}

float em_optimizer_default_eps(em_optimizer_kind kind)
{
    switch (kind) {
#define OPTIMIZER_EPS(KIND, name, per_element, per_row, keys, eps)                             \
    case EM_OPTIMIZER_##KIND:                                                                  \
        return eps;
        EM_OPTIMIZERS(OPTIMIZER_EPS)
#undef OPTIMIZER_EPS
    case EM_OPTIMIZER_COUNT:
        break;
    }
    return 0.0f;
}

void em_optimizer_init_state(const em_optimizer_config *config, uint32_t dim, float *state)
{
    uint32_t count = em_optimizer_state_floats(config->kind, dim);
    if (em_optimizer_has_accumulator(config->kind)) {
        for (uint32_t i = 0; i < count; i++)
            state[i] = config->initial_accumulator;
        return;
    }
    memset(state, 0, count * sizeof(float));
}

/* restrict: weights, state and gradient never overlap, which lets the compiler
 * vectorise these loops. */
static void apply_sgd(const em_optimizer_config *config, uint32_t dim, float *restrict weights,
                      float *restrict state, const float *restrict gradient)
{
    (void)state; /* sgd keeps none */
    float learning_rate = config->learning_rate;
    for (uint32_t j = 0; j < dim; j++)
        em_sgd_element(&weights[j], gradient[j], learning_rate);
}

static void apply_adagrad(const em_optimizer_config *config, uint32_t dim,
                          float *restrict weights, float *restrict accumulators,
                          const float *restrict gradient)
{
    float learning_rate = config->learning_rate, eps = config->eps;
    for (uint32_t j = 0; j < dim; j++)
        em_adagrad_element(&weights[j], &accumulators[j], gradient[j], learning_rate, eps);
}

static void apply_rowwise_adagrad(const em_optimizer_config *config, uint32_t dim,
                                  float *restrict weights, float *restrict accumulator,
                                  const float *restrict gradient)
{
    *accumulator += em_rowwise_squares(gradient, dim) / (float)dim;
    float denominator = sqrtf(*accumulator) + config->eps;
    float learning_rate = config->learning_rate;
    for (uint32_t j = 0; j < dim; j++)
        em_rowwise_adagrad_element(&weights[j], gradient[j], learning_rate, denominator);
}

static void apply_adam(const em_optimizer_config *config, uint32_t dim, float *restrict weights,
                       float *restrict state, const float *restrict gradient)
{
    float *restrict first_moment = state;
    float *restrict second_moment = state + dim;
    float *step = state + 2 * (size_t)dim;
    *step = em_adam_next_step(*step);
    em_adam_constants constants = em_adam_row_setup(config, *step);
    for (uint32_t j = 0; j < dim; j++)
        em_adam_element(&weights[j], &first_moment[j], &second_moment[j], gradient[j], constants);
}

void em_optimizer_apply_row(const em_optimizer_config *config, uint32_t dim, float *weights,
                            float *state, const float *gradient)
{
    switch (config->kind) {
#define OPTIMIZER_APPLY(KIND, name, per_element, per_row, keys, eps)                           \
    case EM_OPTIMIZER_##KIND:                                                                  \
        apply_##name(config, dim, weights, state, gradient);                                   \
        break;
        EM_OPTIMIZERS(OPTIMIZER_APPLY)
#undef OPTIMIZER_APPLY
    case EM_OPTIMIZER_COUNT:
        break;
    }
}
