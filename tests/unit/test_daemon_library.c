/*
 * The daemon as a library (daemon/daemon.h): several daemons in one process, reload
 * through the configuration schema, stop from another thread, and the fault hooks the
 * client suites rely on, observed on the wire.
 */
#include <arpa/inet.h>
#include <cJSON.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clients/ember_client.h"
#include "daemon/daemon.h"
#include "proto/frame.h"
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

START_TEST(reload_applies_the_reloadable_keys_and_keeps_the_rest)
{
    char path[] = "/tmp/ember-daemon-config-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    write_config(path, "first-token", "error", 1000,
                 "{\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:0\"}");
    em_daemon_config config;
    em_error err;
    ck_assert_msg(em_daemon_config_load(path, &config, &err) == EM_OK, "%s", err.message);
    em_daemon_options options;
    em_daemon_options_init(&options);
    options.config_path = path;
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
                 "{\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:1\"}");
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

START_TEST(a_daemon_stopped_before_it_runs_drains_at_once)
{
    const char *json = "{\"listen\": {\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:0\"},"
                       " \"backend\": {\"type\": \"cpu\", \"threads\": 1,"
                       " \"memory_limit_bytes\": 67108864},"
                       " \"admin_token\": {\"value\": \"t\"}, \"log_level\": \"error\"}";
    em_daemon_config config;
    em_error err;
    ck_assert_msg(em_daemon_config_parse_text(json, "test", &config, &err) == EM_OK, "%s",
                  err.message);
    em_daemon_options options;
    em_daemon_options_init(&options);
    em_daemon *daemon = NULL;
    ck_assert_int_eq(em_daemon_create(&config, &options, &daemon, &err), EM_OK);
    em_daemon_config_deinit(&config);
    em_daemon_stop(daemon, "test finished");
    double start = em_test_now();
    ck_assert(em_daemon_run(daemon)); /* drained, not forced */
    ck_assert_double_lt(em_test_now() - start, 5.0);
    em_daemon_destroy(daemon);
}
END_TEST

START_TEST(a_bad_listen_address_fails_create_naming_it)
{
    const char *json = "{\"listen\": {\"data\": \"127.0.0.1:0\", \"admin\": \"256.1.1.1:7\"},"
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

static int connect_to(const char *address)
{
    char host[64];
    snprintf(host, sizeof(host), "%s", address);
    char *colon = strrchr(host, ':');
    ck_assert_ptr_nonnull(colon);
    *colon = '\0';
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    ck_assert_int_eq(inet_pton(AF_INET, host, &to.sin_addr), 1);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(connect(fd, (struct sockaddr *)&to, sizeof(to)), 0);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
}

static void write_all(int fd, const void *data, size_t length)
{
    const uint8_t *bytes = data;
    while (length > 0) {
        ssize_t sent = write(fd, bytes, length);
        ck_assert_int_gt(sent, 0);
        bytes += sent;
        length -= (size_t)sent;
    }
}

static void read_all(int fd, void *data, size_t length)
{
    uint8_t *bytes = data;
    while (length > 0) {
        ssize_t got = read(fd, bytes, length);
        ck_assert_int_gt(got, 0);
        bytes += got;
        length -= (size_t)got;
    }
}

/* Sends a one-key PUSH of a dim-4 gradient to table t with the given correlation id. */
static void send_push(int fd, uint64_t correlation_id, uint64_t key)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = correlation_id;
    meta.method = EMBER__METHOD__PUSH;
    Ember__PushRequest body = EMBER__PUSH_REQUEST__INIT;
    body.table = "t";
    body.rows = 1;
    body.nnz = 1;
    body.combiner = EMBER__COMBINER__NONE;
    uint8_t attachment[32] = {0};
    em_put_u32(attachment + 4, 1); /* offsets {0, 1}, the key at 8, 4 floats at 16 */
    em_put_u64(attachment + 8, key);
    const float gradient[4] = {0.5f, -0.25f, 1.0f, 2.0f};
    memcpy(attachment + 16, gradient, sizeof(gradient));
    uint8_t *frame = NULL;
    size_t length = 0;
    em_error err;
    ck_assert_int_eq(em_frame_pack(&meta, &body.base, sizeof(attachment), &frame, &length, &err),
                     EM_OK);
    write_all(fd, frame, length);
    write_all(fd, attachment, sizeof(attachment));
    free(frame);
}

/* Sends a one-key PULL of table t with the given correlation id (and deadline). */
static void send_pull_by(int fd, uint64_t correlation_id, uint64_t key, uint64_t deadline_ms)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = correlation_id;
    meta.deadline_ms = deadline_ms;
    meta.method = EMBER__METHOD__PULL;
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = "t";
    body.rows = 1;
    body.nnz = 1;
    body.combiner = EMBER__COMBINER__NONE;
    body.create_missing = true;
    uint8_t attachment[16] = {0};
    em_put_u32(attachment + 4, 1); /* offsets {0, 1}, then the key at 8 */
    em_put_u64(attachment + 8, key);
    uint8_t *frame = NULL;
    size_t length = 0;
    em_error err;
    ck_assert_int_eq(em_frame_pack(&meta, &body.base, sizeof(attachment), &frame, &length, &err),
                     EM_OK);
    write_all(fd, frame, length);
    write_all(fd, attachment, sizeof(attachment));
    free(frame);
}

static void send_pull(int fd, uint64_t correlation_id, uint64_t key)
{
    send_pull_by(fd, correlation_id, key, 0);
}

/* Reads one answer; returns its correlation id (status must be OK). */
static uint64_t read_answer(int fd)
{
    uint8_t header[EM_FRAME_HEADER_BYTES];
    read_all(fd, header, sizeof(header));
    em_frame_header frame;
    em_frame_limits limits = em_frame_default_limits();
    em_error err;
    ck_assert_int_eq(em_frame_header_decode(header, &limits, &frame, &err), EM_OK);
    size_t rest = frame.meta_len + (size_t)frame.body_len + (size_t)frame.attach_len;
    uint8_t *bytes = malloc(rest);
    read_all(fd, bytes, rest);
    Ember__RpcMeta *meta = ember__rpc_meta__unpack(NULL, frame.meta_len, bytes);
    ck_assert_ptr_nonnull(meta);
    ck_assert_msg(meta->status == EMBER__STATUS__OK, "%s", meta->error);
    uint64_t id = meta->correlation_id;
    ember__rpc_meta__free_unpacked(meta, NULL);
    free(bytes);
    return id;
}

START_TEST(reverse_answers_sends_pipelined_answers_last_first)
{
    em_test_daemon_options options = {.reverse_responses = true};
    em_test_daemon *daemon = em_test_daemon_start(&options);
    em_client *admin = client_for(em_test_daemon_admin_address(daemon), EM_TEST_DAEMON_ADMIN_TOKEN);
    em_error err;
    ck_assert_int_eq(em_client_create_table(admin, "{\"name\":\"t\",\"dim\":4,\"capacity\":100}",
                                            NULL, &err),
                     EM_OK);
    em_client_destroy(admin);
    /* pushes run one after the other in the connection's order and each waits on its
     * worker, so all three are outstanding when the first is done, and they finish
     * 1, 2, 3 */
    em_test_daemon_set_delay(daemon, 50);
    int fd = connect_to(em_test_daemon_address(daemon));
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
    int fd = connect_to(em_test_daemon_address(daemon));
    send_pull(fd, 1, 10); /* no table: answered with an error, but answered */
    uint8_t header[EM_FRAME_HEADER_BYTES];
    read_all(fd, header, sizeof(header));
    em_frame_header frame;
    em_frame_limits limits = em_frame_default_limits();
    em_error err;
    ck_assert_int_eq(em_frame_header_decode(header, &limits, &frame, &err), EM_OK);
    uint8_t skip[4096];
    read_all(fd, skip, frame.meta_len + (size_t)frame.body_len + (size_t)frame.attach_len);
    send_pull(fd, 2, 20); /* the second request: the connection closes instead */
    ck_assert_int_eq(read(fd, header, sizeof(header)), 0);
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
    em_client *admin = client_for(em_test_daemon_admin_address(daemon), EM_TEST_DAEMON_ADMIN_TOKEN);
    em_error err;
    ck_assert_int_eq(em_client_create_table(admin, "{\"name\":\"t\",\"dim\":4,\"capacity\":100}",
                                            NULL, &err),
                     EM_OK);
    em_client_destroy(admin);
    int fd = connect_to(em_test_daemon_address(daemon));
    send_pull_by(fd, 7, 1, UINT64_MAX - 3);
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
    suite_add_tcase(suite, lifecycle);
    TCase *faults = tcase_create("faults");
    tcase_set_timeout(faults, 60);
    tcase_add_test(faults, reverse_answers_sends_pipelined_answers_last_first);
    tcase_add_test(faults, close_after_closes_the_connection_that_receives_the_request);
    tcase_add_test(faults, a_deadline_near_two_to_the_64_never_expires);
    suite_add_tcase(suite, faults);
    return em_test_run(suite);
}
