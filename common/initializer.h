/*
 * DESIGN: deterministic initial values.
 *
 * A new row's vector is a pure function of (table seed, key, element index): the same
 * key gets the same initial vector on any backend, with any number of shards or
 * devices, in any request order. Each row draws from a splitmix64 stream:
 *
 *   row_seed  = mix64(key ^ mix64(seed))
 *   bits(c)   = mix64(row_seed + c * 0x9e3779b97f4a7c15)       (c = 1, 2, ...)
 *
 *   zeros         w[j] = 0
 *   uniform(-a,a) u = (bits(j + 1) >> 40) * 2^-24   (24 random bits, u in [0, 1))
 *                 w[j] = a * (2u - 1)                          (in [-a, a))
 *   normal(0, s)  u1 = ((bits(2j + 1) >> 11) + 1) * 2^-53      (in (0, 1])
 *                 u2 = (bits(2j + 2) >> 11) * 2^-53            (in [0, 1))
 *                 w[j] = float(s * sqrt(-2 ln u1) * cos(2 pi u2))   (Box-Muller, double)
 *
 * In the uniform formula 2u - 1 is exact in binary32, so the only rounding is the final
 * product, which IEEE-754 fixes: CPU and GPU produce identical bits. The normal
 * formula goes through log and cos, whose last bit may differ between math libraries.
 *
 * Header-only (EM_HOST_DEVICE) so the CUDA kernels call the same functions; the host
 * fill of a whole row is lib/device/initializer.h.
 */
#ifndef EMBER_COMMON_INITIALIZER_H
#define EMBER_COMMON_INITIALIZER_H

#include <stdint.h>

#ifndef __CUDACC__
#include <math.h>
#endif

#include "common/keyhash.h"

typedef enum em_initializer_kind {
    EM_INIT_ZEROS = 0,
    EM_INIT_UNIFORM = 1,
    EM_INIT_NORMAL = 2,
} em_initializer_kind;

typedef struct em_initializer_config {
    em_initializer_kind kind;
    float bound;    /* uniform: a in uniform(-a, a) */
    float stddev;   /* normal: standard deviation */
    uint64_t seed;
} em_initializer_config;

#define EM_INITIALIZER_STREAM_STEP UINT64_C(0x9e3779b97f4a7c15)

EM_HOST_DEVICE uint64_t em_initializer_row_seed(uint64_t seed, uint64_t key)
{
    return em_mix64(key ^ em_mix64(seed));
}

EM_HOST_DEVICE uint64_t em_initializer_bits(uint64_t row_seed, uint64_t counter)
{
    return em_mix64(row_seed + counter * EM_INITIALIZER_STREAM_STEP);
}

EM_HOST_DEVICE float em_initializer_uniform(uint64_t row_seed, uint32_t element, float bound)
{
    float unit = (float)(em_initializer_bits(row_seed, (uint64_t)element + 1) >> 40) * 0x1p-24f;
    float centered = 2.0f * unit - 1.0f;
    return bound * centered;
}

EM_HOST_DEVICE float em_initializer_normal(uint64_t row_seed, uint32_t element, float stddev)
{
    uint64_t counter = 2 * (uint64_t)element;
    double u1 = (double)((em_initializer_bits(row_seed, counter + 1) >> 11) + 1) * 0x1p-53;
    double u2 = (double)(em_initializer_bits(row_seed, counter + 2) >> 11) * 0x1p-53;
    double z = sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925286766559 * u2);
    return (float)((double)stddev * z);
}

/* Initial value of element `element` of the row for key. */
EM_HOST_DEVICE float em_initializer_value(const em_initializer_config *config, uint64_t key,
                                          uint32_t element)
{
    uint64_t row_seed = em_initializer_row_seed(config->seed, key);
    switch (config->kind) {
    case EM_INIT_UNIFORM:
        return em_initializer_uniform(row_seed, element, config->bound);
    case EM_INIT_NORMAL:
        return em_initializer_normal(row_seed, element, config->stddev);
    case EM_INIT_ZEROS:
        return 0.0f;
    }
    return 0.0f;
}

#endif
