import Foundation
import Testing

/// A signing key made, and used, by the openssl command line: JWS signatures (ES256, RS256,
/// PS256) that owe nothing to our own signer, for testing our verifier. The private key stays
/// in a scratch file; only the public JWK members come out.
public final class OpenSSLSigningKey: Sendable {
    /// What key to make.
    public enum Kind: Sendable {
        /// P-256 (ES256).
        case p256
        /// RSA with a modulus of this many bits (RS256, PS256).
        case rsa(bits: Int)
    }

    public struct Failure: Error, CustomStringConvertible {
        public var description: String
    }

    /// The key's directory (`key.pem`, and the messages and signatures of the moment).
    private let directory: String
    /// The public JWK's members: `kty`, and `crv`, `x`, `y` (EC) or `n`, `e` (RSA), base64url.
    public let jwk: [String: String]

    /// Makes a key with `openssl genpkey` and reads its public half.
    public init(_ kind: Kind) async throws {
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("tb-jws-\(UUID().uuidString.prefix(8))").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        ScratchDirectories.removeAtExit(directory)
        let generate: [String] = switch kind {
        case .p256: ["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", directory + "/key.pem"]
        case let .rsa(bits): ["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:\(bits)", "-out", directory + "/key.pem"]
        }
        try await Self.openssl(generate)
        try await Self.openssl(["pkey", "-in", directory + "/key.pem", "-pubout", "-outform", "DER", "-out", directory + "/public.der"])
        let spki = [UInt8](try Data(contentsOf: URL(fileURLWithPath: directory + "/public.der")))
        // SubjectPublicKeyInfo: SEQUENCE { AlgorithmIdentifier, BIT STRING { 0 unused bits, key } }.
        guard let info = DER.read(spki[...]), let algorithm = DER.read(info.content), let bits = DER.read(algorithm.rest),
              bits.tag == 0x03, bits.content.first == 0 else { throw Failure(description: "openssl wrote an unexpected public key") }
        let key = bits.content.dropFirst()
        switch kind {
        case .p256:
            guard key.count == 65, key.first == 0x04 else { throw Failure(description: "not an uncompressed P-256 point") }
            jwk = ["kty": "EC", "crv": "P-256", "x": Self.base64url(Array(key.dropFirst().prefix(32))), "y": Self.base64url(Array(key.suffix(32)))]
        case .rsa:
            // RSAPublicKey: SEQUENCE { INTEGER n, INTEGER e }.
            guard let sequence = DER.read(key), let n = DER.read(sequence.content), let e = DER.read(n.rest) else {
                throw Failure(description: "not an RSA public key")
            }
            jwk = ["kty": "RSA", "n": Self.base64url(Array(n.content.drop { $0 == 0 })), "e": Self.base64url(Array(e.content.drop { $0 == 0 }))]
        }
    }

    /// The signature of `message` with `algorithm` (ES256: JWS's 64-byte r||s from openssl's DER;
    /// RS256: PKCS #1 v1.5; PS256: PSS with MGF1 SHA-256 and a salt as long as the digest).
    public func sign(_ message: [UInt8], algorithm: String) async throws -> [UInt8] {
        let name = UUID().uuidString.prefix(8)
        let messagePath = "\(directory)/\(name).msg"
        let signaturePath = "\(directory)/\(name).sig"
        defer {
            try? FileManager.default.removeItem(atPath: messagePath)
            try? FileManager.default.removeItem(atPath: signaturePath)
        }
        try Data(message).write(to: URL(fileURLWithPath: messagePath))
        var arguments = ["dgst", "-sha256", "-sign", directory + "/key.pem", "-out", signaturePath]
        if algorithm == "PS256" { arguments += ["-sigopt", "rsa_padding_mode:pss", "-sigopt", "rsa_pss_saltlen:digest", "-sigopt", "rsa_mgf1_md:sha256"] }
        try await Self.openssl(arguments + [messagePath])
        let signature = [UInt8](try Data(contentsOf: URL(fileURLWithPath: signaturePath)))
        guard algorithm == "ES256" else { return signature }
        // ECDSA-Sig-Value: SEQUENCE { INTEGER r, INTEGER s }, each to 32 bytes big-endian.
        guard let sequence = DER.read(signature[...]), let r = DER.read(sequence.content), let s = DER.read(r.rest) else {
            throw Failure(description: "openssl wrote an unexpected ECDSA signature")
        }
        func fixed(_ integer: ArraySlice<UInt8>) -> [UInt8] {
            let value = Array(integer.drop { $0 == 0 })
            return [UInt8](repeating: 0, count: max(0, 32 - value.count)) + value
        }
        return fixed(r.content) + fixed(s.content)
    }

    /// A compact JWS of `claims` (JSON text) under `header` (JSON text), signed with `algorithm`.
    public func jws(header: String, claims: String, algorithm: String) async throws -> String {
        let input = Self.base64url(Array(header.utf8)) + "." + Self.base64url(Array(claims.utf8))
        return input + "." + Self.base64url(try await sign(Array(input.utf8), algorithm: algorithm))
    }

    /// Base64url without padding (RFC 7515 §2).
    public static func base64url(_ bytes: [UInt8]) -> String {
        Data(bytes).base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }

    /// Runs openssl to its end (under a 60 s deadline); its output stays in files, never shown.
    private static func openssl(_ arguments: [String]) async throws {
        let run = try await Child.run("/usr/bin/openssl", arguments)
        guard run.code == 0 else { throw Failure(description: "openssl \(arguments.first ?? "") exited with \(run.code)") }
    }

    /// Just enough DER to take apart a public key and an ECDSA signature.
    enum DER {
        /// The first element of `bytes`: its tag, its content, and what follows it.
        static func read(_ bytes: ArraySlice<UInt8>) -> (tag: UInt8, content: ArraySlice<UInt8>, rest: ArraySlice<UInt8>)? {
            var index = bytes.startIndex
            guard bytes.count >= 2 else { return nil }
            let tag = bytes[index]
            index += 1
            var length = Int(bytes[index])
            index += 1
            if length & 0x80 != 0 {
                let count = length & 0x7F
                guard (1...3).contains(count), bytes.endIndex - index >= count else { return nil }
                length = bytes[index..<(index + count)].reduce(0) { $0 << 8 | Int($1) }
                index += count
            }
            guard bytes.endIndex - index >= length else { return nil }
            return (tag, bytes[index..<(index + length)], bytes[(index + length)...])
        }
    }
}
