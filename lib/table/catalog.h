/*
 * DESIGN: the set of tables a server holds, by name.
 *
 * Requests look a table up by name and hold a reference while they run; dropping a
 * table removes its name at once (later lookups get NOT_FOUND) and destroys it when the
 * last request using it releases its reference. So a drop never frees a table under a
 * running pull, and the catalog lock is only ever held for a name lookup or insert:
 * creating a table's shards and destroying them happen outside it.
 */
#ifndef EMBER_LIB_CATALOG_H
#define EMBER_LIB_CATALOG_H

#include <stddef.h>
#include <stdint.h>

#include "lib/device/backend.h"
#include "lib/base/status.h"
#include "lib/table/table.h"

typedef struct em_catalog em_catalog;

/* The backend is borrowed and must outlive the catalog. */
em_status em_catalog_create(em_backend *backend, em_catalog **out, em_error *err);

/* Destroys every table. No reference may be held. NULL is ignored. */
void em_catalog_destroy(em_catalog *catalog);

/* Creates a table and adds it. *out (nullable) gets a reference the caller releases.
 * Errors: ALREADY_EXISTS naming the table, and em_table_create's errors. Thread-safe. */
em_status em_catalog_create_table(em_catalog *catalog, const em_table_config *config,
                                  em_table **out, em_error *err);

/* Adds a table built elsewhere (a checkpoint load), which the catalog then owns; on an
 * error (ALREADY_EXISTS naming it) the table is destroyed. Thread-safe. */
em_status em_catalog_add(em_catalog *catalog, em_table *table, em_error *err);

/* Adds a table built elsewhere in place of the table of its name, if any, in one step:
 * lookups find the old table or the new one, never neither; requests holding the old one
 * finish on it. On an error the new table is destroyed and the old one stays. */
em_status em_catalog_replace(em_catalog *catalog, em_table *table, em_error *err);

/* A reference to the table called name. Errors: NOT_FOUND ("no table 'x'; tables: a, b").
 * Thread-safe. */
em_status em_catalog_acquire(em_catalog *catalog, const char *name, em_table **out,
                             em_error *err);

/* Releases a reference from create_table, acquire or list. Thread-safe. */
void em_catalog_release(em_catalog *catalog, em_table *table);

/* Removes the table's name and marks it dropped (em_table_mark_dropped, as replace marks
 * the table it replaces); the table goes when its last reference does. Errors:
 * NOT_FOUND. Thread-safe. */
em_status em_catalog_drop(em_catalog *catalog, const char *name, em_error *err);

/* References to every table, sorted by name, in a malloc'ed array (caller releases each
 * and frees the array). Thread-safe. */
em_status em_catalog_list(em_catalog *catalog, em_table ***tables, size_t *count, em_error *err);

size_t em_catalog_count(em_catalog *catalog);

em_backend *em_catalog_backend(const em_catalog *catalog);

#endif
