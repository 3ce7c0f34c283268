/*
 * DESIGN: emberd's network side, on one libuv loop thread.
 *
 * Two listeners (data and admin) accept connections; each connection reads frames with
 * every length checked against the configured limits before anything is allocated,
 * hands complete frames to the dispatcher (daemon/dispatch.h) and writes responses as
 * they come back from the workers. Flow control is per connection (an in-flight byte
 * budget), idle connections are closed after idle_timeout_ms, and draining stops
 * accepting and reading, answers what was received, then reports.
 */
#ifndef EMBER_DAEMON_SERVER_H
#define EMBER_DAEMON_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "daemon/context.h"
#include "daemon/daemon_config.h"
#include "lib/base/status.h"

typedef struct em_server em_server;

/* Copies what it needs from config (limits, tokens, addresses). */
em_status em_server_create(uv_loop_t *loop, const em_daemon_config *config,
                           em_server_context *context, em_server **out, em_error *err);

/* Binds and listens on the data and admin addresses. Errors: UNAVAILABLE naming the
 * address and the system error. */
em_status em_server_listen(em_server *server, em_error *err);

/* The bound addresses ("127.0.0.1:7070"), valid after em_server_listen. */
const char *em_server_data_address(const em_server *server);
const char *em_server_admin_address(const em_server *server);

/* Applies the reloadable parts of config (limits, tokens) to new frames and to the
 * budgets and timeouts of open connections. */
void em_server_reconfigure(em_server *server, const em_daemon_config *config);

/* Stops accepting and reading; calls drained once every received request has been
 * answered and every connection closed, or after timeout_ms with forced = true (the
 * remaining connections are closed then). */
void em_server_drain(em_server *server, uint32_t timeout_ms,
                     void (*drained)(em_server *server, bool forced, void *context),
                     void *context);

/* Closes every handle; closed runs once libuv has released them and the server is
 * freed. */
void em_server_close(em_server *server, void (*closed)(void *context), void *context);

/* Closes every open connection now (answers not yet written are dropped); the
 * listeners stay open. */
void em_server_close_connections(em_server *server);

#endif
