#include "daemon/address.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static em_status bad_address(const char *text, const char *why, em_error *err)
{
    return em_error_set(err, EM_INVALID_ARGUMENT,
                        "listen address '%s': %s (expected IPv4:port or [IPv6]:port)", text, why);
}

static em_status parse_port(const char *text, const char *digits, uint16_t *port, em_error *err)
{
    if (*digits == '\0')
        return bad_address(text, "no port", err);
    char *end = NULL;
    errno = 0;
    unsigned long value = strtoul(digits, &end, 10);
    if (errno != 0 || *end != '\0' || value > 65535 || digits[0] < '0' || digits[0] > '9')
        return bad_address(text, "port must be a number from 0 to 65535", err);
    *port = (uint16_t)value;
    return EM_OK;
}

static em_status parse_ipv6(const char *text, struct sockaddr_storage *out, em_error *err)
{
    const char *close = strchr(text, ']');
    if (close == NULL || close[1] != ':')
        return bad_address(text, "missing ']:' after the IPv6 address", err);
    char host[64];
    size_t length = (size_t)(close - text - 1);
    if (length >= sizeof(host))
        return bad_address(text, "IPv6 address too long", err);
    memcpy(host, text + 1, length);
    host[length] = '\0';
    struct sockaddr_in6 *address = (struct sockaddr_in6 *)out;
    memset(out, 0, sizeof(*out));
    address->sin6_family = AF_INET6;
    if (inet_pton(AF_INET6, host, &address->sin6_addr) != 1)
        return bad_address(text, "not an IPv6 address", err);
    uint16_t port = 0;
    em_status status = parse_port(text, close + 2, &port, err);
    address->sin6_port = htons(port);
    return status;
}

static em_status parse_ipv4(const char *text, struct sockaddr_storage *out, em_error *err)
{
    const char *colon = strrchr(text, ':');
    if (colon == NULL)
        return bad_address(text, "no port", err);
    char host[32];
    size_t length = (size_t)(colon - text);
    if (length >= sizeof(host))
        return bad_address(text, "not an IPv4 address", err);
    memcpy(host, text, length);
    host[length] = '\0';
    struct sockaddr_in *address = (struct sockaddr_in *)out;
    memset(out, 0, sizeof(*out));
    address->sin_family = AF_INET;
    if (inet_pton(AF_INET, host, &address->sin_addr) != 1)
        return bad_address(text, "not an IPv4 address", err);
    uint16_t port = 0;
    em_status status = parse_port(text, colon + 1, &port, err);
    address->sin_port = htons(port);
    return status;
}

em_status em_address_parse(const char *text, struct sockaddr_storage *out, em_error *err)
{
    if (text[0] == '[')
        return parse_ipv6(text, out, err);
    return parse_ipv4(text, out, err);
}

void em_address_format(const struct sockaddr *address, char *buffer, size_t capacity)
{
    char host[INET6_ADDRSTRLEN] = "?";
    if (address->sa_family == AF_INET6) {
        const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)address;
        inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof(host));
        snprintf(buffer, capacity, "[%s]:%u", host, ntohs(v6->sin6_port));
        return;
    }
    const struct sockaddr_in *v4 = (const struct sockaddr_in *)address;
    inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
    snprintf(buffer, capacity, "%s:%u", host, ntohs(v4->sin_port));
}

bool em_address_is_loopback(const struct sockaddr *address)
{
    if (address->sa_family == AF_INET6) {
        const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)address;
        return IN6_IS_ADDR_LOOPBACK(&v6->sin6_addr);
    }
    const struct sockaddr_in *v4 = (const struct sockaddr_in *)address;
    return (ntohl(v4->sin_addr.s_addr) >> 24) == 127;
}
