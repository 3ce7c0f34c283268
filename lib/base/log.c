#include "lib/base/log.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* One log line never exceeds this; longer text is cut with "...". */
#define LOG_LINE_MAX 4096

static const struct {
    em_log_level level;
    const char *name;
} level_names[] = {
    {EM_LOG_ERROR, "error"}, {EM_LOG_WARNING, "warning"}, {EM_LOG_NOTICE, "notice"},
    {EM_LOG_INFO, "info"},   {EM_LOG_DEBUG, "debug"},
};

#define LEVEL_COUNT (sizeof(level_names) / sizeof(level_names[0]))

const char *em_log_level_name(em_log_level level)
{
    for (size_t i = 0; i < LEVEL_COUNT; i++)
        if (level_names[i].level == level)
            return level_names[i].name;
    return "unknown";
}

em_status em_log_level_parse(const char *text, em_log_level *out, em_error *err)
{
    for (size_t i = 0; text != NULL && i < LEVEL_COUNT; i++) {
        if (strcasecmp(text, level_names[i].name) == 0) {
            *out = level_names[i].level;
            return EM_OK;
        }
    }
    return em_error_set(err, EM_INVALID_ARGUMENT,
                        "log level '%s' is not one of error, warning, notice, info, debug",
                        text != NULL ? text : "(null)");
}

bool em_log_fd_is_journal(int fd)
{
    const char *stream = getenv("JOURNAL_STREAM");
    if (stream == NULL)
        return false;
    uintmax_t device = 0, inode = 0;
    if (sscanf(stream, "%" SCNuMAX ":%" SCNuMAX, &device, &inode) != 2)
        return false;
    struct stat info;
    if (fstat(fd, &info) != 0)
        return false;
    return (uintmax_t)info.st_dev == device && (uintmax_t)info.st_ino == inode;
}

void em_log_init(em_log *log, em_log_level level, int fd)
{
    atomic_init(&log->level, (int)level);
    log->fd = fd;
    log->journal = em_log_fd_is_journal(fd);
    atomic_init(&log->logfmt, false);
}

void em_log_set_logfmt(em_log *log, bool logfmt)
{
    atomic_store_explicit(&log->logfmt, logfmt, memory_order_relaxed);
}

void em_log_set_level(em_log *log, em_log_level level)
{
    atomic_store_explicit(&log->level, (int)level, memory_order_relaxed);
}

bool em_log_enabled(const em_log *log, em_log_level level)
{
    return log != NULL &&
           (int)level <= atomic_load_explicit(&((em_log *)log)->level, memory_order_relaxed);
}

/* "2026-11-21T10:04:05.123Z" */
static int format_timestamp(char *buffer, size_t capacity)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    struct tm parts;
    gmtime_r(&now.tv_sec, &parts);
    char seconds[32];
    strftime(seconds, sizeof(seconds), "%Y-%m-%dT%H:%M:%S", &parts);
    unsigned milliseconds = (unsigned)(now.tv_nsec / 1000000L) % 1000u;
    return snprintf(buffer, capacity, "%.20s.%03uZ", seconds, milliseconds);
}

static bool is_logfmt(const em_log *log)
{
    return atomic_load_explicit(&((em_log *)log)->logfmt, memory_order_relaxed);
}

static int format_prefix(const em_log *log, em_log_level level, char *buffer, size_t capacity)
{
    bool logfmt = is_logfmt(log);
    if (log->journal)
        return logfmt ? snprintf(buffer, capacity, "<%d>level=%s msg=\"", (int)level,
                                 em_log_level_name(level))
                      : snprintf(buffer, capacity, "<%d>", (int)level);
    char stamp[40];
    format_timestamp(stamp, sizeof(stamp));
    return logfmt ? snprintf(buffer, capacity, "ts=%s level=%s msg=\"", stamp,
                             em_log_level_name(level))
                  : snprintf(buffer, capacity, "%s %s ", stamp, em_log_level_name(level));
}

/* The message as a logfmt quoted value: backslash, quote and newline escaped, then the
 * closing quote; returns the new length within capacity. */
static size_t quote_message(char *line, size_t start, size_t end, size_t capacity)
{
    char escaped[LOG_LINE_MAX];
    size_t used = 0;
    for (size_t i = start; i < end && used + 3 < sizeof(escaped); i++) {
        char c = line[i];
        if (c == '"' || c == '\\' || c == '\n') {
            escaped[used++] = '\\';
            c = c == '\n' ? 'n' : c;
        }
        escaped[used++] = c;
    }
    size_t room = capacity - start - 3; /* quote, newline, spare */
    if (used > room) {
        used = room;
        size_t backslashes = 0; /* a cut escape would escape the closing quote */
        while (backslashes < used && escaped[used - 1 - backslashes] == '\\')
            backslashes++;
        used -= backslashes % 2;
    }
    memcpy(line + start, escaped, used);
    line[start + used] = '"';
    return start + used + 1;
}

static void write_all(int fd, const char *data, size_t length)
{
    while (length > 0) {
        ssize_t written = write(fd, data, length);
        if (written < 0 && errno == EINTR)
            continue;
        if (written <= 0)
            return; /* nowhere left to report a logging failure */
        data += written;
        length -= (size_t)written;
    }
}

void em_log_write(const em_log *log, em_log_level level, const char *format, ...)
{
    if (!em_log_enabled(log, level))
        return;
    char line[LOG_LINE_MAX];
    int prefix = format_prefix(log, level, line, sizeof(line));
    if (prefix < 0)
        return;
    va_list args;
    va_start(args, format);
    int body = vsnprintf(line + prefix, sizeof(line) - (size_t)prefix - 1, format, args);
    va_end(args);
    if (body < 0)
        return;
    size_t length = (size_t)prefix + (size_t)body;
    if (length > sizeof(line) - 2) {
        length = sizeof(line) - 2;
        memcpy(line + length - 3, "...", 3);
    }
    if (is_logfmt(log))
        length = quote_message(line, (size_t)prefix, length, sizeof(line));
    line[length++] = '\n';
    write_all(log->fd, line, length);
}
