/*
 * What the fuzz harnesses share: one daemon in the process (CPU backend, table "t" of
 * dim 4 holding keys 0..63), raw calls to it, and the checks every input ends with.
 * Failures abort, which libFuzzer reports with the input that caused them.
 */
#ifndef EMBER_TESTS_FUZZ_SUPPORT_H
#define EMBER_TESTS_FUZZ_SUPPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/ember.pb-c.h"

#define FUZZ_DIM 4
#define FUZZ_KEYS 64

typedef struct fuzz_daemon fuzz_daemon;

/* The daemon, started on first use. */
fuzz_daemon *fuzz_daemon_get(void);

/* A blocking connection to its data listener. */
int fuzz_connect(fuzz_daemon *daemon);

/* Reads and discards until the peer closes or timeout_ms passes. */
void fuzz_drain(int fd, int timeout_ms);

/* The daemon answers a PING, and every byte charged to its memory budget has been
 * given back (within a second, as writes complete). */
void fuzz_daemon_check(fuzz_daemon *daemon);

/* One request of method with a raw body and attachment, on a fresh connection: the
 * answer's status, or -1 when none came. */
int fuzz_call_raw(fuzz_daemon *daemon, int method, const uint8_t *body, size_t body_length,
                  const uint8_t *attachment, size_t attachment_length);

typedef struct fuzz_table_state {
    uint64_t rows;
    float values[FUZZ_KEYS * FUZZ_DIM];
} fuzz_table_state;

void fuzz_table_state_read(fuzz_daemon *daemon, fuzz_table_state *out);
bool fuzz_table_state_equal(const fuzz_table_state *a, const fuzz_table_state *b);

#endif
