#include "lib/table/catalog.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* Names listed in a NOT_FOUND message at most. */
#define NAMES_IN_MESSAGE 8

typedef struct entry {
    em_table *table;
    uint32_t references; /* the catalog's own (while named) + requests' */
    bool named;
} entry;

struct em_catalog {
    pthread_mutex_t lock;
    em_backend *backend;
    entry **entries; /* named tables and dropped ones still referenced, in no order */
    size_t count, capacity;
};

em_status em_catalog_create(em_backend *backend, em_catalog **out, em_error *err)
{
    em_catalog *catalog = calloc(1, sizeof(*catalog));
    if (catalog == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "catalog: out of memory");
    pthread_mutex_init(&catalog->lock, NULL);
    catalog->backend = backend;
    *out = catalog;
    return EM_OK;
}

void em_catalog_destroy(em_catalog *catalog)
{
    if (catalog == NULL)
        return;
    for (size_t i = 0; i < catalog->count; i++) {
        em_table_destroy(catalog->entries[i]->table);
        free(catalog->entries[i]);
    }
    free(catalog->entries);
    pthread_mutex_destroy(&catalog->lock);
    free(catalog);
}

em_backend *em_catalog_backend(const em_catalog *catalog)
{
    return catalog->backend;
}

static entry *find_named(const em_catalog *catalog, const char *name)
{
    for (size_t i = 0; i < catalog->count; i++)
        if (catalog->entries[i]->named && strcmp(em_table_name(catalog->entries[i]->table), name) == 0)
            return catalog->entries[i];
    return NULL;
}

static entry *find_table(const em_catalog *catalog, const em_table *table, size_t *index)
{
    for (size_t i = 0; i < catalog->count; i++) {
        if (catalog->entries[i]->table == table) {
            *index = i;
            return catalog->entries[i];
        }
    }
    return NULL;
}

static void describe_names(const em_catalog *catalog, char *buffer, size_t capacity)
{
    size_t used = 0, listed = 0, named = 0;
    buffer[0] = '\0';
    for (size_t i = 0; i < catalog->count; i++) {
        if (!catalog->entries[i]->named)
            continue;
        named++;
        if (listed == NAMES_IN_MESSAGE || used >= capacity)
            continue;
        int written = snprintf(buffer + used, capacity - used, "%s%s", listed ? ", " : "",
                               em_table_name(catalog->entries[i]->table));
        if (written > 0)
            used += (size_t)written;
        listed++;
    }
    if (named == 0)
        snprintf(buffer, capacity, "none");
    else if (named > listed && used < capacity)
        snprintf(buffer + used, capacity - used, ", and %zu more", named - listed);
}

static em_status not_found(const em_catalog *catalog, const char *name, em_error *err)
{
    char names[200];
    describe_names(catalog, names, sizeof(names));
    return em_error_set(err, EM_NOT_FOUND, "no table '%s' (tables: %s)", name, names);
}

static em_status append_entry(em_catalog *catalog, entry *added, em_error *err)
{
    if (catalog->count == catalog->capacity) {
        size_t capacity = catalog->capacity == 0 ? 8 : catalog->capacity * 2;
        entry **grown = realloc(catalog->entries, capacity * sizeof(*grown));
        if (grown == NULL)
            return em_error_set(err, EM_RESOURCE_EXHAUSTED, "catalog: out of memory");
        catalog->entries = grown;
        catalog->capacity = capacity;
    }
    catalog->entries[catalog->count++] = added;
    return EM_OK;
}

static entry *unreference(em_catalog *catalog, entry *e, size_t index);

/* Names table in the catalog with the given references (the catalog's and maybe the
 * caller's), in place of the table of that name when replace; on an error the table is
 * destroyed. */
static em_status adopt(em_catalog *catalog, em_table *table, unsigned references, bool replace,
                       em_error *err)
{
    const em_table_config *config = em_table_get_config(table);
    em_status status = EM_OK;
    entry *added = calloc(1, sizeof(*added)), *last = NULL;
    if (added == NULL) {
        em_table_destroy(table);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "catalog: out of memory");
    }
    *added = (entry){.table = table, .references = references, .named = true};
    pthread_mutex_lock(&catalog->lock);
    /* Another creator may have taken the name while the shards were being set up. */
    entry *old = find_named(catalog, config->name);
    if (old != NULL && !replace)
        status = em_error_set(err, EM_ALREADY_EXISTS, "table '%s' already exists", config->name);
    else
        status = append_entry(catalog, added, err);
    if (status == EM_OK && old != NULL) {
        /* one step under the lock: later lookups find the new table; requests holding
         * the old one finish on it, and it goes with their last reference */
        size_t index = 0;
        old->named = false;
        em_table_mark_dropped(old->table); /* a save still holding it must not write it */
        find_table(catalog, old->table, &index);
        last = unreference(catalog, old, index);
    }
    pthread_mutex_unlock(&catalog->lock);
    if (last != NULL) {
        em_table_destroy(last->table);
        free(last);
    }
    if (status != EM_OK) {
        em_table_destroy(table);
        free(added);
        return status;
    }
    return EM_OK;
}

em_status em_catalog_create_table(em_catalog *catalog, const em_table_config *config,
                                  em_table **out, em_error *err)
{
    pthread_mutex_lock(&catalog->lock);
    bool taken = find_named(catalog, config->name) != NULL;
    pthread_mutex_unlock(&catalog->lock);
    if (taken)
        return em_error_set(err, EM_ALREADY_EXISTS, "table '%s' already exists", config->name);
    em_table *table = NULL;
    em_status status = em_table_create(catalog->backend, config, &table, err);
    if (status != EM_OK)
        return status;
    status = adopt(catalog, table, out != NULL ? 2 : 1, false, err);
    if (status == EM_OK && out != NULL)
        *out = table;
    return status;
}

em_status em_catalog_add(em_catalog *catalog, em_table *table, em_error *err)
{
    return adopt(catalog, table, 1, false, err);
}

em_status em_catalog_replace(em_catalog *catalog, em_table *table, em_error *err)
{
    return adopt(catalog, table, 1, true, err);
}

em_status em_catalog_acquire(em_catalog *catalog, const char *name, em_table **out,
                             em_error *err)
{
    pthread_mutex_lock(&catalog->lock);
    entry *found = find_named(catalog, name);
    em_status status = EM_OK;
    if (found == NULL) {
        status = not_found(catalog, name, err);
    } else {
        found->references++;
        *out = found->table;
    }
    pthread_mutex_unlock(&catalog->lock);
    return status;
}

/* Drops one reference of entries[index]; returns the entry to destroy, if it was the
 * last. Called with the lock held. */
static entry *unreference(em_catalog *catalog, entry *e, size_t index)
{
    if (--e->references > 0)
        return NULL;
    catalog->entries[index] = catalog->entries[--catalog->count];
    return e;
}

void em_catalog_release(em_catalog *catalog, em_table *table)
{
    size_t index = 0;
    pthread_mutex_lock(&catalog->lock);
    entry *e = find_table(catalog, table, &index);
    entry *last = e != NULL ? unreference(catalog, e, index) : NULL;
    pthread_mutex_unlock(&catalog->lock);
    if (last != NULL) {
        em_table_destroy(last->table);
        free(last);
    }
}

em_status em_catalog_drop(em_catalog *catalog, const char *name, em_error *err)
{
    size_t index = 0;
    entry *last = NULL;
    em_status status = EM_OK;
    pthread_mutex_lock(&catalog->lock);
    entry *e = find_named(catalog, name);
    if (e == NULL) {
        status = not_found(catalog, name, err);
    } else {
        e->named = false;
        em_table_mark_dropped(e->table);
        find_table(catalog, e->table, &index);
        last = unreference(catalog, e, index);
    }
    pthread_mutex_unlock(&catalog->lock);
    if (last != NULL) {
        em_table_destroy(last->table);
        free(last);
    }
    return status;
}

static int compare_names(const void *a, const void *b)
{
    return strcmp(em_table_name(*(em_table *const *)a), em_table_name(*(em_table *const *)b));
}

em_status em_catalog_list(em_catalog *catalog, em_table ***tables, size_t *count, em_error *err)
{
    pthread_mutex_lock(&catalog->lock);
    em_table **list = malloc((catalog->count + 1) * sizeof(*list));
    size_t listed = 0;
    for (size_t i = 0; list != NULL && i < catalog->count; i++) {
        if (!catalog->entries[i]->named)
            continue;
        catalog->entries[i]->references++;
        list[listed++] = catalog->entries[i]->table;
    }
    pthread_mutex_unlock(&catalog->lock);
    if (list == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "catalog: out of memory");
    qsort(list, listed, sizeof(*list), compare_names);
    *tables = list;
    *count = listed;
    return EM_OK;
}

size_t em_catalog_count(em_catalog *catalog)
{
    size_t named = 0;
    pthread_mutex_lock(&catalog->lock);
    for (size_t i = 0; i < catalog->count; i++)
        named += catalog->entries[i]->named;
    pthread_mutex_unlock(&catalog->lock);
    return named;
}
