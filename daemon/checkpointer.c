#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/checkpointer.h"
#include "daemon/context.h"
#include "lib/checkpoint/checkpoint_cluster.h"

struct em_checkpointer {
    const em_checkpoint_config *config;
    em_catalog *catalog;
    const em_log *log;
    em_checkpoint_options options;
    em_checkpoint_removals *removals; /* the files of checkpoints the saves pruned */
    em_server_stats *stats;
    pthread_t thread;
    bool thread_running;
    pthread_mutex_t mutex;
    pthread_cond_t wake;
    bool stopping;
};

static uint64_t now_unix_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u;
}

/* ---- saving -------------------------------------------------------------------------- */

/* What one running save has added to the progress gauges of STATS. */
typedef struct save_progress {
    em_server_stats *stats;
    uint64_t read, total;
} save_progress;

static void report_save(void *context, uint64_t rows_read, uint64_t rows_total)
{
    save_progress *p = context;
    atomic_fetch_add(&p->stats->checkpoint_save_rows_read, rows_read - p->read);
    atomic_fetch_add(&p->stats->checkpoint_save_rows, rows_total - p->total);
    p->read = rows_read;
    p->total = rows_total;
}

static em_status save_one(em_checkpointer *c, em_table *table, em_save_mode mode,
                          bool wait_for_lock, em_checkpoint_info *info, em_error *err)
{
    em_checkpoint_options options = c->options;
    options.wait_for_lock = wait_for_lock;
    save_progress progress = {.stats = c->stats};
    options.progress = report_save;
    options.progress_context = &progress;
    bool scheduled_delta = mode == EM_SAVE_SCHEDULED && c->config->full_every > 1;
    options.delta = mode == EM_SAVE_DELTA || scheduled_delta;
    options.max_depth = mode == EM_SAVE_SCHEDULED ? c->config->full_every - 1 : 0;
    /* a periodic or shutdown save of a table nobody changed since its latest checkpoint
     * would write that checkpoint again (or an empty delta, lengthening the chain) */
    options.skip_unchanged = mode == EM_SAVE_SCHEDULED;
    atomic_fetch_add(&c->stats->checkpoint_saves_running, 1);
    em_status status = em_checkpoint_save(table, &options, info, err);
    atomic_fetch_sub(&c->stats->checkpoint_save_rows_read, progress.read);
    atomic_fetch_sub(&c->stats->checkpoint_save_rows, progress.total);
    atomic_fetch_sub(&c->stats->checkpoint_saves_running, 1);
    if (status != EM_OK && em_table_dropped(table)) { /* dropped since it was listed */
        em_log_info(c->log, "table '%s' was dropped or replaced: not saved",
                    em_table_name(table));
        return status;
    }
    if (status != EM_OK && info->busy) {
        /* another save of it (periodic, admin, another process) is writing it now: no
         * failure, and that save covers a periodic one */
        if (mode == EM_SAVE_SCHEDULED)
            atomic_fetch_add(&c->stats->checkpoint_saves_passed_over, 1);
        em_log_info(c->log, "%s save of table '%s' passed over: %s",
                    mode == EM_SAVE_SCHEDULED ? "periodic" : "requested", info->table,
                    err->message);
        return status;
    }
    if (status != EM_OK) {
        atomic_fetch_add(&c->stats->checkpoint_save_failures, 1);
        em_log_error(c->log, "%s", err->message);
        return status;
    }
    atomic_store(&c->stats->checkpoint_last_success_unix_ms, now_unix_ms());
    if (info->unchanged) { /* durable as of now, in the latest checkpoint */
        atomic_fetch_add(&c->stats->checkpoint_saves_unchanged, 1);
        em_log_info(c->log, "table '%s' is unchanged since checkpoint %s: nothing saved",
                    info->table, info->id);
        return EM_OK;
    }
    atomic_fetch_add(&c->stats->checkpoint_saves, 1);
    if (strcmp(info->kind, "delta") == 0)
        atomic_fetch_add(&c->stats->checkpoint_deltas, 1);
    atomic_store(&c->stats->checkpoint_last_save_ms, (uint64_t)(info->seconds * 1000.0));
    atomic_store(&c->stats->checkpoint_last_save_bytes, info->bytes);
    em_log_notice(c->log, "saved table '%s' as %s checkpoint %s: %" PRIu64 " rows, %" PRIu64
                  " tombstones, %" PRIu64 " bytes in %.3f s", info->table, info->kind, info->id,
                  info->rows, info->tombstones, info->bytes, info->seconds);
    return EM_OK;
}

/* Saves one table somewhere: the checkpointer's own saves, or copies into a dir. */
typedef em_status (*save_fn)(void *context, em_table *table, em_checkpoint_info *info,
                             em_error *err);

/* Saves the table called name, or every table, with save; *infos gets what was saved.
 * Every table is tried; the error is the first failure, other than that of a table
 * dropped since it was listed when every table is saved. */
static em_status save_tables(em_catalog *catalog, const char *name, save_fn save, void *context,
                             em_checkpoint_info **infos, size_t *count, em_error *err)
{
    *infos = NULL;
    *count = 0;
    em_table **tables = NULL;
    size_t n = 0;
    em_status status = EM_OK;
    if (name != NULL && name[0] != '\0') {
        tables = malloc(sizeof(*tables));
        if (tables == NULL)
            return em_error_set(err, EM_RESOURCE_EXHAUSTED, "save: out of memory");
        status = em_catalog_acquire(catalog, name, &tables[0], err);
        n = status == EM_OK ? 1 : 0;
    } else {
        status = em_catalog_list(catalog, &tables, &n, err);
    }
    if (status == EM_OK && n > 0) {
        *infos = calloc(n, sizeof(**infos));
        if (*infos == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "save: out of memory");
    }
    em_status first = status;
    for (size_t i = 0; i < n; i++) {
        em_error one;
        if (first == EM_OK || *infos != NULL) {
            em_status saved = save(context, tables[i], &(*infos)[*count], &one);
            bool every = name == NULL || name[0] == '\0';
            bool passed_over = saved != EM_OK && every && em_table_dropped(tables[i]);
            if (saved == EM_OK)
                (*count)++;
            else if (first == EM_OK && !passed_over) {
                first = saved;
                em_error_copy(err, &one);
            }
        }
        em_catalog_release(catalog, tables[i]);
    }
    free(tables);
    return first;
}

typedef struct own_save {
    em_checkpointer *checkpointer;
    em_save_mode mode;
    bool wait_for_lock;
} own_save;

static em_status save_own(void *context, em_table *table, em_checkpoint_info *info,
                          em_error *err)
{
    own_save *own = context;
    return save_one(own->checkpointer, table, own->mode, own->wait_for_lock, info, err);
}

em_status em_checkpointer_save(em_checkpointer *c, const char *name, em_save_mode mode,
                               em_checkpoint_info **infos, size_t *count, em_error *err)
{
    own_save own = {.checkpointer = c, .mode = mode};
    return save_tables(c->catalog, name, save_own, &own, infos, count, err);
}

em_status em_checkpointer_save_at_exit(em_checkpointer *c, em_checkpoint_info **infos,
                                       size_t *count, em_error *err)
{
    em_checkpointer_stop(c);
    own_save own = {.checkpointer = c, .mode = EM_SAVE_SCHEDULED, .wait_for_lock = true};
    return save_tables(c->catalog, NULL, save_own, &own, infos, count, err);
}

typedef struct copy_save {
    const em_log *log;
    em_server_stats *stats;
    const char *dir;
} copy_save;

static em_status save_copy(void *context, em_table *table, em_checkpoint_info *info,
                           em_error *err)
{
    copy_save *copy = context;
    em_checkpoint_options options;
    em_checkpoint_options_init(&options, copy->dir);
    options.detached = true;
    options.keep = UINT32_MAX; /* copies are never pruned here */
    save_progress progress = {.stats = copy->stats};
    options.progress = report_save;
    options.progress_context = &progress;
    atomic_fetch_add(&copy->stats->checkpoint_saves_running, 1);
    em_status status = em_checkpoint_save(table, &options, info, err);
    atomic_fetch_sub(&copy->stats->checkpoint_save_rows_read, progress.read);
    atomic_fetch_sub(&copy->stats->checkpoint_save_rows, progress.total);
    atomic_fetch_sub(&copy->stats->checkpoint_saves_running, 1);
    if (status != EM_OK) {
        atomic_fetch_add(&copy->stats->checkpoint_save_failures, 1);
        em_log_error(copy->log, "%s", err->message);
        return status;
    }
    em_log_notice(copy->log, "saved table '%s' into %s (a copy outside its chain): %" PRIu64
                  " rows, %" PRIu64 " bytes in %.3f s", info->table, info->path, info->rows,
                  info->bytes, info->seconds);
    return EM_OK;
}

em_status em_checkpointer_save_into(em_catalog *catalog, const em_log *log,
                                    em_server_stats *stats, const char *dir, const char *name,
                                    em_checkpoint_info **infos, size_t *count, em_error *err)
{
    *infos = NULL;
    *count = 0;
    if (dir == NULL || dir[0] != '/')
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "save: dir '%s' is not an absolute path on the server",
                            dir == NULL ? "" : dir);
    copy_save copy = {.log = log, .stats = stats, .dir = dir};
    return save_tables(catalog, name, save_copy, &copy, infos, count, err);
}

/* ---- the periodic saves ------------------------------------------------------------- */

static void *periodic(void *argument)
{
    em_checkpointer *c = argument;
    pthread_mutex_lock(&c->mutex);
    while (!c->stopping) {
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_sec += (time_t)c->config->interval_s;
        while (!c->stopping && pthread_cond_timedwait(&c->wake, &c->mutex, &until) != ETIMEDOUT)
            ;
        if (c->stopping)
            break;
        pthread_mutex_unlock(&c->mutex);
        em_checkpoint_info *infos = NULL;
        size_t count = 0;
        em_error err;
        /* failures are logged */
        em_checkpointer_save(c, NULL, EM_SAVE_SCHEDULED, &infos, &count, &err);
        free(infos);
        pthread_mutex_lock(&c->mutex);
    }
    pthread_mutex_unlock(&c->mutex);
    return NULL;
}

em_status em_checkpointer_create(const em_checkpoint_config *config, em_catalog *catalog,
                                 const em_log *log, em_server_stats *stats,
                                 em_checkpointer **out, em_error *err)
{
    em_checkpointer *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "checkpointer: out of memory");
    c->config = config;
    c->catalog = catalog;
    c->log = log;
    c->stats = stats;
    em_checkpoint_options_init(&c->options, config->dir);
    c->options.keep = config->keep;
    c->options.copy_limit_bytes = config->copy_limit_bytes;
    c->options.track_changes = config->full_every > 1;
    pthread_mutex_init(&c->mutex, NULL);
    em_status status = em_checkpoint_removals_create(&c->removals, err);
    if (status != EM_OK) {
        pthread_mutex_destroy(&c->mutex);
        free(c);
        return status;
    }
    c->options.removals = c->removals;
    pthread_condattr_t attributes;
    pthread_condattr_init(&attributes);
    pthread_condattr_setclock(&attributes, CLOCK_MONOTONIC);
    pthread_cond_init(&c->wake, &attributes);
    pthread_condattr_destroy(&attributes);
    if (config->interval_s > 0) {
        int rc = pthread_create(&c->thread, NULL, periodic, c);
        if (rc != 0) {
            em_checkpointer_destroy(c);
            return em_error_set(err, EM_INTERNAL, "checkpointer thread: %s", strerror(rc));
        }
        c->thread_running = true;
    }
    *out = c;
    return EM_OK;
}

void em_checkpointer_stop(em_checkpointer *c)
{
    if (!c->thread_running)
        return;
    pthread_mutex_lock(&c->mutex);
    c->stopping = true;
    pthread_cond_signal(&c->wake);
    pthread_mutex_unlock(&c->mutex);
    pthread_join(c->thread, NULL);
    c->thread_running = false;
}

void em_checkpointer_destroy(em_checkpointer *c)
{
    if (c == NULL)
        return;
    em_checkpointer_stop(c);
    em_checkpoint_removals_destroy(c->removals); /* waits for them */
    pthread_cond_destroy(&c->wake);
    pthread_mutex_destroy(&c->mutex);
    free(c);
}

/* ---- restore ---------------------------------------------------------------------------- */

/* What the progress of one table's load goes to. */
typedef struct load_progress {
    void (*progress)(void *context, const char *line, bool detail);
    void *context;
    const char *table;
    size_t index, count;
    uint64_t last_ms; /* em_monotonic_ms of the last line */
} load_progress;

static void report_load(void *context, uint64_t rows, uint64_t bytes, uint64_t total_bytes)
{
    load_progress *p = context;
    uint64_t now = em_monotonic_ms();
    if (p->progress == NULL || now - p->last_ms < 1000)
        return;
    p->last_ms = now;
    char line[512];
    snprintf(line, sizeof(line),
             "restoring table '%s' (%zu of %zu): %" PRIu64 " rows, %.2f of %.2f GB read",
             p->table, p->index, p->count, rows, (double)bytes / 1e9, (double)total_bytes / 1e9);
    p->progress(p->context, line, true);
}

em_status em_checkpointer_restore(em_checkpointer *c,
                                  void (*progress)(void *context, const char *line,
                                                   bool detail),
                                  void *context, em_error *err)
{
    char **names = NULL;
    size_t count = 0;
    em_status status = em_checkpoint_tables(c->config->dir, &names, &count, err);
    for (size_t i = 0; status == EM_OK && i < count; i++) {
        char line[512], path[4200];
        snprintf(line, sizeof(line), "restoring table '%s' (%zu of %zu)", names[i], i + 1, count);
        if (progress != NULL)
            progress(context, line, false);
        load_progress reporter = {.progress = progress, .context = context, .table = names[i],
                                  .index = i + 1, .count = count,
                                  .last_ms = em_monotonic_ms()};
        em_checkpoint_load_options options = {.track_changes = c->options.track_changes,
                                              .progress = report_load,
                                              .progress_context = &reporter};
        em_checkpoint_info info;
        em_table *table = NULL;
        status = em_checkpoint_latest(c->config->dir, names[i], path, sizeof(path), err);
        if (status == EM_OK)
            status = em_checkpoint_load(path, em_catalog_backend(c->catalog), NULL, &options,
                                        &table, &info, err);
        if (status == EM_OK)
            status = em_catalog_add(c->catalog, table, err);
        if (status != EM_OK) {
            em_error_prefix(err, "restore of table '%s': ", names[i]);
            break;
        }
        atomic_fetch_add(&c->stats->checkpoint_tables_restored, 1);
        atomic_fetch_add(&c->stats->checkpoint_rows_restored, info.table_rows);
        em_log_notice(c->log, "restored table '%s' from %s checkpoint %s (depth %u): %" PRIu64
                      " rows in %.3f s", names[i], info.kind, info.id, info.depth,
                      info.table_rows, info.seconds);
    }
    em_checkpoint_free_names(names, count);
    return status;
}

/* Loads one table of the seed (paths: one checkpoint, or a cluster checkpoint's parts)
 * unless the catalog has it. */
static em_status seed_table(em_checkpointer *c, const char *name, const char *const *paths,
                            size_t count, const uint64_t *manifests,
                            void (*progress)(void *context, const char *line, bool detail),
                            void *context, size_t index, size_t total, em_error *err)
{
    em_table *existing = NULL;
    em_error ignored;
    if (em_catalog_acquire(c->catalog, name, &existing, &ignored) == EM_OK) {
        em_catalog_release(c->catalog, existing);
        em_log_notice(c->log, "table '%s' restored from its own checkpoint, not from %s", name,
                      c->config->restore_text);
        return EM_OK;
    }
    char line[1600];
    snprintf(line, sizeof(line), "seeding table '%s' (%zu of %zu) from %s", name, index, total,
             c->config->restore_text);
    if (progress != NULL)
        progress(context, line, false);
    load_progress reporter = {.progress = progress, .context = context, .table = name,
                              .index = index, .count = total, .last_ms = em_monotonic_ms()};
    bool cluster = manifests != NULL;
    em_checkpoint_load_options options = {.progress = report_load,
                                          .progress_context = &reporter,
                                          .manifest_xxh3 = manifests,
                                          .owner_index = cluster ? c->config->cluster_index : 0,
                                          .owner_count = cluster ? c->config->cluster_size : 0};
    em_checkpoint_info info;
    em_table *table = NULL;
    em_status status = em_checkpoint_load_sources(paths, count, em_catalog_backend(c->catalog),
                                                  name, &options, &table, &info, err);
    if (status == EM_OK)
        status = em_catalog_add(c->catalog, table, err);
    if (status != EM_OK)
        return em_error_prefix(err, "seed of table '%s' from %s: ", name,
                               c->config->restore_text);
    atomic_fetch_add(&c->stats->checkpoint_tables_restored, 1);
    atomic_fetch_add(&c->stats->checkpoint_rows_restored, info.table_rows);
    if (cluster)
        em_log_notice(c->log, "seeded table '%s' from cluster checkpoint %s as server %u of %u: "
                      "%" PRIu64 " rows from %zu parts in %.3f s", name, c->config->restore_text,
                      c->config->cluster_index, c->config->cluster_size, info.table_rows, count,
                      info.seconds);
    else
        em_log_notice(c->log, "seeded table '%s' from %s checkpoint %s: %" PRIu64
                      " rows in %.3f s", name, info.kind, paths[0], info.table_rows,
                      info.seconds);
    return EM_OK;
}

static em_status seed_cluster(em_checkpointer *c,
                              void (*progress)(void *context, const char *line, bool detail),
                              void *context, em_error *err)
{
    const char *dir = c->config->restore_text;
    if (c->config->cluster_size == 0)
        return em_error_set(err, EM_FAILED_PRECONDITION,
                            "checkpoint.restore: %s is a cluster checkpoint: set "
                            "checkpoint.cluster_index and checkpoint.cluster_size, this "
                            "server's place in its cluster's server list", dir);
    cJSON *record = NULL;
    em_status status = em_cluster_read(dir, &record, err);
    const cJSON *tables = status == EM_OK ? cJSON_GetObjectItemCaseSensitive(record, "tables")
                                          : NULL;
    size_t total = tables != NULL ? (size_t)cJSON_GetArraySize(tables) : 0, index = 0;
    const cJSON *entry = NULL;
    cJSON_ArrayForEach(entry, tables)
    {
        const char *name = cJSON_GetObjectItemCaseSensitive(entry, "name")->valuestring;
        char **paths = NULL;
        uint64_t *manifests = NULL;
        size_t count = 0;
        status = em_cluster_sources(record, dir, name, &paths, &manifests, &count, err);
        if (status == EM_OK)
            status = seed_table(c, name, (const char *const *)paths, count, manifests, progress,
                                context, ++index, total, err);
        em_cluster_free_sources(paths, manifests, count);
        if (status != EM_OK)
            break;
    }
    cJSON_Delete(record);
    return status;
}

em_status em_checkpointer_seed(em_checkpointer *c,
                               void (*progress)(void *context, const char *line, bool detail),
                               void *context, em_error *err)
{
    const char *dir = c->config->restore_text;
    char record[EM_CHECKPOINT_DIR_MAX + 32];
    snprintf(record, sizeof(record), "%s/%s", dir, EM_CLUSTER_FILE);
    if (access(record, F_OK) == 0)
        return seed_cluster(c, progress, context, err);
    char **names = NULL;
    size_t count = 0;
    em_status status = em_checkpoint_tables(dir, &names, &count, err);
    if (status == EM_OK && count == 0)
        status = em_error_set(err, EM_NOT_FOUND,
                              "checkpoint.restore: %s holds no table's checkpoint (nor a "
                              "cluster checkpoint)", dir);
    for (size_t i = 0; status == EM_OK && i < count; i++) {
        char path[4200];
        status = em_checkpoint_latest(dir, names[i], path, sizeof(path), err);
        const char *one[1] = {path};
        if (status == EM_OK)
            status = seed_table(c, names[i], one, 1, NULL, progress, context, i + 1, count, err);
    }
    em_checkpoint_free_names(names, count);
    return status;
}

em_status em_checkpointer_load(em_catalog *catalog, const char *dir, const em_load_spec *spec,
                               em_checkpoint_info *info, em_error *err)
{
    const char *table = spec->table, *path = spec->path;
    bool has_path = path != NULL && path[0] != '\0', owned = spec->server_count > 0;
    em_status status = EM_OK;
    if (has_path && spec->source_count > 0)
        status = em_error_set(err, EM_INVALID_ARGUMENT,
                              "give a path or the sources of a cluster checkpoint, not both");
    else if (spec->weights_only && (spec->source_count > 0 || owned || spec->shards > 0))
        status = em_error_set(err, EM_INVALID_ARGUMENT,
                              "weights_only loads one whole checkpoint into the existing "
                              "table's shape: not with sources, server_count or shards");
    if (status != EM_OK)
        return em_error_prefix(err, "load of table '%s': ", table);
    char latest[4200];
    if (!has_path && spec->source_count == 0) {
        if (dir == NULL)
            return em_error_set(err, EM_FAILED_PRECONDITION,
                                "load of table '%s': no path given, and this server has no "
                                "checkpoint dir", table);
        status = em_checkpoint_latest(dir, table, latest, sizeof(latest), err);
        path = latest;
    }
    em_table *loaded = NULL;
    if (status == EM_OK && spec->weights_only) {
        em_table *existing = NULL;
        status = em_catalog_acquire(catalog, table, &existing, err);
        if (status == EM_OK) {
            em_table_config config = *em_table_get_config(existing);
            em_catalog_release(catalog, existing);
            status = em_checkpoint_load_weights(path, em_catalog_backend(catalog), &config,
                                                &loaded, info, err);
        }
    } else if (status == EM_OK) {
        em_checkpoint_load_options options = {.shards = spec->shards,
                                              .owner_index = spec->server_index,
                                              .owner_count = spec->server_count,
                                              .manifest_xxh3 = spec->manifests};
        const char *one[1] = {path};
        status = em_checkpoint_load_sources(spec->source_count > 0 ? spec->sources : one,
                                            spec->source_count > 0 ? spec->source_count : 1,
                                            em_catalog_backend(catalog), table, &options,
                                            &loaded, info, err);
    }
    if (status == EM_OK)
        status = em_catalog_replace(catalog, loaded, err);
    if (status != EM_OK)
        return em_error_prefix(err, "load of table '%s': ", table);
    return EM_OK;
}
