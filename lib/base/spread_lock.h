/*
 * DESIGN: a reader-writer lock whose readers do not share a cache line. Every request
 * to a table takes the table's lock shared, so with a pthread rwlock every request on
 * every thread writes the same word, and with requests of a few microseconds on
 * several threads that line moving between cores costs as much as the requests
 * (tests/bench/RESULTS.md). Here a reader counts itself in one of EM_SPREAD_SLOTS
 * counters, each on a cache line of its own, chosen by the thread's number
 * (em_thread_number), and then checks the writer flag, which only writers write. A
 * writer raises the flag, then waits until every counter is zero: a reader that counted
 * itself before the flag was up holds the lock, and one that came after sees the flag,
 * takes its count back and waits for the writer to finish. Both sides use sequentially
 * consistent operations, so of a reader's count-then-check and a writer's
 * flag-then-check at least one sees the other.
 *
 * Writers come first: once a writer raised the flag no reader enters, so a steady
 * stream of readers cannot starve one (as PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP,
 * which the table's lock had). Writers take a mutex for the whole exclusive hold, so
 * they go one at a time. Waiting, on either side, first tries for up to
 * EM_RWLOCK_PATIENT_NS where another CPU can run the holder (lib/base/rwlock.h), then
 * sleeps on a condition variable: readers until the writer lets go, a writer until the
 * readers it waits for have gone (the last of them wakes it).
 *
 * Shared holds are not recursive: a thread that takes the lock shared twice can wait
 * for a writer that waits for it. The lock costs EM_SPREAD_SLOTS x 64 bytes.
 */
#ifndef EMBER_LIB_BASE_SPREAD_LOCK_H
#define EMBER_LIB_BASE_SPREAD_LOCK_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define EM_SPREAD_SLOTS 16

typedef struct em_spread_slot {
    _Atomic uint64_t readers;
    char apart[64 - sizeof(uint64_t)];
} em_spread_slot;

typedef struct em_spread_lock {
    em_spread_slot *slots;   /* EM_SPREAD_SLOTS, 64-byte aligned */
    _Atomic uint32_t writer; /* 1 from a writer's flag until it lets go */
    pthread_mutex_t writers; /* held by the writer for its whole hold */
    pthread_mutex_t waiting; /* the two conditions' */
    pthread_cond_t released; /* the writer let go */
    pthread_cond_t drained;  /* a reader left while a writer waited */
} em_spread_lock;

/* 0, or an errno value (ENOMEM). */
int em_spread_lock_init(em_spread_lock *lock);
void em_spread_lock_destroy(em_spread_lock *lock);

void em_spread_lock_read(em_spread_lock *lock);
void em_spread_unlock_read(em_spread_lock *lock);
void em_spread_lock_write(em_spread_lock *lock);
void em_spread_unlock_write(em_spread_lock *lock);

/* A number for the calling thread: 1, 2, ... in the order threads first ask. */
uint32_t em_thread_number(void);

#endif
