/*
 * DESIGN: what a save removes, and when its files go.
 *
 * Once LATEST names the new checkpoint, the save prunes with its table's lock held:
 * each checkpoint beyond keep that no kept delta builds on, and what saves that never
 * finished left (temporaries, directories newer than LATEST), is renamed to
 * .old-<id> in the table's directory. One rename each, so when the save answers, the
 * table's checkpoints are the ones kept: listing, loading, a restore and the next id
 * pass over names that start with '.', and a crash leaves .old- directories for the
 * next save's prune to remove.
 *
 * Given an em_checkpoint_removals (options->removals), their files are unlinked after
 * the save answers, on a thread of their own that the removals count: unlinking a
 * checkpoint of 1.5 GB took 0.2-0.3 s on a virtual disk (tests/bench/RESULTS.md), which
 * the save's caller has no reason to wait for. The thread works through a descriptor of
 * the table's directory, so a drop that renames that directory meanwhile
 * (em_checkpoint_drop_table) does not make it lose its place. A save given removals
 * waits for those already begun before it writes, so the disk never holds more than
 * when saves removed before answering (a save of every table, one after another, frees
 * each table's old checkpoint before the next table's is written). Destroying the
 * removals waits for their threads. Without one, the save removes them before it
 * answers.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lib/checkpoint/checkpoint.h"
#include "lib/checkpoint/checkpoint_internal.h"

/* Removes the directory name (of plain files) in the directory dir_fd (AT_FDCWD: name is
 * a path), best effort. */
static void remove_dir_at(int dir_fd, const char *name)
{
    int fd = openat(dir_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) {
        DIR *dir = fdopendir(fd);
        if (dir == NULL) {
            close(fd);
        } else {
            struct dirent *entry;
            while ((entry = readdir(dir)) != NULL)
                if (strcmp(entry->d_name, ".") != 0 && strcmp(entry->d_name, "..") != 0)
                    unlinkat(fd, entry->d_name, 0);
            closedir(dir); /* and fd with it */
        }
    }
    unlinkat(dir_fd, name, AT_REMOVEDIR);
}

void em__checkpoint_remove_dir(const char *path)
{
    remove_dir_at(AT_FDCWD, path);
}

/* ---- removal after the answer ------------------------------------------------------------ */

struct em_checkpoint_removals {
    pthread_mutex_t lock;
    pthread_cond_t ended;
    unsigned running; /* removal threads not ended */
};

em_status em_checkpoint_removals_create(em_checkpoint_removals **out, em_error *err)
{
    em_checkpoint_removals *removals = calloc(1, sizeof(*removals));
    if (removals == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "checkpoint removals: out of memory");
    pthread_mutex_init(&removals->lock, NULL);
    pthread_cond_init(&removals->ended, NULL);
    *out = removals;
    return EM_OK;
}

void em_checkpoint_removals_wait(em_checkpoint_removals *removals)
{
    if (removals == NULL)
        return;
    pthread_mutex_lock(&removals->lock);
    while (removals->running > 0)
        pthread_cond_wait(&removals->ended, &removals->lock);
    pthread_mutex_unlock(&removals->lock);
}

void em_checkpoint_removals_destroy(em_checkpoint_removals *removals)
{
    if (removals == NULL)
        return;
    em_checkpoint_removals_wait(removals);
    pthread_cond_destroy(&removals->ended);
    pthread_mutex_destroy(&removals->lock);
    free(removals);
}

/* Removes every .old- directory in the directory dir_fd. */
static void remove_old_dirs(int dir_fd)
{
    int scan_fd = openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *dir = scan_fd >= 0 ? fdopendir(scan_fd) : NULL;
    if (dir == NULL) {
        if (scan_fd >= 0)
            close(scan_fd);
        return;
    }
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL)
        if (strncmp(entry->d_name, EM__CHECKPOINT_OLD, strlen(EM__CHECKPOINT_OLD)) == 0)
            remove_dir_at(dir_fd, entry->d_name);
    closedir(dir);
}

typedef struct removal {
    em_checkpoint_removals *removals;
    int dir_fd; /* the table's directory */
} removal;

static void *run_removal(void *argument)
{
    removal *job = argument;
    em_checkpoint_removals *removals = job->removals;
    remove_old_dirs(job->dir_fd);
    close(job->dir_fd);
    free(job);
    pthread_mutex_lock(&removals->lock);
    removals->running--;
    pthread_cond_broadcast(&removals->ended);
    pthread_mutex_unlock(&removals->lock);
    return NULL;
}

/* Removes the .old- directories of table_dir: on a thread of its own counted in
 * removals, or here without removals (or where no thread starts). */
static void remove_old(const char *table_dir, em_checkpoint_removals *removals)
{
    int dir_fd = open(table_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd < 0)
        return;
    removal *job = removals != NULL ? malloc(sizeof(*job)) : NULL;
    if (job == NULL) {
        remove_old_dirs(dir_fd);
        close(dir_fd);
        return;
    }
    *job = (removal){removals, dir_fd};
    pthread_mutex_lock(&removals->lock);
    removals->running++;
    pthread_mutex_unlock(&removals->lock);
    pthread_attr_t attr;
    pthread_t thread;
    bool started = pthread_attr_init(&attr) == 0;
    if (started) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        started = pthread_create(&thread, &attr, run_removal, job) == 0;
        pthread_attr_destroy(&attr);
    }
    if (!started)
        run_removal(job);
}

/* ---- pruning ------------------------------------------------------------------------------ */

/* The oldest id that the newest keep checkpoints need: the full checkpoint each of
 * their chains starts at (a chain's links are consecutive published ids). "" when a
 * manifest does not read: then nothing is removed. */
static void oldest_needed(const em_checkpoint_info *infos, size_t count, uint32_t keep,
                          char *oldest)
{
    strcpy(oldest, infos[count - 1].id);
    for (size_t i = count > keep ? count - keep : 0; i < count; i++) {
        em__chain_link link;
        em_error err;
        if (em__checkpoint_read_link(infos[i].path, &link, &err) != EM_OK) {
            oldest[0] = '\0';
            return;
        }
        if (strcmp(link.base_id, oldest) < 0)
            strcpy(oldest, link.base_id);
    }
}

/* Renames table_dir/name (a checkpoint id, or .tmp-<id>) to .old-<id>; where that
 * fails, removes it here. */
static void set_aside(const char *table_dir, const char *name)
{
    const char *id = strncmp(name, ".tmp-", 5) == 0 ? name + 5 : name;
    char from[4400], to[4400];
    snprintf(from, sizeof(from), "%s/%s", table_dir, name);
    snprintf(to, sizeof(to), "%s/%s%s", table_dir, EM__CHECKPOINT_OLD, id);
    if (rename(from, to) != 0)
        em__checkpoint_remove_dir(from);
}

/* Sets aside what saves that never finished left in table_dir (temporaries, ids newer
 * than latest_id); returns how many, and *old says whether .old- directories are there
 * already. */
static size_t set_aside_leftovers(const char *table_dir, const char *latest_id, bool *old)
{
    *old = false;
    DIR *d = opendir(table_dir);
    if (d == NULL)
        return 0;
    /* the names first: the directory is not read while it changes */
    char (*leftovers)[NAME_MAX + 1] = NULL;
    size_t count = 0, capacity = 0;
    struct dirent *entry;
    while ((entry = readdir(d)) != NULL) {
        const char *name = entry->d_name;
        *old = *old || strncmp(name, EM__CHECKPOINT_OLD, strlen(EM__CHECKPOINT_OLD)) == 0;
        bool unpublished = em__checkpoint_is_id(name) && strcmp(name, latest_id) > 0;
        if (!unpublished && strncmp(name, ".tmp-", 5) != 0)
            continue;
        if (count == capacity) {
            size_t grown = capacity == 0 ? 4 : 2 * capacity;
            void *more = realloc(leftovers, grown * sizeof(*leftovers));
            if (more == NULL) { /* then this one goes now */
                char path[4400];
                snprintf(path, sizeof(path), "%s/%s", table_dir, name);
                em__checkpoint_remove_dir(path);
                continue;
            }
            leftovers = more;
            capacity = grown;
        }
        snprintf(leftovers[count++], sizeof(*leftovers), "%s", name);
    }
    closedir(d);
    for (size_t i = 0; i < count; i++)
        set_aside(table_dir, leftovers[i]);
    free(leftovers);
    return count;
}

void em__checkpoint_prune(const char *table_dir, const char *dir, const char *table,
                          uint32_t keep, em_checkpoint_removals *removals)
{
    em_checkpoint_info *infos = NULL;
    size_t count = 0;
    em_error err;
    if (em_checkpoint_list(dir, table, &infos, &count, &err) != EM_OK)
        return;
    char oldest[EM_CHECKPOINT_ID_DIGITS + 1] = "";
    if (count > keep)
        oldest_needed(infos, count, keep, oldest);
    size_t aside = 0;
    for (size_t i = 0; i + keep < count; i++)
        if (strcmp(infos[i].id, oldest) < 0) {
            set_aside(table_dir, infos[i].id);
            aside++;
        }
    char latest_id[EM_CHECKPOINT_ID_DIGITS + 1];
    snprintf(latest_id, sizeof(latest_id), "%s", count > 0 ? infos[count - 1].id : "");
    free(infos);
    bool old;
    aside += set_aside_leftovers(table_dir, latest_id, &old);
    if (old || aside > 0)
        remove_old(table_dir, removals);
}
