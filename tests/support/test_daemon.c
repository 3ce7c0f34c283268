#include "tests/support/test_daemon.h"

#include <check.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/daemon.h"
#include "daemon/methods.h"

struct em_test_daemon {
    em_daemon *daemon;
    pthread_t thread;
    char admin_token[EM_TOKEN_MAX + 1];
};

static void *run_daemon(void *argument)
{
    em_test_daemon *test = argument;
    em_daemon_run(test->daemon);
    return NULL;
}

/* The configuration: CPU backend, one device with a 1 GiB pool starting at 64 MiB, four
 * workers (delayed requests sleep on them), ports chosen by the kernel, quiet logs. */
static void build_config(const em_test_daemon_options *options, const char *admin_token,
                         char *json, size_t capacity)
{
    char data_token[EM_TOKEN_MAX + 64] = "";
    if (options->data_token != NULL)
        snprintf(data_token, sizeof(data_token), ", \"data_token\": {\"value\": \"%s\"}",
                 options->data_token);
    char tables[1024] = "";
    if (options->tables_json != NULL)
        snprintf(tables, sizeof(tables), ", \"tables\": %s", options->tables_json);
    snprintf(json, capacity,
             "{\"listen\": {\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:0\","
             " \"metrics\": \"%s\"},"
             " \"backend\": {\"type\": \"cpu\", \"devices\": 1, \"threads\": 4,"
             "  \"memory_limit_bytes\": 1073741824, \"initial_bytes\": 67108864,"
             "  \"growth_bytes\": 67108864},"
             " \"admin_token\": {\"value\": \"%s\"}%s,"
             " \"log_level\": \"error\", \"drain_timeout_ms\": 5000,"
             " \"request_histograms\": %s%s}",
             options->metrics ? "127.0.0.1:0" : "", admin_token, data_token,
             options->no_request_histograms ? "false" : "true", tables);
}

/* Not check's assertions: benchmarks start test daemons outside any test. */
static void require(bool ok, const char *message)
{
    if (ok)
        return;
    fprintf(stderr, "test daemon: %s\n", message);
    abort();
}

em_test_daemon *em_test_daemon_start(const em_test_daemon_options *options)
{
    /* as in emberd: a peer that left is an error from write(), not a signal */
    signal(SIGPIPE, SIG_IGN);
    em_test_daemon_options defaults = {0};
    if (options == NULL)
        options = &defaults;
    em_test_daemon *test = calloc(1, sizeof(*test));
    require(test != NULL, "out of memory");
    snprintf(test->admin_token, sizeof(test->admin_token), "%s",
             options->admin_token != NULL ? options->admin_token : EM_TEST_DAEMON_ADMIN_TOKEN);
    char json[2048];
    build_config(options, test->admin_token, json, sizeof(json));
    em_daemon_config config;
    em_error err;
    require(em_daemon_config_parse_text(json, "test daemon", &config, &err) == EM_OK, err.message);
    em_daemon_options daemon_options;
    em_daemon_options_init(&daemon_options);
    require(em_daemon_create(&config, &daemon_options, &test->daemon, &err) == EM_OK, err.message);
    em_daemon_config_deinit(&config);
    atomic_store(&em_daemon_faults(test->daemon)->reverse_answers, options->reverse_responses);
    require(pthread_create(&test->thread, NULL, run_daemon, test) == 0, "pthread_create failed");
    return test;
}

void em_test_daemon_stop(em_test_daemon *test)
{
    em_daemon_stop(test->daemon, "test finished");
    pthread_join(test->thread, NULL);
    em_daemon_destroy(test->daemon);
    free(test);
}

const char *em_test_daemon_address(const em_test_daemon *test)
{
    return em_daemon_data_address(test->daemon);
}

const char *em_test_daemon_admin_address(const em_test_daemon *test)
{
    return em_daemon_admin_address(test->daemon);
}

const char *em_test_daemon_metrics_address(const em_test_daemon *test)
{
    return em_daemon_metrics_address(test->daemon);
}

const char *em_test_daemon_admin_token(const em_test_daemon *test)
{
    return test->admin_token;
}

void em_test_daemon_set_delay(em_test_daemon *test, uint32_t delay_ms)
{
    atomic_store(&em_daemon_faults(test->daemon)->delay_ms, delay_ms);
}

void em_test_daemon_close_after(em_test_daemon *test, uint32_t requests)
{
    atomic_store(&em_daemon_faults(test->daemon)->close_after, requests);
}

void em_test_daemon_drop_connections(em_test_daemon *test)
{
    uint64_t open = atomic_load(&em_daemon_stats(test->daemon)->connections_current);
    em_daemon_drop_connections(test->daemon);
    /* done when the loop has closed them (the counter drops as each one closes) */
    for (int waited = 0; open > 0 && waited < 5000; waited++) {
        if (atomic_load(&em_daemon_stats(test->daemon)->connections_current) == 0)
            break;
        usleep(1000);
    }
}

uint64_t em_test_daemon_data_requests(const em_test_daemon *test)
{
    const em_server_stats *stats = em_daemon_stats(test->daemon);
    return atomic_load(&stats->requests[EM_METHOD_SLOT_PULL]) +
           atomic_load(&stats->requests[EM_METHOD_SLOT_PUSH]);
}

uint64_t em_test_daemon_connections(const em_test_daemon *test)
{
    return atomic_load(&em_daemon_stats(test->daemon)->connections_total);
}

uint64_t em_test_daemon_memory_used(const em_test_daemon *test)
{
    return atomic_load(&em_daemon_stats(test->daemon)->memory_used_bytes);
}

uint64_t em_test_daemon_answered(const em_test_daemon *test, int method)
{
    const em_method_info *info = em_method_find(method);
    ck_assert_ptr_nonnull(info);
    size_t slot = (size_t)(info - em_methods);
    return atomic_load(&em_daemon_stats(test->daemon)->requests[slot]);
}

uint64_t em_test_daemon_succeeded(const em_test_daemon *test, int method)
{
    const em_method_info *info = em_method_find(method);
    ck_assert_ptr_nonnull(info);
    size_t slot = (size_t)(info - em_methods);
    const em_server_stats *stats = em_daemon_stats(test->daemon);
    return atomic_load(&stats->requests[slot]) - atomic_load(&stats->errors[slot]);
}
