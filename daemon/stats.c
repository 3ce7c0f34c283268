#include "daemon/stats.h"

#include <stdlib.h>
#include <string.h>

/* ---- the schema ---------------------------------------------------------------------- */

const uint64_t em_duration_bounds_ns[EM_DURATION_BUCKETS] = {
    50000,      100000,     250000,     500000,      1000000,    2500000,
    5000000,    10000000,   25000000,   50000000,    100000000,  250000000,
    500000000,  1000000000, 2500000000, 5000000000u, 10000000000u,
};

/* X(name, kind, unit, help): the server's descriptive numbers, set by the caller of
 * em_stats_collect. */
#define SERVER_INFO(X)                                                                        \
    X(version, INFO, NONE, "ember version")                                                   \
    X(state, INFO, NONE, "starting, serving, draining or failed (a GPU failed)")              \
    X(backend, INFO, NONE, "cpu or cuda")                                                     \
    X(exchange, INFO, NONE, "how devices exchange keys: host-staged or nccl")                 \
    X(exchange_fallback, GAUGE, NONE,                                                         \
      "1 when NCCL could not initialise and several GPUs exchange through host memory")       \
    X(pinned_buffer_bytes_in_use, GAUGE, BYTES,                                               \
      "pinned host memory holding requests and answers now")                                  \
    X(pinned_buffer_bytes_limit, GAUGE, BYTES,                                                \
      "most pinned host memory for requests and answers (0: none)")                           \
    X(pinned_buffers_full, COUNTER, NONE,                                                     \
      "request or answer buffers that found the pinned memory full (their copies staged)")    \
    X(bytes_copied_directly, COUNTER, BYTES,                                                  \
      "host <-> GPU copies of pinned request and answer buffers, by DMA")                     \
    X(bytes_copied_staged, COUNTER, BYTES,                                                    \
      "host <-> GPU copies of other host memory, through the lanes' staging")                 \
    X(device_waits, COUNTER, NONE,                                                            \
      "times requests waited for work enqueued on a GPU to finish (0 on the cpu backend)")    \
    X(device_wait_ms, COUNTER, MILLISECONDS, "the time those waits took")                     \
    X(uptime_ms, GAUGE, MILLISECONDS, "time since start")

#define SCHEMA_ROW(scope_, name_, kind_, unit_, help_)                                         \
    {.name = #name_, .kind = EM_STAT_##kind_, .unit = EM_STAT_##unit_, .scope = (scope_),      \
     .help = (help_)},
#define SERVER_ROW(name, kind, unit, help) SCHEMA_ROW(EM_STAT_SERVER, name, kind, unit, help)
#define METHOD_ROW(name, kind, unit, help) SCHEMA_ROW(EM_STAT_METHOD, name, kind, unit, help)
#define TABLE_ROW(type, name, kind, unit, help) SCHEMA_ROW(EM_STAT_TABLE, name, kind, unit, help)
#define POOL_ROW(type, name, kind, unit, help) SCHEMA_ROW(EM_STAT_POOL, name, kind, unit, help)

enum {
#define COUNT_SERVER(name, kind, unit, help) SERVER_STAT_##name,
    SERVER_INFO(COUNT_SERVER) EM_SERVER_COUNTERS(COUNT_SERVER)
#undef COUNT_SERVER
    SERVER_STATS
};
enum {
#define COUNT_METHOD(name, kind, unit, help) METHOD_STAT_##name,
    EM_METHOD_COUNTERS(COUNT_METHOD)
#undef COUNT_METHOD
    METHOD_STATS
};
enum {
#define COUNT_TABLE(type, name, kind, unit, help) TABLE_STAT_##name,
    EM_TABLE_STATS(COUNT_TABLE)
#undef COUNT_TABLE
    TABLE_STATS
};

static const em_stat schema[] = {
    SERVER_INFO(SERVER_ROW) EM_SERVER_COUNTERS(SERVER_ROW)
    EM_METHOD_COUNTERS(METHOD_ROW)
    EM_TABLE_STATS(TABLE_ROW)
    EM_POOL_STATS(POOL_ROW)
};

#define SCHEMA_COUNT (sizeof(schema) / sizeof(schema[0]))

/* Where each scope starts in schema. */
#define METHOD_SCHEMA (schema + SERVER_STATS)
#define TABLE_SCHEMA (METHOD_SCHEMA + METHOD_STATS)
#define POOL_SCHEMA (TABLE_SCHEMA + TABLE_STATS)

const em_stat *em_stats_schema(size_t *count)
{
    *count = SCHEMA_COUNT;
    return schema;
}

/* ---- visiting ------------------------------------------------------------------------ */

static em_stat_value u64_value(uint64_t value)
{
    return (em_stat_value){.type = EM_STAT_VALUE_U64, .u64 = value};
}

static em_stat_value double_value(double value)
{
    return (em_stat_value){.type = EM_STAT_VALUE_DOUBLE, .f64 = value};
}

static em_stat_value text_value(const char *value)
{
    return (em_stat_value){.type = EM_STAT_VALUE_TEXT, .text = value != NULL ? value : ""};
}

#define STAT_VALUE(x)                                                                          \
    _Generic((x), double: double_value, const char *: text_value, default: u64_value)(x)

static void visit_server(const em_stats_snapshot *snapshot, em_stats_visitor visitor,
                         void *context)
{
    const em_stat *stat = schema;
#define VISIT_SERVER(field, kind, unit, help)                                                  \
    visitor(context, stat++, 0, NULL, STAT_VALUE(snapshot->field));
    SERVER_INFO(VISIT_SERVER)
    EM_SERVER_COUNTERS(VISIT_SERVER)
#undef VISIT_SERVER
}

static void visit_method(const em_method_snapshot *method, size_t index, em_stats_visitor visitor,
                         void *context)
{
    const em_stat *stat = METHOD_SCHEMA;
    const char *label = method->name;
#define VISIT_METHOD(field, kind, unit, help)                                                  \
    visitor(context, stat++, index, label, STAT_VALUE(method->field));
    EM_METHOD_COUNTERS(VISIT_METHOD)
#undef VISIT_METHOD
}

static void visit_table(const em_table_stats_snapshot *table, size_t index, em_stats_visitor visitor,
                        void *context)
{
    const em_stat *stat = TABLE_SCHEMA;
    const char *label = table->name;
#define VISIT_TABLE(type, field, kind, unit, help)                                             \
    visitor(context, stat++, index, label, STAT_VALUE(table->stats.field));
    EM_TABLE_STATS(VISIT_TABLE)
#undef VISIT_TABLE
}

static void visit_pool(const em_pool_snapshot *pool, size_t index, em_stats_visitor visitor,
                       void *context)
{
    const em_stat *stat = POOL_SCHEMA;
    const char *label = pool->device;
#define VISIT_POOL(type, field, kind, unit, help)                                              \
    visitor(context, stat++, index, label, STAT_VALUE(pool->stats.field));
    EM_POOL_STATS(VISIT_POOL)
#undef VISIT_POOL
}

void em_stats_visit(const em_stats_snapshot *snapshot, em_stats_visitor visitor, void *context)
{
    visit_server(snapshot, visitor, context);
    for (size_t i = 0; i < snapshot->method_count; i++)
        visit_method(&snapshot->methods[i], i, visitor, context);
    for (size_t i = 0; i < snapshot->table_count; i++)
        visit_table(&snapshot->tables[i], i, visitor, context);
    for (size_t i = 0; i < snapshot->pool_count; i++)
        visit_pool(&snapshot->pools[i], i, visitor, context);
}

/* ---- recording ---------------------------------------------------------------------- */

/* One writer: a relaxed load and store, no locked instruction. */
static void bump(_Atomic uint64_t *counter, uint64_t amount)
{
    atomic_store_explicit(counter, atomic_load_explicit(counter, memory_order_relaxed) + amount,
                          memory_order_relaxed);
}

void em_stats_record_response(em_server_stats *stats, size_t method, em_status status,
                              uint64_t duration_ns, bool details)
{
    bump(&stats->requests[method], 1);
    if (status != EM_OK)
        bump(&stats->errors[method], 1);
    if (!details)
        return;
    size_t bucket = 0;
    while (bucket < EM_DURATION_BUCKETS && duration_ns > em_duration_bounds_ns[bucket])
        bucket++;
    if ((unsigned)status < EM_STATUS_COUNT)
        bump(&stats->answers[method][status], 1);
    bump(&stats->duration_buckets[method][bucket], 1);
    bump(&stats->duration_sum_ns[method], duration_ns);
}

/* ---- collecting ---------------------------------------------------------------------- */

static void collect_counters(const em_server_stats *counters, em_stats_snapshot *snapshot)
{
#define LOAD_SERVER_COUNTER(field, kind, unit, help)                                              \
    snapshot->field = atomic_load(&counters->field);
    EM_SERVER_COUNTERS(LOAD_SERVER_COUNTER)
#undef LOAD_SERVER_COUNTER
    snapshot->method_count = EM_METHOD_COUNT;
    for (size_t i = 0; i < EM_METHOD_COUNT; i++) {
        snapshot->methods[i].name = em_methods[i].name;
#define LOAD_METHOD_COUNTER(field, kind, unit, help)                                              \
    snapshot->methods[i].field = atomic_load(&counters->field[i]);
        EM_METHOD_COUNTERS(LOAD_METHOD_COUNTER)
#undef LOAD_METHOD_COUNTER
        for (size_t s = 0; s < EM_STATUS_COUNT; s++)
            snapshot->methods[i].answers[s] = atomic_load(&counters->answers[i][s]);
        for (size_t b = 0; b <= EM_DURATION_BUCKETS; b++)
            snapshot->methods[i].duration_buckets[b] =
                atomic_load(&counters->duration_buckets[i][b]);
        snapshot->methods[i].duration_sum_ns = atomic_load(&counters->duration_sum_ns[i]);
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
    snapshot->exchange = backend->exchange->name;
    snapshot->exchange_fallback = backend->exchange_fallback[0] != '\0';
    em_host_buffers_stats buffers;
    em_host_buffers_get_stats(backend->host_buffers, &buffers);
    snapshot->pinned_buffer_bytes_in_use = buffers.pinned_bytes_in_use;
    snapshot->pinned_buffer_bytes_limit = buffers.pinned_bytes_limit;
    snapshot->pinned_buffers_full = buffers.unpinned_allocations;
    snapshot->bytes_copied_directly = buffers.bytes_copied_directly;
    snapshot->bytes_copied_staged = buffers.bytes_copied_staged;
    uint64_t wait_ns = 0;
    for (uint32_t d = 0; d < backend->device_count; d++) {
        em_device *device = backend->devices[d];
        snapshot->device_waits += atomic_load_explicit(&device->waits, memory_order_relaxed);
        wait_ns += atomic_load_explicit(&device->wait_ns, memory_order_relaxed);
    }
    snapshot->device_wait_ms = wait_ns / 1000000u;
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
