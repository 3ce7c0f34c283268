#include "tests/fuzz/fuzz_support.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "proto/frame.h"
#include "tests/integration/harness.h"
#include "tests/support/test_daemon.h"

static fuzz_daemon *the_daemon;

static void fail(const char *what)
{
    fprintf(stderr, "fuzz: %s\n", what);
    abort();
}

static test_frame call(const char *address, int method, const char *token,
                       const ProtobufCMessage *body, const void *attachment, size_t length)
{
    int fd = test_connect(address);
    test_frame frame = test_call(fd, 1, method, token, body, attachment, length);
    close(fd);
    return frame;
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
    uint8_t *attachment = test_csr_attachment(1, offsets, FUZZ_KEYS, keys, gradients,
                                              FUZZ_KEYS * FUZZ_DIM, &length);
    Ember__PushRequest push = EMBER__PUSH_REQUEST__INIT;
    push.table = "t";
    push.rows = 1;
    push.nnz = FUZZ_KEYS;
    test_frame frame = call(em_test_daemon_address(daemon), EMBER__METHOD__PUSH, NULL,
                            &push.base, attachment, length);
    free(attachment);
    if (frame.meta->status != EMBER__STATUS__OK)
        fail("the table could not be populated");
    test_frame_free(&frame);
}

fuzz_daemon *fuzz_daemon_get(void)
{
    if (the_daemon != NULL)
        return the_daemon;
    em_test_daemon_options options = {
        .tables_json = "[{\"name\": \"t\", \"dim\": 4, \"capacity\": 1000000, \"shards\": 2,"
                       " \"optimizer\": {\"type\": \"adagrad\", \"lr\": 0.1}}]",
    };
    the_daemon = em_test_daemon_start(&options);
    populate(the_daemon);
    return the_daemon;
}

int fuzz_connect(fuzz_daemon *daemon)
{
    int fd = test_connect(em_test_daemon_address(daemon));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
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
    test_frame frame = call(em_test_daemon_address(daemon), EMBER__METHOD__PING, NULL,
                            &ping.base, NULL, 0);
    if (frame.meta->status != EMBER__STATUS__OK)
        fail("the daemon stopped answering PING");
    test_frame_free(&frame);
    for (int waited = 0; em_test_daemon_memory_used(daemon) != 0; waited++) {
        if (waited == 1000) {
            fprintf(stderr, "fuzz: %llu bytes stay charged to the memory budget\n",
                    (unsigned long long)em_test_daemon_memory_used(daemon));
            abort();
        }
        sleep_ms(1);
    }
}

int fuzz_call_raw(fuzz_daemon *daemon, int method, const uint8_t *body, size_t body_length,
                  const uint8_t *attachment, size_t attachment_length)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = 1;
    meta.method = (Ember__Method)method;
    size_t meta_length = protobuf_c_message_get_packed_size(&meta.base);
    size_t total = EM_FRAME_HEADER_BYTES + meta_length + body_length + attachment_length;
    uint8_t *frame = malloc(total);
    if (frame == NULL)
        fail("out of memory");
    em_frame_header header = {(uint32_t)meta_length, body_length, attachment_length};
    em_frame_header_encode(&header, frame);
    protobuf_c_message_pack(&meta.base, frame + EM_FRAME_HEADER_BYTES);
    if (body_length > 0)
        memcpy(frame + EM_FRAME_HEADER_BYTES + meta_length, body, body_length);
    if (attachment_length > 0)
        memcpy(frame + EM_FRAME_HEADER_BYTES + meta_length + body_length, attachment,
               attachment_length);
    int fd = fuzz_connect(daemon);
    bool sent = test_send_all(fd, frame, total);
    free(frame);
    test_frame answer;
    int status = -1;
    if (sent && test_read_frame(fd, 10000, &answer) == 1) {
        status = (int)answer.meta->status;
        test_frame_free(&answer);
    }
    close(fd);
    return status;
}

void fuzz_table_state_read(fuzz_daemon *daemon, fuzz_table_state *out)
{
    memset(out, 0, sizeof(*out));
    Ember__StatsRequest stats = EMBER__STATS_REQUEST__INIT;
    stats.table = "t";
    test_frame frame = call(em_test_daemon_admin_address(daemon), EMBER__METHOD__STATS,
                            em_test_daemon_admin_token(daemon), &stats.base, NULL, 0);
    Ember__StatsResponse *response =
        frame.meta->status == EMBER__STATUS__OK
            ? ember__stats_response__unpack(NULL, frame.body_length, frame.body)
            : NULL;
    if (response == NULL || response->n_tables != 1)
        fail("STATS of table t failed");
    out->rows = response->tables[0]->rows;
    ember__stats_response__free_unpacked(response, NULL);
    test_frame_free(&frame);

    uint32_t offsets[FUZZ_KEYS + 1];
    uint64_t keys[FUZZ_KEYS];
    for (uint32_t k = 0; k <= FUZZ_KEYS; k++)
        offsets[k] = k;
    for (uint32_t k = 0; k < FUZZ_KEYS; k++)
        keys[k] = k;
    size_t length = 0;
    uint8_t *attachment = test_csr_attachment(FUZZ_KEYS, offsets, FUZZ_KEYS, keys, NULL, 0,
                                              &length);
    Ember__PullRequest pull = EMBER__PULL_REQUEST__INIT;
    pull.table = "t";
    pull.rows = FUZZ_KEYS;
    pull.nnz = FUZZ_KEYS;
    frame = call(em_test_daemon_address(daemon), EMBER__METHOD__PULL, NULL, &pull.base,
                 attachment, length);
    free(attachment);
    if (frame.meta->status != EMBER__STATUS__OK ||
        frame.attachment_length != sizeof(out->values))
        fail("PULL of keys 0..63 failed");
    memcpy(out->values, frame.attachment, sizeof(out->values));
    test_frame_free(&frame);
}

bool fuzz_table_state_equal(const fuzz_table_state *a, const fuzz_table_state *b)
{
    return a->rows == b->rows && memcmp(a->values, b->values, sizeof(a->values)) == 0;
}
