#include "lib/table/csr.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "common/row_check.h"
#include "lib/base/parallel.h"

static const char *const combiner_names[] = {"none", "sum", "mean", "sqrtn"};
#define COMBINER_COUNT EM_COMBINER_COUNT

const char *em_combiner_name(em_combiner combiner)
{
    if ((unsigned)combiner >= COMBINER_COUNT)
        return "unknown";
    return combiner_names[combiner];
}

em_status em_combiner_parse(const char *text, em_combiner *out, em_error *err)
{
    for (int i = 0; text != NULL && i < COMBINER_COUNT; i++) {
        if (strcmp(text, combiner_names[i]) == 0) {
            *out = (em_combiner)i;
            return EM_OK;
        }
    }
    return em_error_set(err, EM_INVALID_ARGUMENT,
                        "combiner '%s' is not one of none, sum, mean, sqrtn",
                        text != NULL ? text : "(null)");
}

em_status em_combiner_check(int value, em_error *err)
{
    if (value < 0 || value >= COMBINER_COUNT)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "combiner %d is not one of 0 (none), 1 (sum), 2 (mean), 3 (sqrtn)",
                            value);
    return EM_OK;
}

em_status em_csr_validate(const em_csr *csr, em_error *err)
{
    const uint32_t *offsets = csr->offsets;
    if (offsets[0] != 0)
        return em_error_set(err, EM_INVALID_ARGUMENT, "offsets[0]=%u, must be 0", offsets[0]);
    for (uint32_t r = 1; r <= csr->rows; r++) {
        if (offsets[r] < offsets[r - 1])
            return em_error_set(err, EM_INVALID_ARGUMENT, "offsets[%u]=%u < offsets[%u]=%u", r,
                                offsets[r], r - 1, offsets[r - 1]);
    }
    if ((uint64_t)offsets[csr->rows] != csr->nnz)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "offsets[rows=%u]=%u, must equal nnz=%llu", csr->rows,
                            offsets[csr->rows], (unsigned long long)csr->nnz);
    return EM_OK;
}

uint64_t em_csr_output_vectors(const em_csr *csr, em_combiner combiner)
{
    return combiner == EM_COMBINER_NONE ? csr->nnz : csr->rows;
}

/* First non-finite element of a vector of dim floats, or dim when all are finite. */
static uint32_t first_non_finite(const float *vector, uint32_t dim)
{
    for (uint32_t j = 0; j < dim; j++)
        if (!isfinite(vector[j]))
            return j;
    return dim;
}

static const char *non_finite_name(float value)
{
    if (isnan(value))
        return "NaN";
    return value > 0 ? "+inf" : "-inf";
}

/* Row that holds key index i (binary search over offsets). */
static uint32_t row_of_key(const em_csr *csr, uint64_t index)
{
    uint32_t low = 0, high = csr->rows;
    while (high - low > 1) {
        uint32_t middle = low + (high - low) / 2;
        if ((uint64_t)csr->offsets[middle] <= index)
            low = middle;
        else
            high = middle;
    }
    return low;
}

static em_status per_key_gradient_error(const em_csr *csr, uint64_t index, uint32_t element,
                                        float value, em_error *err)
{
    return em_error_set(err, EM_INVALID_ARGUMENT,
                        "gradient of key %llu (keys[%llu], row %u) element %u is %s",
                        (unsigned long long)csr->keys[index], (unsigned long long)index,
                        row_of_key(csr, index), element, non_finite_name(value));
}

static em_status per_row_gradient_error(const em_csr *csr, uint32_t row, uint32_t element,
                                        float value, em_error *err)
{
    return em_error_set(err, EM_INVALID_ARGUMENT,
                        "gradient of row %u (keys[%u..%u)) element %u is %s", row,
                        csr->offsets[row], csr->offsets[row + 1], element,
                        non_finite_name(value));
}

/* The largest sizes of the parts of values, a part a thread. */
typedef struct largest_parts {
    const float *values;
    uint64_t count, part;
    float found[EM_CSR_CHECK_THREADS_MAX];
} largest_parts;

static void largest_of_part(void *context, uint64_t i)
{
    largest_parts *p = context;
    uint64_t begin = i * p->part;
    uint64_t count = p->count - begin < p->part ? p->count - begin : p->part;
    p->found[i] = em_row_largest_size(p->values + begin, count);
}

/* em_row_largest_size of values[0..count), on up to threads threads (of pool). */
static float largest_size(const float *values, uint64_t count, em_parallel_pool *pool,
                          uint32_t threads)
{
    uint64_t parts = count / EM_CSR_CHECK_FLOATS_PER_THREAD;
    threads = threads < EM_CSR_CHECK_THREADS_MAX ? threads : EM_CSR_CHECK_THREADS_MAX;
    parts = parts < threads ? parts : threads;
    if (parts < 2)
        return em_row_largest_size(values, count);
    largest_parts p = {.values = values, .count = count, .part = (count + parts - 1) / parts};
    em_parallel_pool_run(pool, parts, (uint32_t)parts, largest_of_part, &p);
    /* sizes order as their bit patterns do (NaN above infinity): the largest of the parts' */
    return em_row_largest_size(p.found, parts);
}

em_status em_csr_check_gradients(const em_csr *csr, em_combiner combiner, uint32_t dim,
                                 const float *gradients, float *largest, em_error *err)
{
    return em_csr_check_gradients_on(csr, combiner, dim, gradients, NULL, 1, largest, err);
}

em_status em_csr_check_gradients_on(const em_csr *csr, em_combiner combiner, uint32_t dim,
                                    const float *gradients, em_parallel_pool *pool,
                                    uint32_t threads, float *largest, em_error *err)
{
    uint64_t vectors = em_csr_output_vectors(csr, combiner);
    /* one branch-free pass settles the usual case; only a non-finite element is looked
     * for vector by vector, to be named */
    float found = largest_size(gradients, vectors * dim, pool, threads);
    if (largest != NULL)
        *largest = found;
    if (found <= FLT_MAX)
        return EM_OK;
    for (uint64_t v = 0; v < vectors; v++) {
        const float *vector = gradients + v * dim;
        uint32_t bad = first_non_finite(vector, dim);
        if (bad == dim)
            continue;
        if (combiner == EM_COMBINER_NONE)
            return per_key_gradient_error(csr, v, bad, vector[bad], err);
        return per_row_gradient_error(csr, (uint32_t)v, bad, vector[bad], err);
    }
    return EM_OK;
}
