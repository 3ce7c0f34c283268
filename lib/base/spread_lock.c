#include "lib/base/spread_lock.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "lib/base/aligned.h"
#include "lib/base/rwlock.h"

uint32_t em_thread_number(void)
{
    static _Atomic uint32_t threads;
    static _Thread_local uint32_t number; /* 0: not numbered yet */
    if (number == 0)
        number = atomic_fetch_add_explicit(&threads, 1, memory_order_relaxed) + 1;
    return number;
}

int em_spread_lock_init(em_spread_lock *lock)
{
    memset(lock, 0, sizeof(*lock));
    lock->slots = em_aligned_calloc(EM_SPREAD_SLOTS, sizeof(em_spread_slot));
    if (lock->slots == NULL)
        return ENOMEM;
    for (uint32_t i = 0; i < EM_SPREAD_SLOTS; i++)
        atomic_init(&lock->slots[i].readers, 0);
    atomic_init(&lock->writer, 0);
    int failed = pthread_mutex_init(&lock->writers, NULL);
    if (failed == 0 && (failed = pthread_mutex_init(&lock->waiting, NULL)) != 0)
        pthread_mutex_destroy(&lock->writers);
    if (failed == 0 && (failed = pthread_cond_init(&lock->released, NULL)) != 0) {
        pthread_mutex_destroy(&lock->waiting);
        pthread_mutex_destroy(&lock->writers);
    }
    if (failed == 0 && (failed = pthread_cond_init(&lock->drained, NULL)) != 0) {
        pthread_cond_destroy(&lock->released);
        pthread_mutex_destroy(&lock->waiting);
        pthread_mutex_destroy(&lock->writers);
    }
    if (failed != 0) {
        free(lock->slots);
        lock->slots = NULL;
    }
    return failed;
}

void em_spread_lock_destroy(em_spread_lock *lock)
{
    if (lock->slots == NULL)
        return;
    pthread_cond_destroy(&lock->drained);
    pthread_cond_destroy(&lock->released);
    pthread_mutex_destroy(&lock->waiting);
    pthread_mutex_destroy(&lock->writers);
    free(lock->slots);
    lock->slots = NULL;
}

static em_spread_slot *own_slot(em_spread_lock *lock)
{
    return &lock->slots[em_thread_number() % EM_SPREAD_SLOTS];
}

/* Tries until done() or EM_RWLOCK_PATIENT_NS passed, where spinning can pay. */
static bool wait_patiently(em_spread_lock *lock, const _Atomic uint64_t *readers)
{
    if (!em_rwlock_spin_pays())
        return false;
    uint64_t deadline = em_rwlock_now_ns() + EM_RWLOCK_PATIENT_NS;
    do {
        for (int i = 0; i < EM_RWLOCK_SPINS; i++)
            em_cpu_relax();
        bool done = readers != NULL ? atomic_load(readers) == 0 : atomic_load(&lock->writer) == 0;
        if (done)
            return true;
    } while (em_rwlock_now_ns() < deadline);
    return false;
}

/* A reader's count goes back; a writer that waits for it is woken. */
static void leave(em_spread_lock *lock, em_spread_slot *slot)
{
    atomic_fetch_sub(&slot->readers, 1);
    if (atomic_load(&lock->writer) != 0) {
        pthread_mutex_lock(&lock->waiting);
        pthread_cond_broadcast(&lock->drained);
        pthread_mutex_unlock(&lock->waiting);
    }
}

void em_spread_lock_read(em_spread_lock *lock)
{
    em_spread_slot *slot = own_slot(lock);
    for (;;) {
        atomic_fetch_add(&slot->readers, 1);
        if (atomic_load(&lock->writer) == 0)
            return;
        leave(lock, slot);
        if (wait_patiently(lock, NULL))
            continue;
        pthread_mutex_lock(&lock->waiting);
        while (atomic_load(&lock->writer) != 0)
            pthread_cond_wait(&lock->released, &lock->waiting);
        pthread_mutex_unlock(&lock->waiting);
    }
}

void em_spread_unlock_read(em_spread_lock *lock)
{
    leave(lock, own_slot(lock));
}

void em_spread_lock_write(em_spread_lock *lock)
{
    pthread_mutex_lock(&lock->writers);
    atomic_store(&lock->writer, 1);
    for (uint32_t i = 0; i < EM_SPREAD_SLOTS; i++) {
        _Atomic uint64_t *readers = &lock->slots[i].readers;
        if (atomic_load(readers) == 0 || wait_patiently(lock, readers))
            continue;
        pthread_mutex_lock(&lock->waiting);
        while (atomic_load(readers) != 0)
            pthread_cond_wait(&lock->drained, &lock->waiting);
        pthread_mutex_unlock(&lock->waiting);
    }
}

void em_spread_unlock_write(em_spread_lock *lock)
{
    pthread_mutex_lock(&lock->waiting);
    atomic_store(&lock->writer, 0);
    pthread_cond_broadcast(&lock->released);
    pthread_mutex_unlock(&lock->waiting);
    pthread_mutex_unlock(&lock->writers);
}
