/*
 * DESIGN: key -> 64-bit value maps for deltas (checkpoint_internal.h): the digest of
 * every row of the last checkpoint, and, while a chain loads, which checkpoint of the
 * chain decided each key.
 *
 * Open addressing with linear probing over {key, value} slots, a power of two of them,
 * at most three quarters used. Every u64 is a key: the slot marker (UINT64_MAX) lives
 * in a side entry when it is a key. 16 bytes per slot, so about 21 to 43 bytes per key.
 */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/keyhash.h"
#include "lib/checkpoint/checkpoint_internal.h"

#define EMPTY UINT64_MAX

static uint64_t home(const em__key_map *map, uint64_t key)
{
    return em_mix64(key) & (map->slots - 1);
}

static bool rehash(em__key_map *map, uint64_t slots)
{
    em__key_map grown = {.keys = malloc(slots * sizeof(uint64_t)),
                         .values = malloc(slots * sizeof(uint64_t)),
                         .slots = slots,
                         .used = map->used,
                         .has_empty_key = map->has_empty_key,
                         .empty_key_value = map->empty_key_value};
    if (grown.keys == NULL || grown.values == NULL) {
        free(grown.keys);
        free(grown.values);
        return false;
    }
    memset(grown.keys, 0xff, slots * sizeof(uint64_t));
    for (uint64_t i = 0; i < map->slots; i++) {
        if (map->keys[i] == EMPTY)
            continue;
        uint64_t slot = home(&grown, map->keys[i]);
        while (grown.keys[slot] != EMPTY)
            slot = (slot + 1) & (slots - 1);
        grown.keys[slot] = map->keys[i];
        grown.values[slot] = map->values[i];
    }
    free(map->keys);
    free(map->values);
    *map = grown;
    return true;
}

bool em__key_map_init(em__key_map *map, uint64_t expected)
{
    memset(map, 0, sizeof(*map));
    uint64_t slots = 64;
    while (slots / 4 * 3 < expected)
        slots *= 2;
    return rehash(map, slots);
}

void em__key_map_free(em__key_map *map)
{
    free(map->keys);
    free(map->values);
    memset(map, 0, sizeof(*map));
}

/* The slot holding key, or the empty slot where it would go. */
static uint64_t find_slot(const em__key_map *map, uint64_t key)
{
    uint64_t slot = home(map, key);
    while (map->keys[slot] != key && map->keys[slot] != EMPTY)
        slot = (slot + 1) & (map->slots - 1);
    return slot;
}

bool em__key_map_get(const em__key_map *map, uint64_t key, uint64_t *value)
{
    if (key == EMPTY) {
        *value = map->empty_key_value;
        return map->has_empty_key;
    }
    uint64_t slot = find_slot(map, key);
    *value = map->values[slot];
    return map->keys[slot] == key;
}

bool em__key_map_put(em__key_map *map, uint64_t key, uint64_t value)
{
    if (key == EMPTY) {
        map->used += !map->has_empty_key;
        map->has_empty_key = true;
        map->empty_key_value = value;
        return true;
    }
    uint64_t slot = find_slot(map, key);
    if (map->keys[slot] == EMPTY) {
        if ((map->used + 1) > map->slots / 4 * 3) {
            if (!rehash(map, map->slots * 2))
                return false;
            slot = find_slot(map, key);
        }
        map->keys[slot] = key;
        map->used++;
    }
    map->values[slot] = value;
    return true;
}

uint64_t em__row_digest(const float *row, uint32_t floats, const void *access)
{
    uint64_t values = XXH3_64bits(row, (size_t)floats * sizeof(float));
    return access == NULL ? values : XXH3_64bits_withSeed(access, sizeof(em_row_access), values);
}
