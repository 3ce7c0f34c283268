#include "daemon/tls.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

/* The largest piece handed to one SSL_read or SSL_write (they take an int). */
#define TLS_PIECE_MAX ((size_t)1 << 30)

struct em_tls_server {
    SSL_CTX *context;
    bool verify_clients;
};

struct em_tls_session {
    SSL *ssl;
    BIO *network_in;  /* ciphertext received, read by OpenSSL */
    BIO *network_out; /* ciphertext OpenSSL produced, to send */
    bool handshake_done;
};

/* OpenSSL's queued reasons, oldest first, appended to err's message. */
static em_status openssl_error(em_error *err, em_status status, const char *what)
{
    char reasons[384] = "";
    unsigned long code;
    while ((code = ERR_get_error()) != 0) {
        char one[192];
        ERR_error_string_n(code, one, sizeof(one));
        size_t used = strlen(reasons);
        snprintf(reasons + used, sizeof(reasons) - used, "%s%s", used > 0 ? "; " : "", one);
    }
    return em_error_set(err, status, "%s: %s", what,
                        reasons[0] != '\0' ? reasons : "no reason given by OpenSSL");
}

em_status em_tls_server_create(const em_tls_config *config, em_tls_server **out,
                               em_error *err)
{
    ERR_clear_error();
    em_tls_server *server = calloc(1, sizeof(*server));
    if (server == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "tls: out of memory");
    server->context = SSL_CTX_new(TLS_server_method());
    if (server->context == NULL) {
        free(server);
        return openssl_error(err, EM_INTERNAL, "tls: cannot create a context");
    }
    SSL_CTX *context = server->context;
    SSL_CTX_set_min_proto_version(context, TLS1_2_VERSION);
    SSL_CTX_set_options(context, SSL_OP_IGNORE_UNEXPECTED_EOF | SSL_OP_NO_RENEGOTIATION);
    SSL_CTX_set_mode(context, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_RELEASE_BUFFERS);
    char what[EM_TLS_PATH_MAX + 64];
    em_status status = EM_OK;
    if (SSL_CTX_use_certificate_chain_file(context, config->certificate_file) != 1) {
        snprintf(what, sizeof(what), "tls.certificate_file '%s'", config->certificate_file);
        status = openssl_error(err, EM_INVALID_ARGUMENT, what);
    } else if (SSL_CTX_use_PrivateKey_file(context, config->private_key_file,
                                           SSL_FILETYPE_PEM) != 1) {
        snprintf(what, sizeof(what), "tls.private_key_file '%s'", config->private_key_file);
        status = openssl_error(err, EM_INVALID_ARGUMENT, what);
    } else if (SSL_CTX_check_private_key(context) != 1) {
        snprintf(what, sizeof(what), "tls.private_key_file '%s' does not match the certificate",
                 config->private_key_file);
        status = openssl_error(err, EM_INVALID_ARGUMENT, what);
    } else if (config->client_ca_file[0] != '\0') {
        if (SSL_CTX_load_verify_locations(context, config->client_ca_file, NULL) != 1) {
            snprintf(what, sizeof(what), "tls.client_ca_file '%s'", config->client_ca_file);
            status = openssl_error(err, EM_INVALID_ARGUMENT, what);
        } else {
            STACK_OF(X509_NAME) *names = SSL_load_client_CA_file(config->client_ca_file);
            if (names != NULL)
                SSL_CTX_set_client_CA_list(context, names);
            SSL_CTX_set_verify(context, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
            server->verify_clients = true;
        }
    }
    if (status != EM_OK) {
        em_tls_server_destroy(server);
        return status;
    }
    *out = server;
    return EM_OK;
}

void em_tls_server_destroy(em_tls_server *server)
{
    if (server == NULL)
        return;
    SSL_CTX_free(server->context);
    free(server);
}

bool em_tls_server_verifies_clients(const em_tls_server *server)
{
    return server->verify_clients;
}

em_tls_session *em_tls_session_create(em_tls_server *server)
{
    em_tls_session *session = calloc(1, sizeof(*session));
    if (session == NULL)
        return NULL;
    session->ssl = SSL_new(server->context);
    session->network_in = BIO_new(BIO_s_mem());
    session->network_out = BIO_new(BIO_s_mem());
    if (session->ssl == NULL || session->network_in == NULL || session->network_out == NULL) {
        SSL_free(session->ssl);
        BIO_free(session->network_in);
        BIO_free(session->network_out);
        free(session);
        return NULL;
    }
    /* an empty memory BIO reads as "retry", not as end of file */
    BIO_set_mem_eof_return(session->network_in, -1);
    SSL_set_bio(session->ssl, session->network_in, session->network_out);
    SSL_set_accept_state(session->ssl);
    return session;
}

void em_tls_session_destroy(em_tls_session *session)
{
    if (session == NULL)
        return;
    SSL_free(session->ssl); /* frees both BIOs */
    free(session);
}

em_status em_tls_session_receive(em_tls_session *session, const uint8_t *data, size_t length,
                                 em_error *err)
{
    while (length > 0) {
        int piece = length > TLS_PIECE_MAX ? (int)TLS_PIECE_MAX : (int)length;
        int written = BIO_write(session->network_in, data, piece);
        if (written <= 0)
            return em_error_set(err, EM_RESOURCE_EXHAUSTED, "tls: out of memory for input");
        data += written;
        length -= (size_t)written;
    }
    return EM_OK;
}

em_status em_tls_session_handshake(em_tls_session *session, bool *done, em_error *err)
{
    if (session->handshake_done) {
        *done = true;
        return EM_OK;
    }
    ERR_clear_error();
    int rc = SSL_do_handshake(session->ssl);
    if (rc == 1) {
        session->handshake_done = true;
        *done = true;
        return EM_OK;
    }
    int reason = SSL_get_error(session->ssl, rc);
    if (reason == SSL_ERROR_WANT_READ || reason == SSL_ERROR_WANT_WRITE) {
        *done = false;
        return EM_OK;
    }
    long verify = SSL_get_verify_result(session->ssl);
    if (verify != X509_V_OK)
        return em_error_set(err, EM_UNAUTHENTICATED, "tls handshake: client certificate refused: %s",
                            X509_verify_cert_error_string(verify));
    return openssl_error(err, EM_UNAUTHENTICATED, "tls handshake failed");
}

em_status em_tls_session_read(em_tls_session *session, uint8_t *out, size_t capacity,
                              size_t *got, bool *closed, em_error *err)
{
    *got = 0;
    *closed = false;
    if (capacity == 0)
        return EM_OK;
    ERR_clear_error();
    int piece = capacity > TLS_PIECE_MAX ? (int)TLS_PIECE_MAX : (int)capacity;
    int rc = SSL_read(session->ssl, out, piece);
    if (rc > 0) {
        *got = (size_t)rc;
        return EM_OK;
    }
    int reason = SSL_get_error(session->ssl, rc);
    if (reason == SSL_ERROR_WANT_READ || reason == SSL_ERROR_WANT_WRITE)
        return EM_OK;
    if (reason == SSL_ERROR_ZERO_RETURN) {
        *closed = true;
        return EM_OK;
    }
    return openssl_error(err, EM_UNAVAILABLE, "tls read failed");
}

em_status em_tls_session_write(em_tls_session *session, const void *data, size_t length,
                               em_error *err)
{
    const uint8_t *bytes = data;
    ERR_clear_error();
    while (length > 0) {
        int piece = length > TLS_PIECE_MAX ? (int)TLS_PIECE_MAX : (int)length;
        int rc = SSL_write(session->ssl, bytes, piece);
        if (rc <= 0)
            return openssl_error(err, EM_INTERNAL, "tls write failed");
        bytes += rc;
        length -= (size_t)rc;
    }
    return EM_OK;
}

em_status em_tls_session_take_output(em_tls_session *session, uint8_t **out, size_t *length,
                                     em_error *err)
{
    *out = NULL;
    *length = 0;
    size_t pending = BIO_ctrl_pending(session->network_out);
    if (pending == 0)
        return EM_OK;
    uint8_t *buffer = malloc(pending);
    if (buffer == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "tls: out of memory for %zu bytes of output",
                            pending);
    size_t taken = 0;
    while (taken < pending) {
        size_t want = pending - taken;
        int piece = want > TLS_PIECE_MAX ? (int)TLS_PIECE_MAX : (int)want;
        int rc = BIO_read(session->network_out, buffer + taken, piece);
        if (rc <= 0)
            break;
        taken += (size_t)rc;
    }
    *out = buffer;
    *length = taken;
    return EM_OK;
}
