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
    /// The key the token is bound to (DPoP sessions: proofs for it are signed with this key,
    /// in the daemon; never handed out).
    public var proofKey: Secret?

    public init(token: Secret, tokenType: String, expiresAt: Int64?, generation: Int, serial: UInt64, proofKey: Secret? = nil) {
        self.token = token
        self.tokenType = tokenType
        self.expiresAt = expiresAt
        self.generation = generation
        self.serial = serial
        self.proofKey = proofKey
    }
}

extension IssuedToken: CustomStringConvertible {
    public var description: String { "token #\(serial) (generation \(generation))" }
}
