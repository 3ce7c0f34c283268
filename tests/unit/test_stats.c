/*
 * The stats schema (daemon/stats.h) against the STATS answer: every number declared
 * once reaches the wire under its own name, every number on the wire is declared, and
 * the values that arrive are the ones the visitor gives.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/stats.h"
#include "lib/device/backend.h"
#include "lib/table/catalog.h"
#include "tests/support/test_support.h"

static const ProtobufCMessageDescriptor *scope_message(em_stat_scope scope)
{
    switch (scope) {
    case EM_STAT_SERVER:
        return &ember__server_stats__descriptor;
    case EM_STAT_METHOD:
        return &ember__method_stats__descriptor;
    case EM_STAT_TABLE:
        return &ember__table_stats__descriptor;
    case EM_STAT_POOL:
        return &ember__pool_stats__descriptor;
    }
    return NULL;
}

/* Fields of the stats messages that are not numbers of the schema: the labels, the
 * server's list of methods, and the duration histograms with their bounds and the
 * answers by status (rendered from the method snapshots directly). */
static bool is_label(const ProtobufCMessageDescriptor *message, const char *field)
{
    if (message == &ember__server_stats__descriptor)
        return strcmp(field, "methods") == 0 || strcmp(field, "duration_bounds_seconds") == 0;
    if (message == &ember__method_stats__descriptor)
        return strcmp(field, "method") == 0 || strcmp(field, "answers") == 0 ||
               strcmp(field, "duration_buckets") == 0 ||
               strcmp(field, "duration_sum_seconds") == 0;
    if (message == &ember__table_stats__descriptor)
        return strcmp(field, "name") == 0;
    return strcmp(field, "device") == 0;
}

START_TEST(every_stat_has_its_field_and_every_field_its_stat)
{
    size_t count = 0;
    const em_stat *schema = em_stats_schema(&count);
    ck_assert_uint_gt(count, 30);
    for (size_t i = 0; i < count; i++) {
        const ProtobufCMessageDescriptor *message = scope_message(schema[i].scope);
        ck_assert_msg(protobuf_c_message_descriptor_get_field_by_name(message, schema[i].name),
                      "stat '%s' has no field in %s", schema[i].name, message->name);
        ck_assert_msg(schema[i].help != NULL && schema[i].help[0] != '\0', "%s has no help",
                      schema[i].name);
        for (size_t j = 0; j < i; j++)
            ck_assert_msg(schema[j].scope != schema[i].scope ||
                              strcmp(schema[j].name, schema[i].name) != 0,
                          "stat '%s' is declared twice", schema[i].name);
    }
    const em_stat_scope scopes[] = {EM_STAT_SERVER, EM_STAT_METHOD, EM_STAT_TABLE, EM_STAT_POOL};
    for (size_t s = 0; s < 4; s++) {
        const ProtobufCMessageDescriptor *message = scope_message(scopes[s]);
        for (unsigned f = 0; f < message->n_fields; f++) {
            const char *name = message->fields[f].name;
            bool declared = is_label(message, name);
            for (size_t i = 0; i < count && !declared; i++)
                declared = schema[i].scope == scopes[s] && strcmp(schema[i].name, name) == 0;
            ck_assert_msg(declared, "%s.%s is on the wire but not in the stats schema",
                          message->name, name);
        }
    }
}
END_TEST

/* ---- rendering a snapshot ----------------------------------------------------------- */

typedef struct visit {
    const em_stat *stat;
    size_t index;
    char label[64];
    em_stat_value value;
} visit;

typedef struct visits {
    visit items[256];
    size_t count;
} visits;

static void record(void *context, const em_stat *stat, size_t index, const char *label,
                   em_stat_value value)
{
    visits *v = context;
    ck_assert_uint_lt(v->count, 256);
    visit *item = &v->items[v->count++];
    item->stat = stat;
    item->index = index;
    snprintf(item->label, sizeof(item->label), "%s", label != NULL ? label : "");
    item->value = value;
}

static const ProtobufCMessage *visited_message(const Ember__StatsResponse *response,
                                               const visit *item)
{
    switch (item->stat->scope) {
    case EM_STAT_SERVER:
        return &response->server->base;
    case EM_STAT_METHOD:
        ck_assert_str_eq(response->server->methods[item->index]->method, item->label);
        return &response->server->methods[item->index]->base;
    case EM_STAT_TABLE:
        ck_assert_str_eq(response->tables[item->index]->name, item->label);
        return &response->tables[item->index]->base;
    case EM_STAT_POOL:
        ck_assert_str_eq(response->pools[item->index]->device, item->label);
        return &response->pools[item->index]->base;
    }
    return NULL;
}

static void assert_field_is(const ProtobufCMessage *message, const visit *item)
{
    const ProtobufCFieldDescriptor *field =
        protobuf_c_message_descriptor_get_field_by_name(message->descriptor, item->stat->name);
    const void *at = (const char *)message + field->offset;
    if (field->type == PROTOBUF_C_TYPE_UINT64)
        ck_assert_uint_eq(*(const uint64_t *)at, item->value.u64);
    else if (field->type == PROTOBUF_C_TYPE_UINT32)
        ck_assert_uint_eq(*(const uint32_t *)at, item->value.u64);
    else if (field->type == PROTOBUF_C_TYPE_DOUBLE)
        ck_assert_double_eq(*(const double *)at, item->value.f64);
    else if (field->type == PROTOBUF_C_TYPE_STRING)
        ck_assert_str_eq(*(char *const *)at, item->value.text);
    else
        ck_abort_msg("%s has an unexpected wire type %d", item->stat->name, (int)field->type);
}

/* A snapshot in which every number differs from every other. */
static void fill_snapshot(em_stats_snapshot *s, em_table_stats_snapshot *tables, em_pool_snapshot *pools)
{
    memset(s, 0, sizeof(*s));
    uint64_t next = 1000;
    s->version = "9.9.9";
    s->state = "serving";
    s->backend = "cpu";
    s->uptime_ms = next++;
#define FILL_SERVER(field, kind, unit, help) s->field = next++;
    EM_SERVER_COUNTERS(FILL_SERVER)
#undef FILL_SERVER
    s->method_count = EM_METHOD_COUNT;
    for (size_t m = 0; m < EM_METHOD_COUNT; m++) {
        s->methods[m].name = em_methods[m].name;
#define FILL_METHOD(field, kind, unit, help) s->methods[m].field = next++;
        EM_METHOD_COUNTERS(FILL_METHOD)
#undef FILL_METHOD
    }
    for (size_t t = 0; t < 2; t++) {
        snprintf(tables[t].name, sizeof(tables[t].name), "table%zu", t);
#define FILL_TABLE(type, field, kind, unit, help) tables[t].stats.field = (type)(next++);
        EM_TABLE_STATS(FILL_TABLE)
#undef FILL_TABLE
    }
    for (size_t p = 0; p < 3; p++) {
        snprintf(pools[p].device, sizeof(pools[p].device), "cpu%zu", p);
#define FILL_POOL(type, field, kind, unit, help) pools[p].stats.field = (type)(next++);
        EM_POOL_STATS(FILL_POOL)
#undef FILL_POOL
        pools[p].stats.fragmentation = 0.25 * (double)p + 0.125;
    }
    s->tables = tables;
    s->table_count = 2;
    s->pools = pools;
    s->pool_count = 3;
}

START_TEST(the_answer_carries_every_visited_value)
{
    em_stats_snapshot snapshot;
    em_table_stats_snapshot tables[2];
    em_pool_snapshot pools[3];
    fill_snapshot(&snapshot, tables, pools);
    static visits seen;
    seen.count = 0;
    em_stats_visit(&snapshot, record, &seen);
    size_t schema_count = 0;
    em_stats_schema(&schema_count);
    /* server numbers once, method numbers per method, and so on: every declared stat */
    size_t expected = 0;
    const em_stat *schema = em_stats_schema(&schema_count);
    for (size_t i = 0; i < schema_count; i++)
        expected += schema[i].scope == EM_STAT_SERVER   ? 1
                    : schema[i].scope == EM_STAT_METHOD ? EM_METHOD_COUNT
                    : schema[i].scope == EM_STAT_TABLE  ? 2
                                                        : 3;
    ck_assert_uint_eq(seen.count, expected);

    uint8_t *bytes = NULL;
    size_t length = 0;
    em_error err;
    ck_assert_msg(em_stats_render_response(&snapshot, &bytes, &length, &err) == EM_OK, "%s",
                  err.message);
    Ember__StatsResponse *response = ember__stats_response__unpack(NULL, length, bytes);
    ck_assert_ptr_nonnull(response);
    ck_assert_uint_eq(response->server->n_methods, EM_METHOD_COUNT);
    ck_assert_uint_eq(response->n_tables, 2);
    ck_assert_uint_eq(response->n_pools, 3);
    for (size_t i = 0; i < seen.count; i++)
        assert_field_is(visited_message(response, &seen.items[i]), &seen.items[i]);
    ember__stats_response__free_unpacked(response, NULL);
    free(bytes);
}
END_TEST

/* A real table's numbers, collected, reach the answer equal to the engine's. */
START_TEST(collected_numbers_are_the_engines)
{
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.pool_limit_bytes = UINT64_C(64) << 20;
    options.pool_initial_bytes = UINT64_C(8) << 20;
    em_backend *backend = NULL;
    em_catalog *catalog = NULL;
    em_error err;
    ck_assert_int_eq(em_backend_create_cpu(&options, &backend, &err), EM_OK);
    ck_assert_int_eq(em_catalog_create(backend, &catalog, &err), EM_OK);
    em_table_config config;
    ck_assert_int_eq(em_table_config_parse_text("{\"name\":\"clicks\",\"dim\":4,\"capacity\":100,"
                                                "\"optimizer\":{\"type\":\"adam\"}}",
                                                &config, &err),
                     EM_OK);
    em_table *table = NULL;
    ck_assert_int_eq(em_catalog_create_table(catalog, &config, &table, &err), EM_OK);
    const uint32_t offsets[] = {0, 3};
    const uint64_t keys[] = {5, 6, 7};
    float gradients[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    em_push_request push = {.batch = {1, 3, offsets, keys}, .combiner = EM_COMBINER_NONE,
                            .gradients = gradients, .gradient_count = 12};
    em_push_result pushed;
    ck_assert_int_eq(em_table_push(table, &push, &pushed, &err), EM_OK);
    em_table_stats engine;
    em_table_get_stats(table, &engine);
    em_catalog_release(catalog, table);

    em_server_stats counters;
    memset(&counters, 0, sizeof(counters));
    atomic_store(&counters.bytes_in, 4242);
    em_stats_snapshot snapshot;
    ck_assert_int_eq(em_stats_collect(&counters, catalog, "clicks", &snapshot, &err), EM_OK);
    snapshot.version = "1";
    snapshot.state = "serving";
    uint8_t *bytes = NULL;
    size_t length = 0;
    ck_assert_int_eq(em_stats_render_response(&snapshot, &bytes, &length, &err), EM_OK);
    Ember__StatsResponse *response = ember__stats_response__unpack(NULL, length, bytes);
    ck_assert_ptr_nonnull(response);
    ck_assert_uint_eq(response->server->bytes_in, 4242);
    /* the cpu backend does a request's work as it is asked: nothing to wait for */
    ck_assert_uint_eq(response->server->device_waits, 0);
    ck_assert_uint_eq(response->server->device_wait_ms, 0);
    ck_assert_uint_eq(response->n_tables, 1);
    const Ember__TableStats *wire = response->tables[0];
    ck_assert_str_eq(wire->name, "clicks");
    ck_assert_uint_eq(wire->rows, 3);
    ck_assert_uint_eq(wire->row_floats, engine.row_floats);
    ck_assert_uint_eq(wire->row_floats, 4 + 2 * 4 + 1);
    ck_assert_uint_eq(wire->keys_pushed, 3);
    ck_assert_uint_eq(wire->rows_created, 3);
    ck_assert_uint_eq(wire->pushes, 1);
    ck_assert_uint_eq(wire->imports, engine.imports);
    ck_assert_uint_eq(wire->row_bytes, engine.row_bytes);
    ck_assert_uint_eq(response->n_pools, 1);
    em_pool_stats pool;
    em_pool_get_stats(backend->devices[0]->pool, &pool);
    ck_assert_uint_eq(response->pools[0]->total_allocations, pool.total_allocations);
    ck_assert_uint_eq(response->pools[0]->region_count, pool.region_count);
    ck_assert_uint_eq(response->pools[0]->bytes_free, pool.bytes_free);
    ck_assert_uint_gt(response->pools[0]->total_allocations, 0);
    ember__stats_response__free_unpacked(response, NULL);
    free(bytes);
    em_stats_snapshot_free(&snapshot);
    em_catalog_destroy(catalog);
    em_backend_destroy(backend);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("stats");
    TCase *tc = tcase_create("schema");
    tcase_add_test(tc, every_stat_has_its_field_and_every_field_its_stat);
    tcase_add_test(tc, the_answer_carries_every_visited_value);
    tcase_add_test(tc, collected_numbers_are_the_engines);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
