/*
 * DESIGN: the binary layout of rows.emb and index.emb (docs/checkpoints.md), shared by
 * the writer and the reader. Every number is little-endian.
 */
#ifndef EMBER_LIB_CHECKPOINT_FORMAT_H
#define EMBER_LIB_CHECKPOINT_FORMAT_H

#include <stdint.h>
#include <xxhash.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoints are written in the host's byte order, which must be little-endian"
#endif

#define EM_CHUNK_MAGIC "EMBCHUNK"
#define EM_INDEX_MAGIC "EMBINDEX"
#define EM_TOMBSTONES_MAGIC "EMBTOMBS"
#define EM_ADMISSION_MAGIC "EMBADMIT"
#define EM_EVICTED_MAGIC "EMBEVICT"

/* A chunk of rows.emb: this header, then rows keys (u64), then rows x row_floats
 * floats (f32). */
typedef struct em_chunk_header {
    char magic[8];
    uint32_t version;
    uint32_t bucket;
    uint32_t rows;
    uint32_t row_floats;
    uint64_t payload_bytes; /* rows x (8 + 4 x row_floats) */
    uint64_t payload_xxh3;  /* XXH3-64 of the payload */
    uint64_t header_xxh3;   /* XXH3-64 of the 40 bytes above */
} em_chunk_header;

_Static_assert(sizeof(em_chunk_header) == 48, "chunk header layout");

/* The manifest's checksum of rows.emb from format version 4: the XXH3-64 of the
 * chunks' (header_xxh3, payload_xxh3) pairs, 16 bytes each, in the file's order. Every
 * byte of the file is in a chunk whose header and payload checksums a reader checks
 * anyway, so the file's checksum costs no pass over its bytes (before version 4 it was
 * the XXH3-64 of every byte, a second pass for the writer and the reader). */
static inline void em_rows_digest_add(XXH3_state_t *digest, const em_chunk_header *header)
{
    uint64_t pair[2] = {header->header_xxh3, header->payload_xxh3};
    XXH3_64bits_update(digest, pair, sizeof(pair));
}

/* index.emb: this header, chunks entries, then the XXH3-64 of all bytes before it. */
typedef struct em_index_header {
    char magic[8];
    uint32_t version;
    uint32_t buckets;
    uint64_t chunks;
} em_index_header;

typedef struct em_index_entry {
    uint32_t bucket;
    uint32_t rows;
    uint64_t offset;       /* of the chunk's header in rows.emb */
    uint64_t payload_xxh3; /* as in the chunk's header */
} em_index_entry;

_Static_assert(sizeof(em_index_header) == 24, "index header layout");
_Static_assert(sizeof(em_index_entry) == 24, "index entry layout");

/* tombstones.emb (format version 2): this header, count keys (u64, ordered by bucket
 * then key), then the XXH3-64 of all bytes before it. */
typedef struct em_tombstones_header {
    char magic[8];
    uint32_t version;
    uint32_t buckets;
    uint64_t count;
} em_tombstones_header;

_Static_assert(sizeof(em_tombstones_header) == 24, "tombstones header layout");

/* admission.emb (format version 3, tables with counter admission only): this header, the
 * sketch's counters (one byte each), then the XXH3-64 of all bytes before it. */
typedef struct em_admission_header {
    char magic[8];
    uint32_t version;
    uint32_t threshold;
    uint64_t counters;
} em_admission_header;

_Static_assert(sizeof(em_admission_header) == 24, "admission header layout");

/* evicted.emb (format version 5, tables whose eviction tracks access): this header, the
 * keys of the evicted-key ring oldest first (count u64; sequences total - count + 1 to
 * total), then the XXH3-64 of all bytes before it. */
typedef struct em_evicted_header {
    char magic[8];
    uint32_t version;
    uint32_t ring;   /* the table's eviction.ring */
    uint64_t total;  /* keys the policy removed (evicted or expired) up to the snapshot */
    uint64_t count;  /* keys that follow: min(total, ring) */
} em_evicted_header;

_Static_assert(sizeof(em_evicted_header) == 32, "evicted header layout");

#endif
