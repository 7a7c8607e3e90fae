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
public final class DPoPKey: Sendable {
    /// The P-256 key (its making, reading and signing are `SigningKey`'s).
    private let key: SigningKey
    /// The public key as a JWK (`kty`, `crv`, `x`, `y`), in the members' lexical order.
    public let jwk: [(name: String, value: String)]
    /// The JWK thumbprint (RFC 7638): what a DPoP-bound token's `cnf.jkt` names.
    public var thumbprint: String { key.thumbprint }
    /// A proof's header with this key (`typ` `dpop+jwt`, `alg` ES256, `jwk`), base64url: the
    /// same for every proof, so encoded once.
    public let headerSegment: String

    /// A new key.
    public convenience init() throws(DPoPError) {
        try self.init(SigningKey(for: .es256))
    }

    /// The key kept earlier (`sealedForm`, opened).
    public convenience init(der: [UInt8]) throws(DPoPError) {
        let key: SigningKey
        do { key = try SigningKey(der: der) } catch { throw DPoPError("the kept DPoP key cannot be read") }
        try self.init(key)
    }

    private init(_ key: SigningKey) throws(DPoPError) {
        guard key.family == .ec else { throw DPoPError("a DPoP key must be P-256") }
        self.key = key
        jwk = key.publicMembers
        let header: JSONObject = ["typ": "dpop+jwt", "alg": "ES256", "jwk": .object(JSONObject(jwk.map { (key: $0.name, value: JSON.string($0.value)) }))]
        headerSegment = Base64.urlEncode(JSON.object(header).encoded)
    }

    /// The private key as DER (PKCS #8), for the caller to seal before it is stored.
    public var sealedForm: [UInt8] { key.privateDER }

    /// The public key as DER (SubjectPublicKeyInfo), for verifiers (tests: openssl).
    public var publicDER: [UInt8] { key.publicDER }

    /// An ES256 signature of `message`: r and s, 32 bytes each (JWS's form, RFC 7518 §3.4).
    public func sign(_ message: [UInt8]) throws(DPoPError) -> [UInt8] {
        try key.sign(message, .es256)
    }

    /// SHA-256 of `bytes`.
    public static func sha256(_ bytes: [UInt8]) -> [UInt8] {
        // (SHA256(), not EVP_Digest: the latter looks the algorithm up in the provider tables on
        // every call, half the cost of hashing a token.)
        var digest = [UInt8](repeating: 0, count: 32)
        _ = bytes.withUnsafeBufferPointer { input in
            digest.withUnsafeMutableBufferPointer { SHA256(input.baseAddress, input.count, $0.baseAddress) }
        }
        return digest
    }
}
