/*
 * DESIGN: the methods emberd serves, declared once.
 *
 * EM_METHODS has one row per method of proto/ember.proto's Method enum (a unit test
 * checks that every value has exactly one row). Each row says:
 *
 *   METHOD    the wire value, EMBER__METHOD__<METHOD>
 *   name      the handler (em_handle_<name>, daemon/handlers.c) and the message types
 *             (ember__<name>_request / ember__<name>_response)
 *   listener  ANY: served on the data and the admin listener; ADMIN: admin listener only
 *   access    OPEN: no token; DATA: the data token when one is configured (or the admin
 *             token on the admin listener); ADMIN: the admin token
 *   ordering  LOOP: cheap and lock-free, answered on the loop thread; READ: runs on a
 *             worker alongside the connection's other reads; WRITE: runs on a worker
 *             alone in the connection's order (daemon/connection.h)
 *   payload   NONE: the frame carries no attachment; CSR: it carries a CSR batch, and
 *             em_admit_<name> (daemon/handlers.c) checks its length and says how large
 *             the answer will be once the body is decoded, before the attachment is
 *             read or anything is allocated for it
 *
 * The dispatch table, the handler declarations and the per-method counter slots are
 * generated from it, so adding a method is one row here, one handler, and its messages
 * in the .proto.
 */
#ifndef EMBER_DAEMON_METHODS_H
#define EMBER_DAEMON_METHODS_H

#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lib/base/status.h"
#include "proto/ember.pb-c.h"

/* X(METHOD, name, listener, access, ordering, payload) */
#define EM_METHODS(X)                                                                         \
    X(PULL, pull, ANY, DATA, READ, CSR)                                                       \
    X(PUSH, push, ANY, DATA, WRITE, CSR)                                                      \
    X(PING, ping, ANY, OPEN, LOOP, NONE)                                                      \
    X(HEALTH, health, ANY, OPEN, LOOP, NONE)                                                  \
    X(CREATE_TABLE, create_table, ADMIN, ADMIN, WRITE, NONE)                                  \
    X(DROP_TABLE, drop_table, ADMIN, ADMIN, WRITE, NONE)                                      \
    X(LIST_TABLES, list_tables, ADMIN, ADMIN, READ, NONE)                                     \
    X(STATS, stats, ADMIN, ADMIN, READ, NONE)                                                 \
    X(SAVE, save, ADMIN, ADMIN, READ, NONE)                                                   \
    X(LOAD, load, ADMIN, ADMIN, WRITE, NONE)                                                  \
    X(DRAIN, drain, ADMIN, ADMIN, LOOP, NONE)                                                 \
    X(UNDRAIN, undrain, ADMIN, ADMIN, LOOP, NONE)                                             \
    X(RELOAD, reload, ADMIN, ADMIN, LOOP, NONE)                                               \
    X(SLOWLOG, slowlog, ADMIN, ADMIN, LOOP, NONE)                                             \
    X(ERASE, erase, ADMIN, ADMIN, WRITE, NONE)                                                \
    X(EVICTED, evicted, ADMIN, ADMIN, READ, NONE)                                             \
    X(CHECKPOINTS, checkpoints, ADMIN, ADMIN, READ, NONE)

typedef enum em_method_listener {
    EM_METHOD_LISTENER_ANY,
    EM_METHOD_LISTENER_ADMIN,
} em_method_listener;

typedef enum em_method_access {
    EM_METHOD_ACCESS_OPEN,
    EM_METHOD_ACCESS_DATA,
    EM_METHOD_ACCESS_ADMIN,
} em_method_access;

typedef enum em_method_ordering {
    EM_METHOD_ORDERING_LOOP,
    EM_METHOD_ORDERING_READ,
    EM_METHOD_ORDERING_WRITE,
} em_method_ordering;

/* Slots: indices of the table below, for per-method counters. */
typedef enum em_method_slot {
#define EM_METHOD_SLOT(METHOD, name, listener, access, ordering, payload) EM_METHOD_SLOT_##METHOD,
    EM_METHODS(EM_METHOD_SLOT)
#undef EM_METHOD_SLOT
    EM_METHOD_COUNT
} em_method_slot;

typedef enum em_method_payload {
    EM_METHOD_PAYLOAD_NONE,
    EM_METHOD_PAYLOAD_CSR,
} em_method_payload;

typedef struct em_request em_request;
typedef em_status (*em_method_handler)(em_request *request, em_error *err);
/* Checks a decoded request against the attachment length its frame announced and
 * sets *answer_bytes to the most its answer will hold (loop thread). */
typedef em_status (*em_method_admit)(em_request *request, uint64_t attachment_length,
                                     uint64_t *answer_bytes, em_error *err);

typedef struct em_method_info {
    Ember__Method method;
    const char *name; /* "PULL" */
    em_method_listener listener;
    em_method_access access;
    em_method_ordering ordering;
    em_method_payload payload;
    em_method_admit admit; /* CSR payloads only */
    const ProtobufCMessageDescriptor *request;
    const ProtobufCMessageDescriptor *response;
    em_method_handler handler;
} em_method_info;

/* The table, EM_METHOD_COUNT rows in EM_METHODS order. */
extern const em_method_info em_methods[EM_METHOD_COUNT];

/* The row of a wire method value, or NULL when this server does not serve it. */
const em_method_info *em_method_find(int method);

/* Handlers (daemon/handlers.c): run on a worker (or the loop for LOOP methods), fill in
 * the response with em_request_respond, return an error naming what was wrong. */
#define EM_METHOD_HANDLER(METHOD, name, listener, access, ordering, payload)                 \
    em_status em_handle_##name(em_request *request, em_error *err);
EM_METHODS(EM_METHOD_HANDLER)
#undef EM_METHOD_HANDLER

/* Admission checks of the methods whose payload is CSR (daemon/handlers.c). */
#define EM_METHOD_ADMIT_NONE(name) NULL
#define EM_METHOD_ADMIT_CSR(name) em_admit_##name
#define EM_METHOD_ADMIT_DECLARE_NONE(name)
#define EM_METHOD_ADMIT_DECLARE_CSR(name)                                                     \
    em_status em_admit_##name(em_request *request, uint64_t attachment_length,                \
                              uint64_t *answer_bytes, em_error *err);
#define EM_METHOD_ADMIT_DECLARE(METHOD, name, listener, access, ordering, payload)            \
    EM_METHOD_ADMIT_DECLARE_##payload(name)
EM_METHODS(EM_METHOD_ADMIT_DECLARE)
#undef EM_METHOD_ADMIT_DECLARE

#endif
