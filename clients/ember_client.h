/*
 * DESIGN: libember-client, the C client of emberd.
 *
 * A client holds one TCP connection per server of its list and speaks the frame
 * protocol of proto/frame.h over blocking sockets driven by poll(2); it needs no event
 * loop. Requests are pipelined: up to `window` requests per connection are in flight,
 * and responses are matched by correlation id in whatever order they come.
 *
 * With several servers, keys are spread by jump consistent hash of their virtual
 * bucket (em_key_server, common/keyhash.h): a pull or push is split into one sub-request per server
 * holding only that server's keys, sent together, and reassembled so the caller sees
 * one result. The split keeps results bit-identical to a single server holding every
 * key: pooled pulls fetch each server's distinct keys unpooled and pool them here in
 * key order with the server's arithmetic; pushes with per-row gradients send per-key
 * gradients (row gradient / em_combiner_divisor) so each server sums a key's gradients
 * in the same order a single server would.
 *
 * Errors carry the server's status and message ("server 10.0.0.2:7070: NOT_FOUND: no
 * table 'x'"); connection failures are UNAVAILABLE, expired timeouts
 * DEADLINE_EXCEEDED. A broken connection fails the calls in flight on it and is
 * re-established (with backoff, up to reconnect_attempts) by the next call.
 *
 * Thread-safety: a client is used by one thread at a time; threads create their own.
 */
#ifndef EMBER_CLIENTS_EMBER_CLIENT_H
#define EMBER_CLIENTS_EMBER_CLIENT_H

#include <cJSON.h>
#include <stdbool.h>
#include <stdint.h>

#include "lib/table/csr.h"
#include "lib/base/status.h"

typedef struct em_client em_client;

typedef struct em_client_options {
    const char *servers;         /* "host:port[,host:port...]"; copied */
    const char *token;           /* sent with every request; NULL or "" for none; copied */
    uint32_t window;             /* requests in flight per connection (default 64) */
    uint32_t timeout_ms;         /* per call, sent as deadline_ms; 0 = none (default 30000) */
    uint32_t connect_timeout_ms; /* default 5000 */
    uint32_t reconnect_attempts; /* default 3 */
    /* TLS: on when tls_ca_file is set (the CA the servers' certificates chain to); with
     * tls_cert_file and tls_key_file the client presents a certificate (mutual TLS);
     * tls_server_name, when set, is the name checked in the servers' certificates
     * instead of the host dialled. All copied. */
    const char *tls_ca_file;
    const char *tls_cert_file;
    const char *tls_key_file;
    const char *tls_server_name;
} em_client_options;

void em_client_options_init(em_client_options *options);

/* Parses the server list and connects to every server. Errors: INVALID_ARGUMENT for a
 * bad list (naming the entry), UNAVAILABLE naming the server that did not answer. */
em_status em_client_create(const em_client_options *options, em_client **out, em_error *err);

/* Closes the connections; calls not finished are dropped. NULL is ignored. */
void em_client_destroy(em_client *client);

uint32_t em_client_server_count(const em_client *client);

/* ---- data ------------------------------------------------------------------------- */

typedef struct em_client_pull_args {
    const char *table;
    em_csr batch;
    em_combiner combiner;
    bool create_missing;
    float *out;            /* caller-owned: em_csr_output_vectors() x dim floats */
    uint64_t out_capacity; /* floats available at out */
} em_client_pull_args;

typedef struct em_client_pull_result {
    uint32_t dim;
    uint64_t unique_keys, missing, created; /* summed over servers */
} em_client_pull_result;

typedef struct em_client_push_args {
    const char *table;
    em_csr batch;
    em_combiner combiner;
    const float *gradients;  /* em_csr_output_vectors() x dim floats */
    uint64_t gradient_count; /* floats at gradients */
} em_client_push_args;

typedef struct em_client_push_result {
    uint64_t updated, created; /* summed over servers */
} em_client_push_result;

/* Blocking pull and push (start + finish). */
em_status em_client_pull(em_client *client, const em_client_pull_args *args,
                         em_client_pull_result *result, em_error *err);
em_status em_client_push(em_client *client, const em_client_push_args *args,
                         em_client_push_result *result, em_error *err);

/* Pipelining: start sends the request(s) and returns at once (waiting only while the
 * window is full); finish waits for that call's responses, fills the result and frees
 * the call. The arrays in args (and out) must stay valid until finish. Calls may be
 * finished in any order. */
typedef struct em_client_call em_client_call;

em_status em_client_pull_start(em_client *client, const em_client_pull_args *args,
                               em_client_call **call, em_error *err);
em_status em_client_push_start(em_client *client, const em_client_push_args *args,
                               em_client_call **call, em_error *err);
/* result points to an em_client_pull_result or em_client_push_result matching the
 * call's kind (may be NULL). */
em_status em_client_finish(em_client *client, em_client_call *call, void *result, em_error *err);

/* ---- health and admin (sent to the first server of the list) ----------------------- */

typedef struct em_client_health {
    bool ready;
    char state[16];
    char backend[16];
    uint32_t devices, tables;
} em_client_health;

em_status em_client_ping(em_client *client, char *version, size_t version_capacity,
                         uint64_t *uptime_ms, em_error *err);
em_status em_client_health_check(em_client *client, em_client_health *out, em_error *err);

/* config_json: a table config object (lib/table/table_config.h). *info (nullable) gets the
 * created table as a JSON object (caller frees with cJSON_Delete). */
em_status em_client_create_table(em_client *client, const char *config_json, cJSON **info,
                                 em_error *err);
/* The table stays dropped across restarts: a server with checkpoints sets its checkpoints
 * aside (proto/ember.proto, DropTableRequest). */
em_status em_client_drop_table(em_client *client, const char *table, em_error *err);

/* JSON array of table objects {name, dim, capacity, shards, optimizer, rows, config}. */
em_status em_client_list_tables(em_client *client, cJSON **tables, em_error *err);

/* JSON object {server: {...}, tables: [...], pools: [...]} with the fields of
 * StatsResponse in proto/ember.proto; table NULL or "" for every table. */
em_status em_client_stats(em_client *client, const char *table, cJSON **stats, em_error *err);

/* Saves the table (NULL or "": every table) as a checkpoint on the first server, with
 * delta only what changed since its last checkpoint; *saved gets a JSON array of
 * {table, id, path, rows, bytes, seconds, kind, parent, depth, tombstones,
 * table_rows, manifest_xxh3, chunks, created_unix_ms}. */
em_status em_client_save(em_client *client, const char *table, bool delta, cJSON **saved,
                         em_error *err);

/* The complete checkpoints of the table (NULL or "": every table) under the first
 * server's checkpoint.dir, each table's oldest first and its latest last, from their
 * manifests; *listed gets a JSON array of objects as em_client_save's (seconds 0; kind
 * "?" for a manifest that does not read). Errors: FAILED_PRECONDITION without a
 * checkpoint section, NOT_FOUND for a table without checkpoints. */
em_status em_client_checkpoints(em_client *client, const char *table, cJSON **listed,
                                em_error *err);

/* Loads a checkpoint on the first server into the table (new, or replacing it in one
 * step): path is the checkpoint's directory on the server, or NULL for the table's
 * latest checkpoint; weights_only keeps the table's optimizer and loads the weights.
 * *loaded (nullable) gets {table, id, path, rows, bytes, seconds}. */
em_status em_client_load(em_client *client, const char *table, const char *path,
                         bool weights_only, cJSON **loaded, em_error *err);

/* ---- cluster checkpoints (every server of the list; lib/checkpoint/checkpoint_cluster.h) */

/* Saves the table (NULL or "": every table) of every server into one cluster checkpoint
 * at dir: an absolute path that this client and every server see alike (shared
 * storage), new or empty. Server i writes full copies under <dir>/server-<i> (its own
 * checkpoints and deltas are left alone), all servers at once; then the record,
 * <dir>/cluster.json, is written last, so a failed save leaves no cluster checkpoint.
 * *record (nullable) gets the record. Errors: INVALID_ARGUMENT (a relative dir),
 * ALREADY_EXISTS (dir holds a cluster checkpoint), a server's error naming it. */
em_status em_client_cluster_save(em_client *client, const char *table, const char *dir,
                                 cJSON **record, em_error *err);

/* Restores the table (NULL or "": every table of the record) from the cluster checkpoint
 * at dir onto the servers of this client's list, whatever their number: server j loads
 * from every part the buckets it owns among them (jump hash over this list), reading
 * only those chunks, and replaces its table in one step; shards > 0 sets the tables'
 * shard count (0: as saved). Servers load at once; a failure on one leaves the others
 * loaded (run it again). *loaded (nullable) gets one {table, server, address, rows,
 * table_rows, sources, ...} per server and table. Errors: NOT_FOUND (no record, or no
 * such table in it), DATA_LOSS (a damaged record or part), a server's error naming it. */
em_status em_client_cluster_load(em_client *client, const char *dir, const char *table,
                                 uint32_t shards, cJSON **loaded, em_error *err);

/* Maintenance on the first server: DRAIN takes it out of service (its data listener
 * refuses connections and data requests; HEALTH says "drained"), requests already
 * received finish; UNDRAIN puts it back. Both are idempotent. */
typedef struct em_client_drain_state {
    bool was_drained;          /* it was drained before this call */
    uint64_t requests_running; /* requests queued for or running on its workers */
    uint32_t data_connections; /* connections still open on its data listener */
} em_client_drain_state;

em_status em_client_drain(em_client *client, em_client_drain_state *out, em_error *err);
em_status em_client_undrain(em_client *client, bool *was_drained, em_error *err);

/* RELOAD on the first server (as SIGHUP): *report gets {path, changed: [keys],
 * needs_restart: [keys]}. */
em_status em_client_reload(em_client *client, cJSON **report, em_error *err);

/* The slow log of the first server, newest first (max 0: every entry held; reset empties
 * it after reading): *log gets {recorded, dropped, threshold_ms, entries: [{id, unix_ms,
 * duration_us, queue_us, run_us, method, table, keys, bytes, status, peer}]}. */
em_status em_client_slowlog(em_client *client, uint32_t max, bool reset, cJSON **log,
                            em_error *err);

/* ERASE: removes the listed keys (repeats allowed) from the table, each on the server
 * that holds it; *erased gets how many were present. */
em_status em_client_erase(em_client *client, const char *table, const uint64_t *keys,
                          uint64_t n, uint64_t *erased, em_error *err);

/* ERASE by age on every server: removes the rows neither pushed nor created in the
 * table's last not_pushed_for pushes (at least 1); *erased gets how many. */
em_status em_client_erase_older(em_client *client, const char *table, uint32_t not_pushed_for,
                                uint64_t *erased, em_error *err);

/* ERASE by time on every server: removes the rows neither pushed nor created since
 * since_unix_ms (a row pushed shortly before may stay: the servers know push clocks at
 * sampled times); *erased gets how many. */
em_status em_client_erase_before(em_client *client, const char *table, uint64_t since_unix_ms,
                                 uint64_t *erased, em_error *err);

/* EVICTED on the first server: the keys the table's eviction policy removed after
 * sequence number `after`, oldest first (max 0: all the ring holds): *evicted gets
 * {keys: ["decimal", ...], first, total, missed} (keys[0] has sequence `first`; missed:
 * keys after `after` the ring dropped before this read). */
em_status em_client_evicted(em_client *client, const char *table, uint64_t after, uint32_t max,
                            cJSON **evicted, em_error *err);

#endif
