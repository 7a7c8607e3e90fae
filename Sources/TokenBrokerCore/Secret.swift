/// A credential (access token, refresh token, client secret) that must never reach a log line,
/// an error message, status output or a test report.
///
/// `description`, `debugDescription` and reflection all print `<redacted>`; the only way to read
/// the value is the explicit `reveal` property, which callers use at the single point where the
/// secret leaves the process (an HTTP request, a varlink reply, the database).
public struct Secret: Sendable, Hashable, CustomStringConvertible, CustomDebugStringConvertible, CustomReflectable {
    private let value: String

    public init(_ value: String) { self.value = value }

    /// The secret itself. Name the call site for what it sends, and never interpolate it into text.
    public var reveal: String { value }

    public var isEmpty: Bool { value.isEmpty }

    public var description: String { "<redacted>" }
    public var debugDescription: String { "<redacted>" }
    public var customMirror: Mirror { Mirror(self, children: [], displayStyle: .struct) }
}

/// Key material (a state key, a fleet key) that must never be printed: raw bytes, as read,
/// with the same redaction as `Secret`.
public struct SecretBytes: Sendable, Hashable, CustomStringConvertible, CustomDebugStringConvertible, CustomReflectable {
    private let value: [UInt8]

    public init(_ value: [UInt8]) { self.value = value }

    /// The bytes themselves, for the one place that makes a cipher of them.
    public var reveal: [UInt8] { value }

    public var description: String { "<redacted>" }
    public var debugDescription: String { "<redacted>" }
    public var customMirror: Mirror { Mirror(self, children: [], displayStyle: .struct) }
}
