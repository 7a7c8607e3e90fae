/// What became of one upstream refresh (or of a demand the refresh guard turned away), for the
/// daemon's log. Names tokens by serial only.
public struct RefreshOutcome: Sendable, Equatable {
    public enum Result: Sendable, Equatable {
        /// A new token is installed; `lifetime` is what the server gave (`nil`: none).
        case refreshed(serial: UInt64, lifetime: Duration?)
        /// The refresh failed and will be retried after `retryAfter` (backoff).
        case failed(reason: String, refused: Bool, retryAfter: Duration?)
        /// The refresh failed for good: the session has ended until the next login.
        case ended(reason: String)
        /// The answer came after a logout or login had ended its generation; nothing installed.
        case dropped
        /// No request was sent: the refresh budget is spent for `retryAfter` — `demander`'s own
        /// share (it alone is turned away), or the session's when `nil`.
        case throttled(retryAfter: Duration, demander: Demander?)
    }

    public var session: String
    public var generation: Int
    /// From the request's start to its answer (zero for `throttled`).
    public var duration: Duration
    public var result: Result

    public init(session: String, generation: Int, duration: Duration, result: Result) {
        self.session = session
        self.generation = generation
        self.duration = duration
        self.result = result
    }
}
