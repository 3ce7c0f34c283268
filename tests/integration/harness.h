/*
 * Integration-test harness: a real emberd started on ephemeral loopback ports, and raw
 * frame I/O so tests can send well-formed requests and deliberately broken frames.
 *
 * The daemon binary comes from the EMBERD environment variable (set by meson). Each
 * daemon gets a temporary directory with its config, listen file and log; it is killed
 * if the test process dies (PR_SET_PDEATHSIG), so a failing test leaves nothing behind.
 */
#ifndef EMBER_TESTS_INTEGRATION_HARNESS_H
#define EMBER_TESTS_INTEGRATION_HARNESS_H

#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "proto/frame.h"

#define TEST_ADMIN_TOKEN "test-admin-token"

typedef struct test_daemon {
    pid_t pid;
    char directory[256];
    char config_path[320];
    char log_path[320];
    char data[64];
    char admin[64];
    char metrics[64]; /* "" without a metrics listener */
} test_daemon;

/* The backend the daemons run on: EMBER_TEST_BACKEND ("cpu" by default, or "cuda"). */
bool test_backend_is_cuda(void);

/* "cuda" or "cpu", as health and stats name the backend. */
const char *test_backend_name(void);

/* Call first in main(): when EMBER_TEST_BACKEND asks for the cuda backend, exits 77
 * (skipped) if `emberd --list-devices` sees no GPU, and 1 (failed, with emberd's reason)
 * if GPUs or a driver are there but unusable. */
void test_skip_without_backend(void);

/* Results of the daemon against the in-process CPU engine: identical bits on the cpu
 * backend; on the cuda backend within 1e-5 relative (reductions may round in another
 * order there). */
void test_assert_floats_match(const float *got, const float *expected, uint64_t count,
                              const char *what);

/* Starts emberd with the base test config (ephemeral ports, admin token
 * TEST_ADMIN_TOKEN, cpu backend, 2 threads) overridden key by key by the top-level
 * keys of overrides_json (NULL for none). Fails the test if it does not come up. */
test_daemon *test_daemon_start(const char *overrides_json);

/* Sends signal_number and waits up to timeout_ms; returns the exit code (or 128 +
 * signal when killed, -1 on timeout, after which the daemon is killed). Frees daemon. */
int test_daemon_stop(test_daemon *daemon, int signal_number, int timeout_ms);

/* Waits up to timeout_ms (polling every 20 ms) for text to appear in the daemon's log;
 * whether it did. */
bool test_daemon_wait_log(const test_daemon *daemon, const char *text, int timeout_ms);

/* Rewrites the daemon's config file (the full base config overridden as above). */
void test_daemon_rewrite_config(test_daemon *daemon, const char *overrides_json);

/* The daemon's log so far (malloc'ed, caller frees). */
char *test_daemon_log(const test_daemon *daemon);

/* Blocking TCP connection to "host:port"; fails the test on error. */
int test_connect(const char *address);

/* Sends everything or returns false. */
bool test_send_all(int fd, const void *data, size_t length);

/* Sends one frame with the given meta (any fields: deadline, method, token ...). */
bool test_send_frame(int fd, const Ember__RpcMeta *meta, const ProtobufCMessage *body,
                     const void *attachment, size_t attachment_length);

/* Sends one request frame. token may be NULL. */
bool test_send_request(int fd, uint64_t correlation_id, int method, const char *token,
                       const ProtobufCMessage *body, const void *attachment,
                       size_t attachment_length);

typedef struct test_frame {
    Ember__RpcMeta *meta;
    uint8_t *body;
    size_t body_length;
    uint8_t *attachment;
    size_t attachment_length;
} test_frame;

/* Reads one frame: 1 on success, 0 when the peer closed, -1 on timeout or error. */
int test_read_frame(int fd, int timeout_ms, test_frame *out);
void test_frame_free(test_frame *frame);

/* True when the peer closes the connection (EOF) within timeout_ms, discarding data. */
bool test_wait_closed(int fd, int timeout_ms);

/* A PULL/PUSH attachment: offsets, zero padding, keys, then gradients (may be NULL). */
uint8_t *test_csr_attachment(uint32_t rows, const uint32_t *offsets, uint64_t nnz,
                             const uint64_t *keys, const float *gradients, uint64_t gradient_count,
                             size_t *length);

/* One request/response round trip; fails the test when no response frame arrives. */
test_frame test_call(int fd, uint64_t correlation_id, int method, const char *token,
                     const ProtobufCMessage *body, const void *attachment,
                     size_t attachment_length);

/* Runs a program (argv, NULL-terminated) with stdout and stderr captured; returns its
 * exit code (128 + signal when killed). *output (malloc'ed, caller frees) gets both
 * streams. The environment variable EMBER_ADMIN_TOKEN is removed for the child unless
 * token is given, in which case it is set to token. */
int test_run_program(char *const argv[], const char *token, char **output);

#endif
