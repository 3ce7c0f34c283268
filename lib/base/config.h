/*
 * DESIGN: configuration declared once, as tables of fields.
 *
 * Every configurable struct (a table's config here, the daemon's config in daemon/)
 * is described by an em_config_schema: one em_config_field per key with its type,
 * where it lives in the struct, its bounds, its default (as JSON text, so defaults go
 * through the very parser that user input does), and flags such as REQUIRED and
 * RELOADABLE. One generic walker then parses a cJSON object into the struct, rejects
 * unknown keys, wrong types and out-of-range values with a message that names the
 * full key path and the value seen ("tables[0].optimizer.lr: must be > 0, got -1"),
 * and serialises a struct back to JSON for stats and checkpoints. Cross-field rules
 * (an option that only applies to one optimizer) go in the schema's check hook.
 */
#ifndef EMBER_LIB_CONFIG_H
#define EMBER_LIB_CONFIG_H

#include <cJSON.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lib/base/status.h"

typedef enum em_config_type {
    EM_CONFIG_BOOL,   /* bool */
    EM_CONFIG_INT,    /* int64_t, uint32_t, ... : any integer field (size gives width) */
    EM_CONFIG_DOUBLE, /* double or float (size gives which); always finite */
    EM_CONFIG_STRING, /* char[size], NUL-terminated; longer text is an error */
    EM_CONFIG_ENUM,   /* int, chosen by name from choices */
    EM_CONFIG_OBJECT, /* nested struct described by object */
    EM_CONFIG_CUSTOM, /* parsed and printed by the field's hooks */
} em_config_type;

enum {
    EM_CONFIG_REQUIRED = 1u << 0,   /* absence is an error */
    EM_CONFIG_RELOADABLE = 1u << 1, /* may change on a live reload */
    EM_CONFIG_UNSIGNED = 1u << 2,   /* EM_CONFIG_INT field is an unsigned type */
    EM_CONFIG_SECRET = 1u << 3,     /* never printed by em_config_to_json */
};

typedef struct em_config_choice {
    const char *name;
    int value;
} em_config_choice;

typedef struct em_config_field em_config_field;
typedef struct em_config_schema em_config_schema;

struct em_config_field {
    const char *name;
    em_config_type type;
    size_t offset;                 /* offsetof the field in the target struct */
    size_t size;                   /* sizeof the field */
    unsigned flags;
    double min, max;               /* inclusive bounds for INT and DOUBLE (min == max == 0: none) */
    bool exclusive_min;            /* DOUBLE: value must be > min rather than >= min */
    const char *default_json;      /* JSON text of the default, NULL for none (zero) */
    const em_config_choice *choices; /* ENUM: terminated by a NULL name */
    const em_config_schema *object;  /* OBJECT */
    /* CUSTOM: parse value into field; path names the key for messages. */
    em_status (*parse)(const cJSON *value, void *field, const char *path, em_error *err);
    /* CUSTOM: returns a new cJSON for the field (NULL to omit it). */
    cJSON *(*print)(const void *field);
    const char *help;              /* one line, for --help-config style listings */
};

struct em_config_schema {
    const char *name;
    const em_config_field *fields;
    size_t field_count;
    /* Optional cross-field validation after all fields are parsed; json is the object
     * the user wrote (to see which keys were given). */
    em_status (*check)(void *target, const cJSON *json, const char *path, em_error *err);
    /* Optional: false for a field that does not apply to target as configured (a cuda
     * key on the cpu backend); em_config_to_json leaves it out, so what is printed
     * parses again. */
    bool (*applies)(const void *target, const em_config_field *field);
};

/* Fills target with every field's default (zero where none). */
em_status em_config_defaults(const em_config_schema *schema, void *target, em_error *err);

/* Parses object into target: defaults first, then each key; path prefixes messages
 * ("" for the top level). Errors: INVALID_ARGUMENT naming path.key and the reason. */
em_status em_config_parse(const em_config_schema *schema, const cJSON *object, const char *path,
                          void *target, em_error *err);

/* Parses JSON text (a whole document holding one object). Errors name the line and
 * column of a syntax error. */
em_status em_config_parse_text(const em_config_schema *schema, const char *text, const char *path,
                               void *target, em_error *err);

/* Serialises target (secrets omitted). Returns NULL on allocation failure. */
cJSON *em_config_to_json(const em_config_schema *schema, const void *target);

/* Copies every top-level RELOADABLE field of schema from fresh to running (a live
 * reload): the schema says what may change, so no caller lists the keys again. */
void em_config_copy_reloadable(const em_config_schema *schema, void *running, const void *fresh);

/* Joins a path and a key ("tables[0]" + "dim" -> "tables[0].dim") into buffer. */
void em_config_join_path(char *buffer, size_t capacity, const char *path, const char *key);

/* The line and column (1-based) of byte offset in text, for syntax errors. */
void em_config_position(const char *text, size_t offset, int *line, int *column);

/* Reads a whole file into a NUL-terminated malloc'ed buffer (caller frees). Errors:
 * NOT_FOUND / PERMISSION_DENIED / INVALID_ARGUMENT naming the path and errno text,
 * or when the file is larger than max_bytes. */
em_status em_config_read_file(const char *path, size_t max_bytes, char **out, em_error *err);

/* Field declaration helpers. */
#define EM_CONFIG_FIELD(type_, name_, struct_, member_)                                       \
    .name = name_, .type = type_, .offset = offsetof(struct_, member_),                      \
    .size = sizeof(((struct_ *)0)->member_)

#endif
