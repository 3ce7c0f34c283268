/*
 * Cluster checkpoints end to end (lib/checkpoint/checkpoint_cluster.h): real in-process daemons
 * saved by the client into one cluster checkpoint and restored onto clusters of other
 * sizes and shard counts, each server loading the buckets it owns. Every key's row and
 * optimizer state is compared bit for bit through the checkpoints the servers write,
 * and training goes on alike on the original and the restored cluster.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lib/checkpoint/checkpoint_cluster.h"
#include "clients/ember_client.h"
#include "common/keyhash.h"
#include "lib/checkpoint/checkpoint.h"
#include "lib/device/backend.h"
#include "lib/table/table.h"
#include "tests/support/test_batches.h"
#include "tests/support/test_daemon.h"
#include "tests/support/test_support.h"

#define DIM 8
#define KEYS 3000
#define TABLE_CONFIG                                                                  \
    "{\"name\":\"t\",\"dim\":8,\"capacity\":100000,\"shards\":8,"                     \
    "\"optimizer\":{\"type\":\"adam\",\"lr\":0.01},"                                 \
    "\"initializer\":{\"type\":\"uniform\",\"bound\":0.5,\"seed\":5}}"

/* ---- fixtures ---------------------------------------------------------------------- */

typedef struct cluster {
    em_test_daemon *servers[3];
    uint32_t count;
    em_client *data, *admin; /* over every server's data and admin listener, in order */
} cluster;

static em_client *client_over(const char *list, const char *token)
{
    em_client_options options;
    em_client_options_init(&options);
    options.servers = list;
    options.token = token;
    options.timeout_ms = 60000;
    em_client *client = NULL;
    em_error err;
    ck_assert_msg(em_client_create(&options, &client, &err) == EM_OK, "%s", err.message);
    return client;
}

/* count servers, holding table t when tables_json is not NULL. */
static cluster start_cluster(uint32_t count, const char *tables_json)
{
    cluster c = {.count = count};
    em_test_daemon_options options = {.tables_json = tables_json};
    char data[512] = "", admin[512] = "";
    for (uint32_t s = 0; s < count; s++) {
        c.servers[s] = em_test_daemon_start(&options);
        snprintf(data + strlen(data), sizeof(data) - strlen(data), "%s%s", s > 0 ? "," : "",
                 em_test_daemon_address(c.servers[s]));
        snprintf(admin + strlen(admin), sizeof(admin) - strlen(admin), "%s%s", s > 0 ? "," : "",
                 em_test_daemon_admin_address(c.servers[s]));
    }
    c.data = client_over(data, NULL);
    c.admin = client_over(admin, EM_TEST_DAEMON_ADMIN_TOKEN);
    return c;
}

static void stop_cluster(cluster *c)
{
    em_client_destroy(c->data);
    em_client_destroy(c->admin);
    for (uint32_t s = 0; s < c->count; s++)
        em_test_daemon_stop(c->servers[s]);
}

/* The same pushes (seeded) to every cluster given. */
static void push_rounds(cluster *const *clusters, size_t count, const uint64_t *keys,
                        uint64_t seed, int rounds)
{
    em_test_rng rng;
    em_test_rng_init(&rng, seed);
    for (int round = 0; round < rounds; round++) {
        uint32_t n = 500, offsets[501];
        uint64_t batch[500];
        for (uint32_t i = 0; i < n; i++) {
            offsets[i] = i;
            batch[i] = keys[em_test_rng_below(&rng, KEYS)];
        }
        offsets[n] = n;
        float *g = em_test_random_floats(&rng, (uint64_t)n * DIM);
        for (size_t c = 0; c < count; c++) {
            em_client_push_args args = {.table = "t",
                                        .batch = {.rows = n, .nnz = n, .offsets = offsets,
                                                  .keys = batch},
                                        .combiner = EM_COMBINER_NONE,
                                        .gradients = g,
                                        .gradient_count = (uint64_t)n * DIM};
            em_error err;
            ck_assert_msg(em_client_push(clusters[c]->data, &args, NULL, &err) == EM_OK, "%s",
                          err.message);
        }
        free(g);
    }
}

/* Every key's weights, read through the cluster (creating the missing ones when
 * create). */
static float *pull_keys(cluster *c, const uint64_t *keys, bool create)
{
    uint32_t *offsets = malloc((KEYS + 1) * sizeof(uint32_t));
    for (uint32_t i = 0; i <= KEYS; i++)
        offsets[i] = i;
    float *out = malloc((size_t)KEYS * DIM * sizeof(float));
    em_client_pull_args args = {.table = "t",
                                .batch = {.rows = KEYS, .nnz = KEYS, .offsets = offsets,
                                          .keys = (uint64_t *)keys},
                                .combiner = EM_COMBINER_NONE,
                                .create_missing = create,
                                .out = out,
                                .out_capacity = (uint64_t)KEYS * DIM};
    em_client_pull_result result;
    em_error err;
    ck_assert_msg(em_client_pull(c->data, &args, &result, &err) == EM_OK, "%s", err.message);
    ck_assert_uint_eq(result.missing, create ? KEYS : 0);
    free(offsets);
    return out;
}

static float *pull_all(cluster *c, const uint64_t *keys)
{
    return pull_keys(c, keys, false);
}

static em_backend *local_backend(void)
{
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.pool_limit_bytes = UINT64_C(256) << 20;
    em_backend *backend = NULL;
    em_error err;
    ck_assert_int_eq(em_backend_create_cpu(&options, &backend, &err), EM_OK);
    return backend;
}

/* Every row and optimizer state of table t in a cluster checkpoint, read here from its
 * parts (all buckets); each part was saved with shards shards and holds exactly the keys
 * the client routes to its server. */
static em_test_snapshot read_cluster_checkpoint(em_backend *backend, const char *dir,
                                                uint32_t parts, uint32_t shards)
{
    cJSON *record = NULL;
    char **paths = NULL;
    uint64_t *manifests = NULL;
    size_t count = 0;
    em_error err;
    ck_assert_msg(em_cluster_read(dir, &record, &err) == EM_OK, "%s", err.message);
    ck_assert_int_eq(em_cluster_sources(record, dir, "t", &paths, &manifests, &count, &err),
                     EM_OK);
    ck_assert_uint_eq(count, parts);
    em_checkpoint_load_options options = {.manifest_xxh3 = manifests};
    em_table *table = NULL;
    ck_assert_msg(em_checkpoint_load_sources((const char *const *)paths, count, backend, NULL,
                                             &options, &table, NULL, &err) == EM_OK,
                  "%s", err.message);
    for (size_t p = 0; p < count; p++) { /* each part as its server saved it */
        em_table *part = NULL;
        ck_assert_int_eq(em_checkpoint_load(paths[p], backend, NULL, NULL, &part, NULL, &err),
                         EM_OK);
        ck_assert_uint_eq(em_table_get_config(part)->shards, shards);
        em_test_snapshot own = em_test_snapshot_take(part, 1000); /* the keys routed to it */
        for (uint64_t r = 0; r < own.count; r++)
            ck_assert_int_eq(em_key_server(own.keys[r], (int32_t)parts), (int32_t)p);
        em_test_snapshot_free(&own);
        em_table_destroy(part);
    }
    em_test_snapshot rows = em_test_snapshot_take(table, 1000);
    em_table_destroy(table);
    em_cluster_free_sources(paths, manifests, count);
    cJSON_Delete(record);
    return rows;
}

/* ---- resharding -------------------------------------------------------------------- */

/* 1 server x 8 shards saved, restored onto 3 servers x 5 shards, saved again and
 * restored onto 1 server x 8 shards: every key's row and state equal at each step, and
 * the 3-server cluster trains on bit for bit as the original does. */
START_TEST(cluster_checkpoints_reshard_1x8_to_3x5_and_back)
{
    char root[256], saved1[300], saved3[300], saved_back[300];
    em_test_make_dir("ember-cluster", root, sizeof(root));
    snprintf(saved1, sizeof(saved1), "%s/one", root);
    snprintf(saved3, sizeof(saved3), "%s/three", root);
    snprintf(saved_back, sizeof(saved_back), "%s/back", root);
    char tables[512];
    snprintf(tables, sizeof(tables), "[%s]", TABLE_CONFIG);
    cluster one = start_cluster(1, tables);
    uint64_t keys[KEYS];
    em_test_rng rng;
    em_test_rng_init(&rng, em_test_seed());
    for (uint32_t i = 0; i < KEYS; i++)
        keys[i] = em_test_rng_next(&rng) | 1u; /* random u64 keys, over every bucket */
    free(pull_keys(&one, keys, true));
    cluster *first[1] = {&one};
    push_rounds(first, 1, keys, em_test_seed() + 1, 12);
    float *before = pull_all(&one, keys);

    em_error err;
    cJSON *record = NULL;
    ck_assert_msg(em_client_cluster_save(one.admin, "t", saved1, &record, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(record, "tables")), 1);
    cJSON_Delete(record);
    /* a cluster checkpoint is never overwritten */
    ck_assert_int_eq(em_client_cluster_save(one.admin, "t", saved1, NULL, &err),
                     EM_ALREADY_EXISTS);

    /* onto 3 servers of 5 shards (none of them has the table yet) */
    cluster three = start_cluster(3, NULL);
    cJSON *loaded = NULL;
    ck_assert_msg(em_client_cluster_load(three.admin, saved1, "t", 5, &loaded, &err) == EM_OK,
                  "%s", err.message);
    ck_assert_int_eq(cJSON_GetArraySize(loaded), 3);
    double rows = 0;
    const cJSON *item = NULL;
    cJSON_ArrayForEach(item, loaded)
    {
        rows += cJSON_GetObjectItem(item, "table_rows")->valuedouble;
        ck_assert(cJSON_GetObjectItem(item, "table_rows")->valuedouble > 0);
    }
    cJSON_Delete(loaded);
    float *after = pull_all(&three, keys);
    ck_assert_mem_eq(after, before, (size_t)KEYS * DIM * sizeof(float));
    free(after);

    /* each server holds exactly the keys the client routes to it */
    ck_assert_msg(em_client_cluster_save(three.admin, "t", saved3, NULL, &err) == EM_OK, "%s",
                  err.message);
    em_backend *backend = local_backend();
    em_test_snapshot original = read_cluster_checkpoint(backend, saved1, 1, 8);
    ck_assert_uint_eq(original.count, (uint64_t)rows);
    em_test_snapshot resharded = read_cluster_checkpoint(backend, saved3, 3, 5);
    em_test_assert_snapshots_identical(&resharded, &original);
    em_test_snapshot_free(&resharded);

    /* and back onto 1 server of 8 shards */
    cluster back = start_cluster(1, NULL);
    ck_assert_msg(em_client_cluster_load(back.admin, saved3, NULL, 8, NULL, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_msg(em_client_cluster_save(back.admin, "t", saved_back, NULL, &err) == EM_OK, "%s",
                  err.message);
    em_test_snapshot returned = read_cluster_checkpoint(backend, saved_back, 1, 8);
    em_test_assert_snapshots_identical(&returned, &original);
    em_test_snapshot_free(&returned);

    /* training goes on alike: the original server and the restored 3-server cluster */
    cluster *both[2] = {&one, &three};
    push_rounds(both, 2, keys, em_test_seed() + 2, 6);
    free(before);
    before = pull_all(&one, keys);
    after = pull_all(&three, keys);
    ck_assert_mem_eq(after, before, (size_t)KEYS * DIM * sizeof(float));
    free(after);
    free(before);

    em_test_snapshot_free(&original);
    em_backend_destroy(backend);
    stop_cluster(&back);
    stop_cluster(&three);
    stop_cluster(&one);
    em_test_remove_tree(root);
}
END_TEST

/* ---- refusals ---------------------------------------------------------------------- */

/* A relative dir, a damaged record, a record naming a part outside its dir, a table the
 * record lacks and a damaged part are refused, naming what is wrong; the servers' tables
 * stay as they were. */
START_TEST(damaged_cluster_checkpoints_are_refused)
{
    char root[256], dir[300], record_path[400];
    em_test_make_dir("ember-cluster", root, sizeof(root));
    snprintf(dir, sizeof(dir), "%s/saved", root);
    snprintf(record_path, sizeof(record_path), "%s/cluster.json", dir);
    char tables[512];
    snprintf(tables, sizeof(tables), "[%s]", TABLE_CONFIG);
    cluster two = start_cluster(2, tables);
    uint64_t keys[KEYS];
    for (uint32_t i = 0; i < KEYS; i++)
        keys[i] = (uint64_t)i * 0x9e3779b97f4a7c15ull + 1;
    free(pull_keys(&two, keys, true));
    cluster *only[1] = {&two};
    push_rounds(only, 1, keys, em_test_seed(), 4);
    float *before = pull_all(&two, keys);
    em_error err;
    ck_assert_int_eq(em_client_cluster_save(two.admin, NULL, "relative/dir", NULL, &err),
                     EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "not absolute") != NULL, "%s", err.message);
    ck_assert_msg(em_client_cluster_save(two.admin, NULL, dir, NULL, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_int_eq(em_client_cluster_load(two.admin, dir, "nothing", 0, NULL, &err),
                     EM_NOT_FOUND);
    ck_assert_msg(strstr(err.message, "no table 'nothing'") != NULL &&
                      strstr(err.message, "'t'") != NULL, "%s", err.message);

    /* a flipped byte in the record */
    struct stat st;
    ck_assert_int_eq(stat(record_path, &st), 0);
    em_test_flip_byte(record_path, 40);
    ck_assert_int_eq(em_client_cluster_load(two.admin, dir, "t", 0, NULL, &err), EM_DATA_LOSS);
    ck_assert_msg(strstr(err.message, "cluster.json") != NULL &&
                      strstr(err.message, "checksum mismatch") != NULL, "%s", err.message);
    em_test_flip_byte(record_path, 40);

    /* a record (checksummed anew) whose part points outside its dir */
    cJSON *record = NULL;
    ck_assert_int_eq(em_cluster_read(dir, &record, &err), EM_OK);
    cJSON *part = cJSON_GetArrayItem(
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(record, "tables"), 0),
                            "parts"), 0);
    cJSON_ReplaceItemInObject(part, "path", cJSON_CreateString("../elsewhere"));
    unlink(record_path);
    ck_assert_int_eq(em_cluster_write(dir, record, &err), EM_OK);
    ck_assert_int_eq(em_client_cluster_load(two.admin, dir, "t", 0, NULL, &err), EM_DATA_LOSS);
    ck_assert_msg(strstr(err.message, "malformed part of table t") != NULL, "%s", err.message);
    cJSON_Delete(record);

    /* a part whose manifest is not the one recorded: refused by the server */
    ck_assert_int_eq(em_cluster_read(dir, &record, &err), EM_DATA_LOSS); /* still bad */
    char good[300];
    snprintf(good, sizeof(good), "%s/good", root);
    ck_assert_int_eq(em_client_cluster_save(two.admin, "t", good, &record, &err), EM_OK);
    part = cJSON_GetArrayItem(
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(record, "tables"), 0),
                            "parts"), 1);
    cJSON_ReplaceItemInObject(part, "manifest_xxh3", cJSON_CreateString("0123456789abcdef"));
    snprintf(record_path, sizeof(record_path), "%s/cluster.json", good);
    unlink(record_path);
    ck_assert_int_eq(em_cluster_write(good, record, &err), EM_OK);
    cJSON_Delete(record);
    ck_assert_int_eq(em_client_cluster_load(two.admin, good, "t", 0, NULL, &err), EM_DATA_LOSS);
    ck_assert_msg(strstr(err.message, "the load expects 0123456789abcdef") != NULL, "%s",
                  err.message);

    float *after = pull_all(&two, keys); /* nothing changed */
    ck_assert_mem_eq(after, before, (size_t)KEYS * DIM * sizeof(float));
    free(after);
    free(before);
    stop_cluster(&two);
    em_test_remove_tree(root);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("client_cluster");
    TCase *reshard = tcase_create("reshard");
    tcase_set_timeout(reshard, 240);
    tcase_add_test(reshard, cluster_checkpoints_reshard_1x8_to_3x5_and_back);
    suite_add_tcase(suite, reshard);
    TCase *refusals = tcase_create("refusals");
    tcase_set_timeout(refusals, 120);
    tcase_add_test(refusals, damaged_cluster_checkpoints_are_refused);
    suite_add_tcase(suite, refusals);
    return em_test_run(suite);
}
