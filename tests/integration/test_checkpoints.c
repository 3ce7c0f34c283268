/*
 * Durable tables in a real emberd: SAVE, kill -9 and restore on start; the save on
 * SIGTERM; and the crash loop, where the daemon is killed at random moments of saves
 * (and at each step of a save, by failpoint) and must come back at exactly one complete
 * checkpoint, bit for bit. EMBER_CRASH_ITERATIONS sets the loop's length (200 by
 * default); it prints the iterations and the seed.
 */
#include <check.h>
#include <cJSON.h>
#include <dirent.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clients/ember_client.h"
#include "lib/checkpoint/checkpoint_io.h"
#include "tests/integration/harness.h"
#include "tests/support/test_support.h"

#define KEYS 20000u
#define DIM 16u

/* A client over one admin listener or a list of them (which take data calls too). */
static em_client *client_over(const char *servers)
{
    em_client_options options;
    em_client_options_init(&options);
    options.servers = servers;
    options.token = TEST_ADMIN_TOKEN;
    options.timeout_ms = 30000;
    em_client *client = NULL;
    em_error err;
    ck_assert_msg(em_client_create(&options, &client, &err) == EM_OK, "%s", err.message);
    return client;
}

static em_client *client_for(const test_daemon *daemon)
{
    return client_over(daemon->admin);
}

static char *overrides(const char *dir, bool on_shutdown)
{
    static char json[2048];
    snprintf(json, sizeof(json),
             "{\"checkpoint\": {\"dir\": \"%s\", \"keep\": 2, \"on_shutdown\": %s,"
             " \"full_every\": 3},"
             " \"tables\": [{\"name\": \"t\", \"dim\": %u, \"capacity\": 100000, \"shards\": 4,"
             " \"optimizer\": {\"type\": \"adam\", \"lr\": 0.01},"
             " \"initializer\": {\"type\": \"uniform\", \"bound\": 0.1, \"seed\": 7}}]}",
             dir, on_shutdown ? "true" : "false", DIM);
    return json;
}



/* A server whose tables start from seed (checkpoint.restore) when it has no checkpoint
 * of its own, as server index of size in its cluster. */
static char *seeded(const char *dir, const char *seed, uint32_t index, uint32_t size)
{
    static char json[4096];
    snprintf(json, sizeof(json),
             "{\"checkpoint\": {\"dir\": \"%s\", \"on_shutdown\": false, \"restore\": \"%s\","
             " \"cluster_index\": %u, \"cluster_size\": %u}}",
             dir, seed, index, size);
    return json;
}

/* ---- the table's state through the wire -------------------------------------------- */

typedef struct batch {
    uint32_t offsets[KEYS + 1];
    uint64_t keys[KEYS];
} batch;

static batch *every_key(void)
{
    batch *b = malloc(sizeof(*b));
    for (uint32_t i = 0; i <= KEYS; i++)
        b->offsets[i] = i;
    for (uint32_t i = 0; i < KEYS; i++)
        b->keys[i] = (uint64_t)i * 0x9e3779b97f4a7c15ull + 1;
    return b;
}

/* Every key's weights in table (zeros where absent); *missing gets how many keys the
 * table lacks. */
static float *read_table(em_client *client, const char *table, const batch *b,
                         uint64_t *missing)
{
    float *out = calloc((size_t)KEYS * DIM, sizeof(float));
    em_client_pull_args args = {.table = table,
                                .batch = {.rows = KEYS, .nnz = KEYS, .offsets = b->offsets,
                                          .keys = b->keys},
                                .combiner = EM_COMBINER_NONE,
                                .create_missing = false,
                                .out = out,
                                .out_capacity = (uint64_t)KEYS * DIM};
    em_client_pull_result result;
    em_error err;
    ck_assert_msg(em_client_pull(client, &args, &result, &err) == EM_OK, "%s", err.message);
    *missing = result.missing;
    return out;
}

/* t's weights for every key. */
static float *read_state(em_client *client, const batch *b, uint64_t *missing)
{
    return read_table(client, "t", b, missing);
}

/* One push to n keys from first on (adam: weights and both moments move). */
static void train_part(em_client *client, const batch *b, uint64_t seed, uint32_t first,
                       uint32_t n)
{
    em_test_rng rng;
    em_test_rng_init(&rng, seed);
    float *g = malloc((size_t)KEYS * DIM * sizeof(float));
    for (uint64_t i = 0; i < (uint64_t)KEYS * DIM; i++)
        g[i] = (float)(em_test_rng_unit(&rng) - 0.5);
    em_client_push_args args = {.table = "t",
                                .batch = {.rows = n, .nnz = n, .offsets = b->offsets,
                                          .keys = b->keys + first},
                                .combiner = EM_COMBINER_NONE,
                                .gradients = g,
                                .gradient_count = (uint64_t)n * DIM};
    em_error err;
    ck_assert_msg(em_client_push(client, &args, NULL, &err) == EM_OK, "%s", err.message);
    free(g);
}

/* One push to every key. */
static void train(em_client *client, const batch *b, uint64_t seed)
{
    train_part(client, b, seed, 0, KEYS);
}

static bool same(const float *a, const float *b)
{
    return memcmp(a, b, (size_t)KEYS * DIM * sizeof(float)) == 0;
}

/* ---- a table at its capacity: lru eviction (the crash loop's second table) ---------- */

#define EVICTING_CAPACITY 6000u
#define EVICTING_PUSH 1500u /* keys per push: each push into the full table evicts */

/* The crash loop's config: t as overrides() has it, and e, which holds a fraction of the
 * keys and evicts. */
static char *crash_overrides(const char *dir)
{
    static char json[2048];
    snprintf(json, sizeof(json),
             "{\"checkpoint\": {\"dir\": \"%s\", \"keep\": 2, \"on_shutdown\": false,"
             " \"full_every\": 3},"
             " \"tables\": [{\"name\": \"t\", \"dim\": %u, \"capacity\": 100000, \"shards\": 4,"
             " \"optimizer\": {\"type\": \"adam\", \"lr\": 0.01},"
             " \"initializer\": {\"type\": \"uniform\", \"bound\": 0.1, \"seed\": 7}},"
             " {\"name\": \"e\", \"dim\": %u, \"capacity\": %u, \"shards\": 3,"
             " \"optimizer\": {\"type\": \"adagrad\", \"lr\": 0.05},"
             " \"initializer\": {\"type\": \"uniform\", \"bound\": 0.1, \"seed\": 9},"
             " \"eviction\": {\"policy\": \"lru\"}}]}",
             dir, DIM, DIM, EVICTING_CAPACITY);
    return json;
}

/* pushes pushes of EVICTING_PUSH keys into e, each from a random start (wrapping). */
static void train_evicting(em_client *client, const batch *b, uint64_t seed, int pushes)
{
    em_test_rng rng;
    em_test_rng_init(&rng, seed ^ 0x5bd1e995u);
    uint64_t keys[EVICTING_PUSH];
    float *g = malloc((size_t)EVICTING_PUSH * DIM * sizeof(float));
    for (int p = 0; p < pushes; p++) {
        uint32_t first = (uint32_t)em_test_rng_below(&rng, KEYS);
        for (uint32_t i = 0; i < EVICTING_PUSH; i++)
            keys[i] = b->keys[(first + i) % KEYS];
        for (uint64_t i = 0; i < (uint64_t)EVICTING_PUSH * DIM; i++)
            g[i] = (float)(em_test_rng_unit(&rng) - 0.5);
        em_client_push_args args = {.table = "e",
                                    .batch = {.rows = EVICTING_PUSH, .nnz = EVICTING_PUSH,
                                              .offsets = b->offsets, .keys = keys},
                                    .combiner = EM_COMBINER_NONE,
                                    .gradients = g,
                                    .gradient_count = (uint64_t)EVICTING_PUSH * DIM};
        em_error err;
        ck_assert_msg(em_client_push(client, &args, NULL, &err) == EM_OK, "%s", err.message);
    }
    free(g);
}

/* The state of both of the crash loop's tables: t's weights, e's weights and its
 * missing count (which keys it holds), and e's evicted-key ring (EVICTED: how many keys
 * its policy removed, and a digest of the keys the ring holds, in order). */
typedef struct crash_state {
    float *t, *e;
    uint64_t t_missing, e_missing;
    uint64_t e_removed, e_ring_digest;
} crash_state;

static void read_ring(em_client *client, const char *table, uint64_t *removed,
                      uint64_t *digest)
{
    cJSON *evicted = NULL;
    em_error err;
    ck_assert_msg(em_client_evicted(client, table, 0, 0, &evicted, &err) == EM_OK, "%s",
                  err.message);
    *removed = (uint64_t)cJSON_GetObjectItem(evicted, "total")->valuedouble;
    *digest = 1469598103934665603ull; /* FNV-1a over the keys' decimal strings */
    const cJSON *key;
    cJSON_ArrayForEach(key, cJSON_GetObjectItem(evicted, "keys"))
        for (const char *c = key->valuestring; ; c++) {
            *digest = (*digest ^ (unsigned char)*c) * 1099511628211ull;
            if (*c == '\0')
                break;
        }
    cJSON_Delete(evicted);
}

static crash_state read_crash_state(em_client *client, const batch *b)
{
    crash_state state;
    state.t = read_state(client, b, &state.t_missing);
    state.e = read_table(client, "e", b, &state.e_missing);
    read_ring(client, "e", &state.e_removed, &state.e_ring_digest);
    return state;
}

/* Whether table t (e) of a equals that of b; a table of b never saved (NULL) is empty. */
static bool same_t(const crash_state *a, const crash_state *b)
{
    return b->t == NULL ? a->t_missing == KEYS : a->t_missing == 0 && same(a->t, b->t);
}

static bool same_e(const crash_state *a, const crash_state *b)
{
    if (b->e == NULL)
        return a->e_missing == KEYS && a->e_removed == 0;
    return a->e_missing == b->e_missing && same(a->e, b->e) && a->e_removed == b->e_removed &&
           a->e_ring_digest == b->e_ring_digest;
}

/* Takes table t (e) of from into into, freeing into's. */
static void take_t(crash_state *into, crash_state *from)
{
    free(into->t);
    into->t = from->t;
    into->t_missing = from->t_missing;
    from->t = NULL;
}

static void take_e(crash_state *into, crash_state *from)
{
    free(into->e);
    into->e = from->e;
    into->e_missing = from->e_missing;
    into->e_removed = from->e_removed;
    into->e_ring_digest = from->e_ring_digest;
    from->e = NULL;
}

static void crash_state_free(crash_state *state)
{
    free(state->t);
    free(state->e);
    state->t = state->e = NULL;
}

/* ---- SAVE, kill -9, restore ---------------------------------------------------------- */

START_TEST(saved_tables_survive_kill_9)
{
    char dir[256];
    em_test_make_dir("ember-checkpoints", dir, sizeof(dir));
    batch *b = every_key();
    test_daemon *daemon = test_daemon_start(overrides(dir, false));
    em_client *client = client_for(daemon);
    uint64_t missing = 0;
    train(client, b, 1);
    train(client, b, 2);
    float *saved_state = read_state(client, b, &missing);
    ck_assert_uint_eq(missing, 0);
    cJSON *saved = NULL;
    em_error err;
    ck_assert_msg(em_client_save(client, NULL, false, &saved, &err) == EM_OK, "%s", err.message);
    ck_assert_int_eq(cJSON_GetArraySize(saved), 1);
    const cJSON *item = cJSON_GetArrayItem(saved, 0);
    ck_assert_str_eq(cJSON_GetObjectItem(item, "table")->valuestring, "t");
    ck_assert_double_eq(cJSON_GetObjectItem(item, "rows")->valuedouble, KEYS);
    char path[4200];
    snprintf(path, sizeof(path), "%s", cJSON_GetObjectItem(item, "path")->valuestring);
    cJSON_Delete(saved);
    cJSON *stats = NULL;
    ck_assert_int_eq(em_client_stats(client, NULL, &stats, &err), EM_OK);
    const cJSON *server = cJSON_GetObjectItem(stats, "server");
    ck_assert_double_eq(cJSON_GetObjectItem(server, "checkpoint_saves")->valuedouble, 1);
    ck_assert_double_eq(cJSON_GetObjectItem(server, "checkpoint_save_failures")->valuedouble, 0);
    ck_assert_double_gt(cJSON_GetObjectItem(server, "checkpoint_last_save_bytes")->valuedouble,
                        KEYS * DIM * 3 * 4);
    ck_assert_double_gt(cJSON_GetObjectItem(server, "checkpoint_last_success_unix_ms")->valuedouble,
                        1.7e12);
    cJSON_Delete(stats);
    /* trained on after the save: lost with the kill */
    train(client, b, 3);
    em_client_destroy(client);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGKILL, 5000), 128 + SIGKILL);

    /* emberctl checks the checkpoint offline */
    char *argv[] = {getenv("EMBERCTL"), "checkpoints", "verify", path, NULL};
    char *output = NULL;
    ck_assert_int_eq(test_run_program(argv, NULL, &output), 0);
    ck_assert_msg(strstr(output, "every checksum matches") != NULL, "%s", output);
    free(output);

    daemon = test_daemon_start(overrides(dir, false));
    char *log = test_daemon_log(daemon);
    ck_assert_msg(strstr(log, "restored table 't' from full checkpoint 00000000000000000001") !=
                      NULL,
                  "%s", log);
    free(log);
    client = client_for(daemon);
    float *restored = read_state(client, b, &missing);
    ck_assert_uint_eq(missing, 0);
    ck_assert(same(restored, saved_state));
    ck_assert_int_eq(em_client_stats(client, NULL, &stats, &err), EM_OK);
    server = cJSON_GetObjectItem(stats, "server");
    ck_assert_double_eq(cJSON_GetObjectItem(server, "checkpoint_tables_restored")->valuedouble, 1);
    ck_assert_double_eq(cJSON_GetObjectItem(server, "checkpoint_rows_restored")->valuedouble, KEYS);
    cJSON_Delete(stats);
    /* and a save there goes on numbering */
    ck_assert_int_eq(em_client_save(client, "t", false, &saved, &err), EM_OK);
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(saved, 0), "id")->valuestring,
                     "00000000000000000002");
    cJSON_Delete(saved);
    ck_assert_int_eq(em_client_save(client, "nope", false, &saved, &err), EM_NOT_FOUND);

    /* LOAD: trained on, then back to the latest checkpoint; and the first one under
     * another name */
    train(client, b, 4);
    cJSON *loaded = NULL;
    ck_assert_msg(em_client_load(client, "t", NULL, false, &loaded, &err) == EM_OK, "%s",
                  err.message);
    ck_assert_str_eq(cJSON_GetObjectItem(loaded, "id")->valuestring, "00000000000000000002");
    cJSON_Delete(loaded);
    float *reloaded = read_state(client, b, &missing);
    ck_assert(missing == 0 && same(reloaded, saved_state));
    free(reloaded);
    ck_assert_int_eq(em_client_load(client, "copy", path, false, NULL, &err), EM_OK);
    ck_assert_int_eq(em_client_load(client, "other", "/nonexistent", false, NULL, &err),
                     EM_NOT_FOUND);
    ck_assert_int_eq(em_client_load(client, "other", "relative/dir", false, NULL, &err),
                     EM_INVALID_ARGUMENT);
    ck_assert_msg(strstr(err.message, "path 'relative/dir' is not an absolute path") != NULL,
                  "%s", err.message);
    em_client_destroy(client);
    test_daemon_stop(daemon, SIGTERM, 10000);
    free(restored);
    free(saved_state);
    free(b);
    em_test_remove_tree(dir);
}
END_TEST

/* With on_shutdown, SIGTERM saves what was trained last. */
START_TEST(sigterm_saves_every_table)
{
    char dir[256];
    em_test_make_dir("ember-checkpoints", dir, sizeof(dir));
    batch *b = every_key();
    test_daemon *daemon = test_daemon_start(overrides(dir, true));
    em_client *client = client_for(daemon);
    train(client, b, 11);
    uint64_t missing = 0;
    float *last = read_state(client, b, &missing);
    em_client_destroy(client);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 20000), 0);
    daemon = test_daemon_start(overrides(dir, true));
    client = client_for(daemon);
    float *restored = read_state(client, b, &missing);
    ck_assert_uint_eq(missing, 0);
    ck_assert(same(restored, last));
    em_client_destroy(client);
    test_daemon_stop(daemon, SIGKILL, 5000);
    free(restored);
    free(last);
    free(b);
    em_test_remove_tree(dir);
}
END_TEST

/* The fields of the one checkpoint a SAVE answered. */
static const cJSON *saved_one(cJSON *saved)
{
    ck_assert_int_eq(cJSON_GetArraySize(saved), 1);
    return cJSON_GetArrayItem(saved, 0);
}

/* save --delta writes what changed; kill -9 and the restart restores base and delta;
 * the shutdown saves follow checkpoint.full_every (3: a full one, then two deltas). */
START_TEST(deltas_survive_kill_9_and_follow_full_every)
{
    char dir[256];
    em_test_make_dir("ember-checkpoints", dir, sizeof(dir));
    batch *b = every_key();
    test_daemon *daemon = test_daemon_start(overrides(dir, true));
    em_client *client = client_for(daemon);
    train(client, b, 21);
    cJSON *saved = NULL;
    em_error err;
    /* nothing to build on yet: a full one */
    ck_assert_int_eq(em_client_save(client, "t", true, &saved, &err), EM_OK);
    ck_assert_str_eq(cJSON_GetObjectItem(saved_one(saved), "kind")->valuestring, "full");
    cJSON_Delete(saved);
    train_part(client, b, 22, 500, 100);
    char *ctl = getenv("EMBERCTL"), *out = NULL;
    char *save[] = {ctl, "--server", daemon->admin, "save", "t", "--delta", NULL};
    ck_assert_int_eq(test_run_program(save, TEST_ADMIN_TOKEN, &out), 0);
    ck_assert_msg(strstr(out, "t: delta checkpoint 00000000000000000002, 100 rows, "
                              "0 tombstones") != NULL, "%s", out);
    free(out);
    /* STATS counts the delta; with no save running the progress gauges are back at 0 */
    cJSON *stats = NULL;
    ck_assert_int_eq(em_client_stats(client, NULL, &stats, &err), EM_OK);
    const cJSON *server = cJSON_GetObjectItem(stats, "server");
    ck_assert_double_eq(cJSON_GetObjectItem(server, "checkpoint_saves")->valuedouble, 2);
    ck_assert_double_eq(cJSON_GetObjectItem(server, "checkpoint_deltas")->valuedouble, 1);
    ck_assert_double_eq(cJSON_GetObjectItem(server, "checkpoint_save_rows_read")->valuedouble, 0);
    ck_assert_double_eq(cJSON_GetObjectItem(server, "checkpoint_save_rows")->valuedouble,
                        0);
    cJSON_Delete(stats);
    /* the server lists its checkpoints as emberctl lists their dir: line for line */
    char *local[] = {ctl, "checkpoints", "list", dir, "t", NULL};
    char *by_server[] = {ctl, "--server", daemon->admin, "checkpoints", "list", "t", NULL};
    char *all[] = {ctl, "--server", daemon->admin, "checkpoints", "list", NULL};
    char *listed_here = NULL, *listed_there = NULL;
    ck_assert_int_eq(test_run_program(local, NULL, &listed_here), 0);
    ck_assert_int_eq(test_run_program(by_server, TEST_ADMIN_TOKEN, &listed_there), 0);
    ck_assert_msg(strstr(listed_here, "00000000000000000002 ") != NULL &&
                      strstr(listed_here, "(latest)") != NULL, "%s", listed_here);
    ck_assert_str_eq(listed_there, listed_here);
    free(listed_there);
    ck_assert_int_eq(test_run_program(all, TEST_ADMIN_TOKEN, &listed_there), 0);
    ck_assert_str_eq(listed_there, listed_here); /* t is its only table */
    free(listed_there);
    free(listed_here);
    char *nope[] = {ctl, "--server", daemon->admin, "checkpoints", "list", "nope", NULL};
    ck_assert_int_eq(test_run_program(nope, TEST_ADMIN_TOKEN, &out), 1);
    ck_assert_msg(strstr(out, "NOT_FOUND") != NULL && strstr(out, "nope") != NULL, "%s", out);
    free(out);
    char *climb[] = {ctl, "--server", daemon->admin, "checkpoints", "list", "../nope", NULL};
    ck_assert_int_eq(test_run_program(climb, TEST_ADMIN_TOKEN, &out), 1);
    ck_assert_msg(strstr(out, "INVALID_ARGUMENT") != NULL, "%s", out);
    free(out);
    uint64_t missing = 0;
    float *state = read_state(client, b, &missing);
    em_client_destroy(client);
    test_daemon_stop(daemon, SIGKILL, 5000);

    daemon = test_daemon_start(overrides(dir, true));
    char *log = test_daemon_log(daemon);
    ck_assert_msg(strstr(log, "from delta checkpoint 00000000000000000002 (depth 1): 20000 "
                              "rows") != NULL, "%s", log);
    free(log);
    client = client_for(daemon);
    float *restored = read_state(client, b, &missing);
    ck_assert(missing == 0 && same(restored, state));
    free(restored);
    free(state);
    /* a LOAD of the delta says how many rows the loaded table has, not only the
     * delta's own */
    char delta_path[512];
    snprintf(delta_path, sizeof(delta_path), "%s/t/00000000000000000002", dir);
    char *load[] = {ctl, "--server", daemon->admin, "load", "t2", "--from", delta_path, NULL};
    ck_assert_int_eq(test_run_program(load, TEST_ADMIN_TOKEN, &out), 0);
    ck_assert_msg(strstr(out, "t2: loaded delta checkpoint 00000000000000000002 (depth 1), "
                              "20000 rows, ") != NULL, "%s", out);
    free(out);
    char *drop[] = {ctl, "--server", daemon->admin, "tables", "drop", "t2", NULL};
    ck_assert_int_eq(test_run_program(drop, TEST_ADMIN_TOKEN, &out), 0);
    free(out);
    /* the restored table's digests carry on: SIGTERM writes delta 3 on top of 2 */
    train_part(client, b, 23, 7000, 50);
    state = read_state(client, b, &missing);
    em_client_destroy(client);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 20000), 0);
    char *list[] = {ctl, "checkpoints", "list", dir, "t", NULL};
    ck_assert_int_eq(test_run_program(list, NULL, &out), 0);
    ck_assert_msg(strstr(out, "table t, delta on 00000000000000000002 (depth 2), 50 rows "
                              "changed, 0 tombstones, 20000 rows restored") != NULL, "%s", out);
    free(out);

    /* restored and only read (pulls that create nothing), the table is still delta 3's:
     * SIGTERM writes nothing */
    daemon = test_daemon_start(overrides(dir, true));
    client = client_for(daemon);
    restored = read_state(client, b, &missing);
    ck_assert(missing == 0 && same(restored, state));
    free(restored);
    em_client_destroy(client);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 20000), 0);
    ck_assert_int_eq(test_run_program(list, NULL, &out), 0);
    ck_assert_msg(strstr(out, "00000000000000000004") == NULL, "%s", out);
    free(out);
    /* the chain has full_every - 1 deltas: the next scheduled save that writes is full */
    daemon = test_daemon_start(overrides(dir, true));
    client = client_for(daemon);
    restored = read_state(client, b, &missing);
    ck_assert(missing == 0 && same(restored, state));
    free(restored);
    free(state);
    train_part(client, b, 24, 9000, 20);
    em_client_destroy(client);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 20000), 0);
    ck_assert_int_eq(test_run_program(list, NULL, &out), 0);
    ck_assert_msg(strstr(out, "00000000000000000004") != NULL &&
                      strstr(strstr(out, "00000000000000000004"), "full, 20000 rows") != NULL,
                  "%s", out);
    free(out);
    free(b);
    em_test_remove_tree(dir);
}
END_TEST

/* The server's STATS number called name. */
static double server_number(em_client *client, const char *name)
{
    cJSON *stats = NULL;
    em_error err;
    ck_assert_msg(em_client_stats(client, NULL, &stats, &err) == EM_OK, "%s", err.message);
    const cJSON *value = cJSON_GetObjectItem(cJSON_GetObjectItem(stats, "server"), name);
    double number = value != NULL ? value->valuedouble : 0.0;
    cJSON_Delete(stats);
    return number;
}

/* Waits up to 15 s for the server's STATS number called name to reach at least target. */
static double wait_for_number(em_client *client, const char *name, double target)
{
    double number = server_number(client, name);
    for (int i = 0; i < 150 && number < target; i++) {
        usleep(100000);
        number = server_number(client, name);
    }
    ck_assert_msg(number >= target, "%s stayed at %g, below %g", name, number, target);
    return number;
}

/* SIGTERM while a periodic save runs (held by the failpoint checkpoint_stall once it
 * has its snapshot of a first training): the shutdown save waits for it and then
 * saves, so the pushes made while it ran survive the restart. Before, the shutdown save
 * found the table's lock taken, failed with "another save of it is running", and the
 * restart came back at the periodic save's snapshot. */
START_TEST(sigterm_during_a_periodic_save_keeps_the_last_pushes)
{
    char dir[256];
    em_test_make_dir("ember-checkpoints", dir, sizeof(dir));
    char json[2048];
    snprintf(json, sizeof(json),
             "{\"checkpoint\": {\"dir\": \"%s\", \"on_shutdown\": true, \"interval_s\": 1},"
             " \"tables\": [{\"name\": \"t\", \"dim\": %u, \"capacity\": 100000, \"shards\": 2,"
             " \"optimizer\": {\"type\": \"adam\", \"lr\": 0.01}}]}",
             dir, DIM);
    batch *b = every_key();
    setenv("EMBER_FAILPOINTS", "checkpoint_stall=4000*1", 1);
    test_daemon *daemon = test_daemon_start(json);
    unsetenv("EMBER_FAILPOINTS");
    em_client *client = client_for(daemon);
    train(client, b, 41);
    /* the first periodic save has its snapshot (STATS hears its rows from then on) */
    wait_for_number(client, "checkpoint_save_rows", KEYS);
    train(client, b, 42);
    uint64_t missing = 0;
    float *last = read_state(client, b, &missing);
    ck_assert_double_eq(server_number(client, "checkpoint_saves_running"), 1); /* still */
    em_client_destroy(client);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 30000), 0);
    daemon = test_daemon_start(json);
    char *log = test_daemon_log(daemon);
    client = client_for(daemon);
    float *restored = read_state(client, b, &missing);
    ck_assert_uint_eq(missing, 0);
    ck_assert_msg(same(restored, last), "the restart lost the pushes of the last training: %s",
                  log);
    free(log);
    em_client_destroy(client);
    test_daemon_stop(daemon, SIGKILL, 5000);
    free(restored);
    free(last);
    free(b);
    em_test_remove_tree(dir);
}
END_TEST

typedef struct program_run {
    char **argv;
    int status;
    char *out;
} program_run;

static void *run_program_thread(void *argument)
{
    program_run *run = argument;
    run->status = test_run_program(run->argv, TEST_ADMIN_TOKEN, &run->out);
    return NULL;
}

/* The name in dir that starts with prefix ("" when none does). */
static void find_entry(const char *dir, const char *prefix, char *name, size_t size)
{
    name[0] = '\0';
    DIR *d = opendir(dir);
    ck_assert_ptr_nonnull(d);
    struct dirent *entry;
    while ((entry = readdir(d)) != NULL)
        if (strncmp(entry->d_name, prefix, strlen(prefix)) == 0)
            snprintf(name, size, "%s", entry->d_name);
    closedir(d);
}

/* A dropped table stays dropped: its checkpoints are moved aside (to
 * .dropped-<name>-<unix ms> under checkpoint.dir), the restart passes over them, and a
 * LOAD can still bring the table back from there. A drop while a save of the table
 * runs waits for it, and its checkpoint goes aside with the others. (Before, the dropped
 * table's checkpoints stayed in place, and every restart restored it.) */
START_TEST(a_dropped_table_stays_dropped_across_restarts)
{
    char dir[256];
    em_test_make_dir("ember-checkpoints", dir, sizeof(dir));
    batch *b = every_key();
    setenv("EMBER_FAILPOINTS", "checkpoint_stall=3000*1", 1); /* the first save stalls */
    test_daemon *daemon = test_daemon_start(overrides(dir, true));
    unsetenv("EMBER_FAILPOINTS");
    em_client *client = client_for(daemon);
    train(client, b, 61);
    char *ctl = getenv("EMBERCTL"), *out = NULL;
    char *save_t[] = {ctl, "--server", daemon->admin, "save", "t", NULL};
    program_run saving = {.argv = save_t};
    pthread_t saver;
    pthread_create(&saver, NULL, run_program_thread, &saving);
    wait_for_number(client, "checkpoint_save_rows", KEYS); /* it has its snapshot */
    char *drop_t[] = {ctl, "--server", daemon->admin, "tables", "drop", "t", NULL};
    ck_assert_int_eq(test_run_program(drop_t, TEST_ADMIN_TOKEN, &out), 0);
    free(out);
    pthread_join(saver, NULL);
    ck_assert_msg(saving.status == 0, "%s", saving.out);
    free(saving.out);
    char aside_t[256], left[256], path[600];
    find_entry(dir, ".dropped-t-", aside_t, sizeof(aside_t));
    ck_assert_msg(aside_t[0] != '\0', "no .dropped-t-* under %s", dir);
    find_entry(dir, "t", left, sizeof(left));
    ck_assert_msg(left[0] == '\0', "%s/%s is still there", dir, left);
    /* the save the drop waited for is complete, aside */
    snprintf(path, sizeof(path), "%s/%s/00000000000000000001", dir, aside_t);
    char *verify[] = {ctl, "checkpoints", "verify", path, NULL};
    ck_assert_int_eq(test_run_program(verify, NULL, &out), 0);
    free(out);

    /* t2: loaded from t's checkpoint, saved into its own directory, then dropped */
    char *load[] = {ctl, "--server", daemon->admin, "load", "t2", "--from", path, NULL};
    ck_assert_int_eq(test_run_program(load, TEST_ADMIN_TOKEN, &out), 0);
    free(out);
    char *save_t2[] = {ctl, "--server", daemon->admin, "save", "t2", NULL};
    ck_assert_int_eq(test_run_program(save_t2, TEST_ADMIN_TOKEN, &out), 0);
    free(out);
    char *drop_t2[] = {ctl, "--server", daemon->admin, "tables", "drop", "t2", NULL};
    ck_assert_int_eq(test_run_program(drop_t2, TEST_ADMIN_TOKEN, &out), 0);
    free(out);
    char aside[256];
    find_entry(dir, ".dropped-t2-", aside, sizeof(aside));
    ck_assert_msg(aside[0] != '\0', "no .dropped-t2-* under %s", dir);
    find_entry(dir, "t2", left, sizeof(left));
    ck_assert_msg(left[0] == '\0', "%s/%s is still there", dir, left);
    char *log = test_daemon_log(daemon);
    ck_assert_msg(strstr(log, "dropped table 't2'; its checkpoints were moved to ") != NULL,
                  "%s", log);
    free(log);
    char *listed[] = {ctl, "--server", daemon->admin, "checkpoints", "list", NULL};
    ck_assert_int_eq(test_run_program(listed, TEST_ADMIN_TOKEN, &out), 0);
    ck_assert_msg(strstr(out, "t2") == NULL, "%s", out);
    free(out);
    em_client_destroy(client);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 20000), 0);

    /* the restart restores neither: t comes back as its configuration makes it, empty */
    daemon = test_daemon_start(overrides(dir, true));
    log = test_daemon_log(daemon);
    ck_assert_msg(strstr(log, "restored table") == NULL, "the restart restored: %s", log);
    free(log);
    char *tables[] = {ctl, "--server", daemon->admin, "tables", "list", NULL};
    ck_assert_int_eq(test_run_program(tables, TEST_ADMIN_TOKEN, &out), 0);
    ck_assert_msg(strstr(out, "t2") == NULL, "%s", out);
    free(out);
    client = client_for(daemon);
    uint64_t missing = 0;
    free(read_state(client, b, &missing));
    ck_assert_uint_eq(missing, KEYS);
    /* what was set aside loads */
    char back[600];
    snprintf(back, sizeof(back), "%s/%s/00000000000000000001", dir, aside);
    char *load_back[] = {ctl, "--server", daemon->admin, "load", "t3", "--from", back, NULL};
    ck_assert_int_eq(test_run_program(load_back, TEST_ADMIN_TOKEN, &out), 0);
    ck_assert_msg(strstr(out, "t3: loaded full checkpoint 00000000000000000001") != NULL &&
                      strstr(out, "20000 rows") != NULL, "%s", out);
    free(out);
    em_client_destroy(client);
    test_daemon_stop(daemon, SIGKILL, 5000);
    free(b);
    em_test_remove_tree(dir);
}
END_TEST

typedef struct admin_saves {
    char **argv;
    _Atomic int stop;
    int busy;  /* refused: a periodic save held the table */
    int other; /* failed otherwise */
    int done;
} admin_saves;

static void *save_until_stopped(void *argument)
{
    admin_saves *a = argument;
    while (!atomic_load(&a->stop)) {
        char *out = NULL;
        if (test_run_program(a->argv, TEST_ADMIN_TOKEN, &out) == 0)
            a->done++;
        else if (strstr(out, "another save of it is running") != NULL)
            a->busy++;
        else
            a->other++;
        free(out);
    }
    return NULL;
}

/* A periodic save that finds an admin SAVE of the table running is passed over (STATS
 * checkpoint_saves_passed_over, an info line), not counted as a failure: the admin save
 * covers it. An admin SAVE that finds a periodic one running is refused
 * (FAILED_PRECONDITION), and not counted as a failure either. Every save stalls 1.5 s
 * (failpoint checkpoint_stall), so the two meet. */
START_TEST(a_periodic_save_beside_an_admin_save_is_passed_over)
{
    char dir[256];
    em_test_make_dir("ember-checkpoints", dir, sizeof(dir));
    char json[2048];
    snprintf(json, sizeof(json),
             "{\"checkpoint\": {\"dir\": \"%s\", \"interval_s\": 1},"
             " \"tables\": [{\"name\": \"t\", \"dim\": %u, \"capacity\": 100000}]}",
             dir, DIM);
    setenv("EMBER_FAILPOINTS", "checkpoint_stall=1500", 1);
    test_daemon *daemon = test_daemon_start(json);
    unsetenv("EMBER_FAILPOINTS");
    em_client *client = client_for(daemon);
    batch *b = every_key();
    train(client, b, 71);
    char *ctl = getenv("EMBERCTL");
    char *save[] = {ctl, "--server", daemon->admin, "save", "t", NULL};
    admin_saves admin = {.argv = save};
    pthread_t thread;
    pthread_create(&thread, NULL, save_until_stopped, &admin);
    wait_for_number(client, "checkpoint_saves_passed_over", 1);
    atomic_store(&admin.stop, 1);
    pthread_join(thread, NULL);
    ck_assert_int_eq(admin.other, 0);
    ck_assert_double_eq(server_number(client, "checkpoint_save_failures"), 0);
    char *log = test_daemon_log(daemon);
    ck_assert_msg(strstr(log, "periodic save of table 't' passed over: save of table 't': "
                              "another save of it is running") != NULL, "%s", log);
    free(log);
    char *shown = NULL, *stats_argv[] = {ctl, "--server", daemon->admin, "stats", NULL};
    ck_assert_int_eq(test_run_program(stats_argv, TEST_ADMIN_TOKEN, &shown), 0);
    ck_assert_msg(strstr(shown, " passed over, 0 failed, ") != NULL, "%s", shown);
    free(shown);
    em_client_destroy(client);
    test_daemon_stop(daemon, SIGKILL, 5000);
    free(b);
    em_test_remove_tree(dir);
}
END_TEST

/* Periodic saves (checkpoint.interval_s) of a table nobody changed write nothing: the
 * latest checkpoint still holds it, and a delta would only lengthen the chain (STATS
 * checkpoint_saves_unchanged; the log says so). A push, or on a table that tracks
 * access a pull that moves its clocks without changing a row, makes the next one write
 * a delta again. */
START_TEST(periodic_saves_write_nothing_for_unchanged_tables)
{
    char dir[256];
    em_test_make_dir("ember-checkpoints", dir, sizeof(dir));
    char json[2048];
    snprintf(json, sizeof(json),
             "{\"checkpoint\": {\"dir\": \"%s\", \"keep\": 3, \"on_shutdown\": false,"
             " \"interval_s\": 1, \"full_every\": 100},"
             " \"tables\": [{\"name\": \"t\", \"dim\": %u, \"capacity\": 100000, \"shards\": 2,"
             " \"optimizer\": {\"type\": \"adam\", \"lr\": 0.01}},"
             " {\"name\": \"l\", \"dim\": 4, \"capacity\": 1000, \"shards\": 2,"
             " \"eviction\": {\"policy\": \"lru\"}}]}",
             dir, DIM);
    batch *b = every_key();
    test_daemon *daemon = test_daemon_start(json);
    em_client *client = client_for(daemon);
    train_part(client, b, 31, 0, 100);
    float gradient[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    uint32_t one[2] = {0, 1};
    uint64_t key = 12345, absent = 999;
    em_client_push_args push_l = {.table = "l",
                                  .batch = {.rows = 1, .nnz = 1, .offsets = one, .keys = &key},
                                  .combiner = EM_COMBINER_NONE,
                                  .gradients = gradient,
                                  .gradient_count = 4};
    em_error err;
    ck_assert_msg(em_client_push(client, &push_l, NULL, &err) == EM_OK, "%s", err.message);
    /* both tables saved since, then found unchanged twice each */
    double unchanged = wait_for_number(client, "checkpoint_saves_unchanged", 4);
    double saves = server_number(client, "checkpoint_saves");
    ck_assert_double_ge(saves, 2);
    wait_for_number(client, "checkpoint_saves_unchanged", unchanged + 4);
    ck_assert_double_eq(server_number(client, "checkpoint_saves"), saves);
    char *ctl = getenv("EMBERCTL"), *shown = NULL; /* emberctl stats counts them too */
    char *stats_argv[] = {ctl, "--server", daemon->admin, "stats", NULL};
    ck_assert_int_eq(test_run_program(stats_argv, TEST_ADMIN_TOKEN, &shown), 0);
    ck_assert_msg(strstr(shown, " unchanged, ") != NULL, "%s", shown);
    free(shown);
    char *log = test_daemon_log(daemon);
    ck_assert_msg(strstr(log, "table 't' is unchanged since checkpoint ") != NULL &&
                      strstr(log, "table 'l' is unchanged since checkpoint ") != NULL,
                  "%s", log);
    free(log);
    /* a pull of an absent key changes no row of l, but moves its access clock, which the
     * checkpoint holds: a delta of l again, and t still unchanged */
    float out[4];
    em_client_pull_args pull_l = {.table = "l",
                                  .batch = {.rows = 1, .nnz = 1, .offsets = one, .keys = &absent},
                                  .combiner = EM_COMBINER_NONE,
                                  .create_missing = false,
                                  .out = out,
                                  .out_capacity = 4};
    em_client_pull_result pulled;
    ck_assert_msg(em_client_pull(client, &pull_l, &pulled, &err) == EM_OK, "%s", err.message);
    ck_assert_uint_eq(pulled.missing, 1);
    double deltas = server_number(client, "checkpoint_deltas");
    wait_for_number(client, "checkpoint_deltas", deltas + 1);
    ck_assert_double_eq(server_number(client, "checkpoint_saves"), saves + 1);
    /* and a push to t: a delta of t's 50 changed rows */
    train_part(client, b, 32, 10, 50);
    wait_for_number(client, "checkpoint_deltas", deltas + 2);
    char *out_text = NULL;
    char *list[] = {ctl, "checkpoints", "list", dir, "t", NULL};
    ck_assert_int_eq(test_run_program(list, NULL, &out_text), 0);
    ck_assert_msg(strstr(out_text, "depth 1), 50 rows changed, 0 tombstones, 100 rows "
                                   "restored") != NULL, "%s", out_text);
    free(out_text);
    em_client_destroy(client);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 20000), 0);
    free(b);
    em_test_remove_tree(dir);
}
END_TEST

/* A server without a checkpoint section says so. */
START_TEST(save_without_a_checkpoint_dir_is_refused)
{
    test_daemon *daemon = test_daemon_start(NULL);
    em_client *client = client_for(daemon);
    cJSON *saved = NULL;
    em_error err;
    ck_assert_int_eq(em_client_save(client, NULL, false, &saved, &err), EM_FAILED_PRECONDITION);
    ck_assert_msg(strstr(err.message, "no checkpoint section") != NULL, "%s", err.message);
    em_client_destroy(client);
    test_daemon_stop(daemon, SIGTERM, 10000);
}
END_TEST

/* ---- the crash loop -------------------------------------------------------------------- */

typedef struct save_call {
    em_client *client;
    bool delta;
    em_status status;
    double seconds; /* how long the call took */
} save_call;

static void *save_in_background(void *argument)
{
    save_call *call = argument;
    cJSON *saved = NULL;
    em_error err;
    double start = em_test_now();
    call->status = em_client_save(call->client, NULL, call->delta, &saved, &err);
    call->seconds = em_test_now() - start;
    cJSON_Delete(saved);
    return NULL;
}

/* Each iteration: the restarted daemon holds exactly the last completed checkpoint (or
 * nothing before the first), in both of its tables: t, and e, which is full and evicts
 * at every push (which keys it holds is part of the state); it trains, a save starts (half of them deltas, after
 * training a few keys), and the daemon dies by kill -9 after a random delay of up to
 * three times the last completed save's duration (so most saves complete, however fast
 * the machine), or by a failpoint at a random step of the save. */
START_TEST(kill_9_during_saves_restarts_at_one_complete_checkpoint)
{
    const char *configured = getenv("EMBER_CRASH_ITERATIONS");
    int iterations = configured != NULL ? atoi(configured) : 200;
    uint64_t seed = em_test_seed();
    em_test_rng rng;
    em_test_rng_init(&rng, seed);
    char dir[256];
    em_test_make_dir("ember-checkpoints", dir, sizeof(dir));
    batch *b = every_key();
    crash_state completed = {0}; /* each table as its last completed save holds it (NULL:
                                  * none yet); a save writes each table's checkpoint apart */
    int saves_completed = 0, deltas_completed = 0, by_failpoint = 0;
    double save_seconds = 0.2; /* until a save has been timed */
    for (int i = 0; i < iterations; i++) {
        bool failpoint = em_test_rng_below(&rng, 3) == 0;
        bool delta = em_test_rng_below(&rng, 2) == 0;
        delta = delta && completed.t != NULL; /* a delta trains a few keys: all exist by then */
        int step = 1 + (int)em_test_rng_below(&rng, EM_SAVE_STEP_COUNT);
        char crash[64];
        snprintf(crash, sizeof(crash), "checkpoint_crash=%d", step);
        if (failpoint)
            setenv("EMBER_FAILPOINTS", crash, 1);
        test_daemon *daemon = test_daemon_start(crash_overrides(dir));
        unsetenv("EMBER_FAILPOINTS");
        em_client *client = client_for(daemon);
        crash_state state = read_crash_state(client, b);
        ck_assert_msg(same_t(&state, &completed),
                      "iteration %d (seed %llu): t restored is not its last completed checkpoint",
                      i, (unsigned long long)seed);
        ck_assert_msg(same_e(&state, &completed),
                      "iteration %d (seed %llu): e restored is not its last completed checkpoint "
                      "(%" PRIu64 " keys missing, %" PRIu64 " in it; %" PRIu64 " keys evicted, "
                      "%" PRIu64 " in it)", i, (unsigned long long)seed, state.e_missing,
                      completed.e_missing, state.e_removed, completed.e_removed);
        crash_state_free(&state);
        if (delta)
            train_part(client, b, seed + (uint64_t)i, (uint32_t)em_test_rng_below(&rng, KEYS - 1000),
                       1000);
        else
            train(client, b, seed + (uint64_t)i);
        /* e is full after the first iteration: every push evicts, and a delta carries the
         * evicted keys as tombstones */
        train_evicting(client, b, seed + (uint64_t)i, delta ? 1 : 4);
        crash_state trained = read_crash_state(client, b);
        save_call call = {.client = client, .delta = delta, .status = EM_UNKNOWN};
        pthread_t thread;
        pthread_create(&thread, NULL, save_in_background, &call);
        if (!failpoint) {
            double delay = 3.0 * save_seconds * em_test_rng_unit(&rng);
            usleep((useconds_t)(delay * 1e6));
        } else {
            pthread_join(thread, NULL); /* answered when the daemon ends itself */
        }
        int code = test_daemon_stop(daemon, SIGKILL, 5000);
        if (!failpoint)
            pthread_join(thread, NULL);
        if (call.status == EM_OK)
            save_seconds = call.seconds;
        em_client_destroy(client);
        if (failpoint)
            by_failpoint += code == 99;
        if (call.status == EM_OK) {
            /* answered before the kill: this save is complete */
            take_t(&completed, &trained);
            take_e(&completed, &trained);
            saves_completed++;
            deltas_completed += delta;
            continue;
        }
        /* unanswered: complete or not, the next start tells; remember both */
        test_daemon *probe = test_daemon_start(crash_overrides(dir));
        client = client_for(probe);
        crash_state now = read_crash_state(client, b);
        em_client_destroy(client);
        test_daemon_stop(probe, SIGKILL, 5000);
        /* each table on its own: its new checkpoint or its old one */
        bool t_new = same_t(&now, &trained), e_new = same_e(&now, &trained);
        ck_assert_msg(t_new || same_t(&now, &completed),
                      "iteration %d (seed %llu): after a kill during a save t is neither its "
                      "old nor its new checkpoint", i, (unsigned long long)seed);
        ck_assert_msg(e_new || same_e(&now, &completed),
                      "iteration %d (seed %llu): after a kill during a save e is neither its "
                      "old nor its new checkpoint", i, (unsigned long long)seed);
        if (t_new)
            take_t(&completed, &trained);
        if (e_new)
            take_e(&completed, &trained);
        saves_completed += t_new && e_new;
        deltas_completed += t_new && e_new && delta;
        crash_state_free(&trained);
        crash_state_free(&now);
    }
    printf("crash loop: %d iterations (seed %llu), %d saves completed (%d asked as deltas), %d "
           "crashed by failpoint inside a save; e holds %" PRIu64 " of the %u keys\n",
           iterations, (unsigned long long)seed, saves_completed, deltas_completed, by_failpoint,
           completed.e != NULL ? KEYS - completed.e_missing : 0, KEYS);
    if (iterations >= 10) /* e filled up, and its saves held it full */
        ck_assert_msg(completed.e != NULL && completed.e_missing == KEYS - EVICTING_CAPACITY,
                      "e's last checkpoint holds %" PRIu64 " keys, not its capacity %u",
                      KEYS - completed.e_missing, EVICTING_CAPACITY);
    crash_state_free(&completed);
    free(b);
    em_test_remove_tree(dir);
}
END_TEST

/* ---- cluster checkpoints ------------------------------------------------------------ */

/* A client over several daemons (their admin listeners, which take data calls too). */
static em_client *cluster_client(test_daemon *const *daemons, uint32_t count, char *list,
                                 size_t capacity)
{
    list[0] = '\0';
    for (uint32_t s = 0; s < count; s++)
        snprintf(list + strlen(list), capacity - strlen(list), "%s%s", s > 0 ? "," : "",
                 daemons[s]->admin);
    return client_over(list);
}

/* emberctl saves 2 servers into a cluster checkpoint, verifies it offline, and restores
 * it onto 3 new servers with 3 shards each: every key reads back as trained, and the
 * restored servers save on into their own checkpoint dirs. */
static int compare_key_order(const void *a, const void *b)
{
    uint64_t x = ((const uint64_t *)a)[0], y = ((const uint64_t *)b)[0];
    return x < y ? -1 : x > y;
}

/* Checks that the arrays exported into out hold every key of b, ascending, with the
 * weights of trained (b's order). */
static void assert_export_holds(const char *out, const batch *b, const float *trained)
{
    uint64_t *keys = em_test_read_array(out, "keys.npy", "<u8", KEYS, 0);
    float *weights = em_test_read_array(out, "weights.npy", "<f4", KEYS, DIM);
    uint64_t *order = malloc((size_t)KEYS * 2 * sizeof(uint64_t));
    for (uint64_t i = 0; i < KEYS; i++) {
        order[2 * i] = b->keys[i];
        order[2 * i + 1] = i;
    }
    qsort(order, KEYS, 2 * sizeof(uint64_t), compare_key_order);
    for (uint64_t i = 0; i < KEYS; i++) {
        ck_assert_uint_eq(keys[i], order[2 * i]);
        ck_assert_mem_eq(weights + i * DIM, trained + order[2 * i + 1] * DIM,
                         DIM * sizeof(float));
    }
    free(order);
    free(keys);
    free(weights);
}

/* emberctl exports a server's checkpoint as arrays and imports them as a new checkpoint
 * of another table, which the server loads: every key's weights as trained; a directory
 * that holds files, and arrays of another dim, are refused with what was wrong. */
START_TEST(emberctl_exports_arrays_and_imports_them_into_a_server)
{
    char dir[256], out[512], root[512], table_dir[512];
    em_test_make_dir("ember-checkpoints", dir, sizeof(dir));
    snprintf(out, sizeof(out), "%s/export", dir);
    snprintf(root, sizeof(root), "%s/imported", dir);
    snprintf(table_dir, sizeof(table_dir), "%s/t", dir);
    batch *b = every_key();
    test_daemon *daemon = test_daemon_start(overrides(dir, false));
    em_client *client = client_for(daemon);
    train(client, b, 31);
    train_part(client, b, 32, 100, 5000);
    uint64_t missing = 0;
    float *trained = read_state(client, b, &missing);
    ck_assert_uint_eq(missing, 0);
    char *ctl = getenv("EMBERCTL"), *output = NULL;
    char *save[] = {ctl, "--server", daemon->admin, "save", "t", NULL};
    ck_assert_int_eq(test_run_program(save, TEST_ADMIN_TOKEN, &output), 0);
    free(output);

    char *export[] = {ctl, "checkpoints", "export", table_dir, "--out", out, NULL};
    ck_assert_int_eq(test_run_program(export, NULL, &output), 0);
    ck_assert_msg(strstr(output, "table t, checkpoint 00000000000000000001, 20000 rows") != NULL,
                  "%s", output);
    free(output);
    assert_export_holds(out, b, trained);
    ck_assert_int_eq(test_run_program(export, NULL, &output), 1); /* out holds the export */
    ck_assert_msg(strstr(output, "FAILED_PRECONDITION") != NULL &&
                      strstr(output, "is not empty") != NULL, "%s", output);
    free(output);

    char *import[] = {ctl, "checkpoints", "import", out, "--to", root, "--name", "t2", NULL};
    ck_assert_int_eq(test_run_program(import, NULL, &output), 0);
    ck_assert_msg(strstr(output, "table t2, full, 20000 rows") != NULL, "%s", output);
    free(output);
    char from[600];
    snprintf(from, sizeof(from), "%s/t2", root);
    char *load[] = {ctl, "--server", daemon->admin, "load", "t2", "--from", from, NULL};
    ck_assert_int_eq(test_run_program(load, TEST_ADMIN_TOKEN, &output), 0);
    free(output);
    float *imported = read_table(client, "t2", b, &missing);
    ck_assert_uint_eq(missing, 0);
    ck_assert(same(imported, trained));
    free(imported);

    char *other_dim[] = {ctl, "checkpoints", "import", out, "--to", root, "--json-config",
                         "{\"name\": \"t3\", \"dim\": 8, \"capacity\": 100000, "
                         "\"optimizer\": {\"type\": \"adam\"}}", NULL};
    ck_assert_int_eq(test_run_program(other_dim, NULL, &output), 1);
    ck_assert_msg(strstr(output, "INVALID_ARGUMENT") != NULL &&
                      strstr(output, "weights of 16 floats a row where the table's dim is 8") !=
                          NULL, "%s", output);
    free(output);
    free(trained);
    em_client_destroy(client);
    test_daemon_stop(daemon, SIGTERM, 10000);
    free(b);
    em_test_remove_tree(dir);
}
END_TEST

START_TEST(emberctl_moves_a_table_between_clusters)
{
    char root[256], dirs[5][300], cluster_dir[300], list[512];
    em_test_make_dir("ember-checkpoints", root, sizeof(root));
    snprintf(cluster_dir, sizeof(cluster_dir), "%s/cluster", root);
    test_daemon *two[2], *three[3];
    for (int s = 0; s < 5; s++)
        snprintf(dirs[s], sizeof(dirs[s]), "%s/server-dir-%d", root, s);
    for (int s = 0; s < 2; s++)
        two[s] = test_daemon_start(overrides(dirs[s], false));
    batch *b = every_key();
    em_client *client = cluster_client(two, 2, list, sizeof(list));
    train(client, b, 1);
    train(client, b, 2);
    uint64_t missing = 0;
    float *trained = read_state(client, b, &missing);
    ck_assert_uint_eq(missing, 0);
    em_client_destroy(client);

    char *save[] = {getenv("EMBERCTL"), "--server", list, "save", "t", "--cluster", cluster_dir,
                    NULL};
    char *output = NULL;
    ck_assert_int_eq(test_run_program(save, TEST_ADMIN_TOKEN, &output), 0);
    ck_assert_msg(strstr(output, "t: server 1 (") != NULL &&
                      strstr(output, "tables from 2 servers") != NULL, "%s", output);
    free(output);
    for (int s = 0; s < 2; s++)
        test_daemon_stop(two[s], SIGTERM, 10000);
    char *verify[] = {getenv("EMBERCTL"), "checkpoints", "verify", cluster_dir, NULL};
    ck_assert_int_eq(test_run_program(verify, NULL, &output), 0);
    ck_assert_msg(strstr(output, "table t, 2 parts, 20000 rows: every checksum matches") != NULL,
                  "%s", output);
    free(output);
    /* the parts together export as one table, every key once */
    char exported[400];
    snprintf(exported, sizeof(exported), "%s/export", root);
    char *export[] = {getenv("EMBERCTL"), "checkpoints", "export", cluster_dir, "--out",
                      exported, NULL};
    ck_assert_int_eq(test_run_program(export, NULL, &output), 0);
    ck_assert_msg(strstr(output, "table t, checkpoint 00000000000000000001, 20000 rows") != NULL,
                  "%s", output);
    free(output);
    assert_export_holds(exported, b, trained);

    /* two new servers seeded from it at start, each with its own buckets; after a
     * kill -9 they come back at their own latest save, not at the seed */
    test_daemon *again[2];
    for (uint32_t s = 0; s < 2; s++)
        again[s] = test_daemon_start(seeded(dirs[2 + s], cluster_dir, s, 2));
    client = cluster_client(again, 2, list, sizeof(list));
    float *seeded_state = read_state(client, b, &missing);
    ck_assert_uint_eq(missing, 0);
    ck_assert(same(seeded_state, trained));
    free(seeded_state);
    char *log = test_daemon_log(again[1]);
    ck_assert_msg(strstr(log, "as server 1 of 2") != NULL, "%s", log);
    free(log);
    train(client, b, 3);
    float *trained_on = read_state(client, b, &missing);
    cJSON *saved = NULL;
    em_error err;
    for (uint32_t s = 0; s < 2; s++) { /* each server's own checkpoint */
        em_client *one = client_for(again[s]);
        ck_assert_int_eq(em_client_save(one, "t", false, &saved, &err), EM_OK);
        cJSON_Delete(saved);
        em_client_destroy(one);
        ck_assert_int_eq(test_daemon_stop(again[s], SIGKILL, 5000), 128 + SIGKILL);
    }
    em_client_destroy(client);
    for (uint32_t s = 0; s < 2; s++)
        again[s] = test_daemon_start(seeded(dirs[2 + s], cluster_dir, s, 2));
    client = cluster_client(again, 2, list, sizeof(list));
    seeded_state = read_state(client, b, &missing);
    ck_assert(missing == 0 && same(seeded_state, trained_on));
    free(seeded_state);
    free(trained_on);
    log = test_daemon_log(again[0]);
    ck_assert_msg(strstr(log, "restored from its own checkpoint, not from") != NULL, "%s", log);
    free(log);
    em_client_destroy(client);
    for (uint32_t s = 0; s < 2; s++)
        test_daemon_stop(again[s], SIGTERM, 10000);
    for (int s = 2; s < 4; s++)
        em_test_remove_tree(dirs[s]);

    for (int s = 0; s < 3; s++)
        three[s] = test_daemon_start(overrides(dirs[2 + s], false));
    client = cluster_client(three, 3, list, sizeof(list));
    char *load[] = {getenv("EMBERCTL"), "--server", list, "load", "--cluster", cluster_dir,
                    "--shards", "3", NULL};
    ck_assert_int_eq(test_run_program(load, TEST_ADMIN_TOKEN, &output), 0);
    ck_assert_msg(strstr(output, "t: server 2 (") != NULL &&
                      strstr(output, "from 2 parts") != NULL, "%s", output);
    free(output);
    float *restored = read_state(client, b, &missing);
    ck_assert_uint_eq(missing, 0);
    ck_assert(same(restored, trained));
    cJSON *tables = NULL;
    ck_assert_int_eq(em_client_list_tables(client, &tables, &err), EM_OK);
    ck_assert_double_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(tables, 0), "shards")->valuedouble,
                        3);
    cJSON_Delete(tables);
    /* a damaged record is refused, and the tables stay as loaded */
    char record_path[400];
    snprintf(record_path, sizeof(record_path), "%s/cluster.json", cluster_dir);
    FILE *f = fopen(record_path, "r+");
    ck_assert(f != NULL);
    fseek(f, 10, SEEK_SET);
    fputc('X', f);
    fclose(f);
    ck_assert_int_eq(test_run_program(load, TEST_ADMIN_TOKEN, &output), 1);
    ck_assert_msg(strstr(output, "DATA_LOSS") != NULL && strstr(output, "cluster.json") != NULL,
                  "%s", output);
    free(output);
    ck_assert_int_eq(test_run_program(verify, NULL, &output), 1);
    free(output);
    free(restored);
    restored = read_state(client, b, &missing);
    ck_assert(missing == 0 && same(restored, trained));
    em_client_destroy(client);
    for (int s = 0; s < 3; s++)
        test_daemon_stop(three[s], SIGTERM, 10000);
    free(restored);
    free(trained);
    free(b);
    em_test_remove_tree(root);
}
END_TEST

int main(void)
{
    test_skip_without_backend();
    Suite *suite = suite_create("checkpoints");
    TCase *restart = tcase_create("restart");
    tcase_set_timeout(restart, 120);
    tcase_add_test(restart, saved_tables_survive_kill_9);
    tcase_add_test(restart, sigterm_saves_every_table);
    tcase_add_test(restart, save_without_a_checkpoint_dir_is_refused);
    tcase_add_test(restart, deltas_survive_kill_9_and_follow_full_every);
    tcase_add_test(restart, periodic_saves_write_nothing_for_unchanged_tables);
    tcase_add_test(restart, sigterm_during_a_periodic_save_keeps_the_last_pushes);
    tcase_add_test(restart, a_dropped_table_stays_dropped_across_restarts);
    tcase_add_test(restart, a_periodic_save_beside_an_admin_save_is_passed_over);
    tcase_add_test(restart, emberctl_moves_a_table_between_clusters);
    tcase_add_test(restart, emberctl_exports_arrays_and_imports_them_into_a_server);
    suite_add_tcase(suite, restart);
    TCase *crash = tcase_create("crash");
    tcase_set_timeout(crash, 1800);
    tcase_add_test(crash, kill_9_during_saves_restarts_at_one_complete_checkpoint);
    suite_add_tcase(suite, crash);
    return em_test_run(suite);
}
