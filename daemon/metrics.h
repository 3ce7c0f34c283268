/*
 * DESIGN: the STATS numbers for Prometheus.
 *
 * em_metrics_render walks the same snapshot with the same visitor as the STATS answer
 * (daemon/stats.h), so a scrape and STATS never disagree, and writes Prometheus's text
 * format 0.0.4 or, when asked, OpenMetrics 1.0. Names follow Prometheus's conventions:
 *
 *   ember_<stat>            every stat of the schema (a table's ember_table_<stat>, a
 *                           pool's ember_pool_<stat>); a counter's samples end in _total
 *   gauges named x_count    x_counts would read as a histogram's: ember_xs
 *   bytes                   named so: largest_free_block -> largest_free_block_bytes
 *   counters                one total: total_allocations -> allocations_total
 *   milliseconds            become seconds: x_ms -> x_seconds, x_unix_ms ->
 *                           x_timestamp_seconds
 *   text stats              ember_build_info{version} and ember_<stat>_info{<stat>} 1
 *   labels                  method (per-method stats), table, device (pools)
 *
 * and, per method, what the schema does not hold: ember_responses_total{method,status}
 * (answers by status) and the histogram ember_request_duration_seconds{method} (buckets
 * from 50 us to 10 s), for the methods that answered anything.
 */
#ifndef EMBER_DAEMON_METRICS_H
#define EMBER_DAEMON_METRICS_H

#include <stdbool.h>
#include <stddef.h>

#include "daemon/stats.h"
#include "lib/base/status.h"

#define EM_METRICS_TEXT_TYPE "text/plain; version=0.0.4; charset=utf-8"
#define EM_METRICS_OPENMETRICS_TYPE "application/openmetrics-text; version=1.0.0; charset=utf-8"

/* Whether an Accept header asks for OpenMetrics. */
bool em_metrics_wants_openmetrics(const char *accept);

/* The exposition of snapshot; *out is malloc'ed. Errors: RESOURCE_EXHAUSTED. */
em_status em_metrics_render(const em_stats_snapshot *snapshot, bool openmetrics, char **out,
                            size_t *length, em_error *err);

#endif
