/*
 * DESIGN: what every part of a running daemon shares, owned by the daemon
 * (daemon/daemon.c) and borrowed by the server, the dispatcher and the handlers.
 */
#ifndef EMBER_DAEMON_CONTEXT_H
#define EMBER_DAEMON_CONTEXT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "daemon/checkpointer.h"
#include "daemon/executor.h"
#include "daemon/slowlog.h"
#include "daemon/stats.h"
#include "lib/base/log.h"
#include "lib/device/backend.h"
#include "lib/table/catalog.h"

typedef enum em_server_state {
    EM_SERVER_STARTING = 0,
    EM_SERVER_SERVING = 1,
    EM_SERVER_DRAINING = 2,
    EM_SERVER_FAILED = 3, /* a GPU failed: draining, then exiting non-zero */
} em_server_state;

/* Fault injection, for tests of clients against a real daemon (em_daemon_faults):
 * every field is 0 in service, and nothing but a test sets them. */
typedef struct em_faults {
    _Atomic uint32_t delay_ms;    /* data methods (PULL, PUSH) wait this long on their
                                   * worker, once their deadline has been checked */
    _Atomic uint32_t close_after; /* the connection receiving the n-th next request is
                                   * closed instead of answering it (0: never) */
    _Atomic bool reverse_answers; /* answers of pipelined requests (up to
                                   * EM_FAULT_REVERSE_MAX) are held and sent last-first */
} em_faults;

#define EM_FAULT_REVERSE_MAX 8u

/* What a reload changed: space-separated top-level keys. */
typedef struct em_reload_report {
    char path[1024];          /* the file read */
    char changed[512];        /* applied now */
    char needs_restart[512];  /* take effect only after a restart */
} em_reload_report;

typedef struct em_server_context {
    em_catalog *catalog;
    em_checkpointer *checkpointer; /* NULL without a checkpoint section */
    const char *checkpoint_dir;    /* checkpoint.dir, with the checkpointer */
    em_backend *backend;
    em_executor *executor;
    const em_log *log;
    em_server_stats stats;
    bool request_details; /* answers by status and durations are recorded (request_histograms) */
    uint64_t start_ms;  /* em_monotonic_ms at start */
    _Atomic int state;  /* em_server_state */
    _Atomic bool drained; /* out of service by DRAIN until UNDRAIN */
    _Atomic uint32_t data_connections; /* open on the data listener */
    em_faults faults;
    em_slowlog slowlog;                     /* loop thread only */
    _Atomic uint64_t slowlog_threshold_us; /* 0: off */
    /* the daemon's reload (RELOAD; the loop thread only) and its argument */
    em_status (*reload)(void *owner, em_reload_report *report, em_error *err);
    void *owner;
} em_server_context;

/* "starting", "serving", "draining", "failed". */
const char *em_server_state_name(int state);

/* The state as HEALTH, STATS and /healthz say it: "drained" while serving under DRAIN. */
const char *em_server_state_now(const em_server_context *context);

/* Whether the server takes data requests: serving and not drained. */
bool em_server_ready(const em_server_context *context);

/* Every number of the server (tables limited to table_filter unless NULL or ""), with
 * version, state and uptime: what STATS and /metrics render. Errors: em_stats_collect's. */
em_status em_server_collect_stats(em_server_context *context, const char *table_filter,
                                  em_stats_snapshot *snapshot, em_error *err);

/* Milliseconds on the monotonic clock (usable from any thread). */
uint64_t em_monotonic_ms(void);

#endif
