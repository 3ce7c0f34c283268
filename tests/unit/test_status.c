#include <string.h>

#include "lib/base/status.h"
#include "tests/support/test_support.h"

START_TEST(codes_follow_grpc_numbering)
{
    ck_assert_int_eq(EM_OK, 0);
    ck_assert_int_eq(EM_INVALID_ARGUMENT, 3);
    ck_assert_int_eq(EM_NOT_FOUND, 5);
    ck_assert_int_eq(EM_RESOURCE_EXHAUSTED, 8);
    ck_assert_int_eq(EM_FAILED_PRECONDITION, 9);
    ck_assert_int_eq(EM_UNAVAILABLE, 14);
    ck_assert_int_eq(EM_DATA_LOSS, 15);
    ck_assert_int_eq(EM_UNAUTHENTICATED, 16);
}
END_TEST

START_TEST(names_round_trip)
{
    for (int code = 0; code < EM_STATUS_COUNT; code++) {
        const char *name = em_status_name((em_status)code);
        em_status parsed = EM_UNKNOWN;
        ck_assert_msg(em_status_parse(name, &parsed), "name %s did not parse", name);
        ck_assert_int_eq(parsed, code);
        ck_assert_str_ne(em_status_message((em_status)code), "");
    }
    ck_assert_str_eq(em_status_name(EM_DEADLINE_EXCEEDED), "DEADLINE_EXCEEDED");
    ck_assert_str_eq(em_status_name((em_status)99), "UNKNOWN_STATUS");
    em_status parsed;
    ck_assert(em_status_parse("not_found", &parsed));
    ck_assert_int_eq(parsed, EM_NOT_FOUND);
    ck_assert(em_status_parse("16", &parsed));
    ck_assert_int_eq(parsed, EM_UNAUTHENTICATED);
    ck_assert(!em_status_parse("17", &parsed));
    ck_assert(!em_status_parse("NOPE", &parsed));
    ck_assert(!em_status_parse("", &parsed));
}
END_TEST

START_TEST(error_set_formats_and_returns_status)
{
    em_error err;
    em_error_clear(&err);
    ck_assert_int_eq(err.status, EM_OK);
    em_status status = em_error_set(&err, EM_NOT_FOUND, "table '%s' does not exist", "clicks");
    ck_assert_int_eq(status, EM_NOT_FOUND);
    ck_assert_int_eq(err.status, EM_NOT_FOUND);
    ck_assert_str_eq(err.message, "table 'clicks' does not exist");
    ck_assert_int_eq(em_error_set(NULL, EM_INTERNAL, "ignored"), EM_INTERNAL);
}
END_TEST

START_TEST(error_prefix_keeps_status)
{
    em_error err;
    em_error_set(&err, EM_INVALID_ARGUMENT, "offsets[3]=9 < offsets[2]=10");
    ck_assert_int_eq(em_error_prefix(&err, "pull on '%s': ", "ads"), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "pull on 'ads': offsets[3]=9 < offsets[2]=10");
}
END_TEST

START_TEST(long_messages_are_marked_truncated)
{
    char big[2 * EM_ERROR_MESSAGE_MAX];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    em_error err;
    em_error_set(&err, EM_INTERNAL, "%s", big);
    size_t length = strlen(err.message);
    ck_assert_uint_eq(length, EM_ERROR_MESSAGE_MAX - 1);
    ck_assert_str_eq(err.message + length - 3, "...");
    em_error_prefix(&err, "context: ");
    ck_assert(strncmp(err.message, "context: xxx", 12) == 0);
    ck_assert_str_eq(err.message + strlen(err.message) - 3, "...");
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("status");
    TCase *tc = tcase_create("status");
    tcase_add_test(tc, codes_follow_grpc_numbering);
    tcase_add_test(tc, names_round_trip);
    tcase_add_test(tc, error_set_formats_and_returns_status);
    tcase_add_test(tc, error_prefix_keeps_status);
    tcase_add_test(tc, long_messages_are_marked_truncated);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
