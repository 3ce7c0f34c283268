#include "tests/support/test_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <check.h>

#include "lib/device/backend.h"
#include "lib/device/optimizer.h"
#include "lib/table/table.h"
#include "proto/frame.h"

#define MAX_TABLES 16
#define MAX_CONNECTIONS 64
#define MAX_REVERSED 8

typedef struct request_frame {
    em_frame_header header;
    Ember__RpcMeta *meta;
    uint8_t *message; /* meta + body */
    uint8_t *attachment;
} request_frame;

typedef struct connection {
    em_test_server *server;
    int fd;
    pthread_t thread;
} connection;

struct em_test_server {
    em_test_server_options options;
    int listener;
    uint16_t port;
    char address[32];
    pthread_t acceptor;
    atomic_bool stopping;
    atomic_uint delay_ms;
    atomic_uint close_after;
    atomic_uint_fast64_t data_requests;
    atomic_uint_fast64_t connections_total;
    pthread_mutex_t lock; /* tables, connections, stats */
    connection connections[MAX_CONNECTIONS];
    uint32_t connection_count;
    em_backend *backend;
    em_table *tables[MAX_TABLES];
    uint64_t method_requests[32], method_errors[32];
    struct timespec started;
};

/* ---- socket I/O -------------------------------------------------------------------- */

static bool read_exact(int fd, void *buffer, uint64_t length)
{
    uint8_t *at = buffer;
    while (length > 0) {
        ssize_t got = recv(fd, at, length, 0);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return false;
        at += got;
        length -= (uint64_t)got;
    }
    return true;
}

static bool write_exact(int fd, const void *buffer, uint64_t length)
{
    const uint8_t *at = buffer;
    while (length > 0) {
        ssize_t put = send(fd, at, length, MSG_NOSIGNAL);
        if (put < 0 && errno == EINTR)
            continue;
        if (put <= 0)
            return false;
        at += put;
        length -= (uint64_t)put;
    }
    return true;
}

static void free_frame(request_frame *frame)
{
    if (frame->meta != NULL)
        ember__rpc_meta__free_unpacked(frame->meta, NULL);
    free(frame->message);
    free(frame->attachment);
    memset(frame, 0, sizeof(*frame));
}

static bool read_frame(int fd, request_frame *frame)
{
    memset(frame, 0, sizeof(*frame));
    uint8_t header[EM_FRAME_HEADER_BYTES];
    em_frame_limits limits = em_frame_default_limits();
    em_error err;
    if (!read_exact(fd, header, sizeof(header)) ||
        em_frame_header_decode(header, &limits, &frame->header, &err) != EM_OK)
        return false;
    uint64_t message_len = frame->header.meta_len + frame->header.body_len;
    frame->message = malloc(message_len);
    frame->attachment = malloc(frame->header.attach_len + 1);
    if (!read_exact(fd, frame->message, message_len) ||
        !read_exact(fd, frame->attachment, frame->header.attach_len)) {
        free_frame(frame);
        return false;
    }
    frame->meta = ember__rpc_meta__unpack(NULL, frame->header.meta_len, frame->message);
    if (frame->meta == NULL) {
        free_frame(frame);
        return false;
    }
    return true;
}

/* ---- responses ---------------------------------------------------------------------- */

typedef struct response {
    em_error error;
    ProtobufCMessage *body; /* borrowed */
    const void *attachment;
    uint64_t attach_len;
} response;

static bool send_response(int fd, const request_frame *request, const response *answer)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = request->meta->correlation_id;
    meta.method = request->meta->method;
    meta.status = (Ember__Status)answer->error.status;
    meta.error = (char *)answer->error.message;
    bool ok = answer->error.status == EM_OK;
    uint8_t *prefix;
    size_t prefix_len;
    em_error err;
    if (em_frame_pack(&meta, ok ? answer->body : NULL, ok ? answer->attach_len : 0, &prefix,
                      &prefix_len, &err) != EM_OK)
        return false;
    bool sent = write_exact(fd, prefix, prefix_len) &&
                (!ok || write_exact(fd, answer->attachment, answer->attach_len));
    free(prefix);
    return sent;
}

/* ---- tables ------------------------------------------------------------------------- */

static int find_table(em_test_server *server, const char *name)
{
    for (int i = 0; i < MAX_TABLES; i++)
        if (server->tables[i] != NULL && strcmp(em_table_name(server->tables[i]), name) == 0)
            return i;
    return -1;
}

static em_table *table_named(em_test_server *server, const char *name, em_error *err)
{
    int index = find_table(server, name);
    if (index < 0) {
        em_error_set(err, EM_NOT_FOUND, "no table '%s'", name);
        return NULL;
    }
    return server->tables[index];
}

/* Views the CSR arrays of a PULL/PUSH attachment (and where the gradients start). */
static bool csr_view(const request_frame *request, uint32_t rows, uint64_t nnz,
                     uint64_t gradient_floats, em_csr *csr, const float **gradients,
                     em_error *err)
{
    em_csr_attachment layout;
    if (em_csr_attachment_layout(rows, nnz, gradient_floats, &layout, err) != EM_OK)
        return false;
    if (layout.total != request->header.attach_len) {
        em_error_set(err, EM_INVALID_ARGUMENT, "attachment has %llu bytes; expected %llu",
                     (unsigned long long)request->header.attach_len,
                     (unsigned long long)layout.total);
        return false;
    }
    *csr = (em_csr){.rows = rows,
                    .nnz = nnz,
                    .offsets = (const uint32_t *)request->attachment,
                    .keys = (const uint64_t *)(request->attachment + layout.keys_at)};
    if (gradients != NULL)
        *gradients = (const float *)(request->attachment + layout.gradients_at);
    return true;
}

static const uint8_t *body_of(const request_frame *request)
{
    return request->message + request->header.meta_len;
}

static void handle_pull(em_test_server *server, int fd, const request_frame *request)
{
    response answer = {0};
    float *vectors = NULL;
    Ember__PullRequest *body = ember__pull_request__unpack(NULL, request->header.body_len,
                                                           body_of(request));
    em_table *table = body != NULL ? table_named(server, body->table, &answer.error) : NULL;
    em_csr csr;
    Ember__PullResponse out = EMBER__PULL_RESPONSE__INIT;
    if (table != NULL &&
        csr_view(request, body->rows, body->nnz, 0, &csr, NULL, &answer.error)) {
        uint64_t floats = em_csr_output_vectors(&csr, (em_combiner)body->combiner) *
                          em_table_dim(table);
        vectors = malloc(floats * sizeof(float) + 1);
        em_pull_request pull = {.batch = csr,
                                .combiner = (em_combiner)body->combiner,
                                .create_missing = body->create_missing,
                                .out = vectors,
                                .out_capacity = floats};
        em_pull_result result;
        if (em_table_pull(table, &pull, &result, &answer.error) == EM_OK) {
            out.dim = em_table_dim(table);
            out.missing = result.missing;
            out.created = result.created;
            out.unique_keys = result.unique_keys;
            answer.body = &out.base;
            answer.attachment = vectors;
            answer.attach_len = floats * sizeof(float);
        }
    }
    send_response(fd, request, &answer);
    free(vectors);
    if (body != NULL)
        ember__pull_request__free_unpacked(body, NULL);
}

static void handle_push(em_test_server *server, int fd, const request_frame *request)
{
    response answer = {0};
    Ember__PushRequest *body = ember__push_request__unpack(NULL, request->header.body_len,
                                                           body_of(request));
    em_table *table = body != NULL ? table_named(server, body->table, &answer.error) : NULL;
    Ember__PushResponse out = EMBER__PUSH_RESPONSE__INIT;
    if (table != NULL) {
        em_csr shape = {.rows = body->rows, .nnz = body->nnz};
        uint64_t floats = em_csr_output_vectors(&shape, (em_combiner)body->combiner) *
                          em_table_dim(table);
        em_csr csr;
        const float *gradients;
        if (csr_view(request, body->rows, body->nnz, floats, &csr, &gradients, &answer.error)) {
            em_push_request push = {.batch = csr,
                                    .combiner = (em_combiner)body->combiner,
                                    .gradients = gradients,
                                    .gradient_count = floats};
            em_push_result result;
            if (em_table_push(table, &push, &result, &answer.error) == EM_OK) {
                out.updated = result.updated;
                out.created = result.created;
                answer.body = &out.base;
            }
        }
    }
    send_response(fd, request, &answer);
    if (body != NULL)
        ember__push_request__free_unpacked(body, NULL);
}

static Ember__TableInfo *table_info(em_table *table, char **config_text)
{
    Ember__TableInfo *info = malloc(sizeof(*info));
    ember__table_info__init(info);
    const em_table_config *config = em_table_get_config(table);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    info->name = (char *)em_table_name(table);
    info->dim = config->dim;
    info->capacity = config->capacity;
    info->shards = config->shards;
    info->optimizer = (char *)em_optimizer_name(config->optimizer.kind);
    info->rows = stats.rows;
    cJSON *json = em_table_config_to_json(config);
    *config_text = cJSON_PrintUnformatted(json);
    cJSON_Delete(json);
    info->config_json = *config_text;
    return info;
}

static void handle_create(em_test_server *server, int fd, const request_frame *request)
{
    response answer = {0};
    Ember__CreateTableRequest *body = ember__create_table_request__unpack(
        NULL, request->header.body_len, body_of(request));
    em_table_config config;
    em_table *table = NULL;
    if (em_table_config_parse_text(body->config_json, &config, &answer.error) == EM_OK) {
        int free_slot = -1;
        for (int i = 0; i < MAX_TABLES && free_slot < 0; i++)
            if (server->tables[i] == NULL)
                free_slot = i;
        if (find_table(server, config.name) >= 0)
            em_error_set(&answer.error, EM_ALREADY_EXISTS, "table '%s' already exists",
                         config.name);
        else if (free_slot < 0)
            em_error_set(&answer.error, EM_RESOURCE_EXHAUSTED, "at most %d tables", MAX_TABLES);
        else if (em_table_create(server->backend, &config, &table, &answer.error) == EM_OK)
            server->tables[free_slot] = table;
    }
    Ember__CreateTableResponse out = EMBER__CREATE_TABLE_RESPONSE__INIT;
    char *config_text = NULL;
    if (table != NULL) {
        out.table = table_info(table, &config_text);
        answer.body = &out.base;
    }
    send_response(fd, request, &answer);
    free(out.table);
    free(config_text);
    ember__create_table_request__free_unpacked(body, NULL);
}

static void handle_drop(em_test_server *server, int fd, const request_frame *request)
{
    response answer = {0};
    Ember__DropTableRequest *body = ember__drop_table_request__unpack(
        NULL, request->header.body_len, body_of(request));
    int index = find_table(server, body->table);
    Ember__DropTableResponse out = EMBER__DROP_TABLE_RESPONSE__INIT;
    if (index < 0) {
        em_error_set(&answer.error, EM_NOT_FOUND, "no table '%s'", body->table);
    } else {
        em_table_destroy(server->tables[index]);
        server->tables[index] = NULL;
        answer.body = &out.base;
    }
    send_response(fd, request, &answer);
    ember__drop_table_request__free_unpacked(body, NULL);
}

static void handle_list(em_test_server *server, int fd, const request_frame *request)
{
    Ember__TableInfo *infos[MAX_TABLES];
    char *texts[MAX_TABLES];
    Ember__ListTablesResponse out = EMBER__LIST_TABLES_RESPONSE__INIT;
    out.tables = infos;
    for (int i = 0; i < MAX_TABLES; i++)
        if (server->tables[i] != NULL) {
            texts[out.n_tables] = NULL;
            infos[out.n_tables] = table_info(server->tables[i], &texts[out.n_tables]);
            out.n_tables++;
        }
    response answer = {.body = &out.base};
    send_response(fd, request, &answer);
    for (size_t i = 0; i < out.n_tables; i++) {
        free(infos[i]);
        free(texts[i]);
    }
}

static void handle_stats(em_test_server *server, int fd, const request_frame *request)
{
    Ember__ServerStats stats = EMBER__SERVER_STATS__INIT;
    stats.version = "test";
    stats.state = "serving";
    stats.backend = "cpu";
    stats.connections_total = atomic_load(&server->connections_total);
    Ember__MethodStats method_stats[2] = {EMBER__METHOD_STATS__INIT, EMBER__METHOD_STATS__INIT};
    Ember__MethodStats *methods[2] = {&method_stats[0], &method_stats[1]};
    int ids[2] = {EMBER__METHOD__PULL, EMBER__METHOD__PUSH};
    for (int i = 0; i < 2; i++) {
        method_stats[i].method = (char *)em_method_name(ids[i]);
        method_stats[i].requests = server->method_requests[ids[i]];
        method_stats[i].errors = server->method_errors[ids[i]];
    }
    stats.n_methods = 2;
    stats.methods = methods;
    Ember__TableStats table_stats[MAX_TABLES];
    Ember__TableStats *tables[MAX_TABLES];
    Ember__StatsResponse out = EMBER__STATS_RESPONSE__INIT;
    out.server = &stats;
    out.tables = tables;
    for (int i = 0; i < MAX_TABLES; i++) {
        if (server->tables[i] == NULL)
            continue;
        em_table_stats s;
        em_table_get_stats(server->tables[i], &s);
        Ember__TableStats *t = &table_stats[out.n_tables];
        ember__table_stats__init(t);
        t->name = (char *)em_table_name(server->tables[i]);
        t->rows = s.rows;
        t->capacity = s.capacity;
        t->dim = s.dim;
        t->shards = s.shards;
        t->row_bytes = s.row_bytes;
        t->index_bytes = s.index_bytes;
        t->pulls = s.pulls;
        t->pushes = s.pushes;
        tables[out.n_tables++] = t;
    }
    Ember__PoolStats pool = EMBER__POOL_STATS__INIT;
    Ember__PoolStats *pools[1] = {&pool};
    pool.device = "cpu0";
    pool.bytes_in_use = 1536;
    pool.bytes_reserved = UINT64_C(64) << 20;
    pool.bytes_limit = UINT64_C(1) << 30;
    pool.fragmentation = 0.125;
    out.n_pools = 1;
    out.pools = pools;
    response answer = {.body = &out.base};
    send_response(fd, request, &answer);
}

static void handle_health(em_test_server *server, int fd, const request_frame *request)
{
    Ember__HealthResponse out = EMBER__HEALTH_RESPONSE__INIT;
    out.ready = true;
    out.state = "serving";
    out.backend = "cpu";
    out.devices = 1;
    for (int i = 0; i < MAX_TABLES; i++)
        out.tables += server->tables[i] != NULL;
    response answer = {.body = &out.base};
    send_response(fd, request, &answer);
}

static void handle_ping(em_test_server *server, int fd, const request_frame *request)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    Ember__PingResponse out = EMBER__PING_RESPONSE__INIT;
    out.version = "test";
    out.uptime_ms = (uint64_t)((now.tv_sec - server->started.tv_sec) * 1000 +
                               (now.tv_nsec - server->started.tv_nsec) / 1000000);
    response answer = {.body = &out.base};
    send_response(fd, request, &answer);
}

/* ---- dispatch ----------------------------------------------------------------------- */

static bool token_ok(const char *expected, const ProtobufCBinaryData *token)
{
    if (expected == NULL)
        return true;
    return token->len == strlen(expected) && memcmp(token->data, expected, token->len) == 0;
}

/* An error answer for a request that may not run here, or false. */
static bool refused(em_test_server *server, const request_frame *request, response *answer)
{
    int method = request->meta->method;
    bool data = method == EMBER__METHOD__PULL || method == EMBER__METHOD__PUSH;
    bool open = method == EMBER__METHOD__PING || method == EMBER__METHOD__HEALTH;
    const char *token = data ? server->options.data_token : server->options.admin_token;
    if (!open && !token_ok(token, &request->meta->auth_token)) {
        em_error_set(&answer->error, EM_UNAUTHENTICATED, "%s needs the %s token",
                     em_method_name(method), data ? "data" : "admin");
        return true;
    }
    return false;
}

static void handle(em_test_server *server, int fd, const request_frame *request)
{
    int method = request->meta->method;
    if (method == EMBER__METHOD__PULL || method == EMBER__METHOD__PUSH) {
        atomic_fetch_add(&server->data_requests, 1);
        uint32_t delay = atomic_load(&server->delay_ms);
        if (delay > 0)
            usleep(delay * 1000);
    }
    pthread_mutex_lock(&server->lock);
    response refusal = {0};
    if ((unsigned)method < 32)
        server->method_requests[method]++;
    if (refused(server, request, &refusal)) {
        server->method_errors[method]++;
        send_response(fd, request, &refusal);
        pthread_mutex_unlock(&server->lock);
        return;
    }
    switch (method) {
    case EMBER__METHOD__PULL:
        handle_pull(server, fd, request);
        break;
    case EMBER__METHOD__PUSH:
        handle_push(server, fd, request);
        break;
    case EMBER__METHOD__PING:
        handle_ping(server, fd, request);
        break;
    case EMBER__METHOD__HEALTH:
        handle_health(server, fd, request);
        break;
    case EMBER__METHOD__CREATE_TABLE:
        handle_create(server, fd, request);
        break;
    case EMBER__METHOD__DROP_TABLE:
        handle_drop(server, fd, request);
        break;
    case EMBER__METHOD__LIST_TABLES:
        handle_list(server, fd, request);
        break;
    case EMBER__METHOD__STATS:
        handle_stats(server, fd, request);
        break;
    default:
        em_error_set(&refusal.error, EM_UNIMPLEMENTED, "method %d", method);
        send_response(fd, request, &refusal);
    }
    pthread_mutex_unlock(&server->lock);
}

static bool readable_now(int fd)
{
    struct pollfd entry = {.fd = fd, .events = POLLIN};
    return poll(&entry, 1, 0) == 1 && (entry.revents & POLLIN);
}

/* Reads one request, or (reverse_responses) every request already waiting up to
 * MAX_REVERSED, and answers them last-first. Returns false when the connection ends. */
static bool serve_some(em_test_server *server, int fd)
{
    request_frame frames[MAX_REVERSED];
    int count = 0;
    bool open = true;
    do {
        open = read_frame(fd, &frames[count]);
        count += open;
        uint32_t left = atomic_load(&server->close_after);
        if (open && left > 0 && atomic_fetch_sub(&server->close_after, 1) == 1)
            open = false;
    } while (open && server->options.reverse_responses && count < MAX_REVERSED &&
             readable_now(fd));
    for (int i = count - 1; i >= 0; i--) {
        if (open)
            handle(server, fd, &frames[i]);
        free_frame(&frames[i]);
    }
    return open;
}

static void *serve_connection(void *arg)
{
    connection *c = arg;
    while (!atomic_load(&c->server->stopping) && serve_some(c->server, c->fd))
        ;
    shutdown(c->fd, SHUT_RDWR);
    return NULL;
}

static void *accept_connections(void *arg)
{
    em_test_server *server = arg;
    for (;;) {
        int fd = accept(server->listener, NULL, NULL);
        if (fd < 0 && errno == EINTR)
            continue;
        if (fd < 0 || atomic_load(&server->stopping)) {
            if (fd >= 0)
                close(fd);
            return NULL;
        }
        pthread_mutex_lock(&server->lock);
        if (server->connection_count == MAX_CONNECTIONS) {
            close(fd);
        } else {
            int one = 1; /* answers go out in two writes: no Nagle delay between them */
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
            connection *c = &server->connections[server->connection_count++];
            c->server = server;
            c->fd = fd;
            atomic_fetch_add(&server->connections_total, 1);
            pthread_create(&c->thread, NULL, serve_connection, c);
        }
        pthread_mutex_unlock(&server->lock);
    }
}

/* ---- lifecycle ---------------------------------------------------------------------- */

em_test_server *em_test_server_start(const em_test_server_options *options)
{
    em_test_server *server = calloc(1, sizeof(*server));
    ck_assert_ptr_nonnull(server);
    if (options != NULL)
        server->options = *options;
    pthread_mutex_init(&server->lock, NULL);
    clock_gettime(CLOCK_MONOTONIC, &server->started);
    em_cpu_backend_options backend_options;
    em_cpu_backend_options_init(&backend_options);
    backend_options.pool_limit_bytes = UINT64_C(256) << 20;
    backend_options.pool_initial_bytes = UINT64_C(8) << 20;
    backend_options.pool_growth_bytes = UINT64_C(16) << 20;
    em_error err;
    ck_assert_msg(em_backend_create_cpu(&backend_options, &server->backend, &err) == EM_OK, "%s",
                  err.message);
    server->listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ck_assert_int_ge(server->listener, 0);
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = 0};
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_int_eq(bind(server->listener, (struct sockaddr *)&address, sizeof(address)), 0);
    ck_assert_int_eq(listen(server->listener, 16), 0);
    socklen_t length = sizeof(address);
    ck_assert_int_eq(getsockname(server->listener, (struct sockaddr *)&address, &length), 0);
    server->port = ntohs(address.sin_port);
    snprintf(server->address, sizeof(server->address), "127.0.0.1:%u", server->port);
    ck_assert_int_eq(pthread_create(&server->acceptor, NULL, accept_connections, server), 0);
    return server;
}

void em_test_server_stop(em_test_server *server)
{
    atomic_store(&server->stopping, true);
    shutdown(server->listener, SHUT_RDWR);
    pthread_join(server->acceptor, NULL);
    close(server->listener);
    for (uint32_t i = 0; i < server->connection_count; i++)
        shutdown(server->connections[i].fd, SHUT_RDWR);
    for (uint32_t i = 0; i < server->connection_count; i++) {
        pthread_join(server->connections[i].thread, NULL);
        close(server->connections[i].fd);
    }
    for (int i = 0; i < MAX_TABLES; i++)
        if (server->tables[i] != NULL)
            em_table_destroy(server->tables[i]);
    em_backend_destroy(server->backend);
    pthread_mutex_destroy(&server->lock);
    free(server);
}

uint16_t em_test_server_port(const em_test_server *server)
{
    return server->port;
}

const char *em_test_server_address(const em_test_server *server)
{
    return server->address;
}

void em_test_server_set_delay(em_test_server *server, uint32_t delay_ms)
{
    atomic_store(&server->delay_ms, delay_ms);
}

void em_test_server_close_after(em_test_server *server, uint32_t requests)
{
    atomic_store(&server->close_after, requests);
}

uint64_t em_test_server_data_requests(em_test_server *server)
{
    return atomic_load(&server->data_requests);
}

uint64_t em_test_server_connections(em_test_server *server)
{
    return atomic_load(&server->connections_total);
}

void em_test_server_drop_connections(em_test_server *server)
{
    pthread_mutex_lock(&server->lock);
    for (uint32_t i = 0; i < server->connection_count; i++)
        shutdown(server->connections[i].fd, SHUT_RDWR);
    pthread_mutex_unlock(&server->lock);
}

uint64_t em_test_server_requests(em_test_server *server, int method)
{
    pthread_mutex_lock(&server->lock);
    uint64_t count = (unsigned)method < 32 ? server->method_requests[method] : 0;
    pthread_mutex_unlock(&server->lock);
    return count;
}
