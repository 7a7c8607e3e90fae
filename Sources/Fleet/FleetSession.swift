#if canImport(Glibc)
import Glibc
#endif
import Basics
import Sealing
import Synchronization
import TokenBrokerCore
import Upstream
import WireJSON

public typealias FleetCoordinator = RefreshCoordinator<ContinuousClock>

/// One session shared by the brokers of a fleet, through etcd. It is the coordinator's token
/// source and store, and follows the fleet's changes into the coordinator.
///
/// Under `<prefix>/sessions/<name>/` etcd holds:
/// - `generation`: the fleet generation, in clear. Every login or logout anywhere adds one, in
///   a transaction that compares its revision: that is the fleet's logout boundary.
/// - `record`: the session's state and tokens, sealed with the fleet key.
/// - `flight`: the broker that refreshes now, on a lease of `FlightLease=`. A broker takes it
///   only if it does not exist (`create_revision == 0`) and the record is the one it read.
/// - `backoff`: after a failed refresh, until when no broker tries again, and why.
///
/// As a **source**, `fetch` first looks at the fleet: a record newer than this host's token is
/// another broker's refresh, returned with no upstream request; while another broker holds the
/// flight it waits for its result. Otherwise it takes the flight, redeems the record's refresh
/// token upstream (giving up before the lease can lapse), and commits the new record in a
/// transaction that compares the generation, the record and its own flight: only a committed
/// result is returned, so no host hands out a token the fleet does not hold.
///
/// As a **store**, login and logout writes of this host first move the fleet generation, then
/// reach the local database; everything else (refresh results, and changes that came from the
/// fleet) is this host's copy only.
///
/// Its sync loop reads the keys whenever the watch reports a change (and every few seconds
/// anyway), and applies them: a new generation is a login or logout here too (`replicated`, so
/// not published again), a newer record of the same generation is adopted.
public final class FleetSession: TokenSource, SessionStore, Sendable {
    public enum Health: Sendable, Equatable {
        case starting
        case healthy
        /// etcd cannot be reached, has no quorum, or holds what this broker cannot open.
        case unavailable(String)
    }

    /// What `Status` shows of the fleet.
    public struct Status: Sendable, Equatable {
        public var health: Health
        /// The etcd revision of the last read.
        public var revision: Int64
        public var generation: Int64?
        /// The member holding the session's flight, if one does.
        public var flightHolder: String?
    }

    /// The session's keys as read in one range request.
    struct Snapshot: Sendable {
        var revision: Int64
        var generation: Int64 = 0
        /// The generation key's last change (0: no key yet).
        var generationRevision: Int64 = 0
        var record: FleetRecord?
        var recordRevision: Int64 = 0
        var flight: EtcdKeyValue?
        var backoff: (untilMilliseconds: Int64, reason: String)?
    }

    private struct State {
        var coordinator: FleetCoordinator?
        /// Which local generation stands for which fleet generation (`nil`: not synced yet).
        var bound: (local: Int, fleet: Int64)?
        /// The record revision this host's token came from.
        var known: Int64 = 0
        var health = Health.starting
        var revision: Int64 = 0
        var generation: Int64?
        var holder: String?
        /// Bumped at every change the watch reports.
        var changes: UInt64 = 0
        var waiting: [UInt64: CheckedContinuation<Void, Never>] = [:]
        var woken: Set<UInt64> = []
        /// Waiters between their start and their end (only those can be woken early).
        var active: Set<UInt64> = []
        var nextWaiter: UInt64 = 0
        /// A local login that could not reach the fleet: its generation's logout is local only.
        var failedLogin: Int?
        /// The coordinator is being retired: a flight that waits for another broker's gives up.
        var stopping = false
        /// A logout of this host that etcd has not taken yet (also across a restart, from the
        /// marker file): the fleet generation it ends (nil: unknown, the newest).
        var pendingLogout: Int64??
        /// The first read of the fleet has been applied (or has failed).
        var synced = false
    }

    public let name: String
    public let settings: FleetSettings
    private let etcd: EtcdClient
    private let cipher: TokenCipher
    private let upstream: any TokenSource
    private let local: any SessionStore
    private let wall: any WallClock
    private let holder: String
    /// Answers the fleet could not take (revoked upstream, best effort).
    private let discarded: @Sendable (FetchedToken) -> Void
    private let log: @Sendable (FleetLogLevel, String) -> Void
    private let state = Mutex(State())
    /// Orders this host's boundaries against the application of the fleet's.
    private let serializer = AsyncSerializer()
    private let base: String
    private let pendingLogoutFile: String?

    private var generationKey: [UInt8] { Array((base + "generation").utf8) }
    private var recordKey: [UInt8] { Array((base + "record").utf8) }
    private var flightKey: [UInt8] { Array((base + "flight").utf8) }
    private var backoffKey: [UInt8] { Array((base + "backoff").utf8) }
    private var recordData: String { base + "record" }

    /// - Parameter pendingLogoutFile: where a logout that could not reach etcd is remembered
    ///   until it does, across restarts (`nil`: in memory only).
    public init(name: String, settings: FleetSettings, upstream: any TokenSource, local: any SessionStore,
                wall: any WallClock, pendingLogoutFile: String? = nil, discarded: @escaping @Sendable (FetchedToken) -> Void = { _ in },
                log: @escaping @Sendable (FleetLogLevel, String) -> Void = { _, _ in }) throws(TokenCipher.Failure) {
        self.pendingLogoutFile = pendingLogoutFile
        self.name = name
        self.settings = settings
        self.etcd = EtcdClient(endpoints: settings.endpoints, tls: settings.tls, timeout: settings.requestTimeout)
        self.cipher = try TokenCipher(keyMaterial: Array(settings.key.reveal.unicodeScalars.map { UInt8(truncatingIfNeeded: $0.value) }), name: "fleet key")
        self.upstream = upstream
        self.local = local
        self.wall = wall
        self.discarded = discarded
        self.log = log
        var random = [UInt8](repeating: 0, count: 4)
        for index in random.indices { random[index] = UInt8.random(in: 0...255) }
        self.holder = "\(settings.member) pid \(getpid()) \(random.map { String($0, radix: 16) }.joined())"
        self.base = settings.prefix + "/sessions/" + name + "/"
        if let pendingLogoutFile, let text = PendingLogoutFile.read(pendingLogoutFile) {
            // "<prefix> <generation or ->": a logout of this session under that prefix.
            let words = text.split(separator: " ")
            if words.count == 2, words[0] == settings.prefix {
                let generation = Int64(words[1])
                state.withLock { $0.pendingLogout = .some(generation) }
            } else {
                log(.warning, "session \(name): \(pendingLogoutFile) does not name a logout under \(settings.prefix); ignored")
            }
        }
    }

    /// Binds the coordinator this session feeds (once, right after both are made).
    public func attach(_ coordinator: FleetCoordinator) {
        state.withLock { $0.coordinator = coordinator }
    }

    /// Makes a refresh that waits for another broker's flight give up at once (the coordinator
    /// is retiring: its flight must land soon, and has nothing of its own to commit). A flight
    /// this broker holds goes on to its commit.
    public func stopWaiting() {
        state.withLock { $0.stopping = true }
        signal()
    }

    /// Waits until the first read of the fleet has been applied, or has failed, or `limit`.
    public func firstSync(within limit: Duration) async {
        let clock = ContinuousClock()
        let deadline = clock.now + limit
        while clock.now < deadline {
            let (synced, version) = state.withLock { ($0.synced, $0.changes) }
            if synced { return }
            await waitForChange(after: version, upTo: clock.now.duration(to: deadline))
        }
    }

    public var status: Status {
        state.withLock { Status(health: $0.health, revision: $0.revision, generation: $0.generation, flightHolder: $0.holder) }
    }

    // MARK: - The sync loop

    /// Follows the fleet until cancelled: a watch on the session's keys, and a loop that reads
    /// and applies them at every change (at least every `resync`).
    public func run(resync: Duration = .seconds(10)) async {
        await withTaskGroup(of: Void.self) { group in
            group.addTask { await self.watchLoop() }
            await self.syncLoop(resync: resync)
            group.cancelAll()
        }
    }

    private func syncLoop(resync: Duration) async {
        var failures = 0
        while !Task.isCancelled {
            let version = state.withLock { $0.changes }
            do {
                if state.withLock({ $0.pendingLogout }) != nil {
                    // A logout of this host (before a restart, maybe) goes to the fleet first.
                    let published: Result<Void, EtcdError> = await Task {
                        do throws(EtcdError) {
                            try await self.publishPendingLogout()
                            return .success(())
                        } catch {
                            return .failure(error)
                        }
                    }.value
                    try published.get()
                }
                let snapshot = try await read()
                await serializer.run { await self.apply(snapshot) }
                failures = 0
                markSynced()
                await waitForChange(after: version, upTo: resync)
            } catch {
                failures += 1
                markSynced()
                await waitForChange(after: version, upTo: min(.milliseconds(100) * (1 << min(failures, 6)), .seconds(5)))
            }
        }
    }

    private func markSynced() {
        let first = state.withLock { state -> Bool in
            defer { state.synced = true }
            return !state.synced
        }
        if first { signal() }
    }

    private func watchLoop() async {
        var failures = 0
        while !Task.isCancelled {
            let revision = state.withLock { $0.revision }
            do {
                try await etcd.watch(prefix: Array(base.utf8), from: revision == 0 ? 0 : revision + 1, for: .seconds(30)) { [weak self] _ in
                    self?.signal()
                }
                failures = 0
            } catch {
                failures += 1
                signal()   // the sync loop reads, and learns whether etcd answers
                try? await Task.sleep(for: min(.milliseconds(100) * (1 << min(failures, 6)), .seconds(5)))
            }
        }
    }

    /// Applies what the fleet holds to the coordinator (under the serializer).
    private func apply(_ snapshot: Snapshot) async {
        guard let coordinator = state.withLock({ $0.coordinator }) else { return }
        let (bound, known) = state.withLock { ($0.bound, $0.known) }
        let record = snapshot.record.flatMap { $0.generation == snapshot.generation ? $0 : nil }
        if bound == nil || snapshot.generation > bound!.fleet {
            // A login or logout elsewhere (or this broker's first contact with the fleet).
            if let record, record.state == .active {
                do {
                    let local = try await coordinator.login(refreshToken: record.refreshToken, initial: usable(record), replicated: true)
                    state.withLock { $0.bound = (local, snapshot.generation); $0.known = snapshot.recordRevision }
                    log(.info, "session \(name): logged in from the fleet (fleet generation \(snapshot.generation))")
                } catch {
                    log(.error, "session \(name): cannot apply the fleet's login: \(error)")
                }
            } else {
                let wasActive = await coordinator.status().state == .active
                try? await coordinator.logout(replicated: true)
                let local = await coordinator.status().generation
                state.withLock { $0.bound = (local, snapshot.generation); $0.known = snapshot.recordRevision }
                if wasActive || bound != nil {
                    let why = record?.state == .ended ? "ended in the fleet: \(record?.endReason ?? "")" : "logged out in the fleet"
                    log(.notice, "session \(name): \(why) (fleet generation \(snapshot.generation))")
                }
            }
        } else if let bound, snapshot.generation == bound.fleet, let record, snapshot.recordRevision > known {
            if record.state == .active, let token = usable(record) {
                if await coordinator.adopt(token, generation: bound.local) {
                    state.withLock { $0.known = max($0.known, snapshot.recordRevision) }
                }
            } else if record.state == .ended {
                try? await coordinator.logout(replicated: true)
                let local = await coordinator.status().generation
                state.withLock { $0.bound = (local, snapshot.generation); $0.known = snapshot.recordRevision }
                log(.notice, "session \(name): ended in the fleet: \(record.endReason ?? "")")
            }
        }
    }

    // MARK: - Reading

    /// The session's keys, in one request; updates health and what `status` shows.
    private func read() async throws(EtcdError) -> Snapshot {
        do throws(EtcdError) {
            let (records, revision) = try await etcd.range(prefix: Array(base.utf8))
            var snapshot = Snapshot(revision: revision)
            for entry in records {
                switch String(decoding: entry.key, as: UTF8.self).dropFirst(base.utf8.count) {
                case "generation":
                    guard let generation = Int64(String(decoding: entry.value, as: UTF8.self)), (0..<(Int64.max / 2)).contains(generation) else {
                        throw EtcdError(kind: .malformed, message: "the fleet generation is not a number")
                    }
                    snapshot.generation = generation
                    snapshot.generationRevision = entry.modRevision
                case "record":
                    do {
                        snapshot.record = try FleetRecord.open(entry.value, with: cipher, associatedData: recordData)
                    } catch {
                        throw EtcdError(kind: .malformed, message: "the fleet record: \(error.description)")
                    }
                    snapshot.recordRevision = entry.modRevision
                case "flight":
                    snapshot.flight = entry
                case "backoff":
                    if let object = (try? JSONParser.parse(entry.value))?.objectValue,
                       let until = object["until"]?.stringValue.flatMap({ Int64($0) }) {
                        // At most an hour from now, whatever the key says.
                        let latest = Int64(wall.unixTime() * 1000) + 3_600_000
                        snapshot.backoff = (min(until, latest), String((object["reason"]?.stringValue ?? "refresh failed").prefix(300)))
                    }
                default:
                    break
                }
            }
            let recovered = state.withLock { state -> Bool in
                defer { state.health = .healthy }
                if case .unavailable = state.health { return true }
                return false
            }
            if recovered { log(.notice, "session \(name): the fleet is available again") }
            state.withLock { state in
                state.revision = max(state.revision, revision)
                state.generation = snapshot.generation
                state.holder = snapshot.flight.map { String(decoding: $0.value.prefix(200), as: UTF8.self) }
            }
            return snapshot
        } catch where error.kind == .cancelled {
            throw error   // nothing learnt about etcd
        } catch {
            let becameUnavailable = state.withLock { state -> Bool in
                defer { state.health = .unavailable(error.message) }
                if case .unavailable = state.health { return false }
                return true
            }
            if becameUnavailable { log(.warning, "session \(name): the fleet is unavailable: \(error.message); serving cached tokens, no refresh") }
            throw error
        }
    }

    // MARK: - The source

    public func fetch(_ request: FetchRequest) async throws -> FetchedToken {
        let clock = ContinuousClock()
        let deadline = clock.now + settings.flightLease + .seconds(5)
        var waited = false
        while true {
            try Task.checkCancellation()
            guard let bound = state.withLock({ $0.bound }), bound.local == request.generation else {
                throw FetchFailure.transient("fleet: this broker has not caught up with the fleet yet")
            }
            let version = state.withLock { $0.changes }
            let snapshot: Snapshot
            do {
                snapshot = try await read()
            } catch {
                throw FetchFailure.transient("fleet: \(error.message)")
            }
            guard snapshot.generation == bound.fleet, let record = snapshot.record, record.generation == snapshot.generation,
                  record.state == .active else {
                // Logged out, in or ended elsewhere: applying it ends this flight.
                await serializer.run { await self.apply(snapshot) }
                throw FetchFailure.transient("fleet: the session was logged out or in on another broker")
            }
            if snapshot.recordRevision > state.withLock({ $0.known }) {
                let held = state.withLock { $0.coordinator }?.currentToken()?.token
                state.withLock { $0.known = max($0.known, snapshot.recordRevision) }
                // Another broker refreshed: its token, with no upstream request — unless this
                // host already has it (adopted), and it is the one this demand must replace.
                if let token = usable(record), token.accessToken != held { return token }
            }
            let nowMilliseconds = Int64(wall.unixTime() * 1000)
            if let backoff = snapshot.backoff, backoff.untilMilliseconds > nowMilliseconds {
                throw FetchFailure.transient("fleet: \(backoff.reason)", retryAfter: .milliseconds(backoff.untilMilliseconds - nowMilliseconds))
            }
            if let flight = snapshot.flight {
                if !waited {
                    waited = true
                    log(.info, "session \(name): \(String(decoding: flight.value.prefix(200), as: UTF8.self)) refreshes for the fleet; waiting for its result")
                }
                guard clock.now < deadline else { throw FetchFailure.transient("fleet: another broker's refresh has not finished") }
                guard !state.withLock({ $0.stopping }) else { throw FetchFailure.transient("fleet: shutting down") }
                await waitForChange(after: version, upTo: min(.seconds(1), clock.now.duration(to: deadline)))
                continue
            }
            let taken = clock.now
            let lease: Int64
            let took: EtcdTransaction
            do {
                lease = try await etcd.grantLease(ttl: settings.flightLease).id
                took = try await etcd.transaction(
                    [generationHolds(snapshot), .createRevision(key: flightKey, equals: 0), .modRevision(key: recordKey, equals: snapshot.recordRevision)],
                    success: [.put(key: flightKey, value: Array(holder.utf8), lease: lease)],
                    failure: [.get(key: flightKey)])
            } catch {
                throw FetchFailure.transient("fleet: \(error.message)")
            }
            // Ours also when etcd applied the transaction but its answer was lost, and the request
            // was sent again (the flight key then carries our lease).
            let flight = took.succeeded ? took.revision : (took.reads.first ?? nil).flatMap { $0.lease == lease ? $0.createRevision : nil }
            guard let flight else {
                revokeLater(lease)
                continue
            }
            return try await refreshAsHolder(request, snapshot, record, lease: lease, flight: flight, taken: taken)
        }
    }

    /// This broker holds the flight: one upstream request, given up before the lease can lapse,
    /// then the commit.
    private func refreshAsHolder(_ request: FetchRequest, _ snapshot: Snapshot, _ record: FleetRecord, lease: Int64, flight: Int64,
                                 taken: ContinuousClock.Instant) async throws -> FetchedToken {
        let clock = ContinuousClock()
        // The lease runs from before the transaction that took the flight; the upstream
        // request ends (or is abandoned) a margin before it can lapse.
        let margin = min(.seconds(2), settings.flightLease / 4)
        let budget = settings.flightLease - margin - taken.duration(to: clock.now)
        let compares: [EtcdCompare] = [generationHolds(snapshot), .createRevision(key: flightKey, equals: flight),
                                       .modRevision(key: recordKey, equals: snapshot.recordRevision)]
        let outcome = await Self.within(budget) { [upstream] in
            try await upstream.fetch(FetchRequest(session: request.session, generation: request.generation, refreshToken: record.refreshToken))
        }
        switch outcome {
        case let .success(fetched):
            let unixNow = wall.unixTime()
            var next = record
            next.accessToken = fetched.accessToken
            next.tokenType = fetched.tokenType
            next.expiresAt = fetched.expiresIn.map { Int64((unixNow + Double($0.components.seconds)).rounded(.down)) }
            next.refreshToken = fetched.refreshToken ?? record.refreshToken
            next.serial += 1
            next.lastRefresh = Int64(unixNow)
            // The issuer has rotated: the record's refresh token is spent, so the new record is
            // committed whoever holds the flight now (comparing the generation and the record,
            // not the flight), retried while etcd is unreachable, and not this task's
            // cancellation to stop. Only a logout or login elsewhere makes it worthless.
            let sealed: [UInt8]
            do throws(EtcdError) {
                sealed = try seal(next)
            } catch {
                revokeLater(lease)
                throw FetchFailure.transient("fleet: \(error.message)")
            }
            let commitBy = taken + settings.flightLease * 2
            let outcome = await Task { () -> CommitOutcome in
                var problem = "etcd did not answer"
                var attempts = 0
                while clock.now < commitBy {
                    attempts += 1
                    // While the commit is retried, the flight stays this broker's: another one
                    // would present the spent refresh token.
                    if attempts > 1 { _ = try? await self.etcd.keepAlive(lease: lease) }
                    do throws(EtcdError) {
                        let done = try await self.etcd.transaction(
                            [self.generationHolds(snapshot), .modRevision(key: self.recordKey, equals: snapshot.recordRevision)],
                            success: [.put(key: self.recordKey, value: sealed, lease: 0), .delete(key: self.backoffKey)],
                            failure: [.get(key: self.generationKey), .get(key: self.recordKey)])
                        if done.succeeded { return .committed(done.revision) }
                        // Our own commit, applied before its answer was lost and sent again.
                        if let stored = done.reads.last ?? nil, stored.value == sealed { return .committed(stored.modRevision) }
                        let generation = done.reads.first ?? nil
                        return (generation?.modRevision ?? 0) != snapshot.generationRevision ? .overtakenByBoundary : .overtakenByRecord
                    } catch where error.kind == .unavailable {
                        problem = error.message
                        try? await Task.sleep(for: .milliseconds(200))
                    } catch {
                        return .failed(error.message)
                    }
                }
                return .failed(problem)
            }.value
            revokeLater(lease)   // (deletes the flight key, if it is still ours)
            signal()
            switch outcome {
            case let .committed(revision):
                state.withLock { $0.known = max($0.known, revision) }
                return FetchedToken(accessToken: fetched.accessToken, tokenType: fetched.tokenType, expiresIn: fetched.expiresIn,
                                    refreshToken: next.refreshToken)
            case .overtakenByBoundary:
                // Logged out or in elsewhere meanwhile: never installed anywhere; its refresh
                // token is revoked upstream (the fleet's session it belonged to is over).
                discarded(fetched)
                log(.notice, "session \(name): a refresh answer arrived after a logout or login elsewhere; it is discarded")
                throw FetchFailure.transient("fleet: the session was logged out or in on another broker meanwhile")
            case .overtakenByRecord:
                // Another broker committed a refresh of this generation first (this one's lease
                // had lapsed). Not revoked: at a server that does not rotate, it is the fleet's
                // refresh token too.
                log(.warning, "session \(name): another broker committed a refresh first (this broker's flight lease had lapsed); this answer is dropped")
                throw FetchFailure.transient("fleet: another broker committed a refresh first")
            case let .failed(problem):
                log(.error, "session \(name): the rotated refresh token could not be committed to the fleet (\(problem)); "
                    + "the next refresh will present the spent one, and the issuer may refuse it as a replay: log in again if so")
                throw FetchFailure.transient("fleet: the refresh could not be committed: \(problem)")
            }
        case let .failure(error):
            let failure = (error as? FetchFailure) ?? .transient(error is CancellationError ? "cancelled" : "unexpected error (\(type(of: error)))")
            var operations: [EtcdOperation] = [.delete(key: flightKey)]
            if error is CancellationError {
                // Cancelled here (a logout or the stop of this broker): nothing to tell the fleet.
            } else if case .terminal = failure.kind, failure.reason != "invalid_grant" {
                // This broker's own configuration (its client credentials, scope, endpoint): it
                // ends here only, and the others go on.
            } else if case .terminal = failure.kind {
                // The refresh token itself is dead, for every broker: the session ends fleet-wide.
                let ended = FleetRecord(generation: record.generation, state: .ended, serial: record.serial, endReason: failure.reason)
                if let sealed = try? ended.sealed(with: cipher, associatedData: recordData) {
                    operations.append(.put(key: recordKey, value: sealed, lease: 0))
                }
            } else {
                var wait = Duration.seconds(1)
                switch failure.kind {
                case let .transient(retryAfter), let .refused(retryAfter): wait = max(wait, retryAfter ?? wait)
                case .terminal: break
                }
                let until = Int64(wall.unixTime() * 1000) + wait.components.seconds * 1000 + wait.components.attoseconds / 1_000_000_000_000_000
                let backoff: JSONObject = ["until": .string(String(until)), "reason": .string(failure.reason)]
                var bytes: [UInt8] = []
                backoff.encode(into: &bytes)
                operations.append(.put(key: backoffKey, value: bytes, lease: 0))
            }
            await Task { [etcd] in _ = try? await etcd.transaction(compares, success: operations) }.value
            revokeLater(lease)
            throw error
        }
    }

    /// Runs `body`, abandoning it (cancelled) once `budget` is spent.
    private static func within(_ budget: Duration, _ body: @escaping @Sendable () async throws -> FetchedToken) async -> Result<FetchedToken, any Error> {
        guard budget > .zero else { return .failure(FetchFailure.transient("fleet: no time left in the flight lease")) }
        return await withTaskGroup(of: Result<FetchedToken, any Error>?.self) { group in
            group.addTask {
                do { return .success(try await body()) } catch { return .failure(error) }
            }
            group.addTask {
                do { try await Task.sleep(for: budget) } catch { return nil }
                return .failure(FetchFailure.transient("fleet: the upstream request was abandoned before the flight lease could lapse"))
            }
            var first: Result<FetchedToken, any Error>?
            while first == nil, let next = await group.next() { first = next }
            group.cancelAll()
            return first ?? .failure(CancellationError())
        }
    }

    private func generationHolds(_ snapshot: Snapshot) -> EtcdCompare {
        snapshot.generationRevision == 0 ? .createRevision(key: generationKey, equals: 0)
            : .modRevision(key: generationKey, equals: snapshot.generationRevision)
    }

    private func revokeLater(_ lease: Int64) {
        Task { [etcd] in try? await etcd.revoke(lease: lease) }
    }

    /// The record's token for this host, when it has one that is not about to expire.
    private func usable(_ record: FleetRecord) -> FetchedToken? {
        guard let token = record.accessToken else { return nil }
        var expiresIn: Duration?
        if let expiresAt = record.expiresAt {
            let left = Double(expiresAt) - wall.unixTime()
            guard left > 1 else { return nil }
            expiresIn = .milliseconds(Int64(left * 1000))
        }
        return FetchedToken(accessToken: token, tokenType: record.tokenType, expiresIn: expiresIn, refreshToken: record.refreshToken)
    }

    // MARK: - The store

    public func load(_ session: String) async throws -> SessionRecord? {
        try await local.load(session)
    }

    public func write(_ write: StoreWrite) async throws -> Bool {
        // Changes that came from the fleet, and refresh results (committed to the fleet by
        // `fetch` already) or a local end: this host's copy only. (A session ends fleet-wide
        // only when the issuer says its refresh token is dead: `refreshAsHolder`.)
        if write.replicated || write.guardedBy == .sameGeneration { return try await local.write(write) }
        // What reaches etcd runs to its end even if the caller goes away (a client that hangs
        // up must not leave a boundary half-published).
        let published: Result<Void, EtcdError> = await Task {
            await self.serializer.run { () -> Result<Void, EtcdError> in
                do throws(EtcdError) {
                    try await self.publishBoundary(write)
                    return .success(())
                } catch {
                    return .failure(error)
                }
            }
        }.value
        switch published {
        case .success:
            return try await local.write(write)
        case let .failure(error) where write.record.state != .active:
            // A logout: in effect here at once and on disk, and remembered until etcd takes it
            // (across restarts too); the caller hears that the fleet has not.
            _ = try await local.write(write)
            throw error
        case let .failure(error):
            throw error
        }
    }

    /// Moves the fleet generation on with this host's login or logout (under the serializer).
    private func publishBoundary(_ write: StoreWrite) async throws(EtcdError) {
        enum Decision { case publish(ending: Int64?), localOnly }
        let decision = state.withLock { state -> Decision in
            // Published already (a retry after this host's own database failed), or superseded
            // by a newer boundary here.
            if let bound = state.bound, bound.local >= write.record.generation { return .localOnly }
            // The end of a login that never reached the fleet: nothing to tell it.
            if state.failedLogin == write.record.generation, write.record.state != .active {
                state.failedLogin = nil
                state.bound = nil   // follow the fleet afresh
                return .localOnly
            }
            return .publish(ending: state.bound?.fleet)
        }
        guard case .publish = decision else { return }
        if write.record.state == .active {
            do throws(EtcdError) {
                if let published = try await publish(state: .active, of: write.record, ending: nil) {
                    state.withLock { $0.bound = (write.record.generation, published) }
                }
            } catch {
                state.withLock { $0.failedLogin = write.record.generation }
                throw error
            }
            // A login here supersedes this host's logout still waiting for etcd.
            forgetPendingLogout()
            return
        }
        // A logout ends the newest generation this host has read of the fleet: its own read
        // below is the ordering point. Only a logout that already waited for etcd (a retry, or
        // one remembered across a restart) gives way to a newer boundary made meanwhile.
        let waiting = state.withLock { $0.pendingLogout }
        if waiting == nil { remember(pendingLogout: state.withLock { $0.generation ?? $0.bound?.fleet }) }
        if let published = try await publish(state: write.record.state, of: write.record, ending: waiting ?? nil) {
            state.withLock { $0.bound = (write.record.generation, published) }
        }
        // (Overtaken: the sync loop applies the newer boundary here too.)
        forgetPendingLogout()
    }

    /// A logout remembered from before a restart, or from a call that could not reach etcd.
    private func publishPendingLogout() async throws(EtcdError) {
        try await serializer.run { () -> Result<Void, EtcdError> in
            guard let ending = self.state.withLock({ $0.pendingLogout }) else { return .success(()) }
            do throws(EtcdError) {
                _ = try await self.publish(state: .signedOut, of: nil, ending: ending)
            } catch {
                return .failure(error)
            }
            // Published, or overtaken by a newer boundary: either way it is done.
            self.forgetPendingLogout(ifStill: ending)
            return .success(())
        }.get()
    }

    /// One boundary transaction: a new fleet generation holding `record`'s state (tokens only
    /// for a login); returns that generation. A logout that ends `ending` is dropped once the
    /// fleet has gone past it (returns nil).
    private func publish(state newState: SessionState, of record: SessionRecord?, ending: Int64?) async throws(EtcdError) -> Int64? {
        for _ in 0..<16 {
            let snapshot = try await read()
            if newState != .active, let ending, snapshot.generation != ending {
                log(.notice, "session \(name): the logout was overtaken in the fleet (fleet generation \(snapshot.generation)); not published")
                signal()
                return nil
            }
            let next = snapshot.generation + 1
            var fleetRecord = FleetRecord(generation: next, state: newState)
            if newState == .active, let record {
                fleetRecord = FleetRecord(generation: next, state: .active, refreshToken: record.refreshToken, accessToken: record.accessToken,
                                          tokenType: record.tokenType, expiresAt: record.expiresAt, lastRefresh: record.lastRefresh,
                                          serial: record.accessToken == nil ? 0 : 1)
            }
            let sealed = try seal(fleetRecord)
            let done = try await etcd.transaction(
                [generationHolds(snapshot)],
                success: [.put(key: generationKey, value: Array(String(next).utf8), lease: 0), .put(key: recordKey, value: sealed, lease: 0),
                          .delete(key: flightKey), .delete(key: backoffKey)],
                failure: [.get(key: recordKey)])
            // An answer lost after etcd applied it, then sent again: the record is ours.
            let ours = done.succeeded ? done.revision : (done.reads.first??.value == sealed ? done.reads.first??.modRevision : nil)
            if let ours {
                state.withLock { state in
                    state.known = max(state.known, ours)
                    state.generation = max(state.generation ?? 0, next)
                }
                log(.info, "session \(name): \(newState == .active ? "login" : "logout") published to the fleet (fleet generation \(next))")
                signal()
                return next
            }
        }
        throw EtcdError(kind: .unavailable, message: "the fleet generation kept moving; try again")
    }

    private func seal(_ record: FleetRecord) throws(EtcdError) -> [UInt8] {
        do {
            return try record.sealed(with: cipher, associatedData: recordData)
        } catch {
            throw EtcdError(kind: .malformed, message: "cannot seal the fleet record: \(error.description)")
        }
    }

    private func remember(pendingLogout ending: Int64?) {
        state.withLock { $0.pendingLogout = .some(ending) }
        guard let pendingLogoutFile else { return }
        if !PendingLogoutFile.write(pendingLogoutFile, settings.prefix + " " + (ending.map { String($0) } ?? "-")) {
            log(.error, "session \(name): cannot remember the logout in \(pendingLogoutFile); it is kept in memory only")
        }
    }

    /// Forgets the pending logout (only if it is still the one that ends `ending`, when given).
    private func forgetPendingLogout(ifStill ending: Int64?? = nil) {
        let forgotten = state.withLock { state -> Bool in
            if let ending, state.pendingLogout != ending { return false }
            state.pendingLogout = nil
            return true
        }
        if forgotten, let pendingLogoutFile { PendingLogoutFile.remove(pendingLogoutFile) }
    }

    // MARK: - Changes

    private func signal() {
        let resumed = state.withLock { state -> [CheckedContinuation<Void, Never>] in
            state.changes &+= 1
            defer { state.waiting.removeAll() }
            return Array(state.waiting.values)
        }
        for continuation in resumed { continuation.resume() }
    }

    /// Returns at the next change after `version`, or after `limit`, or at cancellation.
    private func waitForChange(after version: UInt64, upTo limit: Duration) async {
        let id = state.withLock { state -> UInt64 in
            state.nextWaiter &+= 1
            state.active.insert(state.nextWaiter)
            return state.nextWaiter
        }
        let timer = Task { [weak self] in
            try? await Task.sleep(for: limit)
            self?.wake(id)
        }
        defer {
            timer.cancel()
            state.withLock { state in
                state.active.remove(id)
                state.woken.remove(id)
            }
        }
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let now = state.withLock { state -> Bool in
                    if state.changes != version || state.woken.remove(id) != nil { return true }
                    state.waiting[id] = continuation
                    return false
                }
                if now { continuation.resume() }
            }
        } onCancel: {
            wake(id)
        }
    }

    private func wake(_ id: UInt64) {
        let continuation = state.withLock { state -> CheckedContinuation<Void, Never>? in
            if let continuation = state.waiting.removeValue(forKey: id) { return continuation }
            if state.active.contains(id) { state.woken.insert(id) }
            return nil
        }
        continuation?.resume()
    }
}

/// What became of a holder's commit.
private enum CommitOutcome: Sendable {
    case committed(Int64)
    case overtakenByBoundary
    case overtakenByRecord
    case failed(String)
}

public enum FleetLogLevel: Sendable {
    case error, warning, notice, info
}
