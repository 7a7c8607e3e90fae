/// An access token as the broker hands it out.
public struct IssuedToken: Sendable, Equatable {
    /// The bearer credential itself.
    public var token: Secret
    /// The token type from the server, normally `Bearer`.
    public var tokenType: String
    /// Expiry in Unix seconds, or `nil` when the server gave no lifetime.
    public var expiresAt: Int64?
    /// The session generation the token belongs to.
    public var generation: Int
    /// A per-session serial number: how logs, status and tests name a token (never by value).
    public var serial: UInt64

    public init(token: Secret, tokenType: String, expiresAt: Int64?, generation: Int, serial: UInt64) {
        self.token = token
        self.tokenType = tokenType
        self.expiresAt = expiresAt
        self.generation = generation
        self.serial = serial
    }
}

extension IssuedToken: CustomStringConvertible {
    public var description: String { "token #\(serial) (generation \(generation))" }
}
