import Synchronization

/// The hot path's copy of a coordinator's current token. (Not nested in the generic
/// coordinator: a nested type's metadata would be looked up at run time on every call.)
private struct PublishedToken: Sendable {
    var token: IssuedToken
    /// Monotonic offset until which the token may be handed out without the actor;
    /// `nil`: no expiry.
    var freshUntil: Duration?
    /// When it expires (monotonic); `nil`: no expiry.
    var deadline: Duration?
}

/// What became of `RefreshCoordinator.adopt`.
public enum AdoptOutcome: Sendable, Equatable {
    case adopted
    /// A flight is under way here: adopt again once it has landed (`awaitFlight`).
    case busy
    /// The token handed out is no longer the one the caller decided on.
    case superseded
    /// The session is not active in that generation here, or the coordinator retires.
    case over
}

/// Owns one session: hands out its current token, runs at most one upstream refresh at a time
/// for all callers, and enforces the logout boundary.
///
/// The decisions live in `RefreshStateMachine`; this actor carries out its actions: it starts
/// the fetch, parks and resolves waiters, writes to the store, tells watchers. After every
/// `await` it asks the state machine again instead of trusting what it knew before.
///
/// - The in-flight fetch is the coordinator's only unstructured `Task`. Many callers wait on it,
///   so no caller's cancellation stops it; only a boundary (logout, login, shutdown) cancels it,
///   and even a fetch that ignores the cancellation and succeeds cannot install its token, since
///   its flight is no longer current.
/// - A caller whose task is cancelled leaves **at once** with `CancellationError`; the flight
///   goes on for the others and installs its token for later demands.
/// - A fetched token is written to the store (generation-guarded) before any caller receives it.
/// - `freshToken()` answers the common case, a current token outside the refresh-ahead window,
///   from a `Mutex`-guarded snapshot without entering the actor.
public actor RefreshCoordinator<C: Clock> where C.Duration == Duration {
    public nonisolated let session: String

    private let source: any TokenSource
    private let store: any SessionStore
    private nonisolated let clock: C
    private let wall: any WallClock
    private let randomUnit: @Sendable () -> Double
    private let discarded: @Sendable (FetchedToken) -> Void
    private let outcomes: @Sendable (RefreshOutcome) -> Void
    private let boundaries: @Sendable (SessionBoundary) async -> Void
    private nonisolated let epoch: C.Instant

    /// Every change is observed (`observe()`): the status snapshot and the summary follow it.
    private var machine: RefreshStateMachine {
        didSet { observe() }
    }
    private var flightTask: RunningFlight?
    private var nextWaiter: UInt64 = 0
    private let waiters = WaiterTable()
    private let watchers: WatcherList
    private nonisolated let published = Mutex<PublishedToken?>(nil)
    /// The generation's DPoP key as of the last change (`proofKey`).
    private nonisolated let publishedKey = Mutex<Secret?>(nil)
    private nonisolated let observation: Observation

    /// The session as `status()` would answer it, kept current at every change of the state
    /// machine, so that a daemon with thousands of sessions reads them without entering each
    /// actor; and the summary its observer is told of.
    private final class Observation: Sendable {
        struct State {
            var status: SessionStatus
            var backoffUntil: Duration?
            /// The demanders whose share is spent, and until when (`status.throttled` is
            /// those still throttled when it is read).
            var throttledUntil: [(demander: Demander, until: Duration)]
            var summary: SessionSummary
            /// Counts the changes of `status` (a cache of what was made of it knows when it is stale).
            var version: UInt64 = 0
        }

        let state: Mutex<State>
        let observer: @Sendable (SessionSummary) -> Void

        init(_ initial: State, observer: @escaping @Sendable (SessionSummary) -> Void) {
            state = Mutex(initial)
            self.observer = observer
        }

        /// Applies `change`; tells the observer, under the lock (so in order), when the summary changed.
        func update(_ change: (inout State) -> Void) {
            state.withLock { state in
                let before = state.summary
                change(&state)
                if state.summary != before { observer(state.summary) }
            }
        }
    }

    /// The task of the flight under way: a refresh's, or a derivation's (which answers its one
    /// caller).
    private struct RunningFlight {
        let id: FlightID
        let cancel: @Sendable () -> Void
        let finished: @Sendable () async -> Void

        init<T: Sendable>(_ id: FlightID, _ task: Task<T, Never>) {
            self.id = id
            cancel = { task.cancel() }
            finished = { _ = await task.value }
        }
    }

    /// - Parameters:
    ///   - restored: what the store held for this session at start-up (`nil`: nothing).
    ///   - randomUnit: draws the backoff jitter, a number in [0, 1).
    ///   - discarded: receives a successful answer that arrived after its generation had ended
    ///     (a logout or login overtook the flight); the daemon revokes what it carries, since
    ///     nobody will ever use it.
    ///   - outcomes: told what became of each refresh (for the log); called on the actor, so it
    ///     must not block.
    ///   - summaries: told the session's summary each time it changes, in order, under a lock:
    ///     it must not block nor call back into the coordinator.
    ///   - boundaries: told of each login and logout once it is in effect, before the call that
    ///     made it returns, and of a refresh that ended the session, and awaited (the daemon's
    ///     derived sessions follow their parent's).
    public init(session: String, policy: RefreshPolicy = RefreshPolicy(), source: any TokenSource,
                store: any SessionStore, restored: SessionRecord? = nil, pendingWrite: StoreWrite? = nil,
                counters: SessionCounters = SessionCounters(), clock: C, wall: any WallClock,
                randomUnit: @escaping @Sendable () -> Double = { Double.random(in: 0..<1) },
                discarded: @escaping @Sendable (FetchedToken) -> Void = { _ in },
                outcomes: @escaping @Sendable (RefreshOutcome) -> Void = { _ in },
                summaries: @escaping @Sendable (SessionSummary) -> Void = { _ in },
                boundaries: @escaping @Sendable (SessionBoundary) async -> Void = { _ in }) {
        self.session = session
        self.source = source
        self.store = store
        self.clock = clock
        self.wall = wall
        self.randomUnit = randomUnit
        self.discarded = discarded
        self.outcomes = outcomes
        self.boundaries = boundaries
        let epoch = clock.now
        self.epoch = epoch
        let machine = RefreshStateMachine(session: session, policy: policy, restored: restored, pendingWrite: pendingWrite,
                                          counters: counters, now: .zero, unixNow: wall.unixTime())
        self.machine = machine
        let observation = Observation(Self.observed(machine, watched: false, now: .zero), observer: summaries)
        self.observation = observation
        watchers = WatcherList(countChanged: { count in observation.update { $0.summary.watched = count > 0 } })
        published.withLock { $0 = machine.publishable.map { PublishedToken(token: $0.token, freshUntil: $0.freshUntil, deadline: $0.deadline) } }
        publishedKey.withLock { $0 = machine.currentProofKey }
    }

    private static func observed(_ machine: RefreshStateMachine, watched: Bool, now: Duration) -> Observation.State {
        var status = machine.status(now: now)
        status.backoffRemaining = nil
        return Observation.State(status: status, backoffUntil: machine.backoffUntil, throttledUntil: machine.spentShares(now: now),
                                 summary: SessionSummary(state: status.state, degraded: status.degraded, lastRefresh: status.lastRefresh,
                                                         watched: watched))
    }

    private func observe() {
        let next = Self.observed(machine, watched: false, now: now())
        observation.update { state in
            let (watched, version) = (state.summary.watched, state.version)
            state = next
            state.summary.watched = watched
            state.version = version &+ 1
        }
    }

    private nonisolated func now() -> Duration { epoch.duration(to: clock.now) }

    // MARK: - Tokens

    /// The current token when it is valid and outside the refresh-ahead window, read without
    /// entering the actor; `nil` means "ask `token()`".
    public nonisolated func freshToken() -> IssuedToken? {
        published.withLock { published in
            guard let published else { return nil }
            if let freshUntil = published.freshUntil, now() >= freshUntil { return nil }
            return published.token
        }
    }

    /// `freshToken()` for a caller that needs the token valid for `minimum` more; `nil`: ask
    /// `token(validFor:)`.
    public nonisolated func freshToken(validFor minimum: Duration) -> IssuedToken? {
        published.withLock { published in
            guard let published else { return nil }
            let now = now()
            if let freshUntil = published.freshUntil, now >= freshUntil { return nil }
            if let deadline = published.deadline, deadline - now < minimum { return nil }
            return published.token
        }
    }

    /// The token the hot path hands out now, fresh or not (`nil` when there is none).
    public nonisolated func currentToken() -> IssuedToken? {
        published.withLock { $0?.token }
    }

    /// The current token; waits for the shared refresh when it has expired or there is none.
    /// Inside the refresh-ahead window it answers at once and starts one background refresh.
    public func token() async throws -> IssuedToken {
        try await run(.get)
    }

    /// The current token if it is valid for `minimum` more; else it waits for the session's one
    /// refresh (a refresh it starts is charged to `demander`), then answers with the new token,
    /// or `lifetimeTooShort` when the issuer's tokens live less than `minimum` (no second
    /// refresh: at most one more demand, which delivers or says so).
    public func token(validFor minimum: Duration, by demander: Demander? = nil) async throws -> IssuedToken {
        let token = try await run(.valid(for: minimum), by: demander)
        guard let published = machine.publishable, let deadline = published.deadline, deadline - now() < minimum else { return token }
        return try await run(.valid(for: minimum), by: demander)
    }

    /// The worker's request was rejected with `rejected`, the token it actually sent. If that is
    /// no longer the current token, the current one comes back at once (guarantee 2); otherwise
    /// the caller joins the one shared refresh (guarantee 1).
    ///
    /// A refresh it starts is charged to `demander` (`RefreshBudget`): a peer that spent its
    /// share is throttled alone.
    public func recover(rejected: Secret, by demander: Demander? = nil) async throws -> IssuedToken {
        try await run(.recover(rejected: rejected), by: demander)
    }

    /// Starts the refresh a demand would start now — refresh-ahead inside the window, or a
    /// refresh of an expired or missing token — without waiting for it. For sessions whose
    /// only users are watchers: nobody else would ask, and they want the next token before the
    /// current one expires. Backoff, the refresh guard and the single flight apply as usual.
    public func prefetch() {
        guard machine.phase == .active, !machine.isShutDown, freshToken() == nil else { return }
        switch machine.demand(.get, now: now()) {
        case let .deliverAndStart(_, request, id), let .startAndWait(request, id):
            launch(request, id)
        case .deliver, .wait, .waitForLineage, .fail:
            break
        }
    }

    /// Number of `watch()` subscribers.
    public nonisolated var watcherCount: Int { watchers.count }

    /// Refreshes now, whatever the current token (an operator's `ctl refresh`): joins the
    /// flight under way or starts one; backoff and the refresh guard still apply.
    public func refresh(by demander: Demander? = nil) async throws -> IssuedToken {
        try await run(.refresh, by: demander)
    }

    private func run(_ demand: RefreshStateMachine.Demand, by demander: Demander? = nil) async throws -> IssuedToken {
        while true {
            let action = machine.demand(demand, now: now(), by: demander)
            guard case let .waitForLineage(flight) = action else { return try await run(action, by: demander) }
            // A derivation redeems the refresh token: once it is over, this demand is decided anew.
            await awaitFlight(flight)
            try Task.checkCancellation()
        }
    }

    private func run(_ action: RefreshStateMachine.DemandAction, by demander: Demander?) async throws -> IssuedToken {
        switch action {
        case let .deliver(token):
            return token
        case let .deliverAndStart(token, request, id):
            launch(request, id)
            return token
        case let .startAndWait(request, id):
            launch(request, id)
            return try await wait(on: id)
        case let .wait(id):
            return try await wait(on: id)
        case .waitForLineage:
            preconditionFailure("decided by run(_ demand:)")
        case let .fail(error):
            if case let .throttled(retryAfter) = error {
                // Whose budget is spent: this demander's share (it alone is turned away), or the session's.
                let alone = demander.flatMap { machine.hasSpentShare($0, now: now()) ? $0 : nil }
                outcomes(RefreshOutcome(session: session, generation: machine.generation, duration: .zero,
                                        result: .throttled(retryAfter: retryAfter, demander: alone)))
            }
            throw error
        }
    }

    private func wait(on flight: FlightID) async throws -> IssuedToken {
        nextWaiter += 1
        let waiter = nextWaiter
        waiters.register(waiter, on: flight)
        return try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { continuation in
                waiters.park(waiter, continuation)
            }
        } onCancel: { [waiters] in
            waiters.cancel(waiter)
        }
    }

    // MARK: - The flight

    private func launch(_ request: FetchRequest, _ id: FlightID) {
        let source = self.source
        let started = now()
        let task = Task {
            let outcome: Result<FetchedToken, any Error>
            do {
                outcome = .success(try await source.fetch(request))
            } catch {
                outcome = .failure(error)
            }
            await self.landed(id, outcome, started: started, generation: request.generation)
        }
        flightTask = RunningFlight(id, task)
    }

    private func landed(_ id: FlightID, _ outcome: Result<FetchedToken, any Error>, started: Duration, generation: Int) async {
        // The task stays recorded until its answer is committed, so `retire()` waits for both.
        defer { if flightTask?.id == id { flightTask = nil } }
        let duration = now() - started
        func report(_ result: RefreshOutcome.Result) {
            outcomes(RefreshOutcome(session: session, generation: generation, duration: duration, result: result))
        }
        switch outcome {
        case let .success(fetched):
            guard let write = machine.fetchSucceeded(id, fetched, now: now(), unixNow: wall.unixTime()) else {
                report(.dropped)
                discarded(fetched)
                return
            }
            let committed = await commit(write)
            // Re-check after the await: a logout may have ended this flight meanwhile.
            guard let resolution = machine.commitFinished(id, committed, now: now()) else {
                report(.dropped)
                discarded(fetched)
                return
            }
            resolve(resolution)
            switch resolution.result {
            case let .success(token): report(.refreshed(serial: token.serial, lifetime: fetched.expiresIn))
            case .failure: report(.dropped)
            }
        case let .failure(error):
            let failure = Self.classify(error)
            guard let resolution = machine.fetchFailed(id, failure, now: now(), unit: randomUnit()) else {
                report(.dropped)
                return
            }
            resolve(resolution)
            // The journal gets the server's own words too (`lastError`); workers get the reason.
            if case let .ended(reason) = machine.phase {
                report(.ended(reason: machine.lastError ?? reason))
                await boundaries(.ended(generation: machine.generation))
            } else {
                var refused = false
                if case .refused = failure.kind { refused = true }
                var retryAfter: Duration?
                if case let .failure(.refreshFailed(_, _, wait)) = resolution.result { retryAfter = wait }
                report(.failed(reason: failure.message, refused: refused, retryAfter: retryAfter))
            }
            if let write = resolution.write { await persist(write) }
        }
    }

    private func resolve(_ resolution: RefreshStateMachine.Resolution) {
        republish()
        waiters.resolve(resolution.flight, with: resolution.result)
        if let event = resolution.event { watchers.send(event) }
    }

    /// What the source threw, as a classified failure. Only the type of an unknown error is
    /// kept: its description might quote a request.
    static func classify(_ error: any Error) -> FetchFailure {
        switch error {
        case let failure as FetchFailure: return failure
        case is CancellationError: return .transient("cancelled")
        default: return .transient("unexpected error (\(type(of: error)))")
        }
    }

    /// Installs a token another broker of the fleet fetched and committed, as if this
    /// coordinator had refreshed: written to the store (this host's copy) first, then handed
    /// out and told to watchers — only in `generation`, only between flights, and only while the
    /// token handed out is still `replacing` (what the caller's decision was based on).
    public func adopt(_ fetched: FetchedToken, generation: Int, replacing expected: Secret?) async -> AdoptOutcome {
        guard machine.phase == .active, !machine.isShutDown, !machine.isRetiring, machine.generation == generation else { return .over }
        guard machine.currentFlight == nil else { return .busy }
        guard machine.publishable?.token.token == expected else { return .superseded }
        guard let id = machine.beginAdoption(generation: generation),
              var write = machine.fetchSucceeded(id, fetched, now: now(), unixNow: wall.unixTime()) else { return .over }
        write.replicated = true
        let committed = await commit(write)
        guard let resolution = machine.commitFinished(id, committed, now: now()) else { return .over }
        resolve(resolution)
        if case .success = resolution.result { return .adopted }
        return .over
    }

    /// Returns once the flight under way, if any, is over — landed and committed, failed, or
    /// ended by a boundary — or at once when the caller is cancelled. (A fleet applies a
    /// refresh made elsewhere between this host's flights: `adopt` declines during one.) The
    /// caller waits like a joined waiter, and its result is dropped.
    public func awaitFlight() async {
        guard let flight = machine.currentFlight else { return }
        await awaitFlight(flight)
    }

    private func awaitFlight(_ flight: FlightID) async {
        nextWaiter += 1
        let waiter = nextWaiter
        waiters.register(waiter, on: flight)
        _ = try? await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { continuation in
                waiters.park(waiter, continuation)
            }
        } onCancel: { [waiters] in
            waiters.cancel(waiter)
        }
    }

    // MARK: - Derivations

    /// The current generation's DPoP key, if its requests carry proofs: what a derived
    /// session's login (or a key made of this session) takes from it, so the derived tokens are
    /// bound to the same key. Published with the state at every change (no actor hop).
    public nonisolated var proofKey: Secret? { publishedKey.withLock { $0 } }

    /// A token derived from this session's refresh token by `source` (a derived session's
    /// `Derivation=refresh`: the refresh token with `resource` and a narrower `scope`, RFC 8707
    /// §2.2), in this session's one lineage: after its flight under way, never beside another
    /// redemption. A rotated refresh token is this session's, durable before the derived token
    /// is returned; the token returned carries none. A boundary of this session (logout, login,
    /// stop) ends the derivation: its answer is dropped, and `signedOut` (or `shuttingDown`)
    /// thrown. The server's refusal is thrown as it came (a `FetchFailure`), changing nothing
    /// here. A redemption, once started, is waited for even by a cancelled caller (its answer
    /// may have rotated the refresh token), within the source's own deadline.
    public func derive(by source: any TokenSource, timeLimit: Duration? = nil) async throws -> FetchedToken {
        while true {
            switch machine.beginDerivation() {
            case let .fail(error):
                throw error
            case let .waitForLineage(flight):
                await awaitFlight(flight)
                try Task.checkCancellation()
            case let .start(request, id):
                var request = request
                request.timeLimit = timeLimit
                let task = Task { () -> Result<FetchedToken, any Error> in
                    let outcome: Result<FetchedToken, any Error>
                    do {
                        outcome = .success(try await source.fetch(request))
                    } catch {
                        outcome = .failure(error)
                    }
                    return await self.derivationLanded(id, outcome)
                }
                flightTask = RunningFlight(id, task)
                return try await task.value.get()
            }
        }
    }

    private func derivationLanded(_ id: FlightID, _ outcome: Result<FetchedToken, any Error>) async -> Result<FetchedToken, any Error> {
        defer { if flightTask?.id == id { flightTask = nil } }
        let over: SessionError = machine.isShutDown ? .shuttingDown : .signedOut
        switch outcome {
        case let .success(fetched):
            var derived = fetched
            derived.refreshToken = nil
            switch machine.derivationSucceeded(id, fetched) {
            case .dropped:
                discarded(fetched)
                return .failure(over)
            case .deliver:
                waiters.resolve(id, with: .failure(.superseded))
                return .success(derived)
            case let .commit(write):
                let committed = await commit(write)
                guard let (error, event) = machine.derivationCommitted(id, committed) else {
                    discarded(fetched)
                    let over: SessionError = machine.isShutDown ? .shuttingDown : .signedOut
                    return .failure(over)
                }
                republish()
                waiters.resolve(id, with: .failure(error ?? .superseded))
                if let event { watchers.send(event) }
                if let error {
                    // Another writer ended this generation: the rotated refresh token is nobody's.
                    discarded(fetched)
                    return .failure(error)
                }
                return .success(derived)
            }
        case let .failure(error):
            // After a boundary (which cancelled the request, or whatever else became of it):
            // the boundary is the answer, not what the cut-off request threw.
            guard machine.derivationFailed(id) else { return .failure(over) }
            waiters.resolve(id, with: .failure(.superseded))
            return .failure(error)
        }
    }

    // MARK: - Boundaries

    /// Logs the session out: a new generation, no tokens, the flight cancelled and its waiters
    /// failed with `signedOut`, watchers told. Returns once the logout is durable; throws
    /// `storeFailed` when it is in effect but not yet persisted.
    ///
    /// - Parameter handingOver: receives the refresh token that was in force, right after the
    ///   boundary (the daemon revokes it upstream, best effort, without delaying the logout).
    /// - Parameter replicated: the logout happened elsewhere (another broker of a fleet) and is
    ///   only applied here: the store writes it to this host's copy alone.
    public func logout(replicated: Bool = false, handingOver: @Sendable (Secret) -> Void = { _ in }) async throws {
        let retired = machine.currentRefreshToken
        var boundary = machine.logout()
        boundary.write?.replicated = replicated
        cross(boundary)
        if let retired { handingOver(retired) }
        await boundaries(.loggedOut(generation: machine.generation))
        if let write = boundary.write, let reason = await persist(write) {
            throw SessionError.storeFailed(reason: reason)
        }
    }

    /// A logout made elsewhere (another broker of a fleet), applied here: as
    /// `logout(replicated: true)`, but it answers the generation it ended the session in, also
    /// when this host's copy could not be written yet (the write is then pending).
    /// `handingOver` receives the refresh token that was in force, as `logout`'s does.
    @discardableResult
    public func logoutReplicated(handingOver: @Sendable (Secret) -> Void = { _ in }) async -> Int {
        let retired = machine.currentRefreshToken
        var boundary = machine.logout()
        boundary.write?.replicated = true
        cross(boundary)
        if let retired { handingOver(retired) }
        let generation = machine.generation
        await boundaries(.loggedOut(generation: generation))
        if let write = boundary.write { await persist(write) }
        return generation
    }

    /// Installs a credential under a new generation (`nil` for grants without a refresh token,
    /// such as `client_credentials`) and returns that generation. `initial` is an access token
    /// the login produced (the device grant answers one), installed with it; `proofKey` the
    /// generation's new DPoP key, for a session whose requests carry proofs. Any flight of an
    /// earlier generation is cancelled and can never install its token in the new one.
    /// With `expecting`, the login happens only if the session is still in that generation (an
    /// interactive login that began there: a logout or another login meanwhile wins, and this
    /// one throws `superseded`, changing nothing).
    @discardableResult
    public func login(refreshToken: Secret?, proofKey: Secret? = nil, initial: FetchedToken? = nil, replicated: Bool = false,
                      expecting generation: Int? = nil) async throws -> Int {
        if let generation, machine.generation != generation { throw SessionError.superseded }
        var boundary = machine.beginLogin(refreshToken: refreshToken, proofKey: proofKey, initial: initial, now: now(), unixNow: wall.unixTime())
        boundary.write?.replicated = replicated
        cross(boundary)
        guard let write = boundary.write else { throw SessionError.signedOut }
        let outcome = await commit(write)
        let result = machine.loginFinished(write, outcome)
        republish()
        if case let .success(generation) = result, initial != nil, let token = machine.publishable?.token, token.generation == generation {
            watchers.send(.token(token))
        }
        // The old generation is over either way; a new one began only if the login landed.
        switch result {
        case let .success(generation): await boundaries(.loggedIn(generation: generation))
        case .failure: await boundaries(.loggedOut(generation: machine.generation))
        }
        return try result.get()
    }

    /// Stops the coordinator gracefully: no new flight starts, the one under way (if any) is
    /// allowed to land and commit — an upstream that has already rotated the refresh token
    /// must not have its answer thrown away — then `shutdown()`. Bounded by the source's own
    /// deadline.
    public func retire() async {
        await quiesce()
        shutdown()
    }

    /// The first half of `retire()`: no new flight starts, and the one under way lands and
    /// commits; logins and logouts still work. Tokens already held are still handed out.
    public func quiesce() async {
        machine.retire()
        republish()
        if let flight = flightTask { await flight.finished() }
    }

    /// Ends this coordinator and gives its whole state to a successor (a reload that changes the
    /// session's settings): the record as it stands in memory — newer than the store's when a
    /// write failed — the write the store still owes, if any, and its counters. Call after
    /// `quiesce()`.
    public func handOver() -> (record: SessionRecord, pendingWrite: StoreWrite?, counters: SessionCounters) {
        shutdown()
        return (machine.record, machine.pendingWrite, machine.counters)
    }

    /// Stops the coordinator: the flight is cancelled, waiters and later demands get
    /// `shuttingDown`, watch streams finish.
    public func shutdown() {
        cross(machine.shutdown())
        watchers.finishAll()
    }

    private func cross(_ boundary: RefreshStateMachine.Boundary) {
        republish()
        if let cancelled = boundary.cancelled {
            if let flight = flightTask, flight.id == cancelled {
                flight.cancel()
                flightTask = nil
            }
            waiters.resolve(cancelled, with: .failure(boundary.error))
        }
        if let event = boundary.event { watchers.send(event) }
    }

    // MARK: - The store

    private func commit(_ write: StoreWrite) async -> RefreshStateMachine.CommitOutcome {
        do {
            return try await store.write(write) ? .applied : .rejected
        } catch {
            return .failed(reason: Self.describe(error))
        }
    }

    /// Writes, recording a failure as a pending write; returns the failure's reason.
    @discardableResult
    private func persist(_ write: StoreWrite) async -> String? {
        guard case let .failed(reason) = await commit(write) else { return nil }
        machine.writeFailed(write, reason: reason)
        return reason
    }

    /// Retries the pending write of a degraded session; returns whether none is left.
    @discardableResult
    public func flushPendingWrite() async -> Bool {
        guard let write = machine.pendingWrite else { return true }
        switch await commit(write) {
        case .applied, .rejected:
            machine.pendingWriteSettled(write)
        case let .failed(reason):
            machine.writeFailed(write, reason: reason)
        }
        return machine.pendingWrite == nil
    }

    /// A store error as text for status and logs.
    static func describe(_ error: any Error) -> String {
        if let error = error as? any CustomStringConvertible { return error.description }
        return "\(type(of: error))"
    }

    // MARK: - Observation

    public func status() -> SessionStatus {
        machine.status(now: now())
    }

    /// What `status()` answers, read without entering the actor (Status, metrics and systemd's
    /// STATUS= line of a daemon with many sessions).
    public nonisolated func statusSnapshot() -> SessionStatus {
        let (status, until, throttled) = observation.state.withLock { ($0.status, $0.backoffUntil, $0.throttledUntil) }
        var snapshot = status
        let now = now()
        snapshot.backoffRemaining = until.flatMap { $0 > now ? $0 - now : nil }
        snapshot.throttled = throttled.filter { $0.until > now }.map(\.demander)
        return snapshot
    }

    /// A number that changes with every change of `statusSnapshot()`, while the snapshot does
    /// not change by itself (`nil` during a backoff, whose time left does, and while a peer is
    /// throttled, which ends by itself).
    public nonisolated var steadyStatusVersion: UInt64? {
        let (version, until, throttled) = observation.state.withLock { ($0.version, $0.backoffUntil, $0.throttledUntil) }
        let now = now()
        if let until, until > now { return nil }
        if throttled.contains(where: { $0.until > now }) { return nil }
        return version
    }

    /// The session's summary as last told to the observer.
    public nonisolated var summary: SessionSummary { observation.state.withLock { $0.summary } }

    /// The session's events: first the current state (its token, or `signedOut` when it has
    /// none to give), then every new token and every logout. A slow subscriber keeps only the
    /// newest events.
    public func watch() -> AsyncStream<SessionEvent> {
        let (stream, continuation) = AsyncStream.makeStream(of: SessionEvent.self, bufferingPolicy: .bufferingNewest(32))
        if machine.isShutDown {
            continuation.finish()
            return stream
        }
        if let token = machine.publishable?.token {
            continuation.yield(.token(token))
        } else if machine.phase != .active {
            continuation.yield(.signedOut(generation: machine.generation))
        }
        watchers.add(continuation)
        return stream
    }

    private func republish() {
        let snapshot = machine.publishable.map { PublishedToken(token: $0.token, freshUntil: $0.freshUntil, deadline: $0.deadline) }
        published.withLock { $0 = snapshot }
        let key = machine.currentProofKey
        publishedKey.withLock { $0 = key }
    }

    /// Number of callers currently parked on a flight (for tests and status).
    public nonisolated var parkedWaiters: Int { waiters.count }
}
