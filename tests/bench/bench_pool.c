/*
 * Benchmark of the pool allocator. Prints three tables and the command that
 * reproduces them:
 *
 *  1. alloc/free pairs per second with a steady working set (each step frees a random
 *     live block and allocates a new one), the pool against glibc malloc/free on the
 *     exact same sequence of sizes and victims. The pool runs over host memory with
 *     MAP_NORESERVE and never touches the bytes, and neither does the malloc run, so
 *     both measure bookkeeping only (malloc's includes its mmap/munmap calls for
 *     large blocks: that is what it costs).
 *  2. the cost of one alloc/free pair as the number of free holes grows, to show that
 *     best fit does not scan the free chunks.
 *  3. fragmentation, largest free block and free chunks at the end of table 1's runs.
 *
 * Options: --ops N (steps of table 1, default 1000000), --probe-ops N (pairs per row of
 * table 2, default 200000), --max-holes N (largest row of table 2, default 100000),
 * --seed N. The default run takes well under a minute.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>

#include "lib/memory/pool.h"
#include "tests/support/test_support.h"

#define KiB ((size_t)1024)
#define MiB (1024 * KiB)
#define GiB (1024 * MiB)

/* The pool of every run: regions are MAP_NORESERVE mappings that are never touched,
 * so a limit far above the machine's memory costs nothing. */
#define BENCH_INITIAL_BYTES (1 * GiB)
#define BENCH_GROWTH_BYTES (1 * GiB)
#define BENCH_LIMIT_BYTES (64 * GiB)

typedef struct bench_options {
    uint64_t ops;
    uint64_t probe_ops;
    uint64_t max_holes;
    uint64_t seed;
} bench_options;

/* One steady-state workload: the first `live` sizes fill the working set, then step i
 * frees slot victims[i] and refills it with sizes[live + i]. */
typedef struct workload {
    const char *label;
    size_t min_bytes;
    size_t max_bytes;
    size_t live;
    uint64_t steps;
    size_t *sizes;
    uint32_t *victims;
} workload;

static void die(const char *what, const char *detail)
{
    fprintf(stderr, "bench_pool: %s: %s\n", what, detail);
    exit(EXIT_FAILURE);
}

static void *checked_calloc(size_t count, size_t size)
{
    void *memory = calloc(count, size);
    if (memory == NULL)
        die("calloc", "out of memory");
    return memory;
}

static size_t log_uniform(em_test_rng *rng, size_t min_bytes, size_t max_bytes)
{
    double low = log((double)min_bytes);
    double high = log((double)max_bytes);
    size_t bytes = (size_t)exp(low + em_test_rng_unit(rng) * (high - low));
    return bytes < min_bytes ? min_bytes : bytes > max_bytes ? max_bytes : bytes;
}

static void workload_make(workload *w, em_test_rng *rng)
{
    w->sizes = checked_calloc(w->live + w->steps, sizeof(size_t));
    w->victims = checked_calloc(w->steps, sizeof(uint32_t));
    for (uint64_t i = 0; i < w->live + w->steps; i++)
        w->sizes[i] = log_uniform(rng, w->min_bytes, w->max_bytes);
    for (uint64_t i = 0; i < w->steps; i++)
        w->victims[i] = (uint32_t)em_test_rng_below(rng, w->live);
}

static void workload_free(workload *w)
{
    free(w->sizes);
    free(w->victims);
}

static em_pool *bench_pool_create(void)
{
    em_pool_options options = {
        .name = "bench",
        .initial_bytes = BENCH_INITIAL_BYTES,
        .growth_bytes = BENCH_GROWTH_BYTES,
        .limit_bytes = BENCH_LIMIT_BYTES,
        .provider = em_pool_host_provider(),
    };
    em_pool *pool = NULL;
    em_error err;
    if (em_pool_create(&options, &pool, &err) != EM_OK)
        die("pool create", err.message);
    return pool;
}

static uintptr_t pool_alloc_or_die(em_pool *pool, size_t bytes)
{
    uintptr_t address = 0;
    em_error err;
    if (em_pool_alloc(pool, bytes, &address, &err) != EM_OK)
        die("pool alloc", err.message);
    return address;
}

static void pool_free_or_die(em_pool *pool, uintptr_t address)
{
    em_error err;
    if (em_pool_free(pool, address, &err) != EM_OK)
        die("pool free", err.message);
}

/* Seconds for the steady steps; the statistics before the final frees go to *stats. */
static double run_pool(const workload *w, em_pool_stats *stats)
{
    em_pool *pool = bench_pool_create();
    uintptr_t *slots = checked_calloc(w->live, sizeof(uintptr_t));
    for (size_t i = 0; i < w->live; i++)
        slots[i] = pool_alloc_or_die(pool, w->sizes[i]);
    double start = em_test_now();
    for (uint64_t i = 0; i < w->steps; i++) {
        uint32_t victim = w->victims[i];
        pool_free_or_die(pool, slots[victim]);
        slots[victim] = pool_alloc_or_die(pool, w->sizes[w->live + i]);
    }
    double seconds = em_test_now() - start;
    em_pool_get_stats(pool, stats);
    for (size_t i = 0; i < w->live; i++)
        pool_free_or_die(pool, slots[i]);
    free(slots);
    em_pool_destroy(pool);
    return seconds;
}

static double run_malloc(const workload *w)
{
    void **slots = checked_calloc(w->live, sizeof(void *));
    for (size_t i = 0; i < w->live; i++)
        if ((slots[i] = malloc(w->sizes[i])) == NULL)
            die("malloc", "out of memory");
    double start = em_test_now();
    for (uint64_t i = 0; i < w->steps; i++) {
        uint32_t victim = w->victims[i];
        free(slots[victim]);
        if ((slots[victim] = malloc(w->sizes[w->live + i])) == NULL)
            die("malloc", "out of memory");
    }
    double seconds = em_test_now() - start;
    for (size_t i = 0; i < w->live; i++)
        free(slots[i]);
    free(slots);
    return seconds;
}

/* ---- tables 1 and 3: steady working sets ------------------------------------------- */

static void print_rate_row(const workload *w, const char *allocator, double seconds)
{
    double steps = (double)w->steps;
    printf("%-18s %7zu %9" PRIu64 "  %-12s %12.0f %9.1f\n", w->label, w->live, w->steps,
           allocator, steps / seconds, seconds * 1e9 / steps);
}

static void print_fragmentation_row(const workload *w, const em_pool_stats *s)
{
    char in_use[32], reserved[32], free_bytes[32], largest[32];
    snprintf(in_use, sizeof(in_use), "%.1f MiB", (double)s->bytes_in_use / (double)MiB);
    snprintf(reserved, sizeof(reserved), "%.1f MiB", (double)s->bytes_reserved / (double)MiB);
    snprintf(free_bytes, sizeof(free_bytes), "%.1f MiB", (double)s->bytes_free / (double)MiB);
    snprintf(largest, sizeof(largest), "%.1f MiB", (double)s->largest_free_block / (double)MiB);
    printf("%-18s %10" PRIu64 " %6" PRIu64 " %12s %12s %12s %12s %8" PRIu64 " %8.3f\n",
           w->label, 2 * w->steps + w->live, s->live_allocations, in_use, reserved,
           free_bytes, largest, s->free_chunks, s->fragmentation);
}

#define MIX_COUNT 2

/* Both mixes of table 1 with the pool statistics at the end of their runs. */
typedef struct steady_runs {
    workload mixes[MIX_COUNT];
    em_pool_stats stats[MIX_COUNT];
} steady_runs;

static void steady_table(const bench_options *options, steady_runs *runs)
{
    *runs = (steady_runs){.mixes = {
        {.label = "256 B .. 64 MiB", .min_bytes = 256, .max_bytes = 64 * MiB, .live = 1000},
        {.label = "256 B .. 1 MiB", .min_bytes = 256, .max_bytes = 1 * MiB, .live = 10000},
    }};
    em_test_rng rng;
    em_test_rng_init(&rng, options->seed);
    printf("1. steady working set: each step frees a random live block and allocates a new "
           "one\n   (sizes log-uniform; same sequence for both allocators; memory untouched)\n");
    printf("%-18s %7s %9s  %-12s %12s %9s\n", "mix", "live", "steps", "allocator", "pairs/s",
           "ns/pair");
    for (size_t m = 0; m < MIX_COUNT; m++) {
        workload *w = &runs->mixes[m];
        w->steps = options->ops;
        workload_make(w, &rng);
        print_rate_row(w, "ember pool", run_pool(w, &runs->stats[m]));
        print_rate_row(w, "glibc malloc", run_malloc(w));
        fflush(stdout);
    }
}

static void fragmentation_table(steady_runs *runs)
{
    printf("\n3. pool fragmentation at the end of the runs of table 1 "
           "(operations = allocs + frees)\n");
    printf("%-18s %10s %6s %12s %12s %12s %12s %8s %8s\n", "mix", "operations", "live",
           "in use", "reserved", "free", "largest free", "chunks", "frag");
    for (size_t m = 0; m < MIX_COUNT; m++) {
        print_fragmentation_row(&runs->mixes[m], &runs->stats[m]);
        workload_free(&runs->mixes[m]);
    }
}

/* ---- table 2: pair cost against the number of free holes ------------------------- */

#define HOLE_MIN_BYTES ((size_t)256)
#define HOLE_MAX_BYTES (64 * KiB)

/* Makes `holes` free holes of random sizes, each kept apart by a live 256-byte block,
 * then times `pairs` allocations of random sizes, each freed at once (so every pair
 * finds the same layout: the hole it split coalesces back). */
static double time_pairs_with_holes(uint64_t holes, uint64_t pairs, em_test_rng *rng,
                                    em_pool_stats *stats)
{
    em_pool *pool = bench_pool_create();
    uintptr_t *hole_addresses = checked_calloc(holes, sizeof(uintptr_t));
    for (uint64_t i = 0; i < holes; i++) {
        hole_addresses[i] = pool_alloc_or_die(pool, log_uniform(rng, HOLE_MIN_BYTES,
                                                                HOLE_MAX_BYTES));
        pool_alloc_or_die(pool, 256);
    }
    for (uint64_t i = 0; i < holes; i++)
        pool_free_or_die(pool, hole_addresses[i]);
    free(hole_addresses);

    size_t *sizes = checked_calloc(pairs, sizeof(size_t));
    for (uint64_t i = 0; i < pairs; i++)
        sizes[i] = log_uniform(rng, HOLE_MIN_BYTES, HOLE_MAX_BYTES);
    em_pool_get_stats(pool, stats);
    double start = em_test_now();
    for (uint64_t i = 0; i < pairs; i++)
        pool_free_or_die(pool, pool_alloc_or_die(pool, sizes[i]));
    double seconds = em_test_now() - start;
    free(sizes);
    em_pool_destroy(pool);
    return seconds;
}

static void holes_table(const bench_options *options)
{
    em_test_rng rng;
    em_test_rng_init(&rng, options->seed + 1);
    printf("\n2. one alloc/free pair as free holes grow (sizes log-uniform 256 B .. 64 KiB;\n"
           "   each allocation is freed at once; holes kept apart by live blocks)\n");
    printf("%12s %12s %10s %9s %12s\n", "free holes", "free chunks", "pairs", "ns/pair",
           "vs first row");
    double first = 0.0;
    for (uint64_t holes = 1000; holes <= options->max_holes; holes *= 10) {
        em_pool_stats stats;
        double seconds = time_pairs_with_holes(holes, options->probe_ops, &rng, &stats);
        double ns = seconds * 1e9 / (double)options->probe_ops;
        if (first == 0.0)
            first = ns;
        printf("%12" PRIu64 " %12" PRIu64 " %10" PRIu64 " %9.1f %11.2fx\n", holes,
               stats.free_chunks, options->probe_ops, ns, ns / first);
        fflush(stdout);
    }
}

/* ---- the header: machine and command --------------------------------------------- */

static void cpu_model(char *buffer, size_t capacity)
{
    snprintf(buffer, capacity, "unknown CPU");
    FILE *file = fopen("/proc/cpuinfo", "r");
    if (file == NULL)
        return;
    char line[512];
    while (fgets(line, sizeof(line), file) != NULL) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) != 0 || colon == NULL)
            continue;
        colon += 1 + (colon[1] == ' ');
        colon[strcspn(colon, "\n")] = '\0';
        snprintf(buffer, capacity, "%s", colon);
        break;
    }
    fclose(file);
}

static void print_header(const char *program, const bench_options *options)
{
    struct utsname name;
    char cpu[256];
    cpu_model(cpu, sizeof(cpu));
    uname(&name);
    printf("ember pool benchmark\n");
    printf("machine: %s %s %s, %s\n", name.sysname, name.release, name.machine, cpu);
    printf("command: %s --ops %" PRIu64 " --probe-ops %" PRIu64 " --max-holes %" PRIu64
           " --seed %" PRIu64 "\n\n",
           program, options->ops, options->probe_ops, options->max_holes, options->seed);
}

static uint64_t parse_count(const char *flag, const char *text)
{
    char *end = NULL;
    unsigned long long value = text == NULL ? 0 : strtoull(text, &end, 0);
    if (text == NULL || *text == '\0' || *end != '\0')
        die(flag, "expects a number");
    return (uint64_t)value;
}

static bench_options parse_options(int argc, char **argv)
{
    bench_options options = {
        .ops = 1000000, .probe_ops = 200000, .max_holes = 100000, .seed = em_test_seed()};
    for (int i = 1; i < argc; i += 2) { /* every option takes a value */
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "--ops") == 0)
            options.ops = parse_count("--ops", value);
        else if (strcmp(argv[i], "--probe-ops") == 0)
            options.probe_ops = parse_count("--probe-ops", value);
        else if (strcmp(argv[i], "--max-holes") == 0)
            options.max_holes = parse_count("--max-holes", value);
        else if (strcmp(argv[i], "--seed") == 0)
            options.seed = parse_count("--seed", value);
        else
            die(argv[i], "unknown option (--ops, --probe-ops, --max-holes, --seed)");
    }
    if (options.ops == 0 || options.probe_ops == 0)
        die("--ops/--probe-ops", "must be > 0");
    return options;
}

int main(int argc, char **argv)
{
    bench_options options = parse_options(argc, argv);
    print_header(argv[0], &options);
    steady_runs runs;
    steady_table(&options, &runs);
    holes_table(&options);
    fragmentation_table(&runs);
    return EXIT_SUCCESS;
}
