/*
 * Table throughput on the CPU backend: pull (gather, combiner none and sum) and push
 * (each optimizer) in keys per second, for dim 16, 64 and 128, batches of 4096 keys
 * drawn uniformly from a pre-populated key set, with 1 and 2 threads issuing requests
 * against the same table.
 *
 *   bench_table [--keys N] [--seconds S] [--shards N] [--operations all|push]
 *               [--optimizer NAME] [--dim D] [--threads T] [--batches B] [--gradient G]
 *               [--new-keys F] [--batch-keys K]
 *
 * --optimizer and --dim keep one optimizer or dim, --threads the runs with at most T
 * threads, and --batches B makes each thread issue exactly B requests instead of
 * running for S seconds (fixed work, for instruction counts: tests/bench/row_check_cost.py).
 * Pushed gradient elements are G x 0, 1, ..., 12 (G 0.001 by default). --new-keys F makes
 * that fraction of every batch's keys new ones, never requested before (the requests
 * create them; the table's capacity is then unbounded in practice). --batch-keys K
 * makes each request K keys (a multiple of 8) instead of 4096: small requests show what
 * a request costs beyond its keys, and how requests on two threads get in each
 * other's way.
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/device/backend.h"
#include "lib/table/table.h"
#include "tests/support/test_support.h"

/* Keys per request (--batch-keys), 8 a row for the pooled pulls. */
static uint32_t batch_keys = 4096;
static uint32_t batch_rows = 512;

typedef struct options {
    uint64_t keys;
    double seconds;
    uint32_t shards;
    bool pushes_only;   /* --operations push: only the push rows */
    int optimizer;      /* --optimizer: only this one (-1: all) */
    uint32_t dim;       /* --dim: only this one (0: all) */
    int threads;        /* --threads: at most this many */
    uint64_t batches;   /* --batches: requests per thread (0: run for seconds) */
    float gradient;     /* --gradient: the pushed gradients' scale */
    double new_keys;    /* --new-keys: fraction of each batch's keys never seen before */
} options;

typedef enum operation { PULL_NONE, PULL_SUM, PUSH } operation;

typedef struct worker {
    em_table *table;
    operation op;
    uint32_t dim;
    uint64_t universe;
    uint64_t seed;
    double seconds;
    uint64_t batches;
    float gradient;
    uint32_t new_keys;  /* of each batch: keys never requested before */
    uint64_t fresh;     /* the next of this worker's own new keys */
    uint64_t keys_done;
    int failed;
    pthread_barrier_t *start;
} worker;

/* Key i of the populated set is i x an odd constant, so distinct i give distinct keys;
 * worker w's new keys are those of i = 2^40 (w + 1), 2^40 (w + 1) + 1, ... */
static void fill_batch(em_test_rng *rng, worker *w, uint64_t *keys, uint32_t *offsets)
{
    for (uint32_t i = 0; i < batch_keys; i++) {
        uint64_t index = i < w->new_keys ? w->fresh++
                                                   : em_test_rng_below(rng, w->universe);
        keys[i] = index * 0x9e3779b97f4a7c15ull;
    }
    for (uint32_t r = 0; r <= batch_rows; r++)
        offsets[r] = r * (batch_keys / batch_rows);
}

static void *run_worker(void *argument)
{
    worker *w = argument;
    em_test_rng rng;
    em_test_rng_init(&rng, w->seed);
    uint64_t *keys = malloc(batch_keys * sizeof(uint64_t));
    uint32_t *offsets = malloc((batch_rows + 1) * sizeof(uint32_t));
    uint32_t *identity = malloc((batch_keys + 1) * sizeof(uint32_t)); /* a key a row: pushes */
    for (uint32_t i = 0; i <= batch_keys; i++)
        identity[i] = i;
    float *buffer = malloc((size_t)batch_keys * w->dim * sizeof(float));
    for (size_t i = 0; i < (size_t)batch_keys * w->dim; i++)
        buffer[i] = w->gradient * (float)(i % 13);
    em_error err;
    pthread_barrier_wait(w->start);
    double end = em_test_now() + w->seconds;
    uint64_t issued = 0;
    while (w->batches > 0 ? issued < w->batches : em_test_now() < end) {
        for (int repeat = 0; repeat < 8 && (w->batches == 0 || issued < w->batches);
             repeat++, issued++) {
            fill_batch(&rng, w, keys, offsets);
            em_status status;
            if (w->op == PUSH) {
                em_csr csr = {batch_keys, batch_keys, identity, keys};
                em_push_request request = {csr, EM_COMBINER_NONE, buffer,
                                           (uint64_t)batch_keys * w->dim};
                em_push_result result;
                status = em_table_push(w->table, &request, &result, &err);
            } else {
                em_csr csr = {batch_rows, batch_keys, offsets, keys};
                em_combiner combiner = w->op == PULL_SUM ? EM_COMBINER_SUM : EM_COMBINER_NONE;
                em_pull_request request = {csr, combiner, true, buffer,
                                           (uint64_t)batch_keys * w->dim};
                em_pull_result result;
                status = em_table_pull(w->table, &request, &result, &err);
            }
            if (status != EM_OK) {
                fprintf(stderr, "request failed: %s\n", err.message);
                w->failed = 1;
                break;
            }
            w->keys_done += batch_keys;
        }
        if (w->failed)
            break;
    }
    free(buffer);
    free(keys);
    free(offsets);
    free(identity);
    return NULL;
}

static em_table *populated_table(em_backend *backend, uint32_t dim, int optimizer,
                                 const options *opt)
{
    em_table_config config;
    em_table_config_init(&config, "bench", dim,
                         opt->new_keys > 0 ? EM_TABLE_CAPACITY_MAX : opt->keys * 2);
    config.shards = opt->shards;
    config.optimizer.kind = optimizer;
    config.optimizer.learning_rate = 0.01f;
    config.optimizer.eps = optimizer == EM_OPTIMIZER_ADAM ? 1e-8f : 1e-10f;
    config.optimizer.beta1 = 0.9f;
    config.optimizer.beta2 = 0.999f;
    em_table *table = NULL;
    em_error err;
    if (em_table_create(backend, &config, &table, &err) != EM_OK) {
        fprintf(stderr, "create: %s\n", err.message);
        exit(1);
    }
    /* Create every key of the universe once, in batches. */
    uint64_t *keys = malloc(batch_keys * sizeof(uint64_t));
    uint32_t *offsets = malloc((batch_keys + 1) * sizeof(uint32_t));
    float *out = malloc((size_t)batch_keys * dim * sizeof(float));
    for (uint32_t i = 0; i <= batch_keys; i++)
        offsets[i] = i;
    for (uint64_t start = 0; start < opt->keys; start += batch_keys) {
        uint32_t n = (uint32_t)(opt->keys - start < batch_keys ? opt->keys - start : batch_keys);
        for (uint32_t i = 0; i < n; i++)
            keys[i] = (start + i) * 0x9e3779b97f4a7c15ull;
        em_pull_request request = {{n, n, offsets, keys}, EM_COMBINER_NONE, true, out,
                                   (uint64_t)n * dim};
        em_pull_result result;
        if (em_table_pull(table, &request, &result, &err) != EM_OK) {
            fprintf(stderr, "populate: %s\n", err.message);
            exit(1);
        }
    }
    free(keys);
    free(offsets);
    free(out);
    return table;
}

static double measure(em_table *table, operation op, uint32_t dim, int threads,
                      const options *opt)
{
    static uint64_t next_run; /* each run's new keys are new to the table too */
    pthread_t handles[2];
    worker workers[2];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)threads);
    for (int t = 0; t < threads; t++) {
        workers[t] = (worker){.table = table,
                              .op = op,
                              .dim = dim,
                              .universe = opt->keys,
                              .seed = 1000 + (uint64_t)t,
                              .seconds = opt->seconds,
                              .batches = opt->batches,
                              .gradient = opt->gradient,
                              .new_keys = (uint32_t)(opt->new_keys * batch_keys + 0.5),
                              .fresh = (UINT64_C(1) << 40) * (uint64_t)(t + 1) +
                                       (UINT64_C(1) << 32) * next_run++,
                              .start = &start};
        pthread_create(&handles[t], NULL, run_worker, &workers[t]);
    }
    double begin = em_test_now();
    uint64_t total = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(handles[t], NULL);
        if (workers[t].failed)
            exit(1);
        total += workers[t].keys_done;
    }
    double elapsed = em_test_now() - begin;
    pthread_barrier_destroy(&start);
    return (double)total / elapsed;
}


#define TABLE_USAGE                                                                         \
    "usage: bench_table [--keys N] [--seconds S] [--shards N] [--operations all|push]"      \
    " [--optimizer NAME] [--dim D] [--threads T] [--batches B] [--gradient G]"              \
    " [--new-keys F] [--batch-keys K]\n"

int main(int argc, char **argv)
{
    options opt = {.keys = 1000000,
                   .seconds = 2.0,
                   .shards = 8,
                   .optimizer = -1,
                   .threads = 2,
                   .gradient = 1e-3f};
    static const char *const optimizer_names[] = {"sgd", "adagrad", "rowwise_adagrad", "adam"};
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc) {
            fprintf(stderr, "bench_table: %s: no value\n" TABLE_USAGE, argv[i]);
            return 2;
        }
        if (strcmp(argv[i], "--keys") == 0)
            opt.keys = em_test_parse_count("bench_table", "--keys", argv[i + 1], UINT64_MAX);
        else if (strcmp(argv[i], "--seconds") == 0) {
            char *end = NULL;
            opt.seconds = strtod(argv[i + 1], &end);
            if (end == argv[i + 1] || *end != '\0' ||
                !(opt.seconds > 0 && isfinite(opt.seconds))) {
                fprintf(stderr,
                        "bench_table: --seconds '%s': expected a finite number above 0\n",
                        argv[i + 1]);
                return 2;
            }
        } else if (strcmp(argv[i], "--shards") == 0)
            opt.shards = (uint32_t)em_test_parse_count("bench_table", "--shards", argv[i + 1],
                                                       1024);
        else if (strcmp(argv[i], "--operations") == 0) {
            opt.pushes_only = strcmp(argv[i + 1], "push") == 0;
            if (!opt.pushes_only && strcmp(argv[i + 1], "all") != 0) {
                fprintf(stderr, "bench_table: --operations '%s': expected all or push\n",
                        argv[i + 1]);
                return 2;
            }
        } else if (strcmp(argv[i], "--dim") == 0) {
            opt.dim = (uint32_t)em_test_parse_count("bench_table", "--dim", argv[i + 1], 128);
            if (opt.dim != 16 && opt.dim != 64 && opt.dim != 128) { /* the dims it runs */
                fprintf(stderr, "bench_table: --dim '%s': expected 16, 64 or 128\n",
                        argv[i + 1]);
                return 2;
            }
        } else if (strcmp(argv[i], "--threads") == 0)
            opt.threads = em_test_parse_count("bench_table", "--threads", argv[i + 1],
                                              UINT32_MAX) == 1
                              ? 1
                              : 2;
        else if (strcmp(argv[i], "--batches") == 0)
            opt.batches = em_test_parse_count("bench_table", "--batches", argv[i + 1],
                                              UINT64_MAX);
        else if (strcmp(argv[i], "--batch-keys") == 0) {
            unsigned long keys = strtoul(argv[i + 1], NULL, 10);
            if (keys < 8 || keys > 65536 || keys % 8 != 0) {
                fprintf(stderr, "bench_table: --batch-keys '%s' is not a multiple of 8 from 8 "
                        "to 65536\n", argv[i + 1]);
                return 2;
            }
            batch_keys = (uint32_t)keys;
            batch_rows = batch_keys / 8;
        }
        else if (strcmp(argv[i], "--gradient") == 0) {
            char *end = NULL;
            opt.gradient = strtof(argv[i + 1], &end);
            if (end == argv[i + 1] || *end != '\0' || !isfinite(opt.gradient)) {
                fprintf(stderr, "bench_table: --gradient '%s': expected a finite number\n",
                        argv[i + 1]);
                return 2;
            }
        }
        else if (strcmp(argv[i], "--new-keys") == 0) {
            opt.new_keys = strtod(argv[i + 1], NULL);
            if (!(opt.new_keys >= 0 && opt.new_keys <= 1)) {
                fprintf(stderr, "bench_table: --new-keys '%s' is not a fraction in [0, 1]\n",
                        argv[i + 1]);
                return 2;
            }
        }
        else if (strcmp(argv[i], "--optimizer") == 0) {
            for (int o = 0; o < 4; o++)
                if (strcmp(argv[i + 1], optimizer_names[o]) == 0)
                    opt.optimizer = o;
            if (opt.optimizer < 0) {
                fprintf(stderr, "bench_table: unknown optimizer '%s'\n", argv[i + 1]);
                return 2;
            }
        } else {
            fprintf(stderr, "bench_table: unknown option '%s'\n" TABLE_USAGE, argv[i]);
            return 2;
        }
    }
    em_test_print_machine(NULL);
    printf("command: bench_table --keys %" PRIu64 " --seconds %g --shards %u --operations %s "
           "--optimizer %s --dim %u --threads %d --batches %" PRIu64 " --batch-keys %u "
           "--gradient %g --new-keys %g\n",
           opt.keys, opt.seconds, opt.shards, opt.pushes_only ? "push" : "all",
           opt.optimizer < 0 ? "all" : optimizer_names[opt.optimizer], opt.dim, opt.threads,
           opt.batches, batch_keys, (double)opt.gradient, opt.new_keys);
    printf("CPU backend, 1 device; batches of %u keys drawn uniformly from %" PRIu64
           " existing keys", batch_keys, opt.keys);
    if (opt.new_keys > 0)
        printf(", %u of them new keys instead",
               (uint32_t)(opt.new_keys * batch_keys + 0.5));
    printf("; each thread issues its own requests on one table\n\n");
    printf("%-10s %-16s %5s %8s %14s %10s\n", "operation", "optimizer", "dim", "threads",
           "keys/s", "GB/s");
    static const uint32_t dims[] = {16, 64, 128};
    em_cpu_backend_options backend_options;
    em_cpu_backend_options_init(&backend_options);
    for (size_t d = 0; d < 3; d++) {
        if (opt.dim != 0 && dims[d] != opt.dim)
            continue;
        for (int optimizer = 0; optimizer < 4; optimizer++) {
            if (opt.optimizer >= 0 && optimizer != opt.optimizer)
                continue;
            em_backend *backend = NULL;
            em_error err;
            if (em_backend_create_cpu(&backend_options, &backend, &err) != EM_OK) {
                fprintf(stderr, "%s\n", err.message);
                return 1;
            }
            em_table *table = populated_table(backend, dims[d], optimizer, &opt);
            for (int op = optimizer == 0 && !opt.pushes_only ? PULL_NONE : PUSH; op <= PUSH;
                 op++) {
                for (int threads = 1; threads <= opt.threads; threads++) {
                    double rate = measure(table, (operation)op, dims[d], threads, &opt);
                    const char *name = op == PULL_NONE ? "pull" : op == PULL_SUM ? "pull-sum"
                                                                                 : "push";
                    /* bytes of vectors moved: one per key (pull none, push) or per row */
                    double vectors = op == PULL_SUM ? rate / (batch_keys / batch_rows) : rate;
                    printf("%-10s %-16s %5u %8d %14.0f %10.2f\n", name,
                           op == PUSH ? optimizer_names[optimizer] : "-", dims[d], threads, rate,
                           vectors * dims[d] * sizeof(float) / 1e9);
                    fflush(stdout);
                }
            }
            em_table_destroy(table);
            em_backend_destroy(backend);
        }
    }
    return 0;
}
