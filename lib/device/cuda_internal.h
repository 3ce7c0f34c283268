/*
 * DESIGN: what the CUDA device's files share: its lanes, per-GPU state and shards, the
 * small helpers every operation uses, and the functions one file offers the others
 * (lib/device/cuda_device.c: memory, lanes, copies and the device; cuda_home_ops.c:
 * operations on a request's buffers at its home GPU; cuda_shard.c: hash maps and row
 * storage of shards). Not a public header: only these files include it.
 */
#ifndef EMBER_LIB_CUDA_INTERNAL_H
#define EMBER_LIB_CUDA_INTERNAL_H

#include "lib/device/cuda_device.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/keyhash.h"
#include "lib/device/backend.h"

/* Row blocks aim at this many bytes (em_row_blocks_plan). */
#define TARGET_BLOCK_BYTES ((size_t)4 << 20)
/* Hash map slots a new shard starts with at most (it grows on demand). */
#define MAX_INITIAL_SLOTS ((uint64_t)1 << 16)
#define MIN_SLOTS ((uint64_t)16)
/* Maps grow when keys in slots would pass this fraction of the slots (tenths). */
#define MAX_LOAD_TENTHS 9u
/* Export: slots examined per scan, and bytes of rows returned per call at most; both
 * halve (down to one row and MIN_EXPORT_WINDOW slots) while the pool cannot hold the
 * scratch, so a full pool can still be exported (checkpoints). */
#define EXPORT_WINDOW_SLOTS ((uint64_t)1 << 20)
#define MIN_EXPORT_WINDOW ((uint64_t)1 << 10)
#define EXPORT_MAX_BYTES ((uint64_t)64 << 20)
/* Pool buffers freed when their lane next synchronizes, at most (more forces a sync). */
#define DEFERRED_MAX 64u
/* Pinned bytes after a lane's staging halves for small reads back (counts). */
#define READBACK_BYTES ((size_t)256)
/* And after those, for reads back that land at the lane's next synchronisation
 * (copy_to_host_later): LATER_MAX of them, LATER_BYTES in all (room for the starts and
 * missing counts of 64 shards, unique_partition_find_async's). */
#define LATER_BYTES ((size_t)1024)
/* A lane's pinned readback memory (em__cuda_lane_readback) grows up to this much: an
 * eviction whose walks need more reads a shard at a time, or through staging. */
#define LANE_READBACK_MAX ((size_t)64 << 20)
#define LATER_MAX 4u
/* Scratch buffers one operation takes at most. */
#define SCRATCH_MAX 16u
/* Views of a table's shards a lane keeps on its GPU (cuda_shard.c: see_shards). */
#define VIEW_CACHE 4u
/* Most positions a lane keeps on its GPU for the pushes' sort (4 MiB): larger pushes
 * write their own, a launch that costs little next to their size. */
#define IOTA_CACHE_MAX ((uint64_t)1 << 20)

_Static_assert(EM_GPU_ROW_NONE == EM_ROW_NONE, "row marker shared with the kernels");

typedef struct cuda_lane {
    em_lane base;
    uint32_t index;
    bool held;
    em_gpu_stream *stream;
    uint8_t *staging; /* pinned, used as two halves: the host fills or empties one while
                       * the other's copy runs, so a large copy keeps two chunks in flight */
    size_t staging_bytes;
    em_gpu_event *staging_done[2]; /* recorded after the last copy of each half */
    bool staging_in_flight[2];
    uint32_t staging_next; /* the half the next chunk to the device takes */
    size_t staging_used[2]; /* bytes of each half that copies since it was last free use:
                             * small copies to the device share a half (no wait between
                             * them); a copy from the device fills a half until the lane
                             * synchronizes */
    em_gpu_event *handoff;      /* same-device copies between lanes */
    uint64_t *counter;          /* device word for counts (find) */
    void *deferred[DEFERRED_MAX];
    uint32_t deferred_count;
    /* copy_to_host_later: where each read back goes, once the lane has synchronized */
    struct {
        void *host;
        size_t offset, bytes; /* in the words after the readback bytes */
    } later[LATER_MAX];
    uint32_t later_count;
    size_t later_used;
    /* The views of several shards of one table (cuda_shard.c: see_shards) the lane copied
     * to its GPU last: a request whose view is byte for byte one of them uses that copy
     * instead of copying its own. Each device copy is the lane's, from the pool. */
    struct {
        void *host;   /* the view as built on the host (malloc) */
        void *device; /* its copy on the GPU */
        size_t bytes;
    } views[VIEW_CACHE];
    uint32_t next_view; /* the entry the next view not found replaces */
    /* 0, 1, ..., iota_count - 1 on the GPU (cuda_home_ops.c: the values the gradient sums'
     * sort reads), written once when it grows, so that a push launches no iota of its own;
     * at most IOTA_CACHE_MAX entries, from the pool; NULL until a push needs it. */
    uint32_t *iota;
    uint64_t iota_count;
    /* Calls that went to the GPU for this lane (lane_check counts every one, and handing
     * out its stream counts as one), and their number at the last synchronisation: a
     * lane with nothing issued since is idle, and synchronising it waits for nothing. */
    uint64_t issued, synced;
    /* Lanes of other GPUs that the lane's next synchronisation waits for too, in the
     * same round trip (em_device_ops.lane_join); cleared by it and by the release. */
    struct cuda_lane *joined[EM_BACKEND_MAX_DEVICES - 1];
    uint32_t joined_count;
    /* Pinned host memory that a copy back fills while the host does not wait for it (an
     * eviction's walks, read back with other GPUs' work: cuda_shard.c), grown on demand
     * (em__cuda_lane_readback); NULL until then. */
    uint8_t *readback;
    size_t readback_bytes;
} cuda_lane;

typedef struct cuda_state {
    int ordinal;
    em_host_buffers *host_buffers; /* copied directly, without staging; counts copies */
    uint64_t map_segment_slots;    /* a power of two (em_cuda_backend_options) */
    uint64_t gpu_choice_entries;   /* em_cuda_backend_options, resolved */
    em_gpu_device_info info;
    cuda_lane *lanes;
    uint32_t lane_count;
    pthread_mutex_t lock;
    pthread_cond_t lane_freed;
} cuda_state;

/* The slot arrays of a shard's hash map (em_gpu_map): one array while the map has at
 * most the device's map_segment_slots slots, else segments of that many. */
typedef struct cuda_map_arrays {
    em_gpu_slot **segments;        /* host table of the arrays (device memory) */
    em_gpu_slot **device_segments; /* the same table on the device; NULL for one array */
    uint64_t count;
    uint32_t shift;                /* log2 of the slots of each */
} cuda_map_arrays;

typedef struct cuda_shard {
    em_shard base;
    char table[136];
    uint32_t index;
    uint32_t dim;
    uint32_t row_floats; /* dim + optimizer state */
    uint32_t stride;     /* floats between rows */
    em_optimizer_config optimizer;
    em_initializer_config initializer;
    /* hash map */
    cuda_map_arrays arrays;
    uint64_t slot_count;
    uint64_t hash_seed;    /* the map's seed (EM_HASHMAP_SEED unless the table has one) */
    em_gpu_map_header *header;
    em_gpu_map_header *header_host; /* pinned: where an asynchronous insert's copy lands */
    /* A request at once over several shards sends every shard's header back in one copy,
     * into the pinned headers of its first shard (headers_capacity of them); each
     * shard's settle_from then points at its own, for shard_insert_settle. */
    em_gpu_map_header *headers_host;
    uint32_t headers_capacity;
    const em_gpu_map_header *settle_from;
    uint64_t size;         /* keys stored (host copy of header rows - free_count) */
    uint64_t side_rows[2]; /* rows of the keys EMPTY and TOMBSTONE, host copy */
    uint64_t row_limit;    /* rows handed out from the counter (host copy) */
    uint64_t free_count;   /* released rows waiting for reuse (host copy) */
    uint64_t tombstones;   /* erased slots (host copy) */
    uint64_t rehashes_through_host; /* em_shard_stats */
    uint64_t rows_chosen_on_gpu;    /* em_shard_stats rows_evicted_chosen_on_gpu */
    uint64_t *free_rows;   /* the map's free list (device), free_capacity entries */
    uint64_t free_capacity;
    /* row storage */
    float **blocks;        /* host table of device block pointers */
    float **device_blocks; /* the same table on the device */
    uint64_t block_count, block_capacity;
    uint32_t block_shift;
    uint64_t block_mask;
    size_t block_bytes;
    /* access metadata (tables whose eviction tracks access): one block per row block */
    bool track_access;
    em_gpu_row_access **access;        /* host table of device block pointers */
    em_gpu_row_access **device_access; /* the same table on the device */
    /* ordering between lanes */
    pthread_mutex_t order_lock;
    em_gpu_event *write_event;
    bool write_recorded;
    uint32_t write_lane;
    em_gpu_event **read_events; /* one per lane */
    bool *read_recorded;
} cuda_shard;

static inline cuda_state *state_of(const em_device *device)
{
    return (cuda_state *)device->impl;
}

static inline cuda_lane *lane_of(em_lane *lane)
{
    return (cuda_lane *)lane;
}

static inline cuda_shard *shard_of(em_shard *shard)
{
    return (cuda_shard *)shard;
}

/* Bits that hold every value below count (a radix sort's end_bit; log2 of a power of
 * two). */
static inline uint32_t bits_for(uint64_t count)
{
    uint32_t bits = 0;
    while (count > 1 && bits < 64 && ((count - 1) >> bits) != 0)
        bits++;
    return bits;
}

/* Pool buffers of one operation, freed together. */
typedef struct scratch {
    em_device *device;
    void *pointers[SCRATCH_MAX];
    uint32_t count;
} scratch;

/* The status of a call that went to the GPU for lane (counted: cuda_lane.issued). */
static inline em_status lane_check(cuda_lane *lane, em_gpu_status status, em_error *err)
{
    lane->issued++;
    return em__cuda_check(status, lane->base.device->name, err);
}

static inline em_status scratch_take(scratch *s, size_t bytes, const char *what, void **out,
                                     em_error *err)
{
    if (s->count == SCRATCH_MAX)
        return em_error_set(err, EM_INTERNAL, "%s: scratch list full", what);
    em_status status = em_device_alloc(s->device, bytes, what, out, err);
    if (status == EM_OK)
        s->pointers[s->count++] = *out;
    return status;
}

/* Frees at once: only when the lane has synchronized since the buffers were used. */
static inline void scratch_free_now(scratch *s)
{
    for (uint32_t i = s->count; i > 0; i--)
        em_device_free(s->device, s->pointers[i - 1]);
    s->count = 0;
}

/* ---- lanes, memory and copies (lib/device/cuda_device.c) ---- */

em_status em__cuda_copy_to_device(em_lane *base, void *destination, const void *host_source,
                                  size_t bytes, em_error *err);

em_status em__cuda_copy_to_host(em_lane *base, void *host_destination, const void *source,
                                size_t bytes, em_error *err);

em_status em__cuda_copy_to_host_later(em_lane *base, void *host_destination, const void *source,
                                      size_t bytes, em_error *err);

em_status em__cuda_lane_acquire(em_device *device, em_lane **out, em_error *err);

void em__cuda_lane_release(em_lane *base);

/* Ends an operation that may have enqueued work using its scratch. */
em_status em__cuda_finish_async(scratch *s, cuda_lane *lane, em_status status, em_error *err);

/* Takes pointer out of s (nothing where s does not hold it), to be freed once the lane's
 * work so far has completed: a buffer that work enqueued later still reads, where the
 * rest of s is freed at once. */
em_status em__cuda_free_one_later(scratch *s, cuda_lane *lane, void *pointer, em_error *err);

/* Waits for everything issued on the lane, then frees what was waiting for that. */
em_status em__cuda_lane_sync(cuda_lane *lane, em_error *err);

/* Frees a pool buffer once the lane's work so far has completed. */
em_status em__cuda_free_later(cuda_lane *lane, void *pointer, em_error *err);

/* ---- home-side operations (lib/device/cuda_home_ops.c) ---- */

em_status em__cuda_combine(em_lane *base, const em_device_batch *batch, em_combiner combiner,
                           uint32_t dim, const float *vectors, float *out, em_error *err);

em_status em__cuda_copy_repeats(em_lane *base, const em_device_batch *batch,
                                const uint32_t *first_positions, uint32_t dim, float *out,
                                em_error *err);

em_status em__cuda_partition_keys(em_lane *base, const uint64_t *unique, uint64_t n,
                                  uint32_t shard_count, const uint32_t *first_positions,
                                  uint64_t *partitioned, uint32_t *position, uint32_t *targets,
                                  uint64_t *shard_counts, em_error *err);

em_status em__cuda_spread_keys_async(em_lane *base, const uint64_t *unique, uint64_t n,
                                     const uint32_t *count, uint32_t shard_count,
                                     const em_spread *spread, uint64_t *buckets,
                                     uint32_t *bucket_counts, uint32_t *position,
                                     em_error *err);

em_status em__cuda_unique_partition_keys(em_lane *base, const uint64_t *keys, uint64_t n,
                                         uint32_t shard_count, uint64_t *unique,
                                         uint32_t *inverse, uint32_t *first_positions,
                                         uint64_t *partitioned, uint32_t *position,
                                         uint32_t *targets, uint64_t *unique_count,
                                         uint64_t *shard_counts, em_error *err);

em_status em__cuda_unique_partition_find_async(em_shard *const *shards, uint32_t shard_count,
                                              em_lane *base, const uint64_t *keys, uint64_t n,
                                              uint64_t *unique, uint32_t *inverse,
                                              uint32_t *first_positions, uint64_t *partitioned,
                                              uint32_t *position, uint32_t *targets,
                                              uint64_t *rows, uint32_t *shard_starts,
                                              uint64_t *missing, em_error *err);
/* unique_partition_find_async's finds: the first *unique_count of keys[0..n) (a device
 * word), each in its shard among shards[0..count) (count > 1, every one this lane's
 * device's), rows as each shard numbers them, missing[s] (device words, zeroed) += shard
 * s's absent keys; ordered after the shards' writes on other lanes, and recorded. */
em_status em__cuda_shards_find_local_async(em_shard *const *shards, uint32_t count,
                                           cuda_lane *lane, const uint64_t *keys, uint64_t n,
                                           const uint32_t *unique_count, uint64_t *rows,
                                           uint64_t *missing, em_error *err);

em_status em__cuda_sum_gradients(em_lane *base, const em_device_batch *batch,
                                 em_combiner combiner, uint32_t dim, const float *gradients,
                                 float *partitioned_gradients, em_error *err);

em_status em__cuda_unique_keys(em_lane *base, const uint64_t *keys, uint64_t n,
                               uint64_t *unique, uint32_t *inverse, uint32_t *first_positions,
                               uint64_t *unique_count, em_error *err);

em_status em__cuda_unique_keys_async(em_lane *base, const uint64_t *keys, uint64_t n,
                                     uint64_t *unique, uint32_t *inverse,
                                     uint32_t *first_positions, const uint32_t **count,
                                     em_error *err);

/* The lane's pinned readback memory, at least bytes of it (grown: nothing of the lane
 * may be copying into it); RESOURCE_EXHAUSTED beyond LANE_READBACK_MAX. */
em_status em__cuda_lane_readback(cuda_lane *lane, size_t bytes, uint8_t **out, em_error *err);

em_status em__cuda_take_scan_temp(scratch *s, cuda_lane *lane, uint64_t n, void **temp,
                                  size_t *temp_bytes, em_error *err);

/* ---- shards (lib/device/cuda_shard.c) ---- */

em_status em__cuda_shard_check_apply_async(em_shard *base, em_lane *lane_base,
                                           const uint64_t *keys, const uint64_t *rows, uint64_t n,
                                           const float *gradients, float gradient_bound,
                                           uint64_t *first_problem, int *bounded, float *largest,
                                           em_error *err);
em_status em__cuda_shards_check_async(em_shard *const *shards, uint32_t count,
                                     em_lane *lane_base, const uint64_t *keys,
                                     const uint64_t *offsets, const uint64_t *rows,
                                     const float *gradients, uint64_t *first_problems,
                                     em_error *err);
em_status em__cuda_shard_check_apply(em_shard *base, em_lane *lane_base, const uint64_t *keys,
                                     const uint64_t *rows, uint64_t n, const float *gradients,
                                     float gradient_bound, uint64_t *first_problem, int *bounded,
                                     float *largest, em_error *err);
em_status em__cuda_shard_apply(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                               uint64_t n, const float *gradients, float largest,
                               em_error *err);
em_status em__cuda_shards_apply(em_shard *const *shards, uint32_t count, em_lane *lane_base,
                                const uint64_t *offsets, const uint64_t *rows,
                                const float *gradients, uint64_t accessed, uint32_t updated,
                                em_error *err);
em_status em__cuda_shards_gather(em_shard *const *shards, uint32_t count, em_lane *lane_base,
                                 const uint64_t *offsets, const uint64_t *rows,
                                 const uint32_t *targets, float *vectors, uint64_t accessed,
                                 uint32_t updated, em_error *err);
em_status em__cuda_shards_insert_missing_async(em_shard *const *shards, uint32_t count,
                                               em_lane *lane_base, const uint64_t *keys,
                                               const uint64_t *offsets, const uint64_t *missing,
                                               uint64_t *rows, em_error *err);

em_status em__cuda_shard_create(em_device *device, const em_shard_spec *spec, em_shard **out,
                                em_error *err);

void em__cuda_shard_destroy(em_shard *base);

em_status em__cuda_shard_export(em_shard *base, em_lane *lane_base, uint64_t *cursor,
                                uint64_t *keys, float *values, uint64_t *rows, uint64_t max,
                                uint64_t *count, em_error *err);
em_status em__cuda_shard_read_rows(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                   uint64_t n, float *values, em_error *err);

em_status em__cuda_shard_find(em_shard *base, em_lane *lane_base, const uint64_t *keys,
                              uint64_t n, uint64_t *rows, uint64_t *missing, em_error *err);
em_status em__cuda_shard_find_async(em_shard *base, em_lane *lane_base, const uint64_t *keys,
                                    uint64_t n, uint64_t *rows, uint64_t *missing, em_error *err);
em_status em__cuda_shards_find_async(em_shard *const *shards, uint32_t count,
                                     em_lane *lane_base, const uint64_t *keys,
                                     const uint64_t *offsets, uint64_t *rows, uint64_t *missing,
                                     em_error *err);

em_status em__cuda_shards_pull_async(em_shard *const *bases, uint32_t shard_count,
                                     em_lane *lane_base, const em_device_batch *batch,
                                     em_combiner combiner, const uint64_t *unique,
                                     const uint32_t *count, bool create, uint64_t *rows,
                                     uint64_t *missing, float *out, uint64_t accessed,
                                     uint32_t updated, em_error *err);

em_status em__cuda_shards_push_async(em_shard *const *bases, uint32_t shard_count,
                                     em_lane *lane_base, const uint64_t *unique,
                                     const uint32_t *count, uint64_t n, const float *gradients,
                                     bool create, uint64_t *rows, uint64_t *missing,
                                     uint64_t *problem, uint64_t accessed, uint32_t updated,
                                     em_error *err);

em_status em__cuda_shards_find_check_async(em_shard *const *bases, uint32_t shard_count,
                                           em_lane *lane_base, const uint64_t *unique,
                                           const uint32_t *count, uint64_t n,
                                           const float *gradients, uint64_t *rows,
                                           uint64_t *answers, em_error *err);

em_status em__cuda_shards_step_async(em_shard *const *bases, uint32_t shard_count,
                                     em_lane *lane_base, const uint64_t *keys, uint64_t *rows,
                                     const uint32_t *count, uint64_t n, const float *gradients,
                                     const uint64_t *answers, uint32_t parts, uint64_t accessed,
                                     uint32_t updated, em_error *err);

em_status em__cuda_shards_touch_async(em_shard *const *bases, uint32_t shard_count,
                                      em_lane *lane_base, const uint64_t *rows,
                                      const uint32_t *count, uint64_t n, const uint64_t *answers,
                                      uint32_t parts, uint64_t accessed, uint32_t updated,
                                      em_error *err);

em_status em__cuda_shard_gather(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                uint64_t n, const uint32_t *targets, float *vectors,
                                em_error *err);

em_status em__cuda_shard_insert_missing_async(em_shard *base, em_lane *lane_base,
                                             const uint64_t *keys, uint64_t n, uint64_t *rows,
                                             bool initialize, em_error *err);
em_status em__cuda_shard_insert_settle(em_shard *base, em_error *err);
em_status em__cuda_shard_insert_missing(em_shard *base, em_lane *lane_base,
                                        const uint64_t *keys, uint64_t n, uint64_t *rows,
                                        bool initialize, em_error *err);

em_status em__cuda_shard_erase(em_shard *base, em_lane *lane_base, const uint64_t *keys,
                               const uint64_t *rows, uint64_t n, em_error *err);
em_status em__cuda_shard_fill_initial(em_shard *base, em_lane *lane_base, const uint64_t *keys,
                                      const uint64_t *rows, uint64_t n, const uint32_t *targets,
                                      float *vectors, em_error *err);
em_status em__cuda_shard_touch(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                               uint64_t n, uint64_t accessed, uint32_t updated, bool pushed,
                               em_error *err);
em_status em__cuda_shard_read_access(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                     uint64_t n, em_row_access *out, em_error *err);
em_status em__cuda_shard_write_access(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                      uint64_t n, const em_row_access *in, em_error *err);
em_status em__cuda_shard_evict(em_shard *base, em_lane *lane_base, const em_evict_spec *spec,
                               uint64_t *keys, uint64_t *rows, em_error *err);
em_status em__cuda_shards_evict_begin(em_lane *lane, em_shard_evict_part *parts, uint32_t count,
                                      void **pending, em_error *err);
void em__cuda_shards_evict_end(void *pending, em_status synchronized, const em_error *sync_err);
em_status em__cuda_shard_expire(em_shard *base, em_lane *lane_base, uint32_t update_clock,
                                uint32_t min_age, uint64_t *cursor, uint64_t scan,
                                uint64_t *keys, uint64_t *rows, uint64_t *count, em_error *err);
em_status em__cuda_shard_reserve(em_shard *base, em_lane *lane, uint64_t new_keys, uint64_t evicted,
                                 em_error *err);

void em__cuda_shard_stats(em_shard *base, em_shard_stats *out);

em_status em__cuda_shard_write_rows(em_shard *base, em_lane *lane_base, const uint64_t *rows,
                                    uint64_t n, const uint32_t *sources, const float *values,
                                    em_error *err);

#endif
