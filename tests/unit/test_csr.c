#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lib/table/csr.h"
#include "tests/support/test_support.h"

static em_status validate(uint32_t rows, uint64_t nnz, const uint32_t *offsets, em_error *err)
{
    static const uint64_t keys[64];
    em_csr csr = {.rows = rows, .nnz = nnz, .offsets = offsets, .keys = keys};
    return em_csr_validate(&csr, err);
}

START_TEST(valid_batches_pass)
{
    em_error err;
    const uint32_t offsets[] = {0, 2, 2, 5, 5};
    ck_assert_int_eq(validate(4, 5, offsets, &err), EM_OK);
    const uint32_t empty[] = {0};
    ck_assert_int_eq(validate(0, 0, empty, &err), EM_OK);
    const uint32_t all_empty[] = {0, 0, 0};
    ck_assert_int_eq(validate(2, 0, all_empty, &err), EM_OK);
}
END_TEST

START_TEST(errors_name_index_and_value)
{
    em_error err;
    const uint32_t nonzero_start[] = {3, 4};
    ck_assert_int_eq(validate(1, 4, nonzero_start, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "offsets[0]=3, must be 0");

    uint32_t decreasing[18];
    for (uint32_t i = 0; i < 18; i++)
        decreasing[i] = i * 2 + 10;
    decreasing[0] = 0;
    decreasing[16] = 41;
    decreasing[17] = 40;
    ck_assert_int_eq(validate(17, 40, decreasing, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "offsets[17]=40 < offsets[16]=41");

    const uint32_t wrong_end[] = {0, 4, 9};
    ck_assert_int_eq(validate(2, 10, wrong_end, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "offsets[rows=2]=9, must equal nnz=10");
}
END_TEST

START_TEST(combiner_names_and_divisors)
{
    em_combiner combiner;
    em_error err;
    ck_assert_int_eq(em_combiner_parse("sqrtn", &combiner, &err), EM_OK);
    ck_assert_int_eq(combiner, EM_COMBINER_SQRTN);
    ck_assert_int_eq(em_combiner_parse("avg", &combiner, &err), EM_INVALID_ARGUMENT);
    ck_assert(strstr(err.message, "'avg'") != NULL);
    ck_assert_int_eq(em_combiner_check(4, &err), EM_INVALID_ARGUMENT);
    ck_assert(strstr(err.message, "combiner 4") != NULL);
    ck_assert_int_eq(em_combiner_check(2, &err), EM_OK);
    ck_assert_str_eq(em_combiner_name(EM_COMBINER_MEAN), "mean");
    ck_assert_float_eq(em_combiner_divisor(EM_COMBINER_SUM, 7), 1.0f);
    ck_assert_float_eq(em_combiner_divisor(EM_COMBINER_MEAN, 7), 7.0f);
    ck_assert_float_eq(em_combiner_divisor(EM_COMBINER_SQRTN, 9), 3.0f);
    ck_assert_float_eq(em_combiner_divisor(EM_COMBINER_MEAN, 0), 1.0f);
}
END_TEST

START_TEST(output_vectors_by_combiner)
{
    const uint32_t offsets[] = {0, 3, 3, 4};
    const uint64_t keys[] = {1, 2, 3, 4};
    em_csr csr = {.rows = 3, .nnz = 4, .offsets = offsets, .keys = keys};
    ck_assert_uint_eq(em_csr_output_vectors(&csr, EM_COMBINER_NONE), 4);
    ck_assert_uint_eq(em_csr_output_vectors(&csr, EM_COMBINER_SUM), 3);
}
END_TEST

START_TEST(non_finite_gradients_are_located)
{
    const uint32_t offsets[] = {0, 2, 2, 5};
    const uint64_t keys[] = {10, 11, 12, 77, 14};
    em_csr csr = {.rows = 3, .nnz = 5, .offsets = offsets, .keys = keys};
    float per_key[5 * 4] = {0};
    em_error err;
    float largest = -1.0f;
    per_key[7] = 3.5f;
    per_key[13] = -1e30f; /* the largest size, negative */
    per_key[19] = 2e29f;
    ck_assert_int_eq(em_csr_check_gradients(&csr, EM_COMBINER_NONE, 4, per_key, &largest, &err),
                     EM_OK);
    ck_assert_float_eq(largest, 1e30f);
    per_key[3 * 4 + 2] = NAN;
    ck_assert_int_eq(em_csr_check_gradients(&csr, EM_COMBINER_NONE, 4, per_key, NULL, &err),
                     EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "gradient of key 77 (keys[3], row 2) element 2 is NaN");

    float per_row[3 * 4] = {0};
    per_row[2 * 4 + 1] = -INFINITY;
    ck_assert_int_eq(em_csr_check_gradients(&csr, EM_COMBINER_MEAN, 4, per_row, NULL, &err),
                     EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "gradient of row 2 (keys[2..5)) element 1 is -inf");
}
END_TEST

/* The check split over threads finds what one thread finds: the largest size, and the
 * first non-finite element of the whole, whichever part holds it and whatever lies in
 * the parts after (a push of 65,536 keys at dim 64: 4 Mi floats, parts of 1 Mi). */
START_TEST(a_check_on_threads_answers_as_one_thread)
{
    enum { KEYS = 65536, DIM = 64 };
    uint32_t *offsets = malloc((KEYS + 1) * sizeof(uint32_t));
    uint64_t *keys = malloc(KEYS * sizeof(uint64_t));
    float *gradients = malloc((size_t)KEYS * DIM * sizeof(float));
    for (uint32_t i = 0; i <= KEYS; i++)
        offsets[i] = i;
    for (uint32_t i = 0; i < KEYS; i++)
        keys[i] = 1000 + i;
    for (size_t i = 0; i < (size_t)KEYS * DIM; i++)
        gradients[i] = (float)(i % 1000) * 1e-3f - 0.5f;
    em_csr csr = {.rows = KEYS, .nnz = KEYS, .offsets = offsets, .keys = keys};
    gradients[(size_t)KEYS * DIM - 7] = -9e20f; /* the largest, in the last part */
    const uint32_t threads[] = {1, 2, 3, 4, 16, 64};
    em_error err, one_err;
    /* threads started for each check, and a pool's kept between them */
    em_parallel_pool *pools[2] = {NULL, em_parallel_pool_create(63)};
    ck_assert_ptr_nonnull(pools[1]);
    for (size_t t = 0; t < 2 * sizeof(threads) / sizeof(threads[0]); t++) {
        float largest = 0.0f;
        ck_assert_int_eq(em_csr_check_gradients_on(&csr, EM_COMBINER_NONE, DIM, gradients,
                                                   pools[t % 2], threads[t / 2], &largest,
                                                   &err),
                         EM_OK);
        ck_assert_float_eq(largest, 9e20f);
    }
    /* an infinity in the third part, a NaN (larger by bits) in the last */
    gradients[(size_t)40000 * DIM + 5] = INFINITY;
    gradients[(size_t)KEYS * DIM - 3] = NAN;
    ck_assert_int_eq(em_csr_check_gradients(&csr, EM_COMBINER_NONE, DIM, gradients, NULL,
                                            &one_err),
                     EM_INVALID_ARGUMENT);
    ck_assert_str_eq(one_err.message,
                     "gradient of key 41000 (keys[40000], row 40000) element 5 is +inf");
    for (size_t t = 0; t < 2 * sizeof(threads) / sizeof(threads[0]); t++) {
        ck_assert_int_eq(em_csr_check_gradients_on(&csr, EM_COMBINER_NONE, DIM, gradients,
                                                   pools[t % 2], threads[t / 2], NULL, &err),
                         EM_INVALID_ARGUMENT);
        ck_assert_str_eq(err.message, one_err.message);
    }
    em_parallel_pool_destroy(pools[1]);
    free(offsets);
    free(keys);
    free(gradients);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("csr");
    TCase *tc = tcase_create("csr");
    tcase_set_timeout(tc, 60); /* the check over 4 Mi floats, slow under sanitizers */
    tcase_add_test(tc, valid_batches_pass);
    tcase_add_test(tc, errors_name_index_and_value);
    tcase_add_test(tc, combiner_names_and_divisors);
    tcase_add_test(tc, output_vectors_by_combiner);
    tcase_add_test(tc, non_finite_gradients_are_located);
    tcase_add_test(tc, a_check_on_threads_answers_as_one_thread);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
