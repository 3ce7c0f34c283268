/*
 * The method table (daemon/methods.h) against the wire contract: every Method of
 * proto/ember.proto has exactly one row, each row's messages are the method's own, and
 * the access rules say what the README says.
 */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "daemon/methods.h"
#include "proto/frame.h"
#include "tests/support/test_support.h"

/* "CREATE_TABLE" -> "CreateTable" */
static void camel_case(const char *upper, char *out, size_t capacity)
{
    size_t n = 0;
    bool start = true;
    for (const char *c = upper; *c != '\0' && n + 1 < capacity; c++) {
        if (*c == '_') {
            start = true;
            continue;
        }
        out[n++] = start ? *c : (char)tolower((unsigned char)*c);
        start = false;
    }
    out[n] = '\0';
}

START_TEST(every_proto_method_has_exactly_one_row)
{
    const ProtobufCEnumDescriptor *methods = &ember__method__descriptor;
    unsigned served = 0;
    for (unsigned i = 0; i < methods->n_values; i++) {
        int value = methods->values[i].value;
        unsigned rows = 0;
        for (size_t r = 0; r < EM_METHOD_COUNT; r++)
            rows += (int)em_methods[r].method == value;
        if (value == EMBER__METHOD__METHOD_UNSPECIFIED) {
            ck_assert_uint_eq(rows, 0);
            ck_assert_ptr_null(em_method_find(value));
            continue;
        }
        ck_assert_msg(rows == 1, "Method %s has %u rows in EM_METHODS", methods->values[i].name,
                      rows);
        ck_assert_ptr_nonnull(em_method_find(value));
        served++;
    }
    ck_assert_uint_eq(served, EM_METHOD_COUNT);
    ck_assert_ptr_null(em_method_find(9999));
}
END_TEST

START_TEST(rows_name_their_own_messages_and_handlers)
{
    for (size_t r = 0; r < EM_METHOD_COUNT; r++) {
        const em_method_info *row = &em_methods[r];
        ck_assert_str_eq(row->name, em_method_name((int)row->method));
        char camel[64], expected[96];
        camel_case(row->name, camel, sizeof(camel));
        snprintf(expected, sizeof(expected), "%sRequest", camel);
        ck_assert_str_eq(row->request->short_name, expected);
        snprintf(expected, sizeof(expected), "%sResponse", camel);
        ck_assert_str_eq(row->response->short_name, expected);
        ck_assert_ptr_nonnull(row->handler);
        ck_assert_ptr_eq(em_method_find((int)row->method), row);
        for (size_t other = 0; other < r; other++)
            ck_assert_ptr_ne(em_methods[other].handler, row->handler);
    }
}
END_TEST

/* README "Wire protocol": data methods need the data token, ping and health nothing,
 * admin methods the admin listener and token; pushes and table changes order as
 * writes. */
START_TEST(access_and_ordering_follow_the_contract)
{
    for (size_t r = 0; r < EM_METHOD_COUNT; r++) {
        const em_method_info *row = &em_methods[r];
        switch ((int)row->method) {
        case EMBER__METHOD__PULL:
            ck_assert_int_eq(row->access, EM_METHOD_ACCESS_DATA);
            ck_assert_int_eq(row->ordering, EM_METHOD_ORDERING_READ);
            break;
        case EMBER__METHOD__PUSH:
            ck_assert_int_eq(row->access, EM_METHOD_ACCESS_DATA);
            ck_assert_int_eq(row->ordering, EM_METHOD_ORDERING_WRITE);
            break;
        case EMBER__METHOD__PING:
        case EMBER__METHOD__HEALTH:
            ck_assert_int_eq(row->access, EM_METHOD_ACCESS_OPEN);
            ck_assert_int_eq(row->ordering, EM_METHOD_ORDERING_LOOP);
            break;
        case EMBER__METHOD__CREATE_TABLE:
        case EMBER__METHOD__DROP_TABLE:
            ck_assert_int_eq(row->access, EM_METHOD_ACCESS_ADMIN);
            ck_assert_int_eq(row->listener, EM_METHOD_LISTENER_ADMIN);
            ck_assert_int_eq(row->ordering, EM_METHOD_ORDERING_WRITE);
            break;
        default:
            ck_assert_int_eq(row->access, EM_METHOD_ACCESS_ADMIN);
            ck_assert_int_eq(row->listener, EM_METHOD_LISTENER_ADMIN);
            break;
        }
        if (row->access == EM_METHOD_ACCESS_ADMIN)
            ck_assert_int_eq(row->listener, EM_METHOD_LISTENER_ADMIN);
    }
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("methods");
    TCase *tc = tcase_create("table");
    tcase_add_test(tc, every_proto_method_has_exactly_one_row);
    tcase_add_test(tc, rows_name_their_own_messages_and_handlers);
    tcase_add_test(tc, access_and_ordering_follow_the_contract);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
