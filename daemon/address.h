/*
 * Listen addresses: "IPv4:port" or "[IPv6]:port" literals (no name lookups: a daemon
 * must bind exactly what its config says). Port 0 asks the kernel for a free port.
 */
#ifndef EMBER_DAEMON_ADDRESS_H
#define EMBER_DAEMON_ADDRESS_H

#include <stdbool.h>
#include <sys/socket.h>

#include "lib/base/status.h"

em_status em_address_parse(const char *text, struct sockaddr_storage *out, em_error *err);

/* "127.0.0.1:7070" / "[::1]:7070" for a bound address. */
void em_address_format(const struct sockaddr *address, char *buffer, size_t capacity);

/* True for 127.0.0.0/8 and ::1. */
bool em_address_is_loopback(const struct sockaddr *address);

#endif
