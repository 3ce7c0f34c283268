/*
 * DESIGN: the metrics listener, a small read-only HTTP/1.1 server on the loop thread.
 *
 * It serves GET (and HEAD) of two paths: /metrics (daemon/metrics.h; OpenMetrics when
 * the Accept header asks for it) and /healthz (200 "serving", 503 with the state
 * otherwise, for load balancers). Any other path is 404, any other method 405. It
 * needs no token and changes nothing.
 *
 * Requests are parsed by Debian's http-parser. Each connection answers one request and
 * closes. What it holds is bounded: at most EM_HTTP_MAX_CONNECTIONS connections (more
 * are closed at once), EM_HTTP_MAX_HEADER_BYTES of request (more: 431), and
 * EM_HTTP_TIMEOUT_MS to send it (slower senders are closed); refusals are counted in
 * http_requests_refused. None of it touches the data or admin listeners.
 */
#ifndef EMBER_DAEMON_HTTP_H
#define EMBER_DAEMON_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <uv.h>

#include "daemon/stats.h"
#include "lib/base/status.h"

#define EM_HTTP_MAX_CONNECTIONS 16u
#define EM_HTTP_MAX_HEADER_BYTES 8192u
#define EM_HTTP_TIMEOUT_MS 5000u

typedef struct em_http_routes {
    /* GET /metrics: *body malloc'ed */
    em_status (*metrics)(void *context, bool openmetrics, char **body, size_t *length,
                         em_error *err);
    /* GET /healthz: whether the server takes requests, and its state's name */
    bool (*healthy)(void *context, const char **state);
    void *context;
} em_http_routes;

typedef struct em_http_server em_http_server;

/* Binds and listens on address ("127.0.0.1:9464"). stats (kept) counts scrapes and
 * refusals. Errors: INVALID_ARGUMENT for the address, UNAVAILABLE naming it and the
 * system error. */
em_status em_http_server_start(uv_loop_t *loop, const char *address, const em_http_routes *routes,
                               em_server_stats *stats, em_http_server **out, em_error *err);

/* The bound address ("127.0.0.1:9464"). */
const char *em_http_server_address(const em_http_server *server);

/* Closes the listener and every connection; the server is freed once libuv let go. */
void em_http_server_close(em_http_server *server);

#endif
