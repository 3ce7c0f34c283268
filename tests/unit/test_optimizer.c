#include <math.h>
#include <string.h>

#include "lib/device/optimizer.h"
#include "lib/table/table_config.h"
#include "tests/support/reference_table.h"
#include "tests/support/test_support.h"

#define DIM 37
#define STEPS 50

static const em_optimizer_config configs[] = {
    {.kind = EM_OPTIMIZER_SGD, .learning_rate = 0.05f},
    {.kind = EM_OPTIMIZER_ADAGRAD, .learning_rate = 0.1f, .eps = 1e-10f,
     .initial_accumulator = 0.1f},
    {.kind = EM_OPTIMIZER_ROWWISE_ADAGRAD, .learning_rate = 0.1f, .eps = 1e-10f,
     .initial_accumulator = 0.0f},
    {.kind = EM_OPTIMIZER_ADAM, .learning_rate = 0.01f, .eps = 1e-8f, .beta1 = 0.9f,
     .beta2 = 0.999f},
};

/* STEPS steps of every optimizer in binary32 against the float64 formula. */
START_TEST(steps_match_float64_reference)
{
    const em_optimizer_config *config = &configs[_i];
    uint32_t state = em_optimizer_state_floats(config->kind, DIM);
    float row[DIM + 2 * DIM + 1];
    double expected[DIM + 2 * DIM + 1];
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed() + (uint64_t)_i);
    for (uint32_t j = 0; j < DIM; j++) {
        row[j] = (float)(em_test_rng_unit(&rng) - 0.5);
        expected[j] = row[j];
    }
    em_optimizer_init_state(config, DIM, row + DIM);
    for (uint32_t j = 0; j < state; j++)
        expected[DIM + j] = row[DIM + j];
    for (int step = 0; step < STEPS; step++) {
        float g[DIM];
        double g64[DIM];
        for (uint32_t j = 0; j < DIM; j++) {
            g[j] = (float)(4.0 * em_test_rng_unit(&rng) - 2.0);
            g64[j] = g[j];
        }
        em_optimizer_apply_row(config, DIM, row, row + DIM, g);
        reference_apply_optimizer(config, DIM, expected, g64);
    }
    for (uint32_t j = 0; j < DIM + state; j++)
        ck_assert_msg(reference_close(row[j], expected[j], 1e-2),
                      "%s element %u: %.9g vs reference %.9g", em_optimizer_name(config->kind),
                      j, (double)row[j], expected[j]);
}
END_TEST

START_TEST(initial_state)
{
    float state[2 * 5 + 1];
    em_optimizer_init_state(&configs[1], 5, state);
    for (int j = 0; j < 5; j++)
        ck_assert_float_eq(state[j], 0.1f);
    memset(state, 0xff, sizeof(state));
    em_optimizer_init_state(&configs[3], 5, state);
    for (int j = 0; j < 11; j++)
        ck_assert_float_eq(state[j], 0.0f);
    ck_assert_uint_eq(em_optimizer_state_floats(EM_OPTIMIZER_SGD, 5), 0);
    ck_assert_uint_eq(em_optimizer_state_floats(EM_OPTIMIZER_ROWWISE_ADAGRAD, 5), 1);
    ck_assert_uint_eq(em_optimizer_state_floats(EM_OPTIMIZER_ADAM, 5), 11);
}
END_TEST

/* The first adam step moves every weight by lr * sign(g) (bias corrections cancel). */
START_TEST(adam_first_step_is_lr_times_sign)
{
    float row[3 + 7] = {1.0f, 1.0f, 1.0f};
    em_optimizer_init_state(&configs[3], 3, row + 3);
    const float g[3] = {0.5f, -3.0f, 1e-3f};
    em_optimizer_apply_row(&configs[3], 3, row, row + 3, g);
    ck_assert_float_eq_tol(row[0], 1.0f - 0.01f, 1e-6f);
    ck_assert_float_eq_tol(row[1], 1.0f + 0.01f, 1e-6f);
    ck_assert_float_eq_tol(row[2], 1.0f - 0.01f, 1e-5f);
    ck_assert_float_eq(row[3 + 6], 1.0f); /* step count */
}
END_TEST

START_TEST(adam_step_saturates_at_two_to_the_24)
{
    ck_assert_float_eq(em_adam_next_step(41.0f), 42.0f);
    ck_assert_float_eq(em_adam_next_step(EM_ADAM_MAX_STEP), EM_ADAM_MAX_STEP);
    em_adam_row row = em_adam_row_constants(0.9f, 0.999f, EM_ADAM_MAX_STEP);
    ck_assert_float_eq(row.correction1, 1.0f);
    ck_assert_float_eq(row.correction2, 1.0f);
}
END_TEST

/* Rowwise adagrad keeps one accumulator advanced by the mean of g*g. */
START_TEST(rowwise_accumulator_uses_mean_square)
{
    float row[4 + 1] = {0, 0, 0, 0};
    em_optimizer_init_state(&configs[2], 4, row + 4);
    const float g[4] = {1.0f, 2.0f, 3.0f, 4.0f};
    em_optimizer_apply_row(&configs[2], 4, row, row + 4, g);
    ck_assert_float_eq_tol(row[4], 7.5f, 1e-6f); /* (1 + 4 + 9 + 16) / 4 */
    ck_assert_float_eq_tol(row[0], -0.1f / sqrtf(7.5f), 1e-7f);
    ck_assert_float_eq_tol(row[3], -0.4f / sqrtf(7.5f), 1e-7f);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("optimizer");
    TCase *tc = tcase_create("optimizer");
    tcase_add_loop_test(tc, steps_match_float64_reference, 0, 4);
    tcase_add_test(tc, initial_state);
    tcase_add_test(tc, adam_first_step_is_lr_times_sign);
    tcase_add_test(tc, adam_step_saturates_at_two_to_the_24);
    tcase_add_test(tc, rowwise_accumulator_uses_mean_square);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
