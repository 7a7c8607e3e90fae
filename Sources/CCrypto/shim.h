// OpenSSL's libcrypto (already loaded by libcurl's TLS): AES-256-GCM and the random source,
// for encrypting tokens at rest; P-256 keys, ECDSA and SHA-256, for DPoP proofs.
#ifndef TOKENBROKER_CCRYPTO_SHIM_H
#define TOKENBROKER_CCRYPTO_SHIM_H

#include <openssl/bn.h>
#include <openssl/ecdsa.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <openssl/x509.h>

#endif
