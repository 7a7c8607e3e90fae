import Basics
import CCrypto
import WireJSON

/// A key that signs JWTs as a client (RFC 7523 client assertions): P-256 for ES256, or RSA
/// (2048 to 8192 bits) for RS256 and PS256. Made here, read from the DER the store keeps,
/// or from an operator's PEM. The private key leaves it only as `privateDER`, for the caller to
/// seal; `jwk` is the public key.
public final class SigningKey: @unchecked Sendable {
    // @unchecked: the EVP_PKEY is made once and then only read (each signature takes a fresh
    // context; libcrypto allows concurrent signing with one key that way).
    private let key: OpaquePointer
    /// A P-256 key's EC_KEY, for ES256 with values made ahead (`SignatureValues`); nil for RSA.
    private let ecdsa: UnsafeMutableRawPointer?
    /// P-256 or RSA.
    public let family: Family
    /// The public key's JWK members (`kty`, `crv`, `x`, `y` or `e`, `kty`, `n`), in lexical order.
    public let publicMembers: [(name: String, value: String)]
    /// Its RFC 7638 thumbprint: the key id (`kid`) tokenbroker gives it.
    public let thumbprint: String

    public enum Family: String, Sendable, Equatable {
        case ec = "EC"
        case rsa = "RSA"
    }

    /// The JWS algorithms tokenbroker signs with (RFC 7518 §3).
    public enum Algorithm: String, Sendable, Equatable, CaseIterable {
        case es256 = "ES256"
        case rs256 = "RS256"
        case ps256 = "PS256"

        /// The key family that signs with it.
        public var family: Family { self == .es256 ? .ec : .rsa }
    }

    /// The RSA modulus a key made here has (NIST SP 800-57: good to 2030; servers take it).
    public static let rsaBits: Int32 = 2048

    /// A new key for `algorithm`: P-256, or RSA of `rsaBits`.
    public convenience init(for algorithm: Algorithm) throws(DPoPError) {
        let rsa = algorithm.family == .rsa
        guard let context = EVP_PKEY_CTX_new_from_name(nil, rsa ? "RSA" : "EC", nil) else { throw DPoPError("cannot make a key context") }
        defer { EVP_PKEY_CTX_free(context) }
        var made: OpaquePointer?
        guard EVP_PKEY_keygen_init(context) == 1,
              rsa ? EVP_PKEY_CTX_set_rsa_keygen_bits(context, Self.rsaBits) == 1 : EVP_PKEY_CTX_set_group_name(context, "P-256") == 1,
              EVP_PKEY_generate(context, &made) == 1, let made else { throw DPoPError("cannot generate a \(rsa ? "RSA" : "P-256") key") }
        try self.init(taking: made)
    }

    /// A key kept as DER (`privateDER`, opened).
    public convenience init(der: [UInt8]) throws(DPoPError) {
        var pointer: UnsafePointer<UInt8>? = nil
        let key: OpaquePointer? = der.withUnsafeBufferPointer { buffer in
            pointer = buffer.baseAddress
            return d2i_AutoPrivateKey(nil, &pointer, buffer.count)
        }
        guard let key else { throw DPoPError("the kept client key cannot be read") }
        try self.init(taking: key)
    }

    /// An operator's private key in PEM (PKCS #8 `PRIVATE KEY`, `EC PRIVATE KEY` or `RSA
    /// PRIVATE KEY`), unencrypted: an encrypted one is refused, never prompted for.
    public convenience init(pem: [UInt8]) throws(DPoPError) {
        guard pem.count <= 64 << 10 else { throw DPoPError("the key file is larger than 64 KiB") }
        if pem.starts(with: Array("-----BEGIN ENCRYPTED PRIVATE KEY-----".utf8))
            || String(decoding: pem.prefix(200), as: UTF8.self).contains("Proc-Type: 4,ENCRYPTED") {
            throw DPoPError("the key is encrypted: give it unencrypted (a systemd credential keeps it encrypted at rest)")
        }
        let key: OpaquePointer? = pem.withUnsafeBytes { buffer in
            guard let bio = BIO_new_mem_buf(buffer.baseAddress, Int32(buffer.count)) else { return nil }
            defer { BIO_free(bio) }
            // A callback that gives no passphrase: libcrypto would otherwise ask on the terminal.
            return PEM_read_bio_PrivateKey(bio, nil, { _, _, _, _ in -1 }, nil)
        }
        ERR_clear_error()
        guard let key else { throw DPoPError("not a PEM private key") }
        try self.init(taking: key)
    }

    private init(taking key: OpaquePointer) throws(DPoPError) {
        self.key = key
        let ecdsa = EVP_PKEY_get_base_id(key) == EVP_PKEY_EC ? tb_ecdsa_key(key) : nil
        ERR_clear_error()
        self.ecdsa = ecdsa
        func refuse(_ why: String) -> DPoPError {
            EVP_PKEY_free(key)
            tb_ecdsa_free_key(ecdsa)
            return DPoPError(why)
        }
        switch EVP_PKEY_get_base_id(key) {
        case EVP_PKEY_EC:
            var group = [CChar](repeating: 0, count: 32)
            var groupLength = 0
            guard EVP_PKEY_get_bits(key) == 256, EVP_PKEY_get_utf8_string_param(key, "group", &group, group.count, &groupLength) == 1,
                  ["prime256v1", "P-256", "secp256r1"].contains(String(decoding: group.prefix(groupLength).map { UInt8(bitPattern: $0) }, as: UTF8.self))
            else { throw refuse("an EC client key must be P-256 (ES256)") }
            guard let x = Self.number(key, "qx", width: 32), let y = Self.number(key, "qy", width: 32) else {
                throw refuse("the key's public point cannot be read")
            }
            // (Every ES256 signature goes through it: `sign`.)
            guard ecdsa != nil else { throw refuse("the key's EC parameters cannot be read") }
            family = .ec
            publicMembers = [("crv", "P-256"), ("kty", "EC"), ("x", Base64.urlEncode(x)), ("y", Base64.urlEncode(y))].map { (name: $0.0, value: $0.1) }
        case EVP_PKEY_RSA:
            let bits = EVP_PKEY_get_bits(key)
            guard bits >= 2048, bits <= 8192 else { throw refuse("an RSA client key must have 2048 to 8192 bits (this one has \(bits))") }
            guard let n = Self.number(key, "n", width: nil), let e = Self.number(key, "e", width: nil) else {
                throw refuse("the key's public part cannot be read")
            }
            family = .rsa
            publicMembers = [("e", Base64.urlEncode(e)), ("kty", "RSA"), ("n", Base64.urlEncode(n))].map { (name: $0.0, value: $0.1) }
        default:
            throw refuse("a client key must be P-256 or RSA")
        }
        // RFC 7638: the required members, in lexical order, no whitespace.
        let canonical = "{" + publicMembers.map { "\"\($0.name)\":\"\($0.value)\"" }.joined(separator: ",") + "}"
        thumbprint = Base64.urlEncode(DPoPKey.sha256(Array(canonical.utf8)))
    }

    deinit {
        EVP_PKEY_free(key)
        tb_ecdsa_free_key(ecdsa)
    }

    /// Whether it signs with `algorithm`.
    public func signs(_ algorithm: Algorithm) -> Bool { algorithm.family == family }

    /// The algorithm it signs with unless a server asks for another: ES256 or RS256.
    public var defaultAlgorithm: Algorithm { family == .ec ? .es256 : .rs256 }

    /// The public key as a JWK to register: its members, `kid` (the thumbprint), `use` `sig`,
    /// and `alg` when one is given.
    public func publicJWK(algorithm: Algorithm? = nil) -> JSONObject {
        var members: [(key: String, value: JSON)] = publicMembers.map { (key: $0.name, value: JSON.string($0.value)) }
        members.append((key: "kid", value: .string(thumbprint)))
        members.append((key: "use", value: .string("sig")))
        if let algorithm { members.append((key: "alg", value: .string(algorithm.rawValue))) }
        return JSONObject(members)
    }

    /// The private key as DER (libcrypto's form for its type: SEC1 for P-256, PKCS #1 for RSA),
    /// for the caller to seal before it is stored.
    public var privateDER: [UInt8] {
        var output: UnsafeMutablePointer<UInt8>?
        let length = i2d_PrivateKey(key, &output)
        guard length > 0, let output else { return [] }
        // (The private key: the buffer is wiped before it is freed.)
        defer { CRYPTO_clear_free(output, Int(length), #fileID, #line) }
        return Array(UnsafeBufferPointer(start: output, count: Int(length)))
    }

    /// The private key as PKCS #8 PEM (`PRIVATE KEY`), as an operator's `ClientKeyFile=` holds
    /// one: for the development server's demo session, which gives its key so.
    public var privatePEM: String {
        guard let bio = BIO_new(BIO_s_mem()) else { return "" }
        defer { BIO_free(bio) }
        guard PEM_write_bio_PrivateKey(bio, key, nil, nil, 0, nil, nil) == 1 else { return "" }
        var pointer: UnsafeMutablePointer<CChar>?
        // BIO_get_mem_data (a macro): BIO_ctrl with BIO_CTRL_INFO (3).
        let length = BIO_ctrl(bio, 3, 0, &pointer)
        guard length > 0, let pointer else { return "" }
        return String(decoding: UnsafeRawBufferPointer(start: pointer, count: length), as: UTF8.self)
    }

    /// The public key as DER (SubjectPublicKeyInfo), for verifiers (tests: openssl).
    public var publicDER: [UInt8] {
        var output: UnsafeMutablePointer<UInt8>?
        let length = i2d_PUBKEY(key, &output)
        guard length > 0, let output else { return [] }
        defer { CRYPTO_free(output, #fileID, #line) }
        return Array(UnsafeBufferPointer(start: output, count: Int(length)))
    }

    /// A signature of `message` as JWS has it: r||s for ES256 (RFC 7518 §3.4), the RSA
    /// signature for RS256 and PS256 (§3.3, §3.5: MGF1 with SHA-256, a 32-byte salt).
    /// ES256 signs with a value made ahead from `values` when one is ready.
    public func sign(_ message: [UInt8], _ algorithm: Algorithm, values: SignatureValues = .shared) throws(DPoPError) -> [UInt8] {
        guard signs(algorithm) else { throw DPoPError("a \(family.rawValue) key cannot sign \(algorithm.rawValue)") }
        // ES256 (a P-256 key always has `ecdsa`: its init refuses one without).
        if algorithm == .es256, let ecdsa {
            let digest = DPoPKey.sha256(message)
            let value = values.take()
            var signature = [UInt8](repeating: 0, count: 64)
            let signed = digest.withUnsafeBufferPointer { digest in
                signature.withUnsafeMutableBufferPointer { tb_ecdsa_sign(ecdsa, digest.baseAddress, value?.kinv, value?.r, $0.baseAddress) }
            }
            guard signed == 1 else {
                ERR_clear_error()
                throw DPoPError("cannot sign")
            }
            return signature
        }
        guard let context = EVP_MD_CTX_new() else { throw DPoPError("cannot make a digest context") }
        defer { EVP_MD_CTX_free(context) }
        var keyContext: OpaquePointer?
        guard EVP_DigestSignInit(context, &keyContext, EVP_sha256(), nil, key) == 1 else { throw DPoPError("cannot sign") }
        if algorithm == .ps256 {
            // RSA_PKCS1_PSS_PADDING (6); RSA_PSS_SALTLEN_DIGEST (-1): the salt as long as the digest.
            guard EVP_PKEY_CTX_set_rsa_padding(keyContext, 6) == 1, EVP_PKEY_CTX_set_rsa_pss_saltlen(keyContext, -1) == 1 else {
                throw DPoPError("cannot sign with PSS padding")
            }
        }
        var length = 0
        guard message.withUnsafeBufferPointer({ EVP_DigestSign(context, nil, &length, $0.baseAddress, $0.count) }) == 1 else {
            throw DPoPError("cannot sign")
        }
        var signature = [UInt8](repeating: 0, count: length)
        guard message.withUnsafeBufferPointer({ input in
            signature.withUnsafeMutableBufferPointer { EVP_DigestSign(context, $0.baseAddress, &length, input.baseAddress, input.count) }
        }) == 1 else { throw DPoPError("cannot sign") }
        signature.removeLast(signature.count - length)
        return signature
    }

    /// A compact JWS of `claims`, its header `alg`, `kid` (the thumbprint) and `typ` `JWT`.
    public func jwt(_ claims: JSONObject, _ algorithm: Algorithm) throws(DPoPError) -> String {
        let header: JSONObject = ["alg": .string(algorithm.rawValue), "kid": .string(thumbprint), "typ": "JWT"]
        let signingInput = Base64.urlEncode(JSON.object(header).encoded) + "." + Base64.urlEncode(JSON.object(claims).encoded)
        return signingInput + "." + Base64.urlEncode(try sign(Array(signingInput.utf8), algorithm))
    }

    /// A big number parameter of the key, big-endian; `width`: padded to it.
    private static func number(_ key: OpaquePointer, _ name: String, width: Int32?) -> [UInt8]? {
        var number: OpaquePointer?
        defer { BN_free(number) }
        guard EVP_PKEY_get_bn_param(key, name, &number) == 1, let number else { return nil }
        if let width { return bytes(number, width) }
        return bytes(number, (BN_num_bits(number) + 7) / 8)
    }

    private static func bytes(_ number: OpaquePointer, _ width: Int32) -> [UInt8] {
        var output = [UInt8](repeating: 0, count: Int(width))
        _ = output.withUnsafeMutableBufferPointer { BN_bn2binpad(number, $0.baseAddress, width) }
        return output
    }
}
