/// A URL read strictly: `scheme://[userinfo@]host[:port][/path][?query][#fragment]`, refusing
/// whatever two common readers could read differently, so that the host and path a decision is
/// made on are the ones a client reaches. The readers it is held against: WHATWG's (browsers,
/// and urllib3/requests, which end the authority at a backslash too), libcurl's, and RFC 3986's.
///
/// Refused: anything but visible ASCII; a backslash anywhere (WHATWG reads it as `/`, so
/// `http://h:1\@good.test/` reaches `h`); more than one `@` in the authority; a host with
/// percent-encoding or other characters than letters, digits and `-._~` (or a bracketed IPv6
/// address); a host whose last label is a number unless it is a dotted quad as written
/// (`0x7f.1`, `2130706433` and `1.2.3` are IPv4 addresses to WHATWG and libcurl, names to
/// RFC 3986); an empty port, a port that is not 1 to 5 digits or not in 1...65535 (`h:8080:80`).
///
/// The path is kept as written; `hasAmbiguousPath` says whether a server could resolve it to
/// another place than its text names: a `.` or `..` segment (also `..;x`, Tomcat's reading), a
/// percent-encoded `.`, `/` or `\` (`%2e%2e`, `..%2f`), `%`, NUL or overlong UTF-8 lead byte
/// (`%252e`, `%00`, `%c0%ae`), or a `%` not followed by two hex digits.
public struct StrictURL: Sendable, Equatable {
    /// Lower-cased; `nil` when the text names none (only where `requiringScheme` is false).
    public var scheme: String?
    /// Whether the authority has a user part (which is otherwise ignored).
    public var hasUserInfo: Bool
    /// Lower-cased; an IPv6 address in brackets.
    public var host: String
    public var port: Int?
    /// As written, from the first `/` after the authority to the query or fragment; "" for none.
    public var path: String
    public var hasAmbiguousPath: Bool

    public init?(_ text: String, requiringScheme: Bool = true, maximumLength: Int = 4096) {
        // (The length first: a hostile URL as long as a message is not copied to be refused.)
        guard text.utf8.count <= maximumLength else { return nil }
        let bytes = Array(text.utf8)
        guard !bytes.isEmpty, bytes.allSatisfy({ $0 > 0x20 && $0 < 0x7F }),
              !bytes.contains(UInt8(ascii: "\\")) else { return nil }
        var start = 0
        if let colon = bytes.firstIndex(of: UInt8(ascii: ":")), bytes[colon...].starts(with: Array("://".utf8)) {
            let scheme = bytes[..<colon]
            guard let first = scheme.first, Self.isLetter(first),
                  scheme.allSatisfy({ Self.isLetter($0) || Self.isDigit($0) || $0 == UInt8(ascii: "+") || $0 == UInt8(ascii: "-") || $0 == UInt8(ascii: ".") })
            else { return nil }
            self.scheme = String(decoding: scheme, as: UTF8.self).lowercased()
            start = colon + 3
        } else {
            guard !requiringScheme else { return nil }
            scheme = nil
        }
        let end = bytes[start...].firstIndex(where: { $0 == UInt8(ascii: "/") || $0 == UInt8(ascii: "?") || $0 == UInt8(ascii: "#") }) ?? bytes.endIndex
        var authority = bytes[start..<end]
        hasUserInfo = false
        if let at = authority.firstIndex(of: UInt8(ascii: "@")) {
            // One user part at most: readers disagree on which `@` ends it (git takes the first).
            guard authority.lastIndex(of: UInt8(ascii: "@")) == at else { return nil }
            hasUserInfo = true
            authority = authority[(at + 1)...]
        }
        var rest: ArraySlice<UInt8>
        let hostBytes: ArraySlice<UInt8>
        if authority.first == UInt8(ascii: "[") {
            guard let close = authority.firstIndex(of: UInt8(ascii: "]")) else { return nil }
            hostBytes = authority[authority.startIndex...close]
            let inside = hostBytes.dropFirst().dropLast()
            guard !inside.isEmpty, inside.contains(UInt8(ascii: ":")),
                  inside.allSatisfy({ Self.isHexDigit($0) || $0 == UInt8(ascii: ":") || $0 == UInt8(ascii: ".") }) else { return nil }
            rest = authority[(close + 1)...]
        } else {
            let colon = authority.firstIndex(of: UInt8(ascii: ":")) ?? authority.endIndex
            hostBytes = authority[..<colon]
            guard !hostBytes.isEmpty, hostBytes.count <= 253,
                  hostBytes.allSatisfy({ Self.isLetter($0) || Self.isDigit($0) || $0 == UInt8(ascii: "-") || $0 == UInt8(ascii: ".")
                                         || $0 == UInt8(ascii: "_") || $0 == UInt8(ascii: "~") }),
                  Self.isUnambiguousName(hostBytes) else { return nil }
            rest = authority[colon...]
        }
        if rest.isEmpty {
            port = nil
        } else {
            guard rest.removeFirst() == UInt8(ascii: ":"), (1...5).contains(rest.count), rest.allSatisfy(Self.isDigit),
                  let port = Int(String(decoding: rest, as: UTF8.self)), (1...65535).contains(port) else { return nil }
            self.port = port
        }
        host = String(decoding: hostBytes, as: UTF8.self).lowercased()
        let pathEnd = bytes[end...].firstIndex(where: { $0 == UInt8(ascii: "?") || $0 == UInt8(ascii: "#") }) ?? bytes.endIndex
        let path = bytes[end..<pathEnd]
        self.path = String(decoding: path, as: UTF8.self)
        hasAmbiguousPath = Self.isAmbiguous(path)
    }

    /// The port a request to this URL goes to: the written one, else its scheme's default.
    public var effectivePort: Int? { port ?? Self.defaultPort(scheme) }

    /// http's and https's ports (nil for other schemes).
    public static func defaultPort(_ scheme: String?) -> Int? {
        switch scheme {
        case "https": return 443
        case "http": return 80
        default: return nil
        }
    }

    /// `host[:port]` as read (the port only when written).
    public var authority: String { host + (port.map { ":\($0)" } ?? "") }

    // MARK: - Rules

    /// A name whose last label (a final dot aside) is a number is an IPv4 address to WHATWG and
    /// libcurl, in any of their forms: only the dotted quad, as written, reads the same everywhere.
    private static func isUnambiguousName(_ host: ArraySlice<UInt8>) -> Bool {
        var labels = host.split(separator: UInt8(ascii: "."), omittingEmptySubsequences: false)
        if labels.count > 1, labels.last?.isEmpty == true { labels.removeLast() }
        guard let last = labels.last else { return false }
        let numeric = (!last.isEmpty && last.allSatisfy(isDigit))
            || (last.count >= 2 && last.first == UInt8(ascii: "0") && last.dropFirst().first.map { $0 | 0x20 } == UInt8(ascii: "x")
                && last.dropFirst(2).allSatisfy(isHexDigit))
        guard numeric else { return true }
        guard labels.count == 4, host.last != UInt8(ascii: ".") else { return false }
        return labels.allSatisfy { label in
            guard (1...3).contains(label.count), label.allSatisfy(isDigit), label.count == 1 || label.first != UInt8(ascii: "0"),
                  let value = Int(String(decoding: label, as: UTF8.self)) else { return false }
            return value <= 255
        }
    }

    private static func isAmbiguous(_ path: ArraySlice<UInt8>) -> Bool {
        var index = path.startIndex
        while index < path.endIndex {
            if path[index] == UInt8(ascii: "%") {
                guard index + 2 < path.endIndex, isHexDigit(path[index + 1]), isHexDigit(path[index + 2]) else { return true }
                let value = hexValue(path[index + 1]) << 4 | hexValue(path[index + 2])
                // `.`, `/` and `\` a server may decode into a segment; `%25` a proxy that decodes
                // twice reads as another escape (`%252e` → `%2e` → `.`); NUL ends C strings; C0
                // and C1 begin overlong UTF-8 (`%c0%ae` is `.` to a lenient decoder).
                if [UInt8(ascii: "."), UInt8(ascii: "/"), UInt8(ascii: "\\"), 0x25, 0x00, 0xC0, 0xC1].contains(value) { return true }
                index += 3
            } else {
                index += 1
            }
        }
        return path.split(separator: UInt8(ascii: "/")).contains { segment in
            let name = segment.prefix { $0 != UInt8(ascii: ";") }
            return name.elementsEqual(".".utf8) || name.elementsEqual("..".utf8)
        }
    }

    private static func isLetter(_ byte: UInt8) -> Bool { (0x61...0x7A).contains(byte | 0x20) }
    private static func isDigit(_ byte: UInt8) -> Bool { (0x30...0x39).contains(byte) }
    private static func isHexDigit(_ byte: UInt8) -> Bool { isDigit(byte) || (0x61...0x66).contains(byte | 0x20) }
    private static func hexValue(_ byte: UInt8) -> UInt8 { isDigit(byte) ? byte - 0x30 : (byte | 0x20) - 0x61 + 10 }
}
