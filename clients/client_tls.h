/*
 * DESIGN: TLS for the client's connections (OpenSSL on the connection's own socket).
 *
 * One em__client_tls per client holds the trust (the CA file that server certificates
 * must chain to) and, for mutual TLS, the client's certificate and key. Each connection
 * makes its session with em__client_tls_connect, which does the handshake within the
 * connect timeout, checking that the server's certificate names the host the client
 * dialled (a DNS name or an IP address) or the configured server name. Afterwards the
 * connection reads and writes through the session with the same non-blocking rules as
 * the plain socket (client_connection.h).
 */
#ifndef EMBER_CLIENTS_CLIENT_TLS_H
#define EMBER_CLIENTS_CLIENT_TLS_H

#include <openssl/ssl.h>

#include "lib/base/status.h"

typedef struct em__client_tls em__client_tls;

/* Errors: INVALID_ARGUMENT naming the file and OpenSSL's reason. cert_file and
 * key_file may be NULL (no client certificate); server_name NULL: check the host. */
em_status em__client_tls_create(const char *ca_file, const char *cert_file,
                                const char *key_file, const char *server_name,
                                em__client_tls **out, em_error *err);
void em__client_tls_destroy(em__client_tls *tls);

/* Handshake on fd (connected; left non-blocking) with the server dialled as host, within
 * timeout_ms. Errors: UNAVAILABLE (timeout, I/O), UNAUTHENTICATED (certificate refused),
 * each naming server_label and the reason. */
em_status em__client_tls_connect(const em__client_tls *tls, int fd, const char *host,
                                 const char *server_label, int timeout_ms, SSL **out,
                                 em_error *err);

/* What an SSL call's result means for a non-blocking connection. */
typedef enum em__client_tls_result {
    EM_CLIENT_TLS_DONE,   /* bytes moved */
    EM_CLIENT_TLS_WAIT,   /* try again when poll says so */
    EM_CLIENT_TLS_CLOSED, /* the server closed the session */
    EM_CLIENT_TLS_FAILED, /* *err says why */
} em__client_tls_result;

em__client_tls_result em__client_tls_read(SSL *ssl, void *out, size_t capacity, size_t *got,
                                          em_error *err);
em__client_tls_result em__client_tls_write(SSL *ssl, const void *data, size_t length,
                                           size_t *written, em_error *err);

#endif
