#include "lib/base/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

typedef struct status_entry {
    const char *name;
    const char *message;
} status_entry;

static const status_entry status_table[EM_STATUS_COUNT] = {
#define EM__STATUS_ENTRY(name, code, message) [code] = {#name, message},
    EM_STATUS_MAP(EM__STATUS_ENTRY)
#undef EM__STATUS_ENTRY
};

/* The table must be dense: every code below EM_STATUS_COUNT has an entry. */
#define EM__STATUS_COUNT_ONE(name, code, message) +1
_Static_assert(0 EM_STATUS_MAP(EM__STATUS_COUNT_ONE) == EM_STATUS_COUNT,
               "EM_STATUS_COUNT must equal the number of entries in EM_STATUS_MAP");
#undef EM__STATUS_COUNT_ONE

bool em_status_code_valid(unsigned long code)
{
    return code < EM_STATUS_COUNT;
}

const char *em_status_name(em_status status)
{
    if (!em_status_code_valid((unsigned long)status))
        return "UNKNOWN_STATUS";
    return status_table[status].name;
}

const char *em_status_message(em_status status)
{
    if (!em_status_code_valid((unsigned long)status))
        return "status code outside the table";
    return status_table[status].message;
}

bool em_status_parse(const char *text, em_status *out)
{
    if (text == NULL || *text == '\0')
        return false;
    for (int code = 0; code < EM_STATUS_COUNT; code++) {
        if (strcasecmp(text, status_table[code].name) == 0) {
            *out = (em_status)code;
            return true;
        }
    }
    char *end = NULL;
    unsigned long code = strtoul(text, &end, 10);
    if (*end != '\0' || !em_status_code_valid(code))
        return false;
    *out = (em_status)code;
    return true;
}

void em_error_clear(em_error *err)
{
    if (err == NULL)
        return;
    err->status = EM_OK;
    err->message[0] = '\0';
}

/* Marks a message that did not fit, so a reader knows text is missing. */
static void mark_truncated(char *message, size_t capacity)
{
    static const char ellipsis[] = "...";
    memcpy(message + capacity - sizeof(ellipsis), ellipsis, sizeof(ellipsis));
}

em_status em_error_setv(em_error *err, em_status status, const char *format, va_list args)
{
    if (err == NULL)
        return status;
    err->status = status;
    int written = vsnprintf(err->message, sizeof(err->message), format, args);
    if (written < 0)
        snprintf(err->message, sizeof(err->message), "%s", em_status_message(status));
    else if ((size_t)written >= sizeof(err->message))
        mark_truncated(err->message, sizeof(err->message));
    return status;
}

em_status em_error_set(em_error *err, em_status status, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    em_status result = em_error_setv(err, status, format, args);
    va_end(args);
    return result;
}

em_status em_error_prefix(em_error *err, const char *format, ...)
{
    if (err == NULL)
        return EM_OK;
    char prefix[EM_ERROR_MESSAGE_MAX];
    va_list args;
    va_start(args, format);
    int length = vsnprintf(prefix, sizeof(prefix), format, args);
    va_end(args);
    if (length < 0)
        return err->status;
    char combined[EM_ERROR_MESSAGE_MAX];
    int written = snprintf(combined, sizeof(combined), "%s%s", prefix, err->message);
    memcpy(err->message, combined, sizeof(combined));
    if (written >= 0 && (size_t)written >= sizeof(combined))
        mark_truncated(err->message, sizeof(err->message));
    return err->status;
}

em_status em_error_copy(em_error *dst, const em_error *src)
{
    if (src == NULL)
        return EM_OK;
    if (dst != NULL && dst != src)
        *dst = *src;
    return src->status;
}
