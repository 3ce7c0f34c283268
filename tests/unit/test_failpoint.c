/* The failpoint list parser and hit counting (lib/base/failpoint.h). */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "lib/base/failpoint.h"

START_TEST(counts_values_and_disarming)
{
    em_error err;
    ck_assert_int_eq(em_failpoints_arm("pool_alloc*2, worker_stall=300", &err), EM_OK);
    uint64_t value = 0;
    ck_assert(em_failpoint_hit(EM_FAILPOINT_POOL_ALLOC, NULL));
    ck_assert(em_failpoint_hit(EM_FAILPOINT_POOL_ALLOC, NULL));
    ck_assert(!em_failpoint_hit(EM_FAILPOINT_POOL_ALLOC, NULL));
    for (int i = 0; i < 5; i++) {
        ck_assert(em_failpoint_hit(EM_FAILPOINT_WORKER_STALL, &value));
        ck_assert_uint_eq(value, 300);
    }
    ck_assert(!em_failpoint_hit(EM_FAILPOINT_ACCEPT_FAIL, NULL));
    char described[128];
    em_failpoints_describe(described, sizeof(described));
    ck_assert_str_eq(described, "worker_stall=300");
    em_failpoints_disarm_all();
    ck_assert(!em_failpoint_hit(EM_FAILPOINT_WORKER_STALL, NULL));
    em_failpoints_describe(described, sizeof(described));
    ck_assert_str_eq(described, "");
}
END_TEST

START_TEST(bad_lists_are_refused_whole)
{
    em_error err;
    ck_assert_int_eq(em_failpoints_arm("accept_fail, nope=3", &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "failpoint 'nope=3': unknown name (known: pool_alloc, "
                                  "worker_stall, partial_write, accept_fail, checkpoint_fail, "
                                  "checkpoint_crash, checkpoint_stall, checkpoint_read_fail, "
                                  "gpu_fault, nccl_init_fail)");
    ck_assert(!em_failpoint_hit(EM_FAILPOINT_ACCEPT_FAIL, NULL)); /* nothing armed */
    ck_assert_int_eq(em_failpoints_arm("pool_alloc*0", &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "failpoint 'pool_alloc*0': the count must be at least 1");
    ck_assert_int_eq(em_failpoints_arm("worker_stall=soon", &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message,
                     "failpoint 'worker_stall=soon': the value after '=' must be a decimal number");
    setenv("EMBER_FAILPOINTS", "partial_write=x", 1);
    ck_assert_int_eq(em_failpoints_arm_from_env(&err), EM_INVALID_ARGUMENT);
    ck_assert(strncmp(err.message, "EMBER_FAILPOINTS: failpoint 'partial_write=x'", 44) == 0);
    unsetenv("EMBER_FAILPOINTS");
    ck_assert_int_eq(em_failpoints_arm_from_env(&err), EM_OK);
}
END_TEST

static Suite *failpoint_suite(void)
{
    Suite *suite = suite_create("failpoint");
    TCase *tc = tcase_create("failpoint");
    tcase_add_test(tc, counts_values_and_disarming);
    tcase_add_test(tc, bad_lists_are_refused_whole);
    suite_add_tcase(suite, tc);
    return suite;
}

int main(void)
{
    SRunner *runner = srunner_create(failpoint_suite());
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
