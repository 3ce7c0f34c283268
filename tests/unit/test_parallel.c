/* Items of work over several threads for one call (lib/base/parallel.h). */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "lib/base/parallel.h"

typedef struct counted {
    _Atomic uint32_t *runs; /* per item */
} counted;

static void count_item(void *context, uint64_t item)
{
    counted *c = context;
    atomic_fetch_add(&c->runs[item], 1);
}

/* Every item runs exactly once, whatever the threads asked for, n = 0 included. */
START_TEST(every_item_runs_once)
{
    static const uint64_t sizes[] = {0, 1, 2, 7, 1000};
    static const uint32_t threads[] = {0, 1, 2, 3, 8, 100};
    for (size_t a = 0; a < sizeof(sizes) / sizeof(sizes[0]); a++)
        for (size_t b = 0; b < sizeof(threads) / sizeof(threads[0]); b++) {
            uint64_t n = sizes[a];
            _Atomic uint32_t *runs = calloc(n + 1, sizeof(*runs));
            counted c = {runs};
            em_parallel_run(n, threads[b], count_item, &c);
            uint64_t wrong = 0;
            for (uint64_t i = 0; i < n; i++)
                wrong += atomic_load(&runs[i]) != 1;
            ck_assert_msg(wrong == 0, "n %llu, threads %u: %llu items not run once",
                          (unsigned long long)n, threads[b], (unsigned long long)wrong);
            free(runs);
        }
}
END_TEST

typedef struct meeting {
    _Atomic uint32_t arrived;
    _Atomic uint32_t met; /* items that saw the other one arrive */
} meeting;

/* Each of two items waits (up to 10 s) until both have started: only items that run at
 * the same time on two threads both see the other. */
static void meet_item(void *context, uint64_t item)
{
    (void)item;
    meeting *m = context;
    atomic_fetch_add(&m->arrived, 1);
    for (int waited_ms = 0; waited_ms < 10000; waited_ms++) {
        if (atomic_load(&m->arrived) == 2) {
            atomic_fetch_add(&m->met, 1);
            return;
        }
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
}

START_TEST(items_run_at_the_same_time_on_two_threads)
{
    meeting m;
    atomic_init(&m.arrived, 0);
    atomic_init(&m.met, 0);
    em_parallel_run(2, 2, meet_item, &m);
    ck_assert_uint_eq(atomic_load(&m.met), 2);
    ck_assert_uint_ge(em_parallel_cpus(), 1);
}
END_TEST

static Suite *parallel_suite(void)
{
    Suite *suite = suite_create("parallel");
    TCase *tc = tcase_create("parallel");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, every_item_runs_once);
    tcase_add_test(tc, items_run_at_the_same_time_on_two_threads);
    suite_add_tcase(suite, tc);
    return suite;
}

int main(void)
{
    SRunner *runner = srunner_create(parallel_suite());
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
