/*
 * DESIGN: splitting a batch over several servers, and merging pulled vectors back.
 *
 * Pure functions over caller memory (no sockets), so the routing that decides which
 * server answers for a key can be checked against in-process tables.
 *
 * Key k lives on server em_key_server(k, n). A batch becomes one sub-batch per server
 * that keeps every row (a row with none of the server's keys is empty there), so
 * row numbers mean the same thing on every server.
 *
 * Pull: each sub-batch holds the server's DISTINCT keys, each at its first occurrence,
 * and is sent with combiner NONE. The caller's output is built here from the
 * per-key vectors: NONE copies each key's vector in batch order; a pooled combiner
 * starts each row from +0.0f, adds the row's key vectors in key order in float and
 * divides by em_combiner_divisor(combiner, row length) - the arithmetic of the
 * server's own combine (lib/device/cpu_device.c combine_row) - so the result is bit-identical
 * to one server holding every key.
 *
 * Push: each sub-batch holds every occurrence of the server's keys in batch order with
 * one gradient per key (combiner NONE): the key's own gradient for NONE, for a pooled
 * combiner row_gradient / em_combiner_divisor(combiner, full row length) in float.
 * A server sums a key's gradients in batch order, exactly the terms and order a single
 * server would have summed.
 */
#ifndef EMBER_CLIENTS_CLIENT_SPLIT_H
#define EMBER_CLIENTS_CLIENT_SPLIT_H

#include <stdint.h>

#include "lib/table/csr.h"
#include "lib/base/status.h"

/* One server's part of a batch; batch views the arrays below (owned by the split). */
typedef struct em__client_sub_batch {
    em_csr batch;
    uint32_t *offsets;       /* rows + 1 */
    uint64_t *keys;          /* batch.nnz */
    float *gradients;        /* push: batch.nnz x dim floats (one per key); pull: NULL */
    uint64_t gradient_count; /* floats at gradients */
} em__client_sub_batch;

typedef struct em__client_split {
    uint32_t server_count;
    em__client_sub_batch *servers; /* server_count entries */
    /* pull: for the batch's key k, the server that holds it and the key's index in that
     * server's sub-batch (NULL for a push) */
    uint32_t *key_server;
    uint32_t *key_index;
} em__client_split;

/* Splits a pull batch (already validated) over server_count servers. Errors:
 * RESOURCE_EXHAUSTED (out of memory); on error *out holds nothing to free. */
em_status em__client_split_pull(const em_csr *batch, uint32_t server_count,
                                em__client_split *out, em_error *err);

/* Splits a push batch (validated; gradients hold em_csr_output_vectors() x dim floats)
 * over server_count servers. Errors: RESOURCE_EXHAUSTED. */
em_status em__client_split_push(const em_csr *batch, em_combiner combiner, uint32_t dim,
                                const float *gradients, uint32_t server_count,
                                em__client_split *out, em_error *err);

/* Builds the caller's pull output from the servers' unpooled vectors: vectors[s] holds
 * split->servers[s].batch.nnz x dim floats; out holds em_csr_output_vectors(batch,
 * combiner) x dim floats. batch is the one given to em__client_split_pull. */
void em__client_split_merge_pull(const em__client_split *split, const em_csr *batch,
                                 em_combiner combiner, uint32_t dim, const float *const *vectors,
                                 float *out);

/* Frees what a split owns (safe on a zeroed or already deinitialised split). */
void em__client_split_deinit(em__client_split *split);

#endif
