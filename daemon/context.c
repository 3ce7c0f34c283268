#include "daemon/context.h"

#include <time.h>

#include "ember_config.h"

const char *em_server_state_name(int state)
{
    switch ((em_server_state)state) {
    case EM_SERVER_STARTING:
        return "starting";
    case EM_SERVER_SERVING:
        return "serving";
    case EM_SERVER_DRAINING:
        return "draining";
    case EM_SERVER_FAILED:
        return "failed";
    }
    return "unknown";
}

em_status em_server_collect_stats(em_server_context *context, const char *table_filter,
                                  em_stats_snapshot *snapshot, em_error *err)
{
    if (context->executor != NULL)
        atomic_store(&context->stats.work_queued, em_executor_pending(context->executor));
    em_status status = em_stats_collect(&context->stats, context->catalog, table_filter,
                                        snapshot, err);
    if (status != EM_OK)
        return status;
    snapshot->version = EM_VERSION;
    snapshot->state = em_server_state_now(context);
    snapshot->uptime_ms = em_monotonic_ms() - context->start_ms;
    return EM_OK;
}

const char *em_server_state_now(const em_server_context *context)
{
    int state = atomic_load(&context->state);
    if (state == EM_SERVER_SERVING && atomic_load(&context->drained))
        return "drained";
    return em_server_state_name(state);
}

bool em_server_ready(const em_server_context *context)
{
    return atomic_load(&context->state) == EM_SERVER_SERVING && !atomic_load(&context->drained);
}

uint64_t em_monotonic_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u;
}
