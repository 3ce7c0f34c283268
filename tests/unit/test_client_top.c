/*
 * emberctl top's arithmetic (clients/client_top.h): rates and percentiles between two
 * STATS answers, written here by hand so every expected number is known.
 */
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clients/client_top.h"
#include "tests/support/test_support.h"

/* Three bounds (1 ms, 10 ms, 100 ms) and the unbounded bucket. */
static const double bounds[] = {0.001, 0.010, 0.100};

START_TEST(quantiles_interpolate_within_the_bucket_of_the_rank)
{
    /* 100 requests: 50 under 1 ms, 40 in (1, 10] ms, 10 in (10, 100] ms */
    double counts[] = {50, 40, 10, 0};
    ck_assert_double_eq_tol(em_top_quantile(bounds, counts, 3, 0.5), 0.001, 1e-12);
    ck_assert_double_eq_tol(em_top_quantile(bounds, counts, 3, 0.25), 0.0005, 1e-12);
    /* rank 90 is the last of the second bucket; rank 70 half way through it */
    ck_assert_double_eq_tol(em_top_quantile(bounds, counts, 3, 0.9), 0.010, 1e-12);
    ck_assert_double_eq_tol(em_top_quantile(bounds, counts, 3, 0.7), 0.0055, 1e-12);
    /* rank 99: 9 of the 10 in (10, 100] ms */
    ck_assert_double_eq_tol(em_top_quantile(bounds, counts, 3, 0.99), 0.010 + 0.9 * 0.090,
                            1e-12);
    /* a rank in the unbounded bucket reads as the largest bound */
    double slow[] = {0, 0, 1, 9};
    ck_assert_double_eq_tol(em_top_quantile(bounds, slow, 3, 0.5), 0.100, 1e-12);
    /* empty buckets before the rank are skipped, not interpolated into */
    double late[] = {0, 0, 4, 0};
    ck_assert_double_eq_tol(em_top_quantile(bounds, late, 3, 0.5), 0.010 + 0.5 * 0.090, 1e-12);
    double none[] = {0, 0, 0, 0};
    ck_assert_double_eq(em_top_quantile(bounds, none, 3, 0.99), 0.0);
}
END_TEST

/* A STATS answer as em_client_stats gives it, with one method (PULL), two tables and
 * one pool. */
static cJSON *stats(double uptime_ms, double pulls, const double *buckets, double keys_a,
                    double keys_b, double connections)
{
    char text[2048];
    snprintf(text, sizeof(text),
             "{\"server\": {\"version\": \"9.9\", \"state\": \"serving\", \"backend\": \"cpu\","
             " \"uptime_ms\": %g, \"connections_current\": 2, \"connections_total\": %g,"
             " \"connections_rejected\": 0, \"bytes_in\": %g, \"bytes_out\": 0,"
             " \"work_queued\": 1, \"memory_used_bytes\": 10, \"memory_limit_bytes\": 100,"
             " \"duration_bounds_seconds\": [0.001, 0.01, 0.1],"
             " \"methods\": [{\"method\": \"PULL\", \"requests\": %g, \"errors\": 0,"
             " \"duration_buckets\": [%g, %g, %g, %g]},"
             " {\"method\": \"PUSH\", \"requests\": 5, \"errors\": 0,"
             " \"duration_buckets\": [5, 0, 0, 0]}]},"
             " \"tables\": [{\"name\": \"a\", \"rows\": 10, \"capacity\": 100, \"pulls\": %g,"
             " \"keys_pulled\": %g}, {\"name\": \"b\", \"rows\": 0, \"capacity\": 10,"
             " \"pulls\": 0, \"keys_pulled\": %g}],"
             " \"pools\": [{\"device\": \"cpu0\", \"bytes_in_use\": 7, \"bytes_limit\": 70,"
             " \"fragmentation\": 0.5}]}",
             uptime_ms, connections, uptime_ms * 10, pulls, buckets[0], buckets[1], buckets[2],
             buckets[3], pulls, keys_a, keys_b);
    cJSON *json = cJSON_Parse(text);
    ck_assert_msg(json != NULL, "%s", text);
    return json;
}

static double field(const cJSON *object, const char *name)
{
    const cJSON *item = cJSON_GetObjectItem(object, name);
    ck_assert_msg(cJSON_IsNumber(item), "no number %s", name);
    return item->valuedouble;
}

START_TEST(rates_come_from_the_server_uptime_and_only_busy_methods_show)
{
    const double buckets_then[] = {10, 0, 0, 0}, buckets_now[] = {60, 40, 10, 0};
    cJSON *before = stats(10000, 10, buckets_then, 100, 50, 3);
    cJSON *after = stats(12000, 110, buckets_now, 1100, 450, 7);
    /* the wall clock says 5 s; the server's uptimes say 2 s, and they win */
    cJSON *view = em_top_view(before, after, 5.0);
    ck_assert_ptr_nonnull(view);
    ck_assert_double_eq(field(view, "seconds"), 2.0);
    const cJSON *server = cJSON_GetObjectItem(view, "server");
    ck_assert_double_eq(field(server, "connections_per_second"), 2.0);
    ck_assert_double_eq(field(server, "bytes_in_per_second"), 10000.0);
    ck_assert_double_eq(field(server, "connections_current"), 2.0);
    ck_assert_str_eq(cJSON_GetObjectItem(server, "version")->valuestring, "9.9");

    /* PUSH did nothing in the interval: only PULL is shown */
    const cJSON *methods = cJSON_GetObjectItem(view, "methods");
    ck_assert_int_eq(cJSON_GetArraySize(methods), 1);
    const cJSON *pull = cJSON_GetArrayItem(methods, 0);
    ck_assert_str_eq(cJSON_GetObjectItem(pull, "method")->valuestring, "PULL");
    ck_assert_double_eq(field(pull, "requests_per_second"), 50.0);
    /* the interval's histogram is {50, 40, 10, 0}: the first test's numbers */
    ck_assert_double_eq_tol(field(pull, "p50_seconds"), 0.001, 1e-12);
    ck_assert_double_eq_tol(field(pull, "p90_seconds"), 0.010, 1e-12);
    ck_assert_double_eq_tol(field(pull, "p99_seconds"), 0.010 + 0.9 * 0.090, 1e-12);

    /* tables busiest first: b pulled 200 keys/s, a 500 keys/s */
    const cJSON *tables = cJSON_GetObjectItem(view, "tables");
    ck_assert_int_eq(cJSON_GetArraySize(tables), 2);
    const cJSON *first = cJSON_GetArrayItem(tables, 0);
    ck_assert_str_eq(cJSON_GetObjectItem(first, "name")->valuestring, "a");
    ck_assert_double_eq(field(first, "keys_pulled_per_second"), 500.0);
    ck_assert_double_eq(field(first, "pulls_per_second"), 50.0);
    ck_assert_double_eq(field(first, "rows"), 10.0);
    ck_assert_double_eq(field(cJSON_GetArrayItem(tables, 1), "keys_pulled_per_second"), 200.0);

    const cJSON *pool = cJSON_GetArrayItem(cJSON_GetObjectItem(view, "pools"), 0);
    ck_assert_str_eq(cJSON_GetObjectItem(pool, "device")->valuestring, "cpu0");
    ck_assert_double_eq(field(pool, "bytes_limit"), 70.0);
    ck_assert_double_eq(field(pool, "fragmentation"), 0.5);
    cJSON_Delete(view);
    cJSON_Delete(before);
    cJSON_Delete(after);
}
END_TEST

START_TEST(a_restarted_server_or_recreated_table_counts_from_zero)
{
    const double buckets_then[] = {100, 100, 0, 0}, buckets_now[] = {4, 0, 0, 0};
    /* the later answer's uptime is smaller: the server restarted 1 s ago */
    cJSON *before = stats(60000, 200, buckets_then, 5000, 100, 50);
    cJSON *after = stats(1000, 4, buckets_now, 40, 20, 1);
    cJSON *view = em_top_view(before, after, 3.0);
    ck_assert_double_eq(field(view, "seconds"), 1.0);
    const cJSON *pull = cJSON_GetArrayItem(cJSON_GetObjectItem(view, "methods"), 0);
    ck_assert_str_eq(cJSON_GetObjectItem(pull, "method")->valuestring, "PULL");
    ck_assert_double_eq(field(pull, "requests_per_second"), 4.0);
    ck_assert_double_eq_tol(field(pull, "p99_seconds"), 0.99 * 0.001, 1e-12);
    const cJSON *first = cJSON_GetArrayItem(cJSON_GetObjectItem(view, "tables"), 0);
    ck_assert_double_eq(field(first, "keys_pulled_per_second"), 40.0);
    cJSON_Delete(view);
    cJSON_Delete(before);
    cJSON_Delete(after);

    /* same server, but table a's counters went down: it was dropped and created again */
    const double steady[] = {1, 0, 0, 0};
    before = stats(1000, 1, steady, 900, 100, 1);
    after = stats(2000, 1, steady, 30, 150, 1);
    view = em_top_view(before, after, 1.0);
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(view, "methods")), 0);
    const cJSON *tables = cJSON_GetObjectItem(view, "tables");
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(tables, 0), "name")->valuestring,
                     "b");
    ck_assert_double_eq(field(cJSON_GetArrayItem(tables, 0), "keys_pulled_per_second"), 50.0);
    ck_assert_double_eq(field(cJSON_GetArrayItem(tables, 1), "keys_pulled_per_second"), 30.0);
    cJSON_Delete(view);
    cJSON_Delete(before);
    cJSON_Delete(after);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("client_top");
    TCase *arithmetic = tcase_create("arithmetic");
    tcase_add_test(arithmetic, quantiles_interpolate_within_the_bucket_of_the_rank);
    tcase_add_test(arithmetic, rates_come_from_the_server_uptime_and_only_busy_methods_show);
    tcase_add_test(arithmetic, a_restarted_server_or_recreated_table_counts_from_zero);
    suite_add_tcase(suite, arithmetic);
    return em_test_run(suite);
}
