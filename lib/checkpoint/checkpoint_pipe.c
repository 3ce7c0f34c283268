/*
 * DESIGN: a one-slot hand-over to a worker thread (checkpoint_internal.h: em__pipe), so
 * that a save writes one buffer while it fills the next, and a load imports one batch
 * while it reads the next. Items are done one at a time, in the order handed over;
 * after the first failure the rest are skipped and every later call returns it.
 */
#include <string.h>

#include "lib/checkpoint/checkpoint_internal.h"

static void *run_pipe(void *argument)
{
    em__pipe *p = argument;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (p->item == NULL && !p->stop)
            pthread_cond_wait(&p->changed, &p->lock);
        if (p->item == NULL)
            break;
        void *item = p->item;
        em_status status = p->status;
        pthread_mutex_unlock(&p->lock);
        em_error err;
        if (status == EM_OK)
            status = p->work(p->context, item, &err);
        pthread_mutex_lock(&p->lock);
        if (p->status == EM_OK && status != EM_OK) {
            p->status = status;
            em_error_copy(&p->err, &err);
        }
        p->item = NULL;
        pthread_cond_broadcast(&p->changed);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

em_status em__pipe_start(em__pipe *p, em_status (*work)(void *context, void *item, em_error *err),
                         void *context, em_error *err)
{
    memset(p, 0, sizeof(*p));
    p->work = work;
    p->context = context;
    p->status = EM_OK;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->changed, NULL);
    int rc = pthread_create(&p->thread, NULL, run_pipe, p);
    if (rc != 0) {
        pthread_cond_destroy(&p->changed);
        pthread_mutex_destroy(&p->lock);
        return em_error_set(err, EM_INTERNAL, "cannot start a checkpoint worker thread: %s",
                            strerror(rc));
    }
    p->running = true;
    return EM_OK;
}

em_status em__pipe_wait(em__pipe *p, em_error *err)
{
    pthread_mutex_lock(&p->lock);
    while (p->item != NULL)
        pthread_cond_wait(&p->changed, &p->lock);
    em_status status = p->status;
    if (status != EM_OK)
        em_error_copy(err, &p->err);
    pthread_mutex_unlock(&p->lock);
    return status;
}

em_status em__pipe_put(em__pipe *p, void *item, em_error *err)
{
    em_status status = em__pipe_wait(p, err);
    if (status != EM_OK)
        return status;
    pthread_mutex_lock(&p->lock);
    p->item = item;
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
    return EM_OK;
}

em_status em__pipe_finish(em__pipe *p, em_error *err)
{
    if (!p->running)
        return EM_OK;
    em_status status = em__pipe_wait(p, err);
    pthread_mutex_lock(&p->lock);
    p->stop = true;
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
    pthread_join(p->thread, NULL);
    pthread_cond_destroy(&p->changed);
    pthread_mutex_destroy(&p->lock);
    p->running = false;
    return status;
}
