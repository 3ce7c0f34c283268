#include "daemon/server.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/address.h"
#include "daemon/connection.h"
#include "daemon/dispatch.h"

/* Pending connections the kernel may queue per listener. */
#define LISTEN_BACKLOG 511
/* Attachment buffers are aligned for any array the protocol carries (and SIMD). */
#define ATTACHMENT_ALIGNMENT 64u

enum { LISTENER_DATA = 0, LISTENER_ADMIN = 1, LISTENER_COUNT = 2 };

static const char *const listener_names[LISTENER_COUNT] = {"data", "admin"};

struct em_server {
    uv_loop_t *loop;
    em_server_context *context;
    em_dispatch_settings settings;
    em_frame_limits frame_limits;
    uint32_t max_connections;
    uint64_t inflight_budget;
    uint32_t idle_timeout_ms;

    uv_tcp_t listeners[LISTENER_COUNT];
    bool listener_open[LISTENER_COUNT];
    char configured[LISTENER_COUNT][EM_ADDRESS_MAX];
    char bound[LISTENER_COUNT][EM_ADDRESS_MAX];

    em_connection *connections;
    uint32_t connection_count;

    bool draining, drain_reported;
    uv_timer_t drain_timer;
    void (*drained)(em_server *server, bool forced, void *context);
    void *drained_context;

    uint32_t open_handles;
    void (*closed)(void *context);
    void *closed_context;
};

static void connection_advance(em_connection *connection);
static void close_connection(em_connection *connection);

const em_dispatch_settings *em_server_settings(const em_server *server)
{
    return &server->settings;
}

const char *em_server_state_name(int state)
{
    switch (state) {
    case EM_SERVER_STARTING:
        return "starting";
    case EM_SERVER_SERVING:
        return "serving";
    default:
        return "draining";
    }
}

uint64_t em_server_now_ms(const em_server *server)
{
    return uv_now(server->loop);
}

/* ---- configuration ------------------------------------------------------------------- */

static void apply_config(em_server *server, const em_daemon_config *config)
{
    const em_limits_config *limits = &config->limits;
    server->frame_limits = (em_frame_limits){
        .max_meta = limits->max_meta_bytes,
        .max_body = limits->max_body_bytes,
        .max_attachment = limits->max_attachment_bytes,
    };
    server->max_connections = limits->max_connections;
    server->inflight_budget = limits->connection_inflight_bytes;
    server->idle_timeout_ms = limits->idle_timeout_ms;
    server->settings.admin_token = config->admin_token;
    server->settings.data_token = config->data_token;
    server->settings.max_keys_per_request = limits->max_keys_per_request;
    server->settings.max_response_bytes = limits->max_response_bytes;
}

em_status em_server_create(uv_loop_t *loop, const em_daemon_config *config,
                           em_server_context *context, em_server **out, em_error *err)
{
    em_server *server = calloc(1, sizeof(*server));
    if (server == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "server: out of memory");
    server->loop = loop;
    server->context = context;
    server->settings.context = context;
    snprintf(server->configured[LISTENER_DATA], EM_ADDRESS_MAX, "%s", config->listen.data);
    snprintf(server->configured[LISTENER_ADMIN], EM_ADDRESS_MAX, "%s", config->listen.admin);
    snprintf(server->settings.admin_address, EM_ADDRESS_MAX, "%s", config->listen.admin);
    apply_config(server, config);
    uv_timer_init(loop, &server->drain_timer);
    server->drain_timer.data = server;
    server->open_handles = 1;
    *out = server;
    return EM_OK;
}

void em_server_reconfigure(em_server *server, const em_daemon_config *config)
{
    apply_config(server, config);
}

const char *em_server_data_address(const em_server *server)
{
    return server->bound[LISTENER_DATA];
}

const char *em_server_admin_address(const em_server *server)
{
    return server->bound[LISTENER_ADMIN];
}

/* ---- connection lifetime ------------------------------------------------------------- */

void em_connection_ref(em_connection *connection)
{
    connection->references++;
}

void em_connection_unref(em_connection *connection)
{
    if (--connection->references > 0)
        return;
    free(connection->read_buffer);
    free(connection);
}

bool em_connection_writable(const em_connection *connection)
{
    return !connection->handle_closed;
}

static void on_handle_closed(uv_handle_t *handle)
{
    em_connection_unref(handle->data);
}

static void unlink_connection(em_server *server, em_connection *connection)
{
    if (connection->previous != NULL)
        connection->previous->next = connection->next;
    else
        server->connections = connection->next;
    if (connection->next != NULL)
        connection->next->previous = connection->previous;
    server->connection_count--;
    atomic_fetch_sub(&server->context->stats.connections_current, 1);
}

/* Frees a frame that was being read when the connection went away. */
static void discard_partial_frame(em_connection *connection)
{
    if (connection->message != NULL || connection->attachment != NULL)
        connection->inflight_bytes -= EM_FRAME_HEADER_BYTES + connection->frame.meta_len +
                                      connection->frame.body_len + connection->frame.attach_len;
    free(connection->message);
    free(connection->attachment);
    connection->message = NULL;
    connection->attachment = NULL;
    connection->header_have = 0;
}

static void stop_reading(em_connection *connection)
{
    if (connection->reading) {
        uv_read_stop((uv_stream_t *)&connection->handle);
        connection->reading = false;
    }
}

static void check_drained(em_server *server);

static void close_connection(em_connection *connection)
{
    if (connection->handle_closed)
        return;
    em_server *server = connection->server;
    connection->handle_closed = true;
    connection->state = EM_CONNECTION_CLOSING;
    stop_reading(connection);
    discard_partial_frame(connection);
    em_dispatch_abandon_queue(connection);
    unlink_connection(server, connection);
    em_log_debug(server->context->log, "connection from %s closed", connection->peer);
    uv_timer_stop(&connection->idle_timer);
    uv_close((uv_handle_t *)&connection->idle_timer, on_handle_closed);
    uv_close((uv_handle_t *)&connection->handle, on_handle_closed);
    check_drained(server);
}

/* A CLOSING connection goes once every request is answered and every answer written. */
static void maybe_finish_closing(em_connection *connection)
{
    if (!connection->handle_closed && connection->state == EM_CONNECTION_CLOSING &&
        connection->outstanding == 0 && connection->writes_pending == 0)
        close_connection(connection);
}

void em_connection_request_finished(em_connection *connection)
{
    connection->outstanding--;
    maybe_finish_closing(connection);
    em_connection_unref(connection);
}

/* Stops reading frames; what was received is still answered. */
static void begin_closing(em_connection *connection)
{
    connection->state = EM_CONNECTION_CLOSING;
    stop_reading(connection);
    discard_partial_frame(connection);
    connection->read_start = connection->read_end = 0;
    maybe_finish_closing(connection);
}

/* ---- writing ------------------------------------------------------------------------- */

typedef struct pending_write {
    uv_write_t request;
    em_connection *connection;
    uint8_t *frame;
    void *attachment;
    uint64_t charged;
    size_t bytes;
} pending_write;

static void maybe_unblock(em_connection *connection);

static void on_write(uv_write_t *request, int status)
{
    pending_write *write = (pending_write *)request;
    em_connection *connection = write->connection;
    free(write->frame);
    free(write->attachment);
    connection->inflight_bytes -= write->charged;
    connection->writes_pending--;
    if (status == 0) {
        atomic_fetch_add(&connection->server->context->stats.bytes_out, write->bytes);
        maybe_unblock(connection);
        maybe_finish_closing(connection);
    } else if (!connection->handle_closed) {
        em_log_debug(connection->server->context->log, "write to %s failed: %s",
                     connection->peer, uv_strerror(status));
        close_connection(connection);
    }
    free(write);
    em_connection_unref(connection);
}

void em_connection_send(em_connection *connection, uint8_t *frame, size_t frame_length,
                        void *attachment, size_t attachment_length, uint64_t charged)
{
    pending_write *write = calloc(1, sizeof(*write));
    if (write == NULL || connection->handle_closed) {
        free(write);
        free(frame);
        free(attachment);
        connection->inflight_bytes -= charged;
        if (!connection->handle_closed)
            close_connection(connection);
        return;
    }
    size_t response_bytes = frame_length + attachment_length;
    *write = (pending_write){.connection = connection, .frame = frame, .attachment = attachment,
                             .charged = charged + response_bytes, .bytes = response_bytes};
    connection->inflight_bytes += response_bytes;
    uv_buf_t buffers[2] = {uv_buf_init((char *)frame, (unsigned)frame_length),
                           uv_buf_init((char *)attachment, (unsigned)attachment_length)};
    buffers[1].len = attachment_length; /* uv_buf_init takes 32 bits; the field holds size_t */
    em_connection_ref(connection);
    connection->writes_pending++;
    int rc = uv_write(&write->request, (uv_stream_t *)&connection->handle, buffers,
                      attachment_length > 0 ? 2 : 1, on_write);
    if (rc != 0)
        on_write(&write->request, rc); /* libuv does not call back a write it refused */
}

void em_connection_fail(em_connection *connection, uint64_t correlation_id, int method,
                        em_status status, const char *message)
{
    if (connection->handle_closed)
        return;
    em_log_info(connection->server->context->log, "closing connection from %s: %s: %s",
                connection->peer, em_status_name(status), message);
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = correlation_id;
    meta.method = (Ember__Method)method;
    meta.status = (Ember__Status)status;
    meta.error = (char *)message;
    uint8_t *frame = NULL;
    size_t length = 0;
    em_error ignored;
    /* The error frame is queued first, so closing waits for it to be written. */
    if (em_frame_pack(&meta, NULL, 0, &frame, &length, &ignored) == EM_OK)
        em_connection_send(connection, frame, length, NULL, 0, 0);
    begin_closing(connection);
}

/* ---- reading ------------------------------------------------------------------------- */

static void block(em_connection *connection)
{
    connection->state = EM_CONNECTION_BLOCKED;
    stop_reading(connection);
}

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buffer);
static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buffer);

static void start_reading(em_connection *connection)
{
    if (connection->reading || connection->handle_closed)
        return;
    if (uv_read_start((uv_stream_t *)&connection->handle, on_alloc, on_read) == 0)
        connection->reading = true;
    else
        close_connection(connection);
}

static void maybe_unblock(em_connection *connection)
{
    if (connection->state != EM_CONNECTION_BLOCKED ||
        connection->inflight_bytes >= connection->server->inflight_budget)
        return;
    connection->state = EM_CONNECTION_HEADER;
    connection_advance(connection);
    if (connection->state != EM_CONNECTION_BLOCKED && connection->state != EM_CONNECTION_CLOSING)
        start_reading(connection);
}

/* The frame buffer the next bytes belong to, when a large read can go straight there. */
static bool direct_target(em_connection *connection, uint8_t **target, size_t *room)
{
    if (connection->read_start != connection->read_end)
        return false;
    uint64_t remaining = 0;
    if (connection->state == EM_CONNECTION_MESSAGE) {
        remaining = connection->frame.meta_len + connection->frame.body_len -
                    connection->message_have;
        *target = connection->message + connection->message_have;
    } else if (connection->state == EM_CONNECTION_ATTACHMENT) {
        remaining = connection->frame.attach_len - connection->attachment_have;
        *target = connection->attachment + connection->attachment_have;
    }
    if (remaining < EM_READ_BUFFER_BYTES)
        return false;
    *room = remaining > (uint64_t)1 << 30 ? (size_t)1 << 30 : (size_t)remaining;
    return true;
}

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buffer)
{
    (void)suggested;
    em_connection *connection = handle->data;
    uint8_t *target = NULL;
    size_t room = 0;
    if (direct_target(connection, &target, &room)) {
        buffer->base = (char *)target;
        buffer->len = room;
        return;
    }
    if (connection->read_start == connection->read_end)
        connection->read_start = connection->read_end = 0;
    buffer->base = (char *)connection->read_buffer + connection->read_end;
    buffer->len = EM_READ_BUFFER_BYTES - connection->read_end;
}

static void on_peer_closed(em_connection *connection, ssize_t error)
{
    bool mid_frame = connection->header_have > 0 || connection->message != NULL;
    if (error != UV_EOF || mid_frame) {
        em_log_debug(connection->server->context->log, "connection from %s: %s%s",
                     connection->peer, error == UV_EOF ? "" : uv_strerror((int)error),
                     mid_frame ? "truncated frame" : "");
        close_connection(connection);
        return;
    }
    begin_closing(connection);
}

static void restart_idle_timer(em_connection *connection);

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buffer)
{
    em_connection *connection = stream->data;
    if (nread == 0)
        return;
    if (nread < 0) {
        on_peer_closed(connection, nread);
        return;
    }
    atomic_fetch_add(&connection->server->context->stats.bytes_in, (uint64_t)nread);
    restart_idle_timer(connection);
    uint8_t *in_buffer = connection->read_buffer + connection->read_end;
    if ((uint8_t *)buffer->base != in_buffer) {
        if (connection->state == EM_CONNECTION_MESSAGE)
            connection->message_have += (uint64_t)nread;
        else
            connection->attachment_have += (uint64_t)nread;
    } else {
        connection->read_end += (size_t)nread;
    }
    connection_advance(connection);
}

/* Copies up to wanted bytes from the read buffer to destination; returns how many. */
static size_t consume(em_connection *connection, uint8_t *destination, uint64_t wanted)
{
    size_t available = connection->read_end - connection->read_start;
    size_t take = wanted < available ? (size_t)wanted : available;
    memcpy(destination, connection->read_buffer + connection->read_start, take);
    connection->read_start += take;
    return take;
}

static em_status allocate_frame(em_connection *connection, em_error *err)
{
    const em_frame_header *frame = &connection->frame;
    size_t message_bytes = frame->meta_len + (size_t)frame->body_len;
    connection->message = malloc(message_bytes);
    if (frame->attach_len > 0) {
        size_t rounded = ((size_t)frame->attach_len + ATTACHMENT_ALIGNMENT - 1) /
                         ATTACHMENT_ALIGNMENT * ATTACHMENT_ALIGNMENT;
        connection->attachment = aligned_alloc(ATTACHMENT_ALIGNMENT, rounded);
    }
    if (connection->message == NULL || (frame->attach_len > 0 && connection->attachment == NULL))
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "out of memory for a frame of %zu + %" PRIu64 " bytes", message_bytes,
                            frame->attach_len);
    return EM_OK;
}

static void begin_frame(em_connection *connection)
{
    em_server *server = connection->server;
    em_error err;
    em_status status = em_frame_header_decode(connection->header, &server->frame_limits,
                                              &connection->frame, &err);
    if (status == EM_OK) {
        connection->inflight_bytes += EM_FRAME_HEADER_BYTES + connection->frame.meta_len +
                                      connection->frame.body_len + connection->frame.attach_len;
        status = allocate_frame(connection, &err);
    }
    if (status != EM_OK) {
        atomic_fetch_add(&server->context->stats.frames_rejected, 1);
        em_connection_fail(connection, 0, 0, status, err.message);
        return;
    }
    connection->message_have = 0;
    connection->attachment_have = 0;
    connection->state = EM_CONNECTION_MESSAGE;
}

static void complete_frame(em_connection *connection)
{
    uint64_t charged = EM_FRAME_HEADER_BYTES + connection->frame.meta_len +
                       connection->frame.body_len + connection->frame.attach_len;
    uint8_t *message = connection->message, *attachment = connection->attachment;
    em_frame_header frame = connection->frame;
    connection->message = NULL;
    connection->attachment = NULL;
    connection->header_have = 0;
    connection->state = EM_CONNECTION_HEADER;
    em_dispatch_frame(connection, &frame, message, attachment, charged);
    if (connection->state == EM_CONNECTION_HEADER &&
        connection->inflight_bytes >= connection->server->inflight_budget)
        block(connection);
}

/* The one function that moves a connection through its reading states. */
static void connection_advance(em_connection *connection)
{
    for (;;) {
        size_t available = connection->read_end - connection->read_start;
        const em_frame_header *frame = &connection->frame;
        switch (connection->state) {
        case EM_CONNECTION_HEADER:
            if (available == 0)
                return;
            connection->header_have += consume(connection,
                                               connection->header + connection->header_have,
                                               EM_FRAME_HEADER_BYTES - connection->header_have);
            if (connection->header_have == EM_FRAME_HEADER_BYTES)
                begin_frame(connection);
            break;
        case EM_CONNECTION_MESSAGE: {
            uint64_t size = frame->meta_len + frame->body_len;
            if (connection->message_have == size) {
                if (frame->attach_len == 0)
                    complete_frame(connection);
                else
                    connection->state = EM_CONNECTION_ATTACHMENT;
                break;
            }
            if (available == 0)
                return;
            connection->message_have += consume(connection,
                                                connection->message + connection->message_have,
                                                size - connection->message_have);
            break;
        }
        case EM_CONNECTION_ATTACHMENT:
            if (connection->attachment_have == frame->attach_len) {
                complete_frame(connection);
                break;
            }
            if (available == 0)
                return;
            connection->attachment_have += consume(
                connection, connection->attachment + connection->attachment_have,
                frame->attach_len - connection->attachment_have);
            break;
        case EM_CONNECTION_BLOCKED:
        case EM_CONNECTION_CLOSING:
            return;
        }
    }
}

/* ---- idle timeout -------------------------------------------------------------------- */

static void on_idle(uv_timer_t *timer)
{
    em_connection *connection = timer->data;
    if (connection->outstanding > 0 || connection->writes_pending > 0) {
        restart_idle_timer(connection);
        return;
    }
    em_log_debug(connection->server->context->log, "closing idle connection from %s",
                 connection->peer);
    close_connection(connection);
}

static void restart_idle_timer(em_connection *connection)
{
    uint32_t timeout = connection->server->idle_timeout_ms;
    if (timeout > 0 && !connection->handle_closed)
        uv_timer_start(&connection->idle_timer, on_idle, timeout, 0);
}

/* ---- accepting ----------------------------------------------------------------------- */

static void describe_peer(em_connection *connection)
{
    struct sockaddr_storage peer;
    int length = sizeof(peer);
    if (uv_tcp_getpeername(&connection->handle, (struct sockaddr *)&peer, &length) == 0)
        em_address_format((struct sockaddr *)&peer, connection->peer, sizeof(connection->peer));
    else
        snprintf(connection->peer, sizeof(connection->peer), "unknown peer");
}

static em_connection *new_connection(em_server *server, bool admin)
{
    em_connection *connection = calloc(1, sizeof(*connection));
    uint8_t *buffer = malloc(EM_READ_BUFFER_BYTES);
    if (connection == NULL || buffer == NULL) {
        free(connection);
        free(buffer);
        return NULL;
    }
    connection->read_buffer = buffer;
    connection->server = server;
    connection->admin = admin;
    connection->state = EM_CONNECTION_HEADER;
    uv_tcp_init(server->loop, &connection->handle);
    uv_timer_init(server->loop, &connection->idle_timer);
    connection->handle.data = connection;
    connection->idle_timer.data = connection;
    connection->references = 2; /* the two handles */
    return connection;
}

static void link_connection(em_server *server, em_connection *connection)
{
    connection->next = server->connections;
    if (server->connections != NULL)
        server->connections->previous = connection;
    server->connections = connection;
    server->connection_count++;
    atomic_fetch_add(&server->context->stats.connections_current, 1);
    atomic_fetch_add(&server->context->stats.connections_total, 1);
}

static void on_connection(uv_stream_t *listener, int status)
{
    em_server *server = listener->data;
    if (status < 0) {
        em_log_warning(server->context->log, "accept failed: %s", uv_strerror(status));
        return;
    }
    bool admin = listener == (uv_stream_t *)&server->listeners[LISTENER_ADMIN];
    em_connection *connection = new_connection(server, admin);
    if (connection == NULL) {
        em_log_error(server->context->log, "out of memory for a new connection");
        return;
    }
    link_connection(server, connection);
    if (uv_accept(listener, (uv_stream_t *)&connection->handle) != 0) {
        close_connection(connection);
        return;
    }
    uv_tcp_nodelay(&connection->handle, 1);
    describe_peer(connection);
    em_log_debug(server->context->log, "connection from %s on the %s listener", connection->peer,
                 admin ? "admin" : "data");
    if (server->connection_count > server->max_connections) {
        atomic_fetch_add(&server->context->stats.connections_rejected, 1);
        char message[128];
        snprintf(message, sizeof(message),
                 "the server already serves %u connections (max_connections)",
                 server->max_connections);
        em_connection_fail(connection, 0, 0, EM_RESOURCE_EXHAUSTED, message);
        return;
    }
    restart_idle_timer(connection);
    start_reading(connection);
}

static em_status listen_on(em_server *server, int which, em_error *err)
{
    struct sockaddr_storage address;
    em_status status = em_address_parse(server->configured[which], &address, err);
    if (status != EM_OK)
        return status;
    uv_tcp_t *listener = &server->listeners[which];
    uv_tcp_init(server->loop, listener);
    listener->data = server;
    server->listener_open[which] = true;
    server->open_handles++;
    int rc = uv_tcp_bind(listener, (const struct sockaddr *)&address, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)listener, LISTEN_BACKLOG, on_connection);
    if (rc != 0)
        return em_error_set(err, EM_UNAVAILABLE, "cannot listen on %s (%s listener): %s",
                            server->configured[which], listener_names[which], uv_strerror(rc));
    int length = sizeof(address);
    uv_tcp_getsockname(listener, (struct sockaddr *)&address, &length);
    em_address_format((struct sockaddr *)&address, server->bound[which], EM_ADDRESS_MAX);
    if (!em_address_is_loopback((struct sockaddr *)&address))
        em_log_warning(server->context->log,
                       "the %s listener %s is reachable from other hosts", listener_names[which],
                       server->bound[which]);
    return EM_OK;
}

em_status em_server_listen(em_server *server, em_error *err)
{
    for (int which = 0; which < LISTENER_COUNT; which++) {
        em_status status = listen_on(server, which, err);
        if (status != EM_OK)
            return status;
    }
    snprintf(server->settings.admin_address, EM_ADDRESS_MAX, "%s", server->bound[LISTENER_ADMIN]);
    return EM_OK;
}

/* ---- draining and closing ------------------------------------------------------------ */

static void on_server_handle_closed(uv_handle_t *handle)
{
    em_server *server = handle->data;
    if (--server->open_handles > 0)
        return;
    void (*closed)(void *) = server->closed;
    void *context = server->closed_context;
    free(server);
    if (closed != NULL)
        closed(context);
}

static void close_listeners(em_server *server)
{
    for (int which = 0; which < LISTENER_COUNT; which++) {
        if (!server->listener_open[which])
            continue;
        server->listener_open[which] = false;
        uv_close((uv_handle_t *)&server->listeners[which], on_server_handle_closed);
    }
}

static void report_drained(em_server *server, bool forced)
{
    if (server->drain_reported)
        return;
    server->drain_reported = true;
    uv_timer_stop(&server->drain_timer);
    if (server->drained != NULL)
        server->drained(server, forced, server->drained_context);
}

static void check_drained(em_server *server)
{
    if (server->draining && server->connection_count == 0)
        report_drained(server, false);
}

static void close_all_connections(em_server *server)
{
    while (server->connections != NULL)
        close_connection(server->connections);
}

static void on_drain_timeout(uv_timer_t *timer)
{
    em_server *server = timer->data;
    em_log_warning(server->context->log,
                   "drain deadline passed with %u connections still busy; closing them",
                   server->connection_count);
    close_all_connections(server);
    report_drained(server, true);
}

void em_server_drain(em_server *server, uint32_t timeout_ms,
                     void (*drained)(em_server *server, bool forced, void *context),
                     void *context)
{
    server->draining = true;
    server->drained = drained;
    server->drained_context = context;
    close_listeners(server);
    for (em_connection *c = server->connections, *next = NULL; c != NULL; c = next) {
        next = c->next;
        begin_closing(c);
    }
    uv_timer_start(&server->drain_timer, on_drain_timeout, timeout_ms, 0);
    check_drained(server);
}

void em_server_close(em_server *server, void (*closed)(void *context), void *context)
{
    server->closed = closed;
    server->closed_context = context;
    server->draining = false;
    close_all_connections(server);
    close_listeners(server);
    uv_close((uv_handle_t *)&server->drain_timer, on_server_handle_closed);
}
