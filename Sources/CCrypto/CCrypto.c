// See include/CCrypto.h: libcrypto.so.3, opened at the first call into it.
#define _GNU_SOURCE
#include "CCrypto.h"

#include <dlfcn.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

// Every libcrypto function the package calls, once: F(name, return type, parameters,
// arguments) or, returning nothing, V(name, parameters, arguments). Each becomes a pointer
// resolved from libcrypto.so.3 and a hidden function of the same name that calls through it:
// the Swift modules call OpenSSL's names, and the linker finds them here. Hidden, so that
// they are not exported: libssl, loaded by libcurl, binds to libcrypto's own.
// (A function missing from this list fails the link, with its name.)
#define TB_CRYPTO_FUNCTIONS(F, V) \
    F(BIO_ctrl, long, (BIO *bp, int cmd, long larg, void *parg), (bp, cmd, larg, parg)) \
    F(BIO_free, int, (BIO *a), (a)) \
    F(BIO_new, BIO *, (const BIO_METHOD *type), (type)) \
    F(BIO_new_mem_buf, BIO *, (const void *buf, int len), (buf, len)) \
    F(BIO_s_mem, const BIO_METHOD *, (void), ()) \
    F(BN_bin2bn, BIGNUM *, (const unsigned char *s, int len, BIGNUM *ret), (s, len, ret)) \
    F(BN_bn2binpad, int, (const BIGNUM *a, unsigned char *to, int tolen), (a, to, tolen)) \
    V(BN_clear_free, (BIGNUM *a), (a)) \
    V(BN_free, (BIGNUM *a), (a)) \
    F(BN_num_bits, int, (const BIGNUM *a), (a)) \
    V(CRYPTO_clear_free, (void *ptr, size_t num, const char *file, int line), (ptr, num, file, line)) \
    V(CRYPTO_free, (void *ptr, const char *file, int line), (ptr, file, line)) \
    V(ECDSA_SIG_free, (ECDSA_SIG *sig), (sig)) \
    V(ECDSA_SIG_get0, (const ECDSA_SIG *sig, const BIGNUM **pr, const BIGNUM **ps), (sig, pr, ps)) \
    F(ECDSA_SIG_new, ECDSA_SIG *, (void), ()) \
    F(ECDSA_SIG_set0, int, (ECDSA_SIG *sig, BIGNUM *r, BIGNUM *s), (sig, r, s)) \
    F(ECDSA_do_sign_ex, ECDSA_SIG *, (const unsigned char *dgst, int dgstlen, const BIGNUM *kinv, const BIGNUM *rp, EC_KEY *eckey), (dgst, dgstlen, kinv, rp, eckey)) \
    F(ECDSA_sign_setup, int, (EC_KEY *eckey, BN_CTX *ctx, BIGNUM **kinv, BIGNUM **rp), (eckey, ctx, kinv, rp)) \
    V(EC_KEY_free, (EC_KEY *key), (key)) \
    F(EC_KEY_generate_key, int, (EC_KEY *key), (key)) \
    F(EC_KEY_new_by_curve_name, EC_KEY *, (int nid), (nid)) \
    V(ERR_clear_error, (void), ()) \
    F(EVP_CIPHER_CTX_ctrl, int, (EVP_CIPHER_CTX *ctx, int type, int arg, void *ptr), (ctx, type, arg, ptr)) \
    V(EVP_CIPHER_CTX_free, (EVP_CIPHER_CTX *c), (c)) \
    F(EVP_CIPHER_CTX_new, EVP_CIPHER_CTX *, (void), ()) \
    F(EVP_DecryptFinal_ex, int, (EVP_CIPHER_CTX *ctx, unsigned char *outm, int *outl), (ctx, outm, outl)) \
    F(EVP_DecryptInit_ex, int, (EVP_CIPHER_CTX *ctx, const EVP_CIPHER *cipher, ENGINE *impl, const unsigned char *key, const unsigned char *iv), (ctx, cipher, impl, key, iv)) \
    F(EVP_DecryptUpdate, int, (EVP_CIPHER_CTX *ctx, unsigned char *out, int *outl, const unsigned char *in, int inl), (ctx, out, outl, in, inl)) \
    F(EVP_DigestSign, int, (EVP_MD_CTX *ctx, unsigned char *sigret, size_t *siglen, const unsigned char *tbs, size_t tbslen), (ctx, sigret, siglen, tbs, tbslen)) \
    F(EVP_DigestSignInit, int, (EVP_MD_CTX *ctx, EVP_PKEY_CTX **pctx, const EVP_MD *type, ENGINE *e, EVP_PKEY *pkey), (ctx, pctx, type, e, pkey)) \
    F(EVP_DigestVerify, int, (EVP_MD_CTX *ctx, const unsigned char *sigret, size_t siglen, const unsigned char *tbs, size_t tbslen), (ctx, sigret, siglen, tbs, tbslen)) \
    F(EVP_DigestVerifyInit, int, (EVP_MD_CTX *ctx, EVP_PKEY_CTX **pctx, const EVP_MD *type, ENGINE *e, EVP_PKEY *pkey), (ctx, pctx, type, e, pkey)) \
    F(EVP_EncryptFinal_ex, int, (EVP_CIPHER_CTX *ctx, unsigned char *out, int *outl), (ctx, out, outl)) \
    F(EVP_EncryptInit_ex, int, (EVP_CIPHER_CTX *ctx, const EVP_CIPHER *cipher, ENGINE *impl, const unsigned char *key, const unsigned char *iv), (ctx, cipher, impl, key, iv)) \
    F(EVP_EncryptUpdate, int, (EVP_CIPHER_CTX *ctx, unsigned char *out, int *outl, const unsigned char *in, int inl), (ctx, out, outl, in, inl)) \
    V(EVP_MD_CTX_free, (EVP_MD_CTX *ctx), (ctx)) \
    F(EVP_MD_CTX_new, EVP_MD_CTX *, (void), ()) \
    V(EVP_PKEY_CTX_free, (EVP_PKEY_CTX *ctx), (ctx)) \
    F(EVP_PKEY_CTX_new_from_name, EVP_PKEY_CTX *, (OSSL_LIB_CTX *libctx, const char *name, const char *propquery), (libctx, name, propquery)) \
    F(EVP_PKEY_CTX_set_group_name, int, (EVP_PKEY_CTX *ctx, const char *name), (ctx, name)) \
    F(EVP_PKEY_CTX_set_rsa_keygen_bits, int, (EVP_PKEY_CTX *ctx, int bits), (ctx, bits)) \
    F(EVP_PKEY_CTX_set_rsa_mgf1_md, int, (EVP_PKEY_CTX *ctx, const EVP_MD *md), (ctx, md)) \
    F(EVP_PKEY_CTX_set_rsa_padding, int, (EVP_PKEY_CTX *ctx, int pad_mode), (ctx, pad_mode)) \
    F(EVP_PKEY_CTX_set_rsa_pss_saltlen, int, (EVP_PKEY_CTX *ctx, int saltlen), (ctx, saltlen)) \
    V(EVP_PKEY_free, (EVP_PKEY *pkey), (pkey)) \
    F(EVP_PKEY_fromdata, int, (EVP_PKEY_CTX *ctx, EVP_PKEY **ppkey, int selection, OSSL_PARAM param[]), (ctx, ppkey, selection, param)) \
    F(EVP_PKEY_fromdata_init, int, (EVP_PKEY_CTX *ctx), (ctx)) \
    F(EVP_PKEY_generate, int, (EVP_PKEY_CTX *ctx, EVP_PKEY **ppkey), (ctx, ppkey)) \
    F(EVP_PKEY_get1_EC_KEY, struct ec_key_st *, (EVP_PKEY *pkey), (pkey)) \
    F(EVP_PKEY_get_base_id, int, (const EVP_PKEY *pkey), (pkey)) \
    F(EVP_PKEY_get_bits, int, (const EVP_PKEY *pkey), (pkey)) \
    F(EVP_PKEY_get_bn_param, int, (const EVP_PKEY *pkey, const char *key_name, BIGNUM **bn), (pkey, key_name, bn)) \
    F(EVP_PKEY_get_utf8_string_param, int, (const EVP_PKEY *pkey, const char *key_name, char *str, size_t max_buf_sz, size_t *out_sz), (pkey, key_name, str, max_buf_sz, out_sz)) \
    F(EVP_PKEY_keygen_init, int, (EVP_PKEY_CTX *ctx), (ctx)) \
    F(EVP_aes_256_gcm, const EVP_CIPHER *, (void), ()) \
    F(EVP_sha256, const EVP_MD *, (void), ()) \
    V(OSSL_PARAM_BLD_free, (OSSL_PARAM_BLD *bld), (bld)) \
    F(OSSL_PARAM_BLD_new, OSSL_PARAM_BLD *, (void), ()) \
    F(OSSL_PARAM_BLD_push_BN, int, (OSSL_PARAM_BLD *bld, const char *key, const BIGNUM *bn), (bld, key, bn)) \
    F(OSSL_PARAM_BLD_to_param, OSSL_PARAM *, (OSSL_PARAM_BLD *bld), (bld)) \
    F(OSSL_PARAM_construct_end, OSSL_PARAM, (void), ()) \
    F(OSSL_PARAM_construct_octet_string, OSSL_PARAM, (const char *key, void *buf, size_t bsize), (key, buf, bsize)) \
    F(OSSL_PARAM_construct_utf8_string, OSSL_PARAM, (const char *key, char *buf, size_t bsize), (key, buf, bsize)) \
    V(OSSL_PARAM_free, (OSSL_PARAM *p), (p)) \
    F(PEM_read_bio_PrivateKey, EVP_PKEY *, (BIO *out, EVP_PKEY **x, pem_password_cb *cb, void *u), (out, x, cb, u)) \
    F(PEM_write_bio_PrivateKey, int, (BIO *out, const EVP_PKEY *x, const EVP_CIPHER *enc, const unsigned char *kstr, int klen, pem_password_cb *cb, void *u), (out, x, enc, kstr, klen, cb, u)) \
    F(RAND_bytes, int, (unsigned char *buf, int num), (buf, num)) \
    F(SHA256, unsigned char *, (const unsigned char *d, size_t n, unsigned char *md), (d, n, md)) \
    F(d2i_AutoPrivateKey, EVP_PKEY *, (EVP_PKEY **a, const unsigned char **pp, long length), (a, pp, length)) \
    F(i2d_ECDSA_SIG, int, (const ECDSA_SIG *a, unsigned char **out), (a, out)) \
    F(i2d_PUBKEY, int, (const EVP_PKEY *a, unsigned char **out), (a, out)) \
    F(i2d_PrivateKey, int, (const EVP_PKEY *a, unsigned char **pp), (a, pp))

#define TB_POINTER(name, result, parameters, arguments) static result (*p_##name) parameters;
#define TB_VOID_POINTER(name, parameters, arguments) static void (*p_##name) parameters;
TB_CRYPTO_FUNCTIONS(TB_POINTER, TB_VOID_POINTER)

// 1 once every pointer is set (stored with release after them, read with acquire). A load
// that failed leaves it 0, so that the next call tries again: a failure may be passing (no
// descriptor free, no memory).
static int loaded;
static pthread_mutex_t loading = PTHREAD_MUTEX_INITIALIZER;

int tb_crypto_try_load(char *reason, size_t size) {
    if (__atomic_load_n(&loaded, __ATOMIC_ACQUIRE)) return 0;
    pthread_mutex_lock(&loading);
    int result = 0;
    if (!__atomic_load_n(&loaded, __ATOMIC_RELAXED)) {
        void *library = dlopen("libcrypto.so.3", RTLD_NOW | RTLD_LOCAL);
        if (library == NULL) {
            const char *why = dlerror();
            if (reason != NULL && size > 0) snprintf(reason, size, "%s", why ? why : "dlopen(libcrypto.so.3) failed");
            result = -1;
        }
#define TB_RESOLVE(name, result_type, parameters, arguments) \
        if (result == 0) { \
            *(void **)&p_##name = dlsym(library, #name); \
            if (p_##name == NULL) { \
                if (reason != NULL && size > 0) snprintf(reason, size, "libcrypto.so.3 has no %s", #name); \
                result = -1; \
            } \
        }
#define TB_VOID_RESOLVE(name, parameters, arguments) TB_RESOLVE(name, void, parameters, arguments)
        TB_CRYPTO_FUNCTIONS(TB_RESOLVE, TB_VOID_RESOLVE)
        if (result == 0) __atomic_store_n(&loaded, 1, __ATOMIC_RELEASE);
        else if (library != NULL) dlclose(library);
    }
    pthread_mutex_unlock(&loading);
    return result;
}

// A call that finds no library ends the process, saying why: no function here can return
// "libcrypto is missing" to its caller.
static void require(void) {
    char reason[256] = "";
    if (tb_crypto_try_load(reason, sizeof reason) == 0) return;
    char line[400];
    int length = snprintf(line, sizeof line, "<2>cannot use libcrypto.so.3 (OpenSSL 3): %s\n", reason);
    if (length > 0) (void)!write(2, line, (size_t)length < sizeof line ? (size_t)length : sizeof line - 1);
    abort();
}

#define TB_CALL(name, result, parameters, arguments) \
    __attribute__((visibility("hidden"))) result name parameters { \
        if (!__atomic_load_n(&loaded, __ATOMIC_ACQUIRE)) require(); \
        return p_##name arguments; \
    }
#define TB_VOID_CALL(name, parameters, arguments) \
    __attribute__((visibility("hidden"))) void name parameters { \
        if (!__atomic_load_n(&loaded, __ATOMIC_ACQUIRE)) require(); \
        p_##name arguments; \
    }
TB_CRYPTO_FUNCTIONS(TB_CALL, TB_VOID_CALL)
