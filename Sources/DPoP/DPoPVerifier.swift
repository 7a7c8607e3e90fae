import Basics
import CCrypto
import WireJSON

/// Checks a DPoP proof as a server does (RFC 9449 §4.3): its form, its ES256 signature under
/// the public key in its own header, the request it names, its age, and, for a resource
/// request, the access token's hash. For the development issuer and the tests; replayed `jti`s
/// and nonces are the caller's to track.
public enum DPoPVerifier {
    /// What a valid proof says.
    public struct Verified: Sendable, Equatable {
        /// The thumbprint of the key that signed it (a bound token's `cnf.jkt`).
        public var thumbprint: String
        public var jti: String
        public var issuedAt: Int64
        public var nonce: String?
    }

    public static let maximumLength = 8192

    public static func verify(_ proof: String, method: String, url: String, now: Int64, window: Int64 = 60,
                              accessToken: String? = nil) throws(DPoPError) -> Verified {
        guard proof.utf8.count <= maximumLength else { throw DPoPError("the proof is too long") }
        let parts = proof.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let headerBytes = Base64.urlDecode(parts[0]), let claimBytes = Base64.urlDecode(parts[1]), let signature = Base64.urlDecode(parts[2]),
              case let .object(header)? = try? JSONParser.parse(ArraySlice(headerBytes)),
              case let .object(claims)? = try? JSONParser.parse(ArraySlice(claimBytes)) else { throw DPoPError("not a compact JWS") }
        guard header["typ"] == "dpop+jwt", header["alg"] == "ES256" else { throw DPoPError("not an ES256 dpop+jwt") }
        guard let jwk = header["jwk"]?.objectValue, jwk["kty"] == "EC", jwk["crv"] == "P-256", jwk["d"] == nil,
              let x = jwk["x"]?.stringValue.flatMap({ Base64.urlDecode($0) }), let y = jwk["y"]?.stringValue.flatMap({ Base64.urlDecode($0) }),
              x.count == 32, y.count == 32 else { throw DPoPError("the header's jwk is not a P-256 public key") }
        guard signature.count == 64 else { throw DPoPError("not an ES256 signature") }
        try verifySignature(x: x, y: y, message: Array((parts[0] + "." + parts[1]).utf8), signature: signature)
        guard claims["htm"]?.stringValue == method else { throw DPoPError("the proof is for another method") }
        guard let htu = claims["htu"]?.stringValue, let expected = DPoPProof.target(url), DPoPProof.target(htu) == expected else {
            throw DPoPError("the proof is for another URL")
        }
        guard let iat = claims["iat"]?.intValue, iat > now - window, iat < now + window else { throw DPoPError("the proof is too old or from the future") }
        guard let jti = claims["jti"]?.stringValue, !jti.isEmpty, jti.utf8.count <= 256 else { throw DPoPError("the proof has no jti") }
        if let accessToken {
            guard claims["ath"]?.stringValue == Base64.urlEncode(DPoPKey.sha256(Array(accessToken.utf8))) else {
                throw DPoPError("the proof is not for this access token")
            }
        }
        let canonical = #"{"crv":"P-256","kty":"EC","x":"\#(Base64.urlEncode(x))","y":"\#(Base64.urlEncode(y))"}"#
        return Verified(thumbprint: Base64.urlEncode(DPoPKey.sha256(Array(canonical.utf8))), jti: jti, issuedAt: iat,
                        nonce: claims["nonce"]?.stringValue)
    }

    /// A static string's bytes as a C string that lives as long as the program.
    static func cString(_ text: StaticString) -> UnsafePointer<CChar> {
        UnsafeRawPointer(text.utf8Start).assumingMemoryBound(to: CChar.self)
    }

    /// Checks an ES256 signature (JWS r||s, 64 bytes) of `message` under the P-256 public key (`x`, `y`).
    static func verifySignature(x: [UInt8], y: [UInt8], message: [UInt8], signature: [UInt8]) throws(DPoPError) {
        guard let context = EVP_PKEY_CTX_new_from_name(nil, "EC", nil) else { throw DPoPError("cannot make a key context") }
        defer { EVP_PKEY_CTX_free(context) }
        var point = [UInt8(0x04)] + x + y
        var group = Array("P-256".utf8CString)
        var key: OpaquePointer?
        let made: Int32 = group.withUnsafeMutableBufferPointer { groupBuffer in
            point.withUnsafeMutableBytes { pointBuffer in
                // (An OSSL_PARAM keeps its name's pointer: static strings, not temporary ones.)
                var parameters = [OSSL_PARAM_construct_utf8_string(Self.cString("group"), groupBuffer.baseAddress, 0),
                                  OSSL_PARAM_construct_octet_string(Self.cString("pub"), pointBuffer.baseAddress, pointBuffer.count),
                                  OSSL_PARAM_construct_end()]
                guard EVP_PKEY_fromdata_init(context) == 1 else { return 0 }
                // EVP_PKEY_PUBLIC_KEY: the public key and its domain and other parameters (a macro
                // of macros Swift does not import).
                let publicKey = Int32(0x02 | 0x04 | 0x80)
                return EVP_PKEY_fromdata(context, &key, publicKey, &parameters)
            }
        }
        guard made == 1, let key else { throw DPoPError("the jwk is not a point on P-256") }
        defer { EVP_PKEY_free(key) }
        // JWS's r||s as the DER ECDSA-Sig-Value libcrypto verifies.
        guard let sig = ECDSA_SIG_new() else { throw DPoPError("cannot read the signature") }
        defer { ECDSA_SIG_free(sig) }
        let r = signature[0..<32].withUnsafeBufferPointer { BN_bin2bn($0.baseAddress, 32, nil) }
        let s = signature[32..<64].withUnsafeBufferPointer { BN_bin2bn($0.baseAddress, 32, nil) }
        guard let r, let s, ECDSA_SIG_set0(sig, r, s) == 1 else {
            BN_free(r)
            BN_free(s)
            throw DPoPError("cannot read the signature")
        }
        var der: UnsafeMutablePointer<UInt8>?
        let length = i2d_ECDSA_SIG(sig, &der)
        guard length > 0, let der else { throw DPoPError("cannot read the signature") }
        defer { CRYPTO_free(der, #fileID, #line) }
        guard let digest = EVP_MD_CTX_new() else { throw DPoPError("cannot make a digest context") }
        defer { EVP_MD_CTX_free(digest) }
        let valid = message.withUnsafeBufferPointer { input in
            EVP_DigestVerifyInit(digest, nil, EVP_sha256(), nil, key) == 1
                && EVP_DigestVerify(digest, der, Int(length), input.baseAddress, input.count) == 1
        }
        guard valid else { throw DPoPError("the signature does not verify") }
    }
}
