import Basics
import DPoP
import Testing
import TestSupport
import WireJSON

/// The JWS verifier against signatures made by openssl's command line (ES256, RS256, PS256),
/// never by our own signer. No key or signature is printed: failures name the case only.
@Suite("JWS verifier")
struct JWSVerifierTests {
    /// The public JWK of an openssl key, with `kid` if given.
    static func jwk(_ key: OpenSSLSigningKey, kid: String? = nil) -> JSONObject {
        var members = key.jwk.sorted { $0.key < $1.key }.map { (key: $0.key, value: JSON.string($0.value)) }
        if let kid { members.append((key: "kid", value: .string(kid))) }
        return JSONObject(members)
    }

    /// A JWS of `claims` with `alg` (and `kid`) signed by `key`.
    static func jws(_ key: OpenSSLSigningKey, alg: String, kid: String? = nil, claims: JSON = ["sub": "x"]) async throws -> String {
        var header: JSONObject = ["alg": .string(alg), "typ": "JWT"]
        if let kid { header["kid"] = .string(kid) }
        return try await key.jws(header: String(decoding: JSON.object(header).encoded, as: UTF8.self),
                                 claims: String(decoding: claims.encoded, as: UTF8.self), algorithm: alg)
    }

    @Test("ES256, RS256 and PS256 signatures by openssl verify; a changed payload, another key or another algorithm does not")
    func algorithms() async throws {
        let ec = try await OpenSSLSigningKey(.p256)
        let rsa = try await OpenSSLSigningKey(.rsa(bits: 2048))
        let other = try await OpenSSLSigningKey(.p256)
        for (alg, key) in [("ES256", ec), ("RS256", rsa), ("PS256", rsa)] {
            let token = try await Self.jws(key, alg: alg, claims: ["sub": "alice", "n": 1])
            let verified = try JWSVerifier.verify(token, keys: [Self.jwk(other), Self.jwk(key)])
            #expect(verified.claims["sub"] == "alice" && verified.header["alg"] == .string(alg), "\(alg)")
            // The payload changed under the same signature.
            let parts = token.split(separator: ".")
            let forged = parts[0] + "." + Base64.urlEncode(JSON.object(["sub": "mallory", "n": 1]).encoded) + "." + parts[2]
            #expect(throws: DPoPError.self, "\(alg) forged") { try JWSVerifier.verify(String(forged), keys: [Self.jwk(key)]) }
            #expect(throws: DPoPError.self, "\(alg) another key") { try JWSVerifier.verify(token, keys: [Self.jwk(other)]) }
            // Not among the algorithms accepted.
            #expect(throws: DPoPError.self, "\(alg) not accepted") { try JWSVerifier.verify(token, keys: [Self.jwk(key)], algorithms: JWSVerifier.supportedAlgorithms.subtracting([alg])) }
        }
        // An RS256 signature presented as PS256 (and the other way round) does not verify.
        let rs = try await Self.jws(rsa, alg: "RS256")
        let relabelled = Base64.urlEncode(JSON.object(["alg": "PS256", "typ": "JWT"]).encoded) + "." + rs.split(separator: ".").dropFirst().joined(separator: ".")
        #expect(throws: DPoPError("the JWS signature does not verify")) { try JWSVerifier.verify(relabelled, keys: [Self.jwk(rsa)]) }
    }

    @Test("none, HS256, a crit header, a kid no key has, a small RSA key and an oversized JWS are refused; kid picks the key")
    func refusals() async throws {
        let ec = try await OpenSSLSigningKey(.p256)
        let small = try await OpenSSLSigningKey(.rsa(bits: 1024))
        let claims = Base64.urlEncode(JSON.object(["sub": "x"]).encoded)
        for alg in ["none", "HS256", "ES384"] {
            let header = Base64.urlEncode(JSON.object(["alg": .string(alg)]).encoded)
            #expect(throws: DPoPError("the JWS algorithm is not accepted"), "\(alg)") {
                try JWSVerifier.verify(header + "." + claims + "." + Base64.urlEncode([1, 2, 3]), keys: [Self.jwk(ec)], algorithms: ["ES256", alg])
            }
        }
        let critical = Base64.urlEncode(JSON.object(["alg": "ES256", "crit": ["exp"], "exp": 1]).encoded)
        #expect(throws: DPoPError.self) { try JWSVerifier.verify(critical + "." + claims + "." + Base64.urlEncode([UInt8](repeating: 1, count: 64)), keys: [Self.jwk(ec)]) }
        let named = try await Self.jws(ec, alg: "ES256", kid: "k1")
        #expect(throws: DPoPError("no key has the JWS header's kid")) { try JWSVerifier.verify(named, keys: [Self.jwk(ec, kid: "k2")]) }
        #expect((try? JWSVerifier.verify(named, keys: [Self.jwk(ec, kid: "k1")])) != nil)
        let weak = try await Self.jws(small, alg: "RS256")
        #expect(throws: DPoPError.self) { try JWSVerifier.verify(weak, keys: [Self.jwk(small)]) }
        #expect(throws: DPoPError("the JWS is too long")) {
            try JWSVerifier.verify(String(repeating: "a", count: JWSVerifier.maximumLength + 1), keys: [Self.jwk(ec)])
        }
    }

    @Test("the JWK thumbprint is RFC 7638's (its §3.1 example) and the same as a DPoP key's")
    func thumbprint() throws {
        let example: JSONObject = [
            "kty": "RSA", "alg": "RS256", "kid": "2011-04-29", "e": "AQAB",
            "n": "0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tSoc_BJECPebWKRXjBZCiFV4n3oknjhMstn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65YGjQR0_FDW2QvzqY368QQMicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL5hajrn1n91CbOpbISD08qNLyrdkt-bFTWhAI4vMQFh6WeZu0fM4lFd2NcRwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnqDKgw",
        ]
        #expect(JWSVerifier.thumbprint(of: example) == "NzbLsXh8uDCcd-6MNwXF4W_7noWXFZAfHkxZsRGC9Xs")
        let key = try DPoPKey()
        #expect(JWSVerifier.thumbprint(of: JSONObject(key.jwk.map { (key: $0.name, value: JSON.string($0.value)) })) == key.thumbprint)
        #expect(JWSVerifier.thumbprint(of: ["kty": "oct", "k": "c2VjcmV0"]) == nil)
    }
}
