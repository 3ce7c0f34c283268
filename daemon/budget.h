/*
 * DESIGN: the memory the server's connections may hold, as one budget.
 *
 * Every byte a connection holds for a request is charged before it is allocated: the
 * header and RpcMeta when the header arrives, the body once the meta is accepted, the
 * attachment and the most the answer can take once the body is decoded. An answer's
 * bytes stay charged until they are written. Two limits apply to each charge:
 *
 *   the connection's (limits.connection_inflight_bytes): past it the connection takes
 *     no more of its frames until its own answers drain; a connection with nothing else
 *     in flight may always go over it, so one large pull still runs;
 *   the server's (limits.memory_bytes): past it no connection takes more until bytes
 *     are released anywhere; a single request larger than the whole budget is refused.
 *
 * A connection that must wait stops reading its socket and joins the budget's queue;
 * releases wake the queue in order on the next loop turn. Loop thread only; the numbers
 * are mirrored into the server's stats for STATS.
 */
#ifndef EMBER_DAEMON_BUDGET_H
#define EMBER_DAEMON_BUDGET_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/stats.h"

struct em_connection;

typedef struct em_memory_budget {
    uint64_t limit; /* bytes; 0: no limit */
    uint64_t used;
    em_server_stats *stats; /* memory_* gauges and counters */
    /* connections waiting for memory, oldest first (daemon/connection.c) */
    struct em_connection *waiting_head, *waiting_tail;
    /* asks the owner to run em_connection_wake_waiting on the next loop turn */
    void (*schedule_wake)(void *context);
    void *wake_context;
    bool wake_scheduled;
} em_memory_budget;

void em_memory_budget_init(em_memory_budget *budget, uint64_t limit, em_server_stats *stats,
                           void (*schedule_wake)(void *context), void *wake_context);

/* Changes the limit (reload); waiting connections are woken to look again. */
void em_memory_budget_set_limit(em_memory_budget *budget, uint64_t limit);

/* True when bytes more fit under the server's limit. */
bool em_memory_budget_fits(const em_memory_budget *budget, uint64_t bytes);

void em_memory_budget_charge(em_memory_budget *budget, uint64_t bytes);

/* Gives bytes back and schedules a wake when connections wait. */
void em_memory_budget_release(em_memory_budget *budget, uint64_t bytes);

#endif
