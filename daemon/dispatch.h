/*
 * DESIGN: from a frame to a response, in the stages the connection reads it.
 *
 *   meta  RpcMeta is decoded (a frame whose meta does not decode is a framing error:
 *         one error response, then the connection closes), the method looked up in the
 *         method table (daemon/methods.h), the caller's token and right to the listener
 *         checked, and the lengths checked against the method (no attachment where it
 *         takes none) and the server's memory budget. A refusal is answered at once and
 *         the connection skips the rest of the frame unread.
 *   body  the body is decoded (failing to is a framing error); a CSR method's admit
 *         check sees the attachment length and says how large the answer can be, which
 *         the connection charges before reading the attachment.
 *   frame the request answers on the loop thread (LOOP methods) or queues for a worker
 *         in the connection's order (daemon/connection.h). Handlers run on workers,
 *         fill in a response, and the loop thread writes it.
 *
 * While the server drains every new request is answered UNAVAILABLE.
 */
#ifndef EMBER_DAEMON_DISPATCH_H
#define EMBER_DAEMON_DISPATCH_H

#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stdint.h>

#include "daemon/budget.h"
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
    const em_memory_budget *memory;
    bool draining;
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
    uint64_t received_ns;              /* uv_hrtime() when its meta was read */
    uint64_t started_ns, finished_ns;  /* on its worker (0 for methods run on the loop) */
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

/* The meta of a frame (freed here): the request its body belongs to, or NULL when the
 * frame was answered from its meta (or the connection failed). */
em_request *em_dispatch_meta(const em_dispatch_settings *settings, em_connection *connection,
                             const em_frame_header *frame, uint8_t *meta);

/* The body of request's frame (freed here): false when the request was answered (or
 * the connection failed) from it; otherwise *answer_bytes is the most its answer and
 * its own bookkeeping will hold. */
bool em_dispatch_body(const em_dispatch_settings *settings, em_request *request,
                      const em_frame_header *frame, uint8_t *body, uint64_t *answer_bytes);

/* The attachment arrived (taken over): the request runs; charged bytes are released
 * when its answer is sent. */
void em_dispatch_frame(const em_dispatch_settings *settings, em_connection *connection,
                       em_request *request, uint8_t *attachment, uint64_t charged);

/* Frees a request whose frame will not complete. */
void em_dispatch_abandon(em_request *request);

/* Handlers call this once with their response body (of the method's response type) and
 * attachment (taken over and freed with free()). Errors: RESOURCE_EXHAUSTED, INTERNAL
 * for a body of another type. */
em_status em_request_respond(em_request *request, const ProtobufCMessage *body, void *attachment,
                             size_t attachment_length, em_error *err);

#endif
