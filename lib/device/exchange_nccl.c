/*
 * DESIGN: the NCCL exchange (lib/device/exchange.h) between the GPUs of one daemon.
 *
 * One communicator per device, all created together (ncclCommInitAll), rank i on the
 * backend's device i. An exchange round runs as ONE NCCL group: for each transfer
 * between two devices, ncclSend on the sending lane's stream with the sender's
 * communicator and ncclRecv on the receiving lane's stream with the receiver's; so the
 * send waits for the kernels that produced the data, and later work on the receiving
 * lane waits for the data (stream order), with no host synchronisation. NCCL needs
 * every rank to see its operations in the same order, so rounds are serialised by a
 * mutex. Transfers between two lanes of one device are stream-ordered copies.
 */
#include <pthread.h>
#include <stdlib.h>

#include "lib/device/cuda_device.h"
#include "lib/device/exchange.h"

typedef struct nccl_exchange {
    pthread_mutex_t lock;
    em_gpu_comm **comms;
    uint32_t count;
    em_gpu_send_recv *pending; /* the current round's device-to-device transfers */
    size_t pending_capacity;
} nccl_exchange;

static em_status ensure_pending(nccl_exchange *state, size_t count, em_error *err)
{
    if (state->pending_capacity >= count)
        return EM_OK;
    em_gpu_send_recv *grown = realloc(state->pending, count * sizeof(*grown));
    if (grown == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "nccl exchange: out of host memory");
    state->pending = grown;
    state->pending_capacity = count;
    return EM_OK;
}

/* Same-device transfers run at once; the others are collected for the group. */
static em_status sort_transfers(nccl_exchange *state, const em_transfer *transfers,
                                size_t count, size_t *pending, em_error *err)
{
    *pending = 0;
    for (size_t i = 0; i < count; i++) {
        const em_transfer *t = &transfers[i];
        em_device *from = t->from->device, *to = t->to->device;
        if (t->bytes == 0)
            continue;
        if (from == to) {
            em_status status =
                em__cuda_lane_copy(t->from, t->to, t->destination, t->source, t->bytes, err);
            if (status != EM_OK)
                return em_error_prefix(err, "exchange on %s: ", from->name);
            continue;
        }
        state->pending[(*pending)++] = (em_gpu_send_recv){
            .source = t->source,
            .source_stream = em__cuda_lane_stream(t->from),
            .source_rank = (int)from->index,
            .destination = t->destination,
            .destination_stream = em__cuda_lane_stream(t->to),
            .destination_rank = (int)to->index,
            .bytes = t->bytes,
        };
    }
    return EM_OK;
}

static em_status nccl_run(em_exchange *exchange, const em_transfer *transfers, size_t count,
                          em_error *err)
{
    nccl_exchange *state = exchange->impl;
    pthread_mutex_lock(&state->lock);
    size_t pending = 0;
    em_status status = ensure_pending(state, count, err);
    if (status == EM_OK)
        status = sort_transfers(state, transfers, count, &pending, err);
    if (status == EM_OK && pending > 0)
        status = em__cuda_check(em_gpu_comm_exchange(state->comms, state->pending, pending),
                                "nccl exchange", err);
    pthread_mutex_unlock(&state->lock);
    return status;
}

static void nccl_destroy(em_exchange *exchange)
{
    nccl_exchange *state = exchange->impl;
    for (uint32_t i = 0; i < state->count; i++)
        em_gpu_comm_destroy(state->comms[i]);
    free(state->comms);
    free(state->pending);
    pthread_mutex_destroy(&state->lock);
    free(state);
    free(exchange);
}

static const em_exchange_ops nccl_ops = {
    .run = nccl_run,
    .destroy = nccl_destroy,
};

em_status em_exchange_create_nccl(const uint32_t *ordinals, uint32_t count, em_exchange **out,
                                  em_error *err)
{
    em_exchange *exchange = calloc(1, sizeof(*exchange));
    nccl_exchange *state = calloc(1, sizeof(*state));
    int *ranks = calloc(count, sizeof(*ranks));
    em_gpu_comm **comms = calloc(count, sizeof(*comms));
    em_status status = EM_OK;
    if (exchange == NULL || state == NULL || ranks == NULL || comms == NULL)
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "nccl exchange: out of host memory");
    for (uint32_t i = 0; status == EM_OK && i < count; i++)
        ranks[i] = (int)ordinals[i];
    if (status == EM_OK)
        status = em__cuda_check(em_gpu_comm_init_all(ranks, (int)count, comms),
                                "nccl exchange", err);
    if (status == EM_OK) {
        status = em__cuda_check(em_gpu_comm_warm(comms, ranks, (int)count),
                                "nccl exchange (opening connections)", err);
        if (status != EM_OK)
            for (uint32_t i = 0; i < count; i++)
                em_gpu_comm_destroy(comms[i]);
    }
    free(ranks);
    if (status != EM_OK) {
        free(comms);
        free(state);
        free(exchange);
        return status;
    }
    pthread_mutex_init(&state->lock, NULL);
    state->comms = comms;
    state->count = count;
    exchange->ops = &nccl_ops;
    exchange->name = "nccl";
    exchange->impl = state;
    *out = exchange;
    return EM_OK;
}
