/*
 * libFuzzer harness: the connection's frame reader, through the real read path.
 *
 * A daemon runs in this process (tests/support/test_daemon.h). Each input is a byte
 * stream sent to its data listener in chunks whose sizes the input's first bytes choose
 * (each chunk its own send, so the server's reads see many cuts), followed by a
 * half-close; the harness reads whatever comes back until the server closes. After
 * every input the daemon must still answer a PING, and once the connection is gone every
 * byte it charged to the memory budget must have been given back.
 */
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/daemon.h"
#include "tests/fuzz/fuzz_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_daemon *daemon = fuzz_daemon_get();
    if (size < 2)
        return 0;
    uint32_t chunking = (uint32_t)data[0] | (uint32_t)data[1] << 8;
    data += 2;
    size -= 2;
    int fd = fuzz_connect(daemon);
    size_t sent = 0;
    uint32_t state = chunking | 1u;
    while (sent < size) {
        state = state * 1103515245u + 12345u;
        size_t chunk = 1 + (state >> 16) % 97;
        if (chunk > size - sent)
            chunk = size - sent;
        if (send(fd, data + sent, chunk, MSG_NOSIGNAL) <= 0)
            break;
        sent += chunk;
    }
    shutdown(fd, SHUT_WR);
    fuzz_drain(fd, 5000);
    close(fd);
    fuzz_daemon_check(daemon);
    return 0;
}
