/*
 * DESIGN: taking a reader-writer lock that is held for microseconds: a few attempts
 * while the holder finishes, then the blocking call. glibc's rwlock sleeps in the
 * kernel on the first conflict, and waking the sleeper (a futex wake and a context
 * switch, several microseconds each) costs more than the wait itself when critical
 * sections are as short as a shard's one-key step. The attempts are bounded (about a
 * microsecond or two), so a holder that is descheduled costs little spinning.
 */
#ifndef EMBER_LIB_BASE_RWLOCK_H
#define EMBER_LIB_BASE_RWLOCK_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

/* Attempts before blocking. */
#define EM_RWLOCK_SPINS 64

static inline void em_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline void em_rwlock_read_lock(pthread_rwlock_t *lock)
{
    for (int i = 0; i < EM_RWLOCK_SPINS; i++) {
        if (pthread_rwlock_tryrdlock(lock) == 0)
            return;
        em_cpu_relax();
    }
    pthread_rwlock_rdlock(lock);
}

static inline void em_rwlock_write_lock(pthread_rwlock_t *lock)
{
    for (int i = 0; i < EM_RWLOCK_SPINS; i++) {
        if (pthread_rwlock_trywrlock(lock) == 0)
            return;
        em_cpu_relax();
    }
    pthread_rwlock_wrlock(lock);
}

/* How long a patient waiter (the table lock's, lib/base/spread_lock.c) tries before
 * blocking: longer than a table's one-key request under its lock, shorter than a futex
 * wake and a context switch on a busy host (tens of microseconds on a virtual
 * machine). */
#define EM_RWLOCK_PATIENT_NS 50000

static inline uint64_t em_rwlock_now_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}

/* Whether waiting by trying again can pay: not where this is the only CPU online, as
 * the holder cannot run while its waiter spins. */
static inline bool em_rwlock_spin_pays(void)
{
    static int cpus; /* 0 until first asked */
    int known = __atomic_load_n(&cpus, __ATOMIC_RELAXED);
    if (known == 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        known = online > 0 ? (int)online : 1;
        __atomic_store_n(&cpus, known, __ATOMIC_RELAXED);
    }
    return known > 1;
}

#endif
