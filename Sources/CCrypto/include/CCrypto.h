// OpenSSL's libcrypto: AES-256-GCM and the random source, for encrypting tokens at rest; P-256
// keys, ECDSA and SHA-256, for DPoP proofs; RSA (PKCS #1 v1.5 and PSS) and PEM, for client
// assertions and the development issuer's checks of them.
//
// Not linked: loading libcrypto.so.3 (3,500 relocations) was a sixth of the time between exec
// and READY=1, and a daemon without a state key or DPoP needs none of it to start. The Swift
// modules call OpenSSL's functions by their names, declared by OpenSSL's headers below;
// CCrypto.c defines each of them, hidden, as a call through a pointer that tb_crypto_load()
// resolves from libcrypto.so.3 (the first call loads it; the daemon loads it on a thread of its
// own just after READY=1, while descriptors are plentiful, and logs it if it cannot). A call
// that finds the library still not loadable, or lacking a function, ends the process with a
// line on stderr saying why, as the dynamic loader did at exec when it was linked.
#ifndef TOKENBROKER_CCRYPTO_H
#define TOKENBROKER_CCRYPTO_H

// ES256 with per-signature values made ahead (k^-1 and r, ECDSA_sign_setup) needs the EC_KEY
// interface, deprecated since OpenSSL 3.0 with no EVP replacement: only the tb_ecdsa_*
// functions below use it.
#define OPENSSL_SUPPRESS_DEPRECATED 1

#include <stddef.h>
#include <openssl/bn.h>
#include <openssl/ec.h>
#include <openssl/ecdsa.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/param_build.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/rsa.h>
#include <openssl/x509.h>

/// Loads libcrypto.so.3 and resolves every function CCrypto.c defines (thread-safe; once it
/// succeeded, every later call returns 0 at once). 0, or -1 with why in `reason`; a later call
/// (or the first call into libcrypto) tries again.
int tb_crypto_try_load(char *reason, size_t size);

// The EC_KEY of a P-256 EVP_PKEY, for tb_ecdsa_sign (a reference the caller frees with
// tb_ecdsa_free_key); NULL if it has none.
static inline void *tb_ecdsa_key(EVP_PKEY *pkey) { return EVP_PKEY_get1_EC_KEY(pkey); }

static inline void tb_ecdsa_free_key(void *key) { EC_KEY_free((EC_KEY *)key); }

// A P-256 key of its own, for making per-signature values (they depend on the curve, not on
// the key: k random, r = (kG).x, k^-1 mod n).
static inline void *tb_ecdsa_new_p256(void) {
    EC_KEY *key = EC_KEY_new_by_curve_name(NID_X9_62_prime256v1);
    if (key != NULL && EC_KEY_generate_key(key) != 1) { EC_KEY_free(key); key = NULL; }
    return key;
}

// One per-signature value: k^-1 and r, to be used for one signature only, then cleared.
static inline int tb_ecdsa_setup(void *key, BIGNUM **kinv, BIGNUM **r) {
    return ECDSA_sign_setup((EC_KEY *)key, NULL, kinv, r);
}

// An ES256 signature of a 32-byte digest as r||s (64 bytes), with a value made ahead (kinv
// and r) or, both NULL, one made now. 1 on success.
static inline int tb_ecdsa_sign(void *key, const unsigned char *digest, const BIGNUM *kinv, const BIGNUM *r, unsigned char *out) {
    ECDSA_SIG *sig = ECDSA_do_sign_ex(digest, 32, kinv, r, (EC_KEY *)key);
    if (sig == NULL) return 0;
    const BIGNUM *sr = NULL, *ss = NULL;
    ECDSA_SIG_get0(sig, &sr, &ss);
    int ok = BN_bn2binpad(sr, out, 32) == 32 && BN_bn2binpad(ss, out + 32, 32) == 32;
    ECDSA_SIG_free(sig);
    return ok;
}

#endif
