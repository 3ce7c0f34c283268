/*
 * DESIGN: a running daemon, from configuration to drained.
 *
 * em_daemon_create brings the parts up in order (backend, tables, loop, workers,
 * server and listeners, the wake-up handle) and destroys them in reverse through one
 * cleanup path. The loop thread owns everything after that; other threads (and signal
 * handlers) reach it only through `wake`, an async handle, with a flag saying what
 * they want: a drain, a reload, or dropped connections.
 *
 * Reload goes through the configuration schema: every RELOADABLE key is copied from
 * the freshly read file by em_config_copy_reloadable, then applied to the parts that
 * read it (the server's limits and tokens, the log level, atomically for workers);
 * keys that need a restart are reported.
 */
#include "daemon/daemon.h"

#include "lib/base/failpoint.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "daemon/executor.h"
#include "daemon/http.h"
#include "daemon/metrics.h"
#include "daemon/server.h"
#include "daemon/sweeper.h"
#include "ember_config.h"
#include "lib/device/backend.h"
#include "lib/table/catalog.h"

/* Builds for tests may bring a host emulation of the kernels (EM_CUDA_EMULATED). */
#if EM_HAVE_CUDA || defined(EM_CUDA_EMULATED)
#define CUDA_BACKEND 1
#else
#define CUDA_BACKEND 0
#endif

/* What other threads ask of the loop (bits of em_daemon.wanted). */
enum {
    WANT_STOP = 1u << 0,
    WANT_RELOAD = 1u << 1,
    WANT_DROP = 1u << 2,
    WANT_FAIL = 1u << 3, /* a GPU failed: drain and exit non-zero */
};

struct em_daemon {
    em_daemon_options options;
    em_daemon_config config;
    em_log log;
    em_backend *backend;
    em_catalog *catalog;
    em_checkpointer *checkpointer; /* NULL without a checkpoint section */
    em_sweeper *sweeper;           /* the expiry sweep */
    uv_loop_t loop;
    bool loop_ready;
    em_executor *executor;
    em_server *server;
    em_server_context context;
    uv_async_t wake;
    bool wake_open;
    _Atomic unsigned wanted;
    const char *_Atomic stop_reason; /* what asked for the drain (a literal) */
    uv_timer_t watchdog;
    bool watchdog_running;
    uint64_t watchdog_completed;
    bool stopping;
    bool drain_started;
    _Atomic bool gpu_failed; /* the CUDA backend lost a GPU (em_cuda_set_failure_handler) */
    bool forced; /* the drain deadline passed */
    char data_address[EM_ADDRESS_MAX];
    char admin_address[EM_ADDRESS_MAX];
    em_http_server *metrics; /* NULL without listen.metrics */
    char metrics_address[EM_ADDRESS_MAX];
};

void em_daemon_options_init(em_daemon_options *options)
{
    *options = (em_daemon_options){.log_fd = STDERR_FILENO};
}

static void notify(em_daemon *d, const char *format, ...) __attribute__((format(printf, 2, 3)));

static void notify(em_daemon *d, const char *format, ...)
{
    if (d->options.notify == NULL)
        return;
    char state[512];
    va_list args;
    va_start(args, format);
    vsnprintf(state, sizeof(state), format, args);
    va_end(args);
    d->options.notify(d->options.notify_context, state);
}

/* ---- bring-up steps ------------------------------------------------------------------ */

#if CUDA_BACKEND
static em_status create_cuda_backend(em_daemon *d, em_error *err)
{
    const em_backend_config *config = &d->config.backend;
    em_cuda_backend_options options;
    em_cuda_backend_options_init(&options);
    memcpy(options.devices, config->gpus.ordinals, config->gpus.count * sizeof(uint32_t));
    options.device_count = config->gpus.count;
    options.pool_bytes = config->memory_limit_bytes;
    options.memory_fraction = config->memory_fraction;
    options.lanes = config->lanes;
    options.staging_bytes = config->staging_bytes;
    options.pinned_buffer_bytes = config->pinned_buffer_bytes;
    em_status status = em_backend_create_cuda(&options, &d->backend, err);
    if (status != EM_OK)
        return em_error_prefix(err, "backend \"cuda\": ");
    em_pool_stats pool;
    em_pool_get_stats(d->backend->devices[0]->pool, &pool);
    em_log_notice(&d->log, "backend cuda: %u GPU(s) (%s first), pool %" PRIu64
                  " MiB each, %u lanes each, %s exchange", d->backend->device_count,
                  d->backend->devices[0]->name, pool.bytes_limit >> 20, config->lanes,
                  d->backend->exchange->name);
    if (d->backend->exchange_fallback[0] != '\0')
        em_log_warning(&d->log, "NCCL could not initialise, so the %u GPUs exchange keys "
                       "through host memory (slower; STATS exchange_fallback 1): %s",
                       d->backend->device_count, d->backend->exchange_fallback);
    return EM_OK;
}
#endif

/* auto: the CUDA backend when this build has it and a usable GPU is visible. */
static em_backend_type resolve_backend_type(em_daemon *d)
{
    em_backend_type type = (em_backend_type)d->config.backend.type;
    if (type != EM_BACKEND_AUTO)
        return type;
#if CUDA_BACKEND
    uint32_t gpus = 0;
    em_error err;
    if (em_cuda_available(&gpus, &err) == EM_OK && gpus > 0)
        return EM_BACKEND_CUDA;
    em_log_notice(&d->log, "backend auto: no usable GPU (%s); using the CPU backend",
                  err.message);
#else
    em_log_notice(&d->log, "backend auto: this build has no CUDA backend; using the CPU backend");
#endif
    return EM_BACKEND_CPU;
}

static em_status create_cpu_backend(em_daemon *d, em_error *err)
{
    const em_backend_config *config = &d->config.backend;
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.devices = config->devices;
    options.pool_limit_bytes = config->memory_limit_bytes;
    options.pool_initial_bytes = config->initial_bytes;
    options.pool_growth_bytes = config->growth_bytes;
    options.eviction_threads = config->eviction_threads;
    em_status status = em_backend_create_cpu(&options, &d->backend, err);
    if (status != EM_OK)
        return status;
    em_pool_stats pool;
    em_pool_get_stats(d->backend->devices[0]->pool, &pool);
    em_log_notice(&d->log, "backend cpu: %u device(s), pool limit %" PRIu64 " MiB each",
                  d->backend->device_count, pool.bytes_limit >> 20);
    return EM_OK;
}

static em_status create_backend(em_daemon *d, em_error *err)
{
    switch (resolve_backend_type(d)) {
    case EM_BACKEND_CUDA:
#if CUDA_BACKEND
        return create_cuda_backend(d, err);
#else
        return em_error_set(err, EM_FAILED_PRECONDITION,
                            "backend.type is \"cuda\" but this emberd was built without the "
                            "CUDA backend; use \"cpu\" or \"auto\"");
#endif
    case EM_BACKEND_CPU:
    case EM_BACKEND_AUTO:
        break;
    }
    return create_cpu_backend(d, err);
}

/* Each line goes to STATUS=, and asks the service manager for another minute of start
 * time: a restore that goes on making progress never meets TimeoutStartSec. */
static void restore_progress(void *context, const char *line, bool detail)
{
    em_daemon *d = context;
    if (detail)
        em_log_info(&d->log, "%s", line);
    else
        em_log_notice(&d->log, "%s", line);
    notify(d, "STATUS=%s\nEXTEND_TIMEOUT_USEC=60000000", line);
}

/* A configured table that a checkpoint restored stays as restored, if its dim agrees. */
static em_status check_restored(em_daemon *d, const em_table_config *configured, bool *restored,
                                em_error *err)
{
    em_table *table = NULL;
    em_error ignored;
    *restored = em_catalog_acquire(d->catalog, configured->name, &table, &ignored) == EM_OK;
    if (!*restored)
        return EM_OK;
    uint32_t dim = em_table_dim(table);
    em_catalog_release(d->catalog, table);
    if (dim != configured->dim)
        return em_error_set(err, EM_FAILED_PRECONDITION,
                            "table '%s': the configuration says dim %u, its checkpoint has dim "
                            "%u", configured->name, configured->dim, dim);
    return EM_OK;
}

static em_status create_tables(em_daemon *d, em_error *err)
{
    em_status status = em_catalog_create(d->backend, &d->catalog, err);
    if (status == EM_OK && d->config.checkpoint.enabled)
        status = em_checkpointer_create(&d->config.checkpoint, d->catalog, &d->log,
                                        &d->context.stats, &d->checkpointer, err);
    if (status == EM_OK && d->checkpointer != NULL &&
        d->config.checkpoint.restore != EM_RESTORE_NONE)
        status = em_checkpointer_restore(d->checkpointer, restore_progress, d, err);
    if (status == EM_OK && d->checkpointer != NULL &&
        d->config.checkpoint.restore == EM_RESTORE_SEED)
        status = em_checkpointer_seed(d->checkpointer, restore_progress, d, err);
    for (uint32_t i = 0; status == EM_OK && i < d->config.tables.count; i++) {
        const em_table_config *table = &d->config.tables.items[i];
        bool restored = false;
        status = check_restored(d, table, &restored, err);
        if (status != EM_OK || restored)
            continue;
        status = em_catalog_create_table(d->catalog, table, NULL, err);
        if (status == EM_OK)
            em_log_notice(&d->log, "table '%s': dim %u, capacity %" PRIu64 ", %s", table->name,
                          table->dim, table->capacity, em_optimizer_name(table->optimizer.kind));
    }
    return status;
}

/* Workers run table requests. A GPU request holds a lane on every GPU for its whole
 * run, so with the cuda backend more workers than lanes would only wait for lanes. */
static uint32_t worker_threads(const em_daemon *d)
{
    if (d->config.backend.threads > 0)
        return d->config.backend.threads;
    if (strcmp(d->backend->kind, "cuda") == 0)
        return d->config.backend.lanes;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (uint32_t)online : 1;
}

/* ---- stopping ------------------------------------------------------------------------ */

/* Stops everything that keeps the loop alive; uv_run then returns. */
static void stop(em_daemon *d)
{
    if (d->stopping)
        return;
    d->stopping = true;
    if (d->executor != NULL) {
        em_executor_close(d->executor); /* waits for running jobs, answers them */
        d->executor = NULL;
    }
    if (d->server != NULL) {
        em_server_close(d->server, NULL, NULL);
        d->server = NULL;
    }
    if (d->metrics != NULL) {
        em_http_server_close(d->metrics);
        d->metrics = NULL;
    }
    if (d->wake_open) {
        uv_close((uv_handle_t *)&d->wake, NULL);
        d->wake_open = false;
    }
    if (d->watchdog_running) {
        uv_close((uv_handle_t *)&d->watchdog, NULL);
        d->watchdog_running = false;
    }
}

static void on_drained(em_server *server, bool forced, void *context)
{
    (void)server;
    em_daemon *d = context;
    d->forced = forced;
    em_log_notice(&d->log, "drained%s; exiting", forced ? " (deadline passed)" : "");
    stop(d);
}

static void begin_drain(em_daemon *d)
{
    if (d->server == NULL || d->drain_started)
        return;
    d->drain_started = true;
    if (atomic_load(&d->context.state) != EM_SERVER_FAILED)
        atomic_store(&d->context.state, EM_SERVER_DRAINING);
    const char *reason = atomic_load(&d->stop_reason);
    em_log_notice(&d->log, "%s: draining (deadline %u ms)", reason != NULL ? reason : "stop",
                  d->config.drain_timeout_ms);
    notify(d, "STOPPING=1\nSTATUS=draining");
    em_server_drain(d->server, d->config.drain_timeout_ms, on_drained, d);
}

#if CUDA_BACKEND
static void want(em_daemon *d, unsigned what);

/* A GPU's context is lost (any thread): from now on every CUDA call of the process
 * fails, so readiness goes at once and the loop drains and stops; main exits non-zero
 * and the service manager restarts emberd (checkpoints bring the tables back). */
static void on_gpu_failure(void *context, const char *cause)
{
    em_daemon *d = context;
    (void)cause; /* logged by the loop, from em_cuda_failed */
    atomic_store(&d->gpu_failed, true);
    atomic_store(&d->context.state, EM_SERVER_FAILED);
    want(d, WANT_FAIL);
}
#endif

static void fail(em_daemon *d)
{
    char cause[EM_ERROR_MESSAGE_MAX] = "";
#if CUDA_BACKEND
    (void)em_cuda_failed(cause, sizeof(cause));
#endif
    em_log_error(&d->log, "GPU failed: %s; draining and exiting with status 1, so that the "
                 "service manager restarts emberd", cause);
    notify(d, "STATUS=failed: GPU failed: %s", cause);
    atomic_store(&d->stop_reason, "a GPU failure");
    begin_drain(d);
}

/* ---- reload -------------------------------------------------------------------------- */

typedef struct reload_changes {
    em_daemon *daemon;
    em_reload_report *report; /* NULL: only logged */
} reload_changes;

static void append_key(char *list, size_t capacity, const char *key)
{
    size_t used = strlen(list);
    snprintf(list + used, capacity - used, "%s%s", used > 0 ? " " : "", key);
}

static void report_change(void *context, const char *key, bool reloadable)
{
    reload_changes *changes = context;
    if (!reloadable)
        em_log_warning(&changes->daemon->log,
                       "reload: '%s' changed but takes effect only after a restart", key);
    if (changes->report != NULL)
        append_key(reloadable ? changes->report->changed : changes->report->needs_restart,
                   sizeof(changes->report->changed), key);
}

/* Reads the configuration file again and applies what may change while running; report
 * (nullable) gets the changed keys. Loop thread. Errors: FAILED_PRECONDITION (no file to
 * read, or a file that does not parse: the running configuration stays). */
static em_status reload_now(em_daemon *d, em_reload_report *report, em_error *err)
{
    if (d->options.config_path == NULL || d->server == NULL)
        return em_error_set(err, EM_FAILED_PRECONDITION,
                            "this daemon was started without a configuration file to reload");
    if (report != NULL) {
        memset(report, 0, sizeof(*report));
        snprintf(report->path, sizeof(report->path), "%s", d->options.config_path);
    }
    /* MONOTONIC_USEC lets a Type=notify-reload manager (systemd 253 and later) match the
     * reload it asked for; older managers ignore it */
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    notify(d, "RELOADING=1\nMONOTONIC_USEC=%" PRIu64 "\nSTATUS=reloading",
           (uint64_t)now.tv_sec * 1000000u + (uint64_t)now.tv_nsec / 1000u);
    em_daemon_config fresh;
    if (em_daemon_config_load(d->options.config_path, &fresh, err) != EM_OK) {
        em_log_error(&d->log, "reload failed, keeping the running configuration: %s",
                     err->message);
        notify(d, "READY=1\nSTATUS=serving (reload failed)");
        em_error_prefix(err, "reload failed, the running configuration stays: ");
        err->status = EM_FAILED_PRECONDITION;
        return EM_FAILED_PRECONDITION;
    }
    em_error failpoint_err;
    if (em_failpoints_arm_from_env(&failpoint_err) != EM_OK)
        em_log_error(&d->log, "failpoints: %s", failpoint_err.message);
    char armed[256];
    em_failpoints_describe(armed, sizeof(armed));
    if (armed[0] != '\0')
        em_log_warning(&d->log, "failpoints armed (for tests only): %s", armed);
    reload_changes changes = {d, report};
    em_daemon_config_changes(&d->config, &fresh, report_change, &changes);
    em_config_copy_reloadable(&em_daemon_config_schema, &d->config, &fresh);
    em_log_set_level(&d->log, (em_log_level)d->config.log_level);
    em_log_set_logfmt(&d->log, d->config.log_format == 1);
    atomic_store(&d->context.slowlog_threshold_us, (uint64_t)d->config.slowlog_threshold_ms * 1000u);
    em_server_reconfigure(d->server, &d->config);
    em_daemon_config_deinit(&fresh);
    em_log_notice(&d->log, "configuration reloaded from %s", d->options.config_path);
    notify(d, "READY=1\nSTATUS=serving");
    return EM_OK;
}

static void reload(em_daemon *d)
{
    em_error ignored; /* logged by reload_now */
    (void)reload_now(d, NULL, &ignored);
}

/* RELOAD over the admin RPC (context: the daemon). */
static em_status reload_for_rpc(void *context, em_reload_report *report, em_error *err)
{
    return reload_now(context, report, err);
}

/* ---- wake-ups and watchdog ----------------------------------------------------------- */

static void on_wake(uv_async_t *handle)
{
    em_daemon *d = handle->data;
    unsigned wanted = atomic_exchange(&d->wanted, 0u);
    if ((wanted & WANT_DROP) && d->server != NULL)
        em_server_close_connections(d->server);
    if (wanted & WANT_RELOAD)
        reload(d);
    if (wanted & WANT_FAIL)
        fail(d);
    if (wanted & WANT_STOP)
        begin_drain(d);
}

static void want(em_daemon *d, unsigned what)
{
    atomic_fetch_or(&d->wanted, what);
    uv_async_send(&d->wake);
}

void em_daemon_stop(em_daemon *daemon, const char *reason)
{
    atomic_store(&daemon->stop_reason, reason);
    want(daemon, WANT_STOP);
}

void em_daemon_reload(em_daemon *daemon)
{
    want(daemon, WANT_RELOAD);
}

void em_daemon_drop_connections(em_daemon *daemon)
{
    want(daemon, WANT_DROP);
}

/* Pings the service manager only while the workers make progress: with work queued and
 * none done since the last tick, the ping is withheld and a stuck daemon is restarted. */
static void on_watchdog(uv_timer_t *timer)
{
    em_daemon *d = timer->data;
    if (d->executor == NULL)
        return;
    uint64_t completed = em_executor_completed(d->executor);
    bool stuck = em_executor_pending(d->executor) > 0 && completed == d->watchdog_completed;
    d->watchdog_completed = completed;
    if (stuck)
        em_log_warning(&d->log, "workers made no progress in a watchdog interval");
    else
        notify(d, "WATCHDOG=1");
}

static void start_watchdog(em_daemon *d)
{
    uint64_t usec = d->options.watchdog_usec;
    if (usec == 0 || d->options.notify == NULL)
        return;
    uint64_t interval_ms = usec / 2000 > 0 ? usec / 2000 : 1;
    uv_timer_init(&d->loop, &d->watchdog);
    d->watchdog.data = d;
    uv_timer_start(&d->watchdog, on_watchdog, interval_ms, interval_ms);
    d->watchdog_running = true;
}

/* ---- create, run, destroy ------------------------------------------------------------ */

/* ---- the metrics listener's routes ----------------------------------------------------- */

static em_status scrape(void *context, bool openmetrics, char **body, size_t *length,
                        em_error *err)
{
    em_daemon *d = context;
    em_stats_snapshot snapshot;
    em_status status = em_server_collect_stats(&d->context, NULL, &snapshot, err);
    if (status != EM_OK)
        return status;
    status = em_metrics_render(&snapshot, openmetrics, body, length, err);
    em_stats_snapshot_free(&snapshot);
    return status;
}

static bool healthy(void *context, const char **state)
{
    em_daemon *d = context;
    *state = em_server_state_now(&d->context);
    return em_server_ready(&d->context);
}

static em_status start(em_daemon *d, em_error *err)
{
    em_status status = create_backend(d, err);
    if (status == EM_OK)
        status = create_tables(d, err);
    if (status == EM_OK)
        status = em_sweeper_create(d->catalog, &d->log, &d->sweeper, err);
    if (status != EM_OK)
        return status;
    int rc = uv_loop_init(&d->loop);
    if (rc != 0)
        return em_error_set(err, EM_INTERNAL, "uv_loop_init: %s", uv_strerror(rc));
    d->loop_ready = true;
    rc = uv_async_init(&d->loop, &d->wake, on_wake);
    if (rc != 0)
        return em_error_set(err, EM_INTERNAL, "uv_async_init: %s", uv_strerror(rc));
    d->wake.data = d;
    d->wake_open = true;
#if CUDA_BACKEND
    /* Once the loop can be woken; a failure before it is handed over now. */
    if (strcmp(d->backend->kind, "cuda") == 0)
        em_cuda_set_failure_handler(on_gpu_failure, d);
#endif
    d->context.catalog = d->catalog;
    d->context.checkpointer = d->checkpointer;
    d->context.checkpoint_dir = d->config.checkpoint.dir;
    d->context.backend = d->backend;
    d->context.log = &d->log;
    d->context.reload = reload_for_rpc;
    d->context.owner = d;
    status = em_slowlog_init(&d->context.slowlog, d->config.slowlog_max_entries, err);
    if (status != EM_OK)
        return status;
    atomic_store(&d->context.slowlog_threshold_us, (uint64_t)d->config.slowlog_threshold_ms * 1000u);
    d->context.start_ms = em_monotonic_ms();
    status = em_executor_create(&d->loop, worker_threads(d), "cpu", &d->executor, err);
    d->context.executor = d->executor;
    if (status == EM_OK)
        status = em_server_create(&d->loop, &d->config, &d->context, &d->server, err);
    if (status == EM_OK)
        status = em_server_listen(d->server, err);
    d->context.request_details = d->config.request_histograms;
    if (status == EM_OK && d->config.listen.metrics[0] != '\0') {
        em_http_routes routes = {.metrics = scrape, .healthy = healthy, .context = d};
        status = em_http_server_start(&d->loop, d->config.listen.metrics, &routes,
                                      &d->context.stats, &d->metrics, err);
        if (status == EM_OK)
            snprintf(d->metrics_address, sizeof(d->metrics_address), "%s",
                     em_http_server_address(d->metrics));
    }
    return status;
}

static em_status copy_config(em_daemon_config *to, const em_daemon_config *from, em_error *err)
{
    *to = *from;
    to->tables.items = NULL;
    if (from->tables.count == 0)
        return EM_OK;
    to->tables.items = calloc(from->tables.count, sizeof(*to->tables.items));
    if (to->tables.items == NULL) {
        to->tables.count = 0;
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "configuration: out of memory");
    }
    memcpy(to->tables.items, from->tables.items, from->tables.count * sizeof(*to->tables.items));
    return EM_OK;
}

em_status em_daemon_create(const em_daemon_config *config, const em_daemon_options *options,
                           em_daemon **out, em_error *err)
{
    em_daemon *d = calloc(1, sizeof(*d));
    if (d == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "daemon: out of memory");
    d->options = *options;
    atomic_init(&d->wanted, 0u);
    atomic_init(&d->stop_reason, NULL);
    atomic_init(&d->context.state, EM_SERVER_STARTING);
    em_status status = copy_config(&d->config, config, err);
    if (status != EM_OK) {
        free(d);
        return status;
    }
    em_log_init(&d->log, (em_log_level)d->config.log_level, options->log_fd);
    em_log_set_logfmt(&d->log, d->config.log_format == 1);
    if (options->log_fd < 0)
        em_log_set_level(&d->log, (em_log_level)0); /* nothing passes */
    em_log_notice(&d->log, "emberd %s starting with %s", EM_VERSION,
                  options->config_path != NULL ? options->config_path : "a configuration");
    status = em_failpoints_arm_from_env(err);
    char armed[256];
    em_failpoints_describe(armed, sizeof(armed));
    if (armed[0] != '\0')
        em_log_warning(&d->log, "failpoints armed (for tests only): %s", armed);
    if (status == EM_OK)
        status = start(d, err);
    if (status != EM_OK) {
        em_log_error(&d->log, "cannot start: %s", err->message);
        em_daemon_destroy(d);
        return status;
    }
    snprintf(d->data_address, sizeof(d->data_address), "%s", em_server_data_address(d->server));
    snprintf(d->admin_address, sizeof(d->admin_address), "%s",
             em_server_admin_address(d->server));
    *out = d;
    return EM_OK;
}

bool em_daemon_run(em_daemon *d)
{
    int starting = EM_SERVER_STARTING; /* a GPU may have failed already */
    atomic_compare_exchange_strong(&d->context.state, &starting, EM_SERVER_SERVING);
    start_watchdog(d);
    em_log_notice(&d->log, "serving: data %s, admin %s, metrics %s, %u worker thread(s), %zu "
                  "table(s)", d->data_address, d->admin_address,
                  d->metrics_address[0] != '\0' ? d->metrics_address : "off",
                  em_executor_threads(d->executor), em_catalog_count(d->catalog));
    notify(d, "READY=1\nSTATUS=serving on %s (admin %s)", d->data_address, d->admin_address);
    uv_run(&d->loop, UV_RUN_DEFAULT);
    return !d->forced;
}

bool em_daemon_gpu_failed(const em_daemon *d)
{
    return atomic_load(&d->gpu_failed);
}

void em_daemon_save_at_shutdown(em_daemon *d)
{
    if (d->checkpointer == NULL || !d->config.checkpoint.on_shutdown)
        return;
    if (atomic_load(&d->gpu_failed)) {
        em_log_error(&d->log, "shutdown save skipped: a GPU failed, its rows cannot be read; "
                     "the last completed checkpoint stays current");
        return;
    }
    notify(d, "STATUS=saving every table");
    em_checkpoint_info *infos = NULL;
    size_t count = 0;
    em_error err;
    if (em_checkpointer_save_at_exit(d->checkpointer, &infos, &count, &err) != EM_OK)
        em_log_error(&d->log, "shutdown save: %s", err.message);
    free(infos);
}

void em_daemon_destroy(em_daemon *d)
{
    if (d == NULL)
        return;
#if CUDA_BACKEND
    if (d->backend != NULL && strcmp(d->backend->kind, "cuda") == 0)
        em_cuda_set_failure_handler(NULL, NULL);
#endif
    stop(d);
    if (d->loop_ready) {
        uv_run(&d->loop, UV_RUN_DEFAULT); /* let closing handles finish */
        uv_loop_close(&d->loop);
    }
    em_sweeper_destroy(d->sweeper);
    em_checkpointer_destroy(d->checkpointer);
    em_slowlog_free(&d->context.slowlog);
    em_catalog_destroy(d->catalog);
    em_backend_destroy(d->backend);
    em_daemon_config_deinit(&d->config);
    free(d);
}

const char *em_daemon_data_address(const em_daemon *daemon)
{
    return daemon->data_address;
}

const char *em_daemon_admin_address(const em_daemon *daemon)
{
    return daemon->admin_address;
}

const char *em_daemon_metrics_address(const em_daemon *daemon)
{
    return daemon->metrics_address;
}

const em_server_stats *em_daemon_stats(const em_daemon *daemon)
{
    return &daemon->context.stats;
}

uint32_t em_daemon_worker_threads(const em_daemon *daemon)
{
    return daemon->executor != NULL ? em_executor_threads(daemon->executor) : 0;
}

em_faults *em_daemon_faults(em_daemon *daemon)
{
    return &daemon->context.faults;
}
