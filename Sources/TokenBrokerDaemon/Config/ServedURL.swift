import Basics

/// A URL, or a host, read strictly (`StrictURL`): what a session serves (`Serves=`) and what a
/// credential helper asks for. `[scheme://][user@]host[:port][/path][?query][#fragment]`, the
/// host a DNS name, IPv4 address or bracketed IPv6 address; the host lower-cased, the user, query
/// and fragment dropped, the path without a trailing slash.
public struct ServedURL: Sendable, Equatable, CustomStringConvertible {
    public var scheme: String?
    public var host: String
    public var port: Int?
    /// "" for the whole host, else "/a/b".
    public var path: String

    public static let maximumLength = 2048

    public init?(_ text: String) {
        // (StrictURL refuses what two common URL readers read differently, and a path a server
        // could resolve elsewhere: a prefix must not be escaped by "..", "%2e%2e" or "..%2f".)
        guard let url = StrictURL(text, requiringScheme: false, maximumLength: Self.maximumLength), !url.hasAmbiguousPath else { return nil }
        scheme = url.scheme
        host = url.host
        port = url.port
        var path = url.path
        while path.hasSuffix("/") { path.removeLast() }
        self.path = path
    }

    /// The port a request to this URL goes to (its scheme's default when none is written).
    public var effectivePort: Int? { port ?? StrictURL.defaultPort(scheme) }

    /// How specifically this entry (what a session serves) matches `url`, a request: `nil` when
    /// it does not; more when more of it is written (a longer path, a port, a scheme). An entry
    /// without a scheme means https: it never answers a plain-http URL (the token would cross the
    /// network in clear); `http://` must be written to serve one. A request must name its scheme:
    /// one without (a registry's bare host, pip's netloc) could be sent over either, so no entry
    /// answers it; the helpers of protocols that cannot say the scheme decide it for their tool
    /// (`CredentialHelper`).
    public func specificity(for url: ServedURL) -> Int? {
        guard host == url.host, let asked = url.scheme, asked == (scheme ?? "https") else { return nil }
        if port != nil, url.effectivePort != effectivePort { return nil }
        guard path.isEmpty || url.path == path || url.path.hasPrefix(path + "/") else { return nil }
        return path.utf8.count * 4 + (port == nil ? 0 : 2) + (scheme == nil ? 0 : 1)
    }

    public var description: String {
        (scheme.map { $0 + "://" } ?? "") + (host.contains(":") && !host.hasPrefix("[") ? "[\(host)]" : host)
            + (port.map { ":\($0)" } ?? "") + path
    }
}
