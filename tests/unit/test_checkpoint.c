#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/keyhash.h"
#include "lib/base/failpoint.h"
#include "lib/checkpoint/checkpoint.h"
#include "lib/checkpoint/checkpoint_io.h"
#include "lib/device/backend.h"
#include "lib/table/table.h"
#include "tests/support/test_batches.h"
#include "tests/support/test_support.h"

#define MEBIBYTE (UINT64_C(1) << 20)

/* Loads that keep the digests a delta needs. */
static const em_checkpoint_load_options tracking = {.track_changes = true};

/* ---- fixtures ---------------------------------------------------------------------- */

static em_backend *make_backend(void)
{
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.devices = 2;
    options.pool_limit_bytes = 256 * MEBIBYTE;
    em_backend *backend = NULL;
    em_error err;
    ck_assert_msg(em_backend_create_cpu(&options, &backend, &err) == EM_OK, "%s", err.message);
    return backend;
}



/* A table with rows trained by a few random pushes (every optimizer state moves). */
static em_table *trained_table(em_backend *backend, int optimizer, uint32_t dim, uint32_t rows,
                               em_test_rng *rng)
{
    em_table_config config;
    em_table_config_init(&config, "t", dim, 100000);
    config.shards = 3;
    config.optimizer = em_test_optimizers[optimizer];
    config.initializer.kind = EM_INIT_UNIFORM;
    config.initializer.bound = 0.5f;
    config.initializer.seed = 99;
    em_table *table = em_test_make_table(backend, &config);
    em_error err;
    for (int round = 0; round < 3; round++) {
        em_test_batch b = em_test_random_batch(rng, rows, 4, rows * 2);
        float *g = em_test_random_floats(rng, b.csr.nnz * dim);
        ck_assert_int_eq(em_test_push(table, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
        free(g);
        em_test_batch_free(&b);
    }
    return table;
}

static void push_same(em_table *a, em_table *b, uint32_t dim, uint64_t seed)
{
    em_test_rng rng;
    em_test_rng_init(&rng, seed);
    em_test_batch batch = em_test_random_batch(&rng, 200, 4, 600);
    float *g = em_test_random_floats(&rng, batch.csr.nnz * dim);
    em_error err;
    ck_assert_int_eq(em_test_push(a, &batch.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    ck_assert_int_eq(em_test_push(b, &batch.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    free(g);
    em_test_batch_free(&batch);
}

/* ---- round trips ------------------------------------------------------------------- */

/* Every row and all optimizer state come back bit for bit, and training on from the
 * restored table gives bit for bit what training on from the original gives. */
START_TEST(saved_tables_load_bit_for_bit_and_train_on_alike)
{
    int optimizer = _i;
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, optimizer, 8, 3000, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.buffer_bytes = 1; /* the smallest buffer: several runs per save */
    em_checkpoint_info saved, loaded;
    em_error err;
    ck_assert_msg(em_checkpoint_save(table, &options, &saved, &err) == EM_OK, "%s", err.message);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(saved.rows, stats.rows);
    ck_assert_str_eq(saved.id, "00000000000000000001");

    char latest[4200];
    ck_assert_int_eq(em_checkpoint_latest(dir, "t", latest, sizeof(latest), &err), EM_OK);
    ck_assert_str_eq(latest, saved.path);
    em_table *restored = NULL;
    ck_assert_msg(em_checkpoint_load(latest, backend, NULL, NULL, &restored, &loaded, &err) == EM_OK,
                  "%s", err.message);
    ck_assert_uint_eq(loaded.rows, saved.rows);
    ck_assert_uint_eq(loaded.bytes, saved.bytes);
    const em_table_config *a = em_table_get_config(table), *b = em_table_get_config(restored);
    ck_assert_str_eq(b->name, "t");
    ck_assert_uint_eq(b->dim, a->dim);
    ck_assert_int_eq(b->optimizer.kind, a->optimizer.kind);
    ck_assert_uint_eq(b->shards, a->shards);

    em_test_snapshot before = em_test_snapshot_take(table, 1000);
    em_test_snapshot after = em_test_snapshot_take(restored, 1000);
    em_test_assert_snapshots_identical(&before, &after);
    em_test_snapshot_free(&after);
    /* read a few KiB at a time: chunks straddle the blocks, and the rows of each block
     * go in from where it holds them while the next is read into the other */
    em_checkpoint_load_options small_blocks = {.read_block_bytes = 3001};
    em_table *again = NULL;
    ck_assert_msg(em_checkpoint_load(latest, backend, NULL, &small_blocks, &again, NULL, &err) ==
                      EM_OK, "%s", err.message);
    after = em_test_snapshot_take(again, 1000);
    em_test_assert_snapshots_identical(&before, &after);
    em_test_snapshot_free(&after);
    em_table_destroy(again);
    for (uint64_t step = 0; step < 3; step++)
        push_same(table, restored, 8, em_test_seed() + step);
    em_test_snapshot_free(&before);
    before = em_test_snapshot_take(table, 1000);
    after = em_test_snapshot_take(restored, 1000);
    em_test_assert_snapshots_identical(&before, &after);
    em_test_snapshot_free(&before);
    em_test_snapshot_free(&after);

    /* and under another name */
    em_table *renamed = NULL;
    ck_assert_int_eq(em_checkpoint_load(latest, backend, "u", NULL, &renamed, NULL, &err), EM_OK);
    ck_assert_str_eq(em_table_name(renamed), "u");
    /* rows come in the saved table's map order: the loaded maps hash with a seed of
     * their own, the same for every load of this checkpoint */
    ck_assert_uint_eq(em_table_hash_seed(table), 0);
    ck_assert_uint_ne(em_table_hash_seed(restored), 0);
    ck_assert_uint_eq(em_table_hash_seed(renamed),
                      em_table_hash_seed(restored));
    em_table_destroy(renamed);
    em_table_destroy(restored);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* Warm start: the weights of an adam table into tables with other optimizers, each
 * row's state as a new row's; another dim is refused naming both. */
START_TEST(weights_load_into_another_optimizer)
{
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, 3, 8, 500, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    em_checkpoint_info info;
    em_error err;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
    em_test_snapshot source = em_test_snapshot_take(table, 1000);
    for (int optimizer = 0; optimizer < 3; optimizer++) {
        em_table_config config;
        em_table_config_init(&config, "warm", 8, 1000);
        config.optimizer = em_test_optimizers[optimizer];
        config.optimizer.initial_accumulator = optimizer == 0 ? 0.0f : 0.25f;
        em_table *warm = NULL;
        ck_assert_msg(em_checkpoint_load_weights(info.path, backend, &config, &warm, NULL,
                                                 &err) == EM_OK, "%s", err.message);
        ck_assert_str_eq(em_table_name(warm), "warm");
        em_test_snapshot got = em_test_snapshot_take(warm, 1000);
        ck_assert_uint_eq(got.count, source.count);
        for (uint64_t r = 0; r < got.count; r++) {
            ck_assert_uint_eq(got.keys[r], source.keys[r]);
            ck_assert_mem_eq(got.values + r * got.width, source.values + r * source.width,
                             8 * sizeof(float));
            for (uint32_t j = 8; j < got.width; j++)
                ck_assert_float_eq(got.values[r * got.width + j], 0.25f);
        }
        em_test_snapshot_free(&got);
        em_table_destroy(warm);
    }
    em_table_config wide;
    em_table_config_init(&wide, "wide", 16, 1000);
    em_table *none = NULL;
    ck_assert_int_eq(em_checkpoint_load_weights(info.path, backend, &wide, &none, NULL, &err),
                     EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "dim 8") != NULL && strstr(err.message, "dim 16") != NULL,
                  "%s", err.message);
    /* the table keeps its capacity: the rows do not go into one row less */
    em_table_config small;
    em_table_config_init(&small, "small", 8, source.count - 1);
    ck_assert_int_eq(em_checkpoint_load_weights(info.path, backend, &small, &none, NULL, &err),
                     EM_INVALID_ARGUMENT);
    ck_assert_ptr_null(none);
    char expected[160];
    snprintf(expected, sizeof(expected), "its %" PRIu64 " rows are more than the capacity %" PRIu64
             " of table 'small'", source.count, source.count - 1);
    ck_assert_msg(strstr(err.message, expected) != NULL, "%s", err.message);
    small.capacity = source.count;
    ck_assert_msg(em_checkpoint_load_weights(info.path, backend, &small, &none, NULL, &err) ==
                      EM_OK, "%s", err.message);
    em_table_stats small_stats;
    em_table_get_stats(none, &small_stats);
    ck_assert_uint_eq(small_stats.rows, source.count);
    ck_assert_uint_eq(em_table_get_config(none)->capacity, source.count);
    em_table_destroy(none);
    em_test_snapshot_free(&source);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

START_TEST(empty_tables_round_trip)
{
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_table_config config;
    em_table_config_init(&config, "empty", 4, 100);
    em_table *table = em_test_make_table(backend, &config);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    em_checkpoint_info info;
    em_error err;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
    ck_assert_uint_eq(info.rows, 0);
    em_table *restored = NULL;
    ck_assert_msg(em_checkpoint_load(info.path, backend, NULL, NULL, &restored, NULL, &err) == EM_OK,
                  "%s", err.message);
    em_table_stats stats;
    em_table_get_stats(restored, &stats);
    ck_assert_uint_eq(stats.rows, 0);
    em_table_destroy(restored);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* Saves number themselves, LATEST moves to each, and only `keep` stay; a table's
 * directory loads as its latest checkpoint. */
START_TEST(saves_keep_the_newest)
{
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, 0, 4, 100, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.keep = 2;
    em_checkpoint_info info;
    em_error err;
    for (int i = 1; i <= 4; i++) {
        ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
        char expected[32];
        snprintf(expected, sizeof(expected), "%020d", i);
        ck_assert_str_eq(info.id, expected);
    }
    em_checkpoint_info *list = NULL;
    size_t count = 0;
    ck_assert_int_eq(em_checkpoint_list(dir, "t", &list, &count, &err), EM_OK);
    ck_assert_uint_eq(count, 2);
    ck_assert_str_eq(list[0].id, "00000000000000000003");
    ck_assert_str_eq(list[1].id, "00000000000000000004");
    free(list);
    char **names = NULL;
    ck_assert_int_eq(em_checkpoint_tables(dir, &names, &count, &err), EM_OK);
    ck_assert_uint_eq(count, 1);
    ck_assert_str_eq(names[0], "t");
    em_checkpoint_free_names(names, count);
    ck_assert_int_eq(em_checkpoint_latest(dir, "nothing", info.path, sizeof(info.path), &err),
                     EM_NOT_FOUND);
    /* a table's directory stands for the checkpoint its LATEST names, with or without a
     * trailing slash; the checkpoint dir above it is no checkpoint at all */
    char table_dir[512];
    for (int slash = 0; slash < 2; slash++) {
        snprintf(table_dir, sizeof(table_dir), "%s/t%s", dir, slash ? "/" : "");
        em_checkpoint_info found;
        ck_assert_msg(em_checkpoint_verify(table_dir, &found, &err) == EM_OK, "%s", err.message);
        ck_assert_str_eq(found.id, "00000000000000000004");
        ck_assert_str_eq(found.path, info.path);
        em_table *loaded = NULL;
        ck_assert_msg(em_checkpoint_load(table_dir, backend, NULL, NULL, &loaded, &found, &err) ==
                          EM_OK,
                      "%s", err.message);
        ck_assert_str_eq(found.path, info.path);
        em_table_destroy(loaded);
    }
    ck_assert_int_eq(em_checkpoint_verify(dir, NULL, &err), EM_NOT_FOUND);
    ck_assert_msg(strstr(err.message, "is not a checkpoint (no manifest.json, rows.emb or "
                                      "index.emb) nor a table's directory of checkpoints") != NULL,
                  "%s", err.message);
    ck_assert_msg(strstr(err.message, "it holds the checkpoints of tables t: name one") != NULL,
                  "%s", err.message);
    /* beside a table named LATEST (a directory, whose own LATEST names its checkpoint),
     * the dir above is still no checkpoint, and both tables are named */
    char latest_table[512];
    snprintf(latest_table, sizeof(latest_table), "%s/LATEST", dir);
    ck_assert_int_eq(mkdir(latest_table, 0755), 0);
    char pointer[600];
    snprintf(pointer, sizeof(pointer), "%s/LATEST", latest_table);
    FILE *file = fopen(pointer, "w");
    ck_assert_ptr_nonnull(file);
    fputs("00000000000000000001\n", file);
    fclose(file);
    ck_assert_int_eq(em_checkpoint_verify(dir, NULL, &err), EM_NOT_FOUND);
    ck_assert_msg(strstr(err.message, "nor a table's directory of checkpoints (no LATEST file)") !=
                          NULL &&
                      strstr(err.message, " t") != NULL && strstr(err.message, " LATEST") != NULL,
                  "%s", err.message);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* ---- corruption -------------------------------------------------------------------- */

static long file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (long)st.st_size : -1;
}

/* Damages one file of a copy of the checkpoint, in one of the ways below. */
enum damage { FLIP_ROWS, FLIP_ROWS_HEADER, FLIP_INDEX, FLIP_MANIFEST, TRUNCATE_ROWS,
              EXTEND_ROWS, MISSING_INDEX, FOREIGN_ROWS, DAMAGE_COUNT };

static const char *const damaged_file[DAMAGE_COUNT] = {
    "rows.emb", "rows.emb", "index.emb", "manifest.json", "rows.emb", "rows.emb",
    "index.emb", "rows.emb",
};

static void damage(const char *checkpoint, enum damage how)
{
    char path[4400];
    snprintf(path, sizeof(path), "%s/%s", checkpoint, damaged_file[how]);
    long size = file_size(path);
    switch (how) {
    case FLIP_ROWS:
        em_test_flip_byte(path, size / 2);
        break;
    case FLIP_ROWS_HEADER:
        em_test_flip_byte(path, 20);
        break;
    case FLIP_INDEX:
        em_test_flip_byte(path, 30);
        break;
    case FLIP_MANIFEST:
        em_test_flip_byte(path, 40);
        break;
    case TRUNCATE_ROWS:
        ck_assert_int_eq(truncate(path, size - 100), 0);
        break;
    case EXTEND_ROWS: {
        FILE *f = fopen(path, "ab");
        fputs("more", f);
        fclose(f);
        break;
    }
    case MISSING_INDEX:
        ck_assert_int_eq(unlink(path), 0);
        break;
    case FOREIGN_ROWS: { /* the same size of something else */
        FILE *f = fopen(path, "wb");
        for (long i = 0; i < size; i++)
            fputc((int)(i * 7 % 251), f);
        fclose(f);
        break;
    }
    case DAMAGE_COUNT:
        break;
    }
}

/* Each damage is refused with DATA_LOSS naming the file; loading fails whole. */
/* An adam table of dim 8 trained on 2,000 keys, saved (whole) under a new directory
 * (dir): the table, and the checkpoint in *info. */
static em_table *saved_adam_table(em_backend *backend, char *dir, size_t dir_capacity,
                                  em_checkpoint_info *info)
{
    em_test_make_dir("ember-checkpoint", dir, dir_capacity);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, 3, 8, 2000, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    em_error err;
    ck_assert_msg(em_checkpoint_save(table, &options, info, &err) == EM_OK, "%s", err.message);
    return table;
}

START_TEST(damaged_checkpoints_are_refused_naming_the_file)
{
    enum damage how = (enum damage)_i;
    char dir[256];
    em_backend *backend = make_backend();
    em_checkpoint_info info;
    em_table *table = saved_adam_table(backend, dir, sizeof(dir), &info);
    em_error err;
    ck_assert_int_eq(em_checkpoint_verify(info.path, NULL, &err), EM_OK);
    damage(info.path, how);
    ck_assert_int_eq(em_checkpoint_verify(info.path, NULL, &err), EM_DATA_LOSS);
    ck_assert_msg(strstr(err.message, damaged_file[how]) != NULL, "%s", err.message);
    ck_assert_msg(strstr(err.message, info.path) != NULL, "%s", err.message);
    if (how == FLIP_ROWS)
        ck_assert_msg(strstr(err.message, "chunk ") != NULL &&
                          strstr(err.message, "checksum mismatch: expected ") != NULL &&
                          strstr(err.message, ", seen ") != NULL,
                      "%s", err.message);
    em_table *restored = NULL;
    ck_assert_int_eq(em_checkpoint_load(info.path, backend, NULL, NULL, &restored, NULL, &err),
                     EM_DATA_LOSS);
    ck_assert_ptr_null(restored);
    ck_assert_msg(strstr(err.message, damaged_file[how]) != NULL, "%s", err.message);
    if (how == FLIP_ROWS) /* the load's importer checks the payloads as verify does */
        ck_assert_msg(strstr(err.message, "chunk ") != NULL &&
                          strstr(err.message, "checksum mismatch: expected ") != NULL &&
                          strstr(err.message, ", seen ") != NULL,
                      "%s", err.message);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* rows.emb read a few bytes at a time: every chunk spans several blocks, more than the
 * read ahead holds at once, and a block ends within most chunks. The table comes back
 * bit for bit, and a flipped byte is still refused naming its chunk. */
START_TEST(chunks_larger_than_the_blocks_read_ahead_load_alike)
{
    char dir[256];
    em_backend *backend = make_backend();
    em_checkpoint_info info;
    em_table *table = saved_adam_table(backend, dir, sizeof(dir), &info);
    em_error err;
    em_test_snapshot before = em_test_snapshot_take(table, 1000);
    const uint64_t block_bytes[] = {7, 64, 333, 0};
    for (int ahead = -1; ahead <= 1; ahead += 2) /* read here, then on the thread */
        for (size_t b = 0; b < sizeof(block_bytes) / sizeof(block_bytes[0]); b++) {
            em_checkpoint_load_options small_blocks = {.read_block_bytes = block_bytes[b],
                                                       .read_ahead = ahead};
            em_table *restored = NULL;
            ck_assert_msg(em_checkpoint_load(info.path, backend, NULL, &small_blocks, &restored,
                                             NULL, &err) == EM_OK,
                          "blocks of %" PRIu64 " bytes, read_ahead %d: %s", block_bytes[b], ahead,
                          err.message);
            em_test_snapshot after = em_test_snapshot_take(restored, 1000);
            em_test_assert_snapshots_identical(&before, &after);
            em_test_snapshot_free(&after);
            em_table_destroy(restored);
        }
    damage(info.path, FLIP_ROWS);
    for (int ahead = -1; ahead <= 1; ahead += 2) {
        em_checkpoint_load_options small_blocks = {.read_block_bytes = 64, .read_ahead = ahead};
        em_table *restored = NULL;
        ck_assert_int_eq(em_checkpoint_load(info.path, backend, NULL, &small_blocks, &restored,
                                            NULL, &err),
                         EM_DATA_LOSS);
        ck_assert_ptr_null(restored);
        ck_assert_msg(strstr(err.message, "rows.emb") != NULL &&
                          strstr(err.message, "chunk ") != NULL &&
                          strstr(err.message, "checksum mismatch") != NULL,
                      "%s", err.message);
    }
    em_test_snapshot_free(&before);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* A read of rows.emb that fails (failpoint checkpoint_read_fail: half the read, then
 * EIO), the first block's or a later one's, read here or ahead on the thread, whole or
 * for some buckets: the load is refused with DATA_LOSS naming the file, the chunk and
 * the error, no table comes back, and the next load, the failpoint spent, succeeds. */
START_TEST(a_failed_read_is_refused_naming_the_file)
{
    char dir[256];
    em_backend *backend = make_backend();
    em_checkpoint_info info;
    em_table *table = saved_adam_table(backend, dir, sizeof(dir), &info);
    em_error err;
    em_test_snapshot before = em_test_snapshot_take(table, 1000);
    for (int ahead = -1; ahead <= 1; ahead += 2)
        for (int owner = 0; owner < 2; owner++)
            for (int later = 0; later < 2; later++) {
                char spec[64];
                snprintf(spec, sizeof(spec), "checkpoint_read_fail=%" PRIu64 "*1",
                         later ? info.bytes / 2 : 0);
                ck_assert_int_eq(em_failpoints_arm(spec, &err), EM_OK);
                em_checkpoint_load_options reads = {.read_block_bytes = 4096,
                                                    .read_ahead = ahead,
                                                    .owner_count = owner ? 2 : 0};
                em_table *restored = NULL;
                ck_assert_int_eq(em_checkpoint_load(info.path, backend, NULL, &reads, &restored,
                                                    NULL, &err),
                                 EM_DATA_LOSS);
                em_failpoints_disarm_all();
                ck_assert_ptr_null(restored);
                ck_assert_msg(strstr(err.message, "rows.emb") != NULL &&
                                  strstr(err.message, "chunk ") != NULL &&
                                  strstr(err.message, "read failed: Input/output error") != NULL,
                              "read_ahead %d, owner %d, later %d: %s", ahead, owner, later,
                              err.message);
                ck_assert_msg(em_checkpoint_load(info.path, backend, NULL, &reads, &restored,
                                                 NULL, &err) == EM_OK,
                              "%s", err.message);
                if (!owner) {
                    em_test_snapshot after = em_test_snapshot_take(restored, 1000);
                    em_test_assert_snapshots_identical(&before, &after);
                    em_test_snapshot_free(&after);
                }
                em_table_destroy(restored);
            }
    /* chunks larger than the blocks, a read past the middle failing every time: the reads
     * a large chunk did not need are made again, and the failure is what is reported */
    for (int ahead = -1; ahead <= 1; ahead += 2) {
        char spec[64];
        snprintf(spec, sizeof(spec), "checkpoint_read_fail=%" PRIu64, info.bytes / 2);
        ck_assert_int_eq(em_failpoints_arm(spec, &err), EM_OK);
        em_checkpoint_load_options tiny = {.read_block_bytes = 7, .read_ahead = ahead};
        em_table *restored = NULL;
        ck_assert_int_eq(em_checkpoint_load(info.path, backend, NULL, &tiny, &restored, NULL,
                                            &err),
                         EM_DATA_LOSS);
        em_failpoints_disarm_all();
        ck_assert_ptr_null(restored);
        ck_assert_msg(strstr(err.message, "read failed: Input/output error") != NULL, "%s",
                      err.message);
    }
    em_test_snapshot_free(&before);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* ---- values that pass every checksum and no table takes ------------------------------ */

static unsigned char *read_whole(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    fseek(f, 0, SEEK_END);
    *size = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *data = malloc(*size + 1);
    ck_assert_uint_eq(fread(data, 1, *size, f), *size);
    data[*size] = 0;
    fclose(f);
    return data;
}

static void write_whole(const char *path, const void *data, size_t size)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(data, 1, size, f), size);
    fclose(f);
}

/* Replaces the 16 hex digits of old by those of new in text (once, where they are). */
static void replace_hex(char *text, uint64_t old, uint64_t new)
{
    char from[17], to[17];
    snprintf(from, sizeof(from), "%016" PRIx64, old);
    snprintf(to, sizeof(to), "%016" PRIx64, new);
    char *at = strstr(text, from);
    ck_assert_ptr_nonnull(at);
    memcpy(at, to, 16);
}

/* rows.emb's checksum as the manifest has it (format version 4 and later): of each
 * chunk's header and payload checksums, in the order index.emb lists the chunks. */
static uint64_t rows_checksum(const unsigned char *rows, const unsigned char *index,
                              size_t index_size)
{
    XXH3_state_t *digest = XXH3_createState();
    XXH3_64bits_reset(digest);
    for (size_t entry = 24; entry + 24 <= index_size - 8; entry += 24) {
        uint64_t offset, pair[2];
        memcpy(&offset, index + entry + 8, 8);
        memcpy(&pair[0], rows + offset + 40, 8); /* header_xxh3 */
        memcpy(&pair[1], rows + offset + 32, 8); /* payload_xxh3 */
        XXH3_64bits_update(digest, pair, sizeof(pair));
    }
    uint64_t sum = XXH3_64bits_digest(digest);
    XXH3_freeState(digest);
    return sum;
}

/* Writes value into float `element` of the first row of the checkpoint's first chunk and
 * seals it all again as a save would (docs/checkpoints.md): the chunk's payload and
 * header checksums, its index entry and index.emb's checksum, both files' checksums in
 * the manifest and the manifest's own line. Only the value is wrong; every checksum
 * holds. Returns the row's key. */
static uint64_t reseal_with_value(const char *checkpoint, uint32_t element, float value)
{
    char rows_path[4400], index_path[4400], manifest_path[4400];
    snprintf(rows_path, sizeof(rows_path), "%s/rows.emb", checkpoint);
    snprintf(index_path, sizeof(index_path), "%s/index.emb", checkpoint);
    snprintf(manifest_path, sizeof(manifest_path), "%s/manifest.json", checkpoint);
    size_t rows_size, index_size, manifest_size;
    unsigned char *rows = read_whole(rows_path, &rows_size);
    unsigned char *index = read_whole(index_path, &index_size);
    char *manifest = (char *)read_whole(manifest_path, &manifest_size);
    uint64_t rows_before = rows_checksum(rows, index, index_size);
    uint64_t index_before = XXH3_64bits(index, index_size);

    uint64_t offset, payload_bytes, key;
    uint32_t n;
    memcpy(&offset, index + 24 + 8, 8); /* entry 0: bucket, rows, offset, payload xxh3 */
    unsigned char *header = rows + offset;
    ck_assert_int_eq(memcmp(header, "EMBCHUNK", 8), 0);
    memcpy(&n, header + 16, 4);
    memcpy(&payload_bytes, header + 24, 8);
    unsigned char *payload = header + 48;
    memcpy(&key, payload, 8);
    memcpy(payload + (size_t)n * 8 + (size_t)element * 4, &value, 4);
    uint64_t payload_xxh3 = XXH3_64bits(payload, payload_bytes);
    memcpy(header + 32, &payload_xxh3, 8);
    uint64_t header_xxh3 = XXH3_64bits(header, 40);
    memcpy(header + 40, &header_xxh3, 8);
    memcpy(index + 24 + 16, &payload_xxh3, 8);
    uint64_t index_xxh3 = XXH3_64bits(index, index_size - 8);
    memcpy(index + index_size - 8, &index_xxh3, 8);

    replace_hex(manifest, rows_before, rows_checksum(rows, index, index_size));
    replace_hex(manifest, index_before, XXH3_64bits(index, index_size));
    char *last = strstr(manifest, "\nxxh3 ");
    ck_assert_ptr_nonnull(last);
    size_t body = (size_t)(last - manifest) + 1;
    snprintf(manifest + body, manifest_size + 1 - body, "xxh3 %016" PRIx64 "\n",
             XXH3_64bits(manifest, body));
    write_whole(rows_path, rows, rows_size);
    write_whole(index_path, index, index_size);
    write_whole(manifest_path, manifest, strlen(manifest));
    free(rows);
    free(index);
    free(manifest);
    return key;
}

/* The 16 hex digits of the checksum line of the manifest in checkpoint. */
static uint64_t manifest_line(const char *checkpoint)
{
    char path[4400];
    snprintf(path, sizeof(path), "%s/manifest.json", checkpoint);
    size_t size;
    char *text = (char *)read_whole(path, &size);
    char *last = strstr(text, "\nxxh3 ");
    ck_assert_ptr_nonnull(last);
    uint64_t sum = strtoull(last + 6, NULL, 16);
    free(text);
    return sum;
}

/* Makes the delta at checkpoint name its parent's manifest by the checksum now, and
 * signs its own manifest again. */
static void relink_to_parent(const char *checkpoint, uint64_t parent_before, uint64_t parent_now)
{
    char path[4400];
    snprintf(path, sizeof(path), "%s/manifest.json", checkpoint);
    size_t size;
    char *manifest = (char *)read_whole(path, &size);
    replace_hex(manifest, parent_before, parent_now);
    char *last = strstr(manifest, "\nxxh3 ");
    ck_assert_ptr_nonnull(last);
    size_t body = (size_t)(last - manifest) + 1;
    snprintf(manifest + body, size + 1 - body, "xxh3 %016" PRIx64 "\n",
             XXH3_64bits(manifest, body));
    write_whole(path, manifest, strlen(manifest));
    free(manifest);
}

/* The key of the first row of the checkpoint's first chunk. */
static uint64_t first_key(const char *checkpoint)
{
    char rows_path[4400], index_path[4400];
    snprintf(rows_path, sizeof(rows_path), "%s/rows.emb", checkpoint);
    snprintf(index_path, sizeof(index_path), "%s/index.emb", checkpoint);
    size_t rows_size, index_size;
    unsigned char *rows = read_whole(rows_path, &rows_size);
    unsigned char *index = read_whole(index_path, &index_size);
    uint64_t offset, key;
    memcpy(&offset, index + 24 + 8, 8);
    memcpy(&key, rows + offset + 48, 8);
    free(rows);
    free(index);
    return key;
}

/* A row that every checksum vouches for but that holds a non-finite weight or a negative
 * accumulator (a writer with a bug): a load refuses it with DATA_LOSS naming the chunk,
 * the key and the element, and so does verify, which checks what a load checks. Also
 * where the row is in the parent of a delta that holds the key anew (the load does not
 * take that row, but accepts no checkpoint that verify refuses). */
START_TEST(checksummed_rows_no_table_takes_are_refused)
{
    static const struct {
        int optimizer;
        uint32_t element;
        float value;
        const char *what;
    } cases[] = {
        {3, 2, NAN, "weight element 2 is not finite"},
        {3, 9, INFINITY, "is not finite"},
        {1, 8 + 3, -1.0f, "must be >= 0"},
    };
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, cases[_i].optimizer, 8, 2000, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.track_changes = true;
    em_checkpoint_info info;
    em_error err;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
    char parent[4096];
    snprintf(parent, sizeof(parent), "%s", info.path);
    /* the delta holds the parent's first row anew */
    uint64_t key = first_key(parent);
    em_test_batch one = em_test_key_batch(&key, 1);
    float g[8] = {0.5f, -0.25f, 0.125f, 1, 2, 3, 4, 5};
    ck_assert_int_eq(em_test_push(table, &one.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    em_test_batch_free(&one);
    options.delta = true;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
    ck_assert_str_eq(info.kind, "delta");
    char delta[4096];
    snprintf(delta, sizeof(delta), "%s", info.path);

    uint64_t parent_before = manifest_line(parent);
    ck_assert_uint_eq(reseal_with_value(parent, cases[_i].element, cases[_i].value), key);
    relink_to_parent(delta, parent_before, manifest_line(parent));
    char named[64];
    snprintf(named, sizeof(named), "(key %" PRIu64 ")", key);
    const char *const paths[2] = {parent, delta};
    for (int check = 0; check < 4; check++) { /* verify, then load, the parent then the delta */
        const char *path = paths[check / 2];
        em_table *restored = NULL;
        if (check % 2 == 0) {
            ck_assert_int_eq(em_checkpoint_verify(path, NULL, &err), EM_DATA_LOSS);
        } else {
            ck_assert_int_eq(em_checkpoint_load(path, backend, NULL, NULL, &restored, NULL, &err),
                             EM_DATA_LOSS);
            ck_assert_ptr_null(restored);
        }
        ck_assert_msg(strstr(err.message, parent) != NULL &&
                          strstr(err.message, "rows.emb: chunk 0: ") != NULL &&
                          strstr(err.message, named) != NULL &&
                          strstr(err.message, cases[_i].what) != NULL,
                      "%s", err.message);
    }
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* Replaces, in the manifest text (malloc'ed), the value of the first member `field`
 * after `anchor` by value; returns the new text. */
static char *replace_member(char *text, const char *anchor, const char *field, const char *value)
{
    char *from = strstr(text, anchor);
    ck_assert_ptr_nonnull(from);
    char quoted[64];
    snprintf(quoted, sizeof(quoted), "\"%s\":", field);
    char *at = strstr(from, quoted);
    ck_assert_ptr_nonnull(at);
    at += strlen(quoted);
    at += strspn(at, " \t");
    size_t old_length = strcspn(at, ",\n}");
    size_t head = (size_t)(at - text), tail = strlen(at + old_length);
    char *out = malloc(head + strlen(value) + tail + 1);
    memcpy(out, text, head);
    memcpy(out + head, value, strlen(value));
    memcpy(out + head + strlen(value), at + old_length, tail + 1);
    free(text);
    return out;
}

/* Signs the manifest text again (its last line) and writes it to checkpoint. */
static void write_signed_manifest(const char *checkpoint, char *text)
{
    char *last = strstr(text, "\nxxh3 ");
    ck_assert_ptr_nonnull(last);
    size_t body = (size_t)(last - text) + 1;
    char line[32];
    snprintf(line, sizeof(line), "xxh3 %016" PRIx64 "\n", XXH3_64bits(text, body));
    char path[4400];
    snprintf(path, sizeof(path), "%s/manifest.json", checkpoint);
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(text, 1, body, f), body);
    ck_assert_uint_eq(fwrite(line, 1, strlen(line), f), strlen(line));
    fclose(f);
}

/* Files and manifests that every checksum vouches for but whose sizes and counts are
 * impossible (a writer with a bug, or a checkpoint made up): refused with DATA_LOSS
 * naming the file and what is wrong, nothing read out of bounds (the sanitizer builds
 * check that), whether loaded or verified. */
START_TEST(sealed_impossible_sizes_and_counts_are_refused)
{
    static const char *const expected[] = {
        "index.emb: its header does not match the manifest",
        "manifest.json: field rows is missing or not a count",
        "manifest.json: field chunks is missing or not a count",
        "manifest.json: the entry of rows.emb is malformed",
        "manifest.json: field tombstones is missing or not a count",
    };
    char dir[256];
    em_backend *backend = make_backend();
    em_checkpoint_info info;
    em_table *table = saved_adam_table(backend, dir, sizeof(dir), &info);
    char manifest_path[4400];
    snprintf(manifest_path, sizeof(manifest_path), "%s/manifest.json", info.path);
    size_t size;
    char *text = (char *)read_whole(manifest_path, &size);
    if (_i == 0) { /* index.emb shorter than its header, the manifest agreeing */
        char index_path[4400];
        snprintf(index_path, sizeof(index_path), "%s/index.emb", info.path);
        unsigned char *index = read_whole(index_path, &size);
        replace_hex(text, XXH3_64bits(index, size), XXH3_64bits(index, 10));
        text = replace_member(text, "\"index.emb\"", "bytes", "10");
        write_whole(index_path, index, 10);
        free(index);
    } else if (_i == 1) { /* more rows than a count can be */
        text = replace_member(text, "\"kind\"", "rows", "1e300");
    } else if (_i == 2) {
        text = replace_member(text, "\"kind\"", "chunks", "2.5");
    } else if (_i == 3) {
        text = replace_member(text, "\"rows.emb\"", "bytes", "-0.5");
    } else {
        text = replace_member(text, "\"kind\"", "tombstones", "18446744073709551615");
    }
    write_signed_manifest(info.path, text);
    free(text);
    em_error err;
    ck_assert_int_eq(em_checkpoint_verify(info.path, NULL, &err), EM_DATA_LOSS);
    ck_assert_msg(strstr(err.message, expected[_i]) != NULL, "%s", err.message);
    em_table *restored = NULL;
    ck_assert_int_eq(em_checkpoint_load(info.path, backend, NULL, NULL, &restored, NULL, &err),
                     EM_DATA_LOSS);
    ck_assert_ptr_null(restored);
    ck_assert_msg(strstr(err.message, expected[_i]) != NULL, "%s", err.message);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* ---- failures of every step --------------------------------------------------------- */

static int count_entries(const char *path)
{
    int count = 0;
    DIR *dir = opendir(path);
    struct dirent *entry;
    while (dir != NULL && (entry = readdir(dir)) != NULL)
        count += entry->d_name[0] != '.' || strcmp(entry->d_name, ".lock") == 0 ? 1 : 0;
    if (dir != NULL)
        closedir(dir);
    return count;
}


/* rows.emb is written around the page cache (O_DIRECT) in whole aligned blocks; where
 * a write is refused that way (here: from memory that is not aligned), em_save_write
 * goes on through the page cache and every byte lands. */
START_TEST(direct_writes_go_on_buffered_where_refused)
{
    char dir[256], path[300];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    snprintf(path, sizeof(path), "%s/direct.bin", dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
    if (fd < 0) /* the file system has no direct I/O: nothing to fall back from */
        fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ck_assert_int_ge(fd, 0);
    enum { BYTES = 3 * 4096 + 100 };
    unsigned char *buffer = malloc(BYTES + 1);
    for (size_t i = 0; i <= BYTES; i++)
        buffer[i] = (unsigned char)(i * 7 + 1);
    em_error err;
    ck_assert_msg(em_save_write(fd, buffer + 1, BYTES, EM_SAVE_ROWS_WRITE, path, &err) == EM_OK,
                  "%s", err.message);
    ck_assert_int_eq(fsync(fd), 0);
    close(fd);
    FILE *f = fopen(path, "rb");
    unsigned char *back = malloc(BYTES + 1);
    ck_assert_uint_eq(fread(back, 1, BYTES + 1, f), BYTES);
    fclose(f);
    ck_assert_mem_eq(back, buffer + 1, BYTES);
    free(back);
    free(buffer);
    em_test_remove_tree(dir);
}
END_TEST

#ifndef EM_ADDRESS_SANITIZED
/* The resident bytes of this process, from /proc/self/statm. */
static uint64_t resident_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, resident = 0;
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(fscanf(f, "%llu %llu", &size, &resident), 2);
    fclose(f);
    return (uint64_t)resident * (uint64_t)sysconf(_SC_PAGESIZE);
}
#endif

/* io buffers of every size are aligned as direct writes need (from 2 MiB on, to 2 MiB),
 * hold every byte asked for, and go back to the system when freed: a save's buffers do
 * not stay in the process after it (outside a sanitizer build, whose buffers come from
 * malloc). */
START_TEST(io_buffers_are_aligned_and_given_back_when_freed)
{
    const size_t sizes[] = {0, 1, 4095, 4096, 100000, 2 * MEBIBYTE - 1, 2 * MEBIBYTE,
                            2 * MEBIBYTE + 1, 7 * MEBIBYTE + 3};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        unsigned char *buffer = em_io_buffer_alloc(sizes[i]);
        ck_assert_ptr_nonnull(buffer);
        size_t align = sizes[i] >= 2 * MEBIBYTE ? 2 * MEBIBYTE : EM_SAVE_DIRECT_ALIGN;
        ck_assert_msg((uintptr_t)buffer % align == 0, "%zu bytes at %p", sizes[i],
                      (void *)buffer);
        for (size_t b = 0; b < sizes[i]; b++)
            buffer[b] = (unsigned char)(b * 13 + i);
        size_t wrong = 0;
        for (size_t b = 0; b < sizes[i]; b++)
            wrong += buffer[b] != (unsigned char)(b * 13 + i);
        ck_assert_uint_eq(wrong, 0);
        em_io_buffer_free(buffer);
    }
    em_io_buffer_free(NULL);
    ck_assert_ptr_null(em_io_buffer_alloc(SIZE_MAX)); /* refused, not wrapped around */
    ck_assert_ptr_null(em_io_buffer_alloc(SIZE_MAX - 4096));
#ifndef EM_ADDRESS_SANITIZED
    enum { BUFFERS = 8 };
    const size_t bytes = 3 * MEBIBYTE + 12345;
    uint64_t before = resident_bytes();
    /* what the process allocates while a save runs, and keeps: from malloc, the buffers
     * (under malloc's own mapping bound, which rises to the size of a mapped block freed)
     * stayed in the heap below such blocks, 7 MiB of them resident after the frees */
    void *meanwhile[4] = {NULL};
    for (int round = 0; round < 4; round++) {
        unsigned char *buffers[BUFFERS];
        for (int k = 0; k < BUFFERS; k++) {
            buffers[k] = em_io_buffer_alloc(bytes);
            ck_assert_ptr_nonnull(buffers[k]);
            memset(buffers[k], round + 1, bytes);
        }
        meanwhile[round] = calloc(1, 200000);
        ck_assert_uint_ge(resident_bytes(), before + BUFFERS * (bytes / 2));
        for (int k = 0; k < BUFFERS; k++)
            em_io_buffer_free(buffers[k]);
        ck_assert_msg(resident_bytes() < before + 2 * MEBIBYTE,
                      "resident bytes went from %" PRIu64 " to %" PRIu64
                      " after the buffers were freed", before, resident_bytes());
    }
    for (int round = 0; round < 4; round++)
        free(meanwhile[round]);
#endif
}
END_TEST

/* A save whose step fails says which, and the checkpoint before it stays current and
 * whole; nothing of the failed one stays behind (the step after the rename of LATEST
 * is the one exception: the new checkpoint is complete and current then). */
START_TEST(a_failed_step_leaves_the_previous_checkpoint_current)
{
    int step = _i;
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, 1, 4, 500, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    em_checkpoint_info first, second;
    em_error err;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &first, &err), EM_OK);
    em_test_snapshot before = em_test_snapshot_take(table, 1000);
    push_same(table, table, 4, 5); /* the table moves on */

    char spec[64];
    snprintf(spec, sizeof(spec), "checkpoint_fail=%d", step);
    ck_assert_int_eq(em_failpoints_arm(spec, &err), EM_OK);
    em_status status = em_checkpoint_save(table, &options, &second, &err);
    em_failpoints_disarm_all();
    ck_assert_int_eq(status, EM_INTERNAL);
    ck_assert_msg(strstr(err.message, em_save_step_name((em_save_step)step)) != NULL, "%s",
                  err.message);

    char latest[4200], table_dir[300];
    em_status found = em_checkpoint_latest(dir, "t", latest, sizeof(latest), &err);
    ck_assert_int_eq(found, EM_OK);
    snprintf(table_dir, sizeof(table_dir), "%s/t", dir);
    if (step == EM_SAVE_LATEST_DIR_FSYNC) {
        ck_assert_str_eq(latest, second.path);
    } else {
        ck_assert_str_eq(latest, first.path);
        /* LATEST, .lock and the first checkpoint only */
        ck_assert_int_eq(count_entries(table_dir), 3);
        em_table *restored = NULL;
        ck_assert_int_eq(em_checkpoint_load(latest, backend, NULL, NULL, &restored, NULL, &err), EM_OK);
        em_test_assert_table_unchanged(restored, &before);
        em_table_destroy(restored);
    }
    /* the next save works */
    ck_assert_int_eq(em_checkpoint_save(table, &options, &second, &err), EM_OK);
    ck_assert_int_eq(em_checkpoint_verify(second.path, NULL, &err), EM_OK);
    em_test_snapshot_free(&before);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* Loads the checkpoint of an older format under tests/data (after verify passes it) and
 * checks its 64 rows: keys i x 1000003 + 5 of an adagrad table of dim 4, weights i / 4 + j
 * and accumulators one above. Returns the table for the caller's own checks. */
static em_table *load_old_checkpoint(em_backend *backend, const char *under)
{
    const char *data = getenv("EMBER_TEST_DATA");
    ck_assert_ptr_nonnull(data);
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", data, under);
    em_error err;
    ck_assert_msg(em_checkpoint_verify(path, NULL, &err) == EM_OK, "%s", err.message);
    em_table *table = NULL;
    em_checkpoint_info info;
    ck_assert_msg(em_checkpoint_load(path, backend, NULL, &tracking, &table, &info, &err) == EM_OK,
                  "%s", err.message);
    ck_assert_str_eq(info.kind, "full");
    ck_assert_uint_eq(info.table_rows, 64);
    em_test_snapshot got = em_test_snapshot_take(table, 1000);
    ck_assert_uint_eq(got.count, 64);
    for (uint64_t r = 0; r < got.count; r++) {
        uint64_t i = (got.keys[r] - 5) / 1000003u;
        ck_assert_uint_eq(got.keys[r], i * 1000003u + 5);
        for (uint32_t j = 0; j < 8; j++)
            ck_assert_float_eq(got.values[r * 8 + j],
                               (float)i * 0.25f + (float)j + (j >= 4 ? 1.0f : 0.0f));
    }
    em_test_snapshot_free(&got);
    return table;
}

/* A full checkpoint that format version 1 wrote (tests/data/checkpoint-v1) loads. */
START_TEST(version_1_checkpoints_still_load)
{
    em_backend *backend = make_backend();
    em_table *table = load_old_checkpoint(backend, "checkpoint-v1/v1/00000000000000000001");
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* A full checkpoint that format version 3 wrote (tests/data/checkpoint-v3: the same rows
 * in an lru table, with their access metadata; its rows.emb checksum is of the file's
 * bytes) loads. */
START_TEST(version_3_checkpoints_still_load)
{
    em_backend *backend = make_backend();
    em_table *table = load_old_checkpoint(backend, "checkpoint-v3/v3/00000000000000000001");
    ck_assert_int_eq(em_table_get_config(table)->eviction.policy, EM_EVICTION_LRU);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* A full checkpoint that format version 4 wrote (tests/data/checkpoint-v4: the same
 * rows in an lru table, without evicted.emb) loads, its evicted-key ring empty. */
START_TEST(version_4_checkpoints_still_load)
{
    em_backend *backend = make_backend();
    em_table *table = load_old_checkpoint(backend, "checkpoint-v4/v4/00000000000000000001");
    ck_assert_int_eq(em_table_get_config(table)->eviction.policy, EM_EVICTION_LRU);
    uint64_t keys[4];
    em_evicted_view view;
    em_error err;
    ck_assert_int_eq(em_table_evicted(table, 0, 4, keys, &view, &err), EM_OK);
    ck_assert_uint_eq(view.total, 0);
    em_table_destroy(table);
    em_backend_destroy(backend);
}
END_TEST

/* ---- deltas ------------------------------------------------------------------------- */

/* Moves the table on the way training does between saves: pushes to a few of its keys
 * (and a few new ones), and erases some. */
static void change_a_little(em_table *table, uint32_t dim, em_test_rng *rng, uint64_t new_keys)
{
    em_test_batch b = em_test_random_batch(rng, 20, 2, 4000);
    float *g = em_test_random_floats(rng, b.csr.nnz * dim);
    em_error err;
    ck_assert_int_eq(em_test_push(table, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    free(g);
    em_test_batch_free(&b);
    uint64_t fresh[8], gone[5], erased = 0;
    for (int i = 0; i < 8; i++)
        fresh[i] = new_keys + (uint64_t)i;
    uint32_t offsets[2] = {0, 8};
    em_csr csr = {.rows = 1, .nnz = 8, .offsets = offsets, .keys = fresh};
    g = em_test_random_floats(rng, 8 * dim);
    ck_assert_int_eq(em_test_push(table, &csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    free(g);
    for (int i = 0; i < 5; i++)
        gone[i] = em_test_rng_below(rng, 4000);
    ck_assert_int_eq(em_table_erase(table, gone, 5, &erased, &err), EM_OK);
}

/* Keeps the last progress of a save: rows read, rows in the snapshot. */
static void record_save_progress(void *context, uint64_t rows_read, uint64_t rows_total)
{
    uint64_t *heard = context;
    ck_assert_uint_le(rows_read, rows_total);
    heard[0] = rows_read;
    heard[1] = rows_total;
}

/* Keeps the last progress of a load: rows, bytes, total bytes. */
static void record_progress(void *context, uint64_t rows, uint64_t bytes, uint64_t total_bytes)
{
    uint64_t *heard = context;
    ck_assert_uint_ge(rows, heard[0]);
    ck_assert_uint_ge(bytes, heard[1]);
    heard[0] = rows;
    heard[1] = bytes;
    heard[2] = total_bytes;
}

/* A delta holds only what changed; the chain loads back to exactly the table at the
 * last delta's instant, every optimizer's state bit for bit, and a table loaded from a
 * delta saves its next delta on top of it. */
START_TEST(deltas_restore_the_table_of_their_instant)
{
    int optimizer = _i;
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, optimizer, 8, 4000, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.delta = true;
    options.buffer_bytes = 1;
    uint64_t saving[2] = {0};
    options.progress = record_save_progress;
    options.progress_context = saving;
    em_checkpoint_info full, delta;
    em_error err;
    /* no parent yet: a full save */
    ck_assert_msg(em_checkpoint_save(table, &options, &full, &err) == EM_OK, "%s", err.message);
    ck_assert_str_eq(full.kind, "full");
    ck_assert_uint_eq(full.rows, full.table_rows);
    ck_assert_uint_eq(saving[0], full.table_rows); /* the last progress: every row read */
    ck_assert_uint_eq(saving[1], full.table_rows);
    for (uint32_t depth = 1; depth <= 3; depth++) {
        change_a_little(table, 8, &rng, 1000000 + depth * 100);
        char parent[EM_CHECKPOINT_ID_DIGITS + 1];
        snprintf(parent, sizeof(parent), "%s", depth == 1 ? full.id : delta.id);
        ck_assert_msg(em_checkpoint_save(table, &options, &delta, &err) == EM_OK, "%s",
                      err.message);
        ck_assert_str_eq(delta.kind, "delta");
        ck_assert_str_eq(delta.parent, parent);
        ck_assert_uint_eq(delta.depth, depth);
        ck_assert_uint_le(delta.tombstones, 5);
        ck_assert_uint_ge(delta.rows, 8); /* the new keys at least */
        ck_assert_uint_lt(delta.rows * 10, full.rows);
        ck_assert_uint_lt(delta.bytes * 5, full.bytes);
        ck_assert_msg(em_checkpoint_verify(delta.path, NULL, &err) == EM_OK, "%s", err.message);
    }
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(delta.table_rows, stats.rows);
    em_test_snapshot expected = em_test_snapshot_take(table, 1000);

    em_table *restored = NULL;
    em_checkpoint_info loaded;
    uint64_t heard[3] = {0};
    em_checkpoint_load_options with_progress = {.track_changes = true,
                                                .read_block_bytes = 2999, /* blocks of a
                                                * few chunks, links of several blocks */
                                                .progress = record_progress,
                                                .progress_context = heard};
    ck_assert_msg(em_checkpoint_load(delta.path, backend, NULL, &with_progress, &restored,
                                     &loaded, &err) == EM_OK,
                  "%s", err.message);
    /* the last progress heard is the whole chain */
    ck_assert_uint_eq(heard[0], stats.rows);
    ck_assert_uint_eq(heard[1], heard[2]);
    ck_assert_uint_gt(heard[2], full.bytes / 2);
    ck_assert_str_eq(loaded.kind, "delta");
    ck_assert_uint_eq(loaded.depth, 3);
    em_test_snapshot got = em_test_snapshot_take(restored, 1000);
    em_test_assert_snapshots_identical(&got, &expected);
    em_test_snapshot_free(&got);

    /* the restored table's next save is a delta of the one it came from; unchanged, it
     * holds nothing */
    ck_assert_msg(em_checkpoint_save(restored, &options, &full, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_str_eq(full.kind, "delta");
    ck_assert_str_eq(full.parent, delta.id);
    ck_assert_uint_eq(full.rows, 0);
    ck_assert_uint_eq(full.tombstones, 0);
    /* the original table is no longer the latest's source: its delta becomes full */
    ck_assert_int_eq(em_checkpoint_save(table, &options, &delta, &err), EM_OK);
    ck_assert_str_eq(delta.kind, "full");
    em_test_snapshot_free(&expected);
    em_table_destroy(restored);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* Saves 1 (full) and deltas 2, 3, 4 of a table; paths[i] is checkpoint i + 1. */
static void save_chain(em_backend *backend, const char *dir, char paths[4][4200])
{
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, 2, 4, 4000, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.delta = true;
    options.keep = 10;
    em_error err;
    for (int i = 0; i < 4; i++) {
        if (i > 0)
            change_a_little(table, 4, &rng, 2000000 + (uint64_t)i * 100);
        em_checkpoint_info info;
        ck_assert_msg(em_checkpoint_save(table, &options, &info, &err) == EM_OK, "%s",
                      err.message);
        ck_assert_str_eq(info.kind, i == 0 ? "full" : "delta");
        snprintf(paths[i], 4200, "%s", info.path);
    }
    em_table_destroy(table);
}

static void copy_dir(const char *from, const char *to)
{
    char command[8500];
    snprintf(command, sizeof(command), "cp -r '%s' '%s'", from, to);
    ck_assert_int_eq(system(command), 0);
}

/* What can go wrong with a chain; each is refused with DATA_LOSS naming the file. */
enum chain_damage { CHAIN_GAP, CHAIN_DUPLICATE, CHAIN_REORDER, CHAIN_TRUNCATED,
                    CHAIN_WRONG_PARENT, CHAIN_TOMBSTONES, CHAIN_DAMAGE_COUNT };

START_TEST(broken_chains_are_refused_naming_the_file)
{
    enum chain_damage how = (enum chain_damage)_i;
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    char paths[4][4200], path[4400], other[4400];
    save_chain(backend, dir, paths);
    em_error err;
    ck_assert_msg(em_checkpoint_verify(paths[3], NULL, &err) == EM_OK, "%s", err.message);
    const char *named = NULL;
    switch (how) {
    case CHAIN_GAP: /* delta 2 is gone */
        em_test_remove_tree(paths[1]);
        named = "the chain has a gap";
        break;
    case CHAIN_DUPLICATE: /* delta 3's directory holds delta 2 again */
        em_test_remove_tree(paths[2]);
        copy_dir(paths[1], paths[2]);
        named = "manifest.json";
        break;
    case CHAIN_REORDER: /* deltas 2 and 3 swap places */
        snprintf(path, sizeof(path), "%s.swap", paths[1]);
        ck_assert_int_eq(rename(paths[1], path), 0);
        ck_assert_int_eq(rename(paths[2], paths[1]), 0);
        ck_assert_int_eq(rename(path, paths[2]), 0);
        named = "manifest.json";
        break;
    case CHAIN_TRUNCATED:
        snprintf(path, sizeof(path), "%s/rows.emb", paths[2]);
        ck_assert_int_eq(truncate(path, file_size(path) - 10), 0);
        named = "rows.emb";
        break;
    case CHAIN_WRONG_PARENT: { /* the full checkpoint is another save's */
        snprintf(other, sizeof(other), "%s/other", dir);
        char other_paths[4][4200];
        save_chain(backend, other, other_paths);
        em_test_remove_tree(paths[0]);
        copy_dir(other_paths[0], paths[0]);
        named = "does not match";
        break;
    }
    case CHAIN_TOMBSTONES:
        snprintf(path, sizeof(path), "%s/tombstones.emb", paths[1]);
        em_test_flip_byte(path, 30);
        named = "tombstones.emb";
        break;
    case CHAIN_DAMAGE_COUNT:
        break;
    }
    ck_assert_int_eq(em_checkpoint_verify(paths[3], NULL, &err), EM_DATA_LOSS);
    ck_assert_msg(strstr(err.message, named) != NULL, "%s", err.message);
    em_table *restored = NULL;
    ck_assert_int_eq(em_checkpoint_load(paths[3], backend, NULL, &tracking, &restored, NULL, &err),
                     EM_DATA_LOSS);
    ck_assert_msg(strstr(err.message, named) != NULL, "%s", err.message);
    ck_assert_ptr_null(restored);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* A delta save that fails at any step leaves the table's digests as they were: the
 * next delta still holds everything since the last complete checkpoint. */
START_TEST(a_failed_delta_leaves_the_next_one_complete)
{
    int step = _i;
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, 1, 4, 4000, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.delta = true;
    em_checkpoint_info info;
    em_error err;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
    change_a_little(table, 4, &rng, 3000000);
    char spec[64];
    snprintf(spec, sizeof(spec), "checkpoint_fail=%d", step);
    ck_assert_int_eq(em_failpoints_arm(spec, &err), EM_OK);
    em_status status = em_checkpoint_save(table, &options, &info, &err);
    em_failpoints_disarm_all();
    ck_assert_int_eq(status, EM_INTERNAL);
    change_a_little(table, 4, &rng, 4000000);
    ck_assert_msg(em_checkpoint_save(table, &options, &info, &err) == EM_OK, "%s", err.message);
    /* after a failure past the rename of LATEST the failed one is the latest, which the
     * table's digests do not describe: a full save then */
    ck_assert_str_eq(info.kind, step == EM_SAVE_LATEST_DIR_FSYNC ? "full" : "delta");
    em_test_snapshot expected = em_test_snapshot_take(table, 1000);
    em_table *restored = NULL;
    ck_assert_msg(em_checkpoint_load(info.path, backend, NULL, NULL, &restored, NULL, &err) ==
                      EM_OK, "%s", err.message);
    em_test_assert_table_unchanged(restored, &expected);
    em_test_snapshot_free(&expected);
    em_table_destroy(restored);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* The names in dir, sorted, joined by spaces. */
static void names_in(const char *dir, char *names, size_t size)
{
    char *list[64];
    int count = 0;
    DIR *d = opendir(dir);
    ck_assert_ptr_nonnull(d);
    struct dirent *entry;
    while ((entry = readdir(d)) != NULL && count < 64)
        if (strcmp(entry->d_name, ".") != 0 && strcmp(entry->d_name, "..") != 0)
            list[count++] = strdup(entry->d_name);
    closedir(d);
    for (int i = 1; i < count; i++) /* few names: insertion */
        for (int j = i; j > 0 && strcmp(list[j - 1], list[j]) > 0; j--) {
            char *t = list[j];
            list[j] = list[j - 1];
            list[j - 1] = t;
        }
    names[0] = '\0';
    for (int i = 0; i < count; i++) {
        snprintf(names + strlen(names), size - strlen(names), "%s%s", i > 0 ? " " : "", list[i]);
        free(list[i]);
    }
}

/* A directory holding one file of bytes bytes. */
static void make_dir_with_file(const char *dir, const char *name, size_t bytes)
{
    char path[4400];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    ck_assert_int_eq(mkdir(path, 0755), 0);
    snprintf(path + strlen(path), sizeof(path) - strlen(path), "/rows.emb");
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    for (size_t i = 0; i < bytes; i++)
        fputc((int)(i & 0xff), f);
    fclose(f);
}

/* A save answers with the checkpoints it prunes already set aside (.old-<id>, which no
 * list, load or restore reads), and removes their files after; what a crash left set
 * aside or half-written goes with the next save's, and ids go on past both. The removal
 * keeps its place when the table's directory is renamed under it, as a drop does. */
START_TEST(pruned_checkpoints_are_removed_after_the_save_answers)
{
    char dir[256], table_dir[512], names[4096];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    snprintf(table_dir, sizeof(table_dir), "%s/t", dir);
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, 1, 4, 300, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.keep = 1;
    em_checkpoint_info info;
    em_error err;
    em_checkpoint_removals *removals = NULL;
    ck_assert_int_eq(em_checkpoint_removals_create(&removals, &err), EM_OK);
    options.removals = removals;
    for (int i = 1; i <= 3; i++) {
        ck_assert_msg(em_checkpoint_save(table, &options, &info, &err) == EM_OK, "%s",
                      err.message);
        /* as the save answers: the one before is no longer where it was */
        char before[4400];
        snprintf(before, sizeof(before), "%s/%020d", table_dir, i - 1);
        struct stat st;
        ck_assert_int_ne(stat(before, &st), 0);
        em_checkpoint_info *list = NULL;
        size_t count = 0;
        ck_assert_int_eq(em_checkpoint_list(dir, "t", &list, &count, &err), EM_OK);
        ck_assert_uint_eq(count, 1);
        ck_assert_str_eq(list[0].id, info.id);
        free(list);
    }
    em_checkpoint_removals_wait(removals);
    names_in(table_dir, names, sizeof(names));
    ck_assert_str_eq(names, ".lock 00000000000000000003 LATEST");

    /* what a crash leaves: a checkpoint set aside, a save half-written, a directory
     * renamed but never published */
    make_dir_with_file(table_dir, ".old-00000000000000000013", 5000);
    make_dir_with_file(table_dir, ".tmp-00000000000000000010", 5000);
    make_dir_with_file(table_dir, "00000000000000000011", 5000);
    ck_assert_msg(em_checkpoint_save(table, &options, &info, &err) == EM_OK, "%s", err.message);
    ck_assert_str_eq(info.id, "00000000000000000014");
    em_checkpoint_removals_wait(removals);
    names_in(table_dir, names, sizeof(names));
    ck_assert_str_eq(names, ".lock 00000000000000000014 LATEST");

    /* a save waits for the removals begun before it: none of these is left once the
     * second save answers (its own prune's removal may still run) */
    for (int k = 0; k < 8; k++) {
        char name[64];
        snprintf(name, sizeof(name), ".old-%020d", 30 + k);
        make_dir_with_file(table_dir, name, 4 << 20);
    }
    for (int k = 0; k < 2; k++)
        ck_assert_msg(em_checkpoint_save(table, &options, &info, &err) == EM_OK, "%s",
                      err.message);
    ck_assert_str_eq(info.id, "00000000000000000039");
    names_in(table_dir, names, sizeof(names));
    for (int k = 0; k < 8; k++) {
        char name[64];
        snprintf(name, sizeof(name), ".old-%020d", 30 + k);
        ck_assert_msg(strstr(names, name) == NULL, "%s is still there: %s", name, names);
    }
    em_checkpoint_removals_wait(removals);

    /* the table's directory renamed while the removal may still run */
    for (int k = 0; k < 4; k++) {
        char name[64];
        snprintf(name, sizeof(name), ".old-%020d", 100 + k);
        make_dir_with_file(table_dir, name, 1 << 20);
    }
    ck_assert_msg(em_checkpoint_save(table, &options, &info, &err) == EM_OK, "%s", err.message);
    char aside[600];
    snprintf(aside, sizeof(aside), "%s/.dropped-t", dir);
    ck_assert_int_eq(rename(table_dir, aside), 0);
    em_checkpoint_removals_wait(removals);
    names_in(aside, names, sizeof(names));
    ck_assert_str_eq(names, ".lock 00000000000000000104 LATEST");
    ck_assert_msg(em_checkpoint_verify(aside, &info, &err) == EM_OK, "%s", err.message);

    /* without removals, a save removes what it prunes before it answers */
    options.removals = NULL;
    ck_assert_int_eq(rename(aside, table_dir), 0);
    make_dir_with_file(table_dir, ".old-00000000000000000200", 5000);
    ck_assert_msg(em_checkpoint_save(table, &options, &info, &err) == EM_OK, "%s", err.message);
    ck_assert_str_eq(info.id, "00000000000000000201");
    names_in(table_dir, names, sizeof(names));
    ck_assert_str_eq(names, ".lock 00000000000000000201 LATEST");
    em_checkpoint_removals_destroy(removals);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* keep counts checkpoints, but one that a kept delta builds on stays until no kept
 * checkpoint needs it. */
START_TEST(pruning_keeps_the_chains_of_kept_deltas)
{
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, 0, 4, 500, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.keep = 2;
    em_checkpoint_info info;
    em_error err;
    /* full 1, deltas 2 and 3, full 4, delta 5 */
    const bool deltas[5] = {false, true, true, false, true};
    const size_t kept_after[5] = {1, 2, 3, 4, 2};
    for (int i = 0; i < 5; i++) {
        options.delta = deltas[i];
        options.track_changes = true;
        ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
        ck_assert_str_eq(info.kind, deltas[i] ? "delta" : "full");
        em_checkpoint_info *infos = NULL;
        size_t count = 0;
        ck_assert_int_eq(em_checkpoint_list(dir, "t", &infos, &count, &err), EM_OK);
        ck_assert_uint_eq(count, kept_after[i]);
        ck_assert_str_eq(infos[count - 1].kind, info.kind);
        if (i == 4) {
            ck_assert_str_eq(infos[0].id, "00000000000000000004");
            ck_assert_str_eq(infos[1].parent, "00000000000000000004");
        }
        free(infos);
    }
    ck_assert_int_eq(em_checkpoint_verify(info.path, NULL, &err), EM_OK);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* ---- cluster checkpoints ----------------------------------------------------------- */

/* The rows of several tables (each a server's part), as one snapshot sorted by key. */
static em_test_snapshot union_of(em_table *const *parts, size_t count)
{
    em_test_snapshot all = {0};
    em_test_snapshot *taken = calloc(count, sizeof(*taken));
    for (size_t p = 0; p < count; p++) {
        taken[p] = em_test_snapshot_take(parts[p], 700);
        all.count += taken[p].count;
        all.width = taken[p].width;
    }
    all.keys = malloc((all.count + 1) * sizeof(uint64_t));
    all.values = malloc((all.count + 1) * all.width * sizeof(float));
    size_t *next = calloc(count, sizeof(size_t));
    for (uint64_t i = 0; i < all.count; i++) { /* merge the sorted parts */
        size_t from = count;
        for (size_t p = 0; p < count; p++)
            if (next[p] < taken[p].count &&
                (from == count || taken[p].keys[next[p]] < taken[from].keys[next[from]]))
                from = p;
        all.keys[i] = taken[from].keys[next[from]];
        memcpy(all.values + i * all.width, taken[from].values + next[from] * all.width,
               all.width * sizeof(float));
        next[from]++;
    }
    for (size_t p = 0; p < count; p++)
        em_test_snapshot_free(&taken[p]);
    free(taken);
    free(next);
    return all;
}

/* Loads server `owner` of `servers` from the checkpoints at paths, with `shards` shards,
 * and checks that it holds only keys the client routes to it. */
/* load_part's way of reading: the read ahead (em_checkpoint_load_options.read_ahead)
 * and the block size. */
typedef struct part_reads {
    int read_ahead;
    uint64_t block_bytes;
} part_reads;

static em_table *load_part_read(em_backend *backend, const char *const *paths, size_t count,
                                uint32_t owner, uint32_t servers, uint32_t shards,
                                const uint64_t *manifests, part_reads reads)
{
    em_checkpoint_load_options options = {.shards = shards, .owner_index = owner,
                                          .owner_count = servers, .manifest_xxh3 = manifests,
                                          .read_ahead = reads.read_ahead,
                                          .read_block_bytes = reads.block_bytes};
    em_table *part = NULL;
    em_checkpoint_info info;
    em_error err;
    ck_assert_msg(em_checkpoint_load_sources(paths, count, backend, NULL, &options, &part, &info,
                                             &err) == EM_OK, "%s", err.message);
    ck_assert_uint_eq(em_table_get_config(part)->shards, shards);
    em_test_snapshot rows = em_test_snapshot_take(part, 1000);
    ck_assert_uint_eq(info.table_rows, rows.count);
    for (uint64_t r = 0; r < rows.count; r++)
        ck_assert_int_eq(em_key_server(rows.keys[r], (int32_t)servers), (int32_t)owner);
    em_test_snapshot_free(&rows);
    return part;
}

static em_table *load_part(em_backend *backend, const char *const *paths, size_t count,
                           uint32_t owner, uint32_t servers, uint32_t shards,
                           const uint64_t *manifests)
{
    return load_part_read(backend, paths, count, owner, servers, shards, manifests,
                          (part_reads){0});
}

/* A table (with a delta chain) split over 3 servers of 5 shards, each loading only the
 * buckets it owns; the 3 parts saved and merged back onto 2 servers of 8 shards: every
 * key's row and state equal the original's at each step. Sources of another table
 * shape, another manifest than recorded, a key in two sources and a server outside the
 * cluster are refused. A detached save leaves the table's delta chain alone. */
START_TEST(cluster_parts_load_the_buckets_each_server_owns)
{
    char dir[256], path[4200];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, 3, 8, 3000, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.track_changes = true;
    em_checkpoint_info full, copy, delta;
    em_error err;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &full, &err), EM_OK);
    change_a_little(table, 8, &rng, 1u << 20);
    snprintf(path, sizeof(path), "%s/detached", dir);
    em_checkpoint_options detached;
    em_checkpoint_options_init(&detached, path);
    detached.detached = true;
    detached.delta = true;
    ck_assert_msg(em_checkpoint_save(table, &detached, &copy, &err) == EM_OK, "%s", err.message);
    ck_assert_str_eq(copy.kind, "full");
    options.delta = true;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &delta, &err), EM_OK);
    ck_assert_str_eq(delta.kind, "delta"); /* the detached copy left the chain alone */
    em_test_snapshot original = em_test_snapshot_take(table, 1000);

    /* one server's chain onto 3 servers of 5 shards; the runs of owned chunks read here
     * and ahead on a thread, in blocks of the default size and of a few chunks */
    const char *one[1] = {delta.path};
    em_table *parts[3];
    const part_reads ways[] = {{-1, 0}, {1, 0}, {-1, 700}, {1, 700}};
    for (size_t w = 0; w < sizeof(ways) / sizeof(ways[0]); w++) {
        for (uint32_t j = 0; j < 3; j++)
            parts[j] = load_part_read(backend, one, 1, j, 3, 5, &delta.manifest_xxh3, ways[w]);
        em_test_snapshot merged = union_of(parts, 3);
        em_test_assert_snapshots_identical(&merged, &original);
        em_test_snapshot_free(&merged);
        if (w + 1 < sizeof(ways) / sizeof(ways[0]))
            for (uint32_t j = 0; j < 3; j++)
                em_table_destroy(parts[j]);
    }
    em_test_snapshot merged;

    /* the 3 parts saved, and loaded onto 2 servers of 8 shards */
    char part_dirs[3][300];
    em_checkpoint_info part_infos[3];
    const char *part_paths[3];
    uint64_t manifests[3];
    for (uint32_t j = 0; j < 3; j++) {
        snprintf(part_dirs[j], sizeof(part_dirs[j]), "%s/server-%u", dir, j);
        em_checkpoint_options_init(&detached, part_dirs[j]);
        detached.detached = true;
        ck_assert_int_eq(em_checkpoint_save(parts[j], &detached, &part_infos[j], &err), EM_OK);
        part_paths[j] = part_infos[j].path;
        manifests[j] = part_infos[j].manifest_xxh3;
    }
    em_table *two[2];
    for (uint32_t j = 0; j < 2; j++)
        two[j] = load_part(backend, part_paths, 3, j, 2, 8, manifests);
    merged = union_of(two, 2);
    em_test_assert_snapshots_identical(&merged, &original);
    em_test_snapshot_free(&merged);
    /* and whole onto one server, without an owner */
    em_table *whole = NULL;
    em_checkpoint_load_options all = {.manifest_xxh3 = manifests};
    ck_assert_msg(em_checkpoint_load_sources(part_paths, 3, backend, "w", &all, &whole, NULL,
                                             &err) == EM_OK, "%s", err.message);
    merged = em_test_snapshot_take(whole, 1000);
    em_test_assert_snapshots_identical(&merged, &original);
    em_test_snapshot_free(&merged);
    em_table_destroy(whole);

    /* refusals */
    uint64_t wrong[3] = {manifests[0], manifests[1] ^ 1, manifests[2]};
    em_checkpoint_load_options checked = {.manifest_xxh3 = wrong};
    ck_assert_int_eq(em_checkpoint_load_sources(part_paths, 3, backend, NULL, &checked, &whole,
                                                NULL, &err), EM_DATA_LOSS);
    ck_assert_msg(strstr(err.message, part_paths[1]) != NULL &&
                      strstr(err.message, "manifest.json") != NULL, "%s", err.message);
    const char *twice[2] = {part_paths[0], part_paths[0]};
    ck_assert_int_eq(em_checkpoint_load_sources(twice, 2, backend, NULL, NULL, &whole, NULL,
                                                &err), EM_DATA_LOSS);
    ck_assert_msg(strstr(err.message, "is in checkpoint") != NULL &&
                      strstr(err.message, part_paths[0]) != NULL, "%s", err.message);
    em_checkpoint_load_options outside = {.owner_index = 2, .owner_count = 2};
    ck_assert_int_eq(em_checkpoint_load_sources(part_paths, 3, backend, NULL, &outside, &whole,
                                                NULL, &err), EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "server 2 of a cluster of 2") != NULL, "%s", err.message);
    em_table *narrow = trained_table(backend, 3, 4, 100, &rng);
    em_checkpoint_info narrow_info;
    snprintf(path, sizeof(path), "%s/narrow", dir);
    em_checkpoint_options_init(&detached, path);
    ck_assert_int_eq(em_checkpoint_save(narrow, &detached, &narrow_info, &err), EM_OK);
    const char *mixed[2] = {part_paths[0], narrow_info.path};
    ck_assert_int_eq(em_checkpoint_load_sources(mixed, 2, backend, NULL, NULL, &whole, NULL,
                                                &err), EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, narrow_info.path) != NULL &&
                      strstr(err.message, "another table") != NULL, "%s", err.message);

    em_table_destroy(narrow);
    for (uint32_t j = 0; j < 3; j++)
        em_table_destroy(parts[j]);
    for (uint32_t j = 0; j < 2; j++)
        em_table_destroy(two[j]);
    em_test_snapshot_free(&original);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* A damaged chunk of an owned bucket is refused naming the chunk; an index that no
 * longer lays the chunks end to end is refused by every server, owner or not. */
START_TEST(cluster_parts_refuse_damaged_chunks)
{
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, 1, 8, 3000, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    em_checkpoint_info info;
    em_error err;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
    char rows_path[4400];
    snprintf(rows_path, sizeof(rows_path), "%s/rows.emb", info.path);
    em_test_flip_byte(rows_path, file_size(rows_path) - 3); /* in the last chunk's payload */
    const char *one[1] = {info.path};
    int refused = 0;
    for (uint32_t j = 0; j < 3; j++) {
        em_checkpoint_load_options owner = {.owner_index = j, .owner_count = 3};
        em_table *part = NULL;
        em_status status = em_checkpoint_load_sources(one, 1, backend, NULL, &owner, &part, NULL,
                                                      &err);
        if (status == EM_OK) {
            em_table_destroy(part);
            continue;
        }
        refused++;
        ck_assert_int_eq(status, EM_DATA_LOSS);
        ck_assert_msg(strstr(err.message, "rows.emb") != NULL &&
                          strstr(err.message, "checksum mismatch") != NULL, "%s", err.message);
    }
    ck_assert_int_eq(refused, 1); /* the owner of the damaged chunk's bucket */
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* ---- access metadata ---------------------------------------------------------------- */

/* Every row's key and access metadata, sorted by key (through a snapshot). */
typedef struct keyed_access {
    uint64_t key;
    em_row_access access;
} keyed_access;

static int compare_keyed(const void *a, const void *b)
{
    uint64_t x = ((const keyed_access *)a)->key, y = ((const keyed_access *)b)->key;
    return x < y ? -1 : x > y;
}

static uint64_t read_access(em_table *table, uint64_t **keys, em_row_access **access)
{
    em_table_snapshot *snapshot = NULL;
    em_error err;
    ck_assert_int_eq(em_table_snapshot_begin(table, 1 << 20, &snapshot, &err), EM_OK);
    uint64_t total = em_table_snapshot_rows(snapshot), count = 1, got = 0;
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    uint64_t *k = malloc((total + 1) * sizeof(uint64_t));
    em_row_access *a = malloc((total + 1) * sizeof(em_row_access));
    float *values = malloc((total + 1) * stats.row_floats * sizeof(float));
    while (count > 0) {
        ck_assert_int_eq(em_table_snapshot_read(snapshot, 100, k + got,
                                                values + got * stats.row_floats, a + got, &count,
                                                &err), EM_OK);
        got += count;
    }
    em_table_snapshot_end(snapshot);
    ck_assert_uint_eq(got, total);
    keyed_access *pairs = malloc((got + 1) * sizeof(*pairs));
    for (uint64_t i = 0; i < got; i++)
        pairs[i] = (keyed_access){.key = k[i], .access = a[i]};
    qsort(pairs, got, sizeof(*pairs), compare_keyed);
    for (uint64_t i = 0; i < got; i++) {
        k[i] = pairs[i].key;
        a[i] = pairs[i].access;
    }
    free(pairs);
    free(values);
    *keys = k;
    *access = a;
    return got;
}

/* Pushes rounds random batches of 300 keys out of 20,000 (seeded) into table. */
static void push_rounds(em_table *table, uint64_t seed, int rounds)
{
    em_test_rng rng;
    em_test_rng_init(&rng, seed);
    em_error err;
    for (int round = 0; round < rounds; round++) {
        em_test_batch b = em_test_random_batch(&rng, 300, 1, 20000);
        float *g = em_test_random_floats(&rng, b.csr.nnz * 4);
        ck_assert_msg(em_test_push(table, &b.csr, EM_COMBINER_NONE, g, NULL, &err) == EM_OK,
                      "%s", err.message);
        free(g);
        em_test_batch_free(&b);
    }
}

/* A byte of checkpoint/file flipped at offset: a load is refused with DATA_LOSS naming
 * the file and the checksum that no longer matches. */
static void load_refuses_a_flipped_byte(em_backend *backend, const char *checkpoint,
                                        const char *file, long offset)
{
    char path[4400];
    snprintf(path, sizeof(path), "%s/%s", checkpoint, file);
    em_test_flip_byte(path, offset);
    em_table *loaded = NULL;
    em_error err;
    ck_assert_int_eq(em_checkpoint_load(checkpoint, backend, NULL, NULL, &loaded, NULL, &err),
                     EM_DATA_LOSS);
    ck_assert_ptr_null(loaded);
    ck_assert_msg(strstr(err.message, file) != NULL &&
                      strstr(err.message, "checksum mismatch") != NULL, "%s", err.message);
}

/* An lru table of capacity 2,000 over 4 shards with an evicted-key ring of `ring`, full
 * and evicting after 30 pushes of 300 keys out of 20,000. */
static em_table *full_lru_table(em_backend *backend, uint32_t ring)
{
    em_table_config config;
    em_table_config_init(&config, "lru", 4, 2000);
    config.shards = 4;
    config.eviction.policy = EM_EVICTION_LRU;
    config.eviction.ring = ring;
    em_table *table = em_test_make_table(backend, &config);
    push_rounds(table, 1, 30);
    return table;
}

/* Which rows an lru eviction compares depends on the hash map's layout, which a load
 * rebuilds: every load of one checkpoint rebuilds it alike, so the same pushes after
 * two loads keep the same rows and evict the same keys, in the same order. */
START_TEST(every_load_of_a_checkpoint_evicts_alike)
{
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_table *table = full_lru_table(backend, 4096);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    em_checkpoint_info info;
    em_error err;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
    em_table *loaded[2] = {NULL, NULL};
    em_test_snapshot after[2];
    uint64_t evicted[2][4096];
    em_evicted_view view[2];
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(em_checkpoint_load(info.path, backend, NULL, NULL, &loaded[i], NULL,
                                            &err), EM_OK);
        push_rounds(loaded[i], 2, 20);
        after[i] = em_test_snapshot_take(loaded[i], 1000);
        ck_assert_int_eq(em_table_evicted(loaded[i], 0, 4096, evicted[i], &view[i], &err),
                         EM_OK);
    }
    ck_assert_uint_eq(after[0].count, 2000);
    em_test_assert_snapshots_identical(&after[0], &after[1]);
    ck_assert_uint_gt(view[0].count, 1000); /* the pushes evicted */
    ck_assert_uint_eq(view[0].count, view[1].count);
    ck_assert_mem_eq(evicted[0], evicted[1], view[0].count * sizeof(uint64_t));
    for (int i = 0; i < 2; i++) {
        em_test_snapshot_free(&after[i]);
        em_table_destroy(loaded[i]);
    }
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* The evicted-key ring of a table, all it holds (EVICTED from the start). */
typedef struct ring_view {
    em_evicted_view view;
    uint64_t keys[64];
} ring_view;

static ring_view ring_of(em_table *table)
{
    ring_view ring;
    em_error err;
    ck_assert_int_eq(em_table_evicted(table, 0, 64, ring.keys, &ring.view, &err), EM_OK);
    return ring;
}

static void assert_rings_equal(const ring_view *a, const ring_view *b)
{
    ck_assert_uint_eq(a->view.total, b->view.total);
    ck_assert_uint_eq(a->view.first, b->view.first);
    ck_assert_uint_eq(a->view.count, b->view.count);
    ck_assert_mem_eq(a->keys, b->keys, a->view.count * sizeof(uint64_t));
}

/* The keys an lru table's policy removed (EVICTED, its sequence numbers) are part of its
 * checkpoints: a load gives the ring as of the save's instant, whole and through a delta
 * chain, and the sequence numbers go on from there; a table loaded as one server's
 * buckets starts its ring afresh; a damaged evicted.emb is refused naming it. */
START_TEST(the_evicted_ring_survives_a_load)
{
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_table *table = full_lru_table(backend, 64);
    ring_view saved = ring_of(table);
    ck_assert_uint_gt(saved.view.total, 64); /* the ring has wrapped */
    ck_assert_uint_eq(saved.view.count, 64);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.track_changes = true;
    em_checkpoint_info full;
    em_error err;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &full, &err), EM_OK);
    push_rounds(table, 2, 5);
    em_table *loaded = NULL;
    ck_assert_int_eq(em_checkpoint_load(full.path, backend, NULL, NULL, &loaded, NULL, &err),
                     EM_OK);
    ring_view got = ring_of(loaded);
    assert_rings_equal(&got, &saved);
    push_rounds(loaded, 2, 5); /* numbered on from the checkpoint's */
    em_table_stats stats;
    em_table_get_stats(loaded, &stats); /* evicted since the load */
    ck_assert_uint_gt(stats.rows_evicted, 0);
    ck_assert_uint_eq(ring_of(loaded).view.total, saved.view.total + stats.rows_evicted);
    ring_view table_on = ring_of(table);
    em_table_destroy(loaded);

    /* a delta holds the ring at its instant */
    options.delta = true;
    em_checkpoint_info delta;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &delta, &err), EM_OK);
    ck_assert_str_eq(delta.kind, "delta");
    ck_assert_int_eq(em_checkpoint_load(delta.path, backend, NULL, NULL, &loaded, NULL, &err),
                     EM_OK);
    got = ring_of(loaded);
    assert_rings_equal(&got, &table_on);
    em_table_destroy(loaded);

    /* one server's buckets: a ring of its own */
    const char *one[1] = {delta.path};
    em_checkpoint_load_options owner = {.owner_index = 0, .owner_count = 2};
    ck_assert_int_eq(em_checkpoint_load_sources(one, 1, backend, NULL, &owner, &loaded, NULL,
                                                &err), EM_OK);
    ck_assert_uint_eq(ring_of(loaded).view.total, 0);
    em_table_destroy(loaded);

    /* damaged: refused, naming the file, in a load and a verify */
    load_refuses_a_flipped_byte(backend, full.path, "evicted.emb", 40);
    ck_assert_int_eq(em_checkpoint_verify(delta.path, NULL, &err), EM_DATA_LOSS);
    ck_assert_msg(strstr(err.message, "evicted.emb") != NULL, "%s", err.message);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* A table whose eviction tracks access keeps each row's metadata (last access, last
 * update, frequency) and the table's clocks across a save and a load, whole or as one
 * server's buckets, and through a delta chain. */
START_TEST(access_metadata_and_clocks_survive_a_load)
{
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_table_config config;
    em_table_config_init(&config, "lru", 4, 100000);
    config.shards = 3;
    config.optimizer = em_test_optimizers[1];
    config.eviction.policy = EM_EVICTION_LRU;
    config.eviction.candidates = 8;
    config.eviction.max_age_seconds = 3600;
    em_table *table = em_test_make_table(backend, &config);
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_error err;
    for (int round = 0; round < 6; round++) {
        em_test_batch b = em_test_random_batch(&rng, 2000, 3, 60000);
        float *g = em_test_random_floats(&rng, b.csr.nnz * 4);
        ck_assert_int_eq(em_test_push(table, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
        free(g);
        em_test_batch_free(&b);
        b = em_test_random_batch(&rng, 800, 3, 60000); /* pulls move access and frequency */
        float *out = malloc(b.csr.nnz * 4 * sizeof(float) + 4);
        ck_assert_int_eq(em_test_pull(table, &b.csr, EM_COMBINER_NONE, false, out, NULL, &err),
                         EM_OK);
        free(out);
        em_test_batch_free(&b);
    }
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    em_checkpoint_info info;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
    uint64_t *keys = NULL, *loaded_keys = NULL;
    em_row_access *access = NULL, *loaded_access = NULL;
    uint64_t rows = read_access(table, &keys, &access);
    uint32_t frequent = 0;
    for (uint64_t i = 0; i < rows; i++)
        frequent += access[i].frequency > 1;
    ck_assert_uint_gt(frequent, 0); /* the metadata is not trivially zero */
    em_table_clocks before, after;
    em_table_get_clocks(table, &before);
    ck_assert_uint_gt(before.update_clock, 0);
    ck_assert_uint_gt(before.samples, 0);

    em_table *restored = NULL;
    em_checkpoint_load_options small_blocks = {.read_block_bytes = 1500}; /* straddled */
    ck_assert_msg(em_checkpoint_load(info.path, backend, NULL, &small_blocks, &restored, NULL, &err) ==
                      EM_OK, "%s", err.message);
    ck_assert_uint_eq(read_access(restored, &loaded_keys, &loaded_access), rows);
    ck_assert_mem_eq(loaded_keys, keys, rows * sizeof(uint64_t));
    ck_assert_mem_eq(loaded_access, access, rows * sizeof(em_row_access));
    em_table_get_clocks(restored, &after);
    ck_assert_uint_eq(after.access_clock, before.access_clock);
    ck_assert_uint_eq(after.update_clock, before.update_clock);
    ck_assert_uint_eq(after.samples, before.samples);
    ck_assert_mem_eq(after.sample_ms, before.sample_ms, before.samples * sizeof(uint64_t));
    ck_assert_mem_eq(after.sample_clock, before.sample_clock, before.samples * sizeof(uint32_t));
    free(loaded_keys);
    free(loaded_access);
    em_table_destroy(restored);

    /* one server's buckets: its rows' metadata */
    const char *one[1] = {info.path};
    em_checkpoint_load_options owner = {.owner_index = 1, .owner_count = 2};
    ck_assert_int_eq(em_checkpoint_load_sources(one, 1, backend, NULL, &owner, &restored, NULL,
                                                &err), EM_OK);
    uint64_t part = read_access(restored, &loaded_keys, &loaded_access);
    ck_assert_uint_gt(part, 0);
    for (uint64_t i = 0, j = 0; i < part; i++) {
        while (keys[j] != loaded_keys[i])
            j++;
        ck_assert_mem_eq(&loaded_access[i], &access[j], sizeof(em_row_access));
    }
    free(loaded_keys);
    free(loaded_access);
    em_table_destroy(restored);

    /* a delta holds the rows whose values or metadata changed (pulled rows too), so
     * through the chain every row's metadata is the table's at the delta */
    em_test_snapshot at_full = em_test_snapshot_take(table, 1000);
    options.track_changes = true;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
    for (int round = 0; round < 2; round++) {
        em_test_batch b = em_test_random_batch(&rng, 500, 2, 60000);
        float *g = em_test_random_floats(&rng, b.csr.nnz * 4);
        ck_assert_int_eq(em_test_push(table, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
        free(g);
        em_test_batch_free(&b);
        b = em_test_random_batch(&rng, 2000, 3, 60000);
        float *out = malloc(b.csr.nnz * 4 * sizeof(float) + 4);
        ck_assert_int_eq(em_test_pull(table, &b.csr, EM_COMBINER_NONE, false, out, NULL, &err),
                         EM_OK);
        free(out);
        em_test_batch_free(&b);
    }
    options.delta = true;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
    ck_assert_str_eq(info.kind, "delta");
    em_test_snapshot at_delta = em_test_snapshot_take(table, 1000);
    uint64_t *now_keys = NULL;
    em_row_access *now_access = NULL;
    uint64_t now_rows = read_access(table, &now_keys, &now_access);
    ck_assert_uint_eq(at_delta.count, now_rows);
    ck_assert_int_eq(em_checkpoint_load(info.path, backend, NULL, NULL, &restored, NULL, &err),
                     EM_OK);
    ck_assert_uint_eq(read_access(restored, &loaded_keys, &loaded_access), now_rows);
    uint32_t from_delta = 0, pulled_only = 0;
    for (uint64_t i = 0, j = 0; i < now_rows; i++) { /* both sorted by key */
        ck_assert_uint_eq(at_delta.keys[i], now_keys[i]);
        while (j < rows && keys[j] < now_keys[i])
            j++;
        bool old = j < rows && keys[j] == now_keys[i]; /* in the full checkpoint */
        bool changed = !old || memcmp(at_full.values + j * at_full.width,
                                      at_delta.values + i * at_delta.width,
                                      at_full.width * sizeof(float)) != 0;
        from_delta += changed;
        pulled_only += !changed && memcmp(&now_access[i], &access[j], sizeof(em_row_access)) != 0;
        ck_assert_mem_eq(&loaded_access[i], &now_access[i], sizeof(em_row_access));
    }
    ck_assert_uint_gt(from_delta, 0);
    ck_assert_uint_gt(pulled_only, 0); /* rows whose metadata alone changed */
    ck_assert_uint_eq(info.rows, from_delta + pulled_only);
    em_table_destroy(restored);

    /* restored with tracking, the digests include the metadata as loaded: a delta after
     * pulls of 50 stored keys holds exactly those rows (options: delta) */
    ck_assert_int_eq(em_checkpoint_load(info.path, backend, NULL, &tracking, &restored, NULL,
                                        &err), EM_OK);
    uint64_t pulled[50];
    uint32_t offsets[51];
    for (uint32_t i = 0; i < 50; i++) {
        pulled[i] = now_keys[i * (now_rows / 50)];
        offsets[i] = i;
    }
    offsets[50] = 50;
    em_csr csr = {.rows = 50, .nnz = 50, .offsets = offsets, .keys = pulled};
    float out[50 * 4];
    ck_assert_int_eq(em_test_pull(restored, &csr, EM_COMBINER_NONE, false, out, NULL, &err),
                     EM_OK);
    ck_assert_int_eq(em_checkpoint_save(restored, &options, &info, &err), EM_OK);
    ck_assert_str_eq(info.kind, "delta");
    ck_assert_uint_eq(info.rows, 50);
    free(now_keys);
    free(now_access);
    free(loaded_keys);
    free(loaded_access);
    em_test_snapshot_free(&at_full);
    em_test_snapshot_free(&at_delta);
    em_table_destroy(restored);
    free(keys);
    free(access);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* A table "admit" (dim 4, sgd) that stores a key at its third sighting, counted in a
 * sketch of 4,096 counters. */
static em_table *admitting_table(em_backend *backend)
{
    em_table_config config;
    em_table_config_init(&config, "admit", 4, 10000);
    config.optimizer = em_test_optimizers[0];
    config.admission.policy = EM_ADMISSION_COUNTER;
    config.admission.threshold = 3;
    config.admission.counters = 4096;
    return em_test_make_table(backend, &config);
}

/* Counter admission's sketch is saved with the rows and restored: a key seen twice
 * before the save is stored on its third sighting after the load; a damaged sketch is
 * refused naming admission.emb. */
START_TEST(admission_sketches_survive_a_load)
{
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_table *table = admitting_table(backend);
    uint64_t keys[50];
    uint32_t offsets[51];
    for (uint32_t i = 0; i <= 50; i++)
        offsets[i] = i;
    for (uint32_t i = 0; i < 50; i++)
        keys[i] = 1000 + i * 7;
    em_csr csr = {.rows = 50, .nnz = 50, .offsets = offsets, .keys = keys};
    float g[50 * 4];
    for (int i = 0; i < 50 * 4; i++)
        g[i] = 0.5f;
    em_error err;
    for (int sighting = 0; sighting < 2; sighting++) /* seen twice: not stored yet */
        ck_assert_int_eq(em_test_push(table, &csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    em_table_stats stats;
    em_table_get_stats(table, &stats);
    ck_assert_uint_eq(stats.rows, 0);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    em_checkpoint_info info;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &info, &err), EM_OK);
    uint8_t *sketch = malloc(4096), *loaded_sketch = malloc(4096);
    ck_assert_uint_eq(em_table_admission_bytes(table), 4096);
    em_table_get_admission(table, sketch);

    em_table *restored = NULL;
    ck_assert_msg(em_checkpoint_load(info.path, backend, NULL, NULL, &restored, NULL, &err) ==
                      EM_OK, "%s", err.message);
    em_table_get_admission(restored, loaded_sketch);
    ck_assert_mem_eq(loaded_sketch, sketch, 4096);
    ck_assert_int_eq(em_test_push(restored, &csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    em_table_get_stats(restored, &stats);
    ck_assert_uint_eq(stats.rows, 50); /* the third sighting */
    em_table_destroy(restored);

    load_refuses_a_flipped_byte(backend, info.path, "admission.emb", 100);
    free(sketch);
    free(loaded_sketch);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* Saves table twice (options with skip_unchanged): the first writes a full checkpoint,
 * *first; the second writes nothing and names it, and the table's dir has no new
 * entry. */
static void save_then_find_unchanged(em_table *table, const em_checkpoint_options *options,
                                     const char *dir, em_checkpoint_info *first)
{
    em_checkpoint_info again;
    em_error err;
    ck_assert_int_eq(em_checkpoint_save(table, options, first, &err), EM_OK);
    ck_assert_str_eq(first->kind, "full");
    ck_assert(!first->unchanged);
    char table_dir[300];
    snprintf(table_dir, sizeof(table_dir), "%s/%s", dir, em_table_name(table));
    int entries = count_entries(table_dir);
    ck_assert_int_eq(em_checkpoint_save(table, options, &again, &err), EM_OK);
    ck_assert(again.unchanged);
    ck_assert_str_eq(again.id, first->id);
    ck_assert_str_eq(again.path, first->path);
    ck_assert_str_eq(again.kind, "full");
    ck_assert_uint_eq(again.depth, 0);
    ck_assert_uint_eq(again.rows + again.bytes, 0);
    ck_assert_uint_eq(again.table_rows, first->table_rows);
    ck_assert_int_eq(count_entries(table_dir), entries);
}

/* With skip_unchanged, a delta that would change nothing is not written: the answer
 * names the latest checkpoint (unchanged, its id and depth), no directory appears, and
 * the next delta still builds on that one. A table with an admission sketch writes one
 * once a request was made of it (sightings change the sketch, not a row). */
START_TEST(unchanged_deltas_are_skipped_when_asked)
{
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, 55);
    em_table *table = trained_table(backend, 1, 8, 300, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.delta = true;
    options.skip_unchanged = true;
    em_checkpoint_info first, again, delta;
    em_error err;
    /* nothing to build on: full, whatever changed */
    save_then_find_unchanged(table, &options, dir, &first);
    change_a_little(table, 8, &rng, 5);
    ck_assert_int_eq(em_checkpoint_save(table, &options, &delta, &err), EM_OK);
    ck_assert(!delta.unchanged);
    ck_assert_str_eq(delta.kind, "delta");
    ck_assert_str_eq(delta.parent, first.id);
    ck_assert_uint_gt(delta.rows, 0);
    ck_assert_int_eq(em_checkpoint_save(table, &options, &again, &err), EM_OK);
    ck_assert(again.unchanged);
    ck_assert_str_eq(again.id, delta.id);
    ck_assert_uint_eq(again.depth, 1);
    options.skip_unchanged = false; /* asked for, an empty delta is written */
    ck_assert_int_eq(em_checkpoint_save(table, &options, &again, &err), EM_OK);
    ck_assert(!again.unchanged);
    ck_assert_str_eq(again.parent, delta.id);
    ck_assert_uint_eq(again.rows, 0);
    em_table_destroy(table);

    /* an admission sketch: untouched since, unchanged; a push of keys not admitted yet
     * moves only the sketch, and the delta is written */
    table = admitting_table(backend);
    options.skip_unchanged = true;
    save_then_find_unchanged(table, &options, dir, &first);
    uint64_t key = 77;
    uint32_t offsets[2] = {0, 1};
    em_csr one = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = &key};
    float gradient[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    ck_assert_int_eq(em_test_push(table, &one, EM_COMBINER_NONE, gradient, NULL, &err), EM_OK);
    ck_assert_int_eq(em_checkpoint_save(table, &options, &again, &err), EM_OK);
    ck_assert(!again.unchanged);
    ck_assert_str_eq(again.kind, "delta");
    ck_assert_uint_eq(again.rows, 0);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* Saves (full, or a delta) that skip_unchanged lets pass write nothing while no call
 * that may change the table ran since its latest checkpoint was saved from it or loaded
 * into it: pulls that create nothing of a table that tracks no access leave it
 * unchanged; a pull that may create keys, a push, an erase, or any pull of a table that
 * tracks access change it. A load of the table as saved is that checkpoint; a load into
 * another shape, or another save of the table's name (another table), is not. */
START_TEST(saves_of_unchanged_tables_write_nothing_when_asked)
{
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, 56);
    em_table *table = trained_table(backend, 1, 8, 300, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    options.skip_unchanged = true;
    em_checkpoint_info first, again;
    em_error err;
    save_then_find_unchanged(table, &options, dir, &first);
    /* serving: pulls that create nothing */
    em_test_batch b = em_test_random_batch(&rng, 50, 2, 600);
    float *out = malloc(b.csr.nnz * 8 * sizeof(float));
    ck_assert_int_eq(em_test_pull(table, &b.csr, EM_COMBINER_NONE, false, out, NULL, &err),
                     EM_OK);
    ck_assert_int_eq(em_checkpoint_save(table, &options, &again, &err), EM_OK);
    ck_assert(again.unchanged);
    /* a pull that may create keys (all of these are stored: it creates none) */
    ck_assert_int_eq(em_test_pull(table, &b.csr, EM_COMBINER_NONE, true, out, NULL, &err),
                     EM_OK);
    ck_assert_int_eq(em_checkpoint_save(table, &options, &again, &err), EM_OK);
    ck_assert(!again.unchanged);
    ck_assert_str_eq(again.kind, "full");
    ck_assert_str_ne(again.id, first.id);
    em_checkpoint_info latest = again;
    /* without skip_unchanged a save writes, changed or not */
    options.skip_unchanged = false;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &again, &err), EM_OK);
    ck_assert(!again.unchanged);
    ck_assert_str_ne(again.id, latest.id);
    latest = again;
    options.skip_unchanged = true;
    /* an erase, even of a key not stored */
    uint64_t gone = 123456789, erased = 0;
    ck_assert_int_eq(em_table_erase(table, &gone, 1, &erased, &err), EM_OK);
    ck_assert_uint_eq(erased, 0);
    ck_assert_int_eq(em_checkpoint_save(table, &options, &again, &err), EM_OK);
    ck_assert(!again.unchanged);
    latest = again;
    /* a load of the table as saved is its latest checkpoint; its next save writes nothing
     * until it changes */
    em_table *restored = NULL;
    ck_assert_msg(em_checkpoint_load(latest.path, backend, NULL, NULL, &restored, NULL, &err) ==
                      EM_OK, "%s", err.message);
    ck_assert_int_eq(em_checkpoint_save(restored, &options, &again, &err), EM_OK);
    ck_assert(again.unchanged);
    ck_assert_str_eq(again.id, latest.id);
    float *g = em_test_random_floats(&rng, b.csr.nnz * 8);
    ck_assert_int_eq(em_test_push(restored, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    ck_assert_int_eq(em_checkpoint_save(restored, &options, &again, &err), EM_OK);
    ck_assert(!again.unchanged);
    latest = again;
    /* the first table is no longer what the latest checkpoint of t holds */
    ck_assert_int_eq(em_checkpoint_save(table, &options, &again, &err), EM_OK);
    ck_assert(!again.unchanged);
    latest = again;
    em_table_destroy(restored);
    /* loaded into another shape (more shards): a table of its own */
    em_checkpoint_load_options reshape = {.shards = 5};
    ck_assert_msg(em_checkpoint_load(latest.path, backend, NULL, &reshape, &restored, NULL,
                                     &err) == EM_OK,
                  "%s", err.message);
    ck_assert_int_eq(em_checkpoint_save(restored, &options, &again, &err), EM_OK);
    ck_assert(!again.unchanged);
    em_table_destroy(restored);
    em_table_destroy(table);

    /* a table that tracks access: a pull moves its clocks and its rows' metadata */
    em_table_config config;
    em_table_config_init(&config, "l", 8, 1000);
    config.eviction.policy = EM_EVICTION_LRU;
    table = em_test_make_table(backend, &config);
    ck_assert_int_eq(em_test_push(table, &b.csr, EM_COMBINER_NONE, g, NULL, &err), EM_OK);
    ck_assert_int_eq(em_checkpoint_save(table, &options, &first, &err), EM_OK);
    ck_assert_int_eq(em_checkpoint_save(table, &options, &again, &err), EM_OK);
    ck_assert(again.unchanged);
    ck_assert_int_eq(em_test_pull(table, &b.csr, EM_COMBINER_NONE, false, out, NULL, &err),
                     EM_OK);
    ck_assert_int_eq(em_checkpoint_save(table, &options, &again, &err), EM_OK);
    ck_assert(!again.unchanged);
    em_table_destroy(table);
    free(g);
    free(out);
    em_test_batch_free(&b);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

/* A list gives each checkpoint's figures from its manifest without reading the data:
 * a damaged rows.emb still lists (verify refuses it), a damaged manifest lists as "?". */
START_TEST(lists_read_manifests_only)
{
    char dir[256];
    em_test_make_dir("ember-checkpoint", dir, sizeof(dir));
    em_backend *backend = make_backend();
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    em_table *table = trained_table(backend, 3, 8, 500, &rng);
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, dir);
    em_checkpoint_info first, second, verified;
    em_error err;
    ck_assert_int_eq(em_checkpoint_save(table, &options, &first, &err), EM_OK);
    ck_assert_int_eq(em_checkpoint_save(table, &options, &second, &err), EM_OK);
    char path[4400];
    snprintf(path, sizeof(path), "%s/rows.emb", second.path);
    em_test_flip_byte(path, 100);
    snprintf(path, sizeof(path), "%s/manifest.json", first.path);
    em_test_flip_byte(path, 30);
    em_checkpoint_info *list = NULL;
    size_t count = 0;
    ck_assert_int_eq(em_checkpoint_list(dir, "t", &list, &count, &err), EM_OK);
    ck_assert_uint_eq(count, 2);
    ck_assert_str_eq(list[0].kind, "?");
    ck_assert_str_eq(list[1].kind, "full");
    ck_assert_uint_eq(list[1].rows, second.rows);
    ck_assert_uint_eq(list[1].table_rows, second.table_rows);
    ck_assert_uint_eq(list[1].bytes, second.bytes);
    ck_assert_uint_eq(list[1].chunks, second.chunks);
    ck_assert_uint_eq(list[1].manifest_xxh3, second.manifest_xxh3);
    free(list);
    ck_assert_int_eq(em_checkpoint_verify(second.path, &verified, &err), EM_DATA_LOSS);
    ck_assert_msg(strstr(err.message, "rows.emb") != NULL, "%s", err.message);
    em_table_destroy(table);
    em_backend_destroy(backend);
    em_test_remove_tree(dir);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("checkpoint");
    TCase *round_trip = tcase_create("round_trip");
    tcase_set_timeout(round_trip, 120);
    tcase_add_loop_test(round_trip, saved_tables_load_bit_for_bit_and_train_on_alike, 0, 4);
    tcase_add_test(round_trip, empty_tables_round_trip);
    tcase_add_test(round_trip, chunks_larger_than_the_blocks_read_ahead_load_alike);
    tcase_add_test(round_trip, weights_load_into_another_optimizer);
    tcase_add_test(round_trip, saves_keep_the_newest);
    tcase_add_test(round_trip, pruned_checkpoints_are_removed_after_the_save_answers);
    tcase_add_test(round_trip, unchanged_deltas_are_skipped_when_asked);
    tcase_add_test(round_trip, saves_of_unchanged_tables_write_nothing_when_asked);
    tcase_add_test(round_trip, lists_read_manifests_only);
    tcase_add_test(round_trip, version_1_checkpoints_still_load);
    tcase_add_test(round_trip, version_3_checkpoints_still_load);
    tcase_add_test(round_trip, version_4_checkpoints_still_load);
    suite_add_tcase(suite, round_trip);
    TCase *damaged = tcase_create("damaged");
    tcase_add_loop_test(damaged, damaged_checkpoints_are_refused_naming_the_file, 0, DAMAGE_COUNT);
    tcase_add_loop_test(damaged, checksummed_rows_no_table_takes_are_refused, 0, 3);
    tcase_add_loop_test(damaged, sealed_impossible_sizes_and_counts_are_refused, 0, 5);
    suite_add_tcase(suite, damaged);
    TCase *failures = tcase_create("failures");
    tcase_add_loop_test(failures, a_failed_step_leaves_the_previous_checkpoint_current,
                        EM_SAVE_ROWS_WRITE, EM_SAVE_STEP_COUNT + 1);
    tcase_add_test(failures, direct_writes_go_on_buffered_where_refused);
    tcase_add_test(failures, io_buffers_are_aligned_and_given_back_when_freed);
    tcase_add_test(failures, a_failed_read_is_refused_naming_the_file);
    suite_add_tcase(suite, failures);
    TCase *deltas = tcase_create("deltas");
    tcase_set_timeout(deltas, 120);
    tcase_add_loop_test(deltas, deltas_restore_the_table_of_their_instant, 0, 4);
    tcase_add_loop_test(deltas, broken_chains_are_refused_naming_the_file, 0,
                        CHAIN_DAMAGE_COUNT);
    tcase_add_loop_test(deltas, a_failed_delta_leaves_the_next_one_complete, EM_SAVE_ROWS_WRITE,
                        EM_SAVE_STEP_COUNT + 1);
    tcase_add_test(deltas, pruning_keeps_the_chains_of_kept_deltas);
    TCase *cluster = tcase_create("cluster");
    tcase_set_timeout(cluster, 120);
    tcase_add_test(cluster, cluster_parts_load_the_buckets_each_server_owns);
    tcase_add_test(cluster, cluster_parts_refuse_damaged_chunks);
    tcase_add_test(cluster, access_metadata_and_clocks_survive_a_load);
    tcase_add_test(cluster, every_load_of_a_checkpoint_evicts_alike);
    tcase_add_test(cluster, the_evicted_ring_survives_a_load);
    tcase_add_test(cluster, admission_sketches_survive_a_load);
    suite_add_tcase(suite, cluster);
    suite_add_tcase(suite, deltas);
    return em_test_run(suite);
}
