#include "tests/integration/harness.h"

#include <arpa/inet.h>
#include <cJSON.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define START_TIMEOUT_MS 20000

static const char *base_config =
    "{\"listen\": {\"data\": \"127.0.0.1:0\", \"admin\": \"127.0.0.1:0\", \"metrics\": \"127.0.0.1:0\"},"
    " \"backend\": {\"type\": \"cpu\", \"threads\": 2, \"memory_limit_bytes\": 536870912,"
    "              \"initial_bytes\": 16777216, \"growth_bytes\": 67108864},"
    " \"admin_token\": {\"value\": \"" TEST_ADMIN_TOKEN "\"},"
    " \"log_level\": \"debug\", \"drain_timeout_ms\": 10000}";

static long now_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec * 1000L + now.tv_nsec / 1000000L;
}

static char *read_text_file(const char *path)
{
    FILE *file = fopen(path, "r");
    if (file == NULL)
        return NULL;
    fseek(file, 0, SEEK_END);
    long size = ftell(file);
    fseek(file, 0, SEEK_SET);
    char *text = calloc((size_t)size + 1, 1);
    if (text != NULL && fread(text, 1, (size_t)size, file) != (size_t)size) {
        free(text);
        text = NULL;
    }
    fclose(file);
    return text;
}

char *test_daemon_log(const test_daemon *daemon)
{
    char *text = read_text_file(daemon->log_path);
    return text != NULL ? text : strdup("(no log)");
}

bool test_daemon_wait_log(const test_daemon *daemon, const char *text, int timeout_ms)
{
    for (int waited = 0;; waited += 20) {
        char *log = test_daemon_log(daemon);
        bool found = strstr(log, text) != NULL;
        free(log);
        if (found || waited >= timeout_ms)
            return found;
        usleep(20000);
    }
}

bool test_backend_is_cuda(void)
{
    const char *backend = getenv("EMBER_TEST_BACKEND");
    return backend != NULL && strcmp(backend, "cuda") == 0;
}

const char *test_backend_name(void)
{
    return test_backend_is_cuda() ? "cuda" : "cpu";
}

void test_skip_without_backend(void)
{
    if (!test_backend_is_cuda())
        return;
    const char *binary = getenv("EMBERD");
    char command[1024];
    snprintf(command, sizeof(command), "%s --list-devices", binary != NULL ? binary : "emberd");
    int status = system(command);
    if (status == -1 || !WIFEXITED(status)) {
        printf("%s did not run\n", command);
        exit(1);
    }
    if (WEXITSTATUS(status) == 3) {
        printf("skipped: the cuda backend needs a GPU, and none is visible\n");
        exit(77);
    }
    if (WEXITSTATUS(status) != 0) {
        /* A GPU or a driver is there but unusable: a failure, never a skip (the reason
         * is printed above by emberd). */
        printf("the cuda backend cannot run here (%s exited %d)\n", command,
               WEXITSTATUS(status));
        exit(1);
    }
}

void test_assert_floats_match(const float *got, const float *expected, uint64_t count,
                              const char *what)
{
    if (!test_backend_is_cuda()) {
        ck_assert_msg(memcmp(got, expected, count * sizeof(float)) == 0,
                      "%s: values differ from the engine", what);
        return;
    }
    for (uint64_t i = 0; i < count; i++) {
        double scale = fabs((double)expected[i]) > 1e-2 ? fabs((double)expected[i]) : 1e-2;
        ck_assert_msg(fabs((double)got[i] - (double)expected[i]) <= 1e-5 * scale,
                      "%s: value %llu is %.9g, the engine has %.9g", what,
                      (unsigned long long)i, (double)got[i], (double)expected[i]);
    }
}

static void write_config(test_daemon *daemon, const char *overrides_json)
{
    cJSON *config = cJSON_Parse(base_config);
    ck_assert_ptr_nonnull(config);
    /* one GPU on any machine: the suites' expectations (devices, pools) are for one */
    if (test_backend_is_cuda())
        cJSON_ReplaceItemInObjectCaseSensitive(
            config, "backend",
            cJSON_Parse("{\"type\": \"cuda\", \"gpus\": [0], \"lanes\": 2, "
                        "\"memory_fraction\": 0.2}"));
    if (overrides_json != NULL) {
        cJSON *overrides = cJSON_Parse(overrides_json);
        ck_assert_msg(overrides != NULL, "overrides are not JSON: %s", overrides_json);
        cJSON *item = NULL;
        cJSON_ArrayForEach(item, overrides) {
            cJSON *copy = cJSON_Duplicate(item, true);
            if (cJSON_GetObjectItemCaseSensitive(config, item->string) != NULL)
                cJSON_ReplaceItemInObjectCaseSensitive(config, item->string, copy);
            else
                cJSON_AddItemToObject(config, item->string, copy);
        }
        cJSON_Delete(overrides);
    }
    char *text = cJSON_Print(config);
    FILE *file = fopen(daemon->config_path, "w");
    ck_assert_ptr_nonnull(file);
    fputs(text, file);
    fclose(file);
    free(text);
    cJSON_Delete(config);
}

void test_daemon_rewrite_config(test_daemon *daemon, const char *overrides_json)
{
    write_config(daemon, overrides_json);
}

static void exec_daemon(const test_daemon *daemon, const char *listen_path)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int log = open(daemon->log_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (log >= 0) {
        dup2(log, STDERR_FILENO);
        dup2(log, STDOUT_FILENO);
        close(log);
    }
    const char *binary = getenv("EMBERD");
    if (binary == NULL)
        binary = "emberd";
    execl(binary, binary, "--config", daemon->config_path, "--listen-file", listen_path,
          (char *)NULL);
    fprintf(stderr, "exec %s: %s\n", binary, strerror(errno));
    _exit(127);
}

static bool read_listen_file(test_daemon *daemon, const char *path)
{
    char *text = read_text_file(path);
    if (text == NULL)
        return false;
    cJSON *json = cJSON_Parse(text);
    free(text);
    if (json == NULL)
        return false;
    snprintf(daemon->data, sizeof(daemon->data), "%s",
             cJSON_GetStringValue(cJSON_GetObjectItem(json, "data")));
    snprintf(daemon->admin, sizeof(daemon->admin), "%s",
             cJSON_GetStringValue(cJSON_GetObjectItem(json, "admin")));
    const char *metrics = cJSON_GetStringValue(cJSON_GetObjectItem(json, "metrics"));
    snprintf(daemon->metrics, sizeof(daemon->metrics), "%s", metrics != NULL ? metrics : "");
    cJSON_Delete(json);
    return true;
}

test_daemon *test_daemon_start(const char *overrides_json)
{
    test_daemon *daemon = calloc(1, sizeof(*daemon));
    snprintf(daemon->directory, sizeof(daemon->directory), "/tmp/ember-test-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(daemon->directory));
    snprintf(daemon->config_path, sizeof(daemon->config_path), "%s/emberd.json",
             daemon->directory);
    snprintf(daemon->log_path, sizeof(daemon->log_path), "%s/emberd.log", daemon->directory);
    char listen_path[320];
    snprintf(listen_path, sizeof(listen_path), "%s/listen.json", daemon->directory);
    write_config(daemon, overrides_json);
    daemon->pid = fork();
    ck_assert_int_ge(daemon->pid, 0);
    if (daemon->pid == 0)
        exec_daemon(daemon, listen_path);
    long deadline = now_ms() + START_TIMEOUT_MS;
    while (!read_listen_file(daemon, listen_path)) {
        int status = 0;
        if (waitpid(daemon->pid, &status, WNOHANG) == daemon->pid) {
            char *log = test_daemon_log(daemon);
            ck_abort_msg("emberd exited during start (status %d):\n%s", status, log);
        }
        ck_assert_msg(now_ms() < deadline, "emberd did not start within %d ms",
                      START_TIMEOUT_MS);
        usleep(10000);
    }
    return daemon;
}

static void remove_directory(const test_daemon *daemon)
{
    const char *names[] = {"emberd.json", "emberd.log", "listen.json"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        char path[400];
        snprintf(path, sizeof(path), "%s/%s", daemon->directory, names[i]);
        unlink(path);
    }
    rmdir(daemon->directory);
}

int test_daemon_stop(test_daemon *daemon, int signal_number, int timeout_ms)
{
    kill(daemon->pid, signal_number);
    long deadline = now_ms() + timeout_ms;
    int status = 0, code = -1;
    for (;;) {
        pid_t done = waitpid(daemon->pid, &status, WNOHANG);
        if (done == daemon->pid) {
            code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            break;
        }
        if (now_ms() > deadline) {
            kill(daemon->pid, SIGKILL);
            waitpid(daemon->pid, &status, 0);
            break;
        }
        usleep(5000);
    }
    if (code != 0) {
        char *log = test_daemon_log(daemon);
        fprintf(stderr, "emberd exit code %d; its log:\n%s\n", code, log);
        free(log);
    }
    remove_directory(daemon);
    free(daemon);
    return code;
}

/* ---- sockets ------------------------------------------------------------------------- */

int test_connect(const char *address)
{
    char host[64];
    const char *colon = strrchr(address, ':');
    ck_assert_ptr_nonnull(colon);
    snprintf(host, sizeof(host), "%.*s", (int)(colon - address), address);
    struct sockaddr_in target = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    ck_assert_int_eq(inet_pton(AF_INET, host, &target.sin_addr), 1);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    ck_assert_int_ge(fd, 0);
    ck_assert_msg(connect(fd, (struct sockaddr *)&target, sizeof(target)) == 0,
                  "connect %s: %s", address, strerror(errno));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
}

bool test_send_all(int fd, const void *data, size_t length)
{
    const uint8_t *bytes = data;
    while (length > 0) {
        ssize_t sent = send(fd, bytes, length, MSG_NOSIGNAL);
        if (sent < 0 && errno == EINTR)
            continue;
        if (sent <= 0)
            return false;
        bytes += sent;
        length -= (size_t)sent;
    }
    return true;
}

bool test_send_frame(int fd, const Ember__RpcMeta *meta, const ProtobufCMessage *body,
                     const void *attachment, size_t attachment_length)
{
    uint8_t *frame = NULL;
    size_t length = 0;
    em_error err;
    ck_assert_int_eq(em_frame_pack(meta, body, attachment_length, &frame, &length, &err), EM_OK);
    bool ok = test_send_all(fd, frame, length) &&
              (attachment_length == 0 || test_send_all(fd, attachment, attachment_length));
    free(frame);
    return ok;
}

bool test_send_request(int fd, uint64_t correlation_id, int method, const char *token,
                       const ProtobufCMessage *body, const void *attachment,
                       size_t attachment_length)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = correlation_id;
    meta.method = (Ember__Method)method;
    if (token != NULL) {
        meta.auth_token.data = (uint8_t *)token;
        meta.auth_token.len = strlen(token);
    }
    return test_send_frame(fd, &meta, body, attachment, attachment_length);
}

/* Reads exactly length bytes: 1, 0 on EOF, -1 on timeout or error. */
static int read_exact(int fd, uint8_t *buffer, size_t length, long deadline)
{
    while (length > 0) {
        long left = deadline - now_ms();
        struct pollfd poller = {.fd = fd, .events = POLLIN};
        if (left <= 0 || poll(&poller, 1, (int)left) <= 0)
            return -1;
        ssize_t got = recv(fd, buffer, length, 0);
        if (got == 0)
            return 0;
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return errno == ECONNRESET ? 0 : -1;
        }
        buffer += got;
        length -= (size_t)got;
    }
    return 1;
}

int test_read_frame(int fd, int timeout_ms, test_frame *out)
{
    memset(out, 0, sizeof(*out));
    long deadline = now_ms() + timeout_ms;
    uint8_t header[EM_FRAME_HEADER_BYTES];
    int got = read_exact(fd, header, sizeof(header), deadline);
    if (got <= 0)
        return got;
    em_frame_header frame;
    em_frame_limits limits = em_frame_default_limits();
    limits.max_attachment = UINT64_C(1) << 34;
    em_error err;
    if (em_frame_header_decode(header, &limits, &frame, &err) != EM_OK)
        return -1;
    uint8_t *meta = malloc(frame.meta_len);
    out->body = malloc(frame.body_len + 1);
    out->attachment = malloc(frame.attach_len + 1);
    out->body_length = frame.body_len;
    out->attachment_length = frame.attach_len;
    if (read_exact(fd, meta, frame.meta_len, deadline) != 1 ||
        read_exact(fd, out->body, frame.body_len, deadline) != 1 ||
        read_exact(fd, out->attachment, frame.attach_len, deadline) != 1) {
        free(meta);
        test_frame_free(out);
        return -1;
    }
    out->meta = ember__rpc_meta__unpack(NULL, frame.meta_len, meta);
    free(meta);
    if (out->meta == NULL) {
        test_frame_free(out);
        return -1;
    }
    return 1;
}

void test_frame_free(test_frame *frame)
{
    if (frame->meta != NULL)
        ember__rpc_meta__free_unpacked(frame->meta, NULL);
    free(frame->body);
    free(frame->attachment);
    memset(frame, 0, sizeof(*frame));
}

bool test_wait_closed(int fd, int timeout_ms)
{
    long deadline = now_ms() + timeout_ms;
    uint8_t scratch[4096];
    for (;;) {
        long left = deadline - now_ms();
        struct pollfd poller = {.fd = fd, .events = POLLIN};
        if (left <= 0 || poll(&poller, 1, (int)left) <= 0)
            return false;
        ssize_t got = recv(fd, scratch, sizeof(scratch), 0);
        if (got == 0 || (got < 0 && errno == ECONNRESET))
            return true;
        if (got < 0 && errno != EINTR)
            return false;
    }
}

uint8_t *test_csr_attachment(uint32_t rows, const uint32_t *offsets, uint64_t nnz,
                             const uint64_t *keys, const float *gradients, uint64_t gradient_count,
                             size_t *length)
{
    em_csr_attachment layout;
    em_error err;
    ck_assert_int_eq(em_csr_attachment_layout(rows, nnz, gradient_count, &layout, &err), EM_OK);
    uint8_t *buffer = calloc(layout.total + 1, 1);
    memcpy(buffer, offsets, ((size_t)rows + 1) * sizeof(uint32_t));
    if (nnz > 0)
        memcpy(buffer + layout.keys_at, keys, nnz * sizeof(uint64_t));
    if (gradients != NULL)
        memcpy(buffer + layout.gradients_at, gradients, gradient_count * sizeof(float));
    *length = layout.total;
    return buffer;
}

test_frame test_call(int fd, uint64_t correlation_id, int method, const char *token,
                     const ProtobufCMessage *body, const void *attachment,
                     size_t attachment_length)
{
    ck_assert(test_send_request(fd, correlation_id, method, token, body, attachment,
                                attachment_length));
    test_frame frame;
    ck_assert_int_eq(test_read_frame(fd, 20000, &frame), 1);
    ck_assert_uint_eq(frame.meta->correlation_id, correlation_id);
    return frame;
}

int test_run_program(char *const argv[], const char *token, char **output)
{
    char path[] = "/tmp/ember-run-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        if (token != NULL)
            setenv("EMBER_ADMIN_TOKEN", token, 1);
        else
            unsetenv("EMBER_ADMIN_TOKEN");
        execv(argv[0], argv);
        _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    close(fd);
    *output = read_text_file(path);
    unlink(path);
    if (*output == NULL)
        *output = strdup("");
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
