/*
 * DESIGN: the host side of the initializers (the element formulas and their
 * documentation are in common/initializer.h, shared with the kernels).
 */
#ifndef EMBER_LIB_INITIALIZER_H
#define EMBER_LIB_INITIALIZER_H

#include "common/initializer.h"

/* Fills weights[0..dim) with the initial vector of key. */
void em_initializer_fill(const em_initializer_config *config, uint64_t key, uint32_t dim,
                         float *weights);

#endif
