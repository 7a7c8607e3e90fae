/// Who a demand for a refresh is charged to: a peer of the broker, by uid.
public struct Demander: Hashable, Sendable, CustomStringConvertible {
    public let uid: UInt32

    public init(uid: UInt32) { self.uid = uid }

    public var description: String { "uid \(uid)" }
}

/// The refresh guard, shared fairly: at most `limit` upstream requests per sliding `window` for
/// the session, of which one demander (`Demander`: a peer that rejects the current token, or
/// forces a refresh) may spend `share`. A demander that spent its share is turned away alone;
/// while the session's budget is spent by others, a demander with nothing in the window still
/// gets one, up to twice the limit: one worker cannot spend the session's refreshes for all,
/// and a few cannot keep a newcomer from its one refresh. The refreshes the session needs by
/// itself (expiry, refresh-ahead) are charged to nobody but the session.
///
/// Pure: times are offsets on the coordinator's monotonic time line.
public struct RefreshBudget: Sendable, Equatable {
    public let limit: Int
    public let share: Int
    public let window: Duration
    private var session: RefreshGuard
    /// The requests charged to each demander, only of those with one in the window (at most
    /// twice the limit plus what expiry needs: every charge is a request the session allowed).
    private var charged: [Demander: RefreshGuard] = [:]

    public init(limit: Int, window: Duration) {
        self.limit = max(limit, 1)
        self.share = Self.share(of: limit)
        self.window = window
        session = RefreshGuard(limit: self.limit, window: window)
    }

    /// What one demander may spend of `limit`: half of it, at least one.
    public static func share(of limit: Int) -> Int { max(max(limit, 1) / 2, 1) }

    /// `nil` when a request may start at `now` for `demander` (`nil`: the session's own need),
    /// else how long until one may. `extra` requests are allowed on top of `limit` (the ones
    /// the tokens' lifetime makes necessary).
    public func retryAfter(now: Duration, for demander: Demander?, allowing extra: Int = 0) -> Duration? {
        guard let demander else { return session.retryAfter(now: now, allowing: extra) }
        let mine = charged[demander]
        if let wait = mine?.retryAfter(now: now) { return wait }
        guard let wait = session.retryAfter(now: now, allowing: extra) else { return nil }
        guard (mine?.count(now: now) ?? 0) == 0 else { return wait }
        // A newcomer: its one refresh, within twice the limit.
        guard let ceiling = session.retryAfter(now: now, allowing: extra + limit) else { return nil }
        return min(wait, ceiling)
    }

    /// Whether `demander` is turned away by its own share at `now` (others are not).
    public func hasSpentShare(_ demander: Demander, now: Duration) -> Bool {
        charged[demander]?.retryAfter(now: now) != nil
    }

    /// The demanders whose share is spent at `now`, lowest uid first, with the instant each
    /// may demand again.
    public func spentShares(now: Duration) -> [(demander: Demander, until: Duration)] {
        charged.compactMap { entry in entry.value.retryAfter(now: now).map { (entry.key, now + $0) } }.sorted { $0.demander.uid < $1.demander.uid }
    }

    /// Requests started inside the window ending at `now`.
    public func count(now: Duration) -> Int { session.count(now: now) }

    /// Records a request started at `now`, charged to `demander` (and to the session).
    public mutating func record(now: Duration, for demander: Demander?) {
        session.record(now: now)
        guard let demander else { return }
        charged = charged.filter { $0.key == demander || $0.value.count(now: now) > 0 }
        charged[demander, default: RefreshGuard(limit: share, window: window)].record(now: now)
    }
}
