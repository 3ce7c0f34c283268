#include "lib/base/parallel.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

/* Threads started for one call, at most. */
#define PARALLEL_THREADS_MAX 64u

typedef struct parallel_run {
    em_parallel_item item;
    void *context;
    uint64_t n;
    _Atomic uint64_t next; /* the next item to take */
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

void em_parallel_run(uint64_t n, uint32_t threads, em_parallel_item item, void *context)
{
    parallel_run run = {.item = item, .context = context, .n = n};
    atomic_init(&run.next, 0);
    uint64_t helpers = threads > 1 ? threads - 1 : 0;
    if (helpers > PARALLEL_THREADS_MAX)
        helpers = PARALLEL_THREADS_MAX;
    uint64_t most = n > 0 ? n - 1 : 0; /* the calling thread takes one item too */
    if (helpers > most)
        helpers = most;
    pthread_t started[PARALLEL_THREADS_MAX];
    uint64_t count = 0;
    for (; count < helpers; count++)
        if (pthread_create(&started[count], NULL, take_items, &run) != 0)
            break; /* the threads running take its share */
    take_items(&run);
    for (uint64_t t = 0; t < count; t++)
        pthread_join(started[t], NULL);
}

uint32_t em_parallel_cpus(void)
{
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    return cpus > 0 ? (uint32_t)cpus : 1;
}
