#include "daemon/notify.h"

#include <stdarg.h>
#include <stdio.h>

#include "ember_config.h"

#if EM_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

void em_notify(const char *format, ...)
{
#if EM_HAVE_SYSTEMD
    char text[512];
    va_list args;
    va_start(args, format);
    vsnprintf(text, sizeof(text), format, args);
    va_end(args);
    sd_notify(0, text);
#else
    (void)format;
#endif
}

uint64_t em_notify_watchdog_usec(void)
{
#if EM_HAVE_SYSTEMD
    uint64_t usec = 0;
    if (sd_watchdog_enabled(0, &usec) > 0)
        return usec;
#endif
    return 0;
}
