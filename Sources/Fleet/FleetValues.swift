import TokenBrokerCore

/// A place in a fleet session's history. Every write of the session's state moves it on: a
/// login or logout, on any broker, starts a generation (serial 0); each refresh, and the end of
/// a session, adds one to the serial. Positions are ordered, and a broker never installs,
/// serves or follows anything before the highest position it has applied or published.
public struct FleetPosition: Sendable, Hashable, Comparable, CustomStringConvertible {
    /// Both numbers stay below this (2^53): no successor can overflow, and JSON carries them
    /// exactly.
    public static let limit: Int64 = 1 << 53
    public static let start = FleetPosition(checked: 0, 0)

    public let generation: Int64
    public let serial: Int64

    /// Nil when a number is negative or at the limit.
    public init?(generation: Int64, serial: Int64) {
        guard (0..<Self.limit).contains(generation), (0..<Self.limit).contains(serial) else { return nil }
        self.generation = generation
        self.serial = serial
    }

    private init(checked generation: Int64, _ serial: Int64) {
        self.generation = generation
        self.serial = serial
    }

    /// The next serial of this generation (nil at the limit: the session needs a new login).
    public var nextSerial: FleetPosition? { FleetPosition(generation: generation, serial: serial + 1) }

    /// The first position of the generation after `self` and `other` both.
    static func nextGeneration(after positions: FleetPosition...) -> FleetPosition? {
        let highest = positions.map(\.generation).max() ?? 0
        return FleetPosition(generation: highest + 1, serial: 0)
    }

    public static func < (lhs: FleetPosition, rhs: FleetPosition) -> Bool {
        (lhs.generation, lhs.serial) < (rhs.generation, rhs.serial)
    }

    public var description: String { "generation \(generation), serial \(serial)" }
}

/// A session's state as the fleet shares it, in the `state` key: sealed with the fleet key
/// (`FleetCodec`), so etcd never holds a token in clear and nobody without the key can write one.
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

    /// Whether the value carries a credential.
    var hasTokens: Bool { refreshToken != nil || accessToken != nil }

    /// The state a refresh answer makes of `self`: the next serial, the new access token, and
    /// the rotated refresh token (`FetchedToken.refreshToken(replacing:)`, the one rule).
    /// Nil at the serial limit.
    func refreshed(with fetched: FetchedToken, unixNow: Double) -> FleetState? {
        guard let position = position.nextSerial else { return nil }
        var next = self
        next.position = position
        next.accessToken = fetched.accessToken
        next.tokenType = fetched.tokenType
        next.expiresAt = fetched.expiresIn.map { FleetCodec.expiry(unixNow + $0.seconds) }
        next.refreshToken = fetched.refreshToken(replacing: refreshToken)
        next.lastRefresh = FleetCodec.expiry(unixNow)
        return next
    }

    /// The session ended for good (the refresh token is dead): the next serial, no tokens.
    func ended(reason: String) -> FleetState? {
        guard let position = position.nextSerial else { return nil }
        return FleetState(position: position, phase: .ended, lastRefresh: lastRefresh, endReason: reason)
    }
}

/// Who refreshes now, in the `flight` key, on a lease of `FlightLease=`. Sealed like the state,
/// and tied to the state it refreshes from: a claim of an earlier state, off its lease, or past
/// its time is void, whoever wrote it.
struct FlightClaim: Sendable, Equatable {
    /// The holder's `Name=`, pid and a random tag (shown in Status).
    var holder: String
    /// The lease the key must be attached to.
    var lease: Int64
    /// The etcd revision of the state write it refreshes from.
    var stateRevision: Int64
    /// Until when it holds, Unix milliseconds: the time it was taken plus the lease, renewed by
    /// a holder that keeps the lease alive.
    var until: Int64
}

/// After a failed refresh, until when no broker tries again, and why: in the `backoff` key,
/// sealed and tied to the state it is about.
struct BackoffNote: Sendable, Equatable {
    var stateRevision: Int64
    /// Unix milliseconds (at most an hour ahead when read).
    var until: Int64
    /// What the refresh failed with (bounded, printable).
    var reason: String
}

/// The etcd keys of one fleet session, `<prefix>/sessions/<name>/…`. Each key's path is also the
/// associated data its value is sealed with: a value moved to another key, session or prefix
/// does not open.
struct FleetKeys: Sendable {
    let base: String
    let state: [UInt8]
    let flight: [UInt8]
    let backoff: [UInt8]

    init(prefix: String, session: String) {
        base = prefix + "/sessions/" + session + "/"
        state = Array((base + "state").utf8)
        flight = Array((base + "flight").utf8)
        backoff = Array((base + "backoff").utf8)
    }

    var prefixBytes: [UInt8] { Array(base.utf8) }

    /// The fields of an earlier version's layout (a clear `generation` and a `record`).
    static let earlierLayout: Set<String> = ["generation", "record"]
}
