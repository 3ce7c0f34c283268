/* The frame codec (proto/frame.c) and the agreement between the wire Status enum of
 * proto/ember.proto and the status table of lib/base/status.h. */
#include <stdlib.h>
#include <string.h>

#include "lib/base/status.h"
#include "proto/frame.h"
#include "tests/support/test_support.h"

/* Every code of lib/base/status.h has the same name and number in the wire enum, and the
 * wire enum has no other values. */
START_TEST(wire_status_enum_matches_the_status_table)
{
    const ProtobufCEnumDescriptor *wire = &ember__status__descriptor;
    ck_assert_uint_eq(wire->n_values, EM_STATUS_COUNT);
    for (int code = 0; code < EM_STATUS_COUNT; code++) {
        const ProtobufCEnumValue *value = protobuf_c_enum_descriptor_get_value(wire, code);
        ck_assert_msg(value != NULL, "wire enum lacks code %d", code);
        ck_assert_str_eq(value->name, em_status_name((em_status)code));
    }
}
END_TEST

START_TEST(header_round_trip_is_little_endian)
{
    em_frame_header header = {.meta_len = 0x01020304, .body_len = 0x0a0b0c0d0e0f1011ull,
                              .attach_len = 7};
    uint8_t bytes[EM_FRAME_HEADER_BYTES];
    em_frame_header_encode(&header, bytes);
    const uint8_t expected[EM_FRAME_HEADER_BYTES] = {
        'E', 'M', 'B', '1', 0x04, 0x03, 0x02, 0x01, 0x11, 0x10, 0x0f, 0x0e,
        0x0d, 0x0c, 0x0b, 0x0a, 7, 0, 0, 0, 0, 0, 0, 0};
    ck_assert(memcmp(bytes, expected, sizeof(expected)) == 0);
    em_frame_limits limits = {UINT32_MAX, UINT64_MAX, UINT64_MAX};
    em_frame_header decoded;
    em_error err;
    ck_assert_int_eq(em_frame_header_decode(bytes, &limits, &decoded, &err), EM_OK);
    ck_assert_uint_eq(decoded.meta_len, header.meta_len);
    ck_assert_uint_eq(decoded.body_len, header.body_len);
    ck_assert_uint_eq(decoded.attach_len, header.attach_len);
}
END_TEST

START_TEST(decode_checks_magic_and_every_limit)
{
    em_frame_limits limits = {100, 200, 300};
    uint8_t bytes[EM_FRAME_HEADER_BYTES];
    em_frame_header header = {.meta_len = 100, .body_len = 200, .attach_len = 300}, out;
    em_error err;
    em_frame_header_encode(&header, bytes);
    ck_assert_int_eq(em_frame_header_decode(bytes, &limits, &out, &err), EM_OK);
    header.meta_len = 101;
    em_frame_header_encode(&header, bytes);
    ck_assert_int_eq(em_frame_header_decode(bytes, &limits, &out, &err), EM_RESOURCE_EXHAUSTED);
    ck_assert_str_eq(err.message, "frame meta_len 101 exceeds the limit of 100 bytes");
    header = (em_frame_header){1, 201, 0};
    em_frame_header_encode(&header, bytes);
    ck_assert_int_eq(em_frame_header_decode(bytes, &limits, &out, &err), EM_RESOURCE_EXHAUSTED);
    ck_assert_str_eq(err.message, "frame body_len 201 exceeds the limit of 200 bytes");
    header = (em_frame_header){1, 0, 301};
    em_frame_header_encode(&header, bytes);
    ck_assert_int_eq(em_frame_header_decode(bytes, &limits, &out, &err), EM_RESOURCE_EXHAUSTED);
    ck_assert_str_eq(err.message, "frame attach_len 301 exceeds the limit of 300 bytes");
    header = (em_frame_header){0, 0, 0};
    em_frame_header_encode(&header, bytes);
    ck_assert_int_eq(em_frame_header_decode(bytes, &limits, &out, &err), EM_INVALID_ARGUMENT);
    memcpy(bytes, "GET ", 4);
    ck_assert_int_eq(em_frame_header_decode(bytes, &limits, &out, &err), EM_INVALID_ARGUMENT);
    ck_assert_str_eq(err.message, "bad frame magic 47 45 54 20, expected 'EMB1'");
}
END_TEST

START_TEST(csr_layout_pads_to_eight_and_checks_overflow)
{
    em_csr_attachment layout;
    em_error err;
    /* rows 2: offsets take 12 bytes, keys start at 16 */
    ck_assert_int_eq(em_csr_attachment_layout(2, 3, 0, &layout, &err), EM_OK);
    ck_assert_uint_eq(layout.keys_at, 16);
    ck_assert_uint_eq(layout.gradients_at, 40);
    ck_assert_uint_eq(layout.total, 40);
    /* rows 1: offsets take 8 bytes, no padding; 5 gradient floats after 2 keys */
    ck_assert_int_eq(em_csr_attachment_layout(1, 2, 5, &layout, &err), EM_OK);
    ck_assert_uint_eq(layout.keys_at, 8);
    ck_assert_uint_eq(layout.gradients_at, 24);
    ck_assert_uint_eq(layout.total, 44);
    /* counts no attachment could hold are malformed (README: limits convention) */
    ck_assert_int_eq(em_csr_attachment_layout(1, UINT64_MAX / 4, 0, &layout, &err),
                     EM_INVALID_ARGUMENT);
    ck_assert_int_eq(em_csr_attachment_layout(1, 1, UINT64_MAX / 2, &layout, &err),
                     EM_INVALID_ARGUMENT);
    ck_assert_uint_eq(em_align8(UINT64_MAX - 3), UINT64_MAX);
}
END_TEST

START_TEST(pack_writes_header_meta_and_body)
{
    Ember__RpcMeta meta = EMBER__RPC_META__INIT;
    meta.correlation_id = 99;
    meta.method = EMBER__METHOD__DROP_TABLE;
    Ember__DropTableRequest body = EMBER__DROP_TABLE_REQUEST__INIT;
    body.table = "clicks";
    uint8_t *frame = NULL;
    size_t length = 0;
    em_error err;
    ck_assert_int_eq(em_frame_pack(&meta, &body.base, 1234, &frame, &length, &err), EM_OK);
    em_frame_header header;
    em_frame_limits limits = em_frame_default_limits();
    ck_assert_int_eq(em_frame_header_decode(frame, &limits, &header, &err), EM_OK);
    ck_assert_uint_eq(header.attach_len, 1234);
    ck_assert_uint_eq(length, EM_FRAME_HEADER_BYTES + header.meta_len + header.body_len);
    Ember__RpcMeta *decoded_meta =
        ember__rpc_meta__unpack(NULL, header.meta_len, frame + EM_FRAME_HEADER_BYTES);
    ck_assert_uint_eq(decoded_meta->correlation_id, 99);
    ck_assert_int_eq(decoded_meta->method, EMBER__METHOD__DROP_TABLE);
    Ember__DropTableRequest *decoded_body = ember__drop_table_request__unpack(
        NULL, header.body_len, frame + EM_FRAME_HEADER_BYTES + header.meta_len);
    ck_assert_str_eq(decoded_body->table, "clicks");
    ember__drop_table_request__free_unpacked(decoded_body, NULL);
    ember__rpc_meta__free_unpacked(decoded_meta, NULL);
    free(frame);
    ck_assert_str_eq(em_method_name(EMBER__METHOD__CREATE_TABLE), "CREATE_TABLE");
    ck_assert_str_eq(em_method_name(77), "UNKNOWN_METHOD");
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("frame");
    TCase *tc = tcase_create("frame");
    tcase_add_test(tc, wire_status_enum_matches_the_status_table);
    tcase_add_test(tc, header_round_trip_is_little_endian);
    tcase_add_test(tc, decode_checks_magic_and_every_limit);
    tcase_add_test(tc, csr_layout_pads_to_eight_and_checks_overflow);
    tcase_add_test(tc, pack_writes_header_meta_and_body);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
