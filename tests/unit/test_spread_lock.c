#include <check.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <unistd.h>

#include "lib/base/spread_lock.h"

/* ---- readers share, writers exclude ------------------------------------------------- */

typedef struct shared_state {
    em_spread_lock lock;
    uint64_t a, b; /* equal whenever no writer holds the lock */
    _Atomic uint64_t torn, reads, writes;
    _Atomic bool stop;
} shared_state;

static void *reader(void *argument)
{
    shared_state *s = argument;
    while (!atomic_load(&s->stop)) {
        em_spread_lock_read(&s->lock);
        if (s->a != s->b)
            atomic_fetch_add(&s->torn, 1);
        em_spread_unlock_read(&s->lock);
        atomic_fetch_add(&s->reads, 1);
    }
    return NULL;
}

static void *writer(void *argument)
{
    shared_state *s = argument;
    for (int i = 0; i < 20000; i++) {
        em_spread_lock_write(&s->lock);
        s->a++;
        if (i % 64 == 0)
            sched_yield(); /* readers arrive while a writer holds the lock */
        s->b++;
        em_spread_unlock_write(&s->lock);
        atomic_fetch_add(&s->writes, 1);
    }
    return NULL;
}

START_TEST(writers_exclude_readers_and_each_other)
{
    static shared_state s;
    ck_assert_int_eq(em_spread_lock_init(&s.lock), 0);
    enum { READERS = 4, WRITERS = 3 };
    pthread_t readers[READERS], writers[WRITERS];
    for (int i = 0; i < READERS; i++)
        pthread_create(&readers[i], NULL, reader, &s);
    for (int i = 0; i < WRITERS; i++)
        pthread_create(&writers[i], NULL, writer, &s);
    /* the writers finish while readers keep coming: they are not starved */
    for (int i = 0; i < WRITERS; i++)
        pthread_join(writers[i], NULL);
    atomic_store(&s.stop, true);
    for (int i = 0; i < READERS; i++)
        pthread_join(readers[i], NULL);
    ck_assert_uint_eq(s.a, WRITERS * 20000);
    ck_assert_uint_eq(s.b, WRITERS * 20000);
    uint64_t torn = atomic_load(&s.torn), reads = atomic_load(&s.reads);
    ck_assert_msg(torn == 0, "%" PRIu64 " of %" PRIu64 " reads saw a writer's half-done work",
                  torn, reads);
    ck_assert_uint_gt(reads, 0);
    em_spread_lock_destroy(&s.lock);
}
END_TEST

typedef struct pair_state {
    em_spread_lock lock;
    _Atomic int inside;
    _Atomic bool both_seen;
} pair_state;

static void *hold_and_wait_for_the_other(void *argument)
{
    pair_state *p = argument;
    em_spread_lock_read(&p->lock);
    atomic_fetch_add(&p->inside, 1);
    for (int i = 0; i < 5000 && atomic_load(&p->inside) < 2; i++)
        usleep(1000);
    if (atomic_load(&p->inside) == 2)
        atomic_store(&p->both_seen, true);
    em_spread_unlock_read(&p->lock);
    return NULL;
}

START_TEST(readers_hold_the_lock_together)
{
    static pair_state p;
    ck_assert_int_eq(em_spread_lock_init(&p.lock), 0);
    pthread_t threads[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&threads[i], NULL, hold_and_wait_for_the_other, &p);
    for (int i = 0; i < 2; i++)
        pthread_join(threads[i], NULL);
    ck_assert(atomic_load(&p.both_seen));
    em_spread_lock_destroy(&p.lock);
}
END_TEST

typedef struct waiting_writer {
    em_spread_lock *lock;
    _Atomic bool holds;
} waiting_writer;

static void *take_exclusively(void *argument)
{
    waiting_writer *w = argument;
    em_spread_lock_write(w->lock);
    atomic_store(&w->holds, true);
    em_spread_unlock_write(w->lock);
    return NULL;
}

/* A writer waits for a reader that holds the lock, however long (past the patient
 * spin: it sleeps), and gets it when the reader lets go. */
START_TEST(a_writer_waits_for_the_readers_inside)
{
    em_spread_lock lock;
    ck_assert_int_eq(em_spread_lock_init(&lock), 0);
    em_spread_lock_read(&lock);
    waiting_writer w = {&lock, false};
    pthread_t thread;
    pthread_create(&thread, NULL, take_exclusively, &w);
    usleep(200 * 1000);
    ck_assert(!atomic_load(&w.holds));
    em_spread_unlock_read(&lock);
    pthread_join(thread, NULL);
    ck_assert(atomic_load(&w.holds));
    em_spread_lock_destroy(&lock);
}
END_TEST

START_TEST(threads_are_numbered_once_each)
{
    uint32_t mine = em_thread_number();
    ck_assert_uint_gt(mine, 0);
    ck_assert_uint_eq(em_thread_number(), mine);
}
END_TEST

static Suite *spread_lock_suite(void)
{
    Suite *s = suite_create("spread_lock");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, writers_exclude_readers_and_each_other);
    tcase_add_test(tc, readers_hold_the_lock_together);
    tcase_add_test(tc, a_writer_waits_for_the_readers_inside);
    tcase_add_test(tc, threads_are_numbered_once_each);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *runner = srunner_create(spread_lock_suite());
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed == 0 ? 0 : 1;
}
