/*
 * DESIGN: the client object, its calls, and the public API of clients/ember_client.h.
 *
 * A call is one user-level operation (a pull, a push, an admin method) and owns one
 * request per server it talks to. Starting a call validates the arguments, builds the
 * request frames (splitting the batch when there are several servers, see
 * clients/client_split.h), makes sure each connection is open (reconnecting with
 * backoff) and has room in its window, queues the frames and writes what the sockets
 * take at once. Finishing a call runs the poll loop over every connection until all
 * of its requests are answered or its deadline passes, then assembles the result.
 *
 * The poll loop serves every connection each round, so while one call waits, the
 * responses of others are read and their remaining frames written. A call that runs
 * past its deadline gives its requests back to their connections (see
 * em__client_connection_abandon): their late responses are discarded on arrival.
 *
 * A call split over several servers is not atomic across them: when one server
 * refuses its part (unknown table, capacity), the others may have applied theirs. The
 * error names the server that refused; each server's part is all-or-nothing there.
 */
#include "clients/ember_client.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lib/checkpoint/checkpoint_cluster.h"
#include "clients/client_connection.h"
#include "clients/client_frame.h"
#include "clients/client_json.h"
#include "clients/client_servers.h"
#include "clients/client_split.h"
#include "common/keyhash.h"

#define DEFAULT_SERVERS "127.0.0.1:7070"
#define DEFAULT_WINDOW 64
#define DEFAULT_TIMEOUT_MS 30000
#define DEFAULT_CONNECT_TIMEOUT_MS 5000
#define DEFAULT_RECONNECT_ATTEMPTS 3
/* Pause before the second connection attempt; it doubles after each further failure. */
#define RECONNECT_BACKOFF_FIRST_MS 100

typedef enum call_kind { CALL_PULL, CALL_PUSH, CALL_MESSAGE } call_kind;

struct em_client_call {
    em_client_call *next, *previous; /* the client's live calls */
    call_kind kind;
    int method;
    int64_t deadline_ms; /* monotonic; 0: none */
    uint32_t request_count;
    em__client_request **requests; /* one per server that has keys of the call */
    em__client_request *by_server[EM_CLIENT_SERVERS_MAX]; /* NULL: no keys there */
    /* pull and push: the caller's arguments (arrays borrowed until finish) */
    em_csr batch;
    em_combiner combiner;
    float *out;
    uint64_t out_capacity;
    em__client_split split; /* several servers */
};

struct em_client {
    em_client_options options; /* servers and token point at the copies below */
    char *servers_text;
    char *token;
    em__client_server *servers;
    uint32_t server_count;
    em__client_connection *connections;
    uint32_t connection_count; /* initialised connections */
    struct pollfd *poll_entries;
    uint32_t *poll_servers; /* server of each poll entry */
    uint64_t next_correlation_id;
    em_client_call *calls;
    em__client_tls *tls; /* NULL: plaintext */
};

/* ---- time ------------------------------------------------------------------------- */

static int64_t now_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

/* Milliseconds left until deadline (0: none gives INT_MAX), never negative. */
static int ms_left(int64_t deadline)
{
    if (deadline == 0)
        return INT_MAX;
    int64_t left = deadline - now_ms();
    return left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
}

static void sleep_ms(int ms)
{
    struct timespec pause = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
    while (nanosleep(&pause, &pause) != 0 && errno == EINTR)
        ;
}

/* ---- the poll loop ---------------------------------------------------------------- */

/* One poll over every open connection, serving what is ready. Returns false when no
 * connection is open (nothing can make progress). */
static bool poll_round(em_client *client, int timeout_ms)
{
    nfds_t count = 0;
    for (uint32_t s = 0; s < client->server_count; s++) {
        short events = em__client_connection_events(&client->connections[s]);
        if (events == 0)
            continue;
        client->poll_entries[count] =
            (struct pollfd){.fd = client->connections[s].fd, .events = events};
        client->poll_servers[count++] = s;
    }
    if (count == 0)
        return false;
    int ready = poll(client->poll_entries, count, timeout_ms);
    for (nfds_t i = 0; ready > 0 && i < count; i++)
        if (client->poll_entries[i].revents != 0)
            em__client_connection_service(&client->connections[client->poll_servers[i]],
                                          client->poll_entries[i].revents);
    return true;
}

typedef bool (*wait_condition)(const em_client *client, const void *arg);

/* Polls until done(arg) holds (true) or the deadline passes (false). */
static bool drive(em_client *client, int64_t deadline, wait_condition done, const void *arg)
{
    while (!done(client, arg)) {
        int left = ms_left(deadline);
        if (deadline != 0 && left == 0)
            return false;
        if (!poll_round(client, deadline != 0 ? left : -1))
            return done(client, arg);
    }
    return true;
}

/* ---- connections ------------------------------------------------------------------ */

static em_status connect_with_retries(em_client *client, uint32_t server, int64_t deadline,
                                      em_error *err)
{
    em__client_connection *connection = &client->connections[server];
    uint32_t attempts = client->options.reconnect_attempts > 0
                            ? client->options.reconnect_attempts
                            : 1;
    int backoff = RECONNECT_BACKOFF_FIRST_MS;
    em_status status = EM_OK;
    for (uint32_t attempt = 1;; attempt++) {
        int timeout = (int)client->options.connect_timeout_ms;
        if (ms_left(deadline) < timeout)
            timeout = ms_left(deadline);
        status = em__client_connection_open(connection, timeout > 0 ? timeout : 1, err);
        if (status == EM_OK || attempt >= attempts || ms_left(deadline) == 0)
            break;
        sleep_ms(backoff < ms_left(deadline) ? backoff : ms_left(deadline));
        backoff *= 2;
    }
    return status;
}

typedef struct window_wait {
    uint32_t server;
} window_wait;

static bool window_has_room(const em_client *client, const void *arg)
{
    const em__client_connection *connection =
        &client->connections[((const window_wait *)arg)->server];
    return connection->fd < 0 || connection->in_flight < client->options.window;
}

/* ---- calls ------------------------------------------------------------------------ */

static em_status out_of_memory(em_error *err, const char *what)
{
    return em_error_set(err, EM_RESOURCE_EXHAUSTED, "%s: out of memory", what);
}

static em_client_call *call_create(em_client *client, call_kind kind, int method,
                                   uint32_t max_requests)
{
    em_client_call *call = calloc(1, sizeof(*call));
    if (call == NULL)
        return NULL;
    call->requests = calloc(max_requests, sizeof(*call->requests));
    if (call->requests == NULL) {
        free(call);
        return NULL;
    }
    call->kind = kind;
    call->method = method;
    if (client->options.timeout_ms != 0)
        call->deadline_ms = now_ms() + client->options.timeout_ms;
    call->next = client->calls;
    if (client->calls != NULL)
        client->calls->previous = call;
    client->calls = call;
    return call;
}

static uint32_t server_index(const em_client *client, const em__client_request *request)
{
    return (uint32_t)(request->server - client->servers);
}

/* Frees the call; requests still in flight are abandoned to their connections. */
static void call_destroy(em_client *client, em_client_call *call)
{
    for (uint32_t i = 0; i < call->request_count; i++) {
        em__client_request *request = call->requests[i];
        em__client_connection_abandon(&client->connections[server_index(client, request)],
                                      request);
    }
    if (call->previous != NULL)
        call->previous->next = call->next;
    else
        client->calls = call->next;
    if (call->next != NULL)
        call->next->previous = call->previous;
    em__client_split_deinit(&call->split);
    free(call->requests);
    free(call);
}

static em__client_request *call_add_request(em_client *client, em_client_call *call,
                                            uint32_t server)
{
    em__client_request *request = em__client_request_create(
        call, &client->servers[server], client->next_correlation_id++, call->method);
    if (request != NULL) {
        call->requests[call->request_count++] = request;
        call->by_server[server] = request;
    }
    return request;
}

static em__client_rpc call_rpc(const em_client *client, const em_client_call *call,
                               const em__client_request *request)
{
    return (em__client_rpc){
        .correlation_id = request->correlation_id,
        .method = call->method,
        .deadline_ms = client->options.timeout_ms,
        .token = client->token,
    };
}

/* Opens the request's connection if needed, waits for room in its window, queues it. */
static em_status send_request(em_client *client, em_client_call *call,
                              em__client_request *request, em_error *err)
{
    uint32_t server = server_index(client, request);
    em__client_connection *connection = &client->connections[server];
    window_wait wait = {server};
    for (;;) {
        if (connection->fd < 0) {
            em_status status = connect_with_retries(client, server, call->deadline_ms, err);
            if (status != EM_OK)
                return status;
        }
        if (connection->in_flight < client->options.window)
            break;
        if (!drive(client, call->deadline_ms, window_has_room, &wait))
            return em_error_set(err, EM_DEADLINE_EXCEEDED,
                                "server %s: %s not sent within %u ms: %u requests in flight "
                                "(window %u)",
                                request->server->name, em_method_name(call->method),
                                client->options.timeout_ms, connection->in_flight,
                                client->options.window);
    }
    em__client_connection_enqueue(connection, request);
    return EM_OK;
}

/* Sends every request of the call (frames built), then writes what the sockets take
 * now. On error the call is destroyed. */
static em_status call_send(em_client *client, em_client_call *call, em_error *err)
{
    poll_round(client, 0); /* notice connections the servers closed while idle */
    for (uint32_t i = 0; i < call->request_count; i++) {
        em_status status = send_request(client, call, call->requests[i], err);
        if (status != EM_OK) {
            call_destroy(client, call);
            return status;
        }
    }
    poll_round(client, 0);
    return EM_OK;
}

static bool call_answered(const em_client *client, const void *arg)
{
    (void)client;
    const em_client_call *call = arg;
    for (uint32_t i = 0; i < call->request_count; i++)
        if (!call->requests[i]->done)
            return false;
    return true;
}

/* Waits for every response of the call; the first request error (in server order) or
 * DEADLINE_EXCEEDED naming a server that did not answer. */
static em_status call_wait(em_client *client, em_client_call *call, em_error *err)
{
    if (!drive(client, call->deadline_ms, call_answered, call)) {
        const em__client_request *late = call->requests[0];
        for (uint32_t i = call->request_count; i-- > 0;)
            if (!call->requests[i]->done)
                late = call->requests[i];
        return em_error_set(err, EM_DEADLINE_EXCEEDED, "server %s: %s timed out after %u ms",
                            late->server->name, em_method_name(call->method),
                            client->options.timeout_ms);
    }
    for (uint32_t i = 0; i < call->request_count; i++)
        if (call->requests[i]->error.status != EM_OK)
            return em_error_copy(err, &call->requests[i]->error);
    return EM_OK;
}

/* ---- argument checks -------------------------------------------------------------- */

static em_status check_table_and_batch(const char *table, const em_csr *batch, int combiner,
                                       em_error *err)
{
    if (table == NULL || table[0] == '\0')
        return em_error_set(err, EM_INVALID_ARGUMENT, "table name is empty");
    em_status status = em_combiner_check(combiner, err);
    if (status != EM_OK)
        return status;
    if (batch->offsets == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT, "batch offsets are NULL");
    if (batch->keys == NULL && batch->nnz > 0)
        return em_error_set(err, EM_INVALID_ARGUMENT, "batch keys are NULL for nnz=%llu",
                            (unsigned long long)batch->nnz);
    return em_csr_validate(batch, err);
}

static em_status check_pull_args(const em_client_pull_args *args, em_error *err)
{
    em_status status = check_table_and_batch(args->table, &args->batch, (int)args->combiner, err);
    if (status != EM_OK)
        return status;
    uint64_t vectors = em_csr_output_vectors(&args->batch, args->combiner);
    if (vectors > 0 && args->out == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT, "out is NULL for %llu output vectors",
                            (unsigned long long)vectors);
    if (args->out_capacity < vectors)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "out_capacity %llu floats cannot hold %llu output vectors",
                            (unsigned long long)args->out_capacity, (unsigned long long)vectors);
    return EM_OK;
}

/* Checks the gradients and derives dim from their count. */
static em_status check_push_args(const em_client_push_args *args, uint32_t *dim, em_error *err)
{
    em_status status = check_table_and_batch(args->table, &args->batch, (int)args->combiner, err);
    if (status != EM_OK)
        return status;
    uint64_t vectors = em_csr_output_vectors(&args->batch, args->combiner);
    *dim = 0;
    if (vectors == 0 && args->gradient_count == 0)
        return EM_OK;
    if (vectors == 0 || args->gradient_count % vectors != 0 ||
        args->gradient_count / vectors == 0 || args->gradient_count / vectors > UINT32_MAX)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "gradient_count %llu is not a positive multiple of the %llu gradient "
                            "vectors of a %s push",
                            (unsigned long long)args->gradient_count, (unsigned long long)vectors,
                            em_combiner_name(args->combiner));
    if (args->gradients == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT, "gradients are NULL for gradient_count %llu",
                            (unsigned long long)args->gradient_count);
    *dim = (uint32_t)(args->gradient_count / vectors);
    return em_csr_check_gradients(&args->batch, args->combiner, *dim, args->gradients, NULL,
                                  err);
}

/* ---- pull ------------------------------------------------------------------------- */

static em_status pull_request(em_client *client, em_client_call *call, uint32_t server,
                              const char *table, const em_csr *batch, em_combiner combiner,
                              bool create_missing, float *out, uint64_t out_capacity,
                              em_error *err)
{
    em__client_request *request = call_add_request(client, call, server);
    if (request == NULL)
        return out_of_memory(err, "pull request");
    request->vectors = em_csr_output_vectors(batch, combiner);
    request->out = out;
    request->out_capacity = out_capacity;
    em__client_rpc rpc = call_rpc(client, call, request);
    return em__client_frame_pull(&rpc, table, batch, combiner, create_missing, &request->frame,
                                 err);
}

static em_status pull_requests(em_client *client, em_client_call *call,
                               const em_client_pull_args *args, em_error *err)
{
    if (client->server_count == 1)
        return pull_request(client, call, 0, args->table, &args->batch, args->combiner,
                            args->create_missing, args->out, args->out_capacity, err);
    em_status status = em__client_split_pull(&args->batch, client->server_count, &call->split, err);
    /* only the servers that hold keys of the batch are asked (a batch without keys asks
     * every one, which also checks that they agree on dim), so a server that is down
     * fails only the calls that need it */
    for (uint32_t s = 0; status == EM_OK && s < client->server_count; s++)
        if (call->split.servers[s].batch.nnz > 0 || args->batch.nnz == 0)
            status = pull_request(client, call, s, args->table, &call->split.servers[s].batch,
                                  EM_COMBINER_NONE, args->create_missing, NULL, 0, err);
    return status;
}

em_status em_client_pull_start(em_client *client, const em_client_pull_args *args,
                               em_client_call **call, em_error *err)
{
    *call = NULL;
    em_status status = check_pull_args(args, err);
    if (status != EM_OK)
        return status;
    em_client_call *created =
        call_create(client, CALL_PULL, EMBER__METHOD__PULL, client->server_count);
    if (created == NULL)
        return out_of_memory(err, "pull call");
    created->batch = args->batch;
    created->combiner = args->combiner;
    created->out = args->out;
    created->out_capacity = args->out_capacity;
    status = pull_requests(client, created, args, err);
    if (status != EM_OK) {
        call_destroy(client, created);
        return status;
    }
    status = call_send(client, created, err);
    if (status == EM_OK)
        *call = created;
    return status;
}

/* Several servers: they must agree on dim; the caller's output is merged here. */
static em_status merge_pull(const em_client_call *call, uint32_t *dim, em_error *err)
{
    const em__client_request *first = call->requests[0];
    *dim = first->dim;
    for (uint32_t s = 1; s < call->request_count; s++) {
        const em__client_request *other = call->requests[s];
        if (other->dim != first->dim)
            return em_error_set(err, EM_INTERNAL,
                                "servers %s and %s disagree on the table's dim: %u vs %u",
                                first->server->name, other->server->name, first->dim,
                                other->dim);
    }
    uint64_t vectors = em_csr_output_vectors(&call->batch, call->combiner);
    if (*dim != 0 && vectors > call->out_capacity / *dim)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "out_capacity %llu floats is less than %llu vectors x dim %u",
                            (unsigned long long)call->out_capacity, (unsigned long long)vectors,
                            *dim);
    const float *vectors_of[EM_CLIENT_SERVERS_MAX] = {0};
    for (uint32_t s = 0; s < call->split.server_count; s++)
        vectors_of[s] = call->by_server[s] != NULL ? call->by_server[s]->scratch : NULL;
    em__client_split_merge_pull(&call->split, &call->batch, call->combiner, *dim, vectors_of,
                                call->out);
    return EM_OK;
}

static em_status finish_pull(const em_client_call *call, em_client_pull_result *result,
                             em_error *err)
{
    em_client_pull_result total = {0};
    em_status status = EM_OK;
    if (call->split.server_count == 0)
        total.dim = call->requests[0]->dim; /* one server: the answer went straight to out */
    else
        status = merge_pull(call, &total.dim, err);
    for (uint32_t s = 0; s < call->request_count; s++) {
        const Ember__PullResponse *response =
            (const Ember__PullResponse *)call->requests[s]->response;
        total.unique_keys += response->unique_keys;
        total.missing += response->missing;
        total.created += response->created;
    }
    if (status == EM_OK && result != NULL)
        *result = total;
    return status;
}

em_status em_client_pull(em_client *client, const em_client_pull_args *args,
                         em_client_pull_result *result, em_error *err)
{
    em_client_call *call;
    em_status status = em_client_pull_start(client, args, &call, err);
    if (status != EM_OK)
        return status;
    return em_client_finish(client, call, result, err);
}

/* ---- push ------------------------------------------------------------------------- */

static em_status push_request(em_client *client, em_client_call *call, uint32_t server,
                              const char *table, const em_csr *batch, em_combiner combiner,
                              const float *gradients, uint64_t gradient_count, em_error *err)
{
    em__client_request *request = call_add_request(client, call, server);
    if (request == NULL)
        return out_of_memory(err, "push request");
    em__client_rpc rpc = call_rpc(client, call, request);
    return em__client_frame_push(&rpc, table, batch, combiner, gradients, gradient_count,
                                 &request->frame, err);
}

static em_status push_requests(em_client *client, em_client_call *call,
                               const em_client_push_args *args, uint32_t dim, em_error *err)
{
    if (client->server_count == 1)
        return push_request(client, call, 0, args->table, &args->batch, args->combiner,
                            args->gradients, args->gradient_count, err);
    em_status status = em__client_split_push(&args->batch, args->combiner, dim, args->gradients,
                                             client->server_count, &call->split, err);
    for (uint32_t s = 0; status == EM_OK && s < client->server_count; s++) {
        const em__client_sub_batch *sub = &call->split.servers[s];
        if (sub->batch.nnz == 0 && args->batch.nnz > 0)
            continue; /* as for pulls: only the servers with keys are asked */
        status = push_request(client, call, s, args->table, &sub->batch, EM_COMBINER_NONE,
                              sub->gradients, sub->gradient_count, err);
    }
    return status;
}

em_status em_client_push_start(em_client *client, const em_client_push_args *args,
                               em_client_call **call, em_error *err)
{
    *call = NULL;
    uint32_t dim;
    em_status status = check_push_args(args, &dim, err);
    if (status != EM_OK)
        return status;
    em_client_call *created =
        call_create(client, CALL_PUSH, EMBER__METHOD__PUSH, client->server_count);
    if (created == NULL)
        return out_of_memory(err, "push call");
    status = push_requests(client, created, args, dim, err);
    if (status != EM_OK) {
        call_destroy(client, created);
        return status;
    }
    status = call_send(client, created, err);
    if (status == EM_OK)
        *call = created;
    return status;
}

static void finish_push(const em_client_call *call, em_client_push_result *result)
{
    em_client_push_result total = {0};
    for (uint32_t s = 0; s < call->request_count; s++) {
        const Ember__PushResponse *response =
            (const Ember__PushResponse *)call->requests[s]->response;
        total.updated += response->updated;
        total.created += response->created;
    }
    if (result != NULL)
        *result = total;
}

em_status em_client_push(em_client *client, const em_client_push_args *args,
                         em_client_push_result *result, em_error *err)
{
    em_client_call *call;
    em_status status = em_client_push_start(client, args, &call, err);
    if (status != EM_OK)
        return status;
    return em_client_finish(client, call, result, err);
}

em_status em_client_finish(em_client *client, em_client_call *call, void *result, em_error *err)
{
    em_status status = call_wait(client, call, err);
    if (status == EM_OK && call->kind == CALL_PULL)
        status = finish_pull(call, result, err);
    else if (status == EM_OK && call->kind == CALL_PUSH)
        finish_push(call, result);
    call_destroy(client, call);
    return status;
}

/* ---- messages to the first server ------------------------------------------------- */

/* Sends one request without attachment to the first server and waits for its answer;
 * on success *call holds the response (call_destroy when done). */
/* Sends a framed call and waits for its answers: *call is it, or it is freed on an error. */
static em_status send_and_wait(em_client *client, em_client_call *created, em_client_call **call,
                               em_error *err)
{
    em_status status = call_send(client, created, err);
    if (status != EM_OK)
        return status;
    status = call_wait(client, created, err);
    if (status != EM_OK) {
        call_destroy(client, created);
        return status;
    }
    *call = created;
    return EM_OK;
}

static em_status message_call(em_client *client, int method, const ProtobufCMessage *body,
                              em_client_call **call, em_error *err)
{
    em_client_call *created = call_create(client, CALL_MESSAGE, method, 1);
    if (created == NULL)
        return out_of_memory(err, em_method_name(method));
    em__client_request *request = call_add_request(client, created, 0);
    if (request == NULL) {
        call_destroy(client, created);
        return out_of_memory(err, em_method_name(method));
    }
    em__client_rpc rpc = call_rpc(client, created, request);
    em_status status = em__client_frame_message(&rpc, body, &request->frame, err);
    if (status != EM_OK) {
        call_destroy(client, created);
        return status;
    }
    return send_and_wait(client, created, call, err);
}

static const void *call_response(const em_client_call *call)
{
    return call->requests[0]->response;
}

static void copy_text(char *destination, size_t capacity, const char *source)
{
    if (destination != NULL && capacity > 0)
        snprintf(destination, capacity, "%s", source != NULL ? source : "");
}

em_status em_client_ping(em_client *client, char *version, size_t version_capacity,
                         uint64_t *uptime_ms, em_error *err)
{
    Ember__PingRequest body = EMBER__PING_REQUEST__INIT;
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__PING, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    const Ember__PingResponse *response = call_response(call);
    copy_text(version, version_capacity, response->version);
    if (uptime_ms != NULL)
        *uptime_ms = response->uptime_ms;
    call_destroy(client, call);
    return EM_OK;
}

em_status em_client_health_check(em_client *client, em_client_health *out, em_error *err)
{
    Ember__HealthRequest body = EMBER__HEALTH_REQUEST__INIT;
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__HEALTH, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    const Ember__HealthResponse *response = call_response(call);
    out->ready = response->ready;
    copy_text(out->state, sizeof(out->state), response->state);
    copy_text(out->backend, sizeof(out->backend), response->backend);
    out->devices = response->devices;
    out->tables = response->tables;
    call_destroy(client, call);
    return EM_OK;
}

em_status em_client_create_table(em_client *client, const char *config_json, cJSON **info,
                                 em_error *err)
{
    if (info != NULL)
        *info = NULL;
    if (config_json == NULL || config_json[0] == '\0')
        return em_error_set(err, EM_INVALID_ARGUMENT, "table config is empty");
    Ember__CreateTableRequest body = EMBER__CREATE_TABLE_REQUEST__INIT;
    body.config_json = (char *)config_json;
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__CREATE_TABLE, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    const Ember__CreateTableResponse *response = call_response(call);
    if (info != NULL && response->table != NULL) {
        *info = em__client_json_table_info(response->table);
        if (*info == NULL)
            status = out_of_memory(err, "table info");
    }
    call_destroy(client, call);
    return status;
}

em_status em_client_drop_table(em_client *client, const char *table, em_error *err)
{
    if (table == NULL || table[0] == '\0')
        return em_error_set(err, EM_INVALID_ARGUMENT, "table name is empty");
    Ember__DropTableRequest body = EMBER__DROP_TABLE_REQUEST__INIT;
    body.table = (char *)table;
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__DROP_TABLE, &body.base, &call, err);
    if (status == EM_OK)
        call_destroy(client, call);
    return status;
}

static cJSON *table_list(const Ember__ListTablesResponse *response)
{
    cJSON *tables = cJSON_CreateArray();
    for (size_t i = 0; tables != NULL && i < response->n_tables; i++) {
        cJSON *table = em__client_json_table_info(response->tables[i]);
        if (table == NULL || !cJSON_AddItemToArray(tables, table)) {
            cJSON_Delete(table);
            cJSON_Delete(tables);
            return NULL;
        }
    }
    return tables;
}

em_status em_client_list_tables(em_client *client, cJSON **tables, em_error *err)
{
    *tables = NULL;
    Ember__ListTablesRequest body = EMBER__LIST_TABLES_REQUEST__INIT;
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__LIST_TABLES, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    *tables = table_list(call_response(call));
    if (*tables == NULL)
        status = out_of_memory(err, "table list");
    call_destroy(client, call);
    return status;
}

em_status em_client_stats(em_client *client, const char *table, cJSON **stats, em_error *err)
{
    *stats = NULL;
    Ember__StatsRequest body = EMBER__STATS_REQUEST__INIT;
    body.table = (char *)(table != NULL ? table : "");
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__STATS, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    *stats = em__client_json_stats(call_response(call));
    if (*stats == NULL)
        status = out_of_memory(err, "stats");
    call_destroy(client, call);
    return status;
}

static cJSON *checkpoint_info(const Ember__CheckpointInfo *info)
{
    char hash[17];
    snprintf(hash, sizeof(hash), "%016" PRIx64, info->manifest_xxh3);
    cJSON *item = cJSON_CreateObject();
    if (item == NULL || cJSON_AddStringToObject(item, "table", info->table) == NULL ||
        cJSON_AddStringToObject(item, "id", info->id) == NULL ||
        cJSON_AddStringToObject(item, "path", info->path) == NULL ||
        cJSON_AddNumberToObject(item, "rows", (double)info->rows) == NULL ||
        cJSON_AddNumberToObject(item, "bytes", (double)info->bytes) == NULL ||
        cJSON_AddNumberToObject(item, "seconds", info->seconds) == NULL ||
        cJSON_AddStringToObject(item, "kind", info->kind) == NULL ||
        cJSON_AddStringToObject(item, "parent", info->parent) == NULL ||
        cJSON_AddNumberToObject(item, "depth", info->depth) == NULL ||
        cJSON_AddNumberToObject(item, "tombstones", (double)info->tombstones) == NULL ||
        cJSON_AddNumberToObject(item, "table_rows", (double)info->table_rows) == NULL ||
        cJSON_AddStringToObject(item, "manifest_xxh3", hash) == NULL ||
        cJSON_AddNumberToObject(item, "chunks", (double)info->chunks) == NULL ||
        cJSON_AddNumberToObject(item, "created_unix_ms", (double)info->created_unix_ms) == NULL) {
        cJSON_Delete(item);
        return NULL;
    }
    return item;
}

static cJSON *checkpoint_list(Ember__CheckpointInfo *const *infos, size_t count)
{
    cJSON *list = cJSON_CreateArray();
    for (size_t i = 0; list != NULL && i < count; i++) {
        cJSON *item = checkpoint_info(infos[i]);
        if (item == NULL || !cJSON_AddItemToArray(list, item)) {
            cJSON_Delete(item);
            cJSON_Delete(list);
            return NULL;
        }
    }
    return list;
}

em_status em_client_save(em_client *client, const char *table, bool delta, cJSON **saved,
                         em_error *err)
{
    *saved = NULL;
    Ember__SaveRequest body = EMBER__SAVE_REQUEST__INIT;
    body.table = (char *)(table != NULL ? table : "");
    body.delta = delta;
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__SAVE, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    const Ember__SaveResponse *response = call_response(call);
    *saved = checkpoint_list(response->saved, response->n_saved);
    if (*saved == NULL)
        status = out_of_memory(err, "save");
    call_destroy(client, call);
    return status;
}

em_status em_client_checkpoints(em_client *client, const char *table, cJSON **listed,
                                em_error *err)
{
    *listed = NULL;
    Ember__CheckpointsRequest body = EMBER__CHECKPOINTS_REQUEST__INIT;
    body.table = (char *)(table != NULL ? table : "");
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__CHECKPOINTS, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    const Ember__CheckpointsResponse *response = call_response(call);
    *listed = checkpoint_list(response->checkpoints, response->n_checkpoints);
    if (*listed == NULL)
        status = out_of_memory(err, "checkpoints");
    call_destroy(client, call);
    return status;
}

em_status em_client_drain(em_client *client, em_client_drain_state *out, em_error *err)
{
    Ember__DrainRequest body = EMBER__DRAIN_REQUEST__INIT;
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__DRAIN, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    const Ember__DrainResponse *response = call_response(call);
    out->was_drained = response->was_drained;
    out->requests_running = response->requests_running;
    out->data_connections = response->data_connections;
    call_destroy(client, call);
    return EM_OK;
}

em_status em_client_undrain(em_client *client, bool *was_drained, em_error *err)
{
    Ember__UndrainRequest body = EMBER__UNDRAIN_REQUEST__INIT;
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__UNDRAIN, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    const Ember__UndrainResponse *response = call_response(call);
    if (was_drained != NULL)
        *was_drained = response->was_drained;
    call_destroy(client, call);
    return EM_OK;
}

static cJSON *string_array(char *const *items, size_t count)
{
    cJSON *array = cJSON_CreateArray();
    for (size_t i = 0; array != NULL && i < count; i++)
        cJSON_AddItemToArray(array, cJSON_CreateString(items[i]));
    return array;
}

em_status em_client_reload(em_client *client, cJSON **report, em_error *err)
{
    *report = NULL;
    Ember__ReloadRequest body = EMBER__RELOAD_REQUEST__INIT;
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__RELOAD, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    const Ember__ReloadResponse *response = call_response(call);
    cJSON *json = cJSON_CreateObject();
    if (json != NULL) {
        cJSON_AddStringToObject(json, "path", response->path);
        cJSON_AddItemToObject(json, "changed",
                              string_array(response->changed, response->n_changed));
        cJSON_AddItemToObject(json, "needs_restart",
                              string_array(response->needs_restart, response->n_needs_restart));
    }
    call_destroy(client, call);
    if (json == NULL)
        return out_of_memory(err, "reload");
    *report = json;
    return EM_OK;
}

em_status em_client_slowlog(em_client *client, uint32_t max, bool reset, cJSON **log,
                            em_error *err)
{
    *log = NULL;
    Ember__SlowlogRequest body = EMBER__SLOWLOG_REQUEST__INIT;
    body.max = max;
    body.reset = reset;
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__SLOWLOG, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    const Ember__SlowlogResponse *response = call_response(call);
    cJSON *json = cJSON_CreateObject();
    cJSON *entries = cJSON_AddArrayToObject(json, "entries");
    cJSON_AddNumberToObject(json, "recorded", (double)response->recorded);
    cJSON_AddNumberToObject(json, "dropped", (double)response->dropped);
    cJSON_AddNumberToObject(json, "threshold_ms", (double)response->threshold_ms);
    for (size_t i = 0; entries != NULL && i < response->n_entries; i++) {
        const Ember__SlowRequest *e = response->entries[i];
        cJSON *item = cJSON_CreateObject();
        cJSON_AddNumberToObject(item, "id", (double)e->id);
        cJSON_AddNumberToObject(item, "unix_ms", (double)e->unix_ms);
        cJSON_AddNumberToObject(item, "duration_us", (double)e->duration_us);
        cJSON_AddNumberToObject(item, "queue_us", (double)e->queue_us);
        cJSON_AddNumberToObject(item, "run_us", (double)e->run_us);
        cJSON_AddStringToObject(item, "method", e->method);
        cJSON_AddStringToObject(item, "table", e->table);
        cJSON_AddNumberToObject(item, "keys", (double)e->keys);
        cJSON_AddNumberToObject(item, "bytes", (double)e->bytes);
        cJSON_AddStringToObject(item, "status", e->status);
        cJSON_AddStringToObject(item, "peer", e->peer);
        cJSON_AddItemToArray(entries, item);
    }
    call_destroy(client, call);
    if (json == NULL || entries == NULL) {
        cJSON_Delete(json);
        return out_of_memory(err, "slowlog");
    }
    *log = json;
    return EM_OK;
}

/* ---- erase and evicted keys ------------------------------------------------------- */

em_status em_client_erase(em_client *client, const char *table, const uint64_t *keys,
                          uint64_t n, uint64_t *erased, em_error *err)
{
    *erased = 0;
    if (table == NULL || table[0] == '\0')
        return em_error_set(err, EM_INVALID_ARGUMENT, "table name is empty");
    if (n > 0 && keys == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT, "erase: %" PRIu64 " keys but no array", n);
    uint32_t servers = client->server_count;
    /* each key goes to the server that holds it (as pulls and pushes route it) */
    uint64_t *grouped = malloc((n + 1) * sizeof(uint64_t));
    uint64_t *start = calloc(servers + 1, sizeof(uint64_t));
    em_client_call *call = call_create(client, CALL_MESSAGE, EMBER__METHOD__ERASE, servers);
    if (grouped == NULL || start == NULL || call == NULL) {
        free(grouped);
        free(start);
        if (call != NULL)
            call_destroy(client, call);
        return out_of_memory(err, "erase");
    }
    for (uint64_t i = 0; i < n; i++)
        start[em_key_server(keys[i], (int32_t)servers) + 1]++;
    for (uint32_t s = 0; s < servers; s++)
        start[s + 1] += start[s];
    uint64_t *cursor = calloc(servers, sizeof(uint64_t));
    em_status status = cursor == NULL ? out_of_memory(err, "erase") : EM_OK;
    for (uint64_t i = 0; status == EM_OK && i < n; i++) {
        uint32_t s = (uint32_t)em_key_server(keys[i], (int32_t)servers);
        grouped[start[s] + cursor[s]++] = keys[i];
    }
    for (uint32_t s = 0; status == EM_OK && s < servers; s++) {
        if (start[s + 1] == start[s] && !(n == 0 && s == 0)) /* an empty list asks server 0 */
            continue;
        em__client_request *request = call_add_request(client, call, s);
        if (request == NULL) {
            status = out_of_memory(err, "erase");
            break;
        }
        Ember__EraseRequest body = EMBER__ERASE_REQUEST__INIT;
        body.table = (char *)table;
        body.n_keys = start[s + 1] - start[s];
        body.keys = grouped + start[s];
        em__client_rpc rpc = call_rpc(client, call, request);
        status = em__client_frame_message(&rpc, &body.base, &request->frame, err);
    }
    free(cursor);
    if (status == EM_OK)
        status = call_send(client, call, err);
    else
        call_destroy(client, call);
    if (status == EM_OK) {
        status = call_wait(client, call, err);
        for (uint32_t i = 0; status == EM_OK && i < call->request_count; i++)
            *erased += ((const Ember__EraseResponse *)call->requests[i]->response)->erased;
        call_destroy(client, call);
    }
    free(grouped);
    free(start);
    return status;
}

/* ERASE by age or by time (body's by_age / by_time) on every server, summed. */
static em_status erase_everywhere(em_client *client, const Ember__EraseRequest *body,
                                  uint64_t *erased, em_error *err);

em_status em_client_erase_older(em_client *client, const char *table, uint32_t not_pushed_for,
                                uint64_t *erased, em_error *err)
{
    *erased = 0;
    if (table == NULL || table[0] == '\0')
        return em_error_set(err, EM_INVALID_ARGUMENT, "table name is empty");
    Ember__EraseRequest body = EMBER__ERASE_REQUEST__INIT;
    body.table = (char *)table;
    body.by_age = true;
    body.not_pushed_for = not_pushed_for;
    return erase_everywhere(client, &body, erased, err);
}

em_status em_client_erase_before(em_client *client, const char *table, uint64_t since_unix_ms,
                                 uint64_t *erased, em_error *err)
{
    *erased = 0;
    if (table == NULL || table[0] == '\0')
        return em_error_set(err, EM_INVALID_ARGUMENT, "table name is empty");
    Ember__EraseRequest body = EMBER__ERASE_REQUEST__INIT;
    body.table = (char *)table;
    body.by_time = true;
    body.since_unix_ms = since_unix_ms;
    return erase_everywhere(client, &body, erased, err);
}

static em_status erase_everywhere(em_client *client, const Ember__EraseRequest *body,
                                  uint64_t *erased, em_error *err)
{
    em_client_call *call = call_create(client, CALL_MESSAGE, EMBER__METHOD__ERASE,
                                       client->server_count);
    if (call == NULL)
        return out_of_memory(err, "erase");
    em_status status = EM_OK;
    /* every server holds rows of the table: each erases its own old ones */
    for (uint32_t s = 0; status == EM_OK && s < client->server_count; s++) {
        em__client_request *request = call_add_request(client, call, s);
        if (request == NULL) {
            status = out_of_memory(err, "erase");
            break;
        }
        em__client_rpc rpc = call_rpc(client, call, request);
        status = em__client_frame_message(&rpc, &body->base, &request->frame, err);
    }
    if (status != EM_OK) {
        call_destroy(client, call);
        return status;
    }
    status = call_send(client, call, err);
    if (status == EM_OK) {
        status = call_wait(client, call, err);
        for (uint32_t i = 0; status == EM_OK && i < call->request_count; i++)
            *erased += ((const Ember__EraseResponse *)call->requests[i]->response)->erased;
        call_destroy(client, call);
    }
    return status;
}

em_status em_client_evicted(em_client *client, const char *table, uint64_t after, uint32_t max,
                            cJSON **evicted, em_error *err)
{
    *evicted = NULL;
    if (table == NULL || table[0] == '\0')
        return em_error_set(err, EM_INVALID_ARGUMENT, "table name is empty");
    Ember__EvictedRequest body = EMBER__EVICTED_REQUEST__INIT;
    body.table = (char *)table;
    body.after = after;
    body.max = max;
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__EVICTED, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    const Ember__EvictedResponse *response = call_response(call);
    cJSON *json = cJSON_CreateObject();
    cJSON *keys = cJSON_AddArrayToObject(json, "keys");
    cJSON_AddNumberToObject(json, "first", (double)response->first);
    cJSON_AddNumberToObject(json, "total", (double)response->total);
    cJSON_AddNumberToObject(json, "missed", (double)response->missed);
    bool complete = keys != NULL;
    for (size_t i = 0; complete && i < response->n_keys; i++) {
        /* keys are 64-bit: as decimal text, which a JSON number cannot hold exactly */
        char text[24];
        snprintf(text, sizeof(text), "%" PRIu64, response->keys[i]);
        complete = cJSON_AddItemToArray(keys, cJSON_CreateString(text));
    }
    call_destroy(client, call);
    if (json == NULL || !complete) {
        cJSON_Delete(json);
        return out_of_memory(err, "evicted");
    }
    *evicted = json;
    return EM_OK;
}

em_status em_client_load(em_client *client, const char *table, const char *path,
                         bool weights_only, cJSON **loaded, em_error *err)
{
    if (loaded != NULL)
        *loaded = NULL;
    if (table == NULL || table[0] == '\0')
        return em_error_set(err, EM_INVALID_ARGUMENT, "table name is empty");
    Ember__LoadRequest body = EMBER__LOAD_REQUEST__INIT;
    body.table = (char *)table;
    body.path = (char *)(path != NULL ? path : "");
    body.weights_only = weights_only;
    em_client_call *call;
    em_status status = message_call(client, EMBER__METHOD__LOAD, &body.base, &call, err);
    if (status != EM_OK)
        return status;
    const Ember__LoadResponse *response = (const Ember__LoadResponse *)call_response(call);
    if (loaded != NULL && response->loaded != NULL) {
        *loaded = checkpoint_info(response->loaded);
        if (*loaded == NULL)
            status = out_of_memory(err, "load");
    }
    call_destroy(client, call);
    return status;
}

/* ---- cluster checkpoints ----------------------------------------------------------- */

/* Sends bodies[s] to server s, every server at once, and waits for all the answers:
 * call->requests[s] is server s's. */
static em_status message_call_each(em_client *client, int method,
                                   const ProtobufCMessage *const *bodies, em_client_call **call,
                                   em_error *err)
{
    em_client_call *created = call_create(client, CALL_MESSAGE, method, client->server_count);
    if (created == NULL)
        return out_of_memory(err, em_method_name(method));
    em_status status = EM_OK;
    for (uint32_t s = 0; status == EM_OK && s < client->server_count; s++) {
        em__client_request *request = call_add_request(client, created, s);
        if (request == NULL) {
            status = out_of_memory(err, em_method_name(method));
            break;
        }
        em__client_rpc rpc = call_rpc(client, created, request);
        status = em__client_frame_message(&rpc, bodies[s], &request->frame, err);
    }
    if (status != EM_OK) {
        call_destroy(client, created);
        return status;
    }
    return send_and_wait(client, created, call, err);
}

/* The record's entry for table, added when it has none yet. */
static cJSON *record_table(cJSON *tables, const char *name)
{
    cJSON *table = NULL;
    cJSON_ArrayForEach(table, tables)
    {
        if (strcmp(cJSON_GetObjectItemCaseSensitive(table, "name")->valuestring, name) == 0)
            return table;
    }
    table = cJSON_CreateObject();
    if (table == NULL || cJSON_AddStringToObject(table, "name", name) == NULL ||
        cJSON_AddArrayToObject(table, "parts") == NULL || !cJSON_AddItemToArray(tables, table)) {
        cJSON_Delete(table);
        return NULL;
    }
    return table;
}

/* Adds server s's saved checkpoints (under part_dir, which is below dir) to the record. */
static em_status record_parts(cJSON *tables, const char *dir, const char *part_dir, uint32_t s,
                              const em__client_server *server,
                              const Ember__SaveResponse *response, em_error *err)
{
    size_t prefix = strlen(dir) + 1;
    for (size_t i = 0; i < response->n_saved; i++) {
        const Ember__CheckpointInfo *info = response->saved[i];
        if (strncmp(info->path, part_dir, strlen(part_dir)) != 0 ||
            info->path[strlen(part_dir)] != '/')
            return em_error_set(err, EM_INTERNAL,
                                "cluster save: server %s saved table '%s' at %s, not under %s",
                                server->name, info->table, info->path, part_dir);
        cJSON *table = record_table(tables, info->table);
        cJSON *part = cJSON_CreateObject();
        char hash[17];
        snprintf(hash, sizeof(hash), "%016" PRIx64, info->manifest_xxh3);
        if (table == NULL || part == NULL ||
            cJSON_AddNumberToObject(part, "server", s) == NULL ||
            cJSON_AddStringToObject(part, "address", server->name) == NULL ||
            cJSON_AddStringToObject(part, "path", info->path + prefix) == NULL ||
            cJSON_AddStringToObject(part, "id", info->id) == NULL ||
            cJSON_AddStringToObject(part, "manifest_xxh3", hash) == NULL ||
            cJSON_AddNumberToObject(part, "rows", (double)info->table_rows) == NULL ||
            cJSON_AddNumberToObject(part, "bytes", (double)info->bytes) == NULL ||
            !cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(table, "parts"), part)) {
            cJSON_Delete(part);
            return out_of_memory(err, "cluster save");
        }
    }
    return EM_OK;
}

static cJSON *new_record(const em_client *client)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    cJSON *record = cJSON_CreateObject();
    cJSON *servers = NULL;
    if (record == NULL ||
        cJSON_AddStringToObject(record, "format", "ember-cluster-checkpoint") == NULL ||
        cJSON_AddNumberToObject(record, "version", EM_CLUSTER_FORMAT_VERSION) == NULL ||
        cJSON_AddNumberToObject(record, "buckets", EM_KEY_BUCKETS) == NULL ||
        cJSON_AddNumberToObject(record, "created_unix_ms",
                                (double)now.tv_sec * 1000.0 + (double)(now.tv_nsec / 1000000)) ==
            NULL ||
        (servers = cJSON_AddArrayToObject(record, "servers")) == NULL ||
        cJSON_AddArrayToObject(record, "tables") == NULL) {
        cJSON_Delete(record);
        return NULL;
    }
    for (uint32_t s = 0; s < client->server_count; s++) {
        cJSON *name = cJSON_CreateString(client->servers[s].name);
        if (name == NULL || !cJSON_AddItemToArray(servers, name)) {
            cJSON_Delete(name);
            cJSON_Delete(record);
            return NULL;
        }
    }
    return record;
}

em_status em_client_cluster_save(em_client *client, const char *table, const char *dir,
                                 cJSON **record, em_error *err)
{
    if (record != NULL)
        *record = NULL;
    em_status status = em_cluster_prepare(dir, err);
    if (status != EM_OK)
        return status;
    uint32_t n = client->server_count;
    char (*part_dirs)[3100] = calloc(n, sizeof(*part_dirs));
    Ember__SaveRequest *bodies = calloc(n, sizeof(*bodies));
    const ProtobufCMessage **pointers = calloc(n, sizeof(*pointers));
    cJSON *made = new_record(client);
    if (part_dirs == NULL || bodies == NULL || pointers == NULL || made == NULL)
        status = out_of_memory(err, "cluster save");
    for (uint32_t s = 0; status == EM_OK && s < n; s++) {
        snprintf(part_dirs[s], sizeof(part_dirs[s]), "%s/server-%u", dir, s);
        ember__save_request__init(&bodies[s]);
        bodies[s].table = (char *)(table != NULL ? table : "");
        bodies[s].dir = part_dirs[s];
        pointers[s] = &bodies[s].base;
    }
    em_client_call *call = NULL;
    if (status == EM_OK)
        status = message_call_each(client, EMBER__METHOD__SAVE, pointers, &call, err);
    cJSON *tables = made != NULL ? cJSON_GetObjectItemCaseSensitive(made, "tables") : NULL;
    for (uint32_t s = 0; status == EM_OK && s < n; s++)
        status = record_parts(tables, dir, part_dirs[s], s, &client->servers[s],
                              (const Ember__SaveResponse *)call->requests[s]->response, err);
    if (call != NULL)
        call_destroy(client, call);
    if (status == EM_OK)
        status = em_cluster_write(dir, made, err);
    free(part_dirs);
    free(bodies);
    free(pointers);
    if (status == EM_OK && record != NULL)
        *record = made;
    else
        cJSON_Delete(made);
    return status;
}

/* Loads one table of the record onto every server of the client's list. */
static em_status cluster_load_table(em_client *client, const cJSON *record, const char *dir,
                                    const char *table, uint32_t shards, cJSON *results,
                                    em_error *err)
{
    char **paths = NULL;
    uint64_t *manifests = NULL;
    size_t count = 0;
    em_status status = em_cluster_sources(record, dir, table, &paths, &manifests, &count, err);
    if (status != EM_OK)
        return status;
    uint32_t n = client->server_count;
    Ember__LoadRequest *bodies = calloc(n, sizeof(*bodies));
    const ProtobufCMessage **pointers = calloc(n, sizeof(*pointers));
    if (bodies == NULL || pointers == NULL)
        status = out_of_memory(err, "cluster load");
    for (uint32_t s = 0; status == EM_OK && s < n; s++) {
        ember__load_request__init(&bodies[s]);
        bodies[s].table = (char *)table;
        bodies[s].path = (char *)"";
        bodies[s].n_sources = count;
        bodies[s].sources = paths;
        bodies[s].n_source_manifests = count;
        bodies[s].source_manifests = manifests;
        bodies[s].server_index = s;
        bodies[s].server_count = n;
        bodies[s].shards = shards;
        pointers[s] = &bodies[s].base;
    }
    em_client_call *call = NULL;
    if (status == EM_OK)
        status = message_call_each(client, EMBER__METHOD__LOAD, pointers, &call, err);
    for (uint32_t s = 0; status == EM_OK && s < n; s++) {
        const Ember__LoadResponse *response =
            (const Ember__LoadResponse *)call->requests[s]->response;
        cJSON *item = response->loaded != NULL ? checkpoint_info(response->loaded) : NULL;
        if (item == NULL || cJSON_AddNumberToObject(item, "server", s) == NULL ||
            cJSON_AddStringToObject(item, "address", client->servers[s].name) == NULL ||
            cJSON_AddNumberToObject(item, "sources", (double)count) == NULL ||
            !cJSON_AddItemToArray(results, item)) {
            cJSON_Delete(item);
            status = out_of_memory(err, "cluster load");
        }
    }
    if (call != NULL)
        call_destroy(client, call);
    free(bodies);
    free(pointers);
    em_cluster_free_sources(paths, manifests, count);
    return status;
}

em_status em_client_cluster_load(em_client *client, const char *dir, const char *table,
                                 uint32_t shards, cJSON **loaded, em_error *err)
{
    if (loaded != NULL)
        *loaded = NULL;
    if (dir == NULL || dir[0] != '/')
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "cluster checkpoint dir '%s' is not absolute: the client and every "
                            "server must see it under the same path", dir == NULL ? "" : dir);
    cJSON *record = NULL;
    em_status status = em_cluster_read(dir, &record, err);
    if (status != EM_OK)
        return status;
    cJSON *results = cJSON_CreateArray();
    if (results == NULL)
        status = out_of_memory(err, "cluster load");
    if (status == EM_OK && table != NULL && table[0] != '\0') {
        status = cluster_load_table(client, record, dir, table, shards, results, err);
    } else {
        const cJSON *entry = NULL;
        cJSON_ArrayForEach(entry, cJSON_GetObjectItemCaseSensitive(record, "tables"))
        {
            if (status != EM_OK)
                break;
            status = cluster_load_table(client, record, dir,
                                        cJSON_GetObjectItemCaseSensitive(entry, "name")->valuestring,
                                        shards, results, err);
        }
    }
    cJSON_Delete(record);
    if (status == EM_OK && loaded != NULL)
        *loaded = results;
    else
        cJSON_Delete(results);
    return status;
}

/* ---- lifecycle -------------------------------------------------------------------- */

void em_client_options_init(em_client_options *options)
{
    *options = (em_client_options){
        .servers = DEFAULT_SERVERS,
        .token = NULL,
        .window = DEFAULT_WINDOW,
        .timeout_ms = DEFAULT_TIMEOUT_MS,
        .connect_timeout_ms = DEFAULT_CONNECT_TIMEOUT_MS,
        .reconnect_attempts = DEFAULT_RECONNECT_ATTEMPTS,
    };
}

uint32_t em_client_server_count(const em_client *client)
{
    return client->server_count;
}

static em_status copy_options(em_client *client, const em_client_options *options,
                              em_error *err)
{
    client->options = *options;
    if (client->options.window == 0)
        return em_error_set(err, EM_INVALID_ARGUMENT, "window is 0; at least 1 request must "
                                                      "be allowed in flight");
    if (client->options.connect_timeout_ms == 0)
        client->options.connect_timeout_ms = DEFAULT_CONNECT_TIMEOUT_MS;
    if (client->options.connect_timeout_ms > INT_MAX)
        client->options.connect_timeout_ms = INT_MAX;
    client->servers_text = strdup(options->servers != NULL ? options->servers : "");
    client->token = strdup(options->token != NULL ? options->token : "");
    if (client->servers_text == NULL || client->token == NULL)
        return out_of_memory(err, "client options");
    client->options.servers = client->servers_text;
    client->options.token = client->token;
    /* the TLS files are read once, when the client is created */
    client->options.tls_ca_file = NULL;
    client->options.tls_cert_file = NULL;
    client->options.tls_key_file = NULL;
    client->options.tls_server_name = NULL;
    return EM_OK;
}

static em_status setup_connections(em_client *client, em_error *err)
{
    uint32_t n = client->server_count;
    client->connections = calloc(n, sizeof(*client->connections));
    client->poll_entries = calloc(n, sizeof(*client->poll_entries));
    client->poll_servers = calloc(n, sizeof(*client->poll_servers));
    if (client->connections == NULL || client->poll_entries == NULL ||
        client->poll_servers == NULL)
        return out_of_memory(err, "connections");
    for (uint32_t s = 0; s < n; s++)
        em__client_connection_init(&client->connections[s], &client->servers[s], client->tls);
    client->connection_count = n;
    for (uint32_t s = 0; s < n; s++) {
        em_status status = connect_with_retries(client, s, 0, err);
        if (status != EM_OK)
            return status;
    }
    return EM_OK;
}

em_status em_client_create(const em_client_options *options, em_client **out, em_error *err)
{
    *out = NULL;
    if (options == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT, "client options are NULL");
    em_client *client = calloc(1, sizeof(*client));
    if (client == NULL)
        return out_of_memory(err, "client");
    client->next_correlation_id = 1;
    em_status status = copy_options(client, options, err);
    if (status == EM_OK && options->tls_ca_file != NULL && options->tls_ca_file[0] != '\0')
        status = em__client_tls_create(options->tls_ca_file, options->tls_cert_file,
                                       options->tls_key_file, options->tls_server_name,
                                       &client->tls, err);
    if (status == EM_OK)
        status = em__client_servers_parse(client->servers_text, &client->servers,
                                          &client->server_count, err);
    if (status == EM_OK)
        status = setup_connections(client, err);
    if (status != EM_OK) {
        em_client_destroy(client);
        return status;
    }
    *out = client;
    return EM_OK;
}

void em_client_destroy(em_client *client)
{
    if (client == NULL)
        return;
    for (uint32_t s = 0; s < client->connection_count; s++)
        em__client_connection_deinit(&client->connections[s]);
    while (client->calls != NULL)
        call_destroy(client, client->calls);
    free(client->connections);
    free(client->poll_entries);
    free(client->poll_servers);
    free(client->servers);
    free(client->servers_text);
    free(client->token);
    em__client_tls_destroy(client->tls);
    free(client);
}
