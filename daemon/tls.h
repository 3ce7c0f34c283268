/*
 * DESIGN: TLS for the daemon's listeners, with OpenSSL over memory BIOs so that the
 * libuv loop keeps owning the sockets.
 *
 * A listener with TLS has an em_tls_server (the certificate, its private key and, for
 * mutual TLS, the CA that client certificates must chain to). Each of its connections
 * has an em_tls_session: ciphertext read from the socket goes in with
 * em_tls_session_receive, the handshake and then the plaintext come out of
 * em_tls_session_handshake and em_tls_session_read, answers go in with
 * em_tls_session_write, and whatever the session has to send (handshake messages,
 * encrypted answers) comes out of em_tls_session_take_output for the connection to
 * write. Nothing here touches a socket or the loop. TLS 1.2 is the oldest version
 * accepted.
 */
#ifndef EMBER_DAEMON_TLS_H
#define EMBER_DAEMON_TLS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lib/base/status.h"

#define EM_TLS_PATH_MAX 256

typedef struct em_tls_config {
    bool enabled;                        /* the "tls" object is present */
    char certificate_file[EM_TLS_PATH_MAX];
    char private_key_file[EM_TLS_PATH_MAX];
    char client_ca_file[EM_TLS_PATH_MAX]; /* "": no client certificates asked for */
    bool data;                            /* the data listener uses TLS */
    bool admin;                           /* the admin listener uses TLS */
} em_tls_config;

typedef struct em_tls_server em_tls_server;
typedef struct em_tls_session em_tls_session;

/* Loads the certificate and key (and the client CA). Errors: INVALID_ARGUMENT naming
 * the file and OpenSSL's reason (unreadable file, key that does not match). */
em_status em_tls_server_create(const em_tls_config *config, em_tls_server **out,
                               em_error *err);
void em_tls_server_destroy(em_tls_server *server);
/* True when clients must present a certificate signed by the client CA. */
bool em_tls_server_verifies_clients(const em_tls_server *server);

/* NULL when out of memory. */
em_tls_session *em_tls_session_create(em_tls_server *server);
void em_tls_session_destroy(em_tls_session *session);

/* Ciphertext from the peer. */
em_status em_tls_session_receive(em_tls_session *session, const uint8_t *data, size_t length,
                                 em_error *err);

/* Advances the handshake with what was received: EM_OK with *done when it completed
 * (at once if it had), EM_OK with !*done while it waits for the peer; an error (the
 * peer's certificate refused, a protocol error) with OpenSSL's reason. */
em_status em_tls_session_handshake(em_tls_session *session, bool *done, em_error *err);

/* Plaintext received: the bytes written to out (0: nothing more until more ciphertext
 * arrives; *closed when the peer said close_notify). Errors: the reason. */
em_status em_tls_session_read(em_tls_session *session, uint8_t *out, size_t capacity,
                              size_t *got, bool *closed, em_error *err);

/* Encrypts length bytes for the peer. */
em_status em_tls_session_write(em_tls_session *session, const void *data, size_t length,
                               em_error *err);

/* What the session has to send, as one malloc'ed buffer (*out NULL, *length 0 when
 * nothing). */
em_status em_tls_session_take_output(em_tls_session *session, uint8_t **out, size_t *length,
                                     em_error *err);

#endif
