#include "daemon/connection.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/address.h"
#include "lib/base/log.h"

/* Attachment buffers are aligned for any array the protocol carries (and SIMD). */
#define ATTACHMENT_ALIGNMENT 64u

typedef enum connection_state {
    CONNECTION_HEADER,
    CONNECTION_MESSAGE,
    CONNECTION_ATTACHMENT,
    CONNECTION_BLOCKED,
    CONNECTION_CLOSING,
} connection_state;

struct em_connection {
    uv_tcp_t handle; /* first: handle.data points back here */
    uv_timer_t idle_timer;
    const em_connection_settings *settings;
    const em_connection_hooks *hooks;
    const em_log *log;
    em_connection *previous, *next; /* the owner's list of connections */
    bool admin;                     /* accepted on the admin listener */
    connection_state state;
    bool reading;       /* uv_read_start in effect */
    bool handle_closed; /* uv_close has been called */
    uint32_t references;
    char peer[64];

    /* read buffer: bytes [read_start, read_end) are received but not yet consumed */
    uint8_t *read_buffer;
    size_t read_start, read_end;

    /* the frame being assembled */
    uint8_t header[EM_FRAME_HEADER_BYTES];
    size_t header_have;
    em_frame_header frame;
    uint8_t *message; /* meta + body */
    uint64_t message_have;
    uint8_t *attachment;
    uint64_t attachment_have;

    uint64_t inflight_bytes; /* requests received + responses not yet written */
    uint32_t outstanding;    /* requests received and not yet answered */
    uint32_t writes_pending;

    /* ordering of requests that run off the loop */
    em_connection_work *queue_head, *queue_tail;
    uint32_t running_reads;
    bool running_write;
    void *dispatch_slot;
};

static void connection_advance(em_connection *connection);
static void restart_idle_timer(em_connection *connection);
static void abandon_queue(em_connection *connection);

/* ---- lifetime ------------------------------------------------------------------------ */

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

bool em_connection_is_admin(const em_connection *connection)
{
    return connection->admin;
}

const char *em_connection_peer(const em_connection *connection)
{
    return connection->peer;
}

uv_stream_t *em_connection_stream(em_connection *connection)
{
    return (uv_stream_t *)&connection->handle;
}

em_connection *em_connection_next(const em_connection *connection)
{
    return connection->next;
}

void em_connection_link(em_connection **head, em_connection *connection)
{
    connection->previous = NULL;
    connection->next = *head;
    if (*head != NULL)
        (*head)->previous = connection;
    *head = connection;
}

void em_connection_unlink(em_connection **head, em_connection *connection)
{
    if (connection->previous != NULL)
        connection->previous->next = connection->next;
    else
        *head = connection->next;
    if (connection->next != NULL)
        connection->next->previous = connection->previous;
    connection->previous = connection->next = NULL;
}

em_connection *em_connection_create(uv_loop_t *loop, const em_connection_settings *settings,
                                    const em_connection_hooks *hooks, const em_log *log,
                                    bool admin)
{
    em_connection *connection = calloc(1, sizeof(*connection));
    uint8_t *buffer = malloc(EM_READ_BUFFER_BYTES);
    if (connection == NULL || buffer == NULL) {
        free(connection);
        free(buffer);
        return NULL;
    }
    connection->read_buffer = buffer;
    connection->settings = settings;
    connection->hooks = hooks;
    connection->log = log;
    connection->admin = admin;
    connection->state = CONNECTION_HEADER;
    uv_tcp_init(loop, &connection->handle);
    uv_timer_init(loop, &connection->idle_timer);
    connection->handle.data = connection;
    connection->idle_timer.data = connection;
    connection->references = 2; /* the two handles */
    return connection;
}

static void on_handle_closed(uv_handle_t *handle)
{
    em_connection_unref(handle->data);
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

void em_connection_close(em_connection *connection)
{
    if (connection->handle_closed)
        return;
    connection->handle_closed = true;
    connection->state = CONNECTION_CLOSING;
    stop_reading(connection);
    discard_partial_frame(connection);
    abandon_queue(connection);
    em_log_debug(connection->log, "connection from %s closed", connection->peer);
    uv_timer_stop(&connection->idle_timer);
    uv_close((uv_handle_t *)&connection->idle_timer, on_handle_closed);
    uv_close((uv_handle_t *)&connection->handle, on_handle_closed);
    connection->hooks->closed(connection->hooks->context, connection);
}

/* A CLOSING connection goes once every request is answered and every answer written. */
static void maybe_finish_closing(em_connection *connection)
{
    if (!connection->handle_closed && connection->state == CONNECTION_CLOSING &&
        connection->outstanding == 0 && connection->writes_pending == 0)
        em_connection_close(connection);
}

void em_connection_request_received(em_connection *connection)
{
    em_connection_ref(connection);
    connection->outstanding++;
}

uint32_t em_connection_outstanding(const em_connection *connection)
{
    return connection->outstanding;
}

void **em_connection_dispatch_slot(em_connection *connection)
{
    return &connection->dispatch_slot;
}

void em_connection_request_finished(em_connection *connection)
{
    connection->outstanding--;
    maybe_finish_closing(connection);
    em_connection_unref(connection);
}

void em_connection_begin_closing(em_connection *connection)
{
    connection->state = CONNECTION_CLOSING;
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
        connection->hooks->bytes_out(connection->hooks->context, write->bytes);
        maybe_unblock(connection);
        maybe_finish_closing(connection);
    } else if (!connection->handle_closed) {
        em_log_debug(connection->log, "write to %s failed: %s", connection->peer,
                     uv_strerror(status));
        em_connection_close(connection);
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
            em_connection_close(connection);
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

void em_connection_release(em_connection *connection, uint64_t charged)
{
    connection->inflight_bytes -= charged;
}

void em_connection_fail(em_connection *connection, uint64_t correlation_id, int method,
                        em_status status, const char *message)
{
    if (connection->handle_closed)
        return;
    em_log_info(connection->log, "closing connection from %s: %s: %s", connection->peer,
                em_status_name(status), message);
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
    em_connection_begin_closing(connection);
}

/* ---- reading ------------------------------------------------------------------------- */

static void block(em_connection *connection)
{
    connection->state = CONNECTION_BLOCKED;
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
        em_connection_close(connection);
}

void em_connection_start(em_connection *connection)
{
    struct sockaddr_storage peer;
    int length = sizeof(peer);
    if (uv_tcp_getpeername(&connection->handle, (struct sockaddr *)&peer, &length) == 0)
        em_address_format((struct sockaddr *)&peer, connection->peer, sizeof(connection->peer));
    else
        snprintf(connection->peer, sizeof(connection->peer), "unknown peer");
    uv_tcp_nodelay(&connection->handle, 1);
    restart_idle_timer(connection);
    start_reading(connection);
}

static void maybe_unblock(em_connection *connection)
{
    if (connection->state != CONNECTION_BLOCKED ||
        connection->inflight_bytes >= connection->settings->inflight_budget)
        return;
    connection->state = CONNECTION_HEADER;
    connection_advance(connection);
    if (connection->state != CONNECTION_BLOCKED && connection->state != CONNECTION_CLOSING)
        start_reading(connection);
}

/* The frame buffer the next bytes belong to, when a large read can go straight there. */
static bool direct_target(em_connection *connection, uint8_t **target, size_t *room)
{
    if (connection->read_start != connection->read_end)
        return false;
    uint64_t remaining = 0;
    if (connection->state == CONNECTION_MESSAGE) {
        remaining = connection->frame.meta_len + connection->frame.body_len -
                    connection->message_have;
        *target = connection->message + connection->message_have;
    } else if (connection->state == CONNECTION_ATTACHMENT) {
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
        em_log_debug(connection->log, "connection from %s: %s%s", connection->peer,
                     error == UV_EOF ? "" : uv_strerror((int)error),
                     mid_frame ? "truncated frame" : "");
        em_connection_close(connection);
        return;
    }
    em_connection_begin_closing(connection);
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buffer)
{
    em_connection *connection = stream->data;
    if (nread == 0)
        return;
    if (nread < 0) {
        on_peer_closed(connection, nread);
        return;
    }
    connection->hooks->bytes_in(connection->hooks->context, (uint64_t)nread);
    restart_idle_timer(connection);
    uint8_t *in_buffer = connection->read_buffer + connection->read_end;
    if ((uint8_t *)buffer->base != in_buffer) {
        if (connection->state == CONNECTION_MESSAGE)
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
    em_error err;
    em_status status = em_frame_header_decode(connection->header,
                                              &connection->settings->frame_limits,
                                              &connection->frame, &err);
    if (status == EM_OK) {
        connection->inflight_bytes += EM_FRAME_HEADER_BYTES + connection->frame.meta_len +
                                      connection->frame.body_len + connection->frame.attach_len;
        status = allocate_frame(connection, &err);
    }
    if (status != EM_OK) {
        connection->hooks->frame_rejected(connection->hooks->context);
        em_connection_fail(connection, 0, 0, status, err.message);
        return;
    }
    connection->message_have = 0;
    connection->attachment_have = 0;
    connection->state = CONNECTION_MESSAGE;
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
    connection->state = CONNECTION_HEADER;
    connection->hooks->frame(connection->hooks->context, connection, &frame, message, attachment,
                             charged);
    if (connection->state == CONNECTION_HEADER &&
        connection->inflight_bytes >= connection->settings->inflight_budget)
        block(connection);
}

/* The one function that moves a connection through its reading states. */
static void connection_advance(em_connection *connection)
{
    for (;;) {
        size_t available = connection->read_end - connection->read_start;
        const em_frame_header *frame = &connection->frame;
        switch (connection->state) {
        case CONNECTION_HEADER:
            if (available == 0)
                return;
            connection->header_have += consume(connection,
                                               connection->header + connection->header_have,
                                               EM_FRAME_HEADER_BYTES - connection->header_have);
            if (connection->header_have == EM_FRAME_HEADER_BYTES)
                begin_frame(connection);
            break;
        case CONNECTION_MESSAGE: {
            uint64_t size = frame->meta_len + frame->body_len;
            if (connection->message_have == size) {
                if (frame->attach_len == 0)
                    complete_frame(connection);
                else
                    connection->state = CONNECTION_ATTACHMENT;
                break;
            }
            if (available == 0)
                return;
            connection->message_have += consume(connection,
                                                connection->message + connection->message_have,
                                                size - connection->message_have);
            break;
        }
        case CONNECTION_ATTACHMENT:
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
        case CONNECTION_BLOCKED:
        case CONNECTION_CLOSING:
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
    em_log_debug(connection->log, "closing idle connection from %s", connection->peer);
    em_connection_close(connection);
}

static void restart_idle_timer(em_connection *connection)
{
    uint32_t timeout = connection->settings->idle_timeout_ms;
    if (timeout > 0 && !connection->handle_closed)
        uv_timer_start(&connection->idle_timer, on_idle, timeout, 0);
}

/* ---- request ordering ---------------------------------------------------------------- */

static bool can_start(const em_connection *connection, const em_connection_work *work)
{
    if (work->write)
        return connection->running_reads == 0 && !connection->running_write;
    return !connection->running_write;
}

static void pump(em_connection *connection)
{
    while (connection->queue_head != NULL && can_start(connection, connection->queue_head)) {
        em_connection_work *work = connection->queue_head;
        connection->queue_head = work->next;
        if (connection->queue_head == NULL)
            connection->queue_tail = NULL;
        if (work->write)
            connection->running_write = true;
        else
            connection->running_reads++;
        work->start(work);
    }
}

void em_connection_enqueue(em_connection *connection, em_connection_work *work)
{
    work->next = NULL;
    if (connection->queue_tail != NULL)
        connection->queue_tail->next = work;
    else
        connection->queue_head = work;
    connection->queue_tail = work;
    pump(connection);
}

void em_connection_work_done(em_connection *connection, bool write)
{
    if (write)
        connection->running_write = false;
    else
        connection->running_reads--;
    pump(connection);
}

/* The connection is going away: frees the work still queued (never run). */
static void abandon_queue(em_connection *connection)
{
    em_connection_work *work = connection->queue_head;
    connection->queue_head = NULL;
    connection->queue_tail = NULL;
    while (work != NULL) {
        em_connection_work *next = work->next;
        connection->inflight_bytes -= work->charged;
        work->abandon(work);
        em_connection_request_finished(connection);
        work = next;
    }
}
