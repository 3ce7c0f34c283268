/*
 * DESIGN: how a row's vectors are pooled, for both devices.
 *
 * A pull with a combiner other than NONE answers one vector per row; a push with one
 * spreads each row's gradient to the row's keys, divided by the same divisor. The
 * divisor is written once, here, and both the CPU device and the kernels call it, so
 * they round identically: NONE and SUM 1, MEAN len, SQRTN sqrt(len) (binary32). An
 * empty row has no keys, so its divisor is never used; it is 1.
 */
#ifndef EMBER_COMMON_COMBINER_H
#define EMBER_COMMON_COMBINER_H

#include <stdint.h>

#ifndef __CUDACC__
#include <math.h>
#endif

#include "common/host_device.h"

/* The wire values of proto/ember.proto's Combiner. */
typedef enum em_combiner {
    EM_COMBINER_NONE = 0,  /* one vector per key */
    EM_COMBINER_SUM = 1,   /* per row: sum of the row's vectors */
    EM_COMBINER_MEAN = 2,  /* per row: sum / len */
    EM_COMBINER_SQRTN = 3, /* per row: sum / sqrt(len) */
} em_combiner;

#define EM_COMBINER_COUNT 4

EM_HOST_DEVICE float em_combiner_divisor(em_combiner combiner, uint32_t row_length)
{
    if (row_length == 0)
        return 1.0f;
    switch (combiner) {
    case EM_COMBINER_MEAN:
        return (float)row_length;
    case EM_COMBINER_SQRTN:
        return sqrtf((float)row_length);
    case EM_COMBINER_NONE:
    case EM_COMBINER_SUM:
        return 1.0f;
    }
    return 1.0f;
}

#endif
