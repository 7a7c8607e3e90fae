/// Names one upstream request ("flight") of one coordinator. Never reused.
public struct FlightID: Hashable, Sendable, CustomStringConvertible {
    public let rawValue: UInt64
    public init(_ rawValue: UInt64) { self.rawValue = rawValue }
    public var description: String { "flight #\(rawValue)" }
}

/// The decisions of one session's refresh coordinator, with no I/O and no concurrency.
///
/// Each event (a demand, a fetch outcome, a commit outcome, login, logout) mutates the state and
/// returns an action that the `RefreshCoordinator` actor carries out: deliver a token, start a
/// fetch, park a waiter on a flight, write to the store, resolve a flight's waiters. Time comes in
/// as arguments: `now` is the monotonic offset since the coordinator started, `unixNow` the wall
/// clock (used only to convert lifetimes into the `expiresAt` the API reports and the store keeps).
///
/// Invariants:
/// - at most one flight exists (guarantee 1); its id is unique, so a result that arrives for a
///   flight that is no longer current (logout, login, shutdown) is recognised and dropped;
/// - a flight's token is installed only after its commit outcome is known (guarantee 7), and
///   only if the flight is still current, that is, its generation is still the session's;
/// - a boundary (logout, login) bumps the generation, drops the flight and resolves its waiters
///   with `signedOut` (guarantee 3).
public struct RefreshStateMachine: Sendable {
    public enum Phase: Sendable, Equatable {
        /// Logged out or never logged in (also while a login is being persisted).
        case signedOut
        /// A credential is installed; tokens can be fetched.
        case active
        /// A terminal failure ended the session until the next login.
        case ended(reason: String)

        /// The phase without its details.
        public var state: SessionState {
            switch self {
            case .signedOut: return .signedOut
            case .active: return .active
            case .ended: return .ended
            }
        }
    }

    /// A demand for a token.
    public enum Demand: Sendable {
        /// `GetToken`: the current token, refreshed if it has expired.
        case get
        /// `GetToken` with a minimum validity: the current token if it is valid for `minimum`
        /// more, else the session's one refresh (joined, or started: charged to the demander,
        /// who could otherwise make a refresh of every call); `lifetimeTooShort` when the
        /// issuer's tokens live less than that here, with no refresh.
        case valid(for: Duration)
        /// `Recover`: the worker's request was rejected with `rejected`.
        case recover(rejected: Secret)
        /// An operator's forced refresh: joins the flight under way or starts one (backoff
        /// and the refresh guard still apply).
        case refresh
    }

    /// What to do about a demand.
    public enum DemandAction: Sendable, Equatable {
        /// Answer at once.
        case deliver(IssuedToken)
        /// Answer at once and start a background refresh (refresh-ahead).
        case deliverAndStart(IssuedToken, FetchRequest, FlightID)
        /// Start a fetch and wait for it.
        case startAndWait(FetchRequest, FlightID)
        /// Wait for the flight already under way.
        case wait(FlightID)
        /// The refresh token is being redeemed for a derived token (`beginDerivation`), which
        /// brings this session no token: demand again once that flight is over.
        case waitForLineage(FlightID)
        /// Fail at once.
        case fail(SessionError)
    }

    /// What to do about a derived session's demand for a token derived from this session's
    /// refresh token (`beginDerivation`).
    public enum DerivationAction: Sendable, Equatable {
        /// Redeem the refresh token (the request carries it) in the flight `FlightID`.
        case start(FetchRequest, FlightID)
        /// A flight is under way: ask again once it is over (one redemption at a time).
        case waitForLineage(FlightID)
        case fail(SessionError)
    }

    /// What to do with the answer to a derivation.
    public enum DerivationLanding: Sendable, Equatable {
        /// Its flight is over (a boundary came): drop it, and revoke what it brought.
        case dropped
        /// The server did not rotate the refresh token: hand the derived token out.
        case deliver
        /// The server rotated it: the write must be durable before the derived token is handed out.
        case commit(StoreWrite)
    }

    /// The outcome of writing a fetched token to the store.
    public enum CommitOutcome: Sendable, Equatable {
        /// Durable.
        case applied
        /// The store refused it: it holds another generation (another writer moved it on).
        case rejected
        /// The store could not write (disk full, I/O error).
        case failed(reason: String)
    }

    /// Resolve a flight's waiters (if it is still current), tell watchers, maybe write.
    public struct Resolution: Sendable, Equatable {
        public var flight: FlightID
        public var result: Result<IssuedToken, SessionError>
        public var event: SessionEvent?
        public var write: StoreWrite?
    }

    /// A generation boundary (logout, login, shutdown).
    public struct Boundary: Sendable, Equatable {
        /// The flight to cancel, whose waiters get `error`.
        public var cancelled: FlightID?
        public var error: SessionError
        public var event: SessionEvent?
        public var write: StoreWrite?
    }

    private struct Current: Sendable {
        var token: Secret
        var tokenType: String
        var expiresAt: Int64?
        /// Monotonic expiry; `nil` when the server gave no lifetime.
        var deadline: Duration?
        var serial: UInt64
        /// When it was installed or restored (monotonic): with `deadline`, the lifetime it had.
        var since: Duration = .zero
        /// The lifetime its issuer gave, as counted here (`nil`: unknown, as for a token restored
        /// from the store or followed from another broker without its start).
        var lifetime: Duration?

        /// When the refresh-ahead window opens: `ahead` before expiry, but never earlier than
        /// half-way through the lifetime the token had here. A server whose tokens live less
        /// than twice `RefreshAhead=` would otherwise have every demand start a refresh.
        func windowOpens(ahead: Duration) -> Duration? {
            guard let deadline else { return nil }
            guard ahead > .zero else { return deadline }
            return max(deadline - ahead, since + (deadline - since) / 2)
        }
    }

    private struct Flight: Sendable {
        var id: FlightID
        var generation: Int
        var refreshAhead: Bool
        /// Set once the fetch returned and its write is under way.
        var committing: (current: Current, refreshToken: Secret?, unixNow: Int64)?
        /// A redemption of the refresh token for a derived session's token (RFC 8707 §2.2):
        /// it brings this session no access token, only the refresh token rotated.
        var derivation = false
        /// The rotated refresh token of a derivation, once its write is under way.
        var rotating: Secret?
    }

    private struct BackoffState: Sendable {
        var until: Duration
        var failures: Int
        var reason: String
        /// Of `failures`, the refusals without a reason (see `RefreshPolicy.refusalLimit`).
        var refusals: Int = 0
    }

    public let session: String
    public let policy: RefreshPolicy
    public private(set) var phase: Phase
    public private(set) var generation: Int
    public private(set) var counters = SessionCounters()
    public private(set) var isShutDown = false
    /// Retiring: the flight under way may finish, but no new one starts.
    public private(set) var isRetiring = false
    /// A store write that failed and should be retried; the session is degraded meanwhile.
    public private(set) var pendingWrite: StoreWrite?
    public private(set) var lastError: String?

    private var refreshToken: Secret?
    /// The generation's DPoP key (`SessionRecord.proofKey`): set by the login, kept by every
    /// refresh, dropped with the credentials.
    private var proofKey: Secret?
    private var current: Current?
    private var flight: Flight?
    private var backoff: BackoffState?
    private var budget: RefreshBudget
    private var nextFlight: UInt64 = 0
    private var lastSerial: UInt64
    private var lastRefresh: Int64?
    /// The access token a login in progress brought along.
    private var pendingLogin: Current?

    /// A coordinator's state, from what the store holds (`nil`: nothing stored yet), or from a
    /// predecessor's state together with the write it still owed the store (`pendingWrite`)
    /// and its counters (which go on counting here).
    public init(session: String, policy: RefreshPolicy, restored: SessionRecord?, pendingWrite: StoreWrite? = nil,
                counters: SessionCounters = SessionCounters(), now: Duration, unixNow: Double) {
        self.session = session
        self.counters = counters
        self.policy = policy
        self.budget = RefreshBudget(limit: policy.guardLimit, window: policy.guardWindow)
        if let pendingWrite {
            self.pendingWrite = pendingWrite
            lastError = "store: a write is still pending"
        }
        guard let record = restored else {
            phase = .signedOut
            generation = 0
            lastSerial = 0
            return
        }
        generation = record.generation
        lastSerial = record.tokenSerial
        lastRefresh = record.lastRefresh
        switch record.state {
        case .signedOut:
            phase = .signedOut
        case .ended:
            phase = .ended(reason: record.endReason ?? "session ended")
        case .active:
            phase = .active
            refreshToken = record.refreshToken
            proofKey = record.proofKey
            if let token = record.accessToken {
                // (A stored expiry is ours, but a damaged database must not trap: clamp to ±10 years.)
                let deadline = record.expiresAt.map { now + .milliseconds(Int64(min(max(Double($0) - unixNow, -3e8), 3e8) * 1000)) }
                current = Current(token: token, tokenType: record.tokenType, expiresAt: record.expiresAt,
                                  deadline: deadline, serial: record.tokenSerial, since: now)
            }
        }
    }

    // MARK: - Queries

    /// Whether a flight (fetch or its commit) is under way.
    public var isRefreshing: Bool { flight != nil }

    /// The flight under way (fetch, commit, or an adoption), if any.
    public var currentFlight: FlightID? { flight?.id }

    /// The current token and how long the hot path may hand it out without asking the state
    /// machine: until the refresh-ahead window opens (or expiry). `nil` outside `active`.
    public var publishable: (token: IssuedToken, freshUntil: Duration?, deadline: Duration?)? {
        guard phase == .active, !isShutDown, let current else { return nil }
        return (issued(current), current.windowOpens(ahead: policy.refreshAhead), current.deadline)
    }

    /// What the store should hold now (secrets included; never printed).
    public var record: SessionRecord {
        var endReason: String?
        if case let .ended(reason) = phase { endReason = reason }
        return SessionRecord(name: session, generation: generation, state: phase.state, refreshToken: refreshToken,
                             proofKey: proofKey, accessToken: current?.token, tokenType: current?.tokenType ?? "Bearer",
                             expiresAt: current?.expiresAt, lastRefresh: lastRefresh, tokenSerial: lastSerial,
                             endReason: endReason)
    }

    /// When the backoff after a failure ends (monotonic offset), if one is in force.
    public var backoffUntil: Duration? { backoff?.until }

    /// Whether `demander` is turned away by its own share of the refresh budget (not the
    /// session's) at `now`.
    public func hasSpentShare(_ demander: Demander, now: Duration) -> Bool { budget.hasSpentShare(demander, now: now) }

    /// The demanders whose share of the refresh budget is spent at `now`, and until when.
    public func spentShares(now: Duration) -> [(demander: Demander, until: Duration)] { budget.spentShares(now: now) }

    public func status(now: Duration) -> SessionStatus {
        let state = phase.state
        let remaining = backoff.flatMap { $0.until > now ? $0.until - now : nil }
        return SessionStatus(name: session, state: state, generation: generation, tokenSerial: current?.serial,
                             expiresAt: current?.expiresAt, lastRefresh: lastRefresh, refreshing: flight != nil,
                             backoffRemaining: remaining, lastError: lastError, degraded: pendingWrite != nil,
                             counters: counters, throttled: budget.spentShares(now: now).map(\.demander))
    }

    // MARK: - Demands

    /// - Parameter demander: who a refresh this demand starts is charged to (`RefreshBudget`):
    ///   the peer behind a `recover` or `refresh`. A `get` is charged to nobody: it starts a
    ///   refresh only when the token has expired, which no caller can hasten.
    public mutating func demand(_ demand: Demand, now: Duration, by demander: Demander? = nil) -> DemandAction {
        if isShutDown { return .fail(.shuttingDown) }
        switch phase {
        case .signedOut: return .fail(.signedOut)
        case let .ended(reason): return .fail(.refreshFailed(reason: reason, retryable: false, retryAfter: nil))
        case .active: break
        }
        if case .refresh = demand { return refresh(now: now, by: demander) }
        if case let .valid(minimum) = demand, let current, !isExpired(current, now: now), let deadline = current.deadline,
           deadline - now < minimum {
            // Not valid long enough. A refresh helps only if the issuer's tokens live longer
            // than asked: said at once when the last one it gave did not.
            if let lifetime = current.lifetime, lifetime < minimum {
                return .fail(.lifetimeTooShort(lifetime: lifetime, asked: minimum))
            }
            return refresh(now: now, by: demander)
        }
        if case let .recover(rejected) = demand {
            // Guarantee 2: a rejection of a token that is no longer current is stale. The
            // worker gets the current token (refreshed first only if it has itself expired).
            guard let current, current.token != rejected else { return refresh(now: now, by: demander) }
            counters.staleRejections += 1
        }
        guard let current, !isExpired(current, now: now) else { return refresh(now: now, by: nil) }
        let token = issued(current)
        // A refresh ahead of expiry is advisory: it never spends the last half of the guard's
        // budget, which stays for refreshes the session cannot do without.
        guard policy.refreshAhead > .zero, let opens = current.windowOpens(ahead: policy.refreshAhead), now >= opens,
              flight == nil, !isRetiring, !inBackoff(now: now), budget.retryAfter(now: now, for: nil, allowing: expiryRefreshes) == nil,
              budget.ownCount(now: now) < expiryRefreshes + policy.guardLimit / 2
        else { return .deliver(token) }
        let (request, id) = startFlight(now: now, refreshAhead: true, charging: nil)
        return .deliverAndStart(token, request, id)
    }

    /// A demand that needs a new token: join the flight, or start one if backoff and the budget
    /// allow (joining costs nobody's budget).
    private mutating func refresh(now: Duration, by demander: Demander?) -> DemandAction {
        if let flight {
            if flight.derivation { return .waitForLineage(flight.id) }
            counters.joinedWaiters += 1
            return .wait(flight.id)
        }
        if isRetiring { return .fail(.shuttingDown) }
        if let backoff, now < backoff.until {
            return .fail(.refreshFailed(reason: backoff.reason, retryable: true, retryAfter: backoff.until - now))
        }
        if let wait = budget.retryAfter(now: now, for: demander, allowing: expiryRefreshes) {
            counters.throttled += 1
            return .fail(.throttled(retryAfter: wait))
        }
        let (request, id) = startFlight(now: now, refreshAhead: false, charging: demander)
        return .startAndWait(request, id)
    }

    /// The refreshes per guard window that expiry needs with tokens of the lifetime the current
    /// one had here (`RefreshPolicy.expiryRefreshes`), allowed on top of `RefreshLimitBurst=`
    /// (6-second tokens against the default 10 per 60 s used to fail one call in ten).
    public var expiryRefreshes: Int {
        guard let current, let deadline = current.deadline else { return 0 }
        return policy.expiryRefreshes(lifetime: deadline - current.since)
    }

    private mutating func startFlight(now: Duration, refreshAhead: Bool, charging demander: Demander?) -> (FetchRequest, FlightID) {
        nextFlight += 1
        let id = FlightID(nextFlight)
        flight = Flight(id: id, generation: generation, refreshAhead: refreshAhead)
        budget.record(now: now, for: demander)
        counters.fetches += 1
        return (FetchRequest(session: session, generation: generation, refreshToken: refreshToken, proofKey: proofKey,
                             tokenType: current?.tokenType), id)
    }

    /// A token that arrives from elsewhere (another broker of a fleet refreshed the session):
    /// opens a flight for it, with no upstream request, so that it takes the same path as a
    /// fetched token (`fetchSucceeded`, the store, `commitFinished`). `nil` when the session is
    /// not active in `generation`, or a flight is under way (which will bring the token itself).
    public mutating func beginAdoption(generation: Int) -> FlightID? {
        guard phase == .active, !isShutDown, !isRetiring, self.generation == generation, flight == nil else { return nil }
        nextFlight += 1
        let id = FlightID(nextFlight)
        flight = Flight(id: id, generation: generation, refreshAhead: false)
        return id
    }

    // MARK: - Derivations: one refresh-token lineage

    /// A derived session (`Derivation=refresh`) asks for a token derived from this session's
    /// refresh token. The redemption is a flight of this session: never beside its own refresh
    /// nor another derivation (a rotating refresh token is redeemed once), ended by its
    /// boundaries like any flight; it charges nothing to this session's refresh guard or
    /// backoff (the derived session has its own) and brings this session no access token.
    public mutating func beginDerivation() -> DerivationAction {
        if isShutDown { return .fail(.shuttingDown) }
        switch phase {
        case .signedOut: return .fail(.signedOut)
        case let .ended(reason): return .fail(.refreshFailed(reason: reason, retryable: false, retryAfter: nil))
        case .active: break
        }
        if let flight { return .waitForLineage(flight.id) }
        if isRetiring { return .fail(.shuttingDown) }
        guard let refreshToken else {
            return .fail(.refreshFailed(reason: "the session holds no refresh token to derive from", retryable: false, retryAfter: nil))
        }
        nextFlight += 1
        let id = FlightID(nextFlight)
        flight = Flight(id: id, generation: generation, refreshAhead: false, derivation: true)
        counters.derivations += 1
        return .start(FetchRequest(session: session, generation: generation, refreshToken: refreshToken, proofKey: proofKey,
                                   tokenType: current?.tokenType), id)
    }

    /// A derivation's answer arrived.
    public mutating func derivationSucceeded(_ id: FlightID, _ fetched: FetchedToken) -> DerivationLanding {
        guard var flight, flight.id == id, flight.derivation, flight.generation == generation, flight.rotating == nil else {
            counters.droppedResults += 1
            return .dropped
        }
        guard let rotated = fetched.refreshToken, rotated != refreshToken else {
            self.flight = nil
            return .deliver
        }
        flight.rotating = rotated
        self.flight = flight
        var record = self.record
        record.refreshToken = rotated
        return .commit(StoreWrite(record, guardedBy: writeGuard(.sameGeneration)))
    }

    /// The write of a derivation's rotated refresh token finished: `nil` when a boundary came
    /// meanwhile (the derived token is dropped), else the error the derived session gets, if
    /// any. A failed write is kept to retry (degraded), as a refresh's is; a rejected one means
    /// another writer ended this generation.
    public mutating func derivationCommitted(_ id: FlightID, _ outcome: CommitOutcome) -> (error: SessionError?, event: SessionEvent?)? {
        guard let flight, flight.id == id, flight.derivation, let rotated = flight.rotating else {
            counters.droppedResults += 1
            return nil
        }
        self.flight = nil
        switch outcome {
        case .applied:
            refreshToken = rotated
            pendingWrite = nil
            return (nil, nil)
        case let .failed(reason):
            refreshToken = rotated
            lastError = "store: \(reason)"
            pendingWrite = StoreWrite(record, guardedBy: writeGuard(.sameGeneration), replicated: true)
            return (nil, nil)
        case .rejected:
            generation += 1
            phase = .signedOut
            clearCredentials()
            lastError = "store holds a newer generation"
            return (.signedOut, .signedOut(generation: generation))
        }
    }

    /// A derivation failed: the failure is the derived session's alone (its backoff, its end);
    /// this session's state is unchanged. Returns whether the flight was still current.
    public mutating func derivationFailed(_ id: FlightID) -> Bool {
        guard let flight, flight.id == id, flight.derivation, flight.rotating == nil else { return false }
        self.flight = nil
        return true
    }

    // MARK: - Flight outcomes

    /// The fetch returned a token: returns the write that must be durable before anyone sees it,
    /// or `nil` when the flight is no longer current (its answer is dropped).
    public mutating func fetchSucceeded(_ id: FlightID, _ fetched: FetchedToken, now: Duration, unixNow: Double) -> StoreWrite? {
        guard var flight, flight.id == id, !flight.derivation, flight.generation == generation, flight.committing == nil else {
            counters.droppedResults += 1
            return nil
        }
        let (expiresAt, deadline, lifetime) = Self.ending(of: fetched, now: now, unixNow: unixNow)
        let next = Current(token: fetched.accessToken, tokenType: fetched.tokenType, expiresAt: expiresAt,
                           deadline: deadline, serial: lastSerial + 1, since: now, lifetime: lifetime)
        let nextRefreshToken = fetched.refreshToken(replacing: refreshToken)
        let stamp = Int64(unixNow.rounded(.down))
        flight.committing = (next, nextRefreshToken, stamp)
        self.flight = flight
        var record = self.record
        record.refreshToken = nextRefreshToken
        record.accessToken = next.token
        record.tokenType = next.tokenType
        record.expiresAt = next.expiresAt
        record.tokenSerial = next.serial
        record.lastRefresh = stamp
        return StoreWrite(record, guardedBy: writeGuard(.sameGeneration))
    }

    /// The write of a fetched token finished: install it and resolve the waiters. A token that
    /// ended before `now` (an issuer's lifetime shorter than the exchange took) is installed —
    /// its refresh token is the session's now — but handed to nobody: the waiters get a
    /// retryable failure saying so.
    public mutating func commitFinished(_ id: FlightID, _ outcome: CommitOutcome, now: Duration? = nil) -> Resolution? {
        guard let flight, flight.id == id, let (next, nextRefreshToken, stamp) = flight.committing else {
            counters.droppedResults += 1
            return nil
        }
        self.flight = nil
        switch outcome {
        case .applied, .failed:
            current = next
            refreshToken = nextRefreshToken
            lastSerial = next.serial
            lastRefresh = stamp
            backoff = nil
            if case let .failed(reason) = outcome {
                // Degraded: serve from memory, keep the write to retry (the store decides how).
                lastError = "store: \(reason)"
                // `replicated`: a fetched token is the source's to share, and a store shared
                // with others has it already (a fleet's source commits before it returns).
                pendingWrite = StoreWrite(record, guardedBy: writeGuard(.sameGeneration), replicated: true)
            } else {
                pendingWrite = nil
            }
            let token = issued(next)
            if let now, isExpired(next, now: now) {
                let reason = "the issuer's token had ended when its answer arrived (its lifetime is shorter than the request took)"
                lastError = reason
                return Resolution(flight: id, result: .failure(.refreshFailed(reason: reason, retryable: true, retryAfter: nil)), event: nil, write: nil)
            }
            return Resolution(flight: id, result: .success(token), event: .token(token), write: nil)
        case .rejected:
            // The store holds another generation: another writer has logged this session out or
            // in. This coordinator's generation is over; its token must not be handed out.
            generation += 1
            phase = .signedOut
            clearCredentials()
            lastError = "store holds a newer generation"
            return Resolution(flight: id, result: .failure(.signedOut), event: .signedOut(generation: generation), write: nil)
        }
    }

    /// The fetch failed: every waiter gets the same error; the flight is cleared.
    ///
    /// - Parameter unit: a random number in [0, 1) for the backoff's jitter.
    public mutating func fetchFailed(_ id: FlightID, _ failure: FetchFailure, now: Duration, unit: Double) -> Resolution? {
        guard let flight, flight.id == id, !flight.derivation, flight.committing == nil else {
            counters.droppedResults += 1
            return nil
        }
        self.flight = nil
        counters.failures += 1
        var failure = failure
        // Only a refresh token can be dead: a client_credentials session keeps retrying.
        if case .refused = failure.kind, refreshToken != nil, (backoff?.refusals ?? 0) + 1 >= policy.refusalLimit {
            // The server keeps refusing this session: it ends, and stops sending a dead token.
            failure = .terminal("\(failure.reason), \(policy.refusalLimit) times in a row: the server refuses this session's refresh "
                                + "(a revoked, replayed or unknown refresh token, or wrong client credentials); log in again "
                                + "(tokenbroker ctl login) or check the client configuration")
        }
        lastError = failure.message
        switch failure.kind {
        case let .transient(retryAfter), let .refused(retryAfter):
            let failures = (backoff?.failures ?? 0) + 1
            var refusals = backoff?.refusals ?? 0
            if case .refused = failure.kind { refusals += 1 }
            let delay = policy.backoff.delay(failures: failures, unit: unit, retryAfter: retryAfter)
            backoff = BackoffState(until: now + delay, failures: failures, reason: failure.reason, refusals: refusals)
            return Resolution(flight: id, result: .failure(.refreshFailed(reason: failure.reason, retryable: true, retryAfter: delay)),
                              event: nil, write: nil)
        case .terminal:
            phase = .ended(reason: failure.reason)
            clearCredentials()
            return Resolution(flight: id, result: .failure(.refreshFailed(reason: failure.reason, retryable: false, retryAfter: nil)),
                              event: .signedOut(generation: generation),
                              write: StoreWrite(record, guardedBy: writeGuard(.sameGeneration)))
        }
    }

    // MARK: - Boundaries

    /// Logout: a new generation with no credential. The returned write must be durable before
    /// the logout is acknowledged.
    public mutating func logout() -> Boundary {
        var boundary = endGeneration(error: .signedOut)
        boundary.write = StoreWrite(record, guardedBy: .newerGeneration)
        return boundary
    }

    /// Login, first half: ends the current generation like a logout and returns the write that
    /// installs `refreshToken` and `proofKey` (and `initial`, an access token the login itself
    /// produced, such as the device grant's) under the new one. The session stays signed out until
    /// `loginFinished` reports the write durable, so no token of the new generation exists
    /// before the store has it.
    public mutating func beginLogin(refreshToken: Secret?, proofKey: Secret? = nil, initial: FetchedToken? = nil, now: Duration = .zero,
                                    unixNow: Double = 0) -> Boundary {
        var boundary = endGeneration(error: .signedOut)
        var record = self.record
        record.state = .active
        record.refreshToken = refreshToken
        record.proofKey = proofKey
        if let initial {
            let serial = lastSerial + 1
            let (expiresAt, deadline, lifetime) = Self.ending(of: initial, now: now, unixNow: unixNow)
            pendingLogin = Current(token: initial.accessToken, tokenType: initial.tokenType, expiresAt: expiresAt,
                                   deadline: deadline, serial: serial, since: now, lifetime: lifetime)
            record.accessToken = initial.accessToken
            record.tokenType = initial.tokenType
            record.expiresAt = pendingLogin?.expiresAt
            record.tokenSerial = serial
            record.lastRefresh = Int64(unixNow.rounded(.down))
        } else {
            pendingLogin = nil
        }
        boundary.write = StoreWrite(record, guardedBy: .newerGeneration)
        return boundary
    }

    /// Login, second half. Fails when another boundary overtook this login while it was written,
    /// or when the write failed (the session then stays signed out, and that is what the
    /// store is told next).
    public mutating func loginFinished(_ write: StoreWrite, _ outcome: CommitOutcome) -> Result<Int, SessionError> {
        guard write.record.generation == generation, phase == .signedOut, !isShutDown else { return .failure(.signedOut) }
        defer { pendingLogin = nil }
        switch outcome {
        case .applied:
            phase = .active
            refreshToken = write.record.refreshToken
            proofKey = write.record.proofKey
            if let initial = pendingLogin {
                current = initial
                lastSerial = initial.serial
                lastRefresh = write.record.lastRefresh
            }
            pendingWrite = nil
            lastError = nil
            return .success(generation)
        case .rejected:
            return .failure(.signedOut)
        case let .failed(reason):
            // The boundary itself stands: the store must still learn that the old generation
            // is over, so the signed-out state is kept as a pending write.
            lastError = "store: \(reason)"
            pendingWrite = StoreWrite(record, guardedBy: .newerGeneration, replicated: write.replicated)
            return .failure(.storeFailed(reason: reason))
        }
    }

    /// The refresh token in force (the one a logout should revoke).
    public var currentRefreshToken: Secret? { refreshToken }

    /// The generation's DPoP key, if its requests carry proofs (a derived session's login takes
    /// its parent's: its tokens are bound to the same key).
    public var currentProofKey: Secret? { proofKey }

    /// Retirement, first half: no new flight starts (demands that would need one fail with
    /// `shuttingDown`); the one under way, if any, may still land and commit.
    public mutating func retire() {
        isRetiring = true
    }

    /// Shutdown: the flight is dropped and its waiters get `shuttingDown`; later demands too.
    public mutating func shutdown() -> Boundary {
        isShutDown = true
        let cancelled = flight?.id
        flight = nil
        return Boundary(cancelled: cancelled, error: .shuttingDown, event: nil, write: nil)
    }

    /// A boundary's write (logout) failed: keep it to retry; the session is degraded meanwhile.
    public mutating func writeFailed(_ write: StoreWrite, reason: String) {
        lastError = "store: \(reason)"
        guard write.record.generation >= (pendingWrite?.record.generation ?? Int.min) else { return }
        pendingWrite = StoreWrite(write.record, guardedBy: writeGuard(write.guardedBy), replicated: write.replicated)
    }

    /// A retried pending write has reached the store (applied, or superseded there).
    public mutating func pendingWriteSettled(_ write: StoreWrite) {
        if pendingWrite == write { pendingWrite = nil }
    }

    private mutating func endGeneration(error: SessionError) -> Boundary {
        // Watchers hear of the boundary only when it ends a usable session.
        let wasActive = phase == .active
        generation += 1
        phase = .signedOut
        clearCredentials()
        let cancelled = flight?.id
        flight = nil
        backoff = nil
        return Boundary(cancelled: cancelled, error: error, event: wasActive ? .signedOut(generation: generation) : nil, write: nil)
    }

    private mutating func clearCredentials() {
        refreshToken = nil
        proofKey = nil
        current = nil
    }

    // MARK: - Helpers

    /// While an earlier write that advances the generation is still pending, the store is
    /// behind: a later write must advance it too (it carries the whole newer state).
    private func writeGuard(_ wanted: StoreWrite.Guard) -> StoreWrite.Guard {
        pendingWrite?.guardedBy == .newerGeneration ? .newerGeneration : wanted
    }

    /// A fetched token's end (`FetchedToken.expiresAt(receivedAt:)`), as Unix seconds rounded
    /// down and on the monotonic line, for an answer received at `now` (`unixNow`); and the
    /// lifetime its issuer gave, counted from its start (unknown for a remainder).
    private static func ending(of fetched: FetchedToken, now: Duration, unixNow: Double) -> (expiresAt: Int64?, deadline: Duration?, lifetime: Duration?) {
        guard let end = fetched.expiresAt(receivedAt: unixNow), end.isFinite else { return (nil, nil, nil) }
        // (Bounded by Upstream's longest lifetime; clamped here all the same: no input traps.)
        let left = min(max(end - unixNow, -3e8), 3e8)
        let start = fetched.lifetimeStart.map { min(Double($0), unixNow) } ?? unixNow
        let lifetime = fetched.lifetimeIsRemainder ? nil : Duration.milliseconds(Int64((min(max(end - start, 0), 3e8) * 1000).rounded(.down)))
        return (Int64((unixNow + left).rounded(.down)), now + .milliseconds(Int64((left * 1000).rounded(.down))), lifetime)
    }

    private func isExpired(_ current: Current, now: Duration) -> Bool {
        current.deadline.map { now >= $0 } ?? false
    }

    private func inBackoff(now: Duration) -> Bool {
        backoff.map { now < $0.until } ?? false
    }

    private func issued(_ current: Current) -> IssuedToken {
        IssuedToken(token: current.token, tokenType: current.tokenType, expiresAt: current.expiresAt,
                    generation: generation, serial: current.serial, proofKey: proofKey)
    }
}
