#include "clients/client_servers.h"

#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* One entry of the list as written (not NUL-terminated), for parsing and messages. */
typedef struct entry_text {
    uint32_t position; /* 1-based */
    const char *text;
    size_t length;
} entry_text;

static em_status entry_error(em_error *err, const entry_text *entry, const char *what)
{
    return em_error_set(err, EM_INVALID_ARGUMENT, "server list entry %u '%.*s' %s",
                        entry->position, (int)entry->length, entry->text, what);
}

static bool host_character_ok(char c)
{
    return isalnum((unsigned char)c) || c == '.' || c == '-' || c == '_';
}

static bool ipv6_character_ok(char c)
{
    /* hex digits, ':' and '.', and a zone after '%' ("fe80::1%eth0") */
    return isalnum((unsigned char)c) || c == ':' || c == '.' || c == '%';
}

static em_status parse_port(const entry_text *entry, const char *port, size_t length,
                            em__client_server *out, em_error *err)
{
    unsigned long value = 0;
    bool digits = length > 0 && length <= 5;
    for (size_t i = 0; digits && i < length; i++) {
        digits = isdigit((unsigned char)port[i]) != 0;
        value = value * 10 + (unsigned long)(port[i] - '0');
    }
    if (!digits || value == 0 || value > 65535) {
        char what[64];
        snprintf(what, sizeof(what), "has port '%.*s'; expected a number in 1..65535",
                 (int)(length < 16 ? length : 16), port);
        return entry_error(err, entry, what);
    }
    snprintf(out->port, sizeof(out->port), "%lu", value);
    return EM_OK;
}

static em_status store_host(const entry_text *entry, const char *host, size_t length,
                            bool (*character_ok)(char), em__client_server *out, em_error *err)
{
    if (length == 0)
        return entry_error(err, entry, "has an empty host; expected host:port");
    if (length > EM_CLIENT_HOST_MAX) {
        char what[80];
        snprintf(what, sizeof(what), "has a host of %zu characters; at most %d", length,
                 EM_CLIENT_HOST_MAX);
        return entry_error(err, entry, what);
    }
    for (size_t i = 0; i < length; i++) {
        if (!character_ok(host[i])) {
            char what[64];
            snprintf(what, sizeof(what), "has the character '%c' in its host", host[i]);
            return entry_error(err, entry, what);
        }
    }
    memcpy(out->host, host, length);
    out->host[length] = '\0';
    return EM_OK;
}

/* "[address]:port" */
static em_status parse_bracketed(const entry_text *entry, em__client_server *out, em_error *err)
{
    const char *close = memchr(entry->text, ']', entry->length);
    if (close == NULL)
        return entry_error(err, entry, "has no closing ']'; expected [address]:port");
    const char *host = entry->text + 1;
    em_status status = store_host(entry, host, (size_t)(close - host), ipv6_character_ok, out,
                                  err);
    if (status != EM_OK)
        return status;
    const char *end = entry->text + entry->length;
    if (close + 1 == end || close[1] != ':')
        return entry_error(err, entry, "has no port after ']'; expected [address]:port");
    status = parse_port(entry, close + 2, (size_t)(end - close - 2), out, err);
    if (status == EM_OK)
        snprintf(out->name, sizeof(out->name), "[%s]:%s", out->host, out->port);
    return status;
}

/* "host:port" */
static em_status parse_plain(const entry_text *entry, em__client_server *out, em_error *err)
{
    const char *colon = memchr(entry->text, ':', entry->length);
    if (colon == NULL)
        return entry_error(err, entry, "has no port; expected host:port");
    size_t host_length = (size_t)(colon - entry->text);
    if (memchr(colon + 1, ':', entry->length - host_length - 1) != NULL)
        return entry_error(err, entry,
                           "has several ':'; write an IPv6 address as [address]:port");
    em_status status = store_host(entry, entry->text, host_length, host_character_ok, out, err);
    if (status != EM_OK)
        return status;
    status = parse_port(entry, colon + 1, entry->length - host_length - 1, out, err);
    if (status == EM_OK)
        snprintf(out->name, sizeof(out->name), "%s:%s", out->host, out->port);
    return status;
}

static em_status parse_entry(const entry_text *entry, em__client_server *out, em_error *err)
{
    if (entry->length == 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "server list entry %u is empty; expected host:port", entry->position);
    if (entry->text[0] == '[')
        return parse_bracketed(entry, out, err);
    return parse_plain(entry, out, err);
}

static em_status check_repeats(const entry_text *entry, const em__client_server *servers,
                               uint32_t count, em_error *err)
{
    const em__client_server *last = &servers[count];
    for (uint32_t i = 0; i < count; i++) {
        if (strcasecmp(servers[i].host, last->host) == 0 &&
            strcmp(servers[i].port, last->port) == 0) {
            char what[48];
            snprintf(what, sizeof(what), "repeats entry %u", i + 1);
            return entry_error(err, entry, what);
        }
    }
    return EM_OK;
}

/* The entry starting at text, without surrounding spaces; *next is after its comma. */
static entry_text next_entry(const char *text, uint32_t position, const char **next)
{
    const char *end = strchr(text, ',');
    *next = end != NULL ? end + 1 : NULL;
    if (end == NULL)
        end = text + strlen(text);
    while (text < end && isspace((unsigned char)*text))
        text++;
    while (end > text && isspace((unsigned char)end[-1]))
        end--;
    return (entry_text){.position = position, .text = text, .length = (size_t)(end - text)};
}

em_status em__client_servers_parse(const char *text, em__client_server **out, uint32_t *count,
                                   em_error *err)
{
    if (text == NULL || *text == '\0')
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "server list is empty; expected host:port[,host:port...]");
    uint32_t capacity = 1;
    for (const char *c = text; *c != '\0'; c++)
        capacity += *c == ',';
    if (capacity > EM_CLIENT_SERVERS_MAX)
        return em_error_set(err, EM_INVALID_ARGUMENT, "server list has %u entries; at most %d",
                            capacity, EM_CLIENT_SERVERS_MAX);
    em__client_server *servers = calloc(capacity, sizeof(*servers));
    if (servers == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "server list of %u entries: out of memory",
                            capacity);
    uint32_t parsed = 0;
    for (const char *cursor = text; cursor != NULL; parsed++) {
        entry_text entry = next_entry(cursor, parsed + 1, &cursor);
        em_status status = parse_entry(&entry, &servers[parsed], err);
        if (status == EM_OK)
            status = check_repeats(&entry, servers, parsed, err);
        if (status != EM_OK) {
            free(servers);
            return status;
        }
    }
    *out = servers;
    *count = parsed;
    return EM_OK;
}
