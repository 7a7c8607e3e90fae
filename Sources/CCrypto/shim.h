// OpenSSL's libcrypto (already loaded by libcurl's TLS): AES-256-GCM and the random source,
// for encrypting tokens at rest.
#ifndef TOKENBROKER_CCRYPTO_SHIM_H
#define TOKENBROKER_CCRYPTO_SHIM_H

#include <openssl/evp.h>
#include <openssl/rand.h>

#endif
