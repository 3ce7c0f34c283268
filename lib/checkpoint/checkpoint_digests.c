/*
 * DESIGN: key -> 64-bit value maps for deltas (checkpoint_internal.h): the digest of
 * every row of the last checkpoint, and, while a chain loads, which checkpoint of the
 * chain decided each key.
 *
 * Open addressing with linear probing over {key, value} slots, a power of two of them,
 * at most three quarters used. Every u64 is a key: the slot marker (UINT64_MAX) lives
 * in a side entry when it is a key. 16 bytes per slot, so about 21 to 43 bytes per key.
 * A save puts and looks up every row's key, in the snapshot's order, which is not the
 * map's: callers prefetch each key's home slot a few keys ahead (em__key_map_prefetch),
 * and the key and its value share the slot's line.
 */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/keyhash.h"
#include "lib/checkpoint/checkpoint_internal.h"

#define EMPTY EM__KEY_MAP_EMPTY

static uint64_t home(const em__key_map *map, uint64_t key)
{
    return em_mix64(key) & (map->slots - 1);
}

static bool rehash(em__key_map *map, uint64_t slots)
{
    em__key_map grown = {.slot = malloc(slots * sizeof(em__key_slot)),
                         .slots = slots,
                         .used = map->used,
                         .has_empty_key = map->has_empty_key,
                         .empty_key_value = map->empty_key_value};
    if (grown.slot == NULL)
        return false;
    for (uint64_t i = 0; i < slots; i++)
        grown.slot[i].key = EMPTY;
    for (uint64_t i = 0; i < map->slots; i++) {
        if (map->slot[i].key == EMPTY)
            continue;
        uint64_t at = home(&grown, map->slot[i].key);
        while (grown.slot[at].key != EMPTY)
            at = (at + 1) & (slots - 1);
        grown.slot[at] = map->slot[i];
    }
    free(map->slot);
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
    free(map->slot);
    memset(map, 0, sizeof(*map));
}

/* The slot holding key, or the empty slot where it would go. */
static uint64_t find_slot(const em__key_map *map, uint64_t key)
{
    uint64_t at = home(map, key);
    while (map->slot[at].key != key && map->slot[at].key != EMPTY)
        at = (at + 1) & (map->slots - 1);
    return at;
}

bool em__key_map_get(const em__key_map *map, uint64_t key, uint64_t *value)
{
    if (key == EMPTY) {
        *value = map->empty_key_value;
        return map->has_empty_key;
    }
    uint64_t at = find_slot(map, key);
    *value = map->slot[at].value;
    return map->slot[at].key == key;
}

bool em__key_map_put(em__key_map *map, uint64_t key, uint64_t value)
{
    if (key == EMPTY) {
        map->used += !map->has_empty_key;
        map->has_empty_key = true;
        map->empty_key_value = value;
        return true;
    }
    uint64_t at = find_slot(map, key);
    if (map->slot[at].key == EMPTY) {
        if ((map->used + 1) > map->slots / 4 * 3) {
            if (!rehash(map, map->slots * 2))
                return false;
            at = find_slot(map, key);
        }
        map->slot[at].key = key;
        map->used++;
    }
    map->slot[at].value = value;
    return true;
}

void em__key_map_prefetch(const em__key_map *map, uint64_t key)
{
    if (map->slots > 0)
        __builtin_prefetch(&map->slot[home(map, key)]);
}

uint64_t em__row_digest(const float *row, uint32_t floats, const void *access)
{
    uint64_t values = XXH3_64bits(row, (size_t)floats * sizeof(float));
    return access == NULL ? values : XXH3_64bits_withSeed(access, sizeof(em_row_access), values);
}
