#include "daemon/dispatch.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef enum method_access {
    ACCESS_OPEN,  /* anyone (ping, health) */
    ACCESS_DATA,  /* the data token, when one is configured */
    ACCESS_ADMIN, /* the admin listener and the admin token */
} method_access;

typedef struct method_info {
    Ember__Method method;
    const ProtobufCMessageDescriptor *body;
    method_access access;
    bool write;   /* orders as a write (see connection.h) */
    bool on_loop; /* cheap and lock-free: answered on the loop thread */
    em_status (*handler)(em_request *request, em_error *err);
} method_info;

static const method_info methods[] = {
    {EMBER__METHOD__PULL, &ember__pull_request__descriptor, ACCESS_DATA, false, false,
     em_handle_pull},
    {EMBER__METHOD__PUSH, &ember__push_request__descriptor, ACCESS_DATA, true, false,
     em_handle_push},
    {EMBER__METHOD__PING, &ember__ping_request__descriptor, ACCESS_OPEN, false, true,
     em_handle_ping},
    {EMBER__METHOD__HEALTH, &ember__health_request__descriptor, ACCESS_OPEN, false, true,
     em_handle_health},
    {EMBER__METHOD__CREATE_TABLE, &ember__create_table_request__descriptor, ACCESS_ADMIN, true,
     false, em_handle_create_table},
    {EMBER__METHOD__DROP_TABLE, &ember__drop_table_request__descriptor, ACCESS_ADMIN, true, false,
     em_handle_drop_table},
    {EMBER__METHOD__LIST_TABLES, &ember__list_tables_request__descriptor, ACCESS_ADMIN, false,
     false, em_handle_list_tables},
    {EMBER__METHOD__STATS, &ember__stats_request__descriptor, ACCESS_ADMIN, false, false,
     em_handle_stats},
};

#define METHOD_COUNT (sizeof(methods) / sizeof(methods[0]))
_Static_assert(METHOD_COUNT <= EM_METHOD_SLOTS, "EM_METHOD_SLOTS too small for the method table");

size_t em_dispatch_method_count(void)
{
    return METHOD_COUNT;
}

const char *em_dispatch_method_name(size_t slot)
{
    return slot < METHOD_COUNT ? em_method_name(methods[slot].method) : "UNKNOWN_METHOD";
}

uint64_t em_monotonic_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u;
}

static int method_slot(int method)
{
    for (size_t i = 0; i < METHOD_COUNT; i++)
        if ((int)methods[i].method == method)
            return (int)i;
    return -1;
}

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

em_status em_request_respond(em_request *request, const ProtobufCMessage *body, void *attachment,
                             size_t attachment_length, em_error *err)
{
    em_status status = pack_response(request, EM_OK, NULL, body, attachment_length, err);
    if (status != EM_OK) {
        free(attachment);
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
    free(request->response_attachment);
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
    free(request->message);
    free(request->attachment);
    free(request->response_frame);
    free(request->response_attachment);
    free(request);
}

static void count_response(em_request *request)
{
    em_server_stats *stats = &request->context->stats;
    if (request->slot < 0)
        return;
    atomic_fetch_add_explicit(&stats->requests[request->slot], 1, memory_order_relaxed);
    if (request->error.status != EM_OK)
        atomic_fetch_add_explicit(&stats->errors[request->slot], 1, memory_order_relaxed);
}

/* Writes the answer (if the connection can still take it) and retires the request. */
static void deliver(em_request *request)
{
    em_connection *connection = request->connection;
    if (request->error.status != EM_OK)
        pack_error(request);
    count_response(request);
    if (request->response_frame == NULL) {
        em_connection_fail(connection, request->correlation_id, request->method, EM_INTERNAL,
                           "the response could not be encoded");
    } else if (em_connection_writable(connection)) {
        em_connection_send(connection, request->response_frame, request->response_frame_length,
                           request->response_attachment, request->response_attachment_length,
                           request->charged);
        request->response_frame = NULL;
        request->response_attachment = NULL;
        request->charged = 0;
    }
    if (request->charged > 0)
        connection->inflight_bytes -= request->charged;
    free_request(request);
    em_connection_request_finished(connection);
}

/* ---- running on workers, in the connection's order ---------------------------------- */

static void pump(em_connection *connection);

static void run_job(em_job *job)
{
    em_request *request = (em_request *)job;
    uint64_t now = em_monotonic_ms();
    if (request->deadline_ms != 0 && now > request->deadline_ms) {
        em_error_set(&request->error, EM_DEADLINE_EXCEEDED,
                     "%s waited %" PRIu64 " ms before it could run; its deadline was %" PRIu64
                     " ms",
                     em_method_name(request->method), now - request->received_ms,
                     request->deadline_ms - request->received_ms);
        return;
    }
    em_error_clear(&request->error);
    request->handler(request, &request->error);
}

static void job_done(em_job *job)
{
    em_request *request = (em_request *)job;
    em_connection *connection = request->connection;
    if (request->write)
        connection->running_write = false;
    else
        connection->running_reads--;
    em_connection_ref(connection); /* deliver may drop the last reference */
    deliver(request);
    pump(connection);
    em_connection_unref(connection);
}

static bool can_start(const em_connection *connection, const em_request *request)
{
    if (request->write)
        return connection->running_reads == 0 && !connection->running_write;
    return !connection->running_write;
}

static void pump(em_connection *connection)
{
    while (connection->queue_head != NULL && can_start(connection, connection->queue_head)) {
        em_request *request = connection->queue_head;
        connection->queue_head = request->next;
        if (connection->queue_head == NULL)
            connection->queue_tail = NULL;
        if (request->write)
            connection->running_write = true;
        else
            connection->running_reads++;
        em_executor_submit(request->context->executor, &request->job);
    }
}

static void enqueue(em_connection *connection, em_request *request)
{
    request->next = NULL;
    if (connection->queue_tail != NULL)
        connection->queue_tail->next = request;
    else
        connection->queue_head = request;
    connection->queue_tail = request;
    pump(connection);
}

void em_dispatch_abandon_queue(em_connection *connection)
{
    em_request *request = connection->queue_head;
    connection->queue_head = NULL;
    connection->queue_tail = NULL;
    while (request != NULL) {
        em_request *next = request->next;
        connection->inflight_bytes -= request->charged;
        free_request(request);
        em_connection_request_finished(connection);
        request = next;
    }
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

static em_status authorize(const method_info *info, const Ember__RpcMeta *meta,
                           const em_connection *connection, const em_dispatch_settings *settings,
                           em_error *err)
{
    const char *name = em_method_name(info->method);
    const ProtobufCBinaryData *token = &meta->auth_token;
    if (info->access == ACCESS_OPEN)
        return EM_OK;
    if (info->access == ACCESS_ADMIN) {
        if (!connection->admin)
            return em_error_set(err, EM_PERMISSION_DENIED,
                                "%s is an admin method; send it to the admin listener (%s)", name,
                                settings->admin_address);
        if (token->len == 0)
            return em_error_set(err, EM_UNAUTHENTICATED, "%s needs the admin token; none was sent",
                                name);
        if (!token_matches(&settings->admin_token, token))
            return em_error_set(err, EM_UNAUTHENTICATED,
                                "the token sent with %s is not the admin token", name);
        return EM_OK;
    }
    if (!settings->data_token.set)
        return EM_OK;
    if (token->len == 0)
        return em_error_set(err, EM_UNAUTHENTICATED, "%s needs the data token; none was sent",
                            name);
    if (!token_matches(&settings->data_token, token) &&
        !(connection->admin && token_matches(&settings->admin_token, token)))
        return em_error_set(err, EM_UNAUTHENTICATED, "the token sent with %s is not the data token",
                            name);
    return EM_OK;
}

/* ---- decoding ------------------------------------------------------------------------ */

static em_request *new_request(em_connection *connection, const em_dispatch_settings *settings,
                               uint8_t *message, uint8_t *attachment, uint64_t attachment_length,
                               uint64_t charged)
{
    em_request *request = calloc(1, sizeof(*request));
    if (request == NULL)
        return NULL;
    request->job.run = run_job;
    request->job.done = job_done;
    request->connection = connection;
    request->context = settings->context;
    request->slot = -1;
    request->message = message;
    request->attachment = attachment;
    request->attachment_length = attachment_length;
    request->charged = charged;
    request->received_ms = em_monotonic_ms();
    request->max_keys_per_request = settings->max_keys_per_request;
    request->max_response_bytes = settings->max_response_bytes;
    return request;
}

static void reject_frame(em_connection *connection, uint8_t *message, uint8_t *attachment,
                         uint64_t charged, uint64_t correlation_id, int method, em_status status,
                         const char *text)
{
    free(message);
    free(attachment);
    connection->inflight_bytes -= charged;
    em_server_stats *stats = &em_server_settings(connection->server)->context->stats;
    atomic_fetch_add_explicit(&stats->frames_rejected, 1, memory_order_relaxed);
    em_connection_fail(connection, correlation_id, method, status, text);
}

/* Decodes the body of a request whose meta decoded; false when it does not decode. */
static bool decode_body(em_request *request, const method_info *info, const em_frame_header *frame)
{
    const uint8_t *bytes = request->message + frame->meta_len;
    request->body = protobuf_c_message_unpack(info->body, NULL, (size_t)frame->body_len, bytes);
    return request->body != NULL;
}

static void answer_now(em_request *request, em_connection *connection)
{
    em_connection_ref(connection);
    connection->outstanding++;
    deliver(request);
}

void em_dispatch_frame(em_connection *connection, const em_frame_header *frame, uint8_t *message,
                       uint8_t *attachment, uint64_t charged)
{
    const em_dispatch_settings *settings = em_server_settings(connection->server);
    Ember__RpcMeta *meta = ember__rpc_meta__unpack(NULL, frame->meta_len, message);
    if (meta == NULL) {
        reject_frame(connection, message, attachment, charged, 0, 0, EM_INVALID_ARGUMENT,
                     "the frame's RpcMeta could not be decoded");
        return;
    }
    uint64_t correlation_id = meta->correlation_id;
    int method = (int)meta->method;
    int slot = method_slot(method);
    em_request *request = new_request(connection, settings, message, attachment,
                                      frame->attach_len, charged);
    if (request == NULL) {
        ember__rpc_meta__free_unpacked(meta, NULL);
        reject_frame(connection, message, attachment, charged, correlation_id, method,
                     EM_RESOURCE_EXHAUSTED, "out of memory for the request");
        return;
    }
    request->correlation_id = correlation_id;
    request->method = method;
    request->slot = slot;
    if (slot < 0) {
        em_error_set(&request->error, EM_UNIMPLEMENTED, "method %d is not served by this server",
                     method);
        ember__rpc_meta__free_unpacked(meta, NULL);
        answer_now(request, connection);
        return;
    }
    const method_info *info = &methods[slot];
    request->write = info->write;
    request->handler = info->handler;
    if (meta->deadline_ms > 0)
        request->deadline_ms = request->received_ms + meta->deadline_ms;
    em_status status = authorize(info, meta, connection, settings, &request->error);
    ember__rpc_meta__free_unpacked(meta, NULL);
    if (!decode_body(request, info, frame)) {
        char text[128];
        snprintf(text, sizeof(text), "the %s body (%" PRIu64 " bytes) could not be decoded",
                 em_method_name(method), frame->body_len);
        request->message = NULL;
        request->attachment = NULL;
        request->charged = 0;
        free_request(request);
        reject_frame(connection, message, attachment, charged, correlation_id, method,
                     EM_INVALID_ARGUMENT, text);
        return;
    }
    if (status != EM_OK || info->on_loop) {
        if (status == EM_OK)
            request->handler(request, &request->error);
        answer_now(request, connection);
        return;
    }
    em_connection_ref(connection);
    connection->outstanding++;
    enqueue(connection, request);
}
