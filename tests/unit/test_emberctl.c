/*
 * emberctl as a user runs it: the built binary (its path is this program's first
 * argument) against a real daemon in the test process (tests/support/test_daemon.h),
 * checking output and exit status.
 */
#include <arpa/inet.h>
#include <cJSON.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clients/ember_client.h"
#include "ember_config.h"
#include "tests/support/test_daemon.h"
#include "tests/support/test_support.h"

#define DEVELOPMENT_TOKEN "ember-dev-admin-token"
#define OUTPUT_MAX 16384

static const char *emberctl_path;

typedef struct run_result {
    int code;
    char out[OUTPUT_MAX];
    char err[OUTPUT_MAX];
} run_result;

static void slurp(FILE *file, char *buffer)
{
    rewind(file);
    size_t got = fread(buffer, 1, OUTPUT_MAX - 1, file);
    buffer[got] = '\0';
    fclose(file);
}

/* Runs emberctl with args (NULL-terminated); token_env sets EMBER_ADMIN_TOKEN. */
static run_result *run(const char *token_env, const char *const *args)
{
    static run_result result;
    FILE *out = tmpfile(), *err = tmpfile();
    ck_assert(out != NULL && err != NULL);
    const char *argv[32] = {emberctl_path};
    int argc = 1;
    for (; args[argc - 1] != NULL; argc++)
        argv[argc] = args[argc - 1];
    argv[argc] = NULL;
    fflush(NULL);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        dup2(fileno(out), STDOUT_FILENO);
        dup2(fileno(err), STDERR_FILENO);
        if (token_env != NULL)
            setenv("EMBER_ADMIN_TOKEN", token_env, 1);
        else
            unsetenv("EMBER_ADMIN_TOKEN");
        execv(emberctl_path, (char *const *)argv);
        _exit(127);
    }
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert(WIFEXITED(status));
    result.code = WEXITSTATUS(status);
    slurp(out, result.out);
    slurp(err, result.err);
    return &result;
}

#define RUN(token, ...) run(token, (const char *const[]){__VA_ARGS__, NULL})

static em_test_daemon *dev_server(void)
{
    em_test_daemon_options options = {.admin_token = DEVELOPMENT_TOKEN};
    return em_test_daemon_start(&options);
}

START_TEST(version_and_help)
{
    run_result *r = RUN(NULL, "--version");
    ck_assert_int_eq(r->code, 0);
    ck_assert_str_eq(r->out, "emberctl " EM_VERSION "\n");
    r = RUN(NULL, "--help");
    ck_assert_int_eq(r->code, 0);
    ck_assert(strstr(r->out, "tables create --name N --dim D --capacity C") != NULL);
    ck_assert(strstr(r->out, "\"ember-dev-admin-token\": the development default") != NULL);
    ck_assert(strstr(r->out, "127.0.0.1:7071") != NULL);
}
END_TEST

START_TEST(usage_errors_exit_2_and_say_what_was_wrong)
{
    run_result *r = RUN(NULL, "--json");
    ck_assert_int_eq(r->code, 2);
    ck_assert(strstr(r->err, "emberctl: no command given") == r->err);
    r = RUN(NULL, "frobnicate");
    ck_assert_int_eq(r->code, 2);
    ck_assert(strstr(r->err, "unknown command 'frobnicate'") != NULL);
    r = RUN(NULL, "--timeout", "soon", "ping");
    ck_assert_int_eq(r->code, 2);
    ck_assert(strstr(r->err, "--timeout 'soon'") != NULL);
    r = RUN(NULL, "--server", "localhost", "ping");
    ck_assert_int_eq(r->code, 2);
    ck_assert(strstr(r->err, "emberctl: INVALID_ARGUMENT: server list entry 1 'localhost' has "
                            "no port") != NULL);
    /* arguments are checked before connecting: nothing listens on port 1 */
    r = RUN(NULL, "--server", "127.0.0.1:1", "tables", "create", "--name", "t", "--dim", "x",
            "--capacity", "10");
    ck_assert_int_eq(r->code, 2);
    ck_assert(strstr(r->err, "--dim 'x' is not a whole number") != NULL);
    r = RUN(NULL, "--server", "127.0.0.1:1", "tables", "create", "--name", "t");
    ck_assert_int_eq(r->code, 2);
    ck_assert(strstr(r->err, "needs --name, --dim and --capacity") != NULL);
    r = RUN(NULL, "tables", "create", "--json-config", "{broken");
    ck_assert_int_eq(r->code, 2);
    r = RUN(NULL, "tables", "drop");
    ck_assert_int_eq(r->code, 2);
    r = RUN(NULL, "--token-file", "/nonexistent/token", "ping");
    ck_assert_int_eq(r->code, 2);
    ck_assert(strstr(r->err, "cannot read token file '/nonexistent/token'") != NULL);
    /* checkpoints list DIR TABLE reads a dir on this host: a path that is not one */
    r = RUN(NULL, "checkpoints", "list", "/nonexistent/checkpoints", "t");
    ck_assert_int_eq(r->code, 1);
    ck_assert_msg(strstr(r->err, "'/nonexistent/checkpoints' is not a directory") != NULL, "%s",
                  r->err);
    char empty[256];
    em_test_make_dir("ember-emberctl", empty, sizeof(empty));
    r = RUN(NULL, "checkpoints", "list", empty);
    ck_assert_int_eq(r->code, 0);
    ck_assert_msg(strstr(r->out, "no checkpoints under ") == r->out, "%s", r->out);
    em_test_remove_tree(empty);
}
END_TEST

START_TEST(no_server_exits_3)
{
    int holder = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = 0};
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_int_eq(bind(holder, (struct sockaddr *)&address, sizeof(address)), 0);
    socklen_t length = sizeof(address);
    getsockname(holder, (struct sockaddr *)&address, &length);
    char server[64], expected[256];
    snprintf(server, sizeof(server), "127.0.0.1:%u", ntohs(address.sin_port));
    run_result *r = RUN(NULL, "--server", server, "ping");
    ck_assert_int_eq(r->code, 3);
    snprintf(expected, sizeof(expected),
             "emberctl: UNAVAILABLE: server %s: cannot connect: Connection refused\n", server);
    ck_assert_str_eq(r->err, expected);
    close(holder);
}
END_TEST

START_TEST(tables_lifecycle_in_text_and_json)
{
    em_test_daemon *server = dev_server();
    const char *at = em_test_daemon_admin_address(server);
    run_result *r = RUN(NULL, "--server", at, "tables", "list");
    ck_assert_int_eq(r->code, 0);
    ck_assert_str_eq(r->out, "no tables\n");
    r = RUN(NULL, "--server", at, "tables", "create", "--name", "clicks", "--dim", "16",
            "--capacity", "1000000", "--shards", "4", "--optimizer", "adagrad", "--lr", "0.05",
            "--initializer", "zeros", "--seed", "7");
    ck_assert_msg(r->code == 0, "%s", r->err);
    ck_assert_str_eq(r->out, "created table 'clicks': dim 16, capacity 1000000, 4 shards, "
                             "adagrad\n");
    r = RUN(NULL, "--server", at, "tables", "create", "--json-config",
            "{\"name\":\"users\",\"dim\":8,\"capacity\":500}");
    ck_assert_msg(r->code == 0, "%s", r->err);
    r = RUN(NULL, "--server", at, "tables", "list");
    ck_assert_int_eq(r->code, 0);
    ck_assert_str_eq(r->out, "NAME    DIM  CAPACITY  SHARDS  OPTIMIZER  ROWS\n"
                             "clicks   16   1000000       4  adagrad       0\n"
                             "users     8       500       1  sgd           0\n");
    r = RUN(NULL, "--server", at, "--json", "tables", "list");
    ck_assert_int_eq(r->code, 0);
    cJSON *json = cJSON_Parse(r->out);
    ck_assert(cJSON_IsArray(json));
    ck_assert_int_eq(cJSON_GetArraySize(json), 2);
    const cJSON *config = cJSON_GetObjectItem(cJSON_GetArrayItem(json, 0), "config");
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(config, "initializer"), "type")
                         ->valuestring,
                     "zeros");
    cJSON_Delete(json);
    /* a seed from 2^53 on travels as digits: as a JSON number 2^53 + 1 would become 2^53 */
    r = RUN(NULL, "--server", at, "tables", "create", "--name", "seeded", "--dim", "4",
            "--capacity", "10", "--initializer", "uniform", "--seed", "9007199254740993");
    ck_assert_msg(r->code == 0, "%s", r->err);
    r = RUN(NULL, "--server", at, "--json", "tables", "list");
    ck_assert_int_eq(r->code, 0);
    json = cJSON_Parse(r->out);
    ck_assert_int_eq(cJSON_GetArraySize(json), 3);
    const cJSON *seed = NULL;
    for (int t = 0; t < 3; t++) {
        const cJSON *table = cJSON_GetArrayItem(json, t);
        if (strcmp(cJSON_GetObjectItem(table, "name")->valuestring, "seeded") == 0)
            seed = cJSON_GetObjectItem(
                cJSON_GetObjectItem(cJSON_GetObjectItem(table, "config"), "initializer"), "seed");
    }
    ck_assert(seed != NULL && cJSON_IsString(seed));
    ck_assert_str_eq(seed->valuestring, "9007199254740993");
    cJSON_Delete(json);
    r = RUN(NULL, "--server", at, "tables", "drop", "seeded");
    ck_assert_int_eq(r->code, 0);
    r = RUN(NULL, "--server", at, "tables", "create", "--name", "clicks", "--dim", "16",
            "--capacity", "10");
    ck_assert_int_eq(r->code, 1);
    ck_assert(strstr(r->err, "emberctl: server ") == r->err);
    ck_assert(strstr(r->err, ": ALREADY_EXISTS: ") != NULL);
    r = RUN(NULL, "--server", at, "tables", "drop", "clicks");
    ck_assert_int_eq(r->code, 0);
    ck_assert_str_eq(r->out, "dropped table 'clicks'\n");
    r = RUN(NULL, "--server", at, "tables", "drop", "clicks");
    ck_assert_int_eq(r->code, 1);
    char expected[128];
    snprintf(expected, sizeof(expected),
             "emberctl: server %s: NOT_FOUND: no table 'clicks' (tables: users)\n", at);
    ck_assert_str_eq(r->err, expected);
    em_test_daemon_stop(server);
}
END_TEST

START_TEST(tokens_come_from_flag_file_environment_or_default)
{
    em_test_daemon_options options = {.admin_token = "s3cret"};
    em_test_daemon *server = em_test_daemon_start(&options);
    const char *at = em_test_daemon_admin_address(server);
    /* the development default is not this server's token */
    run_result *r = RUN(NULL, "--server", at, "tables", "list");
    ck_assert_int_eq(r->code, 1);
    ck_assert(strstr(r->err, "emberctl: server ") == r->err);
    ck_assert(strstr(r->err, ": UNAUTHENTICATED: ") != NULL);
    r = RUN("s3cret", "--server", at, "tables", "list");
    ck_assert_msg(r->code == 0, "%s", r->err);
    r = RUN("s3cret", "--server", at, "--token", "wrong", "tables", "list");
    ck_assert_int_eq(r->code, 1);
    r = RUN(NULL, "--server", at, "--token", "s3cret", "tables", "list");
    ck_assert_int_eq(r->code, 0);
    char path[] = "/tmp/emberctl-token-XXXXXX";
    int fd = mkstemp(path);
    ck_assert(write(fd, "s3cret\n", 7) == 7);
    close(fd);
    r = RUN("wrong", "--server", at, "--token-file", path, "tables", "list");
    ck_assert_msg(r->code == 0, "%s", r->err);
    unlink(path);
    em_test_daemon_stop(server);

    server = dev_server();
    r = RUN(NULL, "--server", em_test_daemon_admin_address(server), "tables", "list");
    ck_assert_msg(r->code == 0, "%s", r->err);
    em_test_daemon_stop(server);
}
END_TEST

START_TEST(ping_health_and_stats)
{
    em_test_daemon *server = dev_server();
    const char *at = em_test_daemon_admin_address(server);
    run_result *r = RUN(NULL, "--server", at, "ping");
    ck_assert_int_eq(r->code, 0);
    ck_assert(strstr(r->out, "pong from ") == r->out);
    ck_assert(strstr(r->out, "version " EM_VERSION ", up ") != NULL);
    r = RUN(NULL, "--server", at, "health");
    ck_assert_int_eq(r->code, 0);
    ck_assert(strstr(r->out, "ready    yes\nstate    serving\nbackend  cpu\n") != NULL);
    r = RUN(NULL, "--server", at, "--json", "health");
    ck_assert_int_eq(r->code, 0);
    cJSON *json = cJSON_Parse(r->out);
    ck_assert(cJSON_IsTrue(cJSON_GetObjectItem(json, "ready")));
    cJSON_Delete(json);

    r = RUN(NULL, "--server", at, "tables", "create", "--name", "t", "--dim", "4", "--capacity",
            "100");
    ck_assert_int_eq(r->code, 0);
    r = RUN(NULL, "--server", at, "stats");
    ck_assert_msg(r->code == 0, "%s", r->err);
    ck_assert(strstr(r->out, "server\n  version      " EM_VERSION "\n  state        serving\n") ==
              r->out);
    ck_assert_msg(strstr(r->out, "\nMETHOD        REQUESTS  ERRORS\n"
                                 "PULL                 0       0\n") != NULL,
                  "%s", r->out);
    ck_assert(strstr(r->out, "\nTABLE  ROWS  CAPACITY  DIM  SHARDS") != NULL);
    ck_assert(strstr(r->out, "\nPOOL   IN USE  RESERVED    LIMIT") != NULL);
    /* the table's 2 KiB in a 64 MiB region of the 1 GiB pool, all free space in one block */
    ck_assert_msg(strstr(r->out, "cpu0  2.0 KiB  64.0 MiB  1.0 GiB  2.0 KiB      64.0 MiB"
                                 "           0.0%\n") != NULL,
                  "%s", r->out);
    r = RUN(NULL, "--server", at, "--json", "stats", "t");
    ck_assert_int_eq(r->code, 0);
    json = cJSON_Parse(r->out);
    ck_assert(cJSON_IsObject(cJSON_GetObjectItem(json, "server")));
    ck_assert(cJSON_IsArray(cJSON_GetObjectItem(json, "pools")));
    cJSON_Delete(json);
    em_test_daemon_stop(server);
}
END_TEST

/* ---- top, over live traffic ---------------------------------------------------------- */

#define TOP_KEYS 8

typedef struct pull_loop {
    const char *address;
    atomic_bool stop;
    uint64_t pulls;
} pull_loop;

static void *pull_until_stopped(void *arg)
{
    pull_loop *loop = arg;
    em_client_options options;
    em_client_options_init(&options);
    options.servers = loop->address;
    em_client *client = NULL;
    em_error err;
    if (em_client_create(&options, &client, &err) != EM_OK)
        return NULL;
    uint32_t offsets[TOP_KEYS + 1];
    uint64_t keys[TOP_KEYS];
    float out[TOP_KEYS * 4];
    for (uint32_t i = 0; i <= TOP_KEYS; i++)
        offsets[i] = i;
    for (uint32_t i = 0; i < TOP_KEYS; i++)
        keys[i] = i;
    while (!atomic_load(&loop->stop)) {
        em_client_pull_args args = {.table = "t",
                                    .batch = {.rows = TOP_KEYS, .nnz = TOP_KEYS,
                                              .offsets = offsets, .keys = keys},
                                    .combiner = EM_COMBINER_NONE,
                                    .create_missing = true,
                                    .out = out,
                                    .out_capacity = TOP_KEYS * 4};
        if (em_client_pull(client, &args, NULL, &err) != EM_OK)
            break;
        loop->pulls++;
    }
    em_client_destroy(client);
    return NULL;
}

static double number_of(const cJSON *object, const char *name)
{
    const cJSON *item = cJSON_GetObjectItem(object, name);
    ck_assert_msg(cJSON_IsNumber(item), "no number '%s'", name);
    return item->valuedouble;
}

START_TEST(top_shows_the_rates_and_latency_of_live_traffic)
{
    em_test_daemon *server = dev_server();
    const char *at = em_test_daemon_admin_address(server);
    run_result *r = RUN(NULL, "--server", at, "tables", "create", "--name", "t", "--dim", "4",
                        "--capacity", "100");
    ck_assert_int_eq(r->code, 0);
    pull_loop loop = {.address = em_test_daemon_address(server)};
    pthread_t thread;
    ck_assert_int_eq(pthread_create(&thread, NULL, pull_until_stopped, &loop), 0);

    r = RUN(NULL, "--server", at, "--json", "top", "--once", "--interval", "0.5");
    ck_assert_msg(r->code == 0, "%s", r->err);
    cJSON *view = cJSON_Parse(r->out);
    ck_assert_msg(view != NULL, "%s", r->out);
    ck_assert_double_ge(number_of(view, "seconds"), 0.45);
    const cJSON *pull = NULL, *m;
    cJSON_ArrayForEach(m, cJSON_GetObjectItem(view, "methods"))
    {
        if (strcmp(cJSON_GetObjectItem(m, "method")->valuestring, "PULL") == 0)
            pull = m;
    }
    ck_assert_msg(pull != NULL, "%s", r->out);
    double pulls_per_second = number_of(pull, "requests_per_second");
    ck_assert_double_gt(pulls_per_second, 0);
    ck_assert_double_eq(number_of(pull, "errors_per_second"), 0);
    double p50 = number_of(pull, "p50_seconds"), p90 = number_of(pull, "p90_seconds");
    double p99 = number_of(pull, "p99_seconds");
    ck_assert_msg(p50 > 0 && p50 <= p90 && p90 <= p99 && p99 <= 10.0, "%g %g %g", p50, p90,
                  p99);
    const cJSON *table = cJSON_GetArrayItem(cJSON_GetObjectItem(view, "tables"), 0);
    ck_assert_str_eq(cJSON_GetObjectItem(table, "name")->valuestring, "t");
    ck_assert_double_eq(number_of(table, "rows"), TOP_KEYS);
    /* each pull reads TOP_KEYS keys (the table counts pulls and keys one after the other,
     * so a pull may fall between them) */
    double per_second = number_of(table, "pulls_per_second");
    double seconds = number_of(view, "seconds");
    ck_assert_double_eq_tol(number_of(table, "keys_pulled_per_second") * seconds,
                            per_second * seconds * TOP_KEYS, TOP_KEYS + 0.5);
    /* the table counts a pull as it serves it, the server as it answers, and STATS reads
     * the two one after the other: each view's pair may be a pull apart, plus one that
     * completed between the two reads, so their differences over the interval within 2 */
    ck_assert_double_eq_tol(per_second * seconds, pulls_per_second * seconds, 2.5);
    cJSON_Delete(view);

    /* for a person: two views, one after the other (no terminal: no redrawing) */
    r = RUN(NULL, "--server", at, "top", "--count", "2", "--interval", "0.2");
    ck_assert_msg(r->code == 0, "%s", r->err);
    const char *second = strstr(r->out, "rates over the last");
    ck_assert_msg(second != NULL && strstr(second + 1, "rates over the last") != NULL, "%s",
                  r->out);
    ck_assert_msg(strstr(r->out, "\nMETHOD  ") != NULL && strstr(r->out, "\nPULL  ") != NULL &&
                      strstr(r->out, "\nTABLE  ROWS  FILL  PULLS/S") != NULL &&
                      strstr(r->out, "\nt  ") != NULL && strstr(r->out, "\nPOOL  ") != NULL,
                  "%s", r->out);
    ck_assert(strchr(r->out, '\033') == NULL);
    atomic_store(&loop.stop, true);
    pthread_join(thread, NULL);
    ck_assert_uint_gt(loop.pulls, 0);

    r = RUN(NULL, "--server", at, "top", "--interval", "0");
    ck_assert_int_eq(r->code, 2);
    ck_assert_msg(strstr(r->err, "--interval '0' is not a number of seconds") != NULL, "%s",
                  r->err);
    r = RUN("wrong-token", "--server", at, "top", "--once");
    ck_assert_int_eq(r->code, 1);
    em_test_daemon_stop(server);
}
END_TEST

/* ---- capacity: eviction, evicted keys, erase --------------------------------------------- */

static void pull_one(em_client *client, uint64_t key)
{
    uint32_t offsets[2] = {0, 1};
    float out[4];
    em_client_pull_args args = {.table = "t",
                                .batch = {.rows = 1, .nnz = 1, .offsets = offsets, .keys = &key},
                                .combiner = EM_COMBINER_NONE,
                                .create_missing = true,
                                .out = out,
                                .out_capacity = 4};
    em_error err;
    ck_assert_msg(em_client_pull(client, &args, NULL, &err) == EM_OK, "%s", err.message);
}

START_TEST(eviction_evicted_keys_and_erase_through_emberctl)
{
    em_test_daemon *server = dev_server();
    const char *at = em_test_daemon_admin_address(server);
    run_result *r = RUN(NULL, "--server", at, "tables", "create", "--name", "t", "--dim", "4",
                        "--capacity", "4", "--shards", "1", "--eviction", "lru",
                        "--candidates", "64", "--ring", "8");
    ck_assert_msg(r->code == 0, "%s", r->err);
    r = RUN(NULL, "--server", at, "tables", "create", "--name", "u", "--dim", "4",
            "--capacity", "4", "--eviction", "mru");
    ck_assert_int_eq(r->code, 1);
    ck_assert_msg(strstr(r->err, "eviction.policy") != NULL && strstr(r->err, "mru") != NULL,
                  "%s", r->err);
    r = RUN(NULL, "--server", at, "tables", "create", "--name", "u", "--dim", "4",
            "--capacity", "4", "--eviction", "lru", "--headroom", "0.9");
    ck_assert_int_eq(r->code, 1);
    ck_assert_msg(strstr(r->err, "table.eviction.headroom: must be >= 0 and <= 0.5, got 0.9") !=
                      NULL, "%s", r->err);
    r = RUN(NULL, "--server", at, "tables", "create", "--name", "u", "--dim", "4",
            "--capacity", "4", "--eviction", "lru", "--headroom", "0.25");
    ck_assert_msg(r->code == 0, "%s", r->err);
    r = RUN(NULL, "--server", at, "--json", "tables", "list");
    cJSON *tables = cJSON_Parse(r->out);
    const cJSON *eviction = cJSON_GetObjectItem(
        cJSON_GetObjectItem(cJSON_GetArrayItem(tables, 1), "config"), "eviction");
    ck_assert_double_eq(cJSON_GetObjectItem(eviction, "headroom")->valuedouble, 0.25);
    cJSON_Delete(tables);
    r = RUN(NULL, "--server", at, "tables", "drop", "u");
    ck_assert_int_eq(r->code, 0);
    em_client_options options;
    em_client_options_init(&options);
    options.servers = em_test_daemon_address(server);
    em_client *client = NULL;
    em_error err;
    ck_assert(em_client_create(&options, &client, &err) == EM_OK);
    for (uint64_t key = 1; key <= 6; key++)
        pull_one(client, key);
    em_client_destroy(client);

    /* keys 1 and 2 made room for 5 and 6 */
    r = RUN(NULL, "--server", at, "evicted", "t");
    ck_assert_msg(r->code == 0, "%s", r->err);
    ck_assert_str_eq(r->out,
                     "table 't': 2 key(s) evicted or expired in all; sequence 1 to 2 below\n1\n2\n");
    /* a sequence past the server's count: said, so that a poller knows to start over */
    r = RUN(NULL, "--server", at, "evicted", "t", "--after", "7");
    ck_assert_msg(r->code == 0, "%s", r->err);
    ck_assert_str_eq(r->out, "table 't': 2 key(s) evicted or expired in all; --after 7 is past "
                             "them all: the table went back to a checkpoint (or this is another "
                             "server)\n");
    r = RUN(NULL, "--server", at, "--json", "evicted", "t", "--after", "1");
    ck_assert_int_eq(r->code, 0);
    cJSON *json = cJSON_Parse(r->out);
    ck_assert_double_eq(cJSON_GetObjectItem(json, "first")->valuedouble, 2);
    ck_assert_double_eq(cJSON_GetObjectItem(json, "total")->valuedouble, 2);
    ck_assert_double_eq(cJSON_GetObjectItem(json, "missed")->valuedouble, 0);
    ck_assert_str_eq(cJSON_GetArrayItem(cJSON_GetObjectItem(json, "keys"), 0)->valuestring, "2");
    cJSON_Delete(json);

    /* erase from the command line and from a file */
    r = RUN(NULL, "--server", at, "erase", "t", "3", "99");
    ck_assert_msg(r->code == 0, "%s", r->err);
    ck_assert_str_eq(r->out, "erased 1 of 2 listed key(s) from table 't'\n");
    char path[4096];
    const char *tmpdir = getenv("TMPDIR");
    snprintf(path, sizeof(path), "%s/ember-keys-XXXXXX",
             tmpdir != NULL && tmpdir[0] != '\0' ? tmpdir : "/tmp");
    int fd = mkstemp(path);
    ck_assert(fd >= 0);
    const char *lines = "# keys to forget\n4\n\n5\n";
    ck_assert(write(fd, lines, strlen(lines)) == (ssize_t)strlen(lines));
    close(fd);
    r = RUN(NULL, "--server", at, "--json", "erase", "t", "--file", path);
    ck_assert_msg(r->code == 0, "%s", r->err);
    json = cJSON_Parse(r->out);
    ck_assert_double_eq(cJSON_GetObjectItem(json, "erased")->valuedouble, 2);
    ck_assert_double_eq(cJSON_GetObjectItem(json, "listed")->valuedouble, 2);
    cJSON_Delete(json);
    unlink(path);
    r = RUN(NULL, "--server", at, "--json", "stats", "t");
    json = cJSON_Parse(r->out);
    const cJSON *table = cJSON_GetArrayItem(cJSON_GetObjectItem(json, "tables"), 0);
    ck_assert_double_eq(cJSON_GetObjectItem(table, "rows")->valuedouble, 1);
    ck_assert_double_eq(cJSON_GetObjectItem(table, "rows_evicted")->valuedouble, 2);
    ck_assert_double_eq(cJSON_GetObjectItem(table, "rows_erased")->valuedouble, 3);
    ck_assert_double_eq(cJSON_GetObjectItem(table, "access_bytes")->valuedouble,
                        cJSON_GetObjectItem(table, "access_bytes")->valuedouble);
    ck_assert_double_gt(cJSON_GetObjectItem(table, "access_bytes")->valuedouble, 0);
    cJSON_Delete(json);

    /* mistakes: a bad key, no keys, an unknown table, the wrong token */
    r = RUN(NULL, "--server", at, "erase", "t", "12x");
    ck_assert_int_eq(r->code, 2);
    ck_assert_msg(strstr(r->err, "'12x' is not a key") != NULL, "%s", r->err);
    r = RUN(NULL, "--server", at, "erase", "t");
    ck_assert_int_eq(r->code, 2);
    r = RUN(NULL, "--server", at, "erase", "nope", "1");
    ck_assert_int_eq(r->code, 1);
    ck_assert_msg(strstr(r->err, "NOT_FOUND") != NULL, "%s", r->err);
    r = RUN("wrong-token", "--server", at, "erase", "t", "1");
    ck_assert_int_eq(r->code, 1);
    r = RUN(NULL, "--server", at, "evicted", "t", "--max", "x");
    ck_assert_int_eq(r->code, 2);
    /* a server without a checkpoint section has no checkpoints to list */
    r = RUN(NULL, "--server", at, "checkpoints", "list");
    ck_assert_int_eq(r->code, 1);
    ck_assert_msg(strstr(r->err, "FAILED_PRECONDITION") != NULL &&
                      strstr(r->err, "no checkpoint section") != NULL, "%s", r->err);

    /* by age: key 6 stays (pushed last), key 1 goes; 0 would take every row */
    r = RUN(NULL, "--server", at, "erase", "t", "--not-pushed-for", "1");
    ck_assert_msg(r->code == 0, "%s", r->err);
    ck_assert_msg(strstr(r->out, "erased ") == r->out, "%s", r->out);
    r = RUN(NULL, "--server", at, "erase", "t", "--not-pushed-for", "0");
    ck_assert_int_eq(r->code, 2);
    ck_assert_msg(strstr(r->err, "pushes in 1..2147483647") != NULL, "%s", r->err);
    r = RUN(NULL, "--server", at, "erase", "t", "--not-pushed-for", "x");
    ck_assert_int_eq(r->code, 2);

    /* expiry: the daemon's sweep removes rows not pushed in the last 3 pushes */
    r = RUN(NULL, "--server", at, "tables", "create", "--name", "x", "--dim", "4",
            "--capacity", "100", "--max-age-steps", "3");
    ck_assert_msg(r->code == 0, "%s", r->err);
    ck_assert(em_client_create(&options, &client, &err) == EM_OK);
    uint32_t offsets[2] = {0, 1};
    float gradient[4] = {0.1f, 0.1f, 0.1f, 0.1f};
    for (uint64_t key = 1; key <= 10; key++) {
        uint64_t pushed = key <= 5 ? key : 6; /* keys 1..5, then key 6 five times */
        em_client_push_args args = {.table = "x",
                                    .batch = {.rows = 1, .nnz = 1, .offsets = offsets,
                                              .keys = &pushed},
                                    .combiner = EM_COMBINER_NONE,
                                    .gradients = gradient,
                                    .gradient_count = 4};
        ck_assert_msg(em_client_push(client, &args, NULL, &err) == EM_OK, "%s", err.message);
    }
    em_client_destroy(client);
    double expired = 0;
    for (int wait = 0; wait < 100 && expired < 5; wait++) {
        usleep(50 * 1000);
        r = RUN(NULL, "--server", at, "--json", "stats", "x");
        json = cJSON_Parse(r->out);
        table = cJSON_GetArrayItem(cJSON_GetObjectItem(json, "tables"), 0);
        expired = cJSON_GetObjectItem(table, "rows_expired")->valuedouble;
        cJSON_Delete(json);
    }
    ck_assert_double_eq(expired, 5);
    r = RUN(NULL, "--server", at, "evicted", "x");
    ck_assert_msg(strstr(r->out, "table 'x': 5 key(s) evicted or expired in all") == r->out, "%s",
                  r->out);
    em_test_daemon_stop(server);
}
END_TEST

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH-TO-EMBERCTL\n", argv[0]);
        return 2;
    }
    emberctl_path = argv[1];
    Suite *suite = suite_create("emberctl");
    TCase *cli = tcase_create("cli");
    tcase_set_timeout(cli, 60);
    tcase_add_test(cli, version_and_help);
    tcase_add_test(cli, usage_errors_exit_2_and_say_what_was_wrong);
    tcase_add_test(cli, no_server_exits_3);
    tcase_add_test(cli, tables_lifecycle_in_text_and_json);
    tcase_add_test(cli, tokens_come_from_flag_file_environment_or_default);
    tcase_add_test(cli, ping_health_and_stats);
    tcase_add_test(cli, top_shows_the_rates_and_latency_of_live_traffic);
    tcase_add_test(cli, eviction_evicted_keys_and_erase_through_emberctl);
    suite_add_tcase(suite, cli);
    return em_test_run(suite);
}
