/*
 * DESIGN: one TCP connection to one server, and the requests in flight on it.
 *
 * A connection is a blocking socket that is only ever written and read with
 * MSG_DONTWAIT after poll(2) said it was ready, so the client writes a large pipelined
 * request a piece at a time while it reads the responses the server sends meanwhile:
 * neither side can fill its buffers and wait for the other.
 *
 * Requests in flight form one list in send order; `unsent` points at the first one not
 * completely written, and consecutive frames are gathered into one sendmsg. Responses
 * are matched to the list by correlation id in any order; a PULL response's vectors
 * are read straight into the caller's output (one server) or into the request's own
 * buffer (several servers, merged later).
 *
 * A request belongs to its call until the call goes away early (timeout, client
 * destroyed); then it is abandoned: never-started frames are dropped, a half-written
 * frame keeps a copy of its unsent bytes so the stream stays whole, and a late
 * response is read and thrown away, after which the connection frees the request.
 *
 * Any I/O error, EOF or malformed frame fails the connection: the socket is closed
 * and every request on it fails with the reason (UNAVAILABLE for I/O, INTERNAL for a
 * response that breaks the protocol, the server's own status for a frame the server
 * rejected). The client reopens it on its next call.
 */
#ifndef EMBER_CLIENTS_CLIENT_CONNECTION_H
#define EMBER_CLIENTS_CLIENT_CONNECTION_H

#include <stdbool.h>
#include <stdint.h>

#include "clients/client_frame.h"
#include "clients/client_servers.h"
#include "clients/client_tls.h"
#include "lib/base/status.h"

typedef struct em__client_request {
    struct em__client_request *next, *previous; /* in the connection's list */
    bool linked;                               /* in a connection's list */
    void *owner;                               /* the call; NULL once abandoned */
    const em__client_server *server;
    uint64_t correlation_id;
    int method;
    em__client_frame frame;
    uint64_t sent; /* bytes of frame written */
    /* outcome */
    bool done;
    em_error error;              /* status OK or why the request failed */
    ProtobufCMessage *response;  /* unpacked body of an OK response */
    /* PULL: `vectors` output vectors go to out (out_capacity floats) or, with out
     * NULL, into scratch, allocated once the response tells dim */
    uint64_t vectors;
    float *out;
    uint64_t out_capacity;
    float *scratch;
    uint32_t dim;
} em__client_request;

typedef struct em__client_connection {
    const em__client_server *server;
    const em__client_tls *tls; /* NULL: plaintext */
    int fd;                    /* -1 while closed */
    SSL *ssl;                  /* the TLS session on fd, with tls */
    em__client_request *head, *tail;
    em__client_request *unsent; /* first request of the list not completely written */
    uint32_t in_flight;         /* requests in the list */
    em__client_reader reader;
    em__client_request *reading; /* whose attachment is being read; NULL: discarded */
} em__client_connection;

/* A request for `owner` (malloc'ed, zeroed apart from what is given). NULL when out
 * of memory. */
em__client_request *em__client_request_create(void *owner, const em__client_server *server,
                                              uint64_t correlation_id, int method);
/* Frees a request that is in no list. NULL is ignored. */
void em__client_request_destroy(em__client_request *request);

/* tls (borrowed; NULL for plaintext) is used by every open. */
void em__client_connection_init(em__client_connection *connection,
                                const em__client_server *server, const em__client_tls *tls);
/* Closes the socket; abandoned requests are freed, the others unlinked and failed. */
void em__client_connection_deinit(em__client_connection *connection);

/* Resolves the server's name and connects (one attempt over its addresses) within
 * timeout_ms, with the TLS handshake when the connection has tls. Errors: UNAVAILABLE
 * naming the server and the reason, UNAUTHENTICATED for a refused certificate. */
em_status em__client_connection_open(em__client_connection *connection, int timeout_ms,
                                     em_error *err);

/* Appends a request (with its frame built) to the connection's list. */
void em__client_connection_enqueue(em__client_connection *connection,
                                   em__client_request *request);

/* poll(2) events the connection waits for; 0 when closed. */
short em__client_connection_events(const em__client_connection *connection);

/* Writes and reads as far as the socket allows without blocking, after poll reported
 * revents. Failures fail the connection (see above); nothing is returned. */
void em__client_connection_service(em__client_connection *connection, short revents);

/* The request's call is gone: drop, detach or orphan it as described above. */
void em__client_connection_abandon(em__client_connection *connection,
                                   em__client_request *request);

/* Closes the socket and fails every request on it with status and the formatted
 * message (already naming the server). */
void em__client_connection_fail(em__client_connection *connection, em_status status,
                                const char *format, ...) __attribute__((format(printf, 3, 4)));

#endif
