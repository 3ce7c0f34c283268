/*
 * Throughput of the CPU hash map: find_or_insert of new keys, find of present keys,
 * find of absent keys, and a walk of its entries (em_hashmap_walk_next, as eviction
 * reads the map), in million keys per second, at load factors 0.5 and 0.9 with 1 and 2
 * threads. Each configuration gets a fresh map presized so that the key set
 * gives exactly that load (no growth while timing); threads split the key set into
 * contiguous parts and call the map in batches. Each configuration runs --repeat times
 * on a fresh map; the table gives the median rate and the range seen.
 *
 *   bench_hashmap [--keys N] [--batch N] [--repeat N] [--seed N]
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lib/memory/hashmap.h"
#include "tests/support/test_support.h"

#define DEFAULT_KEYS 10000000u
#define DEFAULT_BATCH 4096u
#define DEFAULT_REPEAT 3u
#define MAX_REPEAT 99
#define MAX_THREADS 2

static const double bench_loads[] = {0.5, 0.9};
static const size_t bench_threads[] = {1, 2};

typedef struct bench_options {
    size_t keys;
    size_t batch;
    size_t repeat;
    uint64_t seed;
} bench_options;

typedef enum bench_operation {
    OP_INSERT,
    OP_FIND_PRESENT,
    OP_FIND_ABSENT,
    OP_WALK,
    OP_COUNT
} bench_operation;

static const char *operation_names[OP_COUNT] = {
    "find_or_insert (new keys)",
    "find (present keys)",
    "find (absent keys)",
    "walk (entries)",
};

typedef struct bench_worker {
    em_hashmap *map;
    pthread_barrier_t *start;
    bench_operation operation;
    const uint64_t *keys;
    uint64_t *values;
    size_t n;
    size_t batch;
    size_t first;   /* of the key set: a walk starts there */
    size_t counted; /* keys inserted, keys not found, or entries walked */
    em_status status;
    double began, ended;
} bench_worker;

static void *bench_run(void *argument)
{
    bench_worker *worker = argument;
    /* a walk: n entries from a position of its own, a batch's keys at a time */
    uint64_t *walked = NULL;
    if (worker->operation == OP_WALK) {
        walked = malloc(worker->batch * sizeof(uint64_t));
        if (walked == NULL) {
            fprintf(stderr, "cannot allocate a walk's buffer of %zu keys\n", worker->batch);
            exit(EXIT_FAILURE);
        }
    }
    pthread_barrier_wait(worker->start);
    worker->began = em_test_now();
    if (worker->operation == OP_WALK) {
        em_hashmap_walk walk;
        em_hashmap_walk_begin(worker->map, worker->first * 2, &walk);
        for (size_t got = 1; worker->counted < worker->n && got > 0; worker->counted += got) {
            size_t want = worker->n - worker->counted;
            got = em_hashmap_walk_next(worker->map, &walk, walked, worker->values,
                                       want < worker->batch ? want : worker->batch);
        }
        worker->ended = em_test_now();
        free(walked);
        return NULL;
    }
    for (size_t done = 0; done < worker->n; done += worker->batch) {
        size_t n = worker->n - done < worker->batch ? worker->n - done : worker->batch;
        const uint64_t *keys = worker->keys + done;
        uint64_t *values = worker->values + done;
        if (worker->operation == OP_INSERT) {
            size_t inserted = 0;
            em_error err = {0};
            worker->status =
                em_hashmap_find_or_insert(worker->map, keys, n, values, NULL, &inserted, &err);
            if (worker->status != EM_OK) {
                fprintf(stderr, "find_or_insert: %s\n", err.message);
                return NULL;
            }
            worker->counted += inserted;
        } else {
            worker->counted += em_hashmap_find(worker->map, keys, n, values);
        }
    }
    worker->ended = em_test_now();
    return NULL;
}

/* Runs operation over keys[0..n) split among thread_count threads (a walk: n entries);
 * returns seconds from the first worker's start to the last one's end (the workers read
 * the clock: the main thread may not get a core back until they are done) and stores
 * their summed count. */
static double timed_run(em_hashmap *map, bench_operation operation, const uint64_t *keys,
                        uint64_t *values, size_t n, size_t thread_count, size_t batch,
                        size_t *counted)
{
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)thread_count + 1);
    bench_worker workers[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    for (size_t t = 0; t < thread_count; t++) {
        size_t first = n * t / thread_count, last = n * (t + 1) / thread_count;
        workers[t] = (bench_worker){.map = map, .start = &start, .operation = operation,
                                    .keys = keys + first, .values = values + first,
                                    .first = first,
                                    .n = last - first, .batch = batch, .status = EM_OK};
        pthread_create(&threads[t], NULL, bench_run, &workers[t]);
    }
    pthread_barrier_wait(&start);
    *counted = 0;
    double began = 0, ended = 0;
    for (size_t t = 0; t < thread_count; t++) {
        pthread_join(threads[t], NULL);
        if (workers[t].status != EM_OK)
            exit(EXIT_FAILURE);
        *counted += workers[t].counted;
        began = t == 0 || workers[t].began < began ? workers[t].began : began;
        ended = workers[t].ended > ended ? workers[t].ended : ended;
    }
    double seconds = ended - began;
    pthread_barrier_destroy(&start);
    return seconds;
}

static em_hashmap *presized_map(size_t keys, double load)
{
    size_t slots = (size_t)((double)keys / load);
    while ((double)slots * load < (double)keys)
        slots++;
    em_hashmap_options options = {.initial_slots = slots,
                                  .max_load_factor = load > EM_HASHMAP_DEFAULT_MAX_LOAD
                                                         ? load
                                                         : EM_HASHMAP_DEFAULT_MAX_LOAD};
    em_hashmap *map = NULL;
    em_error err = {0};
    if (em_hashmap_create(&options, &map, &err) != EM_OK) {
        fprintf(stderr, "create: %s\n", err.message);
        exit(EXIT_FAILURE);
    }
    return map;
}

static int compare_doubles(const void *left, const void *right)
{
    double a = *(const double *)left, b = *(const double *)right;
    return (a > b) - (a < b);
}

/* Prints the median rate over the repeats and the range. Sorts rates. */
static void print_row(bench_operation operation, double load, size_t thread_count,
                      double *rates, size_t repeat)
{
    qsort(rates, repeat, sizeof(*rates), compare_doubles);
    double median = repeat % 2 ? rates[repeat / 2]
                               : (rates[repeat / 2 - 1] + rates[repeat / 2]) / 2;
    printf("%-26s %5.2f %8zu %10.1f %8.1f-%.1f\n", operation_names[operation], load,
           thread_count, median, rates[0], rates[repeat - 1]);
}

static void check_count(const char *what, size_t got, size_t want)
{
    if (got != want) {
        fprintf(stderr, "%s: counted %zu, expected %zu\n", what, got, want);
        exit(EXIT_FAILURE);
    }
}

/* One fresh map: inserts every present key, then finds present and absent keys, then
 * walks as many entries as it holds. Stores the rate of each operation in million keys
 * per second. */
static void bench_once(const bench_options *options, const uint64_t *present,
                       const uint64_t *absent, uint64_t *values, double load,
                       size_t thread_count, double rates[OP_COUNT])
{
    size_t n = options->keys, counted = 0;
    em_hashmap *map = presized_map(n, load);
    double seconds = timed_run(map, OP_INSERT, present, values, n, thread_count,
                               options->batch, &counted);
    check_count("find_or_insert", counted, n);
    rates[OP_INSERT] = (double)n / seconds / 1e6;

    em_hashmap_stats stats;
    em_hashmap_get_stats(map, &stats);
    if (stats.grow_count != 0)
        fprintf(stderr, "warning: the map grew during the run (%" PRIu64 " slots)\n",
                stats.slots);

    seconds = timed_run(map, OP_FIND_PRESENT, present, values, n, thread_count, options->batch,
                        &counted);
    check_count("find of present keys (missing)", counted, 0);
    rates[OP_FIND_PRESENT] = (double)n / seconds / 1e6;

    seconds = timed_run(map, OP_FIND_ABSENT, absent, values, n, thread_count, options->batch,
                        &counted);
    check_count("find of absent keys (missing)", counted, n);
    rates[OP_FIND_ABSENT] = (double)n / seconds / 1e6;

    seconds = timed_run(map, OP_WALK, present, values, n, thread_count, options->batch,
                        &counted);
    check_count("walk (entries)", counted, n);
    rates[OP_WALK] = (double)n / seconds / 1e6;
    em_hashmap_destroy(map);
}

static void bench_configuration(const bench_options *options, const uint64_t *present,
                                const uint64_t *absent, uint64_t *values, double load,
                                size_t thread_count)
{
    double rates[OP_COUNT][MAX_REPEAT];
    for (size_t r = 0; r < options->repeat; r++) {
        double once[OP_COUNT];
        bench_once(options, present, absent, values, load, thread_count, once);
        for (int op = 0; op < OP_COUNT; op++)
            rates[op][r] = once[op];
    }
    for (int op = 0; op < OP_COUNT; op++)
        print_row((bench_operation)op, load, thread_count, rates[op], options->repeat);
}

/* Distinct random keys: a random odd multiplier and offset make i -> key a bijection, so
 * present keys [0, n) and absent keys [n, 2n) never collide. */
static void make_keys(uint64_t seed, size_t n, uint64_t *present, uint64_t *absent)
{
    em_test_rng rng;
    em_test_rng_init(&rng, seed);
    uint64_t multiplier = em_test_rng_next(&rng) | 1, offset = em_test_rng_next(&rng);
    for (size_t i = 0; i < n; i++) {
        present[i] = (uint64_t)i * multiplier + offset;
        absent[i] = (uint64_t)(n + i) * multiplier + offset;
    }
    /* Scramble the order too, so that consecutive keys share nothing. */
    for (size_t i = n; i > 1; i--) {
        size_t j = em_test_rng_below(&rng, i);
        uint64_t swap = present[i - 1];
        present[i - 1] = present[j];
        present[j] = swap;
    }
}

static void print_machine(void)
{
    char model[256] = "unknown";
    FILE *cpuinfo = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (cpuinfo != NULL && fgets(line, sizeof(line), cpuinfo) != NULL) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) == 0 && colon != NULL) {
            snprintf(model, sizeof(model), "%s", colon + 2);
            model[strcspn(model, "\n")] = '\0';
            break;
        }
    }
    if (cpuinfo != NULL)
        fclose(cpuinfo);
    printf("machine: %s, %ld cores online\n", model, sysconf(_SC_NPROCESSORS_ONLN));
#ifdef __OPTIMIZE__
    const char *optimized = "optimized";
#else
    const char *optimized = "not optimized";
#endif
    printf("compiler: %s (%s)\n", __VERSION__, optimized);
}

static void print_command(int argc, char **argv)
{
    printf("command:");
    for (int i = 0; i < argc; i++)
        printf(" %s", argv[i]);
    printf("\n");
}

static void usage(const char *program)
{
    fprintf(stderr,
            "usage: %s [--keys N (default %u)] [--batch N (default %u)]\n"
            "       [--repeat N (1..%d, default %u)] [--seed N]\n",
            program, DEFAULT_KEYS, DEFAULT_BATCH, MAX_REPEAT, DEFAULT_REPEAT);
    exit(EXIT_FAILURE);
}

static size_t parse_count(const char *program, const char *text)
{
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 0);
    if (end == text || *end != '\0' || value == 0)
        usage(program);
    return (size_t)value;
}

static bench_options parse_options(int argc, char **argv)
{
    bench_options options = {
        .keys = DEFAULT_KEYS, .batch = DEFAULT_BATCH, .repeat = DEFAULT_REPEAT, .seed = 1};
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc)
            usage(argv[0]);
        if (strcmp(argv[i], "--keys") == 0)
            options.keys = parse_count(argv[0], argv[++i]);
        else if (strcmp(argv[i], "--batch") == 0)
            options.batch = parse_count(argv[0], argv[++i]);
        else if (strcmp(argv[i], "--repeat") == 0)
            options.repeat = parse_count(argv[0], argv[++i]);
        else if (strcmp(argv[i], "--seed") == 0)
            options.seed = parse_count(argv[0], argv[++i]);
        else
            usage(argv[0]);
    }
    if (options.repeat > MAX_REPEAT)
        usage(argv[0]);
    return options;
}

int main(int argc, char **argv)
{
    bench_options options = parse_options(argc, argv);
    uint64_t *present = malloc(options.keys * sizeof(uint64_t));
    uint64_t *absent = malloc(options.keys * sizeof(uint64_t));
    uint64_t *values = malloc(options.keys * sizeof(uint64_t));
    if (present == NULL || absent == NULL || values == NULL) {
        fprintf(stderr, "cannot allocate key arrays for %zu keys\n", options.keys);
        return EXIT_FAILURE;
    }
    make_keys(options.seed, options.keys, present, absent);

    printf("ember CPU hash map: %zu random u64 keys, batches of %zu keys per call, "
           "median of %zu runs\n",
           options.keys, options.batch, options.repeat);
    print_command(argc, argv);
    print_machine();
    printf("\n%-26s %5s %8s %10s %12s\n", "operation", "load", "threads", "Mops/s", "range");
    for (size_t l = 0; l < sizeof(bench_loads) / sizeof(bench_loads[0]); l++)
        for (size_t t = 0; t < sizeof(bench_threads) / sizeof(bench_threads[0]); t++)
            bench_configuration(&options, present, absent, values, bench_loads[l],
                                bench_threads[t]);
    free(present);
    free(absent);
    free(values);
    return EXIT_SUCCESS;
}
