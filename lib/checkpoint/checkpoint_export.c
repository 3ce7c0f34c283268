/*
 * DESIGN: a table's rows in and out of ember as NumPy array files, offline.
 *
 * Export: the checkpoint (with its chain, every checksum checked) is loaded into a table
 * on a CPU backend of this process, its rows are copied out, sorted by key, and written
 * as one array file each for the keys, the weights and each part of the optimizer state
 * (docs/checkpoints.md, "Export and import"), beside export.json, which holds the table's
 * config and names the files. Every file is written under a temporary name, fsynced and
 * renamed, and export.json comes last: a directory with export.json holds a whole export.
 * The sort makes the files a function of the table's rows alone. It needs the table's
 * rows twice in memory for a moment (the table, then its copy): an export of a table is
 * run where the table fits twice.
 *
 * Import: the reverse, into a new full checkpoint under a checkpoint root, which a server
 * then loads (LOAD, or a restore at start): the arrays' shapes and types are checked
 * against the config before any row is read, keys must be distinct and within capacity,
 * every value is checked as a load checks it (finite; accumulators and second moments
 * not negative), and the optimizer state starts as a new row's where the files hold none
 * (or weights_only asks for that). Nothing is written unless every row passed.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "lib/base/config.h"
#include "lib/checkpoint/checkpoint.h"
#include "lib/checkpoint/npy.h"
#include "lib/device/optimizer.h"

#define EXPORT_FORMAT "ember-export"
#define EXPORT_VERSION 1
#define EXPORT_MANIFEST "export.json"
/* Rows copied, gathered or imported at a time. */
#define EXPORT_BATCH_ROWS ((uint64_t)65536)
/* An export.json larger than this is not one. */
#define EXPORT_MANIFEST_MAX ((size_t)1 << 20)

/* One part of a row's optimizer state, as the array file it is written to: floats
 * [offset, offset + width) of the state; width 1 is an array of one dimension. */
typedef struct state_array {
    const char *name;
    uint32_t offset, width;
} state_array;

#define STATE_ARRAYS_MAX 3

/* The state arrays of the optimizer (the layout of lib/device/optimizer.c's state). */
static uint32_t state_arrays_of(em_optimizer_kind kind, uint32_t dim, state_array *out)
{
    switch (kind) {
    case EM_OPTIMIZER_ADAGRAD:
        out[0] = (state_array){"accumulator", 0, dim};
        return 1;
    case EM_OPTIMIZER_ROWWISE_ADAGRAD:
        out[0] = (state_array){"accumulator", 0, 1};
        return 1;
    case EM_OPTIMIZER_ADAM:
        out[0] = (state_array){"first_moment", 0, dim};
        out[1] = (state_array){"second_moment", dim, dim};
        out[2] = (state_array){"step", 2 * dim, 1};
        return 3;
    case EM_OPTIMIZER_SGD:
    case EM_OPTIMIZER_COUNT:
        break;
    }
    return 0;
}

static double seconds_now(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec / 1e9;
}

/* A CPU backend for one table, its pool allowed all of the machine's memory (reserved
 * as the table fills). */
static em_status scratch_backend(em_backend **out, em_error *err)
{
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page > 0)
        options.pool_limit_bytes = (uint64_t)pages * (uint64_t)page;
    options.eviction_threads = 1;
    return em_backend_create_cpu(&options, out, err);
}

/* ---- writing ----------------------------------------------------------------------- */

/* A new or empty directory for an export. */
static em_status prepare_out_dir(const char *dir, em_error *err)
{
    if (mkdir(dir, 0755) == 0)
        return EM_OK;
    if (errno != EEXIST)
        return em_error_set(err, EM_INVALID_ARGUMENT, "cannot create %s: %s", dir,
                            strerror(errno));
    DIR *listing = opendir(dir);
    if (listing == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT, "%s: %s", dir, strerror(errno));
    struct dirent *entry;
    const char *found = NULL;
    char name[256] = "";
    while (found == NULL && (entry = readdir(listing)) != NULL)
        if (strcmp(entry->d_name, ".") != 0 && strcmp(entry->d_name, "..") != 0) {
            snprintf(name, sizeof(name), "%s", entry->d_name);
            found = name;
        }
    closedir(listing);
    if (found != NULL)
        return em_error_set(err, EM_FAILED_PRECONDITION,
                            "%s is not empty (it holds %s): an export goes into a new or "
                            "empty directory",
                            dir, found);
    return EM_OK;
}

/* A file being written under a temporary name in dir, renamed to name once whole. */
typedef struct out_file {
    FILE *file;
    char path[4200], temporary[4200];
} out_file;

static em_status out_open(out_file *f, const char *dir, const char *name, em_error *err)
{
    snprintf(f->path, sizeof(f->path), "%s/%s", dir, name);
    snprintf(f->temporary, sizeof(f->temporary), "%s/.%s.tmp", dir, name);
    f->file = fopen(f->temporary, "wbx");
    if (f->file == NULL)
        return em_error_set(err, EM_INTERNAL, "cannot create %s: %s", f->temporary,
                            strerror(errno));
    return EM_OK;
}

/* Flushes, fsyncs and closes the file, then renames it to its name (or removes it when
 * status is an error already). */
static em_status out_close(out_file *f, em_status status, em_error *err)
{
    if (f->file == NULL)
        return status;
    if (status == EM_OK && (fflush(f->file) != 0 || fsync(fileno(f->file)) != 0))
        status = em_error_set(err, EM_INTERNAL, "writing %s failed: %s", f->temporary,
                              strerror(errno));
    if (fclose(f->file) != 0 && status == EM_OK)
        status = em_error_set(err, EM_INTERNAL, "writing %s failed: %s", f->temporary,
                              strerror(errno));
    f->file = NULL;
    if (status == EM_OK && rename(f->temporary, f->path) != 0)
        status = em_error_set(err, EM_INTERNAL, "renaming %s to %s failed: %s", f->temporary,
                              f->path, strerror(errno));
    if (status != EM_OK)
        unlink(f->temporary);
    return status;
}

static em_status fsync_dir(const char *dir, em_error *err)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    em_status status = EM_OK;
    if (fd < 0 || fsync(fd) != 0)
        status = em_error_set(err, EM_INTERNAL, "fsync of %s failed: %s", dir, strerror(errno));
    if (fd >= 0)
        close(fd);
    return status;
}

static em_status out_write(out_file *f, const void *data, size_t bytes, em_error *err)
{
    if (fwrite(data, 1, bytes, f->file) != bytes)
        return em_error_set(err, EM_INTERNAL, "writing %s failed: %s", f->temporary,
                            strerror(errno));
    return EM_OK;
}

/* The exported rows: keys[i] with values[i * floats ...], in order[] by key. */
typedef struct exported {
    uint64_t rows;
    uint32_t floats;
    uint64_t *keys;
    float *values;
    uint64_t *order;
} exported;

/* Writes every row of source (rows of stride bytes, in the table's order) in key order as
 * an array file of descr: the width elements at byte offset of each row, as shape (rows,)
 * when one_dimension, else (rows, width). */
static em_status write_array(const char *dir, const char *name, const exported *e,
                             const char *descr, const void *source, size_t stride,
                             size_t offset, uint32_t width, bool one_dimension, em_error *err)
{
    out_file f;
    em_status status = out_open(&f, dir, name, err);
    if (status != EM_OK)
        return status;
    size_t row_bytes = (size_t)width * em_npy_element_bytes(descr);
    unsigned char *buffer = malloc(EXPORT_BATCH_ROWS * row_bytes);
    if (buffer == NULL)
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "export: out of memory");
    if (status == EM_OK)
        status = em_npy_write_header(f.file, f.temporary, descr, e->rows,
                                     one_dimension ? 0 : width, err);
    const unsigned char *rows = source;
    for (uint64_t first = 0; status == EM_OK && first < e->rows; first += EXPORT_BATCH_ROWS) {
        uint64_t n = e->rows - first < EXPORT_BATCH_ROWS ? e->rows - first : EXPORT_BATCH_ROWS;
        for (uint64_t i = 0; i < n; i++)
            memcpy(buffer + i * row_bytes, rows + e->order[first + i] * stride + offset,
                   row_bytes);
        status = out_write(&f, buffer, n * row_bytes, err);
    }
    free(buffer);
    return out_close(&f, status, err);
}

/* Floats [offset, offset + width) of every row (write_array). */
static em_status write_floats(const char *dir, const char *name, const exported *e,
                              uint32_t offset, uint32_t width, bool one_dimension,
                              em_error *err)
{
    return write_array(dir, name, e, "<f4", e->values, e->floats * sizeof(float),
                       offset * sizeof(float), width, one_dimension, err);
}

static char *array_file_name(const char *array)
{
    size_t bytes = strlen(array) + sizeof(".npy");
    char *name = malloc(bytes);
    if (name != NULL)
        snprintf(name, bytes, "%s.npy", array);
    return name;
}

/* export.json: what the export holds and the table's config. */
static em_status write_manifest(const char *dir, const em_table_config *config,
                                const em_checkpoint_info *info, const exported *e,
                                const state_array *states, uint32_t state_count,
                                bool weights_only, em_error *err)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "format", EXPORT_FORMAT);
    cJSON_AddNumberToObject(root, "version", EXPORT_VERSION);
    cJSON_AddStringToObject(root, "table", config->name);
    cJSON_AddStringToObject(root, "checkpoint", info->id);
    cJSON_AddStringToObject(root, "checkpoint_path", info->path);
    cJSON_AddNumberToObject(root, "rows", (double)e->rows);
    cJSON_AddBoolToObject(root, "weights_only", weights_only);
    cJSON *arrays = cJSON_AddObjectToObject(root, "arrays");
    cJSON_AddStringToObject(arrays, "keys", "keys.npy");
    cJSON_AddStringToObject(arrays, "weights", "weights.npy");
    for (uint32_t s = 0; s < state_count && !weights_only; s++) {
        char *name = array_file_name(states[s].name);
        if (name != NULL)
            cJSON_AddStringToObject(arrays, states[s].name, name);
        free(name);
    }
    cJSON_AddItemToObject(root, "config", em_table_config_to_json(config));
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    if (text == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "export: out of memory");
    out_file f;
    em_status status = out_open(&f, dir, EXPORT_MANIFEST, err);
    if (status == EM_OK) {
        status = out_write(&f, text, strlen(text), err);
        if (status == EM_OK)
            status = out_write(&f, "\n", 1, err);
        status = out_close(&f, status, err);
    }
    free(text);
    return status;
}

static int compare_key_index(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* keys[0..n) as (key, index) pairs sorted by key (equal keys side by side, in no set
 * order), or NULL when there is no memory for them. */
static uint64_t *sorted_key_pairs(const uint64_t *keys, uint64_t n)
{
    uint64_t *pairs = malloc((n + 1) * 2 * sizeof(uint64_t));
    if (pairs == NULL)
        return NULL;
    for (uint64_t i = 0; i < n; i++) {
        pairs[2 * i] = keys[i];
        pairs[2 * i + 1] = i;
    }
    qsort(pairs, n, 2 * sizeof(uint64_t), compare_key_index);
    return pairs;
}

/* e->order: the rows' indexes by ascending key. */
static em_status sort_by_key(exported *e, em_error *err)
{
    uint64_t *pairs = sorted_key_pairs(e->keys, e->rows);
    e->order = malloc((e->rows + 1) * sizeof(uint64_t));
    if (pairs == NULL || e->order == NULL) {
        free(pairs);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "export: out of memory");
    }
    for (uint64_t i = 0; i < e->rows; i++)
        e->order[i] = pairs[2 * i + 1];
    free(pairs);
    return EM_OK;
}

/* Copies every row of the table into e (keys and floats, in the table's order). */
static em_status copy_rows(em_table *table, exported *e, em_error *err)
{
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    e->rows = stats.rows;
    e->floats = stats.row_floats;
    e->keys = malloc((e->rows + 1) * sizeof(uint64_t));
    e->values = malloc((e->rows + 1) * e->floats * sizeof(float));
    if (e->keys == NULL || e->values == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "export: out of memory for a copy of %" PRIu64 " rows", e->rows);
    em_table_cursor cursor = {0};
    uint64_t have = 0;
    for (;;) {
        uint64_t room = e->rows - have, count = 0;
        uint64_t max = room < EXPORT_BATCH_ROWS ? room + 1 : EXPORT_BATCH_ROWS;
        em_status status = em_table_export(table, &cursor, max, e->keys + have,
                                           e->values + have * e->floats, &count, err);
        if (status != EM_OK)
            return status;
        if (count == 0)
            break;
        if (count > room)
            return em_error_set(err, EM_INTERNAL,
                                "export: the table gave more than its %" PRIu64 " rows",
                                e->rows);
        have += count;
    }
    if (have != e->rows)
        return em_error_set(err, EM_INTERNAL,
                            "export: the table gave %" PRIu64 " of its %" PRIu64 " rows", have,
                            e->rows);
    return EM_OK;
}

static em_status write_arrays(const char *out_dir, const em_table_config *config,
                              const em_checkpoint_info *info, const exported *e,
                              bool weights_only, em_error *err)
{
    state_array states[STATE_ARRAYS_MAX];
    uint32_t state_count = state_arrays_of(config->optimizer.kind, config->dim, states);
    em_status status = write_array(out_dir, "keys.npy", e, "<u8", e->keys, sizeof(uint64_t),
                                   0, 1, true, err);
    if (status == EM_OK)
        status = write_floats(out_dir, "weights.npy", e, 0, config->dim, false, err);
    for (uint32_t s = 0; status == EM_OK && !weights_only && s < state_count; s++) {
        char *name = array_file_name(states[s].name);
        status = name != NULL ? write_floats(out_dir, name, e, config->dim + states[s].offset,
                                             states[s].width, states[s].width == 1, err)
                              : em_error_set(err, EM_RESOURCE_EXHAUSTED, "export: out of memory");
        free(name);
    }
    if (status == EM_OK)
        status = write_manifest(out_dir, config, info, e, states, state_count, weights_only,
                                err);
    if (status == EM_OK)
        status = fsync_dir(out_dir, err);
    return status;
}

/* Exports the table that load fills (a checkpoint, or the parts of a cluster one). */
static em_status export_loaded(em_status (*load)(const void *what, em_backend *backend,
                                                 em_table **table, em_checkpoint_info *info,
                                                 em_error *err),
                               const void *what, const char *out_dir, bool weights_only,
                               em_checkpoint_info *info, em_error *err)
{
    double began = seconds_now();
    em_backend *backend = NULL;
    em_table *table = NULL;
    exported e = {0};
    em_table_config config;
    em_status status = prepare_out_dir(out_dir, err);
    if (status == EM_OK)
        status = scratch_backend(&backend, err);
    if (status == EM_OK)
        status = load(what, backend, &table, info, err);
    if (status == EM_OK) {
        config = *em_table_get_config(table);
        status = copy_rows(table, &e, err);
    }
    em_table_destroy(table); /* the copy is what is written */
    em_backend_destroy(backend);
    if (status == EM_OK)
        status = sort_by_key(&e, err);
    if (status == EM_OK)
        status = write_arrays(out_dir, &config, info, &e, weights_only, err);
    free(e.keys);
    free(e.values);
    free(e.order);
    if (status == EM_OK) {
        info->rows = e.rows;
        info->seconds = seconds_now() - began;
    }
    return status;
}

static em_status load_path(const void *what, em_backend *backend, em_table **table,
                           em_checkpoint_info *info, em_error *err)
{
    return em_checkpoint_load(what, backend, NULL, NULL, table, info, err);
}

em_status em_checkpoint_export(const char *path, const char *out_dir, bool weights_only,
                               em_checkpoint_info *info, em_error *err)
{
    return export_loaded(load_path, path, out_dir, weights_only, info, err);
}

/* The parts of a cluster checkpoint's table. */
typedef struct sources {
    const char *const *paths;
    size_t count;
    const uint64_t *manifest_xxh3;
} sources;

static em_status load_sources(const void *what, em_backend *backend, em_table **table,
                              em_checkpoint_info *info, em_error *err)
{
    const sources *s = what;
    em_checkpoint_load_options options = {.manifest_xxh3 = s->manifest_xxh3};
    return em_checkpoint_load_sources(s->paths, s->count, backend, NULL, &options, table, info,
                                      err);
}

em_status em_checkpoint_export_sources(const char *const *paths, size_t count,
                                       const uint64_t *manifest_xxh3, const char *out_dir,
                                       bool weights_only, em_checkpoint_info *info,
                                       em_error *err)
{
    sources s = {paths, count, manifest_xxh3};
    return export_loaded(load_sources, &s, out_dir, weights_only, info, err);
}

/* ---- import ------------------------------------------------------------------------ */

/* An array file being read. */
typedef struct in_array {
    FILE *file;
    char path[4200];
    em_npy_array shape;
} in_array;

/* What an import reads: the config, the keys, and the open files of the rows. */
typedef struct importing {
    const char *dir;
    em_table_config config;
    uint32_t floats; /* dim plus state */
    uint64_t rows;
    uint64_t *keys;
    in_array keys_file, weights;
    state_array states[STATE_ARRAYS_MAX];
    in_array state_files[STATE_ARRAYS_MAX];
    uint32_t state_count;
    bool with_state; /* the state comes from the files */
} importing;

static void close_array(in_array *a)
{
    if (a->file != NULL)
        fclose(a->file);
    a->file = NULL;
}

/* Opens dir/name and reads its header; *present false (and no error) when there is no
 * such file and it may be absent. */
static em_status open_array(const char *dir, const char *name, bool optional, in_array *a,
                            bool *present, em_error *err)
{
    snprintf(a->path, sizeof(a->path), "%s/%s", dir, name);
    a->file = fopen(a->path, "rb");
    if (present != NULL)
        *present = a->file != NULL;
    if (a->file == NULL && optional && errno == ENOENT)
        return EM_OK;
    if (a->file == NULL)
        return em_error_set(err, errno == ENOENT ? EM_NOT_FOUND : EM_INVALID_ARGUMENT,
                            "%s: %s", a->path, strerror(errno));
    return em_npy_read_header(a->file, a->path, &a->shape, err);
}

/* Checks that a's elements are '<f4' with rows rows of width floats: shape (rows, width),
 * or (rows,) where width is 1. */
static em_status check_floats(const in_array *a, uint64_t rows, uint32_t width,
                              const char *what, em_error *err)
{
    if (strcmp(a->shape.descr, "<f4") != 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: elements of type '%s'; %s are float32 ('<f4': "
                            "array.astype(np.float32))",
                            a->path, a->shape.descr, what);
    bool one = a->shape.dimensions == 1;
    if ((one && width != 1) || a->shape.columns != width)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: %s of %" PRIu64 " floats a row where the table's %s %" PRIu32,
                            a->path, what, one ? 1 : a->shape.columns,
                            width == 1 ? "rows hold" : "dim is", width);
    if (a->shape.rows != rows)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: %" PRIu64 " rows where keys.npy holds %" PRIu64 " keys", a->path,
                            a->shape.rows, rows);
    return EM_OK;
}

/* The table's config in dir's export.json. */
static em_status export_config(const char *dir, em_table_config *config, em_error *err)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, EXPORT_MANIFEST);
    char *text = NULL;
    em_error read_err;
    if (em_config_read_file(path, EXPORT_MANIFEST_MAX, &text, &read_err) != EM_OK)
        return em_error_set(err, read_err.status == EM_RESOURCE_EXHAUSTED
                                     ? EM_RESOURCE_EXHAUSTED
                                     : EM_INVALID_ARGUMENT,
                            "%s; give the table's config instead", read_err.message);
    cJSON *json = cJSON_Parse(text);
    free(text);
    const cJSON *format = cJSON_GetObjectItemCaseSensitive(json, "format");
    const cJSON *table = cJSON_GetObjectItemCaseSensitive(json, "config");
    em_status status = EM_OK;
    if (json == NULL || !cJSON_IsString(format) ||
        strcmp(format->valuestring, EXPORT_FORMAT) != 0 || !cJSON_IsObject(table))
        status = em_error_set(err, EM_INVALID_ARGUMENT,
                              "%s: not an ember export's manifest (JSON with format \"%s\" "
                              "and the table's config)",
                              path, EXPORT_FORMAT);
    else
        status = em_table_config_parse(table, "export.json config", config, err);
    cJSON_Delete(json);
    return status;
}

/* The config: options->config_json, else export.json's, named options->name if given. */
static em_status import_config(const char *dir, const em_checkpoint_import_options *options,
                               em_table_config *config, em_error *err)
{
    em_status status = options->config_json != NULL
                           ? em_table_config_parse_text(options->config_json, config, err)
                           : export_config(dir, config, err);
    if (status == EM_OK && options->name != NULL) {
        status = em_table_name_check(options->name, err);
        if (status == EM_OK)
            snprintf(config->name, sizeof(config->name), "%s", options->name);
    }
    return status == EM_OK ? em_table_config_validate(config, err) : status;
}

/* Opens keys.npy, weights.npy and the state's files, and checks their shapes against the
 * config. */
static em_status open_arrays(importing *im, bool weights_only, em_error *err)
{
    const em_table_config *config = &im->config;
    em_status status = open_array(im->dir, "keys.npy", false, &im->keys_file, NULL, err);
    const em_npy_array *keys = &im->keys_file.shape;
    if (status == EM_OK && strcmp(keys->descr, "<u8") != 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: elements of type '%s'; keys are uint64 ('<u8': "
                            "keys.astype(np.uint64))",
                            im->keys_file.path, keys->descr);
    if (status == EM_OK && keys->dimensions != 1)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: an array of shape (%" PRIu64 ", %" PRIu64
                            "); keys are one dimension",
                            im->keys_file.path, keys->rows, keys->columns);
    if (status != EM_OK)
        return status;
    im->rows = keys->rows;
    if (im->rows > config->capacity)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: %" PRIu64 " keys, above table '%s''s capacity of %" PRIu64,
                            im->keys_file.path, im->rows, config->name, config->capacity);
    status = open_array(im->dir, "weights.npy", false, &im->weights, NULL, err);
    if (status == EM_OK)
        status = check_floats(&im->weights, im->rows, config->dim, "weights", err);
    im->state_count = state_arrays_of(config->optimizer.kind, config->dim, im->states);
    uint32_t present_count = 0;
    const char *missing = NULL;
    for (uint32_t s = 0; status == EM_OK && !weights_only && s < im->state_count; s++) {
        char *name = array_file_name(im->states[s].name);
        bool present = false;
        status = name != NULL ? open_array(im->dir, name, true, &im->state_files[s], &present,
                                           err)
                              : em_error_set(err, EM_RESOURCE_EXHAUSTED, "import: out of memory");
        if (status == EM_OK && present)
            status = check_floats(&im->state_files[s], im->rows, im->states[s].width,
                                  im->states[s].name, err);
        present_count += present;
        if (!present && missing == NULL)
            missing = im->states[s].name;
        free(name);
    }
    if (status == EM_OK && present_count > 0 && missing != NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s holds part of %s's optimizer state but no %s.npy: give all of "
                            "it, or import the weights only",
                            im->dir, config->name, missing);
    im->with_state = present_count > 0;
    im->floats = config->dim + em_optimizer_state_floats(config->optimizer.kind, config->dim);
    return status;
}

static em_status read_exactly(in_array *a, void *data, size_t bytes, em_error *err)
{
    if (fread(data, 1, bytes, a->file) != bytes)
        return em_error_set(err, EM_INVALID_ARGUMENT, "%s: cut short while read (%s)", a->path,
                            ferror(a->file) ? strerror(errno) : "end of file");
    return EM_OK;
}

/* Reads every key and refuses a key that appears twice, naming both rows. */
static em_status read_keys(importing *im, em_error *err)
{
    im->keys = malloc((im->rows + 1) * sizeof(uint64_t));
    em_status status = im->keys != NULL
                           ? read_exactly(&im->keys_file, im->keys, im->rows * sizeof(uint64_t),
                                          err)
                           : em_error_set(err, EM_RESOURCE_EXHAUSTED, "import: out of memory");
    uint64_t *pairs = status == EM_OK ? sorted_key_pairs(im->keys, im->rows) : NULL;
    if (status == EM_OK && pairs == NULL)
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "import: out of memory");
    for (uint64_t i = 1; status == EM_OK && i < im->rows; i++) {
        if (pairs[2 * i] != pairs[2 * i - 2])
            continue;
        uint64_t a = pairs[2 * i - 1], b = pairs[2 * i + 1];
        status = em_error_set(err, EM_INVALID_ARGUMENT,
                              "%s: key %" PRIu64 " appears twice (rows %" PRIu64 " and %" PRIu64
                              ")",
                              im->keys_file.path, pairs[2 * i], a < b ? a : b, a < b ? b : a);
    }
    free(pairs);
    return status;
}

/* The first value of row (row `index` of the files, key) that a load would refuse,
 * named by its file and element. */
static em_status bad_value(const importing *im, uint64_t index, uint64_t key, const float *row,
                           em_error *err)
{
    uint32_t dim = im->config.dim;
    for (uint32_t j = 0; j < im->floats; j++) {
        bool weight = j < dim, nonnegative = !weight &&
                               em_optimizer_state_nonnegative(im->config.optimizer.kind, dim,
                                                              j - dim);
        if (isfinite(row[j]) && !(nonnegative && row[j] < 0.0f))
            continue;
        const in_array *file = &im->weights;
        uint32_t element = j;
        for (uint32_t s = 0; !weight && s < im->state_count; s++)
            if (j - dim >= im->states[s].offset &&
                j - dim < im->states[s].offset + im->states[s].width) {
                file = &im->state_files[s];
                element = j - dim - im->states[s].offset;
            }
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: row %" PRIu64 " (key %" PRIu64 "), element %" PRIu32 " is %g%s",
                            file->path, index, key, element, (double)row[j],
                            isfinite(row[j]) ? ", must be >= 0" : ": values must be finite");
    }
    return EM_OK;
}

/* Reads rows [first, first + n) of the files into values (floats a row). */
static em_status read_rows(importing *im, uint64_t first, uint64_t n, float *values,
                           float *column, em_error *err)
{
    uint32_t dim = im->config.dim;
    em_status status = read_exactly(&im->weights, column, n * dim * sizeof(float), err);
    for (uint64_t i = 0; status == EM_OK && i < n; i++)
        memcpy(values + i * im->floats, column + i * dim, dim * sizeof(float));
    for (uint32_t s = 0; status == EM_OK && im->with_state && s < im->state_count; s++) {
        uint32_t width = im->states[s].width, at = dim + im->states[s].offset;
        status = read_exactly(&im->state_files[s], column, n * width * sizeof(float), err);
        for (uint64_t i = 0; status == EM_OK && i < n; i++)
            memcpy(values + i * im->floats + at, column + i * width, width * sizeof(float));
    }
    for (uint64_t i = 0; status == EM_OK && !im->with_state && i < n; i++)
        em_optimizer_init_state(&im->config.optimizer, dim, values + i * im->floats + dim);
    for (uint64_t i = 0; status == EM_OK && i < n; i++) {
        em_error ignored;
        if (em_table_config_check_rows(&im->config, &im->keys[first + i],
                                       values + i * im->floats, 1, &ignored) != EM_OK)
            status = bad_value(im, first + i, im->keys[first + i], values + i * im->floats, err);
    }
    return status;
}

/* Fills a new table of the config with every row. */
static em_status fill_table(importing *im, em_table *table, em_error *err)
{
    uint64_t batch = EXPORT_BATCH_ROWS;
    float *values = malloc(batch * im->floats * sizeof(float));
    float *column = malloc(batch * im->floats * sizeof(float));
    em_status status = values != NULL && column != NULL
                           ? em_table_reserve(table, im->rows, err)
                           : em_error_set(err, EM_RESOURCE_EXHAUSTED, "import: out of memory");
    for (uint64_t first = 0; status == EM_OK && first < im->rows; first += batch) {
        uint64_t n = im->rows - first < batch ? im->rows - first : batch;
        status = read_rows(im, first, n, values, column, err);
        if (status == EM_OK)
            status = em_table_import_new(table, im->keys + first, values, n, err);
    }
    free(values);
    free(column);
    return status;
}

static void importing_free(importing *im)
{
    close_array(&im->keys_file);
    close_array(&im->weights);
    for (uint32_t s = 0; s < STATE_ARRAYS_MAX; s++)
        close_array(&im->state_files[s]);
    free(im->keys);
}

void em_checkpoint_import_options_init(em_checkpoint_import_options *options)
{
    memset(options, 0, sizeof(*options));
}

em_status em_checkpoint_import(const char *in_dir, const char *root,
                               const em_checkpoint_import_options *options,
                               em_checkpoint_info *info, em_error *err)
{
    double began = seconds_now();
    importing im = {.dir = in_dir};
    em_backend *backend = NULL;
    em_table *table = NULL;
    em_status status = import_config(in_dir, options, &im.config, err);
    if (status == EM_OK)
        status = open_arrays(&im, options->weights_only, err);
    if (status == EM_OK)
        status = read_keys(&im, err);
    if (status == EM_OK)
        status = scratch_backend(&backend, err);
    if (status == EM_OK)
        status = em_table_create(backend, &im.config, &table, err);
    if (status == EM_OK)
        status = fill_table(&im, table, err);
    if (status == EM_OK) {
        em_checkpoint_options save;
        em_checkpoint_options_init(&save, root);
        save.keep = UINT32_MAX; /* the table's older checkpoints there stay */
        status = em_checkpoint_save(table, &save, info, err);
    }
    em_table_destroy(table);
    em_backend_destroy(backend);
    importing_free(&im);
    if (status == EM_OK)
        info->seconds = seconds_now() - began;
    return status;
}
