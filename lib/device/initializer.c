#include "lib/device/initializer.h"

#include <string.h>

/* A uniform row, element by element as em_initializer_uniform: integer steps and one
 * IEEE product each, so any vector width gives the same bits as the kernels. Also
 * compiled for x86-64 with AVX-512 (whose 64-bit multiplies the mix needs to go eight
 * elements at a time; about 6x faster per row there, tests/bench/RESULTS.md), the
 * loader choosing the build for the CPU it runs on. Not under ThreadSanitizer, whose
 * instrumented resolver would run before its runtime is set up, as the loader binds the
 * clone. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("arch=x86-64-v4", "default")))
#endif
static void fill_uniform(uint64_t row_seed, float bound, uint32_t dim, float *weights)
{
    for (uint32_t j = 0; j < dim; j++)
        weights[j] = em_initializer_uniform(row_seed, j, bound);
}

void em_initializer_fill(const em_initializer_config *config, uint64_t key, uint32_t dim,
                         float *weights)
{
    uint64_t row_seed = em_initializer_row_seed(config->seed, key);
    switch (config->kind) {
    case EM_INIT_UNIFORM:
        fill_uniform(row_seed, config->bound, dim, weights);
        break;
    case EM_INIT_NORMAL:
        for (uint32_t j = 0; j < dim; j++)
            weights[j] = em_initializer_normal(row_seed, j, config->stddev);
        break;
    case EM_INIT_ZEROS:
        memset(weights, 0, dim * sizeof(float));
        break;
    }
}
