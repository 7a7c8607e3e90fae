import TokenBrokerCore

/// A place in a fleet session's history. Every write of the session's state moves it on: a
/// login or logout, on any broker, starts a generation (serial 0); every other write — a flight
/// taken, a refresh committed, a failure noted, the end of a session — adds one to the serial.
/// An admin's reset (`ResetFleetHistory`) starts the history anew: a later history, whose
/// generations come after every one of the earlier (the only way the numbers start low again).
/// Positions are ordered, and a broker never installs, serves, refreshes from or follows a
/// state before the highest position it has applied or published.
public struct FleetPosition: Sendable, Hashable, Comparable, CustomStringConvertible {
    /// Every number stays below this (2^53): no successor can overflow, and JSON carries them
    /// exactly.
    public static let limit: Int64 = 1 << 53
    /// The room kept below `limit`: a value read from etcd whose history, generation or serial
    /// is `limit - room` (2^53 − 2^48) or more is refused, whoever sealed it. So whatever a
    /// broker accepts leaves 2^48 more logins (65,536 even at the 2^32 a login can jump, from
    /// an etcd member that lies about its revision) and 2^48 more writes of a generation: a
    /// value sealed with the fleet key cannot use the fleet's numbers up.
    public static let room: Int64 = 1 << 48
    public static let start = FleetPosition(checked: 0, 0, 0)

    /// Which history (0 until the first reset).
    public let history: Int64
    public let generation: Int64
    public let serial: Int64

    /// Nil when a number is negative or at the limit.
    public init?(history: Int64 = 0, generation: Int64, serial: Int64) {
        guard (0..<Self.limit).contains(history), (0..<Self.limit).contains(generation), (0..<Self.limit).contains(serial) else { return nil }
        self.history = history
        self.generation = generation
        self.serial = serial
    }

    private init(checked history: Int64, _ generation: Int64, _ serial: Int64) {
        self.history = history
        self.generation = generation
        self.serial = serial
    }

    /// The generation this position is in.
    public var fleetGeneration: FleetGeneration { FleetGeneration(history: history, generation: generation) }

    /// Whether every number leaves `room` below the limit (what a value read must do).
    public var leavesRoom: Bool { max(history, generation, serial) < Self.limit - Self.room }

    /// The next serial of this generation (nil at the limit: the session needs a new login).
    public var nextSerial: FleetPosition? { FleetPosition(history: history, generation: generation, serial: serial + 1) }

    /// The first position of a generation after this position's, and at least `atLeast`, in
    /// its history (nil at the limit: the history must be started anew).
    func nextGeneration(atLeast: Int64) -> FleetPosition? {
        guard generation < Self.limit - 1 else { return nil }
        return FleetPosition(history: history, generation: min(max(generation + 1, atLeast), Self.limit - 1), serial: 0)
    }

    /// The first position of a history after this position's: its generation at least
    /// `atLeast` (as a login's is) and at most 2^32, so that it starts low (nil at the limit).
    func nextHistory(atLeast: Int64) -> FleetPosition? {
        guard history < Self.limit - 1 else { return nil }
        return FleetPosition(history: history + 1, generation: min(max(atLeast, 1), 1 << 32), serial: 0)
    }

    public static func < (lhs: FleetPosition, rhs: FleetPosition) -> Bool {
        (lhs.history, lhs.generation, lhs.serial) < (rhs.history, rhs.generation, rhs.serial)
    }

    public var description: String {
        (history > 0 ? "history \(history), " : "") + "generation \(generation), serial \(serial)"
    }
}

/// A generation of a session's fleet history: what one login or logout starts, anywhere in the
/// fleet. Ordered: the generations of a later history come after all of an earlier one's.
public struct FleetGeneration: Sendable, Hashable, Comparable, CustomStringConvertible {
    public var history: Int64
    public var generation: Int64

    public init(history: Int64 = 0, generation: Int64) {
        self.history = history
        self.generation = generation
    }

    public static func < (lhs: FleetGeneration, rhs: FleetGeneration) -> Bool {
        (lhs.history, lhs.generation) < (rhs.history, rhs.generation)
    }

    public var description: String { (history > 0 ? "history \(history), " : "") + "generation \(generation)" }
}

/// A session's state as the fleet shares it, in its `state` key: sealed with the fleet key
/// (`FleetCodec`), so etcd never holds a token in clear and nobody without the key can write
/// one. It also carries who refreshes now and the backoff after a failure: every fact a broker
/// acts on is in this one authenticated value, placed in the key's history.
struct FleetState: Sendable, Equatable {
    var position: FleetPosition
    var phase: SessionState
    var refreshToken: Secret?
    var accessToken: Secret?
    var tokenType: String = "Bearer"
    /// Access token expiry, Unix seconds (clamped when read).
    var expiresAt: Int64?
    var lastRefresh: Int64?
    var endReason: String?
    /// The broker refreshing from this state now.
    var flight: FlightClaim?
    /// After a failed refresh, until when nobody tries again.
    var backoff: BackoffNote?

    /// Whether the value carries a credential.
    var hasTokens: Bool { refreshToken != nil || accessToken != nil }

    /// `self` at the next serial, with no flight and no backoff (nil at the serial limit).
    private func next() -> FleetState? {
        guard let position = position.nextSerial else { return nil }
        var next = self
        next.position = position
        next.flight = nil
        next.backoff = nil
        return next
    }

    /// The same tokens, with `claim`'s broker refreshing from them.
    func claimed(_ claim: FlightClaim) -> FleetState? {
        var next = next()
        next?.flight = claim
        return next
    }

    /// The state a refresh answer makes of `self`: the new access token, and the rotated
    /// refresh token (`FetchedToken.refreshToken(replacing:)`, the one rule).
    func refreshed(with fetched: FetchedToken, unixNow: Double) -> FleetState? {
        guard var next = next() else { return nil }
        next.accessToken = fetched.accessToken
        next.tokenType = fetched.tokenType
        next.expiresAt = fetched.expiresAt(receivedAt: unixNow).map(FleetCodec.expiry)
        next.refreshToken = fetched.refreshToken(replacing: refreshToken)
        next.lastRefresh = FleetCodec.expiry(unixNow)
        return next
    }

    /// The refresh failed: the same tokens, and nobody tries again before `note.until`.
    func failed(_ note: BackoffNote) -> FleetState? {
        var next = next()
        next?.backoff = note
        return next
    }

    /// The flight is given up with nothing to say (cancelled, or a failure of this broker's own).
    func released() -> FleetState? { next() }

    /// The session ended for good (the refresh token is dead): no tokens.
    func ended(reason: String) -> FleetState? {
        guard let position = position.nextSerial else { return nil }
        return FleetState(position: position, phase: .ended, lastRefresh: lastRefresh, endReason: reason)
    }
}

/// Who refreshes a state now: part of the state value, so nobody without the fleet key can
/// claim, extend or remove it. Each broker holds it for `lease` from the moment it first saw it
/// (on its own monotonic clock, whatever the hosts' clocks say); the holder gives its upstream
/// request up a margin before that.
struct FlightClaim: Sendable, Equatable {
    /// The holder's `Name=`, pid and a random tag (shown in Status).
    var holder: String
    /// The holder's `FlightLease=` (bounded to [1 s, 1 h] when read).
    var lease: Duration
    /// When it was taken, Unix milliseconds by the holder's clock (for operators only).
    var taken: Int64
}

/// After a failed refresh of a state, until when no broker tries again, and why.
struct BackoffNote: Sendable, Equatable {
    /// Unix milliseconds (at most an hour ahead when read).
    var until: Int64
    /// What the refresh failed with (bounded, printable).
    var reason: String
}

/// The etcd key of one fleet session, `<prefix>/sessions/<name>/state`. Its path is also the
/// associated data its value is sealed with: a value moved to another key, session or prefix
/// does not open.
struct FleetKeys: Sendable {
    let base: String
    let state: [UInt8]
    /// Where an earlier version kept the session (a clear generation and a sealed record).
    let earlierRecord: [UInt8]

    init(prefix: String, session: String) {
        base = prefix + "/sessions/" + session + "/"
        state = Array((base + "state").utf8)
        earlierRecord = Array((base + "record").utf8)
    }
}
