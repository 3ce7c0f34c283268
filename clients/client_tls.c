#include "clients/client_tls.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/err.h>
#include <openssl/x509v3.h>

struct em__client_tls {
    SSL_CTX *context;
    char *server_name;
};

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

em_status em__client_tls_create(const char *ca_file, const char *cert_file,
                                const char *key_file, const char *server_name,
                                em__client_tls **out, em_error *err)
{
    ERR_clear_error();
    em__client_tls *tls = calloc(1, sizeof(*tls));
    if (tls == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "tls: out of memory");
    tls->context = SSL_CTX_new(TLS_client_method());
    if (tls->context == NULL) {
        free(tls);
        return openssl_error(err, EM_INTERNAL, "tls: cannot create a context");
    }
    SSL_CTX_set_min_proto_version(tls->context, TLS1_2_VERSION);
    SSL_CTX_set_options(tls->context, SSL_OP_IGNORE_UNEXPECTED_EOF);
    SSL_CTX_set_mode(tls->context,
                     SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    SSL_CTX_set_verify(tls->context, SSL_VERIFY_PEER, NULL);
    char what[512];
    em_status status = EM_OK;
    if (SSL_CTX_load_verify_locations(tls->context, ca_file, NULL) != 1) {
        snprintf(what, sizeof(what), "tls CA file '%s'", ca_file);
        status = openssl_error(err, EM_INVALID_ARGUMENT, what);
    } else if (cert_file != NULL && cert_file[0] != '\0' &&
               SSL_CTX_use_certificate_chain_file(tls->context, cert_file) != 1) {
        snprintf(what, sizeof(what), "tls certificate file '%s'", cert_file);
        status = openssl_error(err, EM_INVALID_ARGUMENT, what);
    } else if (cert_file != NULL && cert_file[0] != '\0' &&
               (key_file == NULL ||
                SSL_CTX_use_PrivateKey_file(tls->context, key_file, SSL_FILETYPE_PEM) != 1 ||
                SSL_CTX_check_private_key(tls->context) != 1)) {
        snprintf(what, sizeof(what), "tls key file '%s'", key_file != NULL ? key_file : "(none)");
        status = openssl_error(err, EM_INVALID_ARGUMENT, what);
    }
    if (status == EM_OK && server_name != NULL && server_name[0] != '\0') {
        tls->server_name = strdup(server_name);
        if (tls->server_name == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "tls: out of memory");
    }
    if (status != EM_OK) {
        em__client_tls_destroy(tls);
        return status;
    }
    *out = tls;
    return EM_OK;
}

void em__client_tls_destroy(em__client_tls *tls)
{
    if (tls == NULL)
        return;
    SSL_CTX_free(tls->context);
    free(tls->server_name);
    free(tls);
}

static int elapsed_ms(const struct timespec *start)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int)((now.tv_sec - start->tv_sec) * 1000 + (now.tv_nsec - start->tv_nsec) / 1000000);
}

/* The name the server's certificate must carry: an IP address or a DNS name. */
static int expect_identity(SSL *ssl, const char *name)
{
    unsigned char address[16];
    if (inet_pton(AF_INET, name, address) == 1 || inet_pton(AF_INET6, name, address) == 1)
        return X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), name);
    SSL_set_tlsext_host_name(ssl, name);
    return SSL_set1_host(ssl, name);
}

em_status em__client_tls_connect(const em__client_tls *tls, int fd, const char *host,
                                 const char *server_label, int timeout_ms, SSL **out,
                                 em_error *err)
{
    ERR_clear_error();
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0)
        return em_error_set(err, EM_UNAVAILABLE, "server %s: %s", server_label, strerror(errno));
    SSL *ssl = SSL_new(tls->context);
    if (ssl == NULL || SSL_set_fd(ssl, fd) != 1 ||
        expect_identity(ssl, tls->server_name != NULL ? tls->server_name : host) != 1) {
        SSL_free(ssl);
        return openssl_error(err, EM_INTERNAL, "tls: cannot set up the session");
    }
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        int rc = SSL_connect(ssl);
        if (rc == 1)
            break;
        int reason = SSL_get_error(ssl, rc);
        int left = timeout_ms - elapsed_ms(&start);
        if ((reason == SSL_ERROR_WANT_READ || reason == SSL_ERROR_WANT_WRITE) && left > 0) {
            struct pollfd entry = {.fd = fd,
                                   .events = reason == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT};
            poll(&entry, 1, left);
            continue;
        }
        em_status status;
        long verify = SSL_get_verify_result(ssl);
        if (reason == SSL_ERROR_WANT_READ || reason == SSL_ERROR_WANT_WRITE)
            status = em_error_set(err, EM_UNAVAILABLE,
                                  "server %s: no TLS handshake within %d ms", server_label,
                                  timeout_ms);
        else if (verify != X509_V_OK)
            status = em_error_set(err, EM_UNAUTHENTICATED,
                                  "server %s: its TLS certificate is refused: %s", server_label,
                                  X509_verify_cert_error_string(verify));
        else {
            char what[160];
            snprintf(what, sizeof(what), "server %s: TLS handshake failed", server_label);
            status = openssl_error(err, EM_UNAVAILABLE, what);
        }
        SSL_free(ssl);
        return status;
    }
    *out = ssl;
    return EM_OK;
}

static em__client_tls_result interpret(SSL *ssl, int rc, const char *what, em_error *err)
{
    int reason = SSL_get_error(ssl, rc);
    if (reason == SSL_ERROR_WANT_READ || reason == SSL_ERROR_WANT_WRITE)
        return EM_CLIENT_TLS_WAIT;
    if (reason == SSL_ERROR_ZERO_RETURN)
        return EM_CLIENT_TLS_CLOSED;
    if (reason == SSL_ERROR_SYSCALL && ERR_peek_error() == 0 && errno == 0)
        return EM_CLIENT_TLS_CLOSED;
    openssl_error(err, EM_UNAVAILABLE, what);
    return EM_CLIENT_TLS_FAILED;
}

em__client_tls_result em__client_tls_read(SSL *ssl, void *out, size_t capacity, size_t *got,
                                          em_error *err)
{
    ERR_clear_error();
    errno = 0;
    int piece = capacity > INT_MAX ? INT_MAX : (int)capacity;
    int rc = SSL_read(ssl, out, piece);
    if (rc > 0) {
        *got = (size_t)rc;
        return EM_CLIENT_TLS_DONE;
    }
    return interpret(ssl, rc, "tls read failed", err);
}

em__client_tls_result em__client_tls_write(SSL *ssl, const void *data, size_t length,
                                           size_t *written, em_error *err)
{
    ERR_clear_error();
    errno = 0;
    int piece = length > INT_MAX ? INT_MAX : (int)length;
    int rc = SSL_write(ssl, data, piece);
    if (rc > 0) {
        *written = (size_t)rc;
        return EM_CLIENT_TLS_DONE;
    }
    return interpret(ssl, rc, "tls write failed", err);
}
