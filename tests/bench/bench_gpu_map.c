/*
 * The GPU hash map's probe lengths, counted on the host with the kernels' own code
 * (kernels/kernel_logic.h runs on the CPU too): how many slots a search compares and
 * how many 128-byte lines it reads, for present and absent keys, at loads 0.5 and 0.9
 * (0.9 is the most a shard's map holds before it grows). Beside the map as it is
 * (double hashing over buckets of EM_GPU_BUCKET_SLOTS slots, em_gpu_probe), the same
 * keys in slot-by-slot linear probing from the same home hash (the map's layout before
 * buckets), counted by this program. Counts, not times: the GPU's speed needs a GPU
 * (bench_gpu); what a search costs there is mostly the lines it reads.
 *
 *   bench_gpu_map [--slots N] [--searches N] [--seed N]
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernel_logic.h"

enum { LINE_BYTES = 128 };

typedef struct options {
    uint64_t slots; /* a power of two */
    uint64_t searches;
    uint64_t seed;
} options;

typedef struct counts {
    double slots, lines;
} counts;

static void usage(void)
{
    fprintf(stderr, "usage: bench_gpu_map [--slots N (a power of two >= 16)] [--searches N] "
                    "[--seed N]\n");
    exit(2);
}

static options parse(int argc, char **argv)
{
    options o = {.slots = UINT64_C(1) << 22, .searches = 1000000, .seed = 20261126};
    for (int i = 1; i < argc; i += 2) { /* --option value */
        if (i + 1 >= argc)
            usage();
        uint64_t value = strtoull(argv[i + 1], NULL, 10);
        if (strcmp(argv[i], "--slots") == 0)
            o.slots = value;
        else if (strcmp(argv[i], "--searches") == 0)
            o.searches = value;
        else if (strcmp(argv[i], "--seed") == 0)
            o.seed = value;
        else
            usage();
    }
    if (o.slots < 16 || (o.slots & (o.slots - 1)) != 0 || o.searches == 0)
        usage();
    return o;
}

/* The i-th key of the run: distinct, spread like real ids after mixing. */
static uint64_t key_at(const options *o, uint64_t i)
{
    return em_mix64(o->seed * 0x9e3779b97f4a7c15ull + i) | 1u;
}

/* Lines [first, last] a search read (slot indices, in order of reading). */
typedef struct line_tracker {
    uint64_t last_line, lines;
} line_tracker;

static void track(line_tracker *t, uint64_t slot)
{
    uint64_t line = slot * sizeof(em_gpu_slot) / LINE_BYTES;
    if (t->lines == 0 || line != t->last_line)
        t->lines++;
    t->last_line = line;
}

/* A search of the map as the kernels probe it (em_gpu_map_lookup's sequence). */
static void search_buckets(em_gpu_map map, uint64_t key, counts *c)
{
    em_gpu_probe probe;
    line_tracker t = {0};
    uint64_t slot = em_gpu_probe_start(&probe, key, map.seed, map.slot_count);
    for (uint64_t seen = 0; seen < map.slot_count; seen++) {
        track(&t, slot);
        c->slots += 1;
        uint64_t held = map.slots[slot].key;
        if (held == key || held == EM_GPU_EMPTY_KEY)
            break;
        slot = em_gpu_probe_next(&probe);
    }
    c->lines += (double)t.lines;
}

static uint64_t linear_home(uint64_t key, uint64_t seed, uint64_t slot_count)
{
    return em_hash_scale(em_mix64(key ^ seed), slot_count);
}

static void insert_linear(em_gpu_slot *slots, uint64_t slot_count, uint64_t key)
{
    uint64_t slot = linear_home(key, EM_HASHMAP_SEED, slot_count);
    while (slots[slot].key != EM_GPU_EMPTY_KEY)
        slot = slot + 1 == slot_count ? 0 : slot + 1;
    slots[slot].key = key;
}

static void search_linear(const em_gpu_slot *slots, uint64_t slot_count, uint64_t key, counts *c)
{
    line_tracker t = {0};
    uint64_t slot = linear_home(key, EM_HASHMAP_SEED, slot_count);
    for (;;) {
        track(&t, slot);
        c->slots += 1;
        uint64_t held = slots[slot].key;
        if (held == key || held == EM_GPU_EMPTY_KEY)
            break;
        slot = slot + 1 == slot_count ? 0 : slot + 1;
    }
    c->lines += (double)t.lines;
}

static void run_load(const options *o, double load)
{
    uint64_t keys = (uint64_t)(load * (double)o->slots);
    em_gpu_slot *bucketed = aligned_alloc(16, o->slots * sizeof(em_gpu_slot));
    em_gpu_slot *linear = aligned_alloc(16, o->slots * sizeof(em_gpu_slot));
    if (bucketed == NULL || linear == NULL) {
        fprintf(stderr, "bench_gpu_map: out of memory\n");
        exit(1);
    }
    memset(bucketed, 0xff, o->slots * sizeof(em_gpu_slot));
    memset(linear, 0xff, o->slots * sizeof(em_gpu_slot));
    em_gpu_map_header header = {.side_rows = {EM_GPU_ROW_NONE, EM_GPU_ROW_NONE}};
    em_gpu_map map = {.slots = bucketed, .slot_count = o->slots, .header = &header,
                      .seed = EM_HASHMAP_SEED};
    for (uint64_t i = 0; i < keys; i++) {
        int fresh = 0;
        em_gpu_map_insert_key(map, key_at(o, i), &fresh);
        insert_linear(linear, o->slots, key_at(o, i));
    }
    if (header.overflow != 0) {
        fprintf(stderr, "bench_gpu_map: the map overflowed at load %.2f\n", load);
        exit(1);
    }
    counts present[2] = {{0}}, absent[2] = {{0}};
    uint64_t step = keys / o->searches > 0 ? keys / o->searches : 1, found = 0;
    for (uint64_t i = 0; i < keys; i += step, found++) {
        search_buckets(map, key_at(o, i), &present[0]);
        search_linear(linear, o->slots, key_at(o, i), &present[1]);
    }
    for (uint64_t i = 0; i < o->searches; i++) {
        search_buckets(map, key_at(o, keys + i), &absent[0]);
        search_linear(linear, o->slots, key_at(o, keys + i), &absent[1]);
    }
    static const char *const layouts[] = {"buckets of 8, double hashing", "linear, slot by slot"};
    for (int l = 0; l < 2; l++)
        printf("%5.2f  %-30s %12.2f %12.2f %12.2f %12.2f\n", load, layouts[l],
               present[l].slots / (double)found, present[l].lines / (double)found,
               absent[l].slots / (double)o->searches, absent[l].lines / (double)o->searches);
    free(bucketed);
    free(linear);
}

int main(int argc, char **argv)
{
    options o = parse(argc, argv);
    printf("command: bench_gpu_map --slots %" PRIu64 " --searches %" PRIu64 " --seed %" PRIu64
           "\n",
           o.slots, o.searches, o.seed);
    printf("GPU hash map searches, counted on the host (16-byte slots, %d-byte lines)\n\n",
           LINE_BYTES);
    printf("%5s  %-30s %12s %12s %12s %12s\n", "load", "layout", "hit slots", "hit lines",
           "miss slots", "miss lines");
    run_load(&o, 0.5);
    run_load(&o, 0.9);
    return 0;
}
