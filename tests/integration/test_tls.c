/*
 * TLS between the C client and a real emberd: certificates made for the test with the
 * openssl command (a CA, a server certificate for 127.0.0.1, client certificates from
 * that CA and from another one), then every way a handshake should pass or be refused,
 * with the refusals counted in STATS and the daemon serving throughout.
 */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clients/ember_client.h"
#include "proto/ember.pb-c.h"
#include "tests/integration/harness.h"

static char directory[256];

static void run_or_fail(const char *command)
{
    char line[2048];
    snprintf(line, sizeof(line), "cd %s && %s >/dev/null 2>&1", directory, command);
    if (system(line) != 0) {
        fprintf(stderr, "test_tls: making the test certificates failed: %s\n", command);
        exit(EXIT_FAILURE);
    }
}

/* ca.pem/ca.key, server.pem/server.key (IP 127.0.0.1), client.pem/client.key (same CA),
 * rogue-ca.pem and rogue.pem/rogue.key (another CA). */
static void make_certificates(void)
{
    snprintf(directory, sizeof(directory), "/tmp/ember-tls-XXXXXX");
    if (mkdtemp(directory) == NULL) {
        perror("test_tls: mkdtemp");
        exit(EXIT_FAILURE);
    }
    const char *subject_ca = "-subj /CN=ember-test-ca";
    char command[1024];
    snprintf(command, sizeof(command),
             "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 "
             "-keyout ca.key -out ca.pem %s", subject_ca);
    run_or_fail(command);
    run_or_fail("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 "
                "-keyout rogue-ca.key -out rogue-ca.pem -subj /CN=rogue-ca");
    char extensions[320];
    snprintf(extensions, sizeof(extensions), "%s/server.ext", directory);
    FILE *file = fopen(extensions, "w");
    if (file == NULL) {
        perror("test_tls: server.ext");
        exit(EXIT_FAILURE);
    }
    fprintf(file, "subjectAltName=IP:127.0.0.1,DNS:localhost\n");
    fclose(file);
    run_or_fail("openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes "
                "-keyout server.key -out server.csr -subj /CN=emberd");
    run_or_fail("openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
                "-days 2 -extfile server.ext -out server.pem");
    run_or_fail("openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes "
                "-keyout client.key -out client.csr -subj /CN=trainer");
    run_or_fail("openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
                "-days 2 -out client.pem");
    run_or_fail("openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes "
                "-keyout rogue.key -out rogue.csr -subj /CN=intruder");
    run_or_fail("openssl x509 -req -in rogue.csr -CA rogue-ca.pem -CAkey rogue-ca.key "
                "-CAcreateserial -days 2 -out rogue.pem");
    run_or_fail("chmod 600 *.key");
}

static char *path_of(const char *name)
{
    static char paths[8][320];
    static int next;
    char *path = paths[next++ % 8];
    snprintf(path, 320, "%s/%s", directory, name);
    return path;
}

/* A daemon with TLS on the data listener (the admin listener stays plaintext so the
 * harness can read STATS); client_ca: mutual TLS. */
static test_daemon *start_tls(bool client_ca)
{
    char json[2048];
    snprintf(json, sizeof(json),
             "{\"tables\": [{\"name\": \"t\", \"dim\": 4, \"capacity\": 1000,"
             "  \"initializer\": {\"type\": \"zeros\"}}],"
             " \"tls\": {\"certificate_file\": \"%s\", \"private_key_file\": \"%s\","
             "  \"client_ca_file\": \"%s\", \"admin\": false}}",
             path_of("server.pem"), path_of("server.key"),
             client_ca ? path_of("ca.pem") : "");
    return test_daemon_start(json);
}

static em_status connect_client(const test_daemon *daemon, const char *ca, const char *cert,
                                const char *key, const char *server_name, em_client **client,
                                em_error *err)
{
    em_client_options options;
    em_client_options_init(&options);
    options.servers = daemon->data;
    options.reconnect_attempts = 1;
    options.connect_timeout_ms = 3000;
    options.tls_ca_file = ca;
    options.tls_cert_file = cert;
    options.tls_key_file = key;
    options.tls_server_name = server_name;
    return em_client_create(&options, client, err);
}

/* A push then a pull of three keys through client; the pulled values are the pushed
 * step (sgd lr 0.01 by default, zeros initialised). */
static void round_trip(em_client *client)
{
    const uint32_t offsets[] = {0, 1, 2, 3};
    const uint64_t keys[] = {1, 2, 3};
    em_csr batch = {.rows = 3, .nnz = 3, .offsets = offsets, .keys = keys};
    float gradients[12], out[12];
    for (int i = 0; i < 12; i++)
        gradients[i] = 1.0f;
    em_error err;
    em_client_push_args push = {.table = "t", .batch = batch, .combiner = EM_COMBINER_NONE,
                                .gradients = gradients, .gradient_count = 12};
    ck_assert_msg(em_client_push(client, &push, NULL, &err) == EM_OK, "%s", err.message);
    em_client_pull_args pull = {.table = "t", .batch = batch, .combiner = EM_COMBINER_NONE,
                                .out = out, .out_capacity = 12};
    ck_assert_msg(em_client_pull(client, &pull, NULL, &err) == EM_OK, "%s", err.message);
    for (int i = 0; i < 12; i++)
        ck_assert(out[i] < 0.0f);
}

static Ember__ServerStats *server_stats(const test_daemon *daemon)
{
    int fd = test_connect(daemon->admin);
    Ember__StatsRequest request = EMBER__STATS_REQUEST__INIT;
    test_frame frame = test_call(fd, 9, EMBER__METHOD__STATS, TEST_ADMIN_TOKEN, &request.base,
                                 NULL, 0);
    close(fd);
    ck_assert_msg(frame.meta->status == EMBER__STATUS__OK, "%s", frame.meta->error);
    Ember__StatsResponse *response = ember__stats_response__unpack(NULL, frame.body_length,
                                                                   frame.body);
    test_frame_free(&frame);
    Ember__ServerStats *server = response->server;
    response->server = NULL;
    ember__stats_response__free_unpacked(response, NULL);
    return server;
}

START_TEST(tls_serves_clients_that_trust_the_server_and_refuses_plaintext)
{
    test_daemon *daemon = start_tls(false);
    em_client *client = NULL;
    em_error err;
    ck_assert_msg(connect_client(daemon, path_of("ca.pem"), NULL, NULL, NULL, &client, &err) ==
                      EM_OK,
                  "%s", err.message);
    round_trip(client);
    em_client_destroy(client);

    /* A plaintext client: its frame is not a TLS handshake; the connection is closed. */
    int fd = test_connect(daemon->data);
    Ember__PingRequest ping = EMBER__PING_REQUEST__INIT;
    ck_assert(test_send_request(fd, 1, EMBER__METHOD__PING, NULL, &ping.base, NULL, 0));
    test_frame frame;
    ck_assert_int_ne(test_read_frame(fd, 5000, &frame), 1);
    close(fd);

    /* A client that trusts another CA refuses the server's certificate. */
    ck_assert_int_eq(connect_client(daemon, path_of("rogue-ca.pem"), NULL, NULL, NULL, &client,
                                    &err),
                     EM_UNAUTHENTICATED);
    ck_assert_msg(strstr(err.message, "TLS certificate is refused") != NULL, "%s", err.message);
    /* And one that expects another name. */
    ck_assert_int_eq(connect_client(daemon, path_of("ca.pem"), NULL, NULL, "db.example",
                                    &client, &err),
                     EM_UNAUTHENTICATED);

    Ember__ServerStats *stats = server_stats(daemon);
    ck_assert_uint_ge(stats->tls_handshakes, 1);
    ck_assert_uint_ge(stats->tls_handshakes_failed, 3);
    ember__server_stats__free_unpacked(stats, NULL);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(mutual_tls_takes_only_certificates_from_the_client_ca)
{
    test_daemon *daemon = start_tls(true);
    em_client *client = NULL;
    em_error err;
    ck_assert_msg(connect_client(daemon, path_of("ca.pem"), path_of("client.pem"),
                                 path_of("client.key"), NULL, &client, &err) == EM_OK,
                  "%s", err.message);
    round_trip(client);
    em_client_destroy(client);

    /* Without a certificate, or with one from another CA, no call goes through. */
    const char *certs[2][2] = {{NULL, NULL}, {"rogue.pem", "rogue.key"}};
    for (int i = 0; i < 2; i++) {
        em_status status = connect_client(
            daemon, path_of("ca.pem"), certs[i][0] != NULL ? path_of(certs[i][0]) : NULL,
            certs[i][1] != NULL ? path_of(certs[i][1]) : NULL, NULL, &client, &err);
        if (status == EM_OK) {
            /* TLS 1.3: the server's refusal arrives with the first read */
            char version[32];
            status = em_client_ping(client, version, sizeof(version), NULL, &err);
            em_client_destroy(client);
        }
        ck_assert_msg(status != EM_OK, "a client with %s got in",
                      certs[i][0] != NULL ? certs[i][0] : "no certificate");
    }
    Ember__ServerStats *stats = server_stats(daemon);
    ck_assert_uint_ge(stats->tls_handshakes_failed, 2);
    ember__server_stats__free_unpacked(stats, NULL);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

START_TEST(bad_tls_files_and_exposed_listeners_refuse_to_start)
{
    char config[1024];
    snprintf(config, sizeof(config),
             "%s/bad.json", directory);
    FILE *file = fopen(config, "w");
    fprintf(file,
            "{\"admin_token\": {\"value\": \"a-token\"},"
            " \"listen\": {\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:0\", \"metrics\": \"\"},"
            " \"backend\": {\"type\": \"cpu\"},"
            " \"tls\": {\"certificate_file\": \"%s\", \"private_key_file\": \"%s\"}}",
            path_of("server.pem"), path_of("client.key"));
    fclose(file);
    char *argv[] = {getenv("EMBERD"), "--config", config, NULL};
    char *output = NULL;
    ck_assert_int_eq(test_run_program(argv, NULL, &output), 1);
    ck_assert_msg(strstr(output, "client.key': ") != NULL &&
                      strstr(output, "key values mismatch") != NULL,
                  "%s", output);
    free(output);

    /* Reachable from other hosts with neither a data token nor TLS: refused. */
    file = fopen(config, "w");
    fprintf(file,
            "{\"admin_token\": {\"value\": \"a-token\"},"
            " \"listen\": {\"data\": \"0.0.0.0:0\", \"admin\": \"127.0.0.1:0\", \"metrics\": \"\"},"
            " \"backend\": {\"type\": \"cpu\"}}");
    fclose(file);
    ck_assert_int_eq(test_run_program(argv, NULL, &output), 1);
    ck_assert_msg(strstr(output, "neither a data_token nor tls") != NULL, "%s", output);
    free(output);
}
END_TEST

START_TEST(emberctl_reaches_a_tls_admin_listener)
{
    char json[1024];
    snprintf(json, sizeof(json),
             "{\"tls\": {\"certificate_file\": \"%s\", \"private_key_file\": \"%s\"}}",
             path_of("server.pem"), path_of("server.key"));
    test_daemon *daemon = test_daemon_start(json);
    char *with_tls[] = {getenv("EMBERCTL"), "--server", daemon->admin, "--tls-ca",
                        path_of("ca.pem"), "--json", "stats", NULL};
    char *output = NULL;
    ck_assert_int_eq(test_run_program(with_tls, TEST_ADMIN_TOKEN, &output), 0);
    ck_assert_msg(strstr(output, "tls_handshakes") != NULL, "%s", output);
    free(output);
    char *plain[] = {getenv("EMBERCTL"), "--server", daemon->admin, "--timeout", "2000", "ping",
                     NULL};
    ck_assert_int_eq(test_run_program(plain, TEST_ADMIN_TOKEN, &output), 3);
    free(output);
    ck_assert_int_eq(test_daemon_stop(daemon, SIGTERM, 10000), 0);
}
END_TEST

static Suite *tls_suite(void)
{
    Suite *suite = suite_create("tls");
    TCase *tc = tcase_create("tls");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, tls_serves_clients_that_trust_the_server_and_refuses_plaintext);
    tcase_add_test(tc, mutual_tls_takes_only_certificates_from_the_client_ca);
    tcase_add_test(tc, bad_tls_files_and_exposed_listeners_refuse_to_start);
    tcase_add_test(tc, emberctl_reaches_a_tls_admin_listener);
    suite_add_tcase(suite, tc);
    return suite;
}

int main(void)
{
    make_certificates();
    SRunner *runner = srunner_create(tls_suite());
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    char cleanup[320];
    snprintf(cleanup, sizeof(cleanup), "rm -rf %s", directory);
    if (system(cleanup) != 0)
        fprintf(stderr, "could not remove %s\n", directory);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
