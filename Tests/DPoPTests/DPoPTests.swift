import Basics
import DPoP
import Foundation
import Testing
import TestSupport
import WireJSON

/// The DPoP key and proofs, the signatures checked by code we did not write (openssl, against
/// the key's public half).
@Suite("DPoP keys and proofs")
struct DPoPTests {
    static func decode(_ part: Substring) -> [UInt8]? {
        var text = part.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        while text.count % 4 != 0 { text += "=" }
        return Base64.decode(text)
    }

    /// Whether openssl accepts `signature` (JWS r||s) of `message` under the key's public half.
    static func opensslVerifies(_ key: DPoPKey, _ message: [UInt8], _ signature: [UInt8]) throws -> Bool {
        try opensslVerifies(publicDER: key.publicDER, message, signature)
    }

    static func opensslVerifies(publicDER: [UInt8], _ message: [UInt8], _ signature: [UInt8]) throws -> Bool {
        let directory = try FileManager.default.url(for: .itemReplacementDirectory, in: .userDomainMask,
                                                    appropriateFor: URL(fileURLWithPath: NSTemporaryDirectory()), create: true).path
        defer { try? FileManager.default.removeItem(atPath: directory) }
        try Data(publicDER).write(to: URL(fileURLWithPath: directory + "/public.der"))
        try Data(message).write(to: URL(fileURLWithPath: directory + "/message"))
        // JWS's r||s as the DER ECDSA-Sig-Value openssl reads.
        func integer(_ bytes: ArraySlice<UInt8>) -> [UInt8] {
            var value = Array(bytes.drop { $0 == 0 })
            if value.isEmpty { value = [0] }
            if value[0] & 0x80 != 0 { value.insert(0, at: 0) }
            return [0x02, UInt8(value.count)] + value
        }
        let body = integer(signature[0..<32]) + integer(signature[32..<64])
        try Data([0x30, UInt8(body.count)] + body).write(to: URL(fileURLWithPath: directory + "/signature"))
        let run = try Child("/usr/bin/openssl", ["dgst", "-sha256", "-verify", directory + "/public.der", "-keyform", "DER",
                                                 "-signature", directory + "/signature", directory + "/message"], directory: directory)
        let code = await_(run)
        return code == 0
    }

    /// `Child.wait` from a synchronous helper (the test awaits nothing else meanwhile).
    static func await_(_ child: Child) -> Int32 {
        child.process.waitUntilExit()
        return child.process.terminationStatus
    }

    @Test("ES256 signatures verify with openssl; a changed message or another key does not")
    func signatures() throws {
        let key = try DPoPKey()
        let message = Array("header.payload".utf8)
        let signature = try key.sign(message)
        #expect(signature.count == 64)
        #expect(try Self.opensslVerifies(key, message, signature))
        #expect(try !Self.opensslVerifies(key, Array("header.payloaD".utf8), signature))
        #expect(try !Self.opensslVerifies(try DPoPKey(), message, signature))
    }

    @Test("ES256 with values made ahead: every signature verifies, made ahead or inline once the pool is empty; no value signs twice (every r differs)")
    func valuesMadeAhead() async throws {
        let pool = SignatureValues(capacity: 8)
        let key = try SigningKey(for: .es256)
        let jwk = key.publicJWK(algorithm: .es256)
        // The first signature starts the maker; then the pool fills.
        _ = try key.sign([0], .es256, values: pool)
        try await eventually("the pool is full") { pool.counts.ready == pool.capacity }
        let before = pool.counts.taken
        var rs: Set<[UInt8]> = []
        for n in 1...40 {
            let compact = Base64.urlEncode(Array(#"{"alg":"ES256"}"#.utf8)) + "." + Base64.urlEncode(Array(#"{"n":\#(n)}"#.utf8))
            let signature = try key.sign(Array(compact.utf8), .es256, values: pool)
            rs.insert(Array(signature.prefix(32)))
            _ = try JWSVerifier.verify(compact + "." + Base64.urlEncode(signature), keys: [jwk])
        }
        // The first ones came from the pool (and the rest, as the maker kept up or not).
        #expect(pool.counts.taken - before >= pool.capacity)
        #expect(rs.count == 40)
        // And openssl agrees on one made ahead.
        try await eventually("the pool has values again") { pool.counts.ready > 0 }
        let taken = pool.counts.taken
        let signature = try key.sign(Array("ahead".utf8), .es256, values: pool)
        #expect(pool.counts.taken == taken + 1)
        #expect(try Self.opensslVerifies(publicDER: key.publicDER, Array("ahead".utf8), signature))
    }

    @Test("the key survives its sealed form; its thumbprint and JWK stay the same")
    func keptKey() throws {
        let key = try DPoPKey()
        let kept = try DPoPKey(der: key.sealedForm)
        #expect(kept.thumbprint == key.thumbprint && kept.jwk.map(\.value) == key.jwk.map(\.value))
        let signature = try kept.sign(Array("m".utf8))
        #expect(try Self.opensslVerifies(key, Array("m".utf8), signature))
        #expect(throws: DPoPError.self) { try DPoPKey(der: [0x30, 0x03, 0x02, 0x01, 0x00]) }
        #expect(throws: DPoPError.self) { try DPoPKey(der: []) }
    }

    @Test("the JWK thumbprint is RFC 7638's: SHA-256 of the required members in order, base64url")
    func thumbprint() throws {
        let key = try DPoPKey()
        let members = Dictionary(uniqueKeysWithValues: key.jwk.map { ($0.name, $0.value) })
        #expect(key.jwk.map(\.name) == ["crv", "kty", "x", "y"] && members["crv"] == "P-256" && members["kty"] == "EC")
        let canonical = #"{"crv":"P-256","kty":"EC","x":"\#(members["x"]!)","y":"\#(members["y"]!)"}"#
        #expect(key.thumbprint == Base64.urlEncode(DPoPKey.sha256(Array(canonical.utf8))))
        // The SHA-256 itself, against a known answer (FIPS 180-2's "abc").
        #expect(DPoPKey.sha256(Array("abc".utf8)).map { String(format: "%02x", $0) }.joined()
                == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    }

    @Test("a proof: dpop+jwt with the public JWK; jti, htm, htu without query and fragment, iat, nonce, ath; signed over its first two parts")
    func proof() throws {
        let key = try DPoPKey()
        let token = "an-access-token"
        let proof = try DPoPProof.make(key: key, method: "POST", url: "HTTPS://AS.Example.com/token?x=1#f", issuedAt: 1_800_000_000,
                                       nonce: "n-1", accessToken: token, jti: "j-1")
        let parts = proof.split(separator: ".", omittingEmptySubsequences: false)
        #expect(parts.count == 3)
        let headerBytes = try #require(Self.decode(parts[0]))
        let claimBytes = try #require(Self.decode(parts[1]))
        let header = try #require(try JSONParser.parse(ArraySlice(headerBytes)).objectValue)
        let claims = try #require(try JSONParser.parse(ArraySlice(claimBytes)).objectValue)
        #expect(header["typ"] == "dpop+jwt" && header["alg"] == "ES256")
        #expect(header["jwk"]?.objectValue?["x"]?.stringValue == key.jwk.first { $0.name == "x" }?.value)
        #expect(header["jwk"]?.objectValue?["d"] == nil, "never the private part")
        #expect(claims["htm"] == "POST" && claims["htu"] == "https://as.example.com/token" && claims["iat"] == .int(1_800_000_000))
        #expect(claims["jti"] == "j-1" && claims["nonce"] == "n-1")
        #expect(claims["ath"]?.stringValue == Base64.urlEncode(DPoPKey.sha256(Array(token.utf8))))
        let signature = try #require(Self.decode(parts[2]))
        #expect(try Self.opensslVerifies(key, Array((parts[0] + "." + parts[1]).utf8), signature))
        // Each proof its own jti.
        let jtis = try Set((0..<100).map { _ in
            try DPoPProof.make(key: key, method: "GET", url: "https://rs.example/x", issuedAt: 1).split(separator: ".")[1]
        })
        #expect(jtis.count == 100)
    }

    @Test("htu: http(s) with a host only; bad methods and URLs are refused, never normalised into another")
    func targets() throws {
        #expect(DPoPProof.target("https://a.example") == "https://a.example/")
        #expect(DPoPProof.target("http://127.0.0.1:8080/p/q?r#s") == "http://127.0.0.1:8080/p/q")
        // RFC 3986 §6.2.3: the scheme's default port, and an empty one, are left out.
        #expect(DPoPProof.target("HTTPS://A.Example:443/X") == "https://a.example/X")
        #expect(DPoPProof.target("http://a.example:80") == "http://a.example/")
        #expect(DPoPProof.target("https://a.example:80/") == "https://a.example:80/" && DPoPProof.target("https://[::1]:443/") == "https://[::1]/")
        for bad in ["ftp://a/", "https://", "https://user@a/", "a.example/x", "https://a b/", String(repeating: "h", count: 5000),
                    "https://:443/", "http://:80/x", "https://[]/",
                    // Read strictly, not normalised: two ports, an empty one, a backslash, a number for a name.
                    "http://h:8080:80/", "http://a.example:/p", #"http://h:1\@a.example/"#, "http://127.1/"] {
            #expect(DPoPProof.target(bad) == nil, "\(bad.prefix(20))")
        }
        let key = try DPoPKey()
        #expect(throws: DPoPError.self) { try DPoPProof.make(key: key, method: "get", url: "https://a/", issuedAt: 1) }
        #expect(throws: DPoPError.self) { try DPoPProof.make(key: key, method: "GET", url: "mailto:x", issuedAt: 1) }
    }

    @Test("the verifier accepts the proofs the broker makes, and refuses a forged signature, another key's header, another method, URL or token, a stale iat, and a private key in the header")
    func verifier() throws {
        let key = try DPoPKey()
        let token = "access-token-1"
        let proof = try DPoPProof.make(key: key, method: "GET", url: "https://rs.example/api?q=1", issuedAt: 1_000, nonce: "n", accessToken: token)
        let verified = try DPoPVerifier.verify(proof, method: "GET", url: "https://rs.example/api", now: 1_010, accessToken: token)
        #expect(verified.thumbprint == key.thumbprint && verified.nonce == "n" && verified.issuedAt == 1_000)
        func refused(_ proof: String, method: String = "GET", url: String = "https://rs.example/api", now: Int64 = 1_010,
                     accessToken: String? = token) -> Bool {
            (try? DPoPVerifier.verify(proof, method: method, url: url, now: now, accessToken: accessToken)) == nil
        }
        #expect(refused(proof, method: "POST"))
        #expect(refused(proof, url: "https://rs.example/other"))
        #expect(refused(proof, url: "https://evil.example/api"))
        #expect(refused(proof, accessToken: "another-token"))
        #expect(refused(proof, now: 1_100))
        #expect(refused(proof, now: 900))
        // The signature of one proof under another key's header; a flipped signature byte.
        let parts = proof.split(separator: ".").map(String.init)
        let other = try DPoPProof.make(key: try DPoPKey(), method: "GET", url: "https://rs.example/api", issuedAt: 1_000, accessToken: token)
        let otherParts = other.split(separator: ".").map(String.init)
        #expect(refused(otherParts[0] + "." + parts[1] + "." + parts[2]))
        var signature = try #require(Self.decode(Substring(parts[2])))
        signature[10] ^= 0x01
        #expect(refused(parts[0] + "." + parts[1] + "." + Base64.urlEncode(signature)))
        // A header that carries a private key, or an algorithm other than ES256.
        for header in [#"{"typ":"dpop+jwt","alg":"ES256","jwk":{"kty":"EC","crv":"P-256","x":"AA","y":"AA","d":"AA"}}"#,
                       #"{"typ":"dpop+jwt","alg":"none","jwk":{}}"#, #"{"typ":"JWT","alg":"ES256"}"#] {
            #expect(refused(Base64.urlEncode(Array(header.utf8)) + "." + parts[1] + "." + parts[2]))
        }
        #expect(refused("a.b"))
        #expect(refused(String(repeating: "a", count: 9000)))
    }
}
