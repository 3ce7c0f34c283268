/*
 * DESIGN: CSR batches (row offsets + keys) and their validation.
 *
 * A batch has `rows` rows (one per sample-slot); row r owns keys[offsets[r] ..
 * offsets[r+1]). offsets has rows + 1 entries, starts at 0, never decreases and ends
 * at nnz. Empty rows are allowed. Everything from the network is checked here before
 * any table is touched, and each message names the offending index and value, so a
 * trainer can find the bad sample.
 */
#ifndef EMBER_LIB_CSR_H
#define EMBER_LIB_CSR_H

#include <stddef.h>
#include <stdint.h>

#include "common/combiner.h"
#include "lib/base/parallel.h"
#include "lib/base/status.h"

/* Borrowed view of a batch; the arrays belong to the caller. */
typedef struct em_csr {
    uint32_t rows;
    uint64_t nnz;
    const uint32_t *offsets; /* rows + 1 entries */
    const uint64_t *keys;    /* nnz entries */
} em_csr;


/* "none", "sum", "mean", "sqrtn"; "unknown" otherwise. */
const char *em_combiner_name(em_combiner combiner);
em_status em_combiner_parse(const char *text, em_combiner *out, em_error *err);
/* Errors: INVALID_ARGUMENT when value is not a combiner. */
em_status em_combiner_check(int value, em_error *err);

/* Checks offsets against rows/nnz: "offsets[0]=3, must be 0", "offsets[17]=40 <
 * offsets[16]=41", "offsets[rows=4]=9, must equal nnz=10". Errors: INVALID_ARGUMENT. */
em_status em_csr_validate(const em_csr *csr, em_error *err);

/* Number of output vectors a pull returns: nnz for NONE, rows otherwise. */
uint64_t em_csr_output_vectors(const em_csr *csr, em_combiner combiner);

/* em_combiner_divisor: common/combiner.h. */

/* Checks that every value is finite; the message names the gradient vector, the key or
 * row it belongs to and the element: for NONE (one vector per key) "gradient of key 77
 * (keys[5], row 2) element 3 is NaN", otherwise (one per row) "gradient of row 2
 * (keys[4..7)) element 3 is +inf". largest (nullable) gets the largest element size.
 * Errors: INVALID_ARGUMENT. */
em_status em_csr_check_gradients(const em_csr *csr, em_combiner combiner, uint32_t dim,
                                 const float *gradients, float *largest, em_error *err);

/* Floats of gradients a thread of em_csr_check_gradients_on takes at least: its pass
 * over them takes far longer than starting the thread. */
#define EM_CSR_CHECK_FLOATS_PER_THREAD ((uint64_t)1 << 20)
#define EM_CSR_CHECK_THREADS_MAX 16u

/* em_csr_check_gradients with the pass over the gradients split over up to threads
 * threads (at most EM_CSR_CHECK_THREADS_MAX, each with EM_CSR_CHECK_FLOATS_PER_THREAD
 * floats or more; the calling thread and those of pool, which may be NULL:
 * em_parallel_pool_run): the same answer, the same error. */
em_status em_csr_check_gradients_on(const em_csr *csr, em_combiner combiner, uint32_t dim,
                                    const float *gradients, em_parallel_pool *pool,
                                    uint32_t threads, float *largest, em_error *err);

#endif
