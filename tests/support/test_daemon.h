/*
 * A real emberd (daemon/daemon.h) inside the test process, on ephemeral loopback ports,
 * for testing the client library, emberctl and the examples against the daemon's own
 * framing, ordering, backpressure and handlers.
 *
 * It runs on the CPU backend on a thread of its own. Faults are injected through the
 * daemon's fault hooks (daemon/context.h): delayed data requests, a connection closed
 * on a request, every connection dropped, answers of pipelined requests sent
 * last-first, so a client's behaviour in those cases can be observed.
 */
#ifndef EMBER_TESTS_TEST_DAEMON_H
#define EMBER_TESTS_TEST_DAEMON_H

#include <stdbool.h>
#include <stdint.h>

/* The admin token a test daemon has unless told otherwise (emberctl's development
 * default). */
#define EM_TEST_DAEMON_ADMIN_TOKEN "ember-dev-admin-token"

typedef struct em_test_daemon em_test_daemon;

typedef struct em_test_daemon_options {
    const char *admin_token; /* NULL: EM_TEST_DAEMON_ADMIN_TOKEN */
    const char *data_token;  /* NULL: data methods need no token */
    /* Answers of pipelined requests of one connection (up to 8) go out last-first. */
    bool reverse_responses;
    /* The "tables" array of the configuration, as JSON text (NULL: none). */
    const char *tables_json;
    /* A metrics listener on an ephemeral loopback port (and its recording). */
    bool metrics;
    /* Answers by status and duration histograms not recorded (request_histograms). */
    bool no_request_histograms;
} em_test_daemon_options;

/* Starts a daemon (options may be NULL); aborts (the test, or the program) on failure. */
em_test_daemon *em_test_daemon_start(const em_test_daemon_options *options);
/* Drains it and frees everything. */
void em_test_daemon_stop(em_test_daemon *daemon);

/* "127.0.0.1:PORT" of the data and the admin listener. */
const char *em_test_daemon_address(const em_test_daemon *daemon);
const char *em_test_daemon_admin_address(const em_test_daemon *daemon);
const char *em_test_daemon_admin_token(const em_test_daemon *daemon);
/* The metrics listener's address ("" without one). */
const char *em_test_daemon_metrics_address(const em_test_daemon *daemon);

/* Data requests wait this long on their worker from now on (0: at once). */
void em_test_daemon_set_delay(em_test_daemon *daemon, uint32_t delay_ms);
/* The connection that receives the n-th next request is closed instead (0: never). */
void em_test_daemon_close_after(em_test_daemon *daemon, uint32_t requests);
/* Closes every open connection (the clients see EOF while idle); returns once done. */
void em_test_daemon_drop_connections(em_test_daemon *daemon);

/* Data requests (PULL and PUSH) answered so far, and connections accepted (both
 * listeners). */
uint64_t em_test_daemon_data_requests(const em_test_daemon *daemon);
uint64_t em_test_daemon_connections(const em_test_daemon *daemon);
/* Bytes charged to the daemon's memory budget now (daemon/budget.h). */
uint64_t em_test_daemon_memory_used(const em_test_daemon *daemon);
/* Requests of one method (Ember__Method) answered, with or without an error. */
uint64_t em_test_daemon_answered(const em_test_daemon *daemon, int method);
/* Requests of one method (Ember__Method) answered without an error: for a PUSH, the
 * pushes applied. */
uint64_t em_test_daemon_succeeded(const em_test_daemon *daemon, int method);

#endif
