#if canImport(Glibc)
import Glibc
#endif
import CCurl

/// Which endpoint URLs tokenbroker will talk to: `https://` anywhere, `http://` only to a
/// loopback IP literal (127.0.0.0/8 or [::1]); credentials must not cross a network in clear
/// text. It applies to configured and discovered endpoints alike, and once more right before a
/// request that carries a credential is sent.
///
/// The URL is taken apart by libcurl's own parser — the one that will connect — so the host
/// checked is the host reached (`http://127.0.0.1.attacker.example/`, `http://x\@127.0.0.1/`
/// and the like cannot pass as loopback). Names, `localhost` included, are not loopback here:
/// only the address itself is.
public enum EndpointPolicy {
    /// `nil` when `url` is acceptable, else why not.
    public static func problem(with url: String) -> String? {
        guard url.utf8.count <= 2048 else { return "URL longer than 2048 bytes" }
        guard !url.unicodeScalars.contains(where: { $0.value < 0x21 || $0.value == 0x7F || $0.value > 0x7E }) else {
            return "URL with spaces, control or non-ASCII characters (percent-encode them)"
        }
        guard let parts = parse(url) else { return "not a URL: \(url)" }
        guard !parts.hasUserInfo else { return "no user name or password in endpoint URLs (the client authenticates itself)" }
        switch parts.scheme {
        case "https":
            return nil
        case "http":
            return isLoopbackLiteral(parts.host) ? nil
                : "http:// is allowed only for loopback addresses (127.0.0.0/8, [::1]); use https://"
        default:
            return "only https:// (or http:// to a loopback address) URLs are allowed"
        }
    }

    /// Scheme (lowercase) and host as libcurl reads them, and whether a user or password is in
    /// it; `nil` when it cannot, or when there is no host.
    static func parse(_ url: String) -> (scheme: String, host: String, hasUserInfo: Bool)? {
        guard let handle = curl_url() else { return nil }
        defer { curl_url_cleanup(handle) }
        // No scheme guessing: "example.com/token" is not a URL here.
        guard curl_url_set(handle, CURLUPART_URL, url, 0) == CURLUE_OK else { return nil }
        func part(_ which: CURLUPart) -> String? {
            var value: UnsafeMutablePointer<CChar>?
            guard curl_url_get(handle, which, &value, 0) == CURLUE_OK, let value else { return nil }
            defer { curl_free(value) }
            return String(cString: value)
        }
        guard let scheme = part(CURLUPART_SCHEME), let host = part(CURLUPART_HOST), !host.isEmpty else { return nil }
        return (scheme.lowercased(), host, part(CURLUPART_USER) != nil || part(CURLUPART_PASSWORD) != nil)
    }

    /// Whether `host` (as libcurl prints it: IPv6 in brackets) is an address in 127.0.0.0/8 or
    /// `::1`, written as a literal.
    static func isLoopbackLiteral(_ host: String) -> Bool {
        if host.hasPrefix("[") && host.hasSuffix("]") {
            var address = in6_addr()
            guard inet_pton(AF_INET6, String(host.dropFirst().dropLast()), &address) == 1 else { return false }
            return withUnsafeBytes(of: &address) { bytes in bytes.prefix(15).allSatisfy { $0 == 0 } && bytes[15] == 1 }
        }
        var address = in_addr()
        guard inet_pton(AF_INET, host, &address) == 1 else { return false }
        return withUnsafeBytes(of: &address) { $0[0] == 127 }
    }
}
