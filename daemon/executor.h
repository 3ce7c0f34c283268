/*
 * DESIGN: the bridge between the loop thread and the workers that run table work.
 *
 * The loop thread hands a job to em_executor_submit; one of the worker threads runs its
 * `run` function; the finished job goes on a completion list and the loop is woken with
 * uv_async_send. libuv coalesces wake-ups, so the async callback swaps out the whole
 * list and calls every job's `done` on the loop thread. The loop never waits for a
 * worker: submit only takes the queue mutex, which workers hold for a pointer swap.
 *
 * The CPU backend runs all tables on one pool of workers; a GPU backend gives each
 * device its own executor whose single thread owns the device's streams.
 */
#ifndef EMBER_DAEMON_EXECUTOR_H
#define EMBER_DAEMON_EXECUTOR_H

#include <stdint.h>
#include <uv.h>

#include "lib/base/status.h"

typedef struct em_job em_job;

struct em_job {
    void (*run)(em_job *job);  /* on a worker thread */
    void (*done)(em_job *job); /* on the loop thread, after run */
    em_job *next;              /* queue link, owned by the executor */
};

typedef struct em_executor em_executor;

/* Starts threads workers. The executor's async handle keeps loop alive until
 * em_executor_close. Errors: RESOURCE_EXHAUSTED or INTERNAL naming what failed. */
em_status em_executor_create(uv_loop_t *loop, uint32_t threads, const char *name,
                             em_executor **out, em_error *err);

/* Queues a job. Loop thread only. */
void em_executor_submit(em_executor *executor, em_job *job);

/* Jobs submitted and not yet done. Any thread. */
uint64_t em_executor_pending(const em_executor *executor);

/* Jobs each worker has finished since start (progress for watchdogs), summed. */
uint64_t em_executor_completed(const em_executor *executor);

uint32_t em_executor_threads(const em_executor *executor);

/* Stops the workers once the queue is empty, joins them, closes the async handle and
 * frees the executor when libuv has released the handle. Jobs still queued run first.
 * Loop thread only. */
void em_executor_close(em_executor *executor);

#endif
