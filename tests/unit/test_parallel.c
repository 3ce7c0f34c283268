/* Items of work over several threads for one call (lib/base/parallel.h). */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "lib/base/parallel.h"

typedef struct counted {
    _Atomic uint32_t *runs; /* per item */
} counted;

static void count_item(void *context, uint64_t item)
{
    counted *c = context;
    atomic_fetch_add(&c->runs[item], 1);
}

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

/* Every item runs exactly once, whatever the threads asked for, n = 0 included: with
 * threads started for the run (no pool), and through pools of 0, 1, 3 and 100 threads
 * (more than any run takes). */
START_TEST(every_item_runs_once)
{
    static const uint64_t sizes[] = {0, 1, 2, 7, 1000};
    static const uint32_t threads[] = {0, 1, 2, 3, 8, 100};
    static const uint32_t helpers[] = {0, 1, 3, 100};
    for (size_t h = 0; h < sizeof(helpers) / sizeof(helpers[0]) + 1; h++) {
        em_parallel_pool *pool =
            h < sizeof(helpers) / sizeof(helpers[0]) ? em_parallel_pool_create(helpers[h]) : NULL;
        for (size_t a = 0; a < sizeof(sizes) / sizeof(sizes[0]); a++)
            for (size_t b = 0; b < sizeof(threads) / sizeof(threads[0]); b++) {
                uint64_t n = sizes[a];
                _Atomic uint32_t *runs = calloc(n + 1, sizeof(*runs));
                counted c = {runs};
                em_parallel_pool_run(pool, n, threads[b], count_item, &c);
                uint64_t wrong = 0;
                for (uint64_t i = 0; i < n; i++)
                    wrong += atomic_load(&runs[i]) != 1;
                ck_assert_msg(wrong == 0, "pool %zu, n %llu, threads %u: %llu items not run once",
                              h, (unsigned long long)n, threads[b], (unsigned long long)wrong);
                free(runs);
            }
        em_parallel_pool_destroy(pool);
    }
}
END_TEST

typedef struct met_on {
    meeting m;
    _Atomic long tids[2]; /* the threads of the two items */
} met_on;

static void meet_and_name_item(void *context, uint64_t item)
{
    met_on *on = context;
    atomic_store(&on->tids[item], (long)syscall(SYS_gettid));
    meet_item(&on->m, item);
}

/* Two items meet on two threads of the pool's, and the next run meets on the same two:
 * the pool's thread was kept, not started again. */
START_TEST(a_pool_runs_items_at_the_same_time_on_threads_it_keeps)
{
    em_parallel_pool *pool = em_parallel_pool_create(1);
    long helper = 0;
    for (int round = 0; round < 3; round++) {
        met_on on;
        atomic_init(&on.m.arrived, 0);
        atomic_init(&on.m.met, 0);
        em_parallel_pool_run(pool, 2, 2, meet_and_name_item, &on);
        ck_assert_uint_eq(atomic_load(&on.m.met), 2);
        long self = (long)syscall(SYS_gettid);
        long other = atomic_load(&on.tids[0]) == self ? atomic_load(&on.tids[1])
                                                       : atomic_load(&on.tids[0]);
        ck_assert_int_ne(other, self);
        if (round > 0)
            ck_assert_int_eq(other, helper);
        helper = other;
    }
    em_parallel_pool_destroy(pool);
}
END_TEST

typedef struct nested {
    em_parallel_pool *pool;
    _Atomic uint32_t inner; /* items of the runs started from items */
} nested;

static void inner_item(void *context, uint64_t item)
{
    (void)item;
    nested *n = context;
    atomic_fetch_add(&n->inner, 1);
}

static void outer_item(void *context, uint64_t item)
{
    (void)item;
    nested *n = context;
    em_parallel_pool_run(n->pool, 16, 4, inner_item, n);
}

typedef struct caller {
    em_parallel_pool *pool;
    uint64_t wrong;
} caller;

static void *call_many(void *untyped)
{
    caller *c = untyped;
    for (int r = 0; r < 300; r++) {
        _Atomic uint32_t runs[9] = {0};
        counted count = {runs};
        em_parallel_pool_run(c->pool, 9, 4, count_item, &count);
        for (int i = 0; i < 9; i++)
            c->wrong += atomic_load(&runs[i]) != 1;
    }
    return NULL;
}

/* Runs from four threads at once share a pool of two threads, and runs started inside
 * an item finish: no run waits for a thread the others hold. */
START_TEST(runs_from_several_threads_and_from_items_share_a_pool)
{
    em_parallel_pool *pool = em_parallel_pool_create(2);
    caller callers[4];
    pthread_t threads[4];
    for (int t = 0; t < 4; t++) {
        callers[t] = (caller){pool, 0};
        ck_assert_int_eq(pthread_create(&threads[t], NULL, call_many, &callers[t]), 0);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(threads[t], NULL);
        ck_assert_uint_eq(callers[t].wrong, 0);
    }
    nested n = {pool, 0};
    em_parallel_pool_run(pool, 8, 3, outer_item, &n);
    ck_assert_uint_eq(atomic_load(&n.inner), 8 * 16);
    em_parallel_pool_destroy(pool);
}
END_TEST

/* A child forked after the pool started its thread (which the child does not have)
 * runs every item, on threads of its own, and destroys the pool without waiting for it. */
START_TEST(a_forked_child_runs_without_the_parents_pool_threads)
{
    em_parallel_pool *pool = em_parallel_pool_create(1);
    met_on on;
    atomic_init(&on.m.arrived, 0);
    atomic_init(&on.m.met, 0);
    em_parallel_pool_run(pool, 2, 2, meet_and_name_item, &on); /* the thread starts */
    ck_assert_uint_eq(atomic_load(&on.m.met), 2);
    pid_t child = fork();
    ck_assert_int_ge(child, 0);
    if (child == 0) {
#ifdef __SANITIZE_THREAD__
        /* ThreadSanitizer stops a child of a threaded process that starts a thread:
         * there the items run on the calling thread */
        _Atomic uint32_t runs[2] = {0};
        counted c = {runs};
        em_parallel_pool_run(pool, 2, 1, count_item, &c);
        em_parallel_pool_destroy(pool);
        _exit(atomic_load(&runs[0]) == 1 && atomic_load(&runs[1]) == 1 ? 0 : 1);
#else
        met_on again;
        atomic_init(&again.m.arrived, 0);
        atomic_init(&again.m.met, 0);
        em_parallel_pool_run(pool, 2, 2, meet_and_name_item, &again);
        em_parallel_pool_destroy(pool);
        _exit(atomic_load(&again.m.met) == 2 ? 0 : 1);
#endif
    }
    int status = 0;
    ck_assert_int_eq(waitpid(child, &status, 0), child);
    ck_assert(WIFEXITED(status));
    ck_assert_int_eq(WEXITSTATUS(status), 0);
    em_parallel_pool_destroy(pool);
}
END_TEST

static Suite *parallel_suite(void)
{
    Suite *suite = suite_create("parallel");
    TCase *tc = tcase_create("parallel");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, every_item_runs_once);
    tcase_add_test(tc, items_run_at_the_same_time_on_two_threads);
    tcase_add_test(tc, a_pool_runs_items_at_the_same_time_on_threads_it_keeps);
    tcase_add_test(tc, runs_from_several_threads_and_from_items_share_a_pool);
    tcase_add_test(tc, a_forked_child_runs_without_the_parents_pool_threads);
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
