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
    public static func make(key: DPoPKey, method: String, url: String, issuedAt: Int64, nonce: String? = nil,
                            accessToken: String? = nil, jti: String = randomJTI()) throws(DPoPError) -> String {
        guard let htu = target(url) else { throw DPoPError("not an http(s) URL") }
        guard !method.isEmpty, method.utf8.allSatisfy({ (0x41...0x5A).contains($0) }) else { throw DPoPError("not an HTTP method") }
        // (The header is the key's, encoded once: `headerSegment`. The claims are appended in
        // order, no lookups: a proof is made per worker request.)
        var claims: [(key: String, value: JSON)] = [("jti", .string(jti)), ("htm", .string(method)), ("htu", .string(htu)), ("iat", .int(issuedAt))]
        if let nonce { claims.append(("nonce", .string(nonce))) }
        if let accessToken { claims.append(("ath", .string(Base64.urlEncode(DPoPKey.sha256(Array(accessToken.utf8)))))) }
        let signingInput = key.headerSegment + "." + Base64.urlEncode(JSON.object(JSONObject(claims)).encoded)
        return signingInput + "." + Base64.urlEncode(try key.sign(Array(signingInput.utf8)))
    }

    /// `url` as `htu` says it (RFC 3986 §6.2.2-6.2.3 normalization, as RFC 9449 §4.3 compares):
    /// scheme and authority lower-cased, the scheme's default port left out, an empty path `/`,
    /// without query and fragment; nil unless it is an http or https URL with a host.
    public static func target(_ url: String) -> String? {
        guard url.utf8.count <= 4096, url.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else { return nil }
        var text = Substring(url)
        if let cut = text.firstIndex(where: { $0 == "?" || $0 == "#" }) { text = text[..<cut] }
        let lower = text.lowercased()
        let scheme: String
        if lower.hasPrefix("https://") { scheme = "https://" } else if lower.hasPrefix("http://") { scheme = "http://" } else { return nil }
        let rest = text.dropFirst(scheme.count)
        let authorityEnd = rest.firstIndex(of: "/") ?? rest.endIndex
        var authority = rest[..<authorityEnd].lowercased()
        guard !authority.isEmpty, !authority.contains("@") else { return nil }
        let defaultPort = scheme == "https://" ? ":443" : ":80"
        if authority.hasSuffix(defaultPort) { authority.removeLast(defaultPort.count) }
        if authority.hasSuffix(":") { authority.removeLast() }
        // A host is left: not a bare port, not an empty IPv6 literal.
        guard !authority.isEmpty, !authority.hasPrefix(":"), authority != "[]" else { return nil }
        let path = rest[authorityEnd...]
        return scheme + authority + (path.isEmpty ? "/" : String(path))
    }

    /// 16 random bytes, base64url.
    public static func randomJTI() -> String {
        // (Two draws of the system generator, not sixteen.)
        var generator = SystemRandomNumberGenerator()
        let words = [generator.next(), generator.next()]
        return Base64.urlEncode(words.withUnsafeBytes { Array($0) })
    }
}
