/*
 * DESIGN: writing a checkpoint (checkpoint.h has the protocol).
 *
 * Rows come from a table snapshot into a staging buffer; each full buffer is grouped by
 * bucket (a counting sort into an output buffer, already laid out as chunks: header,
 * keys, rows) and handed to a writer thread, which hashes it into the file's checksum
 * and writes it with one write while the next buffer is read and grouped: the disk
 * and the CPU work overlap. So the extra memory of a save is the snapshot's (table.h)
 * plus three buffers of options->buffer_bytes (staging, and two outputs), mapped for the
 * save alone and unmapped when it ends (em_io_buffer_alloc), and every row is read once
 * and written once.
 *
 * A save that tracks changes digests every row as it stages it, into a new key ->
 * digest map; a delta then keeps only the rows whose digest differs from the parent's
 * (or that the parent lacks), and after the pass the parent's keys missing from the new
 * map are the tombstones. The new map replaces the table's only once the checkpoint is
 * published, so the extra memory of a delta is a second map while it runs. A full save
 * keeps every row whatever its digest, so there a thread of its own digests each full
 * staging buffer while the save groups it into chunks.
 */
#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/keyhash.h"
#include "ember_config.h"
#include "lib/base/failpoint.h"
#include "lib/checkpoint/checkpoint.h"
#include "lib/checkpoint/checkpoint_format.h"
#include "lib/checkpoint/checkpoint_internal.h"
#include "lib/checkpoint/checkpoint_io.h"
#include "lib/table/table_config.h"

void em_checkpoint_options_init(em_checkpoint_options *options, const char *dir)
{
    *options = (em_checkpoint_options){
        .dir = dir,
        .keep = 3,
        .copy_limit_bytes = UINT64_C(256) << 20,
        .buffer_bytes = UINT64_C(32) << 20,
    };
}

uint32_t em__checkpoint_bucket(uint64_t key)
{
    return em_key_bucket(key);
}

/* ---- the state of one save ----------------------------------------------------------- */

/* An output buffer handed to the writer thread (em__pipe), which writes it; buffers go
 * out in order. Its chunks start at data + lead. */
typedef struct run_out {
    unsigned char *data;
    size_t lead, bytes;
} run_out;

/* rows.emb, written around the page cache (O_DIRECT) where its file system allows: the
 * kernel then copies nothing, where a buffered write copies every byte into the page
 * cache on the writer's thread. Direct writes cover whole blocks of
 * EM_SAVE_DIRECT_ALIGN bytes, so the bytes of a run past its last whole block wait in
 * carry, and go at the start of the next run: each run leaves `lead` bytes in front of
 * its chunks for them (the file's length so far, modulo the block). The last carry goes
 * through the page cache. */
typedef struct rows_file {
    int fd;
    const char *path;
    bool direct;
    unsigned char *carry; /* EM_SAVE_DIRECT_ALIGN bytes, aligned */
    size_t carry_bytes;
} rows_file;

static em_status write_run(void *context, void *item, em_error *err)
{
    rows_file *file = context;
    const run_out *run = item;
    if (!file->direct)
        return em_save_write(file->fd, run->data, run->bytes, EM_SAVE_ROWS_WRITE, file->path,
                             err);
    memcpy(run->data, file->carry, run->lead); /* run->lead == file->carry_bytes */
    size_t total = run->lead + run->bytes, whole = total & ~(EM_SAVE_DIRECT_ALIGN - 1);
    em_status status = whole == 0 ? EM_OK
                                  : em_save_write(file->fd, run->data, whole,
                                                  EM_SAVE_ROWS_WRITE, file->path, err);
    file->carry_bytes = total - whole;
    memcpy(file->carry, run->data + whole, file->carry_bytes);
    return status;
}

/* The bytes of rows.emb still in carry, once every run went out. */
static em_status write_carry(rows_file *file, em_error *err)
{
    if (!file->direct || file->carry_bytes == 0)
        return EM_OK;
    file->direct = false;
    return em_save_write_buffered(file->fd, file->carry, file->carry_bytes, EM_SAVE_ROWS_WRITE,
                                  file->path, err);
}

typedef struct save {
    em_table *table;
    const em_checkpoint_options *options;
    uint32_t row_floats;
    size_t row_bytes;        /* key and floats (and access metadata) */
    bool access;             /* the table tracks access: rows carry their metadata */
    em_table_clocks clocks;  /* with access: the table's clocks at the snapshot */
    uint64_t buffer_rows;
    uint64_t *keys;          /* staging, buffer_rows each */
    float *values;
    em_row_access *row_access; /* with access */
    uint8_t *admission;      /* counter admission: the sketch at the snapshot */
    uint64_t admission_bytes;
    uint64_t *evicted;       /* with access: the evicted-key ring at the snapshot */
    uint64_t evicted_total, evicted_count;
    run_out runs[2];         /* output buffers: chunks of one run each, aligned for
                              * direct writes, with room for a lead (rows_file) */
    unsigned char *carry;    /* rows_file's */
    unsigned char *out;      /* the one being filled (runs[filling].data) */
    int filling;
    size_t out_capacity;
    rows_file file;
    em__pipe writer;
    em__pipe digester;        /* a full save that tracks: digests the staging buffer */
    uint64_t digest_rows;     /* the digester's item: rows of staging to digest */
    uint64_t staged;
    int fd;
    char tmp_dir[4096], rows_path[4200];
    uint64_t file_bytes;
    XXH3_state_t *file_hash; /* rows.emb's checksum (em_rows_digest_add) */
    em_index_entry *index;
    uint64_t chunks, index_capacity;
    uint64_t rows;            /* written */
    uint64_t table_rows;      /* in the snapshot */
    bool delta;               /* only what changed since parent */
    const em__delta_base *parent;
    em__delta_base *next;     /* this save, for the table's next save (not detached) */
    bool tracking;            /* next gets the digests of the rows as saved */
    uint64_t changes;         /* em_table_changes before the snapshot */
    uint64_t *tombstones;     /* a delta's: the parent's keys no longer in the table */
    uint64_t tombstone_count;
    bool unchanged;           /* skip_unchanged: nothing written, the parent holds it all */
} save;

/* Groups the staged rows by bucket into chunks and writes them. */
static em_status flush_run(save *s, em_error *err)
{
    if (s->staged == 0)
        return EM_OK;
    uint32_t *count = calloc(EM_CHECKPOINT_BUCKETS, sizeof(uint32_t));
    uint32_t *placed = calloc(EM_CHECKPOINT_BUCKETS, sizeof(uint32_t));
    uint64_t *chunk_at = calloc(EM_CHECKPOINT_BUCKETS, sizeof(uint64_t));
    em_status status = EM_OK;
    if (count == NULL || placed == NULL || chunk_at == NULL)
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "save: out of host memory");
    for (uint64_t i = 0; status == EM_OK && i < s->staged; i++)
        count[em__checkpoint_bucket(s->keys[i])]++;
    uint64_t used = 0, chunks = 0;
    for (uint32_t b = 0; status == EM_OK && b < EM_CHECKPOINT_BUCKETS; b++) {
        chunk_at[b] = used;
        if (count[b] > 0) {
            used += sizeof(em_chunk_header) + count[b] * s->row_bytes;
            chunks++;
        }
    }
    if (status == EM_OK && s->chunks + chunks > s->index_capacity) {
        uint64_t capacity = s->index_capacity < 4096 ? 4096 : s->index_capacity;
        while (capacity < s->chunks + chunks)
            capacity *= 2;
        em_index_entry *index = realloc(s->index, capacity * sizeof(*index));
        if (index == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "save: out of host memory");
        else {
            s->index = index;
            s->index_capacity = capacity;
        }
    }
    /* rows into place: keys after the header, values after the keys, then the access
     * metadata; the run's chunks start after its lead (rows_file) */
    size_t lead = s->file.direct ? (size_t)(s->file_bytes % EM_SAVE_DIRECT_ALIGN) : 0;
    unsigned char *out = s->out + lead;
    for (uint64_t i = 0; status == EM_OK && i < s->staged; i++) {
        uint32_t b = em__checkpoint_bucket(s->keys[i]);
        unsigned char *chunk = out + chunk_at[b];
        unsigned char *keys = chunk + sizeof(em_chunk_header);
        unsigned char *values = keys + (size_t)count[b] * sizeof(uint64_t);
        memcpy(keys + (size_t)placed[b] * sizeof(uint64_t), &s->keys[i], sizeof(uint64_t));
        memcpy(values + (size_t)placed[b] * s->row_floats * sizeof(float),
               s->values + i * s->row_floats, s->row_floats * sizeof(float));
        if (s->access)
            memcpy(values + (size_t)count[b] * s->row_floats * sizeof(float) +
                       (size_t)placed[b] * sizeof(em_row_access),
                   &s->row_access[i], sizeof(em_row_access));
        placed[b]++;
    }
    for (uint32_t b = 0; status == EM_OK && b < EM_CHECKPOINT_BUCKETS; b++) {
        if (count[b] == 0)
            continue;
        em_chunk_header header = {.version = EM_CHECKPOINT_FORMAT_VERSION,
                                  .bucket = b,
                                  .rows = count[b],
                                  .row_floats = s->row_floats,
                                  .payload_bytes = (uint64_t)count[b] * s->row_bytes};
        memcpy(header.magic, EM_CHUNK_MAGIC, 8);
        unsigned char *chunk = out + chunk_at[b];
        header.payload_xxh3 = XXH3_64bits(chunk + sizeof(header), header.payload_bytes);
        header.header_xxh3 = XXH3_64bits(&header, offsetof(em_chunk_header, header_xxh3));
        memcpy(chunk, &header, sizeof(header));
        em_rows_digest_add(s->file_hash, &header); /* chunks go out in this order */
        s->index[s->chunks++] = (em_index_entry){.bucket = b,
                                                 .rows = count[b],
                                                 .offset = s->file_bytes + chunk_at[b],
                                                 .payload_xxh3 = header.payload_xxh3};
    }
    if (status == EM_OK) {
        s->runs[s->filling].lead = lead;
        s->runs[s->filling].bytes = used;
        status = em__pipe_put(&s->writer, &s->runs[s->filling], err);
    }
    if (status == EM_OK) {
        s->filling = 1 - s->filling;
        s->out = s->runs[s->filling].data;
        s->file_bytes += used;
        s->rows += s->staged;
        s->staged = 0;
    }
    free(count);
    free(placed);
    free(chunk_at);
    return status;
}

/* Digests the count rows of staging from first into s->next's digests (when tracking)
 * and keeps, for a delta, only those that changed since the parent (values, state or
 * access metadata); *kept of them stay, in order. */
static em_status digest_staged(save *s, uint64_t first, uint64_t count, uint64_t *kept,
                               em_error *err)
{
    *kept = count;
    if (!s->tracking)
        return EM_OK;
    uint32_t floats = s->row_floats;
    uint64_t *keys = s->keys + first;
    float *values = s->values + first * floats;
    uint64_t out = 0;
    for (uint64_t i = 0; i < count; i++) {
        if (i + EM__KEY_PREFETCH < count) { /* keys[] before i move down only: ahead stays */
            em__key_map_prefetch(&s->next->digests, keys[i + EM__KEY_PREFETCH]);
            if (s->delta)
                em__key_map_prefetch(&s->parent->digests, keys[i + EM__KEY_PREFETCH]);
        }
        const em_row_access *access = s->access ? &s->row_access[first + i] : NULL;
        uint64_t digest = em__row_digest(values + i * floats, floats, access), before = 0;
        if (!em__key_map_put(&s->next->digests, keys[i], digest))
            return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                "out of host memory for the row digests of %" PRIu64 " rows",
                                s->next->digests.used);
        if (s->delta && em__key_map_get(&s->parent->digests, keys[i], &before) &&
            before == digest)
            continue; /* unchanged since the parent */
        if (out != i) {
            keys[out] = keys[i];
            memcpy(values + out * floats, values + i * floats, floats * sizeof(float));
            if (s->access)
                s->row_access[first + out] = s->row_access[first + i];
        }
        out++;
    }
    *kept = out;
    return EM_OK;
}

/* The digester's work: the rows of a full staging buffer (a full save keeps them all). */
static em_status digest_run(void *context, void *item, em_error *err)
{
    save *s = context;
    uint64_t kept;
    return digest_staged(s, 0, *(const uint64_t *)item, &kept, err);
}

int em__checkpoint_key_order(uint64_t x, uint64_t y)
{
    uint32_t bx = em__checkpoint_bucket(x), by = em__checkpoint_bucket(y);
    if (bx != by)
        return bx < by ? -1 : 1;
    return x < y ? -1 : x > y;
}

static int compare_tombstones(const void *a, const void *b)
{
    return em__checkpoint_key_order(*(const uint64_t *)a, *(const uint64_t *)b);
}

/* A delta's tombstones: the parent's keys that the snapshot no longer has, ordered by
 * bucket then key. */
static em_status collect_tombstones(save *s, em_error *err)
{
    const em__key_map *before = &s->parent->digests, *now = &s->next->digests;
    uint64_t capacity = before->used, digest;
    s->tombstones = malloc((capacity + 1) * sizeof(uint64_t));
    if (s->tombstones == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory for tombstones");
    for (uint64_t slot = 0; slot < before->slots; slot++) {
        if (slot + EM__KEY_PREFETCH < before->slots &&
            before->slot[slot + EM__KEY_PREFETCH].key != EM__KEY_MAP_EMPTY)
            em__key_map_prefetch(now, before->slot[slot + EM__KEY_PREFETCH].key);
        uint64_t key = before->slot[slot].key;
        if (key != EM__KEY_MAP_EMPTY && !em__key_map_get(now, key, &digest))
            s->tombstones[s->tombstone_count++] = key;
    }
    if (before->has_empty_key && !em__key_map_get(now, UINT64_MAX, &digest))
        s->tombstones[s->tombstone_count++] = UINT64_MAX;
    qsort(s->tombstones, s->tombstone_count, sizeof(uint64_t), compare_tombstones);
    return EM_OK;
}

/* Reads the whole snapshot through the staging buffer into rows.emb. */
static em_status write_rows(save *s, em_error *err)
{
    em_table_snapshot *snapshot = NULL;
    /* the admission sketch just before the snapshot: copying it takes the table's
     * exclusive lock, which must not wait on a push that waits for the snapshot reader */
    if (s->admission_bytes > 0)
        em_table_get_admission(s->table, s->admission);
    em_status status =
        em_table_snapshot_begin(s->table, s->options->copy_limit_bytes, &snapshot, err);
    if (status == EM_OK && s->access)
        em_table_get_clocks(s->table, &s->clocks);
    if (status == EM_OK && s->access) /* for evicted.emb */
        s->evicted = em_table_snapshot_take_evicted(snapshot, &s->evicted_total,
                                                    &s->evicted_count);
    if (status == EM_OK && s->tracking &&
        !em__key_map_init(&s->next->digests, em_table_snapshot_rows(snapshot)))
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED,
                              "out of host memory for the row digests of %" PRIu64 " rows",
                              em_table_snapshot_rows(snapshot));
    int flags = fcntl(s->fd, F_GETFL);
    s->file = (rows_file){.fd = s->fd, .path = s->rows_path,
                          .direct = flags != -1 && (flags & O_DIRECT) != 0,
                          .carry = s->carry};
    if (status == EM_OK)
        status = em__pipe_start(&s->writer, write_run, &s->file, err);
    /* a full save's digests beside the grouping (a delta's decide what it groups) */
    bool digest_aside = s->tracking && !s->delta;
    if (status == EM_OK && digest_aside)
        status = em__pipe_start(&s->digester, digest_run, s, err);
    const em_checkpoint_options *o = s->options;
    uint64_t total = status == EM_OK ? em_table_snapshot_rows(snapshot) : 0;
    if (status == EM_OK && o->progress != NULL)
        o->progress(o->progress_context, 0, total);
    uint64_t stall_ms = 0; /* a test's: the save holds its snapshot a while */
    if (status == EM_OK && em_failpoint_hit(EM_FAILPOINT_CHECKPOINT_STALL, &stall_ms))
        usleep((useconds_t)(stall_ms * 1000u));
    uint64_t count = 1;
    while (status == EM_OK && count > 0) {
        status = em_table_snapshot_read(snapshot, s->buffer_rows - s->staged,
                                        s->keys + s->staged,
                                        s->values + s->staged * s->row_floats,
                                        s->access ? s->row_access + s->staged : NULL, &count,
                                        err);
        s->table_rows += count;
        uint64_t kept = count;
        if (status == EM_OK && !digest_aside)
            status = digest_staged(s, s->staged, count, &kept, err);
        s->staged += kept;
        if (status == EM_OK && (s->staged == s->buffer_rows || count == 0)) {
            if (digest_aside && s->staged > 0) {
                s->digest_rows = s->staged;
                status = em__pipe_put(&s->digester, &s->digest_rows, err);
            }
            if (status == EM_OK)
                status = flush_run(s, err);
            /* both read staging; the next snapshot read writes it */
            em_error digested;
            em_status digesting = digest_aside ? em__pipe_wait(&s->digester, &digested) : EM_OK;
            if (status == EM_OK && digesting != EM_OK) {
                status = digesting;
                em_error_copy(err, &digested);
            }
            if (status == EM_OK && o->progress != NULL)
                o->progress(o->progress_context, s->table_rows, total);
        }
    }
    em_error ignored; /* every item handed to the digester was waited for above */
    (void)em__pipe_finish(&s->digester, &ignored);
    em_error written;
    em_status writing = em__pipe_finish(&s->writer, &written);
    if (status == EM_OK && writing != EM_OK) {
        status = writing;
        em_error_copy(err, &written);
    }
    if (status == EM_OK)
        status = write_carry(&s->file, err);
    em_table_snapshot_end(snapshot);
    if (status == EM_OK && s->delta)
        status = collect_tombstones(s, err);
    return status;
}

/* ---- files ---------------------------------------------------------------------------- */

static em_status write_file(const char *path, const void *data, size_t bytes,
                            em_save_step write_step, em_error *err)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return em_error_set(err, EM_INTERNAL, "%s (step %d) failed for %s: %s",
                            em_save_step_name(write_step), (int)write_step, path,
                            strerror(errno));
    em_status status = em_save_write(fd, data, bytes, write_step, path, err);
    if (status == EM_OK) /* the fsync step follows its write step */
        status = em_save_fsync(fd, (em_save_step)(write_step + 1), path, err);
    close(fd);
    return status;
}

/* A file of header, items, and the XXH3-64 of every byte before it (index.emb,
 * tombstones.emb), written and fsynced: write_step and the step after it. */
static em_status write_listing(save *s, const char *name, const void *header,
                               size_t header_bytes, const void *items, size_t items_bytes,
                               em_save_step write_step, uint64_t *bytes, uint64_t *checksum,
                               em_error *err)
{
    size_t size = header_bytes + items_bytes + sizeof(uint64_t);
    unsigned char *data = malloc(size);
    if (data == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "save: out of host memory");
    memcpy(data, header, header_bytes);
    if (items_bytes > 0) /* an empty list has no array */
        memcpy(data + header_bytes, items, items_bytes);
    uint64_t trailer = XXH3_64bits(data, size - sizeof(uint64_t));
    memcpy(data + size - sizeof(uint64_t), &trailer, sizeof(trailer));
    *bytes = size;
    *checksum = XXH3_64bits(data, size);
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", s->tmp_dir, name);
    em_status status = write_file(path, data, size, write_step, err);
    free(data);
    return status;
}

static em_status write_index(save *s, uint64_t *bytes, uint64_t *checksum, em_error *err)
{
    em_index_header header = {.version = EM_CHECKPOINT_FORMAT_VERSION,
                              .buckets = EM_CHECKPOINT_BUCKETS,
                              .chunks = s->chunks};
    memcpy(header.magic, EM_INDEX_MAGIC, 8);
    return write_listing(s, "index.emb", &header, sizeof(header), s->index,
                         s->chunks * sizeof(em_index_entry), EM_SAVE_INDEX_WRITE, bytes,
                         checksum, err);
}

static em_status write_tombstones(save *s, uint64_t *bytes, uint64_t *checksum, em_error *err)
{
    em_tombstones_header header = {.version = EM_CHECKPOINT_FORMAT_VERSION,
                                   .buckets = EM_CHECKPOINT_BUCKETS,
                                   .count = s->tombstone_count};
    memcpy(header.magic, EM_TOMBSTONES_MAGIC, 8);
    return write_listing(s, "tombstones.emb", &header, sizeof(header), s->tombstones,
                         s->tombstone_count * sizeof(uint64_t), EM_SAVE_TOMBSTONES_WRITE, bytes,
                         checksum, err);
}

/* Counter admission's sketch, as of the snapshot: admission.emb. */
static em_status write_admission(save *s, uint64_t *bytes, uint64_t *checksum, em_error *err)
{
    em_admission_header header = {
        .version = EM_CHECKPOINT_FORMAT_VERSION,
        .threshold = em_table_get_config(s->table)->admission.threshold,
        .counters = s->admission_bytes,
    };
    memcpy(header.magic, EM_ADMISSION_MAGIC, 8);
    return write_listing(s, "admission.emb", &header, sizeof(header), s->admission,
                         s->admission_bytes, EM_SAVE_TOMBSTONES_WRITE, bytes, checksum, err);
}

/* The evicted-key ring, as of the snapshot: evicted.emb. */
static em_status write_evicted(save *s, uint64_t *bytes, uint64_t *checksum, em_error *err)
{
    em_evicted_header header = {
        .version = EM_CHECKPOINT_FORMAT_VERSION,
        .ring = em_table_get_config(s->table)->eviction.ring,
        .total = s->evicted_total,
        .count = s->evicted_count,
    };
    memcpy(header.magic, EM_EVICTED_MAGIC, 8);
    return write_listing(s, "evicted.emb", &header, sizeof(header), s->evicted,
                         s->evicted_count * sizeof(uint64_t), EM_SAVE_TOMBSTONES_WRITE, bytes,
                         checksum, err);
}

static void add_file(cJSON *files, const char *name, uint64_t bytes, uint64_t checksum)
{
    char hex[17];
    snprintf(hex, sizeof(hex), "%016" PRIx64, checksum);
    cJSON *file = cJSON_CreateObject();
    cJSON_AddStringToObject(file, "name", name);
    cJSON_AddNumberToObject(file, "bytes", (double)bytes);
    cJSON_AddStringToObject(file, "xxh3", hex);
    cJSON_AddItemToArray(files, file);
}

typedef struct file_sums {
    uint64_t index_bytes, index_xxh3, tombstones_bytes, tombstones_xxh3;
    uint64_t admission_bytes, admission_xxh3, evicted_bytes, evicted_xxh3;
    uint64_t manifest_xxh3; /* out: its checksum line */
} file_sums;

static void add_hex(cJSON *object, const char *name, uint64_t value)
{
    char hex[17];
    snprintf(hex, sizeof(hex), "%016" PRIx64, value);
    cJSON_AddStringToObject(object, name, hex);
}

/* The table's clocks as of the snapshot: "clocks": {access, update, sample_spacing_ms,
 * samples: [[unix_ms, push clock], ...]}. */
static void add_clocks(cJSON *manifest, const em_table_clocks *clocks)
{
    cJSON *object = cJSON_AddObjectToObject(manifest, "clocks");
    cJSON_AddNumberToObject(object, "access", (double)clocks->access_clock);
    cJSON_AddNumberToObject(object, "update", (double)clocks->update_clock);
    cJSON_AddNumberToObject(object, "sample_spacing_ms", (double)clocks->sample_spacing_ms);
    cJSON *samples = cJSON_AddArrayToObject(object, "samples");
    for (uint32_t i = 0; samples != NULL && i < clocks->samples; i++) {
        cJSON *pair = cJSON_CreateArray();
        cJSON_AddItemToArray(pair, cJSON_CreateNumber((double)clocks->sample_ms[i]));
        cJSON_AddItemToArray(pair, cJSON_CreateNumber((double)clocks->sample_clock[i]));
        cJSON_AddItemToArray(samples, pair);
    }
}

static em_status write_manifest(save *s, const em_checkpoint_info *info, file_sums *sums,
                                em_error *err)
{
    cJSON *manifest = cJSON_CreateObject();
    cJSON_AddStringToObject(manifest, "format", "ember-checkpoint");
    cJSON_AddNumberToObject(manifest, "version", EM_CHECKPOINT_FORMAT_VERSION);
    cJSON_AddStringToObject(manifest, "ember_version", EM_VERSION);
    cJSON_AddStringToObject(manifest, "id", info->id);
    cJSON_AddStringToObject(manifest, "kind", s->delta ? "delta" : "full");
    if (s->delta) {
        cJSON *parent = cJSON_AddObjectToObject(manifest, "parent");
        cJSON_AddStringToObject(parent, "id", s->parent->id);
        add_hex(parent, "manifest_xxh3", s->parent->manifest_xxh3);
        cJSON_AddStringToObject(manifest, "base", s->parent->base_id);
    } else {
        cJSON_AddNullToObject(manifest, "parent");
        cJSON_AddStringToObject(manifest, "base", info->id);
    }
    cJSON_AddNumberToObject(manifest, "depth", info->depth);
    cJSON_AddNumberToObject(manifest, "created_unix_ms", (double)info->created_unix_ms);
    cJSON_AddItemToObject(manifest, "table", em_table_config_to_json(em_table_get_config(s->table)));
    cJSON_AddNumberToObject(manifest, "row_floats", s->row_floats);
    cJSON_AddNumberToObject(manifest, "rows", (double)s->rows);
    cJSON_AddNumberToObject(manifest, "tombstones", (double)s->tombstone_count);
    cJSON_AddNumberToObject(manifest, "table_rows", (double)s->table_rows);
    cJSON_AddStringToObject(manifest, "key_hash", "splitmix64 finalizer (Mix13)");
    cJSON_AddNumberToObject(manifest, "buckets", EM_CHECKPOINT_BUCKETS);
    cJSON_AddStringToObject(manifest, "bucket_of_key", "key_hash(key) >> 52");
    cJSON_AddNumberToObject(manifest, "chunks", (double)s->chunks);
    cJSON_AddBoolToObject(manifest, "access", s->access);
    if (s->access)
        add_clocks(manifest, &s->clocks);
    cJSON *files = cJSON_AddArrayToObject(manifest, "files");
    add_file(files, "rows.emb", s->file_bytes, XXH3_64bits_digest(s->file_hash));
    add_file(files, "index.emb", sums->index_bytes, sums->index_xxh3);
    add_file(files, "tombstones.emb", sums->tombstones_bytes, sums->tombstones_xxh3);
    if (s->admission_bytes > 0)
        add_file(files, "admission.emb", sums->admission_bytes, sums->admission_xxh3);
    if (s->access)
        add_file(files, "evicted.emb", sums->evicted_bytes, sums->evicted_xxh3);
    char *text = cJSON_Print(manifest);
    cJSON_Delete(manifest);
    if (text == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "save: out of host memory");
    size_t length = strlen(text);
    char *full = malloc(length + 32);
    em_status status = EM_OK;
    if (full == NULL)
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "save: out of host memory");
    else {
        memcpy(full, text, length);
        full[length++] = '\n';
        sums->manifest_xxh3 = XXH3_64bits(full, length);
        length += (size_t)snprintf(full + length, 32, "xxh3 %016" PRIx64 "\n",
                                   sums->manifest_xxh3);
        char path[4200];
        snprintf(path, sizeof(path), "%s/manifest.json", s->tmp_dir);
        status = write_file(path, full, length, EM_SAVE_MANIFEST_WRITE, err);
    }
    free(full);
    cJSON_free(text);
    return status;
}

/* ---- directories ------------------------------------------------------------------------- */

static em_status make_dir(const char *path, em_error *err)
{
    if (mkdir(path, 0755) == 0 || errno == EEXIST)
        return EM_OK;
    return em_error_set(err, EM_INTERNAL, "cannot create directory %s: %s", path,
                        strerror(errno));
}

/* The next id: one more than any checkpoint (complete, unfinished or being removed) of
 * the table. */
static uint64_t next_id(const char *table_dir)
{
    uint64_t next = 1;
    DIR *d = opendir(table_dir);
    if (d == NULL)
        return next;
    struct dirent *entry;
    while ((entry = readdir(d)) != NULL) {
        const char *name = entry->d_name;
        if (strncmp(name, ".tmp-", 5) == 0 || strncmp(name, EM__CHECKPOINT_OLD, 5) == 0)
            name += 5; /* a save that never finished, or one being removed */
        if (em__checkpoint_is_id(name)) {
            uint64_t id = strtoull(name, NULL, 10);
            next = id + 1 > next ? id + 1 : next;
        }
    }
    closedir(d);
    return next;
}

/* LATEST.tmp, fsynced, renamed over LATEST, the directory fsynced. */
static em_status publish_latest(const char *table_dir, const char *id, em_error *err)
{
    char tmp[4200], latest[4200], line[EM_CHECKPOINT_ID_DIGITS + 2];
    snprintf(tmp, sizeof(tmp), "%s/LATEST.tmp", table_dir);
    snprintf(latest, sizeof(latest), "%s/LATEST", table_dir);
    int length = snprintf(line, sizeof(line), "%s\n", id);
    em_status status = write_file(tmp, line, (size_t)length, EM_SAVE_LATEST_WRITE, err);
    if (status == EM_OK)
        status = em_save_rename(tmp, latest, EM_SAVE_LATEST_RENAME, err);
    if (status == EM_OK)
        status = em_save_fsync_dir(table_dir, EM_SAVE_LATEST_DIR_FSYNC, err);
    return status;
}

/* ---- save --------------------------------------------------------------------------------- */

void em__delta_base_free(void *data)
{
    em__delta_base *base = data;
    if (base == NULL)
        return;
    em__key_map_free(&base->digests);
    free(base);
}

/* Whether the checkpoint base describes is still the latest of the table under dir
 * (no other save replaced it since). */
static bool base_is_latest(const em__delta_base *base, em_table *table, const char *dir)
{
    char latest[4200];
    em__chain_link link;
    em_error ignored;
    return em_checkpoint_latest(dir, em_table_name(table), latest, sizeof(latest), &ignored) ==
               EM_OK &&
           strcmp(latest, base->path) == 0 &&
           em__checkpoint_read_link(latest, &link, &ignored) == EM_OK &&
           link.manifest_xxh3 == base->manifest_xxh3;
}

/* The table's digests when they describe the latest checkpoint under dir, unchanged
 * since: then this save can be a delta of it. */
static const em__delta_base *delta_parent(em_table *table, const em_checkpoint_options *options,
                                          uint32_t row_floats)
{
    const em__delta_base *base = em_table_attachment(table);
    if (base == NULL || !base->tracked || base->row_floats != row_floats ||
        (options->max_depth > 0 && base->depth >= options->max_depth) ||
        !base_is_latest(base, table, options->dir))
        return NULL;
    return base;
}

/* Whether the latest checkpoint of the table under dir still holds it: it was saved
 * from the table or loaded into it, and no call that may change the table has run
 * since (em_table_changed_since). */
static const em__delta_base *holding_checkpoint(em_table *table, const char *dir)
{
    const em__delta_base *base = em_table_attachment(table);
    if (base == NULL || !base->holds_table || em_table_changed_since(table, base->changes) ||
        !base_is_latest(base, table, dir))
        return NULL;
    return base;
}

/* Whether the delta just read changes nothing its parent holds (skip_unchanged): no
 * row and no tombstone, and nothing beside the rows that a manifest carries and may have
 * moved: the clocks of a table that tracks access are the parent's, and there is no
 * admission sketch (which sightings change without changing a row). */
static bool delta_changes_nothing(const save *s)
{
    if (!s->delta || !s->options->skip_unchanged || s->rows > 0 || s->tombstone_count > 0 ||
        s->admission_bytes > 0)
        return false;
    if (!s->access)
        return true;
    const em_table_clocks *a = &s->clocks, *b = &s->parent->clocks;
    if (!s->parent->clocks_known || a->access_clock != b->access_clock ||
        a->update_clock != b->update_clock || a->sample_spacing_ms != b->sample_spacing_ms ||
        a->samples != b->samples)
        return false;
    for (uint32_t i = 0; i < a->samples; i++)
        if (a->sample_ms[i] != b->sample_ms[i] || a->sample_clock[i] != b->sample_clock[i])
            return false;
    return true;
}

/* What a save that wrote nothing answers: the checkpoint that still holds the table. */
static void describe_holder(const em__delta_base *holder, uint64_t table_rows,
                            em_checkpoint_info *info)
{
    info->unchanged = true;
    snprintf(info->id, sizeof(info->id), "%s", holder->id);
    snprintf(info->path, sizeof(info->path), "%s", holder->path);
    snprintf(info->kind, sizeof(info->kind), "%s", holder->depth == 0 ? "full" : "delta");
    info->parent[0] = '\0';
    info->depth = holder->depth;
    info->manifest_xxh3 = holder->manifest_xxh3;
    info->table_rows = table_rows;
}

static em_status save_files(save *s, const char *table_dir, em_checkpoint_info *info,
                            em_error *err)
{
    em_status status = make_dir(s->tmp_dir, err);
    if (status != EM_OK)
        return status;
    s->fd = open(s->rows_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
    if (s->fd < 0 && errno == EINVAL) /* a file system without direct I/O (tmpfs) */
        s->fd = open(s->rows_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (s->fd < 0)
        return em_error_set(err, EM_INTERNAL, "cannot create %s: %s", s->rows_path,
                            strerror(errno));
    status = write_rows(s, err);
    s->unchanged = status == EM_OK && delta_changes_nothing(s);
    if (s->unchanged) {
        close(s->fd);
        em__checkpoint_remove_dir(s->tmp_dir);
        describe_holder(s->parent, s->table_rows, info);
        return EM_OK;
    }
    if (status == EM_OK)
        status = em_save_fsync(s->fd, EM_SAVE_ROWS_FSYNC, s->rows_path, err);
    close(s->fd);
    file_sums sums = {0};
    if (status == EM_OK)
        status = write_index(s, &sums.index_bytes, &sums.index_xxh3, err);
    if (status == EM_OK)
        status = write_tombstones(s, &sums.tombstones_bytes, &sums.tombstones_xxh3, err);
    if (status == EM_OK && s->admission_bytes > 0)
        status = write_admission(s, &sums.admission_bytes, &sums.admission_xxh3, err);
    if (status == EM_OK && s->access)
        status = write_evicted(s, &sums.evicted_bytes, &sums.evicted_xxh3, err);
    if (status == EM_OK)
        status = write_manifest(s, info, &sums, err);
    if (status == EM_OK)
        status = em_save_fsync_dir(s->tmp_dir, EM_SAVE_DIR_FSYNC, err);
    if (status == EM_OK)
        status = em_save_rename(s->tmp_dir, info->path, EM_SAVE_RENAME, err);
    if (status == EM_OK)
        status = em_save_fsync_dir(table_dir, EM_SAVE_TABLE_DIR_FSYNC, err);
    if (status == EM_OK)
        status = publish_latest(table_dir, info->id, err);
    info->bytes = s->file_bytes + sums.index_bytes + sums.tombstones_bytes +
                  sums.admission_bytes + sums.evicted_bytes;
    info->manifest_xxh3 = sums.manifest_xxh3;
    info->rows = s->rows;
    info->tombstones = s->tombstone_count;
    info->table_rows = s->table_rows;
    info->chunks = s->chunks;
    if (s->next != NULL) {
        snprintf(s->next->path, sizeof(s->next->path), "%s", info->path);
        snprintf(s->next->id, sizeof(s->next->id), "%s", info->id);
        snprintf(s->next->base_id, sizeof(s->next->base_id), "%s",
                 s->delta ? s->parent->base_id : info->id);
        s->next->depth = info->depth;
        s->next->manifest_xxh3 = sums.manifest_xxh3;
        s->next->row_floats = s->row_floats;
        s->next->tracked = s->tracking;
        s->next->holds_table = true;
        s->next->changes = s->changes;
        s->next->clocks_known = s->access;
        s->next->clocks = s->clocks;
    }
    return status;
}

static uint64_t unix_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u;
}

static double monotonic_seconds(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec / 1e9;
}

/* Takes the save lock of the table whose directory is table_dir (<table_dir>/.lock, one
 * save of a table at a time, across processes too), waiting for its holder when wait;
 * *fd gets the descriptor that holds it (closing it lets go). create: make the lock
 * file if missing; without it, a missing file leaves *fd at -1 and is no error (the
 * table was never saved). Errors, prefixed "<what> of table '<table>': ":
 * FAILED_PRECONDITION when another save holds it and !wait (*busy set), INTERNAL naming
 * the file. */
static em_status take_save_lock(const char *table_dir, const char *table, const char *what,
                                bool create, bool wait, int *fd, bool *busy, em_error *err)
{
    char lock_path[4200];
    snprintf(lock_path, sizeof(lock_path), "%s/.lock", table_dir);
    *fd = open(lock_path, O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0), 0644);
    if (*fd < 0 && !create && errno == ENOENT)
        return EM_OK;
    if (*fd < 0)
        return em_error_set(err, EM_INTERNAL, "%s of table '%s': cannot open %s: %s", what,
                            table, lock_path, strerror(errno));
    int locked;
    while ((locked = flock(*fd, wait ? LOCK_EX : LOCK_EX | LOCK_NB)) != 0 && errno == EINTR)
        ;
    if (locked == 0)
        return EM_OK;
    int error = errno;
    close(*fd);
    *fd = -1;
    *busy = error == EWOULDBLOCK;
    return error == EWOULDBLOCK
               ? em_error_set(err, EM_FAILED_PRECONDITION,
                              "%s of table '%s': another save of it is running", what, table)
               : em_error_set(err, EM_INTERNAL, "%s of table '%s': cannot lock %s: %s", what,
                              table, lock_path, strerror(error));
}

em_status em_checkpoint_drop_table(const char *dir, const char *table,
                                   em_status (*drop)(void *context, em_error *err),
                                   void *context, char *aside, size_t size, em_error *err)
{
    aside[0] = '\0';
    char table_dir[4096];
    if ((size_t)snprintf(table_dir, sizeof(table_dir), "%s/%s", dir, table) >=
        sizeof(table_dir) - 64)
        return drop(context, err); /* longer than any save makes: never saved */
    /* a save of the table that is running ends first */
    int lock_fd = -1;
    bool busy = false;
    em_status status = take_save_lock(table_dir, table, "drop", false, true, &lock_fd, &busy, err);
    if (status != EM_OK)
        return status;
    if (lock_fd < 0) /* never saved: nothing to set aside */
        return drop(context, err);
    status = drop(context, err);
    if (status == EM_OK) {
        char path[4200];
        snprintf(path, sizeof(path), "%s/.dropped-%s-%" PRIu64, dir, table, unix_ms());
        int dir_fd = -1;
        if (rename(table_dir, path) != 0)
            status = em_error_set(err, EM_INTERNAL,
                                  "table '%s' was dropped, but its checkpoints stay where a "
                                  "restart restores them (move them aside by hand): rename of "
                                  "%s to %s failed: %s", table, table_dir, path, strerror(errno));
        else if ((dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0 ||
                 fsync(dir_fd) != 0)
            status = em_error_set(err, EM_INTERNAL,
                                  "table '%s' was dropped and its checkpoints moved to %s, but "
                                  "fsync of %s failed (a crash may undo the move): %s", table,
                                  path, dir, strerror(errno));
        if (dir_fd >= 0)
            close(dir_fd);
        if (status == EM_OK)
            snprintf(aside, size, "%s", path);
    }
    close(lock_fd); /* and the lock with it */
    return status;
}

static em_status dropped_error(const char *name, em_error *err)
{
    return em_error_set(err, EM_FAILED_PRECONDITION,
                        "save of table '%s': the table was dropped or replaced", name);
}

em_status em_checkpoint_save(em_table *table, const em_checkpoint_options *options,
                             em_checkpoint_info *info, em_error *err)
{
    double start = monotonic_seconds();
    const char *name = em_table_name(table);
    memset(info, 0, sizeof(*info));
    snprintf(info->table, sizeof(info->table), "%s", name);
    char table_dir[4096];
    if ((size_t)snprintf(table_dir, sizeof(table_dir), "%s/%s", options->dir, name) >=
        sizeof(table_dir) - 64)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "save of table '%s': checkpoint dir '%.256s' is too long (at most "
                            "%zu characters with the table name)",
                            name, options->dir, sizeof(table_dir) - 64);
    if (em_table_dropped(table)) /* its checkpoints may be set aside already */
        return dropped_error(name, err);
    em_status status = make_dir(options->dir, err);
    if (status == EM_OK)
        status = make_dir(table_dir, err);
    if (status != EM_OK)
        return em_error_prefix(err, "save of table '%s': ", name);
    /* what earlier saves pruned is gone before this one writes: the disk never holds
     * more than when saves removed it before answering */
    em_checkpoint_removals_wait(options->removals);

    int lock_fd = -1;
    status = take_save_lock(table_dir, name, "save", true, options->wait_for_lock, &lock_fd,
                            &info->busy, err);
    if (status != EM_OK)
        return status;
    /* dropped while this save waited: a drop sets the table's checkpoints aside holding
     * this lock, after marking it (daemon/handlers.c, DROP_TABLE) */
    if (em_table_dropped(table)) {
        close(lock_fd);
        return dropped_error(name, err);
    }
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    const em__delta_base *holder = options->skip_unchanged && !options->detached
                                       ? holding_checkpoint(table, options->dir)
                                       : NULL;
    if (holder != NULL) { /* nothing to write: that checkpoint is the table as it is */
        describe_holder(holder, stats.rows, info);
        close(lock_fd);
        info->seconds = monotonic_seconds() - start;
        return EM_OK;
    }
    save s = {.table = table, .options = options, .row_floats = stats.row_floats, .fd = -1};
    /* before the snapshot: every change counted is in it */
    s.changes = em_table_changes(table);
    s.access = em_eviction_tracks_access(&em_table_get_config(table)->eviction);
    s.row_bytes = sizeof(uint64_t) + s.row_floats * sizeof(float) +
                  (s.access ? sizeof(em_row_access) : 0);
    /* no larger than the table's rows need (a table of a few thousand rows took 128 MiB
     * of buffers for its saves), and 1 MiB at least */
    uint64_t buffer = options->buffer_bytes;
    if (stats.rows < buffer / s.row_bytes)
        buffer = (stats.rows + 1) * s.row_bytes;
    if (buffer < (UINT64_C(1) << 20))
        buffer = UINT64_C(1) << 20;
    s.buffer_rows = buffer / s.row_bytes + 1;
    s.out_capacity = s.buffer_rows * s.row_bytes + EM_CHECKPOINT_BUCKETS * sizeof(em_chunk_header);
    /* staging, mapped like the outputs: every buffer a save takes goes back to the system
     * when it ends */
    s.keys = em_io_buffer_alloc(s.buffer_rows * sizeof(uint64_t));
    s.values = em_io_buffer_alloc(s.buffer_rows * s.row_floats * sizeof(float));
    if (s.access)
        s.row_access = em_io_buffer_alloc(s.buffer_rows * sizeof(em_row_access));
    s.admission_bytes = em_table_admission_bytes(table);
    if (s.admission_bytes > 0)
        s.admission = malloc(s.admission_bytes);
    for (int k = 0; k < 2; k++) /* large pages: pinned for direct writes (checkpoint_io.h) */
        s.runs[k].data = em_io_buffer_alloc(s.out_capacity + EM_SAVE_DIRECT_ALIGN);
    if (posix_memalign((void **)&s.carry, EM_SAVE_DIRECT_ALIGN, EM_SAVE_DIRECT_ALIGN) != 0)
        s.carry = NULL;
    s.out = s.runs[0].data;
    s.file_hash = XXH3_createState();
    bool tracking = !options->detached && (options->delta || options->track_changes);
    if (options->delta && !options->detached)
        s.parent = delta_parent(table, options, s.row_floats);
    s.delta = s.parent != NULL;
    snprintf(info->kind, sizeof(info->kind), "%s", s.delta ? "delta" : "full");
    if (s.delta) {
        snprintf(info->parent, sizeof(info->parent), "%s", s.parent->id);
        info->depth = s.parent->depth + 1;
    }
    s.tracking = tracking;
    if (!options->detached)
        s.next = calloc(1, sizeof(*s.next));
    if (s.keys == NULL || s.values == NULL || s.runs[0].data == NULL || s.runs[1].data == NULL ||
        s.carry == NULL ||
        s.file_hash == NULL || (!options->detached && s.next == NULL) ||
        (s.access && s.row_access == NULL) || (s.admission_bytes > 0 && s.admission == NULL))
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory for buffers");
    else
        XXH3_64bits_reset(s.file_hash);

    info->created_unix_ms = unix_ms();
    snprintf(info->id, sizeof(info->id), "%0*" PRIu64, EM_CHECKPOINT_ID_DIGITS,
             next_id(table_dir));
    /* table_dir left room for these (checked above) */
    if (snprintf(info->path, sizeof(info->path), "%s/%s", table_dir, info->id) < 0 ||
        snprintf(s.tmp_dir, sizeof(s.tmp_dir), "%s/.tmp-%s", table_dir, info->id) < 0 ||
        snprintf(s.rows_path, sizeof(s.rows_path), "%s/rows.emb", s.tmp_dir) < 0)
        status = em_error_set(err, EM_INTERNAL, "checkpoint path");
    if (status == EM_OK)
        status = save_files(&s, table_dir, info, err);
    if (status != EM_OK) {
        em__checkpoint_remove_dir(s.tmp_dir);
        char latest_tmp[4200];
        if (snprintf(latest_tmp, sizeof(latest_tmp), "%s/LATEST.tmp", table_dir) > 0)
            unlink(latest_tmp);
        /* a directory renamed but never published is not a checkpoint */
        char current[4200];
        em_error ignored;
        if (em_checkpoint_latest(options->dir, name, current, sizeof(current), &ignored) !=
                EM_OK ||
            strcmp(current, info->path) != 0)
            em__checkpoint_remove_dir(info->path);
        em__delta_base_free(s.next);
    } else if (s.unchanged) { /* the parent stays the table's checkpoint and the base, */
        em__delta_base_free(s.next);
        /* holding the table as of this save's count of its changes */
        ((em__delta_base *)em_table_attachment(table))->changes = s.changes;
    } else {
        /* the table's rows are now written as this checkpoint: the next delta's parent */
        if (!options->detached)
            em_table_set_attachment(table, s.next, em__delta_base_free);
        em__checkpoint_prune(table_dir, options->dir, name,
                             options->keep == 0 ? 1 : options->keep, options->removals);
    }
    free(s.tombstones);
    em_io_buffer_free(s.keys);
    em_io_buffer_free(s.values);
    em_io_buffer_free(s.row_access);
    free(s.admission);
    free(s.evicted);
    em_io_buffer_free(s.runs[0].data);
    em_io_buffer_free(s.runs[1].data);
    free(s.carry);
    free(s.index);
    XXH3_freeState(s.file_hash);
    close(lock_fd); /* and the lock with it */
    info->seconds = monotonic_seconds() - start;
    if (status != EM_OK)
        return em_error_prefix(err, "save of table '%s': ", name);
    return EM_OK;
}
