#include "daemon/budget.h"

#include <stddef.h>

void em_memory_budget_init(em_memory_budget *budget, uint64_t limit, em_server_stats *stats,
                           void (*schedule_wake)(void *context), void *wake_context)
{
    *budget = (em_memory_budget){.limit = limit, .stats = stats,
                                 .schedule_wake = schedule_wake, .wake_context = wake_context};
    atomic_store(&stats->memory_limit_bytes, limit);
}

static void schedule_wake(em_memory_budget *budget)
{
    if (budget->waiting_head == NULL || budget->wake_scheduled)
        return;
    budget->wake_scheduled = true;
    budget->schedule_wake(budget->wake_context);
}

void em_memory_budget_set_limit(em_memory_budget *budget, uint64_t limit)
{
    budget->limit = limit;
    atomic_store(&budget->stats->memory_limit_bytes, limit);
    schedule_wake(budget);
}

bool em_memory_budget_fits(const em_memory_budget *budget, uint64_t bytes)
{
    return budget->limit == 0 || (bytes <= budget->limit && budget->used <= budget->limit - bytes);
}

void em_memory_budget_charge(em_memory_budget *budget, uint64_t bytes)
{
    budget->used += bytes;
    atomic_store_explicit(&budget->stats->memory_used_bytes, budget->used, memory_order_relaxed);
    if (budget->used > atomic_load_explicit(&budget->stats->memory_peak_bytes,
                                            memory_order_relaxed))
        atomic_store_explicit(&budget->stats->memory_peak_bytes, budget->used,
                              memory_order_relaxed);
}

void em_memory_budget_release(em_memory_budget *budget, uint64_t bytes)
{
    budget->used -= bytes;
    atomic_store_explicit(&budget->stats->memory_used_bytes, budget->used, memory_order_relaxed);
    schedule_wake(budget);
}
