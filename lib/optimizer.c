#include "lib/optimizer.h"

#include <string.h>

const char *em_optimizer_name(int kind)
{
    switch (kind) {
    case EM_OPTIMIZER_SGD:
        return "sgd";
    case EM_OPTIMIZER_ADAGRAD:
        return "adagrad";
    case EM_OPTIMIZER_ROWWISE_ADAGRAD:
        return "rowwise_adagrad";
    case EM_OPTIMIZER_ADAM:
        return "adam";
    default:
        return "unknown";
    }
}

void em_optimizer_init_state(const em_optimizer_config *config, uint32_t dim, float *state)
{
    uint32_t count = em_optimizer_state_floats(config->kind, dim);
    if (config->kind == EM_OPTIMIZER_ADAGRAD || config->kind == EM_OPTIMIZER_ROWWISE_ADAGRAD) {
        for (uint32_t i = 0; i < count; i++)
            state[i] = config->initial_accumulator;
        return;
    }
    memset(state, 0, count * sizeof(float));
}

/* restrict: weights, state and gradient never overlap, which lets the compiler
 * vectorise these loops. */
static void apply_sgd(const em_optimizer_config *config, uint32_t dim, float *restrict weights,
                      const float *restrict gradient)
{
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
    float squares = 0.0f;
    for (uint32_t j = 0; j < dim; j++)
        squares += gradient[j] * gradient[j];
    *accumulator += squares / (float)dim;
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
    case EM_OPTIMIZER_ADAGRAD:
        apply_adagrad(config, dim, weights, state, gradient);
        break;
    case EM_OPTIMIZER_ROWWISE_ADAGRAD:
        apply_rowwise_adagrad(config, dim, weights, state, gradient);
        break;
    case EM_OPTIMIZER_ADAM:
        apply_adam(config, dim, weights, state, gradient);
        break;
    default:
        apply_sgd(config, dim, weights, gradient);
        break;
    }
}
