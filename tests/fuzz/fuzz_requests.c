/*
 * libFuzzer harness: PULL and PUSH decoding and handlers against a real table.
 *
 * Each input is [method: 1 byte, even PULL, odd PUSH][body length: 2 bytes LE][body]
 * [attachment: the rest]: a well-formed frame whose protobuf body and CSR attachment
 * are the fuzzer's. It goes to a daemon in this process whose table "t" (dim 4) holds
 * keys 0..63. Whatever the answer, the daemon goes on serving; and a request answered
 * with an error (or closed without an answer) must have changed nothing: the table's rows and the values of keys
 * 0..63 are the same before and after it.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/fuzz/fuzz_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_daemon *daemon = fuzz_daemon_get();
    if (size < 3)
        return 0;
    int method = (data[0] & 1) ? EMBER__METHOD__PUSH : EMBER__METHOD__PULL;
    size_t body_length = (size_t)data[1] | (size_t)data[2] << 8;
    if (body_length > size - 3)
        body_length = size - 3;
    const uint8_t *body = data + 3;
    const uint8_t *attachment = body + body_length;
    size_t attachment_length = size - 3 - body_length;

    fuzz_table_state before;
    fuzz_table_state_read(daemon, &before);
    /* -1: no answer read, as when a framing error closes the connection while the rest
     * of the request is still being sent; the checks below apply as to any error */
    int status = fuzz_call_raw(daemon, method, body, body_length, attachment, attachment_length);
    fuzz_table_state after;
    fuzz_table_state_read(daemon, &after);
    if (status != EMBER__STATUS__OK && !fuzz_table_state_equal(&before, &after)) {
        fprintf(stderr, "a %s answered with status %d changed the table\n",
                method == EMBER__METHOD__PUSH ? "PUSH" : "PULL", status);
        abort();
    }
    fuzz_daemon_check(daemon);
    return 0;
}
