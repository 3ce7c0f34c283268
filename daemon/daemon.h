/*
 * DESIGN: emberd as a library.
 *
 * em_daemon_create brings a daemon up one step at a time from a parsed configuration
 * (backend, tables, loop, workers, listeners) and unwinds whatever was set up when a
 * step fails; em_daemon_run serves until a drain finishes; em_daemon_stop and
 * em_daemon_reload may be called from any thread, and from a signal handler (they only
 * set a flag and wake the loop with uv_async_send, which is async-signal-safe).
 *
 * main.c is arguments, signals and systemd around these calls; tests start real
 * daemons inside their own process the same way (each daemon owns its loop, so a test
 * may run several). The process must ignore SIGPIPE (a client that left is then an
 * error from write(), not a signal); a library does not change signal dispositions.
 */
#ifndef EMBER_DAEMON_DAEMON_H
#define EMBER_DAEMON_DAEMON_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/context.h"
#include "daemon/daemon_config.h"
#include "lib/base/status.h"

typedef struct em_daemon em_daemon;

typedef struct em_daemon_options {
    /* Where a reload reads the configuration again; NULL: reloads keep the running one. */
    const char *config_path;
    /* Log destination (the level is the configuration's); -1: no logging. */
    int log_fd;
    /* Service manager notifications ("READY=1\nSTATUS=..." in sd_notify's format); NULL
     * for none. */
    void (*notify)(void *context, const char *state);
    /* Watchdog interval the service manager asked for (0: none). The daemon notifies
     * "WATCHDOG=1" at half of it, only while its workers make progress. */
    uint64_t watchdog_usec;
    void *notify_context;
} em_daemon_options;

/* Defaults: no config path, log to stderr, no notifications. */
void em_daemon_options_init(em_daemon_options *options);

/* Brings a daemon up from config (copied; the caller keeps its own) and binds its
 * listeners; it serves once em_daemon_run is called. Errors name the step that failed
 * (backend, a table, a listener address). */
em_status em_daemon_create(const em_daemon_config *config, const em_daemon_options *options,
                           em_daemon **out, em_error *err);

/* Serves on the calling thread until a drain (em_daemon_stop) finishes and every handle
 * is closed. Returns false when the drain deadline passed with requests still busy. */
bool em_daemon_run(em_daemon *daemon);

/* Starts a drain: stop accepting, answer what was received (up to drain_timeout_ms),
 * then em_daemon_run returns. reason ("SIGTERM") is logged with it and must outlive
 * the daemon (a string literal). Any thread; async-signal-safe. */
void em_daemon_stop(em_daemon *daemon, const char *reason);

/* Reads options.config_path again and applies what may change at runtime (the
 * RELOADABLE keys of the schema); changes that need a restart are logged. Any thread;
 * async-signal-safe. */
void em_daemon_reload(em_daemon *daemon);

/* Whether a GPU of the CUDA backend failed (its context lost: a kernel fault, an NCCL
 * asynchronous error). The daemon then stops being ready at once, logs the cause,
 * drains and em_daemon_run returns; the process must exit non-zero (emberd exits 1) so
 * that the service manager restarts it. */
bool em_daemon_gpu_failed(const em_daemon *daemon);

/* After em_daemon_run returned: saves every table when checkpoint.on_shutdown says so
 * (failures are logged). The caller makes sure no signal calls into the daemon any more
 * (em_daemon_stop and em_daemon_reload need the loop, which is gone). */
void em_daemon_save_at_shutdown(em_daemon *daemon);

/* Frees everything; after em_daemon_run returned, or instead of it. */
void em_daemon_destroy(em_daemon *daemon);

/* The bound addresses ("127.0.0.1:7070"); valid from create to destroy. */
const char *em_daemon_data_address(const em_daemon *daemon);
const char *em_daemon_admin_address(const em_daemon *daemon);
/* "" without a metrics listener. */
const char *em_daemon_metrics_address(const em_daemon *daemon);

/* Counters as the STATS method reports them (read with atomic loads). */
const em_server_stats *em_daemon_stats(const em_daemon *daemon);

/* Worker threads serving table requests. */
uint32_t em_daemon_worker_threads(const em_daemon *daemon);

/* Fault injection for tests (daemon/context.h): set fields with atomic stores. */
em_faults *em_daemon_faults(em_daemon *daemon);

/* Closes every open connection at the next turn of the loop (fault injection: clients
 * see their connections dropped while idle). Any thread. */
void em_daemon_drop_connections(em_daemon *daemon);

#endif
