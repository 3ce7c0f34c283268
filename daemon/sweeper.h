/*
 * DESIGN: the expiry sweep: a thread that removes rows past their age from every table
 * with eviction.max_age_steps set (lib/table/table.h: em_table_expire).
 *
 * Every tick (100 ms) it takes the tables from the catalog and runs slices of 16,384
 * map entries on each, for at most 5 ms of slices per table per tick: each slice holds
 * its table exclusively only while it runs, so requests wait at most one slice, and a
 * table of N rows is swept whole in about N / 16,384 slices.
 */
#ifndef EMBER_DAEMON_SWEEPER_H
#define EMBER_DAEMON_SWEEPER_H

#include "lib/base/log.h"
#include "lib/base/status.h"
#include "lib/table/catalog.h"

typedef struct em_sweeper em_sweeper;

/* Starts the sweep over catalog (borrowed, outlives the sweeper). */
em_status em_sweeper_create(em_catalog *catalog, const em_log *log, em_sweeper **out,
                            em_error *err);

/* Stops the sweep (waits for a slice that runs). NULL is ignored. */
void em_sweeper_destroy(em_sweeper *sweeper);

#endif
