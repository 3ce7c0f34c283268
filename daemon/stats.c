#include "daemon/stats.h"

#include <stdlib.h>
#include <string.h>

#include "daemon/dispatch.h"

static void collect_counters(const em_server_stats *counters, em_stats_snapshot *snapshot)
{
    snapshot->connections_current = atomic_load(&counters->connections_current);
    snapshot->connections_total = atomic_load(&counters->connections_total);
    snapshot->connections_rejected = atomic_load(&counters->connections_rejected);
    snapshot->bytes_in = atomic_load(&counters->bytes_in);
    snapshot->bytes_out = atomic_load(&counters->bytes_out);
    snapshot->frames_rejected = atomic_load(&counters->frames_rejected);
    snapshot->method_count = em_dispatch_method_count();
    for (size_t i = 0; i < snapshot->method_count; i++) {
        snapshot->methods[i].name = em_dispatch_method_name(i);
        snapshot->methods[i].requests = atomic_load(&counters->requests[i]);
        snapshot->methods[i].errors = atomic_load(&counters->errors[i]);
    }
}

static em_status collect_tables(em_catalog *catalog, const char *filter,
                                em_stats_snapshot *snapshot, em_error *err)
{
    em_table **tables = NULL;
    size_t count = 0;
    if (filter != NULL && filter[0] != '\0') {
        tables = malloc(sizeof(*tables));
        if (tables == NULL)
            return em_error_set(err, EM_RESOURCE_EXHAUSTED, "stats: out of memory");
        em_status status = em_catalog_acquire(catalog, filter, &tables[0], err);
        if (status != EM_OK) {
            free(tables);
            return status;
        }
        count = 1;
    } else {
        em_status status = em_catalog_list(catalog, &tables, &count, err);
        if (status != EM_OK)
            return status;
    }
    snapshot->tables = calloc(count + 1, sizeof(*snapshot->tables));
    for (size_t i = 0; i < count; i++) {
        if (snapshot->tables != NULL) {
            snprintf(snapshot->tables[i].name, sizeof(snapshot->tables[i].name), "%s",
                     em_table_name(tables[i]));
            em_table_get_stats(tables[i], &snapshot->tables[i].stats);
        }
        em_catalog_release(catalog, tables[i]);
    }
    free(tables);
    if (snapshot->tables == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "stats: out of memory");
    snapshot->table_count = count;
    return EM_OK;
}

static em_status collect_pools(const em_backend *backend, em_stats_snapshot *snapshot,
                               em_error *err)
{
    snapshot->pools = calloc(backend->device_count + 1, sizeof(*snapshot->pools));
    if (snapshot->pools == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "stats: out of memory");
    for (uint32_t d = 0; d < backend->device_count; d++) {
        snprintf(snapshot->pools[d].device, sizeof(snapshot->pools[d].device), "%s",
                 backend->devices[d]->name);
        em_pool_get_stats(backend->devices[d]->pool, &snapshot->pools[d].stats);
    }
    snapshot->pool_count = backend->device_count;
    return EM_OK;
}

em_status em_stats_collect(const em_server_stats *counters, em_catalog *catalog,
                           const char *table_filter, em_stats_snapshot *snapshot, em_error *err)
{
    memset(snapshot, 0, sizeof(*snapshot));
    em_backend *backend = em_catalog_backend(catalog);
    snapshot->backend = backend->kind;
    collect_counters(counters, snapshot);
    em_status status = collect_tables(catalog, table_filter, snapshot, err);
    if (status == EM_OK)
        status = collect_pools(backend, snapshot, err);
    if (status != EM_OK)
        em_stats_snapshot_free(snapshot);
    return status;
}

void em_stats_snapshot_free(em_stats_snapshot *snapshot)
{
    free(snapshot->tables);
    free(snapshot->pools);
    snapshot->tables = NULL;
    snapshot->pools = NULL;
}
