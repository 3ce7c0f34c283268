/*
 * DESIGN: kernels of the shard operations: the GPU hash map (u64 key -> row) and the
 * row storage (gather, optimizer steps, initial values, whole-row reads and writes).
 *
 * The map is open addressing over 16-byte slots {key, row}, probed bucket by bucket
 * (buckets of one 128-byte line, double hashing between them: em_gpu_probe in
 * kernels/kernel_logic.h); a slot is claimed by 64-bit compare-and-swap of its key
 * (kernels/kernel_logic.h has the protocol). Erasing tombstones a slot and puts its row
 * on the map's free list, which later inserts take rows from (a counter of rows taken
 * during the launch, then a settle, done by the launch that initialises the new rows:
 * a pull's em_gpu_rows_init, or a push's step, which writes a new row's initial values
 * before stepping it);
 * rehashes drop the tombstones. A pull's find is a group of 8 threads per key, a slot of
 * each bucket each (lookup_grouped), while the groups fit in the GPU at once, and one
 * thread per key for more keys (find_form); a push's find, with its check, one
 * thread per key, a bucket's slots in one pass (em_gpu_map_lookup_buckets). Optimizer
 * steps are one thread per element for sgd and adagrad, and one warp per row for
 * rowwise adagrad (whose mean of g*g is a warp reduction) and adam (whose step count is
 * read by every lane before lane 0 advances it).
 */
#include <atomic>

#include <cooperative_groups.h>

#include "kernels/kernel_logic.h"
#include "kernels/launch.cuh"

namespace cg = cooperative_groups;

#define WARP_MASK 0xffffffffu

/* ---- hash map ------------------------------------------------------------------------ */

/* The threads that search for one key together, one per slot of a bucket. */
typedef cg::thread_block_tile<EM_GPU_BUCKET_SLOTS> bucket_group;

/* em_gpu_map_lookup_buckets by a group: at each bucket, thread t reads slot t (the group
 * reads the bucket's line at once), the group's ballots give the masks of the slots that
 * hold the key and that are EMPTY, and the thread at the stop hands the row it read to
 * the others. Every thread of the group returns the same row. */
__device__ uint64_t lookup_grouped(const bucket_group &group, em_gpu_map map, uint64_t key)
{
    if (!em_gpu_map_by_buckets(map, key))
        return em_gpu_map_lookup(map, key);
    uint32_t t = group.thread_rank();
    em_gpu_probe probe;
    uint64_t first = em_gpu_probe_start(&probe, key, map.seed, map.slot_count);
    for (uint64_t b = 0; b < probe.bucket_count; b++) {
        const em_gpu_slot *at = em_gpu_map_slot(map, first + t);
        uint64_t held = at->key;
        uint32_t hits = group.ballot(held == key);
        uint32_t empties = group.ballot(held == EM_GPU_EMPTY_KEY);
        int stop = em_gpu_bucket_stop(hits, empties);
        if (stop >= 0) {
            if ((hits >> stop & 1u) == 0)
                return EM_GPU_ROW_NONE;
            return group.shfl(t == (uint32_t)stop ? at->row : 0, stop);
        }
        first = em_gpu_probe_next_bucket(&probe);
    }
    return EM_GPU_ROW_NONE;
}

/* The same over a device's shards of one table: the row as the shards number them. */
__device__ uint64_t lookup_grouped(const bucket_group &group, em_gpu_shards shards, uint64_t key)
{
    uint32_t s = em_key_shard(key, shards.count);
    return em_gpu_shards_row(shards, s, lookup_grouped(group, shards.maps[s], key));
}

/* A key's row in one map, or in a device's shards of one table. */
__device__ inline int find_item(em_gpu_map map, const uint64_t *keys, uint64_t i, uint64_t *rows)
{
    return em_gpu_map_find_item(map, keys, i, rows);
}

__device__ inline int find_item(em_gpu_shards shards, const uint64_t *keys, uint64_t i,
                                uint64_t *rows)
{
    return em_gpu_shards_find_item(shards, keys, i, rows);
}

/* The first *count keys (n when count is NULL), in a map or in shards, a group of
 * threads a key (lookup_grouped; launched with EM_GPU_BUCKET_SLOTS threads a key). */
template <typename Seen>
__global__ void find_grouped_kernel(Seen seen, const uint64_t *keys, uint64_t n,
                                    const uint32_t *count, uint64_t *rows, uint64_t *missing)
{
    bucket_group group = cg::tiled_partition<EM_GPU_BUCKET_SLOTS>(cg::this_thread_block());
    uint64_t end = count != NULL && *count < n ? *count : n;
    uint32_t absent = 0;
    for (uint64_t i = EM_GPU_THREAD_INDEX / EM_GPU_BUCKET_SLOTS; i < end;
         i += EM_GPU_THREAD_COUNT / EM_GPU_BUCKET_SLOTS) {
        uint64_t row = lookup_grouped(group, seen, keys[i]);
        if (group.thread_rank() == 0) {
            rows[i] = row;
            absent += row == EM_GPU_ROW_NONE;
        }
    }
    /* One atomic per warp: every lane reaches this point (blocks are whole warps). */
    absent = __reduce_add_sync(WARP_MASK, absent);
    if ((threadIdx.x & 31u) == 0 && absent != 0)
        atomicAdd((unsigned long long *)missing, (unsigned long long)absent);
}

/* The same, a thread a key (em_gpu_map_lookup_buckets). */
template <typename Seen>
__global__ void find_each_kernel(Seen seen, const uint64_t *keys, uint64_t n,
                                 const uint32_t *count, uint64_t *rows, uint64_t *missing)
{
    uint64_t end = count != NULL && *count < n ? *count : n;
    uint32_t absent = 0;
    EM_GPU_FOR_EACH(i, end)
    absent += (uint32_t)find_item(seen, keys, i, rows);
    absent = __reduce_add_sync(WARP_MASK, absent);
    if ((threadIdx.x & 31u) == 0 && absent != 0)
        atomicAdd((unsigned long long *)missing, (unsigned long long)absent);
}

/* Adds the absent keys of the warp's lanes to their shards' counts, one atomic for each
 * shard among them (its lowest lane's): s is the lane's shard (UINT32_MAX for none).
 * Every lane of the warp calls it. */
__device__ inline void count_absent_by_shard(uint32_t s, bool absent, uint64_t *missing)
{
    uint32_t peers = __match_any_sync(WARP_MASK, s);
    uint32_t absent_peers = __ballot_sync(WARP_MASK, absent) & peers;
    if ((threadIdx.x & 31u) == (uint32_t)(__ffs(peers) - 1) && absent_peers != 0)
        atomicAdd((unsigned long long *)&missing[s], (unsigned long long)__popc(absent_peers));
}

/* em_gpu_shards_find_local, a group of threads a key: the lanes of a warp step through
 * the keys together (a warp's first key, then its groups' keys after it), so that they
 * count together at each step. */
__global__ void shards_find_local_grouped_kernel(em_gpu_shards shards, const uint64_t *keys,
                                                 uint64_t n, const uint32_t *count,
                                                 uint64_t *rows, uint64_t *missing)
{
    bucket_group group = cg::tiled_partition<EM_GPU_BUCKET_SLOTS>(cg::this_thread_block());
    uint64_t end = *count < n ? *count : n;
    uint32_t lane = threadIdx.x & 31u;
    for (uint64_t first = (EM_GPU_THREAD_INDEX - lane) / EM_GPU_BUCKET_SLOTS; first < end;
         first += EM_GPU_THREAD_COUNT / EM_GPU_BUCKET_SLOTS) {
        uint64_t i = first + lane / EM_GPU_BUCKET_SLOTS;
        uint32_t s = UINT32_MAX;
        bool absent = false;
        if (i < end) { /* the same for the whole group */
            s = em_key_shard(keys[i], shards.count);
            uint64_t row = lookup_grouped(group, shards.maps[s], keys[i]);
            if (group.thread_rank() == 0) {
                rows[i] = row;
                absent = row == EM_GPU_ROW_NONE;
            }
        }
        count_absent_by_shard(s, absent, missing);
    }
}

/* The same, a thread a key. */
__global__ void shards_find_local_each_kernel(em_gpu_shards shards, const uint64_t *keys,
                                              uint64_t n, const uint32_t *count, uint64_t *rows,
                                              uint64_t *missing)
{
    uint64_t end = *count < n ? *count : n;
    uint32_t lane = threadIdx.x & 31u;
    for (uint64_t first = EM_GPU_THREAD_INDEX - lane; first < end; first += EM_GPU_THREAD_COUNT) {
        uint64_t i = first + lane;
        uint32_t s = UINT32_MAX;
        bool absent = i < end && em_gpu_shards_find_local_item(shards, keys, i, rows, &s) != 0;
        count_absent_by_shard(s, absent, missing);
    }
}

/* The threads a GPU holds at once (its multiprocessors times the threads each holds),
 * read once per GPU; 0 when the runtime cannot say. */
static uint64_t resident_threads(int ordinal)
{
    enum { KNOWN = 64 };
    static std::atomic<uint64_t> known[KNOWN];
    bool kept = ordinal >= 0 && ordinal < KNOWN;
    uint64_t threads = kept ? known[ordinal].load(std::memory_order_relaxed) : 0;
    if (threads != 0)
        return threads;
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal) != cudaSuccess ||
        cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, ordinal) !=
            cudaSuccess)
        return 0;
    threads = (uint64_t)sms * (uint64_t)per_sm;
    if (kept)
        known[ordinal].store(threads, std::memory_order_relaxed);
    return threads;
}

/* How a find of n keys searches (em_gpu_find_form): a group of threads a key while the
 * groups fit in the GPU at once (the time is then each key's chain of dependent reads,
 * which a bucket per step shortens), else a thread a key (the time is then the work,
 * which the group does eight times over). On an H200 (270,336 threads at once: 33,792
 * keys' groups) the thread a key searched 16K keys at 0.88-0.99 of the group's speed and
 * 64K keys at 1.00-1.21 (tests/bench/RESULTS.md). A GPU that cannot say how many threads
 * it holds gets the group. */
static em_gpu_find_form find_form(const em_gpu_stream *stream, uint64_t n, em_gpu_find_form form)
{
    if (form != EM_GPU_FIND_AUTO)
        return form;
    uint64_t threads = resident_threads(stream->ordinal);
    return threads != 0 && n * EM_GPU_BUCKET_SLOTS > threads ? EM_GPU_FIND_EACH
                                                              : EM_GPU_FIND_GROUPED;
}

template <typename Seen>
static em_gpu_status launch_find(em_gpu_stream *stream, Seen seen, const uint64_t *keys,
                                 uint64_t n, const uint32_t *count, uint64_t *rows,
                                 uint64_t *missing, em_gpu_find_form form)
{
    if (find_form(stream, n, form) == EM_GPU_FIND_EACH)
        return EM_GPU_LAUNCH(find_each_kernel<Seen>, n, stream, seen, keys, n, count, rows,
                             missing);
    return EM_GPU_LAUNCH(find_grouped_kernel<Seen>, n * EM_GPU_BUCKET_SLOTS, stream, seen, keys,
                         n, count, rows, missing);
}

/* em_gpu_maps_find: part blockIdx.y, a group of threads a key (as find_grouped_kernel)
 * or a thread a key (as find_each_kernel); a block's keys are all of one part, so one
 * atomic a warp still counts them. */
__global__ void maps_find_grouped_kernel(const em_gpu_map_part *parts)
{
    const em_gpu_map_part *part = &parts[blockIdx.y];
    bucket_group group = cg::tiled_partition<EM_GPU_BUCKET_SLOTS>(cg::this_thread_block());
    uint32_t absent = 0;
    for (uint64_t i = EM_GPU_THREAD_INDEX / EM_GPU_BUCKET_SLOTS; i < part->n;
         i += EM_GPU_THREAD_COUNT / EM_GPU_BUCKET_SLOTS) {
        uint64_t row = lookup_grouped(group, part->map, part->keys[i]);
        if (group.thread_rank() == 0) {
            part->rows[i] = row;
            absent += row == EM_GPU_ROW_NONE;
        }
    }
    absent = __reduce_add_sync(WARP_MASK, absent);
    if ((threadIdx.x & 31u) == 0 && absent != 0)
        atomicAdd((unsigned long long *)part->missing, (unsigned long long)absent);
}

__global__ void maps_find_each_kernel(const em_gpu_map_part *parts)
{
    const em_gpu_map_part *part = &parts[blockIdx.y];
    uint32_t absent = 0;
    EM_GPU_FOR_EACH(i, part->n)
    absent += (uint32_t)em_gpu_map_find_item(part->map, part->keys, i, part->rows);
    absent = __reduce_add_sync(WARP_MASK, absent);
    if ((threadIdx.x & 31u) == 0 && absent != 0)
        atomicAdd((unsigned long long *)part->missing, (unsigned long long)absent);
}

__global__ void map_insert_kernel(em_gpu_map map, const uint64_t *keys, uint64_t n,
                                  uint64_t *rows, uint8_t *inserted)
{
    EM_GPU_FOR_EACH(i, n)
    em_gpu_map_insert_item(map, keys, i, rows, inserted);
}

/* The first *count keys, in a map or in shards. */
__device__ inline void insert_item(em_gpu_map map, const uint64_t *keys, uint64_t i,
                                   uint64_t *rows, uint8_t *inserted)
{
    em_gpu_map_insert_item(map, keys, i, rows, inserted);
}

__device__ inline void insert_item(em_gpu_shards shards, const uint64_t *keys, uint64_t i,
                                   uint64_t *rows, uint8_t *inserted)
{
    em_gpu_shards_insert_item(shards, keys, i, rows, inserted);
}

template <typename Seen>
__global__ void insert_counted_kernel(Seen seen, const uint64_t *keys, uint64_t n,
                                      em_gpu_gate gate, uint64_t *rows, uint8_t *inserted)
{
    uint64_t end = em_gpu_gate_end(gate, n);
    EM_GPU_FOR_EACH(i, end)
    insert_item(seen, keys, i, rows, inserted);
}

__global__ void parts_insert_kernel(const em_gpu_shard_part *parts)
{
    const em_gpu_shard_part *part = &parts[blockIdx.y];
    EM_GPU_FOR_EACH(i, part->n)
    em_gpu_map_insert_item(part->map, part->keys, i, part->rows, part->inserted);
}

__global__ void map_erase_kernel(em_gpu_map map, const uint64_t *keys, const uint64_t *rows,
                                 uint64_t n)
{
    EM_GPU_FOR_EACH(i, n)
    em_gpu_map_erase_item(map, keys, rows, i);
}

__global__ void parts_erase_kernel(const em_gpu_shard_part *parts)
{
    const em_gpu_shard_part *part = &parts[blockIdx.y];
    EM_GPU_FOR_EACH(i, part->n)
    em_gpu_map_erase_item(part->map, part->keys, part->rows, i);
}

__global__ void map_rehash_kernel(const em_gpu_slot *old_slots, uint64_t old_slot_count,
                                  em_gpu_map map)
{
    EM_GPU_FOR_EACH(i, old_slot_count)
    em_gpu_map_rehash_item(old_slots, i, map);
}

__global__ void map_export_flags_kernel(em_gpu_map map, uint64_t begin, uint64_t count,
                                        uint32_t *flags)
{
    EM_GPU_FOR_EACH(i, count + 1)
    em_gpu_map_export_flag_item(map, begin, count, i, flags);
}

__global__ void map_export_compact_kernel(em_gpu_map map, uint64_t begin, uint64_t count,
                                          const uint32_t *flags, const uint32_t *rank,
                                          uint64_t take, uint64_t offset, uint64_t *keys,
                                          uint64_t *rows, uint64_t *next_slot)
{
    EM_GPU_FOR_EACH(i, count)
    em_gpu_map_export_compact_item(map, begin, i, flags, rank, take, offset, keys, rows,
                                   next_slot);
}

extern "C" em_gpu_status em_gpu_map_clear(em_gpu_stream *stream, em_gpu_slot *slots,
                                          uint64_t slot_count)
{
    /* EMPTY key and ROW_NONE are both all-ones. */
    EM_GPU_TRY(em_gpu_use(stream));
    EM_GPU_CALL(cudaMemsetAsync,
                (slots, 0xff, slot_count * sizeof(em_gpu_slot), stream->stream));
    return em_gpu_ok();
}

extern "C" em_gpu_status em_gpu_map_erase(em_gpu_stream *stream, em_gpu_map map,
                                          const uint64_t *keys, const uint64_t *rows, uint64_t n)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(map_erase_kernel, n, stream, map, keys, rows, n);
}

extern "C" em_gpu_status em_gpu_map_find(em_gpu_stream *stream, em_gpu_map map,
                                         const uint64_t *keys, uint64_t n, uint64_t *rows,
                                         uint64_t *missing)
{
    return em_gpu_map_find_as(stream, map, keys, n, rows, missing, EM_GPU_FIND_AUTO);
}

extern "C" em_gpu_status em_gpu_map_find_as(em_gpu_stream *stream, em_gpu_map map,
                                            const uint64_t *keys, uint64_t n, uint64_t *rows,
                                            uint64_t *missing, em_gpu_find_form form)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return launch_find(stream, map, keys, n, (const uint32_t *)NULL, rows, missing, form);
}

extern "C" em_gpu_status em_gpu_maps_find(em_gpu_stream *stream, const em_gpu_map_part *parts,
                                          uint32_t count, uint64_t most_keys, uint64_t all_keys)
{
    if (count == 0 || most_keys == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    if (find_form(stream, all_keys, EM_GPU_FIND_AUTO) == EM_GPU_FIND_EACH)
        return EM_GPU_LAUNCH_ROWS(maps_find_each_kernel, most_keys, count, stream, parts);
    return EM_GPU_LAUNCH_ROWS(maps_find_grouped_kernel, most_keys * EM_GPU_BUCKET_SLOTS, count,
                              stream, parts);
}

extern "C" em_gpu_status em_gpu_map_find_counted(em_gpu_stream *stream, em_gpu_map map,
                                                 const uint64_t *keys, uint64_t n,
                                                 const uint32_t *count, uint64_t *rows,
                                                 uint64_t *missing)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return launch_find(stream, map, keys, n, count, rows, missing, EM_GPU_FIND_AUTO);
}

extern "C" em_gpu_status em_gpu_shards_find_counted(em_gpu_stream *stream, em_gpu_shards shards,
                                                    const uint64_t *keys, uint64_t n,
                                                    const uint32_t *count, uint64_t *rows,
                                                    uint64_t *missing)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return launch_find(stream, shards, keys, n, count, rows, missing, EM_GPU_FIND_AUTO);
}

extern "C" em_gpu_status em_gpu_shards_find_local(em_gpu_stream *stream, em_gpu_shards shards,
                                                  const uint64_t *keys, uint64_t n,
                                                  const uint32_t *count, uint64_t *rows,
                                                  uint64_t *missing)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    if (find_form(stream, n, EM_GPU_FIND_AUTO) == EM_GPU_FIND_EACH)
        return EM_GPU_LAUNCH(shards_find_local_each_kernel, n, stream, shards, keys, n, count,
                             rows, missing);
    return EM_GPU_LAUNCH(shards_find_local_grouped_kernel, n * EM_GPU_BUCKET_SLOTS, stream,
                         shards, keys, n, count, rows, missing);
}

extern "C" em_gpu_status em_gpu_map_insert(em_gpu_stream *stream, em_gpu_map map,
                                           const uint64_t *keys, uint64_t n, uint64_t *rows,
                                           uint8_t *inserted)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(map_insert_kernel, n, stream, map, keys, n, rows, inserted);
}

/* The counted insert into a map or into a device's shards of one table. */
template <typename Seen>
static em_gpu_status insert_counted(em_gpu_stream *stream, Seen seen, const uint64_t *keys,
                                    uint64_t n, em_gpu_gate gate, uint64_t *rows,
                                    uint8_t *inserted)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(insert_counted_kernel<Seen>, n, stream, seen, keys, n, gate, rows,
                         inserted);
}

extern "C" em_gpu_status em_gpu_map_insert_counted(em_gpu_stream *stream, em_gpu_map map,
                                                   const uint64_t *keys, uint64_t n,
                                                   em_gpu_gate gate, uint64_t *rows,
                                                   uint8_t *inserted)
{
    return insert_counted(stream, map, keys, n, gate, rows, inserted);
}

extern "C" em_gpu_status em_gpu_shards_insert_counted(em_gpu_stream *stream, em_gpu_shards shards,
                                                      const uint64_t *keys, uint64_t n,
                                                      em_gpu_gate gate, uint64_t *rows,
                                                      uint8_t *inserted)
{
    return insert_counted(stream, shards, keys, n, gate, rows, inserted);
}

/* A kernel over parts alone: a grid row a part, threads for the largest's keys. */
static em_gpu_status launch_over_parts(void (*kernel)(const em_gpu_shard_part *),
                                       const char *name, em_gpu_stream *stream,
                                       const em_gpu_shard_part *parts, uint32_t count,
                                       uint64_t most_keys)
{
    if (count == 0 || most_keys == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return em_gpu_launch_rows(kernel, name, most_keys, count, stream, parts);
}

extern "C" em_gpu_status em_gpu_parts_insert(em_gpu_stream *stream,
                                             const em_gpu_shard_part *parts, uint32_t count,
                                             uint64_t most_keys)
{
    return launch_over_parts(parts_insert_kernel, "parts_insert_kernel", stream, parts, count,
                             most_keys);
}

extern "C" em_gpu_status em_gpu_parts_erase(em_gpu_stream *stream,
                                            const em_gpu_shard_part *parts, uint32_t count,
                                            uint64_t most_keys)
{
    return launch_over_parts(parts_erase_kernel, "parts_erase_kernel", stream, parts, count,
                             most_keys);
}

extern "C" em_gpu_status em_gpu_map_rehash(em_gpu_stream *stream, const em_gpu_slot *old_slots,
                                           uint64_t old_slot_count, em_gpu_map map)
{
    if (old_slot_count == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(map_rehash_kernel, old_slot_count, stream, old_slots, old_slot_count,
                         map);
}

extern "C" em_gpu_status em_gpu_map_export_flags(em_gpu_stream *stream, em_gpu_map map,
                                                 uint64_t begin, uint64_t count, uint32_t *flags)
{
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(map_export_flags_kernel, count + 1, stream, map, begin, count, flags);
}

extern "C" em_gpu_status em_gpu_map_export_compact(em_gpu_stream *stream, em_gpu_map map,
                                                   uint64_t begin, uint64_t count,
                                                   const uint32_t *flags, const uint32_t *rank,
                                                   uint64_t take, uint64_t offset, uint64_t *keys,
                                                   uint64_t *rows, uint64_t *next_slot)
{
    if (count == 0 || take == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(map_export_compact_kernel, count, stream, map, begin, count, flags, rank,
                         take, offset, keys, rows, next_slot);
}

/* ---- row storage ------------------------------------------------------------------------ */

/* The settle asked of a launch that writes new rows (em_gpu_settle), by its first threads. */
__device__ void settle_maps(const em_gpu_settle &settle)
{
    if (settle.map.header != NULL && EM_GPU_THREAD_INDEX == 0)
        em_gpu_map_settle_item(settle.map);
    EM_GPU_FOR_EACH(s, settle.shards.count)
    {
        em_gpu_map_settle_item(settle.shards.maps[s]);
        settle.headers[s] = *settle.shards.maps[s].header;
    }
}

/* Threads a launch that settles needs at least. */
static uint64_t settle_threads(const em_gpu_settle &settle)
{
    return settle.map.header != NULL ? 1 : settle.shards.count;
}

__global__ void rows_init_kernel(em_gpu_storage storage, const uint64_t *keys,
                                 const uint64_t *rows, const uint8_t *inserted, uint64_t n,
                                 em_initializer_config initializer, em_optimizer_config optimizer,
                                 uint32_t shift, em_gpu_settle settle)
{
    EM_GPU_FOR_EACH_ELEMENT(i, j, n, storage.row_floats, shift)
    em_gpu_rows_init_element(storage, keys, rows, inserted, &initializer, &optimizer, i, j);
    settle_maps(settle);
}

/* em_gpu_parts_init: the settle of part blockIdx.y's map by its first thread, as
 * rows_init_kernel's (the inserts it settles were done by the launch before). */
__global__ void parts_init_kernel(const em_gpu_shard_part *parts,
                                  em_initializer_config initializer,
                                  em_optimizer_config optimizer, uint32_t shift)
{
    const em_gpu_shard_part *part = &parts[blockIdx.y];
    EM_GPU_FOR_EACH_ELEMENT(i, j, part->n, part->storage.row_floats, shift)
    em_gpu_rows_init_element(part->storage, part->keys, part->rows, part->inserted,
                             &initializer, &optimizer, i, j);
    if (EM_GPU_THREAD_INDEX == 0) {
        em_gpu_map_settle_item(part->map);
        *part->header = *part->map.header;
    }
}

__global__ void rows_gather_kernel(em_gpu_storage storage, const uint64_t *rows, uint64_t n,
                                   const uint32_t *targets, float *vectors, uint32_t shift)
{
    EM_GPU_FOR_EACH_ELEMENT(i, j, n, storage.dim, shift)
    em_gpu_rows_gather_element(storage, rows, targets, vectors, i, j);
}

__global__ void rows_gather_quad_kernel(em_gpu_storage storage, const uint64_t *rows, uint64_t n,
                                        const uint32_t *targets, float *vectors, uint32_t shift)
{
    EM_GPU_FOR_EACH_ELEMENT(i, q, n, storage.dim / 4, shift)
    em_gpu_rows_gather_quad(storage, rows, targets, vectors, i, q);
}

__global__ void parts_gather_kernel(const em_gpu_shard_part *parts, uint32_t shift)
{
    const em_gpu_shard_part *part = &parts[blockIdx.y];
    EM_GPU_FOR_EACH_ELEMENT(i, j, part->n, part->storage.dim, shift)
    em_gpu_rows_gather_element(part->storage, part->rows, part->targets, part->vectors, i, j);
}

__global__ void parts_gather_quad_kernel(const em_gpu_shard_part *parts, uint32_t shift)
{
    const em_gpu_shard_part *part = &parts[blockIdx.y];
    EM_GPU_FOR_EACH_ELEMENT(i, q, part->n, part->storage.dim / 4, shift)
    em_gpu_rows_gather_quad(part->storage, part->rows, part->targets, part->vectors, i, q);
}

__global__ void rows_pull_kernel(em_gpu_storage storage, em_gpu_batch batch,
                                 const uint64_t *rows, float *out, uint32_t shift)
{
    uint64_t outputs = batch.combiner == EM_COMBINER_NONE ? batch.nnz : batch.rows;
    EM_GPU_FOR_EACH_ELEMENT(k, j, outputs, batch.dim, shift)
    em_gpu_rows_pull_element(storage, &batch, rows, out, k, j);
}

__global__ void rows_check_kernel(em_gpu_storage storage, em_optimizer_config optimizer,
                                  em_initializer_config initializer, const uint64_t *keys,
                                  const uint64_t *rows, uint64_t n, const uint32_t *count,
                                  const float *gradients, uint64_t *first)
{
    uint64_t end = count != NULL && *count < n ? *count : n;
    EM_GPU_FOR_EACH(i, end)
    {
        uint32_t code = em_gpu_rows_check_item(storage, &optimizer, &initializer, keys, rows,
                                               gradients, i);
        if (code != EM_ROW_CHECK_OK)
            atomicMin((unsigned long long *)first,
                      (unsigned long long)em_gpu_rows_check_result(i, code));
    }
}

__global__ void rows_check_parts_kernel(const em_gpu_check_part *parts)
{
    const em_gpu_check_part *part = &parts[blockIdx.y];
    EM_GPU_FOR_EACH(i, part->n)
    {
        uint32_t code = em_gpu_rows_check_item(part->storage, &part->optimizer,
                                               &part->initializer, part->keys, part->rows,
                                               part->gradients, i);
        if (code != EM_ROW_CHECK_OK)
            atomicMin((unsigned long long *)part->first,
                      (unsigned long long)em_gpu_rows_check_result(i, code));
    }
}

/* find_each_kernel and rows_check_kernel in one pass: each thread checks the row it found. */
template <typename Seen>
__global__ void find_check_kernel(Seen seen, em_gpu_storage storage,
                                  em_optimizer_config optimizer, em_initializer_config initializer,
                                  const uint64_t *keys, uint64_t n, const uint32_t *count,
                                  const float *gradients, uint64_t *rows, uint64_t *missing,
                                  uint64_t *first)
{
    uint64_t end = count != NULL && *count < n ? *count : n;
    uint32_t absent = 0;
    EM_GPU_FOR_EACH(i, end)
    {
        absent += (uint32_t)find_item(seen, keys, i, rows);
        uint32_t code = em_gpu_rows_check_item(storage, &optimizer, &initializer, keys, rows,
                                               gradients, i);
        if (code != EM_ROW_CHECK_OK)
            atomicMin((unsigned long long *)first,
                      (unsigned long long)em_gpu_rows_check_result(i, code));
    }
    /* One atomic per warp: every lane reaches this point (blocks are whole warps). */
    absent = __reduce_add_sync(WARP_MASK, absent);
    if ((threadIdx.x & 31u) == 0 && absent != 0)
        atomicAdd((unsigned long long *)missing, (unsigned long long)absent);
}

__global__ void rows_read_kernel(em_gpu_storage storage, const uint64_t *rows, uint64_t n,
                                 float *values, uint32_t shift)
{
    EM_GPU_FOR_EACH_ELEMENT(i, j, n, storage.row_floats, shift)
    em_gpu_rows_read_element(storage, rows, values, i, j);
}

__global__ void rows_write_kernel(em_gpu_storage storage, const uint64_t *rows, uint64_t n,
                                  const uint32_t *sources, const float *values, uint32_t shift)
{
    EM_GPU_FOR_EACH_ELEMENT(i, j, n, storage.row_floats, shift)
    em_gpu_rows_write_element(storage, rows, sources, values, i, j);
}

/* What an optimizer kernel steps: the rows of one launch (step_rows), or, over several
 * shards of a device, part blockIdx.y's (em_gpu_shard_part: no gate, no new rows). */
struct step_rows {
    em_gpu_storage storage;
    const uint64_t *rows;
    uint64_t n;
    const float *gradients;
    em_gpu_gate gate;
    em_gpu_fresh_rows fresh;
};

__device__ inline step_rows rows_to_step(const step_rows &one)
{
    return one;
}

__device__ inline step_rows rows_to_step(const em_gpu_shard_part *parts)
{
    const em_gpu_shard_part *part = &parts[blockIdx.y];
    step_rows s = {};
    s.storage = part->storage;
    s.rows = part->rows;
    s.n = part->n;
    s.gradients = part->gradients;
    return s;
}

/* The optimizer kernels step the rows their gate leaves (em_gpu_gate_end: the same for
 * every thread, so whole warps skip together). sgd and adagrad go a thread an element. */
template <typename Steps, em_optimizer_kind Kind>
__global__ void element_step_kernel(Steps steps, em_optimizer_config optimizer, uint32_t shift)
{
    const step_rows s = rows_to_step(steps);
    uint64_t end = em_gpu_gate_end(s.gate, s.n);
    EM_GPU_FOR_EACH_ELEMENT(i, j, end, s.storage.dim, shift)
    {
        /* this thread's floats of a new row: element j of the weights and of the state */
        em_gpu_fresh_row_floats(s.storage, &optimizer, s.rows, &s.fresh, i, j, s.storage.dim);
        if (Kind == EM_OPTIMIZER_SGD)
            em_gpu_sgd_element(s.storage, &optimizer, s.rows, s.gradients, i, j);
        else
            em_gpu_adagrad_element(s.storage, &optimizer, s.rows, s.gradients, i, j);
    }
    settle_maps(s.fresh.settle);
}

/* Warp-per-row loop: every lane of a warp has the same i (whole warps iterate). */
#define FOR_EACH_ROW_OF_WARP(i, n)                                        \
    for (uint64_t i = EM_GPU_THREAD_INDEX / EM_GPU_ROW_LANES; i < (n);    \
         i += EM_GPU_THREAD_COUNT / EM_GPU_ROW_LANES)

template <typename Steps>
__global__ void rowwise_adagrad_kernel(Steps steps, em_optimizer_config optimizer)
{
    const step_rows s = rows_to_step(steps);
    uint32_t lane = threadIdx.x % EM_GPU_ROW_LANES;
    uint32_t dim = s.storage.dim;
    uint64_t end = em_gpu_gate_end(s.gate, s.n);
    FOR_EACH_ROW_OF_WARP(i, end)
    {
        if (s.rows[i] == EM_GPU_ROW_PENDING)
            continue; /* a refused key: the whole warp skips it */
        if (s.fresh.inserted != NULL && s.fresh.inserted[i]) { /* a new row: values first */
            em_gpu_fresh_row_floats(s.storage, &optimizer, s.rows, &s.fresh, i, lane,
                                    EM_GPU_ROW_LANES);
            __syncwarp();
        }
        float *weights = em_gpu_row_address(s.storage, s.rows[i]);
        const float *gradient = s.gradients + i * dim;
        float squares = em_gpu_rowwise_partial(gradient, dim, lane, EM_GPU_ROW_LANES);
        for (uint32_t offset = EM_GPU_ROW_LANES / 2; offset > 0; offset /= 2)
            squares += __shfl_xor_sync(WARP_MASK, squares, offset);
        float updated = 0.0f;
        float denominator =
            em_gpu_rowwise_denominator(weights[dim], squares, dim, optimizer.eps, &updated);
        for (uint32_t j = lane; j < dim; j += EM_GPU_ROW_LANES)
            em_rowwise_adagrad_element(&weights[j], gradient[j], optimizer.learning_rate,
                                       denominator);
        __syncwarp();
        if (lane == 0)
            weights[dim] = updated;
    }
    settle_maps(s.fresh.settle);
}

template <typename Steps>
__global__ void adam_kernel(Steps steps, em_optimizer_config optimizer)
{
    const step_rows s = rows_to_step(steps);
    uint32_t lane = threadIdx.x % EM_GPU_ROW_LANES;
    uint32_t dim = s.storage.dim;
    uint64_t end = em_gpu_gate_end(s.gate, s.n);
    FOR_EACH_ROW_OF_WARP(i, end)
    {
        if (s.rows[i] == EM_GPU_ROW_PENDING)
            continue; /* a refused key: the whole warp skips it */
        if (s.fresh.inserted != NULL && s.fresh.inserted[i]) { /* a new row: values first */
            em_gpu_fresh_row_floats(s.storage, &optimizer, s.rows, &s.fresh, i, lane,
                                    EM_GPU_ROW_LANES);
            __syncwarp();
        }
        float *weights = em_gpu_row_address(s.storage, s.rows[i]);
        float *first_moment = weights + dim;
        float *second_moment = first_moment + dim;
        float *step = second_moment + dim;
        const float *gradient = s.gradients + i * dim;
        float next = em_adam_next_step(*step);
        em_adam_constants constants = em_adam_row_setup(&optimizer, next);
        for (uint32_t j = lane; j < dim; j += EM_GPU_ROW_LANES)
            em_adam_element(&weights[j], &first_moment[j], &second_moment[j], gradient[j],
                            constants);
        /* Every lane has read the old step before lane 0 stores the new one. */
        __syncwarp();
        if (lane == 0)
            *step = next;
    }
    settle_maps(s.fresh.settle);
}

__global__ void rows_fill_initial_kernel(em_gpu_storage storage,
                                         em_initializer_config initializer, const uint64_t *keys,
                                         const uint64_t *rows, uint64_t n,
                                         const uint32_t *targets, float *vectors, uint32_t shift)
{
    EM_GPU_FOR_EACH_ELEMENT(i, j, n, storage.dim, shift)
    em_gpu_rows_fill_initial_element(storage, &initializer, keys, rows, targets, vectors, i, j);
}

__global__ void rows_touch_kernel(em_gpu_storage storage, const uint64_t *rows, uint64_t n,
                                  uint64_t accessed, uint32_t updated, int pushed)
{
    EM_GPU_FOR_EACH(i, n)
    em_gpu_rows_touch_item(storage, rows, i, accessed, updated, pushed);
}

__global__ void rows_touch_gated_kernel(em_gpu_storage storage, const uint64_t *rows,
                                        uint64_t n, em_gpu_gate gate, uint64_t accessed,
                                        uint32_t updated, int pushed)
{
    uint64_t end = em_gpu_gate_end(gate, n);
    EM_GPU_FOR_EACH(i, end)
    em_gpu_rows_touch_item(storage, rows, i, accessed, updated, pushed);
}

__global__ void parts_touch_kernel(const em_gpu_shard_part *parts, uint64_t accessed,
                                   uint32_t updated, int pushed)
{
    const em_gpu_shard_part *part = &parts[blockIdx.y];
    EM_GPU_FOR_EACH(i, part->n)
    em_gpu_rows_touch_item(part->storage, part->rows, i, accessed, updated, pushed);
}

__global__ void access_read_kernel(em_gpu_storage storage, const uint64_t *rows, uint64_t n,
                                   em_gpu_row_access *out)
{
    EM_GPU_FOR_EACH(i, n)
    em_gpu_access_read_item(storage, rows, i, out);
}

__global__ void walks_flags_kernel(const em_gpu_walk_piece *pieces, uint32_t count,
                                   uint64_t most_slots, uint32_t *flags)
{
    EM_GPU_FOR_EACH(i, most_slots)
    em_gpu_walks_flag_item(pieces, count, blockIdx.y, i, flags);
}

__global__ void walks_compact_kernel(const em_gpu_walk_piece *pieces, const uint32_t *flags,
                                     const uint32_t *rank)
{
    const em_gpu_walk_piece *piece = &pieces[blockIdx.y];
    EM_GPU_FOR_EACH(i, piece->count)
    em_gpu_walks_compact_item(piece, i, flags, rank);
}

__global__ void walks_advance_kernel(const em_gpu_walk_piece *pieces, uint32_t count,
                                     const uint32_t *rank)
{
    if (EM_GPU_THREAD_INDEX == 0)
        em_gpu_walks_advance_all(pieces, count, rank);
}

__global__ void choice_mark_kept_kernel(em_gpu_choice *choices)
{
    em_gpu_choice *c = &choices[blockIdx.y];
    EM_GPU_FOR_EACH(j, c->kept_count)
    em_gpu_choice_mark_kept_item(c, j);
}

/* A block's counts gather in shared memory, then go to the walk's bins; the walk's last
 * block to add its counts (c->arrived, which atomicInc brings back to 0 for the next
 * pass) reads the totals from L2 (other blocks added them there; this block's L1 may
 * hold an older line of them) and fixes the digit. Every block reads c->state before it
 * arrives, and the fix changes it only after the last has arrived: the blocks of one
 * launch all count, or none does. */
__global__ void choice_count_kernel(em_gpu_choice *choices, uint32_t digit)
{
    __shared__ uint32_t bins[EM_GPU_CHOICE_BINS];
    __shared__ bool last;
    em_gpu_choice *c = &choices[blockIdx.y];
    /* the same for the whole block; a pass before the choice's first byte counts nothing */
    if (c->state != EM_GPU_CHOICE_OPEN || digit < c->digits)
        return;
    for (uint32_t b = threadIdx.x; b < EM_GPU_CHOICE_BINS; b += blockDim.x)
        bins[b] = 0;
    __syncthreads();
    uint64_t held = em_gpu_choice_held(c);
    EM_GPU_FOR_EACH(i, held)
    {
        uint32_t bin = em_gpu_choice_bin(c, i, digit);
        if (bin < EM_GPU_CHOICE_BINS)
            atomicAdd(&bins[bin], 1u);
    }
    __syncthreads();
    for (uint32_t b = threadIdx.x; b < EM_GPU_CHOICE_BINS; b += blockDim.x)
        if (bins[b] != 0)
            atomicAdd(&c->bins[b], bins[b]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        last = atomicInc(&c->arrived, gridDim.x - 1) == gridDim.x - 1;
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    for (uint32_t b = threadIdx.x; b < EM_GPU_CHOICE_BINS; b += blockDim.x) {
        bins[b] = __ldcg(&c->bins[b]);
        c->bins[b] = 0; /* for the next digit's count, a later launch */
    }
    __syncthreads();
    if (threadIdx.x == 0)
        em_gpu_choice_fix_item(c, bins, digit);
}

__global__ void choice_flags_kernel(em_gpu_choice *choices, uint32_t *flags)
{
    const em_gpu_choice *c = &choices[blockIdx.y];
    EM_GPU_FOR_EACH(i, c->want)
    flags[c->first_flag + i] = em_gpu_choice_flag(c, i);
}

__global__ void choice_write_kernel(em_gpu_choice *choices, const uint32_t *flags,
                                    const uint32_t *rank)
{
    em_gpu_choice *c = &choices[blockIdx.y];
    EM_GPU_FOR_EACH(i, c->want)
    em_gpu_choice_write_item(c, i, flags, rank);
}

__global__ void access_write_kernel(em_gpu_storage storage, const uint64_t *rows, uint64_t n,
                                    const em_gpu_row_access *in)
{
    EM_GPU_FOR_EACH(i, n)
    em_gpu_access_write_item(storage, rows, i, in);
}

extern "C" em_gpu_status em_gpu_rows_fill_initial(em_gpu_stream *stream, em_gpu_storage storage,
                                                  em_initializer_config initializer,
                                                  const uint64_t *keys, const uint64_t *rows,
                                                  uint64_t n, const uint32_t *targets,
                                                  float *vectors)
{
    if (n == 0 || storage.dim == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    uint32_t shift = em_gpu_group_shift(storage.dim);
    return EM_GPU_LAUNCH(rows_fill_initial_kernel, em_gpu_element_threads(n, shift), stream,
                         storage, initializer, keys, rows, n, targets, vectors, shift);
}

extern "C" em_gpu_status em_gpu_parts_touch(em_gpu_stream *stream,
                                            const em_gpu_shard_part *parts, uint32_t count,
                                            uint64_t most_keys, uint64_t accessed,
                                            uint32_t updated, int pushed)
{
    if (count == 0 || most_keys == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH_ROWS(parts_touch_kernel, most_keys, count, stream, parts, accessed,
                              updated, pushed);
}

extern "C" em_gpu_status em_gpu_rows_touch(em_gpu_stream *stream, em_gpu_storage storage,
                                           const uint64_t *rows, uint64_t n, uint64_t accessed,
                                           uint32_t updated, int pushed)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(rows_touch_kernel, n, stream, storage, rows, n, accessed, updated,
                         pushed);
}

extern "C" em_gpu_status em_gpu_rows_touch_gated(em_gpu_stream *stream, em_gpu_storage storage,
                                                 const uint64_t *rows, uint64_t n,
                                                 em_gpu_gate gate, uint64_t accessed,
                                                 uint32_t updated, int pushed)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(rows_touch_gated_kernel, n, stream, storage, rows, n, gate, accessed,
                         updated, pushed);
}

extern "C" em_gpu_status em_gpu_rows_pull(em_gpu_stream *stream, em_gpu_storage storage,
                                          const em_gpu_batch *batch, const uint64_t *rows,
                                          float *out)
{
    uint64_t outputs = batch->combiner == EM_COMBINER_NONE ? batch->nnz : batch->rows;
    if (outputs == 0 || batch->dim == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    uint32_t shift = em_gpu_group_shift(batch->dim);
    return EM_GPU_LAUNCH(rows_pull_kernel, em_gpu_element_threads(outputs, shift), stream,
                         storage, *batch, rows, out, shift);
}

extern "C" em_gpu_status em_gpu_access_read(em_gpu_stream *stream, em_gpu_storage storage,
                                            const uint64_t *rows, uint64_t n,
                                            em_gpu_row_access *out)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(access_read_kernel, n, stream, storage, rows, n, out);
}

extern "C" em_gpu_status em_gpu_choice_mark_kept(em_gpu_stream *stream, em_gpu_choice *choices,
                                                 uint32_t walks, uint64_t most_kept)
{
    if (walks == 0 || most_kept == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH_ROWS(choice_mark_kept_kernel, most_kept, walks, stream, choices);
}

extern "C" em_gpu_status em_gpu_choice_count(em_gpu_stream *stream, em_gpu_choice *choices,
                                             uint32_t walks, uint64_t most_held, uint32_t digit)
{
    if (walks == 0) /* with no entries held, a block still fixes each walk's digit */
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH_ROWS(choice_count_kernel, most_held, walks, stream, choices, digit);
}

extern "C" em_gpu_status em_gpu_choice_flags(em_gpu_stream *stream, em_gpu_choice *choices,
                                             uint32_t walks, uint64_t most_want, uint32_t *flags)
{
    if (walks == 0 || most_want == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH_ROWS(choice_flags_kernel, most_want, walks, stream, choices, flags);
}

extern "C" em_gpu_status em_gpu_choice_write(em_gpu_stream *stream, em_gpu_choice *choices,
                                             uint32_t walks, uint64_t most_want,
                                             const uint32_t *flags, const uint32_t *rank)
{
    if (walks == 0 || most_want == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH_ROWS(choice_write_kernel, most_want, walks, stream, choices, flags,
                              rank);
}

extern "C" em_gpu_status em_gpu_walks_flags(em_gpu_stream *stream,
                                            const em_gpu_walk_piece *pieces, uint32_t count,
                                            uint64_t most_slots, uint32_t *flags)
{
    if (count == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH_ROWS(walks_flags_kernel, most_slots, count, stream, pieces, count,
                              most_slots, flags);
}

extern "C" em_gpu_status em_gpu_walks_compact(em_gpu_stream *stream,
                                              const em_gpu_walk_piece *pieces, uint32_t count,
                                              uint64_t most_slots, const uint32_t *flags,
                                              const uint32_t *rank)
{
    if (count == 0 || most_slots == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH_ROWS(walks_compact_kernel, most_slots, count, stream, pieces, flags,
                              rank);
}

extern "C" em_gpu_status em_gpu_walks_advance(em_gpu_stream *stream,
                                              const em_gpu_walk_piece *pieces, uint32_t count,
                                              const uint32_t *rank)
{
    if (count == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(walks_advance_kernel, 1, stream, pieces, count, rank);
}

extern "C" em_gpu_status em_gpu_access_write(em_gpu_stream *stream, em_gpu_storage storage,
                                             const uint64_t *rows, uint64_t n,
                                             const em_gpu_row_access *in)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(access_write_kernel, n, stream, storage, rows, n, in);
}

extern "C" em_gpu_status em_gpu_rows_init(em_gpu_stream *stream, em_gpu_storage storage,
                                          const uint64_t *keys, const uint64_t *rows,
                                          const uint8_t *inserted, uint64_t n,
                                          em_initializer_config initializer,
                                          em_optimizer_config optimizer, em_gpu_settle settle)
{
    uint64_t settles = settle_threads(settle);
    if (n == 0 && settles == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    uint32_t shift = em_gpu_group_shift(storage.row_floats);
    uint64_t threads = em_gpu_element_threads(n, shift);
    return EM_GPU_LAUNCH(rows_init_kernel, threads > settles ? threads : settles, stream, storage,
                         keys, rows, inserted, n, initializer, optimizer, shift, settle);
}

extern "C" em_gpu_status em_gpu_parts_init(em_gpu_stream *stream, const em_gpu_shard_part *parts,
                                           uint32_t count, uint64_t most_keys,
                                           uint32_t row_floats,
                                           em_initializer_config initializer,
                                           em_optimizer_config optimizer)
{
    if (count == 0) /* with no keys, each part's map is still settled */
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    uint32_t shift = em_gpu_group_shift(row_floats);
    return EM_GPU_LAUNCH_ROWS(parts_init_kernel, em_gpu_element_threads(most_keys, shift), count,
                              stream, parts, initializer, optimizer, shift);
}

extern "C" em_gpu_status em_gpu_rows_gather(em_gpu_stream *stream, em_gpu_storage storage,
                                            const uint64_t *rows, uint64_t n,
                                            const uint32_t *targets, float *vectors)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    /* Rows are 16-byte aligned (stride % 4 == 0, aligned blocks); so is every output
     * vector when dim % 4 == 0 and the output starts aligned. */
    if (storage.dim % 4 == 0 && ((uintptr_t)vectors & 15u) == 0) {
        uint32_t shift = em_gpu_group_shift(storage.dim / 4);
        return EM_GPU_LAUNCH(rows_gather_quad_kernel, em_gpu_element_threads(n, shift), stream,
                             storage, rows, n, targets, vectors, shift);
    }
    uint32_t shift = em_gpu_group_shift(storage.dim);
    return EM_GPU_LAUNCH(rows_gather_kernel, em_gpu_element_threads(n, shift), stream, storage,
                         rows, n, targets, vectors, shift);
}

/* Launches the optimizer's kernel over steps (step_rows, or parts: `rows` grid rows) of
 * at most n rows of dim weights each, with at least `least` threads in a row. */
template <typename Steps>
static em_gpu_status launch_steps(em_gpu_stream *stream, Steps steps, uint32_t rows,
                                  em_optimizer_config optimizer, uint64_t n, uint32_t dim,
                                  uint64_t least)
{
    uint32_t shift = em_gpu_group_shift(dim);
    uint64_t element_threads = em_gpu_element_threads(n, shift);
    uint64_t warp_threads = n * EM_GPU_ROW_LANES;
    if (element_threads < least)
        element_threads = least;
    if (warp_threads < least) /* whole warps */
        warp_threads = (least + EM_GPU_ROW_LANES - 1) / EM_GPU_ROW_LANES * EM_GPU_ROW_LANES;
    switch (optimizer.kind) {
    case EM_OPTIMIZER_ADAGRAD:
        return EM_GPU_LAUNCH_ROWS((element_step_kernel<Steps, EM_OPTIMIZER_ADAGRAD>),
                                  element_threads, rows, stream, steps, optimizer, shift);
    case EM_OPTIMIZER_ROWWISE_ADAGRAD:
        return EM_GPU_LAUNCH_ROWS(rowwise_adagrad_kernel<Steps>, warp_threads, rows, stream,
                                  steps, optimizer);
    case EM_OPTIMIZER_ADAM:
        return EM_GPU_LAUNCH_ROWS(adam_kernel<Steps>, warp_threads, rows, stream, steps,
                                  optimizer);
    case EM_OPTIMIZER_SGD:
        return EM_GPU_LAUNCH_ROWS((element_step_kernel<Steps, EM_OPTIMIZER_SGD>),
                                  element_threads, rows, stream, steps, optimizer, shift);
    case EM_OPTIMIZER_COUNT:
        break;
    }
    return em_gpu_invalid_optimizer();
}

extern "C" em_gpu_status em_gpu_parts_gather(em_gpu_stream *stream,
                                             const em_gpu_shard_part *parts, uint32_t count,
                                             uint64_t most_keys, uint32_t dim, int quads)
{
    if (count == 0 || most_keys == 0 || dim == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    if (quads) {
        uint32_t shift = em_gpu_group_shift(dim / 4);
        return EM_GPU_LAUNCH_ROWS(parts_gather_quad_kernel,
                                  em_gpu_element_threads(most_keys, shift), count, stream, parts,
                                  shift);
    }
    uint32_t shift = em_gpu_group_shift(dim);
    return EM_GPU_LAUNCH_ROWS(parts_gather_kernel, em_gpu_element_threads(most_keys, shift), count,
                              stream, parts, shift);
}

extern "C" em_gpu_status em_gpu_rows_apply_gated(em_gpu_stream *stream, em_gpu_storage storage,
                                                 em_optimizer_config optimizer,
                                                 const uint64_t *rows, uint64_t n,
                                                 const float *gradients, em_gpu_gate gate,
                                                 em_gpu_fresh_rows fresh)
{
    uint64_t settles = settle_threads(fresh.settle);
    if (n == 0 && settles == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    step_rows steps = {storage, rows, n, gradients, gate, fresh};
    return launch_steps(stream, steps, 1, optimizer, n, storage.dim, settles);
}

extern "C" em_gpu_status em_gpu_parts_apply(em_gpu_stream *stream, const em_gpu_shard_part *parts,
                                            uint32_t count, uint64_t most_keys, uint32_t dim,
                                            em_optimizer_config optimizer)
{
    if (count == 0 || most_keys == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return launch_steps(stream, parts, count, optimizer, most_keys, dim, 0);
}

extern "C" em_gpu_status em_gpu_rows_apply(em_gpu_stream *stream, em_gpu_storage storage,
                                           em_optimizer_config optimizer, const uint64_t *rows,
                                           uint64_t n, const float *gradients)
{
    em_gpu_gate none = {NULL, NULL, NULL, 0};
    em_gpu_fresh_rows no_rows = {};
    return em_gpu_rows_apply_gated(stream, storage, optimizer, rows, n, gradients, none, no_rows);
}

extern "C" em_gpu_status em_gpu_rows_check(em_gpu_stream *stream, em_gpu_storage storage,
                                           em_optimizer_config optimizer,
                                           em_initializer_config initializer,
                                           const uint64_t *keys, const uint64_t *rows,
                                           uint64_t n, const float *gradients, uint64_t *first)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(rows_check_kernel, n, stream, storage, optimizer, initializer, keys,
                         rows, n, (const uint32_t *)NULL, gradients, first);
}

extern "C" em_gpu_status em_gpu_rows_check_parts(em_gpu_stream *stream,
                                                 const em_gpu_check_part *parts, uint32_t count,
                                                 uint64_t most_keys)
{
    if (count == 0 || most_keys == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH_ROWS(rows_check_parts_kernel, most_keys, count, stream, parts);
}

extern "C" em_gpu_status em_gpu_rows_check_counted(em_gpu_stream *stream, em_gpu_storage storage,
                                                   em_optimizer_config optimizer,
                                                   em_initializer_config initializer,
                                                   const uint64_t *keys, const uint64_t *rows,
                                                   uint64_t n, const uint32_t *count,
                                                   const float *gradients, uint64_t *first)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(rows_check_kernel, n, stream, storage, optimizer, initializer, keys,
                         rows, n, count, gradients, first);
}

extern "C" em_gpu_status em_gpu_map_find_check_counted(
    em_gpu_stream *stream, em_gpu_map map, em_gpu_storage storage, em_optimizer_config optimizer,
    em_initializer_config initializer, const uint64_t *keys, uint64_t n, const uint32_t *count,
    const float *gradients, uint64_t *rows, uint64_t *missing, uint64_t *first)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(find_check_kernel<em_gpu_map>, n, stream, map, storage, optimizer,
                         initializer, keys, n, count, gradients, rows, missing, first);
}

extern "C" em_gpu_status em_gpu_shards_find_check_counted(
    em_gpu_stream *stream, em_gpu_shards shards, em_gpu_storage storage,
    em_optimizer_config optimizer, em_initializer_config initializer, const uint64_t *keys,
    uint64_t n, const uint32_t *count, const float *gradients, uint64_t *rows, uint64_t *missing,
    uint64_t *first)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    return EM_GPU_LAUNCH(find_check_kernel<em_gpu_shards>, n, stream, shards, storage, optimizer,
                         initializer, keys, n, count, gradients, rows, missing, first);
}

extern "C" em_gpu_status em_gpu_rows_read(em_gpu_stream *stream, em_gpu_storage storage,
                                          const uint64_t *rows, uint64_t n, float *values)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    uint32_t shift = em_gpu_group_shift(storage.row_floats);
    return EM_GPU_LAUNCH(rows_read_kernel, em_gpu_element_threads(n, shift), stream, storage, rows,
                         n, values, shift);
}

extern "C" em_gpu_status em_gpu_rows_write(em_gpu_stream *stream, em_gpu_storage storage,
                                           const uint64_t *rows, uint64_t n,
                                           const uint32_t *sources, const float *values)
{
    if (n == 0)
        return em_gpu_ok();
    EM_GPU_TRY(em_gpu_use(stream));
    uint32_t shift = em_gpu_group_shift(storage.row_floats);
    return EM_GPU_LAUNCH(rows_write_kernel, em_gpu_element_threads(n, shift), stream, storage,
                         rows, n, sources, values, shift);
}
