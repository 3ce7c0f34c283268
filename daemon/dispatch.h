/*
 * DESIGN: from a complete frame to a response.
 *
 * The dispatcher decodes RpcMeta and the body (a frame whose meta or body does not
 * decode is a framing error: one error response, then the connection closes), looks
 * the method up in one table that says for each method its body type, who may call it,
 * whether it orders as a read or a write, and its handler, checks the caller's token,
 * and then either answers on the loop thread (ping, health, and every error found so
 * far) or queues the request for a worker in the connection's order (connection.h).
 * Handlers run on workers, fill in a response, and the loop thread writes it.
 */
#ifndef EMBER_DAEMON_DISPATCH_H
#define EMBER_DAEMON_DISPATCH_H

#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stdint.h>

#include "daemon/connection.h"
#include "daemon/daemon_config.h"
#include "daemon/executor.h"
#include "daemon/server.h"
#include "lib/base/status.h"

/* What dispatching needs from the server; the loop thread owns it (reloads rewrite
 * it between frames). */
typedef struct em_dispatch_settings {
    em_server_context *context;
    em_token admin_token;
    em_token data_token;
    char admin_address[EM_ADDRESS_MAX];
    uint64_t max_keys_per_request;
    uint64_t max_response_bytes;
} em_dispatch_settings;

const em_dispatch_settings *em_server_settings(const em_server *server);

struct em_request {
    em_job job; /* first: the executor hands jobs back */
    em_connection *connection;
    em_server_context *context;
    int method;
    int slot; /* index in the method table: per-method counters */
    bool write; /* orders as a write */
    uint64_t correlation_id;
    uint64_t received_ms, deadline_ms; /* monotonic; deadline 0 = none */
    uint8_t *message;                  /* meta + body bytes */
    ProtobufCMessage *body;            /* decoded request */
    uint8_t *attachment;
    uint64_t attachment_length;
    uint64_t charged; /* request bytes in the connection's budget */
    uint64_t max_keys_per_request, max_response_bytes;
    em_status (*handler)(em_request *request, em_error *err);
    /* the answer */
    em_error error;
    uint8_t *response_frame;
    size_t response_frame_length;
    void *response_attachment;
    size_t response_attachment_length;
    em_request *next; /* the connection's queue */
};

/* A complete frame: takes ownership of message (meta + body) and attachment. */
void em_dispatch_frame(em_connection *connection, const em_frame_header *frame, uint8_t *message,
                       uint8_t *attachment, uint64_t charged);

/* The connection is going away: frees the requests still queued (never run). */
void em_dispatch_abandon_queue(em_connection *connection);

/* Handlers call this once with their response body (and attachment, taken over and
 * freed with free()). Errors: RESOURCE_EXHAUSTED. */
em_status em_request_respond(em_request *request, const ProtobufCMessage *body, void *attachment,
                             size_t attachment_length, em_error *err);

/* The method table, for stats: names by slot. */
size_t em_dispatch_method_count(void);
const char *em_dispatch_method_name(size_t slot);

/* Milliseconds on the monotonic clock (usable from any thread). */
uint64_t em_monotonic_ms(void);

/* Handlers (daemon/handlers.c). */
em_status em_handle_pull(em_request *request, em_error *err);
em_status em_handle_push(em_request *request, em_error *err);
em_status em_handle_ping(em_request *request, em_error *err);
em_status em_handle_health(em_request *request, em_error *err);
em_status em_handle_create_table(em_request *request, em_error *err);
em_status em_handle_drop_table(em_request *request, em_error *err);
em_status em_handle_list_tables(em_request *request, em_error *err);
em_status em_handle_stats(em_request *request, em_error *err);

#endif
