#include "lib/device/initializer.h"

#include <string.h>

void em_initializer_fill(const em_initializer_config *config, uint64_t key, uint32_t dim,
                         float *weights)
{
    uint64_t row_seed = em_initializer_row_seed(config->seed, key);
    switch (config->kind) {
    case EM_INIT_UNIFORM:
        for (uint32_t j = 0; j < dim; j++)
            weights[j] = em_initializer_uniform(row_seed, j, config->bound);
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
