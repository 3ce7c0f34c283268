/*
 * emberd over loopback against redis-server on the same workload, in the same run.
 *
 *   bench_server [--emberd PATH] [--seconds S] [--keys N] [--quick]
 *                [--backend cpu|cuda] [--batch 256|4096|65536] [--connections 1|4|16]
 *
 * Starts an emberd (CPU backend) and a redis-server on ephemeral loopback ports, loads
 * the same N keys of dim 64 into both (Redis: one 256-byte binary value per key), then:
 *   1. pull and push keys/s and MB/s for batches of 256 / 4096 / 65536 keys over
 *      1 / 4 / 16 connections (one thread per connection); Redis pulls with pipelined
 *      MGET, writes with MSET (Redis has no optimizer: it only stores the new values);
 *   2. latency p50 / p99 of a 26-key pull with 16 concurrent clients, one request at
 *      a time each (MGET of 26 keys for Redis);
 *   3. raw loopback TCP throughput (one socket, 1 MiB writes) and ember's best pull
 *      MB/s as a fraction of it;
 *   4. pull keys/s with TLS against without, same daemon and run: the admin listener
 *      speaks TLS (certificates made with the openssl command) and serves pulls too, the
 *      data listener is plaintext.
 * It prints the ratio of ember to Redis pull keys/s.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clients/ember_client.h"
#include "tests/support/test_support.h"

#define DIM 64
#define VALUE_BYTES (DIM * sizeof(float))
#define ADMIN_TOKEN "bench-admin-token"
#define LATENCY_KEYS 26
/* Redis MGET/MSET commands carry at most this many keys; larger batches pipeline. */
#define REDIS_CHUNK 4096

typedef struct bench_options {
    const char *emberd;
    double seconds;
    uint64_t keys;
    bool quick;
    const char *backend;       /* emberd's backend.type: cpu, cuda or auto */
    uint32_t only_batch;       /* 0: every batch size */
    uint32_t only_connections; /* 0: every connection count */
} bench_options;

/* ---- processes ------------------------------------------------------------------------- */

/* The servers spawned and not yet stopped: stopped at exit too, so that a run that
 * gives up half-way (a server that did not start, a failed load) leaves none behind. */
#define MAX_SPAWNED 4
static pid_t spawned[MAX_SPAWNED];

static void stop_process(pid_t pid);

static void stop_spawned(void)
{
    for (int i = 0; i < MAX_SPAWNED; i++)
        stop_process(spawned[i]);
}

static pid_t spawn(char *const argv[], const char *log_path)
{
    static bool registered;
    if (!registered)
        registered = atexit(stop_spawned) == 0;
    pid_t pid = fork();
    if (pid == 0) {
        FILE *log = fopen(log_path, "w");
        if (log != NULL) {
            dup2(fileno(log), STDOUT_FILENO);
            dup2(fileno(log), STDERR_FILENO);
        }
        execvp(argv[0], argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    for (int i = 0; pid > 0 && i < MAX_SPAWNED; i++)
        if (spawned[i] == 0) {
            spawned[i] = pid;
            break;
        }
    return pid;
}

static void stop_process(pid_t pid)
{
    if (pid <= 0)
        return;
    for (int i = 0; i < MAX_SPAWNED; i++)
        if (spawned[i] == pid)
            spawned[i] = 0;
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
}

static uint16_t free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bind(fd, (struct sockaddr *)&address, sizeof(address));
    socklen_t length = sizeof(address);
    getsockname(fd, (struct sockaddr *)&address, &length);
    close(fd);
    return ntohs(address.sin_port);
}

static int connect_port(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(port),
                                  .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(fd, (struct sockaddr *)&address, sizeof(address)) != 0) {
        close(fd);
        return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
}

typedef struct servers {
    pid_t emberd, redis;
    char data[64], admin[64];
    uint16_t redis_port;
    char directory[64];
    char ca[128]; /* the CA that signed the admin listener's TLS certificate */
} servers;

static bool read_listen_file(const char *path, servers *s)
{
    FILE *file = fopen(path, "r");
    if (file == NULL)
        return false;
    char text[512] = {0};
    size_t got = fread(text, 1, sizeof(text) - 1, file);
    fclose(file);
    if (got == 0)
        return false;
    return sscanf(text, "{\"data\": \"%63[^\"]\", \"admin\": \"%63[^\"]\"", s->data, s->admin) == 2;
}

/* A CA and a certificate for 127.0.0.1 it signed, in the run's directory. */
static void make_certificates(servers *s)
{
    char command[2048];
    snprintf(command, sizeof(command),
             "cd %s && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes "
             "-days 1 -keyout ca.key -out ca.pem -subj /CN=bench-ca && "
             "openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "
             "server.key -out server.csr -subj /CN=emberd && "
             "printf 'subjectAltName=IP:127.0.0.1\\n' > server.ext && "
             "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "-days 1 -extfile server.ext -out server.pem && chmod 600 *.key",
             s->directory);
    char quiet[2200];
    snprintf(quiet, sizeof(quiet), "(%s) >/dev/null 2>&1", command);
    if (system(quiet) != 0) {
        fprintf(stderr, "making the TLS certificates failed (is openssl installed?)\n");
        exit(1);
    }
    snprintf(s->ca, sizeof(s->ca), "%s/ca.pem", s->directory);
}

static void start_emberd(const bench_options *opt, servers *s)
{
    snprintf(s->directory, sizeof(s->directory), "/tmp/ember-bench-XXXXXX");
    if (mkdtemp(s->directory) == NULL)
        exit(1);
    make_certificates(s);
    char config[256], listen[256], log[256];
    snprintf(config, sizeof(config), "%s/emberd.json", s->directory);
    snprintf(listen, sizeof(listen), "%s/listen.json", s->directory);
    snprintf(log, sizeof(log), "%s/emberd.log", s->directory);
    FILE *file = fopen(config, "w");
    fprintf(file,
            "{\"listen\": {\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:0\", \"metrics\": \"\"},"
            " \"backend\": {\"type\": \"%s\"},"
            " \"limits\": {\"max_connections\": 4096},"
            " \"tables\": [{\"name\": \"bench\", \"dim\": %d, \"capacity\": %" PRIu64 ","
            " \"shards\": 8, \"optimizer\": {\"type\": \"adagrad\", \"lr\": 0.01}}],"
            " \"tls\": {\"certificate_file\": \"%s/server.pem\","
            "  \"private_key_file\": \"%s/server.key\", \"data\": false, \"admin\": true},"
            " \"admin_token\": {\"value\": \"" ADMIN_TOKEN "\"}, \"log_level\": \"warning\"}",
            opt->backend, DIM, opt->keys * 2, s->directory, s->directory);
    fclose(file);
    char *argv[] = {(char *)opt->emberd, "--config", config, "--listen-file", listen, NULL};
    s->emberd = spawn(argv, log);
    for (int i = 0; i < 2000 && !read_listen_file(listen, s); i++)
        usleep(10000);
    if (s->data[0] == '\0') {
        fprintf(stderr, "emberd did not start; see %s\n", log);
        exit(1);
    }
}

static void start_redis(servers *s)
{
    s->redis_port = free_port();
    char port[16], log[256];
    snprintf(port, sizeof(port), "%u", s->redis_port);
    snprintf(log, sizeof(log), "%s/redis.log", s->directory);
    char *argv[] = {"redis-server", "--port", port, "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--protected-mode", "no", NULL};
    s->redis = spawn(argv, log);
    for (int i = 0; i < 500; i++) {
        int fd = connect_port(s->redis_port);
        if (fd >= 0) {
            close(fd);
            return;
        }
        usleep(10000);
    }
    fprintf(stderr, "redis-server did not start (is it installed? deploy/install-deps.sh "
                    "--bench); see %s\n", log);
    exit(1);
}

/* ---- workload ------------------------------------------------------------------------ */

static uint64_t key_of(uint64_t index)
{
    return index * 0x9e3779b97f4a7c15ull;
}

static void fill_keys(em_test_rng *rng, uint64_t universe, uint64_t *keys, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        keys[i] = key_of(em_test_rng_below(rng, universe));
}

static em_client *connect_ember(const char *address, const char *tls_ca)
{
    em_client_options options;
    em_client_options_init(&options);
    options.servers = address;
    options.tls_ca_file = tls_ca;
    em_client *client = NULL;
    em_error err;
    if (em_client_create(&options, &client, &err) != EM_OK) {
        fprintf(stderr, "client: %s\n", err.message);
        exit(1);
    }
    return client;
}

/* One row per key (identity offsets), so pulls return one vector per key. */
static uint32_t *identity_offsets(uint32_t n)
{
    uint32_t *offsets = malloc((n + 1) * sizeof(uint32_t));
    for (uint32_t i = 0; i <= n; i++)
        offsets[i] = i;
    return offsets;
}

static void load_ember(const servers *s, uint64_t universe)
{
    em_client *client = connect_ember(s->data, NULL);
    const uint32_t batch = 65536;
    uint64_t *keys = malloc(batch * sizeof(uint64_t));
    uint32_t *offsets = identity_offsets(batch);
    float *out = malloc((size_t)batch * VALUE_BYTES);
    for (uint64_t start = 0; start < universe; start += batch) {
        uint32_t n = (uint32_t)(universe - start < batch ? universe - start : batch);
        for (uint32_t i = 0; i < n; i++)
            keys[i] = key_of(start + i);
        em_client_pull_args args = {"bench", {n, n, offsets, keys}, EM_COMBINER_NONE, true, out,
                                    (uint64_t)n * DIM};
        em_client_pull_result result;
        em_error err;
        if (em_client_pull(client, &args, &result, &err) != EM_OK) {
            fprintf(stderr, "load: %s\n", err.message);
            exit(1);
        }
    }
    free(keys);
    free(offsets);
    free(out);
    em_client_destroy(client);
}

/* ---- a minimal RESP client ------------------------------------------------------------ */

typedef struct resp {
    int fd;
    char *out;
    size_t out_length, out_capacity;
    char *in;
    size_t in_start, in_end, in_capacity;
} resp;

static void resp_reserve(resp *r, size_t more)
{
    if (r->out_length + more <= r->out_capacity)
        return;
    while (r->out_length + more > r->out_capacity)
        r->out_capacity = r->out_capacity ? r->out_capacity * 2 : 1 << 16;
    r->out = realloc(r->out, r->out_capacity);
}

static void resp_append(resp *r, const void *data, size_t length)
{
    resp_reserve(r, length);
    memcpy(r->out + r->out_length, data, length);
    r->out_length += length;
}

static void resp_bulk(resp *r, const void *data, size_t length)
{
    char header[32];
    int n = snprintf(header, sizeof(header), "$%zu\r\n", length);
    resp_append(r, header, (size_t)n);
    resp_append(r, data, length);
    resp_append(r, "\r\n", 2);
}

static void resp_command(resp *r, const char *name, uint32_t keys, const uint64_t *key_list,
                         const uint8_t *values)
{
    char header[32];
    int n = snprintf(header, sizeof(header), "*%u\r\n", 1 + keys * (values != NULL ? 2 : 1));
    resp_append(r, header, (size_t)n);
    resp_bulk(r, name, strlen(name));
    for (uint32_t i = 0; i < keys; i++) {
        resp_bulk(r, &key_list[i], sizeof(uint64_t));
        if (values != NULL)
            resp_bulk(r, values + (size_t)i * VALUE_BYTES, VALUE_BYTES);
    }
}

static bool resp_flush(resp *r)
{
    size_t sent = 0;
    while (sent < r->out_length) {
        ssize_t n = send(r->fd, r->out + sent, r->out_length - sent, MSG_NOSIGNAL);
        if (n <= 0)
            return false;
        sent += (size_t)n;
    }
    r->out_length = 0;
    return true;
}

static bool resp_fill(resp *r)
{
    if (r->in_start > 0 && r->in_start == r->in_end)
        r->in_start = r->in_end = 0;
    if (r->in_end == r->in_capacity) {
        if (r->in_start > 0) {
            memmove(r->in, r->in + r->in_start, r->in_end - r->in_start);
            r->in_end -= r->in_start;
            r->in_start = 0;
        } else {
            r->in_capacity = r->in_capacity ? r->in_capacity * 2 : 1 << 20;
            r->in = realloc(r->in, r->in_capacity);
        }
    }
    ssize_t n = recv(r->fd, r->in + r->in_end, r->in_capacity - r->in_end, 0);
    if (n <= 0)
        return false;
    r->in_end += (size_t)n;
    return true;
}

/* A line ending in \r\n, without it. */
static bool resp_line(resp *r, char *line, size_t capacity)
{
    for (;;) {
        char *end = memchr(r->in + r->in_start, '\n', r->in_end - r->in_start);
        if (end != NULL) {
            size_t length = (size_t)(end - (r->in + r->in_start)) - 1;
            if (length >= capacity)
                return false;
            memcpy(line, r->in + r->in_start, length);
            line[length] = '\0';
            r->in_start += length + 2;
            return true;
        }
        if (!resp_fill(r))
            return false;
    }
}

static bool resp_skip(resp *r, size_t length)
{
    while (r->in_end - r->in_start < length)
        if (!resp_fill(r))
            return false;
    r->in_start += length;
    return true;
}

/* Reads one reply: +OK, or an array of bulk strings whose payloads are discarded
 * (bytes returned through *payload). */
static bool resp_reply(resp *r, uint64_t *payload)
{
    char line[64];
    if (!resp_line(r, line, sizeof(line)))
        return false;
    if (line[0] == '+')
        return true;
    if (line[0] != '*')
        return false;
    long count = atol(line + 1);
    for (long i = 0; i < count; i++) {
        if (!resp_line(r, line, sizeof(line)) || line[0] != '$')
            return false;
        long length = atol(line + 1);
        if (length < 0)
            continue;
        if (!resp_skip(r, (size_t)length + 2))
            return false;
        *payload += (uint64_t)length;
    }
    return true;
}

static resp *resp_connect(uint16_t port)
{
    resp *r = calloc(1, sizeof(*r));
    r->fd = connect_port(port);
    if (r->fd < 0) {
        fprintf(stderr, "cannot connect to redis on port %u\n", port);
        exit(1);
    }
    return r;
}

static void resp_close(resp *r)
{
    close(r->fd);
    free(r->out);
    free(r->in);
    free(r);
}

/* MGET or MSET of n keys as pipelined chunks; returns false on a protocol error. */
static bool redis_batch(resp *r, bool write, const uint64_t *keys, uint32_t n,
                        const uint8_t *values)
{
    uint32_t commands = 0;
    for (uint32_t start = 0; start < n; start += REDIS_CHUNK, commands++) {
        uint32_t count = n - start < REDIS_CHUNK ? n - start : REDIS_CHUNK;
        resp_command(r, write ? "MSET" : "MGET", count, keys + start,
                     write ? values + (size_t)start * VALUE_BYTES : NULL);
    }
    if (!resp_flush(r))
        return false;
    uint64_t payload = 0;
    for (uint32_t i = 0; i < commands; i++)
        if (!resp_reply(r, &payload))
            return false;
    return write || payload == (uint64_t)n * VALUE_BYTES;
}

static void load_redis(const servers *s, uint64_t universe)
{
    resp *r = resp_connect(s->redis_port);
    uint8_t *values = calloc(REDIS_CHUNK, VALUE_BYTES);
    uint64_t keys[REDIS_CHUNK];
    for (uint64_t start = 0; start < universe; start += REDIS_CHUNK) {
        uint32_t n = (uint32_t)(universe - start < REDIS_CHUNK ? universe - start : REDIS_CHUNK);
        for (uint32_t i = 0; i < n; i++)
            keys[i] = key_of(start + i);
        if (!redis_batch(r, true, keys, n, values)) {
            fprintf(stderr, "redis load failed\n");
            exit(1);
        }
    }
    free(values);
    resp_close(r);
}

/* ---- throughput runs ----------------------------------------------------------------- */

/* EMBER_TLS: ember through the admin listener, which speaks TLS. */
typedef enum target { EMBER, EMBER_TLS, REDIS } target;

static em_client *connect_target(const servers *s, target t)
{
    return t == EMBER_TLS ? connect_ember(s->admin, s->ca) : connect_ember(s->data, NULL);
}

typedef struct worker {
    const servers *servers;
    target target;
    bool write;
    uint32_t batch;
    double seconds;
    uint64_t universe, seed;
    pthread_barrier_t *start;
    uint64_t keys_done;
    bool failed;
} worker;

static void run_ember(worker *w, em_test_rng *rng, uint64_t *keys, uint32_t *offsets,
                      float *buffer, double end)
{
    em_client *client = connect_target(w->servers, w->target);
    pthread_barrier_wait(w->start);
    em_error err;
    while (em_test_now() < end && !w->failed) {
        fill_keys(rng, w->universe, keys, w->batch);
        em_csr batch = {w->batch, w->batch, offsets, keys};
        em_status status;
        if (w->write) {
            em_client_push_args args = {"bench", batch, EM_COMBINER_NONE, buffer,
                                        (uint64_t)w->batch * DIM};
            em_client_push_result result;
            status = em_client_push(client, &args, &result, &err);
        } else {
            em_client_pull_args args = {"bench", batch, EM_COMBINER_NONE, false, buffer,
                                        (uint64_t)w->batch * DIM};
            em_client_pull_result result;
            status = em_client_pull(client, &args, &result, &err);
        }
        if (status != EM_OK) {
            fprintf(stderr, "ember: %s\n", err.message);
            w->failed = true;
        }
        w->keys_done += w->batch;
    }
    em_client_destroy(client);
}

static void run_redis(worker *w, em_test_rng *rng, uint64_t *keys, const uint8_t *values,
                      double end)
{
    resp *r = resp_connect(w->servers->redis_port);
    pthread_barrier_wait(w->start);
    while (em_test_now() < end && !w->failed) {
        fill_keys(rng, w->universe, keys, w->batch);
        if (!redis_batch(r, w->write, keys, w->batch, values)) {
            fprintf(stderr, "redis: protocol error\n");
            w->failed = true;
        }
        w->keys_done += w->batch;
    }
    resp_close(r);
}

static void *worker_main(void *argument)
{
    worker *w = argument;
    em_test_rng rng;
    em_test_rng_init(&rng, w->seed);
    uint64_t *keys = malloc((size_t)w->batch * sizeof(uint64_t));
    uint32_t *offsets = identity_offsets(w->batch);
    float *buffer = calloc((size_t)w->batch, VALUE_BYTES);
    for (size_t i = 0; i < (size_t)w->batch * DIM; i++)
        buffer[i] = 1e-3f;
    /* the barrier is passed inside run_* once connected */
    double end = 0;
    if (w->target != REDIS) {
        end = em_test_now() + w->seconds + 0.05;
        run_ember(w, &rng, keys, offsets, buffer, end);
    } else {
        end = em_test_now() + w->seconds + 0.05;
        run_redis(w, &rng, keys, (const uint8_t *)buffer, end);
    }
    free(keys);
    free(offsets);
    free(buffer);
    return NULL;
}

static double measure(const servers *s, target t, bool write, uint32_t batch,
                      uint32_t connections, const bench_options *opt)
{
    pthread_t *threads = calloc(connections, sizeof(*threads));
    worker *workers = calloc(connections, sizeof(*workers));
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, connections + 1);
    for (uint32_t i = 0; i < connections; i++) {
        workers[i] = (worker){s, t, write, batch, opt->seconds, opt->keys, 77 + i, &start, 0,
                              false};
        pthread_create(&threads[i], NULL, worker_main, &workers[i]);
    }
    pthread_barrier_wait(&start);
    double begin = em_test_now();
    uint64_t total = 0;
    for (uint32_t i = 0; i < connections; i++) {
        pthread_join(threads[i], NULL);
        if (workers[i].failed)
            exit(1);
        total += workers[i].keys_done;
    }
    double elapsed = em_test_now() - begin;
    pthread_barrier_destroy(&start);
    free(threads);
    free(workers);
    return (double)total / elapsed;
}

/* ---- latency ----------------------------------------------------------------------- */

typedef struct latency_worker {
    const servers *servers;
    target target;
    double seconds;
    uint64_t universe, seed;
    pthread_barrier_t *start;
    double *samples;
    size_t count, capacity;
} latency_worker;

static void record(latency_worker *w, double seconds)
{
    if (w->count == w->capacity) {
        w->capacity = w->capacity ? w->capacity * 2 : 4096;
        w->samples = realloc(w->samples, w->capacity * sizeof(double));
    }
    w->samples[w->count++] = seconds;
}

static void *latency_main(void *argument)
{
    latency_worker *w = argument;
    em_test_rng rng;
    em_test_rng_init(&rng, w->seed);
    uint64_t keys[LATENCY_KEYS];
    uint32_t *offsets = identity_offsets(LATENCY_KEYS);
    float out[LATENCY_KEYS * DIM];
    em_client *client = w->target != REDIS ? connect_target(w->servers, w->target) : NULL;
    resp *r = w->target == REDIS ? resp_connect(w->servers->redis_port) : NULL;
    pthread_barrier_wait(w->start);
    double end = em_test_now() + w->seconds;
    em_error err;
    while (em_test_now() < end) {
        fill_keys(&rng, w->universe, keys, LATENCY_KEYS);
        double begin = em_test_now();
        if (client != NULL) {
            em_client_pull_args args = {"bench", {LATENCY_KEYS, LATENCY_KEYS, offsets, keys},
                                        EM_COMBINER_NONE, false, out, LATENCY_KEYS * DIM};
            em_client_pull_result result;
            if (em_client_pull(client, &args, &result, &err) != EM_OK) {
                fprintf(stderr, "ember: %s\n", err.message);
                exit(1);
            }
        } else if (!redis_batch(r, false, keys, LATENCY_KEYS, NULL)) {
            fprintf(stderr, "redis: protocol error\n");
            exit(1);
        }
        record(w, em_test_now() - begin);
    }
    if (client != NULL)
        em_client_destroy(client);
    if (r != NULL)
        resp_close(r);
    free(offsets);
    return NULL;
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void measure_latency(const servers *s, target t, const bench_options *opt, double *p50,
                            double *p99, double *rate)
{
    enum { CLIENTS = 16 };
    pthread_t threads[CLIENTS];
    latency_worker workers[CLIENTS];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, CLIENTS);
    for (int i = 0; i < CLIENTS; i++) {
        workers[i] = (latency_worker){s, t, opt->seconds, opt->keys, 900 + (uint64_t)i, &start,
                                      NULL, 0, 0};
        pthread_create(&threads[i], NULL, latency_main, &workers[i]);
    }
    size_t total = 0;
    for (int i = 0; i < CLIENTS; i++) {
        pthread_join(threads[i], NULL);
        total += workers[i].count;
    }
    double *all = malloc((total + 1) * sizeof(double));
    size_t used = 0;
    for (int i = 0; i < CLIENTS; i++) {
        memcpy(all + used, workers[i].samples, workers[i].count * sizeof(double));
        used += workers[i].count;
        free(workers[i].samples);
    }
    qsort(all, total, sizeof(double), compare_doubles);
    *p50 = all[total / 2] * 1e6;
    *p99 = all[(size_t)((double)total * 0.99)] * 1e6;
    *rate = (double)total / opt->seconds;
    free(all);
    pthread_barrier_destroy(&start);
}

/* ---- raw TCP ------------------------------------------------------------------------- */

typedef struct sink {
    int listener;
    uint64_t received;
} sink;

static void *sink_main(void *argument)
{
    sink *k = argument;
    int fd = accept(k->listener, NULL, NULL);
    static char buffer[1 << 20];
    ssize_t n;
    while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0)
        k->received += (uint64_t)n;
    close(fd);
    return NULL;
}

static double raw_tcp_mb_per_second(double seconds)
{
    sink k = {.listener = socket(AF_INET, SOCK_STREAM, 0)};
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bind(k.listener, (struct sockaddr *)&address, sizeof(address));
    socklen_t length = sizeof(address);
    getsockname(k.listener, (struct sockaddr *)&address, &length);
    listen(k.listener, 1);
    pthread_t thread;
    pthread_create(&thread, NULL, sink_main, &k);
    int fd = connect_port(ntohs(address.sin_port));
    char *block = calloc(1, 1 << 20);
    double begin = em_test_now(), end = begin + seconds;
    /* the receiving side counts: only what arrived is throughput */
    while (em_test_now() < end) {
        if (send(fd, block, 1 << 20, MSG_NOSIGNAL) <= 0)
            break;
    }
    close(fd);
    pthread_join(thread, NULL);
    double elapsed = em_test_now() - begin;
    close(k.listener);
    free(block);
    return (double)k.received / elapsed / 1e6;
}

/* ---- main ---------------------------------------------------------------------------- */


static void parse_options(int argc, char **argv, bench_options *opt)
{
    *opt = (bench_options){.emberd = "build/daemon/emberd", .seconds = 2.0, .keys = 1000000,
                           .backend = "cpu"};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            opt->quick = true;
            opt->seconds = 0.5;
            opt->keys = 200000;
        } else if (i + 1 < argc && strcmp(argv[i], "--emberd") == 0) {
            opt->emberd = argv[++i];
        } else if (i + 1 < argc && strcmp(argv[i], "--seconds") == 0) {
            opt->seconds = strtod(argv[++i], NULL);
        } else if (i + 1 < argc && strcmp(argv[i], "--keys") == 0) {
            opt->keys = strtoull(argv[++i], NULL, 10);
        } else if (i + 1 < argc && strcmp(argv[i], "--backend") == 0) {
            opt->backend = argv[++i];
        } else if (i + 1 < argc && strcmp(argv[i], "--batch") == 0) {
            opt->only_batch = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else if (i + 1 < argc && strcmp(argv[i], "--connections") == 0) {
            opt->only_connections = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else {
            fprintf(stderr, "usage: bench_server [--emberd PATH] [--seconds S] [--keys N] "
                            "[--quick] [--backend cpu|cuda] [--batch N] [--connections N]\n");
            exit(2);
        }
    }
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* each line out at once: a run cut short keeps them */
    bench_options opt;
    parse_options(argc, argv, &opt);
    signal(SIGPIPE, SIG_IGN);
    servers s = {0};
    start_emberd(&opt, &s);
    start_redis(&s);
    em_test_print_machine(" (clients, emberd and redis-server share them)");
    printf("command: bench_server --emberd %s --backend %s --seconds %g --keys %" PRIu64 "\n",
           opt.emberd, opt.backend, opt.seconds, opt.keys);
    printf("workload: dim %d (%zu-byte vectors), %" PRIu64 " keys loaded in both, keys drawn "
           "uniformly; ember pulls NONE without creating, pushes adagrad; redis MGET/MSET "
           "pipelined in commands of at most %d keys\n\n",
           DIM, (size_t)VALUE_BYTES, opt.keys, REDIS_CHUNK);
    load_ember(&s, opt.keys);
    load_redis(&s, opt.keys);

    static const uint32_t batches[] = {256, 4096, 65536};
    static const uint32_t connection_counts[] = {1, 4, 16};
    printf("%-6s %-5s %7s %6s %14s %10s %14s %10s %8s\n", "op", "", "batch", "conns",
           "ember keys/s", "ember MB/s", "redis keys/s", "redis MB/s", "ratio");
    double best_pull_mb = 0, best_ratio = 0, worst_ratio = 1e30;
    for (int write = 0; write <= 1; write++) {
        for (size_t b = 0; b < 3; b++) {
            for (size_t c = 0; c < 3; c++) {
                uint32_t batch = batches[b], conns = connection_counts[c];
                if ((opt.only_batch != 0 && batch != opt.only_batch) ||
                    (opt.only_connections != 0 && conns != opt.only_connections))
                    continue;
                double ember = measure(&s, EMBER, write, batch, conns, &opt);
                double redis = measure(&s, REDIS, write, batch, conns, &opt);
                double ember_mb = ember * VALUE_BYTES / 1e6, redis_mb = redis * VALUE_BYTES / 1e6;
                printf("%-6s %-5s %7u %6u %14.0f %10.1f %14.0f %10.1f %7.1fx\n",
                       write ? "push" : "pull", "", batch, conns, ember, ember_mb, redis,
                       redis_mb, ember / redis);
                fflush(stdout);
                if (!write) {
                    best_pull_mb = ember_mb > best_pull_mb ? ember_mb : best_pull_mb;
                    best_ratio = ember / redis > best_ratio ? ember / redis : best_ratio;
                    worst_ratio = ember / redis < worst_ratio ? ember / redis : worst_ratio;
                }
            }
        }
    }
    double p50, p99, rate, redis_p50, redis_p99, redis_rate;
    measure_latency(&s, EMBER, &opt, &p50, &p99, &rate);
    measure_latency(&s, REDIS, &opt, &redis_p50, &redis_p99, &redis_rate);
    printf("\nlatency of a %d-key pull, 16 concurrent clients, one request at a time each:\n",
           LATENCY_KEYS);
    printf("  ember: p50 %.0f us, p99 %.0f us, %.0f requests/s\n", p50, p99, rate);
    printf("  redis: p50 %.0f us, p99 %.0f us, %.0f requests/s (MGET of %d keys)\n", redis_p50,
           redis_p99, redis_rate, LATENCY_KEYS);
    double raw = raw_tcp_mb_per_second(opt.seconds);
    printf("\nraw loopback TCP (one socket, 1 MiB writes): %.0f MB/s\n", raw);
    printf("ember best pull: %.0f MB/s = %.0f%% of raw loopback TCP\n", best_pull_mb,
           100.0 * best_pull_mb / raw);
    printf("ember / redis pull keys/s: %.1fx to %.1fx over the table above\n", worst_ratio,
           best_ratio);

    printf("\npull keys/s with TLS (admin listener) against without (data listener), same "
           "daemon, same run:\n");
    printf("%7s %6s %14s %14s %8s\n", "batch", "conns", "plain keys/s", "tls keys/s",
           "tls/plain");
    static const uint32_t tls_batches[] = {4096, 65536};
    static const uint32_t tls_connections[] = {1, 4};
    for (size_t b = 0; b < 2; b++) {
        for (size_t c = 0; c < 2; c++) {
            double plain = measure(&s, EMBER, false, tls_batches[b], tls_connections[c], &opt);
            double tls = measure(&s, EMBER_TLS, false, tls_batches[b], tls_connections[c], &opt);
            printf("%7u %6u %14.0f %14.0f %7.2fx\n", tls_batches[b], tls_connections[c], plain,
                   tls, tls / plain);
            fflush(stdout);
        }
    }
    stop_process(s.emberd);
    stop_process(s.redis);
    return 0;
}
