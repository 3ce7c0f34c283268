/*
 * Eviction on the CPU backend, or with --backend cuda on the first GPU:
 *
 *   1. insert throughput (pushes of batches of new keys, sgd, dim 64) into a full table
 *      that evicts (lru) against the same inserts into tables at load 0.5 that need no
 *      room, in the same run: one without a policy (no access metadata kept) and one
 *      with the full table's (lru: the metadata kept, nothing evicted); the full table
 *      twice, evicting on one thread and on the backend's eviction threads (on a GPU,
 *      whose shards share the request's lane, both evict a shard after another);
 *   2. hit rate of lru and lfu (sampled, `candidates` entries per row removed) against
 *      an exact LRU and an exact LFU on the same Zipf streams (alpha 1.05 and 1.2, key
 *      space 10x the capacity), one key per request;
 *   3. counter admission (threshold 2 and 5, two sketch sizes) on a Zipf 1.05 stream of
 *      one-key pushes: rows and memory stored against admitting every key, the share of
 *      pushes dropped, and the keys stored against those an exact count would store;
 *   4. the same pushes from 1 and 2 threads at once, with and without counter
 *      admission, and into a full lru table (capacity a tenth of the key space) with and
 *      without eviction headroom: pushes/s, how many ran again under the exclusive
 *      table lock, and the share of pushes that found their key stored.
 *
 *   bench_eviction [--rows N] [--batch B] [--rounds R] [--capacity C] [--accesses A]
 *                  [--candidates K] [--parts LIST] [--backend cpu|cuda]
 *                  [--gpu-choice-entries N] [--shards N]
 *
 * --parts runs only the listed parts (digits 1 to 4, e.g. 12); all four by default.
 * --gpu-choice-entries: the CUDA backend's gpu_choice_entries (evictions whose windows
 * hold this many entries are chosen on the GPU; 0: the default, "host": never).
 * --shards: of every table (8 by default).
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ember_config.h"
#include "lib/device/backend.h"
#include "lib/table/table.h"
#include "tests/bench/sampler.h"
#include "tests/support/test_support.h"

typedef struct options {
    uint64_t rows;      /* part 1: capacity */
    uint32_t batch;     /* part 1: new keys per push */
    uint64_t capacity;  /* part 2 */
    uint64_t accesses;  /* part 2: requests per stream */
    uint32_t candidates;
    int rounds;         /* part 1 */
    unsigned parts;     /* bit p-1: run part p */
    const char *backend; /* "cpu" or "cuda" */
    uint64_t gpu_choice_entries; /* cuda: the backend option (0: its default) */
    uint32_t shards;             /* of every table */
} options;

static const options *bench_options;

static void die(const char *what, const em_error *err)
{
    fprintf(stderr, "bench_eviction: %s: %s\n", what, err != NULL ? err->message : "");
    exit(1);
}

static bool on_gpu(void)
{
    return strcmp(bench_options->backend, "cuda") == 0;
}

/* The backend --backend names: one host device, or the first GPU. eviction_threads: the
 * CPU backend's option (0: the CPUs online, at most 8); a GPU evicts a shard after
 * another. Exits when the backend cannot be had. */
static em_backend *bench_backend_evicting_on(uint32_t eviction_threads)
{
    em_backend *backend = NULL;
    em_error err;
    em_status status;
    if (!on_gpu()) {
        em_cpu_backend_options cpu;
        em_cpu_backend_options_init(&cpu);
        cpu.devices = 1;
        cpu.eviction_threads = eviction_threads;
        status = em_backend_create_cpu(&cpu, &backend, &err);
    } else {
#if EM_HAVE_CUDA
        em_cuda_backend_options cuda;
        em_cuda_backend_options_init(&cuda);
        cuda.device_count = 1;
        cuda.devices[0] = 0;
        cuda.gpu_choice_entries = bench_options->gpu_choice_entries;
        status = em_backend_create_cuda(&cuda, &backend, &err);
#else
        status = em_error_set(&err, EM_UNAVAILABLE, "this build has no CUDA backend");
#endif
    }
    if (status != EM_OK)
        die(bench_options->backend, &err);
    return backend;
}

static em_backend *bench_backend(void)
{
    return bench_backend_evicting_on(0);
}

static em_table *make_table(em_backend *backend, uint32_t dim, uint64_t capacity,
                            em_eviction_policy policy, uint32_t candidates)
{
    em_table_config config;
    em_table_config_init(&config, "bench", dim, capacity);
    config.shards = bench_options->shards;
    config.optimizer.kind = EM_OPTIMIZER_SGD;
    config.optimizer.learning_rate = 0.01;
    config.eviction.policy = policy;
    config.eviction.candidates = candidates;
    em_table *table = NULL;
    em_error err;
    if (em_table_create(backend, &config, &table, &err) != EM_OK)
        die("create", &err);
    return table;
}

/* ---- part 1: insert throughput ---------------------------------------------------------- */

typedef struct pusher {
    uint32_t batch, dim;
    uint64_t *keys;
    uint32_t *offsets;
    float *gradients;
} pusher;

static pusher pusher_make(uint32_t batch, uint32_t dim)
{
    pusher p = {.batch = batch, .dim = dim};
    p.keys = malloc(batch * sizeof(uint64_t));
    p.offsets = malloc((batch + 1) * sizeof(uint32_t));
    p.gradients = malloc((size_t)batch * dim * sizeof(float));
    for (uint32_t i = 0; i <= batch; i++)
        p.offsets[i] = i;
    for (size_t i = 0; i < (size_t)batch * dim; i++)
        p.gradients[i] = 0.001f;
    return p;
}

/* Pushes keys first, first + 1, ... (scrambled), batch by batch, n keys in all;
 * returns the seconds it took. */
static double push_new_keys(em_table *table, pusher *p, uint64_t first, uint64_t n)
{
    double start = em_test_now();
    for (uint64_t done = 0; done < n; done += p->batch) {
        uint32_t count = n - done < p->batch ? (uint32_t)(n - done) : p->batch;
        for (uint32_t i = 0; i < count; i++)
            p->keys[i] = (first + done + i) * 0x9e3779b97f4a7c15ull + 7;
        em_push_request request = {
            .batch = {.rows = count, .nnz = count, .offsets = p->offsets, .keys = p->keys},
            .combiner = EM_COMBINER_NONE,
            .gradients = p->gradients,
            .gradient_count = (uint64_t)count * p->dim,
        };
        em_push_result result;
        em_error err;
        if (em_table_push(table, &request, &result, &err) != EM_OK)
            die("push", &err);
    }
    return em_test_now() - start;
}

/* The host's waits for the device (em_device waits, wait_ns) over some pushes. */
typedef struct device_waits {
    uint64_t pushes, waits, wait_ns;
    double seconds;
} device_waits;

/* push_new_keys, its waits for the backend's first device added to *w. */
static double push_new_keys_counted(em_table *table, em_backend *backend, pusher *p,
                                    uint64_t first, uint64_t n, device_waits *w)
{
    em_device *device = backend->devices[0];
    uint64_t waits = atomic_load(&device->waits), wait_ns = atomic_load(&device->wait_ns);
    double seconds = push_new_keys(table, p, first, n);
    w->pushes += (n + p->batch - 1) / p->batch;
    w->waits += atomic_load(&device->waits) - waits;
    w->wait_ns += atomic_load(&device->wait_ns) - wait_ns;
    w->seconds += seconds;
    return seconds;
}

static void print_waits(const char *what, const device_waits *w)
{
    printf("  %s: %.1f waits a push, the host waiting %.0f%% of the pushes' time\n", what,
           (double)w->waits / (double)w->pushes, 100.0 * (double)w->wait_ns / 1e9 / w->seconds);
}

static void sort_doubles(double *values, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && values[j] < values[j - 1]; j--) {
            double t = values[j];
            values[j] = values[j - 1];
            values[j - 1] = t;
        }
}

static void insert_throughput(const options *opt)
{
    const uint32_t dim = 64;
    em_backend *backend = bench_backend();
    /* a GPU has one backend at a time (its pool takes most of its memory): both full
     * tables live on it and evict alike, a shard after another */
    em_backend *serial = on_gpu() ? backend : bench_backend_evicting_on(1);
    pusher p = pusher_make(opt->batch, dim);
    uint64_t measured = opt->rows / 4;
    printf("1. insert throughput: pushes of %u new keys (sgd, dim %u, %u shards), %" PRIu64
           " keys timed per round; ",
           opt->batch, dim, opt->shards, measured);
    if (on_gpu())
        printf("on %s, both full tables evict a shard after another (1t: the first one)\n\n",
               backend->devices[0]->name);
    else
        printf("the full tables evict on 1 thread and on %u (a shard each)\n\n",
               backend->eviction_threads);
    printf("%5s %14s %14s %14s %14s %9s %9s %9s\n", "round", "0.5 keys/s", "0.5+lru keys/s",
           "full 1t keys/s", "full keys/s", "full1t/.5", "full/0.5", "full/.5lru");
    /* full[0] evicts on one thread, full[1] on the backend's */
    em_table *full[2] = {make_table(serial, dim, opt->rows, EM_EVICTION_LRU, opt->candidates),
                         make_table(backend, dim, opt->rows, EM_EVICTION_LRU, opt->candidates)};
    for (int f = 0; f < 2; f++)
        push_new_keys(full[f], &p, 0, opt->rows);
    uint64_t next_half = opt->rows / 2, next_full = opt->rows;
    double ratios[3][64]; /* full 1 thread / 0.5, full / 0.5, full / 0.5+lru */
    device_waits waits[2] = {{0}}; /* 0.5, full (the last column's tables) */
    int rounds = opt->rounds;
    /* round 0 warms up and is left out of the medians: the first table at load 0.5 of
     * the process fills memory it never touched (about a fifth of the later rounds'
     * rate on a virtual machine), which would count one round for the full tables */
    for (int r = -1; r < rounds; r++) {
        /* the load-0.5 tables stay between 0.5 and 0.75: fresh ones each round */
        double t_half[2], t_full[2];
        for (int lru = 0; lru < 2; lru++) {
            em_table *half = make_table(backend, dim, opt->rows,
                                        lru ? EM_EVICTION_LRU : EM_EVICTION_NONE,
                                        opt->candidates);
            push_new_keys(half, &p, 1u << 30, opt->rows / 2);
            bench_profile_begin(lru ? "load 0.5, lru" : "load 0.5");
            t_half[lru] = push_new_keys_counted(half, backend, &p, next_half, measured,
                                                &waits[0]);
            bench_profile_end();
            em_table_destroy(half);
        }
        bench_profile_begin("full, 1 thread");
        t_full[0] = push_new_keys(full[0], &p, next_full, measured);
        bench_profile_begin("full");
        t_full[1] = push_new_keys_counted(full[1], backend, &p, next_full, measured, &waits[1]);
        bench_profile_end();
        next_half += measured;
        next_full += measured;
        double ratio[3] = {t_half[0] / t_full[0], t_half[0] / t_full[1], t_half[1] / t_full[1]};
        char label[16];
        snprintf(label, sizeof(label), r < 0 ? "warm" : "%d", r + 1);
        printf("%5s %14.0f %14.0f %14.0f %14.0f %8.3fx %8.3fx %8.3fx\n", label,
               measured / t_half[0], measured / t_half[1], measured / t_full[0],
               measured / t_full[1], ratio[0], ratio[1], ratio[2]);
        for (int k = 0; r >= 0 && k < 3; k++)
            ratios[k][r] = ratio[k];
    }
    for (int k = 0; k < 3; k++)
        sort_doubles(ratios[k], rounds);
    em_table_stats stats;
    em_table_get_stats(full[1], &stats);
    printf("median %65.3fx %8.3fx %8.3fx   (of rounds 1-%d)\n(full tables: %" PRIu64 " rows, %" PRIu64
           " evicted, %" PRIu64 " of them chosen on the GPU; per row: index %.1f bytes, access "
           "metadata %.1f bytes, storage %.1f bytes)\n\n",
           ratios[0][rounds / 2], ratios[1][rounds / 2], ratios[2][rounds / 2], rounds,
           stats.rows,
           stats.rows_evicted, stats.rows_evicted_chosen_on_gpu, stats.index_bytes_per_row,
           stats.access_bytes_per_row, (double)stats.row_bytes / (double)stats.rows);
    if (on_gpu()) {
        printf("host waits for the GPU (STATS device_waits, device_wait_ms):\n");
        print_waits("tables at load 0.5", &waits[0]);
        print_waits("full table", &waits[1]);
        printf("\n");
    }
    for (int f = 0; f < 2; f++)
        em_table_destroy(full[f]);
    free(p.keys);
    free(p.offsets);
    free(p.gradients);
    if (serial != backend)
        em_backend_destroy(serial);
    em_backend_destroy(backend);
}

/* ---- part 2: hit rates against exact oracles -------------------------------------------- */

/* Zipf ranks 0..n-1 by inverse CDF; rank r is key scramble(r). */
typedef struct zipf {
    uint64_t n;
    double *cdf;
} zipf;

static zipf zipf_make(uint64_t n, double alpha)
{
    zipf z = {.n = n, .cdf = malloc(n * sizeof(double))};
    double sum = 0.0;
    for (uint64_t r = 0; r < n; r++) {
        sum += 1.0 / pow((double)(r + 1), alpha);
        z.cdf[r] = sum;
    }
    for (uint64_t r = 0; r < n; r++)
        z.cdf[r] /= sum;
    return z;
}

static uint64_t zipf_draw(const zipf *z, em_test_rng *rng)
{
    double u = em_test_rng_unit(rng);
    uint64_t low = 0, high = z->n - 1;
    while (low < high) {
        uint64_t middle = (low + high) / 2;
        if (z->cdf[middle] < u)
            low = middle + 1;
        else
            high = middle;
    }
    return low * 0x9e3779b97f4a7c15ull + 3;
}

/* An exact LRU or LFU cache of keys: a binary min-heap of (score, stamp) with each key's
 * heap position in an open-addressing map. LRU scores by the last access, LFU by the
 * access count (ties: the last access), as the table's policies do. */
typedef struct oracle_entry {
    uint64_t key, frequency, stamp;
} oracle_entry;

typedef struct oracle {
    bool lfu;
    uint64_t capacity, count, slots;
    oracle_entry *heap;
    uint64_t *slot_keys;     /* UINT64_MAX: empty */
    uint64_t *slot_position; /* heap index of the slot's key */
} oracle;

static uint64_t oracle_slot(const oracle *o, uint64_t key)
{
    uint64_t slot = (key * 0xff51afd7ed558ccdull) % o->slots;
    while (o->slot_keys[slot] != UINT64_MAX && o->slot_keys[slot] != key)
        slot = slot + 1 == o->slots ? 0 : slot + 1;
    return slot;
}

static bool oracle_before(const oracle *o, const oracle_entry *a, const oracle_entry *b)
{
    if (o->lfu && a->frequency != b->frequency)
        return a->frequency < b->frequency;
    return a->stamp < b->stamp;
}

static void oracle_place(oracle *o, uint64_t at, oracle_entry entry)
{
    o->heap[at] = entry;
    o->slot_position[oracle_slot(o, entry.key)] = at;
}

static void oracle_sift(oracle *o, uint64_t at)
{
    oracle_entry entry = o->heap[at];
    while (at > 0 && oracle_before(o, &entry, &o->heap[(at - 1) / 2])) {
        oracle_place(o, at, o->heap[(at - 1) / 2]);
        at = (at - 1) / 2;
    }
    for (;;) {
        uint64_t child = 2 * at + 1;
        if (child >= o->count)
            break;
        if (child + 1 < o->count && oracle_before(o, &o->heap[child + 1], &o->heap[child]))
            child++;
        if (!oracle_before(o, &o->heap[child], &entry))
            break;
        oracle_place(o, at, o->heap[child]);
        at = child;
    }
    oracle_place(o, at, entry);
}

/* Removes the key at slot, keeping the probe chains whole (backward shift). */
static void oracle_unmap(oracle *o, uint64_t slot)
{
    o->slot_keys[slot] = UINT64_MAX;
    for (uint64_t next = slot + 1 == o->slots ? 0 : slot + 1; o->slot_keys[next] != UINT64_MAX;
         next = next + 1 == o->slots ? 0 : next + 1) {
        uint64_t key = o->slot_keys[next], position = o->slot_position[next];
        o->slot_keys[next] = UINT64_MAX;
        uint64_t home = oracle_slot(o, key);
        o->slot_keys[home] = key;
        o->slot_position[home] = position;
    }
}

/* One access; returns whether it was a hit. */
static bool oracle_access(oracle *o, uint64_t key, uint64_t stamp)
{
    uint64_t slot = oracle_slot(o, key);
    if (o->slot_keys[slot] == key) {
        uint64_t at = o->slot_position[slot];
        o->heap[at].frequency++;
        o->heap[at].stamp = stamp;
        oracle_sift(o, at);
        return true;
    }
    if (o->count == o->capacity) {
        oracle_unmap(o, oracle_slot(o, o->heap[0].key));
        o->count--;
        if (o->count > 0) {
            oracle_place(o, 0, o->heap[o->count]);
            oracle_sift(o, 0);
        }
        slot = oracle_slot(o, key);
    }
    o->slot_keys[slot] = key;
    o->slot_position[slot] = o->count;
    o->heap[o->count++] = (oracle_entry){.key = key, .frequency = 1, .stamp = stamp};
    oracle_sift(o, o->count - 1);
    return false;
}

static double oracle_hit_rate(bool lfu, uint64_t capacity, const uint64_t *stream, uint64_t n)
{
    oracle o = {.lfu = lfu, .capacity = capacity, .slots = capacity * 2 + 1};
    o.heap = malloc(capacity * sizeof(*o.heap));
    o.slot_keys = malloc(o.slots * sizeof(uint64_t));
    o.slot_position = malloc(o.slots * sizeof(uint64_t));
    memset(o.slot_keys, 0xff, o.slots * sizeof(uint64_t));
    uint64_t hits = 0;
    for (uint64_t i = 0; i < n; i++)
        hits += oracle_access(&o, stream[i], i + 1);
    free(o.heap);
    free(o.slot_keys);
    free(o.slot_position);
    return (double)hits / (double)n;
}

static double table_hit_rate(em_backend *backend, em_eviction_policy policy, uint32_t candidates,
                             uint64_t capacity, const uint64_t *stream, uint64_t n,
                             double *seconds)
{
    const uint32_t dim = 8;
    em_table *table = make_table(backend, dim, capacity, policy, candidates);
    uint32_t offsets[2] = {0, 1};
    float out[8];
    uint64_t hits = 0;
    double start = em_test_now();
    for (uint64_t i = 0; i < n; i++) {
        em_pull_request request = {
            .batch = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = &stream[i]},
            .combiner = EM_COMBINER_NONE,
            .create_missing = true,
            .out = out,
            .out_capacity = dim,
        };
        em_pull_result result;
        em_error err;
        if (em_table_pull(table, &request, &result, &err) != EM_OK)
            die("pull", &err);
        hits += result.missing == 0;
    }
    *seconds = em_test_now() - start;
    em_table_destroy(table);
    return (double)hits / (double)n;
}

static void hit_rates(const options *opt)
{
    em_backend *backend = bench_backend();
    printf("2. hit rate: one key per pull (create_missing), capacity %" PRIu64
           ", key space %" PRIu64 ", %" PRIu64 " accesses per stream, candidates %u\n\n",
           opt->capacity, opt->capacity * 10, opt->accesses, opt->candidates);
    printf("%6s %7s %11s %11s %11s %12s\n", "alpha", "policy", "ember", "exact", "difference",
           "ember s");
    const double alphas[] = {1.05, 1.2};
    for (int a = 0; a < 2; a++) {
        zipf z = zipf_make(opt->capacity * 10, alphas[a]);
        em_test_rng rng;
        em_test_rng_init(&rng, 77 + (uint64_t)a);
        uint64_t *stream = malloc(opt->accesses * sizeof(uint64_t));
        for (uint64_t i = 0; i < opt->accesses; i++)
            stream[i] = zipf_draw(&z, &rng);
        for (int lfu = 0; lfu <= 1; lfu++) {
            double seconds = 0.0;
            double ours = table_hit_rate(backend, lfu ? EM_EVICTION_LFU : EM_EVICTION_LRU,
                                         opt->candidates, opt->capacity, stream, opt->accesses,
                                         &seconds);
            double exact = oracle_hit_rate(lfu, opt->capacity, stream, opt->accesses);
            printf("%6.2f %7s %10.2f%% %10.2f%% %+10.2f pp %11.2f\n", alphas[a],
                   lfu ? "lfu" : "lru", 100.0 * ours, 100.0 * exact, 100.0 * (ours - exact),
                   seconds);
        }
        free(stream);
        free(z.cdf);
    }
    em_backend_destroy(backend);
}

/* ---- part 3: counter admission ------------------------------------------------------- */

typedef struct admission_run {
    uint64_t rows, bytes, dropped;
} admission_run;

typedef struct stream_pusher {
    em_table *table;
    const uint64_t *stream;
    uint64_t n, first, step; /* pushes stream[first], stream[first + step], ... */
} stream_pusher;

static void *push_stream_part(void *argument)
{
    const stream_pusher *p = argument;
    uint32_t offsets[2] = {0, 1};
    float gradient[64];
    for (uint32_t j = 0; j < 64; j++)
        gradient[j] = 0.01f;
    em_error err;
    for (uint64_t i = p->first; i < p->n; i += p->step) {
        em_push_request request = {
            .batch = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = &p->stream[i]},
            .combiner = EM_COMBINER_NONE,
            .gradients = gradient,
            .gradient_count = 64,
        };
        em_push_result result;
        if (em_table_push(p->table, &request, &result, &err) != EM_OK)
            die("push", &err);
    }
    return NULL;
}

/* Pushes the stream from `threads` threads (interleaved slices) into a new table;
 * pushes per second, and the table's stats after. */
/* What part 4 pushes into, beside admission: an eviction policy and its headroom. */
typedef struct full_table {
    em_eviction_policy policy;
    double headroom;
} full_table;

static double push_stream_threads(em_backend *backend, em_admission_policy policy,
                                  uint32_t threshold, uint32_t counters, full_table eviction,
                                  const uint64_t *stream, uint64_t n, uint64_t capacity,
                                  uint32_t threads, em_table_stats *stats)
{
    em_table_config config;
    em_table_config_init(&config, "bench", 64, capacity);
    config.shards = bench_options->shards;
    config.optimizer.kind = EM_OPTIMIZER_ADAGRAD;
    config.optimizer.learning_rate = 0.01;
    config.admission.policy = policy;
    config.admission.threshold = threshold;
    config.admission.counters = counters;
    config.eviction.policy = eviction.policy;
    config.eviction.headroom = eviction.headroom;
    em_table *table = NULL;
    em_error err;
    if (em_table_create(backend, &config, &table, &err) != EM_OK)
        die("create", &err);
    pthread_t handles[8];
    stream_pusher parts[8];
    double began = em_test_now();
    for (uint32_t t = 0; t < threads; t++) {
        parts[t] = (stream_pusher){table, stream, n, t, threads};
        pthread_create(&handles[t], NULL, push_stream_part, &parts[t]);
    }
    for (uint32_t t = 0; t < threads; t++)
        pthread_join(handles[t], NULL);
    double seconds = em_test_now() - began;
    em_table_get_stats(table, stats);
    em_table_destroy(table);
    return (double)n / seconds;
}

static admission_run push_stream(em_backend *backend, em_admission_policy policy,
                                 uint32_t threshold, uint32_t counters, const uint64_t *stream,
                                 uint64_t n, uint64_t capacity)
{
    em_table_stats stats;
    (void)push_stream_threads(backend, policy, threshold, counters,
                              (full_table){EM_EVICTION_NONE, 0.0}, stream, n, capacity, 1,
                              &stats);
    return (admission_run){.rows = stats.rows,
                           .bytes = stats.rows * stats.row_floats * sizeof(float) + stats.rows * 16,
                           .dropped = stats.pushes_dropped};
}

/* The admission parts' stream: opt->accesses draws of Zipf 1.05 over 10x the capacity
 * (seed 5, so parts 3 and 4 push the same keys). */
static uint64_t *admission_stream(const options *opt)
{
    zipf z = zipf_make(opt->capacity * 10, 1.05);
    em_test_rng rng;
    em_test_rng_init(&rng, 5);
    uint64_t *stream = malloc(opt->accesses * sizeof(uint64_t));
    for (uint64_t i = 0; i < opt->accesses; i++)
        stream[i] = zipf_draw(&z, &rng);
    free(z.cdf);
    return stream;
}

static int compare_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Keys seen at least threshold times in the stream. */
static uint64_t keys_seen(const uint64_t *stream, uint64_t n, uint64_t threshold)
{
    uint64_t *sorted = malloc(n * sizeof(uint64_t));
    memcpy(sorted, stream, n * sizeof(uint64_t));
    qsort(sorted, n, sizeof(uint64_t), compare_u64);
    uint64_t keys = 0;
    for (uint64_t i = 0, run = 1; i < n; i++, run++) {
        if (i + 1 < n && sorted[i + 1] == sorted[i])
            continue;
        keys += run >= threshold;
        run = 0;
    }
    free(sorted);
    return keys;
}

static void admission(const options *opt)
{
    em_backend *backend = bench_backend();
    uint64_t space = opt->capacity * 10;
    printf("\n3. counter admission: %" PRIu64 " one-key pushes (adagrad, dim 64), Zipf 1.05 "
           "over %" PRIu64 " keys, no capacity limit reached\n\n",
           opt->accesses, space);
    printf("%-22s %9s %9s %12s %9s %9s %10s\n", "admission", "rows", "of all", "row memory",
           "dropped", "exact", "early");
    uint64_t *stream = admission_stream(opt);
    admission_run all = push_stream(backend, EM_ADMISSION_ALWAYS, 1, 1024, stream, opt->accesses,
                                    space);
    printf("%-22s %9" PRIu64 " %8.1f%% %9.1f MiB %8.1f%% %9s %10s\n", "always", all.rows, 100.0,
           all.bytes / 1048576.0, 0.0, "-", "-");
    const uint32_t thresholds[] = {2, 5}, sketches[] = {1u << 20, 1u << 14};
    for (int t = 0; t < 2; t++) {
        uint64_t exact = keys_seen(stream, opt->accesses, thresholds[t]);
        for (int k = 0; k < 2; k++) {
            admission_run run = push_stream(backend, EM_ADMISSION_COUNTER, thresholds[t],
                                            sketches[k], stream, opt->accesses, space);
            char label[64];
            snprintf(label, sizeof(label), "counter %u, %u KiB", thresholds[t], sketches[k] / 1024);
            printf("%-22s %9" PRIu64 " %8.1f%% %9.1f MiB %8.1f%% %9" PRIu64 " %+10" PRId64 "\n",
                   label, run.rows, 100.0 * (double)run.rows / (double)all.rows,
                   run.bytes / 1048576.0, 100.0 * (double)run.dropped / (double)opt->accesses,
                   exact, (int64_t)run.rows - (int64_t)exact);
        }
    }
    printf("\n(row memory: rows x (weights and optimizer state + 16 bytes of map entry); "
           "exact: keys pushed at least threshold times; early: keys the sketch stored before "
           "their threshold-th push)\n");
    free(stream);
    em_backend_destroy(backend);
}

static void admission_threads(const options *opt)
{
    em_backend *backend = bench_backend();
    uint64_t space = opt->capacity * 10;
    printf("\n4. one-key pushes from 1 and 2 threads at once, same stream as 3 (counter "
           "threshold 5, 1024 KiB sketch; full: lru, capacity %" PRIu64 "), pushes/s\n\n",
           opt->capacity);
    printf("%-26s %8s %14s %12s %15s %10s\n", "table", "threads", "pushes/s", "vs 1 thread",
           "exclusive/push", "found");
    uint64_t *stream = admission_stream(opt);
    const struct {
        const char *label;
        em_admission_policy admission;
        full_table eviction;
    } cases[] = {
        {"always", EM_ADMISSION_ALWAYS, {EM_EVICTION_NONE, 0.0}},
        {"counter 5", EM_ADMISSION_COUNTER, {EM_EVICTION_NONE, 0.0}},
        {"full", EM_ADMISSION_ALWAYS, {EM_EVICTION_LRU, 0.0}},
        {"full, headroom 0.01", EM_ADMISSION_ALWAYS, {EM_EVICTION_LRU, 0.01}},
        {"full, headroom 0.05", EM_ADMISSION_ALWAYS, {EM_EVICTION_LRU, 0.05}},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        double one = 0;
        uint64_t capacity = cases[c].eviction.policy == EM_EVICTION_NONE ? space : opt->capacity;
        for (uint32_t threads = 1; threads <= 2; threads++) {
            em_table_stats stats;
            double rate = push_stream_threads(backend, cases[c].admission, 5, 1u << 20,
                                              cases[c].eviction, stream, opt->accesses,
                                              capacity, threads, &stats);
            one = threads == 1 ? rate : one;
            /* a push that found no row created one, or was refused by admission */
            uint64_t missed = stats.rows_created + stats.pushes_dropped;
            printf("%-26s %8u %14.0f %11.2fx %15.3f %9.2f%%\n", cases[c].label, threads, rate,
                   rate / one, (double)stats.exclusive_retries / (double)opt->accesses,
                   100.0 * (1.0 - (double)missed / (double)opt->accesses));
        }
    }
    printf("\n(exclusive/push: requests run again under the exclusive table lock to create "
           "keys, per push; found: pushes whose key was stored)\n");
    free(stream);
    em_backend_destroy(backend);
}

static uint64_t count_option(const char *option, const char *text, uint64_t most)
{
    return em_test_parse_count("bench_eviction", option, text, most);
}

static unsigned parse_parts(const char *text)
{
    unsigned parts = 0;
    for (const char *c = text; *c != '\0'; c++) {
        if (*c < '1' || *c > '4') {
            fprintf(stderr, "bench_eviction: --parts '%s': parts are the digits 1 to 4\n", text);
            exit(2);
        }
        parts |= 1u << (*c - '1');
    }
    if (parts == 0) {
        fprintf(stderr, "bench_eviction: --parts is empty\n");
        exit(2);
    }
    return parts;
}

int main(int argc, char **argv)
{
    options opt = {.rows = 1u << 19, .batch = 65536, .capacity = 10000, .accesses = 500000,
                   .candidates = 16, .rounds = 5, .parts = 0xf, .backend = "cpu",
                   .shards = 8};
    bench_options = &opt;
    setvbuf(stdout, NULL, _IOLBF, 0); /* each line out at once: a run cut short keeps them */
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) {
            fprintf(stderr, "usage: bench_eviction [--rows N] [--batch B] [--rounds R] "
                            "[--capacity C] [--accesses A] [--candidates K] [--parts LIST] "
                            "[--backend cpu|cuda] [--gpu-choice-entries N|host] [--shards N]\n");
            return 2;
        }
        const char *value = argv[++i];
        if (strcmp(argv[i - 1], "--rows") == 0)
            opt.rows = count_option("--rows", value, UINT64_MAX);
        else if (strcmp(argv[i - 1], "--batch") == 0)
            opt.batch = (uint32_t)count_option("--batch", value, UINT32_MAX);
        else if (strcmp(argv[i - 1], "--rounds") == 0) {
            uint64_t rounds = count_option("--rounds", value, UINT64_MAX);
            opt.rounds = rounds < 64 ? (int)rounds : 64;
        } else if (strcmp(argv[i - 1], "--capacity") == 0)
            opt.capacity = count_option("--capacity", value, UINT64_MAX);
        else if (strcmp(argv[i - 1], "--accesses") == 0)
            opt.accesses = count_option("--accesses", value, UINT64_MAX);
        else if (strcmp(argv[i - 1], "--candidates") == 0)
            opt.candidates = (uint32_t)count_option("--candidates", value, UINT32_MAX);
        else if (strcmp(argv[i - 1], "--parts") == 0)
            opt.parts = parse_parts(value);
        else if (strcmp(argv[i - 1], "--shards") == 0)
            opt.shards = (uint32_t)count_option("--shards", value, UINT32_MAX);
        else if (strcmp(argv[i - 1], "--gpu-choice-entries") == 0) {
            opt.gpu_choice_entries = strcmp(value, "host") == 0
                                         ? UINT64_MAX
                                         : count_option("--gpu-choice-entries", value,
                                                        UINT64_MAX - 1);
        } else if (strcmp(argv[i - 1], "--backend") == 0) {
            opt.backend = value;
            if (strcmp(opt.backend, "cpu") != 0 && strcmp(opt.backend, "cuda") != 0) {
                fprintf(stderr, "bench_eviction: --backend %s: expected cpu or cuda\n",
                        opt.backend);
                return 2;
            }
        } else {
            fprintf(stderr, "bench_eviction: unknown option '%s'\n", argv[i - 1]);
            return 2;
        }
    }
    em_test_print_machine(NULL);
    printf("command: bench_eviction --rows %" PRIu64 " --batch %u --rounds %d --capacity %" PRIu64
           " --accesses %" PRIu64 " --candidates %u --backend %s",
           opt.rows, opt.batch, opt.rounds, opt.capacity, opt.accesses, opt.candidates,
           opt.backend);
    if (opt.shards != 8)
        printf(" --shards %u", opt.shards);
    if (opt.gpu_choice_entries == UINT64_MAX)
        printf(" --gpu-choice-entries host");
    else if (opt.gpu_choice_entries != 0)
        printf(" --gpu-choice-entries %" PRIu64, opt.gpu_choice_entries);
    if (opt.parts != 0xfu) {
        printf(" --parts ");
        for (unsigned p = 0; p < 4; p++)
            if (opt.parts & (1u << p))
                printf("%u", p + 1);
    }
    printf("\n\n");
    if (opt.parts & 1u)
        insert_throughput(&opt);
    if (opt.parts & 2u)
        hit_rates(&opt);
    if (opt.parts & 4u)
        admission(&opt);
    if (opt.parts & 8u)
        admission_threads(&opt);
    return 0;
}
