import Basics
import CCrypto
import WireJSON

/// A failure of the DPoP key or a signature. Messages never carry key material.
public struct DPoPError: Error, Sendable, Equatable, CustomStringConvertible {
    public var description: String
    public init(_ description: String) { self.description = description }
}

/// A session's DPoP key (RFC 9449): P-256, signing with ES256. The private key never leaves
/// it but as `sealedForm` (DER, for the caller to seal); proofs carry the public key as a JWK.
public final class DPoPKey: @unchecked Sendable {
    // @unchecked: the EVP_PKEY is created once and then only read (signing takes a fresh
    // context per signature; libcrypto allows concurrent use of a key for that).
    private let key: OpaquePointer
    /// The public key as a JWK (`kty`, `crv`, `x`, `y`), in the members' lexical order.
    public let jwk: [(name: String, value: String)]
    /// The JWK thumbprint (RFC 7638): what a DPoP-bound token's `cnf.jkt` names.
    public let thumbprint: String
    /// A proof's header with this key (`typ` `dpop+jwt`, `alg` ES256, `jwk`), base64url: the
    /// same for every proof, so encoded once.
    public let headerSegment: String

    /// A new key.
    public convenience init() throws(DPoPError) {
        guard let context = EVP_PKEY_CTX_new_from_name(nil, "EC", nil) else { throw DPoPError("cannot make a key context") }
        defer { EVP_PKEY_CTX_free(context) }
        var made: OpaquePointer?
        guard EVP_PKEY_keygen_init(context) == 1, EVP_PKEY_CTX_set_group_name(context, "P-256") == 1,
              EVP_PKEY_generate(context, &made) == 1, let made else { throw DPoPError("cannot generate a P-256 key") }
        try self.init(taking: made)
    }

    /// The key kept earlier (`sealedForm`, opened).
    public convenience init(der: [UInt8]) throws(DPoPError) {
        var pointer: UnsafePointer<UInt8>? = nil
        let key: OpaquePointer? = der.withUnsafeBufferPointer { buffer in
            pointer = buffer.baseAddress
            return d2i_AutoPrivateKey(nil, &pointer, buffer.count)
        }
        guard let key else { throw DPoPError("the kept DPoP key cannot be read") }
        try self.init(taking: key)
    }

    private init(taking key: OpaquePointer) throws(DPoPError) {
        self.key = key
        // P-256 by its group's name (other 256-bit curves exist: secp256k1, brainpool).
        var group = [CChar](repeating: 0, count: 32)
        var groupLength = 0
        guard EVP_PKEY_get_base_id(key) == EVP_PKEY_EC, EVP_PKEY_get_bits(key) == 256,
              EVP_PKEY_get_utf8_string_param(key, "group", &group, group.count, &groupLength) == 1,
              ["prime256v1", "P-256", "secp256r1"].contains(String(decoding: group.prefix(groupLength).map { UInt8(bitPattern: $0) }, as: UTF8.self))
        else {
            EVP_PKEY_free(key)
            throw DPoPError("a DPoP key must be P-256")
        }
        var x: OpaquePointer?
        var y: OpaquePointer?
        defer {
            BN_free(x)
            BN_free(y)
        }
        guard EVP_PKEY_get_bn_param(key, "qx", &x) == 1, EVP_PKEY_get_bn_param(key, "qy", &y) == 1, let x, let y else {
            EVP_PKEY_free(key)
            throw DPoPError("the DPoP key's public point cannot be read")
        }
        let members = [("crv", "P-256"), ("kty", "EC"), ("x", Base64.urlEncode(Self.bytes(x, 32))), ("y", Base64.urlEncode(Self.bytes(y, 32)))]
        jwk = members.map { (name: $0.0, value: $0.1) }
        // RFC 7638: the required members, in lexical order, no whitespace.
        let canonical = "{" + members.map { "\"\($0.0)\":\"\($0.1)\"" }.joined(separator: ",") + "}"
        thumbprint = Base64.urlEncode(DPoPKey.sha256(Array(canonical.utf8)))
        let header: JSONObject = ["typ": "dpop+jwt", "alg": "ES256", "jwk": .object(JSONObject(members.map { (key: $0.0, value: JSON.string($0.1)) }))]
        headerSegment = Base64.urlEncode(JSON.object(header).encoded)
    }

    deinit { EVP_PKEY_free(key) }

    /// The private key as DER (PKCS #8), for the caller to seal before it is stored.
    public var sealedForm: [UInt8] {
        var output: UnsafeMutablePointer<UInt8>?
        let length = i2d_PrivateKey(key, &output)
        guard length > 0, let output else { return [] }
        // (The private key: the buffer is wiped before it is freed.)
        defer { CRYPTO_clear_free(output, Int(length), #fileID, #line) }
        return Array(UnsafeBufferPointer(start: output, count: Int(length)))
    }

    /// The public key as DER (SubjectPublicKeyInfo), for verifiers (tests: openssl).
    public var publicDER: [UInt8] {
        var output: UnsafeMutablePointer<UInt8>?
        let length = i2d_PUBKEY(key, &output)
        guard length > 0, let output else { return [] }
        defer { CRYPTO_free(output, #fileID, #line) }
        return Array(UnsafeBufferPointer(start: output, count: Int(length)))
    }

    /// An ES256 signature of `message`: r and s, 32 bytes each (JWS's form, RFC 7518 §3.4).
    public func sign(_ message: [UInt8]) throws(DPoPError) -> [UInt8] {
        guard let context = EVP_MD_CTX_new() else { throw DPoPError("cannot make a digest context") }
        defer { EVP_MD_CTX_free(context) }
        var length = 0
        guard EVP_DigestSignInit(context, nil, EVP_sha256(), nil, key) == 1,
              message.withUnsafeBufferPointer({ EVP_DigestSign(context, nil, &length, $0.baseAddress, $0.count) }) == 1 else {
            throw DPoPError("cannot sign")
        }
        var der = [UInt8](repeating: 0, count: length)
        guard message.withUnsafeBufferPointer({ input in
            der.withUnsafeMutableBufferPointer { EVP_DigestSign(context, $0.baseAddress, &length, input.baseAddress, input.count) }
        }) == 1 else { throw DPoPError("cannot sign") }
        var pointer: UnsafePointer<UInt8>? = nil
        let signature: OpaquePointer? = der.withUnsafeBufferPointer { buffer in
            pointer = buffer.baseAddress
            return d2i_ECDSA_SIG(nil, &pointer, length)
        }
        guard let signature else { throw DPoPError("cannot read the signature") }
        defer { ECDSA_SIG_free(signature) }
        var r: OpaquePointer?
        var s: OpaquePointer?
        ECDSA_SIG_get0(signature, &r, &s)
        guard let r, let s else { throw DPoPError("cannot read the signature") }
        return Self.bytes(r, 32) + Self.bytes(s, 32)
    }

    /// SHA-256 of `bytes`.
    public static func sha256(_ bytes: [UInt8]) -> [UInt8] {
        var digest = [UInt8](repeating: 0, count: 32)
        var length: UInt32 = 0
        _ = bytes.withUnsafeBufferPointer { input in
            digest.withUnsafeMutableBufferPointer { EVP_Digest(input.baseAddress, input.count, $0.baseAddress, &length, EVP_sha256(), nil) }
        }
        return digest
    }

    private static func bytes(_ number: OpaquePointer, _ width: Int32) -> [UInt8] {
        var output = [UInt8](repeating: 0, count: Int(width))
        _ = output.withUnsafeMutableBufferPointer { BN_bn2binpad(number, $0.baseAddress, width) }
        return output
    }
}
