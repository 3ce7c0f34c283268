#include "proto/frame.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

em_frame_limits em_frame_default_limits(void)
{
    return (em_frame_limits){
        .max_meta = EM_FRAME_META_MAX,
        .max_body = EM_FRAME_BODY_MAX,
        .max_attachment = EM_FRAME_ATTACHMENT_DEFAULT_MAX,
    };
}

void em_put_u32(uint8_t *out, uint32_t value)
{
    for (int i = 0; i < 4; i++)
        out[i] = (uint8_t)(value >> (8 * i));
}

void em_put_u64(uint8_t *out, uint64_t value)
{
    for (int i = 0; i < 8; i++)
        out[i] = (uint8_t)(value >> (8 * i));
}

uint32_t em_get_u32(const uint8_t *in)
{
    uint32_t value = 0;
    for (int i = 3; i >= 0; i--)
        value = (value << 8) | in[i];
    return value;
}

uint64_t em_get_u64(const uint8_t *in)
{
    uint64_t value = 0;
    for (int i = 7; i >= 0; i--)
        value = (value << 8) | in[i];
    return value;
}

uint64_t em_align8(uint64_t value)
{
    if (value > UINT64_MAX - 7)
        return UINT64_MAX;
    return (value + 7) & ~UINT64_C(7);
}

void em_frame_header_encode(const em_frame_header *header, uint8_t out[EM_FRAME_HEADER_BYTES])
{
    memcpy(out, EM_FRAME_MAGIC, 4);
    em_put_u32(out + 4, header->meta_len);
    em_put_u64(out + 8, header->body_len);
    em_put_u64(out + 16, header->attach_len);
}

em_status em_frame_header_decode(const uint8_t in[EM_FRAME_HEADER_BYTES],
                                 const em_frame_limits *limits, em_frame_header *out,
                                 em_error *err)
{
    if (memcmp(in, EM_FRAME_MAGIC, 4) != 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "bad frame magic %02x %02x %02x %02x, expected 'EMB1'", in[0], in[1],
                            in[2], in[3]);
    out->meta_len = em_get_u32(in + 4);
    out->body_len = em_get_u64(in + 8);
    out->attach_len = em_get_u64(in + 16);
    if (out->meta_len == 0)
        return em_error_set(err, EM_INVALID_ARGUMENT, "frame meta_len is 0, must be at least 1");
    if (out->meta_len > limits->max_meta)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "frame meta_len %" PRIu32 " exceeds the limit of %" PRIu32 " bytes",
                            out->meta_len, limits->max_meta);
    if (out->body_len > limits->max_body)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "frame body_len %" PRIu64 " exceeds the limit of %" PRIu64 " bytes",
                            out->body_len, limits->max_body);
    if (out->attach_len > limits->max_attachment)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "frame attach_len %" PRIu64 " exceeds the limit of %" PRIu64 " bytes",
                            out->attach_len, limits->max_attachment);
    return EM_OK;
}

/* a * b + c, or false on overflow. */
static bool multiply_add(uint64_t a, uint64_t b, uint64_t c, uint64_t *out)
{
    if (b != 0 && a > (UINT64_MAX - c) / b)
        return false;
    *out = a * b + c;
    return true;
}

em_status em_csr_attachment_layout(uint32_t rows, uint64_t nnz, uint64_t gradient_floats,
                                   em_csr_attachment *out, em_error *err)
{
    uint64_t offsets_end = ((uint64_t)rows + 1) * sizeof(uint32_t);
    out->offsets_at = 0;
    out->keys_at = em_align8(offsets_end);
    if (!multiply_add(nnz, sizeof(uint64_t), out->keys_at, &out->gradients_at) ||
        !multiply_add(gradient_floats, sizeof(float), out->gradients_at, &out->total))
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "attachment for rows=%" PRIu32 " nnz=%" PRIu64 " gradients=%" PRIu64
                            " overflows 64 bits",
                            rows, nnz, gradient_floats);
    return EM_OK;
}

em_status em_frame_pack(const Ember__RpcMeta *meta, const ProtobufCMessage *body,
                        uint64_t attach_len, uint8_t **out, size_t *out_len, em_error *err)
{
    size_t meta_len = protobuf_c_message_get_packed_size(&meta->base);
    size_t body_len = body != NULL ? protobuf_c_message_get_packed_size(body) : 0;
    if (meta_len == 0 || meta_len > EM_FRAME_META_MAX || body_len > EM_FRAME_BODY_MAX)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "frame meta of %zu bytes or body of %zu bytes is outside the "
                            "protocol limits", meta_len, body_len);
    size_t total = EM_FRAME_HEADER_BYTES + meta_len + body_len;
    uint8_t *buffer = malloc(total);
    if (buffer == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "frame of %zu bytes: out of memory",
                            total);
    em_frame_header header = {(uint32_t)meta_len, body_len, attach_len};
    em_frame_header_encode(&header, buffer);
    protobuf_c_message_pack(&meta->base, buffer + EM_FRAME_HEADER_BYTES);
    if (body != NULL)
        protobuf_c_message_pack(body, buffer + EM_FRAME_HEADER_BYTES + meta_len);
    *out = buffer;
    *out_len = total;
    return EM_OK;
}

const char *em_method_name(int method)
{
    const ProtobufCEnumValue *value =
        protobuf_c_enum_descriptor_get_value(&ember__method__descriptor, method);
    return value != NULL ? value->name : "UNKNOWN_METHOD";
}
