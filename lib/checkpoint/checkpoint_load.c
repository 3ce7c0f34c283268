/*
 * DESIGN: reading a checkpoint: the manifest first (its own checksum, its format, the
 * table config), then index.emb whole, then rows.emb once from start to end, each chunk
 * checked against its header, the index and the manifest before its rows are used.
 * Verify and load are the same pass; load also imports each chunk into a new table.
 *
 * A delta is read with its chain: the manifests are followed from it through each
 * parent (a sibling directory named by the parent's id) back to a full checkpoint, each
 * link checked against what its child recorded (id, manifest checksum, depth, base),
 * and then the links are read newest first. A key is taken from the newest link that
 * has it, as a row or as a tombstone; older links' copies of it are skipped, so every
 * key is imported once and nothing needs erasing. Which link decided each key is kept
 * in a map while the chain loads (a key twice in one link is corruption).
 */
#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/keyhash.h"
#include "lib/base/failpoint.h"
#include "lib/checkpoint/checkpoint.h"
#include "lib/checkpoint/checkpoint_format.h"
#include "lib/checkpoint/checkpoint_internal.h"
#include "lib/checkpoint/checkpoint_io.h"
#include "lib/table/table_config.h"

#define MANIFEST_MAX_BYTES (16u << 20)

typedef struct file_entry {
    uint64_t bytes, xxh3;
} file_entry;

typedef struct manifest {
    em_table_config config;
    uint64_t rows, chunks, created_unix_ms;
    uint32_t row_floats;
    uint64_t row_bytes;     /* of a row in a chunk: key, floats and access metadata */
    bool access;            /* rows carry their em_row_access (version 3) */
    em_table_clocks clocks; /* with access: the table's clocks at its snapshot */
    uint32_t version;
    file_entry rows_file, index_file, tombstones_file;
    file_entry admission_file; /* with has_admission */
    bool has_admission;        /* counter admission's sketch in admission.emb (version 3) */
    file_entry evicted_file;   /* with has_evicted */
    bool has_evicted;          /* with access, the evicted-key ring in evicted.emb (version 5) */
    uint64_t tombstones, table_rows;
    em__chain_link link;
} manifest;

bool em__checkpoint_is_id(const char *name)
{
    size_t i = 0;
    for (; name[i] != '\0'; i++)
        if (name[i] < '0' || name[i] > '9')
            return false;
    return i == EM_CHECKPOINT_ID_DIGITS;
}

static em_status data_loss(em_error *err, const char *dir, const char *file, const char *format,
                           ...) __attribute__((format(printf, 4, 5)));

static em_status data_loss(em_error *err, const char *dir, const char *file, const char *format,
                           ...)
{
    char what[768];
    va_list args;
    va_start(args, format);
    vsnprintf(what, sizeof(what), format, args);
    va_end(args);
    return em_error_set(err, EM_DATA_LOSS, "checkpoint %s: %s: %s", dir, file, what);
}

/* ---- the manifest ---------------------------------------------------------------------- */

static em_status read_small_file(const char *dir, const char *name, size_t limit, char **out,
                                 size_t *size, em_error *err)
{
    char path[4400];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return data_loss(err, dir, name, "cannot open: %s", strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size > limit) {
        close(fd);
        return data_loss(err, dir, name, "larger than %zu bytes", limit);
    }
    char *data = malloc((size_t)st.st_size + 1);
    size_t done = 0;
    while (data != NULL && done < (size_t)st.st_size) {
        ssize_t got = read(fd, data + done, (size_t)st.st_size - done);
        if (got <= 0)
            break;
        done += (size_t)got;
    }
    close(fd);
    if (data == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory reading %s", path);
    if (done != (size_t)st.st_size) {
        free(data);
        return data_loss(err, dir, name, "read %zu of %lld bytes", done, (long long)st.st_size);
    }
    data[done] = '\0';
    *out = data;
    *size = done;
    return EM_OK;
}

static bool parse_hex64(const char *text, uint64_t *out)
{
    if (text == NULL || strlen(text) != 16)
        return false;
    char *end = NULL;
    *out = strtoull(text, &end, 16);
    return end == text + 16;
}

static em_status read_file_entry(const cJSON *files, const char *dir, const char *name,
                                 file_entry *out, em_error *err)
{
    const cJSON *file = NULL;
    cJSON_ArrayForEach(file, files)
    {
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(file, "name");
        if (!cJSON_IsString(n) || strcmp(n->valuestring, name) != 0)
            continue;
        const cJSON *bytes = cJSON_GetObjectItemCaseSensitive(file, "bytes");
        const cJSON *hash = cJSON_GetObjectItemCaseSensitive(file, "xxh3");
        if (!em__json_count(bytes, &out->bytes) || !cJSON_IsString(hash) ||
            !parse_hex64(hash->valuestring, &out->xxh3))
            return data_loss(err, dir, "manifest.json", "the entry of %s is malformed", name);
        return EM_OK;
    }
    return data_loss(err, dir, "manifest.json", "lists no file %s", name);
}

bool em__json_count(const cJSON *item, uint64_t *out)
{
    /* 2^53: a double holds every whole number up to it exactly */
    if (!cJSON_IsNumber(item) || !(item->valuedouble >= 0) ||
        item->valuedouble > 9007199254740992.0 ||
        item->valuedouble != (double)(uint64_t)item->valuedouble)
        return false;
    *out = (uint64_t)item->valuedouble;
    return true;
}

static em_status number_field(const cJSON *json, const char *dir, const char *name,
                              uint64_t *out, em_error *err)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(json, name);
    if (em__json_count(item, out))
        return EM_OK;
    if (cJSON_IsNumber(item))
        return data_loss(err, dir, "manifest.json",
                         "field %s is missing or not a count (a whole number from 0 to 2^53): "
                         "%.17g", name, item->valuedouble);
    return data_loss(err, dir, "manifest.json", "field %s is missing or not a count (%s)", name,
                     item == NULL ? "absent" : "not a number");
}

static em_status id_field(const cJSON *json, const char *dir, const char *name,
                          const char *label, char *out, em_error *err)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(json, name);
    if (!cJSON_IsString(item) || !em__checkpoint_is_id(item->valuestring))
        return data_loss(err, dir, "manifest.json", "field %s is missing or not an id", label);
    snprintf(out, EM_CHECKPOINT_ID_DIGITS + 1, "%s", item->valuestring);
    return EM_OK;
}

/* kind, parent, base and depth (version 1 has full checkpoints only). */
static em_status parse_chain(const cJSON *json, const char *dir, manifest *m, em_error *err)
{
    em__chain_link *link = &m->link;
    const cJSON *kind = cJSON_GetObjectItemCaseSensitive(json, "kind");
    bool full = cJSON_IsString(kind) && strcmp(kind->valuestring, "full") == 0;
    link->delta = m->version >= 2 && cJSON_IsString(kind) &&
                  strcmp(kind->valuestring, "delta") == 0;
    if (!full && !link->delta)
        return data_loss(err, dir, "manifest.json", "kind is not \"full\"%s",
                         m->version >= 2 ? " or \"delta\"" : "");
    if (m->version < 2) {
        snprintf(link->base_id, sizeof(link->base_id), "%s", link->id);
        return EM_OK;
    }
    uint64_t depth = 0;
    em_status status = id_field(json, dir, "base", "base", link->base_id, err);
    if (status == EM_OK)
        status = number_field(json, dir, "depth", &depth, err);
    if (status != EM_OK)
        return status;
    const cJSON *parent = cJSON_GetObjectItemCaseSensitive(json, "parent");
    if (!link->delta) {
        if (!cJSON_IsNull(parent) || depth != 0 || strcmp(link->base_id, link->id) != 0)
            return data_loss(err, dir, "manifest.json",
                             "a full checkpoint must have no parent, depth 0 and itself as "
                             "base; it has %s parent, depth %" PRIu64 ", base %s",
                             cJSON_IsNull(parent) ? "no" : "a", depth, link->base_id);
        return EM_OK;
    }
    if (depth == 0 || depth > UINT32_MAX)
        return data_loss(err, dir, "manifest.json", "a delta of depth %" PRIu64, depth);
    link->depth = (uint32_t)depth;
    const cJSON *hash = cJSON_GetObjectItemCaseSensitive(parent, "manifest_xxh3");
    status = id_field(parent, dir, "id", "parent.id", link->parent_id, err);
    if (status == EM_OK && (!cJSON_IsString(hash) ||
                            !parse_hex64(hash->valuestring, &link->parent_manifest_xxh3)))
        status = data_loss(err, dir, "manifest.json", "parent.manifest_xxh3 is malformed");
    if (status == EM_OK && strcmp(link->parent_id, link->id) >= 0)
        status = data_loss(err, dir, "manifest.json",
                           "its parent %s is not older than it (%s): out of order",
                           link->parent_id, link->id);
    return status;
}

/* Version 3: whether rows carry access metadata, and the table's clocks when they do. */
static em_status parse_access(const cJSON *json, const char *dir, manifest *m, em_error *err)
{
    m->access = false;
    if (m->version < 3)
        return EM_OK;
    const cJSON *access = cJSON_GetObjectItemCaseSensitive(json, "access");
    if (!cJSON_IsBool(access))
        return data_loss(err, dir, "manifest.json", "field access is missing or not a boolean");
    m->access = cJSON_IsTrue(access);
    if (m->access != em_eviction_tracks_access(&m->config.eviction))
        return data_loss(err, dir, "manifest.json",
                         "access is %s, but the table's eviction %s access", 
                         m->access ? "true" : "false",
                         m->access ? "does not track" : "tracks");
    if (!m->access)
        return EM_OK;
    const cJSON *clocks = cJSON_GetObjectItemCaseSensitive(json, "clocks");
    em_table_clocks *c = &m->clocks;
    em_status status = number_field(clocks, dir, "access", &c->access_clock, err);
    if (status == EM_OK)
        status = number_field(clocks, dir, "update", &c->update_clock, err);
    if (status == EM_OK)
        status = number_field(clocks, dir, "sample_spacing_ms", &c->sample_spacing_ms, err);
    if (status != EM_OK)
        return status;
    const cJSON *samples = cJSON_GetObjectItemCaseSensitive(clocks, "samples");
    if (!cJSON_IsArray(samples) || cJSON_GetArraySize(samples) > (int)EM_TABLE_CLOCK_SAMPLES)
        return data_loss(err, dir, "manifest.json",
                         "clocks.samples is missing or has more than %u entries",
                         EM_TABLE_CLOCK_SAMPLES);
    c->samples = 0;
    const cJSON *pair = NULL;
    cJSON_ArrayForEach(pair, samples)
    {
        const cJSON *ms = cJSON_GetArrayItem(pair, 0), *clock = cJSON_GetArrayItem(pair, 1);
        uint64_t unix_ms = 0, count = 0;
        if (!cJSON_IsArray(pair) || cJSON_GetArraySize(pair) != 2 ||
            !em__json_count(ms, &unix_ms) || !em__json_count(clock, &count) ||
            count > UINT32_MAX || (c->samples > 0 && unix_ms < c->sample_ms[c->samples - 1]))
            return data_loss(err, dir, "manifest.json",
                             "clocks.samples[%u] is not a [unix_ms, clock] pair in time order",
                             c->samples);
        c->sample_ms[c->samples] = unix_ms;
        c->sample_clock[c->samples++] = (uint32_t)count;
    }
    return EM_OK;
}

static em_status parse_manifest(const cJSON *json, const char *dir, manifest *m, em_error *err)
{
    const cJSON *format = cJSON_GetObjectItemCaseSensitive(json, "format");
    const cJSON *version = cJSON_GetObjectItemCaseSensitive(json, "version");
    if (!cJSON_IsString(format) || strcmp(format->valuestring, "ember-checkpoint") != 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "checkpoint %s: manifest.json is not an ember checkpoint's", dir);
    if (!cJSON_IsNumber(version) || version->valuedouble < 1 ||
        version->valuedouble > EM_CHECKPOINT_FORMAT_VERSION ||
        version->valuedouble != (double)(uint32_t)version->valuedouble)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "checkpoint %s: format version %g, this ember reads versions 1 to "
                            "%u", dir, cJSON_IsNumber(version) ? version->valuedouble : -1.0,
                            EM_CHECKPOINT_FORMAT_VERSION);
    m->version = (uint32_t)version->valuedouble;
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(json, "id");
    if (!cJSON_IsString(id) || !em__checkpoint_is_id(id->valuestring))
        return data_loss(err, dir, "manifest.json", "id is missing or malformed");
    em__chain_link *link = &m->link;
    snprintf(link->id, sizeof(link->id), "%s", id->valuestring);
    em_status status = parse_chain(json, dir, m, err);
    if (status != EM_OK)
        return status;
    status = em_table_config_parse(cJSON_GetObjectItemCaseSensitive(json, "table"), "table",
                                   &m->config, err);
    if (status != EM_OK)
        return em_error_prefix(err, "checkpoint %s: manifest.json: ", dir);
    uint64_t row_floats = 0, buckets = 0;
    status = number_field(json, dir, "rows", &m->rows, err);
    if (status == EM_OK)
        status = number_field(json, dir, "chunks", &m->chunks, err);
    if (status == EM_OK)
        status = number_field(json, dir, "created_unix_ms", &m->created_unix_ms, err);
    if (status == EM_OK)
        status = number_field(json, dir, "row_floats", &row_floats, err);
    if (status == EM_OK)
        status = number_field(json, dir, "buckets", &buckets, err);
    if (status != EM_OK)
        return status;
    uint64_t expected = m->config.dim +
                        em_optimizer_state_floats(m->config.optimizer.kind, m->config.dim);
    if (row_floats != expected)
        return data_loss(err, dir, "manifest.json",
                         "row_floats %" PRIu64 " does not match the table (%" PRIu64 ")",
                         row_floats, expected);
    if (buckets != EM_CHECKPOINT_BUCKETS)
        return data_loss(err, dir, "manifest.json", "%" PRIu64 " buckets, expected %u", buckets,
                         EM_CHECKPOINT_BUCKETS);
    m->row_floats = (uint32_t)row_floats;
    status = parse_access(json, dir, m, err);
    if (status != EM_OK)
        return status;
    m->row_bytes = sizeof(uint64_t) + m->row_floats * sizeof(float) +
                   (m->access ? sizeof(em_row_access) : 0);
    const cJSON *files = cJSON_GetObjectItemCaseSensitive(json, "files");
    status = read_file_entry(files, dir, "rows.emb", &m->rows_file, err);
    if (status == EM_OK)
        status = read_file_entry(files, dir, "index.emb", &m->index_file, err);
    if (status == EM_OK && m->version >= 2)
        status = read_file_entry(files, dir, "tombstones.emb", &m->tombstones_file, err);
    m->has_admission = m->version >= 3 && m->config.admission.policy == EM_ADMISSION_COUNTER;
    if (status == EM_OK && m->has_admission)
        status = read_file_entry(files, dir, "admission.emb", &m->admission_file, err);
    m->has_evicted = m->version >= 5 && m->access;
    if (status == EM_OK && m->has_evicted)
        status = read_file_entry(files, dir, "evicted.emb", &m->evicted_file, err);
    if (status == EM_OK && m->version >= 2) {
        status = number_field(json, dir, "tombstones", &m->tombstones, err);
        if (status == EM_OK)
            status = number_field(json, dir, "table_rows", &m->table_rows, err);
    } else {
        m->table_rows = m->rows;
    }
    if (status == EM_OK && !link->delta && m->table_rows != m->rows)
        status = data_loss(err, dir, "manifest.json",
                           "a full checkpoint of %" PRIu64 " rows says the table has %" PRIu64,
                           m->rows, m->table_rows);
    return status;
}

static em_status read_manifest(const char *dir, manifest *m, em_error *err)
{
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return em_error_set(err, EM_NOT_FOUND, "checkpoint %s: no such directory", dir);
    char *text = NULL;
    size_t size = 0;
    em_status status = read_small_file(dir, "manifest.json", MANIFEST_MAX_BYTES, &text, &size, err);
    if (status != EM_OK)
        return status;
    /* the last line is "xxh3 <16 hex digits>", the checksum of everything before it */
    char *line = size >= 23 ? text + size - 22 : NULL;
    uint64_t expected = 0;
    if (line == NULL || line[-1] != '\n' || strncmp(line, "xxh3 ", 5) != 0 ||
        text[size - 1] != '\n') {
        free(text);
        return data_loss(err, dir, "manifest.json", "its checksum line is missing (truncated?)");
    }
    line[21] = '\0';
    if (!parse_hex64(line + 5, &expected)) {
        free(text);
        return data_loss(err, dir, "manifest.json", "its checksum line is malformed");
    }
    uint64_t seen = XXH3_64bits(text, (size_t)(line - text));
    if (seen != expected) {
        free(text);
        return data_loss(err, dir, "manifest.json",
                         "checksum mismatch: expected %016" PRIx64 ", seen %016" PRIx64, expected,
                         seen);
    }
    line[0] = '\0';
    m->link.manifest_xxh3 = expected;
    cJSON *json = cJSON_Parse(text);
    free(text);
    if (json == NULL)
        return data_loss(err, dir, "manifest.json", "not valid JSON");
    status = parse_manifest(json, dir, m, err);
    cJSON_Delete(json);
    return status;
}

/* ---- index.emb ------------------------------------------------------------------------- */

/* Reads a whole small file and checks its size and checksum against the manifest's
 * entry; *data is the caller's to free (NULL on an error). */
static em_status read_listing(const char *dir, const char *name, size_t limit,
                              const file_entry *entry, char **data, size_t *size, em_error *err)
{
    *data = NULL;
    em_status status = read_small_file(dir, name, limit, data, size, err);
    if (status != EM_OK)
        return status;
    uint64_t seen = XXH3_64bits(*data, *size);
    if (*size != entry->bytes)
        status = data_loss(err, dir, name, "%zu bytes, the manifest says %" PRIu64
                           " (truncated?)", *size, entry->bytes);
    else if (seen != entry->xxh3)
        status = data_loss(err, dir, name,
                           "checksum mismatch: expected %016" PRIx64 ", seen %016" PRIx64,
                           entry->xxh3, seen);
    if (status != EM_OK) {
        free(*data);
        *data = NULL;
    }
    return status;
}

static em_status read_index(const char *dir, const manifest *m, em_index_entry **out,
                            em_error *err)
{
    char *data = NULL;
    size_t size = 0;
    size_t limit = sizeof(em_index_header) + EM_CHECKPOINT_BUCKETS * sizeof(em_index_entry) *
                                                 (m->chunks / EM_CHECKPOINT_BUCKETS + 1) +
                   sizeof(uint64_t);
    em_status status = read_listing(dir, "index.emb", limit, &m->index_file, &data, &size, err);
    if (status != EM_OK)
        return status;
    em_index_header header;
    if (status == EM_OK) {
        /* a file shorter than its header (with a manifest that agrees) is refused below */
        memset(&header, 0, sizeof(header));
        memcpy(&header, data, size < sizeof(header) ? size : sizeof(header));
        if (size != sizeof(header) + m->chunks * sizeof(em_index_entry) + sizeof(uint64_t) ||
            memcmp(header.magic, EM_INDEX_MAGIC, 8) != 0 || header.chunks != m->chunks ||
            header.version != m->version)
            status = data_loss(err, dir, "index.emb",
                               "its header does not match the manifest (%" PRIu64 " chunks)",
                               m->chunks);
    }
    if (status == EM_OK) {
        *out = malloc(m->chunks * sizeof(em_index_entry) + 1);
        if (*out == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
        else
            memcpy(*out, data + sizeof(header), m->chunks * sizeof(em_index_entry));
    }
    free(data);
    return status;
}

/* ---- rows.emb -------------------------------------------------------------------------- */

/* Rows go into the table in batches of about this many bytes (chunks are small), where
 * they are not imported from the file's blocks (reader.in_place). */
#define IMPORT_BATCH_BYTES (16u << 20)

/* Rows of chunks first..last of a link, for the table. */
typedef struct import_batch {
    uint64_t *keys;
    float *values;           /* the rows, copied; or, in place: */
    const float **rows;      /* where each row lies in the reader's block */
    em_row_access *access;   /* when the table and the checkpoint keep access metadata */
    bool has_access;
    uint64_t count, first_chunk, last_chunk;
    const char *dir;         /* the link's */
    uint64_t bytes_read;     /* of the chain's rows.emb files when it was handed over */
} import_batch;

/* One read of rows.emb: want bytes at offset into to. */
typedef struct block_read {
    int fd;
    unsigned char *to;
    uint64_t offset;
    size_t want, got;
    int error; /* errno of a failed read; 0 */
} block_read;

/* Blocks of rows.emb read ahead of the one being taken, at most, when it is read from
 * start to end (read_ahead). */
#define READ_AHEAD_BLOCKS 2

/* The ring of buffers: the block being taken, the one before it (in place, the importer
 * may still be reading rows from it) and the blocks read ahead. */
#define AHEAD_BUFFERS (READ_AHEAD_BLOCKS + 2)

typedef enum ahead_state {
    AHEAD_FREE,    /* the reader thread may read into it */
    AHEAD_READING, /* the reader thread's */
    AHEAD_READY,   /* read, not taken yet */
    AHEAD_TAKEN,   /* the reader's (struct reader): the current block, or the one before */
} ahead_state;

/* Owned chunks that lie one after another in rows.emb (plan_runs): one read. */
typedef struct ahead_run {
    uint64_t offset, bytes;
} ahead_run;

/* The reads of rows.emb, block after block (or run after run) into a ring of buffers,
 * in the file's order: on a thread of its own while the reader takes the blocks read
 * before (next_block_ahead), or by the reader as it needs each (not threaded). Each
 * buffer holds `front` bytes before where a read lands, for the end of the block before
 * it (the start of a chunk that straddles the two). */
typedef struct read_ahead {
    pthread_t thread;
    bool running;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    bool stop;
    int fd;
    uint64_t offset, end; /* the next block to read starts at offset; the file's size */
    size_t block, front;
    unsigned char *base[AHEAD_BUFFERS];
    size_t base_front[AHEAD_BUFFERS], capacity[AHEAD_BUFFERS];
    ahead_state state[AHEAD_BUFFERS];
    block_read read[AHEAD_BUFFERS];
    int fill;             /* the buffer the thread reads into next (ring order) */
    int take;             /* the buffer the reader takes next (ring order) */
    int current, before;  /* the buffers the reader holds (TAKEN), or -1 */
    bool threaded;        /* reads ahead on the thread; else the reader reads each block */
    bool ended;           /* a read failed or came short: none after it */
    const ahead_run *runs; /* a load of some buckets: the runs of chunks it reads, in
                            * order (one block each), instead of the file from its start */
    size_t run_count, next_run;
} read_ahead;

typedef struct reader {
    const char *dir;
    const manifest *m;
    int fd;                 /* rows.emb */
    XXH3_state_t *hash;     /* the file's checksum (no owner): of its bytes as they are taken,
                             * or from version 4 of its chunks' (em_rows_digest_add) */
    uint64_t position;      /* in the file: the next byte to take */
    unsigned char *block;   /* the current block: bytes of the file from block_start,
                             * block_bytes of them, in a buffer of the read ahead's */
    size_t block_bytes;
    uint64_t block_start;
    uint64_t let_go;        /* the page cache was told to let the file's pages before this
                             * go (let_pages_go) */
    bool in_place;          /* a batch's rows are imported from the block that holds
                             * them (a load of every bucket, rows as saved) */
    read_ahead ahead;       /* the blocks after the current one, read on a thread of their
                             * own meanwhile where that pays (read_ahead_start) */
    ahead_run *runs;        /* with an owner: the runs of owned chunks, in the file's order */
    size_t run_capacity;
    unsigned char *payload; /* the chunk being read: in block (u64 keys unaligned) */
    em_table *table;        /* NULL: verify only */
    bool access;            /* the table tracks access: rows' metadata goes with them */
    bool weights_only;      /* rows get the weights, and a new row's optimizer state */
    uint32_t table_floats;  /* floats per row of the table */
    float initial_state;    /* weights only: every state float of a new row */
    import_batch batches[2]; /* rows for the table: one filled here, one with the importer */
    int filling;
    uint64_t batch_capacity; /* rows per batch */
    em__pipe importer;       /* imports the batches on a thread of its own */
    em__key_map *decided;   /* a chain: key -> the link that decided it; else NULL */
    uint64_t level;         /* this link's (0 is the newest) */
    em__key_map *digests;   /* tracking: key -> digest of its row as loaded; else NULL */
    uint32_t *kept;         /* scratch: kept rows' positions in the chunk */
    uint64_t kept_capacity;
    uint64_t *keys;         /* verify: scratch, a chunk's keys aligned for its value check */
    uint64_t keys_capacity;
    uint64_t taken;         /* rows used, of every link read */
    const em_checkpoint_load_options *options; /* progress; NULL when none */
    uint32_t owner_index, owner_count; /* owner_count > 0: only the buckets owned */
    const char *const *sources; /* several checkpoints: their paths, and for each bucket */
    uint32_t *bucket_source;    /* 1 + the source whose chunks hold it (0: none yet) */
    uint32_t source;            /* the source being read */
    uint64_t bytes_read;    /* of the rows.emb files, every link's so far */
    uint64_t total_bytes;   /* of the rows.emb files: what the load reads of them */
    uint64_t imported;      /* rows imported so far */
} reader;

/* Whether the load takes the rows of bucket (all of them without an owner). */
static bool owns(const reader *r, uint32_t bucket)
{
    return r->owner_count == 0 ||
           (uint32_t)em_bucket_server(bucket, (int32_t)r->owner_count) == r->owner_index;
}

/* The payload's keys are read and written with memcpy: a chunk starts wherever the one
 * before it ended, so they are 4-byte aligned only (the floats always are). */
static uint64_t payload_key(const unsigned char *payload, uint32_t i)
{
    uint64_t key;
    memcpy(&key, payload + (size_t)i * sizeof(uint64_t), sizeof(key));
    return key;
}

/* The digest of row i of a payload of n rows (em__row_digest): its floats, and its
 * access metadata, which follows all n rows' floats, when the table tracks access (a
 * tracking load's checkpoint then carries it: track_changes). */
static uint64_t row_digest(const reader *r, const float *values, uint32_t n, uint32_t i)
{
    uint32_t floats = r->m->row_floats;
    const unsigned char *access = NULL;
    if (r->access && r->m->access)
        access = (const unsigned char *)(values + (size_t)n * floats) +
                 (size_t)i * sizeof(em_row_access);
    return em__row_digest(values + (size_t)i * floats, floats, access);
}

/* Whether every row of a chunk is checked as it is read (check_chunk_values): for a
 * verify, and for a weights-only load, which puts in the weights alone but refuses a
 * checkpoint whose optimizer state is bad as verify does. A load of whole rows checks
 * the rows it keeps as it batches them for its table (batch_chunk), and the rows a
 * newer link overrides as it skips them (keep_rows), so that it accepts exactly what
 * verify accepts. */
static bool checked_whole(const reader *r)
{
    return r->table == NULL || r->weights_only;
}

/* n rows of the chunk (keys aligned), checked by the manifest's table config as a load
 * checks the rows it imports: every float finite, the optimizer state that cannot be
 * negative not negative. DATA_LOSS naming the chunk, the row and the element. */
static em_status check_values(reader *r, uint64_t chunk, const uint64_t *keys,
                              const float *values, uint32_t n, em_error *err)
{
    if (em_table_config_check_rows(&r->m->config, keys, values, n, err) == EM_OK)
        return EM_OK;
    em_error_prefix(err, "checkpoint %s: rows.emb: chunk %" PRIu64 ": ", r->dir, chunk);
    err->status = EM_DATA_LOSS;
    return EM_DATA_LOSS;
}

/* Every row of the chunk just read, checked (checked_whole), before keep_rows moves the
 * rows it keeps. */
static em_status check_chunk_values(reader *r, uint64_t chunk, uint32_t rows, em_error *err)
{
    if (rows > r->keys_capacity) {
        uint64_t *grown = realloc(r->keys, (size_t)rows * sizeof(uint64_t));
        if (grown == NULL)
            return em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory for %u keys",
                                rows);
        r->keys = grown;
        r->keys_capacity = rows;
    }
    for (uint32_t k = 0; k < rows; k++)
        r->keys[k] = payload_key(r->payload, k);
    const float *values = (const float *)(r->payload + (size_t)rows * sizeof(uint64_t));
    return check_values(r, chunk, r->keys, values, rows, err);
}

/* Drops the rows of the chunk in r->payload that a newer link decided, records the
 * rest as decided by this link (and their digests when tracking), and compacts the
 * payload to the kept rows: *rows becomes their count. */
static em_status keep_rows(reader *r, uint64_t chunk, uint32_t *rows, em_error *err)
{
    uint32_t n = *rows, floats = r->m->row_floats, out = 0;
    if (r->decided == NULL && r->digests == NULL) {
        r->taken += n;
        return EM_OK;
    }
    if (n > r->kept_capacity) {
        uint32_t *kept = realloc(r->kept, n * sizeof(uint32_t));
        if (kept == NULL)
            return em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
        r->kept = kept;
        r->kept_capacity = n;
    }
    unsigned char *keys = r->payload;
    const float *values = (const float *)(r->payload + (size_t)n * sizeof(uint64_t));
    for (uint32_t i = 0; i < n; i++) {
        if (i + EM__KEY_PREFETCH < n) { /* the keys before i move down only: ahead stays */
            uint64_t ahead = payload_key(keys, i + EM__KEY_PREFETCH);
            if (r->decided != NULL)
                em__key_map_prefetch(r->decided, ahead);
            if (r->digests != NULL)
                em__key_map_prefetch(r->digests, ahead);
        }
        uint64_t key = payload_key(keys, i), by = 0;
        if (r->decided != NULL && em__key_map_get(r->decided, key, &by)) {
            if (by == r->level)
                return data_loss(err, r->dir, "rows.emb",
                                 "chunk %" PRIu64 ": key %" PRIu64 " appears twice in this "
                                 "checkpoint", chunk, key);
            /* a newer link has it: the row is not loaded, but checked as the rows that
             * are (check_chunk_values checked it already where every row was) */
            if (!checked_whole(r) &&
                check_values(r, chunk, &key, values + (size_t)i * floats, 1, err) != EM_OK)
                return EM_DATA_LOSS;
            continue;
        }
        if ((r->decided != NULL && !em__key_map_put(r->decided, key, r->level)) ||
            (r->digests != NULL &&
             !em__key_map_put(r->digests, key, row_digest(r, values, n, i))))
            return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                "out of host memory for the keys of a checkpoint");
        memcpy(keys + (size_t)out * sizeof(uint64_t), &key, sizeof(key));
        r->kept[out++] = i;
    }
    size_t row_bytes = floats * sizeof(float);
    unsigned char *to = r->payload + (size_t)out * sizeof(uint64_t);
    if (out < n) /* every row moves down: never over a row still to move */
        for (uint32_t j = 0; j < out; j++)
            memmove(to + j * row_bytes, (const unsigned char *)values + r->kept[j] * row_bytes,
                    row_bytes);
    if (out < n && r->m->access) { /* and the access metadata after the floats, likewise */
        const unsigned char *from = (const unsigned char *)values + (size_t)n * row_bytes;
        unsigned char *access = to + (size_t)out * row_bytes;
        for (uint32_t j = 0; j < out; j++)
            memmove(access + j * sizeof(em_row_access), from + r->kept[j] * sizeof(em_row_access),
                    sizeof(em_row_access));
    }
    *rows = out;
    r->taken += out;
    return EM_OK;
}

/* The importer's work (em__pipe): one batch into the table, its values checked already
 * (batch_chunk). A refusal means rows that passed their checksums but that no table
 * takes (a key repeated across chunks): the checkpoint is bad. Progress is heard from
 * this thread. */
static em_status import_batch_rows(void *context, void *item, em_error *err)
{
    reader *r = context;
    const import_batch *b = item;
    em_status status = r->in_place
                           ? em_table_import_new_from(r->table, b->keys, b->rows, b->count, err)
                           : em_table_import_new(r->table, b->keys, b->values, b->count, err);
    if (status == EM_OK && b->has_access)
        status = em_table_set_access(r->table, b->keys, b->access, b->count, err);
    if (status == EM_INVALID_ARGUMENT) {
        em_error_prefix(err, "checkpoint %s: rows.emb: chunks %" PRIu64 "..%" PRIu64 ": ", b->dir,
                        b->first_chunk, b->last_chunk);
        err->status = EM_DATA_LOSS;
        status = EM_DATA_LOSS;
    }
    if (status != EM_OK)
        return status;
    r->imported += b->count; /* the importer's alone until it finishes */
    if (r->options != NULL && r->options->progress != NULL)
        r->options->progress(r->options->progress_context, r->imported, b->bytes_read,
                             r->total_bytes);
    return EM_OK;
}

/* Hands the batch being filled to the importer and goes on with the other one. */
static em_status flush_batch(reader *r, uint64_t last_chunk, em_error *err)
{
    import_batch *b = &r->batches[r->filling];
    if (b->count == 0)
        return EM_OK;
    b->last_chunk = last_chunk;
    b->dir = r->dir;
    b->bytes_read = r->bytes_read;
    em_status status = em__pipe_put(&r->importer, b, err);
    if (status != EM_OK)
        return status;
    r->filling = 1 - r->filling;
    r->batches[r->filling].count = 0; /* done: em__pipe_put waited for it */
    return EM_OK;
}

/* Adds chunk i's rows (in r->payload) to the batch, importing it first when full. */
static em_status batch_chunk(reader *r, uint64_t i, uint32_t rows, em_error *err)
{
    uint32_t floats = r->table_floats, dim = r->m->config.dim;
    if (r->batch_capacity == 0) {
        r->batch_capacity = IMPORT_BATCH_BYTES / (sizeof(uint64_t) + floats * sizeof(float)) + 1;
        for (int k = 0; k < 2; k++) {
            r->batches[k].keys = malloc(r->batch_capacity * sizeof(uint64_t));
            if (r->in_place)
                r->batches[k].rows = malloc(r->batch_capacity * sizeof(const float *));
            else
                r->batches[k].values = malloc(r->batch_capacity * floats * sizeof(float));
            if (r->access)
                r->batches[k].access = malloc(r->batch_capacity * sizeof(em_row_access));
            if (r->batches[k].keys == NULL ||
                (r->in_place ? r->batches[k].rows == NULL : r->batches[k].values == NULL) ||
                (r->access && r->batches[k].access == NULL))
                return em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
        }
    }
    em_status status = EM_OK;
    if (r->batches[r->filling].count + rows > r->batch_capacity)
        status = flush_batch(r, i - 1, err);
    if (status != EM_OK)
        return status;
    for (uint32_t done = 0; done < rows;) {
        import_batch *b = &r->batches[r->filling];
        if (b->count == r->batch_capacity) {
            status = flush_batch(r, i, err);
            if (status != EM_OK)
                return status;
            b = &r->batches[r->filling];
        }
        if (b->count == 0)
            b->first_chunk = i;
        uint32_t take = rows - done;
        uint64_t room = r->batch_capacity - b->count;
        take = take < room ? take : (uint32_t)room;
        const float *values = (const float *)(r->payload + rows * sizeof(uint64_t));
        memcpy(b->keys + b->count, r->payload + (size_t)done * sizeof(uint64_t),
               take * sizeof(uint64_t));
        if (b->count == 0)
            b->has_access = r->access && r->m->access;
        if (b->has_access != (r->access && r->m->access)) /* never: one table's chain */
            return data_loss(err, r->dir, "manifest.json", "access differs within the load");
        if (b->has_access) /* after the floats; unaligned in the payload: copied */
            memcpy(b->access + b->count,
                   r->payload + rows * sizeof(uint64_t) + (size_t)rows * r->m->row_floats *
                                                              sizeof(float) +
                       (size_t)done * sizeof(em_row_access),
                   take * sizeof(em_row_access));
        /* in place, the batch has no values of its own (b->values is NULL) */
        const float *checked_values = r->in_place ? values + (size_t)done * floats
                                                  : b->values + b->count * floats;
        if (r->in_place) { /* the rows stay where they are, the same floats as the table's */
            for (uint32_t k = 0; k < take; k++)
                b->rows[b->count + k] = values + (size_t)(done + k) * floats;
        } else if (!r->weights_only) {
            memcpy(b->values + b->count * floats, values + (size_t)done * floats,
                   (size_t)take * floats * sizeof(float));
        } else { /* weights only: a new row's state after them */
            for (uint32_t k = 0; k < take; k++) {
                float *row = b->values + (b->count + k) * floats;
                memcpy(row, values + (size_t)(done + k) * r->m->row_floats, dim * sizeof(float));
                for (uint32_t j = dim; j < floats; j++)
                    row[j] = r->initial_state;
            }
        }
        /* checked here, in the cache, while the importer puts the batch before in */
        em_status checked = em_table_check_rows(r->table, b->keys + b->count, checked_values,
                                                take, err);
        if (checked != EM_OK) {
            em_error_prefix(err, "checkpoint %s: rows.emb: chunk %" PRIu64 ": ", r->dir, i);
            err->status = EM_DATA_LOSS;
            return EM_DATA_LOSS;
        }
        b->count += take;
        done += take;
    }
    return EM_OK;
}

/* Bytes read ahead in one read(): a chunk is a few KiB, so reading them one by one
 * would cost two system calls each. The kernel's own read-ahead of a file read in
 * order (POSIX_FADV_SEQUENTIAL) keeps the disk busy meanwhile; asking it for more
 * (POSIX_FADV_WILLNEED past each block) made loads from a cold page cache slower and
 * cost the reader's thread CPU (tests/bench/RESULTS.md). */
#define READ_BLOCK_BYTES (8u << 20)

/* The page cache is told to let rows.emb's pages go once they are read (into a block)
 * every this many bytes: each such call costs about a millisecond (the kernel drains
 * every CPU's page lists), so not after every block. */
#define LET_GO_BYTES (UINT64_C(64) << 20)

/* Lets the pages of rows.emb before `until` go, LET_GO_BYTES at a time or, with all,
 * whatever is left: the next reads reuse them instead of taking fresh memory, and a
 * restore does not fill the host's memory with a file it reads once. */
static void let_pages_go(reader *r, uint64_t until, bool all)
{
    if (until <= r->let_go || (!all && until - r->let_go < LET_GO_BYTES))
        return;
    (void)posix_fadvise(r->fd, (off_t)r->let_go, (off_t)(until - r->let_go),
                        POSIX_FADV_DONTNEED);
    r->let_go = until;
}

/* Reads b->want bytes (fewer at the end of the file); a failure leaves its errno. The
 * failpoint checkpoint_read_fail makes the first read past its byte read half and fail. */
static void read_block(block_read *b)
{
    b->got = 0;
    b->error = 0;
    uint64_t past = 0;
    size_t fails_at = SIZE_MAX;
    if (em_failpoint_armed(EM_FAILPOINT_CHECKPOINT_READ_FAIL, &past) &&
        b->offset + b->want > past && em_failpoint_hit(EM_FAILPOINT_CHECKPOINT_READ_FAIL, NULL))
        fails_at = b->want / 2;
    while (b->got < b->want) {
        if (b->got >= fails_at) {
            b->error = EIO;
            break;
        }
        size_t want = (fails_at < b->want ? fails_at : b->want) - b->got;
        ssize_t n = pread(b->fd, b->to + b->got, want, (off_t)(b->offset + b->got));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            b->error = errno;
            break;
        }
        if (n == 0)
            break;
        b->got += (size_t)n;
    }
}

static size_t block_size(const reader *r)
{
    return r->options != NULL && r->options->read_block_bytes > 0
               ? (size_t)r->options->read_block_bytes
               : READ_BLOCK_BYTES;
}

/* Where a buffer's read lands: as far into its eight-byte word as the read's offset into
 * the file's, so that every value lies in memory as aligned as in the file (a chunk's
 * floats on four bytes; they start wherever the chunk before ended). */
#define AHEAD_ALIGN ((size_t)8)

/* The first byte of buffer k's read (a->read[k] planned). */
static unsigned char *ahead_data(const read_ahead *a, int k)
{
    return a->base[k] + a->base_front[k] + a->read[k].offset % AHEAD_ALIGN;
}

/* Gives ring buffer k room for `front` bytes before its data and `capacity` after (its
 * read planned), keeping the keep_front bytes before its data and the keep bytes of it.
 * Only the buffer's holder calls it: the thread while it reads into it, the reader once
 * taken. */
static bool buffer_room(read_ahead *a, int k, size_t front, size_t capacity, size_t keep_front,
                        size_t keep)
{
    if (a->base[k] != NULL && a->base_front[k] >= front && a->capacity[k] >= capacity)
        return true;
    front = front > a->base_front[k] ? front : a->base_front[k];
    front = (front + AHEAD_ALIGN - 1) / AHEAD_ALIGN * AHEAD_ALIGN;
    capacity = capacity > a->capacity[k] ? capacity : a->capacity[k];
    /* blocks of megabytes on large pages: the kernel's copies into them and the checks'
     * reads out of them miss the TLB less */
    size_t bytes = front + capacity + AHEAD_ALIGN;
    unsigned char *grown = em_io_buffer_alloc(bytes);
    if (grown == NULL)
        return false;
    size_t shift = a->read[k].offset % AHEAD_ALIGN;
    if (keep_front + keep > 0)
        memcpy(grown + front + shift - keep_front, ahead_data(a, k) - keep_front,
               keep_front + keep);
    em_io_buffer_free(a->base[k]);
    a->base[k] = grown;
    a->base_front[k] = front;
    a->capacity[k] = capacity;
    return true;
}

/* Whether reads are left: blocks to the file's end, or runs. */
static bool reads_left(const read_ahead *a)
{
    return !a->ended && (a->runs != NULL ? a->next_run < a->run_count : a->offset < a->end);
}

/* The next read (reads_left): its offset and bytes. */
static block_read plan_read(read_ahead *a)
{
    block_read b = {.fd = a->fd};
    if (a->runs != NULL) {
        b.offset = a->runs[a->next_run].offset;
        b.want = (size_t)a->runs[a->next_run].bytes;
        a->next_run++;
    } else {
        b.offset = a->offset;
        b.want = a->end - a->offset < a->block ? (size_t)(a->end - a->offset) : a->block;
        a->offset += b.want;
    }
    return b;
}

/* Makes buffer k's planned read (a->read[k]), room for it first; without room the read
 * fails with ENOMEM. Only the buffer's holder calls it. */
static void read_into(read_ahead *a, int k)
{
    if (buffer_room(a, k, a->front, a->read[k].want, 0, 0)) {
        a->read[k].to = ahead_data(a, k);
        read_block(&a->read[k]);
    } else {
        a->read[k].error = ENOMEM;
    }
}

/* The read-ahead thread: each free buffer in ring order gets the next read, until none
 * is left, one fails or comes short (the reader reports it when it takes that block),
 * or a stop. */
static void *run_read_ahead(void *argument)
{
    read_ahead *a = argument;
    pthread_mutex_lock(&a->lock);
    for (;;) {
        while (!a->stop && (!reads_left(a) || a->state[a->fill] != AHEAD_FREE))
            pthread_cond_wait(&a->changed, &a->lock);
        if (a->stop)
            break;
        int k = a->fill;
        a->state[k] = AHEAD_READING;
        a->read[k] = plan_read(a);
        size_t want = a->read[k].want;
        a->fill = (k + 1) % AHEAD_BUFFERS;
        pthread_mutex_unlock(&a->lock);
        read_into(a, k);
        pthread_mutex_lock(&a->lock);
        a->state[k] = AHEAD_READY;
        pthread_cond_broadcast(&a->changed);
        if (a->read[k].error != 0 || a->read[k].got < want) {
            a->ended = true; /* nothing after it is read */
            break;
        }
    }
    pthread_mutex_unlock(&a->lock);
    return NULL;
}

/* Starts the thread reading from offset on, into the free buffers from `fill`. */
static em_status read_ahead_run(read_ahead *a, uint64_t offset, em_error *err)
{
    a->stop = false;
    a->offset = offset;
    pthread_mutex_init(&a->lock, NULL);
    pthread_cond_init(&a->changed, NULL);
    int rc = pthread_create(&a->thread, NULL, run_read_ahead, a);
    if (rc != 0) {
        pthread_cond_destroy(&a->changed);
        pthread_mutex_destroy(&a->lock);
        return em_error_set(err, EM_INTERNAL, "cannot start a checkpoint read thread: %s",
                            strerror(rc));
    }
    a->running = true;
    return EM_OK;
}

/* Whether rows.emb (fd, `end` bytes) looks to be in the page cache: pages at five
 * places in it read without waiting for the disk (RWF_NOWAIT). */
static bool file_looks_cached(int fd, uint64_t end)
{
    unsigned char page[4096];
    for (uint64_t part = 0; part < 5; part++) {
        uint64_t at = end / 4 * part;
        if (at >= end)
            at = end - 1;
        struct iovec vector = {.iov_base = page, .iov_len = sizeof(page)};
        if (preadv2(fd, &vector, 1, (off_t)(at & ~(uint64_t)4095), RWF_NOWAIT) <= 0)
            return false;
    }
    return true;
}

/* Starts reading rows.emb (fd, `end` bytes) in blocks of `block` bytes: ahead, on a
 * thread of its own, where that pays. It does where the load waits for the disk: with
 * the disk's reads hidden behind the checks and the imports (a 1.57 GB rows.emb on a
 * guest of 2 vCPUs: 0.45-0.50 s a load against 0.55-0.60 s, tests/bench/RESULTS.md).
 * With the file in the page cache and fewer than 4 CPUs, a third busy thread only
 * takes the CPUs from the reader and the importer (0.40 s against 0.26-0.31 s there):
 * the reader then reads each block itself when it needs it (take_ahead). A load of some
 * buckets (runs) is read ahead only on 4 CPUs or more: on 2 vCPUs it went from
 * 0.47-0.56 s to 0.54-0.70 s for a third of that rows.emb, as it copies its rows
 * (no rows imported in place) and the three threads share two CPUs.
 * em_checkpoint_load_options.read_ahead may decide instead (choice 1: on the thread,
 * -1: here). */
static em_status read_ahead_start(read_ahead *a, int fd, uint64_t end, size_t block,
                                  const ahead_run *runs, size_t run_count, int choice,
                                  em_error *err)
{
    a->fd = fd;
    a->end = end;
    a->block = block;
    a->runs = runs;
    a->run_count = run_count;
    a->next_run = 0;
    a->ended = false;
    a->front = block / 8 < (1u << 20) ? block / 8 : (1u << 20);
    for (int k = 0; k < AHEAD_BUFFERS; k++)
        a->state[k] = AHEAD_FREE;
    a->fill = a->take = 0;
    a->current = a->before = -1;
    a->offset = 0;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    a->threaded = choice > 0 || (choice == 0 && end > 0 &&
                                 (cpus >= 4 || (runs == NULL && !file_looks_cached(fd, end))));
    return a->threaded ? read_ahead_run(a, 0, err) : EM_OK;
}

/* Stops the thread (a read under way ends first); the buffers stay for the next file. */
static void read_ahead_stop(read_ahead *a)
{
    if (!a->running)
        return;
    pthread_mutex_lock(&a->lock);
    a->stop = true;
    pthread_cond_broadcast(&a->changed);
    pthread_mutex_unlock(&a->lock);
    pthread_join(a->thread, NULL);
    pthread_cond_destroy(&a->changed);
    pthread_mutex_destroy(&a->lock);
    a->running = false;
}

/* Reads the next block into the buffer next in ring order, as the thread would. */
static int read_next_here(read_ahead *a)
{
    int k = a->take;
    if (!reads_left(a) || a->state[k] != AHEAD_FREE)
        return -1;
    a->read[k] = plan_read(a);
    read_into(a, k);
    a->ended = a->read[k].error != 0 || a->read[k].got < a->read[k].want; /* none after */
    a->state[k] = AHEAD_TAKEN;
    a->take = (k + 1) % AHEAD_BUFFERS;
    return k;
}

/* Takes the next block, waiting for the thread's read of it (or reading it here when no
 * thread reads ahead): its buffer, or -1 when no more will come (the file's end, or a
 * read that failed or came short before it). */
static int take_ahead(read_ahead *a)
{
    if (!a->threaded)
        return read_next_here(a);
    pthread_mutex_lock(&a->lock);
    int k = a->take;
    while (a->state[k] == AHEAD_READING || (a->state[k] == AHEAD_FREE && reads_left(a)))
        pthread_cond_wait(&a->changed, &a->lock);
    bool ready = a->state[k] == AHEAD_READY;
    if (ready) {
        a->state[k] = AHEAD_TAKEN;
        a->take = (k + 1) % AHEAD_BUFFERS;
    }
    pthread_mutex_unlock(&a->lock);
    return ready ? k : -1;
}

static void release_ahead(read_ahead *a, int k)
{
    if (!a->threaded) {
        a->state[k] = AHEAD_FREE;
        return;
    }
    pthread_mutex_lock(&a->lock);
    a->state[k] = AHEAD_FREE;
    pthread_cond_broadcast(&a->changed);
    pthread_mutex_unlock(&a->lock);
}

/* A block taken: its read's failure, if any, as the load's. */
static em_status read_outcome(const reader *r, const block_read *b, uint64_t chunk,
                              em_error *err)
{
    if (b->error == ENOMEM)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "out of host memory for a read of %zu bytes of rows.emb", b->want);
    if (b->error != 0)
        return data_loss(err, r->dir, "rows.emb",
                         "chunk %" PRIu64 " at byte %" PRIu64 ": read failed: %s", chunk,
                         b->offset + b->got, strerror(b->error));
    return EM_OK;
}

/* A chunk larger than a block: its bytes after the `have` of buffer k (after `kept`
 * from the block before) come from the blocks read ahead, in order, and then from a
 * read of the rest; the thread is stopped meanwhile and goes on after the chunk, its
 * buffers all free but the reader's two. */
static em_status take_large_chunk(reader *r, int k, size_t kept, size_t *have, size_t bytes,
                                  uint64_t chunk, em_error *err)
{
    read_ahead *a = &r->ahead;
    read_ahead_stop(a); /* every read it began has ended */
    em_status status = EM_OK;
    if (!buffer_room(a, k, kept, bytes - kept, kept, *have))
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "out of host memory for chunk %" PRIu64 " of rows.emb (%zu bytes)",
                            chunk, bytes);
    unsigned char *data = ahead_data(a, k);
    for (int m = a->take; status == EM_OK && a->state[m] == AHEAD_READY && kept + *have < bytes;
         m = a->take) {
        status = read_outcome(r, &a->read[m], chunk, err);
        if (status != EM_OK || a->read[m].got > bytes - kept - *have)
            break; /* the chunk ends within it: the rest is read again below */
        size_t got = a->read[m].got;
        memcpy(data + *have, ahead_data(a, m), got);
        *have += got;
        a->state[m] = AHEAD_FREE;
        a->take = (m + 1) % AHEAD_BUFFERS;
    }
    if (status == EM_OK && kept + *have < bytes) {
        block_read rest = {.fd = r->fd, .to = data + *have, .offset = r->position + kept + *have,
                           .want = bytes - kept - *have};
        read_block(&rest);
        status = read_outcome(r, &rest, chunk, err);
        *have += rest.got;
    }
    for (int m = 0; m < AHEAD_BUFFERS; m++)
        if (m != k && m != a->current)
            a->state[m] = AHEAD_FREE;
    a->fill = a->take = (k + 1) % AHEAD_BUFFERS;
    a->offset = r->position + bytes;
    a->ended = false; /* a read past the chunk that failed is tried again, and reported */
    if (status == EM_OK && kept + *have == bytes && a->threaded)
        status = read_ahead_run(a, r->position + bytes, err);
    return status;
}

/* The next block of a read from start to end, from r->position on: the bytes of the
 * current block from there (`kept`: the start of a chunk that straddles the two) and
 * the next block read ahead (a chunk larger than that: take_large_chunk). First the
 * block before the current one goes back to the thread: in place, its rows were the
 * importer's, which is done with them (handing the current block's batch over waited
 * for that one). */
static em_status next_block_ahead(reader *r, size_t bytes, uint64_t chunk, em_error *err)
{
    read_ahead *a = &r->ahead;
    if (a->before >= 0)
        release_ahead(a, a->before);
    a->before = -1;
    bool keeps = a->current >= 0 && r->position >= r->block_start &&
                 r->position < r->block_start + r->block_bytes;
    size_t kept = keeps ? (size_t)(r->block_start + r->block_bytes - r->position) : 0;
    int k = take_ahead(a);
    if (k < 0)
        return data_loss(err, r->dir, "rows.emb",
                         "chunk %" PRIu64 " at byte %" PRIu64 ": the file ends early "
                         "(truncated)", chunk, r->position);
    em_status status = read_outcome(r, &a->read[k], chunk, err);
    if (status == EM_OK && a->read[k].offset != r->position + kept)
        status = em_error_set(err, EM_INTERNAL, "rows.emb read ahead from byte %" PRIu64
                              ", taken at %" PRIu64, a->read[k].offset, r->position + kept);
    size_t have = a->read[k].got;
    if (status == EM_OK && !buffer_room(a, k, kept, have, 0, have))
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED,
                              "out of host memory for a block of %zu bytes of rows.emb",
                              kept + have);
    if (status == EM_OK && kept > 0)
        memcpy(ahead_data(a, k) - kept, r->block + (r->position - r->block_start), kept);
    if (status == EM_OK && kept + have < bytes && a->runs == NULL)
        status = take_large_chunk(r, k, kept, &have, bytes, chunk, err);
    a->before = a->current;
    a->current = k;
    if (status != EM_OK)
        return status;
    r->block = ahead_data(a, k) - kept;
    r->block_start = r->position;
    r->block_bytes = kept + have;
    let_pages_go(r, r->block_start + r->block_bytes, false);
    return EM_OK;
}

/* Makes the bytes at r->position .. + bytes available at *out (in r->block, valid until
 * the next call) and moves past them. Reading on from the file start, blocks of
 * READ_BLOCK_BYTES are read (next_block_ahead), and their bytes go into the file's
 * checksum as they are taken; with an owner (chunks skipped) the runs of owned chunks
 * are read, each at its offset, so a skipped chunk costs no read. In place, the batch
 * that points into the block is handed to the importer before the next bytes are
 * taken, and its block is not read into until the importer is done with it. */
static em_status take_bytes(reader *r, size_t bytes, unsigned char **out, uint64_t chunk,
                            em_error *err)
{
    uint64_t end = r->position + bytes;
    if (bytes > r->m->rows_file.bytes || end > r->m->rows_file.bytes) /* its size was checked */
        return data_loss(err, r->dir, "rows.emb",
                         "chunk %" PRIu64 " at byte %" PRIu64 ": the file ends early "
                         "(truncated)", chunk, r->position);
    if (r->position < r->block_start || end > r->block_start + r->block_bytes) {
        if (r->in_place) { /* the batch's rows are this block's; an empty one hands nothing
                            * over, and then the batch before must be done */
            em_status status = r->batches[r->filling].count > 0
                                   ? flush_batch(r, chunk - 1, err)
                                   : em__pipe_wait(&r->importer, err);
            if (status != EM_OK)
                return status;
        }
        em_status status = next_block_ahead(r, bytes, chunk, err);
        if (status != EM_OK)
            return status;
        if (r->block_bytes < bytes)
            return data_loss(err, r->dir, "rows.emb",
                             "chunk %" PRIu64 " at byte %" PRIu64 ": the file ends early "
                             "(truncated)", chunk, r->position);
    }
    *out = r->block + (r->position - r->block_start);
    if (r->owner_count == 0 && r->m->version < 4) /* the file's checksum is of its bytes */
        XXH3_64bits_update(r->hash, *out, bytes);
    r->position = end;
    r->bytes_read += bytes;
    return EM_OK;
}

/* Reads chunk i and checks it against its header and index entry. */
static em_status read_chunk(reader *r, uint64_t i, const em_index_entry *entry, em_error *err)
{
    const manifest *m = r->m;
    if (entry->offset != r->position)
        return data_loss(err, r->dir, "index.emb",
                         "chunk %" PRIu64 " is at byte %" PRIu64 ", expected %" PRIu64, i,
                         entry->offset, r->position);
    em_chunk_header header;
    unsigned char *bytes = NULL;
    em_status status = take_bytes(r, sizeof(header), &bytes, i, err);
    if (status != EM_OK)
        return status;
    memcpy(&header, bytes, sizeof(header));
    uint64_t header_seen = XXH3_64bits(&header, offsetof(em_chunk_header, header_xxh3));
    size_t row_bytes = m->row_bytes;
    if (memcmp(header.magic, EM_CHUNK_MAGIC, 8) != 0)
        return data_loss(err, r->dir, "rows.emb", "chunk %" PRIu64 ": not a chunk header", i);
    if (header_seen != header.header_xxh3)
        return data_loss(err, r->dir, "rows.emb",
                         "chunk %" PRIu64 ": header checksum mismatch: expected %016" PRIx64
                         ", seen %016" PRIx64, i, header.header_xxh3, header_seen);
    if (header.bucket != entry->bucket || header.rows != entry->rows ||
        header.row_floats != m->row_floats || header.payload_bytes != header.rows * row_bytes ||
        header.payload_xxh3 != entry->payload_xxh3 || header.bucket >= EM_CHECKPOINT_BUCKETS ||
        header.version != m->version)
        return data_loss(err, r->dir, "rows.emb",
                         "chunk %" PRIu64 ": its header does not match index.emb", i);
    status = take_bytes(r, header.payload_bytes, &r->payload, i, err);
    if (status != EM_OK)
        return status;
    uint64_t seen = XXH3_64bits(r->payload, header.payload_bytes);
    if (seen != header.payload_xxh3)
        return data_loss(err, r->dir, "rows.emb",
                         "chunk %" PRIu64 ": checksum mismatch: expected %016" PRIx64
                         ", seen %016" PRIx64, i, header.payload_xxh3, seen);
    for (uint32_t k = 0; k < header.rows; k++) {
        uint64_t key = payload_key(r->payload, k);
        if (em__checkpoint_bucket(key) != header.bucket)
            return data_loss(err, r->dir, "rows.emb",
                             "chunk %" PRIu64 ": key %" PRIu64 " is not of bucket %u", i, key,
                             header.bucket);
    }
    if (r->owner_count == 0 && m->version >= 4) /* the file's checksum is of its chunks' */
        em_rows_digest_add(r->hash, &header);
    return EM_OK;
}

/* With an owner: the runs of owned chunks that follow one another in the file, each up
 * to about a block (index_layout checked the offsets and sizes), so that a run is one
 * read instead of two per chunk, into r->runs; *count gets how many. */
static em_status plan_runs(reader *r, const manifest *m, const em_index_entry *index,
                           size_t *count, em_error *err)
{
    size_t block = block_size(r);
    *count = 0;
    uint64_t end = 0;
    for (uint64_t i = 0; i < m->chunks; i++) {
        if (!owns(r, index[i].bucket) || (*count > 0 && index[i].offset < end))
            continue;
        uint64_t start = index[i].offset;
        end = start;
        for (uint64_t j = i; j < m->chunks && owns(r, index[j].bucket) && index[j].offset == end;
             j++) {
            uint64_t bytes = sizeof(em_chunk_header) + (uint64_t)index[j].rows * m->row_bytes;
            if (j > i && end + bytes - start > block)
                break;
            end += bytes;
        }
        if (*count == r->run_capacity) {
            size_t capacity = r->run_capacity == 0 ? 64 : 2 * r->run_capacity;
            ahead_run *grown = realloc(r->runs, capacity * sizeof(ahead_run));
            if (grown == NULL)
                return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                    "out of host memory for %zu runs of owned chunks of "
                                    "rows.emb", capacity);
            r->runs = grown;
            r->run_capacity = capacity;
        }
        r->runs[(*count)++] = (ahead_run){.offset = start, .bytes = end - start};
    }
    return EM_OK;
}

/* One pass over rows.emb; each chunk's rows go into r->table when it is not NULL. r has
 * the table, the chain's maps and the level set; the rest is set up here. */
static em_status read_rows(reader *r, const char *dir, const manifest *m,
                           const em_index_entry *index, em_error *err)
{
    char path[4400];
    snprintf(path, sizeof(path), "%s/rows.emb", dir);
    r->dir = dir;
    r->m = m;
    r->fd = open(path, O_RDONLY | O_CLOEXEC);
    r->hash = XXH3_createState();
    r->position = 0;
    r->block_start = 0;
    r->block_bytes = 0;
    r->let_go = 0;
    r->table_floats = m->row_floats;
    if (r->table != NULL) {
        em_table_stats stats;
        em_table_get_stats(r->table, &stats);
        r->table_floats = stats.row_floats;
        /* rows read on from the start, as the table keeps them: imported from the blocks */
        r->in_place = !r->weights_only && r->owner_count == 0 &&
                      r->table_floats == m->row_floats;
        const em_optimizer_config *optimizer = &em_table_get_config(r->table)->optimizer;
        r->initial_state = em_optimizer_has_accumulator(optimizer->kind)
                               ? optimizer->initial_accumulator
                               : 0.0f;
    }
    if (r->fd < 0) {
        XXH3_freeState(r->hash);
        return data_loss(err, dir, "rows.emb", "cannot open: %s", strerror(errno));
    }
    em_status status = EM_OK;
    struct stat st;
    if (r->hash == NULL)
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
    else if (fstat(r->fd, &st) != 0 || (uint64_t)st.st_size != m->rows_file.bytes)
        status = data_loss(err, dir, "rows.emb",
                           "%lld bytes, the manifest says %" PRIu64 " (truncated or extended)",
                           (long long)st.st_size, m->rows_file.bytes);
    else
        XXH3_64bits_reset(r->hash);
    /* read from start to end: the kernel may read further ahead; with an owner, the runs
     * of owned chunks. A thread of the load's reads ahead where that pays. */
    size_t runs = 0;
    if (r->owner_count == 0)
        (void)posix_fadvise(r->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    else if (status == EM_OK)
        status = plan_runs(r, m, index, &runs, err);
    if (status == EM_OK)
        status = read_ahead_start(&r->ahead, r->fd, m->rows_file.bytes, block_size(r),
                                  r->owner_count > 0 ? r->runs : NULL, runs,
                                  r->options != NULL ? r->options->read_ahead : 0, err);
    uint64_t rows = 0;
    for (uint64_t i = 0; status == EM_OK && i < m->chunks; i++) {
        if (!owns(r, index[i].bucket))
            continue; /* another server's: index_layout checked where it is */
        if (r->owner_count > 0)
            r->position = index[i].offset;
        uint32_t *held_by = r->bucket_source == NULL
                                ? NULL
                                : &r->bucket_source[index[i].bucket % EM_CHECKPOINT_BUCKETS];
        if (held_by != NULL && *held_by != 0 && *held_by != r->source + 1) {
            status = data_loss(err, dir, "index.emb",
                               "chunk %" PRIu64 ": bucket %u is in checkpoint %s too; the "
                               "checkpoints of one load must be the parts of one cluster, "
                               "each holding buckets no other holds",
                               i, index[i].bucket, r->sources[*held_by - 1]);
            break;
        }
        if (held_by != NULL)
            *held_by = r->source + 1;
        status = read_chunk(r, i, &index[i], err);
        if (status == EM_OK && checked_whole(r))
            status = check_chunk_values(r, i, index[i].rows, err);
        uint32_t kept = index[i].rows;
        if (status == EM_OK)
            status = keep_rows(r, i, &kept, err);
        if (status == EM_OK && r->table != NULL)
            status = batch_chunk(r, i, kept, err);
        rows += index[i].rows;
    }
    if (status == EM_OK && r->table != NULL)
        status = flush_batch(r, m->chunks - 1, err);
    /* the link's rows are in before the next link's read_rows sets the reader up again
     * (in_place and the rest, which the importer reads) */
    if (status == EM_OK && r->table != NULL)
        status = em__pipe_wait(&r->importer, err);
    read_ahead_stop(&r->ahead);
    let_pages_go(r, m->rows_file.bytes, true);
    if (r->owner_count > 0) { /* each chunk read was checked; the others are not read */
        close(r->fd);
        XXH3_freeState(r->hash);
        r->fd = -1;
        r->hash = NULL;
        return status;
    }
    if (status == EM_OK && r->position != m->rows_file.bytes)
        status = data_loss(err, dir, "rows.emb",
                           "%" PRIu64 " bytes after the last chunk the index names",
                           m->rows_file.bytes - r->position);
    if (status == EM_OK && XXH3_64bits_digest(r->hash) != m->rows_file.xxh3)
        status = data_loss(err, dir, "rows.emb",
                           "checksum mismatch: expected %016" PRIx64 ", seen %016" PRIx64,
                           m->rows_file.xxh3, XXH3_64bits_digest(r->hash));
    if (status == EM_OK && rows != m->rows)
        status = data_loss(err, dir, "rows.emb",
                           "%" PRIu64 " rows, the manifest says %" PRIu64, rows, m->rows);
    close(r->fd);
    XXH3_freeState(r->hash);
    r->fd = -1;
    r->hash = NULL;
    return status;
}

/* ---- tombstones.emb -------------------------------------------------------------------- */

/* Reads a link's tombstones and records each as decided by it (a key a newer link
 * decided is left to that link). */
static em_status read_tombstones(reader *r, const char *dir, const manifest *m, em_error *err)
{
    if (m->version < 2)
        return EM_OK; /* full checkpoints only: no tombstones */
    char *data = NULL;
    size_t size = 0;
    size_t expected = sizeof(em_tombstones_header) + m->tombstones * sizeof(uint64_t) +
                      sizeof(uint64_t);
    em_status status = read_listing(dir, "tombstones.emb", expected, &m->tombstones_file, &data,
                                    &size, err);
    em_tombstones_header header;
    if (status == EM_OK && size != expected)
        status = data_loss(err, dir, "tombstones.emb",
                           "%zu bytes for the %" PRIu64 " keys the manifest says (truncated?)",
                           size, m->tombstones);
    if (status == EM_OK) {
        memcpy(&header, data, sizeof(header));
        if (memcmp(header.magic, EM_TOMBSTONES_MAGIC, 8) != 0 || header.count != m->tombstones ||
            header.version != m->version || header.buckets != EM_CHECKPOINT_BUCKETS)
            status = data_loss(err, dir, "tombstones.emb",
                               "its header does not match the manifest (%" PRIu64 " keys)",
                               m->tombstones);
    }
    if (status == EM_OK && m->tombstones > 0 && !m->link.delta)
        status = data_loss(err, dir, "tombstones.emb", "a full checkpoint with tombstones");
    const uint64_t *keys = status == EM_OK ? (const uint64_t *)(data + sizeof(header)) : NULL;
    for (uint64_t i = 0; status == EM_OK && i < m->tombstones; i++) {
        uint64_t key = keys[i], by = 0;
        if (i > 0 && em__checkpoint_key_order(keys[i - 1], key) >= 0)
            status = data_loss(err, dir, "tombstones.emb",
                               "key %" PRIu64 " (number %" PRIu64 ") is out of order or repeated",
                               key, i);
        else if (r->decided != NULL && em__key_map_get(r->decided, key, &by))
            continue;
        else if (r->decided != NULL && !em__key_map_put(r->decided, key, r->level))
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
    }
    free(data);
    return status;
}

/* ---- admission.emb --------------------------------------------------------------------- */

/* Reads a link's admission sketch, checks it, and merges it into table (NULL: verify). */
static em_status read_admission(const char *dir, const manifest *m, em_table *table,
                                em_error *err)
{
    if (!m->has_admission)
        return EM_OK;
    uint64_t counters = m->config.admission.counters;
    size_t expected = sizeof(em_admission_header) + counters + sizeof(uint64_t);
    char *data = NULL;
    size_t size = 0;
    em_status status = read_listing(dir, "admission.emb", expected, &m->admission_file, &data,
                                    &size, err);
    em_admission_header header;
    if (status == EM_OK && size != expected)
        status = data_loss(err, dir, "admission.emb",
                           "%zu bytes for the %" PRIu64 " counters of the table's sketch", size,
                           counters);
    if (status == EM_OK) {
        memcpy(&header, data, sizeof(header));
        if (memcmp(header.magic, EM_ADMISSION_MAGIC, 8) != 0 || header.version != m->version ||
            header.counters != counters)
            status = data_loss(err, dir, "admission.emb",
                               "its header does not match the manifest (%" PRIu64 " counters)",
                               counters);
    }
    /* a table of another sketch size (a warm start into another config) starts afresh */
    if (status == EM_OK && table != NULL && em_table_admission_bytes(table) == counters)
        status = em_table_merge_admission(table, (const uint8_t *)data + sizeof(header),
                                          counters, err);
    free(data);
    return status;
}

/* ---- evicted.emb ----------------------------------------------------------------------- */

/* Reads a link's evicted-key ring, checks it, and gives it to table (NULL: verify). */
static em_status read_evicted(const char *dir, const manifest *m, em_table *table,
                              em_error *err)
{
    if (!m->has_evicted)
        return EM_OK;
    uint32_t ring = m->config.eviction.ring;
    size_t limit = sizeof(em_evicted_header) + ((size_t)ring + 1) * sizeof(uint64_t);
    char *data = NULL;
    size_t size = 0;
    em_status status = read_listing(dir, "evicted.emb", limit, &m->evicted_file, &data, &size,
                                    err);
    em_evicted_header header;
    if (status == EM_OK && size < sizeof(header) + sizeof(uint64_t))
        status = data_loss(err, dir, "evicted.emb", "%zu bytes, less than its header", size);
    if (status == EM_OK) {
        memcpy(&header, data, sizeof(header));
        if (memcmp(header.magic, EM_EVICTED_MAGIC, 8) != 0 || header.version != m->version ||
            header.ring != ring || header.count != (header.total < ring ? header.total : ring) ||
            size != sizeof(header) + (header.count + 1) * sizeof(uint64_t))
            status = data_loss(err, dir, "evicted.emb",
                               "its header (version %u, ring %u, %" PRIu64 " keys of %" PRIu64
                               " removed) does not match the manifest (version %u, ring %u) "
                               "or its %zu bytes", header.version, header.ring, header.count,
                               header.total, m->version, ring, size);
    }
    if (status == EM_OK && table != NULL)
        status = em_table_restore_evicted(table, header.total,
                                          (const uint64_t *)(data + sizeof(header)),
                                          header.count, err);
    free(data);
    return status;
}

/* ---- the chain ------------------------------------------------------------------------- */

/* A chain longer than this is refused (a delta's depth says how long it is). */
#define CHAIN_MAX 100000u

typedef struct link_state {
    char dir[4096];
    manifest m;
    em_index_entry *index; /* read before the rows: a load sizes its table by it */
} link_state;

/* The directory of a checkpoint's parent: a sibling named by the parent's id. */
static void parent_dir(const char *dir, const char *parent_id, char *out, size_t capacity)
{
    size_t length = strlen(dir);
    while (length > 1 && dir[length - 1] == '/')
        length--;
    size_t slash = length;
    while (slash > 0 && dir[slash - 1] != '/')
        slash--;
    if (slash == 0)
        snprintf(out, capacity, "%s", parent_id);
    else
        snprintf(out, capacity, "%.*s%s", (int)slash, dir, parent_id);
}

/* Checks that parent is the link child was made from. */
static em_status check_parent(const link_state *child, const link_state *parent, em_error *err)
{
    const em__chain_link *c = &child->m.link, *p = &parent->m.link;
    if (strcmp(p->id, c->parent_id) != 0)
        return data_loss(err, parent->dir, "manifest.json",
                         "holds checkpoint %s, but its child %s names parent %s here", p->id,
                         c->id, c->parent_id);
    if (p->manifest_xxh3 != c->parent_manifest_xxh3)
        return data_loss(err, child->dir, "manifest.json",
                         "its parent %s does not match: the parent's manifest checksum is "
                         "%016" PRIx64 ", this delta was made from %016" PRIx64, p->id,
                         p->manifest_xxh3, c->parent_manifest_xxh3);
    if (p->depth + 1 != c->depth || strcmp(p->base_id, c->base_id) != 0)
        return data_loss(err, child->dir, "manifest.json",
                         "depth %u on base %s, but its parent %s has depth %u on base %s",
                         c->depth, c->base_id, p->id, p->depth, p->base_id);
    if (parent->m.row_floats != child->m.row_floats || parent->m.config.dim != child->m.config.dim ||
        parent->m.access != child->m.access)
        return data_loss(err, child->dir, "manifest.json",
                         "its parent %s is of another table shape (dim %u, %u floats per row)",
                         p->id, parent->m.config.dim, parent->m.row_floats);
    return EM_OK;
}

/* The checkpoint id that table_dir/LATEST names (id: EM_CHECKPOINT_ID_DIGITS + 1 bytes),
 * checked to be there. NOT_FOUND when there is no LATEST; DATA_LOSS when it holds no id
 * or names a checkpoint that is missing. */
static em_status read_latest(const char *table_dir, char *id, em_error *err)
{
    char path[4400];
    snprintf(path, sizeof(path), "%s/LATEST", table_dir);
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) /* a table named LATEST, in a root */
        return em_error_set(err, EM_NOT_FOUND, "%s: no LATEST file", table_dir);
    FILE *file = fopen(path, "re");
    if (file == NULL)
        return em_error_set(err, EM_NOT_FOUND, "%s: no LATEST", table_dir);
    char line[64] = {0};
    bool read = fgets(line, sizeof(line), file) != NULL;
    fclose(file);
    line[strcspn(line, "\n")] = '\0';
    if (!read || !em__checkpoint_is_id(line))
        return data_loss(err, table_dir, "LATEST", "does not hold a checkpoint id");
    snprintf(path, sizeof(path), "%s/%s", table_dir, line);
    if (stat(path, &st) != 0)
        return data_loss(err, table_dir, "LATEST", "names %s, which is missing", line);
    memcpy(id, line, EM_CHECKPOINT_ID_DIGITS + 1);
    return EM_OK;
}

/* Where dir holds tables' directories of checkpoints (a checkpoint.dir, or a cluster
 * checkpoint's part), out gets ": it holds the checkpoints of tables a, b, ...: name
 * one" (the first few, in directory order), else "". */
static void tables_under(const char *dir, char *out, size_t capacity)
{
    out[0] = '\0';
    DIR *d = opendir(dir);
    if (d == NULL)
        return;
    size_t used = 0, found = 0;
    const struct dirent *entry;
    while ((entry = readdir(d)) != NULL && found < 8) {
        char latest[4400];
        struct stat st;
        snprintf(latest, sizeof(latest), "%s/%s/LATEST", dir, entry->d_name);
        if (entry->d_name[0] == '.' || stat(latest, &st) != 0 || !S_ISREG(st.st_mode))
            continue;
        int n = snprintf(out + used, capacity - used, "%s%s",
                         found == 0 ? ": it holds the checkpoints of tables " : ", ",
                         entry->d_name);
        if (n < 0 || (size_t)n >= capacity - used - 16) {
            out[used] = '\0';
            break;
        }
        used += (size_t)n;
        found++;
    }
    closedir(d);
    if (found > 0)
        snprintf(out + used, capacity - used, ": name one");
}

/* A table's directory of checkpoints (LATEST, and no manifest.json of its own) stands
 * for the checkpoint its LATEST names: *dir gets that checkpoint's path. A directory
 * with none of a checkpoint's files nor LATEST is NOT_FOUND; any other path is taken as
 * it is (a checkpoint that lost its manifest stays DATA_LOSS). */
static em_status resolve_table_dir(const char *path, char *dir, size_t capacity,
                                   em_error *err)
{
    snprintf(dir, capacity, "%s", path);
    char file[4200];
    struct stat st;
    snprintf(file, sizeof(file), "%s/manifest.json", path);
    if (stat(file, &st) == 0 || errno != ENOENT)
        return EM_OK;
    char id[EM_CHECKPOINT_ID_DIGITS + 1];
    em_status status = read_latest(path, id, err);
    if (status == EM_NOT_FOUND) {
        static const char *const parts[] = {"rows.emb", "index.emb", "tombstones.emb"};
        for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
            snprintf(file, sizeof(file), "%s/%s", path, parts[i]);
            if (stat(file, &st) == 0 || errno != ENOENT)
                return EM_OK; /* a checkpoint that lost its manifest: DATA_LOSS */
        }
        if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
            return EM_OK; /* read_manifest names it */
        char tables[256];
        tables_under(path, tables, sizeof(tables));
        return em_error_set(err, EM_NOT_FOUND,
                            "%s is not a checkpoint (no manifest.json, rows.emb or "
                            "index.emb) nor a table's directory of checkpoints (no LATEST "
                            "file)%s",
                            path, tables);
    }
    if (status != EM_OK)
        return status;
    size_t length = strlen(path);
    while (length > 1 && path[length - 1] == '/')
        length--;
    if ((size_t)snprintf(dir, capacity, "%.*s/%s", (int)length, path, id) >= capacity)
        return em_error_set(err, EM_INVALID_ARGUMENT, "checkpoint path under '%.256s' is too long",
                            path);
    return EM_OK;
}

/* Reads the manifests from path back to its full checkpoint: (*links)[0] is path's (a
 * table's directory standing for its latest checkpoint: resolve_table_dir). */
static em_status resolve_chain(const char *path, link_state **links, size_t *count,
                               em_error *err)
{
    *count = 0;
    size_t capacity = 1;
    *links = calloc(capacity, sizeof(link_state));
    if (*links == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
    char resolved[sizeof((*links)[0].dir)]; /* *links moves as the chain grows */
    em_status status = resolve_table_dir(path, resolved, sizeof(resolved), err);
    if (status != EM_OK)
        return status;
    path = resolved;
    snprintf((*links)[0].dir, sizeof((*links)[0].dir), "%s", path);
    status = read_manifest(path, &(*links)[0].m, err);
    /* a checkpoint in a directory named by an id is the checkpoint of that id */
    char name[4096];
    parent_dir(path, "", name, sizeof(name));
    const char *base = path + strlen(name);
    size_t length = strcspn(base, "/");
    if (status == EM_OK && length == EM_CHECKPOINT_ID_DIGITS &&
        strspn(base, "0123456789") == length &&
        strncmp(base, (*links)[0].m.link.id, length) != 0)
        status = data_loss(err, path, "manifest.json",
                           "holds checkpoint %s, but its directory is named %.*s",
                           (*links)[0].m.link.id, (int)length, base);
    if (status == EM_OK)
        *count = 1;
    while (status == EM_OK && (*links)[*count - 1].m.link.delta) {
        if (*count == capacity) {
            capacity = capacity * 2 > CHAIN_MAX ? CHAIN_MAX : capacity * 2;
            link_state *grown = *count == CHAIN_MAX
                                    ? NULL
                                    : realloc(*links, capacity * sizeof(link_state));
            if (grown == NULL) {
                status = em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                      "checkpoint %s: a chain longer than %zu links", path,
                                      *count);
                break;
            }
            *links = grown;
        }
        link_state *child = &(*links)[*count - 1], *parent = &(*links)[*count];
        memset(parent, 0, sizeof(*parent));
        parent_dir(child->dir, child->m.link.parent_id, parent->dir, sizeof(parent->dir));
        status = read_manifest(parent->dir, &parent->m, err);
        if (status == EM_NOT_FOUND)
            status = data_loss(err, child->dir, "manifest.json",
                               "its parent %s is missing (%s): the chain has a gap",
                               child->m.link.parent_id, parent->dir);
        if (status == EM_OK)
            status = check_parent(child, parent, err);
        if (status == EM_OK)
            (*count)++;
    }
    return status;
}

/* ---- verify and load -------------------------------------------------------------------- */

static double monotonic_seconds(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec / 1e9;
}

/* A load that reads only some chunks checks instead that the index lays the chunks
 * end to end over the whole of rows.emb, each where the one before it ends. */
static em_status check_index_layout(const link_state *link, em_error *err)
{
    const manifest *m = &link->m;
    uint64_t at = 0, row_bytes = m->row_bytes;
    for (uint64_t i = 0; i < m->chunks; i++) {
        const em_index_entry *entry = &link->index[i];
        if (entry->offset != at || entry->bucket >= EM_CHECKPOINT_BUCKETS)
            return data_loss(err, link->dir, "index.emb",
                             "chunk %" PRIu64 " (bucket %u) is at byte %" PRIu64
                             ", expected %" PRIu64, i, entry->bucket, entry->offset, at);
        at += sizeof(em_chunk_header) + entry->rows * row_bytes;
    }
    if (at != m->rows_file.bytes)
        return data_loss(err, link->dir, "index.emb",
                         "its chunks end at byte %" PRIu64 ", rows.emb has %" PRIu64, at,
                         m->rows_file.bytes);
    return EM_OK;
}

/* Reads every link's index (checked against its manifest), and sums what the load
 * reads of the rows files and the rows of the owned chunks. */
static em_status read_indexes(const reader *r, link_state *links, size_t count,
                              uint64_t *bytes, uint64_t *rows, em_error *err)
{
    em_status status = EM_OK;
    for (size_t i = 0; status == EM_OK && i < count; i++) {
        uint64_t row_bytes = links[i].m.row_bytes;
        status = read_index(links[i].dir, &links[i].m, &links[i].index, err);
        if (status == EM_OK && r->owner_count > 0)
            status = check_index_layout(&links[i], err);
        for (uint64_t c = 0; status == EM_OK && c < links[i].m.chunks; c++)
            if (owns(r, links[i].index[c].bucket)) {
                *rows += links[i].index[c].rows;
                *bytes += sizeof(em_chunk_header) + links[i].index[c].rows * row_bytes;
            }
    }
    return status;
}

/* Reads every link of the chain, newest first, into table (NULL: verify only). */
static em_status read_links(reader *r, const link_state *links, size_t count, em_error *err)
{
    em_status status = EM_OK;
    for (size_t i = 0; status == EM_OK && i < count; i++) {
        r->level = i;
        status = read_tombstones(r, links[i].dir, &links[i].m, err);
        if (status == EM_OK)
            status = read_rows(r, links[i].dir, &links[i].m, links[i].index, err);
    }
    return status;
}

static void free_links(link_state *links, size_t count)
{
    for (size_t i = 0; links != NULL && i < count; i++)
        free(links[i].index);
    free(links);
}

static void free_reader(reader *r)
{
    free(r->runs);
    free(r->keys);
    for (int k = 0; k < AHEAD_BUFFERS; k++)
        em_io_buffer_free(r->ahead.base[k]);
    free(r->bucket_source);
    for (int k = 0; k < 2; k++) {
        free(r->batches[k].keys);
        free(r->batches[k].values);
        free(r->batches[k].rows);
        free(r->batches[k].access);
    }
    free(r->kept);
}

/* The table was loaded whole from the checkpoint target (the newest link of its
 * chain): its next save may be a delta of it (tracking: *digests is taken), and, when
 * the table is that checkpoint's as saved (holds), needs writing nothing while nothing
 * changes the table. Called after everything the load sets in the table. */
static em_status attach_base(em_table *table, const link_state *target, bool tracking,
                             bool holds, em__key_map *digests, em_error *err)
{
    em__delta_base *base = calloc(1, sizeof(*base));
    if (base == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
    const em__chain_link *link = &target->m.link;
    memcpy(base->path, target->dir, sizeof(base->path)); /* both 4096 */
    snprintf(base->id, sizeof(base->id), "%s", link->id);
    snprintf(base->base_id, sizeof(base->base_id), "%s", link->base_id);
    base->depth = link->depth;
    base->manifest_xxh3 = link->manifest_xxh3;
    base->row_floats = target->m.row_floats;
    base->tracked = tracking;
    base->holds_table = holds;
    if (tracking) {
        base->digests = *digests;
        memset(digests, 0, sizeof(*digests));
    }
    base->changes = em_table_changes(table);
    em_table_set_attachment(table, base, em__delta_base_free);
    return EM_OK;
}

/* Whether a table loaded from a checkpoint kept the config it was saved with (its name,
 * capacity and shards too, which a load may change). */
static bool config_as_saved(const em_table *table, const manifest *m)
{
    const em_table_config *config = em_table_get_config(table);
    return config->capacity == m->config.capacity && config->shards == m->config.shards &&
           strcmp(config->name, m->config.name) == 0;
}

/* The sources of one load: each a checkpoint's chain, newest link first. */
typedef struct source {
    link_state *links;
    size_t count;
} source;

/* The shape two checkpoints must share to fill one table: the table config but for
 * its name, capacity and shards, which a load may change. */
static char *config_shape(const em_table_config *config)
{
    em_table_config copy = *config;
    memset(copy.name, 0, sizeof(copy.name));
    copy.capacity = 0;
    copy.shards = 0;
    cJSON *json = em_table_config_to_json(&copy);
    char *text = json != NULL ? cJSON_PrintUnformatted(json) : NULL;
    cJSON_Delete(json);
    return text;
}

/* Resolves every source's chain and checks that they are of one table, and each of
 * the manifest the caller expects. */
static em_status resolve_sources(const char *const *paths, size_t count,
                                 const em_checkpoint_load_options *options, source *sources,
                                 em_error *err)
{
    em_status status = EM_OK;
    char *shape = NULL;
    for (size_t s = 0; status == EM_OK && s < count; s++) {
        status = resolve_chain(paths[s], &sources[s].links, &sources[s].count, err);
        const manifest *m = status == EM_OK ? &sources[s].links[0].m : NULL;
        if (status == EM_OK && options != NULL && options->manifest_xxh3 != NULL &&
            m->link.manifest_xxh3 != options->manifest_xxh3[s])
            status = data_loss(err, paths[s], "manifest.json",
                               "its checksum is %016" PRIx64 ", the load expects %016" PRIx64
                               " (another checkpoint than the one recorded)",
                               m->link.manifest_xxh3, options->manifest_xxh3[s]);
        if (status != EM_OK || count == 1)
            continue;
        char *own = config_shape(&m->config);
        if (own == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
        else if (shape == NULL)
            shape = own, own = NULL;
        else if (strcmp(own, shape) != 0)
            status = em_error_set(err, EM_INVALID_ARGUMENT,
                                  "checkpoint %s is of another table than %s: its config is "
                                  "%s, the first's %s", paths[s], paths[0], own, shape);
        free(own);
    }
    free(shape);
    return status;
}

/* Verifies (backend NULL) or loads the checkpoints at paths, each with its chain, into
 * one table; weights_into, when not NULL, is the config of the table to create with the
 * weights only. */
static em_status read_checkpoints(const char *const *paths, size_t count, em_backend *backend,
                                  const char *name, const em_table_config *weights_into,
                                  const em_checkpoint_load_options *options, em_table **out,
                                  em_checkpoint_info *info, em_error *err)
{
    double start = monotonic_seconds();
    em_table *table = NULL;
    if (count == 0)
        return em_error_set(err, EM_INVALID_ARGUMENT, "a load needs at least one checkpoint");
    source *sources = calloc(count, sizeof(*sources));
    if (sources == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
    reader r = {.weights_only = weights_into != NULL, .options = options};
    if (options != NULL && options->owner_count > 0) {
        r.owner_index = options->owner_index;
        r.owner_count = options->owner_count;
    }
    em_status status = EM_OK;
    if (r.owner_count > 0 && r.owner_index >= r.owner_count)
        status = em_error_set(err, EM_INVALID_ARGUMENT,
                              "load: server %u of a cluster of %u does not exist (0..%u)",
                              r.owner_index, r.owner_count, r.owner_count - 1);
    if (status == EM_OK)
        status = resolve_sources(paths, count, options, sources, err);
    /* what the table holds at most: the owned chunks' rows (the newest links of a chain
     * may repeat keys of older ones), and never more than the tables saved */
    uint64_t bound = 0, table_rows = 0;
    bool chains = false;
    for (size_t s = 0; status == EM_OK && s < count; s++) {
        uint64_t rows = 0;
        status = read_indexes(&r, sources[s].links, sources[s].count, &r.total_bytes, &rows,
                              err);
        const manifest *newest = &sources[s].links[0].m;
        bound += rows < newest->table_rows ? rows : newest->table_rows;
        table_rows += newest->table_rows;
        chains = chains || sources[s].count > 1;
    }
    const manifest *m = status == EM_OK ? &sources[0].links[0].m : NULL;
    em_table_config config;
    if (status == EM_OK && backend != NULL) {
        config = m->config;
        if (name != NULL && em_table_name_check(name, err) != EM_OK)
            status = EM_INVALID_ARGUMENT;
        else if (name != NULL)
            snprintf(config.name, sizeof(config.name), "%s", name);
        if (status == EM_OK && weights_into != NULL) {
            if (weights_into->dim != m->config.dim)
                status = em_error_set(err, EM_INVALID_ARGUMENT,
                                      "checkpoint %s: its table has dim %u, table '%s' has dim "
                                      "%u", paths[0], m->config.dim, weights_into->name,
                                      weights_into->dim);
            /* the table keeps its config, its capacity too: raising it would be a change
             * of the table nobody asked for */
            else if (bound > weights_into->capacity)
                status = em_error_set(err, EM_INVALID_ARGUMENT,
                                      "checkpoint %s: its %" PRIu64 " rows are more than the "
                                      "capacity %" PRIu64 " of table '%s' (a weights-only load "
                                      "keeps the table's config: raise its capacity, or load "
                                      "the checkpoint as a table of its own)",
                                      paths[0], bound, weights_into->capacity, weights_into->name);
            config = *weights_into;
        }
        if (options != NULL && options->shards > 0)
            config.shards = options->shards;
        if (status == EM_OK && config.capacity < bound)
            config.capacity = bound;
        /* the rows come in the saved table's map order: hash them with another seed,
         * one that the same checkpoint always gets */
        if (status == EM_OK)
            status = em_table_create_seeded(backend, &config,
                                            em_mix64(m->link.manifest_xxh3) | 1u, &table, err);
    }
    /* the maps take the rows' keys without growing step by step: the rows are known
     * exactly unless a server's part of a chain is loaded (then fewer may come) */
    uint64_t reserved = r.owner_count == 0 ? table_rows : chains ? 0 : bound;
    if (status == EM_OK && table != NULL && reserved > 0)
        status = em_table_reserve(table, reserved, err);
    r.table = table;
    r.access = table != NULL &&
               em_eviction_tracks_access(&em_table_get_config(table)->eviction);
    /* a table loaded whole from one checkpoint, its rows' access metadata from it too
     * (else rows get fresh metadata, not digested), can be the parent of a delta */
    bool whole = count == 1 && r.owner_count == 0 && weights_into == NULL;
    bool rows_as_saved = table != NULL && whole && r.access == m->access;
    bool tracking = rows_as_saved && options != NULL && options->track_changes;
    em__key_map decided = {0}, digests = {0};
    if (status == EM_OK && tracking && !em__key_map_init(&digests, m->table_rows))
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED,
                              "out of host memory for the keys of %" PRIu64 " rows",
                              m->table_rows);
    r.digests = tracking ? &digests : NULL;
    if (status == EM_OK && table != NULL)
        status = em__pipe_start(&r.importer, import_batch_rows, &r, err);
    if (status == EM_OK && count > 1) {
        r.sources = paths;
        r.bucket_source = calloc(EM_CHECKPOINT_BUCKETS, sizeof(uint32_t));
        if (r.bucket_source == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
    }
    for (size_t s = 0; status == EM_OK && s < count; s++) {
        /* a key is taken once per chain, and a bucket from one source only */
        r.source = (uint32_t)s;
        em__key_map_free(&decided);
        r.decided = NULL;
        if (sources[s].count > 1) {
            if (!em__key_map_init(&decided, sources[s].links[0].m.table_rows)) {
                status = em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                      "out of host memory for the keys of %" PRIu64 " rows",
                                      sources[s].links[0].m.table_rows);
                break;
            }
            r.decided = &decided;
        }
        status = read_links(&r, sources[s].links, sources[s].count, err);
    }
    em_error imported;
    em_status importing = em__pipe_finish(&r.importer, &imported);
    if (status == EM_OK && importing != EM_OK) {
        status = importing;
        em_error_copy(err, &imported);
    }
    free_reader(&r);
    /* the rows restored: each key once, from the newest link that has it */
    uint64_t restored = r.taken;
    if (status == EM_OK && table != NULL) {
        em_table_stats stats;
        em_table_get_stats(table, &stats);
        restored = stats.rows;
    }
    /* every key of the tables saved, or of the buckets owned when no chain could have
     * replaced a row of an older link */
    uint64_t expected = r.owner_count == 0 ? table_rows : chains ? restored : bound;
    if (status == EM_OK && restored != expected && count == 1)
        status = data_loss(err, paths[0], "manifest.json",
                           "the table it restores has %" PRIu64 " rows, the checkpoint%s "
                           "holds %" PRIu64 " distinct keys",
                           expected, chains ? "'s chain" : "", restored);
    else if (status == EM_OK && restored != expected)
        status = data_loss(err, paths[0], "manifest.json",
                           "the tables its %zu checkpoints restore have %" PRIu64 " rows, "
                           "they hold %" PRIu64 " distinct keys", count, expected, restored);
    /* the admission sketches of the newest links, merged (each counter the largest); an
     * older link's is checked only */
    for (size_t s = 0; s < count; s++)
        for (size_t i = 0; status == EM_OK && i < sources[s].count; i++)
            status = read_admission(sources[s].links[i].dir, &sources[s].links[i].m,
                                    i == 0 ? table : NULL, err);
    /* the evicted-key ring of the newest link, into a table loaded whole from one
     * checkpoint (the ring follows the table's own removals: of a part of a cluster, or
     * of weights only, it starts afresh); an older link's is checked only */
    for (size_t s = 0; s < count; s++)
        for (size_t i = 0; status == EM_OK && i < sources[s].count; i++)
            status = read_evicted(sources[s].links[i].dir, &sources[s].links[i].m,
                                  i == 0 && whole ? table : NULL, err);
    /* the clocks the rows' metadata counts in: the largest of the sources'; when every
     * row's metadata came with it, the ticks of the imports themselves are dropped */
    bool every_row_access = r.access;
    for (size_t s = 0; s < count; s++)
        every_row_access = every_row_access && sources[s].links[0].m.access;
    for (size_t s = 0; status == EM_OK && r.access && s < count; s++)
        if (sources[s].links[0].m.access)
            em_table_set_clocks(table, &sources[s].links[0].m.clocks,
                                every_row_access && s == 0);
    bool as_saved = status == EM_OK && rows_as_saved && config_as_saved(table, m);
    if (status == EM_OK && (tracking || as_saved))
        status = attach_base(table, &sources[0].links[0], tracking, as_saved, &digests, err);
    em__key_map_free(&decided);
    em__key_map_free(&digests);
    if (status == EM_OK && info != NULL) {
        memset(info, 0, sizeof(*info));
        snprintf(info->table, sizeof(info->table), "%s",
                 table != NULL ? em_table_name(table) : m->config.name);
        snprintf(info->id, sizeof(info->id), "%s", m->link.id);
        snprintf(info->path, sizeof(info->path), "%s", sources[0].links[0].dir);
        snprintf(info->kind, sizeof(info->kind), "%s", m->link.delta ? "delta" : "full");
        snprintf(info->parent, sizeof(info->parent), "%s", m->link.parent_id);
        info->depth = m->link.depth;
        info->manifest_xxh3 = m->link.manifest_xxh3;
        info->tombstones = m->tombstones;
        info->rows = count > 1 || r.owner_count > 0 ? r.taken : m->rows;
        info->table_rows = count > 1 || r.owner_count > 0 ? restored : m->table_rows;
        info->chunks = m->chunks;
        info->bytes = m->rows_file.bytes + m->index_file.bytes + m->tombstones_file.bytes +
                      (m->has_admission ? m->admission_file.bytes : 0) +
                      (m->has_evicted ? m->evicted_file.bytes : 0);
        info->created_unix_ms = m->created_unix_ms;
        info->seconds = monotonic_seconds() - start;
    }
    for (size_t s = 0; s < count; s++)
        free_links(sources[s].links, sources[s].count);
    free(sources);
    if (status != EM_OK) {
        em_table_destroy(table);
        return status;
    }
    if (out != NULL)
        *out = table;
    return EM_OK;
}

static em_status read_checkpoint(const char *path, em_backend *backend, const char *name,
                                 const em_table_config *weights_into,
                                 const em_checkpoint_load_options *options, em_table **out,
                                 em_checkpoint_info *info, em_error *err)
{
    return read_checkpoints(&path, 1, backend, name, weights_into, options, out, info, err);
}

em_status em_checkpoint_verify(const char *path, em_checkpoint_info *info, em_error *err)
{
    return read_checkpoint(path, NULL, NULL, NULL, NULL, NULL, info, err);
}

em_status em_checkpoint_load(const char *path, em_backend *backend, const char *name,
                             const em_checkpoint_load_options *options, em_table **out,
                             em_checkpoint_info *info, em_error *err)
{
    return read_checkpoint(path, backend, name, NULL, options, out, info, err);
}

em_status em_checkpoint_load_sources(const char *const *paths, size_t count,
                                     em_backend *backend, const char *name,
                                     const em_checkpoint_load_options *options, em_table **out,
                                     em_checkpoint_info *info, em_error *err)
{
    return read_checkpoints(paths, count, backend, name, NULL, options, out, info, err);
}

em_status em_checkpoint_verify_sources(const char *const *paths, size_t count,
                                       const uint64_t *manifest_xxh3, em_checkpoint_info *info,
                                       em_error *err)
{
    em_checkpoint_load_options options = {.manifest_xxh3 = manifest_xxh3};
    return read_checkpoints(paths, count, NULL, NULL, NULL, &options, NULL, info, err);
}

em_status em_checkpoint_load_weights(const char *path, em_backend *backend,
                                     const em_table_config *config, em_table **out,
                                     em_checkpoint_info *info, em_error *err)
{
    return read_checkpoint(path, backend, NULL, config, NULL, out, info, err);
}

em_status em__checkpoint_read_link(const char *path, em__chain_link *link, em_error *err)
{
    manifest m;
    memset(&m, 0, sizeof(m));
    em_status status = read_manifest(path, &m, err);
    if (status == EM_OK)
        *link = m.link;
    return status;
}

/* ---- the checkpoint directory --------------------------------------------------------- */

em_status em_checkpoint_latest(const char *dir, const char *table, char *path, size_t capacity,
                               em_error *err)
{
    char table_dir[4200];
    snprintf(table_dir, sizeof(table_dir), "%s/%s", dir, table);
    char id[EM_CHECKPOINT_ID_DIGITS + 1];
    em_status status = read_latest(table_dir, id, err);
    if (status == EM_NOT_FOUND)
        return em_error_set(err, EM_NOT_FOUND, "table '%s' has no checkpoint in %s", table, dir);
    if (status != EM_OK)
        return status;
    if ((size_t)snprintf(path, capacity, "%s/%s", table_dir, id) >= capacity)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "checkpoint path under '%.256s' for table '%s' is too long", dir,
                            table);
    return EM_OK;
}

static int compare_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

void em_checkpoint_free_names(char **names, size_t count)
{
    for (size_t i = 0; names != NULL && i < count; i++)
        free(names[i]);
    free(names);
}

em_status em_checkpoint_tables(const char *dir, char ***names, size_t *count, em_error *err)
{
    *names = NULL;
    *count = 0;
    DIR *d = opendir(dir);
    if (d == NULL) {
        if (errno == ENOENT)
            return EM_OK;
        return em_error_set(err, EM_INTERNAL, "cannot read %s: %s", dir, strerror(errno));
    }
    size_t capacity = 0;
    em_status status = EM_OK;
    struct dirent *entry;
    while (status == EM_OK && (entry = readdir(d)) != NULL) {
        if (entry->d_name[0] == '.')
            continue;
        char latest[4400];
        snprintf(latest, sizeof(latest), "%s/%s/LATEST", dir, entry->d_name);
        if (access(latest, F_OK) != 0)
            continue;
        if (*count == capacity) {
            capacity = capacity == 0 ? 8 : capacity * 2;
            char **grown = realloc(*names, capacity * sizeof(char *));
            if (grown == NULL) {
                status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
                break;
            }
            *names = grown;
        }
        (*names)[*count] = strdup(entry->d_name);
        if ((*names)[*count] == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
        else
            (*count)++;
    }
    closedir(d);
    if (status != EM_OK) {
        em_checkpoint_free_names(*names, *count);
        *names = NULL;
        *count = 0;
        return status;
    }
    if (*count > 1)
        qsort(*names, *count, sizeof(char *), compare_names);
    return EM_OK;
}

static int compare_infos(const void *a, const void *b)
{
    return strcmp(((const em_checkpoint_info *)a)->id, ((const em_checkpoint_info *)b)->id);
}

em_status em_checkpoint_list(const char *dir, const char *table, em_checkpoint_info **infos,
                             size_t *count, em_error *err)
{
    *infos = NULL;
    *count = 0;
    char latest[4400], table_dir[4200];
    snprintf(table_dir, sizeof(table_dir), "%s/%s", dir, table);
    em_status status = em_checkpoint_latest(dir, table, latest, sizeof(latest), err);
    if (status != EM_OK)
        return status;
    const char *latest_id = strrchr(latest, '/') + 1;
    DIR *d = opendir(table_dir);
    if (d == NULL)
        return em_error_set(err, EM_INTERNAL, "cannot read %s: %s", table_dir, strerror(errno));
    size_t capacity = 0;
    struct dirent *entry;
    while ((entry = readdir(d)) != NULL) {
        /* published ones only: ids up to LATEST's */
        if (!em__checkpoint_is_id(entry->d_name) || strcmp(entry->d_name, latest_id) > 0)
            continue;
        if (*count == capacity) {
            capacity = capacity == 0 ? 8 : capacity * 2;
            em_checkpoint_info *grown = realloc(*infos, capacity * sizeof(**infos));
            if (grown == NULL) {
                closedir(d);
                free(*infos);
                *infos = NULL;
                *count = 0;
                return em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
            }
            *infos = grown;
        }
        em_checkpoint_info *info = &(*infos)[(*count)++];
        memset(info, 0, sizeof(*info));
        snprintf(info->table, sizeof(info->table), "%s", table);
        memcpy(info->id, entry->d_name, EM_CHECKPOINT_ID_DIGITS + 1); /* an id: 20 digits */
        if (snprintf(info->path, sizeof(info->path), "%s/%s", table_dir, entry->d_name) < 0)
            info->path[0] = '\0';
    }
    closedir(d);
    if (*count > 1)
        qsort(*infos, *count, sizeof(**infos), compare_infos);
    manifest *m = malloc(sizeof(*m));
    if (m == NULL) {
        free(*infos);
        *infos = NULL;
        *count = 0;
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "out of host memory");
    }
    for (size_t i = 0; i < *count; i++) { /* each manifest's figures, checked by its checksum */
        em_checkpoint_info *info = &(*infos)[i];
        em_error ignored;
        memset(m, 0, sizeof(*m));
        if (read_manifest(info->path, m, &ignored) != EM_OK) {
            snprintf(info->kind, sizeof(info->kind), "?");
            continue;
        }
        snprintf(info->kind, sizeof(info->kind), "%s", m->link.delta ? "delta" : "full");
        snprintf(info->parent, sizeof(info->parent), "%s", m->link.parent_id);
        info->depth = m->link.depth;
        info->rows = m->rows;
        info->tombstones = m->tombstones;
        info->table_rows = m->table_rows;
        info->chunks = m->chunks;
        info->created_unix_ms = m->created_unix_ms;
        info->manifest_xxh3 = m->link.manifest_xxh3;
        info->bytes = m->rows_file.bytes + m->index_file.bytes + m->tombstones_file.bytes +
                      (m->has_admission ? m->admission_file.bytes : 0) +
                      (m->has_evicted ? m->evicted_file.bytes : 0);
    }
    free(m);
    return EM_OK;
}
