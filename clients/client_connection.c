#include "clients/client_connection.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* iovec entries gathered into one sendmsg (frames of several requests together). */
#define SEND_PIECES_MAX 64

/* ---- requests --------------------------------------------------------------------- */

em__client_request *em__client_request_create(void *owner, const em__client_server *server,
                                              uint64_t correlation_id, int method)
{
    em__client_request *request = calloc(1, sizeof(*request));
    if (request == NULL)
        return NULL;
    request->owner = owner;
    request->server = server;
    request->correlation_id = correlation_id;
    request->method = method;
    return request;
}

void em__client_request_destroy(em__client_request *request)
{
    if (request == NULL)
        return;
    em__client_frame_deinit(&request->frame);
    if (request->response != NULL)
        protobuf_c_message_free_unpacked(request->response, NULL);
    free(request->scratch);
    free(request);
}

/* Records the outcome; the first error a request gets is the one it keeps. */
static void request_set_error(em__client_request *request, const em_error *error)
{
    if (request->error.status == EM_OK)
        em_error_copy(&request->error, error);
}

/* ---- the list --------------------------------------------------------------------- */

static void unlink_request(em__client_connection *connection, em__client_request *request)
{
    if (connection->unsent == request)
        connection->unsent = request->next;
    if (connection->reading == request) {
        connection->reading = NULL;
        em__client_reader_set_target(&connection->reader, NULL);
    }
    if (request->previous != NULL)
        request->previous->next = request->next;
    else
        connection->head = request->next;
    if (request->next != NULL)
        request->next->previous = request->previous;
    else
        connection->tail = request->previous;
    request->next = request->previous = NULL;
    request->linked = false;
    connection->in_flight--;
}

void em__client_connection_enqueue(em__client_connection *connection,
                                   em__client_request *request)
{
    request->previous = connection->tail;
    request->next = NULL;
    if (connection->tail != NULL)
        connection->tail->next = request;
    else
        connection->head = request;
    connection->tail = request;
    if (connection->unsent == NULL)
        connection->unsent = request;
    request->linked = true;
    connection->in_flight++;
}

/* The request has its answer (or its failure): it leaves the list; an abandoned one
 * is freed, the others wait for their call to collect them. */
static void complete_request(em__client_connection *connection, em__client_request *request)
{
    unlink_request(connection, request);
    request->done = true;
    if (request->owner == NULL)
        em__client_request_destroy(request);
}

static em__client_request *find_request(const em__client_connection *connection,
                                        uint64_t correlation_id)
{
    for (em__client_request *r = connection->head; r != NULL; r = r->next)
        if (r->correlation_id == correlation_id)
            return r;
    return NULL;
}

/* ---- lifecycle -------------------------------------------------------------------- */

void em__client_connection_init(em__client_connection *connection,
                                const em__client_server *server, const em__client_tls *tls)
{
    memset(connection, 0, sizeof(*connection));
    connection->server = server;
    connection->tls = tls;
    connection->fd = -1;
    em_frame_limits limits = em_frame_default_limits();
    em__client_reader_init(&connection->reader, &limits);
}

static void fail_requests(em__client_connection *connection, const em_error *error)
{
    while (connection->head != NULL) {
        em__client_request *request = connection->head;
        request_set_error(request, error);
        complete_request(connection, request);
    }
}

static void close_socket(em__client_connection *connection)
{
    SSL_free(connection->ssl);
    connection->ssl = NULL;
    if (connection->fd >= 0)
        close(connection->fd);
    connection->fd = -1;
    em_frame_limits limits = connection->reader.limits;
    em__client_reader_deinit(&connection->reader);
    em__client_reader_init(&connection->reader, &limits);
    connection->reading = NULL;
}

void em__client_connection_fail(em__client_connection *connection, em_status status,
                                const char *format, ...)
{
    em_error error;
    va_list args;
    va_start(args, format);
    em_error_setv(&error, status, format, args);
    va_end(args);
    close_socket(connection);
    fail_requests(connection, &error);
}

void em__client_connection_deinit(em__client_connection *connection)
{
    em__client_connection_fail(connection, EM_CANCELLED, "server %s: the client was closed",
                               connection->server->name);
    em__client_reader_deinit(&connection->reader);
}

/* ---- connecting ------------------------------------------------------------------- */

static int elapsed_ms_since(const struct timespec *start)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int)((now.tv_sec - start->tv_sec) * 1000 + (now.tv_nsec - start->tv_nsec) / 1000000);
}

/* Waits for a non-blocking connect; returns 0 or the errno that ended it. */
static int wait_connected(int fd, int timeout_ms)
{
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        int left = timeout_ms - elapsed_ms_since(&start);
        struct pollfd entry = {.fd = fd, .events = POLLOUT};
        int ready = poll(&entry, 1, left > 0 ? left : 0);
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready < 0)
            return errno;
        if (ready == 0)
            return ETIMEDOUT;
        int error = 0;
        socklen_t length = sizeof(error);
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0)
            return errno;
        return error;
    }
}

/* The socket options of a data connection; the socket ends up blocking. */
static int configure_socket(int fd)
{
    int one = 1;
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0 ||
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0 ||
        setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one)) != 0)
        return errno;
    return 0;
}

/* Connects to one address; returns the socket or -1 with *error set. */
static int connect_address(const struct addrinfo *address, int timeout_ms, int *error)
{
    int fd = socket(address->ai_family, address->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                    address->ai_protocol);
    if (fd < 0) {
        *error = errno;
        return -1;
    }
    *error = 0;
    if (connect(fd, address->ai_addr, address->ai_addrlen) != 0)
        *error = errno == EINPROGRESS ? wait_connected(fd, timeout_ms) : errno;
    if (*error == 0)
        *error = configure_socket(fd);
    if (*error != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

em_status em__client_connection_open(em__client_connection *connection, int timeout_ms,
                                     em_error *err)
{
    const em__client_server *server = connection->server;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV};
    struct addrinfo *addresses = NULL;
    int resolved = getaddrinfo(server->host, server->port, &hints, &addresses);
    if (resolved != 0)
        return em_error_set(err, EM_UNAVAILABLE, "server %s: cannot resolve '%s': %s",
                            server->name, server->host, gai_strerror(resolved));
    int error = 0;
    for (struct addrinfo *a = addresses; a != NULL && connection->fd < 0; a = a->ai_next)
        connection->fd = connect_address(a, timeout_ms, &error);
    freeaddrinfo(addresses);
    if (connection->fd >= 0 && connection->tls != NULL) {
        em_status status = em__client_tls_connect(connection->tls, connection->fd, server->host,
                                                  server->name, timeout_ms, &connection->ssl,
                                                  err);
        if (status != EM_OK) {
            close(connection->fd);
            connection->fd = -1;
        }
        return status;
    }
    if (connection->fd >= 0)
        return EM_OK;
    if (error == ETIMEDOUT)
        return em_error_set(err, EM_UNAVAILABLE, "server %s: no connection within %d ms",
                            server->name, timeout_ms);
    return em_error_set(err, EM_UNAVAILABLE, "server %s: cannot connect: %s", server->name,
                        strerror(error));
}

short em__client_connection_events(const em__client_connection *connection)
{
    if (connection->fd < 0)
        return 0;
    return (short)(POLLIN | (connection->unsent != NULL ? POLLOUT : 0));
}

/* ---- writing ---------------------------------------------------------------------- */

/* Gathers the unsent bytes of consecutive requests into pieces. */
static int gather_unsent(const em__client_connection *connection, struct iovec *pieces)
{
    uint32_t used = 0;
    for (const em__client_request *r = connection->unsent; r != NULL && used < SEND_PIECES_MAX;
         r = r->next)
        used += em__client_frame_remaining(&r->frame, r->sent, pieces + used,
                                           SEND_PIECES_MAX - used);
    return (int)used;
}

/* Credits `bytes` written to the requests from unsent on. */
static void advance_unsent(em__client_connection *connection, uint64_t bytes)
{
    while (bytes > 0 && connection->unsent != NULL) {
        em__client_request *request = connection->unsent;
        uint64_t left = request->frame.total - request->sent;
        uint64_t taken = bytes < left ? bytes : left;
        request->sent += taken;
        bytes -= taken;
        if (request->sent == request->frame.total)
            connection->unsent = request->next;
    }
}

/* TLS: writes the unsent bytes through the session; false when the connection failed. */
static bool write_some_tls(em__client_connection *connection)
{
    while (connection->unsent != NULL) {
        struct iovec pieces[SEND_PIECES_MAX];
        gather_unsent(connection, pieces);
        size_t written = 0;
        em_error error;
        em__client_tls_result result = em__client_tls_write(
            connection->ssl, pieces[0].iov_base, pieces[0].iov_len, &written, &error);
        if (result == EM_CLIENT_TLS_WAIT)
            return true;
        if (result != EM_CLIENT_TLS_DONE) {
            em__client_connection_fail(connection, EM_UNAVAILABLE, "server %s: %s",
                                       connection->server->name,
                                       result == EM_CLIENT_TLS_CLOSED
                                           ? "connection closed by the server"
                                           : error.message);
            return false;
        }
        advance_unsent(connection, (uint64_t)written);
    }
    return true;
}

/* Returns false when the connection failed. */
static bool write_some(em__client_connection *connection)
{
    if (connection->ssl != NULL)
        return write_some_tls(connection);
    while (connection->unsent != NULL) {
        struct iovec pieces[SEND_PIECES_MAX];
        struct msghdr message = {.msg_iov = pieces};
        message.msg_iovlen = (size_t)gather_unsent(connection, pieces);
        ssize_t written = sendmsg(connection->fd, &message, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (written < 0 && errno == EINTR)
            continue;
        if (written < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return true;
        if (written < 0) {
            em__client_connection_fail(connection, EM_UNAVAILABLE, "server %s: send failed: %s",
                                       connection->server->name, strerror(errno));
            return false;
        }
        advance_unsent(connection, (uint64_t)written);
    }
    return true;
}

/* ---- reading ---------------------------------------------------------------------- */

static const ProtobufCMessageDescriptor *response_descriptor(int method)
{
    switch (method) {
    case EMBER__METHOD__PULL:
        return &ember__pull_response__descriptor;
    case EMBER__METHOD__PUSH:
        return &ember__push_response__descriptor;
    case EMBER__METHOD__PING:
        return &ember__ping_response__descriptor;
    case EMBER__METHOD__HEALTH:
        return &ember__health_response__descriptor;
    case EMBER__METHOD__CREATE_TABLE:
        return &ember__create_table_response__descriptor;
    case EMBER__METHOD__DROP_TABLE:
        return &ember__drop_table_response__descriptor;
    case EMBER__METHOD__LIST_TABLES:
        return &ember__list_tables_response__descriptor;
    case EMBER__METHOD__STATS:
        return &ember__stats_response__descriptor;
    case EMBER__METHOD__SAVE:
        return &ember__save_response__descriptor;
    case EMBER__METHOD__LOAD:
        return &ember__load_response__descriptor;
    case EMBER__METHOD__DRAIN:
        return &ember__drain_response__descriptor;
    case EMBER__METHOD__UNDRAIN:
        return &ember__undrain_response__descriptor;
    case EMBER__METHOD__RELOAD:
        return &ember__reload_response__descriptor;
    case EMBER__METHOD__SLOWLOG:
        return &ember__slowlog_response__descriptor;
    case EMBER__METHOD__ERASE:
        return &ember__erase_response__descriptor;
    case EMBER__METHOD__EVICTED:
        return &ember__evicted_response__descriptor;
    case EMBER__METHOD__CHECKPOINTS:
        return &ember__checkpoints_response__descriptor;
    default:
        return NULL;
    }
}

/* "server HOST:PORT: NOT_FOUND: no table 'x'" with the server's status. */
static void server_error(em_error *error, const em__client_server *server,
                         const Ember__RpcMeta *meta)
{
    const char *text = meta->error != NULL && meta->error[0] != '\0' ? meta->error
                                                                     : "(no message)";
    if (!em_status_code_valid((unsigned long)meta->status)) {
        em_error_set(error, EM_UNKNOWN, "server %s: status %d: %s", server->name,
                     (int)meta->status, text);
        return;
    }
    em_status status = (em_status)meta->status;
    em_error_set(error, status, "server %s: %s: %s", server->name, em_status_name(status), text);
}

/* Bytes of vectors x dim floats, or UINT64_MAX when that overflows. */
static uint64_t vector_bytes(uint64_t vectors, uint32_t dim)
{
    uint64_t per_vector = (uint64_t)dim * sizeof(float);
    if (per_vector != 0 && vectors > UINT64_MAX / per_vector)
        return UINT64_MAX;
    return vectors * per_vector;
}

/* Where an OK PULL response's vectors go; NULL (discard) with the request's error set
 * when they cannot be taken. */
static void *pull_target(em__client_request *request, uint64_t attach_len)
{
    const Ember__PullResponse *response = (const Ember__PullResponse *)request->response;
    request->dim = response->dim;
    uint64_t expected = vector_bytes(request->vectors, response->dim);
    if (response->dim == 0) {
        em_error_set(&request->error, EM_INTERNAL, "server %s: PULL response has dim 0",
                     request->server->name);
        return NULL;
    }
    if (attach_len != expected) {
        em_error_set(&request->error, EM_INTERNAL,
                     "server %s: PULL response carries %llu bytes of vectors; expected %llu "
                     "(%llu vectors x dim %u)",
                     request->server->name, (unsigned long long)attach_len,
                     (unsigned long long)expected, (unsigned long long)request->vectors,
                     response->dim);
        return NULL;
    }
    uint64_t floats = expected / sizeof(float);
    if (request->out != NULL && request->out_capacity < floats) {
        em_error_set(&request->error, EM_INVALID_ARGUMENT,
                     "out_capacity %llu floats is less than %llu vectors x dim %u = %llu floats",
                     (unsigned long long)request->out_capacity,
                     (unsigned long long)request->vectors, response->dim,
                     (unsigned long long)floats);
        return NULL;
    }
    if (request->out != NULL || expected == 0)
        return request->out;
    request->scratch = malloc(expected);
    if (request->scratch == NULL)
        em_error_set(&request->error, EM_RESOURCE_EXHAUSTED,
                     "server %s: PULL response of %llu bytes: out of memory",
                     request->server->name, (unsigned long long)expected);
    return request->scratch;
}

/* Decodes an OK response's body into the request. */
static void take_body(em__client_request *request, const uint8_t *body, size_t body_len)
{
    const ProtobufCMessageDescriptor *descriptor = response_descriptor(request->method);
    if (descriptor == NULL) {
        em_error_set(&request->error, EM_INTERNAL,
                     "server %s: an answer to method %d, which this client cannot decode",
                     request->server->name, request->method);
        return;
    }
    request->response = protobuf_c_message_unpack(descriptor, NULL, body_len, body);
    if (request->response == NULL)
        em_error_set(&request->error, EM_INTERNAL, "server %s: undecodable %s body of %zu bytes",
                     request->server->name, descriptor->name, body_len);
}

/* The response for request has its meta and body in; returns the attachment's target. */
static void *take_response(em__client_request *request, const Ember__RpcMeta *meta,
                           const uint8_t *body, size_t body_len, uint64_t attach_len)
{
    if (request->owner == NULL)
        return NULL;
    if (meta->status != EMBER__STATUS__OK) {
        server_error(&request->error, request->server, meta);
        return NULL;
    }
    take_body(request, body, body_len);
    if (request->error.status != EM_OK || request->method != EMBER__METHOD__PULL)
        return NULL;
    return pull_target(request, attach_len);
}

/* A response that names no request of ours: the server rejected a frame it could not
 * parse (and closes the connection), or it answers an id we never sent. */
static void unmatched_response(em__client_connection *connection, const Ember__RpcMeta *meta)
{
    if (meta->status == EMBER__STATUS__OK) {
        em__client_connection_fail(connection, EM_INTERNAL,
                                   "server %s: response for unknown correlation id %llu",
                                   connection->server->name,
                                   (unsigned long long)meta->correlation_id);
        return;
    }
    em_error error;
    server_error(&error, connection->server, meta);
    em__client_connection_fail(connection, error.status, "%s", error.message);
}

/* Returns false when the connection failed. */
static bool handle_message(em__client_connection *connection)
{
    const em__client_reader *reader = &connection->reader;
    const em_frame_header *header = &reader->header;
    Ember__RpcMeta *meta = ember__rpc_meta__unpack(NULL, header->meta_len, reader->message);
    if (meta == NULL) {
        em__client_connection_fail(connection, EM_INTERNAL,
                                   "server %s: undecodable response meta of %u bytes",
                                   connection->server->name, header->meta_len);
        return false;
    }
    em__client_request *request = find_request(connection, meta->correlation_id);
    if (request == NULL) {
        unmatched_response(connection, meta);
        ember__rpc_meta__free_unpacked(meta, NULL);
        return false;
    }
    void *target = take_response(request, meta, reader->message + header->meta_len,
                                 (size_t)header->body_len, header->attach_len);
    bool early = request->sent < request->frame.total;
    ember__rpc_meta__free_unpacked(meta, NULL);
    if (early) {
        /* answered before we finished sending it: the server gave up on the stream */
        if (request->error.status == EM_OK)
            em_error_set(&request->error, EM_INTERNAL,
                         "server %s: answered a request before receiving all of it",
                         connection->server->name);
        complete_request(connection, request);
        em__client_connection_fail(connection, EM_UNAVAILABLE,
                                   "server %s: closed the stream after rejecting a request",
                                   connection->server->name);
        return false;
    }
    if (header->attach_len == 0) {
        complete_request(connection, request);
        return true;
    }
    connection->reading = request;
    em__client_reader_set_target(&connection->reader, target);
    return true;
}

static bool handle_attachment_end(em__client_connection *connection)
{
    if (connection->reading != NULL)
        complete_request(connection, connection->reading);
    connection->reading = NULL;
    return true;
}

/* Returns false when the connection failed or has nothing more to read now. */
static bool read_once(em__client_connection *connection)
{
    em_error error;
    uint8_t *at;
    size_t length;
    if (em__client_reader_buffer(&connection->reader, &at, &length, &error) != EM_OK) {
        em__client_connection_fail(connection, error.status, "server %s: %s",
                                   connection->server->name, error.message);
        return false;
    }
    ssize_t got;
    if (connection->ssl != NULL) {
        size_t taken = 0;
        em__client_tls_result result = em__client_tls_read(connection->ssl, at, length, &taken,
                                                           &error);
        if (result == EM_CLIENT_TLS_WAIT)
            return false;
        if (result == EM_CLIENT_TLS_FAILED) {
            em__client_connection_fail(connection, EM_UNAVAILABLE, "server %s: %s",
                                       connection->server->name, error.message);
            return false;
        }
        got = result == EM_CLIENT_TLS_CLOSED ? 0 : (ssize_t)taken;
        errno = 0;
    } else {
        got = recv(connection->fd, at, length, MSG_DONTWAIT);
    }
    if (got < 0 && errno == EINTR)
        return true;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return false;
    if (got <= 0) {
        em__client_connection_fail(connection, EM_UNAVAILABLE, "server %s: %s",
                                   connection->server->name,
                                   got == 0 ? "connection closed by the server"
                                            : strerror(errno));
        return false;
    }
    em__client_reader_event event;
    if (em__client_reader_advance(&connection->reader, (size_t)got, &event, &error) != EM_OK) {
        em__client_connection_fail(connection, EM_INTERNAL, "server %s: bad response frame: %s",
                                   connection->server->name, error.message);
        return false;
    }
    if (event == EM_CLIENT_READER_MESSAGE)
        return handle_message(connection);
    if (event == EM_CLIENT_READER_FRAME)
        return handle_attachment_end(connection);
    return true;
}

void em__client_connection_service(em__client_connection *connection, short revents)
{
    if ((revents & POLLOUT) && !write_some(connection))
        return;
    if (revents & (POLLIN | POLLHUP | POLLERR))
        while (connection->fd >= 0 && read_once(connection))
            ;
}

/* ---- abandoning ------------------------------------------------------------------- */

void em__client_connection_abandon(em__client_connection *connection,
                                   em__client_request *request)
{
    if (!request->linked) {
        em__client_request_destroy(request);
        return;
    }
    if (request->sent == 0) {
        /* never started: the server will never hear of it */
        unlink_request(connection, request);
        em__client_request_destroy(request);
        return;
    }
    if (request->sent < request->frame.total) {
        em_error error;
        if (em__client_frame_detach(&request->frame, request->sent, &error) != EM_OK) {
            unlink_request(connection, request);
            em__client_request_destroy(request);
            em__client_connection_fail(connection, error.status, "server %s: %s",
                                       connection->server->name, error.message);
            return;
        }
        request->sent = 0; /* the detached frame starts at the first unsent byte */
    }
    request->owner = NULL;
    request->out = NULL;
    if (connection->reading == request)
        em__client_reader_set_target(&connection->reader, NULL);
}
