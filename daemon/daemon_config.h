/*
 * DESIGN: emberd's configuration file.
 *
 * One JSON object, declared below as schema tables (lib/base/config.h), so every key has
 * one line saying its type, bounds, default, whether SIGHUP may change it, and its
 * help text; unknown keys and bad values are errors naming the key path and the value.
 *
 *   {
 *     "listen":  {"data": "127.0.0.1:7070", "admin": "127.0.0.1:7071",
 *                 "metrics": "127.0.0.1:9464" ("" for none; daemon/http.h)},
 *     "limits":  {"max_body_bytes": 67108864, "max_attachment_bytes": 1073741824,
 *                 "max_connections": 1024, "max_keys_per_request": 4194304,
 *                 "connection_inflight_bytes": 268435456, "idle_timeout_ms": 300000,
 *                 "memory_bytes": 0 (a quarter of RAM), "max_admin_connections": 16,
 *                 "frame_timeout_ms": 60000, "write_timeout_ms": 60000, ...},
 *     "backend": {"type": "cpu", "devices": 1, "threads": 0, "memory_limit_bytes": 0},
 *                 (cuda: "gpus": [0, 1], "memory_fraction": 0.8, "lanes": 2),
 *     "tables":  [ {table config, lib/table/table_config.h}, ... ],
 *     "admin_token": {"value": "..."} | {"file": "/etc/ember/admin.token"} | {"env": "NAME"},
 *     "data_token":  same forms (optional),
 *     "log_level": "info", "log_format": "text" | "logfmt",
 *     "tls": {"certificate_file": "...", "private_key_file": "...",
 *             "client_ca_file": "..." (mutual TLS), "data": true, "admin": true},
 *     "insecure": false,
 *     "drain_timeout_ms": 30000,
 *     "slowlog_threshold_ms": 100, "slowlog_max_entries": 128 (daemon/slowlog.h),
 *     "request_histograms": true (answers by status and durations, daemon/stats.h)
 *   }
 *
 * Tokens are resolved when the file is read (a token file's trailing newline is
 * dropped), so a reload picks up a rotated token file.
 */
#ifndef EMBER_DAEMON_DAEMON_CONFIG_H
#define EMBER_DAEMON_DAEMON_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "lib/base/config.h"
#include "lib/base/log.h"
#include "daemon/tls.h"
#include "lib/base/status.h"
#include "lib/table/table_config.h"

#define EM_ADDRESS_MAX 128
#define EM_TOKEN_MAX 256
#define EM_DAEMON_CONFIG_MAX_BYTES (16u << 20)
/* What a printed configuration shows for an inline token. */
#define EM_TOKEN_REDACTED "(redacted)"

typedef struct em_token {
    bool set;
    char value[EM_TOKEN_MAX + 1];
    char source[EM_ADDRESS_MAX + 16]; /* "inline", "file /path", "env NAME": for logs */
} em_token;

typedef struct em_listen_config {
    char data[EM_ADDRESS_MAX];
    char admin[EM_ADDRESS_MAX];
    char metrics[EM_ADDRESS_MAX]; /* "": no metrics listener */
} em_listen_config;

typedef struct em_limits_config {
    uint32_t max_meta_bytes;
    uint64_t max_body_bytes;
    uint64_t max_attachment_bytes;
    uint32_t max_connections;
    uint64_t max_keys_per_request;
    uint64_t max_response_bytes;
    uint64_t connection_inflight_bytes;
    uint32_t idle_timeout_ms;
    uint32_t max_admin_connections;
    uint64_t memory_bytes; /* resolved: never 0 after parsing */
    uint32_t frame_timeout_ms;
    uint32_t write_timeout_ms;
    uint32_t drain_linger_ms;
} em_limits_config;

/* The smallest memory budget a configuration may set. */
#define EM_MEMORY_BUDGET_MIN (1u << 20)

typedef enum em_backend_type {
    EM_BACKEND_AUTO = 0,
    EM_BACKEND_CPU = 1,
    EM_BACKEND_CUDA = 2,
} em_backend_type;

#define EM_MAX_GPUS 64

typedef struct em_gpu_list {
    uint32_t ordinals[EM_MAX_GPUS];
    uint32_t count; /* 0: every usable GPU */
} em_gpu_list;

typedef struct em_backend_config {
    int type; /* em_backend_type */
    uint32_t devices;
    uint32_t threads; /* worker threads; 0: one per online CPU (cpu), lanes (cuda) */
    uint64_t memory_limit_bytes;
    uint64_t initial_bytes;
    uint64_t growth_bytes;
    uint32_t eviction_threads; /* cpu: threads for one request's evictions (0: the CPUs) */
    em_gpu_list gpus;       /* cuda */
    double memory_fraction; /* cuda, when memory_limit_bytes is 0 */
    uint32_t lanes;         /* cuda: streams per GPU */
    uint64_t staging_bytes; /* cuda: pinned staging per lane */
    uint64_t pinned_buffer_bytes; /* cuda: pinned request and answer buffers */
} em_backend_config;

typedef struct em_tables_config {
    em_table_config *items;
    uint32_t count;
} em_tables_config;

#define EM_CHECKPOINT_DIR_MAX 1024

typedef enum em_restore_mode {
    EM_RESTORE_LATEST = 0, /* every table's latest checkpoint under dir */
    EM_RESTORE_NONE = 1,
    EM_RESTORE_SEED = 2,   /* as latest, then the tables that have none from restore_path */
} em_restore_mode;

typedef struct em_checkpoint_config {
    bool enabled; /* the section is present */
    char dir[EM_CHECKPOINT_DIR_MAX];
    uint32_t keep;
    uint32_t interval_s; /* 0: no periodic saves */
    uint32_t full_every; /* periodic and shutdown saves: a full one every this many */
    bool on_shutdown;
    /* "latest", "none" or an absolute path (EM_RESTORE_SEED): a checkpoint root (tables
     * below it, as under dir) or a cluster checkpoint */
    char restore_text[EM_CHECKPOINT_DIR_MAX];
    int restore;         /* em_restore_mode, from restore_text */
    uint32_t cluster_index, cluster_size; /* this server's place in its cluster (size 0:
                                           * not given): the buckets a seed from a
                                           * cluster checkpoint loads */
    uint64_t copy_limit_bytes;
} em_checkpoint_config;

typedef struct em_daemon_config {
    em_listen_config listen;
    em_limits_config limits;
    em_backend_config backend;
    em_tables_config tables;
    em_token admin_token;
    em_token data_token;
    int log_level; /* em_log_level */
    int log_format; /* 0 text, 1 logfmt */
    em_tls_config tls;
    bool insecure;  /* non-loopback listeners without TLS or data token allowed */
    uint32_t drain_timeout_ms;
    uint32_t slowlog_threshold_ms; /* 0: nothing is recorded */
    uint32_t slowlog_max_entries;
    bool request_histograms; /* answers by status, durations by method */
    em_checkpoint_config checkpoint;
} em_daemon_config;

extern const em_config_schema em_daemon_config_schema;

/* Reads and validates the file at path. On error *out holds nothing to free. */
em_status em_daemon_config_load(const char *path, em_daemon_config *out, em_error *err);

/* Parses JSON text; origin names it in messages (a file path). */
em_status em_daemon_config_parse_text(const char *text, const char *origin,
                                      em_daemon_config *out, em_error *err);

/* Frees what parsing allocated (the tables array). */
void em_daemon_config_deinit(em_daemon_config *config);

/* Calls report once per top-level key whose value differs between old and new, saying
 * whether a reload can change it (its RELOADABLE flag); returns how many there were.
 * Secrets are compared by where they come from (a rotated token file is not a change). */
int em_daemon_config_changes(const em_daemon_config *old, const em_daemon_config *new_config,
                             void (*report)(void *context, const char *key, bool reloadable),
                             void *context);

/* "cpu", "cuda", "auto". */
const char *em_backend_type_name(int type);

#endif
