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

#endif
