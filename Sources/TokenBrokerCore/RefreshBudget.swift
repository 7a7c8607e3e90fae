/// Who a demand for a refresh is charged to: a peer of the broker, by uid.
public struct Demander: Hashable, Sendable, CustomStringConvertible {
    public let uid: UInt32
    /// Not 0: every peer of this delegation together (`uid` then means nothing: a peer there
    /// may change its uid at will).
    public let delegation: UInt32

    public init(uid: UInt32, delegation: UInt32 = 0) {
        self.uid = delegation == 0 ? uid : UInt32.max
        self.delegation = delegation
    }

    public var description: String { delegation == 0 ? "uid \(uid)" : "delegation #\(delegation)" }
}

/// The refresh guard, shared fairly. Two budgets per sliding `window`:
/// - the session's own: `limit` upstream requests, plus those the tokens' lifetime needs
///   (`extra`), for what no caller can hasten (expiry, refresh-ahead), charged to nobody;
/// - the callers': `limit` requests started by demanders (`Demander`: a peer that rejects the
///   current token, forces a refresh or asks for a longer validity), of which one may spend
///   `share`; a demander that spent its share is turned away alone, and while the others spent
///   the rest, one with nothing in the window still gets one, up to twice the limit.
/// So callers cannot spend the refreshes the session needs, one worker cannot spend the
/// callers' refreshes for all, and a few cannot keep a newcomer from its one refresh. The most
/// a session sends per window is three times the limit, plus what the lifetime needs.
///
/// Pure: times are offsets on the coordinator's monotonic time line.
public struct RefreshBudget: Sendable, Equatable {
    public let limit: Int
    public let share: Int
    public let window: Duration
    /// Requests charged to nobody (the session's own needs).
    private var own: RefreshGuard
    /// Requests charged to demanders, all of them.
    private var demanded: RefreshGuard
    /// The requests charged to each demander, only of those with one in the window (at most
    /// twice the limit: every charge is a request the callers' budget allowed).
    private var charged: [Demander: RefreshGuard] = [:]

    public init(limit: Int, window: Duration) {
        self.limit = max(limit, 1)
        self.share = Self.share(of: limit)
        self.window = window
        own = RefreshGuard(limit: self.limit, window: window)
        demanded = RefreshGuard(limit: self.limit, window: window)
    }

    /// What one demander may spend of `limit`: half of it, at least one.
    public static func share(of limit: Int) -> Int { max(max(limit, 1) / 2, 1) }

    /// `nil` when a request may start at `now` for `demander` (`nil`: the session's own need),
    /// else how long until one may. `extra` requests are allowed on top of the session's own
    /// `limit` (the ones the tokens' lifetime makes necessary).
    public func retryAfter(now: Duration, for demander: Demander?, allowing extra: Int = 0) -> Duration? {
        guard let demander else { return own.retryAfter(now: now, allowing: extra) }
        let mine = charged[demander]
        if let wait = mine?.retryAfter(now: now) { return wait }
        guard let wait = demanded.retryAfter(now: now) else { return nil }
        guard (mine?.count(now: now) ?? 0) == 0 else { return wait }
        // A newcomer: its one refresh, within twice the limit.
        guard let ceiling = demanded.retryAfter(now: now, allowing: limit) else { return nil }
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

    /// The session's own requests (charged to nobody) inside the window ending at `now`.
    public func ownCount(now: Duration) -> Int { own.count(now: now) }

    /// Records a request started at `now`, charged to `demander` (nil: the session's own).
    public mutating func record(now: Duration, for demander: Demander?) {
        guard let demander else {
            own.record(now: now)
            return
        }
        demanded.record(now: now)
        charged = charged.filter { $0.key == demander || $0.value.count(now: now) > 0 }
        charged[demander, default: RefreshGuard(limit: share, window: window)].record(now: now)
    }
}
