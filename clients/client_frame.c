#include "clients/client_frame.h"

#include <stdlib.h>
#include <string.h>

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "the client sends arrays as they are in memory: the wire is little-endian");

/* Bytes a discarded attachment is read through, a piece at a time. */
#define DISCARD_CHUNK_BYTES (64 * 1024)

static const uint8_t zero_padding[8];

/* ---- requests --------------------------------------------------------------------- */

static em_status frame_prefix(const em__client_rpc *rpc, const ProtobufCMessage *body,
                              uint64_t attach_len, em__client_frame *out, em_error *err)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = rpc->correlation_id;
    meta.method = (Ember__Method)rpc->method;
    meta.deadline_ms = rpc->deadline_ms;
    if (rpc->token != NULL) {
        meta.auth_token.data = (uint8_t *)rpc->token;
        meta.auth_token.len = strlen(rpc->token);
    }
    memset(out, 0, sizeof(*out));
    size_t prefix_len = 0;
    em_status status = em_frame_pack(&meta, body, attach_len, &out->prefix, &prefix_len, err);
    if (status != EM_OK)
        return status;
    out->pieces[0] = (struct iovec){.iov_base = out->prefix, .iov_len = prefix_len};
    out->piece_count = 1;
    out->total = prefix_len + attach_len;
    out->attach_len = attach_len;
    return EM_OK;
}

static void add_piece(em__client_frame *frame, const void *data, uint64_t bytes)
{
    if (bytes == 0)
        return;
    frame->pieces[frame->piece_count++] =
        (struct iovec){.iov_base = (void *)data, .iov_len = (size_t)bytes};
}

/* offsets, padding to 8, keys (and gradient_count floats when gradients is not NULL) */
static void add_csr_pieces(em__client_frame *frame, const em_csr *batch,
                           const em_csr_attachment *layout, const float *gradients,
                           uint64_t gradient_count)
{
    uint64_t offsets_bytes = ((uint64_t)batch->rows + 1) * sizeof(uint32_t);
    add_piece(frame, batch->offsets, offsets_bytes);
    add_piece(frame, zero_padding, layout->keys_at - offsets_bytes);
    add_piece(frame, batch->keys, batch->nnz * sizeof(uint64_t));
    if (gradients != NULL)
        add_piece(frame, gradients, gradient_count * sizeof(float));
}

em_status em__client_frame_message(const em__client_rpc *rpc, const ProtobufCMessage *body,
                                   em__client_frame *out, em_error *err)
{
    return frame_prefix(rpc, body, 0, out, err);
}

em_status em__client_frame_pull(const em__client_rpc *rpc, const char *table,
                                const em_csr *batch, em_combiner combiner, bool create_missing,
                                em__client_frame *out, em_error *err)
{
    em_csr_attachment layout;
    em_status status = em_csr_attachment_layout(batch->rows, batch->nnz, 0, &layout, err);
    if (status != EM_OK)
        return status;
    Ember__PullRequest body = EMBER__PULL_REQUEST__INIT;
    body.table = (char *)table;
    body.rows = batch->rows;
    body.nnz = batch->nnz;
    body.combiner = (Ember__Combiner)combiner;
    body.create_missing = create_missing;
    status = frame_prefix(rpc, &body.base, layout.total, out, err);
    if (status == EM_OK)
        add_csr_pieces(out, batch, &layout, NULL, 0);
    return status;
}

em_status em__client_frame_push(const em__client_rpc *rpc, const char *table,
                                const em_csr *batch, em_combiner combiner,
                                const float *gradients, uint64_t gradient_count,
                                em__client_frame *out, em_error *err)
{
    em_csr_attachment layout;
    em_status status =
        em_csr_attachment_layout(batch->rows, batch->nnz, gradient_count, &layout, err);
    if (status != EM_OK)
        return status;
    Ember__PushRequest body = EMBER__PUSH_REQUEST__INIT;
    body.table = (char *)table;
    body.rows = batch->rows;
    body.nnz = batch->nnz;
    body.combiner = (Ember__Combiner)combiner;
    status = frame_prefix(rpc, &body.base, layout.total, out, err);
    if (status == EM_OK)
        add_csr_pieces(out, batch, &layout, gradients, gradient_count);
    return status;
}

uint32_t em__client_frame_remaining(const em__client_frame *frame, uint64_t sent,
                                    struct iovec *out, uint32_t max)
{
    uint32_t used = 0;
    for (uint32_t i = 0; i < frame->piece_count && used < max; i++) {
        const struct iovec *piece = &frame->pieces[i];
        if (sent >= piece->iov_len) {
            sent -= piece->iov_len;
            continue;
        }
        out[used++] = (struct iovec){.iov_base = (uint8_t *)piece->iov_base + sent,
                                     .iov_len = piece->iov_len - (size_t)sent};
        sent = 0;
    }
    return used;
}

em_status em__client_frame_detach(em__client_frame *frame, uint64_t sent, em_error *err)
{
    uint64_t left = frame->total - sent;
    uint8_t *copy = malloc(left + 1);
    if (copy == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "keeping %llu unsent bytes of an abandoned request: out of memory",
                            (unsigned long long)left);
    struct iovec rest[EM_CLIENT_FRAME_PIECES_MAX];
    uint32_t count = em__client_frame_remaining(frame, sent, rest, EM_CLIENT_FRAME_PIECES_MAX);
    uint64_t at = 0;
    for (uint32_t i = 0; i < count; i++) {
        memcpy(copy + at, rest[i].iov_base, rest[i].iov_len);
        at += rest[i].iov_len;
    }
    free(frame->prefix);
    frame->prefix = copy;
    frame->pieces[0] = (struct iovec){.iov_base = copy, .iov_len = (size_t)left};
    frame->piece_count = 1;
    frame->total = left;
    return EM_OK;
}

void em__client_frame_deinit(em__client_frame *frame)
{
    free(frame->prefix);
    memset(frame, 0, sizeof(*frame));
}

/* ---- responses -------------------------------------------------------------------- */

enum { READ_HEADER, READ_MESSAGE, READ_ATTACHMENT };

void em__client_reader_init(em__client_reader *reader, const em_frame_limits *limits)
{
    memset(reader, 0, sizeof(*reader));
    reader->state = READ_HEADER;
    reader->limits = *limits;
}

void em__client_reader_deinit(em__client_reader *reader)
{
    free(reader->message);
    free(reader->scratch);
    memset(reader, 0, sizeof(*reader));
}

static uint64_t message_length(const em__client_reader *reader)
{
    return reader->header.meta_len + reader->header.body_len;
}

static size_t at_most(uint64_t left, uint64_t limit)
{
    return (size_t)(left < limit ? left : limit);
}

em_status em__client_reader_buffer(em__client_reader *reader, uint8_t **at, size_t *length,
                                   em_error *err)
{
    switch (reader->state) {
    case READ_HEADER:
        /* the previous frame's message has been handled by now */
        free(reader->message);
        reader->message = NULL;
        *at = reader->header_bytes + reader->have;
        *length = EM_FRAME_HEADER_BYTES - (size_t)reader->have;
        return EM_OK;
    case READ_MESSAGE:
        *at = reader->message + reader->have;
        *length = (size_t)(message_length(reader) - reader->have);
        return EM_OK;
    default:
        break;
    }
    uint64_t left = reader->header.attach_len - reader->have;
    if (reader->target != NULL) {
        *at = reader->target + reader->have;
        *length = at_most(left, SIZE_MAX);
        return EM_OK;
    }
    if (reader->scratch == NULL && (reader->scratch = malloc(DISCARD_CHUNK_BYTES)) == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "buffer for a discarded attachment: out of memory");
    *at = reader->scratch;
    *length = at_most(left, DISCARD_CHUNK_BYTES);
    return EM_OK;
}

static em_status header_complete(em__client_reader *reader, em_error *err)
{
    em_status status =
        em_frame_header_decode(reader->header_bytes, &reader->limits, &reader->header, err);
    if (status != EM_OK)
        return status;
    reader->message = malloc(message_length(reader));
    if (reader->message == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED,
                            "response message of %llu bytes: out of memory",
                            (unsigned long long)message_length(reader));
    reader->state = READ_MESSAGE;
    reader->have = 0;
    return EM_OK;
}

static void message_complete(em__client_reader *reader)
{
    reader->have = 0;
    reader->target = NULL;
    reader->state = reader->header.attach_len > 0 ? READ_ATTACHMENT : READ_HEADER;
}

em_status em__client_reader_advance(em__client_reader *reader, size_t n,
                                    em__client_reader_event *event, em_error *err)
{
    *event = EM_CLIENT_READER_MORE;
    reader->have += n;
    switch (reader->state) {
    case READ_HEADER:
        if (reader->have == EM_FRAME_HEADER_BYTES)
            return header_complete(reader, err);
        return EM_OK;
    case READ_MESSAGE:
        if (reader->have == message_length(reader)) {
            message_complete(reader);
            *event = EM_CLIENT_READER_MESSAGE;
        }
        return EM_OK;
    default:
        if (reader->have == reader->header.attach_len) {
            reader->state = READ_HEADER;
            reader->have = 0;
            reader->target = NULL;
            *event = EM_CLIENT_READER_FRAME;
        }
        return EM_OK;
    }
}

void em__client_reader_set_target(em__client_reader *reader, void *target)
{
    reader->target = target;
}
