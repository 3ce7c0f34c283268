/*
 * DESIGN: the order in which a push adds the gradients of a key that occurs several
 * times, the same on every device, so sums are bit-identical between backends.
 *
 * A key's contributions (its gradient rows, or its rows' gradients divided by the
 * combiner's divisor) are taken in increasing key position, then added as a fixed tree
 * of chunks: consecutive groups of EM_SUM_CHUNK values are each summed serially from
 * -0.0, and the group sums, in order, are the next level's values, until one value is
 * left. A key with at most EM_SUM_CHUNK occurrences is therefore summed serially from
 * -0.0, in key order; a key present 65,536 times is summed in 4 levels whose chains are
 * at most 32 additions long, so on a GPU a hot key costs a few dependent steps per level
 * instead of one per occurrence (each chunk of the first level is summed by its own
 * thread).
 *
 * Adding -0.0 first changes no value: -0.0 + x is x for every x, zeros included.
 */
#ifndef EMBER_COMMON_GRADIENT_SUM_H
#define EMBER_COMMON_GRADIENT_SUM_H

#include <stdint.h>

#include "common/host_device.h"

/* Values summed serially at each level of the tree. */
#define EM_SUM_CHUNK 32u

/* Chunks of the first level for a key present `count` times. */
EM_HOST_DEVICE uint32_t em_sum_chunks(uint32_t count)
{
    return (count + EM_SUM_CHUNK - 1) / EM_SUM_CHUNK;
}

/* Element j of the sum of m first-level chunk sums, values[(first + i) * stride + j]
 * for i < m, by the remaining levels of the tree; the values are overwritten (level by
 * level, in place: group i of a level is read before index i is written, and later
 * groups lie above it). Returns the sum. */
EM_HOST_DEVICE float em_sum_chunk_levels(float *values, uint64_t first, uint32_t m,
                                          uint64_t stride, uint32_t j)
{
    while (m > 1) {
        uint32_t groups = em_sum_chunks(m);
        for (uint32_t g = 0; g < groups; g++) {
            uint32_t end = (g + 1) * EM_SUM_CHUNK < m ? (g + 1) * EM_SUM_CHUNK : m;
            float sum = -0.0f;
            for (uint32_t i = g * EM_SUM_CHUNK; i < end; i++)
                sum += values[(first + i) * stride + j];
            values[(first + g) * stride + j] = sum;
        }
        m = groups;
    }
    return values[first * stride + j];
}

#endif
