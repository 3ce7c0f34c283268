/*
 * DESIGN: emberd's entry point: arguments, signals and systemd around the daemon
 * library (daemon/daemon.h).
 *
 * main() reads the arguments and the configuration, creates the daemon, writes the
 * listen file, and runs it until it has drained. Signal handlers only hand the signal
 * to the daemon (em_daemon_stop / em_daemon_reload set a flag and wake its loop, both
 * async-signal-safe): SIGTERM or SIGINT starts a drain (stop accepting, answer what was
 * received, exit 0), a second SIGINT exits at once, SIGHUP reloads what may change at
 * runtime. systemd notifications go through the daemon's notify hook.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <malloc.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/daemon.h"
#include "daemon/daemon_config.h"
#include "daemon/notify.h"
#include "ember_config.h"
#include "lib/device/backend.h"

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
    EXIT_NO_GPU = 3,  /* --list-devices: no GPU is visible */
    EXIT_INTERRUPTED = 130,
};

#define DEFAULT_CONFIG_PATH "/etc/ember/emberd.json"

typedef struct daemon_options {
    const char *config_path;
    const char *listen_file;
    bool check_only;
    bool print_config;
} daemon_options;

static int list_devices(void);

/* ---- arguments ----------------------------------------------------------------------- */

static void print_usage(FILE *out)
{
    fprintf(out,
            "usage: emberd [--config FILE] [--check-config | --print-config] [--listen-file FILE]\n"
            "\n"
            "Serves sharded embedding tables over the ember protocol.\n"
            "\n"
            "  -c, --config FILE       configuration (default " DEFAULT_CONFIG_PATH ")\n"
            "      --check-config      validate the configuration and exit\n"
            "      --print-config      print the configuration in force (defaults filled in,\n"
            "                          inline tokens redacted) as JSON and exit\n"
            "      --listen-file FILE  once serving, write the bound addresses there as JSON\n"
            "      --list-devices      say which GPUs the cuda backend can use (exit 3: no GPU\n"
            "                          visible; 1: GPUs there but unusable, with the reason)\n"
            "  -h, --help              show this help\n"
            "  -V, --version           show the version\n"
            "\n"
            "Signals: SIGTERM/SIGINT drain and exit 0 (a second SIGINT exits at once),\n"
            "SIGHUP reloads log_level, limits, tokens and drain_timeout_ms.\n"
            "Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error, 3 no GPU\n"
            "visible (--list-devices).\n");
}

static int parse_arguments(int argc, char **argv, daemon_options *out)
{
    static const struct option long_options[] = {
        {"config", required_argument, NULL, 'c'},
        {"check-config", no_argument, NULL, 'k'},
        {"print-config", no_argument, NULL, 'P'},
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
        case 'P':
            out->print_config = true;
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
    em_status status = em_cuda_available(&gpus, &err);
    if (status == EM_NOT_FOUND) {
        printf("cuda: %s\n", err.message);
        return EXIT_NO_GPU;
    }
    if (status != EM_OK) {
        printf("cuda: no usable GPU: %s\n", err.message);
        return EXIT_RUNTIME;
    }
    printf("cuda: %u usable GPU(s)\n", gpus);
    return EXIT_OK;
#else
    printf("cuda: this emberd was built without the CUDA backend\n");
    return EXIT_RUNTIME;
#endif
}

/* ---- signals ------------------------------------------------------------------------- */

/* The daemon the signal handlers talk to; set before they are installed. */
static em_daemon *signalled_daemon;
static atomic_int interrupts;

static void on_signal(int signal_number)
{
    if (signal_number == SIGHUP) {
        em_daemon_reload(signalled_daemon);
        return;
    }
    if (signal_number == SIGINT && atomic_fetch_add(&interrupts, 1) >= 1) {
        static const char message[] = "emberd: second SIGINT: exiting now\n";
        ssize_t ignored = write(STDERR_FILENO, message, sizeof(message) - 1);
        (void)ignored;
        _exit(EXIT_INTERRUPTED);
    }
    em_daemon_stop(signalled_daemon, signal_number == SIGINT ? "SIGINT" : "SIGTERM");
}

static int watch_signals(em_daemon *daemon)
{
    static const int numbers[] = {SIGTERM, SIGINT, SIGHUP};
    signalled_daemon = daemon;
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_handler = on_signal;
    action.sa_flags = SA_RESTART;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < sizeof(numbers) / sizeof(numbers[0]); i++) {
        if (sigaction(numbers[i], &action, NULL) != 0) {
            fprintf(stderr, "emberd: cannot watch signal %d: %s\n", numbers[i], strerror(errno));
            return -1;
        }
    }
    return 0;
}

/* ---- systemd ------------------------------------------------------------------------- */

static void notify_systemd(void *context, const char *state)
{
    (void)context;
    em_notify("%s", state);
}

/* ---- listen file --------------------------------------------------------------------- */

static em_status write_listen_file(const char *path, const em_daemon *daemon, em_error *err)
{
    if (path == NULL)
        return EM_OK;
    char temporary[4096];
    snprintf(temporary, sizeof(temporary), "%s.tmp", path);
    FILE *file = fopen(temporary, "w");
    if (file == NULL)
        return em_error_set(err, EM_UNAVAILABLE, "cannot write listen file '%s': %s", temporary,
                            strerror(errno));
    fprintf(file, "{\"data\": \"%s\", \"admin\": \"%s\", \"metrics\": \"%s\", \"pid\": %ld}\n",
            em_daemon_data_address(daemon), em_daemon_admin_address(daemon),
            em_daemon_metrics_address(daemon), (long)getpid());
    if (fclose(file) != 0 || rename(temporary, path) != 0)
        return em_error_set(err, EM_UNAVAILABLE, "cannot write listen file '%s': %s", path,
                            strerror(errno));
    return EM_OK;
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

static int check_config(const daemon_options *options, const em_daemon_config *config)
{
    printf("%s: configuration OK: %u table(s), data %s, admin %s, backend %s\n",
           options->config_path, config->tables.count, config->listen.data, config->listen.admin,
           em_backend_type_name(config->backend.type));
    return EXIT_OK;
}

/* The configuration in force, as JSON that parses to the same configuration. */
static int print_config(const em_daemon_config *config)
{
    cJSON *json = em_config_to_json(&em_daemon_config_schema, config);
    char *text = json != NULL ? cJSON_Print(json) : NULL;
    cJSON_Delete(json);
    if (text == NULL) {
        fprintf(stderr, "emberd: out of memory printing the configuration\n");
        return EXIT_RUNTIME;
    }
    printf("%s\n", text);
    cJSON_free(text);
    return EXIT_OK;
}

/* Creates the daemon, runs it until it has drained; the exit code. */
static int serve(const daemon_options *options, const em_daemon_config *config)
{
    em_daemon_options setup;
    em_daemon_options_init(&setup);
    setup.config_path = options->config_path;
    setup.notify = notify_systemd;
    setup.watchdog_usec = em_notify_watchdog_usec();
    em_daemon *daemon = NULL;
    em_error err;
    em_status status = em_daemon_create(config, &setup, &daemon, &err);
    if (status != EM_OK) { /* em_daemon_create logs its own errors */
        em_notify("STATUS=failed: %s", err.message);
        return EXIT_RUNTIME;
    }
    /* Signals are watched before the listen file says where emberd serves: whoever
     * waits for that file may signal at once (a SIGHUP then must reload, not kill). */
    if (watch_signals(daemon) != 0) {
        em_daemon_destroy(daemon);
        return EXIT_RUNTIME;
    }
    status = write_listen_file(options->listen_file, daemon, &err);
    if (status != EM_OK) {
        fprintf(stderr, "emberd: %s\n", err.message);
        em_notify("STATUS=failed: %s", err.message);
        signal(SIGTERM, SIG_DFL); /* the handlers' daemon goes next */
        signal(SIGINT, SIG_DFL);
        signal(SIGHUP, SIG_IGN);
        em_daemon_destroy(daemon);
        return EXIT_RUNTIME;
    }
    em_daemon_run(daemon);
    /* Drained: a signal finds no loop to wake any more. Another SIGTERM is ignored, as the
     * process is on its way out (a kill during the shutdown save would only lose that
     * save); SIGINT ends it at once. */
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_DFL);
    signal(SIGHUP, SIG_IGN);
    bool gpu_failed = em_daemon_gpu_failed(daemon);
    em_daemon_save_at_shutdown(daemon);
    em_daemon_destroy(daemon);
    return gpu_failed ? EXIT_RUNTIME : EXIT_OK;
}

int main(int argc, char **argv)
{
    daemon_options options;
    int code = parse_arguments(argc, argv, &options);
    if (code != EXIT_OK)
        return code;
    signal(SIGPIPE, SIG_IGN); /* a peer that left is an error from write(), not a signal */
    tune_allocator();
    em_daemon_config config;
    em_error err;
    if (em_daemon_config_load(options.config_path, &config, &err) != EM_OK) {
        fprintf(stderr, "emberd: %s\n", err.message);
        return EXIT_USAGE;
    }
    if (options.print_config)
        code = print_config(&config);
    else if (options.check_only)
        code = check_config(&options, &config);
    else
        code = serve(&options, &config);
    em_daemon_config_deinit(&config);
    return code;
}
