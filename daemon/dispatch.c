#include "daemon/dispatch.h"

#include "lib/base/failpoint.h"
#include "lib/base/zeroed.h"

#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The request a queue link (job or work) is embedded in. */
#define REQUEST_OF(pointer, member)                                                            \
    ((em_request *)((char *)(pointer) - offsetof(em_request, member)))

/* ---- responses ----------------------------------------------------------------------- */

static em_status pack_response(em_request *request, em_status status, const char *error,
                               const ProtobufCMessage *body, uint64_t attachment_length,
                               em_error *err)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = request->correlation_id;
    meta.method = (Ember__Method)request->method;
    meta.status = (Ember__Status)status;
    meta.error = (char *)(error != NULL ? error : "");
    return em_frame_pack(&meta, status == EM_OK ? body : NULL, attachment_length,
                         &request->response_frame, &request->response_frame_length, err);
}

/* Where request and answer attachments come from: the backend's host buffers. */
static em_host_buffers *buffers_of(const em_request *request)
{
    return request->context != NULL && request->context->backend != NULL
               ? request->context->backend->host_buffers
               : NULL;
}

em_status em_request_respond(em_request *request, const ProtobufCMessage *body, void *attachment,
                             size_t attachment_length, em_error *err)
{
    if (request->info == NULL || body->descriptor != request->info->response) {
        em_host_buffer_free(buffers_of(request), attachment);
        return em_error_set(err, EM_INTERNAL, "%s answered with a %s message",
                            em_method_name(request->method), body->descriptor->name);
    }
    em_status status = pack_response(request, EM_OK, NULL, body, attachment_length, err);
    if (status != EM_OK) {
        em_host_buffer_free(buffers_of(request), attachment);
        return status;
    }
    request->response_attachment = attachment;
    request->response_attachment_length = attachment_length;
    return EM_OK;
}

/* Turns request->error into the response frame (replacing any partial success). */
static void pack_error(em_request *request)
{
    free(request->response_frame);
    em_host_buffer_free(buffers_of(request), request->response_attachment);
    request->response_frame = NULL;
    request->response_attachment = NULL;
    request->response_attachment_length = 0;
    em_error ignored;
    if (pack_response(request, request->error.status, request->error.message, NULL, 0,
                      &ignored) != EM_OK)
        request->response_frame = NULL; /* nothing can be said; the connection will close */
}

static void free_request(em_request *request)
{
    if (request->body != NULL)
        protobuf_c_message_free_unpacked(request->body, NULL);
    em_host_buffer_free(buffers_of(request), request->attachment);
    free(request->response_frame);
    em_host_buffer_free(buffers_of(request), request->response_attachment);
    free(request);
}

/* A slow request's entry in the slow log (daemon/slowlog.h). */
static void record_slow(em_request *request, uint64_t duration_ns)
{
    em_slow_request entry = {0};
    entry.unix_ms = (uint64_t)time(NULL) * 1000u;
    entry.duration_us = duration_ns / 1000u;
    if (request->started_ns != 0) {
        entry.queue_us = (request->started_ns - request->received_ns) / 1000u;
        entry.run_us = (request->finished_ns - request->started_ns) / 1000u;
    } else {
        entry.run_us = entry.duration_us;
    }
    entry.bytes = request->attachment_length + request->response_attachment_length;
    snprintf(entry.method, sizeof(entry.method), "%s", request->info->name);
    snprintf(entry.status, sizeof(entry.status), "%s", em_status_name(request->error.status));
    snprintf(entry.peer, sizeof(entry.peer), "%s", em_connection_peer(request->connection));
    if (request->body != NULL && request->method == EMBER__METHOD__PULL) {
        const Ember__PullRequest *pull = (const Ember__PullRequest *)request->body;
        snprintf(entry.table, sizeof(entry.table), "%s", pull->table);
        entry.keys = pull->nnz;
    } else if (request->body != NULL && request->method == EMBER__METHOD__PUSH) {
        const Ember__PushRequest *push = (const Ember__PushRequest *)request->body;
        snprintf(entry.table, sizeof(entry.table), "%s", push->table);
        entry.keys = push->nnz;
    }
    em_slowlog_record(&request->context->slowlog, &entry);
}

static void count_response(em_request *request)
{
    if (request->info == NULL)
        return;
    em_server_context *context = request->context;
    uint64_t threshold_us = atomic_load_explicit(&context->slowlog_threshold_us,
                                                 memory_order_relaxed);
    bool timed = context->request_details || threshold_us > 0;
    uint64_t duration_ns = timed ? uv_hrtime() - request->received_ns : 0;
    em_stats_record_response(&context->stats, (size_t)(request->info - em_methods),
                             request->error.status, duration_ns, context->request_details);
    if (threshold_us > 0 && duration_ns >= threshold_us * 1000u)
        record_slow(request, duration_ns);
    if (request->error.status != EM_OK) /* the request id: peer and correlation id */
        em_log_debug(context->log, "request %s#%" PRIu64 " %s answered %s: %s",
                     em_connection_peer(request->connection), request->correlation_id,
                     request->info->name, em_status_name(request->error.status),
                     request->error.message);
}

/* Writes the answer (if the connection can still take it) and retires the request. */
static void send_answer(em_request *request)
{
    em_connection *connection = request->connection;
    if (request->response_frame == NULL) {
        em_connection_fail(connection, request->correlation_id, request->method, EM_INTERNAL,
                           "the response could not be encoded");
    } else if (em_connection_writable(connection)) {
        em_connection_send(connection, request->response_frame, request->response_frame_length,
                           request->response_attachment, request->response_attachment_length,
                           request->work.charged);
        request->response_frame = NULL;
        request->response_attachment = NULL;
        request->work.charged = 0;
    }
    if (request->work.charged > 0)
        em_connection_release(connection, request->work.charged);
    free_request(request);
    em_connection_request_finished(connection);
}

/* Fault (reverse_answers): answers held back, most recent first. */
static uint32_t held_count(em_connection *connection)
{
    uint32_t count = 0;
    for (em_request *r = *em_connection_dispatch_slot(connection); r != NULL; r = r->held_next)
        count++;
    return count;
}

static void send_held(em_connection *connection)
{
    void **slot = em_connection_dispatch_slot(connection);
    em_request *request = *slot;
    *slot = NULL;
    while (request != NULL) {
        em_request *next = request->held_next;
        send_answer(request);
        request = next;
    }
}

/* Holds an answer while others of the connection are still to come. */
static bool hold_answer(em_request *request)
{
    em_connection *connection = request->connection;
    if (!atomic_load_explicit(&request->context->faults.reverse_answers, memory_order_relaxed))
        return false;
    uint32_t held = held_count(connection);
    if (held + 1 >= em_connection_outstanding(connection) || held + 1 >= EM_FAULT_REVERSE_MAX ||
        !em_connection_writable(connection))
        return false;
    void **slot = em_connection_dispatch_slot(connection);
    request->held_next = *slot;
    *slot = request;
    return true;
}

static void deliver(em_request *request)
{
    em_connection *connection = request->connection;
    if (request->error.status != EM_OK)
        pack_error(request);
    count_response(request);
    if (hold_answer(request))
        return;
    em_connection_ref(connection);
    send_answer(request);
    send_held(connection);
    em_connection_unref(connection);
}

/* ---- running on workers, in the connection's order ---------------------------------- */

static void run_job(em_job *job)
{
    em_request *request = REQUEST_OF(job, job);
    uint64_t stall_ms = 0;
    if (em_failpoint_hit(EM_FAILPOINT_WORKER_STALL, &stall_ms))
        usleep((useconds_t)(stall_ms * 1000u));
    uint64_t now = em_monotonic_ms();
    if (request->deadline_ms != 0 && now > request->deadline_ms) {
        em_error_set(&request->error, EM_DEADLINE_EXCEEDED,
                     "%s waited %" PRIu64 " ms before it could run; its deadline was %" PRIu64
                     " ms",
                     em_method_name(request->method), now - request->received_ms,
                     request->deadline_ms - request->received_ms);
        return;
    }
    uint32_t delay = atomic_load_explicit(&request->context->faults.delay_ms, memory_order_relaxed);
    if (delay > 0 && request->info->access == EM_METHOD_ACCESS_DATA)
        usleep(delay * 1000u);
    em_error_clear(&request->error);
    request->started_ns = uv_hrtime();
    request->info->handler(request, &request->error);
    request->finished_ns = uv_hrtime();
}

static void job_done(em_job *job)
{
    em_request *request = REQUEST_OF(job, job);
    em_connection *connection = request->connection;
    bool write = request->work.write;
    em_connection_ref(connection); /* deliver may drop the last reference */
    deliver(request);
    em_connection_work_done(connection, write);
    em_connection_unref(connection);
}

static void start_work(em_connection_work *work)
{
    em_request *request = REQUEST_OF(work, work);
    em_executor_submit(request->context->executor, &request->job);
}

static void abandon_work(em_connection_work *work)
{
    em_request *request = REQUEST_OF(work, work);
    em_connection *connection = request->connection;
    free_request(request);
    send_held(connection); /* the connection is closed: held answers are only freed */
}

/* ---- authorisation ------------------------------------------------------------------- */

static bool token_matches(const em_token *expected, const ProtobufCBinaryData *given)
{
    size_t length = strlen(expected->value);
    if (given->len != length)
        return false;
    unsigned char difference = 0;
    for (size_t i = 0; i < length; i++)
        difference |= (unsigned char)(expected->value[i] ^ given->data[i]);
    return difference == 0;
}

static em_status authorize_admin(const em_method_info *info, const ProtobufCBinaryData *token,
                                 const em_connection *connection,
                                 const em_dispatch_settings *settings, em_error *err)
{
    if (!em_connection_is_admin(connection))
        return em_error_set(err, EM_PERMISSION_DENIED,
                            "%s is an admin method; send it to the admin listener (%s)",
                            info->name, settings->admin_address);
    if (token->len == 0)
        return em_error_set(err, EM_UNAUTHENTICATED, "%s needs the admin token; none was sent",
                            info->name);
    if (!token_matches(&settings->admin_token, token))
        return em_error_set(err, EM_UNAUTHENTICATED,
                            "the token sent with %s is not the admin token", info->name);
    return EM_OK;
}

static em_status authorize_data(const em_method_info *info, const ProtobufCBinaryData *token,
                                const em_connection *connection,
                                const em_dispatch_settings *settings, em_error *err)
{
    if (!settings->data_token.set)
        return EM_OK;
    if (token->len == 0)
        return em_error_set(err, EM_UNAUTHENTICATED, "%s needs the data token; none was sent",
                            info->name);
    if (!token_matches(&settings->data_token, token) &&
        !(em_connection_is_admin(connection) && token_matches(&settings->admin_token, token)))
        return em_error_set(err, EM_UNAUTHENTICATED, "the token sent with %s is not the data token",
                            info->name);
    return EM_OK;
}

static em_status authorize(const em_method_info *info, const Ember__RpcMeta *meta,
                           const em_connection *connection, const em_dispatch_settings *settings,
                           em_error *err)
{
    if (info->listener == EM_METHOD_LISTENER_ADMIN && !em_connection_is_admin(connection))
        return em_error_set(err, EM_PERMISSION_DENIED,
                            "%s is an admin method; send it to the admin listener (%s)",
                            info->name, settings->admin_address);
    switch (info->access) {
    case EM_METHOD_ACCESS_OPEN:
        return EM_OK;
    case EM_METHOD_ACCESS_DATA:
        return authorize_data(info, &meta->auth_token, connection, settings, err);
    case EM_METHOD_ACCESS_ADMIN:
        return authorize_admin(info, &meta->auth_token, connection, settings, err);
    }
    return em_error_set(err, EM_INTERNAL, "%s has no access rule", info->name);
}

/* ---- decoding, stage by stage ------------------------------------------------------- */

/* What a request holds besides its frame: the request itself and its decoded meta. */
#define REQUEST_OVERHEAD_BYTES 1024u

/* The most a method without a CSR payload answers with (tables, stats). */
#define SMALL_ANSWER_BYTES (256u * 1024u)

static em_request *new_request(em_connection *connection, const em_dispatch_settings *settings,
                               const em_frame_header *frame)
{
    em_request *request = em_zeroed(1, sizeof(*request));
    if (request == NULL)
        return NULL;
    request->job.run = run_job;
    request->job.done = job_done;
    request->work.start = start_work;
    request->work.abandon = abandon_work;
    request->connection = connection;
    request->context = settings->context;
    request->attachment_length = frame->attach_len;
    request->received_ms = em_monotonic_ms();
    request->received_ns = uv_hrtime();
    request->max_keys_per_request = settings->max_keys_per_request;
    request->max_response_bytes = settings->max_response_bytes;
    return request;
}

/* A framing error: one error answer, then the connection closes. */
static void reject_frame(const em_dispatch_settings *settings, em_connection *connection,
                         uint64_t correlation_id, int method, em_status status, const char *text)
{
    atomic_fetch_add_explicit(&settings->context->stats.frames_rejected, 1, memory_order_relaxed);
    em_connection_fail(connection, correlation_id, method, status, text);
}

static void answer_now(em_request *request, em_connection *connection)
{
    em_connection_request_received(connection);
    deliver(request);
}

/* Fault (close_after): true when this request's connection is to be closed instead. */
static bool close_instead(const em_dispatch_settings *settings)
{
    _Atomic uint32_t *left = &settings->context->faults.close_after;
    uint32_t value = atomic_load(left);
    while (value > 0 && !atomic_compare_exchange_weak(left, &value, value - 1))
        ;
    return value == 1;
}

/* Settles a deadline sent in the meta: milliseconds from now, clamped so that a huge
 * value means "no deadline" rather than wrapping around. */
static uint64_t deadline_from(uint64_t received_ms, uint64_t deadline_ms)
{
    if (deadline_ms == 0)
        return 0;
    if (deadline_ms > UINT64_MAX - received_ms)
        return 0;
    return received_ms + deadline_ms;
}

/* Refuses a request that could never fit the server's memory budget. */
static em_status check_memory(const em_dispatch_settings *settings, const em_request *request,
                              uint64_t bytes, const char *what, em_error *err)
{
    uint64_t limit = settings->memory->limit;
    if (limit == 0 || bytes <= limit || em_connection_is_admin(request->connection))
        return EM_OK;
    atomic_fetch_add_explicit(&settings->context->stats.requests_refused_memory, 1,
                              memory_order_relaxed);
    return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                        "%s needs %" PRIu64 " bytes (%s), more than limits.memory_bytes %" PRIu64,
                        request->info->name, bytes, what, limit);
}

/* A request the server does not take now: every one while it shuts down, data requests
 * while an operator has it drained. */
static em_status refuse_out_of_service(const em_dispatch_settings *settings,
                                       const em_method_info *info, em_error *err)
{
    atomic_fetch_add_explicit(&settings->context->stats.requests_refused_draining, 1,
                              memory_order_relaxed);
    return em_error_set(err, EM_UNAVAILABLE,
                        "the server is %s; send %s to another server or retry once it is back%s",
                        settings->draining ? "draining (shutting down)"
                                           : "drained for maintenance (DRAIN)",
                        info->name, settings->draining ? "" : " (UNDRAIN)");
}

/* Everything a frame is checked for before its body is read. */
static em_status admit_meta(const em_dispatch_settings *settings, em_request *request,
                            const Ember__RpcMeta *meta, const em_frame_header *frame,
                            em_error *err)
{
    const em_method_info *info = request->info;
    if (settings->draining ||
        (info->access == EM_METHOD_ACCESS_DATA && atomic_load(&settings->context->drained)))
        return refuse_out_of_service(settings, info, err);
    em_status status = authorize(info, meta, request->connection, settings, err);
    if (status != EM_OK)
        return status;
    if (info->payload == EM_METHOD_PAYLOAD_NONE && frame->attach_len > 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s carries no attachment; the frame announces %" PRIu64 " bytes",
                            info->name, frame->attach_len);
    uint64_t bytes = EM_FRAME_HEADER_BYTES + (uint64_t)frame->meta_len + frame->body_len * 2 +
                     frame->attach_len;
    return check_memory(settings, request, bytes, "its frame", err);
}

em_request *em_dispatch_meta(const em_dispatch_settings *settings, em_connection *connection,
                             const em_frame_header *frame, uint8_t *meta_bytes)
{
    if (close_instead(settings)) {
        free(meta_bytes);
        em_connection_close(connection);
        return NULL;
    }
    Ember__RpcMeta *meta = ember__rpc_meta__unpack(NULL, frame->meta_len, meta_bytes);
    free(meta_bytes);
    if (meta == NULL) {
        reject_frame(settings, connection, 0, 0, EM_INVALID_ARGUMENT,
                     "the frame's RpcMeta could not be decoded");
        return NULL;
    }
    uint64_t correlation_id = meta->correlation_id;
    int method = (int)meta->method;
    em_request *request = new_request(connection, settings, frame);
    if (request == NULL) {
        ember__rpc_meta__free_unpacked(meta, NULL);
        reject_frame(settings, connection, correlation_id, method, EM_RESOURCE_EXHAUSTED,
                     "out of memory for the request");
        return NULL;
    }
    request->correlation_id = correlation_id;
    request->method = method;
    request->info = em_method_find(method);
    em_status status = EM_OK;
    if (request->info == NULL) {
        status = em_error_set(&request->error, EM_UNIMPLEMENTED,
                              "method %d is not served by this server", method);
    } else {
        request->work.write = request->info->ordering == EM_METHOD_ORDERING_WRITE;
        request->deadline_ms = deadline_from(request->received_ms, meta->deadline_ms);
        status = admit_meta(settings, request, meta, frame, &request->error);
    }
    ember__rpc_meta__free_unpacked(meta, NULL);
    if (status != EM_OK) {
        answer_now(request, connection);
        return NULL;
    }
    return request;
}

bool em_dispatch_body(const em_dispatch_settings *settings, em_request *request,
                      const em_frame_header *frame, uint8_t *body, uint64_t *answer_bytes)
{
    em_connection *connection = request->connection;
    const em_method_info *info = request->info;
    request->body = protobuf_c_message_unpack(info->request, NULL, (size_t)frame->body_len, body);
    free(body);
    if (request->body == NULL) {
        char text[128];
        snprintf(text, sizeof(text), "the %s body (%" PRIu64 " bytes) could not be decoded",
                 info->name, frame->body_len);
        uint64_t correlation_id = request->correlation_id;
        int method = request->method;
        free_request(request);
        reject_frame(settings, connection, correlation_id, method, EM_INVALID_ARGUMENT, text);
        return false;
    }
    uint64_t answer = SMALL_ANSWER_BYTES;
    em_status status = EM_OK;
    if (info->admit != NULL)
        status = info->admit(request, frame->attach_len, &answer, &request->error);
    if (status == EM_OK) {
        answer += REQUEST_OVERHEAD_BYTES;
        status = check_memory(settings, request, frame->attach_len + answer,
                              "its attachment and the most its answer can hold",
                              &request->error);
    }
    if (status != EM_OK) {
        answer_now(request, connection);
        return false;
    }
    *answer_bytes = answer;
    return true;
}

void em_dispatch_frame(const em_dispatch_settings *settings, em_connection *connection,
                       em_request *request, uint8_t *attachment, uint64_t charged)
{
    (void)settings;
    request->attachment = attachment;
    request->work.charged = charged;
    const em_method_info *info = request->info;
    if (info->ordering == EM_METHOD_ORDERING_LOOP) {
        info->handler(request, &request->error);
        answer_now(request, connection);
        return;
    }
    em_connection_request_received(connection);
    em_connection_enqueue(connection, &request->work);
}

void em_dispatch_abandon(em_request *request)
{
    free_request(request);
}
