/*
 * DESIGN: the server's numbers, produced once and rendered many ways.
 *
 * Counters live in em_server_stats (atomics: the loop thread counts frames and bytes,
 * workers read them). em_stats_collect gathers them together with every table's and
 * every device pool's statistics into one plain snapshot; the STATS method renders the
 * snapshot as protobuf, and any other output (a metrics endpoint) renders the same
 * snapshot, so all outputs always agree.
 */
#ifndef EMBER_DAEMON_STATS_H
#define EMBER_DAEMON_STATS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "lib/table/catalog.h"
#include "lib/memory/pool.h"
#include "lib/table/table.h"

/* Slots for per-method counters (indices of the dispatch method table). */
#define EM_METHOD_SLOTS 16

typedef struct em_server_stats {
    _Atomic uint64_t connections_current;
    _Atomic uint64_t connections_total;
    _Atomic uint64_t connections_rejected;
    _Atomic uint64_t bytes_in;
    _Atomic uint64_t bytes_out;
    _Atomic uint64_t frames_rejected;
    _Atomic uint64_t requests[EM_METHOD_SLOTS];
    _Atomic uint64_t errors[EM_METHOD_SLOTS];
} em_server_stats;

typedef struct em_method_snapshot {
    const char *name;
    uint64_t requests, errors;
} em_method_snapshot;

typedef struct em_table_snapshot {
    char name[EM_TABLE_NAME_MAX + 1];
    em_table_stats stats;
} em_table_snapshot;

typedef struct em_pool_snapshot {
    char device[32];
    em_pool_stats stats;
} em_pool_snapshot;

typedef struct em_stats_snapshot {
    const char *state;
    const char *backend;
    uint64_t uptime_ms;
    uint64_t connections_current, connections_total, connections_rejected;
    uint64_t bytes_in, bytes_out, frames_rejected;
    em_method_snapshot methods[EM_METHOD_SLOTS];
    size_t method_count;
    em_table_snapshot *tables;
    size_t table_count;
    em_pool_snapshot *pools;
    size_t pool_count;
} em_stats_snapshot;

/* Fills snapshot (tables limited to table_filter unless it is NULL or ""). Errors:
 * NOT_FOUND for an unknown table_filter, RESOURCE_EXHAUSTED. Thread-safe. */
em_status em_stats_collect(const em_server_stats *counters, em_catalog *catalog,
                           const char *table_filter, em_stats_snapshot *snapshot, em_error *err);

void em_stats_snapshot_free(em_stats_snapshot *snapshot);

#endif
