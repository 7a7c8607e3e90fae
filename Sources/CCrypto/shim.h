// OpenSSL's libcrypto (already loaded by libcurl's TLS): AES-256-GCM and the random source,
// for encrypting tokens at rest; P-256 keys, ECDSA and SHA-256, for DPoP proofs; RSA public keys
// (PKCS #1 v1.5 and PSS), for the development issuer's JWT client assertions.
#ifndef TOKENBROKER_CCRYPTO_SHIM_H
#define TOKENBROKER_CCRYPTO_SHIM_H

#include <openssl/bn.h>
#include <openssl/ecdsa.h>
#include <openssl/evp.h>
#include <openssl/param_build.h>
#include <openssl/rand.h>
#include <openssl/rsa.h>
#include <openssl/x509.h>

#endif
