#include "lib/base/failpoint.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ENV_NAME "EMBER_FAILPOINTS"
#define FILE_ENV_NAME "EMBER_FAILPOINTS_FILE"
#define SPEC_MAX 1024

typedef struct failpoint_state {
    _Atomic int64_t remaining; /* 0: disarmed; -1: every hit; n: the next n hits */
    _Atomic uint64_t value;
} failpoint_state;

static failpoint_state states[EM_FAILPOINT_COUNT];

static const char *const names[EM_FAILPOINT_COUNT] = {
#define FAILPOINT_NAME(ID, name, help) #name,
    EM_FAILPOINTS(FAILPOINT_NAME)
#undef FAILPOINT_NAME
};

const char *em_failpoint_name(em_failpoint failpoint)
{
    return failpoint < EM_FAILPOINT_COUNT ? names[failpoint] : "unknown";
}

bool em_failpoint_hit(em_failpoint failpoint, uint64_t *value)
{
    failpoint_state *state = &states[failpoint];
    int64_t remaining = atomic_load_explicit(&state->remaining, memory_order_relaxed);
    for (;;) {
        if (remaining == 0)
            return false;
        if (remaining < 0)
            break;
        if (atomic_compare_exchange_weak(&state->remaining, &remaining, remaining - 1))
            break;
    }
    if (value != NULL)
        *value = atomic_load_explicit(&state->value, memory_order_relaxed);
    return true;
}

bool em_failpoint_armed(em_failpoint failpoint, uint64_t *value)
{
    failpoint_state *state = &states[failpoint];
    if (atomic_load_explicit(&state->remaining, memory_order_relaxed) == 0)
        return false;
    if (value != NULL)
        *value = atomic_load_explicit(&state->value, memory_order_relaxed);
    return true;
}

typedef struct parsed_item {
    em_failpoint failpoint;
    uint64_t value;
    int64_t count;
} parsed_item;

static em_status parse_number(const char *text, const char *item, const char *what,
                              uint64_t *out, em_error *err)
{
    char *end = NULL;
    unsigned long long number = strtoull(text, &end, 10);
    if (text[0] < '0' || text[0] > '9' || *end != '\0')
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "failpoint '%s': the %s must be a decimal number", item, what);
    *out = number;
    return EM_OK;
}

static em_status parse_item(char *item, parsed_item *out, em_error *err)
{
    char copy[SPEC_MAX];
    snprintf(copy, sizeof(copy), "%s", item);
    *out = (parsed_item){.failpoint = EM_FAILPOINT_COUNT, .count = -1};
    char *count = strchr(item, '*');
    if (count != NULL) {
        *count++ = '\0';
        uint64_t number = 0;
        em_status status = parse_number(count, copy, "count after '*'", &number, err);
        if (status != EM_OK)
            return status;
        if (number == 0 || number > INT64_MAX)
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "failpoint '%s': the count must be at least 1", copy);
        out->count = (int64_t)number;
    }
    char *value = strchr(item, '=');
    if (value != NULL) {
        *value++ = '\0';
        em_status status = parse_number(value, copy, "value after '='", &out->value, err);
        if (status != EM_OK)
            return status;
    }
    for (int i = 0; i < EM_FAILPOINT_COUNT; i++)
        if (strcmp(item, names[i]) == 0)
            out->failpoint = (em_failpoint)i;
    if (out->failpoint == EM_FAILPOINT_COUNT) {
        char known[256] = "";
        for (int i = 0; i < EM_FAILPOINT_COUNT; i++)
            snprintf(known + strlen(known), sizeof(known) - strlen(known), "%s%s",
                     i > 0 ? ", " : "", names[i]);
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "failpoint '%s': unknown name (known: %s)", copy, known);
    }
    return EM_OK;
}

em_status em_failpoints_arm(const char *spec, em_error *err)
{
    if (strlen(spec) >= SPEC_MAX)
        return em_error_set(err, EM_INVALID_ARGUMENT, "failpoints: the list is longer than %d",
                            SPEC_MAX - 1);
    char text[SPEC_MAX];
    snprintf(text, sizeof(text), "%s", spec);
    parsed_item items[EM_FAILPOINT_COUNT * 4];
    size_t count = 0;
    char *save = NULL;
    for (char *item = strtok_r(text, ", ", &save); item != NULL;
         item = strtok_r(NULL, ", ", &save)) {
        if (count == sizeof(items) / sizeof(items[0]))
            return em_error_set(err, EM_INVALID_ARGUMENT, "failpoints: too many items");
        em_status status = parse_item(item, &items[count], err);
        if (status != EM_OK)
            return status;
        count++;
    }
    for (size_t i = 0; i < count; i++) {
        failpoint_state *state = &states[items[i].failpoint];
        atomic_store(&state->value, items[i].value);
        atomic_store(&state->remaining, items[i].count);
    }
    return EM_OK;
}

/* The list in the file FILE_ENV_NAME names, read whole (a test rewrites it and sends
 * SIGHUP to arm failpoints in a running daemon). */
static em_status arm_from_file(const char *path, em_error *err)
{
    FILE *file = fopen(path, "r");
    if (file == NULL)
        return em_error_set(err, EM_NOT_FOUND, "%s: cannot read '%s'", FILE_ENV_NAME, path);
    char spec[SPEC_MAX];
    size_t length = fread(spec, 1, sizeof(spec) - 1, file);
    fclose(file);
    spec[length] = '\0';
    for (char *c = spec; *c != '\0'; c++)
        if (*c == '\n' || *c == '\r' || *c == '\t')
            *c = ' ';
    em_status status = em_failpoints_arm(spec, err);
    if (status != EM_OK)
        return em_error_prefix(err, "%s '%s': ", FILE_ENV_NAME, path);
    return EM_OK;
}

em_status em_failpoints_arm_from_env(em_error *err)
{
    const char *spec = getenv(ENV_NAME);
    if (spec != NULL && spec[0] != '\0') {
        em_status status = em_failpoints_arm(spec, err);
        if (status != EM_OK)
            return em_error_prefix(err, "%s: ", ENV_NAME);
    }
    const char *path = getenv(FILE_ENV_NAME);
    if (path != NULL && path[0] != '\0')
        return arm_from_file(path, err);
    return EM_OK;
}

void em_failpoints_disarm_all(void)
{
    for (int i = 0; i < EM_FAILPOINT_COUNT; i++)
        atomic_store(&states[i].remaining, 0);
}

void em_failpoints_describe(char *out, size_t capacity)
{
    size_t used = 0;
    out[0] = '\0';
    for (int i = 0; i < EM_FAILPOINT_COUNT && used < capacity; i++) {
        int64_t remaining = atomic_load(&states[i].remaining);
        if (remaining == 0)
            continue;
        uint64_t value = atomic_load(&states[i].value);
        char count[32] = "";
        if (remaining > 0)
            snprintf(count, sizeof(count), "*%" PRId64, remaining);
        int written = snprintf(out + used, capacity - used, "%s%s=%" PRIu64 "%s",
                               used > 0 ? ", " : "", names[i], value, count);
        if (written < 0)
            break;
        used += (size_t)written;
    }
}
