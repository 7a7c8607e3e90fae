/// Counters of one session since the daemon started.
public struct SessionCounters: Sendable, Equatable {
    /// Upstream token requests started (reactive and refresh-ahead).
    public var fetches = 0
    /// Demands that joined a flight another demand had started.
    public var joinedWaiters = 0
    /// Failed upstream requests.
    public var failures = 0
    /// Recovers whose rejected token was no longer current (answered without a refresh).
    public var staleRejections = 0
    /// Demands refused by the refresh guard.
    public var throttled = 0
    /// Upstream answers dropped because their generation had ended (logout or login while the
    /// request was in flight).
    public var droppedResults = 0
    /// Redemptions of the refresh token for derived sessions' tokens (`Derivation=refresh`).
    public var derivations = 0

    public init() {}
}

/// A point-in-time view of a session for `Status` and `ctl status`. Holds no secret.
public struct SessionStatus: Sendable, Equatable {
    public typealias State = SessionState

    public var name: String
    public var state: State
    public var generation: Int
    /// Serial of the current access token, if there is one.
    public var tokenSerial: UInt64?
    /// Expiry of the current access token, Unix seconds.
    public var expiresAt: Int64?
    /// Last successful refresh, Unix seconds.
    public var lastRefresh: Int64?
    /// An upstream request is in flight.
    public var refreshing: Bool
    /// Time left in the backoff after a transient failure.
    public var backoffRemaining: Duration?
    /// The last failure's reason (never a secret).
    public var lastError: String?
    /// A write to the store failed and is pending; the session is served from memory.
    public var degraded: Bool
    public var counters: SessionCounters
    /// The peers whose share of the refresh budget is spent: their refreshes are refused, the
    /// others' are not (`RefreshBudget`).
    public var throttled: [Demander]

    public init(name: String, state: State, generation: Int, tokenSerial: UInt64?, expiresAt: Int64?, lastRefresh: Int64?,
                refreshing: Bool, backoffRemaining: Duration?, lastError: String?, degraded: Bool, counters: SessionCounters,
                throttled: [Demander] = []) {
        self.name = name
        self.state = state
        self.generation = generation
        self.tokenSerial = tokenSerial
        self.expiresAt = expiresAt
        self.lastRefresh = lastRefresh
        self.refreshing = refreshing
        self.backoffRemaining = backoffRemaining
        self.lastError = lastError
        self.degraded = degraded
        self.counters = counters
        self.throttled = throttled
    }
}

/// What `watch()` subscribers receive.
public enum SessionEvent: Sendable, Equatable {
    /// A new current token (also the first event when one exists at subscription).
    case token(IssuedToken)
    /// The session was logged out or ended; carries the new generation.
    case signedOut(generation: Int)
}

/// What a daemon counts of a session without asking it: its state, whether a write is pending,
/// its last refresh, and whether anyone watches it. Told by the coordinator at each change.
public struct SessionSummary: Sendable, Equatable {
    public var state: SessionState
    public var degraded: Bool
    public var lastRefresh: Int64?
    /// At least one `watch()` stream is open.
    public var watched: Bool

    public init(state: SessionState, degraded: Bool, lastRefresh: Int64?, watched: Bool) {
        (self.state, self.degraded, self.lastRefresh, self.watched) = (state, degraded, lastRefresh, watched)
    }
}

/// A login or logout of a session, or its end, once it is in effect (`RefreshCoordinator`'s
/// `boundaries`).
public enum SessionBoundary: Sendable, Equatable {
    case loggedIn(generation: Int)
    case loggedOut(generation: Int)
    /// A refresh ended the session (the issuer says its grant is dead): no token until a login.
    case ended(generation: Int)
}
