/*
 * DESIGN: the one door between the engine (C) and the GPU (CUDA).
 *
 * Everything lib/ needs from CUDA and NCCL goes through the extern "C" functions
 * below, so no CUDA or NCCL header is ever included outside kernels/. There are two
 * kinds of functions:
 *
 *   runtime wrappers   device count and properties, memory, pinned host memory,
 *                      streams, events, copies, NCCL communicators. Streams, events
 *                      and communicators are opaque; a stream remembers its GPU, so
 *                      every call that takes one works from any host thread.
 *   launchers          one kernel (or one CUB primitive) each, enqueued on a stream
 *                      and returning at once. lib/device/cuda_device.c strings them together
 *                      into the device operations of lib/device/device.h; all scratch memory
 *                      is passed in (it comes from the device's pool), so nothing
 *                      here allocates on the request path.
 *
 * Every function returns an em_gpu_status: code 0 on success, else the CUDA (or NCCL)
 * error code with the name of the call that failed and the library's message (both
 * static strings). A launcher's status reports launch errors only; a fault inside a
 * kernel surfaces at the next synchronizing call on its stream.
 *
 * The per-element work of each kernel is written once, in kernels/kernel_logic.h, as
 * functions that compile for the host too; tests run them serially on the CPU (and
 * tests/support/kernels_emulated.c implements this whole header with them).
 *
 * Sizes: key counts are 64-bit; per-request positions and ranks are 32-bit (a request
 * has at most UINT32_MAX keys, lib/table/table.c).
 */
#ifndef EMBER_KERNELS_EMBER_KERNELS_H
#define EMBER_KERNELS_EMBER_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "common/combiner.h"
#include "common/initializer.h"
#include "common/optimizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status ------------------------------------------------------------------------ */

typedef struct em_gpu_status {
    int code;            /* 0: success; else a cudaError_t or ncclResult_t value */
    int out_of_memory;   /* nonzero when the failure was an allocation */
    const char *call;    /* the failing call, e.g. "cudaMalloc" (static), NULL on success */
    const char *message; /* the library's description (static), NULL on success */
    int fatal;           /* nonzero when the GPU's context is lost: a sticky CUDA error (a
                          * kernel fault, an uncorrectable ECC error: every later call
                          * returns it) or an NCCL asynchronous error; only a new process
                          * can use the GPU again */
} em_gpu_status;

/* ---- runtime ------------------------------------------------------------------------ */

typedef struct em_gpu_stream em_gpu_stream;
typedef struct em_gpu_event em_gpu_event;
typedef struct em_gpu_comm em_gpu_comm;

typedef struct em_gpu_device_info {
    char name[256];
    uint64_t total_bytes;
    uint32_t multiprocessors;
    uint32_t compute_major, compute_minor;
} em_gpu_device_info;

/* Visible GPUs. Fails (never crashes) without a driver or a device. */
em_gpu_status em_gpu_device_count(int *count);
/* The CUDA runtime's codes for the ways em_gpu_device_count finds no GPU: none is
 * visible, the driver is older than the runtime (or absent: the two read alike), and
 * the stub libcuda of a toolkit was loaded instead of a driver. */
#define EM_GPU_ERROR_NO_DEVICE 100
#define EM_GPU_ERROR_INSUFFICIENT_DRIVER 35
#define EM_GPU_ERROR_STUB_LIBRARY 34
/* The CUDA version the installed driver supports (0 without a driver) and the one this
 * build's runtime needs, as 1000 * major + 10 * minor. */
em_gpu_status em_gpu_versions(int *driver, int *runtime);
em_gpu_status em_gpu_device_info_get(int ordinal, em_gpu_device_info *out);
/* Whether this build's kernels run on GPU ordinal (they are compiled for the
 * gpu_architectures option only): fails with "no kernel image is available" if not. */
em_gpu_status em_gpu_kernels_supported(int ordinal);
em_gpu_status em_gpu_memory_info(int ordinal, uint64_t *free_bytes, uint64_t *total_bytes);

/* Device memory (region provider of the device pool; never on the request path). */
em_gpu_status em_gpu_malloc(int ordinal, size_t bytes, void **out);
void em_gpu_free(int ordinal, void *pointer);
/* Whether memory going back to a device's pool is to be filled with garbage first
 * (em_gpu_fill_freed): 0 on a GPU; 1 on the emulated kernels, so that a request that
 * reads scratch after its lane gave it back reads 0xa5 bytes there, as a GPU's would
 * read whatever took the memory next. */
int em_gpu_fills_freed(void);
void em_gpu_fill_freed(void *pointer, size_t bytes);

/* Page-locked host memory, usable by every GPU (staging buffers). */
em_gpu_status em_gpu_host_alloc(size_t bytes, void **out);
void em_gpu_host_free(void *pointer);

/* A non-blocking stream on GPU ordinal (does not synchronize with the legacy stream). */
em_gpu_status em_gpu_stream_create(int ordinal, em_gpu_stream **out);
void em_gpu_stream_destroy(em_gpu_stream *stream);
em_gpu_status em_gpu_stream_synchronize(em_gpu_stream *stream);
/* Waits once for the work so far of count streams, of one GPU or several: the host polls
 * them together, so GPUs that work at once are waited for in one round trip. On an
 * error, *failed is the index of the stream that reported it (else -1); count is at most
 * 64. */
em_gpu_status em_gpu_streams_synchronize(em_gpu_stream *const *streams, int count,
                                         int *failed);

/* Events order work between streams; timing events also measure it (benchmarks). */
em_gpu_status em_gpu_event_create(int ordinal, int timing, em_gpu_event **out);
void em_gpu_event_destroy(em_gpu_event *event);
em_gpu_status em_gpu_event_record(em_gpu_event *event, em_gpu_stream *stream);
/* Later work on stream waits until the event's last recorded point has completed. */
em_gpu_status em_gpu_stream_wait(em_gpu_stream *stream, em_gpu_event *event);
em_gpu_status em_gpu_event_synchronize(em_gpu_event *event);
em_gpu_status em_gpu_event_elapsed_ms(em_gpu_event *start, em_gpu_event *end, float *ms);

/* Asynchronous copy of bytes between any two of host (pinned or pageable) and device
 * memory (unified addressing decides the direction); ordered on stream. */
em_gpu_status em_gpu_memcpy_async(em_gpu_stream *stream, void *destination, const void *source,
                                  size_t bytes);
em_gpu_status em_gpu_memset_async(em_gpu_stream *stream, void *destination, int value,
                                  size_t bytes);

/* One NCCL communicator per listed GPU, rank i on ordinals[i] (ncclCommInitAll). */
em_gpu_status em_gpu_comm_init_all(const int *ordinals, int count, em_gpu_comm **comms);
/* Opens every connection the communicators will use (NCCL connects lazily, at a pair's
 * first transfer): one byte from every rank to every other, in one group, waited for.
 * Takes NCCL's buffers now, before the pools are carved from the free memory. */
em_gpu_status em_gpu_comm_warm(em_gpu_comm *const *comms, const int *ordinals, int count);
void em_gpu_comm_destroy(em_gpu_comm *comm);

/* One point-to-point transfer of an exchange: ranks index the comms array. */
typedef struct em_gpu_send_recv {
    const void *source;
    em_gpu_stream *source_stream;
    int source_rank;
    void *destination;
    em_gpu_stream *destination_stream;
    int destination_rank;
    size_t bytes;
} em_gpu_send_recv;

/* Runs every transfer as one NCCL group: ncclSend on the source stream with the source
 * rank's communicator, ncclRecv on the destination stream with the destination's.
 * Callers serialize groups (NCCL needs the same order of operations on every rank). */
em_gpu_status em_gpu_comm_exchange(em_gpu_comm *const *comms, const em_gpu_send_recv *transfers,
                                   size_t count);

/* ---- shared primitives -------------------------------------------------------------- */

/* out[i] = i for i < n. */
em_gpu_status em_gpu_iota_u32(em_gpu_stream *stream, uint32_t *out, uint64_t n);

/* Exclusive prefix sum of n values (CUB). temp: em_gpu_scan_temp_bytes bytes for n
 * (asked on the stream's GPU; no work is enqueued). */
em_gpu_status em_gpu_scan_temp_bytes(em_gpu_stream *stream, uint64_t n, size_t *bytes);
em_gpu_status em_gpu_exclusive_scan_u32(em_gpu_stream *stream, void *temp, size_t temp_bytes,
                                        const uint32_t *in, uint32_t *out, uint64_t n);

/* Stable sort of (key, value) pairs by the low end_bit bits of key (CUB radix sort).
 * end_bit 0 copies the pairs unchanged. temp: em_gpu_sort_temp_bytes bytes for n and
 * end_bit. */
em_gpu_status em_gpu_sort_temp_bytes(em_gpu_stream *stream, uint64_t n, uint32_t end_bit,
                                     size_t *bytes);
em_gpu_status em_gpu_sort_pairs_u32(em_gpu_stream *stream, void *temp, size_t temp_bytes,
                                    const uint32_t *keys_in, uint32_t *keys_out,
                                    const uint32_t *values_in, uint32_t *values_out, uint64_t n,
                                    uint32_t end_bit);

/* For sorted keys[0..n): starts[s] = first i with keys[i] >= s, for s in 0..segments
 * (starts[segments] = n). Keys are < segments. */
em_gpu_status em_gpu_segment_starts(em_gpu_stream *stream, const uint32_t *sorted_keys,
                                    uint64_t n, uint32_t segments, uint32_t *starts);

/* ---- home-side request operations (lib/device/device.h) ------------------------------------ */

/* unique_keys, in three steps over a scratch table of slot_count (a power of two)
 * uint32 entries, zeroed, that ends up holding, per distinct key, 1 + its first
 * position:
 *   claim    slot_of[i] = the slot of keys[i]
 *   rank     rank = exclusive scan over i in 0..n of "i is its key's first position"
 *            (em_gpu_unique_first, computed as the scan reads it: no flags array, no
 *            kernel of its own); rank[n] is the unique count. temp:
 *            em_gpu_unique_rank_temp_bytes bytes for n
 *   scatter  unique[rank[i]] = keys[i] and first_positions[rank[i]] = i for first
 *            positions; inverse[i] = rank of the key's first position */
em_gpu_status em_gpu_unique_claim(em_gpu_stream *stream, const uint64_t *keys, uint64_t n,
                                  uint32_t *table, uint64_t slot_count, uint32_t *slot_of);
em_gpu_status em_gpu_unique_rank_temp_bytes(em_gpu_stream *stream, uint64_t n, size_t *bytes);
em_gpu_status em_gpu_unique_rank(em_gpu_stream *stream, void *temp, size_t temp_bytes,
                                 const uint32_t *table, const uint32_t *slot_of, uint64_t n,
                                 uint32_t *rank);
em_gpu_status em_gpu_unique_scatter(em_gpu_stream *stream, const uint64_t *keys, uint64_t n,
                                    const uint32_t *table, const uint32_t *slot_of,
                                    const uint32_t *rank, uint64_t *unique, uint32_t *inverse,
                                    uint32_t *first_positions);

/* owner[u] = em_key_shard(unique[u], shard_count); index[u] = u. */
em_gpu_status em_gpu_partition_owners(em_gpu_stream *stream, const uint64_t *unique, uint64_t n,
                                      uint32_t shard_count, uint32_t *owner, uint32_t *index);
/* em_gpu_partition_owners over n entries of which the first *count (a device word) are
 * keys: the others get owner shard_count, after every shard once sorted. */
em_gpu_status em_gpu_partition_owners_counted(em_gpu_stream *stream, const uint64_t *unique,
                                              uint64_t n, const uint32_t *count,
                                              uint32_t shard_count, uint32_t *owner,
                                              uint32_t *index);
/* With sorted_index the unique indices stably sorted by owner: partitioned[i] =
 * unique[sorted_index[i]], position[sorted_index[i]] = i, and (when targets is not
 * NULL) targets[i] = first_positions[sorted_index[i]]. */
em_gpu_status em_gpu_partition_scatter(em_gpu_stream *stream, const uint64_t *unique,
                                       const uint32_t *sorted_index,
                                       const uint32_t *first_positions, uint64_t n,
                                       uint64_t *partitioned, uint32_t *position,
                                       uint32_t *targets);

/* Where a table's shards sit on the devices a request spreads its keys over: device i
 * of count holds shards [first_shard[i], first_shard[i + 1]), first_shard[count] being
 * the table's shard count (a table's shards are contiguous blocks per device). */
#define EM_GPU_SPREAD_MAX 64u
typedef struct em_gpu_spread {
    uint32_t count;
    uint32_t first_shard[EM_GPU_SPREAD_MAX + 1];
} em_gpu_spread;

/* After a counted partition by shard (partitioned and position as em_gpu_partition_scatter
 * leaves them, starts as em_gpu_segment_starts over shard_count + 1 segments): each
 * device's keys into a bucket of its own, buckets[i * n ...] for device i, in partitioned
 * order; bucket_counts[i] = how many; position[u] (for every u whose key is one of the
 * counted ones) becomes the key's place in buckets. */
em_gpu_status em_gpu_spread_keys(em_gpu_stream *stream, const uint64_t *partitioned, uint64_t n,
                                 const uint32_t *starts, uint32_t shard_count,
                                 const em_gpu_spread *spread, uint64_t *buckets,
                                 uint32_t *bucket_counts, uint32_t *position);

/* key_row[k] = the row of key position k (offsets: rows + 1 entries). */
em_gpu_status em_gpu_key_rows(em_gpu_stream *stream, const uint32_t *offsets, uint32_t rows,
                              uint64_t nnz, uint32_t *key_row);

/* The batch as the sum and combine kernels see it (device pointers). */
typedef struct em_gpu_batch {
    uint32_t rows;
    uint64_t nnz;
    const uint32_t *offsets;  /* rows + 1 */
    const uint32_t *inverse;  /* nnz */
    const uint32_t *position; /* unique_count; NULL: u (one shard, planned at once) */
    uint64_t unique_count;
    em_combiner combiner;
    uint32_t dim;             /* floats per vector */
} em_gpu_batch;

/* Gradient sums. sorted_inverse is batch->inverse sorted ascending and sorted_positions
 * the key positions in that order (increasing within a unique index): unique u's
 * positions are the run of sorted_inverse equal to u, found by the kernels themselves
 * (kernels/kernel_logic.h: em_gpu_run_bounds). key_row is needed unless the combiner is
 * NONE. out[position[u]] = the contributions in that order added by the tree of
 * common/gradient_sum.h. partials: scratch of em_gpu_sum_partials_floats(nnz, dim) floats
 * (NULL when that is 0) for the chunk sums of keys present more than 32 times. Two
 * launches (one when nnz <= 32): the keys that are not hot and the first level of the
 * hot ones' trees, then the rest of those trees. */
em_gpu_status em_gpu_sum_gradients(em_gpu_stream *stream, const em_gpu_batch *batch,
                                   const uint32_t *sorted_inverse,
                                   const uint32_t *sorted_positions, const uint32_t *key_row,
                                   const float *gradients, float *partials, float *out);
/* Slots of the partials buffer: a hot key whose positions start at s owns slots from
 * s / EM_GPU_SUM_SLOT_SPACING on (kernels/kernel_logic.h). 0 floats when no key can occur
 * more than 32 times (nnz <= 32). */
#define EM_GPU_SUM_SLOT_SPACING 16u
static inline uint64_t em_gpu_sum_slots(uint64_t nnz)
{
    return nnz / EM_GPU_SUM_SLOT_SPACING + 1;
}
static inline uint64_t em_gpu_sum_partials_floats(uint64_t nnz, uint32_t dim)
{
    return nnz <= 32 ? 0 : em_gpu_sum_slots(nnz) * dim;
}
/* Pull output: NONE copies vectors[position[inverse[k]]] to out[k]; pooled sums each
 * row's vectors in key order from 0.0 and divides by the combiner's divisor. */
em_gpu_status em_gpu_combine(em_gpu_stream *stream, const em_gpu_batch *batch,
                             const float *vectors, float *out);
/* Per-key output whose distinct keys sit at their first positions: out[k] =
 * out[first_positions[inverse[k]]] for the other positions (dim floats each). */
em_gpu_status em_gpu_copy_repeats(em_gpu_stream *stream, const uint32_t *inverse, uint64_t nnz,
                                  const uint32_t *first_positions, uint32_t dim, float *out);

/* ---- shards: hash map ---------------------------------------------------------------- */

/* Key values that mark slots; keys equal to them live in the header's side rows. */
#define EM_GPU_EMPTY_KEY UINT64_MAX
#define EM_GPU_TOMBSTONE_KEY (UINT64_MAX - 1)
/* Row of an absent key (lib/device/device.h EM_ROW_NONE); a side row being claimed. */
#define EM_GPU_ROW_NONE UINT64_MAX
#define EM_GPU_ROW_PENDING (UINT64_MAX - 1)

#if defined(__cplusplus)
#define EM_GPU_ALIGN16 alignas(16)
#else
#define EM_GPU_ALIGN16 _Alignas(16)
#endif

/* Slots of a hash map bucket: one 128-byte line (kernel_logic.h: em_gpu_probe). Maps made
 * by shards have a power-of-two slot count of at least 16. */
#define EM_GPU_BUCKET_SLOTS 8u

/* One open-addressing slot: key and row side by side, so a probe reads one sector. */
typedef struct em_gpu_slot {
    EM_GPU_ALIGN16 uint64_t key;
    uint64_t row;
} em_gpu_slot;

/* Device-resident counters of a map. Keys stored = rows - free_count. */
typedef struct em_gpu_map_header {
    uint64_t rows;          /* rows handed out from the counter (dense from 0): the row limit */
    uint64_t side_rows[2];  /* rows of the keys EMPTY and TOMBSTONE, or ROW_NONE */
    uint64_t overflow;      /* set when an insert found no free slot */
    uint64_t free_count;    /* released rows in the map's free list */
    uint64_t free_taken;    /* of them, taken by inserts since the last settle */
    uint64_t tombstones;    /* erased slots not yet dropped by a rehash */
} em_gpu_map_header;

/* A map's slots are one array (slots), or, for a large map, segments of equal size (a
 * power of two of at least a bucket): slot i is slot i mod 2^segment_shift of
 * segments[i >> segment_shift], a device table of the segments; slots is NULL then.
 * Segments let a map grow by the slots it adds (kernel_logic.h: em_gpu_map_slot;
 * lib/device/cuda_shard.c: rehash_map). */
typedef struct em_gpu_map {
    em_gpu_slot *slots;
    em_gpu_slot *const *segments;
    uint32_t segment_shift;
    uint64_t slot_count;
    em_gpu_map_header *header;
    uint64_t seed; /* xor-ed into keys before hashing them for slots (EM_HASHMAP_SEED, or a
                    * loaded table's own: em_table_create_seeded) */
    uint64_t *free_rows; /* released rows, free_count of them (room for every erase
                          * launched); NULL for a map nothing was erased from */
} em_gpu_map;

/* Every slot to (EMPTY, ROW_NONE). */
em_gpu_status em_gpu_map_clear(em_gpu_stream *stream, em_gpu_slot *slots, uint64_t slot_count);
/* rows[i] = row of keys[i] or ROW_NONE; *missing (device) += absent keys. */
em_gpu_status em_gpu_map_find(em_gpu_stream *stream, em_gpu_map map, const uint64_t *keys,
                              uint64_t n, uint64_t *rows, uint64_t *missing);
/* How a find searches, with the same answers: a group of EM_GPU_BUCKET_SLOTS threads a
 * key, each reading one slot of a bucket per step, or a thread a key reading a bucket's
 * slots in one pass. AUTO, which every find but em_gpu_map_find_as uses: the group while
 * n keys' groups fit in the GPU at once, a thread a key for more. */
typedef enum em_gpu_find_form {
    EM_GPU_FIND_AUTO,
    EM_GPU_FIND_GROUPED,
    EM_GPU_FIND_EACH,
} em_gpu_find_form;
/* em_gpu_map_find in the form asked for (benchmarks). */
em_gpu_status em_gpu_map_find_as(em_gpu_stream *stream, em_gpu_map map, const uint64_t *keys,
                                 uint64_t n, uint64_t *rows, uint64_t *missing,
                                 em_gpu_find_form form);
/* em_gpu_map_find of the first *count (device) of at most n keys: a count still on the
 * GPU (a dedupe's), the grid sized by n. */
em_gpu_status em_gpu_map_find_counted(em_gpu_stream *stream, em_gpu_map map,
                                      const uint64_t *keys, uint64_t n, const uint32_t *count,
                                      uint64_t *rows, uint64_t *missing);
/* One map's part of a find over several maps at once (the shards of one device): keys
 * [0, n) looked up in map, rows[i] their rows or ROW_NONE, *missing (device) += the
 * absent ones. */
typedef struct em_gpu_map_part {
    em_gpu_map map;
    const uint64_t *keys;
    uint64_t n;
    uint64_t *rows;
    uint64_t *missing;
} em_gpu_map_part;
/* em_gpu_map_find of every part (parts: device memory, `count` of them, of at most
 * most_keys keys each; all_keys: their keys together), in one launch. */
em_gpu_status em_gpu_maps_find(em_gpu_stream *stream, const em_gpu_map_part *parts,
                               uint32_t count, uint64_t most_keys, uint64_t all_keys);
/* A device's shards of one table seen as one, for requests that go at once over all of
 * them: shard s (em_key_shard) holds its keys in maps[s], and its rows are rows
 * row_base[s] + r of one storage whose blocks are every shard's in turn. maps and
 * row_base are device arrays of count entries. */
typedef struct em_gpu_shards {
    const em_gpu_map *maps;
    const uint64_t *row_base;
    uint32_t count;
    uint64_t row_limit; /* rows of the storage: shard s owns rows row_base[s] up to
                         * row_base[s + 1] (the last one up to row_limit) */
} em_gpu_shards;
/* em_gpu_map_find_counted over the shards: rows[i] = row_base[s] + the row of keys[i] in
 * its shard s, or ROW_NONE; *missing (device) += absent keys. */
em_gpu_status em_gpu_shards_find_counted(em_gpu_stream *stream, em_gpu_shards shards,
                                         const uint64_t *keys, uint64_t n, const uint32_t *count,
                                         uint64_t *rows, uint64_t *missing);
/* The first *count of keys[0..n) (a device word, at most n), each in its shard s
 * (em_key_shard over shards.count): rows[i] its row as its own shard numbers it (not
 * row_base[s] + it), or ROW_NONE, and missing[s] (shards.count device words) += the
 * absent keys of shard s. Keys in shard order (a partition's) count with an atomic per
 * shard a warp. */
em_gpu_status em_gpu_shards_find_local(em_gpu_stream *stream, em_gpu_shards shards,
                                       const uint64_t *keys, uint64_t n, const uint32_t *count,
                                       uint64_t *rows, uint64_t *missing);
/* What a step decided on the GPU looks at (device words, each NULL for none): it steps
 * the first *count rows, and none at all when *missing is not 0 (keys the find did not
 * find) or *problem is not UINT64_MAX (a check found a row the step would break). With
 * parts above 1, the finds and checks of that many devices (a push spread over them):
 * none at all when any of missing[2p] is not 0 or any of problem[2p] is set, p below
 * parts (each device's pair of words side by side). */
typedef struct em_gpu_gate {
    const uint32_t *count;
    const uint64_t *missing;
    const uint64_t *problem;
    uint32_t parts;
} em_gpu_gate;
/* For each i with rows[i] == ROW_NONE: rows[i] = the row of keys[i], inserting the key
 * when absent (inserted[i] = 1 then, else 0) with a released row from the top of the
 * free list while there is one, else the next row of header->rows. Settle the map
 * before its next erase. */
em_gpu_status em_gpu_map_insert(em_gpu_stream *stream, em_gpu_map map, const uint64_t *keys,
                                uint64_t n, uint64_t *rows, uint8_t *inserted);
/* em_gpu_map_insert of the keys the gate leaves (em_gpu_gate: the first *gate.count of at
 * most n keys, its missing words NULL); inserted[i] for i past them is left as it was.
 * Nothing at all is inserted when a problem word of the gate is set when the kernel
 * runs: a push's check failed (on any of the devices of a push spread over them). */
em_gpu_status em_gpu_map_insert_counted(em_gpu_stream *stream, em_gpu_map map,
                                        const uint64_t *keys, uint64_t n, em_gpu_gate gate,
                                        uint64_t *rows, uint8_t *inserted);
/* em_gpu_map_insert_counted over the shards: keys[i] goes into its shard s's map and
 * rows[i] = row_base[s] + its row there. A row beyond the shard's part of the storage
 * (insert without reserve) sets the map's overflow flag and leaves rows[i] ROW_NONE,
 * inserted[i] 0. Settle the maps (em_gpu_settle, with the launch that writes the new rows)
 * before their next erase. */
em_gpu_status em_gpu_shards_insert_counted(em_gpu_stream *stream, em_gpu_shards shards,
                                           const uint64_t *keys, uint64_t n, em_gpu_gate gate,
                                           uint64_t *rows, uint8_t *inserted);
/* Removes keys[i] where rows is NULL or rows[i] is a stored row: the key's slot becomes
 * a tombstone (header->tombstones grows), or its side row ROW_NONE, and its row goes
 * on the free list. Keys distinct; the free list has room. */
em_gpu_status em_gpu_map_erase(em_gpu_stream *stream, em_gpu_map map, const uint64_t *keys,
                               const uint64_t *rows, uint64_t n);
/* Places every key of old_slots (with its row) into the empty map. */
em_gpu_status em_gpu_map_rehash(em_gpu_stream *stream, const em_gpu_slot *old_slots,
                                uint64_t old_slot_count, em_gpu_map map);
/* Export of slots [begin, begin + count): flags[i] = 1 when slot begin + i holds a key;
 * flags[count] = 0. */
em_gpu_status em_gpu_map_export_flags(em_gpu_stream *stream, em_gpu_map map, uint64_t begin,
                                      uint64_t count, uint32_t *flags);
/* With rank the exclusive scan of flags: the first `take` occupied slots go to
 * keys[offset + rank], rows[offset + rank]; *next_slot (device) = one past the slot
 * of rank take - 1. */
em_gpu_status em_gpu_map_export_compact(em_gpu_stream *stream, em_gpu_map map, uint64_t begin,
                                        uint64_t count, const uint32_t *flags,
                                        const uint32_t *rank, uint64_t take, uint64_t offset,
                                        uint64_t *keys, uint64_t *rows, uint64_t *next_slot);

/* ---- shards: row storage -------------------------------------------------------------- */

/* Per-row access metadata (the layout of lib/device/eviction.h em_row_access). */
typedef struct em_gpu_row_access {
    uint64_t accessed;  /* the table's request clock at the row's last pull or push */
    uint32_t updated;   /* the table's push clock at its last push or creation */
    uint32_t frequency; /* pulls and pushes of the row (saturating) */
} em_gpu_row_access;

/* Rows live in fixed-size blocks: row r at blocks[r >> block_shift] + (r & block_mask) *
 * stride floats, as dim weights then the optimizer state (row_floats in all). Tables
 * whose eviction tracks access keep each row's metadata at access[r >> block_shift] +
 * (r & block_mask). */
typedef struct em_gpu_storage {
    float *const *blocks; /* device array of device pointers */
    em_gpu_row_access *const *access; /* device array of device pointers, or NULL */
    uint32_t block_shift;
    uint64_t block_mask;
    uint32_t stride;      /* floats between rows, a multiple of 4 */
    uint32_t dim;
    uint32_t row_floats;
    uint64_t row_limit;   /* rows the blocks hold; initialisation never writes past it */
} em_gpu_storage;

/* The settle of the maps an insert just took rows from (em_gpu_map_settle_item: drops
 * the released rows the inserts took from the free list), done by the launch that
 * initialises those rows (em_gpu_rows_init, or a push's step: em_gpu_fresh_rows) instead
 * of one of its own: map's when
 * map.header is not NULL, and every map of shards when shards.count is not 0, each
 * header then copied to headers[s] (device memory). Zeroed: none. */
typedef struct em_gpu_settle {
    em_gpu_map map;
    em_gpu_shards shards;
    em_gpu_map_header *headers;
} em_gpu_settle;

/* Initial weights and optimizer state of the rows with inserted[i] != 0 (and zeroed
 * access metadata where the storage keeps it), and the settle asked for (it needs no
 * order with the rows: the inserts before it are done). */
em_gpu_status em_gpu_rows_init(em_gpu_stream *stream, em_gpu_storage storage,
                               const uint64_t *keys, const uint64_t *rows,
                               const uint8_t *inserted, uint64_t n,
                               em_initializer_config initializer, em_optimizer_config optimizer,
                               em_gpu_settle settle);
/* vectors[t] = weights of rows[i], zeros for ROW_NONE and a refused key's row
 * (ROW_PENDING, lib/device/device.h EM_ROW_REJECTED) (dim floats each), where t =
 * targets[i], or i when targets is NULL. */
em_gpu_status em_gpu_rows_gather(em_gpu_stream *stream, em_gpu_storage storage,
                                 const uint64_t *rows, uint64_t n, const uint32_t *targets,
                                 float *vectors);
/* One optimizer step per row with gradients[i]; rows distinct; refused keys' rows
 * (ROW_PENDING) are skipped. */
em_gpu_status em_gpu_rows_apply(em_gpu_stream *stream, em_gpu_storage storage,
                                em_optimizer_config optimizer, const uint64_t *rows, uint64_t n,
                                const float *gradients);
/* The rows a push inserted just before its step: the step's launch gives them their
 * initial values and zeroed access metadata (as em_gpu_rows_init) before stepping them,
 * and does the settle asked for, so a push that creates keys needs no launch of
 * em_gpu_rows_init. Zeroed: none. */
typedef struct em_gpu_fresh_rows {
    const uint64_t *keys;     /* keys[i]: the key of rows[i] */
    const uint8_t *inserted;  /* inserted[i] != 0: rows[i] is new; NULL: none is */
    em_initializer_config initializer;
    em_gpu_settle settle;
} em_gpu_fresh_rows;
/* em_gpu_rows_apply of at most n rows, as the gate says when the kernel runs (the new
 * rows among them initialised first, fresh). */
em_gpu_status em_gpu_rows_apply_gated(em_gpu_stream *stream, em_gpu_storage storage,
                                      em_optimizer_config optimizer, const uint64_t *rows,
                                      uint64_t n, const float *gradients, em_gpu_gate gate,
                                      em_gpu_fresh_rows fresh);
/* em_gpu_rows_touch of at most n rows, as the gate says when the kernel runs: a request
 * touches its rows only when it found them all (and, a push, stepped them), decided on
 * the GPU. */
em_gpu_status em_gpu_rows_touch_gated(em_gpu_stream *stream, em_gpu_storage storage,
                                      const uint64_t *rows, uint64_t n, em_gpu_gate gate,
                                      uint64_t accessed, uint32_t updated, int pushed);
/* Whether one optimizer step per row with gradients[i] keeps every value finite,
 * without writing (common/row_check.h); rows[i] ROW_NONE is the row to be created for
 * keys[i]. *first (device memory, set to UINT64_MAX by the caller) becomes the smallest
 * (i << 32 | code) of the items that fail. */
em_gpu_status em_gpu_rows_check(em_gpu_stream *stream, em_gpu_storage storage,
                                em_optimizer_config optimizer, em_initializer_config initializer,
                                const uint64_t *keys, const uint64_t *rows, uint64_t n,
                                const float *gradients, uint64_t *first);
/* One shard's part of a check over several at once (the shards of one device): the
 * arguments of em_gpu_rows_check. */
typedef struct em_gpu_check_part {
    em_gpu_storage storage;
    em_optimizer_config optimizer;
    em_initializer_config initializer;
    const uint64_t *keys, *rows;
    uint64_t n;
    const float *gradients;
    uint64_t *first;
} em_gpu_check_part;
/* em_gpu_rows_check of every part (parts: device memory, `count` of them, of at most
 * most_keys keys each), in one launch. */
em_gpu_status em_gpu_rows_check_parts(em_gpu_stream *stream, const em_gpu_check_part *parts,
                                      uint32_t count, uint64_t most_keys);
/* em_gpu_rows_check of the first *count (device) of at most n rows. */
em_gpu_status em_gpu_rows_check_counted(em_gpu_stream *stream, em_gpu_storage storage,
                                        em_optimizer_config optimizer,
                                        em_initializer_config initializer, const uint64_t *keys,
                                        const uint64_t *rows, uint64_t n, const uint32_t *count,
                                        const float *gradients, uint64_t *first);
/* A push's find and check in one kernel: em_gpu_map_find_counted (or
 * em_gpu_shards_find_counted) of keys[i], then em_gpu_rows_check_counted of the row found,
 * by the same thread. The rows are the view's (storage numbers them as the map or the
 * shards do). */
em_gpu_status em_gpu_map_find_check_counted(em_gpu_stream *stream, em_gpu_map map,
                                            em_gpu_storage storage,
                                            em_optimizer_config optimizer,
                                            em_initializer_config initializer,
                                            const uint64_t *keys, uint64_t n,
                                            const uint32_t *count, const float *gradients,
                                            uint64_t *rows, uint64_t *missing, uint64_t *first);
em_gpu_status em_gpu_shards_find_check_counted(em_gpu_stream *stream, em_gpu_shards shards,
                                               em_gpu_storage storage,
                                               em_optimizer_config optimizer,
                                               em_initializer_config initializer,
                                               const uint64_t *keys, uint64_t n,
                                               const uint32_t *count, const float *gradients,
                                               uint64_t *rows, uint64_t *missing,
                                               uint64_t *first);
/* A pull's output straight from the rows of a one-shard table, in one pass (no gathered
 * vectors): em_gpu_rows_pull_element over batch->nnz vectors (NONE) or batch->rows
 * (pooled); rows[u] is unique key u's row; batch->position is not used. */
em_gpu_status em_gpu_rows_pull(em_gpu_stream *stream, em_gpu_storage storage,
                               const em_gpu_batch *batch, const uint64_t *rows, float *out);
/* vectors[t] = the initial weights of keys[i] for every i whose rows[i] is a refused
 * key's (ROW_PENDING); t as in em_gpu_rows_gather. */
em_gpu_status em_gpu_rows_fill_initial(em_gpu_stream *stream, em_gpu_storage storage,
                                       em_initializer_config initializer, const uint64_t *keys,
                                       const uint64_t *rows, uint64_t n, const uint32_t *targets,
                                       float *vectors);
/* Records an access of each stored rows[i] (distinct): last access = accessed, frequency
 * + 1 (saturating), last update = updated when pushed or when the row is new (frequency
 * 0). */
em_gpu_status em_gpu_rows_touch(em_gpu_stream *stream, em_gpu_storage storage,
                                const uint64_t *rows, uint64_t n, uint64_t accessed,
                                uint32_t updated, int pushed);

/* One shard's part of an operation over several shards of one device in one launch, a
 * grid row a part (lib/device/cuda_shard.c: the general way of a request over a table's
 * shards): the shard's map and storage, its keys[0, n) and their rows, and what the
 * operation reads or writes besides. Each operation reads only the fields it names. */
typedef struct em_gpu_shard_part {
    em_gpu_map map;
    em_gpu_storage storage;
    const uint64_t *keys;
    uint64_t *rows;
    uint64_t n;
    uint8_t *inserted;          /* inserts: a flag per key */
    em_gpu_map_header *header;  /* inserts: the map's header, once settled */
    const float *gradients;     /* steps: dim floats per row */
    const uint32_t *targets;    /* gathers: where each vector goes, or NULL (in order) */
    float *vectors;             /* gathers: the output */
} em_gpu_shard_part;
/* em_gpu_map_insert of every part (map, keys, n, rows, inserted); parts: device memory,
 * `count` of them, of at most most_keys keys each. */
em_gpu_status em_gpu_parts_insert(em_gpu_stream *stream, const em_gpu_shard_part *parts,
                                  uint32_t count, uint64_t most_keys);
/* em_gpu_map_erase of every part (map, keys, rows: NULL for every key, n); each part's
 * free list has room. */
em_gpu_status em_gpu_parts_erase(em_gpu_stream *stream, const em_gpu_shard_part *parts,
                                 uint32_t count, uint64_t most_keys);
/* em_gpu_rows_init of every part (storage, keys, rows, inserted, n; storages of
 * row_floats floats a row), each part's map settled and its header copied to *header. */
em_gpu_status em_gpu_parts_init(em_gpu_stream *stream, const em_gpu_shard_part *parts,
                                uint32_t count, uint64_t most_keys, uint32_t row_floats,
                                em_initializer_config initializer,
                                em_optimizer_config optimizer);
/* em_gpu_rows_apply of every part (storage, rows, n, gradients; storages of dim weights
 * a row). */
em_gpu_status em_gpu_parts_apply(em_gpu_stream *stream, const em_gpu_shard_part *parts,
                                 uint32_t count, uint64_t most_keys, uint32_t dim,
                                 em_optimizer_config optimizer);
/* em_gpu_rows_gather of every part (storage, rows, n, targets, vectors; storages of dim
 * weights a row); quads: every part's vectors 16-byte aligned, dim a multiple of 4. */
em_gpu_status em_gpu_parts_gather(em_gpu_stream *stream, const em_gpu_shard_part *parts,
                                  uint32_t count, uint64_t most_keys, uint32_t dim, int quads);
/* em_gpu_rows_touch of every part (storage, rows, n). */
em_gpu_status em_gpu_parts_touch(em_gpu_stream *stream, const em_gpu_shard_part *parts,
                                 uint32_t count, uint64_t most_keys, uint64_t accessed,
                                 uint32_t updated, int pushed);

/* An eviction's walk of a map read in one pass (lib/device/cuda_shard.c): its slots
 * flagged and scanned, the occupied ones compacted in slot order into keys, rows and
 * access, its running count kept on the device, so that the host waits once for however
 * many slots. */
typedef struct em_gpu_walk {
    uint64_t taken;       /* occupied slots met so far (may pass want) */
    uint64_t before_wrap; /* taken when the walk went on from slot 0 (a piece with wrap) */
    uint64_t next_slot;   /* one past the slot of entry want - 1, once met; else UINT64_MAX */
    uint64_t reserved;
} em_gpu_walk;

/* A run of slots [begin, begin + count) of a walk's map. The walks of one lane (a shard
 * each) go through a chunk of pieces together, one launch a step: the pieces lie back to
 * back in the chunk's flags (piece p at first_flag, flags[first_flag + count] the next
 * piece's or the chunk's end), a walk's pieces one after another in its order; base_flag
 * is the first flag of the walk's first piece in the chunk. A walk's first piece of all
 * (starts) sets its counts to zero first, and copies kept_count rows from kept_from to
 * kept_to (the request's rows, read back with the walk). With wrap (nonzero) the walk
 * goes on from slot 0 after the piece (walk->before_wrap). */
typedef struct em_gpu_walk_piece {
    em_gpu_map map;
    em_gpu_storage storage;
    uint64_t begin, count;
    uint64_t first_flag, base_flag;
    uint64_t want;
    em_gpu_walk *walk;
    uint64_t *keys, *rows;
    em_gpu_row_access *access;
    const uint64_t *kept_from;
    uint64_t *kept_to;
    uint64_t kept_count;
    uint32_t starts, wrap;
} em_gpu_walk_piece;

/* flags[first_flag + i] = whether slot begin + i of piece p is occupied, for every piece
 * (pieces: device memory, `count` of them, most_slots at least every piece's slots and
 * kept rows, and at least 1), and
 * flags[first_flag + count] = 0 after the last piece; a starting walk's counts zeroed and
 * its kept rows copied. */
em_gpu_status em_gpu_walks_flags(em_gpu_stream *stream, const em_gpu_walk_piece *pieces,
                                 uint32_t count, uint64_t most_slots, uint32_t *flags);
/* With rank the exclusive scan of the chunk's flags: the occupied slot of piece p at
 * flag f becomes entry walk->taken + rank[f] - rank[base_flag] of its walk (keys, rows,
 * and its row's access metadata) when that is below want, and walk->next_slot = one past
 * the slot of entry want - 1. */
em_gpu_status em_gpu_walks_compact(em_gpu_stream *stream, const em_gpu_walk_piece *pieces,
                                   uint32_t count, uint64_t most_slots, const uint32_t *flags,
                                   const uint32_t *rank);
/* After the compaction, one thread, piece after piece: walk->taken += the piece's occupied
 * slots; with wrap, then walk->before_wrap = walk->taken. */
em_gpu_status em_gpu_walks_advance(em_gpu_stream *stream, const em_gpu_walk_piece *pieces,
                                   uint32_t count, const uint32_t *rank);

/* An eviction's choice made on the GPU (lib/device/cuda_shard.c): the count first
 * entries of a walk's window by the policy's order, ties broken by the smaller key
 * (lib/device/eviction.c chooses by the same order on the host), leaving out the rows
 * of the request. An entry's order is a number of 160 bits (em_gpu_rank), read a byte
 * at a time from the top: each pass counts the window's entries that match the bytes
 * fixed so far by their next byte (em_gpu_choice_count), and the pass's last block of
 * each walk fixes that byte as the one where the count-th entry lies, until every
 * entry matching the bytes fixed is chosen; then the chosen entries are flagged
 * (em_gpu_choice_flags), scanned, and written out in window order
 * (em_gpu_choice_write). Several walks (shards of one lane) go through each launch
 * together, a walk per grid row. */
typedef struct em_gpu_rank {
    uint32_t first;    /* lfu: the frequency; age: UINT32_MAX - pushes since the update */
    uint64_t accessed; /* the last access */
    uint64_t key;
} em_gpu_rank;

#define EM_GPU_RANK_DIGITS 20u /* bytes of an em_gpu_rank, top first */
#define EM_GPU_CHOICE_BINS 256u

enum { EM_GPU_CHOICE_OPEN = 0, EM_GPU_CHOICE_SETTLED = 1, EM_GPU_CHOICE_SHORT = 2 };

typedef struct em_gpu_choice {
    /* set by the host */
    const uint64_t *keys, *rows;         /* the window: entries in walk order */
    const em_gpu_row_access *access;
    const em_gpu_walk *walk;             /* its entries: min(walk->taken, want) */
    uint64_t want;
    uint64_t count;                      /* entries to choose (> 0) */
    const uint64_t *kept;                /* the request's rows of the shard (values that
                                          * are not rows among them) */
    uint64_t kept_count;
    uint64_t *kept_bits;                 /* a bit per row below row_limit, cleared */
    uint64_t row_limit;
    uint64_t first_flag;                 /* the walk's first entry in the shared flags */
    uint64_t *out_keys, *out_rows;       /* count each */
    int policy;                          /* em_eviction_policy: 1 lru, 2 lfu, 3 age */
    uint32_t update_clock;
    uint32_t first_digit;                /* the first byte counted (the bytes before it
                                          * taken as 0: an entry with one of them set is
                                          * never chosen) */
    /* the choice in progress */
    uint32_t state;                      /* EM_GPU_CHOICE_* */
    uint32_t digits;                     /* bytes of prefix fixed */
    em_gpu_rank prefix;                  /* those bytes, the others 0 */
    uint64_t remaining;                  /* entries still to choose among those matching */
    uint32_t bins[EM_GPU_CHOICE_BINS];
    uint32_t arrived;                    /* blocks of the count in progress done with it */
    /* what came of it */
    uint64_t taken;                      /* walk->taken, for the host's check of the window */
} em_gpu_choice;

/* Sets each choice's kept_bits for its kept rows (below row_limit). */
em_gpu_status em_gpu_choice_mark_kept(em_gpu_stream *stream, em_gpu_choice *choices,
                                      uint32_t walks, uint64_t most_kept);
/* Counts, per open choice, its free entries that match the fixed bytes by byte digit,
 * and then, in the same launch (the last of the walk's blocks to finish counting), fixes
 * byte digit of the choice; at first_digit it also records taken, and a choice with fewer
 * free entries than count becomes SHORT. */
em_gpu_status em_gpu_choice_count(em_gpu_stream *stream, em_gpu_choice *choices,
                                  uint32_t walks, uint64_t most_held, uint32_t digit);
/* flags[first_flag + i] = whether window entry i (i < want) of each walk was chosen. */
em_gpu_status em_gpu_choice_flags(em_gpu_stream *stream, em_gpu_choice *choices,
                                  uint32_t walks, uint64_t most_want, uint32_t *flags);
/* With rank the exclusive scan of the flags: each chosen entry's key and row go to
 * out_keys and out_rows at its rank within its walk. */
em_gpu_status em_gpu_choice_write(em_gpu_stream *stream, em_gpu_choice *choices,
                                  uint32_t walks, uint64_t most_want, const uint32_t *flags,
                                  const uint32_t *rank);

/* out[i] = the access metadata of rows[i]. */
em_gpu_status em_gpu_access_read(em_gpu_stream *stream, em_gpu_storage storage,
                                 const uint64_t *rows, uint64_t n, em_gpu_row_access *out);
/* The access metadata of rows[i] = in[i]. */
em_gpu_status em_gpu_access_write(em_gpu_stream *stream, em_gpu_storage storage,
                                  const uint64_t *rows, uint64_t n, const em_gpu_row_access *in);
/* values[i] = whole row (row_floats floats) of rows[i]. */
em_gpu_status em_gpu_rows_read(em_gpu_stream *stream, em_gpu_storage storage,
                               const uint64_t *rows, uint64_t n, float *values);
/* Whole rows[i] = values[sources[i]] (values[i] when sources is NULL). */
em_gpu_status em_gpu_rows_write(em_gpu_stream *stream, em_gpu_storage storage,
                                const uint64_t *rows, uint64_t n, const uint32_t *sources,
                                const float *values);

#ifdef __cplusplus
}
#endif

#endif
