/*
 * DESIGN: the method handlers: wire messages in, engine calls, wire messages out.
 *
 * Data handlers check the attachment against what the body says before anything else
 * (its exact length for rows, nnz, combiner and the table's dim; zero padding), then
 * call the table with pointers into the attachment, so keys and gradients are never
 * copied; a pull writes straight into the response attachment. Every error names what
 * was wrong with the numbers seen; the engine's own errors (bad CSR, non-finite
 * gradients, capacity) pass through with its message.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/dispatch.h"
#include "ember_config.h"
#include "lib/table/catalog.h"
#include "lib/table/table.h"

/* ---- attachments --------------------------------------------------------------------- */

static em_status check_padding(const uint8_t *attachment, const em_csr_attachment *layout,
                               uint32_t rows, em_error *err)
{
    uint64_t offsets_end = ((uint64_t)rows + 1) * sizeof(uint32_t);
    for (uint64_t i = offsets_end; i < layout->keys_at; i++)
        if (attachment[i] != 0)
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "attachment padding byte %" PRIu64 " is 0x%02x, must be 0", i,
                                attachment[i]);
    return EM_OK;
}

/* An attachment whose length is not what rows, nnz and the gradients need. vectors is
 * the push's gradient vectors (0 for a pull): where the bytes after the keys are a whole
 * number of floats a vector, the message says how many, the usual slip being gradients
 * of another dim than the table's. */
static em_status size_error(const char *method, uint64_t length, uint32_t rows, uint64_t nnz,
                            uint64_t vectors, const em_csr_attachment *layout, em_error *err)
{
    uint64_t gradient_bytes = layout->total - layout->gradients_at;
    char width[96] = "";
    if (vectors > 0 && length > layout->gradients_at) {
        uint64_t sent = length - layout->gradients_at;
        if (sent % (vectors * sizeof(float)) == 0)
            snprintf(width, sizeof(width), ": the gradients hold %" PRIu64
                     " floats a vector where the table's dim is %" PRIu64,
                     sent / (vectors * sizeof(float)), gradient_bytes / (vectors * sizeof(float)));
    }
    return em_error_set(err, EM_INVALID_ARGUMENT,
                        "%s attachment is %" PRIu64 " bytes; rows=%" PRIu32 " nnz=%" PRIu64
                        "%s need %" PRIu64 " (offsets %" PRIu64 ", keys at %" PRIu64 "%s)%s",
                        method, length, rows, nnz, vectors > 0 ? " with their gradients" : "",
                        layout->total, ((uint64_t)rows + 1) * 4, layout->keys_at,
                        vectors > 0 ? ", gradients after the keys" : "", width);
}

/* Maps a PULL or PUSH attachment onto a CSR view after checking its size. */
static em_status map_batch(const em_request *request, uint32_t rows, uint64_t nnz,
                           uint64_t vectors, uint64_t gradient_floats, em_csr *batch,
                           em_csr_attachment *layout, em_error *err)
{
    const char *method = em_method_name(request->method);
    if (nnz > request->max_keys_per_request)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "%s of %" PRIu64 " keys exceeds max_keys_per_request %" PRIu64, method,
                            nnz, request->max_keys_per_request);
    em_status status = em_csr_attachment_layout(rows, nnz, gradient_floats, layout, err);
    if (status != EM_OK)
        return status;
    if (request->attachment_length != layout->total)
        return size_error(method, request->attachment_length, rows, nnz, vectors, layout, err);
    status = check_padding(request->attachment, layout, rows, err);
    if (status != EM_OK)
        return status;
    batch->rows = rows;
    batch->nnz = nnz;
    batch->offsets = (const uint32_t *)(const void *)request->attachment;
    batch->keys = (const uint64_t *)(const void *)(request->attachment + layout->keys_at);
    return EM_OK;
}

static em_status combiner_of(int wire, em_combiner *out, em_error *err)
{
    em_status status = em_combiner_check(wire, err);
    if (status == EM_OK)
        *out = (em_combiner)wire;
    return status;
}

/* ---- admission (loop thread, before the attachment is read) ------------------------- */

/* The table's dim, or EM_TABLE_DIM_MAX when the table does not exist yet (an earlier
 * request of the connection may create it): the answer is then charged at its most. */
static uint32_t admitted_dim(const em_request *request, const char *name, bool *known)
{
    em_catalog *catalog = request->context->catalog;
    em_table *table = NULL;
    em_error ignored;
    *known = em_catalog_acquire(catalog, name, &table, &ignored) == EM_OK;
    if (!*known)
        return EM_TABLE_DIM_MAX;
    uint32_t dim = em_table_dim(table);
    em_catalog_release(catalog, table);
    return dim;
}

/* The attachment's announced length against the layout the body describes; what
 * names the request in messages ("push to table 't' (dim 4)"). */
static em_status admit_batch(const em_request *request, const char *what, uint32_t rows,
                             uint64_t nnz, uint64_t vectors, uint64_t gradient_floats,
                             uint64_t attachment_length, em_error *err)
{
    if (nnz > request->max_keys_per_request)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "%s of %" PRIu64 " keys exceeds max_keys_per_request %" PRIu64, what,
                            nnz, request->max_keys_per_request);
    em_csr_attachment layout;
    em_status status = em_csr_attachment_layout(rows, nnz, gradient_floats, &layout, err);
    if (status != EM_OK)
        return em_error_prefix(err, "%s: ", what);
    if (attachment_length != layout.total) {
        size_error(em_method_name(request->method), attachment_length, rows, nnz, vectors,
                   &layout, err);
        return em_error_prefix(err, "%s: ", what);
    }
    return EM_OK;
}

em_status em_admit_pull(em_request *request, uint64_t attachment_length, uint64_t *answer_bytes,
                        em_error *err)
{
    const Ember__PullRequest *body = (const Ember__PullRequest *)request->body;
    char what[EM_TABLE_NAME_MAX + 64];
    snprintf(what, sizeof(what), "pull from table '%s'", body->table);
    em_status status = admit_batch(request, what, body->rows, body->nnz, 0, 0,
                                   attachment_length, err);
    if (status != EM_OK)
        return status;
    bool known = false;
    uint64_t dim = admitted_dim(request, body->table, &known);
    uint64_t vectors = body->combiner == EMBER__COMBINER__NONE ? body->nnz : body->rows;
    uint64_t bytes = vectors * dim * sizeof(float);
    if (known && bytes > request->max_response_bytes)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "pull from table '%s' would answer %" PRIu64
                            " bytes, more than max_response_bytes %" PRIu64,
                            body->table, bytes, request->max_response_bytes);
    *answer_bytes = bytes < request->max_response_bytes ? bytes : request->max_response_bytes;
    return EM_OK;
}

em_status em_admit_push(em_request *request, uint64_t attachment_length, uint64_t *answer_bytes,
                        em_error *err)
{
    const Ember__PushRequest *body = (const Ember__PushRequest *)request->body;
    *answer_bytes = 0;
    bool known = false;
    uint64_t dim = admitted_dim(request, body->table, &known);
    if (!known) /* the handler checks the attachment once the table exists */
        return EM_OK;
    uint64_t vectors = body->combiner == EMBER__COMBINER__NONE ? body->nnz : body->rows;
    if (vectors > UINT64_MAX / dim)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "push to table '%s': %" PRIu64 " vectors of dim %" PRIu64
                            " overflow 64 bits", body->table, vectors, dim);
    char what[EM_TABLE_NAME_MAX + 64];
    snprintf(what, sizeof(what), "push to table '%s' (dim %" PRIu64 ")", body->table, dim);
    return admit_batch(request, what, body->rows, body->nnz, vectors, vectors * dim,
                       attachment_length, err);
}

/* ---- pull and push ------------------------------------------------------------------- */

static em_status pull_table(em_request *request, em_table *table, const void *untyped_body,
                            em_error *err)
{
    const Ember__PullRequest *body = untyped_body;
    em_combiner combiner;
    em_csr batch;
    em_csr_attachment layout;
    em_status status = combiner_of((int)body->combiner, &combiner, err);
    if (status != EM_OK)
        return em_error_prefix(err, "pull from table '%s': ", em_table_name(table));
    status = map_batch(request, body->rows, body->nnz, 0, 0, &batch, &layout, err);
    if (status != EM_OK)
        return em_error_prefix(err, "pull from table '%s' (combiner %s): ", em_table_name(table),
                               em_combiner_name(combiner));
    uint32_t dim = em_table_dim(table);
    uint64_t floats = em_csr_output_vectors(&batch, combiner) * dim;
    if (floats * sizeof(float) > request->max_response_bytes)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "pull from table '%s' would answer %" PRIu64
                            " bytes, more than max_response_bytes %" PRIu64,
                            em_table_name(table), floats * sizeof(float),
                            request->max_response_bytes);
    /* the backend's host buffers: a GPU copies the answer into pinned memory directly */
    em_host_buffers *buffers = em_catalog_backend(request->context->catalog)->host_buffers;
    float *out = em_host_buffer_alloc(buffers, floats * sizeof(float));
    if (out == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "pull response of %" PRIu64
                            " bytes: out of memory", floats * sizeof(float));
    em_pull_request pull = {batch, combiner, body->create_missing, out, floats};
    em_pull_result result;
    status = em_table_pull(table, &pull, &result, err);
    if (status != EM_OK) {
        em_host_buffer_free(buffers, out);
        return status;
    }
    Ember__PullResponse response = EMBER__PULL_RESPONSE__INIT;
    response.dim = dim;
    response.missing = result.missing;
    response.created = result.created;
    response.unique_keys = result.unique_keys;
    return em_request_respond(request, &response.base, out, floats * sizeof(float), err);
}

typedef em_status (*table_work)(em_request *request, em_table *table, const void *body,
                                em_error *err);

/* Runs work on the named table while holding a reference to it. */
static em_status with_table(em_request *request, const char *name, table_work work,
                            const void *body, em_error *err)
{
    em_catalog *catalog = request->context->catalog;
    em_table *table = NULL;
    em_status status = em_catalog_acquire(catalog, name, &table, err);
    if (status != EM_OK)
        return status;
    status = work(request, table, body, err);
    em_catalog_release(catalog, table);
    return status;
}

em_status em_handle_pull(em_request *request, em_error *err)
{
    const Ember__PullRequest *body = (const Ember__PullRequest *)request->body;
    return with_table(request, body->table, pull_table, body, err);
}

static em_status push_table(em_request *request, em_table *table, const void *untyped_body,
                            em_error *err)
{
    const Ember__PushRequest *body = untyped_body;
    em_combiner combiner;
    em_status status = combiner_of((int)body->combiner, &combiner, err);
    if (status != EM_OK)
        return em_error_prefix(err, "push to table '%s': ", em_table_name(table));
    uint64_t vectors = combiner == EM_COMBINER_NONE ? body->nnz : body->rows;
    uint64_t dim = em_table_dim(table);
    if (vectors > UINT64_MAX / dim)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "push to table '%s': %" PRIu64 " vectors of dim %" PRIu64
                            " overflow 64 bits", em_table_name(table), vectors, dim);
    em_csr batch;
    em_csr_attachment layout;
    status = map_batch(request, body->rows, body->nnz, vectors, vectors * dim, &batch, &layout,
                       err);
    if (status != EM_OK)
        return em_error_prefix(err, "push to table '%s' (dim %" PRIu64 ", combiner %s): ",
                               em_table_name(table), dim, em_combiner_name(combiner));
    const float *gradients = (const float *)(const void *)(request->attachment +
                                                           layout.gradients_at);
    em_push_request push = {batch, combiner, gradients, vectors * dim};
    em_push_result result;
    status = em_table_push(table, &push, &result, err);
    if (status != EM_OK)
        return status;
    Ember__PushResponse response = EMBER__PUSH_RESPONSE__INIT;
    response.updated = result.updated;
    response.created = result.created;
    return em_request_respond(request, &response.base, NULL, 0, err);
}

em_status em_handle_push(em_request *request, em_error *err)
{
    const Ember__PushRequest *body = (const Ember__PushRequest *)request->body;
    return with_table(request, body->table, push_table, body, err);
}

/* ---- health -------------------------------------------------------------------------- */

static uint64_t uptime_ms(const em_request *request)
{
    return em_monotonic_ms() - request->context->start_ms;
}

em_status em_handle_ping(em_request *request, em_error *err)
{
    Ember__PingResponse response = EMBER__PING_RESPONSE__INIT;
    response.version = (char *)EM_VERSION;
    response.uptime_ms = uptime_ms(request);
    return em_request_respond(request, &response.base, NULL, 0, err);
}

em_status em_handle_health(em_request *request, em_error *err)
{
    em_server_context *context = request->context;
    Ember__HealthResponse response = EMBER__HEALTH_RESPONSE__INIT;
    response.ready = em_server_ready(context);
    response.state = (char *)em_server_state_now(context);
    response.backend = (char *)context->backend->kind;
    response.devices = context->backend->device_count;
    response.tables = (uint32_t)em_catalog_count(context->catalog);
    return em_request_respond(request, &response.base, NULL, 0, err);
}

/* ---- maintenance --------------------------------------------------------------------- */

em_status em_handle_drain(em_request *request, em_error *err)
{
    em_server_context *context = request->context;
    Ember__DrainResponse response = EMBER__DRAIN_RESPONSE__INIT;
    response.was_drained = atomic_exchange(&context->drained, true);
    if (!response.was_drained)
        em_log_notice(context->log, "DRAIN: out of service; data requests are refused until "
                                    "UNDRAIN");
    response.requests_running = em_executor_pending(context->executor);
    response.data_connections = atomic_load(&context->data_connections);
    return em_request_respond(request, &response.base, NULL, 0, err);
}

em_status em_handle_undrain(em_request *request, em_error *err)
{
    em_server_context *context = request->context;
    Ember__UndrainResponse response = EMBER__UNDRAIN_RESPONSE__INIT;
    response.was_drained = atomic_exchange(&context->drained, false);
    if (response.was_drained)
        em_log_notice(context->log, "UNDRAIN: back in service");
    return em_request_respond(request, &response.base, NULL, 0, err);
}

/* Splits a space-separated key list into the strings of a repeated field (in place). */
static size_t split_keys(char *list, char **keys, size_t capacity)
{
    size_t count = 0;
    for (char *save = NULL, *key = strtok_r(list, " ", &save); key != NULL && count < capacity;
         key = strtok_r(NULL, " ", &save))
        keys[count++] = key;
    return count;
}

em_status em_handle_reload(em_request *request, em_error *err)
{
    em_server_context *context = request->context;
    if (context->reload == NULL)
        return em_error_set(err, EM_FAILED_PRECONDITION, "this server cannot reload");
    em_reload_report report;
    em_status status = context->reload(context->owner, &report, err);
    if (status != EM_OK)
        return status;
    char *changed[64], *needs_restart[64];
    Ember__ReloadResponse response = EMBER__RELOAD_RESPONSE__INIT;
    response.path = report.path;
    response.changed = changed;
    response.n_changed = split_keys(report.changed, changed, 64);
    response.needs_restart = needs_restart;
    response.n_needs_restart = split_keys(report.needs_restart, needs_restart, 64);
    return em_request_respond(request, &response.base, NULL, 0, err);
}

em_status em_handle_slowlog(em_request *request, em_error *err)
{
    const Ember__SlowlogRequest *body = (const Ember__SlowlogRequest *)request->body;
    em_slowlog *log = &request->context->slowlog;
    size_t max = body->max == 0 || body->max > log->count ? log->count : body->max;
    em_slow_request *held = calloc(max + 1, sizeof(*held));
    Ember__SlowRequest *entries = calloc(max + 1, sizeof(*entries));
    Ember__SlowRequest **pointers = calloc(max + 1, sizeof(*pointers));
    em_status status = EM_OK;
    if (held == NULL || entries == NULL || pointers == NULL) {
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "slowlog: out of memory");
    } else {
        size_t n = em_slowlog_read(log, held, max);
        for (size_t i = 0; i < n; i++) {
            Ember__SlowRequest *e = &entries[i];
            ember__slow_request__init(e);
            e->id = held[i].id;
            e->unix_ms = held[i].unix_ms;
            e->duration_us = held[i].duration_us;
            e->queue_us = held[i].queue_us;
            e->run_us = held[i].run_us;
            e->method = held[i].method;
            e->table = held[i].table;
            e->keys = held[i].keys;
            e->bytes = held[i].bytes;
            e->status = held[i].status;
            e->peer = held[i].peer;
            pointers[i] = e;
        }
        Ember__SlowlogResponse response = EMBER__SLOWLOG_RESPONSE__INIT;
        response.entries = pointers;
        response.n_entries = n;
        response.recorded = log->recorded;
        response.dropped = em_slowlog_dropped(log);
        response.threshold_ms = atomic_load(&request->context->slowlog_threshold_us) / 1000u;
        status = em_request_respond(request, &response.base, NULL, 0, err);
        if (status == EM_OK && body->reset)
            em_slowlog_reset(log);
    }
    free(pointers);
    free(entries);
    free(held);
    return status;
}

/* ---- tables -------------------------------------------------------------------------- */

/* Fills info for table; the strings it points to are malloc'ed (free_table_info). */
static void describe_table(em_table *table, Ember__TableInfo *info)
{
    const em_table_config *config = em_table_get_config(table);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    cJSON *json = em_table_config_to_json(config);
    ember__table_info__init(info);
    info->name = strdup(config->name);
    info->dim = config->dim;
    info->capacity = config->capacity;
    info->shards = config->shards;
    info->optimizer = strdup(em_optimizer_name(config->optimizer.kind));
    info->rows = stats.rows;
    info->config_json = json != NULL ? cJSON_PrintUnformatted(json) : strdup("{}");
    cJSON_Delete(json);
}

static bool table_info_complete(const Ember__TableInfo *info)
{
    return info->name != NULL && info->optimizer != NULL && info->config_json != NULL;
}

static void free_table_info(Ember__TableInfo *info)
{
    free(info->name);
    free(info->optimizer);
    free(info->config_json);
}

em_status em_handle_create_table(em_request *request, em_error *err)
{
    const Ember__CreateTableRequest *body = (const Ember__CreateTableRequest *)request->body;
    em_table_config config;
    em_status status = em_table_config_parse_text(body->config_json, &config, err);
    if (status != EM_OK)
        return status;
    em_table *table = NULL;
    em_catalog *catalog = request->context->catalog;
    status = em_catalog_create_table(catalog, &config, &table, err);
    if (status != EM_OK)
        return status;
    Ember__TableInfo info;
    describe_table(table, &info);
    em_catalog_release(catalog, table);
    if (!table_info_complete(&info)) {
        free_table_info(&info);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "table info: out of memory");
    }
    em_log_notice(request->context->log, "created table '%s' (dim %u, capacity %" PRIu64
                  ", %u shards, %s)", info.name, info.dim, info.capacity, info.shards,
                  info.optimizer);
    Ember__CreateTableResponse response = EMBER__CREATE_TABLE_RESPONSE__INIT;
    response.table = &info;
    status = em_request_respond(request, &response.base, NULL, 0, err);
    free_table_info(&info);
    return status;
}

typedef struct drop_call {
    em_catalog *catalog;
    const char *table;
} drop_call;

static em_status drop_from_catalog(void *context, em_error *err)
{
    drop_call *call = context;
    return em_catalog_drop(call->catalog, call->table, err);
}

/* A server with checkpoints sets the dropped table's aside, so that a restart does not
 * bring it back (em_checkpoint_drop_table). */
em_status em_handle_drop_table(em_request *request, em_error *err)
{
    const Ember__DropTableRequest *body = (const Ember__DropTableRequest *)request->body;
    em_server_context *context = request->context;
    drop_call call = {.catalog = context->catalog, .table = body->table};
    char aside[4400] = "";
    em_status status = em_table_name_check(body->table, err);
    if (status == EM_OK && context->checkpointer != NULL)
        status = em_checkpoint_drop_table(context->checkpoint_dir, body->table,
                                          drop_from_catalog, &call, aside, sizeof(aside), err);
    else if (status == EM_OK)
        status = drop_from_catalog(&call, err);
    if (status != EM_OK)
        return status;
    if (aside[0] != '\0')
        em_log_notice(context->log, "dropped table '%s'; its checkpoints were moved to %s",
                      body->table, aside);
    else
        em_log_notice(context->log, "dropped table '%s'", body->table);
    Ember__DropTableResponse response = EMBER__DROP_TABLE_RESPONSE__INIT;
    return em_request_respond(request, &response.base, NULL, 0, err);
}

static em_status erase_table(em_request *request, em_table *table, const void *untyped_body,
                             em_error *err)
{
    const Ember__EraseRequest *body = untyped_body;
    if ((body->by_age || body->by_time) && body->n_keys > 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "ERASE takes keys, by_age or by_time, one of them (%zu keys and "
                            "by_%s given)",
                            body->n_keys, body->by_age ? "age" : "time");
    if (body->by_age && body->by_time)
        return em_error_set(err, EM_INVALID_ARGUMENT, "ERASE takes by_age or by_time, not both");
    if (body->by_age || body->by_time) {
        uint64_t erased = 0;
        em_status status =
            body->by_age ? em_table_erase_older(table, body->not_pushed_for, &erased, err)
                         : em_table_erase_before(table, body->since_unix_ms, &erased, err);
        if (status != EM_OK)
            return status;
        em_log_info(request->context->log, "erased %" PRIu64 " rows of table '%s' not pushed %s",
                    erased, em_table_name(table), body->by_age ? "recently" : "since a time");
        Ember__EraseResponse response = EMBER__ERASE_RESPONSE__INIT;
        response.erased = erased;
        return em_request_respond(request, &response.base, NULL, 0, err);
    }
    if (body->n_keys > request->max_keys_per_request)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "ERASE of %zu keys exceeds max_keys_per_request %" PRIu64,
                            body->n_keys, request->max_keys_per_request);
    uint64_t erased = 0;
    em_status status = em_table_erase(table, body->keys, body->n_keys, &erased, err);
    if (status != EM_OK)
        return status;
    em_log_info(request->context->log, "erased %" PRIu64 " of %zu listed keys from table '%s'",
                erased, body->n_keys, em_table_name(table));
    Ember__EraseResponse response = EMBER__ERASE_RESPONSE__INIT;
    response.erased = erased;
    return em_request_respond(request, &response.base, NULL, 0, err);
}

em_status em_handle_erase(em_request *request, em_error *err)
{
    const Ember__EraseRequest *body = (const Ember__EraseRequest *)request->body;
    return with_table(request, body->table, erase_table, body, err);
}

static em_status evicted_table(em_request *request, em_table *table, const void *untyped_body,
                               em_error *err)
{
    const Ember__EvictedRequest *body = untyped_body;
    uint64_t max = body->max == 0 || body->max > EM_EVICTION_RING_MAX ? EM_EVICTION_RING_MAX
                                                                       : body->max;
    uint64_t ring = em_table_get_config(table)->eviction.ring;
    if (max > ring)
        max = ring;
    uint64_t *keys = malloc((max + 1) * sizeof(uint64_t));
    if (keys == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "evicted keys: out of memory");
    em_evicted_view view;
    em_status status = em_table_evicted(table, body->after, max, keys, &view, err);
    if (status == EM_OK) {
        Ember__EvictedResponse response = EMBER__EVICTED_RESPONSE__INIT;
        response.n_keys = view.count;
        response.keys = keys;
        response.first = view.first;
        response.total = view.total;
        response.missed = view.missed;
        status = em_request_respond(request, &response.base, NULL, 0, err);
    }
    free(keys);
    return status;
}

em_status em_handle_evicted(em_request *request, em_error *err)
{
    const Ember__EvictedRequest *body = (const Ember__EvictedRequest *)request->body;
    return with_table(request, body->table, evicted_table, body, err);
}

em_status em_handle_list_tables(em_request *request, em_error *err)
{
    em_catalog *catalog = request->context->catalog;
    em_table **tables = NULL;
    size_t count = 0;
    em_status status = em_catalog_list(catalog, &tables, &count, err);
    if (status != EM_OK)
        return status;
    Ember__TableInfo *infos = calloc(count + 1, sizeof(*infos));
    Ember__TableInfo **pointers = calloc(count + 1, sizeof(*pointers));
    bool complete = infos != NULL && pointers != NULL;
    for (size_t i = 0; i < count; i++) {
        if (complete) {
            describe_table(tables[i], &infos[i]);
            pointers[i] = &infos[i];
            complete = table_info_complete(&infos[i]);
        }
        em_catalog_release(catalog, tables[i]);
    }
    free(tables);
    if (complete) {
        Ember__ListTablesResponse response = EMBER__LIST_TABLES_RESPONSE__INIT;
        response.n_tables = count;
        response.tables = pointers;
        status = em_request_respond(request, &response.base, NULL, 0, err);
    } else {
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "table list: out of memory");
    }
    for (size_t i = 0; infos != NULL && i < count; i++)
        free_table_info(&infos[i]);
    free(infos);
    free(pointers);
    return status;
}

/* ---- checkpoints ----------------------------------------------------------------------- */

/* The CheckpointInfo of info, pointing into it. */
static void checkpoint_message(Ember__CheckpointInfo *item, em_checkpoint_info *info)
{
    ember__checkpoint_info__init(item);
    item->table = info->table;
    item->id = info->id;
    item->path = info->path;
    item->rows = info->rows;
    item->bytes = info->bytes;
    item->seconds = info->seconds;
    item->kind = info->kind;
    item->parent = info->parent;
    item->depth = info->depth;
    item->tombstones = info->tombstones;
    item->table_rows = info->table_rows;
    item->manifest_xxh3 = info->manifest_xxh3;
    item->chunks = info->chunks;
    item->created_unix_ms = info->created_unix_ms;
}

/* The CheckpointInfo messages of infos[0..count) in *items, and *pointers to them, for an
 * answer's repeated field; the caller frees both once it has answered. */
static em_status checkpoint_messages(em_checkpoint_info *infos, size_t count, const char *what,
                                     Ember__CheckpointInfo **items,
                                     Ember__CheckpointInfo ***pointers, em_error *err)
{
    *items = calloc(count + 1, sizeof(**items));
    *pointers = calloc(count + 1, sizeof(**pointers));
    if (*items == NULL || *pointers == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "%s: out of memory", what);
    for (size_t i = 0; i < count; i++) {
        checkpoint_message(&(*items)[i], &infos[i]);
        (*pointers)[i] = &(*items)[i];
    }
    return EM_OK;
}

em_status em_handle_save(em_request *request, em_error *err)
{
    const Ember__SaveRequest *body = (const Ember__SaveRequest *)request->body;
    em_server_context *context = request->context;
    em_checkpointer *checkpointer = context->checkpointer;
    bool into = body->dir != NULL && body->dir[0] != '\0';
    if (into && body->delta)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "save: a save into dir '%s' is a full copy; delta is not for it",
                            body->dir);
    if (checkpointer == NULL && !into)
        return em_error_set(err, EM_FAILED_PRECONDITION,
                            "save: this server has no checkpoint section in its configuration");
    em_checkpoint_info *infos = NULL;
    size_t count = 0;
    em_status status =
        into ? em_checkpointer_save_into(context->catalog, context->log, &context->stats,
                                         body->dir, body->table, &infos, &count, err)
             : em_checkpointer_save(checkpointer, body->table,
                                    body->delta ? EM_SAVE_DELTA : EM_SAVE_FULL, &infos, &count,
                                    err);
    Ember__CheckpointInfo *items = NULL, **pointers = NULL;
    if (status == EM_OK)
        status = checkpoint_messages(infos, count, "save", &items, &pointers, err);
    if (status == EM_OK) {
        Ember__SaveResponse response = EMBER__SAVE_RESPONSE__INIT;
        response.n_saved = count;
        response.saved = pointers;
        status = em_request_respond(request, &response.base, NULL, 0, err);
    }
    free(items);
    free(pointers);
    free(infos);
    return status;
}

/* Appends the checkpoints of table under dir to *infos (*count of them, *capacity room). */
static em_status list_table_checkpoints(const char *dir, const char *table,
                                        em_checkpoint_info **infos, size_t *count,
                                        size_t *capacity, em_error *err)
{
    em_checkpoint_info *listed = NULL;
    size_t n = 0;
    em_status status = em_checkpoint_list(dir, table, &listed, &n, err);
    if (status == EM_OK && *count + n > *capacity) {
        size_t grown_capacity = (*count + n) * 2;
        em_checkpoint_info *grown = realloc(*infos, grown_capacity * sizeof(**infos));
        if (grown == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "checkpoints: out of memory");
        else {
            *infos = grown;
            *capacity = grown_capacity;
        }
    }
    if (status == EM_OK) {
        memcpy(*infos + *count, listed, n * sizeof(*listed));
        *count += n;
    }
    free(listed);
    return status;
}

em_status em_handle_checkpoints(em_request *request, em_error *err)
{
    const Ember__CheckpointsRequest *body = (const Ember__CheckpointsRequest *)request->body;
    em_server_context *context = request->context;
    if (context->checkpointer == NULL)
        return em_error_set(err, EM_FAILED_PRECONDITION,
                            "checkpoints: this server has no checkpoint section in its "
                            "configuration");
    const char *dir = context->checkpoint_dir;
    bool one = body->table != NULL && body->table[0] != '\0';
    char **names = NULL;
    size_t tables = 0, count = 0, capacity = 0;
    em_checkpoint_info *infos = NULL;
    /* a table's name, never a path: it is joined to the dir */
    em_status status = one ? em_table_name_check(body->table, err)
                           : em_checkpoint_tables(dir, &names, &tables, err);
    if (one && status != EM_OK)
        return em_error_prefix(err, "checkpoints: ");
    if (one)
        status = list_table_checkpoints(dir, body->table, &infos, &count, &capacity, err);
    for (size_t t = 0; status == EM_OK && t < tables; t++)
        status = list_table_checkpoints(dir, names[t], &infos, &count, &capacity, err);
    em_checkpoint_free_names(names, tables);
    Ember__CheckpointInfo *items = NULL, **pointers = NULL;
    if (status == EM_OK)
        status = checkpoint_messages(infos, count, "checkpoints", &items, &pointers, err);
    if (status == EM_OK) {
        Ember__CheckpointsResponse response = EMBER__CHECKPOINTS_RESPONSE__INIT;
        response.n_checkpoints = count;
        response.checkpoints = pointers;
        status = em_request_respond(request, &response.base, NULL, 0, err);
    }
    free(items);
    free(pointers);
    free(infos);
    return status;
}

/* What a LOAD may name: sources (a cluster checkpoint's parts, one per server of the
 * cluster saved) and the length of each path (checkpoint paths stay below 4096). */
#define EM_LOAD_SOURCES_MAX 1024u
#define EM_LOAD_PATH_MAX 4000u

em_status em_handle_load(em_request *request, em_error *err)
{
    const Ember__LoadRequest *body = (const Ember__LoadRequest *)request->body;
    em_server_context *context = request->context;
    em_status status = em_table_name_check(body->table, err);
    if (status != EM_OK)
        return em_error_prefix(err, "load: ");
    const char *dir = context->checkpointer != NULL ? context->checkpoint_dir : NULL;
    if (body->n_source_manifests > 0 && body->n_source_manifests != body->n_sources)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "load of table '%s': %zu source_manifests for %zu sources",
                            body->table, body->n_source_manifests, body->n_sources);
    if (body->server_count > 0 && body->server_index >= body->server_count)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "load of table '%s': server_index %u is not below server_count %u",
                            body->table, body->server_index, body->server_count);
    if (body->n_sources > EM_LOAD_SOURCES_MAX)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "load of table '%s': %zu sources, at most %u", body->table,
                            body->n_sources, EM_LOAD_SOURCES_MAX);
    for (size_t i = 0; i <= body->n_sources; i++) {
        const char *path = i < body->n_sources ? body->sources[i] : body->path;
        bool given = path != NULL && path[0] != '\0';
        if ((i < body->n_sources && !given) ||
            (given && (path[0] != '/' || strlen(path) > EM_LOAD_PATH_MAX))) {
            char what[32] = "path";
            if (i < body->n_sources)
                snprintf(what, sizeof(what), "sources[%zu]", i);
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "load of table '%s': %s '%.200s' is not an absolute path of at "
                                "most %u characters on the server", body->table, what,
                                path != NULL ? path : "", EM_LOAD_PATH_MAX);
        }
    }
    if (body->shards > EM_TABLE_SHARDS_MAX)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "load of table '%s': shards %u is above the limit of %u",
                            body->table, body->shards, EM_TABLE_SHARDS_MAX);
    em_load_spec spec = {
        .table = body->table,
        .path = body->path,
        .sources = (const char *const *)body->sources,
        .source_count = body->n_sources,
        .manifests = body->n_source_manifests > 0 ? body->source_manifests : NULL,
        .weights_only = body->weights_only,
        .server_index = body->server_index,
        .server_count = body->server_count,
        .shards = body->shards,
    };
    em_checkpoint_info info;
    status = em_checkpointer_load(context->catalog, dir, &spec, &info, err);
    if (status != EM_OK)
        return status;
    if (body->n_sources > 0)
        em_log_notice(context->log,
                      "loaded table '%s' from %zu checkpoints as server %u of %u: %" PRIu64
                      " rows in %.3f s", body->table, body->n_sources, body->server_index,
                      body->server_count, info.table_rows, info.seconds);
    else
        em_log_notice(context->log, "loaded table '%s' from %s%s: %" PRIu64 " rows in %.3f s",
                      body->table, info.path, body->weights_only ? " (weights only)" : "",
                      info.rows, info.seconds);
    Ember__CheckpointInfo item;
    checkpoint_message(&item, &info);
    Ember__LoadResponse response = EMBER__LOAD_RESPONSE__INIT;
    response.loaded = &item;
    return em_request_respond(request, &response.base, NULL, 0, err);
}

/* ---- stats ----------------------------------------------------------------------------- */

/* The STATS answer is a visitor over the snapshot (daemon/stats.h): each number goes to
 * the protobuf field of the same name in its scope's message, so a number declared in
 * the schema reaches the wire without a line here (a unit test checks that every stat
 * has its field). */
typedef struct stats_message {
    Ember__StatsResponse response;
    Ember__ServerStats server;
    Ember__MethodStats methods[EM_METHOD_COUNT];
    Ember__MethodStats *method_pointers[EM_METHOD_COUNT];
    Ember__StatusCount answers[EM_METHOD_COUNT][EM_STATUS_COUNT];
    Ember__StatusCount *answer_pointers[EM_METHOD_COUNT][EM_STATUS_COUNT];
    uint64_t duration_buckets[EM_METHOD_COUNT][EM_DURATION_BUCKETS + 1];
    double duration_bounds[EM_DURATION_BUCKETS];
    Ember__TableStats *tables;
    Ember__TableStats **table_pointers;
    Ember__PoolStats *pools;
    Ember__PoolStats **pool_pointers;
    const char *missing; /* a stat without its field, if any */
} stats_message;

static ProtobufCMessage *stats_target(stats_message *m, em_stat_scope scope, size_t index)
{
    switch (scope) {
    case EM_STAT_SERVER:
        return &m->server.base;
    case EM_STAT_METHOD:
        return &m->methods[index].base;
    case EM_STAT_TABLE:
        return &m->tables[index].base;
    case EM_STAT_POOL:
        return &m->pools[index].base;
    }
    return NULL;
}

/* Sets a scalar field of message from value, converting to the field's type; false
 * when the types do not fit together. */
static bool set_field(ProtobufCMessage *message, const ProtobufCFieldDescriptor *field,
                      em_stat_value value)
{
    void *at = (char *)message + field->offset;
    switch (field->type) {
    case PROTOBUF_C_TYPE_UINT64:
        *(uint64_t *)at = value.type == EM_STAT_VALUE_U64 ? value.u64 : (uint64_t)value.f64;
        return value.type != EM_STAT_VALUE_TEXT;
    case PROTOBUF_C_TYPE_UINT32:
        *(uint32_t *)at = (uint32_t)value.u64;
        return value.type == EM_STAT_VALUE_U64 && value.u64 <= UINT32_MAX;
    case PROTOBUF_C_TYPE_DOUBLE:
        *(double *)at = value.type == EM_STAT_VALUE_DOUBLE ? value.f64 : (double)value.u64;
        return value.type != EM_STAT_VALUE_TEXT;
    case PROTOBUF_C_TYPE_STRING:
        *(const char **)at = value.text;
        return value.type == EM_STAT_VALUE_TEXT;
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_FLOAT:
    case PROTOBUF_C_TYPE_BOOL:
    case PROTOBUF_C_TYPE_ENUM:
    case PROTOBUF_C_TYPE_BYTES:
    case PROTOBUF_C_TYPE_MESSAGE:
        break;
    }
    return false;
}

static void render_stat(void *context, const em_stat *stat, size_t index, const char *label,
                        em_stat_value value)
{
    (void)label;
    stats_message *m = context;
    ProtobufCMessage *message = stats_target(m, stat->scope, index);
    const ProtobufCFieldDescriptor *field =
        protobuf_c_message_descriptor_get_field_by_name(message->descriptor, stat->name);
    if (field == NULL || field->label == PROTOBUF_C_LABEL_REPEATED ||
        !set_field(message, field, value))
        m->missing = stat->name;
}

/* The numbers outside the schema's scalars: each method's answers by status and its
 * duration histogram (the buckets /metrics exposes, not cumulative here). */
static void render_method_histograms(const em_stats_snapshot *snapshot, stats_message *m)
{
    for (size_t b = 0; b < EM_DURATION_BUCKETS; b++)
        m->duration_bounds[b] = (double)em_duration_bounds_ns[b] / 1e9;
    m->server.n_duration_bounds_seconds = EM_DURATION_BUCKETS;
    m->server.duration_bounds_seconds = m->duration_bounds;
    for (size_t i = 0; i < snapshot->method_count; i++) {
        const em_method_snapshot *method = &snapshot->methods[i];
        Ember__MethodStats *out = &m->methods[i];
        for (size_t s = 0; s < EM_STATUS_COUNT; s++) {
            if (method->answers[s] == 0)
                continue;
            Ember__StatusCount *answer = &m->answers[i][out->n_answers];
            ember__status_count__init(answer);
            answer->status = (Ember__Status)s;
            answer->count = method->answers[s];
            m->answer_pointers[i][out->n_answers++] = answer;
        }
        out->answers = m->answer_pointers[i];
        memcpy(m->duration_buckets[i], method->duration_buckets,
               sizeof(m->duration_buckets[i]));
        out->n_duration_buckets = EM_DURATION_BUCKETS + 1;
        out->duration_buckets = m->duration_buckets[i];
        out->duration_sum_seconds = (double)method->duration_sum_ns / 1e9;
    }
}

static void free_stats_message(stats_message *m);

/* The STATS answer for snapshot, in a message of its own (free_stats_message), or NULL
 * with err set. */
static stats_message *render_stats(const em_stats_snapshot *snapshot, em_error *err)
{
    stats_message *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        em_error_set(err, EM_RESOURCE_EXHAUSTED, "stats: out of memory");
        return NULL;
    }
    ember__stats_response__init(&m->response);
    ember__server_stats__init(&m->server);
    m->tables = calloc(snapshot->table_count + 1, sizeof(*m->tables));
    m->table_pointers = calloc(snapshot->table_count + 1, sizeof(*m->table_pointers));
    m->pools = calloc(snapshot->pool_count + 1, sizeof(*m->pools));
    m->pool_pointers = calloc(snapshot->pool_count + 1, sizeof(*m->pool_pointers));
    if (!m->tables || !m->table_pointers || !m->pools || !m->pool_pointers) {
        em_error_set(err, EM_RESOURCE_EXHAUSTED, "stats: out of memory");
        free_stats_message(m);
        return NULL;
    }
    for (size_t i = 0; i < snapshot->method_count; i++) {
        ember__method_stats__init(&m->methods[i]);
        m->methods[i].method = (char *)snapshot->methods[i].name;
        m->method_pointers[i] = &m->methods[i];
    }
    for (size_t i = 0; i < snapshot->table_count; i++) {
        ember__table_stats__init(&m->tables[i]);
        m->tables[i].name = (char *)snapshot->tables[i].name;
        m->table_pointers[i] = &m->tables[i];
    }
    for (size_t i = 0; i < snapshot->pool_count; i++) {
        ember__pool_stats__init(&m->pools[i]);
        m->pools[i].device = (char *)snapshot->pools[i].device;
        m->pool_pointers[i] = &m->pools[i];
    }
    em_stats_visit(snapshot, render_stat, m);
    if (m->missing != NULL) {
        em_error_set(err, EM_INTERNAL, "stat '%s' has no field in the STATS answer", m->missing);
        free_stats_message(m);
        return NULL;
    }
    render_method_histograms(snapshot, m);
    m->server.n_methods = snapshot->method_count;
    m->server.methods = m->method_pointers;
    m->response.server = &m->server;
    m->response.n_tables = snapshot->table_count;
    m->response.tables = m->table_pointers;
    m->response.n_pools = snapshot->pool_count;
    m->response.pools = m->pool_pointers;
    return m;
}

static void free_stats_message(stats_message *m)
{
    if (m == NULL)
        return;
    free(m->tables);
    free(m->table_pointers);
    free(m->pools);
    free(m->pool_pointers);
    free(m);
}

em_status em_stats_render_response(const em_stats_snapshot *snapshot, uint8_t **out,
                                   size_t *length, em_error *err)
{
    stats_message *message = render_stats(snapshot, err);
    if (message == NULL)
        return err->status;
    em_status status = EM_OK;
    *length = protobuf_c_message_get_packed_size(&message->response.base);
    *out = malloc(*length + 1);
    if (*out == NULL)
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "stats: out of memory");
    else
        protobuf_c_message_pack(&message->response.base, *out);
    free_stats_message(message);
    return status;
}

em_status em_handle_stats(em_request *request, em_error *err)
{
    const Ember__StatsRequest *body = (const Ember__StatsRequest *)request->body;
    em_server_context *context = request->context;
    em_stats_snapshot snapshot;
    em_status status = em_server_collect_stats(context, body->table, &snapshot, err);
    if (status != EM_OK)
        return status;
    stats_message *message = render_stats(&snapshot, err);
    if (message == NULL)
        status = err->status;
    else
        status = em_request_respond(request, &message->response.base, NULL, 0, err);
    free_stats_message(message);
    em_stats_snapshot_free(&snapshot);
    return status;
}
