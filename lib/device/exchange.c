#include "lib/device/exchange.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct host_staged {
    pthread_mutex_t lock;
    void *staging;
    size_t staging_bytes;
} host_staged;

static em_status ensure_staging(host_staged *state, size_t bytes, em_error *err)
{
    if (state->staging_bytes >= bytes)
        return EM_OK;
    void *grown = realloc(state->staging, bytes);
    if (grown == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "host-staged exchange: cannot grow staging buffer to %zu bytes",
                            bytes);
    state->staging = grown;
    state->staging_bytes = bytes;
    return EM_OK;
}

/* Device to device through host memory, for devices that cannot address each other. */
static em_status staged_copy(host_staged *state, const em_transfer *t, em_error *err)
{
    pthread_mutex_lock(&state->lock);
    em_status status = ensure_staging(state, t->bytes, err);
    if (status == EM_OK)
        status = t->from->device->ops->copy_to_host(t->from, state->staging, t->source, t->bytes,
                                                    err);
    if (status == EM_OK)
        status = t->to->device->ops->copy_to_device(t->to, t->destination, state->staging,
                                                    t->bytes, err);
    pthread_mutex_unlock(&state->lock);
    return status;
}

static em_status run_transfer(host_staged *state, const em_transfer *t, em_error *err)
{
    em_device *from = t->from->device, *to = t->to->device;
    if (t->bytes == 0 || (from == to && t->source == t->destination))
        return EM_OK;
    if (from->host_addressable && to->host_addressable) {
        memcpy(t->destination, t->source, t->bytes);
        return EM_OK;
    }
    if (from->host_addressable)
        return to->ops->copy_to_device(t->to, t->destination, t->source, t->bytes, err);
    if (to->host_addressable)
        return from->ops->copy_to_host(t->from, t->destination, t->source, t->bytes, err);
    return staged_copy(state, t, err);
}

static em_status host_staged_run(em_exchange *exchange, const em_transfer *transfers,
                                 size_t count, em_error *err)
{
    host_staged *state = exchange->impl;
    for (size_t i = 0; i < count; i++) {
        em_status status = run_transfer(state, &transfers[i], err);
        if (status != EM_OK)
            return em_error_prefix(err, "exchange %s -> %s: ", transfers[i].from->device->name,
                                   transfers[i].to->device->name);
    }
    return EM_OK;
}

static void host_staged_destroy(em_exchange *exchange)
{
    host_staged *state = exchange->impl;
    pthread_mutex_destroy(&state->lock);
    free(state->staging);
    free(state);
    free(exchange);
}

static const em_exchange_ops host_staged_ops = {
    .run = host_staged_run,
    .destroy = host_staged_destroy,
};

em_status em_exchange_create_host_staged(em_exchange **out, em_error *err)
{
    em_exchange *exchange = calloc(1, sizeof(*exchange));
    host_staged *state = calloc(1, sizeof(*state));
    if (exchange == NULL || state == NULL) {
        free(exchange);
        free(state);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "host-staged exchange: out of memory");
    }
    pthread_mutex_init(&state->lock, NULL);
    exchange->ops = &host_staged_ops;
    exchange->name = "host-staged";
    exchange->impl = state;
    *out = exchange;
    return EM_OK;
}

void em_exchange_destroy(em_exchange *exchange)
{
    if (exchange != NULL)
        exchange->ops->destroy(exchange);
}
