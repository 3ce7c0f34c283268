/*
 * DESIGN: the cluster checkpoint's record, <dir>/cluster.json.
 *
 * A cluster checkpoint is a directory that the client and every server see under the
 * same absolute path (shared storage, or one host). Server i of the saved cluster writes
 * its tables under <dir>/server-<i> (full copies outside its own chain), and the client
 * then writes cluster.json, which names, for each table, every server's part: its path
 * relative to dir, its id and its manifest's checksum. The record is written last
 * (temporary name, fsync, rename, fsync of dir), so a cluster checkpoint without it was
 * never complete. Its last line is "xxh3 <16 hex digits>", the checksum of the text
 * before it, as in a table checkpoint's manifest.json:
 *
 *   {"format": "ember-cluster-checkpoint", "version": 1, "buckets": 4096,
 *    "created_unix_ms": 1795000000000, "servers": ["ps-0:7070", "ps-1:7070"],
 *    "tables": [{"name": "clicks", "parts": [
 *        {"server": 0, "path": "server-0/clicks/00000000000000000001",
 *         "id": "00000000000000000001", "manifest_xxh3": "9f0c...", "rows": 1000}, ...]}]}
 *
 * Restoring sends each server of the new cluster the table's parts as LOAD sources with
 * its place in the new cluster (or a server seeds itself from it at start,
 * checkpoint.restore): it reads only the buckets it now owns.
 */
#ifndef EMBER_LIB_CHECKPOINT_CLUSTER_H
#define EMBER_LIB_CHECKPOINT_CLUSTER_H

#include <cJSON.h>
#include <stddef.h>
#include <stdint.h>

#include "lib/base/status.h"

#define EM_CLUSTER_FILE "cluster.json"
#define EM_CLUSTER_FORMAT_VERSION 1

/* Checks that dir is absolute and holds no cluster checkpoint yet, and creates it.
 * Errors: INVALID_ARGUMENT (a relative dir), ALREADY_EXISTS, INTERNAL naming the step. */
em_status em_cluster_prepare(const char *dir, em_error *err);

/* Writes record (its text, then the checksum line) as <dir>/cluster.json, atomically
 * and durably. Errors: INTERNAL naming the step and the file. */
em_status em_cluster_write(const char *dir, const cJSON *record, em_error *err);

/* Reads and checks <dir>/cluster.json: the checksum line, the format and version, and
 * the shape of every table and part (paths relative, inside dir). Errors: NOT_FOUND,
 * DATA_LOSS naming the file and what is wrong, INVALID_ARGUMENT for another format or
 * version. */
em_status em_cluster_read(const char *dir, cJSON **record, em_error *err);

/* The parts of one table of a record read by em_cluster_read: their absolute paths
 * (dir joined with each part's path) and manifest checksums, in malloc'ed arrays
 * (em_cluster_free_sources). Errors: NOT_FOUND naming the table and the tables the
 * record has. */
em_status em_cluster_sources(const cJSON *record, const char *dir, const char *table,
                              char ***paths, uint64_t **manifests, size_t *count,
                              em_error *err);
void em_cluster_free_sources(char **paths, uint64_t *manifests, size_t count);

#endif
