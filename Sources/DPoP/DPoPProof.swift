import Basics
import WireJSON

/// DPoP proofs (RFC 9449 §4): a compact JWS, `typ` `dpop+jwt`, `alg` ES256, the public key in
/// `jwk`; claims `jti` (unique), `htm`, `htu` (without query and fragment), `iat`, and, where
/// they apply, the server's `nonce` and `ath` (the access token's SHA-256, for resource requests).
public enum DPoPProof {
    /// A proof for a request of `method` to `url`.
    /// - Parameters:
    ///   - jti: unique per proof (random by default).
    ///   - accessToken: the token the request carries (a resource request): its hash goes in `ath`.
    ///   - target: `target(url)`, when the caller has it already (reading a URL costs more than
    ///     the rest of a proof but its signature).
    ///   - accessTokenHash: `accessToken`'s `ath`, when the caller keeps it (a token is hashed once,
    ///     not once per proof).
    public static func make(key: DPoPKey, method: String, url: String, target known: String? = nil, issuedAt: Int64, nonce: String? = nil,
                            accessToken: String? = nil, accessTokenHash: String? = nil, jti: String = randomJTI()) throws(DPoPError) -> String {
        guard let htu = known ?? target(url) else { throw DPoPError("not an http(s) URL") }
        guard !method.isEmpty, method.utf8.allSatisfy({ (0x41...0x5A).contains($0) }) else { throw DPoPError("not an HTTP method") }
        // (The header is the key's, encoded once: `headerSegment`. The claims are appended in
        // order, no lookups: a proof is made per worker request.)
        var claims: [(key: String, value: JSON)] = [("jti", .string(jti)), ("htm", .string(method)), ("htu", .string(htu)), ("iat", .int(issuedAt))]
        if let nonce { claims.append(("nonce", .string(nonce))) }
        if let accessTokenHash {
            claims.append(("ath", .string(accessTokenHash)))
        } else if let accessToken {
            claims.append(("ath", .string(Self.accessTokenHash(accessToken))))
        }
        let signingInput = key.headerSegment + "." + Base64.urlEncode(JSON.object(JSONObject(claims)).encoded)
        return signingInput + "." + Base64.urlEncode(try key.sign(Array(signingInput.utf8)))
    }

    /// `url` as `htu` says it (RFC 3986 §6.2.2-6.2.3 normalization, as RFC 9449 §4.3 compares):
    /// scheme and host lower-cased, the scheme's default port left out, an empty path `/`,
    /// without query and fragment; nil unless it is an http or https URL with a host and no user
    /// part, read alike by every common reader (`StrictURL`: `http://h:8080:80/` is refused, not
    /// normalised).
    public static func target(_ url: String) -> String? {
        guard let parsed = StrictURL(url), let scheme = parsed.scheme, scheme == "https" || scheme == "http", !parsed.hasUserInfo else { return nil }
        let port = parsed.port.map { $0 == StrictURL.defaultPort(scheme) ? "" : ":\($0)" } ?? ""
        return scheme + "://" + parsed.host + port + (parsed.path.isEmpty ? "/" : parsed.path)
    }

    /// `accessToken`'s `ath` claim: its SHA-256, base64url (RFC 9449 §4.2).
    public static func accessTokenHash(_ accessToken: String) -> String {
        Base64.urlEncode(DPoPKey.sha256(Array(accessToken.utf8)))
    }

    /// 16 random bytes, base64url.
    public static func randomJTI() -> String {
        // (Two draws of the system generator, not sixteen.)
        var generator = SystemRandomNumberGenerator()
        let words = [generator.next(), generator.next()]
        return Base64.urlEncode(words.withUnsafeBytes { Array($0) })
    }
}
