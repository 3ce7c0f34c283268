/*
 * DESIGN: work split by nature into independent items (a request's evictions, one per
 * shard) run on several threads for the length of one call. The threads are started for
 * the call and joined before it returns, so nothing outlives it and nothing is shared
 * between calls (lib/ keeps no global state); callers use it only for work that takes
 * far longer than starting a thread (tens of microseconds).
 */
#ifndef EMBER_LIB_BASE_PARALLEL_H
#define EMBER_LIB_BASE_PARALLEL_H

#include <stdint.h>

/* Runs one item of work: item is in [0, n) of em_parallel_run. */
typedef void (*em_parallel_item)(void *context, uint64_t item);

/* Calls item(context, i) once for each i in [0, n): on the calling thread and on up to
 * threads - 1 others started for the call (fewer when n is smaller; when a thread
 * cannot be started, those running do its share). Items run in no set order, at the
 * same time as each other; the call returns once every item has run. */
void em_parallel_run(uint64_t n, uint32_t threads, em_parallel_item item, void *context);

/* The CPUs online (at least 1). */
uint32_t em_parallel_cpus(void);

#endif
