#include "daemon/context.h"

#include <time.h>

const char *em_server_state_name(int state)
{
    switch ((em_server_state)state) {
    case EM_SERVER_STARTING:
        return "starting";
    case EM_SERVER_SERVING:
        return "serving";
    case EM_SERVER_DRAINING:
        return "draining";
    }
    return "unknown";
}

uint64_t em_monotonic_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u;
}
