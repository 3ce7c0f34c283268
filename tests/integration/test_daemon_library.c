/*
 * The daemon as a library (daemon/daemon.h): several daemons in one process, reload
 * through the configuration schema, stop from another thread, and the fault hooks the
 * client suites rely on, observed on the wire.
 */
#include <cJSON.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clients/ember_client.h"
#include "daemon/daemon.h"
#include "tests/integration/harness.h"
#include "tests/support/test_daemon.h"
#include "tests/support/test_support.h"

static em_client *client_for(const char *address, const char *token)
{
    em_client_options options;
    em_client_options_init(&options);
    options.servers = address;
    options.token = token;
    options.timeout_ms = 5000;
    em_client *client = NULL;
    em_error err;
    ck_assert_msg(em_client_create(&options, &client, &err) == EM_OK, "%s", err.message);
    return client;
}

START_TEST(two_daemons_serve_side_by_side_in_one_process)
{
    em_test_daemon *a = em_test_daemon_start(NULL);
    em_test_daemon *b = em_test_daemon_start(NULL);
    ck_assert_str_ne(em_test_daemon_address(a), em_test_daemon_address(b));
    em_client *admin_a = client_for(em_test_daemon_admin_address(a), EM_TEST_DAEMON_ADMIN_TOKEN);
    em_client *admin_b = client_for(em_test_daemon_admin_address(b), EM_TEST_DAEMON_ADMIN_TOKEN);
    em_error err;
    ck_assert_int_eq(em_client_create_table(admin_a, "{\"name\":\"only_a\",\"dim\":4,"
                                                     "\"capacity\":10}", NULL, &err),
                     EM_OK);
    cJSON *tables = NULL;
    ck_assert_int_eq(em_client_list_tables(admin_b, &tables, &err), EM_OK);
    ck_assert_int_eq(cJSON_GetArraySize(tables), 0); /* nothing shared between them */
    cJSON_Delete(tables);
    ck_assert_int_eq(em_client_list_tables(admin_a, &tables, &err), EM_OK);
    ck_assert_int_eq(cJSON_GetArraySize(tables), 1);
    cJSON_Delete(tables);
    em_client_destroy(admin_a);
    em_client_destroy(admin_b);
    em_test_daemon_stop(a);
    em_test_daemon_stop(b);
}
END_TEST

/* ---- reload ------------------------------------------------------------------------- */

static void write_config(const char *path, const char *admin_token, const char *log_level,
                         uint32_t max_keys, const char *listen)
{
    FILE *file = fopen(path, "w");
    ck_assert_ptr_nonnull(file);
    fprintf(file,
            "{\"listen\": %s, \"backend\": {\"type\": \"cpu\", \"threads\": 2,"
            " \"memory_limit_bytes\": 268435456},"
            " \"limits\": {\"max_keys_per_request\": %u},"
            " \"admin_token\": {\"value\": \"%s\"}, \"log_level\": \"%s\"}",
            listen, max_keys, admin_token, log_level);
    fclose(file);
}

static void *run_daemon(void *daemon)
{
    em_daemon_run(daemon);
    return NULL;
}

/* The status of LIST_TABLES sent with token to the daemon's admin listener. */
static em_status list_with(const em_daemon *daemon, const char *token)
{
    em_client *client = client_for(em_daemon_admin_address(daemon), token);
    cJSON *tables = NULL;
    em_error err;
    em_status status = em_client_list_tables(client, &tables, &err);
    cJSON_Delete(tables);
    em_client_destroy(client);
    return status;
}

/* The service manager notifications a daemon sent, one after another. */
typedef struct notifications {
    pthread_mutex_t lock;
    char text[8192];
} notifications;

static void record_notification(void *context, const char *state)
{
    notifications *n = context;
    pthread_mutex_lock(&n->lock);
    size_t used = strlen(n->text);
    snprintf(n->text + used, sizeof(n->text) - used, "%s\n--\n", state);
    pthread_mutex_unlock(&n->lock);
}

START_TEST(reload_applies_the_reloadable_keys_and_keeps_the_rest)
{
    static notifications sent = {.lock = PTHREAD_MUTEX_INITIALIZER};
    char path[] = "/tmp/ember-daemon-config-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    write_config(path, "first-token", "error", 1000,
                 "{\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:0\", \"metrics\": \"\"}");
    em_daemon_config config;
    em_error err;
    ck_assert_msg(em_daemon_config_load(path, &config, &err) == EM_OK, "%s", err.message);
    em_daemon_options options;
    em_daemon_options_init(&options);
    options.config_path = path;
    options.notify = record_notification;
    options.notify_context = &sent;
    em_daemon *daemon = NULL;
    ck_assert_msg(em_daemon_create(&config, &options, &daemon, &err) == EM_OK, "%s",
                  err.message);
    em_daemon_config_deinit(&config);
    pthread_t thread;
    ck_assert_int_eq(pthread_create(&thread, NULL, run_daemon, daemon), 0);
    ck_assert_int_eq(list_with(daemon, "first-token"), EM_OK);

    /* the token is reloadable; the listen addresses are not (they stay bound) */
    char admin_before[64];
    snprintf(admin_before, sizeof(admin_before), "%s", em_daemon_admin_address(daemon));
    write_config(path, "second-token", "error", 2000,
                 "{\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:1\", \"metrics\": \"\"}");
    em_daemon_reload(daemon);
    em_status status = EM_UNAUTHENTICATED;
    for (int attempt = 0; attempt < 500 && status != EM_OK; attempt++) {
        status = list_with(daemon, "second-token");
        if (status != EM_OK)
            usleep(10 * 1000);
    }
    ck_assert_int_eq(status, EM_OK);
    ck_assert_int_eq(list_with(daemon, "first-token"), EM_UNAUTHENTICATED);
    ck_assert_str_eq(em_daemon_admin_address(daemon), admin_before);
    /* systemd heard the reload, with the monotonic time a notify-reload manager matches */
    pthread_mutex_lock(&sent.lock);
    const char *reloading = strstr(sent.text, "RELOADING=1\nMONOTONIC_USEC=");
    ck_assert_msg(reloading != NULL, "%s", sent.text);
    ck_assert_msg(strtoull(reloading + strlen("RELOADING=1\nMONOTONIC_USEC="), NULL, 10) > 0,
                  "%s", sent.text);
    ck_assert_msg(strstr(reloading, "READY=1") != NULL, "%s", sent.text);
    pthread_mutex_unlock(&sent.lock);

    /* a file that does not parse keeps the running configuration */
    FILE *file = fopen(path, "w");
    fputs("{\"admin_token\": ", file);
    fclose(file);
    em_daemon_reload(daemon);
    usleep(100 * 1000);
    ck_assert_int_eq(list_with(daemon, "second-token"), EM_OK);

    em_daemon_stop(daemon, "test finished");
    pthread_join(thread, NULL);
    em_daemon_destroy(daemon);
    unlink(path);
}
END_TEST

/* A daemon of the library created from json; notifications go to sent when not NULL. */
static em_daemon *daemon_from_json(const char *json, notifications *sent)
{
    em_daemon_config config;
    em_error err;
    ck_assert_msg(em_daemon_config_parse_text(json, "test", &config, &err) == EM_OK, "%s",
                  err.message);
    em_daemon_options options;
    em_daemon_options_init(&options);
    if (sent != NULL) {
        options.notify = record_notification;
        options.notify_context = sent;
    }
    em_daemon *daemon = NULL;
    ck_assert_msg(em_daemon_create(&config, &options, &daemon, &err) == EM_OK, "%s",
                  err.message);
    em_daemon_config_deinit(&config);
    return daemon;
}

START_TEST(a_daemon_stopped_before_it_runs_drains_at_once)
{
    const char *json = "{\"listen\": {\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:0\", \"metrics\": \"\"},"
                       " \"backend\": {\"type\": \"cpu\", \"threads\": 1,"
                       " \"memory_limit_bytes\": 67108864},"
                       " \"admin_token\": {\"value\": \"t\"}, \"log_level\": \"error\"}";
    em_daemon *daemon = daemon_from_json(json, NULL);
    em_daemon_stop(daemon, "test finished");
    double start = em_test_now();
    ck_assert(em_daemon_run(daemon)); /* drained, not forced */
    ck_assert_double_lt(em_test_now() - start, 5.0);
    em_daemon_destroy(daemon);
}
END_TEST

/* A daemon configured from json with a table t and checkpoints under dir (a daemon of
 * the library, with notifications going to sent). */
static em_daemon *checkpointing_daemon(const char *dir, notifications *sent)
{
    char json[1024];
    snprintf(json, sizeof(json),
             "{\"listen\": {\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:0\", "
             "\"metrics\": \"\"}, \"backend\": {\"type\": \"cpu\", \"memory_limit_bytes\": "
             "67108864}, \"admin_token\": {\"value\": \"t\"}, \"log_level\": \"error\", "
             "\"checkpoint\": {\"dir\": \"%s\"}, \"tables\": [{\"name\": \"t\", \"dim\": 4, "
             "\"capacity\": 100}]}", dir);
    return daemon_from_json(json, sent);
}

/* A restore says in STATUS= what it restores, and asks systemd for more start time with
 * each line (EXTEND_TIMEOUT_USEC), so a long load that progresses never times out. */
START_TEST(a_restore_tells_the_service_manager_and_extends_the_start)
{
    static notifications sent = {.lock = PTHREAD_MUTEX_INITIALIZER};
    char dir[256];
    em_test_make_dir("ember-restore", dir, sizeof(dir));
    em_daemon *first = checkpointing_daemon(dir, &sent);
    em_daemon_stop(first, "test finished");
    em_daemon_run(first);
    em_daemon_save_at_shutdown(first);
    em_daemon_destroy(first);
    em_daemon *second = checkpointing_daemon(dir, &sent);
    pthread_mutex_lock(&sent.lock);
    ck_assert_msg(strstr(sent.text, "STATUS=restoring table 't' (1 of 1)\n"
                                    "EXTEND_TIMEOUT_USEC=60000000") != NULL,
                  "%s", sent.text);
    pthread_mutex_unlock(&sent.lock);
    em_daemon_stop(second, "test finished");
    em_daemon_run(second);
    em_daemon_destroy(second);
    em_test_remove_tree(dir);
}
END_TEST

START_TEST(a_bad_listen_address_fails_create_naming_it)
{
    const char *json = "{\"listen\": {\"data\": \"127.0.0.1:0\", \"admin\": \"256.1.1.1:7\", \"metrics\": \"\"},"
                       " \"backend\": {\"type\": \"cpu\", \"memory_limit_bytes\": 67108864},"
                       " \"admin_token\": {\"value\": \"t\"}, \"log_level\": \"error\"}";
    em_daemon_config config;
    em_error err;
    em_status status = em_daemon_config_parse_text(json, "test", &config, &err);
    if (status == EM_OK) {
        em_daemon_options options;
        em_daemon_options_init(&options);
        options.log_fd = -1;
        em_daemon *daemon = NULL;
        status = em_daemon_create(&config, &options, &daemon, &err);
        em_daemon_config_deinit(&config);
        ck_assert_ptr_null(daemon);
    }
    ck_assert_int_ne(status, EM_OK);
    ck_assert_msg(strstr(err.message, "256.1.1.1:7") != NULL, "%s", err.message);
}
END_TEST

/* ---- faults, on the wire ------------------------------------------------------------ */

/* One-key requests to table t (dim 4); keys and gradients travel in the attachment. */
static void send_one(int fd, const Ember__RpcMeta *meta, const ProtobufCMessage *body,
                     uint64_t key, const float *gradient)
{
    const uint32_t offsets[] = {0, 1};
    size_t length = 0;
    uint8_t *attachment =
        test_csr_attachment(1, offsets, 1, &key, gradient, gradient != NULL ? 4 : 0, &length);
    ck_assert(test_send_frame(fd, meta, body, attachment, length));
    free(attachment);
}

static void send_push(int fd, uint64_t correlation_id, uint64_t key)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = correlation_id;
    meta.method = EMBER__METHOD__PUSH;
    Ember__PushRequest body = EMBER__PUSH_REQUEST__INIT;
    body.table = "t";
    body.rows = 1;
    body.nnz = 1;
    const float gradient[4] = {0.5f, -0.25f, 1.0f, 2.0f};
    send_one(fd, &meta, &body.base, key, gradient);
}

static void send_pull(int fd, uint64_t correlation_id, uint64_t key, uint64_t deadline_ms)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = correlation_id;
    meta.method = EMBER__METHOD__PULL;
    meta.deadline_ms = deadline_ms;
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = "t";
    body.rows = 1;
    body.nnz = 1;
    body.create_missing = true;
    send_one(fd, &meta, &body.base, key, NULL);
}

/* Reads one answer; returns its correlation id (status must be OK). */
static uint64_t read_answer(int fd)
{
    test_frame frame;
    ck_assert_int_eq(test_read_frame(fd, 10000, &frame), 1);
    ck_assert_msg(frame.meta->status == EMBER__STATUS__OK, "%s", frame.meta->error);
    uint64_t id = frame.meta->correlation_id;
    test_frame_free(&frame);
    return id;
}

static void create_table_t(const em_test_daemon *daemon)
{
    em_client *admin = client_for(em_test_daemon_admin_address(daemon), EM_TEST_DAEMON_ADMIN_TOKEN);
    em_error err;
    ck_assert_int_eq(em_client_create_table(admin, "{\"name\":\"t\",\"dim\":4,\"capacity\":100}",
                                            NULL, &err),
                     EM_OK);
    em_client_destroy(admin);
}

START_TEST(reverse_answers_sends_pipelined_answers_last_first)
{
    em_test_daemon_options options = {.reverse_responses = true};
    em_test_daemon *daemon = em_test_daemon_start(&options);
    create_table_t(daemon);
    /* pushes run one after the other in the connection's order and each waits on its
     * worker, so all three are outstanding when the first is done, and they finish
     * 1, 2, 3 */
    em_test_daemon_set_delay(daemon, 50);
    int fd = test_connect(em_test_daemon_address(daemon));
    for (uint64_t id = 1; id <= 3; id++)
        send_push(fd, id, id * 10);
    uint64_t order[3];
    for (int i = 0; i < 3; i++)
        order[i] = read_answer(fd);
    ck_assert_uint_eq(order[0], 3);
    ck_assert_uint_eq(order[1], 2);
    ck_assert_uint_eq(order[2], 1);
    close(fd);
    em_test_daemon_stop(daemon);
}
END_TEST

START_TEST(close_after_closes_the_connection_that_receives_the_request)
{
    em_test_daemon *daemon = em_test_daemon_start(NULL);
    em_test_daemon_close_after(daemon, 2);
    int fd = test_connect(em_test_daemon_address(daemon));
    send_pull(fd, 1, 10, 0); /* no table: answered with an error, but answered */
    test_frame frame;
    ck_assert_int_eq(test_read_frame(fd, 10000, &frame), 1);
    ck_assert_int_eq(frame.meta->status, EMBER__STATUS__NOT_FOUND);
    test_frame_free(&frame);
    send_pull(fd, 2, 20, 0); /* the second request: the connection closes instead */
    ck_assert_int_eq(test_read_frame(fd, 10000, &frame), 0);
    close(fd);
    ck_assert_uint_eq(em_test_daemon_data_requests(daemon), 1);
    em_test_daemon_stop(daemon);
}
END_TEST

/* A deadline so far away that now + deadline overflows is no deadline at all, not one
 * already passed. */
START_TEST(a_deadline_near_two_to_the_64_never_expires)
{
    em_test_daemon *daemon = em_test_daemon_start(NULL);
    create_table_t(daemon);
    int fd = test_connect(em_test_daemon_address(daemon));
    send_pull(fd, 7, 1, UINT64_MAX - 3);
    ck_assert_uint_eq(read_answer(fd), 7); /* status OK, checked inside */
    close(fd);
    em_test_daemon_stop(daemon);
}
END_TEST

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    Suite *suite = suite_create("daemon_library");
    TCase *lifecycle = tcase_create("lifecycle");
    tcase_set_timeout(lifecycle, 60);
    tcase_add_test(lifecycle, two_daemons_serve_side_by_side_in_one_process);
    tcase_add_test(lifecycle, reload_applies_the_reloadable_keys_and_keeps_the_rest);
    tcase_add_test(lifecycle, a_daemon_stopped_before_it_runs_drains_at_once);
    tcase_add_test(lifecycle, a_bad_listen_address_fails_create_naming_it);
    tcase_add_test(lifecycle, a_restore_tells_the_service_manager_and_extends_the_start);
    suite_add_tcase(suite, lifecycle);
    TCase *faults = tcase_create("faults");
    tcase_set_timeout(faults, 60);
    tcase_add_test(faults, reverse_answers_sends_pipelined_answers_last_first);
    tcase_add_test(faults, close_after_closes_the_connection_that_receives_the_request);
    tcase_add_test(faults, a_deadline_near_two_to_the_64_never_expires);
    suite_add_tcase(suite, faults);
    return em_test_run(suite);
}
