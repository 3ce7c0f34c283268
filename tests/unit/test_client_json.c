#include <string.h>

#include "clients/client_json.h"
#include "tests/support/test_support.h"

static double number(const cJSON *object, const char *name)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(object, name);
    ck_assert_msg(cJSON_IsNumber(item), "%s is not a number", name);
    return item->valuedouble;
}

static const char *string(const cJSON *object, const char *name)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(object, name);
    ck_assert_msg(cJSON_IsString(item), "%s is not a string", name);
    return item->valuestring;
}

START_TEST(table_info_has_the_parsed_config)
{
    Ember__TableInfo info = EMBER__TABLE_INFO__INIT;
    info.name = "clicks";
    info.dim = 64;
    info.capacity = UINT64_C(10000000);
    info.shards = 8;
    info.optimizer = "adagrad";
    info.rows = 1234;
    info.config_json = "{\"name\":\"clicks\",\"dim\":64,\"optimizer\":{\"type\":\"adagrad\"}}";
    cJSON *json = em__client_json_table_info(&info);
    ck_assert_ptr_nonnull(json);
    ck_assert_int_eq(cJSON_GetArraySize(json), 7);
    ck_assert_str_eq(string(json, "name"), "clicks");
    ck_assert_double_eq(number(json, "dim"), 64);
    ck_assert_double_eq(number(json, "capacity"), 1e7);
    ck_assert_double_eq(number(json, "shards"), 8);
    ck_assert_str_eq(string(json, "optimizer"), "adagrad");
    ck_assert_double_eq(number(json, "rows"), 1234);
    const cJSON *config = cJSON_GetObjectItemCaseSensitive(json, "config");
    ck_assert(cJSON_IsObject(config));
    ck_assert_str_eq(string(cJSON_GetObjectItemCaseSensitive(config, "optimizer"), "type"),
                     "adagrad");
    cJSON_Delete(json);

    info.config_json = "not json";
    json = em__client_json_table_info(&info);
    ck_assert_str_eq(string(json, "config"), "not json");
    cJSON_Delete(json);
    info.config_json = "";
    json = em__client_json_table_info(&info);
    ck_assert(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(json, "config")));
    cJSON_Delete(json);
}
END_TEST

START_TEST(stats_follow_the_proto_field_names)
{
    Ember__MethodStats pull = EMBER__METHOD_STATS__INIT, push = EMBER__METHOD_STATS__INIT;
    pull.method = "PULL";
    pull.requests = 100;
    pull.errors = 2;
    push.method = "PUSH";
    push.requests = 50;
    Ember__MethodStats *methods[] = {&pull, &push};
    Ember__ServerStats server = EMBER__SERVER_STATS__INIT;
    server.version = "0.1.0";
    server.state = "serving";
    server.backend = "cpu";
    server.uptime_ms = 5000;
    server.connections_current = 3;
    server.bytes_in = UINT64_C(1) << 40;
    server.n_methods = 2;
    server.methods = methods;
    Ember__TableStats table = EMBER__TABLE_STATS__INIT;
    table.name = "t";
    table.rows = 7;
    table.row_bytes = 4096;
    Ember__TableStats *tables[] = {&table};
    Ember__PoolStats pool = EMBER__POOL_STATS__INIT;
    pool.device = "cpu0";
    pool.bytes_in_use = 1536;
    pool.fragmentation = 0.25;
    Ember__PoolStats *pools[] = {&pool};
    Ember__StatsResponse stats = EMBER__STATS_RESPONSE__INIT;
    stats.server = &server;
    stats.n_tables = 1;
    stats.tables = tables;
    stats.n_pools = 1;
    stats.pools = pools;

    cJSON *json = em__client_json_stats(&stats);
    ck_assert_ptr_nonnull(json);
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(json, "server");
    ck_assert_str_eq(string(s, "version"), "0.1.0");
    ck_assert_str_eq(string(s, "state"), "serving");
    ck_assert_double_eq(number(s, "uptime_ms"), 5000);
    ck_assert_double_eq(number(s, "connections_current"), 3);
    ck_assert_double_eq(number(s, "connections_rejected"), 0);
    ck_assert_double_eq(number(s, "bytes_in"), 1099511627776.0);
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(s, "methods");
    ck_assert_int_eq(cJSON_GetArraySize(m), 2);
    ck_assert_str_eq(string(cJSON_GetArrayItem(m, 0), "method"), "PULL");
    ck_assert_double_eq(number(cJSON_GetArrayItem(m, 0), "errors"), 2);
    ck_assert_double_eq(number(cJSON_GetArrayItem(m, 1), "requests"), 50);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(json, "tables");
    ck_assert_int_eq(cJSON_GetArraySize(t), 1);
    ck_assert_str_eq(string(cJSON_GetArrayItem(t, 0), "name"), "t");
    ck_assert_double_eq(number(cJSON_GetArrayItem(t, 0), "row_bytes"), 4096);
    ck_assert_double_eq(number(cJSON_GetArrayItem(t, 0), "keys_pushed"), 0);
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(json, "pools");
    ck_assert_str_eq(string(cJSON_GetArrayItem(p, 0), "device"), "cpu0");
    ck_assert_double_eq(number(cJSON_GetArrayItem(p, 0), "fragmentation"), 0.25);
    ck_assert_double_eq(number(cJSON_GetArrayItem(p, 0), "bytes_in_use"), 1536);
    cJSON_Delete(json);

    /* no server section: null, empty lists: [] */
    Ember__StatsResponse empty = EMBER__STATS_RESPONSE__INIT;
    json = em__client_json_stats(&empty);
    ck_assert(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(json, "server")));
    ck_assert(cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(json, "tables")));
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(json, "pools")), 0);
    cJSON_Delete(json);
}
END_TEST

START_TEST(enums_are_names_and_bytes_are_hex)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = 12;
    meta.method = EMBER__METHOD__CREATE_TABLE;
    meta.status = EMBER__STATUS__NOT_FOUND;
    meta.error = "no table 'x'";
    uint8_t token[] = {0x01, 0xab, 0xff};
    meta.auth_token.data = token;
    meta.auth_token.len = 3;
    cJSON *json = em__client_json_from_message(&meta.base);
    ck_assert_str_eq(string(json, "method"), "CREATE_TABLE");
    ck_assert_str_eq(string(json, "status"), "NOT_FOUND");
    ck_assert_str_eq(string(json, "error"), "no table 'x'");
    ck_assert_str_eq(string(json, "auth_token"), "01abff");
    ck_assert_double_eq(number(json, "correlation_id"), 12);
    cJSON_Delete(json);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("client_json");
    TCase *convert = tcase_create("convert");
    tcase_add_test(convert, table_info_has_the_parsed_config);
    tcase_add_test(convert, stats_follow_the_proto_field_names);
    tcase_add_test(convert, enums_are_names_and_bytes_are_hex);
    suite_add_tcase(suite, convert);
    return em_test_run(suite);
}
