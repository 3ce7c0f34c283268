/*
 * DESIGN: one table of status codes for the whole project.
 *
 * The codes are gRPC's numbering and travel on the wire as they
 * are, so the engine, the daemon and the clients share a single X-macro table: the
 * enum, the names ("INVALID_ARGUMENT") and the generic messages are all generated from
 * EM_STATUS_MAP below.  Functions return an em_status; when they can fail they also
 * take an em_error out-parameter that receives the status together with a message
 * naming the thing that was wrong and the value that was seen.
 */
#ifndef EMBER_LIB_STATUS_H
#define EMBER_LIB_STATUS_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>

/* X(NAME, code, generic message) */
#define EM_STATUS_MAP(X)                                                    \
    X(OK, 0, "ok")                                                          \
    X(CANCELLED, 1, "the operation was cancelled")                          \
    X(UNKNOWN, 2, "unknown error")                                          \
    X(INVALID_ARGUMENT, 3, "invalid argument")                              \
    X(DEADLINE_EXCEEDED, 4, "the deadline passed before the work finished") \
    X(NOT_FOUND, 5, "not found")                                            \
    X(ALREADY_EXISTS, 6, "already exists")                                  \
    X(PERMISSION_DENIED, 7, "permission denied")                            \
    X(RESOURCE_EXHAUSTED, 8, "a capacity or memory limit was reached")      \
    X(FAILED_PRECONDITION, 9, "the system is not in a state to do this")    \
    X(ABORTED, 10, "aborted")                                               \
    X(OUT_OF_RANGE, 11, "out of range")                                     \
    X(UNIMPLEMENTED, 12, "not implemented by this server")                  \
    X(INTERNAL, 13, "internal error")                                       \
    X(UNAVAILABLE, 14, "the service is unavailable")                        \
    X(DATA_LOSS, 15, "data loss or corruption")                             \
    X(UNAUTHENTICATED, 16, "missing or invalid credentials")

typedef enum em_status {
#define EM__STATUS_ENUM(name, code, message) EM_##name = code,
    EM_STATUS_MAP(EM__STATUS_ENUM)
#undef EM__STATUS_ENUM
} em_status;

/* Number of codes in the table (the highest code + 1). */
#define EM_STATUS_COUNT 17

/* "INVALID_ARGUMENT" for EM_INVALID_ARGUMENT; "STATUS_<n>" style text is never
 * returned: codes outside the table give "UNKNOWN_STATUS". Static strings. */
const char *em_status_name(em_status status);

/* The generic one-line message of a code (static string). */
const char *em_status_message(em_status status);

/* Parses a status name ("NOT_FOUND", case-insensitive) or its decimal code.
 * Returns false when the text names no status. */
bool em_status_parse(const char *text, em_status *out);

/* True when code (for example a number read from the wire) is in the table. */
bool em_status_code_valid(unsigned long code);

#define EM_ERROR_MESSAGE_MAX 512

/* A status with the message that explains it. Caller-allocated; em_error_clear or
 * zero-initialisation makes it OK with an empty message. */
typedef struct em_error {
    em_status status;
    char message[EM_ERROR_MESSAGE_MAX];
} em_error;

void em_error_clear(em_error *err);

/* Records status and a printf-style message in err (err may be NULL) and returns
 * status, so that error paths read `return em_error_set(err, EM_NOT_FOUND, ...)`.
 * Messages longer than EM_ERROR_MESSAGE_MAX - 1 bytes are truncated with "...". */
em_status em_error_set(em_error *err, em_status status, const char *format, ...)
    __attribute__((format(printf, 3, 4)));
em_status em_error_setv(em_error *err, em_status status, const char *format, va_list args)
    __attribute__((format(printf, 3, 0)));

/* Prepends context ("table 'clicks': ") to the message already in err, keeping its
 * status, and returns that status. No-op when err is NULL. */
em_status em_error_prefix(em_error *err, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

/* Copies src into dst (either may be NULL) and returns src's status. */
em_status em_error_copy(em_error *dst, const em_error *src);

#endif
