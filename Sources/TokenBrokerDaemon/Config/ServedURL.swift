/// A URL, or a host, read strictly: what a session serves (`Serves=`) and what a credential
/// helper asks for. `[scheme://][user@]host[:port][/path][?query][#fragment]`, the host a DNS
/// name, IPv4 address or bracketed IPv6 address; the host lower-cased, the user, query and
/// fragment dropped, the path without a trailing slash.
public struct ServedURL: Sendable, Equatable, CustomStringConvertible {
    public var scheme: String?
    public var host: String
    public var port: Int?
    /// "" for the whole host, else "/a/b".
    public var path: String

    public static let maximumLength = 2048

    public init?(_ text: String) {
        guard !text.isEmpty, text.utf8.count <= Self.maximumLength, text.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else { return nil }
        var rest = Substring(text)
        let bytes = Array(text.utf8)
        if let colon = bytes.firstIndex(of: UInt8(ascii: ":")), colon + 2 < bytes.count,
           bytes[colon + 1] == UInt8(ascii: "/"), bytes[colon + 2] == UInt8(ascii: "/") {
            let scheme = String(decoding: bytes[..<colon], as: UTF8.self).lowercased()
            func isSchemeByte(_ byte: UInt8) -> Bool {
                (0x61...0x7A).contains(byte) || (0x30...0x39).contains(byte) || byte == UInt8(ascii: "+") || byte == UInt8(ascii: "-")
                    || byte == UInt8(ascii: ".")
            }
            guard !scheme.isEmpty, scheme.utf8.allSatisfy(isSchemeByte) else { return nil }
            self.scheme = scheme
            rest = Substring(String(decoding: bytes[(colon + 3)...], as: UTF8.self))
        } else {
            scheme = nil
        }
        if let cut = rest.firstIndex(where: { $0 == "?" || $0 == "#" }) { rest = rest[..<cut] }
        let authorityEnd = rest.firstIndex(of: "/") ?? rest.endIndex
        var authority = rest[..<authorityEnd]
        var path = String(rest[authorityEnd...])
        // One user part at most: parsers disagree on which `@` ends it (git takes the first).
        if let at = authority.firstIndex(of: "@") {
            guard authority.lastIndex(of: "@") == at else { return nil }
            authority = authority[authority.index(after: at)...]
        }
        var hostPart = authority
        var portText: Substring?
        if authority.hasPrefix("[") {
            guard let close = authority.firstIndex(of: "]") else { return nil }
            hostPart = authority[...close]
            let after = authority[authority.index(after: close)...]
            if !after.isEmpty {
                guard after.hasPrefix(":") else { return nil }
                portText = after.dropFirst()
            }
            guard hostPart.dropFirst().dropLast().allSatisfy({ $0.isHexDigit || $0 == ":" || $0 == "." }), hostPart.count > 2 else { return nil }
        } else {
            if let colon = authority.firstIndex(of: ":") {
                hostPart = authority[..<colon]
                portText = authority[authority.index(after: colon)...]
            }
            func isHostByte(_ byte: UInt8) -> Bool {
                (0x61...0x7A).contains(byte | 0x20) || (0x30...0x39).contains(byte) || byte == UInt8(ascii: "-") || byte == UInt8(ascii: ".")
                    || byte == UInt8(ascii: "_")
            }
            guard !hostPart.isEmpty, hostPart.utf8.count <= 253, hostPart.utf8.allSatisfy(isHostByte) else { return nil }
        }
        if let portText {
            guard portText.utf8.allSatisfy({ (0x30...0x39).contains($0) }), let port = Int(portText), (1...65535).contains(port) else { return nil }
            self.port = port
        } else {
            port = nil
        }
        host = hostPart.lowercased()
        while path.hasSuffix("/") { path.removeLast() }
        // No dot segments: a prefix must not be escaped by "..".
        guard !path.split(separator: "/").contains(where: { $0 == "." || $0 == ".." }) else { return nil }
        self.path = path
    }

    /// The port a request to this URL goes to (its scheme's default when none is written).
    public var effectivePort: Int? {
        if let port { return port }
        switch scheme {
        case "https": return 443
        case "http": return 80
        default: return nil
        }
    }

    /// How specifically this entry (what a session serves) matches `url`: `nil` when it does
    /// not; more when more of it is written (a longer path, a port, a scheme). An entry without a
    /// scheme means https: it never answers a plain-http URL (the token would cross the network
    /// in clear); `http://` must be written to serve one. A request without a scheme (a
    /// registry's or Terraform's host) matches by host, port and path.
    public func specificity(for url: ServedURL) -> Int? {
        guard host == url.host else { return nil }
        if let asked = url.scheme, asked != (scheme ?? "https") { return nil }
        if port != nil, let asked = url.effectivePort, asked != effectivePort { return nil }
        if port != nil, url.effectivePort == nil { return nil }
        guard path.isEmpty || url.path == path || url.path.hasPrefix(path + "/") else { return nil }
        return path.utf8.count * 4 + (port == nil ? 0 : 2) + (scheme == nil ? 0 : 1)
    }

    public var description: String {
        (scheme.map { $0 + "://" } ?? "") + (host.contains(":") && !host.hasPrefix("[") ? "[\(host)]" : host)
            + (port.map { ":\($0)" } ?? "") + path
    }
}
