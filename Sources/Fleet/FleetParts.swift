import Basics
import TokenBrokerCore
import HTTPTransport

/// How brokers of a fleet reach etcd, and what they share there.
public struct FleetSettings: Sendable, Equatable {
    /// etcd members' client URLs (`Endpoints=`), tried in order.
    public var endpoints: [String]
    /// Where the fleet's keys live (`Prefix=`): `<prefix>/sessions/<name>/…`.
    public var prefix: String
    /// The CA, client certificate and key for etcd's TLS (`CAFile=`, `ClientCertificate=`, `ClientKey=`).
    public var tls: TLSOptions
    /// Seals every value (`KeyFile=` or `KeyCredential=`): 32 bytes or 64 hex digits.
    public var key: SecretBytes
    /// The lease of a flight (`FlightLease=`): how long a broker that took the flight and then
    /// vanished keeps the others from refreshing. Longer than an upstream request may take.
    public var flightLease: Duration
    /// The deadline of one etcd request (`RequestTimeout=`).
    public var requestTimeout: Duration
    /// This broker's name in flight claims and status (`Name=`; the host name by default).
    public var member: String

    /// What a holder keeps of its lease for its commit: one etcd request to each endpoint.
    public var commitReserve: Duration { requestTimeout * endpoints.count }

    public init(endpoints: [String], prefix: String = "/tokenbroker", tls: TLSOptions = TLSOptions(), key: SecretBytes,
                flightLease: Duration = .seconds(60), requestTimeout: Duration = .seconds(2), member: String) {
        self.endpoints = endpoints
        self.prefix = prefix
        self.tls = tls
        self.key = key
        self.flightLease = flightLease
        self.requestTimeout = requestTimeout
        self.member = member
    }
}

/// This host's copy of a fleet session: the state database, which also keeps, per session and
/// prefix, the highest position of the fleet's history this broker has applied or published
/// (its *mark*), written in the same durable commit as the session's row.
public protocol FleetLocalStore: Sendable {
    func load(_ session: String) async throws -> SessionRecord?
    /// Performs `write` if its guard holds, and raises the session's mark to `mark` (never
    /// lowers it) whether or not it applied, in one durable commit; returns whether it applied.
    func write(_ write: StoreWrite, mark: FleetPosition) async throws -> Bool
    /// The session's mark, or nil when this store has seen nothing of the fleet.
    func mark(_ session: String) async throws -> FleetPosition?
    /// A refresh this broker redeemed but could not commit to etcd yet (nil: none).
    func pendingCommit(_ session: String) async throws -> FleetPendingCommit?
    /// Keeps `pending` durably (nil: forgets it) until it is committed or overtaken.
    func keepPendingCommit(_ session: String, _ pending: FleetPendingCommit?) async throws
}

/// A refresh a holder redeemed but could not commit, as its state database keeps it: the issuer
/// has rotated, so the new refresh token must reach etcd before anyone presents the old one —
/// across a stop, a reload, a restart. Both values are sealed with the fleet key.
public struct FleetPendingCommit: Sendable, Equatable {
    /// The next state, sealed for the write after `place`.
    public var value: [UInt8]
    /// The state key as it stood (the holder's claim): its value and revisions.
    public var placeValue: [UInt8]
    public var createRevision: Int64
    public var modRevision: Int64
    public var version: Int64
    /// This host's generation the refresh belonged to.
    public var generation: Int

    public init(value: [UInt8], placeValue: [UInt8], createRevision: Int64, modRevision: Int64, version: Int64, generation: Int) {
        self.value = value
        self.placeValue = placeValue
        self.createRevision = createRevision
        self.modRevision = modRevision
        self.version = version
        self.generation = generation
    }
}

/// The coordinator, as a fleet session drives it: the boundaries and refreshes made elsewhere
/// are applied through it, so that they reach watchers and the store the usual way.
public protocol FleetFollower: AnyObject, Sendable {
    func login(refreshToken: Secret?, initial: FetchedToken?, replicated: Bool) async throws -> Int
    /// A logout made elsewhere, applied here; `handingOver` receives the refresh token in force.
    func logoutReplicated(handingOver: @Sendable (Secret) -> Void) async -> Int
    func adopt(_ fetched: FetchedToken, generation: Int, replacing expected: Secret?) async -> AdoptOutcome
    /// Returns once no flight is under way (after the one that was has landed and committed).
    func awaitFlight() async
    func status() async -> SessionStatus
    func currentToken() -> IssuedToken?
}

extension RefreshCoordinator: FleetFollower {
    /// A fleet's sessions are bearer sessions (`DPoP=yes` with `Fleet=yes` is refused at
    /// configuration): their logins carry no DPoP key.
    public func login(refreshToken: Secret?, initial: FetchedToken?, replicated: Bool) async throws -> Int {
        try await login(refreshToken: refreshToken, proofKey: nil, initial: initial, replicated: replicated)
    }
}

/// A `FleetLocalStore` in memory (development mode, tests): marks are kept with the rows.
public actor InMemoryFleetStore: FleetLocalStore {
    private let sessions: InMemorySessionStore
    private var marks: [String: FleetPosition] = [:]
    private var pending: [String: FleetPendingCommit] = [:]

    public init(_ records: [SessionRecord] = [], marks: [String: FleetPosition] = [:]) {
        sessions = InMemorySessionStore(records)
        self.marks = marks
    }

    public func load(_ session: String) async throws -> SessionRecord? {
        await sessions.load(session)
    }

    public func write(_ write: StoreWrite, mark: FleetPosition) async throws -> Bool {
        marks[write.record.name] = max(marks[write.record.name] ?? .start, mark)
        return await sessions.write(write)
    }

    public func mark(_ session: String) async throws -> FleetPosition? {
        marks[session]
    }

    public func pendingCommit(_ session: String) async throws -> FleetPendingCommit? {
        pending[session]
    }

    public func keepPendingCommit(_ session: String, _ commit: FleetPendingCommit?) async throws {
        pending[session] = commit
    }
}
