/*
 * DESIGN: one client connection, as an explicit state machine.
 *
 *   HEADER     reading the 24 header bytes of the next frame
 *   MESSAGE    reading RpcMeta + body (lengths already checked against the limits)
 *   ATTACHMENT reading the attachment into its own 64-byte-aligned buffer
 *   BLOCKED    the in-flight budget is used up: the socket is not read until
 *              responses drain (unconsumed bytes wait in the read buffer)
 *   CLOSING    no more frames are read (fatal frame error, peer EOF, drain): the
 *              connection closes once every received request is answered and written
 *
 * connection_advance() in server.c is the one function that moves a connection
 * between the reading states. A connection is reference-counted: the open handle,
 * every request received and not yet answered, and every write in progress hold one,
 * so a request finishing on a worker after its client left never touches freed memory.
 *
 * Requests of one connection run in order where order matters: reads (pulls) may run
 * together, but a write (push, create, drop) waits for everything before it and
 * everything after it waits for the write. So a connection's later request always sees
 * the effects of its earlier ones, and pipelined pulls still run in parallel.
 */
#ifndef EMBER_DAEMON_CONNECTION_H
#define EMBER_DAEMON_CONNECTION_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "proto/frame.h"

/* Bytes read from the socket at a time into the connection's buffer. */
#define EM_READ_BUFFER_BYTES (64u * 1024u)

typedef struct em_server em_server;
typedef struct em_request em_request;

typedef enum em_connection_state {
    EM_CONNECTION_HEADER,
    EM_CONNECTION_MESSAGE,
    EM_CONNECTION_ATTACHMENT,
    EM_CONNECTION_BLOCKED,
    EM_CONNECTION_CLOSING,
} em_connection_state;

typedef struct em_connection em_connection;

struct em_connection {
    uv_tcp_t handle; /* first: handle.data points back here */
    uv_timer_t idle_timer;
    em_server *server;
    em_connection *previous, *next; /* the server's list of connections */
    bool admin;                     /* accepted on the admin listener */
    em_connection_state state;
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

    /* ordering of requests that run on workers */
    em_request *queue_head, *queue_tail;
    uint32_t running_reads;
    bool running_write;
};

/* ---- services server.c offers dispatch.c ---------------------------------------- */

/* Sends a response frame (header + meta + body) and an optional attachment; takes
 * ownership of both buffers (attachment freed with free()). charged bytes are released
 * from the in-flight budget when the write completes. */
void em_connection_send(em_connection *connection, uint8_t *frame, size_t frame_length,
                        void *attachment, size_t attachment_length, uint64_t charged);

/* Answers one error frame and closes the connection once everything is written. */
void em_connection_fail(em_connection *connection, uint64_t correlation_id, int method,
                        em_status status, const char *message);

/* Counts a request answered (or abandoned) and closes a CLOSING connection when it was
 * the last. Drops the request's reference. */
void em_connection_request_finished(em_connection *connection);

void em_connection_ref(em_connection *connection);
void em_connection_unref(em_connection *connection);

/* True when responses can still be written to the peer. */
bool em_connection_writable(const em_connection *connection);

#endif
