#include "tests/fuzz/fuzz_support.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "daemon/daemon.h"
#include "daemon/daemon_config.h"
#include "proto/frame.h"

#define ADMIN_TOKEN "fuzz-admin-token"
#define CALL_TIMEOUT_MS 10000

struct fuzz_daemon {
    em_daemon *daemon;
    pthread_t thread;
};

static fuzz_daemon the_daemon;
static bool started;

static void dump_stats(void)
{
    if (!started)
        return;
    const em_server_stats *s = em_daemon_stats(the_daemon.daemon);
    fprintf(stderr,
            "fuzz: daemon: %llu connections (%llu admin), %llu waiting for memory, %llu bytes "
            "charged, %llu waits, %llu frames rejected, %llu accepted, %llu refused, %llu bytes "
            "in, %llu out, timeouts %llu/%llu/%llu\n",
            (unsigned long long)atomic_load(&s->connections_current),
            (unsigned long long)atomic_load(&s->admin_connections_current),
            (unsigned long long)atomic_load(&s->connections_waiting),
            (unsigned long long)atomic_load(&s->memory_used_bytes),
            (unsigned long long)atomic_load(&s->memory_waits),
            (unsigned long long)atomic_load(&s->frames_rejected),
            (unsigned long long)atomic_load(&s->connections_total),
            (unsigned long long)atomic_load(&s->connections_rejected),
            (unsigned long long)atomic_load(&s->bytes_in),
            (unsigned long long)atomic_load(&s->bytes_out),
            (unsigned long long)atomic_load(&s->timeouts_idle),
            (unsigned long long)atomic_load(&s->timeouts_frame),
            (unsigned long long)atomic_load(&s->timeouts_write));
}

static void fail(const char *what)
{
    fprintf(stderr, "fuzz: %s\n", what);
    dump_stats();
    abort();
}

/* ---- raw frames ---------------------------------------------------------------------- */

typedef struct answer {
    Ember__RpcMeta *meta;
    uint8_t *body;
    size_t body_length;
    uint8_t *attachment;
    size_t attachment_length;
} answer;

static void answer_free(answer *a)
{
    if (a->meta != NULL)
        ember__rpc_meta__free_unpacked(a->meta, NULL);
    free(a->body);
    free(a->attachment);
    memset(a, 0, sizeof(*a));
}

/* A connection whose input ends with a half-close goes to TIME_WAIT on this side when
 * the daemon closes after it, holding its port for a minute: at thousands of runs a
 * second one source address runs out of its 28K ephemeral ports. Loopback connections
 * therefore come from 127.1.x.y in turn (the port still picked by the kernel, for that
 * address), 65,536 sources. */
static void bind_next_source(int fd)
{
    static uint32_t next;
    uint32_t n = next++ & 0xFFFF;
    struct sockaddr_in from = {.sin_family = AF_INET,
                               .sin_addr.s_addr = htonl(0x7F010000u | n)};
    int one = 1;
    setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&from, sizeof(from)) != 0) {
        char why[160];
        snprintf(why, sizeof(why), "cannot bind a connection to 127.1.%u.%u: %s", n >> 8,
                 n & 0xFF, strerror(errno));
        fail(why);
    }
}

/* connect(), through signals: one that interrupts it (libFuzzer's timer, for one) leaves
 * the connection going on by itself, so its end is waited for, not asked again. */
static int connect_through_signals(int fd, const struct sockaddr_in *to)
{
    if (connect(fd, (const struct sockaddr *)to, sizeof(*to)) == 0)
        return 0;
    if (errno != EINTR)
        return -1;
    struct pollfd watch = {.fd = fd, .events = POLLOUT};
    int ready;
    while ((ready = poll(&watch, 1, CALL_TIMEOUT_MS)) < 0 && errno == EINTR)
        ;
    if (ready <= 0) {
        errno = ready == 0 ? ETIMEDOUT : errno;
        return -1;
    }
    int error = 0;
    socklen_t length = sizeof(error);
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0)
        return -1;
    errno = error;
    return error == 0 ? 0 : -1;
}

static int connect_to(const char *address)
{
    char host[64];
    snprintf(host, sizeof(host), "%s", address);
    char *colon = strrchr(host, ':');
    if (colon == NULL)
        fail("bad address");
    *colon = '\0';
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    inet_pton(AF_INET, host, &to.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && ((ntohl(to.sin_addr.s_addr) >> 24) == 127))
        bind_next_source(fd);
    if (fd < 0 || connect_through_signals(fd, &to) != 0) {
        char why[160];
        snprintf(why, sizeof(why), "cannot connect to the daemon at %s: %s", address,
                 strerror(errno));
        fail(why);
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    /* closed with a reset: thousands of runs a minute must not use up the ports in
     * TIME_WAIT */
    struct linger reset = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    return fd;
}

static bool send_all(int fd, const void *data, size_t length)
{
    const uint8_t *bytes = data;
    while (length > 0) {
        ssize_t n = send(fd, bytes, length, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return false;
        bytes += n;
        length -= (size_t)n;
    }
    return true;
}

/* Why the last answer did not come, for the failure message. */
static const char *no_answer = "no answer";

static bool receive_all(int fd, void *data, size_t length)
{
    uint8_t *bytes = data;
    while (length > 0) {
        struct pollfd watch = {.fd = fd, .events = POLLIN};
        int ready;
        while ((ready = poll(&watch, 1, CALL_TIMEOUT_MS)) < 0 && errno == EINTR)
            ;
        if (ready <= 0) {
            no_answer = "no answer within the timeout";
            return false;
        }
        ssize_t n = recv(fd, bytes, length, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            no_answer = n == 0 ? "the daemon closed the connection" : strerror(errno);
            return false;
        }
        bytes += n;
        length -= (size_t)n;
    }
    return true;
}

/* Reads one answer frame; false when none came whole. */
static bool read_answer(int fd, answer *out)
{
    memset(out, 0, sizeof(*out));
    uint8_t header[EM_FRAME_HEADER_BYTES];
    if (!receive_all(fd, header, sizeof(header)))
        return false;
    em_frame_limits limits = em_frame_default_limits();
    em_frame_header frame;
    em_error err;
    if (em_frame_header_decode(header, &limits, &frame, &err) != EM_OK)
        fail("the daemon sent a bad frame header");
    uint8_t *meta = malloc(frame.meta_len);
    out->body = malloc(frame.body_len + 1);
    out->attachment = malloc(frame.attach_len + 1);
    if (meta == NULL || out->body == NULL || out->attachment == NULL)
        fail("out of memory");
    bool whole = receive_all(fd, meta, frame.meta_len) &&
                 receive_all(fd, out->body, frame.body_len) &&
                 receive_all(fd, out->attachment, frame.attach_len);
    if (whole) {
        out->meta = ember__rpc_meta__unpack(NULL, frame.meta_len, meta);
        if (out->meta == NULL)
            fail("the daemon sent an undecodable RpcMeta");
    }
    free(meta);
    out->body_length = (size_t)frame.body_len;
    out->attachment_length = (size_t)frame.attach_len;
    if (!whole)
        answer_free(out);
    return whole;
}

static bool send_request(int fd, int method, const char *token, const uint8_t *body,
                         size_t body_length, const uint8_t *attachment,
                         size_t attachment_length)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = 1;
    meta.method = (Ember__Method)method;
    if (token != NULL) {
        meta.auth_token.data = (uint8_t *)token;
        meta.auth_token.len = strlen(token);
    }
    size_t meta_length = protobuf_c_message_get_packed_size(&meta.base);
    size_t head = EM_FRAME_HEADER_BYTES + meta_length;
    uint8_t *frame = malloc(head + body_length);
    if (frame == NULL)
        fail("out of memory");
    em_frame_header header = {(uint32_t)meta_length, body_length, attachment_length};
    em_frame_header_encode(&header, frame);
    protobuf_c_message_pack(&meta.base, frame + EM_FRAME_HEADER_BYTES);
    if (body_length > 0)
        memcpy(frame + head, body, body_length);
    bool sent = send_all(fd, frame, head + body_length) &&
                send_all(fd, attachment, attachment_length);
    free(frame);
    return sent;
}

/* The harness's own connections (one to each listener), kept open across inputs so
 * that hundreds of thousands of runs do not use up the loopback ports. */
static int data_fd = -1, admin_fd = -1;

/* One call of a message body on the harness's connection to address (reopened when it
 * was closed); status -1 when no answer came. */
static int call(const char *address, int method, const char *token, const ProtobufCMessage *body,
                const void *attachment, size_t attachment_length, answer *out)
{
    int *fd = strcmp(address, em_daemon_admin_address(the_daemon.daemon)) == 0 ? &admin_fd
                                                                             : &data_fd;
    size_t length = protobuf_c_message_get_packed_size(body);
    uint8_t *packed = malloc(length + 1);
    if (packed == NULL)
        fail("out of memory");
    protobuf_c_message_pack(body, packed);
    int status = -1;
    for (int attempt = 0; attempt < 2 && status < 0; attempt++) {
        if (*fd < 0)
            *fd = connect_to(address);
        if (send_request(*fd, method, token, packed, length, attachment, attachment_length) &&
            read_answer(*fd, out)) {
            status = (int)out->meta->status;
        } else {
            close(*fd);
            *fd = -1;
        }
    }
    free(packed);
    return status;
}

/* offsets, zero padding to 8, keys, gradients: a PULL or PUSH attachment. */
static uint8_t *csr_attachment(uint32_t rows, const uint32_t *offsets, uint64_t nnz,
                               const uint64_t *keys, const float *gradients, uint64_t floats,
                               size_t *length)
{
    em_csr_attachment layout;
    em_error err;
    if (em_csr_attachment_layout(rows, nnz, floats, &layout, &err) != EM_OK)
        fail("bad layout");
    uint8_t *bytes = calloc(1, layout.total + 1);
    if (bytes == NULL)
        fail("out of memory");
    memcpy(bytes, offsets, ((size_t)rows + 1) * sizeof(uint32_t));
    if (nnz > 0)
        memcpy(bytes + layout.keys_at, keys, nnz * sizeof(uint64_t));
    if (floats > 0)
        memcpy(bytes + layout.gradients_at, gradients, floats * sizeof(float));
    *length = layout.total;
    return bytes;
}

/* ---- the daemon ---------------------------------------------------------------------- */

static void *run_daemon(void *argument)
{
    em_daemon_run(argument);
    return NULL;
}

static void populate(fuzz_daemon *daemon)
{
    uint32_t offsets[2] = {0, FUZZ_KEYS};
    uint64_t keys[FUZZ_KEYS];
    float gradients[FUZZ_KEYS * FUZZ_DIM];
    for (uint32_t k = 0; k < FUZZ_KEYS; k++)
        keys[k] = k;
    for (uint32_t i = 0; i < FUZZ_KEYS * FUZZ_DIM; i++)
        gradients[i] = 0.01f * (float)(i % 17) - 0.05f;
    size_t length = 0;
    uint8_t *attachment = csr_attachment(1, offsets, FUZZ_KEYS, keys, gradients,
                                         FUZZ_KEYS * FUZZ_DIM, &length);
    Ember__PushRequest push = EMBER__PUSH_REQUEST__INIT;
    push.table = "t";
    push.rows = 1;
    push.nnz = FUZZ_KEYS;
    answer a;
    int status = call(em_daemon_data_address(daemon->daemon), EMBER__METHOD__PUSH, NULL,
                      &push.base, attachment, length, &a);
    free(attachment);
    if (status != EMBER__STATUS__OK)
        fail("the table could not be populated");
    answer_free(&a);
}

fuzz_daemon *fuzz_daemon_get(void)
{
    if (started)
        return &the_daemon;
    signal(SIGPIPE, SIG_IGN);
    const char *json =
        "{\"listen\": {\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:0\", \"metrics\": \"\"},"
        " \"backend\": {\"type\": \"cpu\", \"devices\": 1, \"threads\": 2,"
        "  \"memory_limit_bytes\": 268435456, \"initial_bytes\": 16777216,"
        "  \"growth_bytes\": 16777216},"
        " \"limits\": {\"memory_bytes\": 268435456, \"max_attachment_bytes\": 67108864,"
        "  \"max_connections\": 65536, \"max_admin_connections\": 65536},"
        " \"admin_token\": {\"value\": \"" ADMIN_TOKEN "\"}, \"log_level\": \"error\","
        " \"tables\": [{\"name\": \"t\", \"dim\": 4, \"capacity\": 1000000, \"shards\": 2,"
        "  \"optimizer\": {\"type\": \"adagrad\", \"lr\": 0.1}}]}";
    em_daemon_config config;
    em_error err;
    if (em_daemon_config_parse_text(json, "fuzz daemon", &config, &err) != EM_OK)
        fail(err.message);
    em_daemon_options options;
    em_daemon_options_init(&options);
    options.log_fd = -1;
    if (em_daemon_create(&config, &options, &the_daemon.daemon, &err) != EM_OK)
        fail(err.message);
    em_daemon_config_deinit(&config);
    if (pthread_create(&the_daemon.thread, NULL, run_daemon, the_daemon.daemon) != 0)
        fail("cannot start the daemon's thread");
    started = true;
    populate(&the_daemon);
    return &the_daemon;
}

int fuzz_connect(fuzz_daemon *daemon)
{
    return connect_to(em_daemon_data_address(daemon->daemon));
}

void fuzz_drain(int fd, int timeout_ms)
{
    uint8_t buffer[65536];
    struct pollfd watch = {.fd = fd, .events = POLLIN};
    while (poll(&watch, 1, timeout_ms) > 0) {
        ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
        if (n <= 0)
            return;
    }
}

static void sleep_ms(long ms)
{
    struct timespec pause = {0, ms * 1000000L};
    nanosleep(&pause, NULL);
}

void fuzz_daemon_check(fuzz_daemon *daemon)
{
    Ember__PingRequest ping = EMBER__PING_REQUEST__INIT;
    answer a;
    int status = call(em_daemon_data_address(daemon->daemon), EMBER__METHOD__PING, NULL,
                      &ping.base, NULL, 0, &a);
    if (status != EMBER__STATUS__OK) {
        fprintf(stderr, "fuzz: PING: status %d: %s\n", status,
                status >= 0 ? a.meta->error : no_answer);
        dump_stats();
        abort();
    }
    answer_free(&a);
    const em_server_stats *stats = em_daemon_stats(daemon->daemon);
    for (int waited = 0; atomic_load(&stats->memory_used_bytes) != 0; waited++) {
        if (waited == 1000) {
            fprintf(stderr, "fuzz: %llu bytes stay charged to the memory budget\n",
                    (unsigned long long)atomic_load(&stats->memory_used_bytes));
            abort();
        }
        sleep_ms(1);
    }
}

int fuzz_call_raw(fuzz_daemon *daemon, int method, const uint8_t *body, size_t body_length,
                  const uint8_t *attachment, size_t attachment_length)
{
    int fd = fuzz_connect(daemon);
    answer a;
    int status = -1;
    if (send_request(fd, method, NULL, body, body_length, attachment, attachment_length) &&
        read_answer(fd, &a)) {
        status = (int)a.meta->status;
        answer_free(&a);
    }
    close(fd);
    return status;
}

void fuzz_table_state_read(fuzz_daemon *daemon, fuzz_table_state *out)
{
    memset(out, 0, sizeof(*out));
    Ember__StatsRequest stats = EMBER__STATS_REQUEST__INIT;
    stats.table = "t";
    answer a;
    int status = call(em_daemon_admin_address(daemon->daemon), EMBER__METHOD__STATS, ADMIN_TOKEN,
                      &stats.base, NULL, 0, &a);
    if (status != EMBER__STATUS__OK) {
        fprintf(stderr, "fuzz: STATS of table t: status %d: %s\n", status,
                status >= 0 ? a.meta->error : no_answer);
        dump_stats();
        abort();
    }
    Ember__StatsResponse *response = ember__stats_response__unpack(NULL, a.body_length, a.body);
    if (response == NULL || response->n_tables != 1)
        fail("STATS of table t is not one table");
    out->rows = response->tables[0]->rows;
    ember__stats_response__free_unpacked(response, NULL);
    answer_free(&a);

    uint32_t offsets[FUZZ_KEYS + 1];
    uint64_t keys[FUZZ_KEYS];
    for (uint32_t k = 0; k <= FUZZ_KEYS; k++)
        offsets[k] = k;
    for (uint32_t k = 0; k < FUZZ_KEYS; k++)
        keys[k] = k;
    size_t length = 0;
    uint8_t *attachment = csr_attachment(FUZZ_KEYS, offsets, FUZZ_KEYS, keys, NULL, 0, &length);
    Ember__PullRequest pull = EMBER__PULL_REQUEST__INIT;
    pull.table = "t";
    pull.rows = FUZZ_KEYS;
    pull.nnz = FUZZ_KEYS;
    status = call(em_daemon_data_address(daemon->daemon), EMBER__METHOD__PULL, NULL, &pull.base,
                  attachment, length, &a);
    free(attachment);
    if (status != EMBER__STATUS__OK || a.attachment_length != sizeof(out->values)) {
        fprintf(stderr, "fuzz: PULL of keys 0..63: status %d: %s\n", status,
                status >= 0 ? a.meta->error : no_answer);
        dump_stats();
        abort();
    }
    memcpy(out->values, a.attachment, sizeof(out->values));
    answer_free(&a);
}

bool fuzz_table_state_equal(const fuzz_table_state *a, const fuzz_table_state *b)
{
    return a->rows == b->rows && memcmp(a->values, b->values, sizeof(a->values)) == 0;
}
