/*
 * DESIGN: the server list of a client, "host:port[,host:port...]".
 *
 * Parsing only splits and checks the text; names are resolved (getaddrinfo) when the
 * client connects, so a list naming a host that is down or not yet in DNS still parses.
 * Entries are IPv4 addresses, hostnames, or IPv6 addresses in brackets ("[::1]:7070");
 * spaces around an entry are ignored. The order of the list is the routing order of
 * em_key_server, so a repeated entry is an error rather than a silent change of routing.
 * Every error names the entry (its position and text) and what is wrong with it.
 */
#ifndef EMBER_CLIENTS_CLIENT_SERVERS_H
#define EMBER_CLIENTS_CLIENT_SERVERS_H

#include <stdint.h>

#include "lib/base/status.h"

/* Longest host name (RFC 1035 allows 253 characters) and list entry we accept. */
#define EM_CLIENT_HOST_MAX 255
#define EM_CLIENT_SERVERS_MAX 1024

typedef struct em__client_server {
    char host[EM_CLIENT_HOST_MAX + 1]; /* without brackets: "::1", "10.0.0.2", "ps-3" */
    char port[6];                      /* decimal, 1..65535 */
    char name[EM_CLIENT_HOST_MAX + 9]; /* as messages show it: "[::1]:7070", "ps-3:7070" */
} em__client_server;

/* Parses text into a malloc'ed array of *count entries (caller frees with free()).
 * Errors: INVALID_ARGUMENT naming the entry ("server list entry 2 'ps-3' has no port;
 * expected host:port"). */
em_status em__client_servers_parse(const char *text, em__client_server **out, uint32_t *count,
                                   em_error *err);

#endif
