#include "daemon/http.h"

#include <http_parser.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "daemon/address.h"
#include "daemon/daemon_config.h"
#include "daemon/metrics.h"

#define URL_MAX 256
#define ACCEPT_MAX 256
#define FIELD_MAX 32

typedef struct http_connection http_connection;

struct em_http_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    em_http_routes routes;
    em_server_stats *stats;
    char bound[EM_ADDRESS_MAX];
    http_connection *connections; /* open ones, linked */
    uint32_t connection_count;
    uint32_t open_handles; /* the listener's and the connections' */
    bool closing;
};

struct http_connection {
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_write_t write;
    http_parser parser;
    em_http_server *server;
    http_connection *previous, *next;
    uint32_t open_handles;
    size_t received;
    bool answered;
    char url[URL_MAX + 1];
    size_t url_length;
    bool url_too_long;
    char field[FIELD_MAX + 1];
    size_t field_length;
    bool after_value; /* the last header callback was a value */
    char accept[ACCEPT_MAX + 1];
    size_t accept_length;
    char read_buffer[4096];
    char *response;
};

/* ---- closing -------------------------------------------------------------------------- */

static void server_handle_closed(em_http_server *server)
{
    if (--server->open_handles == 0 && server->closing)
        free(server);
}

static void connection_handle_closed(uv_handle_t *handle)
{
    http_connection *connection = handle->data;
    if (--connection->open_handles > 0)
        return;
    em_http_server *server = connection->server;
    free(connection->response);
    free(connection);
    server_handle_closed(server);
}

static void close_connection(http_connection *connection)
{
    em_http_server *server = connection->server;
    if (uv_is_closing((uv_handle_t *)&connection->tcp))
        return;
    if (connection->previous != NULL)
        connection->previous->next = connection->next;
    else
        server->connections = connection->next;
    if (connection->next != NULL)
        connection->next->previous = connection->previous;
    server->connection_count--;
    uv_close((uv_handle_t *)&connection->timer, connection_handle_closed);
    uv_close((uv_handle_t *)&connection->tcp, connection_handle_closed);
}

static void refused(em_http_server *server)
{
    atomic_fetch_add_explicit(&server->stats->http_requests_refused, 1, memory_order_relaxed);
}

/* ---- answering ------------------------------------------------------------------------ */

static void on_written(uv_write_t *write, int status)
{
    (void)status;
    close_connection(write->data);
}

static const char *reason_of(int code)
{
    switch (code) {
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 414:
        return "URI Too Long";
    case 431:
        return "Request Header Fields Too Large";
    case 500:
        return "Internal Server Error";
    case 503:
        return "Service Unavailable";
    default:
        return "Error";
    }
}

/* Sends the whole answer (body taken over; NULL for none) and closes after it. */
static void answer(http_connection *connection, int code, const char *type, char *body,
                   size_t length, bool head)
{
    if (connection->answered) {
        free(body);
        return;
    }
    connection->answered = true;
    uv_read_stop((uv_stream_t *)&connection->tcp);
    uv_timer_stop(&connection->timer);
    if (code != 200 && code != 503)
        refused(connection->server);
    char header[256];
    int header_length =
        snprintf(header, sizeof(header),
                 "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s"
                 "Connection: close\r\n\r\n",
                 code, reason_of(code), type, length, code == 405 ? "Allow: GET, HEAD\r\n" : "");
    size_t body_length = head ? 0 : length;
    connection->response = malloc((size_t)header_length + body_length);
    if (connection->response == NULL) {
        free(body);
        close_connection(connection);
        return;
    }
    memcpy(connection->response, header, (size_t)header_length);
    if (body_length > 0)
        memcpy(connection->response + header_length, body, body_length);
    free(body);
    uv_buf_t buffer = uv_buf_init(connection->response, (unsigned)(header_length + body_length));
    connection->write.data = connection;
    if (uv_write(&connection->write, (uv_stream_t *)&connection->tcp, &buffer, 1, on_written) != 0)
        close_connection(connection);
}

static void answer_text(http_connection *connection, int code, const char *text, bool head)
{
    char *body = strdup(text);
    answer(connection, code, "text/plain; charset=utf-8", body, body != NULL ? strlen(text) : 0,
           head);
}

/* Whether the request's path (the URL up to any query) is path. */
static bool path_is(const http_connection *connection, const char *path)
{
    size_t length = strcspn(connection->url, "?#");
    return length == strlen(path) && strncmp(connection->url, path, length) == 0;
}

static void route(http_connection *connection)
{
    em_http_server *server = connection->server;
    int method = connection->parser.method;
    bool head = method == HTTP_HEAD;
    if (method != HTTP_GET && !head) {
        answer_text(connection, 405, "only GET and HEAD are served here\n", false);
        return;
    }
    if (connection->url_too_long) {
        answer_text(connection, 414, "the path is too long\n", head);
        return;
    }
    if (path_is(connection, "/metrics")) {
        bool openmetrics = em_metrics_wants_openmetrics(connection->accept);
        char *body = NULL;
        size_t length = 0;
        em_error err;
        if (server->routes.metrics(server->routes.context, openmetrics, &body, &length, &err) !=
            EM_OK) {
            char text[EM_ERROR_MESSAGE_MAX + 2];
            snprintf(text, sizeof(text), "%s\n", err.message);
            answer_text(connection, 500, text, head);
            return;
        }
        atomic_fetch_add_explicit(&server->stats->metrics_scrapes, 1, memory_order_relaxed);
        answer(connection, 200, openmetrics ? EM_METRICS_OPENMETRICS_TYPE : EM_METRICS_TEXT_TYPE,
               body, length, head);
        return;
    }
    if (path_is(connection, "/healthz")) {
        const char *state = "";
        bool healthy = server->routes.healthy(server->routes.context, &state);
        char text[64];
        snprintf(text, sizeof(text), "%s\n", state);
        answer_text(connection, healthy ? 200 : 503, text, head);
        return;
    }
    answer_text(connection, 404, "not found: this listener serves /metrics and /healthz\n", head);
}

/* ---- parsing -------------------------------------------------------------------------- */

static http_connection *connection_of(http_parser *parser)
{
    return parser->data;
}

static int on_url(http_parser *parser, const char *at, size_t length)
{
    http_connection *connection = connection_of(parser);
    if (connection->url_length + length > URL_MAX) {
        connection->url_too_long = true;
        return 0;
    }
    memcpy(connection->url + connection->url_length, at, length);
    connection->url_length += length;
    connection->url[connection->url_length] = '\0';
    return 0;
}

static int on_header_field(http_parser *parser, const char *at, size_t length)
{
    http_connection *connection = connection_of(parser);
    if (connection->after_value) { /* a new field (a field may come in pieces) */
        connection->field_length = 0;
        connection->after_value = false;
    }
    size_t room = FIELD_MAX - connection->field_length;
    size_t take = length < room ? length : room;
    memcpy(connection->field + connection->field_length, at, take);
    connection->field_length += take;
    connection->field[connection->field_length] = '\0';
    return 0;
}

static int on_header_value(http_parser *parser, const char *at, size_t length)
{
    http_connection *connection = connection_of(parser);
    connection->after_value = true;
    if (strcasecmp(connection->field, "accept") != 0)
        return 0;
    size_t room = ACCEPT_MAX - connection->accept_length;
    size_t take = length < room ? length : room;
    memcpy(connection->accept + connection->accept_length, at, take);
    connection->accept_length += take;
    connection->accept[connection->accept_length] = '\0';
    return 0;
}

static int on_message_complete(http_parser *parser)
{
    route(connection_of(parser));
    return 1; /* one request per connection: stop here */
}

static const http_parser_settings parser_settings = {
    .on_url = on_url,
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_message_complete = on_message_complete,
};

/* ---- reading -------------------------------------------------------------------------- */

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buffer)
{
    (void)suggested;
    http_connection *connection = handle->data;
    *buffer = uv_buf_init(connection->read_buffer, sizeof(connection->read_buffer));
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buffer)
{
    http_connection *connection = stream->data;
    if (nread == 0)
        return;
    if (nread < 0) {
        if (!connection->answered)
            close_connection(connection);
        return;
    }
    connection->received += (size_t)nread;
    if (connection->received > EM_HTTP_MAX_HEADER_BYTES) {
        answer_text(connection, 431, "the request is larger than 8192 bytes\n", false);
        return;
    }
    size_t parsed = http_parser_execute(&connection->parser, &parser_settings, buffer->base,
                                        (size_t)nread);
    if (connection->answered)
        return;
    enum http_errno error = HTTP_PARSER_ERRNO(&connection->parser);
    if (error != HPE_OK || parsed != (size_t)nread) {
        char text[160];
        snprintf(text, sizeof(text), "bad request: %s\n", http_errno_description(error));
        answer_text(connection, 400, text, false);
    }
}

static void on_timeout(uv_timer_t *timer)
{
    http_connection *connection = timer->data;
    refused(connection->server);
    close_connection(connection); /* a slow sender gets no answer, only the close */
}

static void on_connection(uv_stream_t *listener, int status)
{
    em_http_server *server = listener->data;
    if (status != 0)
        return;
    http_connection *connection = calloc(1, sizeof(*connection));
    if (connection == NULL)
        return;
    connection->server = server;
    uv_tcp_init(server->loop, &connection->tcp);
    uv_timer_init(server->loop, &connection->timer);
    connection->tcp.data = connection;
    connection->timer.data = connection;
    connection->open_handles = 2;
    server->open_handles++;
    connection->next = server->connections;
    if (server->connections != NULL)
        server->connections->previous = connection;
    server->connections = connection;
    server->connection_count++;
    if (uv_accept(listener, (uv_stream_t *)&connection->tcp) != 0) {
        close_connection(connection);
        return;
    }
    if (server->connection_count > EM_HTTP_MAX_CONNECTIONS) {
        refused(server);
        close_connection(connection);
        return;
    }
    http_parser_init(&connection->parser, HTTP_REQUEST);
    connection->parser.data = connection;
    uv_timer_start(&connection->timer, on_timeout, EM_HTTP_TIMEOUT_MS, 0);
    uv_read_start((uv_stream_t *)&connection->tcp, on_alloc, on_read);
}

/* ---- the server ----------------------------------------------------------------------- */

static void listener_closed(uv_handle_t *handle)
{
    server_handle_closed(handle->data);
}

em_status em_http_server_start(uv_loop_t *loop, const char *address, const em_http_routes *routes,
                               em_server_stats *stats, em_http_server **out, em_error *err)
{
    struct sockaddr_storage storage;
    em_status status = em_address_parse(address, &storage, err);
    if (status != EM_OK)
        return em_error_prefix(err, "listen.metrics: ");
    em_http_server *server = calloc(1, sizeof(*server));
    if (server == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "metrics listener: out of memory");
    server->loop = loop;
    server->routes = *routes;
    server->stats = stats;
    uv_tcp_init(loop, &server->listener);
    server->listener.data = server;
    server->open_handles = 1;
    int rc = uv_tcp_bind(&server->listener, (const struct sockaddr *)&storage, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&server->listener, 64, on_connection);
    if (rc != 0) {
        em_http_server_close(server);
        return em_error_set(err, EM_UNAVAILABLE, "cannot listen on %s (metrics listener): %s",
                            address, uv_strerror(rc));
    }
    int length = sizeof(storage);
    uv_tcp_getsockname(&server->listener, (struct sockaddr *)&storage, &length);
    em_address_format((struct sockaddr *)&storage, server->bound, sizeof(server->bound));
    *out = server;
    return EM_OK;
}

const char *em_http_server_address(const em_http_server *server)
{
    return server->bound;
}

void em_http_server_close(em_http_server *server)
{
    server->closing = true;
    while (server->connections != NULL)
        close_connection(server->connections);
    uv_close((uv_handle_t *)&server->listener, listener_closed);
}
