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
 * Their files are unlinked afterwards, on a thread of their own: unlinking a checkpoint
 * of 1.5 GB took 0.2-0.3 s on a virtual disk (tests/bench/RESULTS.md), which the save's
 * caller has no reason to wait for. The thread works through a descriptor of the
 * table's directory, so a drop that renames that directory meanwhile
 * (em_checkpoint_drop_table) does not make it lose its place. em_checkpoint_wait_removals
 * waits for every such thread, for a daemon going down and for a benchmark timing
 * what comes next.
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

/* Removes a checkpoint's directory (its files are plain files). */
void em__checkpoint_remove_dir(const char *path)
{
    DIR *dir = opendir(path);
    if (dir != NULL) {
        struct dirent *entry;
        while ((entry = readdir(dir)) != NULL) {
            if (strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0)
                continue;
            char file[4400];
            snprintf(file, sizeof(file), "%s/%s", path, entry->d_name);
            unlink(file);
        }
        closedir(dir);
    }
    rmdir(path);
}

/* ---- removal after the answer ------------------------------------------------------------ */

static pthread_mutex_t removals_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t removals_ended = PTHREAD_COND_INITIALIZER;
static unsigned removals_running;

/* Removes the directory name (of plain files) in the directory dir_fd. */
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

static void removal_ended(void)
{
    pthread_mutex_lock(&removals_lock);
    removals_running--;
    pthread_cond_broadcast(&removals_ended);
    pthread_mutex_unlock(&removals_lock);
}

static void *run_removal(void *argument)
{
    int dir_fd = (int)(intptr_t)argument;
    remove_old_dirs(dir_fd);
    close(dir_fd);
    removal_ended();
    return NULL;
}

/* Removes the .old- directories of table_dir on a thread of its own (here, where no
 * thread starts). */
static void start_removal(const char *table_dir)
{
    int dir_fd = open(table_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd < 0)
        return;
    pthread_mutex_lock(&removals_lock);
    removals_running++;
    pthread_mutex_unlock(&removals_lock);
    pthread_attr_t attr;
    pthread_t thread;
    bool started = pthread_attr_init(&attr) == 0;
    if (started) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        started = pthread_create(&thread, &attr, run_removal, (void *)(intptr_t)dir_fd) == 0;
        pthread_attr_destroy(&attr);
    }
    if (!started)
        run_removal((void *)(intptr_t)dir_fd);
}

void em_checkpoint_wait_removals(void)
{
    pthread_mutex_lock(&removals_lock);
    while (removals_running > 0)
        pthread_cond_wait(&removals_ended, &removals_lock);
    pthread_mutex_unlock(&removals_lock);
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

void em__checkpoint_prune(const char *table_dir, const char *dir, const char *table,
                          uint32_t keep)
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
    DIR *d = opendir(table_dir);
    if (d == NULL)
        return;
    /* the leftovers' names first: the directory is not read while it changes */
    char (*leftovers)[NAME_MAX + 1] = NULL;
    size_t leftover_count = 0, leftover_capacity = 0;
    bool old = false;
    struct dirent *entry;
    while ((entry = readdir(d)) != NULL) {
        const char *name = entry->d_name;
        old = old || strncmp(name, EM__CHECKPOINT_OLD, strlen(EM__CHECKPOINT_OLD)) == 0;
        bool unpublished = em__checkpoint_is_id(name) && strcmp(name, latest_id) > 0;
        if (!unpublished && strncmp(name, ".tmp-", 5) != 0)
            continue;
        if (leftover_count == leftover_capacity) {
            size_t grown = leftover_capacity == 0 ? 4 : 2 * leftover_capacity;
            void *more = realloc(leftovers, grown * sizeof(*leftovers));
            if (more == NULL) { /* then this one goes now */
                char path[4400];
                snprintf(path, sizeof(path), "%s/%s", table_dir, name);
                em__checkpoint_remove_dir(path);
                continue;
            }
            leftovers = more;
            leftover_capacity = grown;
        }
        snprintf(leftovers[leftover_count++], sizeof(*leftovers), "%s", name);
    }
    closedir(d);
    for (size_t i = 0; i < leftover_count; i++)
        set_aside(table_dir, leftovers[i]);
    free(leftovers);
    if (old || leftover_count > 0 || aside > 0)
        start_removal(table_dir);
}
