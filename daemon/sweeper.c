#include "daemon/sweeper.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

#include "lib/table/table.h"

#define TICK_MS 100
#define SLICE_ENTRIES 16384
#define BUDGET_NS (5 * 1000 * 1000)

struct em_sweeper {
    em_catalog *catalog;
    const em_log *log;
    pthread_t thread;
    pthread_mutex_t mutex;
    pthread_cond_t wake;
    bool stopping;
};

static uint64_t monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}

/* Slices on table until the budget is spent or a slice finds nothing to examine. */
static void sweep_table(em_sweeper *sweeper, em_table *table)
{
    if (em_table_get_config(table)->eviction.max_age_steps == 0)
        return;
    uint64_t started = monotonic_ns(), total = 0;
    uint32_t shards = em_table_get_config(table)->shards;
    for (uint32_t slices = 0; monotonic_ns() - started < BUDGET_NS && slices < 4 * shards;
         slices++) {
        uint64_t expired = 0;
        em_error err;
        if (em_table_expire(table, SLICE_ENTRIES, &expired, &err) != EM_OK) {
            em_log_warning(sweeper->log, "%s", err.message);
            break;
        }
        total += expired;
    }
    if (total > 0)
        em_log_debug(sweeper->log, "expired %" PRIu64 " rows of table '%s'", total,
                     em_table_name(table));
}

static void *run(void *argument)
{
    em_sweeper *sweeper = argument;
    pthread_mutex_lock(&sweeper->mutex);
    while (!sweeper->stopping) {
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += TICK_MS * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        while (!sweeper->stopping &&
               pthread_cond_timedwait(&sweeper->wake, &sweeper->mutex, &until) != ETIMEDOUT)
            ;
        if (sweeper->stopping)
            break;
        pthread_mutex_unlock(&sweeper->mutex);
        em_table **tables = NULL;
        size_t count = 0;
        em_error err;
        if (em_catalog_list(sweeper->catalog, &tables, &count, &err) == EM_OK) {
            for (size_t i = 0; i < count; i++) {
                sweep_table(sweeper, tables[i]);
                em_catalog_release(sweeper->catalog, tables[i]);
            }
            free(tables);
        }
        pthread_mutex_lock(&sweeper->mutex);
    }
    pthread_mutex_unlock(&sweeper->mutex);
    return NULL;
}

em_status em_sweeper_create(em_catalog *catalog, const em_log *log, em_sweeper **out,
                            em_error *err)
{
    em_sweeper *sweeper = calloc(1, sizeof(*sweeper));
    if (sweeper == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "expiry sweep: out of memory");
    sweeper->catalog = catalog;
    sweeper->log = log;
    pthread_mutex_init(&sweeper->mutex, NULL);
    pthread_condattr_t attributes;
    pthread_condattr_init(&attributes);
    pthread_condattr_setclock(&attributes, CLOCK_MONOTONIC);
    pthread_cond_init(&sweeper->wake, &attributes);
    pthread_condattr_destroy(&attributes);
    int rc = pthread_create(&sweeper->thread, NULL, run, sweeper);
    if (rc != 0) {
        pthread_cond_destroy(&sweeper->wake);
        pthread_mutex_destroy(&sweeper->mutex);
        free(sweeper);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "expiry sweep: cannot start a thread");
    }
    *out = sweeper;
    return EM_OK;
}

void em_sweeper_destroy(em_sweeper *sweeper)
{
    if (sweeper == NULL)
        return;
    pthread_mutex_lock(&sweeper->mutex);
    sweeper->stopping = true;
    pthread_cond_signal(&sweeper->wake);
    pthread_mutex_unlock(&sweeper->mutex);
    pthread_join(sweeper->thread, NULL);
    pthread_cond_destroy(&sweeper->wake);
    pthread_mutex_destroy(&sweeper->mutex);
    free(sweeper);
}
