/*
 * DESIGN: emberd's entry point.
 *
 * main() reads the arguments and the configuration, then brings the daemon up one step
 * at a time (logger, backend, tables, loop, workers, listeners, signals), and unwinds
 * whatever was set up through one cleanup ladder. Readiness (READY=1) is sent right
 * before the loop starts. Signals only set things in motion on the loop thread:
 * SIGTERM or SIGINT starts a drain (stop accepting, answer what was received, exit 0),
 * a second SIGINT exits at once, SIGHUP reloads what may change at runtime.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "daemon/daemon_config.h"
#include "daemon/dispatch.h"
#include "daemon/executor.h"
#include "daemon/notify.h"
#include "daemon/server.h"
#include "ember_config.h"
#include "lib/device/backend.h"
#include "lib/table/catalog.h"
#include "lib/base/log.h"

/* Builds for tests may bring a host emulation of the kernels (EM_CUDA_EMULATED). */
#if EM_HAVE_CUDA || defined(EM_CUDA_EMULATED)
#define CUDA_BACKEND 1
#else
#define CUDA_BACKEND 0
#endif

enum exit_code {
    EXIT_OK = 0,
    EXIT_RUNTIME = 1, /* the daemon could not start or run */
    EXIT_USAGE = 2,   /* bad arguments or configuration */
    EXIT_INTERRUPTED = 130,
};

#define DEFAULT_CONFIG_PATH "/etc/ember/emberd.json"

typedef struct daemon_options {
    const char *config_path;
    const char *listen_file;
    bool check_only;
} daemon_options;

static int list_devices(void);

typedef struct daemon_state {
    daemon_options options;
    em_daemon_config config;
    em_log log;
    em_backend *backend;
    em_catalog *catalog;
    uv_loop_t loop;
    bool loop_ready;
    em_executor *executor;
    em_server *server;
    em_server_context context;
    uv_signal_t signals[3];
    int signal_count;
    uv_timer_t watchdog;
    bool watchdog_running;
    uint64_t watchdog_completed;
    int interrupts;
    bool stopping;
} daemon_state;

/* ---- arguments ----------------------------------------------------------------------- */

static void print_usage(FILE *out)
{
    fprintf(out,
            "usage: emberd [--config FILE] [--check-config] [--listen-file FILE]\n"
            "\n"
            "Serves sharded embedding tables over the ember protocol.\n"
            "\n"
            "  -c, --config FILE       configuration (default " DEFAULT_CONFIG_PATH ")\n"
            "      --check-config      validate the configuration and exit\n"
            "      --listen-file FILE  once serving, write the bound addresses there as JSON\n"
            "      --list-devices      say which GPUs the cuda backend can use (exit 1: none)\n"
            "  -h, --help              show this help\n"
            "  -V, --version           show the version\n"
            "\n"
            "Signals: SIGTERM/SIGINT drain and exit 0 (a second SIGINT exits at once),\n"
            "SIGHUP reloads log_level, limits, tokens and drain_timeout_ms.\n"
            "Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error.\n");
}

static int parse_arguments(int argc, char **argv, daemon_options *out)
{
    static const struct option long_options[] = {
        {"config", required_argument, NULL, 'c'},
        {"check-config", no_argument, NULL, 'k'},
        {"listen-file", required_argument, NULL, 'l'},
        {"list-devices", no_argument, NULL, 'D'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    *out = (daemon_options){.config_path = DEFAULT_CONFIG_PATH};
    int option;
    while ((option = getopt_long(argc, argv, "c:hV", long_options, NULL)) != -1) {
        switch (option) {
        case 'c':
            out->config_path = optarg;
            break;
        case 'k':
            out->check_only = true;
            break;
        case 'l':
            out->listen_file = optarg;
            break;
        case 'D':
            exit(list_devices());
        case 'h':
            print_usage(stdout);
            exit(EXIT_OK);
        case 'V':
            printf("emberd %s\n", EM_VERSION);
            exit(EXIT_OK);
        default:
            print_usage(stderr);
            return EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "emberd: unexpected argument '%s'\n", argv[optind]);
        print_usage(stderr);
        return EXIT_USAGE;
    }
    return EXIT_OK;
}

/* ---- devices ------------------------------------------------------------------------- */

static int list_devices(void)
{
#if CUDA_BACKEND
    uint32_t gpus = 0;
    em_error err;
    if (em_cuda_available(&gpus, &err) != EM_OK || gpus == 0) {
        printf("cuda: no usable GPU: %s\n", gpus == 0 && err.message[0] ? err.message : "none");
        return EXIT_RUNTIME;
    }
    printf("cuda: %u usable GPU(s)\n", gpus);
    return EXIT_OK;
#else
    printf("cuda: this emberd was built without the CUDA backend\n");
    return EXIT_RUNTIME;
#endif
}

/* ---- bring-up steps ------------------------------------------------------------------ */

#if CUDA_BACKEND
static em_status create_cuda_backend(daemon_state *d, em_error *err)
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
    em_status status = em_backend_create_cuda(&options, &d->backend, err);
    if (status != EM_OK)
        return em_error_prefix(err, "backend \"cuda\": ");
    em_pool_stats pool;
    em_pool_get_stats(d->backend->devices[0]->pool, &pool);
    em_log_notice(&d->log, "backend cuda: %u GPU(s) (%s first), pool %" PRIu64
                  " MiB each, %u lanes each, %s exchange", d->backend->device_count,
                  d->backend->devices[0]->name, pool.bytes_limit >> 20, config->lanes,
                  d->backend->exchange->name);
    return EM_OK;
}
#endif

/* auto: the CUDA backend when this build has it and a usable GPU is visible. */
static em_backend_type resolve_backend_type(daemon_state *d)
{
    int type = d->config.backend.type;
    if (type != EM_BACKEND_AUTO)
        return (em_backend_type)type;
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

static em_status create_backend(daemon_state *d, em_error *err)
{
    const em_backend_config *config = &d->config.backend;
    em_backend_type type = resolve_backend_type(d);
    if (type == EM_BACKEND_CUDA) {
#if CUDA_BACKEND
        return create_cuda_backend(d, err);
#else
        return em_error_set(err, EM_FAILED_PRECONDITION,
                            "backend.type is \"cuda\" but this emberd was built without the "
                            "CUDA backend; use \"cpu\" or \"auto\"");
#endif
    }
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.devices = config->devices;
    options.pool_limit_bytes = config->memory_limit_bytes;
    options.pool_initial_bytes = config->initial_bytes;
    options.pool_growth_bytes = config->growth_bytes;
    em_status status = em_backend_create_cpu(&options, &d->backend, err);
    if (status != EM_OK)
        return status;
    em_pool_stats pool;
    em_pool_get_stats(d->backend->devices[0]->pool, &pool);
    em_log_notice(&d->log, "backend cpu: %u device(s), pool limit %" PRIu64 " MiB each",
                  d->backend->device_count, pool.bytes_limit >> 20);
    return EM_OK;
}

static em_status create_tables(daemon_state *d, em_error *err)
{
    em_status status = em_catalog_create(d->backend, &d->catalog, err);
    for (uint32_t i = 0; status == EM_OK && i < d->config.tables.count; i++) {
        const em_table_config *table = &d->config.tables.items[i];
        status = em_catalog_create_table(d->catalog, table, NULL, err);
        if (status == EM_OK)
            em_log_notice(&d->log, "table '%s': dim %u, capacity %" PRIu64 ", %s", table->name,
                          table->dim, table->capacity, em_optimizer_name(table->optimizer.kind));
    }
    return status;
}

/* Workers run table requests. A GPU request holds a lane on every GPU for its whole
 * run, so with the cuda backend more workers than lanes would only wait for lanes. */
static uint32_t worker_threads(const daemon_state *d)
{
    if (d->config.backend.threads > 0)
        return d->config.backend.threads;
    if (strcmp(d->backend->kind, "cuda") == 0)
        return d->config.backend.lanes;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (uint32_t)online : 1;
}

static em_status write_listen_file(const daemon_state *d, em_error *err)
{
    const char *path = d->options.listen_file;
    if (path == NULL)
        return EM_OK;
    char temporary[4096];
    snprintf(temporary, sizeof(temporary), "%s.tmp", path);
    FILE *file = fopen(temporary, "w");
    if (file == NULL)
        return em_error_set(err, EM_UNAVAILABLE, "cannot write listen file '%s': %s", temporary,
                            strerror(errno));
    fprintf(file, "{\"data\": \"%s\", \"admin\": \"%s\", \"pid\": %ld}\n",
            em_server_data_address(d->server), em_server_admin_address(d->server),
            (long)getpid());
    if (fclose(file) != 0 || rename(temporary, path) != 0)
        return em_error_set(err, EM_UNAVAILABLE, "cannot write listen file '%s': %s", path,
                            strerror(errno));
    return EM_OK;
}

/* ---- shutdown ------------------------------------------------------------------------ */

static void close_signals(daemon_state *d)
{
    for (int i = 0; i < d->signal_count; i++)
        uv_close((uv_handle_t *)&d->signals[i], NULL);
    d->signal_count = 0;
    if (d->watchdog_running) {
        uv_close((uv_handle_t *)&d->watchdog, NULL);
        d->watchdog_running = false;
    }
}

/* Stops everything that keeps the loop alive; uv_run then returns. */
static void stop(daemon_state *d)
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
    close_signals(d);
}

static void on_drained(em_server *server, bool forced, void *context)
{
    (void)server;
    daemon_state *d = context;
    em_log_notice(&d->log, "drained%s; exiting", forced ? " (deadline passed)" : "");
    stop(d);
}

static void begin_drain(daemon_state *d, const char *why)
{
    if (atomic_load(&d->context.state) == EM_SERVER_DRAINING)
        return;
    atomic_store(&d->context.state, EM_SERVER_DRAINING);
    em_log_notice(&d->log, "%s: draining (deadline %u ms)", why, d->config.drain_timeout_ms);
    em_notify("STOPPING=1\nSTATUS=draining");
    em_server_drain(d->server, d->config.drain_timeout_ms, on_drained, d);
}

/* ---- reload -------------------------------------------------------------------------- */

static void report_fixed_change(void *context, const char *key)
{
    daemon_state *d = context;
    em_log_warning(&d->log, "reload: '%s' changed but takes effect only after a restart", key);
}

static void reload(daemon_state *d)
{
    em_notify("RELOADING=1\nSTATUS=reloading");
    em_daemon_config fresh;
    em_error err;
    if (em_daemon_config_load(d->options.config_path, &fresh, &err) != EM_OK) {
        em_log_error(&d->log, "reload failed, keeping the running configuration: %s",
                     err.message);
        em_notify("READY=1\nSTATUS=serving (reload failed)");
        return;
    }
    em_daemon_config_fixed_changes(&d->config, &fresh, report_fixed_change, d);
    d->config.limits = fresh.limits;
    d->config.admin_token = fresh.admin_token;
    d->config.data_token = fresh.data_token;
    d->config.log_level = fresh.log_level;
    d->config.drain_timeout_ms = fresh.drain_timeout_ms;
    d->log.level = (em_log_level)fresh.log_level;
    em_server_reconfigure(d->server, &d->config);
    em_daemon_config_deinit(&fresh);
    em_log_notice(&d->log, "configuration reloaded from %s", d->options.config_path);
    em_notify("READY=1\nSTATUS=serving");
}

/* ---- signals and watchdog ------------------------------------------------------------ */

static void on_signal(uv_signal_t *handle, int signal_number)
{
    daemon_state *d = handle->data;
    if (signal_number == SIGHUP) {
        reload(d);
        return;
    }
    if (signal_number == SIGINT && ++d->interrupts > 1) {
        em_log_warning(&d->log, "second SIGINT: exiting now");
        _exit(EXIT_INTERRUPTED);
    }
    begin_drain(d, signal_number == SIGINT ? "SIGINT" : "SIGTERM");
}

static em_status watch_signals(daemon_state *d, em_error *err)
{
    static const int numbers[] = {SIGTERM, SIGINT, SIGHUP};
    for (int i = 0; i < 3; i++) {
        uv_signal_init(&d->loop, &d->signals[i]);
        d->signals[i].data = d;
        d->signal_count = i + 1;
        int rc = uv_signal_start(&d->signals[i], on_signal, numbers[i]);
        if (rc != 0)
            return em_error_set(err, EM_INTERNAL, "cannot watch signal %d: %s", numbers[i],
                                uv_strerror(rc));
    }
    return EM_OK;
}

/* Pings systemd only while the workers make progress: with work queued and none done
 * since the last tick, the ping is withheld and systemd restarts a stuck daemon. */
static void on_watchdog(uv_timer_t *timer)
{
    daemon_state *d = timer->data;
    uint64_t completed = em_executor_completed(d->executor);
    bool stuck = em_executor_pending(d->executor) > 0 && completed == d->watchdog_completed;
    d->watchdog_completed = completed;
    if (stuck)
        em_log_warning(&d->log, "workers made no progress in a watchdog interval");
    else
        em_notify("WATCHDOG=1");
}

static void start_watchdog(daemon_state *d)
{
    uint64_t usec = em_notify_watchdog_usec();
    if (usec == 0)
        return;
    uint64_t interval_ms = usec / 2000 > 0 ? usec / 2000 : 1;
    uv_timer_init(&d->loop, &d->watchdog);
    d->watchdog.data = d;
    uv_timer_start(&d->watchdog, on_watchdog, interval_ms, interval_ms);
    d->watchdog_running = true;
}

/* ---- main ---------------------------------------------------------------------------- */

/* Request attachments and pull answers are megabytes each and short-lived. By default
 * glibc serves such blocks with fresh mmaps and unmaps them on free, so every request
 * pays page faults and kernel page zeroing for its buffers. Keeping them in the heap
 * lets freed buffers serve the next requests; the connections' in-flight budgets
 * already bound how much memory that can hold. */
#define LARGE_BLOCK_THRESHOLD (512u << 20)
#define HEAP_TRIM_THRESHOLD (1024u << 20)

static void tune_allocator(void)
{
    mallopt(M_MMAP_THRESHOLD, (int)LARGE_BLOCK_THRESHOLD);
    mallopt(M_TRIM_THRESHOLD, (int)HEAP_TRIM_THRESHOLD);
}

static int check_config(daemon_state *d)
{
    printf("%s: configuration OK: %u table(s), data %s, admin %s, backend %s\n",
           d->options.config_path, d->config.tables.count, d->config.listen.data,
           d->config.listen.admin, em_backend_type_name(d->config.backend.type));
    return EXIT_OK;
}

static em_status start(daemon_state *d, em_error *err)
{
    em_status status = create_backend(d, err);
    if (status == EM_OK)
        status = create_tables(d, err);
    if (status != EM_OK)
        return status;
    int rc = uv_loop_init(&d->loop);
    if (rc != 0)
        return em_error_set(err, EM_INTERNAL, "uv_loop_init: %s", uv_strerror(rc));
    d->loop_ready = true;
    d->context = (em_server_context){.catalog = d->catalog, .backend = d->backend,
                                     .log = &d->log, .start_ms = em_monotonic_ms()};
    atomic_init(&d->context.state, EM_SERVER_STARTING);
    status = em_executor_create(&d->loop, worker_threads(d), "cpu", &d->executor, err);
    d->context.executor = d->executor;
    if (status == EM_OK)
        status = em_server_create(&d->loop, &d->config, &d->context, &d->server, err);
    if (status == EM_OK)
        status = em_server_listen(d->server, err);
    if (status == EM_OK)
        status = watch_signals(d, err);
    if (status == EM_OK)
        status = write_listen_file(d, err);
    return status;
}

int main(int argc, char **argv)
{
    daemon_state d;
    memset(&d, 0, sizeof(d));
    int code = parse_arguments(argc, argv, &d.options);
    if (code != EXIT_OK)
        return code;
    signal(SIGPIPE, SIG_IGN); /* a peer that left is an error from write(), not a signal */
    tune_allocator();
    em_error err;
    if (em_daemon_config_load(d.options.config_path, &d.config, &err) != EM_OK) {
        fprintf(stderr, "emberd: %s\n", err.message);
        return EXIT_USAGE;
    }
    if (d.options.check_only) {
        code = check_config(&d);
        goto cleanup;
    }
    em_log_init(&d.log, (em_log_level)d.config.log_level, STDERR_FILENO);
    em_log_notice(&d.log, "emberd %s starting with %s", EM_VERSION, d.options.config_path);
    if (start(&d, &err) != EM_OK) {
        em_log_error(&d.log, "cannot start: %s", err.message);
        em_notify("STATUS=failed: %s", err.message);
        code = EXIT_RUNTIME;
        stop(&d);
        goto cleanup;
    }
    atomic_store(&d.context.state, EM_SERVER_SERVING);
    start_watchdog(&d);
    em_log_notice(&d.log, "serving: data %s, admin %s, %u worker thread(s), %zu table(s)",
                  em_server_data_address(d.server), em_server_admin_address(d.server),
                  em_executor_threads(d.executor), em_catalog_count(d.catalog));
    em_notify("READY=1\nSTATUS=serving on %s (admin %s)", em_server_data_address(d.server),
              em_server_admin_address(d.server));
    uv_run(&d.loop, UV_RUN_DEFAULT);
    code = EXIT_OK;
cleanup:
    if (d.loop_ready) {
        uv_run(&d.loop, UV_RUN_DEFAULT); /* let closing handles finish */
        uv_loop_close(&d.loop);
    }
    em_catalog_destroy(d.catalog);
    em_backend_destroy(d.backend);
    em_daemon_config_deinit(&d.config);
    return code;
}
