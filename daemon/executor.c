#include "daemon/executor.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

struct em_executor {
    uv_async_t wakeup; /* first: the handle's data points back here */
    pthread_mutex_t lock;
    pthread_cond_t work_ready;
    em_job *queue_head, *queue_tail;
    em_job *completed; /* finished jobs, newest first */
    bool stopping;
    pthread_t *threads;
    uint32_t thread_count;
    _Atomic uint64_t pending; /* written by the loop thread only, read by anyone */
    _Atomic uint64_t completed_count;
};

static em_job *take_job(em_executor *executor)
{
    pthread_mutex_lock(&executor->lock);
    while (executor->queue_head == NULL && !executor->stopping)
        pthread_cond_wait(&executor->work_ready, &executor->lock);
    em_job *job = executor->queue_head;
    if (job != NULL) {
        executor->queue_head = job->next;
        if (executor->queue_head == NULL)
            executor->queue_tail = NULL;
    }
    pthread_mutex_unlock(&executor->lock);
    return job;
}

static void complete_job(em_executor *executor, em_job *job)
{
    pthread_mutex_lock(&executor->lock);
    job->next = executor->completed;
    executor->completed = job;
    pthread_mutex_unlock(&executor->lock);
    atomic_fetch_add_explicit(&executor->completed_count, 1, memory_order_relaxed);
    uv_async_send(&executor->wakeup);
}

static void *worker_main(void *argument)
{
    em_executor *executor = argument;
    em_job *job;
    while ((job = take_job(executor)) != NULL) {
        job->run(job);
        complete_job(executor, job);
    }
    return NULL;
}

/* Runs every finished job's done, oldest first. */
static void drain_completions(uv_async_t *handle)
{
    em_executor *executor = handle->data;
    pthread_mutex_lock(&executor->lock);
    em_job *newest_first = executor->completed;
    executor->completed = NULL;
    pthread_mutex_unlock(&executor->lock);
    em_job *oldest_first = NULL;
    while (newest_first != NULL) {
        em_job *next = newest_first->next;
        newest_first->next = oldest_first;
        oldest_first = newest_first;
        newest_first = next;
    }
    while (oldest_first != NULL) {
        em_job *next = oldest_first->next;
        atomic_store_explicit(&executor->pending,
                              atomic_load_explicit(&executor->pending, memory_order_relaxed) - 1,
                              memory_order_relaxed);
        oldest_first->done(oldest_first);
        oldest_first = next;
    }
}

em_status em_executor_create(uv_loop_t *loop, uint32_t threads, const char *name,
                             em_executor **out, em_error *err)
{
    em_executor *executor = calloc(1, sizeof(*executor));
    pthread_t *handles = calloc(threads, sizeof(*handles));
    if (executor == NULL || handles == NULL || threads == 0) {
        free(executor);
        free(handles);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "executor %s with %u threads: %s", name,
                            threads, threads == 0 ? "needs at least one thread" : "out of memory");
    }
    pthread_mutex_init(&executor->lock, NULL);
    pthread_cond_init(&executor->work_ready, NULL);
    executor->threads = handles;
    int rc = uv_async_init(loop, &executor->wakeup, drain_completions);
    if (rc != 0) {
        free(handles);
        free(executor);
        return em_error_set(err, EM_INTERNAL, "executor %s: uv_async_init: %s", name,
                            uv_strerror(rc));
    }
    executor->wakeup.data = executor;
    for (uint32_t i = 0; i < threads; i++) {
        if (pthread_create(&handles[i], NULL, worker_main, executor) != 0) {
            executor->thread_count = i;
            em_executor_close(executor);
            return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                                "executor %s: could not start worker thread %u", name, i);
        }
        executor->thread_count = i + 1;
    }
    *out = executor;
    return EM_OK;
}

void em_executor_submit(em_executor *executor, em_job *job)
{
    job->next = NULL;
    atomic_store_explicit(&executor->pending,
                          atomic_load_explicit(&executor->pending, memory_order_relaxed) + 1,
                          memory_order_relaxed);
    pthread_mutex_lock(&executor->lock);
    if (executor->queue_tail != NULL)
        executor->queue_tail->next = job;
    else
        executor->queue_head = job;
    executor->queue_tail = job;
    pthread_cond_signal(&executor->work_ready);
    pthread_mutex_unlock(&executor->lock);
}

uint64_t em_executor_pending(const em_executor *executor)
{
    return atomic_load_explicit(&executor->pending, memory_order_relaxed);
}

uint64_t em_executor_completed(const em_executor *executor)
{
    return atomic_load_explicit(&executor->completed_count, memory_order_relaxed);
}

uint32_t em_executor_threads(const em_executor *executor)
{
    return executor->thread_count;
}

static void free_executor(uv_handle_t *handle)
{
    em_executor *executor = handle->data;
    pthread_mutex_destroy(&executor->lock);
    pthread_cond_destroy(&executor->work_ready);
    free(executor->threads);
    free(executor);
}

void em_executor_close(em_executor *executor)
{
    pthread_mutex_lock(&executor->lock);
    executor->stopping = true;
    pthread_cond_broadcast(&executor->work_ready);
    pthread_mutex_unlock(&executor->lock);
    for (uint32_t i = 0; i < executor->thread_count; i++)
        pthread_join(executor->threads[i], NULL);
    /* Jobs that finished while stopping still get their done callbacks. */
    drain_completions(&executor->wakeup);
    uv_close((uv_handle_t *)&executor->wakeup, free_executor);
}
