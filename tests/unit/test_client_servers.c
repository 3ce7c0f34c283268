#include <stdlib.h>
#include <string.h>

#include "clients/client_servers.h"
#include "tests/support/test_support.h"

static em__client_server *parse_ok(const char *text, uint32_t expected_count)
{
    em__client_server *servers = NULL;
    uint32_t count = 0;
    em_error err;
    ck_assert_msg(em__client_servers_parse(text, &servers, &count, &err) == EM_OK, "%s: %s", text,
                  err.message);
    ck_assert_uint_eq(count, expected_count);
    return servers;
}

static void assert_rejected(const char *text, const char *message)
{
    em__client_server *servers = NULL;
    uint32_t count = 0;
    em_error err;
    ck_assert_int_eq(em__client_servers_parse(text, &servers, &count, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, message);
    ck_assert_ptr_null(servers);
}

START_TEST(parses_ipv4_hostnames_and_bracketed_ipv6)
{
    em__client_server *servers =
        parse_ok("127.0.0.1:7070,ps-3.example.com:80, [::1]:7071 ,[fe80::1%eth0]:65535", 4);
    ck_assert_str_eq(servers[0].host, "127.0.0.1");
    ck_assert_str_eq(servers[0].port, "7070");
    ck_assert_str_eq(servers[0].name, "127.0.0.1:7070");
    ck_assert_str_eq(servers[1].host, "ps-3.example.com");
    ck_assert_str_eq(servers[1].port, "80");
    ck_assert_str_eq(servers[2].host, "::1");
    ck_assert_str_eq(servers[2].port, "7071");
    ck_assert_str_eq(servers[2].name, "[::1]:7071");
    ck_assert_str_eq(servers[3].host, "fe80::1%eth0");
    ck_assert_str_eq(servers[3].port, "65535");
    free(servers);
}
END_TEST

START_TEST(single_entry_and_leading_zeros_in_port)
{
    em__client_server *servers = parse_ok("localhost:07070", 1);
    ck_assert_str_eq(servers[0].host, "localhost");
    ck_assert_str_eq(servers[0].port, "7070");
    ck_assert_str_eq(servers[0].name, "localhost:7070");
    free(servers);
}
END_TEST

START_TEST(bad_entries_are_named)
{
    assert_rejected("", "server list is empty; expected host:port[,host:port...]");
    assert_rejected(NULL, "server list is empty; expected host:port[,host:port...]");
    assert_rejected("a:1,,b:2", "server list entry 2 is empty; expected host:port");
    assert_rejected("a:1,", "server list entry 2 is empty; expected host:port");
    assert_rejected("ps-3", "server list entry 1 'ps-3' has no port; expected host:port");
    assert_rejected("a:1, :7070", "server list entry 2 ':7070' has an empty host; expected "
                                  "host:port");
    assert_rejected("a:0", "server list entry 1 'a:0' has port '0'; expected a number in "
                           "1..65535");
    assert_rejected("a:65536", "server list entry 1 'a:65536' has port '65536'; expected a "
                               "number in 1..65535");
    assert_rejected("a:", "server list entry 1 'a:' has port ''; expected a number in 1..65535");
    assert_rejected("a:http", "server list entry 1 'a:http' has port 'http'; expected a number "
                              "in 1..65535");
    assert_rejected("a:-1", "server list entry 1 'a:-1' has port '-1'; expected a number in "
                            "1..65535");
    assert_rejected("::1:7070", "server list entry 1 '::1:7070' has several ':'; write an IPv6 "
                                "address as [address]:port");
    assert_rejected("[::1:7070", "server list entry 1 '[::1:7070' has no closing ']'; expected "
                                 "[address]:port");
    assert_rejected("[::1]7070", "server list entry 1 '[::1]7070' has no port after ']'; "
                                 "expected [address]:port");
    assert_rejected("[]:7070", "server list entry 1 '[]:7070' has an empty host; expected "
                               "host:port");
    assert_rejected("a b:1", "server list entry 1 'a b:1' has the character ' ' in its host");
    assert_rejected("a:1,b:2,A:1", "server list entry 3 'A:1' repeats entry 1");
    assert_rejected("a:1,a:01", "server list entry 2 'a:01' repeats entry 1");
}
END_TEST

START_TEST(too_long_hosts_and_lists_are_refused)
{
    char host[300];
    memset(host, 'h', 256);
    strcpy(host + 256, ":1");
    em__client_server *servers = NULL;
    uint32_t count = 0;
    em_error err;
    ck_assert_int_eq(em__client_servers_parse(host, &servers, &count, &err), EM_INVALID_ARGUMENT);
    ck_assert(strstr(err.message, "has a host of 256 characters; at most 255") != NULL);

    size_t length = (EM_CLIENT_SERVERS_MAX + 1) * 2;
    char *list = malloc(length + 1);
    for (size_t i = 0; i < length; i += 2)
        memcpy(list + i, "x,", 2);
    list[length - 1] = '\0';
    ck_assert_int_eq(em__client_servers_parse(list, &servers, &count, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "server list has 1025 entries; at most 1024");
    free(list);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("client_servers");
    TCase *parse = tcase_create("parse");
    tcase_add_test(parse, parses_ipv4_hostnames_and_bracketed_ipv6);
    tcase_add_test(parse, single_entry_and_leading_zeros_in_port);
    tcase_add_test(parse, bad_entries_are_named);
    tcase_add_test(parse, too_long_hosts_and_lists_are_refused);
    suite_add_tcase(suite, parse);
    return em_test_run(suite);
}
