#include "daemon/connection.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/address.h"
#include "daemon/tls.h"
#include "lib/base/failpoint.h"
#include "lib/base/log.h"
#include "lib/base/zeroed.h"

/* Attachment buffers (em_host_buffer_alloc) are aligned for any array the protocol
 * carries, and for SIMD. */
_Static_assert(EM_HOST_BUFFER_ALIGNMENT >= 64, "attachments are 64-byte aligned");

/* Reads larger than this go straight into the frame's buffer. */
#define DIRECT_READ_MAX ((size_t)1 << 30)

typedef enum connection_state {
    CONNECTION_HEADER,
    CONNECTION_META,
    CONNECTION_BODY,
    CONNECTION_ATTACHMENT,
    CONNECTION_DISCARD,
    CONNECTION_WAITING,
    CONNECTION_CLOSING,
} connection_state;

struct em_connection {
    uv_tcp_t handle; /* first: handle.data points back here */
    uv_timer_t timer;
    const em_connection_settings *settings;
    const em_connection_hooks *hooks;
    const em_log *log;
    em_connection *previous, *next; /* the owner's list of connections */
    bool admin;                     /* accepted on the admin listener */
    connection_state state;
    bool reading;       /* uv_read_start in effect */
    bool handle_closed; /* uv_close has been called */
    bool draining;
    bool advancing; /* connection_advance is on the stack */
    uint32_t references;
    char peer[64];

    /* TLS (NULL: plaintext): ciphertext is read into cipher_buffer, and plaintext comes
     * out of the session into the read buffer or straight into a frame part */
    em_tls_session *tls;
    bool tls_ready; /* handshake done */
    uint8_t *cipher_buffer;

    /* read buffer (allocated while bytes wait in it): [read_start, read_end) unconsumed */
    uint8_t *read_buffer;
    size_t read_start, read_end;

    /* the frame being assembled */
    uint8_t header[EM_FRAME_HEADER_BYTES];
    size_t header_have;
    em_frame_header frame;
    uint8_t *part;      /* the buffer of the part being read (meta, body, attachment) */
    uint64_t part_size; /* its length */
    uint64_t part_have;
    uint64_t discard_left;
    void *request;          /* the owner's, between META and the complete frame */
    uint64_t frame_charged; /* charged for the frame being read */

    /* waiting for memory: the charge that did not fit and the state it leads to */
    uint64_t wait_bytes;
    connection_state wait_next;
    bool queued; /* in the budget's waiting queue */
    em_connection *wait_next_connection;

    uint64_t inflight_bytes; /* charged: requests received + answers not yet written */
    uint32_t outstanding;    /* requests received and not yet answered */
    uint32_t writes_pending;

    /* deadlines (loop time, ms) */
    uint64_t last_activity;
    uint64_t frame_started;
    uint64_t write_progress;
    size_t write_queue_seen;

    /* ordering of requests that run off the loop */
    em_connection_work *queue_head, *queue_tail;
    uint32_t running_reads;
    bool running_write;
    void *dispatch_slot;
};

static void connection_advance(em_connection *connection);
static void schedule_timer(em_connection *connection);
static void abandon_queue(em_connection *connection);
static void stop_reading(em_connection *connection);

static uint64_t now_ms(const em_connection *connection)
{
    return uv_now(connection->handle.loop);
}

/* ---- lifetime ------------------------------------------------------------------------ */

void em_connection_ref(em_connection *connection)
{
    connection->references++;
}

void em_connection_unref(em_connection *connection)
{
    if (--connection->references > 0)
        return;
    em_tls_session_destroy(connection->tls);
    free(connection->cipher_buffer);
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
                                    bool admin, em_tls_server *tls)
{
    em_connection *connection = calloc(1, sizeof(*connection));
    if (connection == NULL)
        return NULL;
    if (tls != NULL) {
        connection->tls = em_tls_session_create(tls);
        if (connection->tls == NULL) {
            free(connection);
            return NULL;
        }
    }
    connection->settings = settings;
    connection->hooks = hooks;
    connection->log = log;
    connection->admin = admin;
    connection->state = CONNECTION_HEADER;
    uv_tcp_init(loop, &connection->handle);
    uv_timer_init(loop, &connection->timer);
    connection->handle.data = connection;
    connection->timer.data = connection;
    connection->references = 2; /* the two handles */
    return connection;
}

static void on_handle_closed(uv_handle_t *handle)
{
    em_connection_unref(handle->data);
}

/* ---- the budgets --------------------------------------------------------------------- */

static em_memory_budget *memory_of(const em_connection *connection)
{
    return connection->settings->memory;
}

/* The connection's own limit: one request with nothing else in flight always fits. */
static bool own_budget_allows(const em_connection *connection, uint64_t bytes)
{
    uint64_t held = connection->inflight_bytes;
    if (held == connection->frame_charged)
        return true;
    return bytes <= connection->settings->inflight_budget &&
           held <= connection->settings->inflight_budget - bytes;
}

/* The server's limit; an empty server takes any request (the owner refuses requests
 * larger than the whole budget before they are charged), and operators on the admin
 * listener are never held back by data traffic. */
static bool server_budget_allows(const em_connection *connection, uint64_t bytes)
{
    const em_memory_budget *memory = memory_of(connection);
    return connection->admin || memory->used == 0 || em_memory_budget_fits(memory, bytes);
}

static void charge(em_connection *connection, uint64_t bytes, bool frame)
{
    connection->inflight_bytes += bytes;
    if (frame)
        connection->frame_charged += bytes;
    em_memory_budget_charge(memory_of(connection), bytes);
}

static void release(em_connection *connection, uint64_t bytes)
{
    connection->inflight_bytes -= bytes;
    em_memory_budget_release(memory_of(connection), bytes);
}

static void enqueue_waiting(em_connection *connection)
{
    em_memory_budget *memory = memory_of(connection);
    em_connection_ref(connection); /* the queue holds one */
    connection->queued = true;
    connection->wait_next_connection = NULL;
    if (memory->waiting_tail != NULL)
        memory->waiting_tail->wait_next_connection = connection;
    else
        memory->waiting_head = connection;
    memory->waiting_tail = connection;
    atomic_fetch_add(&memory->stats->connections_waiting, 1);
}

/* Takes a connection out of the waiting queue (it is closing). */
static void remove_waiting(em_connection *connection)
{
    if (!connection->queued)
        return;
    em_memory_budget *memory = memory_of(connection);
    em_connection *previous = NULL;
    for (em_connection *c = memory->waiting_head; c != NULL; c = c->wait_next_connection) {
        if (c != connection) {
            previous = c;
            continue;
        }
        if (previous != NULL)
            previous->wait_next_connection = c->wait_next_connection;
        else
            memory->waiting_head = c->wait_next_connection;
        if (memory->waiting_tail == c)
            memory->waiting_tail = previous;
        break;
    }
    connection->queued = false;
    connection->wait_next_connection = NULL;
    atomic_fetch_sub(&memory->stats->connections_waiting, 1);
    em_connection_unref(connection);
}

/* ---- closing ------------------------------------------------------------------------- */

/* Gives up the frame being read: its buffers, its request and its charge. */
static void discard_partial_frame(em_connection *connection)
{
    em_host_buffer_free(connection->settings->buffers, connection->part);
    connection->part = NULL;
    if (connection->request != NULL) {
        connection->hooks->abandon(connection->hooks->context, connection->request);
        connection->request = NULL;
    }
    release(connection, connection->frame_charged);
    connection->frame_charged = 0;
    connection->header_have = 0;
    connection->discard_left = 0;
    remove_waiting(connection);
}

static void free_read_buffer(em_connection *connection)
{
    free(connection->read_buffer);
    connection->read_buffer = NULL;
    connection->read_start = connection->read_end = 0;
}

void em_connection_close(em_connection *connection)
{
    if (connection->handle_closed)
        return;
    connection->handle_closed = true;
    connection->state = CONNECTION_CLOSING;
    stop_reading(connection);
    discard_partial_frame(connection);
    free_read_buffer(connection);
    free(connection->cipher_buffer);
    connection->cipher_buffer = NULL;
    abandon_queue(connection);
    em_log_debug(connection->log, "connection from %s closed", connection->peer);
    uv_timer_stop(&connection->timer);
    uv_close((uv_handle_t *)&connection->timer, on_handle_closed);
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
    connection->last_activity = now_ms(connection);
    maybe_finish_closing(connection);
    schedule_timer(connection);
    em_connection_unref(connection);
}

void em_connection_begin_closing(em_connection *connection)
{
    connection->state = CONNECTION_CLOSING;
    stop_reading(connection);
    discard_partial_frame(connection);
    free_read_buffer(connection);
    maybe_finish_closing(connection);
}

void em_connection_drain(em_connection *connection)
{
    connection->draining = true;
    schedule_timer(connection);
}

/* ---- writing ------------------------------------------------------------------------- */

typedef struct pending_write {
    uv_write_t request;
    em_connection *connection;
    uint8_t *frame;
    void *attachment;
    size_t bytes;
    uint32_t parts_left; /* uv_write calls not yet called back (partial_write failpoint) */
    int status;
    uv_write_t *parts;
} pending_write;

static void on_write(uv_write_t *request, int status)
{
    pending_write *write = request->data;
    if (status != 0 && write->status == 0)
        write->status = status;
    if (--write->parts_left > 0)
        return;
    status = write->status;
    em_connection *connection = write->connection;
    free(write->frame);
    em_host_buffer_free(connection->settings->buffers, write->attachment);
    free(write->parts);
    release(connection, write->bytes);
    connection->writes_pending--;
    if (status == 0) {
        connection->hooks->bytes_out(connection->hooks->context, write->bytes);
        connection->last_activity = connection->write_progress = now_ms(connection);
        maybe_finish_closing(connection);
        schedule_timer(connection);
    } else if (!connection->handle_closed) {
        em_log_debug(connection->log, "write to %s failed: %s", connection->peer,
                     uv_strerror(status));
        em_connection_close(connection);
    }
    free(write);
    em_connection_unref(connection);
}

/* Failpoint partial_write: the answer goes out in pieces of piece bytes, one uv_write
 * each, so clients see it arrive a little at a time. */
static int write_in_pieces(em_connection *connection, pending_write *write,
                           const uv_buf_t *buffers, int count, size_t piece)
{
    size_t pieces = 0;
    for (int b = 0; b < count; b++)
        pieces += (buffers[b].len + piece - 1) / piece;
    write->parts = em_zeroed(pieces, sizeof(*write->parts));
    if (write->parts == NULL)
        return UV_ENOMEM;
    write->parts_left = (uint32_t)pieces;
    size_t issued = 0;
    for (int b = 0; b < count; b++) {
        for (size_t at = 0; at < buffers[b].len; at += piece) {
            size_t length = buffers[b].len - at < piece ? buffers[b].len - at : piece;
            uv_buf_t slice = uv_buf_init(buffers[b].base + at, (unsigned)length);
            uv_write_t *part = &write->parts[issued];
            part->data = write;
            int rc = uv_write(part, (uv_stream_t *)&connection->handle, &slice, 1, on_write);
            if (rc != 0) {
                /* the pieces not issued will never call back */
                write->parts_left -= (uint32_t)(pieces - issued - 1);
                on_write(part, rc);
                return 0;
            }
            issued++;
        }
    }
    return 0;
}

/* Writes count buffers (owning first and second, freed once written) and charges their
 * bytes until then. */
static void queue_write(em_connection *connection, uint8_t *first, void *second,
                        const uv_buf_t *buffers, int count, size_t bytes)
{
    pending_write *write = em_zeroed(1, sizeof(*write));
    if (write == NULL) {
        free(first);
        em_host_buffer_free(connection->settings->buffers, second);
        em_connection_close(connection);
        return;
    }
    *write = (pending_write){.connection = connection, .frame = first, .attachment = second,
                             .bytes = bytes, .parts_left = 1};
    write->request.data = write;
    charge(connection, bytes, false);
    em_connection_ref(connection);
    if (connection->writes_pending++ == 0)
        connection->write_progress = now_ms(connection);
    uint64_t piece = 0;
    int rc;
    if (em_failpoint_hit(EM_FAILPOINT_PARTIAL_WRITE, &piece))
        rc = write_in_pieces(connection, write, buffers, count, piece > 0 ? piece : 1);
    else
        rc = uv_write(&write->request, (uv_stream_t *)&connection->handle, buffers,
                      (unsigned)count, on_write);
    if (rc != 0) {
        on_write(&write->request, rc); /* libuv does not call back a write it refused */
        return;
    }
    if (!connection->handle_closed)
        connection->write_queue_seen =
            uv_stream_get_write_queue_size((uv_stream_t *)&connection->handle);
    schedule_timer(connection);
}

/* Sends what the TLS session has to send (handshake messages, encrypted answers). */
static void flush_tls(em_connection *connection)
{
    uint8_t *output = NULL;
    size_t length = 0;
    em_error err;
    if (em_tls_session_take_output(connection->tls, &output, &length, &err) != EM_OK) {
        em_log_info(connection->log, "closing connection from %s: %s", connection->peer,
                    err.message);
        em_connection_close(connection);
        return;
    }
    if (length == 0)
        return;
    uv_buf_t buffer = uv_buf_init((char *)output, 0);
    buffer.len = length;
    queue_write(connection, output, NULL, &buffer, 1, length);
}

void em_connection_send(em_connection *connection, uint8_t *frame, size_t frame_length,
                        void *attachment, size_t attachment_length, uint64_t charged)
{
    if (connection->handle_closed) {
        free(frame);
        em_host_buffer_free(connection->settings->buffers, attachment);
        release(connection, charged);
        return;
    }
    if (connection->tls != NULL) {
        /* encrypted into the session's output: the plaintext goes at once */
        em_error err;
        em_status status = em_tls_session_write(connection->tls, frame, frame_length, &err);
        if (status == EM_OK && attachment_length > 0)
            status = em_tls_session_write(connection->tls, attachment, attachment_length, &err);
        free(frame);
        em_host_buffer_free(connection->settings->buffers, attachment);
        release(connection, charged);
        if (status != EM_OK) {
            em_log_info(connection->log, "closing connection from %s: %s", connection->peer,
                        err.message);
            em_connection_close(connection);
            return;
        }
        flush_tls(connection);
        return;
    }
    uv_buf_t buffers[2] = {uv_buf_init((char *)frame, (unsigned)frame_length),
                           uv_buf_init((char *)attachment, (unsigned)attachment_length)};
    buffers[1].len = attachment_length; /* uv_buf_init takes 32 bits; the field holds size_t */
    /* the answer's own bytes replace the request's charge until they are written */
    queue_write(connection, frame, attachment, buffers, attachment_length > 0 ? 2 : 1,
                frame_length + attachment_length);
    release(connection, charged);
}

void em_connection_release(em_connection *connection, uint64_t charged)
{
    release(connection, charged);
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

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buffer);
static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buffer);

static void stop_reading(em_connection *connection)
{
    if (connection->reading) {
        uv_read_stop((uv_stream_t *)&connection->handle);
        connection->reading = false;
    }
}

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
    connection->last_activity = now_ms(connection);
    schedule_timer(connection);
    start_reading(connection);
}

/* True while the part being read can take a large read directly. */
static bool reads_into_part(const em_connection *connection)
{
    return connection->state == CONNECTION_BODY || connection->state == CONNECTION_ATTACHMENT;
}

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buffer)
{
    (void)suggested;
    em_connection *connection = handle->data;
    if (connection->tls != NULL) {
        if (connection->cipher_buffer == NULL)
            connection->cipher_buffer = malloc(EM_READ_BUFFER_BYTES);
        *buffer = uv_buf_init((char *)connection->cipher_buffer,
                              connection->cipher_buffer != NULL ? EM_READ_BUFFER_BYTES : 0);
        return;
    }
    if (connection->read_start == connection->read_end && reads_into_part(connection)) {
        uint64_t remaining = connection->part_size - connection->part_have;
        if (remaining >= EM_READ_BUFFER_BYTES) {
            buffer->base = (char *)connection->part + connection->part_have;
            buffer->len = remaining > DIRECT_READ_MAX ? DIRECT_READ_MAX : (size_t)remaining;
            return;
        }
    }
    if (connection->read_buffer == NULL)
        connection->read_buffer = malloc(EM_READ_BUFFER_BYTES);
    if (connection->read_buffer == NULL) {
        *buffer = uv_buf_init(NULL, 0); /* libuv reports UV_ENOBUFS */
        return;
    }
    if (connection->read_start == connection->read_end)
        connection->read_start = connection->read_end = 0;
    buffer->base = (char *)connection->read_buffer + connection->read_end;
    buffer->len = EM_READ_BUFFER_BYTES - connection->read_end;
}

static bool mid_frame(const em_connection *connection)
{
    switch (connection->state) {
    case CONNECTION_HEADER:
        return connection->header_have > 0;
    case CONNECTION_META:
    case CONNECTION_BODY:
    case CONNECTION_ATTACHMENT:
    case CONNECTION_DISCARD:
    case CONNECTION_WAITING:
        return true;
    case CONNECTION_CLOSING:
        return false;
    }
    return false;
}

static void on_peer_closed(em_connection *connection, ssize_t error)
{
    bool partial = mid_frame(connection);
    if (error != UV_EOF || partial) {
        em_log_debug(connection->log, "connection from %s: %s%s", connection->peer,
                     error == UV_EOF ? "" : uv_strerror((int)error),
                     partial ? "truncated frame" : "");
        em_connection_close(connection);
        return;
    }
    em_connection_begin_closing(connection);
}

/* TLS: advances the handshake, then decrypts what was received into the read buffer or
 * straight into the frame part being read, and moves the frame reader along, until
 * the session has nothing more or the connection must wait. */
static void tls_pump(em_connection *connection)
{
    em_error err;
    if (!connection->tls_ready) {
        bool done = false;
        em_status status = em_tls_session_handshake(connection->tls, &done, &err);
        if (status == EM_OK)
            flush_tls(connection);
        if (connection->handle_closed)
            return;
        if (status != EM_OK) {
            connection->hooks->tls_handshake(connection->hooks->context, false);
            em_log_info(connection->log, "closing connection from %s: %s", connection->peer,
                        err.message);
            em_connection_close(connection);
            return;
        }
        if (!done)
            return;
        connection->tls_ready = true;
        connection->hooks->tls_handshake(connection->hooks->context, true);
    }
    while (connection->state != CONNECTION_WAITING && connection->state != CONNECTION_CLOSING) {
        uint8_t *target = NULL;
        size_t room = 0;
        bool direct = false;
        if (connection->read_start == connection->read_end && reads_into_part(connection) &&
            connection->part_size - connection->part_have >= EM_READ_BUFFER_BYTES) {
            uint64_t remaining = connection->part_size - connection->part_have;
            target = connection->part + connection->part_have;
            room = remaining > DIRECT_READ_MAX ? DIRECT_READ_MAX : (size_t)remaining;
            direct = true;
        } else {
            if (connection->read_buffer == NULL)
                connection->read_buffer = malloc(EM_READ_BUFFER_BYTES);
            if (connection->read_buffer == NULL) {
                em_connection_close(connection);
                return;
            }
            if (connection->read_start == connection->read_end)
                connection->read_start = connection->read_end = 0;
            target = connection->read_buffer + connection->read_end;
            room = EM_READ_BUFFER_BYTES - connection->read_end;
            if (room == 0)
                break; /* the reader is waiting for its buffer to drain */
        }
        size_t got = 0;
        bool closed = false;
        if (em_tls_session_read(connection->tls, target, room, &got, &closed, &err) != EM_OK) {
            em_log_info(connection->log, "closing connection from %s: %s", connection->peer,
                        err.message);
            em_connection_close(connection);
            return;
        }
        if (closed) {
            on_peer_closed(connection, UV_EOF);
            return;
        }
        if (got == 0)
            break;
        if (direct)
            connection->part_have += got;
        else
            connection->read_end += got;
        connection_advance(connection);
    }
    if (!connection->handle_closed)
        flush_tls(connection); /* what reading made the session want to send */
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buffer)
{
    em_connection *connection = stream->data;
    if (nread < 0) {
        on_peer_closed(connection, nread);
        return;
    }
    if (nread > 0 && connection->tls != NULL) {
        connection->hooks->bytes_in(connection->hooks->context, (uint64_t)nread);
        connection->last_activity = now_ms(connection);
        em_error err;
        if (em_tls_session_receive(connection->tls, (const uint8_t *)buffer->base,
                                   (size_t)nread, &err) != EM_OK) {
            em_log_info(connection->log, "closing connection from %s: %s", connection->peer,
                        err.message);
            em_connection_close(connection);
            return;
        }
        tls_pump(connection);
    } else if (nread > 0) {
        connection->hooks->bytes_in(connection->hooks->context, (uint64_t)nread);
        connection->last_activity = now_ms(connection);
        bool direct = connection->read_buffer == NULL ||
                      (uint8_t *)buffer->base !=
                          connection->read_buffer + connection->read_end;
        if (direct)
            connection->part_have += (uint64_t)nread;
        else
            connection->read_end += (size_t)nread;
        connection_advance(connection);
    }
    if (connection->handle_closed)
        return;
    if (connection->state != CONNECTION_WAITING && connection->read_start == connection->read_end)
        free_read_buffer(connection); /* idle connections hold no buffer */
    schedule_timer(connection);
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

/* Allocates the part next is about to read (the charge is already made). */
static void enter(em_connection *connection, connection_state next)
{
    const em_frame_header *frame = &connection->frame;
    uint64_t size = next == CONNECTION_META ? frame->meta_len
                    : next == CONNECTION_BODY ? frame->body_len
                                              : frame->attach_len;
    uint8_t *part = NULL;
    if (next == CONNECTION_ATTACHMENT && size > 0) {
        part = em_host_buffer_alloc(connection->settings->buffers, (size_t)size);
    } else if (next != CONNECTION_ATTACHMENT) {
        part = malloc(size > 0 ? (size_t)size : 1);
    }
    if (size > 0 && part == NULL) {
        char message[128];
        snprintf(message, sizeof(message), "out of memory for a frame part of %" PRIu64 " bytes",
                 size);
        connection->hooks->frame_rejected(connection->hooks->context);
        em_connection_fail(connection, 0, 0, EM_RESOURCE_EXHAUSTED, message);
        return;
    }
    connection->part = part;
    connection->part_size = size;
    connection->part_have = 0;
    connection->state = next;
}

/* Charges bytes and moves on to next, or waits for memory. */
static void charge_or_wait(em_connection *connection, uint64_t bytes, connection_state next)
{
    if (own_budget_allows(connection, bytes) && server_budget_allows(connection, bytes)) {
        charge(connection, bytes, true);
        enter(connection, next);
        return;
    }
    connection->state = CONNECTION_WAITING;
    connection->wait_bytes = bytes;
    connection->wait_next = next;
    stop_reading(connection);
    atomic_fetch_add_explicit(&memory_of(connection)->stats->memory_waits, 1,
                              memory_order_relaxed);
    enqueue_waiting(connection);
}

static bool can_resume(const em_connection *connection)
{
    return own_budget_allows(connection, connection->wait_bytes) &&
           server_budget_allows(connection, connection->wait_bytes);
}

static void resume(em_connection *connection)
{
    charge(connection, connection->wait_bytes, true);
    connection->wait_bytes = 0;
    enter(connection, connection->wait_next);
    if (connection->state == CONNECTION_CLOSING)
        return;
    connection_advance(connection);
    if (connection->tls != NULL && !connection->handle_closed)
        tls_pump(connection); /* plaintext the session still holds */
    if (connection->state != CONNECTION_WAITING && connection->state != CONNECTION_CLOSING)
        start_reading(connection);
    schedule_timer(connection);
}

void em_connection_wake_waiting(em_memory_budget *memory)
{
    memory->wake_scheduled = false;
    em_connection *connection = memory->waiting_head;
    memory->waiting_head = memory->waiting_tail = NULL;
    bool server_full = false; /* an older connection waits for the server's memory */
    while (connection != NULL) {
        em_connection *next = connection->wait_next_connection;
        connection->wait_next_connection = NULL;
        connection->queued = false;
        atomic_fetch_sub(&memory->stats->connections_waiting, 1);
        if (!connection->handle_closed && connection->state == CONNECTION_WAITING) {
            if (!server_full && can_resume(connection))
                resume(connection);
            else {
                if (own_budget_allows(connection, connection->wait_bytes))
                    server_full = true;
                enqueue_waiting(connection);
            }
        }
        em_connection_unref(connection); /* the old queue's reference */
        connection = next;
    }
}

/* Gives the charge of a frame answered before it was complete back; the rest of it is
 * skipped. */
static void skip_rest(em_connection *connection, uint64_t bytes)
{
    connection->request = NULL;
    release(connection, connection->frame_charged);
    connection->frame_charged = 0;
    connection->discard_left = bytes;
    connection->state = CONNECTION_DISCARD;
}

static void begin_frame(em_connection *connection)
{
    em_error err;
    em_status status = em_frame_header_decode(connection->header,
                                              &connection->settings->frame_limits,
                                              &connection->frame, &err);
    if (status != EM_OK) {
        connection->hooks->frame_rejected(connection->hooks->context);
        em_connection_fail(connection, 0, 0, status, err.message);
        return;
    }
    charge_or_wait(connection, EM_FRAME_HEADER_BYTES + (uint64_t)connection->frame.meta_len,
                   CONNECTION_META);
}

static void meta_arrived(em_connection *connection)
{
    uint8_t *meta = connection->part;
    connection->part = NULL;
    void *request = connection->hooks->meta(connection->hooks->context, connection,
                                            &connection->frame, meta);
    if (connection->state == CONNECTION_CLOSING)
        return;
    const em_frame_header *frame = &connection->frame;
    if (request == NULL) {
        skip_rest(connection, frame->body_len + frame->attach_len);
        return;
    }
    connection->request = request;
    /* the body and what protobuf-c unpacks it into */
    charge_or_wait(connection, frame->body_len * 2, CONNECTION_BODY);
}

static void body_arrived(em_connection *connection)
{
    uint8_t *body = connection->part;
    connection->part = NULL;
    uint64_t answer_bytes = 0;
    void *request = connection->request;
    connection->request = NULL; /* the owner's while it looks at the body */
    bool accepted = connection->hooks->body(connection->hooks->context, connection,
                                            &connection->frame, request, body, &answer_bytes);
    if (connection->state == CONNECTION_CLOSING)
        return; /* refused: the owner has freed the request */
    if (!accepted) {
        skip_rest(connection, connection->frame.attach_len);
        return;
    }
    connection->request = request;
    charge_or_wait(connection, connection->frame.attach_len + answer_bytes,
                   CONNECTION_ATTACHMENT);
}

static void complete_frame(em_connection *connection)
{
    void *request = connection->request;
    uint8_t *attachment = connection->part;
    uint64_t charged = connection->frame_charged;
    connection->request = NULL;
    connection->part = NULL;
    connection->frame_charged = 0;
    connection->header_have = 0;
    connection->state = CONNECTION_HEADER;
    connection->hooks->frame(connection->hooks->context, connection, request, attachment,
                             charged);
}

static void part_arrived(em_connection *connection)
{
    switch (connection->state) {
    case CONNECTION_META:
        meta_arrived(connection);
        return;
    case CONNECTION_BODY:
        body_arrived(connection);
        return;
    case CONNECTION_ATTACHMENT:
        complete_frame(connection);
        return;
    case CONNECTION_HEADER:
    case CONNECTION_DISCARD:
    case CONNECTION_WAITING:
    case CONNECTION_CLOSING:
        return;
    }
}

/* The one function that moves a connection through its reading states. */
static void connection_advance(em_connection *connection)
{
    for (;;) {
        size_t available = connection->read_end - connection->read_start;
        switch (connection->state) {
        case CONNECTION_HEADER:
            if (available == 0)
                return;
            if (connection->header_have == 0)
                connection->frame_started = now_ms(connection);
            connection->header_have += consume(connection,
                                               connection->header + connection->header_have,
                                               EM_FRAME_HEADER_BYTES - connection->header_have);
            if (connection->header_have == EM_FRAME_HEADER_BYTES)
                begin_frame(connection);
            break;
        case CONNECTION_META:
        case CONNECTION_BODY:
        case CONNECTION_ATTACHMENT:
            if (connection->part_have == connection->part_size) {
                part_arrived(connection);
                break;
            }
            if (available == 0)
                return;
            connection->part_have += consume(connection, connection->part + connection->part_have,
                                             connection->part_size - connection->part_have);
            break;
        case CONNECTION_DISCARD: {
            if (connection->discard_left == 0) {
                connection->header_have = 0;
                connection->state = CONNECTION_HEADER;
                break;
            }
            if (available == 0)
                return;
            size_t take = connection->discard_left < available ? (size_t)connection->discard_left
                                                               : available;
            connection->read_start += take;
            connection->discard_left -= take;
            break;
        }
        case CONNECTION_WAITING:
        case CONNECTION_CLOSING:
            return;
        }
    }
}

/* ---- deadlines ----------------------------------------------------------------------- */

/* Nothing in flight: the idle clock runs (a frame begun and left unfinished is idle
 * too once no byte arrives); the drain linger waits for a frame boundary as well. */
static bool quiet(const em_connection *connection)
{
    return connection->outstanding == 0 && connection->writes_pending == 0 &&
           connection->state != CONNECTION_WAITING;
}

static bool lingering(const em_connection *connection)
{
    return connection->draining && quiet(connection) && !mid_frame(connection);
}

/* The frame clock runs while a frame is begun, waiting for memory included: a frame
 * parked longer than frame_timeout_ms gives its memory back (a server kept full by
 * half-sent frames would otherwise never drain). */
static bool frame_clock_runs(const em_connection *connection)
{
    return mid_frame(connection);
}

static void close_for(em_connection *connection, em_connection_timeout which, const char *what)
{
    em_log_info(connection->log, "closing connection from %s: %s", connection->peer, what);
    connection->hooks->timed_out(connection->hooks->context, which);
    em_connection_close(connection);
}

static void on_timer(uv_timer_t *timer)
{
    em_connection *connection = timer->data;
    const em_connection_settings *settings = connection->settings;
    uint64_t now = now_ms(connection);
    if (connection->writes_pending > 0 && settings->write_timeout_ms > 0) {
        size_t queued = uv_stream_get_write_queue_size((uv_stream_t *)&connection->handle);
        if (queued < connection->write_queue_seen)
            connection->write_progress = now; /* the peer is reading, slowly */
        connection->write_queue_seen = queued;
        if (now - connection->write_progress >= settings->write_timeout_ms) {
            close_for(connection, EM_CONNECTION_TIMEOUT_WRITE,
                      "its answers made no progress within write_timeout_ms");
            return;
        }
    }
    if (frame_clock_runs(connection) && settings->frame_timeout_ms > 0 &&
        now - connection->frame_started >= settings->frame_timeout_ms) {
        if (connection->state == CONNECTION_WAITING) {
            char message[160];
            snprintf(message, sizeof(message),
                     "the request waited %" PRIu64 " ms for memory (limits.memory_bytes, "
                     "connection_inflight_bytes); the server is overloaded",
                     now - connection->frame_started);
            connection->hooks->timed_out(connection->hooks->context,
                                         EM_CONNECTION_TIMEOUT_FRAME);
            em_connection_fail(connection, 0, 0, EM_RESOURCE_EXHAUSTED, message);
            return;
        }
        close_for(connection, EM_CONNECTION_TIMEOUT_FRAME,
                  "a frame was not completed within frame_timeout_ms");
        return;
    }
    if (lingering(connection) && now - connection->last_activity >= settings->drain_linger_ms) {
        em_connection_begin_closing(connection);
        return;
    }
    if (quiet(connection) && settings->idle_timeout_ms > 0 &&
        now - connection->last_activity >= settings->idle_timeout_ms) {
        close_for(connection, EM_CONNECTION_TIMEOUT_IDLE, "idle past idle_timeout_ms");
        return;
    }
    schedule_timer(connection);
}

static uint64_t earlier(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

/* Arms the timer for the nearest deadline that applies now. */
static void schedule_timer(em_connection *connection)
{
    if (connection->handle_closed)
        return;
    const em_connection_settings *settings = connection->settings;
    uint64_t next = UINT64_MAX;
    if (lingering(connection))
        next = connection->last_activity + settings->drain_linger_ms;
    if (quiet(connection) && settings->idle_timeout_ms > 0)
        next = earlier(next, connection->last_activity + settings->idle_timeout_ms);
    if (frame_clock_runs(connection) && settings->frame_timeout_ms > 0)
        next = earlier(next, connection->frame_started + settings->frame_timeout_ms);
    if (connection->writes_pending > 0 && settings->write_timeout_ms > 0)
        next = earlier(next, connection->write_progress + settings->write_timeout_ms);
    if (next == UINT64_MAX) {
        uv_timer_stop(&connection->timer);
        return;
    }
    uint64_t now = now_ms(connection);
    uv_timer_start(&connection->timer, on_timer, next > now ? next - now : 0, 0);
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
        release(connection, work->charged);
        work->abandon(work);
        em_connection_request_finished(connection);
        work = next;
    }
}
