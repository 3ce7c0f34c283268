/*
 * DESIGN: what `emberctl top` shows, computed from two STATS answers.
 *
 * The server keeps totals (counters since start, and per-method duration histograms);
 * rates and latency percentiles are differences between two of its answers. The
 * interval is the difference of the two answers' uptime_ms, so the client's own
 * scheduling does not skew the rates; a smaller uptime in the later answer (the server
 * restarted) makes the earlier answer count as all zeros.
 *
 * Percentiles are read from the histogram of the requests answered in the interval, as
 * Prometheus's histogram_quantile does: linear within the bucket that holds the rank, the
 * first bucket starting at 0; a rank in the unbounded last bucket reads as the largest
 * bound (10 s), so "p99 10 s" means "at least 10 s".
 *
 * The view is JSON, the one thing both the terminal rendering and --json print:
 *   {"seconds", "server": {version, state, backend, uptime_ms, connections_current,
 *    connections_per_second, rejected_per_second, bytes_in_per_second,
 *    bytes_out_per_second, work_queued, memory_used_bytes, memory_limit_bytes},
 *    "methods": [{method, requests_per_second, errors_per_second, p50_seconds,
 *                 p90_seconds, p99_seconds}]   (methods with requests in the interval),
 *    "tables": [{name, rows, capacity, pulls_per_second, pushes_per_second,
 *                keys_pulled_per_second, keys_pushed_per_second,
 *                rows_created_per_second}]   (busiest first),
 *    "pools": [{device, bytes_in_use, bytes_reserved, bytes_limit, peak_bytes_in_use,
 *               largest_free_block, fragmentation}]}
 */
#ifndef EMBER_CLIENTS_CLIENT_TOP_H
#define EMBER_CLIENTS_CLIENT_TOP_H

#include <cJSON.h>
#include <stddef.h>
#include <stdint.h>

/* The view of what happened between two STATS answers (em_client_stats's JSON) taken
 * wall_seconds apart (used only when the uptimes do not give an interval); NULL when
 * out of memory. The caller frees it with cJSON_Delete. */
cJSON *em_top_view(const cJSON *before, const cJSON *after, double wall_seconds);

/* The q-quantile (0 < q <= 1) of a histogram: counts[i] requests fell at or below
 * bounds[i] (and above bounds[i-1]), counts[bound_count] above the last bound. Returns 0
 * for an empty histogram. */
double em_top_quantile(const double *bounds, const double *counts, size_t bound_count,
                       double q);

#endif
