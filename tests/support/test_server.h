/*
 * A small in-process server that speaks ember's wire protocol on a loopback port, for
 * testing the client library, emberctl and the examples without a daemon.
 *
 * It is deliberately simple - a thread per connection reading one frame at a time
 * with blocking sockets - and backed by real em_tables on a CPU backend, so results
 * are the engine's. It is not emberd: its job is to make the client's behaviour
 * observable (out-of-order answers, slow answers, dropped connections, counters of
 * what reached it).
 */
#ifndef EMBER_TESTS_TEST_SERVER_H
#define EMBER_TESTS_TEST_SERVER_H

#include <stdbool.h>
#include <stdint.h>

typedef struct em_test_server em_test_server;

typedef struct em_test_server_options {
    const char *admin_token; /* NULL: admin methods need no token */
    const char *data_token;  /* NULL: data methods need no token */
    /* Pipelined requests already waiting on a connection (up to 8) are answered
     * last-first. */
    bool reverse_responses;
} em_test_server_options;

/* Listens on 127.0.0.1 at an ephemeral port; aborts the test on failure. */
em_test_server *em_test_server_start(const em_test_server_options *options);
/* Closes every connection and frees the tables. */
void em_test_server_stop(em_test_server *server);

uint16_t em_test_server_port(const em_test_server *server);
/* "127.0.0.1:PORT" in a static buffer per server. */
const char *em_test_server_address(const em_test_server *server);

/* Waits this long before answering each data request from now on (0: at once). */
void em_test_server_set_delay(em_test_server *server, uint32_t delay_ms);
/* Closes a connection after it has received this many more requests (0: never). */
void em_test_server_close_after(em_test_server *server, uint32_t requests);
/* Shuts down every open connection (the clients see EOF while idle). */
void em_test_server_drop_connections(em_test_server *server);
/* Data requests (PULL and PUSH) received so far, and connections accepted. */
uint64_t em_test_server_data_requests(em_test_server *server);
uint64_t em_test_server_connections(em_test_server *server);
/* Requests of one method (Ember__Method) handled so far, refused ones included. */
uint64_t em_test_server_requests(em_test_server *server, int method);

#endif
