#include "tests/support/reference_table.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lib/device/initializer.h"
#include "lib/device/optimizer.h"

typedef struct reference_row_entry {
    uint64_t key;
    bool used;
    double *values; /* weights, then state */
} reference_row_entry;

struct reference_table {
    em_table_config config;
    uint32_t width;
    reference_row_entry *slots;
    uint64_t slot_count, rows;
};

static uint64_t slot_hash(uint64_t key)
{
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdull;
    key ^= key >> 33;
    return key;
}

reference_table *reference_table_create(const em_table_config *config)
{
    reference_table *table = calloc(1, sizeof(*table));
    table->config = *config;
    table->width = config->dim + em_optimizer_state_floats(config->optimizer.kind, config->dim);
    table->slot_count = 1024;
    table->slots = calloc(table->slot_count, sizeof(*table->slots));
    return table;
}

void reference_table_destroy(reference_table *table)
{
    for (uint64_t i = 0; i < table->slot_count; i++)
        free(table->slots[i].values);
    free(table->slots);
    free(table);
}

uint64_t reference_table_rows(const reference_table *table)
{
    return table->rows;
}

static reference_row_entry *lookup(const reference_table *table, uint64_t key)
{
    uint64_t i = slot_hash(key) & (table->slot_count - 1);
    while (table->slots[i].used && table->slots[i].key != key)
        i = (i + 1) & (table->slot_count - 1);
    return &table->slots[i];
}

static void grow(reference_table *table)
{
    reference_row_entry *old = table->slots;
    uint64_t old_count = table->slot_count;
    table->slot_count *= 2;
    table->slots = calloc(table->slot_count, sizeof(*table->slots));
    for (uint64_t i = 0; i < old_count; i++)
        if (old[i].used)
            *lookup(table, old[i].key) = old[i];
    free(old);
}

static double *insert(reference_table *table, uint64_t key)
{
    if (2 * (table->rows + 1) > table->slot_count)
        grow(table);
    reference_row_entry *entry = lookup(table, key);
    entry->used = true;
    entry->key = key;
    entry->values = calloc(table->width, sizeof(double));
    uint32_t dim = table->config.dim;
    for (uint32_t j = 0; j < dim; j++)
        entry->values[j] = em_initializer_value(&table->config.initializer, key, j);
    int kind = table->config.optimizer.kind;
    if (kind == EM_OPTIMIZER_ADAGRAD || kind == EM_OPTIMIZER_ROWWISE_ADAGRAD)
        for (uint32_t j = dim; j < table->width; j++)
            entry->values[j] = table->config.optimizer.initial_accumulator;
    table->rows++;
    return entry->values;
}

bool reference_row(const reference_table *table, uint64_t key, double *values)
{
    const reference_row_entry *entry = lookup(table, key);
    if (!entry->used)
        return false;
    memcpy(values, entry->values, table->width * sizeof(double));
    return true;
}

static double divisor(em_combiner combiner, uint32_t length)
{
    if (combiner == EM_COMBINER_MEAN)
        return length;
    if (combiner == EM_COMBINER_SQRTN)
        return sqrt((double)length);
    return 1.0;
}

/* Distinct missing keys of a batch, counted before anything is inserted. */
static uint64_t count_missing(const reference_table *table, const em_csr *batch)
{
    uint64_t missing = 0;
    for (uint64_t k = 0; k < batch->nnz; k++) {
        if (lookup(table, batch->keys[k])->used)
            continue;
        bool seen_before = false;
        for (uint64_t e = 0; e < k && !seen_before; e++)
            seen_before = batch->keys[e] == batch->keys[k];
        missing += !seen_before;
    }
    return missing;
}

uint64_t reference_pull(reference_table *table, const em_csr *batch, em_combiner combiner,
                        bool create_missing, double *out, double *magnitude)
{
    uint32_t dim = table->config.dim;
    uint64_t missing = count_missing(table, batch);
    uint64_t vectors = em_csr_output_vectors(batch, combiner);
    memset(out, 0, vectors * dim * sizeof(double));
    if (magnitude != NULL)
        memset(magnitude, 0, vectors * dim * sizeof(double));
    for (uint32_t r = 0; r < batch->rows; r++) {
        uint32_t begin = batch->offsets[r], end = batch->offsets[r + 1];
        for (uint32_t k = begin; k < end; k++) {
            reference_row_entry *entry = lookup(table, batch->keys[k]);
            const double *row = entry->used ? entry->values : NULL;
            if (row == NULL && create_missing)
                row = insert(table, batch->keys[k]);
            uint64_t target = (combiner == EM_COMBINER_NONE ? k : r) * dim;
            for (uint32_t j = 0; row != NULL && j < dim; j++) {
                out[target + j] += row[j];
                if (magnitude != NULL)
                    magnitude[target + j] += fabs(row[j]);
            }
        }
        for (uint32_t j = 0; combiner != EM_COMBINER_NONE && end > begin && j < dim; j++) {
            out[(uint64_t)r * dim + j] /= divisor(combiner, end - begin);
            if (magnitude != NULL)
                magnitude[(uint64_t)r * dim + j] /= divisor(combiner, end - begin);
        }
    }
    return missing;
}

void reference_apply_optimizer(const em_optimizer_config *o, uint32_t dim, double *w,
                               const double *g)
{
    double *s = w + dim;
    switch (o->kind) {
    case EM_OPTIMIZER_SGD:
        for (uint32_t j = 0; j < dim; j++)
            w[j] -= (double)o->learning_rate * g[j];
        break;
    case EM_OPTIMIZER_ADAGRAD:
        for (uint32_t j = 0; j < dim; j++) {
            s[j] += g[j] * g[j];
            w[j] -= (double)o->learning_rate * g[j] / (sqrt(s[j]) + (double)o->eps);
        }
        break;
    case EM_OPTIMIZER_ROWWISE_ADAGRAD: {
        double squares = 0;
        for (uint32_t j = 0; j < dim; j++)
            squares += g[j] * g[j];
        s[0] += squares / dim;
        for (uint32_t j = 0; j < dim; j++)
            w[j] -= (double)o->learning_rate * g[j] / (sqrt(s[0]) + (double)o->eps);
        break;
    }
    case EM_OPTIMIZER_ADAM: {
        double *m = s, *v = s + dim, *t = s + 2 * dim;
        *t += 1;
        double b1 = o->beta1, b2 = o->beta2;
        for (uint32_t j = 0; j < dim; j++) {
            m[j] = b1 * m[j] + (1 - b1) * g[j];
            v[j] = b2 * v[j] + (1 - b2) * g[j] * g[j];
            double m_hat = m[j] / (1 - pow(b1, *t));
            double v_hat = v[j] / (1 - pow(b2, *t));
            w[j] -= (double)o->learning_rate * m_hat / (sqrt(v_hat) + (double)o->eps);
        }
        break;
    }
    case EM_OPTIMIZER_COUNT:
        abort(); /* not an optimizer: the model has no formula to compare with */
    }
}

void reference_push(reference_table *table, const em_csr *batch, em_combiner combiner,
                    const float *gradients)
{
    uint32_t dim = table->config.dim;
    /* Distinct keys in order of first appearance with their summed gradients. */
    uint64_t *keys = calloc(batch->nnz + 1, sizeof(uint64_t));
    double *sums = calloc((batch->nnz + 1) * dim, sizeof(double));
    uint64_t distinct = 0;
    for (uint32_t r = 0; r < batch->rows; r++) {
        uint32_t begin = batch->offsets[r], end = batch->offsets[r + 1];
        for (uint32_t k = begin; k < end; k++) {
            uint64_t u = 0;
            while (u < distinct && keys[u] != batch->keys[k])
                u++;
            if (u == distinct)
                keys[distinct++] = batch->keys[k];
            const float *g = gradients + (combiner == EM_COMBINER_NONE ? k : r) * dim;
            for (uint32_t j = 0; j < dim; j++)
                sums[u * dim + j] += (double)g[j] / divisor(combiner, end - begin);
        }
    }
    for (uint64_t u = 0; u < distinct; u++) {
        reference_row_entry *entry = lookup(table, keys[u]);
        double *row = entry->used ? entry->values : insert(table, keys[u]);
        reference_apply_optimizer(&table->config.optimizer, dim, row, sums + u * dim);
    }
    free(keys);
    free(sums);
}

bool reference_close(double got, double expected, double floor)
{
    double scale = fabs(expected) > floor ? fabs(expected) : floor;
    return fabs(got - expected) <= 1e-5 * scale;
}
