/*
 * DESIGN: the backend interface - what a device must provide.
 *
 * A device is one memory space with one pool allocator over it (the CPU backend's
 * devices are host memory; a CUDA device is one GPU). Tables never touch a device's
 * memory directly: they orchestrate a request as a sequence of the operations below,
 * each given buffers in the device's own memory (pool allocations), so the same table
 * code drives the CPU backend and the CUDA backend, and the same routing drives one
 * device or many through an exchange (lib/device/exchange.h).
 *
 * A request runs on a "home" device:
 *   unique_keys       dedupe the batch's keys (order of first appearance), with the
 *                     index of each key's unique entry
 *   partition_keys    group the unique keys by owner shard (stable), shards in order
 *   sum_gradients     push: each unique key's summed gradient, in canonical order
 *                     (keys' positions in the batch), placed in partitioned order
 *   combine           pull: per-key vectors (partitioned order) back into batch order,
 *                     pooled per row
 * and each owner shard (on its own device) runs
 *   find, reserve, insert_missing, gather, apply, export, import.
 * Values computed on a device never depend on the number of shards or devices: sums
 * happen at home in a fixed order, so results are identical with 1 or N shards.
 *
 * Every operation runs on a lane: a device's execution context held by one request at
 * a time (for a GPU, a stream with its own pinned staging buffers; for the CPU, the
 * calling thread). A request takes a lane on every device before it starts, in device
 * order, so requests on different lanes overlap (one's copies with another's kernels)
 * and lane acquisition cannot deadlock. Operations on one lane complete in the order
 * they were issued; those that return a count (unique, partition, find) deliver it to
 * host memory and so wait for the lane; the others may run asynchronously and are
 * complete once `synchronize` returns. Tables order the operations of different lanes
 * on one shard with their locks (see lib/table.h).
 */
#ifndef EMBER_LIB_DEVICE_H
#define EMBER_LIB_DEVICE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/combiner.h"
#include "lib/device/eviction.h"
#include "lib/device/initializer.h"
#include "lib/device/optimizer.h"
#include "lib/memory/pool.h"
#include "lib/base/status.h"

/* Row index marking a key that is not in a shard (as EM_HASHMAP_NOT_FOUND). */
#define EM_ROW_NONE UINT64_MAX
/* Row index marking a key the table did not admit (lib/table/table_config.h:
 * admission): it is not created, reads as its initial value, and steps skip it. */
#define EM_ROW_REJECTED (UINT64_MAX - 1)

/* Whether a row index names a stored row (not EM_ROW_NONE or EM_ROW_REJECTED). */
static inline bool em_row_stored(uint64_t row)
{
    return row < EM_ROW_REJECTED;
}

typedef struct em_device em_device;

/* One shard's storage on its device. Backends embed this as the first member of their
 * own shard struct. */
typedef struct em_shard {
    em_device *device;
} em_shard;

/* An execution context of a device, held by one request at a time. Backends embed this
 * as the first member of their own lane struct. */
typedef struct em_lane {
    em_device *device;
} em_lane;

/* What a shard stores: used to create it. */
typedef struct em_shard_spec {
    const char *table;         /* for messages; borrowed for the call */
    uint32_t index;            /* shard index within the table */
    uint32_t dim;
    uint64_t expected_rows;    /* sizing hint (capacity / shards) */
    em_optimizer_config optimizer;
    em_initializer_config initializer;
    bool track_access; /* keep per-row access metadata (tables with an eviction policy) */
    uint64_t hash_seed; /* the shard's hash map seed (em_table_create_seeded) */
} em_shard_spec;


typedef struct em_shard_stats {
    uint64_t rows;        /* keys stored */
    uint64_t row_bytes;   /* bytes of row storage (weights + optimizer state) */
    uint64_t index_bytes; /* bytes of the hash map */
    uint64_t row_limit;   /* rows the storage can hold without growing */
    uint64_t access_bytes; /* bytes of per-row access metadata (em_row_access) */
    uint64_t index_rehashes_through_host; /* map growths (or rehashes) that went through
                                           * host memory, the pool having no room for the
                                           * old map beside the new (CUDA) */
    uint64_t rows_evicted_chosen_on_gpu; /* rows the shard evicted whose choice the GPU
                                          * made (CUDA), not the host */
} em_shard_stats;

/* Home-side view of a batch in device memory (offsets, keys from the request). */
typedef struct em_device_batch {
    uint32_t rows;
    uint64_t nnz;
    const uint32_t *offsets;  /* rows + 1, device memory */
    const uint32_t *inverse;  /* nnz: index of each key's unique entry */
    const uint32_t *position; /* unique_count: where unique entry u sits in partitioned
                               * order; NULL for u (one shard, a request planned at once:
                               * only on devices with unique_keys_async) */
    uint64_t unique_count;
} em_device_batch;

/* The devices a request spreads its keys over and the shards each holds
 * (spread_keys_async): device i holds shards [first_shard[i], first_shard[i + 1]). */
#define EM_SPREAD_MAX 64u
typedef struct em_spread {
    uint32_t count;
    uint32_t first_shard[EM_SPREAD_MAX + 1];
} em_spread;

/* One shard's part of shards_evict_begin and shards_evict_end. */
typedef struct em_shard_evict_part {
    em_shard *shard;
    em_evict_spec spec;
    uint64_t *keys, *rows; /* out: spec.count each, host memory */
    em_status status;
    em_error err;
} em_shard_evict_part;

typedef struct em_device_ops {
    /* -- memory and lanes ---------------------------------------------------------- */
    /* Region provider for the device's pool (cudaMalloc, or host memory). */
    em_pool_region_provider (*region_provider)(em_device *device);
    /* Takes a lane, waiting while all are held. Thread-safe. */
    em_status (*lane_acquire)(em_device *device, em_lane **out, em_error *err);
    /* Gives the lane back once everything issued on it has completed (so memory its
     * work used may be freed after the call). */
    void (*lane_release)(em_lane *lane);
    /* Host <-> device copies of bytes (device pointers from the pool). The host buffer
     * of copy_to_device may be reused as soon as the call returns, except a buffer from
     * the backend's pinned host buffers (em_backend.host_buffers), which the device
     * reads by DMA after the call returns: it must stay unchanged until the lane
     * synchronizes (a request holds its input until it ends, and ending a request
     * synchronizes its lanes). copy_to_host has filled its host buffer when it
     * returns. */
    em_status (*copy_to_device)(em_lane *lane, void *destination, const void *host_source,
                                size_t bytes, em_error *err);
    em_status (*copy_to_host)(em_lane *lane, void *host_destination, const void *source,
                              size_t bytes, em_error *err);
    /* Enqueues a copy of a few device bytes (a count) that reaches host_destination when
     * the lane next synchronizes (synchronize, or a copy_to_host, which ends with one), so
     * counts a request needs only at its end come back with its answer. The host memory
     * must stay valid until then; dropped if that synchronisation fails. A lane keeps
     * room for a few such bytes; one that finds no room is copied at once (waiting).
     * NULL where copies are synchronous anyway (the CPU). */
    em_status (*copy_to_host_later)(em_lane *lane, void *host_destination, const void *source,
                                    size_t bytes, em_error *err);
    /* Waits until every operation issued on the lane so far has completed. */
    em_status (*synchronize)(em_lane *lane, em_error *err);
    /* synchronize of count lanes of devices of this kind (one lane per device), in
     * one wait: the host polls their devices together, so devices that work at once
     * cost one round trip. NULL where each is synchronized in turn (the CPU). */
    em_status (*synchronize_lanes)(em_lane *const *lanes, uint32_t count, em_error *err);
    /* The lane's next synchronisation (synchronize, or the end of a copy_to_host) waits
     * for companion's work so far too, a lane of another device of this kind, in the
     * same round trip; the lane's release forgets it. The companion stays held until
     * then. NULL where waits are not joined (the CPU). */
    em_status (*lane_join)(em_lane *lane, em_lane *companion, em_error *err);

    /* -- home-side request operations -------------------------------------------- */
    /* unique[0..*unique_count) = distinct keys in order of first appearance;
     * inverse[i] = index in unique of keys[i]; first[u] = the position in keys where
     * unique[u] first appears. unique, inverse and first hold n entries. */
    em_status (*unique_keys)(em_lane *lane, const uint64_t *keys, uint64_t n, uint64_t *unique,
                             uint32_t *inverse, uint32_t *first, uint64_t *unique_count,
                             em_error *err);
    /* unique_keys without waiting (n > 0): *count is a device word holding the unique
     * count, valid until the lane next synchronizes, for the operations that take a
     * count on the device (shards_pull_async). NULL on the CPU. */
    em_status (*unique_keys_async)(em_lane *lane, const uint64_t *keys, uint64_t n,
                                   uint64_t *unique, uint32_t *inverse, uint32_t *first,
                                   const uint32_t **count, em_error *err);
    /* Stable partition of unique[0..n) by owner shard (em_key_shard): partitioned keys
     * grouped by shard 0, 1, ...; position[u] = index of unique[u] in partitioned;
     * shard_counts (host memory, shard_count entries) = keys per shard. When targets is
     * not NULL, targets[position[u]] = first[u] (where each partitioned key's vector
     * goes in a per-key output). */
    em_status (*partition_keys)(em_lane *lane, const uint64_t *unique, uint64_t n,
                                uint32_t shard_count, const uint32_t *first,
                                uint64_t *partitioned, uint32_t *position, uint32_t *targets,
                                uint64_t *shard_counts, em_error *err);
    /* For a request over the shards of several devices, without waiting (n > 0): each
     * of unique[0..*count) (count a device word, at most n) goes to the device whose
     * shards own it: spread device i (of spread->count, at most EM_SPREAD_MAX) holds
     * shards [first_shard[i], first_shard[i + 1]) of shard_count. buckets (spread->count
     * x n entries): device i's keys from i x n on, in shard order, and bucket_counts[i]
     * (device words) how many; position (n entries): position[u] = where unique[u] went
     * in buckets (spread->count x n must fit 32 bits). NULL on the CPU. */
    em_status (*spread_keys_async)(em_lane *lane, const uint64_t *unique, uint64_t n,
                                   const uint32_t *count, uint32_t shard_count,
                                   const em_spread *spread, uint64_t *buckets,
                                   uint32_t *bucket_counts, uint32_t *position, em_error *err);
    /* unique_keys then partition_keys with one wait for both: the same unique, inverse,
     * first, partitioned, position and targets (each with room for n entries; those past
     * *unique_count hold nothing of use), *unique_count and shard_counts (host memory).
     * NULL where the two wait no more than once anyway (the CPU). */
    em_status (*unique_partition_keys)(em_lane *lane, const uint64_t *keys, uint64_t n,
                                       uint32_t shard_count, uint64_t *unique, uint32_t *inverse,
                                       uint32_t *first, uint64_t *partitioned,
                                       uint32_t *position, uint32_t *targets,
                                       uint64_t *unique_count, uint64_t *shard_counts,
                                       em_error *err);
    /* unique_partition_keys for a table whose shards[0..shard_count) (2 or more) are all
     * on this device, and the finds of its keys there, enqueued with no wait: rows (n
     * entries) gets partitioned[i]'s row in its shard (as the shard numbers it) or NONE;
     * when the lane next synchronizes, shard_starts (host memory, shard_count + 1
     * entries) gets where each shard's keys begin and where the last one's end (the
     * unique count), and missing (host memory, shard_count entries) each shard's absent
     * keys. So the general way's dedupe, partition and find wait once, not twice. The
     * caller holds every shard's read lock until it returns. NULL on the CPU. */
    em_status (*unique_partition_find_async)(em_shard *const *shards, uint32_t shard_count,
                                             em_lane *lane, const uint64_t *keys, uint64_t n,
                                             uint64_t *unique, uint32_t *inverse,
                                             uint32_t *first, uint64_t *partitioned,
                                             uint32_t *position, uint32_t *targets,
                                             uint64_t *rows, uint32_t *shard_starts,
                                             uint64_t *missing, em_error *err);
    /* Push: partitioned_gradients[position[u]] = sum, starting from -0.0 (the identity
     * of IEEE addition, so a key's only gradient is copied bit for bit), over the
     * batch's keys k with inverse[k] = u, in order of k, of the key's gradient (NONE:
     * gradients[k]; otherwise gradients[row(k)] / em_combiner_divisor(row length)).
     * dim floats each. */
    em_status (*sum_gradients)(em_lane *lane, const em_device_batch *batch, em_combiner combiner,
                               uint32_t dim, const float *gradients, float *partitioned_gradients,
                               em_error *err);
    /* Pull: out = per key vectors[position[inverse[k]]] in batch order (NONE) or, per
     * row, their sum (in key order) / em_combiner_divisor(row length); empty rows 0. */
    em_status (*combine)(em_lane *lane, const em_device_batch *batch, em_combiner combiner,
                         uint32_t dim, const float *partitioned_vectors, float *out,
                         em_error *err);
    /* Per-key pull whose distinct keys' vectors were gathered straight into out at their
     * first positions: copies them to the keys' later occurrences (out[k] =
     * out[first[inverse[k]]] for every k that is not a first occurrence). */
    em_status (*copy_repeats)(em_lane *lane, const em_device_batch *batch, const uint32_t *first,
                              uint32_t dim, float *out, em_error *err);

    /* -- shards --------------------------------------------------------------------- */
    em_status (*shard_create)(em_device *device, const em_shard_spec *spec, em_shard **out,
                              em_error *err);
    void (*shard_destroy)(em_shard *shard);
    /* rows[i] = row of keys[i] or EM_ROW_NONE; *missing (host) = how many were absent.
     * Safe concurrently with other finds and gathers on the shard. */
    em_status (*shard_find)(em_shard *shard, em_lane *lane, const uint64_t *keys, uint64_t n,
                            uint64_t *rows, uint64_t *missing, em_error *err);
    /* shard_find without waiting: *missing is a device word, written when the lane's
     * work gets there, so that the finds of several shards are read back at once. The
     * shard's later writes (growth included) wait for this find. NULL where the
     * device finds synchronously anyway (the CPU). */
    em_status (*shard_find_async)(em_shard *shard, em_lane *lane, const uint64_t *keys,
                                  uint64_t n, uint64_t *rows, uint64_t *missing, em_error *err);
    /* shard_find_async of shards[0..count) of this device at once, in a few operations
     * for all of them: shard i's keys are keys[offsets[i], offsets[i + 1]) (offsets: host
     * memory), its rows the same entries of rows, its missing count missing[i] (device
     * words). The caller holds every shard's read lock until it returns. NULL where the
     * device finds a shard at a time. */
    em_status (*shards_find_async)(em_shard *const *shards, uint32_t count, em_lane *lane,
                                   const uint64_t *keys, const uint64_t *offsets,
                                   uint64_t *rows, uint64_t *missing, em_error *err);
    /* A pull from a table whose shards[0..shard_count) are all on this device, for the
     * common case of keys all stored, without waiting: finds unique[0..*count) (count a
     * device word, at most batch->nnz), each in its shard (em_key_shard), into rows
     * (batch->nnz entries: with one shard the shard's rows, with several rows that only
     * this request's kernels understand), counts the absent ones in *missing (a device
     * word), writes the output into out from the rows (batch->nnz vectors with NONE, one
     * per batch row pooled: shard_gather then combine, in one pass), and, where the
     * shards track access and accessed != 0, touches the rows (pulled: last access
     * accessed, updated for rows never touched) only if none was absent. The caller holds
     * every shard's read lock until the operations are enqueued. batch->position and
     * unique_count are not used. With *missing > 0 the output is not the pull's.
     * batch->inverse NULL (combiner NONE, batch->nnz = n): the output is per distinct key,
     * out[u] the vector of unique[u] for u below *count and zeros from there to n.
     * With create, the absent keys are inserted (shard_insert_missing, initial rows
     * included) before the output is written, and the rows are touched whatever was
     * absent: the caller holds every shard's write lock, has made room for every key it
     * may create in each shard (shard_reserve), and once the lane has synchronized
     * calls shard_insert_settle on each shard before releasing the locks; *missing then
     * counts the keys created. NULL on the CPU. */
    em_status (*shards_pull_async)(em_shard *const *shards, uint32_t shard_count, em_lane *lane,
                                   const em_device_batch *batch, em_combiner combiner,
                                   const uint64_t *unique, const uint32_t *count, bool create,
                                   uint64_t *rows, uint64_t *missing, float *out,
                                   uint64_t accessed, uint32_t updated, em_error *err);
    /* A push to a table whose shards are all on this device, for the common case of keys
     * all stored and steps that keep rows finite, without waiting: finds
     * unique[0..*count) (count a device word, at most n) into rows (n entries, numbered as
     * shards_pull_async says), counts the absent ones in *missing, checks each row's step
     * with gradients[u] (summed, in unique order) as shard_check_apply does into *problem
     * (UINT64_MAX: none, else the first as shard_check_apply says), and steps the rows,
     * and where the shards track access and accessed != 0 touches them as pushed (last
     * update `updated`), only if nothing was absent and nothing failed its check: all or
     * nothing, decided on the GPU. missing and problem are device words. The caller holds
     * every shard's write lock until the operations are enqueued. With create, the absent
     * keys are inserted with their initial rows when every row checked (and then stepped
     * like the others), nothing is inserted when one did not, and the caller does as
     * shards_pull_async says for create. NULL on the CPU. */
    em_status (*shards_push_async)(em_shard *const *shards, uint32_t shard_count, em_lane *lane,
                                   const uint64_t *unique, const uint32_t *count, uint64_t n,
                                   const float *gradients, bool create, uint64_t *rows,
                                   uint64_t *missing, uint64_t *problem, uint64_t accessed,
                                   uint32_t updated, em_error *err);
    /* A push to a table whose shards are on several devices of this kind, spread over
     * them (each device holding a run of the table's shards: shards[0..shard_count) here),
     * is shards_push_async in two halves on every device, with each device's answers sent
     * to the others between them. shards_find_check_async finds unique[0..*count) (count a
     * device word, at most n) into rows and checks each row's step with gradients[u] as
     * shards_push_async does, writing answers[0] (the keys absent) and answers[1] (the
     * first problem, UINT64_MAX for none), device words. shards_step_async then, on the
     * same lane, steps the first *count of rows with gradients (and touches them as
     * shards_push_async says) only if none of `parts` pairs of answers (answers[2p],
     * answers[2p + 1]: every device's) found a key absent or a problem: all or nothing
     * over every device, decided on each. Given keys (unique, as found), shards_step_async
     * creates the keys found absent first, as shards_push_async creating does: their
     * rows are inserted (room made with shard_reserve) and stepped from their initial
     * values, gated on every device's checks only, and their counters settle as
     * shard_insert_settle says. The caller holds every shard's write lock from the find
     * until the step is enqueued (creating, until the shards are settled). NULL on the
     * CPU. */
    em_status (*shards_find_check_async)(em_shard *const *shards, uint32_t shard_count,
                                         em_lane *lane, const uint64_t *unique,
                                         const uint32_t *count, uint64_t n,
                                         const float *gradients, uint64_t *rows,
                                         uint64_t *answers, em_error *err);
    em_status (*shards_step_async)(em_shard *const *shards, uint32_t shard_count, em_lane *lane,
                                   const uint64_t *keys, uint64_t *rows, const uint32_t *count,
                                   uint64_t n, const float *gradients, const uint64_t *answers,
                                   uint32_t parts, uint64_t accessed, uint32_t updated,
                                   em_error *err);
    /* A pull spread over several devices (shards as shards_find_check_async says) of a
     * table that tracks access: after shards_pull_async (accessed 0) on each device and
     * every device's missing count sent to each, touches the first *count of rows (n
     * entries) as pulled (last access `accessed`, update `updated` for rows never
     * touched), on the same lane, only if none of `parts` missing counts (answers[2p])
     * is above 0. The caller holds every shard's read lock from the pull until this is
     * enqueued. NULL on the CPU. */
    em_status (*shards_touch_async)(em_shard *const *shards, uint32_t shard_count,
                                    em_lane *lane, const uint64_t *rows, const uint32_t *count,
                                    uint64_t n, const uint64_t *answers, uint32_t parts,
                                    uint64_t accessed, uint32_t updated, em_error *err);
    /* Makes room (index and storage) for new_keys more keys, inserted after `evicted` of
     * the shard's rows have been evicted (shard_evict; evicted may pass new_keys: a
     * table's headroom, and then new_keys may be 0), so that insert_missing of that many
     * cannot fail. Errors: RESOURCE_EXHAUSTED naming the pool state. */
    em_status (*shard_reserve)(em_shard *shard, em_lane *lane, uint64_t new_keys,
                               uint64_t evicted, em_error *err);
    /* Inserts the keys whose rows[i] is EM_ROW_NONE with their initial values and
     * optimizer state, storing their new rows in rows[i]. Keys are distinct. Without
     * initialize the caller writes every new row before anyone can read it (an import
     * under the table's exclusive lock, with nothing left that can fail), and a device
     * may leave the values as they are. */
    em_status (*shard_insert_missing)(em_shard *shard, em_lane *lane, const uint64_t *keys,
                                      uint64_t n, uint64_t *rows, bool initialize,
                                      em_error *err);
    /* shard_insert_missing without waiting: the shard's counters come back with the
     * lane's next synchronisation, after which shard_insert_settle takes them in, so
     * that the inserts of several shards wait once. The caller holds the shard's write
     * lock from one to the other. NULL where inserts are synchronous (the CPU). */
    em_status (*shard_insert_missing_async)(em_shard *shard, em_lane *lane,
                                            const uint64_t *keys, uint64_t n, uint64_t *rows,
                                            bool initialize, em_error *err);
    /* shard_insert_missing_async of shards[0..count) of this device at once, in a few
     * operations for all of them: shard i's keys are keys[offsets[i], offsets[i + 1])
     * (offsets: host memory), their rows the same entries of rows, and missing[i] (host)
     * says how many of them it lacks; a shard that lacks none is left alone (and is not
     * settled). The caller holds the write lock of every shard that inserts until each
     * is settled (shard_insert_settle, after a synchronisation of the lane); after an
     * error, none is. NULL where the device inserts a shard at a time. */
    em_status (*shards_insert_missing_async)(em_shard *const *shards, uint32_t count,
                                             em_lane *lane, const uint64_t *keys,
                                             const uint64_t *offsets, const uint64_t *missing,
                                             uint64_t *rows, em_error *err);
    /* After shard_insert_missing_async and a synchronisation of its lane. Errors:
     * INTERNAL when the insert overflowed what shard_reserve made room for. */
    em_status (*shard_insert_settle)(em_shard *shard, em_error *err);
    /* vectors[t] = weights of rows[i] (zeros for EM_ROW_NONE and EM_ROW_REJECTED), dim
     * floats each, where
     * t = targets[i], or t = i when targets is NULL. */
    em_status (*shard_gather)(em_shard *shard, em_lane *lane, const uint64_t *rows, uint64_t n,
                              const uint32_t *targets, float *vectors, em_error *err);
    /* shard_gather of shards[0..count) of this device at once, without waiting, and then,
     * where the shards track access and accessed != 0, shard_touch of the same rows (not
     * pushed, with updated): shard i's rows are rows[offsets[i], offsets[i + 1]) (offsets:
     * host memory), its vectors placed by targets + offsets[i] into vectors where targets
     * is given, else in order from vectors + offsets[i] x dim. The caller holds every
     * shard's read lock until it returns. NULL where the device gathers a shard at a
     * time. */
    em_status (*shards_gather)(em_shard *const *shards, uint32_t count, em_lane *lane,
                               const uint64_t *offsets, const uint64_t *rows,
                               const uint32_t *targets, float *vectors, uint64_t accessed,
                               uint32_t updated, em_error *err);
    /* Whether one optimizer step per row with gradients[i] would keep every value
     * finite, writing nothing (common/row_check.h): *first_problem (host) is UINT64_MAX
     * when it would, else (i << 32 | code) for the smallest failing i. rows[i]
     * EM_ROW_NONE stands for the row the push will create for keys[i]; EM_ROW_REJECTED
     * rows are skipped (nothing is applied to them). *bounded (host) is
     * 1 when every row was bounded (row_check.h: em_row_bounded, for existing rows only),
     * so the answer holds across a few concurrent bounded steps; a device may always say
     * 0. gradient_bound: a bound on the gradients' element sizes known already (the push
     * finds one while checking its input), or -1. *largest (host) is the bound the check
     * used, for shard_apply, or -1. */
    em_status (*shard_check_apply)(em_shard *shard, em_lane *lane, const uint64_t *keys,
                                   const uint64_t *rows, uint64_t n, const float *gradients,
                                   float gradient_bound, uint64_t *first_problem, int *bounded,
                                   float *largest, em_error *err);
    /* shard_check_apply without waiting: *first_problem is a device word, written when
     * the lane's work gets there, so that the checks of several shards are read back at
     * once; *bounded and *largest (host) are set at once. NULL where the device checks
     * synchronously anyway (the CPU). */
    em_status (*shard_check_apply_async)(em_shard *shard, em_lane *lane, const uint64_t *keys,
                                         const uint64_t *rows, uint64_t n,
                                         const float *gradients, float gradient_bound,
                                         uint64_t *first_problem, int *bounded, float *largest,
                                         em_error *err);
    /* shard_check_apply_async of shards[0..count) of this device at once, in a few
     * operations for all of them: shard i's keys are keys[offsets[i], offsets[i + 1])
     * (offsets: host memory), their rows the same entries of rows, their gradients dim
     * floats each from gradients + offsets[i] x dim, its answer first_problems[i] (device
     * words); as shard_check_apply_async says, with no bound known and none found (each
     * shard's bounded 0, largest -1). The caller holds every shard's read lock until it
     * returns. NULL where the device checks a shard at a time. */
    em_status (*shards_check_async)(em_shard *const *shards, uint32_t count, em_lane *lane,
                                    const uint64_t *keys, const uint64_t *offsets,
                                    const uint64_t *rows, const float *gradients,
                                    uint64_t *first_problems, em_error *err);
    /* One optimizer step per row with gradients[i] (dim floats each); EM_ROW_REJECTED
     * rows are skipped. Rows distinct.
     * largest: a bound on the gradients' element sizes from shard_check_apply, or -1 when
     * unknown. */
    em_status (*shard_apply)(em_shard *shard, em_lane *lane, const uint64_t *rows, uint64_t n,
                             const float *gradients, float largest, em_error *err);
    /* shard_apply of shards[0..count) of this device at once, without waiting, and then,
     * where the shards track access and accessed != 0, shard_touch of the same rows
     * (pushed, with updated): shard i's rows are rows[offsets[i], offsets[i + 1])
     * (offsets: host memory), their gradients dim floats each from gradients +
     * offsets[i] x dim. The caller holds every shard's write lock until it returns. NULL
     * where the device steps a shard at a time. */
    em_status (*shards_apply)(em_shard *const *shards, uint32_t count, em_lane *lane,
                              const uint64_t *offsets, const uint64_t *rows,
                              const float *gradients, uint64_t accessed, uint32_t updated,
                              em_error *err);
    /* Copies up to max rows (key, weights and optimizer state: dim + state floats each)
     * into host memory from *cursor on (0 to start); *count 0 means done. values may be
     * NULL (keys only); rows (nullable, host) gets each key's row. */
    em_status (*shard_export)(em_shard *shard, em_lane *lane, uint64_t *cursor, uint64_t *keys,
                              float *values, uint64_t *rows, uint64_t max, uint64_t *count,
                              em_error *err);
    /* values[i] = rows[i] (existing rows; dim + state floats each); both device memory. */
    em_status (*shard_read_rows)(em_shard *shard, em_lane *lane, const uint64_t *rows, uint64_t n,
                                 float *values, em_error *err);
    /* Overwrites rows[i] (existing rows) with values[s] (device memory, dim + state floats
     * each), where s = sources[i], or s = i when sources is NULL. */
    em_status (*shard_write_rows)(em_shard *shard, em_lane *lane, const uint64_t *rows,
                                  uint64_t n, const uint32_t *sources, const float *values,
                                  em_error *err);
    /* Overwrites rows[i] (existing rows) with the dim + state floats at sources[i], host
     * memory each (a loader's rows, where the file's blocks hold them). Devices whose
     * memory is the host's; NULL on others. */
    em_status (*shard_write_rows_from)(em_shard *shard, em_lane *lane, const uint64_t *rows,
                                       uint64_t n, const float *const *sources,
                                       em_error *err);
    void (*shard_stats)(em_shard *shard, em_shard_stats *out);

    /* -- capacity: shards that track access (NULL where a backend has no eviction) -- */
    /* Records a pull or a push (pushed) of rows: each row's last access becomes
     * accessed and its frequency grows by one; a push, or the first touch of a row just
     * created, sets its last update to updated (the table's push clock). EM_ROW_NONE
     * rows are skipped. Safe under the shard's read lock (two touches of one row at once
     * may count once). */
    em_status (*shard_touch)(em_shard *shard, em_lane *lane, const uint64_t *rows, uint64_t n,
                             uint64_t accessed, uint32_t updated, bool pushed, em_error *err);
    /* out[i] = the access metadata of rows[i] (existing rows; host memory): what a
     * checkpoint saves. Safe under the shard's read lock (a touch at the same time may
     * or may not be seen). */
    em_status (*shard_read_access)(em_shard *shard, em_lane *lane, const uint64_t *rows,
                                   uint64_t n, em_row_access *out, em_error *err);
    /* Sets the access metadata of rows[i] (existing rows) to in[i] (host memory): what a
     * load restores. Under the shard's write lock. */
    em_status (*shard_write_access)(em_shard *shard, em_lane *lane, const uint64_t *rows,
                                    uint64_t n, const em_row_access *in, em_error *err);
    /* Removes the keys whose last update is at least min_age pushes before update_clock
     * (min_age 0: every key), examining the map's entries from *cursor on, at most scan of them
     * (0 to start); writes the removed keys and rows to host memory (scan entries of
     * room each) and their number to *count, and advances *cursor, which comes back as
     * 0 once the whole map has been examined. Under the shard's write lock. */
    em_status (*shard_expire)(em_shard *shard, em_lane *lane, uint32_t update_clock,
                              uint32_t min_age, uint64_t *cursor, uint64_t scan, uint64_t *keys,
                              uint64_t *rows, uint64_t *count, em_error *err);
    /* Removes spec->count keys chosen by spec's policy, none of whose rows is in
     * spec->kept, and writes their keys and rows to host memory (count each); the rows'
     * values stay as they were until a later insert reuses them. The caller has checked
     * that the shard holds that many rows outside kept. Under the shard's write lock
     * and the table's exclusive lock: nothing else uses the shard, so its index may
     * move entries (em_hashmap_erase_exclusive). */
    em_status (*shard_evict)(em_shard *shard, em_lane *lane, const em_evict_spec *spec,
                             uint64_t *keys, uint64_t *rows, em_error *err);
    /* shard_evict of several shards of this device at once, on one lane, in two steps so
     * that the shards' walks, and those of other devices, come back in one wait (where
     * shard_evict waits once for each): shards_evict_begin enqueues the reads of the
     * parts' walks (nothing changes; *pending for the end: NULL on an error, or when no
     * part evicts, every part's status then set); the caller synchronizes the lane
     * (synchronize, or synchronize_lanes with other devices');
     * shards_evict_end, given that synchronisation's status and error, makes each part's
     * shard give up part->spec.count rows into part->keys and part->rows, and sets each
     * part's status and error. The parts stay the caller's from one to the other. NULL
     * where a backend evicts a shard at a time. */
    em_status (*shards_evict_begin)(em_lane *lane, em_shard_evict_part *parts, uint32_t count,
                                    void **pending, em_error *err);
    void (*shards_evict_end)(void *pending, em_status synchronized, const em_error *sync_err);
    /* Removes the keys whose rows[i] is not EM_ROW_NONE (distinct keys with their rows
     * from shard_find, device memory); their rows are reused by later inserts. Under the
     * shard's write lock. NULL where a backend cannot erase. */
    em_status (*shard_erase)(em_shard *shard, em_lane *lane, const uint64_t *keys,
                             const uint64_t *rows, uint64_t n, em_error *err);
    /* After shard_gather: vectors[t] = the initial weights of keys[i] for every i whose
     * rows[i] is EM_ROW_REJECTED (t as in shard_gather). NULL where a backend has no
     * admission. */
    em_status (*shard_fill_initial)(em_shard *shard, em_lane *lane, const uint64_t *keys,
                                    const uint64_t *rows, uint64_t n, const uint32_t *targets,
                                    float *vectors, em_error *err);

    /* -- lifecycle ----------------------------------------------------------------- */
    void (*destroy)(em_device *device);
} em_device_ops;

/* Requests carve their small buffers out of blocks of EM_DEVICE_SCRATCH_BLOCK bytes
 * (lib/table/table_request.c). A device keeps up to EM_DEVICE_SCRATCH_SLOTS such blocks
 * that requests gave back, a cache line a slot, so that requests on several threads
 * do not each take the pool's lock (and, when they meet there, sleep in the kernel)
 * twice a request: a block given back goes into an empty slot, or back to the pool when
 * every slot holds one. The blocks kept count in the pool's bytes in use, as they did
 * while a request held them: at most EM_DEVICE_SCRATCH_SLOTS x EM_DEVICE_SCRATCH_BLOCK
 * bytes (512 KiB) a device once requests have run on it. A block is given back when
 * the request that held it has ended on the device (its lanes released), as a pool
 * free would be. */
#define EM_DEVICE_SCRATCH_BLOCK ((size_t)64 << 10)
#define EM_DEVICE_SCRATCH_SLOTS 8

typedef struct em_scratch_slot {
    _Alignas(64) void *_Atomic block;
} em_scratch_slot;

struct em_device {
    const em_device_ops *ops;
    char name[32];         /* "cpu0", "cuda:0" */
    const char *kind;      /* "cpu", "cuda" */
    uint32_t index;        /* position in the backend's device list */
    bool host_addressable; /* device pointers are host pointers: no staging copies */
    em_pool *pool;         /* every allocation of the device comes from here */
    void *impl;            /* backend-private state */
    /* Times the host waited for work it had enqueued on the device to finish (a lane's
     * synchronisation, or a staging half's copy), and the nanoseconds those waits took:
     * with the requests' own time, how much of it the GPU took. 0 where work runs as it
     * is called (the CPU backend). A wait for several devices at once (synchronize_lanes)
     * counts on the first of them only, so that the sums over devices stay the host's. */
    _Atomic uint64_t waits;
    _Atomic uint64_t wait_ns;
    /* Request scratch blocks kept between requests (em_device_scratch_take). */
    em_scratch_slot scratch[EM_DEVICE_SCRATCH_SLOTS];
};

/* How a shard stores rows (both backends): each row is its weights then its optimizer
 * state (row_floats floats), padded to a multiple of 4 floats (16-byte rows, so vector
 * loads and stores stay aligned); rows live in fixed-size blocks of a power of two rows
 * (row r in block r >> block_shift, slot r & block_mask), so storage grows a block at a
 * time and rows never move. */
typedef struct em_row_blocks {
    uint32_t row_floats;
    uint32_t stride; /* floats from one row to the next */
    uint32_t block_shift;
    uint64_t block_mask;
    size_t block_bytes;
} em_row_blocks;

/* Rows per block: the largest power of two in [16, 65536] whose block stays within
 * target_block_bytes (16 when even that is larger), and no larger than needed for
 * expected_rows (the shard's share of its table's capacity; 0: no bound), so that a small
 * table does not take a block sized for a large one (a shard that outgrows its share adds
 * blocks as any other). */
em_row_blocks em_row_blocks_plan(uint32_t dim, int optimizer_kind, size_t target_block_bytes,
                                 uint64_t expected_rows);

/* A zeroed em_device, aligned as its scratch slots ask (NULL when out of memory); free()
 * frees it. */
em_device *em_device_allocate(void);

/* Pool allocation of bytes on the device, as a pointer. Errors: RESOURCE_EXHAUSTED with
 * the pool's statistics, prefixed with what (e.g. "pull scratch"). */
em_status em_device_alloc(em_device *device, size_t bytes, const char *what, void **out,
                          em_error *err);
void em_device_free(em_device *device, void *pointer);

/* A scratch block of EM_DEVICE_SCRATCH_BLOCK bytes: one the device kept, else from the
 * pool (em_device_alloc's errors). */
em_status em_device_scratch_take(em_device *device, const char *what, void **out,
                                 em_error *err);
/* Gives back a block from em_device_scratch_take: kept for the next request when a slot
 * is free, else freed. */
void em_device_scratch_give(em_device *device, void *block);
/* Frees the blocks the device keeps (before its pool goes; nothing may run on it). */
void em_device_scratch_drop(em_device *device);

#endif
