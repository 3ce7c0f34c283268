/*
 * Checkpoint throughput and the cost of a save to serving, on the CPU backend, or with
 * --backend cuda on the first GPU (the rows in GPU memory: a save copies them out and a
 * load in, through the lane's pinned staging):
 *
 *   1. save and load GB/s of a table (Adam state) against dd writing the same bytes with
 *      conv=fdatasync and reading them back, on the same disk in the same run (the page
 *      cache is dropped before each read when /proc/sys/vm/drop_caches is writable),
 *      with the CPU time the first load spent in the kernel (first touches of fresh
 *      memory), loads into the pool memory the first one touched (no fresh pages),
 *      --pairs times, each beside dd reading the same rows.emb (before it, then after
 *      it, in turn; the ratio of each pair, their median, and the median load against
 *      the fastest dd read of the run), and loads with the file in the page cache (the
 *      load's own work: best of three); then --pairs saves, full and keeping the row
 *      digests deltas need, each pair beside dd copying the bytes a save wrote (its
 *      rows.emb, in the page cache) directly and with conv=fdatasync: ratios, and the
 *      median saves against the fastest dd copy of the run;
 *   2. a delta after pushes to 1% of the rows: its bytes against the full checkpoint's
 *      (target at most 1.5%), and the time of a full save that keeps the row digests
 *      deltas need against one that does not;
 *   3. latency of 26-key pulls from `clients` threads while idle and while a save runs
 *      (in-process threads, no network), p50 / p99 / max.
 *
 *   bench_checkpoint [--rows N] [--dim D] [--dir PATH] [--clients C] [--seconds S]
 *                    [--backend cpu|cuda] [--pairs P (1 to 9, 5 by default)]
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ember_config.h"
#include "lib/checkpoint/checkpoint.h"
#include "lib/device/backend.h"
#include "lib/table/table.h"
#include "tests/bench/sampler.h"
#include "tests/support/test_support.h"

#define PULL_KEYS 26

/* Most loads into touched memory, each beside a dd read (--pairs). */
#define MAX_PAIRS 9

typedef struct options {
    uint64_t rows;
    uint32_t dim;
    const char *dir;
    int clients;
    double seconds;
    const char *backend; /* "cpu" or "cuda" */
    int pairs;           /* loads into touched memory, each beside a dd read (1 to 9) */
} options;

static uint64_t key_of(uint64_t i)
{
    return i * 0x9e3779b97f4a7c15ull + 1;
}

static em_table *populated_table(em_backend *backend, const options *opt)
{
    em_table_config config;
    em_table_config_init(&config, "bench", opt->dim, opt->rows + 1024);
    config.shards = 8;
    config.optimizer.kind = EM_OPTIMIZER_ADAM;
    config.optimizer.learning_rate = 0.01f;
    config.optimizer.eps = 1e-8f;
    config.optimizer.beta1 = 0.9f;
    config.optimizer.beta2 = 0.999f;
    em_table *table = NULL;
    em_error err;
    if (em_table_create(backend, &config, &table, &err) != EM_OK) {
        fprintf(stderr, "create: %s\n", err.message);
        exit(1);
    }
    enum { BATCH = 65536 };
    uint64_t *keys = malloc(BATCH * sizeof(uint64_t));
    uint32_t *offsets = malloc((BATCH + 1) * sizeof(uint32_t));
    float *g = malloc((size_t)BATCH * opt->dim * sizeof(float));
    for (uint32_t i = 0; i <= BATCH; i++)
        offsets[i] = i;
    for (size_t i = 0; i < (size_t)BATCH * opt->dim; i++)
        g[i] = 1e-3f * (float)(i % 17) - 0.008f;
    for (uint64_t start = 0; start < opt->rows; start += BATCH) {
        uint32_t n = (uint32_t)(opt->rows - start < BATCH ? opt->rows - start : BATCH);
        for (uint32_t i = 0; i < n; i++)
            keys[i] = key_of(start + i);
        em_push_request request = {{n, n, offsets, keys}, EM_COMBINER_NONE, g,
                                   (uint64_t)n * opt->dim};
        em_push_result result;
        if (em_table_push(table, &request, &result, &err) != EM_OK) {
            fprintf(stderr, "populate: %s\n", err.message);
            exit(1);
        }
    }
    free(keys);
    free(offsets);
    free(g);
    return table;
}

static bool drop_caches(void)
{
    sync();
    FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
    if (f == NULL)
        return false;
    bool ok = fputs("3\n", f) >= 0;
    return fclose(f) == 0 && ok;
}

/* Seconds dd takes to read path (page cache dropped before), as a load reads it: each
 * page let go once read (iflag=nocache). */
static double dd_read_file(const char *path)
{
    char command[4600];
    snprintf(command, sizeof(command), "dd if=%s of=/dev/null bs=1M iflag=nocache status=none",
             path);
    drop_caches();
    double start = em_test_now();
    if (system(command) != 0)
        fprintf(stderr, "dd failed: %s\n", command);
    return em_test_now() - start;
}

/* dd of `bytes` (rounded to whole MiB) to a file with conv=fdatasync, then back, twice. */
static void run_dd(const char *dir, uint64_t bytes, double *write_s, double *read_s,
                   double *read_nocache_s)
{
    char command[1024];
    uint64_t mib = (bytes + (1u << 20) - 1) >> 20;
    snprintf(command, sizeof(command),
             "dd if=/dev/zero of=%s/dd.bin bs=1M count=%" PRIu64 " conv=fdatasync status=none",
             dir, mib);
    double start = em_test_now();
    if (system(command) != 0)
        fprintf(stderr, "dd failed: %s\n", command);
    *write_s = em_test_now() - start;
    drop_caches();
    snprintf(command, sizeof(command), "dd if=%s/dd.bin of=/dev/null bs=1M status=none", dir);
    start = em_test_now();
    if (system(command) != 0)
        fprintf(stderr, "dd failed: %s\n", command);
    *read_s = em_test_now() - start;
    /* and reading as a load does, letting each page go once read (iflag=nocache) */
    snprintf(command, sizeof(command), "%s/dd.bin", dir);
    *read_nocache_s = dd_read_file(command);
    unlink(command);
}

/* Reads dir/name to its end, so that its pages are in the page cache. */
static void read_into_cache(const char *dir, const char *name)
{
    char path[8192];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "%s: cannot open\n", path);
        exit(1);
    }
    static char buffer[1 << 20];
    while (fread(buffer, 1, sizeof(buffer), f) == sizeof(buffer))
        ;
    fclose(f);
}

/* The seconds dd takes to copy a checkpoint's rows.emb (read into the page cache first)
 * to a new file beside it, around the page cache in writes of 4 MiB (oflag=direct: the
 * disk's own speed for these bytes) into *direct, and through it with conv=fdatasync
 * into *buffered; the range of the times its files took to remove widens [*unlink_low,
 * *unlink_high]. Writes of zeros, as the first table's dd, can be far cheaper than writes
 * of data on a virtual disk (tests/bench/RESULTS.md), so the saves are also held against
 * the same bytes they write. */
static void dd_copies(const char *dir, const char *checkpoint, double *direct, double *buffered,
                      double *unlink_low, double *unlink_high)
{
    char command[9000], path[900];
    snprintf(path, sizeof(path), "%s/dd-copy.bin", dir);
    for (int way = 0; way < 2; way++) {
        read_into_cache(checkpoint, "rows.emb"); /* what is timed is the write */
        snprintf(command, sizeof(command), "dd if=%s/rows.emb of=%s bs=4M %s status=none",
                 checkpoint, path, way == 0 ? "oflag=direct" : "conv=fdatasync");
        sync();
        double start = em_test_now();
        if (system(command) != 0)
            fprintf(stderr, "dd failed: %s\n", command);
        *(way == 0 ? direct : buffered) = em_test_now() - start;
        start = em_test_now();
        unlink(path);
        double unlink_s = em_test_now() - start;
        *unlink_low = unlink_s < *unlink_low ? unlink_s : *unlink_low;
        *unlink_high = unlink_s > *unlink_high ? unlink_s : *unlink_high;
    }
}

/* ---- pull latency ---------------------------------------------------------------------- */

typedef struct client {
    em_table *table;
    const options *opt;
    uint64_t seed;
    _Atomic int *stop;
    double *latencies;
    uint64_t count, capacity;
} client;

static void *run_client(void *argument)
{
    client *c = argument;
    em_test_rng rng;
    em_test_rng_init(&rng, c->seed);
    uint64_t keys[PULL_KEYS];
    uint32_t offsets[] = {0, PULL_KEYS};
    float *out = malloc((size_t)c->opt->dim * sizeof(float));
    em_error err;
    while (!atomic_load(c->stop) && c->count < c->capacity) {
        for (int i = 0; i < PULL_KEYS; i++)
            keys[i] = key_of(em_test_rng_below(&rng, c->opt->rows));
        em_pull_request request = {{1, PULL_KEYS, offsets, keys}, EM_COMBINER_SUM, false, out,
                                   c->opt->dim};
        em_pull_result result;
        double start = em_test_now();
        if (em_table_pull(c->table, &request, &result, &err) != EM_OK) {
            fprintf(stderr, "pull: %s\n", err.message);
            break;
        }
        c->latencies[c->count++] = em_test_now() - start;
    }
    free(out);
    return NULL;
}

/* Keeps the last progress of a load: rows, bytes of rows.emb read, bytes it reads. */
static void record_bytes(void *context, uint64_t rows, uint64_t bytes, uint64_t total_bytes)
{
    uint64_t *heard = context;
    heard[0] = rows;
    heard[1] = bytes;
    heard[2] = total_bytes;
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct latency {
    double p50, p99, max;
    uint64_t pulls;
} latency;

typedef struct saver {
    em_table *table;
    const options *opt;
    bool delta, track;
    em_checkpoint_info info;
    int status;
    double seconds;   /* the save, to its answer */
    double removal_s; /* then the removal of the checkpoint it pruned, waited for */
} saver;

/* The range of the removals' times after the saves of the pairs. */
static double removal_low = 1e9, removal_high = 0;
/* Where the saves remove the checkpoints they prune, after they answer. */
static em_checkpoint_removals *removals;

static void *run_save(void *argument)
{
    saver *s = argument;
    em_checkpoint_options save_options;
    em_checkpoint_options_init(&save_options, s->opt->dir);
    save_options.keep = 1;
    save_options.delta = s->delta;
    save_options.track_changes = s->track;
    save_options.removals = removals;
    em_error err;
    double start = em_test_now();
    s->status = em_checkpoint_save(s->table, &save_options, &s->info, &err);
    s->seconds = em_test_now() - start;
    if (s->status != EM_OK)
        fprintf(stderr, "save: %s\n", err.message);
    /* the checkpoint before it goes after the answer (checkpoint_prune.c): its removal
     * ends before anything else is timed */
    start = em_test_now();
    em_checkpoint_removals_wait(removals);
    s->removal_s = em_test_now() - start;
    return NULL;
}

/* One push to n keys spread evenly over the table's rows; returns n. */
static uint64_t touch_rows(em_table *table, const options *opt, uint64_t n)
{
    uint64_t *keys = malloc(n * sizeof(uint64_t));
    uint32_t *offsets = malloc((n + 1) * sizeof(uint32_t));
    float *g = malloc((size_t)n * opt->dim * sizeof(float));
    uint64_t stride = opt->rows / n;
    for (uint64_t i = 0; i < n; i++) {
        keys[i] = key_of(i * stride);
        offsets[i] = (uint32_t)i;
    }
    offsets[n] = (uint32_t)n;
    for (size_t i = 0; i < (size_t)n * opt->dim; i++)
        g[i] = 1e-3f * (float)(i % 13) - 0.006f;
    em_push_request request = {{(uint32_t)n, n, offsets, keys}, EM_COMBINER_NONE, g,
                               n * opt->dim};
    em_push_result result;
    em_error err;
    if (em_table_push(table, &request, &result, &err) != EM_OK) {
        fprintf(stderr, "push: %s\n", err.message);
        exit(1);
    }
    free(keys);
    free(offsets);
    free(g);
    return n;
}

/* Pull latencies for `seconds`, or while a save runs when with_save. */
static latency measure_pulls(em_table *table, const options *opt, bool with_save, double *save_s)
{
    _Atomic int stop = 0;
    client *clients = calloc((size_t)opt->clients, sizeof(*clients));
    pthread_t *threads = calloc((size_t)opt->clients, sizeof(*threads));
    for (int i = 0; i < opt->clients; i++) {
        clients[i] = (client){.table = table, .opt = opt, .seed = 77 + (uint64_t)i,
                              .stop = &stop, .capacity = 4000000};
        clients[i].latencies = malloc(clients[i].capacity * sizeof(double));
        pthread_create(&threads[i], NULL, run_client, &clients[i]);
    }
    if (with_save) {
        saver s = {.table = table, .opt = opt};
        run_save(&s);
        *save_s = s.seconds;
    } else {
        /* the whole time, whatever signal cuts a sleep short */
        double until = em_test_now() + opt->seconds;
        for (double left = opt->seconds; left > 0; left = until - em_test_now())
            usleep((useconds_t)(left * 1e6));
    }
    atomic_store(&stop, 1);
    uint64_t total = 0;
    for (int i = 0; i < opt->clients; i++) {
        pthread_join(threads[i], NULL);
        total += clients[i].count;
    }
    double *all = malloc((total + 1) * sizeof(double));
    uint64_t at = 0;
    for (int i = 0; i < opt->clients; i++) {
        memcpy(all + at, clients[i].latencies, clients[i].count * sizeof(double));
        at += clients[i].count;
        free(clients[i].latencies);
    }
    qsort(all, total, sizeof(double), compare_doubles);
    latency l = {.pulls = total};
    if (total > 0) {
        l.p50 = all[total / 2];
        l.p99 = all[(uint64_t)((double)total * 0.99)];
        l.max = all[total - 1];
    }
    free(all);
    free(clients);
    free(threads);
    return l;
}


/* The backend --backend names; exits when it cannot be had. */
static em_backend *bench_backend(const options *opt)
{
    em_backend *backend = NULL;
    em_error err;
    em_status status;
    if (strcmp(opt->backend, "cpu") == 0) {
        em_cpu_backend_options cpu;
        em_cpu_backend_options_init(&cpu);
        status = em_backend_create_cpu(&cpu, &backend, &err);
    } else if (strcmp(opt->backend, "cuda") == 0) {
#if EM_HAVE_CUDA
        em_cuda_backend_options cuda;
        em_cuda_backend_options_init(&cuda);
        cuda.device_count = 1;
        cuda.devices[0] = 0;
        status = em_backend_create_cuda(&cuda, &backend, &err);
#else
        status = em_error_set(&err, EM_UNAVAILABLE, "this build has no CUDA backend");
#endif
    } else {
        status = em_error_set(&err, EM_INVALID_ARGUMENT,
                              "--backend %s: expected cpu or cuda", opt->backend);
    }
    if (status != EM_OK) {
        fprintf(stderr, "backend %s: %s\n", opt->backend, err.message);
        exit(1);
    }
    return backend;
}

/* CPU seconds of the whole process so far: user, and in the kernel (system). */
static void process_cpu(double *user, double *system)
{
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    *user = (double)usage.ru_utime.tv_sec + (double)usage.ru_utime.tv_usec * 1e-6;
    *system = (double)usage.ru_stime.tv_sec + (double)usage.ru_stime.tv_usec * 1e-6;
}

/* The CPU seconds of the last timed_load, its threads together: user and kernel (the
 * kernel's share is its copies out of the page cache and the first touches of fresh
 * memory, which a guest's host may make slow). */
static double last_load_user, last_load_system;

/* Seconds to load the checkpoint at path into a new table (then destroyed), sampled
 * under label (EMBER_BENCH_PROFILE); exits on a failure. */
static double timed_load(const char *path, em_backend *backend, em_checkpoint_info *info,
                         const char *label)
{
    em_table *loaded = NULL;
    em_error err;
    double user_before, system_before;
    process_cpu(&user_before, &system_before);
    bench_profile_begin(label);
    double start = em_test_now();
    if (em_checkpoint_load(path, backend, "loaded", NULL, &loaded, info, &err) != EM_OK) {
        fprintf(stderr, "load: %s\n", err.message);
        exit(1);
    }
    double seconds = em_test_now() - start;
    bench_profile_end();
    process_cpu(&last_load_user, &last_load_system);
    last_load_user -= user_before;
    last_load_system -= system_before;
    em_table_destroy(loaded);
    return seconds;
}

#define CHECKPOINT_USAGE                                                                    \
    "usage: bench_checkpoint [--rows N] [--dim D] [--dir PATH] [--clients C] [--seconds S]" \
    " [--backend cpu|cuda] [--pairs P]\n"

int main(int argc, char **argv)
{
    options opt = {.rows = 2000000, .dim = 64, .dir = "/tmp/ember-bench-checkpoint",
                   .clients = 16, .seconds = 3, .backend = "cpu", .pairs = 5};
    for (int i = 1; i < argc; i += 2) {
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(CHECKPOINT_USAGE, stdout);
            return 0;
        }
        if (value == NULL) {
            fprintf(stderr, "bench_checkpoint: %s: no value\n" CHECKPOINT_USAGE, argv[i]);
            return 2;
        }
        if (strcmp(argv[i], "--rows") == 0)
            opt.rows = em_test_parse_count("bench_checkpoint", "--rows", value, UINT64_C(1) << 40);
        else if (strcmp(argv[i], "--dim") == 0)
            opt.dim = (uint32_t)em_test_parse_count("bench_checkpoint", "--dim", value, 65536);
        else if (strcmp(argv[i], "--dir") == 0)
            opt.dir = value;
        else if (strcmp(argv[i], "--clients") == 0)
            opt.clients = (int)em_test_parse_count("bench_checkpoint", "--clients", value, 1024);
        else if (strcmp(argv[i], "--seconds") == 0) {
            char *end = NULL;
            opt.seconds = strtod(value, &end);
            if (end == value || *end != '\0' || !(opt.seconds > 0 && isfinite(opt.seconds))) {
                fprintf(stderr,
                        "bench_checkpoint: --seconds '%s': expected a finite number above 0\n",
                        value);
                return 2;
            }
        } else if (strcmp(argv[i], "--backend") == 0)
            opt.backend = value;
        else if (strcmp(argv[i], "--pairs") == 0)
            opt.pairs = (int)em_test_parse_count("bench_checkpoint", "--pairs", value, MAX_PAIRS);
        else {
            fprintf(stderr, "bench_checkpoint: unknown option '%s'\n" CHECKPOINT_USAGE, argv[i]);
            return 2;
        }
    }
    setvbuf(stdout, NULL, _IOLBF, 0); /* each line out at once: a run cut short keeps them */
    mkdir(opt.dir, 0755);
    em_test_print_machine(NULL);
    printf("command: bench_checkpoint --rows %" PRIu64 " --dim %u --dir %s --clients %d "
           "--seconds %g --backend %s --pairs %d\n", opt.rows, opt.dim, opt.dir, opt.clients,
           opt.seconds, opt.backend, opt.pairs);
    em_backend *backend = bench_backend(&opt);
    em_error err;
    if (em_checkpoint_removals_create(&removals, &err) != EM_OK) {
        fprintf(stderr, "%s\n", err.message);
        return 1;
    }
    printf("%s backend, device %s, 8 shards, adam (weights, two moments and a step per row)\n\n",
           opt.backend, backend->devices[0]->name);
    em_table *table = populated_table(backend, &opt);

    /* 1. save and load against dd */
    saver s = {.table = table, .opt = &opt};
    double start = em_test_now();
    run_save(&s);
    double save_s = s.seconds;
    if (s.status != EM_OK)
        return 1;
    bool dropped = drop_caches();
    em_table *loaded = NULL;
    em_checkpoint_info info;
    double load_s = timed_load(s.info.path, backend, &info, "first load");
    double load_user = last_load_user, load_system = last_load_system;
    /* again, into the pool memory the first load touched and gave back: what the load
     * itself costs, without the kernel providing and clearing fresh pages; in turn with
     * dd reading the same rows.emb, --pairs times, so that each load and the dd read
     * beside it meet the disk and the page cache alike (a guest's reads and first
     * touches of memory swing by several times from one minute to the next), dd first
     * in odd pairs and the load first in even ones, as what comes first after the page
     * cache is dropped may meet the coldest memory */
    const int pairs = opt.pairs;
    char rows_file[4400];
    snprintf(rows_file, sizeof(rows_file), "%s/rows.emb", s.info.path);
    double pair_dd[MAX_PAIRS], pair_load[MAX_PAIRS], pair_ratio[MAX_PAIRS];
    double pair_system[MAX_PAIRS];
    for (int k = 0; k < pairs; k++) {
        if (k % 2 == 0)
            pair_dd[k] = dd_read_file(rows_file);
        drop_caches();
        pair_load[k] = timed_load(s.info.path, backend, &info, "load from disk");
        pair_system[k] = last_load_system;
        if (k % 2 == 1)
            pair_dd[k] = dd_read_file(rows_file);
        pair_ratio[k] = pair_dd[k] / pair_load[k];
    }
    double sorted_ratio[MAX_PAIRS];
    memcpy(sorted_ratio, pair_ratio, pairs * sizeof(double));
    qsort(sorted_ratio, pairs, sizeof(double), compare_doubles);
    /* and with rows.emb in the page cache (read just before; a load lets the pages it
     * has read go): the load's own work, which the disk hides when it is slower (best
     * of three) */
    double cached_s = 0.0;
    for (int k = 0; k < 3; k++) {
        read_into_cache(s.info.path, "rows.emb");
        double seconds = timed_load(s.info.path, backend, &info, "load from the page cache");
        cached_s = k == 0 || seconds < cached_s ? seconds : cached_s;
    }
    drop_caches();
    start = em_test_now();
    if (em_checkpoint_verify(s.info.path, &info, &err) != EM_OK) {
        fprintf(stderr, "verify: %s\n", err.message);
        return 1;
    }
    double verify_s = em_test_now() - start;
    double dd_write_s = 0, dd_read_s = 0, dd_nocache_s = 0;
    run_dd(opt.dir, s.info.bytes, &dd_write_s, &dd_read_s, &dd_nocache_s);
    double gb = (double)s.info.bytes / 1e9;
    printf("checkpoint of %" PRIu64 " rows: %.3f GB (page cache %s before reads)\n",
           s.info.rows, gb, dropped ? "dropped" : "NOT dropped (not root)");
    printf("%-34s %10s %10s %12s\n", "operation", "seconds", "GB/s", "vs dd");
    printf("%-34s %10.3f %10.3f %12s\n", "dd write of zeros, conv=fdatasync", dd_write_s, gb / dd_write_s,
           "1.00");
    printf("%-34s %10.3f %10.3f %12.2f\n", "save (snapshot, write, fsyncs)", save_s, gb / save_s,
           dd_write_s / save_s);
    printf("%-34s %10.3f %10.3f %12s\n", "dd read", dd_read_s, gb / dd_read_s, "1.00");
    printf("%-34s %10.3f %10.3f %12.2f\n", "dd read, iflag=nocache", dd_nocache_s,
           gb / dd_nocache_s, dd_read_s / dd_nocache_s);
    printf("%-34s %10.3f %10.3f %12.2f   (CPU: %.2f s user, %.2f s in the kernel)\n",
           "load (read, check, new table)", load_s, gb / load_s, dd_read_s / load_s, load_user,
           load_system);
    for (int k = 0; k < pairs; k++) {
        char label[64];
        snprintf(label, sizeof(label), "dd read of rows.emb, pair %d%s", k + 1,
                 k % 2 == 0 ? "" : " (after)");
        printf("%-34s %10.3f %10.3f %12s\n", label, pair_dd[k], gb / pair_dd[k], "1.00");
        snprintf(label, sizeof(label), "load again, pair %d", k + 1);
        printf("%-34s %10.3f %10.3f %12.2f   (%.2f s in the kernel)\n", label, pair_load[k],
               gb / pair_load[k], pair_ratio[k], pair_system[k]);
    }
    double sorted_load[MAX_PAIRS];
    double fastest_dd = dd_read_s < dd_nocache_s ? dd_read_s : dd_nocache_s;
    memcpy(sorted_load, pair_load, pairs * sizeof(double));
    qsort(sorted_load, pairs, sizeof(double), compare_doubles);
    for (int k = 0; k < pairs; k++)
        fastest_dd = pair_dd[k] < fastest_dd ? pair_dd[k] : fastest_dd;
    printf("%-34s %10s %10s %12.2f\n", "load again: median of the pairs", "", "",
           sorted_ratio[pairs / 2]);
    printf("%-34s %10.3f %10.3f %12.2f   (against the fastest dd read of the run, %.3f s)\n",
           "load again: median load", sorted_load[pairs / 2], gb / sorted_load[pairs / 2],
           fastest_dd / sorted_load[pairs / 2], fastest_dd);
    printf("%-34s %10.3f %10.3f %12.2f\n", "load, file in the page cache", cached_s,
           gb / cached_s, dd_read_s / cached_s);
    printf("%-34s %10.3f %10.3f %12.2f\n\n", "verify (read, check)", verify_s, gb / verify_s,
           dd_read_s / verify_s);

    /* 1b. the same checkpoint restored onto a cluster of 3: each server reads only the
     * chunks of its buckets (one after another here; on 3 hosts at once) */
    printf("restored onto a cluster of 3 servers (as loads of one server's buckets, one "
           "after another):\n");
    printf("%-10s %12s %16s %12s %10s %10s\n", "server", "rows", "rows.emb read", "of file",
           "seconds", "vs dd");
    uint64_t cluster_rows = 0, cluster_bytes = 0;
    for (uint32_t j = 0; j < 3; j++) {
        drop_caches();
        uint64_t heard[3] = {0};
        em_checkpoint_load_options owner = {.owner_index = j, .owner_count = 3,
                                            .progress = record_bytes, .progress_context = heard};
        const char *one[1] = {s.info.path};
        start = em_test_now();
        if (em_checkpoint_load_sources(one, 1, backend, "part", &owner, &loaded, &info, &err) !=
            EM_OK) {
            fprintf(stderr, "load of server %u's buckets: %s\n", j, err.message);
            return 1;
        }
        double part_s = em_test_now() - start;
        em_table_destroy(loaded);
        cluster_rows += info.table_rows;
        cluster_bytes += heard[1];
        char label[16];
        snprintf(label, sizeof(label), "%u of 3", j);
        printf("%-10s %12" PRIu64 " %16" PRIu64 " %12.3f %10.3f %10.2f\n", label,
               info.table_rows, heard[1], (double)heard[1] / (double)s.info.bytes, part_s,
               dd_read_s * ((double)heard[1] / (double)s.info.bytes) / part_s);
    }
    char rows_path[4400];
    snprintf(rows_path, sizeof(rows_path), "%s/rows.emb", s.info.path);
    struct stat rows_stat;
    uint64_t rows_bytes = stat(rows_path, &rows_stat) == 0 ? (uint64_t)rows_stat.st_size : 0;
    printf("%-10s %12" PRIu64 " %16" PRIu64 " %12.3f   (rows.emb has %" PRIu64 " bytes; "
           "index and manifest read by each)\n\n", "together", cluster_rows, cluster_bytes,
           (double)cluster_bytes / (double)s.info.bytes, rows_bytes);

    /* 1c. saves beside dd copies of the bytes they write: a full save and one keeping
     * the row digests deltas need, each pair in turn with dd copying the last save's
     * rows.emb directly and through the page cache (dd first in odd pairs, last in even
     * ones), for the same reason as the loads' pairs */
    double copy_direct[MAX_PAIRS] = {0}, copy_buffered[MAX_PAIRS] = {0};
    double unlink_low = 1e9, unlink_high = 0;
    double save_plain[MAX_PAIRS], save_tracked[MAX_PAIRS];
    char last_saved[4400]; /* the last save's checkpoint */
    snprintf(last_saved, sizeof(last_saved), "%s", s.info.path);
    for (int k = 0; k < pairs; k++) {
        if (k % 2 == 0)
            dd_copies(opt.dir, last_saved, &copy_direct[k], &copy_buffered[k], &unlink_low,
                      &unlink_high);
        for (int which = 0; which < 2; which++) {
            bool track = (which == 0) == (k % 2 == 1); /* which goes first alternates too */
            saver pair_save = {.table = table, .opt = &opt, .track = track};
            drop_caches();
            run_save(&pair_save);
            double seconds = pair_save.seconds;
            if (pair_save.status != EM_OK)
                return 1;
            removal_low = pair_save.removal_s < removal_low ? pair_save.removal_s : removal_low;
            removal_high = pair_save.removal_s > removal_high ? pair_save.removal_s : removal_high;
            *(track ? &save_tracked[k] : &save_plain[k]) = seconds;
            snprintf(last_saved, sizeof(last_saved), "%s", pair_save.info.path);
        }
        if (k % 2 == 1)
            dd_copies(opt.dir, last_saved, &copy_direct[k], &copy_buffered[k], &unlink_low,
                      &unlink_high);
    }
    printf("saves beside dd copying the rows.emb a save wrote (4 MiB writes, oflag=direct "
           "and conv=fdatasync):\n");
    printf("%-6s %12s %14s %12s %8s %16s %8s\n", "pair", "dd direct s", "dd fdatasync s",
           "full save s", "vs dd", "with digests s", "vs dd");
    double fastest_direct = copy_direct[0], fastest_buffered = copy_buffered[0];
    double sorted_plain[MAX_PAIRS], sorted_tracked[MAX_PAIRS];
    for (int k = 0; k < pairs; k++) {
        double dd = copy_direct[k] < copy_buffered[k] ? copy_direct[k] : copy_buffered[k];
        printf("%-6d %12.3f %14.3f %12.3f %8.2f %16.3f %8.2f\n", k + 1, copy_direct[k],
               copy_buffered[k], save_plain[k], dd / save_plain[k], save_tracked[k],
               dd / save_tracked[k]);
        fastest_direct = copy_direct[k] < fastest_direct ? copy_direct[k] : fastest_direct;
        fastest_buffered =
            copy_buffered[k] < fastest_buffered ? copy_buffered[k] : fastest_buffered;
    }
    memcpy(sorted_plain, save_plain, pairs * sizeof(double));
    memcpy(sorted_tracked, save_tracked, pairs * sizeof(double));
    qsort(sorted_plain, pairs, sizeof(double), compare_doubles);
    qsort(sorted_tracked, pairs, sizeof(double), compare_doubles);
    double fastest = fastest_direct < fastest_buffered ? fastest_direct : fastest_buffered;
    printf("(vs dd: the faster dd of the pair.) Median saves against the fastest dd copy of "
           "the run (%.3f s; direct %.3f s, fdatasync %.3f s): full %.2f (%.3f s), with "
           "digests %.2f (%.3f s)\n",
           fastest, fastest_direct, fastest_buffered, fastest / sorted_plain[pairs / 2],
           sorted_plain[pairs / 2], fastest / sorted_tracked[pairs / 2],
           sorted_tracked[pairs / 2]);
    printf("Each save (keep 1) answers with the checkpoint before it set aside; its files were "
           "removed after the answer, in %.3f-%.3f s, waited for before the next step (removing "
           "dd's copies, files of the same size: %.3f-%.3f s).\n\n", removal_low, removal_high,
           unlink_low, unlink_high);

    /* 2. a delta after pushes to 1% of the rows */
    saver tracked = {.table = table, .opt = &opt, .track = true};
    run_save(&tracked);
    double tracked_s = tracked.seconds;
    uint64_t touched = touch_rows(table, &opt, opt.rows / 100);
    saver delta = {.table = table, .opt = &opt, .delta = true};
    run_save(&delta);
    double delta_s = delta.seconds;
    if (tracked.status != EM_OK || delta.status != EM_OK || strcmp(delta.info.kind, "delta") != 0)
        return 1;
    printf("a delta after pushes to %" PRIu64 " keys (1%% of the rows):\n", touched);
    printf("%-34s %10s %14s %10s %12s\n", "save", "seconds", "bytes", "rows", "of full");
    printf("%-34s %10.3f %14" PRIu64 " %10" PRIu64 " %12s\n", "full", save_s, s.info.bytes,
           s.info.rows, "1.0000");
    printf("%-34s %10.3f %14" PRIu64 " %10" PRIu64 " %12.4f\n", "full, keeping row digests",
           tracked_s, tracked.info.bytes, tracked.info.rows,
           (double)tracked.info.bytes / (double)s.info.bytes);
    printf("%-34s %10.3f %14" PRIu64 " %10" PRIu64 " %12.4f\n\n", "delta", delta_s,
           delta.info.bytes, delta.info.rows, (double)delta.info.bytes / (double)s.info.bytes);

    /* 3. pull latency, idle and during a save */
    latency idle = measure_pulls(table, &opt, false, NULL);
    double during_s = 0;
    latency busy = measure_pulls(table, &opt, true, &during_s);
    printf("%d clients pulling %d keys (sum), in-process:\n", opt.clients, PULL_KEYS);
    printf("%-22s %10s %10s %10s %10s\n", "", "pulls", "p50 us", "p99 us", "max us");
    printf("%-22s %10" PRIu64 " %10.1f %10.1f %10.1f\n", "idle", idle.pulls, idle.p50 * 1e6,
           idle.p99 * 1e6, idle.max * 1e6);
    printf("%-22s %10" PRIu64 " %10.1f %10.1f %10.1f\n", "during a save", busy.pulls,
           busy.p50 * 1e6, busy.p99 * 1e6, busy.max * 1e6);
    printf("p99 during / idle: %.2f (the save took %.3f s with the pulls running)\n",
           busy.p99 / idle.p99, during_s);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_checkpoint_removals_destroy(removals);
    return 0;
}
