/*
 * DESIGN: one client connection, as an explicit state machine.
 *
 *   HEADER     reading the 24 header bytes of the next frame; its lengths are checked
 *              against the frame limits, then the header and RpcMeta are charged
 *   META       reading RpcMeta; the owner decodes it, checks the method, the caller's
 *              token and the lengths against the method, and either accepts the frame
 *              (the body is charged and read) or answers it (the rest is skipped)
 *   BODY       reading the body; the owner decodes it and says how large its answer can
 *              be; the attachment and that answer are charged, or the frame is answered
 *   ATTACHMENT reading the attachment into its own 64-byte-aligned buffer
 *   DISCARD    skipping the body and attachment of a frame already answered
 *   WAITING    a charge does not fit the connection's or the server's budget
 *              (daemon/budget.h): the socket is not read until memory is released
 *   CLOSING    no more frames are read (fatal frame error, peer EOF): the connection
 *              closes once every received request is answered and written
 *
 * connection_advance() in connection.c is the one function that moves a connection
 * between the reading states. Nothing large is allocated before it is charged, and
 * nothing is charged for a frame the owner refuses from its meta.
 *
 * One timer watches three deadlines: idle (nothing in flight for idle_timeout_ms), frame
 * (a frame started and not finished within frame_timeout_ms: a trickling sender, or a
 * frame that waited that long for memory, which is answered RESOURCE_EXHAUSTED) and
 * write (answers waiting to be written made no progress for write_timeout_ms: a peer
 * that does not read). Each closes the connection and releases what it held. A draining
 * connection keeps reading so that late requests get an answer (the owner answers them
 * UNAVAILABLE) and closes once it has been quiet for its linger.
 *
 * A connection is reference-counted: the open handles, every request received and not
 * yet answered, and every write in progress hold one, so a request finishing on a
 * worker after its client left never touches freed memory.
 *
 * Requests of one connection run in order where order matters (em_connection_work):
 * reads (pulls) may run together, but a write (push, create, drop) waits for everything
 * before it and everything after it waits for the write. So a connection's later
 * request always sees the effects of its earlier ones, and pipelined pulls still run in
 * parallel.
 *
 * Every function here runs on the loop thread.
 */
#ifndef EMBER_DAEMON_CONNECTION_H
#define EMBER_DAEMON_CONNECTION_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "daemon/budget.h"
#include "daemon/tls.h"
#include "lib/device/host_buffers.h"
#include "lib/base/log.h"
#include "lib/base/status.h"
#include "proto/frame.h"

/* Bytes read from the socket at a time into the connection's buffer. */
#define EM_READ_BUFFER_BYTES (64u * 1024u)

typedef struct em_connection em_connection;

/* What a connection needs from its owner (the server); the owner keeps it alive and
 * may rewrite the limits between frames (reload). */
typedef struct em_connection_settings {
    em_frame_limits frame_limits;
    uint64_t inflight_budget;   /* bytes of requests + answers before reading stops */
    uint32_t idle_timeout_ms;   /* 0: never */
    uint32_t frame_timeout_ms;  /* 0: never */
    uint32_t write_timeout_ms;  /* 0: never */
    uint32_t drain_linger_ms;   /* quiet time before a draining connection closes */
    em_memory_budget *memory;   /* the server's budget */
    em_host_buffers *buffers;   /* attachments are read into these (pinned memory where
                                 * the backend has it: its GPUs copy them directly); the
                                 * answers' attachments are freed there too */
} em_connection_settings;

/* Why a timer closed a connection. */
typedef enum em_connection_timeout {
    EM_CONNECTION_TIMEOUT_IDLE,
    EM_CONNECTION_TIMEOUT_FRAME,
    EM_CONNECTION_TIMEOUT_WRITE,
} em_connection_timeout;

typedef struct em_connection_hooks {
    /* The RpcMeta of a frame arrived (meta is the owner's to free). Returns the request
     * the body belongs to, or NULL when the frame was answered (or the connection
     * failed) from its meta alone: its body and attachment are then skipped. */
    void *(*meta)(void *context, em_connection *connection, const em_frame_header *frame,
                  uint8_t *meta);
    /* The body arrived (the owner's to free). Returns false when the request was
     * answered from it (the attachment is skipped); otherwise *answer_bytes is the most
     * its answer will hold, charged with the attachment before it is read. */
    bool (*body)(void *context, em_connection *connection, const em_frame_header *frame,
                 void *request, uint8_t *body, uint64_t *answer_bytes);
    /* The attachment arrived: the request runs. charged bytes stay in the budgets until
     * its answer is sent (em_connection_send) or given back (em_connection_release). */
    void (*frame)(void *context, em_connection *connection, void *request,
                  uint8_t *attachment, uint64_t charged);
    /* A request whose frame will not complete (the connection closed mid-frame). */
    void (*abandon)(void *context, void *request);
    /* The socket is closed (the connection may live on while requests finish). */
    void (*closed)(void *context, em_connection *connection);
    /* Counters: bytes read, bytes written, frames refused while reading, timeouts, waits
     * for memory. */
    void (*bytes_in)(void *context, uint64_t bytes);
    void (*bytes_out)(void *context, uint64_t bytes);
    void (*frame_rejected)(void *context);
    void (*timed_out)(void *context, em_connection_timeout which);
    /* A TLS handshake completed (ok) or was refused. */
    void (*tls_handshake)(void *context, bool ok);
    void *context;
} em_connection_hooks;

/* Creates a connection whose handle is initialised on loop, ready for uv_accept on
 * em_connection_stream; with tls, the connection speaks TLS (daemon/tls.h). settings,
 * hooks and tls are borrowed. NULL when out of memory. */
em_connection *em_connection_create(uv_loop_t *loop, const em_connection_settings *settings,
                                    const em_connection_hooks *hooks, const em_log *log,
                                    bool admin, em_tls_server *tls);

/* The stream to accept into. */
uv_stream_t *em_connection_stream(em_connection *connection);

/* Starts reading frames (after a successful accept). */
void em_connection_start(em_connection *connection);

/* Closes the socket now (answers not yet written are dropped). */
void em_connection_close(em_connection *connection);

/* Stops reading frames; what was received is still answered, then it closes. */
void em_connection_begin_closing(em_connection *connection);

/* The server is draining: frames are still read (and answered by the owner), and the
 * connection closes once nothing is in flight and no frame arrived for the linger. */
void em_connection_drain(em_connection *connection);

/* Resumes the connections of budget that wait for memory and now fit, oldest first
 * (the owner calls it when the budget schedules a wake). */
void em_connection_wake_waiting(em_memory_budget *budget);

/* Answers one error frame and closes the connection once everything is written. */
void em_connection_fail(em_connection *connection, uint64_t correlation_id, int method,
                        em_status status, const char *message);

/* Sends a response frame (header + meta + body) and an optional attachment; takes
 * ownership of both buffers (attachment freed with free()). The request's charged
 * bytes are given back and the answer's own bytes are charged until it is written. */
void em_connection_send(em_connection *connection, uint8_t *frame, size_t frame_length,
                        void *attachment, size_t attachment_length, uint64_t charged);

/* Gives back charged bytes that nothing will write (a request answered without them). */
void em_connection_release(em_connection *connection, uint64_t charged);

/* True when responses can still be written to the peer. */
bool em_connection_writable(const em_connection *connection);

bool em_connection_is_admin(const em_connection *connection);
const char *em_connection_peer(const em_connection *connection);

void em_connection_ref(em_connection *connection);
void em_connection_unref(em_connection *connection);

/* The owner's list of connections (intrusive links). */
em_connection *em_connection_next(const em_connection *connection);
void em_connection_link(em_connection **head, em_connection *connection);
void em_connection_unlink(em_connection **head, em_connection *connection);

/* ---- request ordering ------------------------------------------------------------- */

/* One request that runs off the loop, as the ordering queue sees it. */
typedef struct em_connection_work em_connection_work;
struct em_connection_work {
    bool write;       /* orders as a write */
    uint64_t charged; /* budget bytes it holds */
    /* Runs it (hands it to a worker); em_connection_work_done follows on the loop. */
    void (*start)(em_connection_work *work);
    /* Frees it without running it (the connection went away). */
    void (*abandon)(em_connection_work *work);
    em_connection_work *next;
};

/* A request was received: counts it outstanding (holding a reference) until
 * em_connection_request_finished. */
void em_connection_request_received(em_connection *connection);

/* Queues work in the connection's order; it starts as soon as the order allows. */
void em_connection_enqueue(em_connection *connection, em_connection_work *work);

/* Work that started (a write if write) has run and been answered; later work may
 * start. */
void em_connection_work_done(em_connection *connection, bool write);

/* Requests received and not yet answered. */
uint32_t em_connection_outstanding(const em_connection *connection);

/* One pointer the dispatcher may keep per connection (answers held back by a fault). */
void **em_connection_dispatch_slot(em_connection *connection);

/* Counts a request answered (or abandoned) and closes a CLOSING connection when it was
 * the last. Drops the request's reference. */
void em_connection_request_finished(em_connection *connection);

#endif
