#include <stdlib.h>
#include <string.h>

#include "clients/client_frame.h"
#include "tests/support/test_support.h"

/* The whole frame as one buffer, through em__client_frame_remaining. */
static uint8_t *flatten(const em__client_frame *frame, uint64_t from)
{
    uint8_t *bytes = malloc(frame->total + 1);
    struct iovec pieces[EM_CLIENT_FRAME_PIECES_MAX];
    uint32_t count = em__client_frame_remaining(frame, from, pieces, EM_CLIENT_FRAME_PIECES_MAX);
    uint64_t at = 0;
    for (uint32_t i = 0; i < count; i++) {
        memcpy(bytes + at, pieces[i].iov_base, pieces[i].iov_len);
        at += pieces[i].iov_len;
    }
    ck_assert_uint_eq(at, frame->total - from);
    return bytes;
}

typedef struct decoded {
    em_frame_header header;
    Ember__RpcMeta *meta;
    const uint8_t *body;
    const uint8_t *attachment;
} decoded;

static decoded decode(const uint8_t *bytes, uint64_t total)
{
    decoded d;
    em_frame_limits limits = em_frame_default_limits();
    em_error err;
    ck_assert_int_eq(em_frame_header_decode(bytes, &limits, &d.header, &err), EM_OK);
    ck_assert_uint_eq(EM_FRAME_HEADER_BYTES + d.header.meta_len + d.header.body_len +
                          d.header.attach_len,
                      total);
    d.meta = ember__rpc_meta__unpack(NULL, d.header.meta_len, bytes + EM_FRAME_HEADER_BYTES);
    ck_assert_ptr_nonnull(d.meta);
    d.body = bytes + EM_FRAME_HEADER_BYTES + d.header.meta_len;
    d.attachment = d.body + d.header.body_len;
    return d;
}

static void assert_meta(const Ember__RpcMeta *meta, uint64_t id, int method, uint64_t deadline,
                        const char *token)
{
    ck_assert_uint_eq(meta->correlation_id, id);
    ck_assert_int_eq(meta->method, method);
    ck_assert_uint_eq(meta->deadline_ms, deadline);
    ck_assert_uint_eq(meta->auth_token.len, strlen(token));
    ck_assert(strlen(token) == 0 || memcmp(meta->auth_token.data, token, strlen(token)) == 0);
}

/* offsets (rows + 1) x u32, zero padding to 8, keys x u64, at the layout's places */
static void assert_csr_attachment(const uint8_t *attachment, const em_csr *csr,
                                  const em_csr_attachment *layout)
{
    uint64_t offsets_end = ((uint64_t)csr->rows + 1) * 4;
    for (uint32_t r = 0; r <= csr->rows; r++)
        ck_assert_uint_eq(em_get_u32(attachment + 4 * r), csr->offsets[r]);
    ck_assert_uint_eq(layout->keys_at % 8, 0);
    for (uint64_t i = offsets_end; i < layout->keys_at; i++)
        ck_assert_msg(attachment[i] == 0, "padding byte %llu is %u", (unsigned long long)i,
                      attachment[i]);
    for (uint64_t k = 0; k < csr->nnz; k++)
        ck_assert_uint_eq(em_get_u64(attachment + layout->keys_at + 8 * k), csr->keys[k]);
}

/* Loop index: rows 2 (offsets end off a multiple of 8: padding) or 3 (none). */
START_TEST(pull_frame_decodes_back)
{
    uint32_t rows = _i == 0 ? 2 : 3;
    const uint32_t offsets[] = {0, 2, 3, 3};
    const uint64_t keys[] = {UINT64_MAX, 42, UINT64_C(7) << 40};
    em_csr csr = {.rows = rows, .nnz = 3, .offsets = offsets, .keys = keys};
    em__client_rpc rpc = {.correlation_id = 77, .method = EMBER__METHOD__PULL,
                          .deadline_ms = 1500, .token = "secret"};
    em__client_frame frame;
    em_error err;
    ck_assert_int_eq(em__client_frame_pull(&rpc, "clicks", &csr, EM_COMBINER_MEAN, true, &frame,
                                           &err),
                     EM_OK);
    uint8_t *bytes = flatten(&frame, 0);
    decoded d = decode(bytes, frame.total);
    assert_meta(d.meta, 77, EMBER__METHOD__PULL, 1500, "secret");
    Ember__PullRequest *body = ember__pull_request__unpack(NULL, d.header.body_len, d.body);
    ck_assert_ptr_nonnull(body);
    ck_assert_str_eq(body->table, "clicks");
    ck_assert_uint_eq(body->rows, rows);
    ck_assert_uint_eq(body->nnz, 3);
    ck_assert_int_eq(body->combiner, EMBER__COMBINER__MEAN);
    ck_assert(body->create_missing);
    em_csr_attachment layout;
    ck_assert_int_eq(em_csr_attachment_layout(rows, 3, 0, &layout, &err), EM_OK);
    ck_assert_uint_eq(d.header.attach_len, layout.total);
    /* 12 bytes of offsets + 4 of padding, or 16 of offsets and no padding piece */
    ck_assert_uint_eq(layout.keys_at, 16);
    ck_assert_uint_eq(frame.piece_count, rows == 2 ? 4 : 3);
    assert_csr_attachment(d.attachment, &csr, &layout);
    ember__pull_request__free_unpacked(body, NULL);
    ember__rpc_meta__free_unpacked(d.meta, NULL);
    free(bytes);
    em__client_frame_deinit(&frame);
}
END_TEST

START_TEST(push_frame_carries_gradients_after_the_keys)
{
    const uint32_t offsets[] = {0, 1, 3};
    const uint64_t keys[] = {5, 6, 7};
    const float gradients[] = {0.5f, -1.0f, 2.0f, -0.0f};
    em_csr csr = {.rows = 2, .nnz = 3, .offsets = offsets, .keys = keys};
    em__client_rpc rpc = {.correlation_id = 9, .method = EMBER__METHOD__PUSH, .token = NULL};
    em__client_frame frame;
    em_error err;
    ck_assert_int_eq(em__client_frame_push(&rpc, "t", &csr, EM_COMBINER_SUM, gradients, 4, &frame,
                                           &err),
                     EM_OK);
    uint8_t *bytes = flatten(&frame, 0);
    decoded d = decode(bytes, frame.total);
    assert_meta(d.meta, 9, EMBER__METHOD__PUSH, 0, "");
    Ember__PushRequest *body = ember__push_request__unpack(NULL, d.header.body_len, d.body);
    ck_assert_ptr_nonnull(body);
    ck_assert_str_eq(body->table, "t");
    ck_assert_uint_eq(body->rows, 2);
    ck_assert_uint_eq(body->nnz, 3);
    ck_assert_int_eq(body->combiner, EMBER__COMBINER__SUM);
    em_csr_attachment layout;
    ck_assert_int_eq(em_csr_attachment_layout(2, 3, 4, &layout, &err), EM_OK);
    ck_assert_uint_eq(d.header.attach_len, layout.total);
    assert_csr_attachment(d.attachment, &csr, &layout);
    ck_assert(memcmp(d.attachment + layout.gradients_at, gradients, sizeof(gradients)) == 0);
    ember__push_request__free_unpacked(body, NULL);
    ember__rpc_meta__free_unpacked(d.meta, NULL);
    free(bytes);
    em__client_frame_deinit(&frame);
}
END_TEST

START_TEST(empty_pull_has_offsets_only)
{
    const uint32_t offsets[] = {0};
    em_csr csr = {.rows = 0, .nnz = 0, .offsets = offsets, .keys = NULL};
    em__client_rpc rpc = {.correlation_id = 1, .method = EMBER__METHOD__PULL};
    em__client_frame frame;
    em_error err;
    ck_assert_int_eq(em__client_frame_pull(&rpc, "t", &csr, EM_COMBINER_NONE, false, &frame, &err),
                     EM_OK);
    /* offsets[0], then 4 bytes of padding to keys_at = 8 */
    ck_assert_uint_eq(frame.attach_len, 8);
    uint8_t *bytes = flatten(&frame, 0);
    decoded d = decode(bytes, frame.total);
    for (int i = 0; i < 8; i++)
        ck_assert_uint_eq(d.attachment[i], 0);
    ember__rpc_meta__free_unpacked(d.meta, NULL);
    free(bytes);
    em__client_frame_deinit(&frame);
}
END_TEST

START_TEST(remaining_bytes_and_detach_resume_anywhere)
{
    const uint32_t offsets[] = {0, 2, 3};
    const uint64_t keys[] = {1, 2, 3};
    const float gradients[] = {1, 2, 3, 4, 5, 6};
    em_csr csr = {.rows = 2, .nnz = 3, .offsets = offsets, .keys = keys};
    em__client_rpc rpc = {.correlation_id = 3, .method = EMBER__METHOD__PUSH, .token = "k"};
    em__client_frame frame;
    em_error err;
    ck_assert_int_eq(em__client_frame_push(&rpc, "t", &csr, EM_COMBINER_SUM, gradients, 6, &frame,
                                           &err),
                     EM_OK);
    uint8_t *whole = flatten(&frame, 0);
    for (uint64_t sent = 0; sent < frame.total; sent++) {
        uint8_t *rest = flatten(&frame, sent);
        ck_assert(memcmp(rest, whole + sent, frame.total - sent) == 0);
        free(rest);
    }
    uint64_t total = frame.total;
    ck_assert_int_eq(em__client_frame_detach(&frame, 29, &err), EM_OK);
    ck_assert_uint_eq(frame.total, total - 29);
    uint8_t *detached = flatten(&frame, 0);
    ck_assert(memcmp(detached, whole + 29, total - 29) == 0);
    free(detached);
    free(whole);
    em__client_frame_deinit(&frame);
}
END_TEST

/* ---- the reader -------------------------------------------------------------------- */

/* A response frame: meta (id, status), body bytes, attachment. */
static uint8_t *response_frame(uint64_t id, const uint8_t *attachment, uint64_t attach_len,
                               size_t *length)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = id;
    meta.method = EMBER__METHOD__PULL;
    Ember__PullResponse body = EMBER__PULL_RESPONSE__INIT;
    body.dim = 2;
    uint8_t *prefix;
    size_t prefix_len;
    em_error err;
    ck_assert_int_eq(em_frame_pack(&meta, &body.base, attach_len, &prefix, &prefix_len, &err),
                     EM_OK);
    uint8_t *frame = malloc(prefix_len + attach_len);
    memcpy(frame, prefix, prefix_len);
    if (attach_len > 0)
        memcpy(frame + prefix_len, attachment, attach_len);
    free(prefix);
    *length = prefix_len + attach_len;
    return frame;
}

/* Feeds bytes in chunks of `chunk` (as recv would deliver them); counts the events. */
static void feed(em__client_reader *reader, const uint8_t *bytes, size_t length, size_t chunk,
                 void *target, int *messages, int *frames)
{
    size_t at = 0;
    em_error err;
    while (at < length) {
        uint8_t *into;
        size_t room;
        ck_assert_int_eq(em__client_reader_buffer(reader, &into, &room, &err), EM_OK);
        size_t n = room < chunk ? room : chunk;
        if (n > length - at)
            n = length - at;
        memcpy(into, bytes + at, n);
        at += n;
        em__client_reader_event event;
        ck_assert_int_eq(em__client_reader_advance(reader, n, &event, &err), EM_OK);
        if (event == EM_CLIENT_READER_MESSAGE) {
            ++*messages;
            Ember__RpcMeta *meta =
                ember__rpc_meta__unpack(NULL, reader->header.meta_len, reader->message);
            ck_assert_ptr_nonnull(meta);
            ck_assert_uint_eq(meta->correlation_id, (uint64_t)*messages);
            ember__rpc_meta__free_unpacked(meta, NULL);
            em__client_reader_set_target(reader, *messages == 1 ? target : NULL);
        }
        if (event == EM_CLIENT_READER_FRAME)
            ++*frames;
    }
}

/* Loop index: chunk size 1, 5, 64 bytes. */
START_TEST(reader_puts_attachments_where_told_in_any_chunking)
{
    static const size_t chunks[] = {1, 5, 64};
    const float vectors[4] = {1.5f, -2.0f, 3.25f, 0.0f};
    size_t first_len, second_len, third_len;
    uint8_t *first = response_frame(1, (const uint8_t *)vectors, sizeof(vectors), &first_len);
    uint8_t *second = response_frame(2, (const uint8_t *)vectors, sizeof(vectors), &second_len);
    uint8_t *third = response_frame(3, NULL, 0, &third_len);
    size_t length = first_len + second_len + third_len;
    uint8_t *stream = malloc(length);
    memcpy(stream, first, first_len);
    memcpy(stream + first_len, second, second_len);
    memcpy(stream + first_len + second_len, third, third_len);

    em_frame_limits limits = em_frame_default_limits();
    em__client_reader reader;
    em__client_reader_init(&reader, &limits);
    float out[4] = {0};
    int messages = 0, frames = 0;
    feed(&reader, stream, length, chunks[_i], out, &messages, &frames);
    ck_assert_int_eq(messages, 3);
    ck_assert_int_eq(frames, 2); /* the third has no attachment */
    ck_assert(memcmp(out, vectors, sizeof(vectors)) == 0);
    em__client_reader_deinit(&reader);
    free(first);
    free(second);
    free(third);
    free(stream);
}
END_TEST

START_TEST(reader_refuses_bad_headers_before_allocating)
{
    em_frame_limits limits = em_frame_default_limits();
    limits.max_attachment = 1024;
    em__client_reader reader;
    em__client_reader_init(&reader, &limits);
    uint8_t *into;
    size_t room;
    em_error err;
    ck_assert_int_eq(em__client_reader_buffer(&reader, &into, &room, &err), EM_OK);
    ck_assert_uint_eq(room, EM_FRAME_HEADER_BYTES);
    em_frame_header header = {.meta_len = 4, .body_len = 0, .attach_len = 4096};
    em_frame_header_encode(&header, into);
    em__client_reader_event event;
    ck_assert_int_eq(em__client_reader_advance(&reader, EM_FRAME_HEADER_BYTES, &event, &err),
                     EM_RESOURCE_EXHAUSTED);
    ck_assert_str_eq(err.message, "frame attach_len 4096 exceeds the limit of 1024 bytes");
    ck_assert_ptr_null(reader.message);
    em__client_reader_deinit(&reader);

    em__client_reader_init(&reader, &limits);
    ck_assert_int_eq(em__client_reader_buffer(&reader, &into, &room, &err), EM_OK);
    memcpy(into, "HTTP/1.1 400 Bad Request\r\n", EM_FRAME_HEADER_BYTES);
    ck_assert_int_eq(em__client_reader_advance(&reader, EM_FRAME_HEADER_BYTES, &event, &err),
                     EM_INVALID_ARGUMENT);
    ck_assert(strstr(err.message, "bad frame magic") != NULL);
    em__client_reader_deinit(&reader);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("client_frame");
    TCase *requests = tcase_create("requests");
    tcase_add_loop_test(requests, pull_frame_decodes_back, 0, 2);
    tcase_add_test(requests, push_frame_carries_gradients_after_the_keys);
    tcase_add_test(requests, empty_pull_has_offsets_only);
    tcase_add_test(requests, remaining_bytes_and_detach_resume_anywhere);
    suite_add_tcase(suite, requests);
    TCase *responses = tcase_create("responses");
    tcase_add_loop_test(responses, reader_puts_attachments_where_told_in_any_chunking, 0, 3);
    tcase_add_test(responses, reader_refuses_bad_headers_before_allocating);
    suite_add_tcase(suite, responses);
    return em_test_run(suite);
}
