#include "clients/client_split.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/keyhash.h"

/* ---- distinct keys ---------------------------------------------------------------- */

/*
 * Open-addressing set of the batch's keys. A slot holds 1 + the index of the key in
 * order of first appearance (0: empty), so every u64 value can be a key; at most half
 * the slots are used, so probes stay short.
 */
typedef struct key_set {
    uint32_t *slots;
    uint64_t mask;
    const uint64_t *distinct; /* the keys, by index */
} key_set;

static bool key_set_init(key_set *set, uint64_t keys, const uint64_t *distinct)
{
    uint64_t capacity = 16;
    while (capacity < 2 * keys)
        capacity *= 2;
    set->slots = calloc(capacity, sizeof(uint32_t));
    set->mask = capacity - 1;
    set->distinct = distinct;
    return set->slots != NULL;
}

/* Index of key, inserting it as index `next` when absent; *inserted says which. */
static uint32_t key_set_find_or_add(key_set *set, uint64_t key, uint32_t next, bool *inserted)
{
    uint64_t slot = em_hashmap_hash(key) & set->mask;
    for (;; slot = (slot + 1) & set->mask) {
        uint32_t entry = set->slots[slot];
        if (entry == 0) {
            set->slots[slot] = next + 1;
            *inserted = true;
            return next;
        }
        if (set->distinct[entry - 1] == key) {
            *inserted = false;
            return entry - 1;
        }
    }
}

/* ---- allocation ------------------------------------------------------------------- */

static em_status out_of_memory(em_error *err, const char *what, uint64_t count)
{
    return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                        "splitting a batch over servers: %s of %llu entries: out of memory", what,
                        (unsigned long long)count);
}

static em_status split_alloc(uint32_t rows, uint32_t server_count, em__client_split *out,
                             em_error *err)
{
    memset(out, 0, sizeof(*out));
    out->servers = calloc(server_count, sizeof(*out->servers));
    if (out->servers == NULL)
        return out_of_memory(err, "server table", server_count);
    out->server_count = server_count;
    for (uint32_t s = 0; s < server_count; s++) {
        out->servers[s].offsets = calloc((size_t)rows + 1, sizeof(uint32_t));
        if (out->servers[s].offsets == NULL) {
            em__client_split_deinit(out);
            return out_of_memory(err, "sub-batch offsets", (uint64_t)rows + 1);
        }
    }
    return EM_OK;
}

/* Allocates each server's keys (and gradient_floats_per_key floats per key). */
static em_status sub_batches_alloc(em__client_split *split, uint32_t rows,
                                   uint32_t gradient_floats_per_key, em_error *err)
{
    for (uint32_t s = 0; s < split->server_count; s++) {
        em__client_sub_batch *sub = &split->servers[s];
        uint64_t nnz = sub->offsets[rows];
        sub->keys = malloc((nnz + 1) * sizeof(uint64_t));
        sub->gradient_count = nnz * gradient_floats_per_key;
        if (gradient_floats_per_key > 0)
            sub->gradients = malloc((sub->gradient_count + 1) * sizeof(float));
        if (sub->keys == NULL || (gradient_floats_per_key > 0 && sub->gradients == NULL))
            return out_of_memory(err, "sub-batch keys", nnz);
        sub->batch = (em_csr){
            .rows = rows, .nnz = nnz, .offsets = sub->offsets, .keys = sub->keys};
    }
    return EM_OK;
}

void em__client_split_deinit(em__client_split *split)
{
    for (uint32_t s = 0; split->servers != NULL && s < split->server_count; s++) {
        free(split->servers[s].offsets);
        free(split->servers[s].keys);
        free(split->servers[s].gradients);
    }
    free(split->servers);
    free(split->key_server);
    free(split->key_index);
    memset(split, 0, sizeof(*split));
}

/* ---- pull ------------------------------------------------------------------------- */

/*
 * One pass in batch order: a key seen for the first time is appended to its server's
 * keys (distinct[] keeps it for the set, sub-batch keys are filled afterwards), and
 * every server's row end is recorded after each row.
 */
static em_status assign_distinct_keys(const em_csr *batch, em__client_split *split,
                                      uint64_t *distinct, uint32_t *first_of, em_error *err)
{
    key_set set;
    if (!key_set_init(&set, batch->nnz, distinct))
        return out_of_memory(err, "key set", batch->nnz);
    uint32_t distinct_count = 0;
    for (uint32_t r = 0; r < batch->rows; r++) {
        for (uint32_t k = batch->offsets[r]; k < batch->offsets[r + 1]; k++) {
            bool inserted;
            uint32_t u = key_set_find_or_add(&set, batch->keys[k], distinct_count, &inserted);
            if (inserted) {
                distinct[distinct_count++] = batch->keys[k];
                uint32_t server = (uint32_t)em_key_server(batch->keys[k],
                                                          (int32_t)split->server_count);
                split->key_server[k] = server;
                split->key_index[k] = split->servers[server].offsets[r + 1]++;
                first_of[u] = k;
            } else {
                split->key_server[k] = split->key_server[first_of[u]];
                split->key_index[k] = split->key_index[first_of[u]];
            }
        }
        for (uint32_t s = 0; s < split->server_count && r + 1 < batch->rows; s++)
            split->servers[s].offsets[r + 2] = split->servers[s].offsets[r + 1];
    }
    free(set.slots);
    return EM_OK;
}

static void fill_distinct_keys(const em_csr *batch, em__client_split *split)
{
    for (uint64_t k = 0; k < batch->nnz; k++)
        split->servers[split->key_server[k]].keys[split->key_index[k]] = batch->keys[k];
}

em_status em__client_split_pull(const em_csr *batch, uint32_t server_count,
                                em__client_split *out, em_error *err)
{
    em_status status = split_alloc(batch->rows, server_count, out, err);
    if (status != EM_OK)
        return status;
    uint64_t *distinct = malloc((batch->nnz + 1) * sizeof(uint64_t));
    uint32_t *first_of = malloc((batch->nnz + 1) * sizeof(uint32_t));
    out->key_server = malloc((batch->nnz + 1) * sizeof(uint32_t));
    out->key_index = malloc((batch->nnz + 1) * sizeof(uint32_t));
    if (distinct == NULL || first_of == NULL || out->key_server == NULL || out->key_index == NULL)
        status = out_of_memory(err, "key routing", batch->nnz);
    if (status == EM_OK)
        status = assign_distinct_keys(batch, out, distinct, first_of, err);
    if (status == EM_OK)
        status = sub_batches_alloc(out, batch->rows, 0, err);
    if (status == EM_OK)
        fill_distinct_keys(batch, out);
    free(distinct);
    free(first_of);
    if (status != EM_OK)
        em__client_split_deinit(out);
    return status;
}

static void add_vector(float *sum, const float *vector, uint32_t dim)
{
    for (uint32_t j = 0; j < dim; j++)
        sum[j] += vector[j];
}

static const float *key_vector(const em__client_split *split, const float *const *vectors,
                               uint64_t k, uint32_t dim)
{
    return vectors[split->key_server[k]] + (uint64_t)split->key_index[k] * dim;
}

/* The server's combine_row: +0.0f, add in key order, divide unless the divisor is 1. */
static void pool_row(const em__client_split *split, const em_csr *batch, uint32_t row,
                     em_combiner combiner, uint32_t dim, const float *const *vectors, float *out)
{
    uint32_t begin = batch->offsets[row], end = batch->offsets[row + 1];
    memset(out, 0, dim * sizeof(float));
    for (uint32_t k = begin; k < end; k++)
        add_vector(out, key_vector(split, vectors, k, dim), dim);
    float divisor = em_combiner_divisor(combiner, end - begin);
    if (divisor != 1.0f)
        for (uint32_t j = 0; j < dim; j++)
            out[j] /= divisor;
}

void em__client_split_merge_pull(const em__client_split *split, const em_csr *batch,
                                 em_combiner combiner, uint32_t dim, const float *const *vectors,
                                 float *out)
{
    if (combiner == EM_COMBINER_NONE) {
        for (uint64_t k = 0; k < batch->nnz; k++)
            memcpy(out + k * dim, key_vector(split, vectors, k, dim), dim * sizeof(float));
        return;
    }
    for (uint32_t r = 0; r < batch->rows; r++)
        pool_row(split, batch, r, combiner, dim, vectors, out + (uint64_t)r * dim);
}

/* ---- push ------------------------------------------------------------------------- */

/* Counts each server's keys per row into its offsets (prefix sums). */
static void count_push_keys(const em_csr *batch, em__client_split *split, uint32_t *key_server)
{
    for (uint32_t r = 0; r < batch->rows; r++) {
        for (uint32_t k = batch->offsets[r]; k < batch->offsets[r + 1]; k++) {
            key_server[k] = (uint32_t)em_key_server(batch->keys[k], (int32_t)split->server_count);
            split->servers[key_server[k]].offsets[r + 1]++;
        }
        for (uint32_t s = 0; s < split->server_count && r + 1 < batch->rows; s++)
            split->servers[s].offsets[r + 2] = split->servers[s].offsets[r + 1];
    }
}

/* The gradient a server receives for key k of row `row`, dim floats into out. */
static void key_gradient(const em_csr *batch, uint32_t row, uint64_t k, em_combiner combiner,
                         uint32_t dim, const float *gradients, float *out)
{
    if (combiner == EM_COMBINER_NONE) {
        memcpy(out, gradients + k * dim, dim * sizeof(float));
        return;
    }
    const float *row_gradient = gradients + (uint64_t)row * dim;
    float divisor = em_combiner_divisor(combiner, batch->offsets[row + 1] - batch->offsets[row]);
    for (uint32_t j = 0; j < dim; j++)
        out[j] = row_gradient[j] / divisor;
}

static void fill_push_keys(const em_csr *batch, em_combiner combiner, uint32_t dim,
                           const float *gradients, em__client_split *split,
                           const uint32_t *key_server, uint64_t *filled)
{
    for (uint32_t r = 0; r < batch->rows; r++) {
        for (uint32_t k = batch->offsets[r]; k < batch->offsets[r + 1]; k++) {
            em__client_sub_batch *sub = &split->servers[key_server[k]];
            uint64_t at = filled[key_server[k]]++;
            sub->keys[at] = batch->keys[k];
            key_gradient(batch, r, k, combiner, dim, gradients, sub->gradients + at * dim);
        }
    }
}

em_status em__client_split_push(const em_csr *batch, em_combiner combiner, uint32_t dim,
                                const float *gradients, uint32_t server_count,
                                em__client_split *out, em_error *err)
{
    em_status status = split_alloc(batch->rows, server_count, out, err);
    if (status != EM_OK)
        return status;
    uint32_t *key_server = malloc((batch->nnz + 1) * sizeof(uint32_t));
    uint64_t *filled = calloc(server_count, sizeof(uint64_t));
    if (key_server == NULL || filled == NULL)
        status = out_of_memory(err, "key routing", batch->nnz);
    if (status == EM_OK) {
        count_push_keys(batch, out, key_server);
        status = sub_batches_alloc(out, batch->rows, dim, err);
    }
    if (status == EM_OK)
        fill_push_keys(batch, combiner, dim, gradients, out, key_server, filled);
    free(key_server);
    free(filled);
    if (status != EM_OK)
        em__client_split_deinit(out);
    return status;
}
