/*
 * DESIGN: the server's numbers, declared once, produced once, rendered many ways.
 *
 * Every number has one declaration: the server's counters in EM_SERVER_COUNTERS below,
 * the per-method counters in EM_METHOD_COUNTERS, a table's in EM_TABLE_STATS
 * (lib/table/table.h) and a pool's in EM_POOL_STATS (lib/memory/pool.h). Each row gives
 * the name, whether it is a counter or a gauge, its unit and a help text; the scope
 * (server, method, table, pool) says which label it carries.
 *
 * em_stats_collect gathers everything into one plain snapshot; em_stats_visit walks a
 * snapshot and calls a visitor once per number with its descriptor, label and value.
 * Every output is a visitor over the same snapshot: the STATS answer (protobuf fields
 * are found by the stat's name, daemon/handlers.c) today, a metrics endpoint tomorrow,
 * so all outputs agree and a number declared here reaches every one of them.
 *
 * Counters live in em_server_stats (atomics: the loop thread counts frames, bytes and
 * answered requests, anyone may read them). Besides the declared numbers, each method
 * keeps its answers by status and a histogram of request durations (from the frame's
 * arrival to its answer being handed to the connection), written only by the loop
 * thread, so recording one is a few plain stores and reading takes no lock.
 */
#ifndef EMBER_DAEMON_STATS_H
#define EMBER_DAEMON_STATS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/methods.h"
#include "lib/memory/pool.h"
#include "lib/table/catalog.h"
#include "lib/table/table.h"

/* X(name, kind, unit, help): the server-wide counters the daemon keeps. */
#define EM_SERVER_COUNTERS(X)                                                                 \
    X(connections_current, GAUGE, NONE, "connections open now")                               \
    X(connections_total, COUNTER, NONE, "connections accepted since start")                   \
    X(connections_rejected, COUNTER, NONE,                                                    \
      "connections refused over max_connections or while drained")        \
    X(bytes_in, COUNTER, BYTES, "bytes read from clients")                                    \
    X(bytes_out, COUNTER, BYTES, "bytes written to clients")                                  \
    X(frames_rejected, COUNTER, NONE, "frames that could not be parsed (connection closed)")    \
    X(admin_connections_current, GAUGE, NONE, "connections open on the admin listener now")   \
    X(admin_connections_rejected, COUNTER, NONE,                                             \
      "admin connections refused over max_admin_connections")                                 \
    X(memory_limit_bytes, GAUGE, BYTES, "memory connections may hold (limits.memory_bytes)")  \
    X(memory_used_bytes, GAUGE, BYTES, "bytes held now for requests and unwritten answers")   \
    X(memory_peak_bytes, GAUGE, BYTES, "most bytes held at once since start")                 \
    X(memory_waits, COUNTER, NONE, "times a connection stopped reading to wait for memory")   \
    X(connections_waiting, GAUGE, NONE, "connections waiting for memory now")                 \
    X(requests_refused_memory, COUNTER, NONE,                                                 \
      "requests refused as larger than the whole memory budget")                              \
    X(timeouts_idle, COUNTER, NONE, "connections closed after idle_timeout_ms")               \
    X(timeouts_frame, COUNTER, NONE,                                                          \
      "connections closed for a frame slower than frame_timeout_ms")                          \
    X(timeouts_write, COUNTER, NONE,                                                          \
      "connections closed when their answers made no progress for write_timeout_ms")          \
    X(requests_refused_draining, COUNTER, NONE, "requests answered UNAVAILABLE while draining") \
    X(tls_handshakes, COUNTER, NONE, "TLS handshakes completed")                              \
    X(tls_handshakes_failed, COUNTER, NONE, "TLS handshakes refused (bad certificate, protocol)") \
    X(checkpoint_saves, COUNTER, NONE, "table checkpoints completed")                         \
    X(checkpoint_save_failures, COUNTER, NONE,                                                \
      "table checkpoints that failed (not those refused beside another save of the table)")   \
    X(checkpoint_saves_running, GAUGE, NONE, "table checkpoints being written now")           \
    X(checkpoint_last_success_unix_ms, GAUGE, MILLISECONDS,                                   \
      "when the last checkpoint completed (Unix time)")                                       \
    X(checkpoint_last_save_ms, GAUGE, MILLISECONDS, "how long the last completed save took") \
    X(checkpoint_last_save_bytes, GAUGE, BYTES, "bytes the last completed save wrote")        \
    X(checkpoint_tables_restored, COUNTER, NONE, "tables loaded from checkpoints at start")   \
    X(checkpoint_rows_restored, COUNTER, NONE, "rows loaded from checkpoints at start")      \
    X(checkpoint_deltas, COUNTER, NONE, "table checkpoints completed as deltas")             \
    X(checkpoint_saves_unchanged, COUNTER, NONE,                                              \
      "periodic saves of a table unchanged since its latest checkpoint: nothing written")     \
    X(checkpoint_saves_passed_over, COUNTER, NONE,                                            \
      "periodic saves passed over because another save of the table was running")            \
    X(checkpoint_save_rows_read, GAUGE, NONE, "rows the saves running now have read")        \
    X(checkpoint_save_rows, GAUGE, NONE, "rows the snapshots of the saves running hold") \
    X(work_queued, GAUGE, NONE, "requests queued for or running on the workers now")       \
    X(metrics_scrapes, COUNTER, NONE, "answers to GET /metrics")                              \
    X(http_requests_refused, COUNTER, NONE,                                                   \
      "metrics listener requests refused (path, method, size, too slow, too many)")

/* X(name, kind, unit, help): per method. */
#define EM_METHOD_COUNTERS(X)                                                                 \
    X(requests, COUNTER, NONE, "requests answered")                                           \
    X(errors, COUNTER, NONE, "requests answered with an error")

/* Request duration buckets: upper bounds, 50 us to 10 s; one more, unbounded, follows. */
#define EM_DURATION_BUCKETS 17
extern const uint64_t em_duration_bounds_ns[EM_DURATION_BUCKETS];

typedef struct em_server_stats {
#define EM_SERVER_COUNTER_FIELD(name, kind, unit, help) _Atomic uint64_t name;
    EM_SERVER_COUNTERS(EM_SERVER_COUNTER_FIELD)
#undef EM_SERVER_COUNTER_FIELD
#define EM_METHOD_COUNTER_FIELD(name, kind, unit, help) _Atomic uint64_t name[EM_METHOD_COUNT];
    EM_METHOD_COUNTERS(EM_METHOD_COUNTER_FIELD)
#undef EM_METHOD_COUNTER_FIELD
    /* the loop thread's alone to write (em_stats_record_response) */
    _Atomic uint64_t answers[EM_METHOD_COUNT][EM_STATUS_COUNT];
    _Atomic uint64_t duration_buckets[EM_METHOD_COUNT][EM_DURATION_BUCKETS + 1];
    _Atomic uint64_t duration_sum_ns[EM_METHOD_COUNT];
} em_server_stats;

/* Counts one answered request of method slot (requests, errors) and, with details, its
 * status and duration. Loop thread only (the single writer of these counters). */
void em_stats_record_response(em_server_stats *stats, size_t method, em_status status,
                              uint64_t duration_ns, bool details);

typedef enum em_stat_kind {
    EM_STAT_COUNTER, /* only grows */
    EM_STAT_GAUGE,   /* goes up and down */
    EM_STAT_INFO,    /* text (version, state, backend) */
} em_stat_kind;

typedef enum em_stat_unit {
    EM_STAT_NONE,
    EM_STAT_BYTES,
    EM_STAT_MILLISECONDS,
    EM_STAT_RATIO,
} em_stat_unit;

/* Which label a number carries. */
typedef enum em_stat_scope {
    EM_STAT_SERVER, /* none */
    EM_STAT_METHOD, /* method ("PULL") */
    EM_STAT_TABLE,  /* table name */
    EM_STAT_POOL,   /* device ("cpu0") */
} em_stat_scope;

typedef struct em_stat {
    const char *name; /* as on the wire: "keys_pulled" */
    em_stat_kind kind;
    em_stat_unit unit;
    em_stat_scope scope;
    const char *help;
} em_stat;

typedef struct em_stat_value {
    enum { EM_STAT_VALUE_U64, EM_STAT_VALUE_DOUBLE, EM_STAT_VALUE_TEXT } type;
    uint64_t u64;
    double f64;
    const char *text;
} em_stat_value;

typedef struct em_method_snapshot {
    const char *name;
#define EM_METHOD_SNAPSHOT_FIELD(name, kind, unit, help) uint64_t name;
    EM_METHOD_COUNTERS(EM_METHOD_SNAPSHOT_FIELD)
#undef EM_METHOD_SNAPSHOT_FIELD
    uint64_t answers[EM_STATUS_COUNT];                 /* by status */
    uint64_t duration_buckets[EM_DURATION_BUCKETS + 1]; /* per bucket, not cumulative */
    uint64_t duration_sum_ns;
} em_method_snapshot;

typedef struct em_table_stats_snapshot {
    char name[EM_TABLE_NAME_MAX + 1];
    em_table_stats stats;
} em_table_stats_snapshot;

typedef struct em_pool_snapshot {
    char device[32];
    em_pool_stats stats;
} em_pool_snapshot;

typedef struct em_stats_snapshot {
    const char *version;
    const char *state;
    const char *backend;
    const char *exchange;
    uint64_t exchange_fallback;
    uint64_t pinned_buffer_bytes_in_use, pinned_buffer_bytes_limit, pinned_buffers_full;
    uint64_t bytes_copied_directly, bytes_copied_staged;
    uint64_t device_waits, device_wait_ms;
    uint64_t uptime_ms;
#define EM_SERVER_SNAPSHOT_FIELD(name, kind, unit, help) uint64_t name;
    EM_SERVER_COUNTERS(EM_SERVER_SNAPSHOT_FIELD)
#undef EM_SERVER_SNAPSHOT_FIELD
    em_method_snapshot methods[EM_METHOD_COUNT];
    size_t method_count;
    em_table_stats_snapshot *tables;
    size_t table_count;
    em_pool_snapshot *pools;
    size_t pool_count;
} em_stats_snapshot;

/* Fills snapshot (tables limited to table_filter unless it is NULL or ""); version,
 * state and uptime are the caller's to set. Errors: NOT_FOUND for an unknown
 * table_filter, RESOURCE_EXHAUSTED. Thread-safe. */
em_status em_stats_collect(const em_server_stats *counters, em_catalog *catalog,
                           const char *table_filter, em_stats_snapshot *snapshot, em_error *err);

void em_stats_snapshot_free(em_stats_snapshot *snapshot);

/* Called once per number: index is the method, table or pool position in the snapshot
 * (0 for server numbers), label its name (NULL for server numbers). */
typedef void (*em_stats_visitor)(void *context, const em_stat *stat, size_t index,
                                 const char *label, em_stat_value value);

/* Visits every number of snapshot: the server's, then each method's, table's and
 * pool's, each in declaration order. */
void em_stats_visit(const em_stats_snapshot *snapshot, em_stats_visitor visitor, void *context);

/* The STATS answer (an Ember__StatsResponse, packed) for snapshot, rendered by the
 * visitor of daemon/handlers.c: *out is malloc'ed. Errors: INTERNAL when a stat has no
 * field of its name on the wire, RESOURCE_EXHAUSTED. */
em_status em_stats_render_response(const em_stats_snapshot *snapshot, uint8_t **out,
                                   size_t *length, em_error *err);

/* Every stat the schema declares, in visiting order within each scope (for tests and
 * for outputs that describe the numbers before giving them). */
const em_stat *em_stats_schema(size_t *count);

#endif
