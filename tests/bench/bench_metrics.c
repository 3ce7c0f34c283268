/*
 * What recording metrics costs: pull throughput of daemons in this process, one with a
 * metrics listener and request_histograms on (every answer recorded by status and
 * duration, the default) and two with neither (the second a control: how much two alike
 * daemons differ), measured in turn, round after round, on the same workload; then what
 * a scrape costs.
 *
 *   bench_metrics [--seconds S] [--rounds R] [--connections C]
 *
 * Each connection is a thread pulling 26 keys of a dim-64 table one request at a time,
 * so the fixed cost of a request, where recording happens, weighs the most.
 */
#include <arpa/inet.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "clients/ember_client.h"
#include "tests/support/test_daemon.h"
#include "tests/support/test_support.h"

#define KEYS 26u
#define DIM 64u
#define TABLE_KEYS 100000u

typedef struct options {
    double seconds;
    int rounds;
    int connections;
} options;

typedef struct worker {
    const char *address;
    double seconds;
    uint64_t seed, pulls;
} worker;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static em_client *connect_to(const char *address)
{
    em_client_options o;
    em_client_options_init(&o);
    o.servers = address;
    o.timeout_ms = 30000;
    em_client *client = NULL;
    em_error err;
    if (em_client_create(&o, &client, &err) != EM_OK) {
        fprintf(stderr, "connect %s: %s\n", address, err.message);
        exit(1);
    }
    return client;
}

static void *pull_loop(void *argument)
{
    worker *w = argument;
    em_client *client = connect_to(w->address);
    uint32_t offsets[KEYS + 1];
    uint64_t keys[KEYS];
    float out[KEYS * DIM];
    for (uint32_t i = 0; i <= KEYS; i++)
        offsets[i] = i;
    uint64_t state = w->seed;
    double end = now() + w->seconds;
    em_error err;
    while (now() < end) {
        for (uint32_t i = 0; i < KEYS; i++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            keys[i] = (state >> 33) % TABLE_KEYS;
        }
        em_client_pull_args args = {.table = "t",
                                    .batch = {.rows = KEYS, .nnz = KEYS, .offsets = offsets,
                                              .keys = keys},
                                    .combiner = EM_COMBINER_NONE,
                                    .create_missing = true,
                                    .out = out,
                                    .out_capacity = KEYS * DIM};
        if (em_client_pull(client, &args, NULL, &err) != EM_OK) {
            fprintf(stderr, "pull: %s\n", err.message);
            exit(1);
        }
        w->pulls++;
    }
    em_client_destroy(client);
    return NULL;
}

/* Pulls per second over all connections. */
static double measure(const char *address, const options *opt, uint64_t seed)
{
    pthread_t threads[64];
    worker workers[64];
    for (int c = 0; c < opt->connections; c++) {
        workers[c] = (worker){address, opt->seconds, seed + (uint64_t)c, 0};
        pthread_create(&threads[c], NULL, pull_loop, &workers[c]);
    }
    uint64_t pulls = 0;
    for (int c = 0; c < opt->connections; c++) {
        pthread_join(threads[c], NULL);
        pulls += workers[c].pulls;
    }
    return (double)pulls / opt->seconds;
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *values, int count)
{
    qsort(values, (size_t)count, sizeof(*values), compare_doubles);
    return count % 2 ? values[count / 2] : (values[count / 2 - 1] + values[count / 2]) / 2;
}

/* Bytes of one GET of path on a fresh connection (answer read to the close). */
static size_t http_get_bytes(const char *address, const char *path)
{
    char host[64];
    snprintf(host, sizeof(host), "%s", address);
    char *colon = strrchr(host, ':');
    *colon = '\0';
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    inet_pton(AF_INET, host, &to.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&to, sizeof(to)) != 0) {
        perror("connect");
        exit(1);
    }
    char request[128], buffer[65536];
    int length = snprintf(request, sizeof(request), "GET %s HTTP/1.1\r\nHost: x\r\n\r\n", path);
    if (write(fd, request, (size_t)length) != length) {
        perror("write");
        exit(1);
    }
    size_t total = 0;
    ssize_t n;
    while ((n = read(fd, buffer, sizeof(buffer))) > 0)
        total += (size_t)n;
    close(fd);
    return total;
}

/* Seconds per GET /metrics, over n scrapes (a fresh connection each). */
static double scrape_seconds(const char *address, int n, size_t *bytes)
{
    size_t total = 0;
    double start = now();
    for (int i = 0; i < n; i++)
        total += http_get_bytes(address, "/metrics");
    *bytes = total / (size_t)n;
    return (now() - start) / n;
}

static void parse(int argc, char **argv, options *opt)
{
    *opt = (options){.seconds = 1.0, .rounds = 7, .connections = 1};
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && strcmp(argv[i], "--seconds") == 0)
            opt->seconds = strtod(argv[++i], NULL);
        else if (i + 1 < argc && strcmp(argv[i], "--rounds") == 0)
            opt->rounds = atoi(argv[++i]);
        else if (i + 1 < argc && strcmp(argv[i], "--connections") == 0)
            opt->connections = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_metrics [--seconds S] [--rounds R] "
                            "[--connections C]\n");
            exit(2);
        }
    }
    if (opt->connections < 1 || opt->connections > 64 || opt->rounds < 1 || opt->rounds > 99)
        exit(2);
}

int main(int argc, char **argv)
{
    options opt;
    parse(argc, argv, &opt);
    static const char *tables = "[{\"name\": \"t\", \"dim\": 64, \"capacity\": 200000}]";
    em_test_daemon_options off = {.tables_json = tables, .no_request_histograms = true};
    em_test_daemon_options on = {.tables_json = tables, .metrics = true};
    /* a second daemon recording nothing is the control: what two alike daemons differ by */
    em_test_daemon *daemons[3] = {em_test_daemon_start(&off), em_test_daemon_start(&off),
                                  em_test_daemon_start(&on)};
    em_test_print_machine(NULL);
    printf("command: bench_metrics --seconds %g --rounds %d --connections %d\n", opt.seconds,
           opt.rounds, opt.connections);
    printf("three daemons in this process (CPU backend): two recording nothing (off, "
           "control: request_histograms false, no metrics listener), one recording every "
           "answer with a metrics listener (on); pulls of %u keys (dim %u), one request at a time per "
           "connection, the three in turn, the order rotating each round\n\n", KEYS, DIM);
    printf("%5s %14s %14s %14s %9s %9s\n", "round", "off pulls/s", "control", "on pulls/s",
           "ctrl/off", "on/off");
    double off_rates[99], control_rates[99], on_rates[99], control_ratios[99], on_ratios[99];
    for (int r = 0; r < opt.rounds; r++) {
        double rate[3];
        for (int k = 0; k < 3; k++) {
            int which = (r + k) % 3;
            rate[which] = measure(em_test_daemon_address(daemons[which]), &opt, 17u + (uint64_t)r);
        }
        off_rates[r] = rate[0];
        control_rates[r] = rate[1];
        on_rates[r] = rate[2];
        control_ratios[r] = rate[1] / rate[0];
        on_ratios[r] = rate[2] / rate[0];
        printf("%5d %14.0f %14.0f %14.0f %8.3fx %8.3fx\n", r + 1, rate[0], rate[1], rate[2],
               control_ratios[r], on_ratios[r]);
    }
    printf("%5s %14.0f %14.0f %14.0f %8.3fx %8.3fx (medians; ratios: median of the rounds')\n",
           "median", median(off_rates, opt.rounds), median(control_rates, opt.rounds),
           median(on_rates, opt.rounds), median(control_ratios, opt.rounds),
           median(on_ratios, opt.rounds));
    size_t bytes = 0;
    double seconds = scrape_seconds(em_test_daemon_metrics_address(daemons[2]), 200, &bytes);
    printf("\nscrape: %.1f us per GET /metrics (%zu bytes, 1 table), 200 scrapes\n",
           seconds * 1e6, bytes);
    for (int d = 0; d < 3; d++)
        em_test_daemon_stop(daemons[d]);
    return 0;
}
