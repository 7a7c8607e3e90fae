#if canImport(Glibc)
import Glibc
#endif
import CCurl

/// Which endpoint URLs tokenbroker will talk to: `https://` anywhere, `http://` only to a
/// loopback IP literal (127.0.0.0/8 or [::1]); credentials must not cross a network in clear
/// text. It applies to configured and discovered endpoints alike, and once more right before a
/// request that carries a credential is sent.
///
/// A URL passes only if it passes on two readings: tokenbroker's own, strict one (RFC 3986
/// with no percent-encoding, backslash or empty port in the authority), and libcurl's — the
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
            return "not a URL (scheme://host[:port][/path]; no backslash, percent-encoding or empty port before the path): \(url)"
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

    /// Scheme (lowercase) and host (IPv6 in brackets) on the strict reading, and whether the
    /// authority holds user information; `nil` when the URL is not of the form
    /// `scheme://[userinfo@]host[:port][/path][?query][#fragment]` with a host of letters,
    /// digits, `-._~` or a bracketed IPv6 address, and a port of 1 to 65535.
    static func strictParse(_ url: String) -> (scheme: String, host: String, hasUserInfo: Bool)? {
        let bytes = Array(url.utf8)
        guard !bytes.contains(UInt8(ascii: "\\")) else { return nil }
        guard let colon = bytes.firstIndex(of: UInt8(ascii: ":")), colon > 0,
              bytes[colon...].starts(with: Array("://".utf8)) else { return nil }
        let scheme = bytes[..<colon]
        func isLetter(_ byte: UInt8) -> Bool { (0x61...0x7A).contains(byte | 0x20) }
        func isDigit(_ byte: UInt8) -> Bool { (0x30...0x39).contains(byte) }
        guard isLetter(scheme[scheme.startIndex]),
              scheme.allSatisfy({ isLetter($0) || isDigit($0) || $0 == UInt8(ascii: "+") || $0 == UInt8(ascii: "-") || $0 == UInt8(ascii: ".") })
        else { return nil }
        let start = colon + 3
        let end = bytes[start...].firstIndex(where: { $0 == UInt8(ascii: "/") || $0 == UInt8(ascii: "?") || $0 == UInt8(ascii: "#") }) ?? bytes.endIndex
        var authority = bytes[start..<end]
        var hasUserInfo = false
        if let at = authority.lastIndex(of: UInt8(ascii: "@")) {
            hasUserInfo = true
            authority = authority[(at + 1)...]
        }
        let host: ArraySlice<UInt8>
        var rest: ArraySlice<UInt8>
        if authority.first == UInt8(ascii: "[") {
            guard let close = authority.firstIndex(of: UInt8(ascii: "]")) else { return nil }
            host = authority[authority.startIndex...close]
            let inside = host.dropFirst().dropLast()
            guard !inside.isEmpty, inside.allSatisfy({ isDigit($0) || (0x61...0x66).contains($0 | 0x20) || $0 == UInt8(ascii: ":") || $0 == UInt8(ascii: ".") })
            else { return nil }
            rest = authority[(close + 1)...]
        } else {
            let colon = authority.firstIndex(of: UInt8(ascii: ":")) ?? authority.endIndex
            host = authority[..<colon]
            guard !host.isEmpty, host.allSatisfy({ isLetter($0) || isDigit($0) || $0 == UInt8(ascii: "-") || $0 == UInt8(ascii: ".")
                                                     || $0 == UInt8(ascii: "_") || $0 == UInt8(ascii: "~") })
            else { return nil }
            rest = authority[colon...]
        }
        if !rest.isEmpty {
            guard rest.removeFirst() == UInt8(ascii: ":"), (1...5).contains(rest.count), rest.allSatisfy(isDigit),
                  let port = Int(String(decoding: rest, as: UTF8.self)), (1...65535).contains(port) else { return nil }
        }
        return (String(decoding: scheme, as: UTF8.self).lowercased(), String(decoding: host, as: UTF8.self), hasUserInfo)
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
