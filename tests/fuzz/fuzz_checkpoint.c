/*
 * libFuzzer harness: the checkpoint reader (lib/checkpoint). The first input builds, once,
 * a small table with every file a checkpoint can hold (adam, lru eviction with its ring,
 * counter admission), saved as a full checkpoint and a delta on it (erased keys, so
 * tombstones). Each input then rewrites one file of the delta or of its parent, and
 * loads or verifies the chain:
 *
 *   byte 0  bits 0-2  the file: manifest.json, rows.emb, index.emb, tombstones.emb,
 *                     admission.emb, evicted.emb, the table's LATEST, manifest.json
 *           bit 3     the parent (the full checkpoint) instead of the delta
 *           bits 4-5  how: 0 edits, then every checksum fixed (so that the reader's
 *                     checks past the checksums are reached: counts, sizes, offsets,
 *                     buckets, values, the chain's links); 1 edits only; 2 the file
 *                     replaced by the rest of the input; 3 resized to the next two
 *                     bytes' length, then edits and checksums fixed
 *           bits 6-7  what: load, verify (and list the table's checkpoints), load
 *                     the weights only into another optimizer, load the buckets of
 *                     server 1 of 3
 *   byte 1  bit 0 read ahead on a thread; bit 1 blocks of 4 KiB; bits 2-3 shards
 *   then    edits of 3 bytes: an offset (u16, modulo the file's size) and its new byte
 *
 * What must hold: every refusal says why; a load and a verify of the same files agree
 * on whether they are whole (a load refused for what verify accepts, or the reverse,
 * aborts with both answers); the unedited checkpoint loads; and no crash, leak or
 * unbounded allocation (the harness's limit) whatever the manifest claims.
 */
#include <fcntl.h>
#include <ftw.h>
#include <stddef.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cJSON.h>
#include <xxhash.h>

#include "lib/checkpoint/checkpoint.h"
#include "lib/checkpoint/checkpoint_format.h"
#include "lib/device/backend.h"
#include "lib/table/table.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define DIM 2
#define CAPACITY 24
#define FILE_COUNT 7 /* the checkpoint's six, and LATEST */
#define LATEST_FILE 6

static const char *const file_names[FILE_COUNT] = {
    "manifest.json", "rows.emb", "index.emb", "tombstones.emb", "admission.emb", "evicted.emb",
    "LATEST",
};

typedef struct blob {
    uint8_t *bytes;
    size_t size;
} blob;

/* The saved checkpoints, as bytes: [0] the full one, [1] the delta on it. */
typedef struct fixture {
    char root[256];        /* the checkpoint dir: <root>/f/<id>/ */
    char table_dir[300];
    char paths[2][320];    /* each checkpoint's directory */
    blob files[2][FILE_COUNT];
    em_backend *backend;
} fixture;

static fixture fx;

static void die(const char *what, const em_error *err)
{
    fprintf(stderr, "fuzz_checkpoint: %s: %s\n", what, err != NULL ? err->message : "");
    abort();
}

static blob read_blob(const char *path)
{
    blob b = {NULL, 0};
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return b; /* a file this checkpoint does not have */
    struct stat st;
    if (fstat(fd, &st) != 0)
        abort();
    b.size = (size_t)st.st_size;
    b.bytes = malloc(b.size + 1);
    if (b.bytes == NULL || read(fd, b.bytes, b.size) != (ssize_t)b.size)
        abort();
    close(fd);
    return b;
}

static void write_blob(const char *path, const blob *b)
{
    if (b->bytes == NULL) {
        unlink(path);
        return;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || (b->size > 0 && write(fd, b->bytes, b->size) != (ssize_t)b->size))
        abort();
    close(fd);
}

static void file_path(char *out, size_t size, int checkpoint, int file)
{
    if (file == LATEST_FILE)
        snprintf(out, size, "%s/LATEST", fx.table_dir);
    else
        snprintf(out, size, "%s/%s", fx.paths[checkpoint], file_names[file]);
}

static uint64_t key_of(uint64_t i)
{
    return i * 0x9e3779b97f4a7c15ull + 1;
}

/* Pushes keys key_of(first) ... key_of(first + count - 1). */
static void push_keys(em_table *table, uint64_t first, uint64_t count)
{
    uint64_t keys[64];
    uint32_t offsets[65];
    float gradients[64 * DIM];
    for (uint64_t i = 0; i < count; i++) {
        keys[i] = key_of(first + i);
        offsets[i] = (uint32_t)i;
    }
    offsets[count] = (uint32_t)count;
    for (size_t i = 0; i < count * DIM; i++)
        gradients[i] = 0.25f - 0.01f * (float)i;
    em_push_request request = {
        .batch = {.rows = (uint32_t)count, .nnz = (uint32_t)count, .offsets = offsets,
                  .keys = keys},
        .combiner = EM_COMBINER_NONE,
        .gradients = gradients,
        .gradient_count = count * DIM,
    };
    em_push_result result;
    em_error err;
    if (em_table_push(table, &request, &result, &err) != EM_OK)
        die("push", &err);
}

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *at)
{
    (void)st;
    (void)type;
    (void)at;
    remove(path);
    return 0;
}

/* The fixture's directory goes when the fuzzer exits (its time is up, or it stops). */
static void remove_fixture(void)
{
    nftw(fx.root, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static void build_fixture(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(fx.root, sizeof(fx.root), "%s/ember-fuzz-checkpoint-XXXXXX",
             tmp != NULL && tmp[0] != '\0' ? tmp : "/tmp");
    if (mkdtemp(fx.root) == NULL) /* the X's: mkdtemp's template for a unique name */
        abort();
    atexit(remove_fixture);
    snprintf(fx.table_dir, sizeof(fx.table_dir), "%s/f", fx.root);

    em_cpu_backend_options cpu;
    em_cpu_backend_options_init(&cpu);
    cpu.devices = 1;
    /* what a manifest's claims may make a load reserve */
    cpu.pool_limit_bytes = 64u << 20;
    cpu.pool_initial_bytes = 4u << 20;
    cpu.pool_growth_bytes = 4u << 20;
    cpu.eviction_threads = 1;
    em_error err;
    if (em_backend_create_cpu(&cpu, &fx.backend, &err) != EM_OK)
        die("backend", &err);

    em_table_config config;
    em_table_config_init(&config, "f", DIM, CAPACITY);
    config.shards = 2;
    config.optimizer.kind = EM_OPTIMIZER_ADAM;
    config.optimizer.learning_rate = 0.01;
    config.eviction.policy = EM_EVICTION_LRU;
    config.eviction.ring = 8;
    config.admission.policy = EM_ADMISSION_COUNTER;
    config.admission.threshold = 2;
    config.admission.counters = 1024;
    em_table *table = NULL;
    if (em_table_create(fx.backend, &config, &table, &err) != EM_OK)
        die("create", &err);
    /* each seen twice, so admitted; more than the capacity, so some evicted */
    for (uint64_t group = 0; group < 3; group++)
        for (int twice = 0; twice < 2; twice++)
            push_keys(table, group * 10, 10);
    push_keys(table, 5000, 3); /* seen once: counted in the sketch only */

    em_checkpoint_options options;
    em_checkpoint_options_init(&options, fx.root);
    options.keep = 4;
    options.track_changes = true;
    em_checkpoint_info info;
    if (em_checkpoint_save(table, &options, &info, &err) != EM_OK)
        die("full save", &err);
    snprintf(fx.paths[0], sizeof(fx.paths[0]), "%s", info.path);

    push_keys(table, 20, 6);
    uint64_t erase[3] = {key_of(25), key_of(26), key_of(27)};
    uint64_t erased = 0;
    if (em_table_erase(table, erase, 3, &erased, &err) != EM_OK)
        die("erase", &err);
    options.delta = true;
    if (em_checkpoint_save(table, &options, &info, &err) != EM_OK)
        die("delta save", &err);
    if (strcmp(info.kind, "delta") != 0 || info.tombstones == 0)
        die("the second save is not a delta with tombstones", NULL);
    snprintf(fx.paths[1], sizeof(fx.paths[1]), "%s", info.path);
    em_table_destroy(table);

    char path[400];
    for (int c = 0; c < 2; c++)
        for (int f = 0; f < FILE_COUNT; f++) {
            file_path(path, sizeof(path), c, f);
            fx.files[c][f] = read_blob(path);
        }
    for (int f = 0; f < LATEST_FILE; f++)
        if (fx.files[1][f].bytes == NULL)
            die("the delta lacks a file", NULL);
}

/* ---- checksums made right again after edits -------------------------------------------- */

static void store_u64(uint8_t *p, uint64_t v)
{
    memcpy(p, &v, sizeof(v));
}

/* The trailing XXH3-64 of index.emb, tombstones.emb, admission.emb and evicted.emb. */
static void fix_trailer(blob *b)
{
    if (b->bytes != NULL && b->size >= 8)
        store_u64(b->bytes + b->size - 8, XXH3_64bits(b->bytes, b->size - 8));
}

/* Each chunk of rows.emb that lies whole in the file gets its payload's and header's
 * checksums, the index entry of the same rank the payload's; *digest gets the manifest's
 * checksum of the file (of the chunks' checksum pairs). */
static void fix_rows(blob *rows, blob *index, uint64_t *digest)
{
    XXH3_state_t *state = XXH3_createState();
    if (state == NULL)
        abort();
    XXH3_64bits_reset(state);
    size_t at = 0;
    uint64_t rank = 0;
    while (at + sizeof(em_chunk_header) <= rows->size) {
        em_chunk_header header;
        memcpy(&header, rows->bytes + at, sizeof(header));
        size_t left = rows->size - at - sizeof(header);
        if (header.payload_bytes > left)
            break;
        header.payload_xxh3 = XXH3_64bits(rows->bytes + at + sizeof(header), header.payload_bytes);
        header.header_xxh3 = XXH3_64bits(&header, offsetof(em_chunk_header, header_xxh3));
        memcpy(rows->bytes + at, &header, sizeof(header));
        em_rows_digest_add(state, &header);
        size_t entry = sizeof(em_index_header) + rank * sizeof(em_index_entry);
        if (index->bytes != NULL && entry + sizeof(em_index_entry) + 8 <= index->size)
            store_u64(index->bytes + entry + offsetof(em_index_entry, payload_xxh3),
                      header.payload_xxh3);
        at += sizeof(header) + header.payload_bytes;
        rank++;
    }
    *digest = XXH3_64bits_digest(state);
    XXH3_freeState(state);
}

static void hex64(char out[17], uint64_t v)
{
    snprintf(out, 17, "%016" PRIx64, v);
}

/* The text of a manifest without its checksum line (which it may have lost). */
static size_t manifest_body(const blob *m)
{
    if (m->size >= 23 && m->bytes[m->size - 1] == '\n' && m->bytes[m->size - 23] == '\n' &&
        memcmp(m->bytes + m->size - 22, "xxh3 ", 5) == 0)
        return m->size - 22;
    return m->size;
}

/* Gives the manifest its checksum line over its text; the checksum is returned. */
static uint64_t sign_manifest(blob *m, size_t body)
{
    uint64_t sum = XXH3_64bits(m->bytes, body);
    uint8_t *bytes = realloc(m->bytes, body + 23);
    if (bytes == NULL)
        abort();
    m->bytes = bytes;
    m->size = body + snprintf((char *)bytes + body, 23, "xxh3 %016" PRIx64 "\n", sum);
    return sum;
}

/* Replaces object's member name by item, where it has one (else item goes). */
static void replace_item(cJSON *object, const char *name, cJSON *item)
{
    if (!cJSON_ReplaceItemInObjectCaseSensitive(object, name, item))
        cJSON_Delete(item);
}

/* Rewrites the manifest's files entries (and, for a delta, its parent's checksum when
 * parent_xxh3 is given) from the files as they are now, and signs it. A manifest that
 * no longer parses is only signed. Returns its checksum. */
static uint64_t fix_manifest(blob *files, uint64_t rows_digest, const uint64_t *parent_xxh3)
{
    blob *m = &files[0];
    size_t body = manifest_body(m);
    char *text = malloc(body + 1);
    if (text == NULL)
        abort();
    memcpy(text, m->bytes, body);
    text[body] = '\0';
    cJSON *json = cJSON_Parse(text);
    free(text);
    cJSON *listed = json != NULL ? cJSON_GetObjectItemCaseSensitive(json, "files") : NULL;
    cJSON *entry = NULL;
    cJSON_ArrayForEach(entry, listed)
    {
        cJSON *name = cJSON_GetObjectItemCaseSensitive(entry, "name");
        for (int f = 1; f < LATEST_FILE && cJSON_IsString(name); f++) {
            if (strcmp(name->valuestring, file_names[f]) != 0 || files[f].bytes == NULL)
                continue;
            char hex[17];
            hex64(hex, f == 1 ? rows_digest : XXH3_64bits(files[f].bytes, files[f].size));
            replace_item(entry, "bytes", cJSON_CreateNumber((double)files[f].size));
            replace_item(entry, "xxh3", cJSON_CreateString(hex));
        }
    }
    cJSON *parent = json != NULL ? cJSON_GetObjectItemCaseSensitive(json, "parent") : NULL;
    if (parent_xxh3 != NULL && cJSON_IsObject(parent)) {
        char hex[17];
        hex64(hex, *parent_xxh3);
        replace_item(parent, "manifest_xxh3", cJSON_CreateString(hex));
    }
    if (json != NULL) {
        char *printed = cJSON_Print(json);
        if (printed == NULL)
            abort();
        free(m->bytes);
        m->size = strlen(printed) + 1;
        m->bytes = malloc(m->size + 23);
        if (m->bytes == NULL)
            abort();
        memcpy(m->bytes, printed, m->size - 1);
        m->bytes[m->size - 1] = '\n';
        body = m->size;
        cJSON_free(printed);
        cJSON_Delete(json);
    }
    return sign_manifest(m, body);
}

/* Every checksum of checkpoint c's files made right; *manifest_xxh3 its manifest's. */
static void fix_checkpoint(blob *files, const uint64_t *parent_xxh3, uint64_t *manifest_xxh3)
{
    uint64_t digest = 0;
    if (files[1].bytes != NULL)
        fix_rows(&files[1], &files[2], &digest);
    for (int f = 2; f < LATEST_FILE; f++)
        fix_trailer(&files[f]);
    *manifest_xxh3 = fix_manifest(files, digest, parent_xxh3);
}

/* ---- one input --------------------------------------------------------------------------- */

static blob copy_blob(const blob *b)
{
    blob c = {NULL, b->size};
    if (b->bytes != NULL) {
        c.bytes = malloc(b->size + 1);
        if (c.bytes == NULL)
            abort();
        memcpy(c.bytes, b->bytes, b->size);
    }
    return c;
}

static void resize_blob(blob *b, size_t size)
{
    uint8_t *bytes = realloc(b->bytes, size + 1);
    if (bytes == NULL)
        abort();
    if (size > b->size)
        memset(bytes + b->size, 0, size - b->size);
    b->bytes = bytes;
    b->size = size;
}

static void apply_edits(blob *b, const uint8_t *edits, size_t size)
{
    if (b->bytes == NULL || b->size == 0)
        return;
    for (size_t i = 0; i + 3 <= size; i += 3) {
        size_t offset = ((size_t)edits[i] | (size_t)edits[i + 1] << 8) % b->size;
        b->bytes[offset] = edits[i + 2];
    }
}

typedef struct outcome {
    em_status status;
    em_error err;
} outcome;

static void refused_with_reason(const outcome *o, const char *what)
{
    if (o->status != EM_OK && o->err.message[0] == '\0') {
        fprintf(stderr, "fuzz_checkpoint: %s refused (status %d) without a message\n", what,
                (int)o->status);
        abort();
    }
}

/* The checkpoint a load or a verify is given: the delta, or for LATEST the one the
 * table's LATEST names (its reading is part of what is fuzzed). */
static bool target_path(bool latest, char *path, size_t size, outcome *o)
{
    if (!latest) {
        snprintf(path, size, "%s", fx.paths[1]);
        return true;
    }
    o->status = em_checkpoint_latest(fx.root, "f", path, size, &o->err);
    refused_with_reason(o, "latest");
    return o->status == EM_OK;
}

static outcome run_load(const char *path, const em_checkpoint_load_options *options)
{
    outcome o = {0};
    em_table *table = NULL;
    em_checkpoint_info info;
    o.status = em_checkpoint_load(path, fx.backend, NULL, options, &table, &info, &o.err);
    if (o.status == EM_OK)
        em_table_destroy(table);
    return o;
}

static outcome run_verify(const char *path)
{
    outcome o = {0};
    em_checkpoint_info info;
    o.status = em_checkpoint_verify(path, &info, &o.err);
    return o;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool built = false;
    if (!built) {
        build_fixture();
        built = true;
    }
    if (size < 2)
        return 0;
    int file = data[0] & 7;
    if (file == 7)
        file = 0; /* the manifest, a second time: it holds the most to check */
    int checkpoint = (data[0] & 8) ? 0 : 1;
    int how = (data[0] >> 4) & 3;
    int what = data[0] >> 6;
    em_checkpoint_load_options options = {
        .read_ahead = (data[1] & 1) ? 1 : -1,
        .read_block_bytes = (data[1] & 2) ? 4096 : 0,
        .shards = (data[1] >> 2) & 3,
    };
    const uint8_t *rest = data + 2;
    size_t rest_size = size - 2;
    if (file == LATEST_FILE)
        checkpoint = 1; /* LATEST is the table's, not a checkpoint's */

    blob files[2][FILE_COUNT];
    for (int c = 0; c < 2; c++)
        for (int f = 0; f < FILE_COUNT; f++)
            files[c][f] = copy_blob(&fx.files[c][f]);
    blob *target = &files[checkpoint][file];
    bool edited = rest_size >= 3 || how == 2;
    if (how == 2) {
        free(target->bytes);
        target->bytes = malloc(rest_size + 1);
        if (target->bytes == NULL)
            abort();
        memcpy(target->bytes, rest, rest_size);
        target->size = rest_size;
    } else {
        if (how == 3 && rest_size >= 2 && target->bytes != NULL) {
            resize_blob(target, (size_t)rest[0] | (size_t)rest[1] << 8);
            rest += 2;
            rest_size -= 2;
            edited = true;
        }
        apply_edits(target, rest, rest_size);
        if ((how == 0 || how == 3) && file != LATEST_FILE) {
            uint64_t parent_xxh3 = 0, child_xxh3 = 0;
            fix_checkpoint(files[checkpoint], NULL, checkpoint == 0 ? &parent_xxh3 : &child_xxh3);
            if (checkpoint == 0) /* the delta names its parent's new checksum */
                fix_checkpoint(files[1], &parent_xxh3, &child_xxh3);
        }
    }
    char path[400];
    for (int c = 0; c < 2; c++)
        for (int f = 0; f < FILE_COUNT; f++) {
            file_path(path, sizeof(path), c, f);
            if (f != LATEST_FILE || c == 1)
                write_blob(path, &files[c][f]);
        }

    char target_dir[400];
    outcome located = {0};
    if (target_path(file == LATEST_FILE, target_dir, sizeof(target_dir), &located)) {
        if (what == 0) {
            outcome load = run_load(target_dir, &options);
            outcome verify = run_verify(target_dir);
            refused_with_reason(&load, "load");
            refused_with_reason(&verify, "verify");
            if ((load.status == EM_OK) != (verify.status == EM_OK) &&
                load.status != EM_RESOURCE_EXHAUSTED) {
                fprintf(stderr,
                        "fuzz_checkpoint: load and verify disagree\n  load: %d %s\n  verify: %d %s\n",
                        (int)load.status, load.err.message, (int)verify.status,
                        verify.err.message);
                abort();
            }
            if (!edited && load.status != EM_OK) {
                fprintf(stderr, "fuzz_checkpoint: the unedited checkpoint was refused: %s\n",
                        load.err.message);
                abort();
            }
        } else if (what == 1) {
            outcome verify = run_verify(target_dir);
            refused_with_reason(&verify, "verify");
            /* and the listing, which reads the manifests only */
            em_checkpoint_info *infos = NULL;
            size_t count = 0;
            outcome listed = {0};
            listed.status = em_checkpoint_list(fx.root, "f", &infos, &count, &listed.err);
            refused_with_reason(&listed, "list");
            free(infos);
        } else if (what == 2) {
            em_table_config config;
            em_table_config_init(&config, "w", DIM, CAPACITY);
            config.optimizer.kind = EM_OPTIMIZER_ADAGRAD;
            config.optimizer.learning_rate = 0.1;
            outcome o = {0};
            em_table *table = NULL;
            em_checkpoint_info info;
            o.status = em_checkpoint_load_weights(target_dir, fx.backend, &config, &table, &info,
                                                  &o.err);
            refused_with_reason(&o, "weights-only load");
            if (o.status == EM_OK)
                em_table_destroy(table);
        } else {
            em_checkpoint_load_options owned = options;
            owned.owner_index = 1;
            owned.owner_count = 3;
            const char *paths[1] = {target_dir};
            outcome o = {0};
            em_table *table = NULL;
            em_checkpoint_info info;
            o.status = em_checkpoint_load_sources(paths, 1, fx.backend, NULL, &owned, &table, &info,
                                                  &o.err);
            refused_with_reason(&o, "load of server 1 of 3");
            if (o.status == EM_OK)
                em_table_destroy(table);
        }
    }

    for (int c = 0; c < 2; c++)
        for (int f = 0; f < FILE_COUNT; f++) {
            file_path(path, sizeof(path), c, f);
            if (f != LATEST_FILE || c == 1)
                write_blob(path, &fx.files[c][f]);
            free(files[c][f].bytes);
        }
    return 0;
}
