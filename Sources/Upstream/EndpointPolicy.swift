#if canImport(Glibc)
import Glibc
#endif
import Basics
import CCurl
import HTTPTransport

/// Which endpoint URLs tokenbroker will talk to: `https://` anywhere, `http://` only to a
/// loopback IP literal (127.0.0.0/8 or [::1]); credentials must not cross a network in clear
/// text. It applies to configured and discovered endpoints alike, and once more right before a
/// request that carries a credential is sent.
///
/// A URL passes only if it passes on two readings: tokenbroker's own, strict one (`StrictURL`:
/// no percent-encoding, backslash, empty port or numeric name in the authority), and libcurl's — the
/// parser of the library that will connect — so the host checked is the host reached
/// (`http://127.0.0.1.attacker.example/`, `http://x\@127.0.0.1/` and the like cannot pass as
/// loopback). Names, `localhost` included, are not loopback here: only the address itself is.
///
/// Configuration is checked on the strict reading alone (`problemBeforeLibcurl`): libcurl is
/// loaded on first use, after the daemon is ready, and every request checks both.
public enum EndpointPolicy {
    /// `nil` when `url` is acceptable on both readings, else why not.
    public static func problem(with url: String) -> String? {
        if let problem = problemBeforeLibcurl(with: url) { return problem }
        if let failure = Libcurl.loadProblem { return "libcurl cannot be loaded: \(failure)" }
        guard let parts = parse(url) else { return "not a URL as libcurl reads it: \(url)" }
        return problem(with: parts)
    }

    /// `nil` when `url` is acceptable on tokenbroker's own, strict reading, else why not.
    public static func problemBeforeLibcurl(with url: String) -> String? {
        guard url.utf8.count <= 2048 else { return "URL longer than 2048 bytes" }
        guard !url.unicodeScalars.contains(where: { $0.value < 0x21 || $0.value == 0x7F || $0.value > 0x7E }) else {
            return "URL with spaces, control or non-ASCII characters (percent-encode them)"
        }
        guard let parts = strictParse(url) else {
            return "not a URL (scheme://host[:port][/path]; no backslash, percent-encoding, empty port or IPv4 address in another form than a.b.c.d before the path): \(url)"
        }
        return problem(with: parts)
    }

    private static func problem(with parts: (scheme: String, host: String, hasUserInfo: Bool)) -> String? {
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

    /// Scheme (lowercase) and host (IPv6 in brackets) on the strict reading (`StrictURL`), and
    /// whether the authority holds user information; `nil` when it is not a URL there.
    static func strictParse(_ url: String) -> (scheme: String, host: String, hasUserInfo: Bool)? {
        guard let parts = StrictURL(url), let scheme = parts.scheme else { return nil }
        return (scheme, parts.host, parts.hasUserInfo)
    }

    /// Scheme (lowercase) and host as libcurl reads them, and whether a user or password is in
    /// it; `nil` when it cannot, or when there is no host. libcurl must be loaded.
    static func parse(_ url: String) -> (scheme: String, host: String, hasUserInfo: Bool)? {
        guard let handle = tb_curl_url() else { return nil }
        defer { tb_curl_url_cleanup(handle) }
        // No scheme guessing: "example.com/token" is not a URL here.
        guard tb_curl_url_set(handle, CURLUPART_URL, url, 0) == CURLUE_OK else { return nil }
        func part(_ which: CURLUPart) -> String? {
            var value: UnsafeMutablePointer<CChar>?
            guard tb_curl_url_get(handle, which, &value, 0) == CURLUE_OK, let value else { return nil }
            defer { tb_curl_free(value) }
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
