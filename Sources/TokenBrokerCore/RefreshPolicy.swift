/// The tunables of one session's refresh behaviour.
public struct RefreshPolicy: Sendable, Equatable {
    /// How long before expiry a demand starts a background refresh while still being served the
    /// valid token. Zero turns refresh-ahead off.
    public var refreshAhead: Duration
    /// The refresh guard: at most `limit` upstream requests in any sliding `window`.
    public var guardLimit: Int
    public var guardWindow: Duration
    /// Backoff after transient failures.
    public var backoff: Backoff
    /// Refusals without a reason (`FetchFailure.Kind.refused`) in a row, since the last
    /// success, after which the session ends.
    public var refusalLimit: Int

    /// Sixty seconds of refresh-ahead covers a token handed out just before it expires plus
    /// the round trip of the request it is used for; ten refreshes a minute is far more than a
    /// healthy session needs (one per token lifetime) and far less than a worker stuck in a
    /// refresh loop would cause.
    public init(refreshAhead: Duration = .seconds(60), guardLimit: Int = 10, guardWindow: Duration = .seconds(60),
                backoff: Backoff = Backoff(), refusalLimit: Int = 3) {
        self.refreshAhead = refreshAhead
        self.guardLimit = guardLimit
        self.guardWindow = guardWindow
        self.backoff = backoff
        self.refusalLimit = refusalLimit
    }

    /// The refreshes per guard window that expiry alone needs with tokens that live `lifetime`:
    /// one per refresh-ahead window (which opens `refreshAhead` before expiry, but no earlier
    /// than half-way through the token's life), half a second apart at least. The guard allows these
    /// on top of `guardLimit`: it stops a storm of needless refreshes, never the ones that
    /// short-lived tokens require.
    public func expiryRefreshes(lifetime: Duration) -> Int {
        guard lifetime > .zero else { return Int((guardWindow / .milliseconds(500)).rounded(.up)) }
        let step = refreshAhead > .zero ? max(lifetime - refreshAhead, lifetime / 2) : lifetime
        return min(Int((guardWindow / max(step, .milliseconds(500))).rounded(.up)), 100_000)
    }
}

/// Exponential backoff with jitter, bounded, honouring a server-given `Retry-After`.
public struct Backoff: Sendable, Equatable {
    /// Delay after the first failure.
    public var initial: Duration
    /// Upper bound of the computed delay (a server's `Retry-After` may exceed it).
    public var maximum: Duration
    /// Growth factor per consecutive failure.
    public var multiplier: Double
    /// Fraction of the delay that is randomised: with 0.2 the delay lies in [0.8 d, d].
    public var jitter: Double

    public init(initial: Duration = .seconds(1), maximum: Duration = .seconds(300), multiplier: Double = 2, jitter: Double = 0.2) {
        self.initial = initial
        self.maximum = maximum
        self.multiplier = multiplier
        self.jitter = jitter
    }

    /// The delay after `failures` consecutive failures (1 for the first).
    ///
    /// - Parameters:
    ///   - unit: a random number in [0, 1); the caller draws it, so that this stays pure.
    ///   - retryAfter: the server's `Retry-After`, a lower bound of the result.
    public func delay(failures: Int, unit: Double, retryAfter: Duration?) -> Duration {
        let initialSeconds = initial.seconds
        let maximumSeconds = maximum.seconds
        var seconds = initialSeconds
        var step = 1
        while step < failures && seconds < maximumSeconds {
            seconds *= multiplier
            step += 1
        }
        seconds = min(seconds, maximumSeconds)
        let clampedUnit = min(max(unit, 0), 1)
        seconds *= 1 - min(max(jitter, 0), 1) * clampedUnit
        let computed = Duration.milliseconds(Int64((seconds * 1000).rounded(.up)))
        guard let retryAfter else { return computed }
        return max(computed, retryAfter)
    }
}
