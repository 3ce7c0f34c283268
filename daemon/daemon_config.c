#include "daemon/daemon_config.h"

#include <errno.h>
#include <inttypes.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/address.h"

/* Token files are small; anything bigger is a mistake worth reporting. */
#define TOKEN_FILE_MAX_BYTES 4096

/* ---- tokens ------------------------------------------------------------------------ */

static em_status token_from_text(const char *text, size_t length, em_token *token,
                                 const char *path, em_error *err)
{
    while (length > 0 && (text[length - 1] == '\n' || text[length - 1] == '\r'))
        length--;
    if (length == 0 || length > EM_TOKEN_MAX)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: token must have 1 to %d characters, got %zu", path,
                            EM_TOKEN_MAX, length);
    memcpy(token->value, text, length);
    token->value[length] = '\0';
    token->set = true;
    return EM_OK;
}

/* Reads a token file: opened without following a symbolic link, checked on the open
 * descriptor (a regular file only its owner can read: mode 0600 or 0400), then read. */
static em_status read_token_file(const char *file, char *text, size_t capacity,
                                 const char *path, em_error *err)
{
    int fd = open(file, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        int saved = errno;
        return em_error_set(err, saved == ENOENT ? EM_NOT_FOUND : EM_PERMISSION_DENIED,
                            "%s: cannot open token file '%s': %s%s", path, file,
                            strerror(saved),
                            saved == ELOOP ? " (token files may not be symbolic links)" : "");
    }
    struct stat info;
    em_status status = EM_OK;
    if (fstat(fd, &info) != 0)
        status = em_error_set(err, EM_PERMISSION_DENIED, "%s: cannot stat token file '%s': %s",
                              path, file, strerror(errno));
    else if (!S_ISREG(info.st_mode))
        status = em_error_set(err, EM_INVALID_ARGUMENT,
                              "%s: token file '%s' is not a regular file", path, file);
    else if ((info.st_mode & 07777) != 0600 && (info.st_mode & 07777) != 0400)
        status = em_error_set(err, EM_PERMISSION_DENIED,
                              "%s: token file '%s' has mode %04o; only its owner may read it "
                              "(chmod 600 or 400)",
                              path, file, (unsigned)(info.st_mode & 07777));
    else if ((uint64_t)info.st_size >= capacity)
        status = em_error_set(err, EM_INVALID_ARGUMENT,
                              "%s: token file '%s' is %lld bytes; at most %zu", path, file,
                              (long long)info.st_size, capacity - 1);
    size_t length = 0;
    while (status == EM_OK && length < capacity - 1) {
        ssize_t got = read(fd, text + length, capacity - 1 - length);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            status = em_error_set(err, EM_PERMISSION_DENIED, "%s: cannot read token file '%s': %s",
                                  path, file, strerror(errno));
        if (got <= 0)
            break;
        length += (size_t)got;
    }
    close(fd);
    text[length] = '\0';
    return status;
}

static em_status token_from_file(const char *file, em_token *token, const char *path,
                                 em_error *err)
{
    char text[TOKEN_FILE_MAX_BYTES + 1];
    em_status status = read_token_file(file, text, sizeof(text), path, err);
    if (status == EM_OK)
        status = token_from_text(text, strlen(text), token, path, err);
    memset(text, 0, sizeof(text));
    snprintf(token->source, sizeof(token->source), "file %.*s", EM_ADDRESS_MAX, file);
    return status;
}

static em_status token_from_env(const char *name, em_token *token, const char *path,
                                em_error *err)
{
    const char *value = getenv(name);
    if (value == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: environment variable %s is not set", path, name);
    snprintf(token->source, sizeof(token->source), "env %.*s", EM_ADDRESS_MAX, name);
    return token_from_text(value, strlen(value), token, path, err);
}

/* {"value": ...} | {"file": ...} | {"env": ...}, exactly one. */
static em_status parse_token(const cJSON *value, void *field, const char *path, em_error *err)
{
    em_token *token = field;
    memset(token, 0, sizeof(*token));
    if (!cJSON_IsObject(value) || cJSON_GetArraySize(value) != 1 ||
        !cJSON_IsString(value->child))
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: must be an object with one string key: value, file or env",
                            path);
    const char *kind = value->child->string, *text = value->child->valuestring;
    char key_path[256];
    em_config_join_path(key_path, sizeof(key_path), path, kind);
    if (strcmp(kind, "value") == 0) {
        snprintf(token->source, sizeof(token->source), "inline");
        return token_from_text(text, strlen(text), token, key_path, err);
    }
    if (strcmp(kind, "file") == 0)
        return token_from_file(text, token, key_path, err);
    if (strcmp(kind, "env") == 0)
        return token_from_env(text, token, key_path, err);
    return em_error_set(err, EM_INVALID_ARGUMENT, "%s: unknown key (known keys: value, file, env)",
                        key_path);
}

/* The secret itself is never printed: a file or variable is printed as it was given
 * (so the printed configuration reads the same token again), an inline value as the
 * text EM_TOKEN_REDACTED. */
static cJSON *print_token(const void *field)
{
    const em_token *token = field;
    if (!token->set)
        return NULL;
    cJSON *object = cJSON_CreateObject();
    if (strncmp(token->source, "file ", 5) == 0)
        cJSON_AddStringToObject(object, "file", token->source + 5);
    else if (strncmp(token->source, "env ", 4) == 0)
        cJSON_AddStringToObject(object, "env", token->source + 4);
    else
        cJSON_AddStringToObject(object, "value", EM_TOKEN_REDACTED);
    return object;
}

/* ---- tables ------------------------------------------------------------------------ */

static em_status check_unique_names(const em_tables_config *tables, const char *path,
                                    em_error *err)
{
    for (uint32_t i = 0; i < tables->count; i++)
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(tables->items[i].name, tables->items[j].name) == 0)
                return em_error_set(err, EM_INVALID_ARGUMENT,
                                    "%s[%u].name: '%s' is already used by %s[%u]", path, i,
                                    tables->items[i].name, path, j);
    return EM_OK;
}

static em_status parse_tables(const cJSON *value, void *field, const char *path, em_error *err)
{
    em_tables_config *tables = field;
    memset(tables, 0, sizeof(*tables));
    if (!cJSON_IsArray(value))
        return em_error_set(err, EM_INVALID_ARGUMENT, "%s: must be an array of table objects",
                            path);
    int count = cJSON_GetArraySize(value);
    tables->items = calloc((size_t)count + 1, sizeof(*tables->items));
    if (tables->items == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "%s: out of memory", path);
    const cJSON *item = NULL;
    cJSON_ArrayForEach(item, value) {
        char item_path[64];
        snprintf(item_path, sizeof(item_path), "%s[%u]", path, tables->count);
        em_status status = em_table_config_parse(item, item_path, &tables->items[tables->count],
                                                 err);
        if (status != EM_OK)
            return status;
        tables->count++;
    }
    return check_unique_names(tables, path, err);
}

static cJSON *print_tables(const void *field)
{
    const em_tables_config *tables = field;
    cJSON *array = cJSON_CreateArray();
    for (uint32_t i = 0; array != NULL && i < tables->count; i++)
        cJSON_AddItemToArray(array, em_table_config_to_json(&tables->items[i]));
    return array;
}

/* ---- sections ---------------------------------------------------------------------- */

static em_status check_listen(void *target, const cJSON *json, const char *path, em_error *err)
{
    (void)json;
    em_listen_config *listen = target;
    struct sockaddr_storage address;
    const char *fields[3] = {listen->data, listen->admin, listen->metrics};
    const char *names[3] = {"data", "admin", "metrics"};
    for (int i = 0; i < 3; i++) {
        if (i == 2 && listen->metrics[0] == '\0')
            continue;
        em_status status = em_address_parse(fields[i], &address, err);
        if (status != EM_OK) {
            char key_path[64];
            em_config_join_path(key_path, sizeof(key_path), path, names[i]);
            return em_error_prefix(err, "%s: ", key_path);
        }
    }
    return EM_OK;
}

static const em_config_field listen_fields[] = {
    {EM_CONFIG_FIELD(EM_CONFIG_STRING, "data", em_listen_config, data),
     .default_json = "\"127.0.0.1:7070\"", .help = "address of the data listener (pull, push)"},
    {EM_CONFIG_FIELD(EM_CONFIG_STRING, "admin", em_listen_config, admin),
     .default_json = "\"127.0.0.1:7071\"",
     .help = "address of the admin listener (every method; admin methods need the admin token)"},
    {EM_CONFIG_FIELD(EM_CONFIG_STRING, "metrics", em_listen_config, metrics),
     .default_json = "\"127.0.0.1:9464\"",
     .help = "address of the HTTP listener serving /metrics (Prometheus) and /healthz, without "
             "a token; \"\" for none"},
};

static const em_config_schema listen_schema = {
    .name = "listen",
    .fields = listen_fields,
    .field_count = sizeof(listen_fields) / sizeof(listen_fields[0]),
    .check = check_listen,
};

#define LIMIT(name_, member_, min_, max_, default_, help_)                                   \
    {EM_CONFIG_FIELD(EM_CONFIG_INT, name_, em_limits_config, member_),                       \
     .flags = EM_CONFIG_UNSIGNED | EM_CONFIG_RELOADABLE, .min = (min_), .max = (max_),       \
     .default_json = default_, .help = help_}

static const em_config_field limits_fields[] = {
    LIMIT("max_meta_bytes", max_meta_bytes, 1, 65536, "65536",
          "largest RpcMeta a frame may carry"),
    LIMIT("max_body_bytes", max_body_bytes, 1, 67108864, "67108864",
          "largest protobuf body a frame may carry"),
    LIMIT("max_attachment_bytes", max_attachment_bytes, 0, 17179869184.0, "1073741824",
          "largest attachment a request may carry"),
    LIMIT("max_connections", max_connections, 1, 1048576, "1024",
          "connections served at once; more are answered RESOURCE_EXHAUSTED and closed"),
    LIMIT("max_keys_per_request", max_keys_per_request, 1, 4294967295.0, "4194304",
          "keys (nnz) in one pull or push"),
    LIMIT("max_response_bytes", max_response_bytes, 1024, 17179869184.0, "1073741824",
          "largest attachment a pull may answer with"),
    LIMIT("connection_inflight_bytes", connection_inflight_bytes, 65536, 1099511627776.0,
          "268435456",
          "requests and responses one connection may hold; past it the server stops reading it"),
    LIMIT("idle_timeout_ms", idle_timeout_ms, 0, 86400000, "300000",
          "close connections idle this long (0: never)"),
    LIMIT("max_admin_connections", max_admin_connections, 1, 65536, "16",
          "connections the admin listener serves at once, apart from max_connections"),
    LIMIT("memory_bytes", memory_bytes, 0, 1125899906842624.0, "0",
          "memory all connections may hold for requests and unwritten answers; past it the "
          "server stops reading until answers drain (0: a quarter of physical memory)"),
    LIMIT("frame_timeout_ms", frame_timeout_ms, 0, 86400000, "60000",
          "close a connection whose frame is not complete this long after it began (0: never)"),
    LIMIT("write_timeout_ms", write_timeout_ms, 0, 86400000, "60000",
          "close a connection whose answers make no progress this long (0: never)"),
    LIMIT("drain_linger_ms", drain_linger_ms, 0, 60000, "200",
          "when draining, close a connection once it has been quiet this long"),
};

/* limits.memory_bytes 0 is a quarter of physical memory, resolved when the whole file
 * is read (the limits object may be absent), so the printed configuration says the
 * number in force. */
static em_status resolve_memory_budget(em_limits_config *limits, em_error *err)
{
    if (limits->memory_bytes == 0) {
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        uint64_t physical = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page
                                                  : UINT64_C(4) << 30;
        limits->memory_bytes = physical / 4;
    }
    if (limits->memory_bytes < EM_MEMORY_BUDGET_MIN)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "limits.memory_bytes: %" PRIu64 " is below the minimum %u",
                            limits->memory_bytes, EM_MEMORY_BUDGET_MIN);
    return EM_OK;
}

static const em_config_schema limits_schema = {
    .name = "limits",
    .fields = limits_fields,
    .field_count = sizeof(limits_fields) / sizeof(limits_fields[0]),
};

static const em_config_choice backend_choices[] = {
    {"auto", EM_BACKEND_AUTO},
    {"cpu", EM_BACKEND_CPU},
    {"cuda", EM_BACKEND_CUDA},
    {NULL, 0},
};

static em_status parse_gpus(const cJSON *value, void *field, const char *path, em_error *err)
{
    em_gpu_list *list = field;
    memset(list, 0, sizeof(*list));
    if (!cJSON_IsArray(value) || cJSON_GetArraySize(value) > EM_MAX_GPUS)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: must be an array of at most %d GPU ordinals", path, EM_MAX_GPUS);
    const cJSON *item = NULL;
    cJSON_ArrayForEach(item, value) {
        double ordinal = cJSON_IsNumber(item) ? item->valuedouble : -1;
        if (ordinal < 0 || ordinal > 255 || ordinal != (double)(uint32_t)ordinal)
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "%s[%u]: must be a GPU ordinal from 0 to 255", path, list->count);
        for (uint32_t i = 0; i < list->count; i++)
            if (list->ordinals[i] == (uint32_t)ordinal)
                return em_error_set(err, EM_INVALID_ARGUMENT, "%s[%u]: GPU %u is listed twice",
                                    path, list->count, (uint32_t)ordinal);
        list->ordinals[list->count++] = (uint32_t)ordinal;
    }
    return EM_OK;
}

static cJSON *print_gpus(const void *field)
{
    const em_gpu_list *list = field;
    cJSON *array = cJSON_CreateArray();
    for (uint32_t i = 0; array != NULL && i < list->count; i++)
        cJSON_AddItemToArray(array, cJSON_CreateNumber(list->ordinals[i]));
    return array;
}

static const char *const cuda_only[] = {"gpus", "memory_fraction", "lanes", "staging_bytes",
                                        "pinned_buffer_bytes"};
#define CUDA_ONLY_COUNT (sizeof(cuda_only) / sizeof(cuda_only[0]))

static bool backend_applies(const void *target, const em_config_field *field)
{
    const em_backend_config *config = target;
    for (size_t i = 0; config->type == EM_BACKEND_CPU && i < CUDA_ONLY_COUNT; i++)
        if (strcmp(field->name, cuda_only[i]) == 0)
            return false;
    return true;
}

static em_status check_backend(void *target, const cJSON *json, const char *path, em_error *err)
{
    const em_backend_config *config = target;
    for (size_t i = 0; config->type == EM_BACKEND_CPU && i < CUDA_ONLY_COUNT; i++) {
        if (cJSON_GetObjectItemCaseSensitive(json, cuda_only[i]) != NULL) {
            char key_path[128];
            em_config_join_path(key_path, sizeof(key_path), path, cuda_only[i]);
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "%s: applies to the cuda backend, not to type \"cpu\"", key_path);
        }
    }
    return EM_OK;
}

static const em_config_field backend_fields[] = {
    {EM_CONFIG_FIELD(EM_CONFIG_ENUM, "type", em_backend_config, type), .choices = backend_choices,
     .default_json = "\"auto\"", .help = "auto (GPUs when present, else cpu), cpu or cuda"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "devices", em_backend_config, devices),
     .flags = EM_CONFIG_UNSIGNED, .min = 1, .max = 64, .default_json = "1",
     .help = "cpu: host memory devices, each with its own pool (tables spread over them)"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "threads", em_backend_config, threads),
     .flags = EM_CONFIG_UNSIGNED, .min = 0, .max = 1024, .default_json = "0",
     .help = "worker threads running table requests (0: one per online CPU)"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "memory_limit_bytes", em_backend_config, memory_limit_bytes),
     .flags = EM_CONFIG_UNSIGNED, .default_json = "0",
     .help = "pool limit per device (0: cpu half of RAM shared by the devices)"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "initial_bytes", em_backend_config, initial_bytes),
     .flags = EM_CONFIG_UNSIGNED, .default_json = "67108864",
     .help = "pool region reserved per device at start"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "growth_bytes", em_backend_config, growth_bytes),
     .flags = EM_CONFIG_UNSIGNED, .default_json = "268435456",
     .help = "size of each further pool region (cpu)"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "eviction_threads", em_backend_config, eviction_threads),
     .flags = EM_CONFIG_UNSIGNED, .min = 0, .max = 64, .default_json = "0",
     .help = "cpu: threads one request's evictions use, a shard each, when they walk at least "
             "65536 map entries (0: the online CPUs, at most 8; 1: one shard after another)"},
    {EM_CONFIG_FIELD(EM_CONFIG_CUSTOM, "gpus", em_backend_config, gpus), .parse = parse_gpus,
     .print = print_gpus, .help = "cuda: GPU ordinals to use ([] or absent: every usable GPU)"},
    {EM_CONFIG_FIELD(EM_CONFIG_DOUBLE, "memory_fraction", em_backend_config, memory_fraction),
     .min = 0, .max = 1, .exclusive_min = true, .default_json = "0.8",
     .help = "cuda: pool per GPU as a fraction of its free memory (memory_limit_bytes 0)"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "lanes", em_backend_config, lanes),
     .flags = EM_CONFIG_UNSIGNED, .min = 1, .max = 16, .default_json = "2",
     .help = "cuda: streams per GPU, i.e. requests whose copies and kernels overlap"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "staging_bytes", em_backend_config, staging_bytes),
     .flags = EM_CONFIG_UNSIGNED, .min = 65536, .max = 4294967296.0, .default_json = "16777216",
     .help = "cuda: pinned host staging per lane (larger copies go through it in pieces)"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "pinned_buffer_bytes", em_backend_config,
                     pinned_buffer_bytes),
     .flags = EM_CONFIG_UNSIGNED, .default_json = "1073741824",
     .help = "cuda: pinned host memory that requests are received into and answered from, "
             "so the GPUs copy them directly (0: none, every copy staged)"},
};

static const em_config_schema backend_schema = {
    .name = "backend",
    .fields = backend_fields,
    .field_count = sizeof(backend_fields) / sizeof(backend_fields[0]),
    .check = check_backend,
    .applies = backend_applies,
};

static const em_config_field tls_fields[] = {
    {EM_CONFIG_FIELD(EM_CONFIG_STRING, "certificate_file", em_tls_config, certificate_file),
     .help = "PEM certificate chain the listeners present (required with tls)"},
    {EM_CONFIG_FIELD(EM_CONFIG_STRING, "private_key_file", em_tls_config, private_key_file),
     .help = "PEM private key of the certificate (required with tls)"},
    {EM_CONFIG_FIELD(EM_CONFIG_STRING, "client_ca_file", em_tls_config, client_ca_file),
     .default_json = "\"\"",
     .help = "PEM CA certificates; when set, clients must present a certificate it signed"},
    {EM_CONFIG_FIELD(EM_CONFIG_BOOL, "data", em_tls_config, data), .default_json = "true",
     .help = "the data listener speaks TLS"},
    {EM_CONFIG_FIELD(EM_CONFIG_BOOL, "admin", em_tls_config, admin), .default_json = "true",
     .help = "the admin listener speaks TLS"},
};

static const em_config_schema tls_schema = {
    .name = "tls",
    .fields = tls_fields,
    .field_count = sizeof(tls_fields) / sizeof(tls_fields[0]),
};

static const em_config_field checkpoint_fields[] = {
    {EM_CONFIG_FIELD(EM_CONFIG_STRING, "dir", em_checkpoint_config, dir),
     .flags = EM_CONFIG_REQUIRED,
     .help = "where checkpoints live: one folder per table (docs/checkpoints.md)"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "keep", em_checkpoint_config, keep),
     .flags = EM_CONFIG_UNSIGNED, .min = 1, .max = 1000, .default_json = "3",
     .help = "complete checkpoints kept per table"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "interval_s", em_checkpoint_config, interval_s),
     .flags = EM_CONFIG_UNSIGNED, .min = 0, .max = 31536000, .default_json = "0",
     .help = "save every table this often (0: only on request and at shutdown)"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "full_every", em_checkpoint_config, full_every),
     .flags = EM_CONFIG_UNSIGNED, .min = 1, .max = 100000, .default_json = "1",
     .help = "of the periodic and shutdown saves, every this many is full and the others "
             "deltas (1: all full; above 1 a table keeps a digest per row in host memory)"},
    {EM_CONFIG_FIELD(EM_CONFIG_BOOL, "on_shutdown", em_checkpoint_config, on_shutdown),
     .default_json = "true", .help = "save every table when SIGTERM has drained the server"},
    {EM_CONFIG_FIELD(EM_CONFIG_STRING, "restore", em_checkpoint_config, restore_text),
     .default_json = "\"latest\"",
     .help = "at start: load every table's latest checkpoint (latest), nothing (none), or "
             "an absolute path: the latest ones, then the tables that have none from the "
             "checkpoint root or cluster checkpoint there"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "cluster_index", em_checkpoint_config, cluster_index),
     .flags = EM_CONFIG_UNSIGNED, .min = 0, .max = 1023, .default_json = "0",
     .help = "this server's place in its cluster's server list (from 0): the buckets it "
             "loads of a cluster checkpoint named by restore"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "cluster_size", em_checkpoint_config, cluster_size),
     .flags = EM_CONFIG_UNSIGNED, .min = 0, .max = 1024, .default_json = "0",
     .help = "the servers in its cluster's list (0: not given)"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "copy_limit_bytes", em_checkpoint_config, copy_limit_bytes),
     .flags = EM_CONFIG_UNSIGNED, .min = 1048576, .max = 1e15, .default_json = "268435456",
     .help = "rows pushed during a save are copied aside up to this; then pushes wait"},
};

static em_status check_checkpoint(void *target, const cJSON *json, const char *path,
                                  em_error *err)
{
    (void)json;
    em_checkpoint_config *config = target;
    config->enabled = true;
    if (config->dir[0] != '/')
        return em_error_set(err, EM_INVALID_ARGUMENT, "%s.dir: must be an absolute path, not '%s'",
                            path, config->dir);
    if (strcmp(config->restore_text, "latest") == 0) {
        config->restore = EM_RESTORE_LATEST;
    } else if (strcmp(config->restore_text, "none") == 0) {
        config->restore = EM_RESTORE_NONE;
    } else if (config->restore_text[0] == '/') {
        config->restore = EM_RESTORE_SEED;
    } else {
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s.restore: '%s' is not \"latest\", \"none\" or an absolute path",
                            path, config->restore_text);
    }
    if (config->cluster_size > 0 && config->cluster_index >= config->cluster_size)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s.cluster_index: %u is not below cluster_size %u", path,
                            config->cluster_index, config->cluster_size);
    if (config->cluster_size == 0 && config->cluster_index > 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s.cluster_index: %u without cluster_size", path,
                            config->cluster_index);
    return EM_OK;
}

static const em_config_schema checkpoint_schema = {
    .name = "checkpoint",
    .fields = checkpoint_fields,
    .field_count = sizeof(checkpoint_fields) / sizeof(checkpoint_fields[0]),
    .check = check_checkpoint,
};

static const em_config_choice log_level_choices[] = {
    {"error", EM_LOG_ERROR}, {"warning", EM_LOG_WARNING}, {"notice", EM_LOG_NOTICE},
    {"info", EM_LOG_INFO},   {"debug", EM_LOG_DEBUG},     {NULL, 0},
};

static const em_config_choice log_format_choices[] = {
    {"text", 0}, {"logfmt", 1}, {NULL, 0},
};

static em_status check_daemon(void *target, const cJSON *json, const char *path, em_error *err)
{
    (void)path;
    em_daemon_config *config = target;
    em_status status = resolve_memory_budget(&config->limits, err);
    if (status != EM_OK)
        return status;
    config->tls.enabled = cJSON_GetObjectItemCaseSensitive(json, "tls") != NULL;
    if (config->tls.enabled && (config->tls.certificate_file[0] == '\0' ||
                                config->tls.private_key_file[0] == '\0'))
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "tls: certificate_file and private_key_file are both required");
    if (config->tls.enabled && !config->tls.data && !config->tls.admin)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "tls: data and admin are both false; remove tls instead");
    if (config->data_token.set && strcmp(config->data_token.value, config->admin_token.value) == 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "data_token: must differ from admin_token, or data clients could "
                            "administer the server");
    return EM_OK;
}

static const em_config_field daemon_fields[] = {
    {EM_CONFIG_FIELD(EM_CONFIG_OBJECT, "listen", em_daemon_config, listen),
     .object = &listen_schema, .help = "where to accept connections"},
    {EM_CONFIG_FIELD(EM_CONFIG_OBJECT, "limits", em_daemon_config, limits),
     .flags = EM_CONFIG_RELOADABLE, .object = &limits_schema,
     .help = "limits checked on every frame and connection"},
    {EM_CONFIG_FIELD(EM_CONFIG_OBJECT, "backend", em_daemon_config, backend),
     .object = &backend_schema, .help = "where tables live"},
    {EM_CONFIG_FIELD(EM_CONFIG_CUSTOM, "tables", em_daemon_config, tables),
     .parse = parse_tables, .print = print_tables, .help = "tables created at start"},
    {EM_CONFIG_FIELD(EM_CONFIG_CUSTOM, "admin_token", em_daemon_config, admin_token),
     .flags = EM_CONFIG_REQUIRED | EM_CONFIG_RELOADABLE, .parse = parse_token,
     .print = print_token, .help = "token admin methods need: {value|file|env}"},
    {EM_CONFIG_FIELD(EM_CONFIG_CUSTOM, "data_token", em_daemon_config, data_token),
     .flags = EM_CONFIG_RELOADABLE, .parse = parse_token, .print = print_token,
     .help = "token data methods need, if set: {value|file|env}"},
    {EM_CONFIG_FIELD(EM_CONFIG_ENUM, "log_level", em_daemon_config, log_level),
     .flags = EM_CONFIG_RELOADABLE, .choices = log_level_choices, .default_json = "\"info\"",
     .help = "error, warning, notice, info or debug"},
    {EM_CONFIG_FIELD(EM_CONFIG_ENUM, "log_format", em_daemon_config, log_format),
     .flags = EM_CONFIG_RELOADABLE, .choices = log_format_choices, .default_json = "\"text\"",
     .help = "text (\"<time> <level> <message>\") or logfmt (ts=... level=... msg=\"...\")"},
    {EM_CONFIG_FIELD(EM_CONFIG_OBJECT, "tls", em_daemon_config, tls), .object = &tls_schema,
     .help = "TLS for the listeners (absent: plaintext)"},
    {EM_CONFIG_FIELD(EM_CONFIG_BOOL, "insecure", em_daemon_config, insecure),
     .default_json = "false",
     .help = "let a listener reachable from other hosts run without TLS or a data token"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "drain_timeout_ms", em_daemon_config, drain_timeout_ms),
     .flags = EM_CONFIG_UNSIGNED | EM_CONFIG_RELOADABLE, .min = 0, .max = 3600000,
     .default_json = "30000",
     .help = "on SIGTERM, how long in-flight requests may take before exiting anyway"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "slowlog_threshold_ms", em_daemon_config,
                     slowlog_threshold_ms),
     .flags = EM_CONFIG_UNSIGNED | EM_CONFIG_RELOADABLE, .min = 0, .max = 3600000,
     .default_json = "100",
     .help = "requests taking at least this long are kept in the slow log (0: none)"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "slowlog_max_entries", em_daemon_config,
                     slowlog_max_entries),
     .flags = EM_CONFIG_UNSIGNED, .min = 1, .max = 100000, .default_json = "128",
     .help = "slow requests kept (the oldest are dropped first)"},
    {EM_CONFIG_FIELD(EM_CONFIG_BOOL, "request_histograms", em_daemon_config,
                     request_histograms),
     .default_json = "true",
     .help = "count answers by status and keep duration histograms per method (STATS, "
             "emberctl top, /metrics)"},
    {EM_CONFIG_FIELD(EM_CONFIG_OBJECT, "checkpoint", em_daemon_config, checkpoint),
     .object = &checkpoint_schema, .help = "durable tables (absent: nothing is saved)"},
};

/* tls is printed only when it is configured. */
static bool daemon_applies(const void *target, const em_config_field *field)
{
    const em_daemon_config *config = target;
    if (strcmp(field->name, "checkpoint") == 0)
        return config->checkpoint.enabled;
    return strcmp(field->name, "tls") != 0 || config->tls.enabled;
}

const em_config_schema em_daemon_config_schema = {
    .name = "emberd",
    .fields = daemon_fields,
    .field_count = sizeof(daemon_fields) / sizeof(daemon_fields[0]),
    .check = check_daemon,
    .applies = daemon_applies,
};

/* ---- loading ----------------------------------------------------------------------- */

em_status em_daemon_config_parse_text(const char *text, const char *origin,
                                      em_daemon_config *out, em_error *err)
{
    memset(out, 0, sizeof(*out));
    em_status status = em_config_parse_text(&em_daemon_config_schema, text, "", out, err);
    if (status != EM_OK) {
        em_daemon_config_deinit(out);
        return em_error_prefix(err, "%s: ", origin);
    }
    return EM_OK;
}

em_status em_daemon_config_load(const char *path, em_daemon_config *out, em_error *err)
{
    char *text = NULL;
    memset(out, 0, sizeof(*out));
    em_status status = em_config_read_file(path, EM_DAEMON_CONFIG_MAX_BYTES, &text, err);
    if (status != EM_OK)
        return status;
    status = em_daemon_config_parse_text(text, path, out, err);
    free(text);
    return status;
}

void em_daemon_config_deinit(em_daemon_config *config)
{
    free(config->tables.items);
    config->tables.items = NULL;
    config->tables.count = 0;
    memset(config->admin_token.value, 0, sizeof(config->admin_token.value));
    memset(config->data_token.value, 0, sizeof(config->data_token.value));
}

int em_daemon_config_changes(const em_daemon_config *old, const em_daemon_config *new_config,
                             void (*report)(void *context, const char *key, bool reloadable),
                             void *context)
{
    cJSON *before = em_config_to_json(&em_daemon_config_schema, old);
    cJSON *after = em_config_to_json(&em_daemon_config_schema, new_config);
    int changes = 0;
    for (size_t i = 0; before != NULL && after != NULL && i < em_daemon_config_schema.field_count;
         i++) {
        const em_config_field *field = &em_daemon_config_schema.fields[i];
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(before, field->name);
        const cJSON *b = cJSON_GetObjectItemCaseSensitive(after, field->name);
        if ((a != NULL || b != NULL) && !cJSON_Compare(a, b, true)) {
            report(context, field->name, (field->flags & EM_CONFIG_RELOADABLE) != 0);
            changes++;
        }
    }
    cJSON_Delete(before);
    cJSON_Delete(after);
    return changes;
}

const char *em_backend_type_name(int type)
{
    for (const em_config_choice *c = backend_choices; c->name != NULL; c++)
        if (c->value == type)
            return c->name;
    return "unknown";
}
