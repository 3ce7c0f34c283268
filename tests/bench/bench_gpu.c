/*
 * GPU throughput, four tables:
 *
 *   hash map   find (lookup + gather of the row's dim floats) and find_or_insert
 *              (insert of new keys + initial values of their rows) in billion keys/s,
 *              at load factors 0.5 and 0.9 and dim 8 and 64, 1,048,576 keys per call.
 *              The map has --slots slots and is filled to the load with random keys;
 *              find_or_insert times the last call of the fill (the one that reaches
 *              the load), on a rebuilt map each run. Then the find alone (no gather)
 *              of 16K to 1M keys at dim 8 in each of its forms: a group of 8 threads
 *              a key, a thread a key, and the form chosen by the key count (what
 *              requests use).
 *   gather     1,048,576 random rows of dim 16/64/128/256 into a dense array, in GB/s
 *              (bytes read + written), and as a fraction of a device-to-device
 *              cudaMemcpy of the same size measured in the same run.
 *   push       requests through a CUDA-backend table (one GPU, the host side
 *              included): 65,536 keys per push from a universe of 1M present keys,
 *              dim 64, per optimizer, in million keys/s; the keys uniform, and Zipf 1.2
 *              (a hot key repeats thousands of times in one request) side by side.
 *   requests   pulls and pushes of 4,096, 65,536 and 1,048,576 present keys (sgd, dim
 *              64) with the batch in host memory, as a server has it: in malloc'ed
 *              (pageable) buffers, which the GPU copies through its lanes' staging, and
 *              in the backend's pinned host buffers (where the server receives
 *              requests), which it copies by DMA; in million keys/s (the time in the
 *              table's calls, not the drawing of the keys) and as a fraction of the
 *              bus: the time the request's bytes (keys and gradients in, vectors out)
 *              take at the pinned copy rates measured in the same run; "wait", the
 *              share of the requests' time the host spent waiting for the GPU (STATS
 *              device_wait_ms), the rest being the host's own work. Side by side, the
 *              table in one shard and in eight on the same GPU: both serve
 *              requests of stored keys with one wait for the GPU (STATS pulls_at_once),
 *              eight shards with one kernel of each kind over all of them. Then pulls
 *              and pushes whose keys are all new ("new", "newp"), which create them with
 *              one wait too.
 *   pool       em_pool over one cudaMalloc'ed region against cudaMalloc/cudaFree, on
 *              the same random sequence of sizes (256 B .. 16 MiB, 64 live blocks).
 *
 * Kernel times come from CUDA events; each figure is the median of --repeat runs.
 * Exits 77 when no GPU is visible.
 *
 *   bench_gpu [--device N] [--slots N] [--repeat N] [--seconds S]
 */
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ember_kernels.h"
#include "lib/base/parallel.h"
#include "lib/device/backend.h"
#include "lib/memory/pool.h"
#include "lib/table/csr.h"
#include "lib/table/table.h"
#include "tests/support/test_support.h"

#define KEYS_PER_CALL 1048576u
#define DEFAULT_SLOTS (1u << 23)
#define DEFAULT_REPEAT 5u
#define MAX_REPEAT 99u
#define GATHER_ROWS (1u << 21)
#define BLOCK_SHIFT 20u /* rows per storage block in the microbenchmarks: 2^20 */
#define PUSH_KEYS 65536u
#define PUSH_UNIVERSE (1u << 20)
#define POOL_LIVE 64u
#define POOL_OPS 200000u
#define CUDA_MALLOC_OPS 5000u
#define POOL_REGION_BYTES ((size_t)2 << 30)

typedef struct options {
    int device;
    uint64_t slots;
    uint32_t repeat;
    double seconds;
    uint64_t seed;
} options;

/* ---- plumbing ------------------------------------------------------------------------- */

static void check(em_gpu_status status, const char *what)
{
    if (status.code == 0)
        return;
    fprintf(stderr, "%s: %s failed: %s (error %d)\n", what, status.call, status.message,
            status.code);
    exit(EXIT_FAILURE);
}

static void check_em(em_status status, const em_error *err, const char *what)
{
    if (status == EM_OK)
        return;
    fprintf(stderr, "%s: %s\n", what, err->message);
    exit(EXIT_FAILURE);
}

static void *device_alloc(const options *o, size_t bytes)
{
    void *pointer = NULL;
    check(em_gpu_malloc(o->device, bytes, &pointer), "device buffer");
    return pointer;
}

static void *host_alloc(size_t bytes)
{
    void *pointer = malloc(bytes);
    if (pointer == NULL) {
        fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
        exit(EXIT_FAILURE);
    }
    return pointer;
}

/* A copy in either direction, complete on return. */
static void copy_now(em_gpu_stream *stream, void *destination, const void *source, size_t bytes)
{
    check(em_gpu_memcpy_async(stream, destination, source, bytes), "copy");
    check(em_gpu_stream_synchronize(stream), "copy");
}

/* Times what run() enqueues on the stream, in seconds. */
typedef struct timer {
    em_gpu_stream *stream;
    em_gpu_event *start, *end;
} timer;

static timer timer_create(const options *o, em_gpu_stream *stream)
{
    timer t = {.stream = stream};
    check(em_gpu_event_create(o->device, 1, &t.start), "timer");
    check(em_gpu_event_create(o->device, 1, &t.end), "timer");
    return t;
}

static void timer_begin(timer *t)
{
    check(em_gpu_event_record(t->start, t->stream), "timer");
}

static double timer_end(timer *t)
{
    float ms = 0.0f;
    check(em_gpu_event_record(t->end, t->stream), "timer");
    check(em_gpu_event_synchronize(t->end), "timer");
    check(em_gpu_event_elapsed_ms(t->start, t->end, &ms), "timer");
    return (double)ms / 1000.0;
}

static void timer_destroy(timer *t)
{
    em_gpu_event_destroy(t->start);
    em_gpu_event_destroy(t->end);
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *values, uint32_t n)
{
    qsort(values, n, sizeof(*values), compare_doubles);
    return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2.0;
}

/* Random keys, none equal to the map's marker keys (those take the side path). */
static void random_keys(em_test_rng *rng, uint64_t *keys, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) {
        uint64_t key;
        do
            key = em_test_rng_next(rng);
        while (key >= EM_GPU_TOMBSTONE_KEY);
        keys[i] = key;
    }
}

/* Row storage of `rows` rows of `stride` floats in blocks of 2^BLOCK_SHIFT rows. */
typedef struct storage {
    em_gpu_storage view;
    float **blocks; /* host copy */
    uint64_t block_count;
} storage;

static storage storage_create(const options *o, em_gpu_stream *stream, uint64_t rows,
                              uint32_t dim, uint32_t row_floats)
{
    storage s = {.block_count = (rows >> BLOCK_SHIFT) + 1};
    uint32_t stride = (row_floats + 3) / 4 * 4;
    s.blocks = host_alloc(s.block_count * sizeof(float *));
    for (uint64_t b = 0; b < s.block_count; b++)
        s.blocks[b] = device_alloc(o, ((size_t)1 << BLOCK_SHIFT) * stride * sizeof(float));
    float **table = device_alloc(o, s.block_count * sizeof(float *));
    copy_now(stream, table, s.blocks, s.block_count * sizeof(float *));
    s.view = (em_gpu_storage){.blocks = table, .block_shift = BLOCK_SHIFT,
                              .block_mask = ((uint64_t)1 << BLOCK_SHIFT) - 1, .stride = stride,
                              .dim = dim, .row_floats = row_floats,
                              .row_limit = s.block_count << BLOCK_SHIFT};
    return s;
}

static void storage_destroy(const options *o, storage *s)
{
    for (uint64_t b = 0; b < s->block_count; b++)
        em_gpu_free(o->device, s->blocks[b]);
    em_gpu_free(o->device, (void *)s->view.blocks);
    free(s->blocks);
}

/* ---- hash map ------------------------------------------------------------------------- */

typedef struct map_bench {
    const options *o;
    em_gpu_stream *stream;
    em_gpu_map map;
    uint64_t *keys;     /* device, every key of the fill */
    uint64_t *rows;     /* device, KEYS_PER_CALL */
    uint8_t *inserted;  /* device, KEYS_PER_CALL */
    float *vectors;     /* device, KEYS_PER_CALL x 64 */
    uint64_t *counter;  /* device */
} map_bench;

static void map_reset(map_bench *m)
{
    em_gpu_map_header header = {.rows = 0, .side_rows = {EM_GPU_ROW_NONE, EM_GPU_ROW_NONE}};
    check(em_gpu_map_clear(m->stream, m->map.slots, m->map.slot_count), "map clear");
    copy_now(m->stream, m->map.header, &header, sizeof(header));
}

/* Inserts keys[begin, begin + n) with their initial values. */
static void map_insert(map_bench *m, storage *s, uint64_t begin, uint64_t n)
{
    static const em_initializer_config initializer = {.kind = EM_INIT_UNIFORM, .bound = 0.1f};
    static const em_optimizer_config optimizer = {.kind = EM_OPTIMIZER_SGD};
    check(em_gpu_map_insert(m->stream, m->map, m->keys + begin, n, m->rows, m->inserted),
          "map insert");
    check(em_gpu_rows_init(m->stream, s->view, m->keys + begin, m->rows, m->inserted, n,
                           initializer, optimizer, (em_gpu_settle){.map = m->map}),
          "rows init");
}

/* Fills the map to `keys` keys: a partial call first, then full calls; returns the
 * seconds of the last call (KEYS_PER_CALL new keys, ending at the load). */
static double map_fill(map_bench *m, storage *s, uint64_t keys, timer *t)
{
    map_reset(m);
    double last = 0.0;
    uint64_t begin = 0;
    while (begin < keys) {
        uint64_t n = begin == 0 && keys % KEYS_PER_CALL != 0 ? keys % KEYS_PER_CALL
                                                              : KEYS_PER_CALL;
        check(em_gpu_memset_async(m->stream, m->rows, 0xff, n * sizeof(uint64_t)), "rows");
        bool timed = begin + n == keys;
        if (timed)
            timer_begin(t);
        map_insert(m, s, begin, n);
        if (timed)
            last = timer_end(t);
        begin += n;
    }
    check(em_gpu_stream_synchronize(m->stream), "map fill");
    return last;
}

/* Exits when the last find missed any of its keys (all of them present). */
static void expect_all_found(map_bench *m)
{
    uint64_t missing = 0;
    copy_now(m->stream, &missing, m->counter, sizeof(missing));
    if (missing != 0) {
        fprintf(stderr, "map find: %" PRIu64 " present keys not found\n", missing);
        exit(EXIT_FAILURE);
    }
}

/* Seconds of one find + gather of KEYS_PER_CALL present keys (uploaded at `lookups`). */
static double map_find(map_bench *m, storage *s, const uint64_t *lookups, timer *t)
{
    check(em_gpu_memset_async(m->stream, m->counter, 0, sizeof(uint64_t)), "counter");
    timer_begin(t);
    check(em_gpu_map_find(m->stream, m->map, lookups, KEYS_PER_CALL, m->rows, m->counter),
          "map find");
    check(em_gpu_rows_gather(m->stream, s->view, m->rows, KEYS_PER_CALL, NULL, m->vectors),
          "gather");
    double seconds = timer_end(t);
    expect_all_found(m);
    return seconds;
}

#define FORM_SIZES 4u
#define FORMS 3u

/* Seconds of one find of n present keys (no gather) in the form asked for. */
static double map_find_as(map_bench *m, const uint64_t *lookups, uint64_t n,
                          em_gpu_find_form form, timer *t)
{
    check(em_gpu_memset_async(m->stream, m->counter, 0, sizeof(uint64_t)), "counter");
    timer_begin(t);
    check(em_gpu_map_find_as(m->stream, m->map, lookups, n, m->rows, m->counter, form),
          "map find");
    double seconds = timer_end(t);
    expect_all_found(m);
    return seconds;
}

/* Gkeys/s of the find alone at each size and form, medians of 5 x --repeat runs (the
 * small finds take microseconds). */
static void time_find_forms(map_bench *m, const uint64_t *lookups, timer *t,
                            double gkeys[FORM_SIZES][FORMS])
{
    static const uint64_t sizes[FORM_SIZES] = {16384, 65536, 262144, KEYS_PER_CALL};
    static const em_gpu_find_form forms[FORMS] = {EM_GPU_FIND_GROUPED, EM_GPU_FIND_EACH,
                                                  EM_GPU_FIND_AUTO};
    uint32_t runs_count = 5 * m->o->repeat;
    double *runs = host_alloc(runs_count * sizeof(double));
    for (uint32_t z = 0; z < FORM_SIZES; z++)
        for (uint32_t f = 0; f < FORMS; f++) {
            for (uint32_t r = 0; r < runs_count; r++)
                runs[r] = map_find_as(m, lookups, sizes[z], forms[f], t);
            gkeys[z][f] = (double)sizes[z] / median(runs, runs_count) / 1e9;
        }
    free(runs);
}

static void print_find_forms(const double *loads, uint32_t load_count,
                             double gkeys[][FORM_SIZES][FORMS])
{
    static const uint64_t sizes[FORM_SIZES] = {16384, 65536, 262144, KEYS_PER_CALL};
    printf("\nfind alone (no gather), dim 8, by form, Gkeys/s: a group of 8 threads a key, a "
           "thread a key,\nand the form chosen by the key count (what requests use)\n");
    printf("%5s %8s %9s %9s %9s %14s\n", "load", "keys", "group", "thread", "chosen",
           "thread/group");
    for (uint32_t l = 0; l < load_count; l++)
        for (uint32_t z = 0; z < FORM_SIZES; z++)
            printf("%5.2f %8" PRIu64 " %9.3f %9.3f %9.3f %14.2f\n", loads[l], sizes[z],
                   gkeys[l][z][0], gkeys[l][z][1], gkeys[l][z][2],
                   gkeys[l][z][1] / gkeys[l][z][0]);
}

static void bench_hash_map(const options *o, em_gpu_stream *stream)
{
    static const double loads[] = {0.5, 0.9};
    static const uint32_t dims[] = {8, 64};
    printf("\nhash map: %" PRIu64 " slots (16 bytes each), %u keys per call, Gkeys/s\n",
           o->slots, KEYS_PER_CALL);
    printf("%-34s %5s %4s %9s\n", "operation", "load", "dim", "Gkeys/s");
    uint64_t max_keys = (uint64_t)(0.9 * (double)o->slots);
    em_test_rng rng;
    em_test_rng_init(&rng, o->seed);
    uint64_t *host_keys = host_alloc(max_keys * sizeof(uint64_t));
    random_keys(&rng, host_keys, max_keys);
    uint64_t *host_lookups = host_alloc(KEYS_PER_CALL * sizeof(uint64_t));
    map_bench m = {.o = o, .stream = stream};
    m.map.slot_count = o->slots;
    m.map.slots = device_alloc(o, o->slots * sizeof(em_gpu_slot));
    m.map.header = device_alloc(o, sizeof(em_gpu_map_header));
    m.keys = device_alloc(o, max_keys * sizeof(uint64_t));
    m.rows = device_alloc(o, KEYS_PER_CALL * sizeof(uint64_t));
    m.inserted = device_alloc(o, KEYS_PER_CALL);
    m.vectors = device_alloc(o, (size_t)KEYS_PER_CALL * 64 * sizeof(float));
    m.counter = device_alloc(o, sizeof(uint64_t));
    uint64_t *lookups = device_alloc(o, KEYS_PER_CALL * sizeof(uint64_t));
    copy_now(stream, m.keys, host_keys, max_keys * sizeof(uint64_t));
    timer t = timer_create(o, stream);
    double *runs = host_alloc(o->repeat * sizeof(double));
    double forms[2][FORM_SIZES][FORMS];
    for (size_t d = 0; d < sizeof(dims) / sizeof(dims[0]); d++) {
        storage s = storage_create(o, stream, max_keys, dims[d], dims[d]);
        for (size_t l = 0; l < sizeof(loads) / sizeof(loads[0]); l++) {
            uint64_t keys = (uint64_t)(loads[l] * (double)o->slots);
            for (uint32_t r = 0; r < o->repeat; r++)
                runs[r] = map_fill(&m, &s, keys, &t);
            printf("%-34s %5.2f %4u %9.3f\n", "find_or_insert (new keys + init)", loads[l],
                   dims[d], (double)KEYS_PER_CALL / median(runs, o->repeat) / 1e9);
            for (uint32_t i = 0; i < KEYS_PER_CALL; i++)
                host_lookups[i] = host_keys[em_test_rng_below(&rng, keys)];
            copy_now(stream, lookups, host_lookups, KEYS_PER_CALL * sizeof(uint64_t));
            for (uint32_t r = 0; r < o->repeat; r++)
                runs[r] = map_find(&m, &s, lookups, &t);
            printf("%-34s %5.2f %4u %9.3f\n", "find (present keys + gather)", loads[l], dims[d],
                   (double)KEYS_PER_CALL / median(runs, o->repeat) / 1e9);
            if (d == 0)
                time_find_forms(&m, lookups, &t, forms[l]);
        }
        storage_destroy(o, &s);
    }
    print_find_forms(loads, 2, forms);
    free(runs);
    timer_destroy(&t);
    em_gpu_free(o->device, lookups);
    em_gpu_free(o->device, m.counter);
    em_gpu_free(o->device, m.vectors);
    em_gpu_free(o->device, m.inserted);
    em_gpu_free(o->device, m.rows);
    em_gpu_free(o->device, m.keys);
    em_gpu_free(o->device, m.map.header);
    em_gpu_free(o->device, m.map.slots);
    free(host_lookups);
    free(host_keys);
}

/* ---- gather bandwidth ------------------------------------------------------------------ */

static void bench_gather(const options *o, em_gpu_stream *stream)
{
    static const uint32_t dims[] = {16, 64, 128, 256};
    printf("\ngather: %u random rows of %u into a dense array; GB/s = (read + written) / s\n",
           KEYS_PER_CALL, GATHER_ROWS);
    printf("%4s %10s %12s %9s\n", "dim", "gather", "memcpy D2D", "fraction");
    em_test_rng rng;
    em_test_rng_init(&rng, o->seed + 1);
    uint64_t *host_rows = host_alloc(KEYS_PER_CALL * sizeof(uint64_t));
    for (uint32_t i = 0; i < KEYS_PER_CALL; i++)
        host_rows[i] = em_test_rng_below(&rng, GATHER_ROWS);
    uint64_t *rows = device_alloc(o, KEYS_PER_CALL * sizeof(uint64_t));
    copy_now(stream, rows, host_rows, KEYS_PER_CALL * sizeof(uint64_t));
    timer t = timer_create(o, stream);
    double *gather_runs = host_alloc(o->repeat * sizeof(double));
    double *copy_runs = host_alloc(o->repeat * sizeof(double));
    for (size_t d = 0; d < sizeof(dims) / sizeof(dims[0]); d++) {
        storage s = storage_create(o, stream, GATHER_ROWS, dims[d], dims[d]);
        size_t bytes = (size_t)KEYS_PER_CALL * dims[d] * sizeof(float);
        float *out = device_alloc(o, bytes);
        float *copy = device_alloc(o, bytes);
        for (uint32_t r = 0; r < o->repeat; r++) {
            timer_begin(&t);
            check(em_gpu_rows_gather(stream, s.view, rows, KEYS_PER_CALL, NULL, out), "gather");
            gather_runs[r] = timer_end(&t);
            timer_begin(&t);
            check(em_gpu_memcpy_async(stream, copy, out, bytes), "memcpy");
            copy_runs[r] = timer_end(&t);
        }
        double gather = 2.0 * (double)bytes / median(gather_runs, o->repeat) / 1e9;
        double memcpy_rate = 2.0 * (double)bytes / median(copy_runs, o->repeat) / 1e9;
        printf("%4u %10.1f %12.1f %9.2f\n", dims[d], gather, memcpy_rate, gather / memcpy_rate);
        em_gpu_free(o->device, copy);
        em_gpu_free(o->device, out);
        storage_destroy(o, &s);
    }
    free(gather_runs);
    free(copy_runs);
    timer_destroy(&t);
    em_gpu_free(o->device, rows);
    free(host_rows);
}

/* ---- push through a table --------------------------------------------------------------- */

static em_backend *one_gpu_backend(const options *o)
{
    em_cuda_backend_options backend_options;
    em_cuda_backend_options_init(&backend_options);
    backend_options.device_count = 1;
    backend_options.devices[0] = (uint32_t)o->device;
    backend_options.memory_fraction = 0.5;
    em_backend *backend = NULL;
    em_error err;
    check_em(em_backend_create_cuda(&backend_options, &backend, &err), &err, "cuda backend");
    return backend;
}

/* PUSH_BATCHES requests' keys drawn before the clock starts: uniform over the PUSH_UNIVERSE
 * present keys, or Zipf with exponent `zipf` (> 0) over the same keys, rank r drawn with
 * probability proportional to 1 / r^zipf and spread over the key space by an odd
 * multiplier, so that the hot keys are not neighbours. */
#define PUSH_BATCHES 16u

static uint64_t *push_key_stream(const options *o, double zipf)
{
    uint64_t *stream = host_alloc((size_t)PUSH_BATCHES * PUSH_KEYS * sizeof(uint64_t));
    em_test_rng rng;
    em_test_rng_init(&rng, o->seed + 2);
    if (zipf <= 0) {
        for (size_t i = 0; i < (size_t)PUSH_BATCHES * PUSH_KEYS; i++)
            stream[i] = em_test_rng_below(&rng, PUSH_UNIVERSE);
        return stream;
    }
    double *cumulative = host_alloc(PUSH_UNIVERSE * sizeof(double));
    double total = 0;
    for (uint32_t rank = 0; rank < PUSH_UNIVERSE; rank++) {
        total += 1.0 / pow((double)rank + 1.0, zipf);
        cumulative[rank] = total;
    }
    for (size_t i = 0; i < (size_t)PUSH_BATCHES * PUSH_KEYS; i++) {
        double u = em_test_rng_unit(&rng) * total;
        uint32_t low = 0, high = PUSH_UNIVERSE - 1; /* the first rank whose sum reaches u */
        while (low < high) {
            uint32_t middle = low + (high - low) / 2;
            if (cumulative[middle] < u)
                low = middle + 1;
            else
                high = middle;
        }
        stream[i] = ((uint64_t)low * 0x9E3779B1u) & (PUSH_UNIVERSE - 1);
    }
    free(cumulative);
    return stream;
}

static double push_rate(const options *o, em_backend *backend, int optimizer,
                        const uint64_t *stream)
{
    const uint32_t dim = 64;
    em_table_config config;
    em_table_config_init(&config, "bench", dim, PUSH_UNIVERSE);
    config.shards = 1;
    config.optimizer.kind = optimizer;
    config.optimizer.learning_rate = 0.01f;
    config.optimizer.eps = 1e-8f;
    config.optimizer.beta1 = 0.9f;
    config.optimizer.beta2 = 0.999f;
    config.initializer.kind = EM_INIT_UNIFORM;
    config.initializer.bound = 0.1f;
    em_table *table = NULL;
    em_error err;
    check_em(em_table_create(backend, &config, &table, &err), &err, "table");
    uint32_t *offsets = host_alloc((PUSH_KEYS + 1) * sizeof(uint32_t));
    uint64_t *keys = host_alloc(PUSH_KEYS * sizeof(uint64_t));
    float *gradients = host_alloc((size_t)PUSH_KEYS * dim * sizeof(float));
    for (uint32_t i = 0; i <= PUSH_KEYS; i++)
        offsets[i] = i;
    for (size_t i = 0; i < (size_t)PUSH_KEYS * dim; i++)
        gradients[i] = 0.001f * (float)(i % 17) - 0.008f;
    em_push_request request = {
        .batch = {.rows = PUSH_KEYS, .nnz = PUSH_KEYS, .offsets = offsets, .keys = keys},
        .combiner = EM_COMBINER_NONE,
        .gradients = gradients,
        .gradient_count = (uint64_t)PUSH_KEYS * dim,
    };
    em_push_result result;
    for (uint64_t start = 0; start < PUSH_UNIVERSE; start += PUSH_KEYS) { /* create them all */
        for (uint32_t i = 0; i < PUSH_KEYS; i++)
            keys[i] = start + i;
        check_em(em_table_push(table, &request, &result, &err), &err, "push (create)");
    }
    uint64_t pushed = 0;
    double busy = 0; /* in em_table_push: the keys' copy into the request is not timed */
    for (uint32_t batch = 0; busy < o->seconds; batch = (batch + 1) % PUSH_BATCHES) {
        memcpy(keys, stream + (size_t)batch * PUSH_KEYS, PUSH_KEYS * sizeof(uint64_t));
        double began = em_test_now();
        check_em(em_table_push(table, &request, &result, &err), &err, "push");
        busy += em_test_now() - began;
        pushed += PUSH_KEYS;
    }
    em_table_destroy(table);
    free(offsets);
    free(keys);
    free(gradients);
    return (double)pushed / busy;
}

static void bench_push(const options *o)
{
    static const char *names[] = {"sgd", "adagrad", "rowwise_adagrad", "adam"};
    printf("\npush: table on one GPU (host side included), %u keys per request from %u "
           "present keys, dim 64, %.1f s each\n", PUSH_KEYS, PUSH_UNIVERSE, o->seconds);
    printf("keys uniform over the present keys, and Zipf 1.2 over them (hot keys repeat "
           "within a request: their gradients are summed first)\n");
    printf("%-16s %15s %15s %12s\n", "optimizer", "uniform Mkeys/s", "zipf1.2 Mkeys/s",
           "uniform/zipf");
    uint64_t *uniform = push_key_stream(o, 0);
    uint64_t *zipf = push_key_stream(o, 1.2);
    em_backend *backend = one_gpu_backend(o);
    for (int optimizer = 0; optimizer < 4; optimizer++) {
        double flat = push_rate(o, backend, optimizer, uniform);
        double skewed = push_rate(o, backend, optimizer, zipf);
        printf("%-16s %15.2f %15.2f %12.2f\n", names[optimizer], flat / 1e6, skewed / 1e6,
               flat / skewed);
    }
    em_backend_destroy(backend);
    free(uniform);
    free(zipf);
}

/* ---- requests with the batch in host memory ----------------------------------------------- */

#define REQUEST_UNIVERSE (1u << 22)
#define REQUEST_DIM 64u
#define BUS_BYTES ((size_t)256 << 20)

/* Pinned host <-> device copy rates, bytes/s (median of the runs). */
static void bus_rates(const options *o, double *to_device, double *to_host)
{
    em_gpu_stream *stream = NULL;
    check(em_gpu_stream_create(o->device, &stream), "stream");
    void *pinned = NULL;
    check(em_gpu_host_alloc(BUS_BYTES, &pinned), "pinned host buffer");
    memset(pinned, 1, BUS_BYTES);
    void *device = device_alloc(o, BUS_BYTES);
    timer t = timer_create(o, stream);
    double *in = host_alloc(o->repeat * sizeof(double)), *out = host_alloc(o->repeat * sizeof(double));
    for (uint32_t r = 0; r < o->repeat; r++) {
        timer_begin(&t);
        check(em_gpu_memcpy_async(stream, device, pinned, BUS_BYTES), "copy to device");
        in[r] = timer_end(&t);
        timer_begin(&t);
        check(em_gpu_memcpy_async(stream, pinned, device, BUS_BYTES), "copy to host");
        out[r] = timer_end(&t);
    }
    *to_device = (double)BUS_BYTES / median(in, o->repeat);
    *to_host = (double)BUS_BYTES / median(out, o->repeat);
    free(in);
    free(out);
    timer_destroy(&t);
    em_gpu_free(o->device, device);
    em_gpu_host_free(pinned);
    em_gpu_stream_destroy(stream);
}

/* One request's buffers: keys, offsets, gradients (push) or the output (pull). */
typedef struct request_buffers {
    em_host_buffers *from; /* NULL: malloc */
    uint64_t *keys;
    uint32_t *offsets;
    float *vectors;
    bool pinned;
} request_buffers;

static request_buffers request_buffers_make(em_host_buffers *from, uint32_t keys)
{
    request_buffers b = {.from = from};
    size_t vector_bytes = (size_t)keys * REQUEST_DIM * sizeof(float);
    b.keys = em_host_buffer_alloc(from, keys * sizeof(uint64_t));
    b.offsets = em_host_buffer_alloc(from, (keys + 1) * sizeof(uint32_t));
    b.vectors = em_host_buffer_alloc(from, vector_bytes);
    if (b.keys == NULL || b.offsets == NULL || b.vectors == NULL) {
        fprintf(stderr, "out of host memory for a request of %u keys\n", keys);
        exit(EXIT_FAILURE);
    }
    b.pinned = em_host_buffer_pinned(from, b.keys, keys * sizeof(uint64_t)) &&
               em_host_buffer_pinned(from, b.vectors, vector_bytes);
    for (uint32_t i = 0; i <= keys; i++)
        b.offsets[i] = i;
    for (size_t i = 0; i < (size_t)keys * REQUEST_DIM; i++)
        b.vectors[i] = 0.001f * (float)(i % 13) - 0.006f;
    return b;
}

static void request_buffers_free(request_buffers *b)
{
    em_host_buffer_free(b->from, b->keys);
    em_host_buffer_free(b->from, b->offsets);
    em_host_buffer_free(b->from, b->vectors);
}

/* Keys per second of requests of `keys` keys (op: 0 pulls and 1 pushes of random present
 * keys, 2 pulls and 3 pushes that create every key they ask for: NEW_REQUESTS of each
 * size per table, keys never asked before, so that the tables' memory stays bounded). */
#define NEW_REQUESTS 8u

/* *waiting gets the share of that time the host spent waiting for the GPU (em_device
 * wait_ns of the table's GPU): the rest is the host's own work on the requests. */
static double request_rate(const options *o, em_table *table, em_device *device,
                           request_buffers *b, uint32_t keys, int op, em_test_rng *rng,
                           double *waiting)
{
    static uint64_t next_new = REQUEST_UNIVERSE; /* the keys "new" requests create */
    bool push = op == 1 || op == 3, fresh = op >= 2;
    em_csr batch = {.rows = keys, .nnz = keys, .offsets = b->offsets, .keys = b->keys};
    em_pull_request pull = {batch, EM_COMBINER_NONE, fresh, b->vectors,
                            (uint64_t)keys * REQUEST_DIM};
    em_push_request pushed = {batch, EM_COMBINER_NONE, b->vectors, (uint64_t)keys * REQUEST_DIM};
    em_pull_result pull_result;
    em_push_result push_result;
    em_error err;
    uint64_t done = 0;
    double busy = 0; /* in the table's calls: drawing the keys is not timed */
    uint64_t waited_before = atomic_load(&device->wait_ns);
    while (fresh ? done < (uint64_t)NEW_REQUESTS * keys : busy < o->seconds || done == 0) {
        for (uint32_t i = 0; i < keys; i++)
            b->keys[i] = fresh ? (next_new++) * 0x9e3779b97f4a7c15ull
                               : em_test_rng_below(rng, REQUEST_UNIVERSE);
        double began = em_test_now();
        if (push)
            check_em(em_table_push(table, &pushed, &push_result, &err), &err, "push");
        else
            check_em(em_table_pull(table, &pull, &pull_result, &err), &err, "pull");
        busy += em_test_now() - began;
        done += keys;
    }
    *waiting = (double)(atomic_load(&device->wait_ns) - waited_before) / 1e9 / busy;
    return (double)done / busy;
}

static void bench_requests(const options *o)
{
    static const uint32_t sizes[] = {4096, 65536, 1048576};
    double to_device = 0.0, to_host = 0.0;
    bus_rates(o, &to_device, &to_host);
    printf("\nrequests: a table on one GPU (sgd, dim %u, %u present keys), the batch in host "
           "memory; new, newp: pulls and pushes whose keys are all created, %u of each size; "
           "bus: the time "
           "its bytes take at the pinned copy rates measured here (to the GPU %.1f GB/s, to "
           "the host %.1f GB/s), over the request's time\n",
           REQUEST_DIM, REQUEST_UNIVERSE, NEW_REQUESTS, to_device / 1e9, to_host / 1e9);
    printf("(wait: the share of the requests' time the host waited for the GPU)\n");
    printf("%-4s %8s %-9s %17s %7s %6s %17s %7s %6s %9s\n", "op", "keys", "buffers",
           "1 shard Mkeys/s", "of bus", "wait", "8 shards Mkeys/s", "of bus", "wait", "1 / 8");
    em_backend *backend = one_gpu_backend(o);
    em_table *tables[2] = {NULL, NULL};
    em_error err;
    for (int t = 0; t < 2; t++) {
        em_table_config config;
        em_table_config_init(&config, t == 0 ? "one" : "eight", REQUEST_DIM,
                             REQUEST_UNIVERSE + 4 * NEW_REQUESTS * (4096 + 65536 + 1048576));
        config.shards = t == 0 ? 1 : 8;
        config.optimizer.kind = EM_OPTIMIZER_SGD;
        config.optimizer.learning_rate = 0.01f;
        check_em(em_table_create(backend, &config, &tables[t], &err), &err, "table");
    }
    for (int t = 0; t < 2; t++) { /* every key of the universe present */
        em_table *table = tables[t];
        request_buffers fill = request_buffers_make(backend->host_buffers, sizes[2]);
        em_push_request request = {
            .batch = {.rows = sizes[2], .nnz = sizes[2], .offsets = fill.offsets,
                      .keys = fill.keys},
            .combiner = EM_COMBINER_NONE,
            .gradients = fill.vectors,
            .gradient_count = (uint64_t)sizes[2] * REQUEST_DIM,
        };
        em_push_result result;
        for (uint64_t start = 0; start < REQUEST_UNIVERSE; start += sizes[2]) {
            for (uint32_t i = 0; i < sizes[2]; i++)
                fill.keys[i] = start + i;
            check_em(em_table_push(table, &request, &result, &err), &err, "push (create)");
        }
        request_buffers_free(&fill);
    }
    em_test_rng rng;
    em_test_rng_init(&rng, o->seed + 3);
    /* pull: 8 key bytes in, dim floats out per key; push: both in */
    double pull_bus = 8.0 / to_device + REQUEST_DIM * 4.0 / to_host;
    double push_bus = (8.0 + REQUEST_DIM * 4.0) / to_device;
    static const char *const op_names[] = {"pull", "push", "new", "newp"};
    for (int op = 0; op < 4; op++) { /* pull, push, then pulls and pushes creating keys */
        for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
            for (int pinned = 0; pinned < 2; pinned++) {
                request_buffers b = request_buffers_make(pinned ? backend->host_buffers : NULL,
                                                         sizes[s]);
                double rates[2], waits[2];
                for (int t = 0; t < 2; t++)
                    rates[t] = request_rate(o, tables[t], backend->devices[0], &b, sizes[s], op,
                                            &rng, &waits[t]);
                double bus = op == 1 || op == 3 ? push_bus : pull_bus;
                printf("%-4s %8u %-9s %17.2f %7.2f %6.2f %17.2f %7.2f %6.2f %8.2fx\n",
                       op_names[op], sizes[s],
                       !pinned ? "pageable" : b.pinned ? "pinned" : "(full)", rates[0] / 1e6,
                       rates[0] * bus, waits[0], rates[1] / 1e6, rates[1] * bus, waits[1],
                       rates[0] / rates[1]);
                request_buffers_free(&b);
            }
        }
    }
    /* what the host's check of a push's gradients costs (em_table_push leaves it to the
     * GPU when the push goes at once, unless it goes the general way) */
    uint32_t cpus = em_parallel_cpus();
    em_parallel_pool *workers = backend->workers; /* the threads em_table_push takes */
    printf("the host's check of a push's gradients (em_csr_check_gradients_on), pageable, on 1 "
           "thread and on up to %u (the CPUs, as em_table_push does from %" PRIu64 " floats):",
           cpus, 2 * EM_CSR_CHECK_FLOATS_PER_THREAD);
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        request_buffers b = request_buffers_make(NULL, sizes[s]);
        em_csr batch = {.rows = sizes[s], .nnz = sizes[s], .offsets = b.offsets, .keys = b.keys};
        double ms[2];
        for (int threaded = 0; threaded < 2; threaded++) {
            double began = em_test_now(), now = began;
            uint32_t runs = 0;
            for (; runs == 0 || now - began < 0.2; runs++) {
                check_em(em_csr_check_gradients_on(&batch, EM_COMBINER_NONE, REQUEST_DIM,
                                                   b.vectors, workers, threaded ? cpus : 1,
                                                   NULL, &err),
                         &err, "check");
                now = em_test_now();
            }
            ms[threaded] = (now - began) / runs * 1e3;
        }
        printf(" %u keys %.3f / %.3f ms%s", sizes[s], ms[0], ms[1],
               s + 1 < sizeof(sizes) / sizeof(sizes[0]) ? "," : "\n");
        request_buffers_free(&b);
    }
    for (int t = 0; t < 2; t++) {
        em_table_stats stats;
        em_table_get_stats(tables[t], &stats);
        printf("%s: %" PRIu64 " of %" PRIu64 " pulls and %" PRIu64 " of %" PRIu64
               " pushes with one wait\n",
               t == 0 ? "1 shard" : "8 shards", stats.pulls_at_once, stats.pulls,
               stats.pushes_at_once, stats.pushes);
    }
    em_host_buffers_stats stats;
    em_host_buffers_get_stats(backend->host_buffers, &stats);
    printf("copied directly %.1f GB, staged %.1f GB\n", (double)stats.bytes_copied_directly / 1e9,
           (double)stats.bytes_copied_staged / 1e9);
    for (int t = 0; t < 2; t++)
        em_table_destroy(tables[t]);
    em_backend_destroy(backend);
}

/* ---- pool against cudaMalloc -------------------------------------------------------------- */

static em_status pool_reserve(void *context, size_t bytes, uintptr_t *base, em_error *err)
{
    const options *o = context;
    void *pointer = NULL;
    em_gpu_status status = em_gpu_malloc(o->device, bytes, &pointer);
    if (status.code != 0)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "%s: %s", status.call, status.message);
    *base = (uintptr_t)pointer;
    return EM_OK;
}

static void pool_release(void *context, uintptr_t base, size_t bytes)
{
    (void)bytes;
    const options *o = context;
    em_gpu_free(o->device, (void *)base);
}

/* Sizes log-uniform in 256 B .. 16 MiB, and which live block each operation replaces. */
typedef struct pool_sequence {
    size_t *sizes;
    uint32_t *victims;
} pool_sequence;

static pool_sequence make_sequence(uint64_t seed, uint32_t operations)
{
    pool_sequence s = {.sizes = host_alloc(operations * sizeof(size_t)),
                       .victims = host_alloc(operations * sizeof(uint32_t))};
    em_test_rng rng;
    em_test_rng_init(&rng, seed);
    for (uint32_t i = 0; i < operations; i++) {
        uint32_t shift = 8 + (uint32_t)em_test_rng_below(&rng, 17); /* 2^8 .. 2^24 */
        s.sizes[i] = ((size_t)1 << shift) + em_test_rng_below(&rng, (uint64_t)1 << shift);
        if (s.sizes[i] > ((size_t)16 << 20))
            s.sizes[i] = (size_t)16 << 20;
        s.victims[i] = (uint32_t)em_test_rng_below(&rng, POOL_LIVE);
    }
    return s;
}

/* Operations per second (one free of a live block, when there is one, and one alloc). */
static double pool_ops(em_pool *pool, const pool_sequence *s, uint32_t operations)
{
    uintptr_t live[POOL_LIVE] = {0};
    em_error err;
    double began = em_test_now();
    for (uint32_t i = 0; i < operations; i++) {
        uintptr_t *slot = &live[s->victims[i]];
        if (*slot != 0)
            em_pool_free(pool, *slot, NULL);
        check_em(em_pool_alloc(pool, s->sizes[i], slot, &err), &err, "pool alloc");
    }
    double seconds = em_test_now() - began;
    for (uint32_t i = 0; i < POOL_LIVE; i++)
        if (live[i] != 0)
            em_pool_free(pool, live[i], NULL);
    return (double)operations / seconds;
}

static double cuda_malloc_ops(const options *o, const pool_sequence *s, uint32_t operations)
{
    void *live[POOL_LIVE] = {0};
    double began = em_test_now();
    for (uint32_t i = 0; i < operations; i++) {
        void **slot = &live[s->victims[i]];
        em_gpu_free(o->device, *slot);
        check(em_gpu_malloc(o->device, s->sizes[i], slot), "cudaMalloc");
    }
    double seconds = em_test_now() - began;
    for (uint32_t i = 0; i < POOL_LIVE; i++)
        em_gpu_free(o->device, live[i]);
    return (double)operations / seconds;
}

static void bench_pool(const options *o)
{
    printf("\npool: alloc + free of random sizes 256 B .. 16 MiB, %u live blocks, same "
           "sequence for both\n", POOL_LIVE);
    printf("%-22s %12s %10s\n", "allocator", "ops/s", "us/op");
    pool_sequence s = make_sequence(o->seed + 3, POOL_OPS);
    em_pool_options pool_options = {
        .name = "bench",
        .initial_bytes = POOL_REGION_BYTES,
        .growth_bytes = 0,
        .limit_bytes = POOL_REGION_BYTES,
        .provider = {.reserve = pool_reserve, .release = pool_release, .context = (void *)o},
    };
    em_pool *pool = NULL;
    em_error err;
    check_em(em_pool_create(&pool_options, &pool, &err), &err, "pool");
    double pool_rate = pool_ops(pool, &s, POOL_OPS);
    em_pool_destroy(pool);
    double cuda_rate = cuda_malloc_ops(o, &s, CUDA_MALLOC_OPS);
    printf("%-22s %12.0f %10.3f\n", "em_pool (device)", pool_rate, 1e6 / pool_rate);
    printf("%-22s %12.0f %10.3f\n", "cudaMalloc/cudaFree", cuda_rate, 1e6 / cuda_rate);
    printf("(cudaMalloc timed over the first %u operations of the sequence)\n", CUDA_MALLOC_OPS);
    free(s.sizes);
    free(s.victims);
}

/* ---- main --------------------------------------------------------------------------------- */

static void usage(const char *program)
{
    fprintf(stderr,
            "usage: %s [--device N (default 0)] [--slots N (default %u)]\n"
            "       [--repeat N (1..%u, default %u)] [--seconds S (default 2)]\n",
            program, DEFAULT_SLOTS, MAX_REPEAT, DEFAULT_REPEAT);
    exit(EXIT_FAILURE);
}

static options parse_options(int argc, char **argv)
{
    options o = {.device = 0, .slots = DEFAULT_SLOTS, .repeat = DEFAULT_REPEAT, .seconds = 2.0,
                 .seed = 1};
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc)
            usage(argv[0]);
        const char *value = argv[++i];
        char *end = NULL;
        if (strcmp(argv[i - 1], "--device") == 0)
            o.device = (int)strtol(value, &end, 0);
        else if (strcmp(argv[i - 1], "--slots") == 0)
            o.slots = strtoull(value, &end, 0);
        else if (strcmp(argv[i - 1], "--repeat") == 0)
            o.repeat = (uint32_t)strtoul(value, &end, 0);
        else if (strcmp(argv[i - 1], "--seconds") == 0)
            o.seconds = strtod(value, &end);
        else
            usage(argv[0]);
        if (end == value || *end != '\0')
            usage(argv[0]);
    }
    if (o.repeat < 1 || o.repeat > MAX_REPEAT || o.slots < 2 * (uint64_t)KEYS_PER_CALL ||
        o.seconds <= 0.0 || o.device < 0)
        usage(argv[0]);
    return o;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* each line out at once: a run cut short keeps them */
    options o = parse_options(argc, argv);
    uint32_t gpus = 0;
    em_error err;
    em_status available = em_cuda_available(&gpus, &err);
    if (available != EM_OK) {
        printf("bench_gpu: %s\n", err.message);
        return available == EM_NOT_FOUND ? 77 : EXIT_FAILURE;
    }
    if ((uint32_t)o.device >= gpus) {
        fprintf(stderr, "--device %d: %u GPU(s) visible\n", o.device, gpus);
        return EXIT_FAILURE;
    }
    em_gpu_device_info info;
    check(em_gpu_device_info_get(o.device, &info), "device");
    printf("ember GPU benchmarks on GPU %d: %s (sm_%u%u, %u SMs, %.1f GiB), median of %u runs\n",
           o.device, info.name, info.compute_major, info.compute_minor, info.multiprocessors,
           (double)info.total_bytes / (double)(1u << 30), o.repeat);
    printf("command:");
    for (int i = 0; i < argc; i++)
        printf(" %s", argv[i]);
    printf("\n");
    em_gpu_stream *stream = NULL;
    check(em_gpu_stream_create(o.device, &stream), "stream");
    bench_hash_map(&o, stream);
    bench_gather(&o, stream);
    em_gpu_stream_destroy(stream);
    bench_push(&o);
    bench_requests(&o);
    bench_pool(&o);
    return EXIT_SUCCESS;
}
