/*
 * DESIGN: leveled logging to a file descriptor (stderr in the daemon).
 *
 * There is no global logger: whoever owns a component hands it an em_log (or NULL for
 * silence). When the descriptor is connected to the systemd journal (the JOURNAL_STREAM
 * variable names its device and inode) each line starts with the syslog priority
 * prefix "<N>" so journald files it at the right level and adds its own timestamp;
 * otherwise lines carry an ISO-8601 UTC timestamp and the level name. Every line is
 * produced by one write(2), so lines from several threads never interleave.
 */
#ifndef EMBER_LIB_LOG_H
#define EMBER_LIB_LOG_H

#include <stdatomic.h>
#include <stdbool.h>

#include "lib/base/status.h"

/* Values are the syslog priorities the journal prefix uses. */
typedef enum em_log_level {
    EM_LOG_ERROR = 3,
    EM_LOG_WARNING = 4,
    EM_LOG_NOTICE = 5,
    EM_LOG_INFO = 6,
    EM_LOG_DEBUG = 7,
} em_log_level;

typedef struct em_log {
    _Atomic int level; /* em_log_level: lines above this priority number are dropped */
    int fd;
    bool journal; /* write "<N>" prefixes instead of timestamps */
    _Atomic bool logfmt; /* ts=... level=... msg="..." instead of plain text */
} em_log;

/* Initialises a caller-allocated logger writing to fd; detects the journal. */
void em_log_init(em_log *log, em_log_level level, int fd);

/* Changes the level while other threads log (a reload). Thread-safe. */
void em_log_set_level(em_log *log, em_log_level level);

/* Lines as logfmt (`ts=2026-11-21T10:04:05.123Z level=info msg="..."`, under the journal
 * `<6>level=info msg="..."`) or as plain text (the default). Thread-safe. */
void em_log_set_logfmt(em_log *log, bool logfmt);

/* True when fd is the stream JOURNAL_STREAM names (for tests and the daemon). */
bool em_log_fd_is_journal(int fd);

/* "error", "warning", "notice", "info", "debug". Static string. */
const char *em_log_level_name(em_log_level level);

/* Parses a level name; the error names the text seen and the accepted names. */
em_status em_log_level_parse(const char *text, em_log_level *out, em_error *err);

/* Writes one line (a trailing newline is added). log may be NULL: nothing is written.
 * Thread-safe. */
void em_log_write(const em_log *log, em_log_level level, const char *format, ...)
    __attribute__((format(printf, 3, 4)));

bool em_log_enabled(const em_log *log, em_log_level level);

#define em_log_error(log, ...) em_log_write((log), EM_LOG_ERROR, __VA_ARGS__)
#define em_log_warning(log, ...) em_log_write((log), EM_LOG_WARNING, __VA_ARGS__)
#define em_log_notice(log, ...) em_log_write((log), EM_LOG_NOTICE, __VA_ARGS__)
#define em_log_info(log, ...) em_log_write((log), EM_LOG_INFO, __VA_ARGS__)
#define em_log_debug(log, ...) em_log_write((log), EM_LOG_DEBUG, __VA_ARGS__)

#endif
