#include <cjson/cJSON.h>
#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lib/checkpoint/checkpoint.h"
#include "lib/checkpoint/npy.h"
#include "lib/device/backend.h"
#include "lib/device/optimizer.h"
#include "lib/table/table.h"
#include "tests/support/test_batches.h"
#include "tests/support/test_support.h"

#define MEBIBYTE (UINT64_C(1) << 20)

/* ---- fixtures ---------------------------------------------------------------------- */

static em_backend *make_backend(void)
{
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.pool_limit_bytes = 256 * MEBIBYTE;
    em_backend *backend = NULL;
    em_error err;
    ck_assert_msg(em_backend_create_cpu(&options, &backend, &err) == EM_OK, "%s", err.message);
    return backend;
}

/* A table of the optimizer whose rows and state were moved by a few pushes, and saved
 * under dir: a full checkpoint, then a delta after more pushes (the export reads the
 * chain). */
static em_table *saved_table(em_backend *backend, int optimizer, uint32_t dim, const char *dir)
{
    em_table_config config;
    em_table_config_init(&config, "t", dim, 100000);
    config.shards = 3;
    config.optimizer = em_test_optimizers[optimizer];
    config.initializer.kind = EM_INIT_UNIFORM;
    config.initializer.bound = 0.5f;
    config.initializer.seed = 5;
    em_table *table = em_test_make_table(backend, &config);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_error err;
    em_checkpoint_info info;
    for (int round = 0; round < 4; round++) {
        em_test_batch b = em_test_random_batch(&rng, 300, 4, 1500);
        float *g = em_test_random_floats(&rng, b.csr.nnz * dim);
        ck_assert_int_eq(em_test_push(table, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
        free(g);
        em_test_batch_free(&b);
        if (round == 1 || round == 3) {
            em_checkpoint_options options;
            em_checkpoint_options_init(&options, dir);
            options.delta = round == 3;
            options.track_changes = true;
            ck_assert_msg(em_checkpoint_save(table, &options, &info, &err) == EM_OK, "%s",
                          err.message);
            ck_assert_str_eq(info.kind, round == 3 ? "delta" : "full");
        }
    }
    return table;
}

static bool exists(const char *dir, const char *name)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    return access(path, F_OK) == 0;
}

/* The state parts as export writes them: name, first float of the state, width. */
typedef struct part {
    const char *file;
    uint32_t offset, width;
} part;

static uint32_t parts_of(int optimizer, uint32_t dim, part *out)
{
    switch (em_test_optimizers[optimizer].kind) {
    case EM_OPTIMIZER_ADAGRAD:
        out[0] = (part){"accumulator.npy", 0, dim};
        return 1;
    case EM_OPTIMIZER_ROWWISE_ADAGRAD:
        out[0] = (part){"accumulator.npy", 0, 1};
        return 1;
    case EM_OPTIMIZER_ADAM:
        out[0] = (part){"first_moment.npy", 0, dim};
        out[1] = (part){"second_moment.npy", dim, dim};
        out[2] = (part){"step.npy", 2 * dim, 1};
        return 3;
    case EM_OPTIMIZER_SGD:
    case EM_OPTIMIZER_COUNT:
        break;
    }
    return 0;
}

/* ---- export and import ------------------------------------------------------------- */

/* An export holds every row of the checkpoint's instant by ascending key, the weights and
 * each part of the state in its own file; importing it gives back the table bit for bit
 * (and with the weights only, each row's state as a new row's). */
START_TEST(exports_hold_every_row_by_key_and_import_back_bit_for_bit)
{
    int optimizer = _i;
    const uint32_t dim = 6;
    char dir[256], out[512], root[512];
    em_test_make_dir("ember-export", dir, sizeof(dir));
    snprintf(out, sizeof(out), "%s/out", dir);
    snprintf(root, sizeof(root), "%s/imported", dir);
    em_backend *backend = make_backend();
    em_table *table = saved_table(backend, optimizer, dim, dir);
    em_test_snapshot before = em_test_snapshot_take(table, 1000);
    em_checkpoint_info info;
    em_error err;
    char table_dir[512];
    snprintf(table_dir, sizeof(table_dir), "%s/t", dir);
    ck_assert_msg(em_checkpoint_export(table_dir, out, false, &info, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_uint_eq(info.rows, before.count);
    ck_assert_str_eq(info.table, "t");

    uint64_t n = before.count;
    uint64_t *keys = em_test_read_array(out, "keys.npy", "<u8", n, 0);
    float *weights = em_test_read_array(out, "weights.npy", "<f4", n, dim);
    for (uint64_t i = 0; i < n; i++) {
        ck_assert_uint_eq(keys[i], before.keys[i]);
        ck_assert_msg(i == 0 || keys[i] > keys[i - 1], "keys out of order at row %" PRIu64, i);
        ck_assert_mem_eq(weights + i * dim, before.values + i * before.width,
                         dim * sizeof(float));
    }
    part parts[3];
    uint32_t part_count = parts_of(optimizer, dim, parts);
    ck_assert_uint_eq(dim + (part_count == 0 ? 0 : parts[part_count - 1].offset +
                                                       parts[part_count - 1].width),
                      before.width);
    for (uint32_t p = 0; p < part_count; p++) {
        float *state = em_test_read_array(out, parts[p].file, "<f4", n,
                                  parts[p].width == 1 ? 0 : parts[p].width);
        for (uint64_t i = 0; i < n; i++)
            ck_assert_mem_eq(state + i * parts[p].width,
                             before.values + i * before.width + dim + parts[p].offset,
                             parts[p].width * sizeof(float));
        free(state);
    }
    ck_assert(exists(out, "export.json"));

    /* back in, under another name: the same rows and state, bit for bit */
    em_checkpoint_import_options options;
    em_checkpoint_import_options_init(&options);
    options.name = "u";
    ck_assert_msg(em_checkpoint_import(out, root, &options, &info, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_str_eq(info.table, "u");
    ck_assert_str_eq(info.kind, "full");
    ck_assert_uint_eq(info.rows, n);
    em_table *imported = NULL;
    ck_assert_msg(em_checkpoint_load(info.path, backend, NULL, NULL, &imported, NULL, &err) ==
                      EM_OK, "%s", err.message);
    ck_assert_str_eq(em_table_get_config(imported)->name, "u");
    ck_assert_int_eq(em_table_get_config(imported)->optimizer.kind,
                     em_test_optimizers[optimizer].kind);
    em_test_snapshot after = em_test_snapshot_take(imported, 1000);
    em_test_assert_snapshots_identical(&before, &after);
    em_test_snapshot_free(&after);
    em_table_destroy(imported);

    /* the weights alone: the state starts as a new row's */
    char weights_out[512];
    snprintf(weights_out, sizeof(weights_out), "%s/weights", dir);
    ck_assert_int_eq(em_checkpoint_export(table_dir, weights_out, true, &info, &err), EM_OK);
    for (uint32_t p = 0; p < part_count; p++)
        ck_assert_msg(!exists(weights_out, parts[p].file), "%s written", parts[p].file);
    options.name = "w";
    ck_assert_msg(em_checkpoint_import(weights_out, root, &options, &info, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_msg(em_checkpoint_load(info.path, backend, NULL, NULL, &imported, NULL, &err) ==
                      EM_OK, "%s", err.message);
    after = em_test_snapshot_take(imported, 1000);
    ck_assert_uint_eq(after.count, n);
    float fresh[64];
    em_optimizer_init_state(&em_test_optimizers[optimizer], dim, fresh);
    for (uint64_t i = 0; i < n; i++) {
        ck_assert_uint_eq(after.keys[i], before.keys[i]);
        ck_assert_mem_eq(after.values + i * after.width, before.values + i * before.width,
                         dim * sizeof(float));
        ck_assert_mem_eq(after.values + i * after.width + dim, fresh,
                         (after.width - dim) * sizeof(float));
    }
    em_test_snapshot_free(&after);
    em_table_destroy(imported);

    free(keys);
    free(weights);
    em_test_snapshot_free(&before);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* An export goes only into a new or empty directory, and a damaged checkpoint writes no
 * array. */
START_TEST(exports_refuse_occupied_directories_and_damaged_checkpoints)
{
    char dir[256], out[512], table_dir[512], rows[4300];
    em_test_make_dir("ember-export", dir, sizeof(dir));
    snprintf(out, sizeof(out), "%s/out", dir);
    snprintf(table_dir, sizeof(table_dir), "%s/t", dir);
    em_backend *backend = make_backend();
    em_table *table = saved_table(backend, 3, 4, dir);
    ck_assert_int_eq(mkdir(out, 0755), 0);
    char stray[600];
    snprintf(stray, sizeof(stray), "%s/notes.txt", out);
    FILE *file = fopen(stray, "w");
    fputs("mine\n", file);
    fclose(file);
    em_checkpoint_info info;
    em_error err;
    ck_assert_int_eq(em_checkpoint_export(table_dir, out, false, &info, &err),
                     EM_FAILED_PRECONDITION);
    ck_assert_msg(strstr(err.message, "notes.txt") != NULL, "%s", err.message);
    ck_assert(!exists(out, "keys.npy"));

    /* a flipped byte in the full checkpoint's rows: DATA_LOSS, and no array written */
    snprintf(rows, sizeof(rows), "%s/00000000000000000001/rows.emb", table_dir);
    em_test_flip_byte(rows, 100);
    char fresh[600];
    snprintf(fresh, sizeof(fresh), "%s/fresh", dir);
    ck_assert_int_eq(em_checkpoint_export(table_dir, fresh, false, &info, &err), EM_DATA_LOSS);
    ck_assert_msg(strstr(err.message, "rows.emb") != NULL, "%s", err.message);
    ck_assert(!exists(fresh, "keys.npy"));
    ck_assert(!exists(fresh, "export.json"));
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* ---- refusals ---------------------------------------------------------------------- */

static void write_array(const char *dir, const char *name, const char *descr, uint64_t rows,
                        uint64_t columns, const void *data, size_t bytes)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *file = fopen(path, "wb");
    ck_assert_ptr_nonnull(file);
    em_error err;
    ck_assert_int_eq(em_npy_write_header(file, path, descr, rows, columns, &err), EM_OK);
    ck_assert_uint_eq(fwrite(data, 1, bytes, file), bytes);
    fclose(file);
}

/* Rewrites the float at (row, column) of a 2-D (or 1-D) float array file. */
static void set_float(const char *dir, const char *name, uint64_t row, uint64_t column,
                      float value)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *file = fopen(path, "r+b");
    em_npy_array shape;
    em_error err;
    ck_assert_int_eq(em_npy_read_header(file, path, &shape, &err), EM_OK);
    fseek(file, (long)(shape.data_offset + (row * shape.columns + column) * sizeof(float)),
          SEEK_SET);
    fwrite(&value, sizeof(value), 1, file);
    fclose(file);
}

static void truncate_by(const char *dir, const char *name, off_t bytes)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    struct stat st;
    ck_assert_int_eq(stat(path, &st), 0);
    ck_assert_int_eq(truncate(path, st.st_size - bytes), 0);
}

static void remove_in(const char *dir, const char *name)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    ck_assert_int_eq(unlink(path), 0);
}

static void replace_in_file(const char *dir, const char *name, const char *from, const char *to)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *file = fopen(path, "r+b");
    char head[128];
    size_t got = fread(head, 1, sizeof(head), file);
    for (size_t i = 0; i + strlen(from) <= got; i++)
        if (memcmp(head + i, from, strlen(from)) == 0) {
            fseek(file, (long)i, SEEK_SET);
            fwrite(to, 1, strlen(to), file);
            break;
        }
    fclose(file);
}

enum bad_import {
    KEYS_SIGNED,
    WEIGHTS_OTHER_DIM,
    KEY_TWICE,
    STATE_NOT_FINITE,
    SECOND_MOMENT_NEGATIVE,
    WEIGHTS_FEWER_ROWS,
    WEIGHTS_TRUNCATED,
    FORTRAN_ORDER,
    PART_OF_THE_STATE,
    ABOVE_CAPACITY,
    NO_CONFIG,
    NOT_AN_ARRAY,
    BAD_IMPORT_COUNT
};

/* Each bad directory of arrays is refused with INVALID_ARGUMENT naming the file and what
 * is wrong, and nothing is written under the root. */
START_TEST(imports_refuse_bad_arrays_naming_the_file)
{
    enum bad_import how = (enum bad_import)_i;
    const uint32_t dim = 4;
    char dir[256], out[512], root[512];
    em_test_make_dir("ember-import", dir, sizeof(dir));
    snprintf(out, sizeof(out), "%s/out", dir);
    snprintf(root, sizeof(root), "%s/root", dir);
    em_backend *backend = make_backend();
    em_table *table = saved_table(backend, 3, dim, dir); /* adam */
    char table_dir[512];
    snprintf(table_dir, sizeof(table_dir), "%s/t", dir);
    em_checkpoint_info info;
    em_error err;
    ck_assert_int_eq(em_checkpoint_export(table_dir, out, false, &info, &err), EM_OK);
    uint64_t n = info.rows;
    ck_assert_uint_gt(n, 20);
    uint64_t *keys = em_test_read_array(out, "keys.npy", "<u8", n, 0);
    em_checkpoint_import_options options;
    em_checkpoint_import_options_init(&options);
    const char *expected = NULL;
    char text[256];
    switch (how) {
    case KEYS_SIGNED:
        write_array(out, "keys.npy", "<i8", n, 0, keys, n * sizeof(uint64_t));
        expected = "keys.npy: elements of type '<i8'";
        break;
    case WEIGHTS_OTHER_DIM: {
        float *wide = calloc(n * (dim + 1), sizeof(float));
        write_array(out, "weights.npy", "<f4", n, dim + 1, wide, n * (dim + 1) * sizeof(float));
        free(wide);
        expected = "weights.npy: weights of 5 floats a row where the table's dim is 4";
        break;
    }
    case KEY_TWICE:
        keys[17] = keys[3];
        write_array(out, "keys.npy", "<u8", n, 0, keys, n * sizeof(uint64_t));
        snprintf(text, sizeof(text), "key %" PRIu64 " appears twice (rows 3 and 17)", keys[3]);
        expected = text;
        break;
    case STATE_NOT_FINITE:
        set_float(out, "first_moment.npy", 7, 2, NAN);
        snprintf(text, sizeof(text), "first_moment.npy: row 7 (key %" PRIu64 "), element 2 is nan",
                 keys[7]);
        expected = text;
        break;
    case SECOND_MOMENT_NEGATIVE:
        set_float(out, "second_moment.npy", 9, 1, -0.5f);
        snprintf(text, sizeof(text),
                 "second_moment.npy: row 9 (key %" PRIu64 "), element 1 is -0.5, must be >= 0",
                 keys[9]);
        expected = text;
        break;
    case WEIGHTS_FEWER_ROWS: {
        float *fewer = calloc(n * dim, sizeof(float));
        write_array(out, "weights.npy", "<f4", n - 1, dim, fewer, (n - 1) * dim * sizeof(float));
        free(fewer);
        snprintf(text, sizeof(text), "weights.npy: %" PRIu64 " rows where keys.npy holds %" PRIu64
                 " keys", n - 1, n);
        expected = text;
        break;
    }
    case WEIGHTS_TRUNCATED:
        truncate_by(out, "weights.npy", 3);
        expected = "(a truncated file?)";
        break;
    case FORTRAN_ORDER:
        replace_in_file(out, "weights.npy", "False", "True ");
        expected = "weights.npy: the array is in Fortran order";
        break;
    case PART_OF_THE_STATE:
        remove_in(out, "step.npy");
        expected = "but no step.npy";
        break;
    case ABOVE_CAPACITY:
        options.config_json = "{\"name\": \"t\", \"dim\": 4, \"capacity\": 10, "
                              "\"optimizer\": {\"type\": \"adam\"}}";
        snprintf(text, sizeof(text), "keys.npy: %" PRIu64 " keys, above table 't''s capacity of 10",
                 n);
        expected = text;
        break;
    case NO_CONFIG:
        remove_in(out, "export.json");
        expected = "export.json': No such file or directory; give the table's config instead";
        break;
    case NOT_AN_ARRAY: {
        char path[600];
        snprintf(path, sizeof(path), "%s/second_moment.npy", out);
        FILE *file = fopen(path, "w");
        fputs("0.1,0.2,0.3\n", file);
        fclose(file);
        expected = "second_moment.npy: not a NumPy array file";
        break;
    }
    case BAD_IMPORT_COUNT:
        break;
    }
    ck_assert_int_eq(em_checkpoint_import(out, root, &options, &info, &err), EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, expected) != NULL, "'%s' does not say '%s'", err.message,
                  expected);
    ck_assert_msg(access(root, F_OK) != 0, "the refused import wrote under %s", root);

    /* with the weights only, a damaged state is not read */
    if (how == STATE_NOT_FINITE || how == SECOND_MOMENT_NEGATIVE || how == PART_OF_THE_STATE ||
        how == NOT_AN_ARRAY) {
        options.weights_only = true;
        ck_assert_msg(em_checkpoint_import(out, root, &options, &info, &err) == EM_OK, "%s",
                      err.message);
        ck_assert_uint_eq(info.rows, n);
    }
    free(keys);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* Headers NumPy writes in other versions and spacings read alike; others are refused. */
START_TEST(array_headers_read_as_numpy_writes_them)
{
    char dir[256], path[600];
    em_test_make_dir("ember-npy", dir, sizeof(dir));
    snprintf(path, sizeof(path), "%s/a.npy", dir);
    struct {
        const char *header; /* the dict */
        int major;
        em_status status;
        uint64_t rows, columns;
        uint32_t dimensions;
    } cases[] = {
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (3, 2), }", 1, EM_OK, 3, 2, 2},
        {"{\"descr\":\"<f4\",\"fortran_order\":False,\"shape\":(6,)}", 2, EM_OK, 6, 1, 1},
        {"{'shape': (2,3), 'fortran_order': False, 'descr': '<f4'}", 3, EM_OK, 2, 3, 2},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 3), }", 1,
         EM_INVALID_ARGUMENT, 0, 0, 0},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (), }", 1, EM_INVALID_ARGUMENT, 0,
         0, 0},
        {"{'descr': '<f4', 'shape': (6,), }", 1, EM_INVALID_ARGUMENT, 0, 0, 0},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (-6,), }", 1, EM_INVALID_ARGUMENT,
         0, 0, 0},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (6,), }", 4, EM_INVALID_ARGUMENT,
         0, 0, 0},
        {"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,), }", 1,
         EM_INVALID_ARGUMENT, 0, 0, 0},
    };
    float data[6] = {1, 2, 3, 4, 5, 6};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        FILE *file = fopen(path, "wb");
        size_t dict = strlen(cases[c].header);
        size_t length_bytes = cases[c].major == 1 ? 2 : 4;
        size_t total = (6 + 2 + length_bytes + dict + 1 + 63) / 64 * 64;
        uint32_t header_length = (uint32_t)(total - 6 - 2 - length_bytes);
        fwrite("\x93NUMPY", 1, 6, file);
        fputc(cases[c].major, file);
        fputc(0, file);
        for (size_t b = 0; b < length_bytes; b++)
            fputc((int)((header_length >> (8 * b)) & 0xff), file);
        fputs(cases[c].header, file);
        for (size_t pad = 6 + 2 + length_bytes + dict; pad < total - 1; pad++)
            fputc(' ', file);
        fputc('\n', file);
        fwrite(data, sizeof(float), 6, file);
        fclose(file);
        file = fopen(path, "rb");
        em_npy_array shape;
        em_error err;
        em_status status = em_npy_read_header(file, path, &shape, &err);
        ck_assert_msg(status == cases[c].status, "case %zu: %s", c,
                      status == EM_OK ? "read" : err.message);
        if (status == EM_OK) {
            ck_assert_uint_eq(shape.rows, cases[c].rows);
            ck_assert_uint_eq(shape.columns, cases[c].columns);
            ck_assert_uint_eq(shape.dimensions, cases[c].dimensions);
            ck_assert_uint_eq(shape.data_offset, total);
            float first;
            ck_assert_uint_eq(fread(&first, sizeof(first), 1, file), 1);
            ck_assert(first == 1.0f);
        } else {
            ck_assert_msg(strstr(err.message, path) != NULL, "%s", err.message);
        }
        fclose(file);
    }
    em_test_remove_tree(dir);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("export");
    TCase *round_trip = tcase_create("round_trip");
    tcase_set_timeout(round_trip, 120);
    tcase_add_loop_test(round_trip, exports_hold_every_row_by_key_and_import_back_bit_for_bit, 0,
                        4);
    tcase_add_test(round_trip, exports_refuse_occupied_directories_and_damaged_checkpoints);
    suite_add_tcase(suite, round_trip);
    TCase *refusals = tcase_create("refusals");
    tcase_set_timeout(refusals, 120);
    tcase_add_loop_test(refusals, imports_refuse_bad_arrays_naming_the_file, 0, BAD_IMPORT_COUNT);
    tcase_add_test(refusals, array_headers_read_as_numpy_writes_them);
    suite_add_tcase(suite, refusals);
    return em_test_run(suite);
}
