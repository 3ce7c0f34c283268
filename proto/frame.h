/*
 * DESIGN: the frame layer of the wire protocol (README.md, "Wire protocol"), shared by the
 * daemon and the clients.
 *
 *   offset  size  field
 *    0      4     magic       'E' 'M' 'B' '1'
 *    4      4     meta_len    u32, 1 .. 65536
 *    8      8     body_len    u64, 0 .. 64 MiB
 *   16      8     attach_len  u64, 0 .. limit (default 1 GiB)
 *   24            RpcMeta | body | attachment
 *
 * All integers little-endian. Every length is checked against the reader's limits
 * from the 24 header bytes alone, before anything is allocated. Attachment arrays
 * start at multiples of 8 bytes; em_csr_attachment_layout computes where, with every
 * multiplication checked for overflow.
 */
#ifndef EMBER_PROTO_FRAME_H
#define EMBER_PROTO_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "lib/base/status.h"
#include "proto/ember.pb-c.h"

#define EM_FRAME_HEADER_BYTES 24
#define EM_FRAME_MAGIC "EMB1"
#define EM_FRAME_META_MAX UINT32_C(65536)
#define EM_FRAME_BODY_MAX (UINT64_C(64) << 20)
#define EM_FRAME_ATTACHMENT_DEFAULT_MAX (UINT64_C(1) << 30)

typedef struct em_frame_header {
    uint32_t meta_len;
    uint64_t body_len;
    uint64_t attach_len;
} em_frame_header;

/* What a reader accepts; each at most the protocol maximum. */
typedef struct em_frame_limits {
    uint32_t max_meta;
    uint64_t max_body;
    uint64_t max_attachment;
} em_frame_limits;

/* The protocol maxima (attachment: the 1 GiB default). */
em_frame_limits em_frame_default_limits(void);

void em_frame_header_encode(const em_frame_header *header, uint8_t out[EM_FRAME_HEADER_BYTES]);

/* Checks magic and lengths. Errors: INVALID_ARGUMENT ("bad magic 0x..."),
 * RESOURCE_EXHAUSTED for a length over the limit (naming the field, value, limit). */
em_status em_frame_header_decode(const uint8_t in[EM_FRAME_HEADER_BYTES],
                                 const em_frame_limits *limits, em_frame_header *out,
                                 em_error *err);

/* Little-endian helpers. */
void em_put_u32(uint8_t *out, uint32_t value);
void em_put_u64(uint8_t *out, uint64_t value);
uint32_t em_get_u32(const uint8_t *in);
uint64_t em_get_u64(const uint8_t *in);

/* Rounds up to the next multiple of 8; values near UINT64_MAX saturate to it. */
uint64_t em_align8(uint64_t value);

/* Where the arrays of a PULL or PUSH attachment sit. */
typedef struct em_csr_attachment {
    uint64_t offsets_at;   /* always 0: u32 x (rows + 1) */
    uint64_t keys_at;      /* u64 x nnz, after zero padding to 8 */
    uint64_t gradients_at; /* f32 x gradient_floats (push), after the keys */
    uint64_t total;        /* bytes of the whole attachment */
} em_csr_attachment;

/* Layout of offsets + keys (+ gradient_floats floats, 0 for a pull). Errors:
 * INVALID_ARGUMENT when the sizes overflow 64 bits (no such request can exist). */
em_status em_csr_attachment_layout(uint32_t rows, uint64_t nnz, uint64_t gradient_floats,
                                   em_csr_attachment *out, em_error *err);

/* Serialises header + meta + body into one malloc'ed buffer (the attachment, whose
 * length goes in the header, is sent separately by the caller). body may be NULL for
 * an empty body. Errors: RESOURCE_EXHAUSTED (out of memory, or meta/body over the
 * protocol maximum). */
em_status em_frame_pack(const Ember__RpcMeta *meta, const ProtobufCMessage *body,
                        uint64_t attach_len, uint8_t **out, size_t *out_len, em_error *err);

/* Method names for logs, stats and errors: "PULL", "CREATE_TABLE". */
const char *em_method_name(int method);

#endif
