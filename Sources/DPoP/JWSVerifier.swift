import Basics
import CCrypto
import WireJSON

/// Checks a compact JWS (RFC 7515) under a set of public JWKs (RFC 7517), as an authorization
/// server checks a JWT client assertion or a platform's identity token (RFC 7523): ES256 with
/// P-256 keys, RS256 and PS256 with RSA keys of 2048 to 8192 bits. Never `none`, never an HMAC
/// algorithm (a public key is no shared secret). Claims are the caller's to check; messages
/// never carry the token or key material.
public enum JWSVerifier {
    /// The longest compact JWS read, in bytes.
    public static let maximumLength = 16_384

    /// The algorithms this verifier implements (an `algorithms` set is narrowed to them).
    public static let supportedAlgorithms: Set<String> = ["ES256", "RS256", "PS256"]

    /// The smallest and largest RSA modulus taken, in bits.
    static let rsaModulusBits = 2048...8192

    /// The header and claims of `compact` once its signature verifies under one of `keys`:
    /// the one the header's `kid` names if it has one, else each key of the algorithm's `kty`
    /// in turn. A JWK's own `alg` and `use`, when present, must allow the signature.
    public static func verify(_ compact: String, keys: [JSONObject],
                              algorithms: Set<String> = ["ES256", "RS256", "PS256"]) throws(DPoPError) -> (header: JSONObject, claims: JSONObject) {
        guard compact.utf8.count <= maximumLength else { throw DPoPError("the JWS is too long") }
        let parts = compact.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let headerBytes = Base64.urlDecode(parts[0]), let claimBytes = Base64.urlDecode(parts[1]),
              let signature = Base64.urlDecode(parts[2]),
              case let .object(header)? = try? JSONParser.parse(ArraySlice(headerBytes)),
              case let .object(claims)? = try? JSONParser.parse(ArraySlice(claimBytes)) else { throw DPoPError("not a compact JWS with JSON claims") }
        guard let algorithm = header["alg"]?.stringValue, supportedAlgorithms.intersection(algorithms).contains(algorithm) else {
            throw DPoPError("the JWS algorithm is not accepted")
        }
        // RFC 7515 §4.1.11: an extension the verifier must understand; this one understands none.
        guard header["crit"] == nil else { throw DPoPError("the JWS header has critical extensions") }
        var candidates = keys
        if let kid = header["kid"] {
            candidates = keys.filter { $0["kid"] == kid }
            guard !candidates.isEmpty else { throw DPoPError("no key has the JWS header's kid") }
        }
        let kty = algorithm == "ES256" ? "EC" : "RSA"
        candidates = candidates.filter { key in
            key["kty"]?.stringValue == kty && (key["alg"] == nil || key["alg"]?.stringValue == algorithm)
                && (key["use"] == nil || key["use"]?.stringValue == "sig")
        }
        guard !candidates.isEmpty else { throw DPoPError("no key fits the JWS algorithm") }
        let message = Array((parts[0] + "." + parts[1]).utf8)
        for key in candidates where verifies(algorithm, key: key, message: message, signature: signature) {
            return (header, claims)
        }
        throw DPoPError("the JWS signature does not verify")
    }

    /// The JWK thumbprint (RFC 7638): SHA-256 of the key's required members in lexical order
    /// (EC: `crv`, `kty`, `x`, `y`; RSA: `e`, `kty`, `n`), base64url; nil for another key type
    /// or a member missing.
    public static func thumbprint(of jwk: JSONObject) -> String? {
        let names: [String]
        switch jwk["kty"]?.stringValue {
        case "EC": names = ["crv", "kty", "x", "y"]
        case "RSA": names = ["e", "kty", "n"]
        default: return nil
        }
        var members: [(key: String, value: JSON)] = []
        for name in names {
            guard let value = jwk[name]?.stringValue else { return nil }
            members.append((name, .string(value)))
        }
        return Base64.urlEncode(DPoPKey.sha256(JSON.object(JSONObject(members)).encoded))
    }

    // MARK: - Signatures

    /// Whether `signature` of `message` verifies under `key` with `algorithm` (false for a key
    /// that cannot be read: another key may still fit).
    private static func verifies(_ algorithm: String, key: JSONObject, message: [UInt8], signature: [UInt8]) -> Bool {
        do {
            if algorithm == "ES256" {
                guard key["crv"]?.stringValue == "P-256", let x = key["x"]?.stringValue.flatMap({ Base64.urlDecode($0) }),
                      let y = key["y"]?.stringValue.flatMap({ Base64.urlDecode($0) }), x.count == 32, y.count == 32,
                      signature.count == 64 else { return false }
                try DPoPVerifier.verifySignature(x: x, y: y, message: message, signature: signature)
            } else {
                guard let n = key["n"]?.stringValue.flatMap({ Base64.urlDecode($0) }),
                      let e = key["e"]?.stringValue.flatMap({ Base64.urlDecode($0) }) else { return false }
                try verifyRSA(n: n, e: e, pss: algorithm == "PS256", message: message, signature: signature)
            }
            return true
        } catch {
            return false
        }
    }

    /// Checks an RS256 (RSASSA-PKCS1-v1_5) or PS256 (RSASSA-PSS, MGF1 and SHA-256, a 32-byte
    /// salt) signature under the RSA public key (`n`, `e`, big-endian).
    private static func verifyRSA(n: [UInt8], e: [UInt8], pss: Bool, message: [UInt8], signature: [UInt8]) throws(DPoPError) {
        let modulus = Array(n.drop { $0 == 0 })
        let exponent = Array(e.drop { $0 == 0 })
        guard rsaModulusBits.contains(modulus.count * 8 - (modulus.first?.leadingZeroBitCount ?? 8)) else {
            throw DPoPError("the RSA key's size is not accepted")
        }
        // An odd public exponent of at least 3 and at most 64 bits.
        guard (1...8).contains(exponent.count), exponent.last.map({ $0 & 1 == 1 }) == true, exponent != [1] else {
            throw DPoPError("the RSA key's exponent is not accepted")
        }
        // RFC 8017 §8.1.2, §8.2.2: a signature is exactly as long as the modulus.
        guard signature.count == modulus.count else { throw DPoPError("the RSA signature has the wrong length") }
        let key = try rsaKey(modulus: modulus, exponent: exponent)
        defer { EVP_PKEY_free(key) }
        guard let digest = EVP_MD_CTX_new() else { throw DPoPError("cannot make a digest context") }
        defer { EVP_MD_CTX_free(digest) }
        var context: OpaquePointer?
        guard EVP_DigestVerifyInit(digest, &context, EVP_sha256(), nil, key) == 1, let context else {
            throw DPoPError("cannot start an RSA verification")
        }
        if pss {
            // RSA_PKCS1_PSS_PADDING (6) and RSA_PSS_SALTLEN_DIGEST (-1: the salt is as long as
            // the digest, 32 bytes, as RFC 7518 §3.5 requires), with MGF1 over SHA-256.
            guard EVP_PKEY_CTX_set_rsa_padding(context, RSA_PKCS1_PSS_PADDING) == 1,
                  EVP_PKEY_CTX_set_rsa_pss_saltlen(context, RSA_PSS_SALTLEN_DIGEST) == 1,
                  EVP_PKEY_CTX_set_rsa_mgf1_md(context, EVP_sha256()) == 1 else { throw DPoPError("cannot set up RSA-PSS") }
        } else {
            guard EVP_PKEY_CTX_set_rsa_padding(context, RSA_PKCS1_PADDING) == 1 else { throw DPoPError("cannot set up RSA PKCS #1 v1.5") }
        }
        let valid = message.withUnsafeBufferPointer { input in
            signature.withUnsafeBufferPointer { signed in
                EVP_DigestVerify(digest, signed.baseAddress, signed.count, input.baseAddress, input.count) == 1
            }
        }
        guard valid else { throw DPoPError("the signature does not verify") }
    }

    /// An RSA public key from its modulus and exponent (big-endian, no leading zeros), made with
    /// `EVP_PKEY_fromdata` from BIGNUM parameters; the caller frees it.
    private static func rsaKey(modulus: [UInt8], exponent: [UInt8]) throws(DPoPError) -> OpaquePointer {
        let n = modulus.withUnsafeBufferPointer { BN_bin2bn($0.baseAddress, Int32($0.count), nil) }
        let e = exponent.withUnsafeBufferPointer { BN_bin2bn($0.baseAddress, Int32($0.count), nil) }
        defer {
            BN_free(n)
            BN_free(e)
        }
        guard let n, let e, let builder = OSSL_PARAM_BLD_new() else { throw DPoPError("cannot read the RSA key") }
        defer { OSSL_PARAM_BLD_free(builder) }
        // (The parameters keep their names' pointers: static strings, not temporary ones.)
        guard OSSL_PARAM_BLD_push_BN(builder, DPoPVerifier.cString("n"), n) == 1, OSSL_PARAM_BLD_push_BN(builder, DPoPVerifier.cString("e"), e) == 1,
              let parameters = OSSL_PARAM_BLD_to_param(builder) else { throw DPoPError("cannot read the RSA key") }
        defer { OSSL_PARAM_free(parameters) }
        guard let context = EVP_PKEY_CTX_new_from_name(nil, "RSA", nil) else { throw DPoPError("cannot make a key context") }
        defer { EVP_PKEY_CTX_free(context) }
        var key: OpaquePointer?
        // EVP_PKEY_PUBLIC_KEY: the public key and its domain and other parameters (a macro of
        // macros Swift does not import).
        let publicKey = Int32(0x02 | 0x04 | 0x80)
        guard EVP_PKEY_fromdata_init(context) == 1, EVP_PKEY_fromdata(context, &key, publicKey, parameters) == 1, let key else {
            throw DPoPError("the jwk is not an RSA public key")
        }
        return key
    }
}
