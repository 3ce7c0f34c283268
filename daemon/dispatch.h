/*
 * DESIGN: from a complete frame to a response.
 *
 * The dispatcher decodes RpcMeta and the body (a frame whose meta or body does not
 * decode is a framing error: one error response, then the connection closes), looks
 * the method up in the method table (daemon/methods.h: body type, listener, access,
 * ordering, handler), checks the caller's token, and then either answers on the loop
 * thread (LOOP methods, and every error found so far) or queues the request for a
 * worker in the connection's order (daemon/connection.h). Handlers run on workers,
 * fill in a response, and the loop thread writes it.
 */
#ifndef EMBER_DAEMON_DISPATCH_H
#define EMBER_DAEMON_DISPATCH_H

#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stdint.h>

#include "daemon/connection.h"
#include "daemon/context.h"
#include "daemon/daemon_config.h"
#include "daemon/executor.h"
#include "daemon/methods.h"
#include "lib/base/status.h"

/* What dispatching needs; the server owns it (reloads rewrite it between frames). */
typedef struct em_dispatch_settings {
    em_server_context *context;
    em_token admin_token;
    em_token data_token;
    char admin_address[EM_ADDRESS_MAX];
    uint64_t max_keys_per_request;
    uint64_t max_response_bytes;
} em_dispatch_settings;

struct em_request {
    em_connection_work work; /* the connection's ordering queue */
    em_job job;              /* the executor's queue */
    em_connection *connection;
    em_server_context *context;
    int method;
    const em_method_info *info; /* NULL for a method this server does not serve */
    uint64_t correlation_id;
    uint64_t received_ms, deadline_ms; /* monotonic; deadline 0 = none */
    uint8_t *message;                  /* meta + body bytes */
    ProtobufCMessage *body;            /* decoded request */
    uint8_t *attachment;
    uint64_t attachment_length;
    uint64_t max_keys_per_request, max_response_bytes;
    /* the answer */
    em_error error;
    uint8_t *response_frame;
    size_t response_frame_length;
    void *response_attachment;
    size_t response_attachment_length;
    em_request *held_next; /* faults: answers held back to be sent last-first */
};

/* A complete frame: takes ownership of message (meta + body) and attachment. */
void em_dispatch_frame(const em_dispatch_settings *settings, em_connection *connection,
                       const em_frame_header *frame, uint8_t *message, uint8_t *attachment,
                       uint64_t charged);

/* Handlers call this once with their response body (of the method's response type) and
 * attachment (taken over and freed with free()). Errors: RESOURCE_EXHAUSTED, INTERNAL
 * for a body of another type. */
em_status em_request_respond(em_request *request, const ProtobufCMessage *body, void *attachment,
                             size_t attachment_length, em_error *err);

#endif
