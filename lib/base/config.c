/*
 * DESIGN: the generic schema walker behind every configuration struct.
 *
 * A field's default is JSON text parsed by the same code as user input, so a default
 * can never bypass a bound. Integers arrive as JSON numbers (below 2^53, where they are exact) or, for
 * the 64-bit values JSON numbers cannot carry (seeds), as strings of decimal digits.
 * Messages always carry the full key path and the offending value as the user wrote
 * it, cut to VALUE_TEXT_MAX characters.
 */
#include "lib/base/config.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define PATH_MAX_LENGTH 256
#define VALUE_TEXT_MAX 64
/* Largest integer a double (hence a JSON number in cJSON) holds exactly. */
/* 2^53: a JSON number at or above it may be a rounded neighbour of the integer written
 * (9007199254740993 reads as 9007199254740992), so such integers go as strings. */
#define EXACT_DOUBLE_INTEGER 9007199254740992.0

void em_config_join_path(char *buffer, size_t capacity, const char *path, const char *key)
{
    if (path == NULL || *path == '\0')
        snprintf(buffer, capacity, "%s", key);
    else
        snprintf(buffer, capacity, "%s.%s", path, key);
}

void em_config_position(const char *text, size_t offset, int *line, int *column)
{
    *line = 1;
    *column = 1;
    for (size_t i = 0; i < offset && text[i] != '\0'; i++) {
        if (text[i] == '\n') {
            (*line)++;
            *column = 1;
        } else {
            (*column)++;
        }
    }
}

/* The value as the user wrote it, compact and cut, for messages. */
static void describe_value(const cJSON *value, char *buffer, size_t capacity)
{
    char *printed = cJSON_PrintUnformatted(value);
    if (printed == NULL) {
        snprintf(buffer, capacity, "(unprintable)");
        return;
    }
    if (strlen(printed) > VALUE_TEXT_MAX)
        snprintf(buffer, capacity, "%.*s...", VALUE_TEXT_MAX, printed);
    else
        snprintf(buffer, capacity, "%s", printed);
    cJSON_free(printed);
}

static const char *json_type_name(const cJSON *value)
{
    if (cJSON_IsBool(value))
        return "a boolean";
    if (cJSON_IsNumber(value))
        return "a number";
    if (cJSON_IsString(value))
        return "a string";
    if (cJSON_IsArray(value))
        return "an array";
    if (cJSON_IsObject(value))
        return "an object";
    if (cJSON_IsNull(value))
        return "null";
    return "an unknown value";
}

static em_status type_error(const cJSON *value, const char *path, const char *expected,
                            em_error *err)
{
    char seen[VALUE_TEXT_MAX + 8];
    describe_value(value, seen, sizeof(seen));
    return em_error_set(err, EM_INVALID_ARGUMENT, "%s: must be %s, got %s %s", path, expected,
                        json_type_name(value), seen);
}

static bool has_bounds(const em_config_field *field)
{
    return !(field->min == 0 && field->max == 0);
}

/* ---- integers ---------------------------------------------------------------------- */

typedef struct integer_value {
    bool negative;
    uint64_t magnitude;
} integer_value;

static bool integer_from_digits(const char *text, integer_value *out)
{
    const char *digits = text;
    out->negative = false;
    if (*digits == '-') {
        out->negative = true;
        digits++;
    }
    if (*digits < '0' || *digits > '9')
        return false;
    errno = 0;
    char *end = NULL;
    unsigned long long parsed = strtoull(digits, &end, 10);
    if (errno != 0 || *end != '\0')
        return false;
    out->magnitude = parsed;
    return true;
}

static bool integer_from_json(const cJSON *value, integer_value *out)
{
    if (cJSON_IsString(value))
        return integer_from_digits(value->valuestring, out);
    if (!cJSON_IsNumber(value))
        return false;
    double number = value->valuedouble;
    if (!isfinite(number) || floor(number) != number || fabs(number) >= EXACT_DOUBLE_INTEGER)
        return false;
    out->negative = number < 0;
    out->magnitude = (uint64_t)fabs(number);
    return true;
}

/* Limits implied by the field's C type. */
static void integer_type_range(const em_config_field *field, long double *low, long double *high)
{
    bool is_unsigned = (field->flags & EM_CONFIG_UNSIGNED) != 0;
    int bits = (int)(field->size * CHAR_BIT);
    if (is_unsigned) {
        *low = 0;
        *high = bits >= 64 ? (long double)UINT64_MAX : (long double)((UINT64_C(1) << bits) - 1);
    } else {
        *high = (long double)((UINT64_C(1) << (bits - 1)) - 1);
        *low = -*high - 1;
    }
}

static void store_integer(const em_config_field *field, void *slot, integer_value value)
{
    uint64_t bits = value.negative ? (uint64_t)0 - value.magnitude : value.magnitude;
    switch (field->size) {
    case 1: { uint8_t v = (uint8_t)bits; memcpy(slot, &v, 1); break; }
    case 2: { uint16_t v = (uint16_t)bits; memcpy(slot, &v, 2); break; }
    case 4: { uint32_t v = (uint32_t)bits; memcpy(slot, &v, 4); break; }
    default: memcpy(slot, &bits, 8); break;
    }
}

static em_status parse_integer(const em_config_field *field, const cJSON *value, void *slot,
                               const char *path, em_error *err)
{
    integer_value parsed;
    if (!integer_from_json(value, &parsed))
        return type_error(value, path, "an integer (exact; a string of digits from 2^53 on)", err);
    long double low, high;
    integer_type_range(field, &low, &high);
    if (has_bounds(field)) {
        low = field->min;
        high = field->max;
    }
    long double number = parsed.negative ? -(long double)parsed.magnitude
                                         : (long double)parsed.magnitude;
    if (number < low || number > high) {
        char seen[VALUE_TEXT_MAX + 8];
        describe_value(value, seen, sizeof(seen));
        return em_error_set(err, EM_INVALID_ARGUMENT, "%s: must be between %.0Lf and %.0Lf, got %s",
                            path, low, high, seen);
    }
    store_integer(field, slot, parsed);
    return EM_OK;
}

/* ---- other scalar types -------------------------------------------------------------- */

static bool within_bounds(const em_config_field *field, double number)
{
    bool below = field->exclusive_min ? number <= field->min : number < field->min;
    return !below && number <= field->max;
}

static em_status parse_double(const em_config_field *field, const cJSON *value, void *slot,
                              const char *path, em_error *err)
{
    if (!cJSON_IsNumber(value) || !isfinite(value->valuedouble))
        return type_error(value, path, "a finite number", err);
    double number = value->valuedouble;
    if (has_bounds(field) && !within_bounds(field, number))
        return em_error_set(err, EM_INVALID_ARGUMENT, "%s: must be %s %g and <= %g, got %g",
                            path, field->exclusive_min ? ">" : ">=", field->min, field->max,
                            number);
    if (field->size == sizeof(float)) {
        /* the value kept is the float: it must meet the bounds too (1e-50 is > 0, its
         * float is 0) */
        float narrowed = (float)number;
        if (!isfinite(narrowed) || (has_bounds(field) && !within_bounds(field, narrowed)))
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "%s: %g becomes %g as a 32-bit float, which is not %s %g and "
                                "<= %g",
                                path, number, (double)narrowed,
                                field->exclusive_min ? ">" : ">=", field->min, field->max);
        memcpy(slot, &narrowed, sizeof(narrowed));
    } else {
        memcpy(slot, &number, sizeof(number));
    }
    return EM_OK;
}

static em_status parse_string(const em_config_field *field, const cJSON *value, void *slot,
                              const char *path, em_error *err)
{
    if (!cJSON_IsString(value))
        return type_error(value, path, "a string", err);
    size_t length = strlen(value->valuestring);
    if (length >= field->size)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: must be at most %zu characters, got %zu", path, field->size - 1,
                            length);
    memcpy(slot, value->valuestring, length + 1);
    return EM_OK;
}

static void list_choices(const em_config_choice *choices, char *buffer, size_t capacity)
{
    size_t used = 0;
    buffer[0] = '\0';
    for (const em_config_choice *c = choices; c->name != NULL && used < capacity; c++) {
        int written = snprintf(buffer + used, capacity - used, "%s%s",
                               c == choices ? "" : ", ", c->name);
        if (written < 0)
            break;
        used += (size_t)written;
    }
}

static em_status parse_enum(const em_config_field *field, const cJSON *value, void *slot,
                            const char *path, em_error *err)
{
    char names[256];
    list_choices(field->choices, names, sizeof(names));
    if (!cJSON_IsString(value)) {
        char expected[300];
        snprintf(expected, sizeof(expected), "one of %s", names);
        return type_error(value, path, expected, err);
    }
    for (const em_config_choice *c = field->choices; c->name != NULL; c++) {
        if (strcmp(c->name, value->valuestring) == 0) {
            memcpy(slot, &c->value, sizeof(int));
            return EM_OK;
        }
    }
    return em_error_set(err, EM_INVALID_ARGUMENT, "%s: '%s' is not one of %s", path,
                        value->valuestring, names);
}

static em_status parse_field(const em_config_field *field, const cJSON *value, void *target,
                             const char *path, em_error *err)
{
    void *slot = (char *)target + field->offset;
    switch (field->type) {
    case EM_CONFIG_BOOL:
        if (!cJSON_IsBool(value))
            return type_error(value, path, "true or false", err);
        *(bool *)slot = cJSON_IsTrue(value);
        return EM_OK;
    case EM_CONFIG_INT:
        return parse_integer(field, value, slot, path, err);
    case EM_CONFIG_DOUBLE:
        return parse_double(field, value, slot, path, err);
    case EM_CONFIG_STRING:
        return parse_string(field, value, slot, path, err);
    case EM_CONFIG_ENUM:
        return parse_enum(field, value, slot, path, err);
    case EM_CONFIG_OBJECT:
        return em_config_parse(field->object, value, path, slot, err);
    case EM_CONFIG_CUSTOM:
        return field->parse(value, slot, path, err);
    }
    return em_error_set(err, EM_INTERNAL, "%s: field has unknown type %d", path, (int)field->type);
}

/* ---- objects ------------------------------------------------------------------------- */

static const em_config_field *find_field(const em_config_schema *schema, const char *name)
{
    for (size_t i = 0; i < schema->field_count; i++)
        if (strcmp(schema->fields[i].name, name) == 0)
            return &schema->fields[i];
    return NULL;
}

static void list_keys(const em_config_schema *schema, char *buffer, size_t capacity)
{
    size_t used = 0;
    buffer[0] = '\0';
    for (size_t i = 0; i < schema->field_count && used < capacity; i++) {
        int written = snprintf(buffer + used, capacity - used, "%s%s", i == 0 ? "" : ", ",
                               schema->fields[i].name);
        if (written < 0)
            break;
        used += (size_t)written;
    }
}

em_status em_config_defaults(const em_config_schema *schema, void *target, em_error *err)
{
    for (size_t i = 0; i < schema->field_count; i++) {
        const em_config_field *field = &schema->fields[i];
        void *slot = (char *)target + field->offset;
        memset(slot, 0, field->size);
        if (field->type == EM_CONFIG_OBJECT && field->default_json == NULL) {
            em_status status = em_config_defaults(field->object, slot, err);
            if (status != EM_OK)
                return status;
            continue;
        }
        if (field->default_json == NULL)
            continue;
        cJSON *value = cJSON_Parse(field->default_json);
        if (value == NULL)
            return em_error_set(err, EM_INTERNAL, "%s.%s: default '%s' is not valid JSON",
                                schema->name, field->name, field->default_json);
        em_status status = parse_field(field, value, target, field->name, err);
        cJSON_Delete(value);
        if (status != EM_OK)
            return em_error_prefix(err, "default of %s: ", schema->name);
    }
    return EM_OK;
}

static bool is_duplicate_key(const cJSON *object, const cJSON *item)
{
    for (const cJSON *earlier = object->child; earlier != item; earlier = earlier->next)
        if (strcmp(earlier->string, item->string) == 0)
            return true;
    return false;
}

static em_status parse_members(const em_config_schema *schema, const cJSON *object,
                               const char *path, void *target, em_error *err)
{
    char key_path[PATH_MAX_LENGTH];
    for (const cJSON *item = object->child; item != NULL; item = item->next) {
        em_config_join_path(key_path, sizeof(key_path), path, item->string);
        if (is_duplicate_key(object, item))
            return em_error_set(err, EM_INVALID_ARGUMENT, "%s: key given more than once",
                                key_path);
        const em_config_field *field = find_field(schema, item->string);
        if (field == NULL) {
            char known[512];
            list_keys(schema, known, sizeof(known));
            return em_error_set(err, EM_INVALID_ARGUMENT, "%s: unknown key (known keys: %s)",
                                key_path, known);
        }
        em_status status = parse_field(field, item, target, key_path, err);
        if (status != EM_OK)
            return status;
    }
    return EM_OK;
}

static em_status check_required(const em_config_schema *schema, const cJSON *object,
                                const char *path, em_error *err)
{
    for (size_t i = 0; i < schema->field_count; i++) {
        const em_config_field *field = &schema->fields[i];
        if ((field->flags & EM_CONFIG_REQUIRED) &&
            cJSON_GetObjectItemCaseSensitive(object, field->name) == NULL) {
            char key_path[PATH_MAX_LENGTH];
            em_config_join_path(key_path, sizeof(key_path), path, field->name);
            return em_error_set(err, EM_INVALID_ARGUMENT, "%s: required key is missing",
                                key_path);
        }
    }
    return EM_OK;
}

em_status em_config_parse(const em_config_schema *schema, const cJSON *object, const char *path,
                          void *target, em_error *err)
{
    const char *where = (path == NULL || *path == '\0') ? "configuration" : path;
    if (!cJSON_IsObject(object))
        return type_error(object, where, "an object", err);
    em_status status = em_config_defaults(schema, target, err);
    if (status == EM_OK)
        status = parse_members(schema, object, path, target, err);
    if (status == EM_OK)
        status = check_required(schema, object, path, err);
    if (status == EM_OK && schema->check != NULL)
        status = schema->check(target, object, path, err);
    return status;
}

em_status em_config_parse_text(const em_config_schema *schema, const char *text, const char *path,
                               void *target, em_error *err)
{
    const char *error_at = NULL;
    cJSON *json = cJSON_ParseWithOpts(text, &error_at, true);
    if (json == NULL) {
        int line = 0, column = 0;
        size_t offset = error_at != NULL ? (size_t)(error_at - text) : 0;
        em_config_position(text, offset, &line, &column);
        return em_error_set(err, EM_INVALID_ARGUMENT, "%s: invalid JSON at line %d, column %d",
                            (path && *path) ? path : "configuration", line, column);
    }
    em_status status = em_config_parse(schema, json, path, target, err);
    cJSON_Delete(json);
    return status;
}

/* ---- printing ------------------------------------------------------------------------ */

static cJSON *integer_to_json(const em_config_field *field, const void *slot)
{
    bool is_unsigned = (field->flags & EM_CONFIG_UNSIGNED) != 0;
    uint64_t bits = 0;
    int64_t signed_value = 0;
    switch (field->size) {
    case 1: bits = *(const uint8_t *)slot; signed_value = *(const int8_t *)slot; break;
    case 2: bits = *(const uint16_t *)slot; signed_value = *(const int16_t *)slot; break;
    case 4: bits = *(const uint32_t *)slot; signed_value = *(const int32_t *)slot; break;
    default: bits = *(const uint64_t *)slot; signed_value = *(const int64_t *)slot; break;
    }
    if (!is_unsigned)
        return cJSON_CreateNumber((double)signed_value);
    if (bits >= (UINT64_C(1) << 53)) {
        char digits[24];
        snprintf(digits, sizeof(digits), "%llu", (unsigned long long)bits);
        return cJSON_CreateString(digits);
    }
    return cJSON_CreateNumber((double)bits);
}

/* The shortest decimal that reads back as the same float (0.01f prints as 0.01, not
 * 0.00999999977648258), as a double for cJSON. */
static double shortest_float(float value)
{
    char text[32];
    for (int precision = 6; precision <= 9; precision++) {
        snprintf(text, sizeof(text), "%.*g", precision, (double)value);
        double parsed = strtod(text, NULL);
        if ((float)parsed == value)
            return parsed;
    }
    return (double)value;
}

static cJSON *enum_to_json(const em_config_field *field, const void *slot)
{
    int value;
    memcpy(&value, slot, sizeof(value));
    for (const em_config_choice *c = field->choices; c->name != NULL; c++)
        if (c->value == value)
            return cJSON_CreateString(c->name);
    return cJSON_CreateNumber(value);
}

static cJSON *field_to_json(const em_config_field *field, const void *target)
{
    const void *slot = (const char *)target + field->offset;
    switch (field->type) {
    case EM_CONFIG_BOOL:
        return cJSON_CreateBool(*(const bool *)slot);
    case EM_CONFIG_INT:
        return integer_to_json(field, slot);
    case EM_CONFIG_DOUBLE:
        if (field->size == sizeof(float))
            return cJSON_CreateNumber(shortest_float(*(const float *)slot));
        return cJSON_CreateNumber(*(const double *)slot);
    case EM_CONFIG_STRING:
        return cJSON_CreateString((const char *)slot);
    case EM_CONFIG_ENUM:
        return enum_to_json(field, slot);
    case EM_CONFIG_OBJECT:
        return em_config_to_json(field->object, slot);
    case EM_CONFIG_CUSTOM:
        return field->print != NULL ? field->print(slot) : NULL;
    }
    return NULL;
}

cJSON *em_config_to_json(const em_config_schema *schema, const void *target)
{
    cJSON *object = cJSON_CreateObject();
    if (object == NULL)
        return NULL;
    for (size_t i = 0; i < schema->field_count; i++) {
        const em_config_field *field = &schema->fields[i];
        if (field->flags & EM_CONFIG_SECRET)
            continue;
        if (schema->applies != NULL && !schema->applies(target, field))
            continue;
        cJSON *value = field_to_json(field, target);
        if (value != NULL)
            cJSON_AddItemToObject(object, field->name, value);
    }
    return object;
}

/* ---- files --------------------------------------------------------------------------- */

static em_status file_error(const char *path, int error_number, em_error *err)
{
    em_status status = EM_INVALID_ARGUMENT;
    if (error_number == ENOENT)
        status = EM_NOT_FOUND;
    else if (error_number == EACCES || error_number == EPERM)
        status = EM_PERMISSION_DENIED;
    return em_error_set(err, status, "cannot read '%s': %s", path, strerror(error_number));
}

em_status em_config_read_file(const char *path, size_t max_bytes, char **out, em_error *err)
{
    FILE *file = fopen(path, "rb");
    if (file == NULL)
        return file_error(path, errno, err);
    struct stat info;
    if (fstat(fileno(file), &info) != 0) {
        int saved = errno;
        fclose(file);
        return file_error(path, saved, err);
    }
    if (!S_ISREG(info.st_mode) || (uint64_t)info.st_size > max_bytes) {
        fclose(file);
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "'%s' is not a regular file of at most %zu bytes", path, max_bytes);
    }
    size_t length = (size_t)info.st_size;
    char *text = malloc(length + 1);
    if (text == NULL) {
        fclose(file);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "cannot read '%s': out of memory", path);
    }
    size_t got = fread(text, 1, length, file);
    int read_failed = ferror(file);
    fclose(file);
    if (read_failed || got != length) {
        free(text);
        return em_error_set(err, EM_INVALID_ARGUMENT, "cannot read '%s': short read", path);
    }
    text[length] = '\0';
    *out = text;
    return EM_OK;
}

void em_config_copy_reloadable(const em_config_schema *schema, void *running, const void *fresh)
{
    for (size_t i = 0; i < schema->field_count; i++) {
        const em_config_field *field = &schema->fields[i];
        if (field->flags & EM_CONFIG_RELOADABLE)
            memcpy((char *)running + field->offset, (const char *)fresh + field->offset,
                   field->size);
    }
}
