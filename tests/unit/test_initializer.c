/* The initializers are a documented pure function of (seed, key, element). This suite
 * recomputes them from the formula in common/initializer.h with its own code, so a change
 * to the function (which would break CPU/GPU and checkpoint agreement) fails here. */
#include <math.h>
#include <string.h>

#include "lib/device/initializer.h"
#include "tests/support/test_support.h"

/* Independent transcription of the documented formula. */
static uint64_t reference_mix(uint64_t x)
{
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t reference_bits(uint64_t seed, uint64_t key, uint64_t counter)
{
    uint64_t row_seed = reference_mix(key ^ reference_mix(seed));
    return reference_mix(row_seed + counter * 0x9e3779b97f4a7c15ull);
}

static float reference_uniform(uint64_t seed, uint64_t key, uint32_t j, float bound)
{
    double u = (double)(reference_bits(seed, key, j + 1) >> 40) / 16777216.0;
    return (float)((double)bound * (2.0 * u - 1.0));
}

static const uint64_t sample_keys[] = {0, 1, 2, 42, 1ull << 40, 0x123456789abcdefull,
                                       UINT64_MAX - 1, UINT64_MAX};

START_TEST(uniform_matches_documented_formula_bit_for_bit)
{
    em_initializer_config config = {.kind = EM_INIT_UNIFORM, .bound = 0.05f, .seed = 7};
    for (size_t k = 0; k < sizeof(sample_keys) / sizeof(sample_keys[0]); k++) {
        for (uint32_t j = 0; j < 300; j++) {
            float got = em_initializer_value(&config, sample_keys[k], j);
            float expected = reference_uniform(7, sample_keys[k], j, 0.05f);
            ck_assert_msg(memcmp(&got, &expected, sizeof(float)) == 0,
                          "key %llu element %u: %a != %a", (unsigned long long)sample_keys[k], j,
                          (double)got, (double)expected);
            ck_assert(got >= -0.05f && got < 0.05f);
        }
    }
}
END_TEST

START_TEST(fill_equals_value)
{
    em_initializer_config configs[] = {
        {.kind = EM_INIT_ZEROS, .seed = 1},
        {.kind = EM_INIT_UNIFORM, .bound = 1.0f, .seed = 99},
        {.kind = EM_INIT_NORMAL, .stddev = 0.5f, .seed = 3},
    };
    float row[129];
    for (size_t c = 0; c < 3; c++) {
        em_initializer_fill(&configs[c], 12345, 129, row);
        for (uint32_t j = 0; j < 129; j++) {
            float value = em_initializer_value(&configs[c], 12345, j);
            ck_assert(memcmp(&row[j], &value, sizeof(float)) == 0);
            if (configs[c].kind == EM_INIT_ZEROS)
                ck_assert(row[j] == 0.0f);
        }
    }
}
END_TEST

/* The uniform fill goes several elements at a time where the CPU allows: every width and
 * tail, many keys and bounds, bit for bit against the element formula. */
START_TEST(uniform_fill_equals_value_for_every_length)
{
    static const uint32_t dims[] = {1, 3, 7, 8, 9, 15, 16, 17, 31, 64, 100, 129, 256};
    static const float bounds[] = {1.0f, 0.05f, 3.0e-7f, 1.0e30f};
    float row[256];
    for (size_t d = 0; d < sizeof(dims) / sizeof(dims[0]); d++)
        for (size_t b = 0; b < sizeof(bounds) / sizeof(bounds[0]); b++)
            for (uint64_t k = 0; k < 64; k++) {
                em_initializer_config config = {
                    .kind = EM_INIT_UNIFORM, .bound = bounds[b], .seed = 17 + b};
                uint64_t key = k * 0x9e3779b97f4a7c15ull + d;
                em_initializer_fill(&config, key, dims[d], row);
                for (uint32_t j = 0; j < dims[d]; j++) {
                    float value = em_initializer_value(&config, key, j);
                    ck_assert_msg(memcmp(&row[j], &value, sizeof(float)) == 0,
                                  "dim %u key %llu element %u: %a != %a", dims[d],
                                  (unsigned long long)key, j, (double)row[j], (double)value);
                }
            }
}
END_TEST

START_TEST(seed_and_key_change_the_vector)
{
    em_initializer_config a = {.kind = EM_INIT_UNIFORM, .bound = 1.0f, .seed = 1};
    em_initializer_config b = {.kind = EM_INIT_UNIFORM, .bound = 1.0f, .seed = 2};
    float x[16], y[16], z[16];
    em_initializer_fill(&a, 5, 16, x);
    em_initializer_fill(&b, 5, 16, y);
    em_initializer_fill(&a, 6, 16, z);
    ck_assert(memcmp(x, y, sizeof(x)) != 0);
    ck_assert(memcmp(x, z, sizeof(x)) != 0);
}
END_TEST

/* Moments over many keys: uniform(-a, a) has mean 0 and variance a^2/3; normal(0, s)
 * mean 0 and variance s^2. Tolerances are 6 standard errors. */
START_TEST(distributions_have_expected_moments)
{
    const int samples = 200000;
    em_initializer_config uniform = {.kind = EM_INIT_UNIFORM, .bound = 2.0f, .seed = 11};
    em_initializer_config normal = {.kind = EM_INIT_NORMAL, .stddev = 3.0f, .seed = 11};
    double su = 0, su2 = 0, sn = 0, sn2 = 0;
    int beyond_three_sigma = 0;
    for (int i = 0; i < samples; i++) {
        double u = em_initializer_value(&uniform, (uint64_t)i, (uint32_t)(i % 8));
        double n = em_initializer_value(&normal, (uint64_t)i, (uint32_t)(i % 8));
        su += u;
        su2 += u * u;
        sn += n;
        sn2 += n * n;
        beyond_three_sigma += fabs(n) > 9.0;
    }
    double mean_u = su / samples, var_u = su2 / samples - mean_u * mean_u;
    double mean_n = sn / samples, var_n = sn2 / samples - mean_n * mean_n;
    ck_assert_double_lt(fabs(mean_u), 6 * sqrt(4.0 / 3.0 / samples));
    ck_assert_double_lt(fabs(var_u - 4.0 / 3.0), 0.02);
    ck_assert_double_lt(fabs(mean_n), 6 * 3.0 / sqrt(samples));
    ck_assert_double_lt(fabs(var_n - 9.0), 0.15);
    /* 0.27% of a normal lies beyond 3 sigma. */
    ck_assert_int_gt(beyond_three_sigma, samples * 2 / 1000);
    ck_assert_int_lt(beyond_three_sigma, samples * 4 / 1000);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("initializer");
    TCase *tc = tcase_create("initializer");
    tcase_add_test(tc, uniform_matches_documented_formula_bit_for_bit);
    tcase_add_test(tc, fill_equals_value);
    tcase_add_test(tc, uniform_fill_equals_value_for_every_length);
    tcase_add_test(tc, seed_and_key_change_the_vector);
    tcase_add_test(tc, distributions_have_expected_moments);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
