/*
 * DESIGN: JSON views of the admin responses.
 *
 * ember's ops tooling speaks JSON (emberctl --json, the Python binding), while the wire
 * speaks protobuf. Rather than one hand-written converter per message, a message is
 * walked through its protobuf-c descriptor: every field appears under its .proto name,
 * so the JSON follows ember.proto as it grows. Only TableInfo is shaped by hand: its
 * config_json string becomes a parsed "config" object.
 *
 * Numbers are JSON numbers (doubles: exact up to 2^53, plenty for counters and sizes),
 * enums their value names, bytes lowercase hex, an absent sub-message null.
 */
#ifndef EMBER_CLIENTS_CLIENT_JSON_H
#define EMBER_CLIENTS_CLIENT_JSON_H

#include <cJSON.h>

#include "proto/ember.pb-c.h"

/* Every field of message, under its .proto name. NULL when out of memory. */
cJSON *em__client_json_from_message(const ProtobufCMessage *message);

/* {name, dim, capacity, shards, optimizer, rows, config}: config is config_json
 * parsed (its text when it does not parse, null when empty). NULL when out of memory. */
cJSON *em__client_json_table_info(const Ember__TableInfo *info);

/* {server: {...}, tables: [...], pools: [...]}, the StatsResponse fields. */
cJSON *em__client_json_stats(const Ember__StatsResponse *stats);

#endif
