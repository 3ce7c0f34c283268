#include "lib/table/table_config.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

/* The eps default in the schema (adagrad's); check_optimizer puts each optimizer's own
 * default (common/optimizer.h) in place when eps is not given. */
#define DEFAULT_ADAGRAD_EPS "1e-10"

static const em_config_choice optimizer_choices[] = {
#define OPTIMIZER_CHOICE(KIND, name, per_element, per_row, keys, eps) {#name, EM_OPTIMIZER_##KIND},
    EM_OPTIMIZERS(OPTIMIZER_CHOICE)
#undef OPTIMIZER_CHOICE
    {NULL, 0},
};

static const em_config_choice initializer_choices[] = {
    {"zeros", EM_INIT_ZEROS},
    {"uniform", EM_INIT_UNIFORM},
    {"normal", EM_INIT_NORMAL},
    {NULL, 0},
};

/* The hyperparameters beyond lr and their bits in EM_OPTIMIZERS' keys column. */
static const struct {
    const char *key;
    unsigned bit;
} optimizer_keys[] = {
    {"eps", EM_OPTIMIZER_KEY_EPS},
    {"initial_accumulator", EM_OPTIMIZER_KEY_INITIAL_ACCUMULATOR},
    {"beta1", EM_OPTIMIZER_KEY_BETAS},
    {"beta2", EM_OPTIMIZER_KEY_BETAS},
};

#define OPTIMIZER_KEY_COUNT (sizeof(optimizer_keys) / sizeof(optimizer_keys[0]))

static bool optimizer_takes(em_optimizer_kind kind, size_t key)
{
    return (em_optimizer_keys(kind) & optimizer_keys[key].bit) != 0;
}

static em_status check_optimizer(void *target, const cJSON *json, const char *path,
                                 em_error *err)
{
    em_optimizer_config *config = target;
    for (size_t i = 0; i < OPTIMIZER_KEY_COUNT; i++) {
        const char *key = optimizer_keys[i].key;
        if (cJSON_GetObjectItemCaseSensitive(json, key) != NULL &&
            !optimizer_takes(config->kind, i)) {
            char key_path[256];
            em_config_join_path(key_path, sizeof(key_path), path, key);
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "%s: does not apply to optimizer '%s'", key_path,
                                em_optimizer_name(config->kind));
        }
    }
    if (cJSON_GetObjectItemCaseSensitive(json, "eps") == NULL &&
        optimizer_takes(config->kind, 0))
        config->eps = em_optimizer_default_eps(config->kind);
    return EM_OK;
}

static const em_config_field optimizer_fields[] = {
    {EM_CONFIG_FIELD(EM_CONFIG_ENUM, "type", em_optimizer_config, kind),
     .flags = EM_CONFIG_REQUIRED, .choices = optimizer_choices,
     .help = "sgd, adagrad, rowwise_adagrad or adam"},
    {EM_CONFIG_FIELD(EM_CONFIG_DOUBLE, "lr", em_optimizer_config, learning_rate),
     .min = 0, .max = 1e6, .exclusive_min = true, .default_json = "0.01",
     .help = "learning rate"},
    {EM_CONFIG_FIELD(EM_CONFIG_DOUBLE, "eps", em_optimizer_config, eps), .min = 0, .max = 1,
     .exclusive_min = true, .default_json = DEFAULT_ADAGRAD_EPS,
     .help = "added to the denominator (adagrad 1e-10, adam 1e-8 by default)"},
    {EM_CONFIG_FIELD(EM_CONFIG_DOUBLE, "initial_accumulator", em_optimizer_config,
                     initial_accumulator),
     .min = 0, .max = 1e6, .default_json = "0", .help = "adagrad: starting accumulator"},
    {EM_CONFIG_FIELD(EM_CONFIG_DOUBLE, "beta1", em_optimizer_config, beta1), .min = 0,
     .max = 0.999999, .default_json = "0.9", .help = "adam: first moment decay"},
    {EM_CONFIG_FIELD(EM_CONFIG_DOUBLE, "beta2", em_optimizer_config, beta2), .min = 0,
     .max = 0.999999, .default_json = "0.999", .help = "adam: second moment decay"},
};

static const em_config_schema optimizer_schema = {
    .name = "optimizer",
    .fields = optimizer_fields,
    .field_count = sizeof(optimizer_fields) / sizeof(optimizer_fields[0]),
    .check = check_optimizer,
};

static em_status check_initializer(void *target, const cJSON *json, const char *path,
                                   em_error *err)
{
    const em_initializer_config *config = target;
    const char *wrong = NULL;
    if (config->kind != EM_INIT_UNIFORM && cJSON_GetObjectItemCaseSensitive(json, "bound"))
        wrong = "bound";
    else if (config->kind != EM_INIT_NORMAL && cJSON_GetObjectItemCaseSensitive(json, "stddev"))
        wrong = "stddev";
    if (wrong == NULL)
        return EM_OK;
    char key_path[256];
    em_config_join_path(key_path, sizeof(key_path), path, wrong);
    return em_error_set(err, EM_INVALID_ARGUMENT, "%s: does not apply to initializer '%s'",
                        key_path, initializer_choices[config->kind].name);
}

static const em_config_field initializer_fields[] = {
    {EM_CONFIG_FIELD(EM_CONFIG_ENUM, "type", em_initializer_config, kind),
     .choices = initializer_choices, .default_json = "\"uniform\"",
     .help = "zeros, uniform or normal"},
    {EM_CONFIG_FIELD(EM_CONFIG_DOUBLE, "bound", em_initializer_config, bound), .min = 0,
     .max = 1e6, .default_json = "0.01", .help = "uniform: values in [-bound, bound)"},
    {EM_CONFIG_FIELD(EM_CONFIG_DOUBLE, "stddev", em_initializer_config, stddev), .min = 0,
     .max = 1e6, .default_json = "0.01", .help = "normal: standard deviation"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "seed", em_initializer_config, seed),
     .flags = EM_CONFIG_UNSIGNED, .default_json = "0",
     .help = "initial values are a function of (seed, key, element)"},
};

static const em_config_schema initializer_schema = {
    .name = "initializer",
    .fields = initializer_fields,
    .field_count = sizeof(initializer_fields) / sizeof(initializer_fields[0]),
    .check = check_initializer,
};

static const em_config_choice eviction_choices[] = {
    {"none", EM_EVICTION_NONE},
    {"lru", EM_EVICTION_LRU},
    {"lfu", EM_EVICTION_LFU},
    {"age", EM_EVICTION_AGE},
    {NULL, 0},
};

bool em_eviction_tracks_access(const em_eviction_config *config)
{
    return config->policy != EM_EVICTION_NONE || config->max_age_steps > 0 ||
           config->max_age_seconds > 0;
}

const char *em_eviction_policy_name(em_eviction_policy policy)
{
    for (size_t i = 0; eviction_choices[i].name != NULL; i++)
        if (eviction_choices[i].value == (int)policy)
            return eviction_choices[i].name;
    return "unknown";
}

static const em_config_field eviction_fields[] = {
    {EM_CONFIG_FIELD(EM_CONFIG_ENUM, "policy", em_eviction_config, policy),
     .choices = eviction_choices, .default_json = "\"none\"",
     .help = "what makes room when the table is full: none (refuse), lru, lfu or age"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "candidates", em_eviction_config, candidates),
     .flags = EM_CONFIG_UNSIGNED, .min = 1, .max = EM_EVICTION_CANDIDATES_MAX,
     .default_json = "16", .help = "hash map entries compared for each row removed"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "ring", em_eviction_config, ring),
     .flags = EM_CONFIG_UNSIGNED, .min = 0, .max = EM_EVICTION_RING_MAX, .default_json = "1024",
     .help = "the most recently evicted keys kept for EVICTED (0: none)"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "max_age_steps", em_eviction_config, max_age_steps),
     .flags = EM_CONFIG_UNSIGNED, .min = 0, .max = 2147483647.0, .default_json = "0",
     .help = "expire rows not pushed nor created in this many pushes of the table (0: never)"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "max_age_seconds", em_eviction_config, max_age_seconds),
     .flags = EM_CONFIG_UNSIGNED, .min = 0, .max = 3153600000.0, .default_json = "0",
     .help = "expire rows not pushed nor created in this many seconds (0: never)"},
    {EM_CONFIG_FIELD(EM_CONFIG_DOUBLE, "headroom", em_eviction_config, headroom),
     .min = 0, .max = 0.5, .default_json = "0",
     .help = "share of the capacity an eviction frees beyond what its request needs, so "
             "the requests after it create keys without the table to themselves"},
};

static const em_config_schema eviction_schema = {
    .name = "eviction",
    .fields = eviction_fields,
    .field_count = sizeof(eviction_fields) / sizeof(eviction_fields[0]),
};

static const em_config_choice admission_choices[] = {
    {"always", EM_ADMISSION_ALWAYS},
    {"counter", EM_ADMISSION_COUNTER},
    {"probability", EM_ADMISSION_PROBABILITY},
    {NULL, 0},
};

static const em_config_field admission_fields[] = {
    {EM_CONFIG_FIELD(EM_CONFIG_ENUM, "policy", em_admission_config, policy),
     .choices = admission_choices, .default_json = "\"always\"",
     .help = "which new keys are stored: always, counter or probability"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "threshold", em_admission_config, threshold),
     .flags = EM_CONFIG_UNSIGNED, .min = 1, .max = 255, .default_json = "2",
     .help = "counter: times a key is seen before it is stored"},
    {EM_CONFIG_FIELD(EM_CONFIG_DOUBLE, "probability", em_admission_config, probability),
     .min = 0, .max = 1, .default_json = "1", .help = "probability: chance a key is stored"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "counters", em_admission_config, counters),
     .flags = EM_CONFIG_UNSIGNED, .min = 1024, .max = 1073741824.0, .default_json = "1048576",
     .help = "counter: one-byte counters of the sketch (bytes of memory)"},
};

static const em_config_schema admission_schema = {
    .name = "admission",
    .fields = admission_fields,
    .field_count = sizeof(admission_fields) / sizeof(admission_fields[0]),
};

static em_status parse_name(const cJSON *value, void *field, const char *path, em_error *err)
{
    if (!cJSON_IsString(value))
        return em_error_set(err, EM_INVALID_ARGUMENT, "%s: must be a string", path);
    em_status status = em_table_name_check(value->valuestring, err);
    if (status != EM_OK)
        return em_error_prefix(err, "%s: ", path);
    memcpy(field, value->valuestring, strlen(value->valuestring) + 1);
    return EM_OK;
}

static cJSON *print_name(const void *field)
{
    return cJSON_CreateString((const char *)field);
}

static const em_config_field table_fields[] = {
    {EM_CONFIG_FIELD(EM_CONFIG_CUSTOM, "name", em_table_config, name),
     .flags = EM_CONFIG_REQUIRED, .parse = parse_name, .print = print_name,
     .help = "1..128 characters of [A-Za-z0-9_.-]"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "dim", em_table_config, dim),
     .flags = EM_CONFIG_REQUIRED | EM_CONFIG_UNSIGNED, .min = 1, .max = EM_TABLE_DIM_MAX,
     .help = "floats per embedding vector"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "capacity", em_table_config, capacity),
     .flags = EM_CONFIG_REQUIRED | EM_CONFIG_UNSIGNED, .min = 1,
     .max = (double)EM_TABLE_CAPACITY_MAX, .help = "maximum number of rows"},
    {EM_CONFIG_FIELD(EM_CONFIG_INT, "shards", em_table_config, shards),
     .flags = EM_CONFIG_UNSIGNED, .min = 0, .max = EM_TABLE_SHARDS_MAX, .default_json = "0",
     .help = "shard count (0: one per device)"},
    {EM_CONFIG_FIELD(EM_CONFIG_OBJECT, "optimizer", em_table_config, optimizer),
     .object = &optimizer_schema, .default_json = "{\"type\": \"sgd\"}"},
    {EM_CONFIG_FIELD(EM_CONFIG_OBJECT, "initializer", em_table_config, initializer),
     .object = &initializer_schema, .default_json = "{}"},
    {EM_CONFIG_FIELD(EM_CONFIG_OBJECT, "eviction", em_table_config, eviction),
     .object = &eviction_schema, .default_json = "{}",
     .help = "what happens when the table is full"},
    {EM_CONFIG_FIELD(EM_CONFIG_OBJECT, "admission", em_table_config, admission),
     .object = &admission_schema, .default_json = "{}", .help = "which new keys are stored"},
};

const em_config_schema em_table_config_schema = {
    .name = "table",
    .fields = table_fields,
    .field_count = sizeof(table_fields) / sizeof(table_fields[0]),
};

static int is_name_character(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '.' || c == '-';
}

em_status em_table_name_check(const char *name, em_error *err)
{
    size_t length = strlen(name);
    if (length == 0 || length > EM_TABLE_NAME_MAX)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "table name must have 1 to %d characters, got %zu",
                            EM_TABLE_NAME_MAX, length);
    for (size_t i = 0; i < length; i++) {
        if (!is_name_character(name[i]))
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "table name '%s' has character 0x%02x at position %zu; "
                                "allowed are A-Z a-z 0-9 _ . -",
                                name, (unsigned char)name[i], i);
    }
    /* a table's checkpoints live in <checkpoint.dir>/<name>: "." and ".." are not a
     * directory of its own, and the restore passes over hidden ones */
    if (name[0] == '.')
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "table name '%s' starts with '.'; it names the table's "
                            "checkpoint directory, which must not be hidden, '.' or '..'",
                            name);
    return EM_OK;
}

em_status em_table_config_parse(const cJSON *json, const char *path, em_table_config *out,
                                em_error *err)
{
    return em_config_parse(&em_table_config_schema, json, path, out, err);
}

em_status em_table_config_parse_text(const char *text, em_table_config *out, em_error *err)
{
    return em_config_parse_text(&em_table_config_schema, text, "table", out, err);
}

cJSON *em_table_config_to_json(const em_table_config *config)
{
    cJSON *json = em_config_to_json(&em_table_config_schema, config);
    if (json == NULL)
        return NULL;
    /* Hyperparameters that do not apply to the chosen types would not parse back. */
    cJSON *optimizer = cJSON_GetObjectItemCaseSensitive(json, "optimizer");
    for (size_t i = 0; i < OPTIMIZER_KEY_COUNT; i++)
        if (!optimizer_takes(config->optimizer.kind, i))
            cJSON_DeleteItemFromObjectCaseSensitive(optimizer, optimizer_keys[i].key);
    cJSON *initializer = cJSON_GetObjectItemCaseSensitive(json, "initializer");
    if (config->initializer.kind != EM_INIT_UNIFORM)
        cJSON_DeleteItemFromObjectCaseSensitive(initializer, "bound");
    if (config->initializer.kind != EM_INIT_NORMAL)
        cJSON_DeleteItemFromObjectCaseSensitive(initializer, "stddev");
    return json;
}

em_status em_table_config_validate(const em_table_config *config, em_error *err)
{
    if (memchr(config->name, '\0', sizeof(config->name)) == NULL)
        return em_error_set(err, EM_INVALID_ARGUMENT, "table name is not terminated");
    cJSON *json = em_table_config_to_json(config);
    if (json == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "table config: out of memory");
    em_table_config parsed;
    em_status status = em_table_config_parse(json, "table", &parsed, err);
    cJSON_Delete(json);
    return status;
}

void em_table_config_init(em_table_config *config, const char *name, uint32_t dim,
                          uint64_t capacity)
{
    em_config_defaults(&em_table_config_schema, config, NULL);
    snprintf(config->name, sizeof(config->name), "%s", name);
    config->dim = dim;
    config->capacity = capacity;
}
