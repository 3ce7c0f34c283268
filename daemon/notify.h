/*
 * systemd service notifications (sd_notify) when emberd is built with libsystemd;
 * without it, or when not started by systemd, every call does nothing.
 */
#ifndef EMBER_DAEMON_NOTIFY_H
#define EMBER_DAEMON_NOTIFY_H

#include <stdbool.h>
#include <stdint.h>

/* Sends one notification, e.g. "READY=1\nSTATUS=serving". printf-style. */
void em_notify(const char *format, ...) __attribute__((format(printf, 1, 2)));

/* The watchdog interval systemd asked for, in microseconds, or 0 when none. */
uint64_t em_notify_watchdog_usec(void);

#endif
