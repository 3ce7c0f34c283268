/*
 * DESIGN: the slow log, as Redis's SLOWLOG: every request that took at least
 * slowlog_threshold_ms from its arrival to its answer is recorded in a bounded ring
 * (slowlog_max_entries, the oldest dropped first), with what it asked and where its time
 * went (queued for a worker, running on it). The loop thread records and reads it (the
 * SLOWLOG admin method runs there), so it takes no lock.
 */
#ifndef EMBER_DAEMON_SLOWLOG_H
#define EMBER_DAEMON_SLOWLOG_H

#include <stddef.h>
#include <stdint.h>

#include "lib/base/status.h"
#include "lib/table/table_config.h"

typedef struct em_slow_request {
    uint64_t id;          /* increasing from 1 */
    uint64_t unix_ms;     /* when it was answered */
    uint64_t duration_us; /* arrival to answer */
    uint64_t queue_us;    /* waiting for a worker (0 for methods answered on the loop) */
    uint64_t run_us;      /* running on the worker (or the loop) */
    uint64_t keys;        /* PULL, PUSH: keys (nnz) */
    uint64_t bytes;       /* attachment bytes in and out */
    char method[24];
    char table[EM_TABLE_NAME_MAX + 1];
    char status[24];
    char peer[64];
} em_slow_request;

typedef struct em_slowlog {
    em_slow_request *ring;
    uint32_t capacity, count, next; /* next: where the next entry goes */
    uint64_t recorded;              /* since start (or the last reset) */
    uint64_t last_id;
} em_slowlog;

/* Errors: RESOURCE_EXHAUSTED. */
em_status em_slowlog_init(em_slowlog *log, uint32_t capacity, em_error *err);
void em_slowlog_free(em_slowlog *log);

/* Adds entry (its id is set here). */
void em_slowlog_record(em_slowlog *log, em_slow_request *entry);

/* Up to max entries, newest first, into out; returns how many. */
size_t em_slowlog_read(const em_slowlog *log, em_slow_request *out, size_t max);

/* Entries recorded but no longer held. */
uint64_t em_slowlog_dropped(const em_slowlog *log);

void em_slowlog_reset(em_slowlog *log);

#endif
