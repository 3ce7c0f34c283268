#include "daemon/server.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/address.h"
#include "daemon/connection.h"
#include "daemon/dispatch.h"
#include "lib/base/failpoint.h"

/* Pending connections the kernel may queue per listener. */
#define LISTEN_BACKLOG 511

enum { LISTENER_DATA = 0, LISTENER_ADMIN = 1, LISTENER_COUNT = 2 };

static const char *const listener_names[LISTENER_COUNT] = {"data", "admin"};

struct em_server {
    uv_loop_t *loop;
    em_server_context *context;
    em_dispatch_settings settings;
    em_connection_settings connection_settings;
    em_connection_hooks hooks;
    em_memory_budget memory;
    uv_timer_t wake_timer; /* runs the budget's wakes on the next loop turn */
    uint32_t max_connections;
    uint32_t max_admin_connections;
    bool insecure;
    em_tls_server *tls[LISTENER_COUNT]; /* NULL: plaintext */
    em_tls_server *tls_owned;

    uv_tcp_t listeners[LISTENER_COUNT];
    bool listener_open[LISTENER_COUNT];
    char configured[LISTENER_COUNT][EM_ADDRESS_MAX];
    char bound[LISTENER_COUNT][EM_ADDRESS_MAX];

    em_connection *connections;
    uint32_t connection_count;       /* data and admin */
    uint32_t admin_connection_count; /* admin */

    bool draining, drain_reported;
    uv_timer_t drain_timer;
    void (*drained)(em_server *server, bool forced, void *context);
    void *drained_context;

    uint32_t open_handles;
    void (*closed)(void *context);
    void *closed_context;
};

static void check_drained(em_server *server);

/* ---- what connections report ---------------------------------------------------------- */

static void *on_meta(void *context, em_connection *connection, const em_frame_header *frame,
                     uint8_t *meta)
{
    em_server *server = context;
    return em_dispatch_meta(&server->settings, connection, frame, meta);
}

static bool on_body(void *context, em_connection *connection, const em_frame_header *frame,
                    void *request, uint8_t *body, uint64_t *answer_bytes)
{
    em_server *server = context;
    (void)connection;
    return em_dispatch_body(&server->settings, request, frame, body, answer_bytes);
}

static void on_frame(void *context, em_connection *connection, void *request,
                     uint8_t *attachment, uint64_t charged)
{
    em_server *server = context;
    em_dispatch_frame(&server->settings, connection, request, attachment, charged);
}

static void on_abandon(void *context, void *request)
{
    (void)context;
    em_dispatch_abandon(request);
}

static void on_timed_out(void *context, em_connection_timeout which)
{
    em_server *server = context;
    em_server_stats *stats = &server->context->stats;
    switch (which) {
    case EM_CONNECTION_TIMEOUT_IDLE:
        atomic_fetch_add_explicit(&stats->timeouts_idle, 1, memory_order_relaxed);
        return;
    case EM_CONNECTION_TIMEOUT_FRAME:
        atomic_fetch_add_explicit(&stats->timeouts_frame, 1, memory_order_relaxed);
        return;
    case EM_CONNECTION_TIMEOUT_WRITE:
        atomic_fetch_add_explicit(&stats->timeouts_write, 1, memory_order_relaxed);
        return;
    }
}

static void on_tls_handshake(void *context, bool ok)
{
    em_server *server = context;
    atomic_fetch_add_explicit(ok ? &server->context->stats.tls_handshakes
                                 : &server->context->stats.tls_handshakes_failed,
                              1, memory_order_relaxed);
}

static void on_wake(uv_timer_t *timer)
{
    em_server *server = timer->data;
    em_connection_wake_waiting(&server->memory);
}

static void schedule_wake(void *context)
{
    em_server *server = context;
    uv_timer_start(&server->wake_timer, on_wake, 0, 0);
}

static void on_connection_closed(void *context, em_connection *connection)
{
    em_server *server = context;
    em_connection_unlink(&server->connections, connection);
    server->connection_count--;
    atomic_fetch_sub(&server->context->stats.connections_current, 1);
    if (em_connection_is_admin(connection)) {
        server->admin_connection_count--;
        atomic_fetch_sub(&server->context->stats.admin_connections_current, 1);
    } else {
        atomic_fetch_sub(&server->context->data_connections, 1);
    }
    check_drained(server);
}

static void count_bytes_in(void *context, uint64_t bytes)
{
    em_server *server = context;
    atomic_fetch_add_explicit(&server->context->stats.bytes_in, bytes, memory_order_relaxed);
}

static void count_bytes_out(void *context, uint64_t bytes)
{
    em_server *server = context;
    atomic_fetch_add_explicit(&server->context->stats.bytes_out, bytes, memory_order_relaxed);
}

static void count_frame_rejected(void *context)
{
    em_server *server = context;
    atomic_fetch_add_explicit(&server->context->stats.frames_rejected, 1, memory_order_relaxed);
}

/* ---- configuration ------------------------------------------------------------------- */

static void apply_config(em_server *server, const em_daemon_config *config)
{
    const em_limits_config *limits = &config->limits;
    server->connection_settings = (em_connection_settings){
        .frame_limits = {
            .max_meta = limits->max_meta_bytes,
            .max_body = limits->max_body_bytes,
            .max_attachment = limits->max_attachment_bytes,
        },
        .inflight_budget = limits->connection_inflight_bytes,
        .idle_timeout_ms = limits->idle_timeout_ms,
        .frame_timeout_ms = limits->frame_timeout_ms,
        .write_timeout_ms = limits->write_timeout_ms,
        .drain_linger_ms = limits->drain_linger_ms,
        .memory = &server->memory,
        .buffers = server->context->backend != NULL ? server->context->backend->host_buffers
                                                    : NULL,
    };
    em_memory_budget_set_limit(&server->memory, limits->memory_bytes);
    server->max_connections = limits->max_connections;
    server->max_admin_connections = limits->max_admin_connections;
    server->insecure = config->insecure;
    server->settings.admin_token = config->admin_token;
    server->settings.data_token = config->data_token;
    server->settings.max_keys_per_request = limits->max_keys_per_request;
    server->settings.max_response_bytes = limits->max_response_bytes;
}

em_status em_server_create(uv_loop_t *loop, const em_daemon_config *config,
                           em_server_context *context, em_server **out, em_error *err)
{
    /* TLS first: it can fail, and nothing is registered with the loop before it */
    em_tls_server *tls = NULL;
    if (config->tls.enabled) {
        em_status status = em_tls_server_create(&config->tls, &tls, err);
        if (status != EM_OK)
            return status;
    }
    em_server *server = calloc(1, sizeof(*server));
    if (server == NULL) {
        em_tls_server_destroy(tls);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "server: out of memory");
    }
    server->tls_owned = tls;
    server->tls[LISTENER_DATA] = config->tls.data ? tls : NULL;
    server->tls[LISTENER_ADMIN] = config->tls.admin ? tls : NULL;
    server->loop = loop;
    server->context = context;
    server->settings.context = context;
    server->settings.memory = &server->memory;
    em_memory_budget_init(&server->memory, config->limits.memory_bytes, &context->stats,
                          schedule_wake, server);
    snprintf(server->configured[LISTENER_DATA], EM_ADDRESS_MAX, "%s", config->listen.data);
    snprintf(server->configured[LISTENER_ADMIN], EM_ADDRESS_MAX, "%s", config->listen.admin);
    snprintf(server->settings.admin_address, EM_ADDRESS_MAX, "%s", config->listen.admin);
    apply_config(server, config);
    server->hooks = (em_connection_hooks){.meta = on_meta, .body = on_body, .frame = on_frame,
                                          .abandon = on_abandon, .closed = on_connection_closed,
                                          .bytes_in = count_bytes_in, .bytes_out = count_bytes_out,
                                          .frame_rejected = count_frame_rejected,
                                          .timed_out = on_timed_out,
                                          .tls_handshake = on_tls_handshake, .context = server};
    uv_timer_init(loop, &server->wake_timer);
    server->wake_timer.data = server;
    uv_timer_init(loop, &server->drain_timer);
    server->drain_timer.data = server;
    server->open_handles = 2; /* the drain and wake timers */
    *out = server;
    return EM_OK;
}

void em_server_reconfigure(em_server *server, const em_daemon_config *config)
{
    apply_config(server, config);
}

const char *em_server_data_address(const em_server *server)
{
    return server->bound[LISTENER_DATA];
}

const char *em_server_admin_address(const em_server *server)
{
    return server->bound[LISTENER_ADMIN];
}

/* ---- accepting ----------------------------------------------------------------------- */

static void link_connection(em_server *server, em_connection *connection)
{
    em_connection_link(&server->connections, connection);
    server->connection_count++;
    atomic_fetch_add(&server->context->stats.connections_current, 1);
    atomic_fetch_add(&server->context->stats.connections_total, 1);
    if (em_connection_is_admin(connection)) {
        server->admin_connection_count++;
        atomic_fetch_add(&server->context->stats.admin_connections_current, 1);
    } else {
        atomic_fetch_add(&server->context->data_connections, 1);
    }
}

/* Refuses a connection over its listener's limit: the data listener's and the admin
 * listener's are separate, so data clients can never lock operators out. */
static bool refuse_over_limit(em_server *server, em_connection *connection)
{
    bool admin = em_connection_is_admin(connection);
    uint32_t count = admin ? server->admin_connection_count
                           : server->connection_count - server->admin_connection_count;
    uint32_t limit = admin ? server->max_admin_connections : server->max_connections;
    if (count <= limit)
        return false;
    atomic_fetch_add(admin ? &server->context->stats.admin_connections_rejected
                           : &server->context->stats.connections_rejected,
                     1);
    char message[128];
    snprintf(message, sizeof(message), "the %s listener already serves %u connections (%s)",
             admin ? "admin" : "data", limit, admin ? "max_admin_connections" : "max_connections");
    em_connection_fail(connection, 0, 0, EM_RESOURCE_EXHAUSTED, message);
    return true;
}

static void on_connection(uv_stream_t *listener, int status)
{
    em_server *server = listener->data;
    if (status < 0) {
        em_log_warning(server->context->log, "accept failed: %s", uv_strerror(status));
        return;
    }
    bool admin = listener == (uv_stream_t *)&server->listeners[LISTENER_ADMIN];
    em_connection *connection = em_connection_create(
        server->loop, &server->connection_settings, &server->hooks, server->context->log, admin,
        server->tls[admin ? LISTENER_ADMIN : LISTENER_DATA]);
    if (connection == NULL) {
        em_log_error(server->context->log, "out of memory for a new connection");
        return;
    }
    link_connection(server, connection);
    int rc = uv_accept(listener, em_connection_stream(connection));
    if (rc == 0 && em_failpoint_hit(EM_FAILPOINT_ACCEPT_FAIL, NULL))
        rc = UV_ECONNABORTED;
    if (rc != 0) {
        em_log_warning(server->context->log, "accept on the %s listener failed: %s",
                       admin ? "admin" : "data", uv_strerror(rc));
        em_connection_close(connection);
        return;
    }
    em_connection_start(connection);
    em_log_debug(server->context->log, "connection from %s on the %s listener",
                 em_connection_peer(connection), admin ? "admin" : "data");
    if (!admin && atomic_load(&server->context->drained)) {
        atomic_fetch_add(&server->context->stats.connections_rejected, 1);
        em_connection_fail(connection, 0, 0, EM_UNAVAILABLE,
                           "the server is drained for maintenance (DRAIN); connect to another "
                           "server or retry once it is back (UNDRAIN)");
        return;
    }
    refuse_over_limit(server, connection);
}

static em_status listen_on(em_server *server, int which, em_error *err)
{
    struct sockaddr_storage address;
    em_status status = em_address_parse(server->configured[which], &address, err);
    if (status != EM_OK)
        return status;
    uv_tcp_t *listener = &server->listeners[which];
    uv_tcp_init(server->loop, listener);
    listener->data = server;
    server->listener_open[which] = true;
    server->open_handles++;
    int rc = uv_tcp_bind(listener, (const struct sockaddr *)&address, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)listener, LISTEN_BACKLOG, on_connection);
    if (rc != 0)
        return em_error_set(err, EM_UNAVAILABLE, "cannot listen on %s (%s listener): %s",
                            server->configured[which], listener_names[which], uv_strerror(rc));
    int length = sizeof(address);
    uv_tcp_getsockname(listener, (struct sockaddr *)&address, &length);
    em_address_format((struct sockaddr *)&address, server->bound[which], EM_ADDRESS_MAX);
    if (em_address_is_loopback((struct sockaddr *)&address))
        return EM_OK;
    /* Reachable from other hosts: data needs a token or TLS unless the config says
     * otherwise, and tokens without TLS cross the network in plaintext. */
    bool tls = server->tls[which] != NULL;
    if (which == LISTENER_DATA && !server->settings.data_token.set && !tls) {
        if (!server->insecure)
            return em_error_set(err, EM_FAILED_PRECONDITION,
                                "the data listener %s is reachable from other hosts with neither "
                                "a data_token nor tls: set one, listen on loopback, or set "
                                "\"insecure\": true",
                                server->bound[which]);
        em_log_warning(server->context->log,
                       "the data listener %s is reachable from other hosts without a token or "
                       "TLS (\"insecure\": true)",
                       server->bound[which]);
    }
    if (!tls)
        em_log_warning(server->context->log,
                       "the %s listener %s is reachable from other hosts; its tokens cross the "
                       "network in plaintext (no tls)",
                       listener_names[which], server->bound[which]);
    return EM_OK;
}

em_status em_server_listen(em_server *server, em_error *err)
{
    for (int which = 0; which < LISTENER_COUNT; which++) {
        em_status status = listen_on(server, which, err);
        if (status != EM_OK)
            return status;
    }
    snprintf(server->settings.admin_address, EM_ADDRESS_MAX, "%s", server->bound[LISTENER_ADMIN]);
    return EM_OK;
}

/* ---- draining and closing ------------------------------------------------------------ */

static void on_server_handle_closed(uv_handle_t *handle)
{
    em_server *server = handle->data;
    if (--server->open_handles > 0)
        return;
    void (*closed)(void *) = server->closed;
    void *context = server->closed_context;
    em_tls_server_destroy(server->tls_owned);
    free(server);
    if (closed != NULL)
        closed(context);
}

static void close_listeners(em_server *server)
{
    for (int which = 0; which < LISTENER_COUNT; which++) {
        if (!server->listener_open[which])
            continue;
        server->listener_open[which] = false;
        uv_close((uv_handle_t *)&server->listeners[which], on_server_handle_closed);
    }
}

static void report_drained(em_server *server, bool forced)
{
    if (server->drain_reported)
        return;
    server->drain_reported = true;
    uv_timer_stop(&server->drain_timer);
    if (server->drained != NULL)
        server->drained(server, forced, server->drained_context);
}

static void check_drained(em_server *server)
{
    if (server->draining && server->connection_count == 0)
        report_drained(server, false);
}

static void close_all_connections(em_server *server)
{
    while (server->connections != NULL)
        em_connection_close(server->connections);
}

void em_server_close_connections(em_server *server)
{
    close_all_connections(server);
}

static void on_drain_timeout(uv_timer_t *timer)
{
    em_server *server = timer->data;
    em_log_warning(server->context->log,
                   "drain deadline passed with %u connections still busy; closing them",
                   server->connection_count);
    close_all_connections(server);
    report_drained(server, true);
}

void em_server_drain(em_server *server, uint32_t timeout_ms,
                     void (*drained)(em_server *server, bool forced, void *context),
                     void *context)
{
    server->draining = true;
    server->settings.draining = true;
    server->drained = drained;
    server->drained_context = context;
    close_listeners(server);
    for (em_connection *c = server->connections; c != NULL; c = em_connection_next(c))
        em_connection_drain(c);
    uv_timer_start(&server->drain_timer, on_drain_timeout, timeout_ms, 0);
    check_drained(server);
}

void em_server_close(em_server *server, void (*closed)(void *context), void *context)
{
    server->closed = closed;
    server->closed_context = context;
    server->draining = false;
    close_all_connections(server);
    close_listeners(server);
    uv_close((uv_handle_t *)&server->drain_timer, on_server_handle_closed);
    uv_close((uv_handle_t *)&server->wake_timer, on_server_handle_closed);
}
