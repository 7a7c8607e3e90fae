// OpenSSL's libcrypto (already loaded by libcurl's TLS): AES-256-GCM and the random source,
// for encrypting tokens at rest; P-256 keys, ECDSA and SHA-256, for DPoP proofs; RSA (PKCS #1
// v1.5 and PSS) and PEM, for client assertions and the development issuer's checks of them.
#ifndef TOKENBROKER_CCRYPTO_SHIM_H
#define TOKENBROKER_CCRYPTO_SHIM_H

#include <openssl/bn.h>
#include <openssl/ecdsa.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/param_build.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/rsa.h>
#include <openssl/x509.h>

#endif
