#include "clients/client_json.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static cJSON *hex_string(const ProtobufCBinaryData *bytes)
{
    static const char digits[] = "0123456789abcdef";
    char *text = malloc(bytes->len * 2 + 1);
    if (text == NULL)
        return NULL;
    for (size_t i = 0; i < bytes->len; i++) {
        text[2 * i] = digits[bytes->data[i] >> 4];
        text[2 * i + 1] = digits[bytes->data[i] & 15];
    }
    text[bytes->len * 2] = '\0';
    cJSON *item = cJSON_CreateString(text);
    free(text);
    return item;
}

static cJSON *enum_value(const ProtobufCFieldDescriptor *field, int value)
{
    const ProtobufCEnumValue *named =
        protobuf_c_enum_descriptor_get_value(field->descriptor, value);
    if (named != NULL)
        return cJSON_CreateString(named->name);
    return cJSON_CreateNumber(value);
}

/* One value of a field's type, stored at `at`. */
static cJSON *field_value(const ProtobufCFieldDescriptor *field, const void *at)
{
    switch (field->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
        return cJSON_CreateNumber(*(const int32_t *)at);
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
        return cJSON_CreateNumber(*(const uint32_t *)at);
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
        return cJSON_CreateNumber((double)*(const int64_t *)at);
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        return cJSON_CreateNumber((double)*(const uint64_t *)at);
    case PROTOBUF_C_TYPE_FLOAT:
        return cJSON_CreateNumber(*(const float *)at);
    case PROTOBUF_C_TYPE_DOUBLE:
        return cJSON_CreateNumber(*(const double *)at);
    case PROTOBUF_C_TYPE_BOOL:
        return cJSON_CreateBool(*(const protobuf_c_boolean *)at);
    case PROTOBUF_C_TYPE_ENUM:
        return enum_value(field, *(const int *)at);
    case PROTOBUF_C_TYPE_STRING: {
        const char *text = *(char *const *)at;
        return cJSON_CreateString(text != NULL ? text : "");
    }
    case PROTOBUF_C_TYPE_BYTES:
        return hex_string((const ProtobufCBinaryData *)at);
    case PROTOBUF_C_TYPE_MESSAGE: {
        const ProtobufCMessage *message = *(ProtobufCMessage *const *)at;
        return message != NULL ? em__client_json_from_message(message) : cJSON_CreateNull();
    }
    }
    return cJSON_CreateNull();
}

/* Bytes one element of a repeated field takes in its array. */
static size_t element_size(ProtobufCType type)
{
    switch (type) {
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        return sizeof(uint64_t);
    case PROTOBUF_C_TYPE_DOUBLE:
        return sizeof(double);
    case PROTOBUF_C_TYPE_BOOL:
        return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_ENUM:
        return sizeof(int);
    case PROTOBUF_C_TYPE_STRING:
    case PROTOBUF_C_TYPE_MESSAGE:
        return sizeof(void *);
    case PROTOBUF_C_TYPE_BYTES:
        return sizeof(ProtobufCBinaryData);
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_FLOAT:
        return sizeof(uint32_t);
    }
    return sizeof(uint32_t);
}

static cJSON *repeated_value(const ProtobufCFieldDescriptor *field, const uint8_t *message)
{
    size_t count = *(const size_t *)(message + field->quantifier_offset);
    const uint8_t *elements = *(uint8_t *const *)(message + field->offset);
    cJSON *array = cJSON_CreateArray();
    for (size_t i = 0; array != NULL && i < count; i++) {
        cJSON *item = field_value(field, elements + i * element_size(field->type));
        if (item == NULL || !cJSON_AddItemToArray(array, item)) {
            cJSON_Delete(item);
            cJSON_Delete(array);
            return NULL;
        }
    }
    return array;
}

/* Optional fields with has_ flags and members of a oneof appear only when set. */
static bool field_present(const ProtobufCFieldDescriptor *field, const uint8_t *message)
{
    if (field->flags & PROTOBUF_C_FIELD_FLAG_ONEOF)
        return *(const uint32_t *)(message + field->quantifier_offset) == field->id;
    if (field->label == PROTOBUF_C_LABEL_OPTIONAL && field->quantifier_offset != 0 &&
        field->type != PROTOBUF_C_TYPE_MESSAGE && field->type != PROTOBUF_C_TYPE_STRING)
        return *(const protobuf_c_boolean *)(message + field->quantifier_offset) != 0;
    return true;
}

cJSON *em__client_json_from_message(const ProtobufCMessage *message)
{
    const ProtobufCMessageDescriptor *descriptor = message->descriptor;
    const uint8_t *base = (const uint8_t *)message;
    cJSON *object = cJSON_CreateObject();
    for (unsigned i = 0; object != NULL && i < descriptor->n_fields; i++) {
        const ProtobufCFieldDescriptor *field = &descriptor->fields[i];
        if (!field_present(field, base))
            continue;
        cJSON *value = field->label == PROTOBUF_C_LABEL_REPEATED
                           ? repeated_value(field, base)
                           : field_value(field, base + field->offset);
        if (value == NULL || !cJSON_AddItemToObject(object, field->name, value)) {
            cJSON_Delete(value);
            cJSON_Delete(object);
            return NULL;
        }
    }
    return object;
}

static cJSON *parsed_config(const char *text)
{
    if (text == NULL || *text == '\0')
        return cJSON_CreateNull();
    cJSON *config = cJSON_Parse(text);
    return config != NULL ? config : cJSON_CreateString(text);
}

cJSON *em__client_json_table_info(const Ember__TableInfo *info)
{
    cJSON *object = cJSON_CreateObject();
    if (object == NULL)
        return NULL;
    cJSON_AddStringToObject(object, "name", info->name != NULL ? info->name : "");
    cJSON_AddNumberToObject(object, "dim", info->dim);
    cJSON_AddNumberToObject(object, "capacity", (double)info->capacity);
    cJSON_AddNumberToObject(object, "shards", info->shards);
    cJSON_AddStringToObject(object, "optimizer", info->optimizer != NULL ? info->optimizer : "");
    cJSON_AddNumberToObject(object, "rows", (double)info->rows);
    cJSON *config = parsed_config(info->config_json);
    /* each add above fails only when out of memory */
    if (cJSON_GetArraySize(object) != 6 || config == NULL ||
        !cJSON_AddItemToObject(object, "config", config)) {
        cJSON_Delete(config);
        cJSON_Delete(object);
        return NULL;
    }
    return object;
}

cJSON *em__client_json_stats(const Ember__StatsResponse *stats)
{
    return em__client_json_from_message(&stats->base);
}
