/*
 * DESIGN: request frames out, response frames in - the client's side of proto/frame.h.
 *
 * Out: a request is a prefix (24-byte header, RpcMeta, body; one malloc'ed buffer) and
 * an attachment sent straight from the caller's arrays as iovec pieces: offsets, the
 * zero padding that puts the keys at a multiple of 8, keys, gradients. Nothing large
 * is copied; a frame whose caller goes away mid-send is detached (its unsent bytes
 * copied) so the stream stays whole. The arrays travel as they are in memory, so the
 * client requires a little-endian host, as the wire is.
 *
 * In: a reader that says where the next bytes go (the header, then meta + body in one
 * buffer sized from the checked header, then the attachment straight into the buffer
 * its owner names, or a scratch buffer when it is to be discarded) and reports when a
 * frame's message and its whole attachment have arrived. Lengths are checked against
 * the limits before anything is allocated.
 */
#ifndef EMBER_CLIENTS_CLIENT_FRAME_H
#define EMBER_CLIENTS_CLIENT_FRAME_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/uio.h>

#include "lib/table/csr.h"
#include "lib/base/status.h"
#include "proto/frame.h"

/* prefix, offsets, padding, keys, gradients */
#define EM_CLIENT_FRAME_PIECES_MAX 5

typedef struct em__client_frame {
    uint8_t *prefix; /* header + RpcMeta + body (owned), or the detached remainder */
    struct iovec pieces[EM_CLIENT_FRAME_PIECES_MAX];
    uint32_t piece_count;
    uint64_t total;      /* bytes of the whole frame */
    uint64_t attach_len; /* bytes of the attachment */
} em__client_frame;

/* What RpcMeta says about a request. */
typedef struct em__client_rpc {
    uint64_t correlation_id;
    int method;            /* Ember__Method */
    uint32_t deadline_ms;  /* 0: none */
    const char *token;     /* NULL or "": none; borrowed for the call */
} em__client_rpc;

/* A request without attachment (PING, HEALTH, admin methods). body may be NULL.
 * Errors: RESOURCE_EXHAUSTED (out of memory, over the protocol limits). */
em_status em__client_frame_message(const em__client_rpc *rpc, const ProtobufCMessage *body,
                                   em__client_frame *out, em_error *err);

/* A PULL request; batch arrays are borrowed until the frame is sent or detached. */
em_status em__client_frame_pull(const em__client_rpc *rpc, const char *table,
                                const em_csr *batch, em_combiner combiner, bool create_missing,
                                em__client_frame *out, em_error *err);

/* A PUSH request: batch then gradient_count floats of gradients (borrowed). */
em_status em__client_frame_push(const em__client_rpc *rpc, const char *table,
                                const em_csr *batch, em_combiner combiner,
                                const float *gradients, uint64_t gradient_count,
                                em__client_frame *out, em_error *err);

/* Fills out (at most max entries) with the bytes of the frame from byte `sent` on and
 * returns how many entries it used. */
uint32_t em__client_frame_remaining(const em__client_frame *frame, uint64_t sent,
                                    struct iovec *out, uint32_t max);

/* Copies the bytes from `sent` on into memory the frame owns, so the borrowed arrays
 * may go away; afterwards the frame's byte 0 is the old byte `sent`. Errors:
 * RESOURCE_EXHAUSTED. */
em_status em__client_frame_detach(em__client_frame *frame, uint64_t sent, em_error *err);

void em__client_frame_deinit(em__client_frame *frame);

/* ---- reading responses ------------------------------------------------------------ */

typedef enum em__client_reader_event {
    EM_CLIENT_READER_MORE,    /* keep reading */
    EM_CLIENT_READER_MESSAGE, /* meta and body are in; name the attachment's target now */
    EM_CLIENT_READER_FRAME,   /* the attachment is complete (only when attach_len > 0) */
} em__client_reader_event;

typedef struct em__client_reader {
    int state;
    em_frame_limits limits;
    uint8_t header_bytes[EM_FRAME_HEADER_BYTES];
    em_frame_header header; /* of the frame being read */
    uint8_t *message;       /* meta (header.meta_len) then body (header.body_len) */
    uint8_t *target;        /* attachment destination; NULL: discarded */
    uint8_t *scratch;       /* where discarded bytes go */
    uint64_t have;          /* bytes of the current part read so far */
} em__client_reader;

void em__client_reader_init(em__client_reader *reader, const em_frame_limits *limits);
void em__client_reader_deinit(em__client_reader *reader);

/* Where the next bytes read from the stream go, and at most how many. Errors:
 * RESOURCE_EXHAUSTED (out of memory for the message or scratch buffer). */
em_status em__client_reader_buffer(em__client_reader *reader, uint8_t **at, size_t *length,
                                   em_error *err);

/* Records that n bytes were written where em__client_reader_buffer said. Errors: the
 * header's (INVALID_ARGUMENT bad magic, RESOURCE_EXHAUSTED over a limit); the stream
 * cannot continue after one. */
em_status em__client_reader_advance(em__client_reader *reader, size_t n,
                                    em__client_reader_event *event, em_error *err);

/* After EM_CLIENT_READER_MESSAGE with header.attach_len > 0: the attachment goes to
 * target (header.attach_len bytes; NULL to discard it). */
void em__client_reader_set_target(em__client_reader *reader, void *target);

#endif
