/*
 * DESIGN: work split by nature into independent items (a request's evictions, one per
 * shard) run on several threads for the length of one call. The threads come from a
 * pool its owner keeps (a backend: em_backend.workers), started as runs first need them
 * and waiting between runs, so that a run costs a wake-up of each thread rather than
 * starting and joining it (tens of microseconds each); without a pool they are started
 * for the call and joined before it returns. Either way nothing of a run outlives the
 * call, and lib/ keeps no global state. The calling thread always runs items too, and
 * no run waits for a thread to become free: threads busy elsewhere leave their share to
 * the ones that take part, so runs from several threads, or from inside an item, never
 * wait for each other.
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

/* Threads kept for runs: up to `helpers` of them (at most 64), each started the first
 * time a run finds none waiting, until the pool is destroyed. */
typedef struct em_parallel_pool em_parallel_pool;

/* NULL when out of memory (runs then start their threads as em_parallel_run does). */
em_parallel_pool *em_parallel_pool_create(uint32_t helpers);
/* Joins the pool's threads; no run may be in progress. NULL: nothing. */
void em_parallel_pool_destroy(em_parallel_pool *pool);

/* em_parallel_run with the pool's threads as the others: at most threads - 1 of them
 * (and n - 1, and the pool's helpers) take items beside the calling thread, those
 * waiting in the pool or started for it now; pool NULL: em_parallel_run. */
void em_parallel_pool_run(em_parallel_pool *pool, uint64_t n, uint32_t threads,
                          em_parallel_item item, void *context);

/* The CPUs online (at least 1). */
uint32_t em_parallel_cpus(void);

#endif
