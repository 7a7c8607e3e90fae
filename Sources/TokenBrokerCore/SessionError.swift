/// Why a session could not produce a token. The socket layer maps these, in one place, to the
/// contract's named errors. No case carries a token or a secret.
public enum SessionError: Error, Sendable, Equatable {
    /// Logged out (or never logged in); fails at once until the next login.
    case signedOut
    /// The shared refresh failed. `retryable` is false once the session has ended (terminal);
    /// while a transient failure's backoff lasts, `retryAfter` says how long.
    case refreshFailed(reason: String, retryable: Bool, retryAfter: Duration?)
    /// The refresh guard allows no further upstream request yet.
    case throttled(retryAfter: Duration)
    /// A login or logout took effect in memory but could not be persisted.
    case storeFailed(reason: String)
    /// The coordinator was shut down while the call waited.
    case shuttingDown
    /// An interactive login ended after a logout or another login: it changed nothing.
    case superseded
    /// A demand for a token valid for at least `asked` (`RefreshStateMachine.Demand.valid`): the
    /// issuer's tokens live only `lifetime` here, so no refresh would give one.
    case lifetimeTooShort(lifetime: Duration, asked: Duration)
}

extension SessionError: CustomStringConvertible {
    public var description: String {
        switch self {
        case .signedOut:
            return "signed out"
        case let .refreshFailed(reason, retryable, retryAfter):
            var text = "refresh failed: \(reason)"
            if !retryable { text += " (session ended; log in again)" }
            if let retryAfter { text += " (retry after \(retryAfter.seconds)s)" }
            return text
        case let .throttled(retryAfter):
            return "refresh throttled (retry after \(retryAfter.seconds)s)"
        case let .storeFailed(reason):
            return "could not persist session state: \(reason)"
        case .shuttingDown:
            return "shutting down"
        case .superseded:
            return "a logout or another login came first"
        case let .lifetimeTooShort(lifetime, asked):
            return "the issuer's tokens live \(lifetime.seconds)s, less than the \(asked.seconds)s asked"
        }
    }
}

extension Duration {
    /// The duration in (fractional) seconds.
    public var seconds: Double {
        let (s, atto) = components
        return Double(s) + Double(atto) / 1e18
    }
}
