/*
 * Operating a real emberd: a scrape of the metrics listener after a known workload
 * counts exactly what was sent, agrees with STATS and passes `promtool check metrics`;
 * /healthz; bad HTTP requests (methods, paths, oversized headers, slow senders, too many
 * connections) are refused without disturbing the RPC listeners; DRAIN, UNDRAIN, RELOAD,
 * and the slow log.
 */
#include <check.h>
#include <cJSON.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clients/ember_client.h"
#include "tests/integration/harness.h"
#include "tests/support/test_support.h"

#define DIM 8u
#define KEYS 64u
#define PULLS 37u
#define PUSHES 11u

static const char *table_overrides =
    "{\"tables\": [{\"name\": \"t\", \"dim\": 8, \"capacity\": 10000, \"shards\": 2,"
    " \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.1}}]}";

static em_client *client_for(const char *address)
{
    em_client_options options;
    em_client_options_init(&options);
    options.servers = address;
    options.token = TEST_ADMIN_TOKEN;
    options.timeout_ms = 30000;
    em_client *client = NULL;
    em_error err;
    ck_assert_msg(em_client_create(&options, &client, &err) == EM_OK, "%s", err.message);
    return client;
}

/* ---- HTTP by hand ------------------------------------------------------------------- */

typedef struct http_answer {
    int status; /* 0: the connection closed without an answer */
    char *head; /* status line and headers */
    char *body;
} http_answer;

/* Sends request as is and reads until the server closes (or timeout_ms passes). */
static http_answer http_exchange(const char *address, const char *request, int timeout_ms)
{
    int fd = test_connect(address);
    ck_assert_msg(fd >= 0, "cannot connect to %s", address);
    ck_assert(test_send_all(fd, request, strlen(request)));
    size_t capacity = 1 << 16, used = 0;
    char *text = malloc(capacity + 1);
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, timeout_ms) <= 0)
            break;
        if (used == capacity) {
            capacity *= 2;
            text = realloc(text, capacity + 1);
        }
        ssize_t n = read(fd, text + used, capacity - used);
        if (n <= 0)
            break;
        used += (size_t)n;
    }
    close(fd);
    text[used] = '\0';
    http_answer answer = {0};
    char *split = strstr(text, "\r\n\r\n");
    if (split == NULL || sscanf(text, "HTTP/1.1 %d", &answer.status) != 1) {
        answer.head = text;
        answer.body = strdup("");
        return answer;
    }
    *split = '\0';
    answer.head = text;
    answer.body = strdup(split + 4);
    return answer;
}

static http_answer http_get(const char *address, const char *path, const char *accept)
{
    char request[512];
    snprintf(request, sizeof(request), "GET %s HTTP/1.1\r\nHost: test\r\n%s%s%sConnection: close\r\n\r\n",
             path, accept != NULL ? "Accept: " : "", accept != NULL ? accept : "",
             accept != NULL ? "\r\n" : "");
    return http_exchange(address, request, 10000);
}

static void http_answer_free(http_answer *answer)
{
    free(answer->head);
    free(answer->body);
}

/* The value of the sample whose line starts with prefix ("name{labels} "), or -1. */
static double sample(const char *exposition, const char *prefix)
{
    size_t length = strlen(prefix);
    for (const char *line = exposition; line != NULL && *line != '\0';) {
        if (strncmp(line, prefix, length) == 0)
            return strtod(line + length, NULL);
        line = strchr(line, '\n');
        line = line != NULL ? line + 1 : NULL;
    }
    return -1.0;
}

static double stats_number(const cJSON *object, const char *name)
{
    const cJSON *item = cJSON_GetObjectItem(object, name);
    ck_assert_msg(item != NULL, "STATS has no %s", name);
    return cJSON_IsString(item) ? strtod(item->valuestring, NULL) : item->valuedouble;
}

/* Reads the file at path (the dashboard: valid JSON too) and checks that every ember_
 * name in it starts a line of the scrape; returns how many names it found. */
static int check_names(const char *path, const char *scrape, bool json)
{
    ck_assert_ptr_nonnull(path);
    FILE *file = fopen(path, "r");
    ck_assert_msg(file != NULL, "%s", path);
    static char text[1 << 17];
    size_t length = fread(text, 1, sizeof(text) - 1, file);
    text[length] = '\0';
    fclose(file);
    if (json) {
        cJSON *parsed = cJSON_Parse(text);
        ck_assert_msg(parsed != NULL, "%s is not valid JSON", path);
        cJSON_Delete(parsed);
    }
    int named = 0;
    for (const char *at = strstr(text, "ember_"); at != NULL; at = strstr(at + 1, "ember_")) {
        char name[128], line_start[132];
        size_t name_length = strspn(at, "abcdefghijklmnopqrstuvwxyz_");
        snprintf(name, sizeof(name), "%.*s", (int)name_length, at);
        snprintf(line_start, sizeof(line_start), "\n%s", name);
        ck_assert_msg(strstr(scrape, line_start) != NULL, "%s names %s, which a scrape does not "
                      "have", path, name);
        named++;
    }
    return named;
}

/* The STATS answer's histogram and answers of method equal the scrape's, bucket by
 * bucket (STATS holds per-bucket counts, the exposition cumulative ones). */
static void check_method_histogram(const char *scrape, const cJSON *server, const char *method)
{
    const cJSON *stats = NULL, *m;
    cJSON_ArrayForEach(m, cJSON_GetObjectItem(server, "methods"))
    {
        if (strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(m, "method")), method) == 0)
            stats = m;
    }
    ck_assert_msg(stats != NULL, "STATS has no method %s", method);
    const cJSON *bounds = cJSON_GetObjectItem(server, "duration_bounds_seconds");
    const cJSON *buckets = cJSON_GetObjectItem(stats, "duration_buckets");
    int bound_count = cJSON_GetArraySize(bounds);
    ck_assert_int_eq(bound_count, 17);
    ck_assert_int_eq(cJSON_GetArraySize(buckets), bound_count + 1);
    ck_assert_double_eq_tol(cJSON_GetArrayItem(bounds, 0)->valuedouble, 50e-6, 1e-12);
    ck_assert_double_eq_tol(cJSON_GetArrayItem(bounds, bound_count - 1)->valuedouble, 10.0, 1e-9);
    double cumulative = 0.0;
    char prefix[160];
    for (int b = 0; b <= bound_count; b++) {
        cumulative += cJSON_GetArrayItem(buckets, b)->valuedouble;
        char bound[32] = "+Inf";
        if (b < bound_count)
            snprintf(bound, sizeof(bound), "%g", cJSON_GetArrayItem(bounds, b)->valuedouble);
        snprintf(prefix, sizeof(prefix),
                 "ember_request_duration_seconds_bucket{method=\"%s\",le=\"%s\"} ", method,
                 bound);
        ck_assert_double_eq(sample(scrape, prefix), cumulative);
    }
    ck_assert_double_eq(cumulative, stats_number(stats, "requests"));
    snprintf(prefix, sizeof(prefix), "ember_request_duration_seconds_sum{method=\"%s\"} ",
             method);
    ck_assert_double_eq_tol(sample(scrape, prefix), stats_number(stats, "duration_sum_seconds"),
                            1e-6);
    double answered = 0.0;
    cJSON_ArrayForEach(m, cJSON_GetObjectItem(stats, "answers"))
    {
        snprintf(prefix, sizeof(prefix), "ember_responses_total{method=\"%s\",status=\"%s\"} ",
                 method, cJSON_GetStringValue(cJSON_GetObjectItem(m, "status")));
        ck_assert_double_eq(sample(scrape, prefix), stats_number(m, "count"));
        answered += stats_number(m, "count");
    }
    ck_assert_double_eq(answered, stats_number(stats, "requests"));
}

/* ---- the workload ------------------------------------------------------------------- */

static void run_workload(em_client *client)
{
    uint32_t offsets[KEYS + 1];
    uint64_t keys[KEYS];
    float out[KEYS * DIM], gradients[KEYS * DIM];
    for (uint32_t i = 0; i <= KEYS; i++)
        offsets[i] = i;
    for (uint32_t i = 0; i < KEYS; i++)
        keys[i] = 1000u + i;
    for (uint32_t i = 0; i < KEYS * DIM; i++)
        gradients[i] = 0.01f;
    em_error err;
    for (uint32_t p = 0; p < PULLS; p++) {
        em_client_pull_args args = {.table = "t",
                                    .batch = {.rows = KEYS, .nnz = KEYS, .offsets = offsets,
                                              .keys = keys},
                                    .combiner = EM_COMBINER_NONE,
                                    .create_missing = true,
                                    .out = out,
                                    .out_capacity = KEYS * DIM};
        ck_assert_msg(em_client_pull(client, &args, NULL, &err) == EM_OK, "%s", err.message);
    }
    for (uint32_t p = 0; p < PUSHES; p++) {
        em_client_push_args args = {.table = "t",
                                    .batch = {.rows = KEYS, .nnz = KEYS, .offsets = offsets,
                                              .keys = keys},
                                    .combiner = EM_COMBINER_NONE,
                                    .gradients = gradients,
                                    .gradient_count = KEYS * DIM};
        ck_assert_msg(em_client_push(client, &args, NULL, &err) == EM_OK, "%s", err.message);
    }
    /* one refused request: a table that does not exist */
    em_client_pull_args bad = {.table = "missing",
                               .batch = {.rows = KEYS, .nnz = KEYS, .offsets = offsets,
                                         .keys = keys},
                               .combiner = EM_COMBINER_NONE,
                               .out = out,
                               .out_capacity = KEYS * DIM};
    ck_assert_int_eq(em_client_pull(client, &bad, NULL, &err), EM_NOT_FOUND);
}

/* ---- tests -------------------------------------------------------------------------- */

START_TEST(a_scrape_counts_the_workload_agrees_with_stats_and_passes_promtool)
{
    test_daemon *daemon = test_daemon_start(table_overrides);
    ck_assert_msg(daemon->metrics[0] != '\0', "the daemon has no metrics listener");
    em_client *client = client_for(daemon->data);
    run_workload(client);
    em_client_destroy(client);

    http_answer scrape = http_get(daemon->metrics, "/metrics", NULL);
    ck_assert_int_eq(scrape.status, 200);
    ck_assert_msg(strstr(scrape.head, "Content-Type: text/plain; version=0.0.4") != NULL, "%s",
                  scrape.head);
    const char *text = scrape.body;
    /* counters equal what was sent, histogram counts equal request counts */
    ck_assert_double_eq(sample(text, "ember_requests_total{method=\"PULL\"} "), PULLS + 1);
    ck_assert_double_eq(sample(text, "ember_errors_total{method=\"PULL\"} "), 1);
    ck_assert_double_eq(sample(text, "ember_requests_total{method=\"PUSH\"} "), PUSHES);
    ck_assert_double_eq(
        sample(text, "ember_responses_total{method=\"PULL\",status=\"OK\"} "), PULLS);
    ck_assert_double_eq(
        sample(text, "ember_responses_total{method=\"PULL\",status=\"NOT_FOUND\"} "), 1);
    ck_assert_double_eq(sample(text, "ember_request_duration_seconds_count{method=\"PULL\"} "),
                        PULLS + 1);
    ck_assert_double_eq(
        sample(text, "ember_request_duration_seconds_bucket{method=\"PULL\",le=\"+Inf\"} "),
        PULLS + 1);
    ck_assert_double_eq(sample(text, "ember_request_duration_seconds_count{method=\"PUSH\"} "),
                        PUSHES);
    ck_assert(sample(text, "ember_request_duration_seconds_sum{method=\"PULL\"} ") > 0.0);
    ck_assert_double_eq(sample(text, "ember_table_keys_pulled_total{table=\"t\"} "), PULLS * KEYS);
    ck_assert_double_eq(sample(text, "ember_table_keys_pushed_total{table=\"t\"} "), PUSHES * KEYS);
    ck_assert_double_eq(sample(text, "ember_table_rows{table=\"t\"} "), KEYS);
    ck_assert_msg(strstr(text, "ember_build_info{version=\"") != NULL, "%s", text);
    ck_assert_msg(strstr(text, "# TYPE ember_request_duration_seconds histogram") != NULL, "%s",
                  text);

    /* the same numbers as STATS (nothing but this STATS ran in between) */
    em_client *admin = client_for(daemon->admin);
    cJSON *stats = NULL;
    em_error err;
    ck_assert_msg(em_client_stats(admin, NULL, &stats, &err) == EM_OK, "%s", err.message);
    const cJSON *server = cJSON_GetObjectItem(stats, "server");
    const cJSON *table = cJSON_GetArrayItem(cJSON_GetObjectItem(stats, "tables"), 0);
    const cJSON *pool = cJSON_GetArrayItem(cJSON_GetObjectItem(stats, "pools"), 0);
    ck_assert_double_eq(sample(text, "ember_table_keys_pulled_total{table=\"t\"} "),
                        stats_number(table, "keys_pulled"));
    ck_assert_double_eq(sample(text, "ember_table_rows_created_total{table=\"t\"} "),
                        stats_number(table, "rows_created"));
    ck_assert_double_eq(sample(text, "ember_table_rows{table=\"t\"} "), stats_number(table, "rows"));
    ck_assert(sample(text, "ember_bytes_in_total ") > PUSHES * KEYS * DIM * sizeof(float));
    ck_assert_double_eq(sample(text, "ember_connections_total_total "), -1.0); /* one suffix */
    ck_assert_double_eq(sample(text, "ember_connections_total ") + 1, /* STATS's own */
                        stats_number(server, "connections_total"));
    ck_assert_double_eq(sample(text, "ember_frames_rejected_total "),
                        stats_number(server, "frames_rejected"));
    char pool_prefix[128];
    snprintf(pool_prefix, sizeof(pool_prefix), "ember_pool_bytes_limit{device=\"%s\"} ",
             cJSON_GetStringValue(cJSON_GetObjectItem(pool, "device")));
    ck_assert_double_eq(sample(text, pool_prefix), stats_number(pool, "bytes_limit"));
    check_method_histogram(text, server, "PULL");
    check_method_histogram(text, server, "PUSH");
    cJSON_Delete(stats);
    em_client_destroy(admin);

    /* promtool (Debian's prometheus package) accepts the exposition */
    char path[4096];
    const char *tmpdir = getenv("TMPDIR");
    snprintf(path, sizeof(path), "%s/ember-scrape-XXXXXX",
             tmpdir != NULL && tmpdir[0] != '\0' ? tmpdir : "/tmp");
    int fd = mkstemp(path);
    ck_assert(fd >= 0);
    ck_assert(write(fd, text, strlen(text)) == (ssize_t)strlen(text));
    close(fd);
    char command[4200];
    snprintf(command, sizeof(command), "promtool check metrics < %s 2>&1", path);
    FILE *promtool = popen(command, "r");
    ck_assert(promtool != NULL);
    char output[4096] = "";
    size_t got = fread(output, 1, sizeof(output) - 1, promtool);
    output[got] = '\0';
    int rc = pclose(promtool);
    unlink(path);
    ck_assert_msg(rc == 0, "promtool check metrics (is promtool installed? "
                           "deploy/install-deps.sh installs it): %s", output);

    /* every metric the shipped alert rules and dashboard name is in a real scrape */
    ck_assert_int_ge(check_names(getenv("EMBER_ALERT_RULES"), text, false), 8);
    ck_assert_int_ge(check_names(getenv("EMBER_DASHBOARD"), text, true), 15);

    /* OpenMetrics when asked */
    http_answer open = http_get(daemon->metrics, "/metrics",
                                "application/openmetrics-text;version=1.0.0,text/plain;q=0.5");
    ck_assert_int_eq(open.status, 200);
    ck_assert_msg(strstr(open.head, "application/openmetrics-text") != NULL, "%s", open.head);
    size_t length = strlen(open.body);
    ck_assert(length > 6 && strcmp(open.body + length - 6, "# EOF\n") == 0);
    ck_assert_msg(strstr(open.body, "# TYPE ember_table_keys_pulled counter") != NULL, "%s", open.body);
    http_answer_free(&open);
    http_answer_free(&scrape);
    /* the refused pull's log line carries its request id (debug level) */
    char *log = test_daemon_log(daemon);
    const char *line = strstr(log, "request 127.0.0.1:");
    ck_assert_msg(line != NULL && strstr(line, " PULL answered NOT_FOUND: ") != NULL &&
                      strchr(line, '#') != NULL, "%s", log);
    free(log);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 20000), 0);
}
END_TEST

START_TEST(the_metrics_listener_refuses_bad_requests_and_the_rpc_listeners_go_on)
{
    test_daemon *daemon = test_daemon_start(table_overrides);
    http_answer health = http_get(daemon->metrics, "/healthz", NULL);
    ck_assert_int_eq(health.status, 200);
    ck_assert_str_eq(health.body, "serving\n");
    http_answer_free(&health);

    http_answer missing = http_get(daemon->metrics, "/admin", NULL);
    ck_assert_int_eq(missing.status, 404);
    http_answer_free(&missing);
    http_answer post = http_exchange(daemon->metrics,
                                     "POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi",
                                     10000);
    ck_assert_int_eq(post.status, 405);
    ck_assert_msg(strstr(post.head, "Allow: GET, HEAD") != NULL, "%s", post.head);
    http_answer_free(&post);
    http_answer garbage = http_exchange(daemon->metrics, "\x01\x02 nonsense\r\n\r\n", 10000);
    ck_assert_int_eq(garbage.status, 400);
    http_answer_free(&garbage);
    size_t big = 10000;
    char *huge = malloc(big + 64);
    int used = snprintf(huge, big + 64, "GET /metrics HTTP/1.1\r\nX-Filler: ");
    memset(huge + used, 'a', big);
    strcpy(huge + used + big, "\r\n\r\n");
    http_answer oversized = http_exchange(daemon->metrics, huge, 10000);
    ck_assert_int_eq(oversized.status, 431);
    http_answer_free(&oversized);
    free(huge);

    /* slow senders hold connections; past the limit connections close at once, and the
     * data listener answers throughout */
    int slow[20];
    for (int i = 0; i < 20; i++) {
        slow[i] = test_connect(daemon->metrics);
        ck_assert(slow[i] >= 0);
        ck_assert(test_send_all(slow[i], "GET /met", 8));
    }
    int closed_early = 0;
    for (int i = 0; i < 20; i++)
        closed_early += test_wait_closed(slow[i], 200) ? 1 : 0;
    ck_assert_int_ge(closed_early, 4);
    em_client *client = client_for(daemon->data);
    char version[64];
    uint64_t uptime = 0;
    em_error err;
    ck_assert_msg(em_client_ping(client, version, sizeof(version), &uptime, &err) == EM_OK, "%s",
                  err.message);
    int closed_late = 0;
    for (int i = 0; i < 20; i++) { /* the others are closed after the 5 s request timeout */
        closed_late += test_wait_closed(slow[i], 8000) ? 1 : 0;
        close(slow[i]);
    }
    ck_assert_int_eq(closed_late, 20);
    ck_assert_msg(em_client_ping(client, version, sizeof(version), &uptime, &err) == EM_OK, "%s",
                  err.message);
    em_client_destroy(client);

    http_answer scrape = http_get(daemon->metrics, "/metrics", NULL);
    ck_assert_int_eq(scrape.status, 200);
    /* 404, 405, 400, 431, 20 slow senders (those over the limit and the timed out) */
    ck_assert_double_eq(sample(scrape.body, "ember_http_requests_refused_total "), 24);
    ck_assert_double_eq(sample(scrape.body, "ember_metrics_scrapes_total "), 0);
    http_answer_free(&scrape);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 20000), 0);
}
END_TEST

/* DRAIN and UNDRAIN end to end through emberctl, with tokens: drained, the data side
 * refuses (requests and new connections), HEALTH and /healthz say not ready, admin goes
 * on; undrained, all is back. */
START_TEST(drain_and_undrain_through_emberctl)
{
    test_daemon *daemon = test_daemon_start(table_overrides);
    const char *ctl = getenv("EMBERCTL");
    ck_assert_ptr_nonnull(ctl);
    char *out = NULL;
    char *drain[] = {(char *)ctl, "--server", daemon->admin, "drain", NULL};
    ck_assert_int_eq(test_run_program(drain, "wrong-token", &out), 1);
    ck_assert_msg(strstr(out, "UNAUTHENTICATED") != NULL, "%s", out);
    free(out);
    em_client *data = client_for(daemon->data); /* connected before the drain */
    ck_assert_int_eq(test_run_program(drain, TEST_ADMIN_TOKEN, &out), 0);
    ck_assert_msg(strstr(out, "drained;") != NULL && strstr(out, "already") == NULL, "%s", out);
    free(out);

    uint32_t offsets[] = {0, 1};
    uint64_t keys[] = {5};
    float vector[DIM];
    em_client_pull_args pull = {.table = "t",
                                .batch = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = keys},
                                .combiner = EM_COMBINER_NONE,
                                .create_missing = true,
                                .out = vector,
                                .out_capacity = DIM};
    em_error err;
    ck_assert_int_eq(em_client_pull(data, &pull, NULL, &err), EM_UNAVAILABLE);
    ck_assert_msg(strstr(err.message, "drained") != NULL, "%s", err.message);
    em_client *late = client_for(daemon->data); /* the data listener refuses new ones */
    char version[64];
    uint64_t uptime = 0;
    ck_assert_int_ne(em_client_ping(late, version, sizeof(version), &uptime, &err), EM_OK);
    em_client_destroy(late);

    em_client *admin = client_for(daemon->admin);
    em_client_health health;
    ck_assert_msg(em_client_health_check(admin, &health, &err) == EM_OK, "%s", err.message);
    ck_assert(!health.ready);
    ck_assert_str_eq(health.state, "drained");
    http_answer healthz = http_get(daemon->metrics, "/healthz", NULL);
    ck_assert_int_eq(healthz.status, 503);
    ck_assert_str_eq(healthz.body, "drained\n");
    http_answer_free(&healthz);
    cJSON *stats = NULL;
    ck_assert_msg(em_client_stats(admin, NULL, &stats, &err) == EM_OK, "%s", err.message);
    const cJSON *server = cJSON_GetObjectItem(stats, "server");
    ck_assert_double_eq(stats_number(server, "requests_refused_draining"), 1);
    ck_assert_double_ge(stats_number(server, "connections_rejected"), 1);
    ck_assert_str_eq(cJSON_GetStringValue(cJSON_GetObjectItem(server, "state")), "drained");
    cJSON_Delete(stats);

    char *again[] = {(char *)ctl, "--server", daemon->admin, "drain", "--wait", "5", NULL};
    ck_assert_int_eq(test_run_program(again, TEST_ADMIN_TOKEN, &out), 0);
    ck_assert_msg(strstr(out, "already") != NULL && strstr(out, "0 request(s) running") != NULL,
                  "%s", out);
    free(out);
    char *bad[] = {(char *)ctl, "--server", daemon->admin, "drain", "--wait", "soon", NULL};
    ck_assert_int_eq(test_run_program(bad, TEST_ADMIN_TOKEN, &out), 2);
    free(out);
    char *undrain[] = {(char *)ctl, "--server", daemon->admin, "undrain", NULL};
    ck_assert_int_eq(test_run_program(undrain, TEST_ADMIN_TOKEN, &out), 0);
    ck_assert_msg(strstr(out, "in service") != NULL, "%s", out);
    free(out);

    ck_assert_msg(em_client_pull(data, &pull, NULL, &err) == EM_OK, "%s", err.message);
    ck_assert_msg(em_client_health_check(admin, &health, &err) == EM_OK, "%s", err.message);
    ck_assert(health.ready);
    ck_assert_str_eq(health.state, "serving");
    healthz = http_get(daemon->metrics, "/healthz", NULL);
    ck_assert_int_eq(healthz.status, 200);
    http_answer_free(&healthz);
    em_client_destroy(admin);
    em_client_destroy(data);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 20000), 0);
}
END_TEST

/* RELOAD through emberctl, with tokens: what changed is applied and listed, what needs
 * a restart is listed apart, and a file that does not parse is refused with the running
 * configuration kept. */
START_TEST(reload_through_emberctl_says_what_changed)
{
    test_daemon *daemon = test_daemon_start(table_overrides);
    const char *ctl = getenv("EMBERCTL");
    ck_assert_ptr_nonnull(ctl);
    char *out = NULL;
    char *reload[] = {(char *)ctl, "--server", daemon->admin, "reload", NULL};
    ck_assert_int_eq(test_run_program(reload, "wrong-token", &out), 1);
    ck_assert_msg(strstr(out, "UNAUTHENTICATED") != NULL, "%s", out);
    free(out);
    ck_assert_int_eq(test_run_program(reload, TEST_ADMIN_TOKEN, &out), 0);
    ck_assert_msg(strstr(out, "changed: none") != NULL &&
                      strstr(out, "needs a restart: none") != NULL, "%s", out);
    free(out);

    char overrides[1024];
    snprintf(overrides, sizeof(overrides),
             "{\"tables\": [{\"name\": \"t\", \"dim\": 8, \"capacity\": 10000, \"shards\": 2,"
             " \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.1}}],"
             " \"log_level\": \"info\", \"limits\": {\"max_connections\": 77},"
             " \"listen\": {\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:0\","
             " \"metrics\": \"127.0.0.1:1\"}}");
    test_daemon_rewrite_config(daemon, overrides);
    char *json_reload[] = {(char *)ctl, "--server", daemon->admin, "--json", "reload", NULL};
    ck_assert_int_eq(test_run_program(json_reload, TEST_ADMIN_TOKEN, &out), 0);
    cJSON *report = cJSON_Parse(out);
    ck_assert_msg(report != NULL, "%s", out);
    char *changed = cJSON_PrintUnformatted(cJSON_GetObjectItem(report, "changed"));
    char *restart = cJSON_PrintUnformatted(cJSON_GetObjectItem(report, "needs_restart"));
    ck_assert_str_eq(changed, "[\"limits\",\"log_level\"]");
    ck_assert_str_eq(restart, "[\"listen\"]");
    free(changed);
    free(restart);
    cJSON_Delete(report);
    free(out);
    /* the metrics listener stayed where it was (listen needs a restart) */
    em_client *admin = client_for(daemon->admin);
    em_error err;
    http_answer health = http_get(daemon->metrics, "/healthz", NULL);
    ck_assert_int_eq(health.status, 200);
    http_answer_free(&health);

    FILE *file = fopen(daemon->config_path, "w");
    ck_assert_ptr_nonnull(file);
    fputs("{\"admin_token\": ", file);
    fclose(file);
    ck_assert_int_eq(test_run_program(reload, TEST_ADMIN_TOKEN, &out), 1);
    ck_assert_msg(strstr(out, "FAILED_PRECONDITION") != NULL &&
                      strstr(out, "running configuration stays") != NULL, "%s", out);
    free(out);
    char version[64];
    uint64_t uptime = 0;
    ck_assert_msg(em_client_ping(admin, version, sizeof(version), &uptime, &err) == EM_OK, "%s",
                  err.message);
    em_client_destroy(admin);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 20000), 0);
}
END_TEST

/* The slow log through emberctl: slow pulls are recorded with what they asked, the ring
 * keeps the newest, and --reset empties it. */
START_TEST(the_slow_log_keeps_the_newest_slow_requests)
{
    test_daemon *daemon = test_daemon_start(
        "{\"tables\": [{\"name\": \"t\", \"dim\": 8, \"capacity\": 300000, \"shards\": 2,"
        " \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.1}}],"
        " \"slowlog_threshold_ms\": 1, \"slowlog_max_entries\": 3}");
    enum { BIG = 200000 };
    uint32_t *offsets = malloc((BIG + 1) * sizeof(*offsets));
    uint64_t *keys = malloc(BIG * sizeof(*keys));
    float *out = malloc((size_t)BIG * DIM * sizeof(float));
    for (uint32_t i = 0; i <= BIG; i++)
        offsets[i] = i;
    for (uint32_t i = 0; i < BIG; i++)
        keys[i] = i;
    em_client *client = client_for(daemon->data);
    em_error err;
    for (int p = 0; p < 5; p++) { /* 6.4 MB answers: well over 1 ms each */
        em_client_pull_args args = {.table = "t",
                                    .batch = {.rows = BIG, .nnz = BIG, .offsets = offsets,
                                              .keys = keys},
                                    .combiner = EM_COMBINER_NONE,
                                    .create_missing = true,
                                    .out = out,
                                    .out_capacity = (uint64_t)BIG * DIM};
        ck_assert_msg(em_client_pull(client, &args, NULL, &err) == EM_OK, "%s", err.message);
    }
    em_client_destroy(client);
    free(offsets);
    free(keys);
    free(out);

    const char *ctl = getenv("EMBERCTL");
    ck_assert_ptr_nonnull(ctl);
    char *output = NULL;
    char *read_log[] = {(char *)ctl, "--server", daemon->admin, "--json", "slowlog", NULL};
    ck_assert_int_eq(test_run_program(read_log, "wrong-token", &output), 1);
    free(output);
    ck_assert_int_eq(test_run_program(read_log, TEST_ADMIN_TOKEN, &output), 0);
    cJSON *log = cJSON_Parse(output);
    ck_assert_msg(log != NULL, "%s", output);
    const cJSON *entries = cJSON_GetObjectItem(log, "entries");
    ck_assert_int_eq(cJSON_GetArraySize(entries), 3);
    double recorded = stats_number(log, "recorded");
    ck_assert_double_ge(recorded, 5);
    ck_assert_double_eq(stats_number(log, "dropped"), recorded - 3);
    ck_assert_double_eq(stats_number(log, "threshold_ms"), 1);
    const cJSON *newest = cJSON_GetArrayItem(entries, 0);
    ck_assert_double_eq(stats_number(newest, "id"), recorded);
    ck_assert_double_gt(stats_number(newest, "id"), stats_number(cJSON_GetArrayItem(entries, 1), "id"));
    int pulls = 0;
    const cJSON *e = NULL;
    cJSON_ArrayForEach(e, entries)
    {
        if (strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(e, "method")), "PULL") != 0)
            continue;
        pulls++;
        ck_assert_str_eq(cJSON_GetStringValue(cJSON_GetObjectItem(e, "table")), "t");
        ck_assert_double_eq(stats_number(e, "keys"), BIG);
        ck_assert_double_ge(stats_number(e, "bytes"), (double)BIG * DIM * sizeof(float));
        ck_assert_str_eq(cJSON_GetStringValue(cJSON_GetObjectItem(e, "status")), "OK");
        ck_assert_double_ge(stats_number(e, "duration_us"), 1000);
        ck_assert_double_ge(stats_number(e, "duration_us") + 1,
                            stats_number(e, "queue_us") + stats_number(e, "run_us"));
    }
    ck_assert_int_ge(pulls, 2);
    cJSON_Delete(log);
    free(output);

    char *reset[] = {(char *)ctl, "--server", daemon->admin, "slowlog", "--reset", NULL};
    ck_assert_int_eq(test_run_program(reset, TEST_ADMIN_TOKEN, &output), 0);
    ck_assert_msg(strstr(output, "the log is now empty") != NULL && strstr(output, "PULL") != NULL,
                  "%s", output);
    free(output);
    ck_assert_int_eq(test_run_program(read_log, TEST_ADMIN_TOKEN, &output), 0);
    log = cJSON_Parse(output);
    ck_assert_msg(log != NULL, "%s", output);
    cJSON_ArrayForEach(e, cJSON_GetObjectItem(log, "entries")) /* at most the reset itself */
        ck_assert_str_ne(cJSON_GetStringValue(cJSON_GetObjectItem(e, "method")), "PULL");
    cJSON_Delete(log);
    free(output);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 20000), 0);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("metrics");
    TCase *tc = tcase_create("metrics");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, a_scrape_counts_the_workload_agrees_with_stats_and_passes_promtool);
    tcase_add_test(tc, the_metrics_listener_refuses_bad_requests_and_the_rpc_listeners_go_on);
    tcase_add_test(tc, drain_and_undrain_through_emberctl);
    tcase_add_test(tc, reload_through_emberctl_says_what_changed);
    tcase_add_test(tc, the_slow_log_keeps_the_newest_slow_requests);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
