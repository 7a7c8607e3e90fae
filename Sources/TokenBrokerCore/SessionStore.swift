/// Where a session stands: the one enumeration the store, the status and the state machine's
/// phase share (its raw values are what the database and `Status` carry).
public enum SessionState: String, Sendable, Equatable {
    /// Logged in: a refresh credential (or a `client_credentials` grant) is installed.
    case active
    /// Logged out, or never logged in.
    case signedOut
    /// A terminal refresh failure ended the session until the next login.
    case ended
}

/// The persisted state of one session. Every write to it is guarded by its generation.
public struct SessionRecord: Sendable, Equatable {
    public typealias State = SessionState

    public var name: String
    public var generation: Int
    public var state: State
    public var refreshToken: Secret?
    /// The session's DPoP private key (RFC 9449), made at login and ended with the generation;
    /// `nil` for bearer sessions. A credential like the refresh token: sealed at rest, never
    /// handed out.
    public var proofKey: Secret?
    public var accessToken: Secret?
    public var tokenType: String
    /// Access token expiry, Unix seconds.
    public var expiresAt: Int64?
    /// When the last successful refresh happened, Unix seconds.
    public var lastRefresh: Int64?
    /// Serial of the current access token (see `IssuedToken.serial`).
    public var tokenSerial: UInt64
    /// Why the session ended, when `state == .ended`.
    public var endReason: String?

    public init(name: String, generation: Int, state: State, refreshToken: Secret? = nil, proofKey: Secret? = nil, accessToken: Secret? = nil,
                tokenType: String = "Bearer", expiresAt: Int64? = nil, lastRefresh: Int64? = nil,
                tokenSerial: UInt64 = 0, endReason: String? = nil) {
        self.name = name
        self.generation = generation
        self.state = state
        self.refreshToken = refreshToken
        self.proofKey = proofKey
        self.accessToken = accessToken
        self.tokenType = tokenType
        self.expiresAt = expiresAt
        self.lastRefresh = lastRefresh
        self.tokenSerial = tokenSerial
        self.endReason = endReason
    }
}

/// One generation-guarded write.
public struct StoreWrite: Sendable, Equatable {
    public enum Guard: Sendable, Equatable {
        /// Applies only when the stored generation equals `record.generation` and the write is
        /// not older than the stored record: a refresh result or a terminal end within a
        /// generation. Within one generation the token serial orders the writes (a record retried
        /// late after a failed write must not replace a newer refresh's), and at one serial only
        /// the step from active to ended is taken. A missing row is not written.
        case sameGeneration
        /// Applies only when no row exists or the stored generation is lower than
        /// `record.generation`: login and logout. Because generations only grow, such writes may
        /// reach the store in any order and the newest one still wins.
        case newerGeneration
    }

    public var record: SessionRecord
    public var guardedBy: Guard
    /// The change came from elsewhere (another broker of a fleet), which already holds it: a
    /// store shared with others writes it only to this host's copy.
    public var replicated: Bool

    public init(_ record: SessionRecord, guardedBy: Guard, replicated: Bool = false) {
        self.record = record
        self.guardedBy = guardedBy
        self.replicated = replicated
    }

    /// Whether this write applies on top of `stored` (`nil`: no row).
    public func applies(over stored: SessionRecord?) -> Bool {
        switch guardedBy {
        case .sameGeneration:
            guard let stored, stored.generation == record.generation else { return false }
            return stored.tokenSerial < record.tokenSerial || (stored.tokenSerial == record.tokenSerial && stored.state != .ended)
        case .newerGeneration:
            return stored.map { $0.generation < record.generation } ?? true
        }
    }
}

/// Durable session state. The coordinator is its only writer for a session.
public protocol SessionStore: Sendable {
    /// The stored state of `session`, or `nil` when nothing is stored.
    func load(_ session: String) async throws -> SessionRecord?
    /// Performs the write if its guard holds; returns whether it was applied. Returns only once
    /// the write is durable. Throws when the store cannot write at all (disk full, I/O error).
    func write(_ write: StoreWrite) async throws -> Bool
}
