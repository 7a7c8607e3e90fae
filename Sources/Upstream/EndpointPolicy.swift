/// Which endpoint URLs tokenbroker will talk to: `https://` anywhere, `http://` only on the
/// loopback interface (credentials must not cross a network in clear text).
public enum EndpointPolicy {
    /// `nil` when `url` is acceptable, else why not.
    public static func problem(with url: String) -> String? {
        let lower = url.lowercased()
        if lower.hasPrefix("https://") { return host(of: url).isEmpty ? "no host in \(url)" : nil }
        guard lower.hasPrefix("http://") else { return "only https:// (or http:// on loopback) URLs are allowed" }
        let host = host(of: url).lowercased()
        if host == "localhost" || host == "[::1]" || host.hasPrefix("127.") { return nil }
        return "http:// is allowed only for loopback hosts (127.0.0.0/8, [::1], localhost); use https://"
    }

    /// The host part of `scheme://host[:port]/…` (brackets kept for IPv6).
    static func host(of url: String) -> String {
        guard let schemeEnd = url.firstRange(of: "://") else { return "" }
        var authority = url[schemeEnd.upperBound...].prefix { $0 != "/" && $0 != "?" && $0 != "#" }
        if let at = authority.lastIndex(of: "@") { authority = authority[authority.index(after: at)...] }
        if authority.hasPrefix("[") { return String(authority.prefix { $0 != "]" }) + "]" }
        return String(authority.prefix { $0 != ":" })
    }
}
