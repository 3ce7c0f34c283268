/*
 * DESIGN: the fixed 64-bit mixers that route keys.
 *
 * Real keys are structured (feature id in the high bits, small counters in the low
 * bits), so nothing ever routes on the raw key. Everything goes through
 * em_key_hash(), the splitmix64 finalizer (Steele, Lea, Flood 2014; constants from
 * Stafford's "Mix13"). It is a bijection on 64-bit values, so distinct keys never
 * collide in it, and every input bit affects every output bit.
 *
 *   h(key)        = mix13(key)
 *   shard         = h(key) mod shard_count                       (inside one daemon)
 *   bucket        = h(key) >> 52, one of 4,096 virtual buckets
 *   server        = jump_consistent_hash(mix13(bucket), server_count)   (client side)
 *   hash map slot = mix13(key ^ EM_HASHMAP_SEED) scaled to the slot count
 *
 * Servers own whole buckets, and checkpoints group rows by the same buckets, so a
 * cluster restored onto another number of servers has each server read only the
 * buckets it now owns (docs/checkpoints.md). The price of 4,096 buckets is balance:
 * the fullest server holds about 1% more than the mean with 2-4 servers, 6% with 8-16,
 * 19% with 32 (tests/unit/test_client_split.c checks the spread and that adding a
 * server moves only about 1/(n+1) of the buckets, all onto the new server).
 *
 * The hash map uses a differently seeded mix so that the keys of one shard (which all
 * share h(key) mod shard_count) still spread over every slot of that shard's map.
 *
 * Header-only and free of libc so CUDA kernels compile the same functions
 * (EM_HOST_DEVICE expands to __host__ __device__ under nvcc): the GPU backend routes
 * and initialises exactly like the CPU backend.
 */
#ifndef EMBER_COMMON_KEYHASH_H
#define EMBER_COMMON_KEYHASH_H

#include <stdint.h>

#include "common/host_device.h"

/* Seed xor-ed into keys before hashing them for hash map slots. */
#define EM_HASHMAP_SEED UINT64_C(0x6a09e667f3bcc909)

/* splitmix64 finalizer ("Mix13"). */
EM_HOST_DEVICE uint64_t em_mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= UINT64_C(0xbf58476d1ce4e5b9);
    x ^= x >> 27;
    x *= UINT64_C(0x94d049bb133111eb);
    x ^= x >> 31;
    return x;
}

/* h(key): the routing hash (README.md, "Semantics"). */
EM_HOST_DEVICE uint64_t em_key_hash(uint64_t key)
{
    return em_mix64(key);
}

/* Owner shard of a key inside one daemon: h(key) mod shard_count. shard_count >= 1. A
 * power of two (the usual count: one shard per GPU, or 8) takes the same remainder with
 * a mask: a 64-bit division costs several times the hash on the host, and more on a
 * GPU, which has no divide instruction. */
EM_HOST_DEVICE uint32_t em_key_shard(uint64_t key, uint32_t shard_count)
{
    uint64_t h = em_key_hash(key);
    if ((shard_count & (shard_count - 1)) == 0)
        return (uint32_t)(h & (shard_count - 1));
    return (uint32_t)(h % shard_count);
}

/*
 * Jump consistent hash (Lamping and Veach, 2014): maps a 64-bit hash to a bucket in
 * [0, buckets) so that growing from n to n+1 buckets moves only 1/(n+1) of the hashes.
 * buckets >= 1.
 */
EM_HOST_DEVICE int32_t em_jump_consistent_hash(uint64_t hash, int32_t buckets)
{
    int64_t bucket = -1;
    int64_t next = 0;
    while (next < buckets) {
        bucket = next;
        hash = hash * UINT64_C(2862933555777941757) + 1;
        next = (int64_t)((double)(bucket + 1) *
                         ((double)(INT64_C(1) << 31) / (double)((hash >> 33) + 1)));
    }
    return (int32_t)bucket;
}

/* Virtual buckets of the key hash: the unit that servers own and checkpoints group. */
#define EM_KEY_BUCKET_BITS 12u
#define EM_KEY_BUCKETS (1u << EM_KEY_BUCKET_BITS)

/* The virtual bucket of a key, in [0, EM_KEY_BUCKETS). */
EM_HOST_DEVICE uint32_t em_key_bucket(uint64_t key)
{
    return (uint32_t)(em_key_hash(key) >> (64u - EM_KEY_BUCKET_BITS));
}

/* Server index of a bucket over a list of server_count servers. */
EM_HOST_DEVICE int32_t em_bucket_server(uint32_t bucket, int32_t server_count)
{
    return em_jump_consistent_hash(em_mix64(bucket), server_count);
}

/* Server index for a key over a list of server_count servers. */
EM_HOST_DEVICE int32_t em_key_server(uint64_t key, int32_t server_count)
{
    return em_bucket_server(em_key_bucket(key), server_count);
}

/* Slot hash used by the hash maps (CPU and GPU). */
EM_HOST_DEVICE uint64_t em_hashmap_hash(uint64_t key)
{
    return em_mix64(key ^ EM_HASHMAP_SEED);
}

/* Maps a 64-bit hash onto [0, range) without a division (Lemire's multiply-shift). */
EM_HOST_DEVICE uint64_t em_hash_scale(uint64_t hash, uint64_t range)
{
    return (uint64_t)(((unsigned __int128)hash * range) >> 64);
}

#endif
