#if canImport(Glibc)
import Glibc
#endif
import Basics
import SQLiteStore
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

    private var generationKey: [UInt8] { Array((base + "generation").utf8) }
    private var recordKey: [UInt8] { Array((base + "record").utf8) }
    private var flightKey: [UInt8] { Array((base + "flight").utf8) }
    private var backoffKey: [UInt8] { Array((base + "backoff").utf8) }
    private var recordData: String { base + "record" }

    public init(name: String, settings: FleetSettings, upstream: any TokenSource, local: any SessionStore,
                wall: any WallClock, discarded: @escaping @Sendable (FetchedToken) -> Void = { _ in },
                log: @escaping @Sendable (FleetLogLevel, String) -> Void = { _, _ in }) throws(TokenCipher.Failure) {
        self.name = name
        self.settings = settings
        self.etcd = EtcdClient(endpoints: settings.endpoints, tls: settings.tls, timeout: settings.requestTimeout)
        self.cipher = try TokenCipher(keyMaterial: Array(settings.key.reveal.unicodeScalars.map { UInt8(truncatingIfNeeded: $0.value) }))
        self.upstream = upstream
        self.local = local
        self.wall = wall
        self.discarded = discarded
        self.log = log
        var random = [UInt8](repeating: 0, count: 4)
        for index in random.indices { random[index] = UInt8.random(in: 0...255) }
        self.holder = "\(settings.member) pid \(getpid()) \(random.map { String($0, radix: 16) }.joined())"
        self.base = settings.prefix + "/sessions/" + name + "/"
    }

    /// Binds the coordinator this session feeds (once, right after both are made).
    public func attach(_ coordinator: FleetCoordinator) {
        state.withLock { $0.coordinator = coordinator }
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
                let snapshot = try await read()
                await serializer.run { await self.apply(snapshot) }
                failures = 0
                await waitForChange(after: version, upTo: resync)
            } catch {
                failures += 1
                await waitForChange(after: version, upTo: min(.milliseconds(100) * (1 << min(failures, 6)), .seconds(5)))
            }
        }
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
                    guard let generation = Int64(String(decoding: entry.value, as: UTF8.self)), generation >= 0 else {
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
                        snapshot.backoff = (until, String((object["reason"]?.stringValue ?? "refresh failed").prefix(300)))
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
            if snapshot.recordRevision > state.withLock({ $0.known }), let token = usable(record) {
                // Another broker refreshed: its token, with no upstream request.
                state.withLock { $0.known = max($0.known, snapshot.recordRevision) }
                return token
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
                    success: [.put(key: flightKey, value: Array(holder.utf8), lease: lease)])
            } catch {
                throw FetchFailure.transient("fleet: \(error.message)")
            }
            guard took.succeeded else {
                revokeLater(lease)
                continue
            }
            return try await refreshAsHolder(request, snapshot, record, lease: lease, flight: took.revision, taken: taken)
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
            var committed: EtcdTransaction?
            var problem = "the session changed meanwhile (a logout or login) or the flight lease lapsed"
            do {
                let sealed = try next.sealed(with: cipher, associatedData: recordData)
                // Not this task's cancellation: a commit under way finishes, or the fleet keeps
                // an answer nobody holds.
                let (etcd, recordKey, flightKey, backoffKey) = (etcd, recordKey, flightKey, backoffKey)
                let commitBy = taken + settings.flightLease - margin / 2
                committed = await Task { () -> EtcdTransaction? in
                    while clock.now < commitBy {
                        do throws(EtcdError) {
                            return try await etcd.transaction(compares, success: [.put(key: recordKey, value: sealed, lease: 0),
                                                                                   .delete(key: flightKey), .delete(key: backoffKey)])
                        } catch where error.kind == .unavailable {
                            try? await Task.sleep(for: .milliseconds(200))
                        } catch {
                            return nil
                        }
                    }
                    return nil
                }.value
                if committed == nil { problem = "etcd did not take the new record before the flight lease ran out" }
            } catch {
                problem = error.description
            }
            revokeLater(lease)
            guard let committed, committed.succeeded else {
                // Never installed anywhere; its refresh token is revoked upstream.
                discarded(fetched)
                signal()
                log(.warning, "session \(name): a refresh result could not be committed to the fleet: \(problem); it is discarded")
                throw FetchFailure.transient("fleet: the refresh could not be committed: \(problem)")
            }
            state.withLock { $0.known = max($0.known, committed.revision) }
            return FetchedToken(accessToken: fetched.accessToken, tokenType: fetched.tokenType, expiresIn: fetched.expiresIn,
                                refreshToken: next.refreshToken)
        case let .failure(error):
            let failure = (error as? FetchFailure) ?? .transient(error is CancellationError ? "cancelled" : "unexpected error (\(type(of: error)))")
            var operations: [EtcdOperation] = [.delete(key: flightKey)]
            if case .terminal = failure.kind {
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
        guard !write.replicated, write.guardedBy == .newerGeneration else { return try await local.write(write) }
        let published: Result<Void, EtcdError> = await serializer.run {
            let skip = self.state.withLock { state -> Bool in
                // Superseded by a newer boundary here, or the end of a login that never reached
                // the fleet: this host's copy only.
                if let bound = state.bound, bound.local > write.record.generation { return true }
                if state.failedLogin == write.record.generation, write.record.state != .active {
                    state.failedLogin = nil
                    state.bound = nil   // resync from the fleet
                    return true
                }
                return false
            }
            if skip { return .success(()) }
            do throws(EtcdError) {
                try await self.publishBoundary(write)
                return .success(())
            } catch {
                if write.record.state == .active { self.state.withLock { $0.failedLogin = write.record.generation } }
                return .failure(error)
            }
        }
        if case let .failure(error) = published { throw error }
        return try await local.write(write)
    }

    /// Moves the fleet generation on with this host's login or logout.
    private func publishBoundary(_ write: StoreWrite) async throws(EtcdError) {
        for _ in 0..<16 {
            let snapshot = try await read()
            let next = snapshot.generation + 1
            var record = FleetRecord(generation: next, state: write.record.state, refreshToken: write.record.refreshToken,
                                     accessToken: write.record.accessToken, tokenType: write.record.tokenType,
                                     expiresAt: write.record.expiresAt, lastRefresh: write.record.lastRefresh,
                                     serial: write.record.accessToken == nil ? 0 : 1, endReason: write.record.endReason)
            if record.state != .active { record.refreshToken = nil; record.accessToken = nil }
            let sealed: [UInt8]
            do {
                sealed = try record.sealed(with: cipher, associatedData: recordData)
            } catch {
                throw EtcdError(kind: .malformed, message: "cannot seal the fleet record: \(error.description)")
            }
            let done = try await etcd.transaction(
                [generationHolds(snapshot)],
                success: [.put(key: generationKey, value: Array(String(next).utf8), lease: 0), .put(key: recordKey, value: sealed, lease: 0),
                          .delete(key: flightKey), .delete(key: backoffKey)])
            if done.succeeded {
                state.withLock { state in
                    state.bound = (write.record.generation, next)
                    state.known = done.revision
                    state.generation = next
                    state.holder = nil
                }
                log(.info, "session \(name): \(write.record.state == .active ? "login" : "logout") published to the fleet (fleet generation \(next))")
                return
            }
        }
        throw EtcdError(kind: .unavailable, message: "the fleet generation kept moving; try again")
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

public enum FleetLogLevel: Sendable {
    case error, warning, notice, info
}
