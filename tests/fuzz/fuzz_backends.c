/*
 * libFuzzer harness: the CPU backend against the CUDA backend's C code over the emulated
 * kernels (tests/support/kernels_emulated.c), fed the same requests. The backends
 * promise the same semantics (README "Semantics"; lib/table/table_config.h for the
 * capacity policies): every answer, every counter, the rows kept and the keys evicted
 * must be the same on both, request after request.
 *
 *   byte 0  bits 0-1  dim: 1, 3, 8 or 33
 *           bits 2-3  shards: 1 to 4
 *           bits 4-5  optimizer: sgd, adagrad, rowwise_adagrad, adam
 *           bits 6-7  eviction: none, lru, lfu, age
 *   byte 1  bits 0-3  capacity: 8 to 68 rows, by 4
 *           bits 4-5  admission: always, always, counter (threshold 2), probability 0.5
 *           bit 6     expiry: max_age_steps 6
 *           bit 7     headroom 0.25
 *   byte 2  bit 0     the GPU backend over two emulated GPUs instead of one
 *           bit 1     initializer zeros instead of uniform
 *           bit 2     every eviction chosen on the GPU (gpu_choice_entries 1), not on
 *                     the host as for windows this short by default
 *           bit 3     an evicted-key ring of 5 keys instead of 256 (a request's
 *                     evictions push out the ring's older keys, and their own)
 *           bit 4     the CPU backend with two devices (its shards spread over them)
 *           bit 5     the emulated kernels run when their stream is waited for, not
 *                     when enqueued (EMBER_EMULATED_LATE)
 *           bit 6     each launch's items in an order of its own (EMBER_EMULATED_ORDER
 *                     scattered), not in index order
 *   then    requests, each a byte (the kind, below) and what it takes:
 *           0-2 pull, 3-5 push: a byte of flags (combiner, create_missing, gradient
 *           shapes) and a batch (a byte of rows, then a byte of keys per row, then a
 *           byte per key: key = byte modulo twice the capacity, or one of the sentinel
 *           and edge keys); a push's gradients are small multiples of 1/64, or, where its
 *           flags say, one of them NaN, infinite or huge
 *           6 erase: a batch's keys
 *           7 erase_older: a byte, the pushes a row must have been pushed within
 *           8 expire: a whole sweep, a slice a shard
 *           9 import: a batch's keys, each row's floats (weights and state) small
 *           multiples of 1/16, or where a byte says one of them NaN or negative (a
 *           row the import must refuse, an accumulator below zero)
 *           10 save each table and load each checkpoint on the other backend: the
 *           tables swap, and go on as they were (rows, state, access metadata, clocks,
 *           admission counts, the evicted keys), at most once an input
 *
 * Evictions compare whole shards (candidates 1,024 > capacity), so that the rows chosen
 * depend on the policy's order alone, not on where each map placed its keys (the
 * choice among a cut of the map is exact on both backends, but the two maps cut their
 * slots in different places).
 *
 * What must hold after each request: the same status on both (or the same error code),
 * a pull's outputs bit for bit, the same counts (unique, missing, created, updated,
 * erased, expired) and the same table counters; after the last: every row (weights and
 * optimizer state) bit for bit, and the same evicted keys in the same order. A
 * mismatch aborts, naming the request and what differed.
 */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lib/checkpoint/checkpoint.h"
#include "lib/device/backend.h"
#include "lib/table/table.h"
#include "tests/support/kernels_emulated.h"
#include "tests/support/test_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_REQUESTS 48
#define MAX_BATCH_ROWS 6
#define MAX_ROW_KEYS 4
#define MAX_KEYS (MAX_BATCH_ROWS * MAX_ROW_KEYS)
#define MAX_DIM 33
#define CPU 0
#define GPU 1

static const char *const backend_names[2] = {"cpu", "cuda (emulated)"};

/* ---- failing ------------------------------------------------------------------------ */

static int request_number;

/* EMBER_FUZZ_TRACE set: each request is printed as it runs (to read a failing input). */
static bool tracing;

__attribute__((format(printf, 1, 2))) static void trace(const char *format, ...)
{
    if (!tracing)
        return;
    va_list args;
    va_start(args, format);
    fprintf(stderr, "  %d: ", request_number);
    vfprintf(stderr, format, args);
    fprintf(stderr, "\n");
    va_end(args);
}

static void trace_batch(const char *what, const em_csr *csr, uint8_t flags)
{
    if (!tracing)
        return;
    char text[1024];
    size_t used = 0;
    for (uint32_t r = 0; r < csr->rows; r++) {
        used += (size_t)snprintf(text + used, sizeof(text) - used, "[");
        for (uint32_t k = csr->offsets[r]; k < csr->offsets[r + 1]; k++)
            used += (size_t)snprintf(text + used, sizeof(text) - used, "%s%" PRIu64,
                                     k == csr->offsets[r] ? "" : " ", csr->keys[k]);
        used += (size_t)snprintf(text + used, sizeof(text) - used, "]");
    }
    trace("%s flags 0x%02x %s", what, flags, text);
}

__attribute__((noreturn, format(printf, 1, 2))) static void fail_input(const char *format, ...)
{
    va_list args;
    va_start(args, format);
    fprintf(stderr, "fuzz_backends: request %d: ", request_number);
    vfprintf(stderr, format, args);
    fprintf(stderr, "\n");
    va_end(args);
    abort();
}

static void must(em_status status, const em_error *err, const char *what, int side)
{
    if (status != EM_OK)
        fail_input("%s on the %s backend failed: %s", what, backend_names[side], err->message);
}

/* ---- the input ---------------------------------------------------------------------- */

typedef struct input {
    const uint8_t *bytes;
    size_t left;
} input;

static uint8_t take(input *in)
{
    if (in->left == 0)
        return 0;
    in->left--;
    return *in->bytes++;
}

/* Keys beside the small ones: the map's two reserved slot markers and other edges. */
static const uint64_t edge_keys[8] = {
    UINT64_MAX, UINT64_MAX - 1, UINT64_MAX - 2, UINT64_C(1) << 63,
    UINT64_C(1) << 32, UINT64_C(0xdeadbeefcafef00d), UINT64_C(0x8000000000000001), 0,
};

typedef struct batch {
    uint32_t offsets[MAX_BATCH_ROWS + 1];
    uint64_t keys[MAX_KEYS];
    em_csr csr;
} batch;

static void read_batch(input *in, uint64_t key_space, batch *b)
{
    uint32_t rows = take(in) % MAX_BATCH_ROWS + 1;
    b->offsets[0] = 0;
    uint32_t nnz = 0;
    for (uint32_t r = 0; r < rows; r++) {
        uint32_t count = take(in) % (MAX_ROW_KEYS + 1);
        for (uint32_t k = 0; k < count; k++) {
            uint8_t byte = take(in);
            b->keys[nnz++] = byte >= 248 ? edge_keys[byte - 248] : byte % key_space;
        }
        b->offsets[r + 1] = nnz;
    }
    b->csr = (em_csr){.rows = rows, .nnz = nnz, .offsets = b->offsets, .keys = b->keys};
}

/* ---- the backends, made once ----------------------------------------------------------- */

static em_backend *cpu_backends[2]; /* one device, two */
static em_backend *gpu_backends[2][2]; /* [one emulated GPU, two][choice: host, GPU] */
static char scratch[4096];

/* Empties the scratch directory (the checkpoints of a swap). */
static void clear_scratch(void)
{
    em_test_remove_tree(scratch);
    if (mkdir(scratch, 0700) != 0)
        fail_input("cannot make %s again", scratch);
}

static void remove_scratch(void)
{
    em_test_remove_tree(scratch);
}

static void make_backends(void)
{
    if (cpu_backends[0] != NULL)
        return;
    em_error err;
    for (uint32_t c = 0; c < 2; c++) {
        em_cpu_backend_options cpu;
        em_cpu_backend_options_init(&cpu);
        cpu.devices = c + 1;
        cpu.pool_limit_bytes = UINT64_C(64) << 20;
        cpu.pool_initial_bytes = UINT64_C(4) << 20;
        cpu.pool_growth_bytes = UINT64_C(4) << 20;
        must(em_backend_create_cpu(&cpu, &cpu_backends[c], &err), &err, "creating the backend",
             CPU);
    }
    for (uint32_t g = 0; g < 4; g++) {
        em_cuda_backend_options cuda;
        em_cuda_backend_options_init(&cuda);
        cuda.device_count = g % 2 + 1;
        for (uint32_t d = 0; d < cuda.device_count; d++)
            cuda.devices[d] = d;
        cuda.gpu_choice_entries = g < 2 ? 0 : 1;
        cuda.pool_bytes = UINT64_C(16) << 20;
        cuda.staging_bytes = UINT64_C(1) << 20;
        cuda.pinned_buffer_bytes = 0;
        cuda.host_staged_exchange = true;
        must(em_backend_create_cuda(&cuda, &gpu_backends[g % 2][g / 2], &err), &err,
             "creating the backend", GPU);
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(scratch, sizeof(scratch), "%s/ember-fuzz-backends-XXXXXX",
             tmp != NULL && tmp[0] != '\0' ? tmp : "/tmp");
    if (mkdtemp(scratch) == NULL) /* the X's: mkdtemp's template for a unique name */
        fail_input("cannot make a scratch directory %s", scratch);
    atexit(remove_scratch);
}

/* ---- comparing ---------------------------------------------------------------------- */

static void compare_counters(em_table *const tables[2])
{
    em_table_stats s[2];
    for (int t = 0; t < 2; t++)
        em_table_get_stats(tables[t], &s[t]);
#define SAME(field)                                                                          \
    if (s[CPU].field != s[GPU].field)                                                        \
        fail_input("table counter " #field ": cpu %" PRIu64 ", cuda %" PRIu64,               \
                   (uint64_t)s[CPU].field, (uint64_t)s[GPU].field);
    SAME(rows)
    SAME(rows_evicted)
    SAME(rows_expired)
    SAME(rows_erased)
    SAME(pushes_dropped)
    SAME(pulls_not_admitted)
    SAME(row_floats)
#undef SAME
}

typedef struct rows_of {
    uint64_t count;
    uint64_t *keys;
    float *values;
} rows_of;

/* Every row of the table, sorted by key (row_floats floats each). */
static rows_of read_rows(em_table *table, uint32_t row_floats, int side)
{
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    rows_of out = {0};
    uint64_t room = stats.rows + 1;
    uint64_t *keys = malloc(room * sizeof(uint64_t));
    float *values = malloc(room * row_floats * sizeof(float));
    em_table_cursor cursor = {0};
    em_error err;
    for (;;) {
        uint64_t got = 0;
        if (out.count == room)
            fail_input("the %s table exported more rows than its %" PRIu64, backend_names[side],
                       stats.rows);
        must(em_table_export(table, &cursor, room - out.count, keys + out.count,
                             values + out.count * row_floats, &got, &err),
             &err, "export", side);
        if (got == 0)
            break;
        out.count += got;
    }
    /* insertion sort by key, moving the values along: tables here hold few rows */
    float *moving = malloc(row_floats * sizeof(float));
    for (uint64_t i = 1; i < out.count; i++) {
        uint64_t key = keys[i];
        memcpy(moving, values + i * row_floats, row_floats * sizeof(float));
        uint64_t j = i;
        for (; j > 0 && keys[j - 1] > key; j--) {
            keys[j] = keys[j - 1];
            memcpy(values + j * row_floats, values + (j - 1) * row_floats,
                   row_floats * sizeof(float));
        }
        keys[j] = key;
        memcpy(values + j * row_floats, moving, row_floats * sizeof(float));
    }
    free(moving);
    out.keys = keys;
    out.values = values;
    return out;
}

static void compare_rows(em_table *const tables[2])
{
    em_table_stats stats;
    em_table_get_stats(tables[CPU], &stats);
    uint32_t row_floats = (uint32_t)stats.row_floats;
    rows_of r[2] = {read_rows(tables[CPU], row_floats, CPU),
                    read_rows(tables[GPU], row_floats, GPU)};
    if (r[CPU].count != r[GPU].count)
        fail_input("rows exported: cpu %" PRIu64 ", cuda %" PRIu64, r[CPU].count, r[GPU].count);
    for (uint64_t i = 0; i < r[CPU].count; i++) {
        if (r[CPU].keys[i] != r[GPU].keys[i])
            fail_input("row %" PRIu64 " by key: cpu key %" PRIu64 ", cuda key %" PRIu64, i,
                       r[CPU].keys[i], r[GPU].keys[i]);
        const float *a = r[CPU].values + i * row_floats, *b = r[GPU].values + i * row_floats;
        for (uint32_t f = 0; f < row_floats; f++)
            if (memcmp(&a[f], &b[f], sizeof(float)) != 0)
                fail_input("key %" PRIu64 " float %u (weights then state): cpu %.9g, cuda %.9g",
                           r[CPU].keys[i], f, (double)a[f], (double)b[f]);
    }
    for (int t = 0; t < 2; t++) {
        free(r[t].keys);
        free(r[t].values);
    }
}

static void compare_evicted(em_table *const tables[2])
{
    uint64_t keys[2][256];
    em_evicted_view view[2];
    em_error err;
    for (int t = 0; t < 2; t++)
        must(em_table_evicted(tables[t], 0, 256, keys[t], &view[t], &err), &err, "evicted", t);
    if (view[CPU].total != view[GPU].total || view[CPU].count != view[GPU].count ||
        view[CPU].first != view[GPU].first)
        fail_input("evicted keys: cpu %" PRIu64 " in all, %" PRIu64 " kept from %" PRIu64
                   "; cuda %" PRIu64 ", %" PRIu64 " from %" PRIu64,
                   view[CPU].total, view[CPU].count, view[CPU].first, view[GPU].total,
                   view[GPU].count, view[GPU].first);
    for (uint64_t i = 0; i < view[CPU].count; i++)
        if (keys[CPU][i] != keys[GPU][i])
            fail_input("evicted key %" PRIu64 ": cpu %" PRIu64 ", cuda %" PRIu64,
                       view[CPU].first + i, keys[CPU][i], keys[GPU][i]);
}

static void compare_status(const em_status status[2], const em_error err[2], const char *what)
{
    if (status[CPU] != status[GPU])
        fail_input("%s: cpu %s (%s), cuda %s (%s)", what, em_status_name(status[CPU]),
                   status[CPU] == EM_OK ? "" : err[CPU].message, em_status_name(status[GPU]),
                   status[GPU] == EM_OK ? "" : err[GPU].message);
}

/* ---- requests ----------------------------------------------------------------------- */

/* A pull's or a push's flags byte and batch; returns the flags. */
static uint8_t read_request(input *in, uint64_t key_space, const char *what, batch *b)
{
    uint8_t flags = take(in);
    read_batch(in, key_space, b);
    trace_batch(what, &b->csr, flags);
    return flags;
}

static void pull(em_table *const tables[2], input *in, uint64_t key_space, uint32_t dim)
{
    batch b;
    uint8_t flags = read_request(in, key_space, "pull", &b);
    em_combiner combiner = (em_combiner)(flags % 4);
    uint64_t floats = em_csr_output_vectors(&b.csr, combiner) * dim;
    float out[2][MAX_KEYS * MAX_DIM];
    em_pull_result result[2];
    em_status status[2];
    em_error err[2];
    for (int t = 0; t < 2; t++) {
        memset(out[t], 0, sizeof(out[t]));
        em_pull_request request = {.batch = b.csr, .combiner = combiner,
                                   .create_missing = (flags & 4) == 0, .out = out[t],
                                   .out_capacity = floats};
        status[t] = em_table_pull(tables[t], &request, &result[t], &err[t]);
    }
    compare_status(status, err, "pull");
    if (status[CPU] != EM_OK)
        return;
    if (result[CPU].unique_keys != result[GPU].unique_keys ||
        result[CPU].missing != result[GPU].missing || result[CPU].created != result[GPU].created)
        fail_input("pull: cpu %" PRIu64 " unique, %" PRIu64 " missing, %" PRIu64 " created; cuda %"
                   PRIu64 ", %" PRIu64 ", %" PRIu64,
                   result[CPU].unique_keys, result[CPU].missing, result[CPU].created,
                   result[GPU].unique_keys, result[GPU].missing, result[GPU].created);
    for (uint64_t i = 0; i < floats; i++)
        if (memcmp(&out[CPU][i], &out[GPU][i], sizeof(float)) != 0)
            fail_input("pull output float %" PRIu64 " (vector %" PRIu64 "): cpu %.9g, cuda %.9g", i,
                       i / dim, (double)out[CPU][i], (double)out[GPU][i]);
}

static void push(em_table *const tables[2], input *in, uint64_t key_space, uint32_t dim)
{
    batch b;
    uint8_t flags = read_request(in, key_space, "push", &b);
    em_combiner combiner = (em_combiner)(flags % 4);
    uint64_t floats = em_csr_output_vectors(&b.csr, combiner) * dim;
    float gradients[MAX_KEYS * MAX_DIM];
    for (uint64_t i = 0; i < floats; i++)
        gradients[i] = (float)((int)(i * 7 + flags) % 17 - 8) / 64.0f;
    if ((flags & 8) != 0 && floats > 0) { /* one element that a push must refuse, or huge */
        static const float odd[4] = {NAN, INFINITY, -INFINITY, 3e38f};
        gradients[take(in) % floats] = odd[(flags >> 4) % 4];
    }
    em_push_result result[2];
    em_status status[2];
    em_error err[2];
    for (int t = 0; t < 2; t++) {
        em_push_request request = {.batch = b.csr, .combiner = combiner, .gradients = gradients,
                                   .gradient_count = floats};
        status[t] = em_table_push(tables[t], &request, &result[t], &err[t]);
    }
    compare_status(status, err, "push");
    if (status[CPU] == EM_OK &&
        (result[CPU].updated != result[GPU].updated || result[CPU].created != result[GPU].created))
        fail_input("push: cpu %" PRIu64 " updated, %" PRIu64 " created; cuda %" PRIu64 ", %" PRIu64,
                   result[CPU].updated, result[CPU].created, result[GPU].updated,
                   result[GPU].created);
}

static void erase(em_table *const tables[2], input *in, uint64_t key_space)
{
    batch b;
    read_batch(in, key_space, &b);
    trace_batch("erase", &b.csr, 0);
    uint64_t erased[2] = {0, 0};
    em_status status[2];
    em_error err[2];
    for (int t = 0; t < 2; t++)
        status[t] = em_table_erase(tables[t], b.keys, b.csr.nnz, &erased[t], &err[t]);
    compare_status(status, err, "erase");
    if (erased[CPU] != erased[GPU])
        fail_input("erase: cpu erased %" PRIu64 ", cuda %" PRIu64, erased[CPU], erased[GPU]);
}

static void erase_older(em_table *const tables[2], input *in)
{
    uint32_t not_pushed_for = take(in) % 12;
    trace("erase_older %u", not_pushed_for);
    uint64_t erased[2] = {0, 0};
    em_status status[2];
    em_error err[2];
    for (int t = 0; t < 2; t++)
        status[t] = em_table_erase_older(tables[t], not_pushed_for, &erased[t], &err[t]);
    compare_status(status, err, "erase_older");
    if (erased[CPU] != erased[GPU])
        fail_input("erase_older: cpu erased %" PRIu64 ", cuda %" PRIu64, erased[CPU], erased[GPU]);
}

/* A whole sweep of expiry, a slice a shard: slices of a sweep examine the rows each map
 * holds from where the last one stopped, and the two backends' maps hold their rows in
 * different orders, so only whole sweeps compare. */
static void expire(em_table *const tables[2], uint32_t shards)
{
    trace("expire");
    uint64_t expired[2] = {0, 0};
    em_status status[2];
    em_error err[2];
    for (int t = 0; t < 2; t++) {
        status[t] = EM_OK;
        for (uint32_t s = 0; s < shards && status[t] == EM_OK; s++) {
            uint64_t slice = 0;
            status[t] = em_table_expire(tables[t], UINT64_C(1) << 20, &slice, &err[t]);
            expired[t] += slice;
        }
    }
    compare_status(status, err, "expire");
    if (expired[CPU] != expired[GPU])
        fail_input("expire: cpu expired %" PRIu64 ", cuda %" PRIu64, expired[CPU], expired[GPU]);
}

static void import(em_table *const tables[2], input *in, uint64_t key_space)
{
    batch b;
    read_batch(in, key_space, &b);
    trace_batch("import", &b.csr, 0);
    em_table_stats stats;
    em_table_get_stats(tables[CPU], &stats);
    uint64_t row_floats = stats.row_floats;
    float values[MAX_KEYS * (3 * MAX_DIM + 1)];
    for (uint64_t i = 0; i < b.csr.nnz * row_floats; i++)
        values[i] = (float)((int)(i * 5 % 13)) / 16.0f;
    uint8_t odd = take(in);
    if (odd >= 224 && b.csr.nnz > 0) /* one element NaN or negative */
        values[take(in) % (b.csr.nnz * row_floats)] = (odd & 1) != 0 ? NAN : -1.0f;
    em_status status[2];
    em_error err[2];
    for (int t = 0; t < 2; t++)
        status[t] = em_table_import(tables[t], b.keys, values, b.csr.nnz, &err[t]);
    compare_status(status, err, "import");
}

/* Saves each table and loads its checkpoint on the other backend. */
static void swap_through_checkpoints(em_table *tables[2], em_backend *backends[2])
{
    char dirs[2][128];
    em_table *loaded[2] = {NULL, NULL};
    em_error err;
    for (int t = 0; t < 2; t++) {
        snprintf(dirs[t], sizeof(dirs[t]), "%s/%s", scratch, t == CPU ? "cpu" : "cuda");
        em_checkpoint_options options;
        em_checkpoint_options_init(&options, dirs[t]);
        em_checkpoint_info info;
        must(em_checkpoint_save(tables[t], &options, &info, &err), &err, "save", t);
        must(em_checkpoint_load(info.path, backends[1 - t], NULL, NULL, &loaded[1 - t], &info,
                                &err),
             &err, "load of the other backend's checkpoint", 1 - t);
    }
    for (int t = 0; t < 2; t++) {
        em_table_destroy(tables[t]);
        tables[t] = loaded[t];
    }
    clear_scratch();
}

/* ---- one input ---------------------------------------------------------------------- */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    make_backends();
    tracing = getenv("EMBER_FUZZ_TRACE") != NULL;
    input in = {.bytes = data, .left = size};
    uint8_t shape = take(&in), policy = take(&in), place = take(&in);
    em_gpu_emulated_set_late((place & 32) != 0);
    em_gpu_emulated_set_order((place & 64) != 0 ? "scattered" : "forward");

    static const uint32_t dims[4] = {1, 3, 8, MAX_DIM};
    static const em_optimizer_config optimizers[4] = {
        {.kind = EM_OPTIMIZER_SGD, .learning_rate = 0.05f},
        {.kind = EM_OPTIMIZER_ADAGRAD, .learning_rate = 0.1f, .eps = 1e-10f,
         .initial_accumulator = 0.01f},
        {.kind = EM_OPTIMIZER_ROWWISE_ADAGRAD, .learning_rate = 0.1f, .eps = 1e-10f},
        {.kind = EM_OPTIMIZER_ADAM, .learning_rate = 0.01f, .eps = 1e-8f, .beta1 = 0.9f,
         .beta2 = 0.999f},
    };
    static const int evictions[4] = {EM_EVICTION_NONE, EM_EVICTION_LRU, EM_EVICTION_LFU,
                                      EM_EVICTION_AGE};
    uint32_t dim = dims[shape % 4];
    em_table_config config;
    em_table_config_init(&config, "t", dim, 8 + 4 * (uint64_t)(policy % 16));
    config.shards = 1 + (shape >> 2) % 4;
    config.optimizer = optimizers[(shape >> 4) % 4];
    config.eviction.policy = evictions[shape >> 6];
    config.eviction.candidates = EM_EVICTION_CANDIDATES_MAX;
    config.eviction.ring = (place & 8) != 0 ? 5 : 256;
    if ((policy & 0x40) != 0)
        config.eviction.max_age_steps = 6;
    if ((policy & 0x80) != 0 && config.eviction.policy != EM_EVICTION_NONE)
        config.eviction.headroom = 0.25;
    int admission = (policy >> 4) % 4;
    if (admission == 2) {
        config.admission.policy = EM_ADMISSION_COUNTER;
        config.admission.threshold = 2;
    } else if (admission == 3) {
        config.admission.policy = EM_ADMISSION_PROBABILITY;
        config.admission.probability = 0.5;
    }
    config.initializer.kind = (place & 2) != 0 ? EM_INIT_ZEROS : EM_INIT_UNIFORM;
    config.initializer.bound = 0.5f;
    config.initializer.seed = 99;

    trace("dim %u, capacity %" PRIu64 ", %u shards, optimizer %d, eviction %d (headroom %.2f, "
          "max_age_steps %u), admission %d, initializer %d, %d GPU(s), choice on the %s, "
          "kernels run %s, items %s",
          dim, config.capacity, config.shards, config.optimizer.kind, config.eviction.policy,
          config.eviction.headroom, config.eviction.max_age_steps, config.admission.policy,
          config.initializer.kind, (place & 1) + 1, (place & 4) != 0 ? "GPU" : "host",
          (place & 32) != 0 ? "late" : "at once", (place & 64) != 0 ? "scattered" : "in order");
    em_backend *backends[2] = {cpu_backends[(place >> 4) & 1],
                               gpu_backends[place & 1][(place >> 2) & 1]};
    em_table *tables[2] = {NULL, NULL};
    em_error err;
    for (int t = 0; t < 2; t++)
        must(em_table_create(backends[t], &config, &tables[t], &err), &err, "create", t);

    uint64_t key_space = 2 * config.capacity;
    bool swapped = false;
    for (request_number = 0; request_number < MAX_REQUESTS && in.left > 0; request_number++) {
        switch (take(&in) % 11) {
        case 0: case 1: case 2:
            pull(tables, &in, key_space, dim);
            break;
        case 3: case 4: case 5:
            push(tables, &in, key_space, dim);
            break;
        case 6:
            erase(tables, &in, key_space);
            break;
        case 7:
            erase_older(tables, &in);
            break;
        case 8:
            expire(tables, config.shards);
            break;
        case 9:
            import(tables, &in, key_space);
            break;
        default:
            if (!swapped) {
                trace("swap through checkpoints");
                swap_through_checkpoints(tables, backends);
                swapped = true;
                compare_rows(tables);
            }
            break;
        }
        compare_counters(tables);
    }
    compare_rows(tables);
    compare_evicted(tables);
    for (int t = 0; t < 2; t++)
        em_table_destroy(tables[t]);
    return 0;
}
