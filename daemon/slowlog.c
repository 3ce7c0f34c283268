#include "daemon/slowlog.h"

#include <stdlib.h>
#include <string.h>

em_status em_slowlog_init(em_slowlog *log, uint32_t capacity, em_error *err)
{
    memset(log, 0, sizeof(*log));
    log->ring = calloc(capacity, sizeof(*log->ring));
    if (log->ring == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "slow log of %u entries: out of memory",
                            capacity);
    log->capacity = capacity;
    return EM_OK;
}

void em_slowlog_free(em_slowlog *log)
{
    free(log->ring);
    log->ring = NULL;
    log->capacity = log->count = 0;
}

void em_slowlog_record(em_slowlog *log, em_slow_request *entry)
{
    if (log->capacity == 0)
        return;
    entry->id = ++log->last_id;
    log->ring[log->next] = *entry;
    log->next = (log->next + 1) % log->capacity;
    if (log->count < log->capacity)
        log->count++;
    log->recorded++;
}

size_t em_slowlog_read(const em_slowlog *log, em_slow_request *out, size_t max)
{
    size_t n = log->count < max ? log->count : max;
    for (size_t i = 0; i < n; i++)
        out[i] = log->ring[(log->next + log->capacity - 1 - i) % log->capacity];
    return n;
}

uint64_t em_slowlog_dropped(const em_slowlog *log)
{
    return log->recorded - log->count;
}

void em_slowlog_reset(em_slowlog *log)
{
    log->count = 0;
    log->next = 0;
    log->recorded = 0;
}
