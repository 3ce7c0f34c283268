#include "lib/base/parallel.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

/* Threads a run takes besides the calling one, and a pool keeps, at most. */
#define PARALLEL_THREADS_MAX 64u

typedef struct parallel_run {
    em_parallel_item item;
    void *context;
    uint64_t n;
    _Atomic uint64_t next; /* the next item to take */
    /* with a pool, under its lock: */
    uint32_t tickets;            /* pool threads it still takes in (it is queued while > 0) */
    uint32_t helping;            /* pool threads taking its items now */
    struct parallel_run *queued; /* the next run in the pool's queue */
} parallel_run;

static void *take_items(void *untyped)
{
    parallel_run *run = untyped;
    for (;;) {
        uint64_t i = atomic_fetch_add_explicit(&run->next, 1, memory_order_relaxed);
        if (i >= run->n)
            return NULL;
        run->item(run->context, i);
    }
}

/* The threads besides the caller that a run of n items on `threads` threads takes: no
 * more than `most`, and none for an item the caller would take itself. */
static uint64_t helpers_for(uint64_t n, uint32_t threads, uint64_t most)
{
    uint64_t helpers = threads > 1 ? threads - 1 : 0;
    if (helpers > most)
        helpers = most;
    if (n > 0 && helpers > n - 1) /* the calling thread takes one item too */
        helpers = n - 1;
    return n > 0 ? helpers : 0;
}

void em_parallel_run(uint64_t n, uint32_t threads, em_parallel_item item, void *context)
{
    parallel_run run = {.item = item, .context = context, .n = n};
    atomic_init(&run.next, 0);
    uint64_t helpers = helpers_for(n, threads, PARALLEL_THREADS_MAX);
    pthread_t started[PARALLEL_THREADS_MAX];
    uint64_t count = 0;
    for (; count < helpers; count++)
        if (pthread_create(&started[count], NULL, take_items, &run) != 0)
            break; /* the threads running take its share */
    take_items(&run);
    for (uint64_t t = 0; t < count; t++)
        pthread_join(started[t], NULL);
}

/* ---- the pool ------------------------------------------------------------------------------ */

struct em_parallel_pool {
    pthread_mutex_t lock;
    pthread_cond_t work;     /* a run was queued, or the pool stops */
    pthread_cond_t finished; /* a thread left a run */
    parallel_run *queue;     /* runs that take more threads in, oldest first */
    uint32_t helpers;        /* threads at most */
    uint32_t started, waiting;
    bool stopping;
    pid_t owner; /* the process whose threads these are: a child forked from it has none
                  * of them (and maybe a lock held at the fork), so it starts its own */
    pthread_t threads[PARALLEL_THREADS_MAX];
};

/* A pool thread: takes the items of the oldest queued run, one thread per ticket, until
 * the pool stops. */
static void *serve(void *untyped)
{
    em_parallel_pool *pool = untyped;
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (pool->queue == NULL && !pool->stopping) {
            pool->waiting++;
            pthread_cond_wait(&pool->work, &pool->lock);
            pool->waiting--;
        }
        if (pool->queue == NULL)
            break; /* stopping */
        parallel_run *run = pool->queue;
        run->helping++;
        if (--run->tickets == 0)
            pool->queue = run->queued;
        pthread_mutex_unlock(&pool->lock);
        take_items(run);
        pthread_mutex_lock(&pool->lock);
        if (--run->helping == 0) /* the last use of run: its caller may return */
            pthread_cond_broadcast(&pool->finished);
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

em_parallel_pool *em_parallel_pool_create(uint32_t helpers)
{
    em_parallel_pool *pool = calloc(1, sizeof(*pool));
    if (pool == NULL)
        return NULL;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->work, NULL);
    pthread_cond_init(&pool->finished, NULL);
    pool->helpers = helpers < PARALLEL_THREADS_MAX ? helpers : PARALLEL_THREADS_MAX;
    pool->owner = getpid();
    return pool;
}

void em_parallel_pool_destroy(em_parallel_pool *pool)
{
    if (pool == NULL)
        return;
    if (pool->owner != getpid()) { /* its threads are the parent's */
        free(pool);
        return;
    }
    pthread_mutex_lock(&pool->lock);
    pool->stopping = true;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->lock);
    for (uint32_t t = 0; t < pool->started; t++)
        pthread_join(pool->threads[t], NULL);
    pthread_cond_destroy(&pool->finished);
    pthread_cond_destroy(&pool->work);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

/* Takes run out of the pool's queue (under its lock). */
static void unqueue(em_parallel_pool *pool, parallel_run *run)
{
    for (parallel_run **at = &pool->queue; *at != NULL; at = &(*at)->queued)
        if (*at == run) {
            *at = run->queued;
            return;
        }
}

void em_parallel_pool_run(em_parallel_pool *pool, uint64_t n, uint32_t threads,
                          em_parallel_item item, void *context)
{
    if (pool == NULL || pool->owner != getpid()) {
        em_parallel_run(n, threads, item, context);
        return;
    }
    parallel_run run = {.item = item, .context = context, .n = n};
    atomic_init(&run.next, 0);
    uint64_t helpers = helpers_for(n, threads, pool->helpers);
    if (helpers > 0) {
        pthread_mutex_lock(&pool->lock);
        run.tickets = (uint32_t)helpers;
        parallel_run **tail = &pool->queue;
        while (*tail != NULL)
            tail = &(*tail)->queued;
        *tail = &run;
        /* threads enough for its tickets, as far as the pool goes; a thread that cannot
         * be started leaves its share to the others */
        uint32_t ready = pool->waiting;
        while (ready < helpers && pool->started < pool->helpers &&
               pthread_create(&pool->threads[pool->started], NULL, serve, pool) == 0) {
            pool->started++;
            ready++;
        }
        if (helpers == 1)
            pthread_cond_signal(&pool->work);
        else
            pthread_cond_broadcast(&pool->work);
        pthread_mutex_unlock(&pool->lock);
    }
    take_items(&run);
    if (helpers > 0) {
        /* every item is taken: tickets not used go, and the threads in it finish */
        pthread_mutex_lock(&pool->lock);
        if (run.tickets > 0) {
            unqueue(pool, &run);
            run.tickets = 0;
        }
        while (run.helping > 0)
            pthread_cond_wait(&pool->finished, &pool->lock);
        pthread_mutex_unlock(&pool->lock);
    }
}

uint32_t em_parallel_cpus(void)
{
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    return cpus > 0 ? (uint32_t)cpus : 1;
}
