#include "clients/client_top.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define BUCKETS_MAX 64

static double number(const cJSON *object, const char *name)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(object, name);
    return cJSON_IsNumber(item) ? item->valuedouble : 0.0;
}

static const char *text(const cJSON *object, const char *name)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(object, name);
    return cJSON_IsString(item) ? item->valuestring : "";
}

/* The element of array whose string field key is value, or NULL. */
static const cJSON *find_named(const cJSON *array, const char *key, const char *value)
{
    const cJSON *element;
    cJSON_ArrayForEach(element, array)
    {
        if (strcmp(text(element, key), value) == 0)
            return element;
    }
    return NULL;
}

/* How much a counter grew; a counter that went down was reset (a table dropped and
 * created again), so all of its value is new. */
static double growth(const cJSON *before, const cJSON *after, const char *name)
{
    double now = number(after, name), then = before != NULL ? number(before, name) : 0.0;
    return now >= then ? now - then : now;
}

double em_top_quantile(const double *bounds, const double *counts, size_t bound_count,
                       double q)
{
    double total = 0.0;
    for (size_t b = 0; b <= bound_count; b++)
        total += counts[b];
    if (total <= 0.0 || bound_count == 0)
        return 0.0;
    double rank = q * total, cumulative = 0.0;
    for (size_t b = 0; b < bound_count; b++) {
        if (counts[b] > 0.0 && cumulative + counts[b] >= rank) {
            double lower = b == 0 ? 0.0 : bounds[b - 1];
            double within = (rank - cumulative) / counts[b];
            return lower + (bounds[b] - lower) * (within > 0.0 ? within : 0.0);
        }
        cumulative += counts[b];
    }
    return bounds[bound_count - 1];
}

/* The interval's duration histogram of one method into counts; returns the bucket
 * count, 0 when the answers carry none. */
static size_t interval_histogram(const cJSON *bounds_json, const cJSON *before,
                                 const cJSON *after, double *bounds, double *counts)
{
    size_t bound_count = (size_t)cJSON_GetArraySize(bounds_json);
    const cJSON *now = cJSON_GetObjectItemCaseSensitive(after, "duration_buckets");
    const cJSON *then = before != NULL
                            ? cJSON_GetObjectItemCaseSensitive(before, "duration_buckets")
                            : NULL;
    if (bound_count == 0 || bound_count + 1 > BUCKETS_MAX ||
        (size_t)cJSON_GetArraySize(now) != bound_count + 1)
        return 0;
    bool reset = false;
    for (size_t b = 0; b <= bound_count; b++) {
        double value = cJSON_GetArrayItem(now, (int)b)->valuedouble;
        const cJSON *old = then != NULL ? cJSON_GetArrayItem(then, (int)b) : NULL;
        double earlier = cJSON_IsNumber(old) ? old->valuedouble : 0.0;
        reset |= value < earlier;
        counts[b] = value - earlier;
        if (b < bound_count)
            bounds[b] = cJSON_GetArrayItem(bounds_json, (int)b)->valuedouble;
    }
    if (reset)
        for (size_t b = 0; b <= bound_count; b++)
            counts[b] = cJSON_GetArrayItem(now, (int)b)->valuedouble;
    return bound_count;
}

static cJSON *method_view(const cJSON *server_after, const cJSON *before, const cJSON *after,
                          double seconds)
{
    double requests = growth(before, after, "requests");
    if (requests <= 0.0)
        return NULL;
    cJSON *view = cJSON_CreateObject();
    cJSON_AddStringToObject(view, "method", text(after, "method"));
    cJSON_AddNumberToObject(view, "requests_per_second", requests / seconds);
    cJSON_AddNumberToObject(view, "errors_per_second", growth(before, after, "errors") / seconds);
    double bounds[BUCKETS_MAX], counts[BUCKETS_MAX];
    size_t bound_count = interval_histogram(
        cJSON_GetObjectItemCaseSensitive(server_after, "duration_bounds_seconds"), before, after,
        bounds, counts);
    static const struct {
        const char *name;
        double q;
    } quantiles[] = {{"p50_seconds", 0.5}, {"p90_seconds", 0.9}, {"p99_seconds", 0.99}};
    for (size_t i = 0; i < 3; i++)
        cJSON_AddNumberToObject(view, quantiles[i].name,
                                em_top_quantile(bounds, counts, bound_count, quantiles[i].q));
    return view;
}

static cJSON *server_view(const cJSON *before, const cJSON *after, double seconds)
{
    cJSON *view = cJSON_CreateObject();
    static const char *const texts[] = {"version", "state", "backend"};
    for (size_t i = 0; i < 3; i++)
        cJSON_AddStringToObject(view, texts[i], text(after, texts[i]));
    static const char *const gauges[] = {"uptime_ms", "connections_current", "work_queued",
                                         "memory_used_bytes", "memory_limit_bytes"};
    for (size_t i = 0; i < 5; i++)
        cJSON_AddNumberToObject(view, gauges[i], number(after, gauges[i]));
    static const struct {
        const char *view, *counter;
    } rates[] = {{"connections_per_second", "connections_total"},
                 {"rejected_per_second", "connections_rejected"},
                 {"bytes_in_per_second", "bytes_in"},
                 {"bytes_out_per_second", "bytes_out"}};
    for (size_t i = 0; i < 4; i++)
        cJSON_AddNumberToObject(view, rates[i].view,
                                growth(before, after, rates[i].counter) / seconds);
    return view;
}

static double table_activity(const cJSON *table)
{
    return number(table, "keys_pulled_per_second") + number(table, "keys_pushed_per_second");
}

static int busiest_first(const void *a, const void *b)
{
    const cJSON *x = *(const cJSON *const *)a, *y = *(const cJSON *const *)b;
    double ax = table_activity(x), ay = table_activity(y);
    if (ax != ay)
        return ax > ay ? -1 : 1;
    return strcmp(text(x, "name"), text(y, "name"));
}

static cJSON *tables_view(const cJSON *before, const cJSON *after, double seconds)
{
    int count = cJSON_GetArraySize(after);
    cJSON **views = calloc((size_t)count + 1, sizeof(*views));
    cJSON *array = cJSON_CreateArray();
    if (views == NULL || array == NULL) {
        free(views);
        cJSON_Delete(array);
        return NULL;
    }
    static const struct {
        const char *view, *counter;
    } rates[] = {{"pulls_per_second", "pulls"},
                 {"pushes_per_second", "pushes"},
                 {"keys_pulled_per_second", "keys_pulled"},
                 {"keys_pushed_per_second", "keys_pushed"},
                 {"rows_created_per_second", "rows_created"}};
    int n = 0;
    const cJSON *table;
    cJSON_ArrayForEach(table, after)
    {
        const cJSON *earlier = find_named(before, "name", text(table, "name"));
        cJSON *view = cJSON_CreateObject();
        cJSON_AddStringToObject(view, "name", text(table, "name"));
        cJSON_AddNumberToObject(view, "rows", number(table, "rows"));
        cJSON_AddNumberToObject(view, "capacity", number(table, "capacity"));
        for (size_t i = 0; i < 5; i++)
            cJSON_AddNumberToObject(view, rates[i].view,
                                    growth(earlier, table, rates[i].counter) / seconds);
        views[n++] = view;
    }
    qsort(views, (size_t)n, sizeof(*views), busiest_first);
    for (int i = 0; i < n; i++)
        cJSON_AddItemToArray(array, views[i]);
    free(views);
    return array;
}

static cJSON *pools_view(const cJSON *after)
{
    cJSON *array = cJSON_CreateArray();
    static const char *const fields[] = {"bytes_in_use",      "bytes_reserved",
                                         "bytes_limit",       "peak_bytes_in_use",
                                         "largest_free_block", "fragmentation"};
    const cJSON *pool;
    cJSON_ArrayForEach(pool, after)
    {
        cJSON *view = cJSON_CreateObject();
        cJSON_AddStringToObject(view, "device", text(pool, "device"));
        for (size_t i = 0; i < 6; i++)
            cJSON_AddNumberToObject(view, fields[i], number(pool, fields[i]));
        cJSON_AddItemToArray(array, view);
    }
    return array;
}

cJSON *em_top_view(const cJSON *before, const cJSON *after, double wall_seconds)
{
    const cJSON *server_after = cJSON_GetObjectItemCaseSensitive(after, "server");
    const cJSON *server_before =
        before != NULL ? cJSON_GetObjectItemCaseSensitive(before, "server") : NULL;
    double uptime_before = number(server_before, "uptime_ms");
    double uptime_after = number(server_after, "uptime_ms");
    if (server_before != NULL && uptime_after < uptime_before) {
        before = NULL; /* the server restarted: everything it counted is new */
        server_before = NULL;
        uptime_before = 0.0;
    }
    double seconds = (uptime_after - uptime_before) / 1000.0;
    if (seconds <= 0.0)
        seconds = wall_seconds > 0.0 ? wall_seconds : 1.0;

    cJSON *view = cJSON_CreateObject();
    if (view == NULL)
        return NULL;
    cJSON_AddNumberToObject(view, "seconds", seconds);
    cJSON_AddItemToObject(view, "server", server_view(server_before, server_after, seconds));
    cJSON *methods = cJSON_AddArrayToObject(view, "methods");
    const cJSON *method;
    cJSON_ArrayForEach(method, cJSON_GetObjectItemCaseSensitive(server_after, "methods"))
    {
        const cJSON *earlier = find_named(
            cJSON_GetObjectItemCaseSensitive(server_before, "methods"), "method",
            text(method, "method"));
        cJSON *row = method_view(server_after, earlier, method, seconds);
        if (row != NULL)
            cJSON_AddItemToArray(methods, row);
    }
    cJSON *tables = tables_view(
        before != NULL ? cJSON_GetObjectItemCaseSensitive(before, "tables") : NULL,
        cJSON_GetObjectItemCaseSensitive(after, "tables"), seconds);
    if (tables == NULL) {
        cJSON_Delete(view);
        return NULL;
    }
    cJSON_AddItemToObject(view, "tables", tables);
    cJSON_AddItemToObject(view, "pools",
                          pools_view(cJSON_GetObjectItemCaseSensitive(after, "pools")));
    return view;
}
