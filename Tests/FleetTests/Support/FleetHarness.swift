@testable import Fleet
import Sealing
import Synchronization
import Testing
import TestSupport
import TokenBrokerCore

extension TestClock: WallClock {}

/// An authorization server with refresh-token rotation and reuse detection (RFC 9700): each
/// refresh token is good once; presenting a retired one revokes its whole family and counts as
/// a replay. Requests can be held: parked before the server processes them (a request on its
/// way), and let go or failed by the test. A held request whose caller gives up is never
/// processed, unless `ignoresCancellation` (a transport that delivers the answer anyway).
final class RotatingIssuer: TokenSource {
    struct Counters: Sendable, Equatable {
        var requests = 0
        var refreshes = 0
        var replays = 0
    }

    private enum Release { case process, fail(FetchFailure) }

    private struct State {
        var families: [String: (family: Int, retired: Bool)] = [:]
        var revoked: Set<Int> = []
        var nextFamily = 0
        var nextToken = 0
        var counters = Counters()
        var hold = 0
        var parked: [UInt64: CheckedContinuation<Release, Never>] = [:]
        var cancelled: Set<UInt64> = []
        var nextPark: UInt64 = 0
    }

    private let state = Mutex(State())
    let ignoresCancellation: Bool

    init(ignoresCancellation: Bool = false) { self.ignoresCancellation = ignoresCancellation }

    var counters: Counters { state.withLock { $0.counters } }
    var parkedCount: Int { state.withLock { $0.parked.count } }

    /// A new family's first refresh token (a login).
    func login() -> Secret {
        state.withLock { state in
            state.nextFamily += 1
            state.nextToken += 1
            let token = "refresh-\(state.nextToken)"
            state.families[token] = (state.nextFamily, false)
            return Secret(token)
        }
    }

    /// The next `count` requests park until `release()` or `fail(_:)`.
    func hold(_ count: Int = 1) { state.withLock { $0.hold += count } }

    func release() { resumeAll(.process) }
    func fail(_ failure: FetchFailure) { resumeAll(.fail(failure)) }

    private func resumeAll(_ release: Release) {
        let parked = state.withLock { state -> [CheckedContinuation<Release, Never>] in
            defer { state.parked.removeAll() }
            return Array(state.parked.values)
        }
        for continuation in parked { continuation.resume(returning: release) }
    }

    func fetch(_ request: FetchRequest) async throws -> FetchedToken {
        let id = state.withLock { state -> UInt64? in
            state.counters.requests += 1
            guard state.hold > 0 else { return nil }
            state.hold -= 1
            state.nextPark += 1
            return state.nextPark
        }
        if let id {
            let release = await withTaskCancellationHandler {
                await withCheckedContinuation { (continuation: CheckedContinuation<Release, Never>) in
                    let early = state.withLock { state -> Bool in
                        if state.cancelled.remove(id) != nil { return true }
                        state.parked[id] = continuation
                        return false
                    }
                    if early { continuation.resume(returning: .fail(.transient("cancelled"))) }
                }
            } onCancel: {
                guard !ignoresCancellation else { return }
                let continuation = state.withLock { state -> CheckedContinuation<Release, Never>? in
                    if let continuation = state.parked.removeValue(forKey: id) { return continuation }
                    state.cancelled.insert(id)
                    return nil
                }
                continuation?.resume(returning: .fail(.transient("cancelled")))
            }
            if !ignoresCancellation, Task.isCancelled { throw CancellationError() }
            if case let .fail(failure) = release { throw failure }
        }
        return try state.withLock { state throws -> FetchedToken in
            guard let sent = request.refreshToken?.reveal, let entry = state.families[sent], !state.revoked.contains(entry.family) else {
                throw FetchFailure.deadGrant
            }
            if entry.retired {
                state.counters.replays += 1
                state.revoked.insert(entry.family)
                throw FetchFailure.deadGrant
            }
            state.families[sent]?.retired = true
            state.nextToken += 1
            let next = "refresh-\(state.nextToken)"
            state.families[next] = (entry.family, false)
            state.counters.refreshes += 1
            return FetchedToken(accessToken: Secret("access-\(state.nextToken)"), expiresIn: .seconds(3600), refreshToken: Secret(next))
        }
    }
}

/// A broker's link to the shared store, which the test can cut (a host killed, stopped or cut
/// off): while cut, every request fails at once, and the watch's events wait in the stream, as
/// in a socket nobody reads, until the link is mended.
final class Link: FleetBackend {
    let inner: MemoryEtcd
    private let state = Locked<(cut: Bool, waiting: [(@Sendable ([EtcdEvent], Int64) -> Void, [EtcdEvent], Int64)])>((false, []))

    init(_ inner: MemoryEtcd) { self.inner = inner }

    func sever() { state.withLock { $0.cut = true } }

    /// A watch stream that lags: while held, its events wait (requests still go through, as to
    /// a member whose watch stream is slow), until `releaseWatch()` delivers them in order.
    private let watchHold = Locked<(held: Bool, waiting: [(@Sendable ([EtcdEvent], Int64) -> Void, [EtcdEvent], Int64)])>((false, []))
    func holdWatch() { watchHold.withLock { $0.held = true } }

    func releaseWatch() {
        let waiting = watchHold.withLock { hold in
            hold.held = false
            defer { hold.waiting = [] }
            return hold.waiting
        }
        for (changed, events, revision) in waiting { changed(events, revision) }
    }

    /// The next read's answer carries this header revision (a member or proxy that lies).
    let forgedRevision = Locked<Int64?>(nil)
    /// The next read's answer, once computed, waits until `releaseAnswer()` (an answer on its way).
    private let answerHold = Locked<(armed: Bool, parked: CheckedContinuation<Void, Never>?)>((false, nil))
    func holdNextAnswer() { answerHold.withLock { $0.armed = true } }
    var answerParked: Bool { answerHold.withLock { $0.parked != nil } }

    func releaseAnswer() {
        let parked = answerHold.withLock { hold -> CheckedContinuation<Void, Never>? in
            defer { hold = (false, nil) }
            return hold.parked
        }
        parked?.resume()
    }

    func mend() {
        let waiting = state.withLock { state in
            state.cut = false
            defer { state.waiting = [] }
            return state.waiting
        }
        for (changed, events, revision) in waiting { changed(events, revision) }
    }

    private func check() throws(EtcdError) {
        if state.value.cut { throw EtcdError(kind: .unavailable, message: "cut off (test)") }
    }

    func get(_ key: [UInt8]) async throws(EtcdError) -> (record: EtcdKeyValue?, revision: Int64) {
        try check()
        var answer = try await inner.get(key)
        if let forged = forgedRevision.withLock({ forged -> Int64? in
            defer { forged = nil }
            return forged
        }) {
            answer.revision = forged
        }
        if answerHold.withLock({ hold -> Bool in
            defer { hold.armed = false }
            return hold.armed
        }) {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in answerHold.withLock { $0.parked = continuation } }
        }
        return answer
    }

    func transaction(_ compare: [EtcdCompare], success: [EtcdOperation], failure: [EtcdOperation]) async throws(EtcdError) -> EtcdTransaction {
        try check()
        return try await inner.transaction(compare, success: success, failure: failure)
    }

    func range(prefix: [UInt8]) async throws(EtcdError) -> (records: [EtcdKeyValue], revision: Int64) {
        try check()
        return try await inner.range(prefix: prefix)
    }

    func watch(prefix: [UInt8], from revision: Int64, for duration: Duration,
               changed: @escaping @Sendable ([EtcdEvent], Int64) -> Void) async throws(EtcdError) -> WatchEnd {
        try check()
        return try await inner.watch(prefix: prefix, from: revision, for: duration) { [state, watchHold] events, revision in
            let now = state.withLock { state -> Bool in
                guard state.cut else { return true }
                state.waiting.append((changed, events, revision))
                return false
            }
            guard now else { return }
            let lagging = watchHold.withLock { hold -> Bool in
                guard hold.held else { return false }
                hold.waiting.append((changed, events, revision))
                return true
            }
            if !lagging { changed(events, revision) }
        }
    }
}

/// One broker of the fleet under test: a real `RefreshCoordinator` fed by a real
/// `FleetSession`, on the shared `MemoryEtcd` through its own `Link`, with its own store and
/// its own clock (a stopped host's clock does not move).
final class TestBroker: Sendable {
    let name: String
    let link: Link
    let clock: TestClock
    let store: InMemoryFleetStore
    let fleet: FleetSession<TestClock>
    let coordinator: RefreshCoordinator<TestClock>
    /// The broker's watch of the fleet's prefix, as the daemon's.
    let watch: FleetWatch<TestClock>
    /// Follows the fleet into the coordinator, as the daemon's does.
    let sync: FleetSync<TestClock>
    let following: Task<Void, Never>
    let discarded = Locked<[String]>([])
    let events = Locked<[FleetEvent]>([])

    init(name: String, etcd: MemoryEtcd, issuer: RotatingIssuer, store: InMemoryFleetStore = InMemoryFleetStore(),
         lease: Duration = .seconds(60), pendingLogoutFile: String? = nil) async throws {
        self.name = name
        self.store = store
        let clock = TestClock()
        self.clock = clock
        link = Link(etcd)
        // (One endpoint: a holder keeps one second of its lease for its commit.)
        let settings = FleetSettings(endpoints: ["memory:"], prefix: "/t", key: FleetHarness.key, flightLease: lease, requestTimeout: .seconds(1),
                                     member: name)
        let discarded = self.discarded
        let events = self.events
        fleet = try FleetSession(name: "api", settings: settings, backend: link, upstream: issuer, local: store,
                                 floor: try await store.mark("api"), pending: try await store.pendingCommit("api"), clock: clock, wall: clock,
                                 pendingLogoutFile: pendingLogoutFile,
                                 discarded: { fetched in discarded.withLock { $0.append(fetched.refreshToken?.reveal ?? "-") } },
                                 report: { event in events.withLock { $0.append(event) } })
        // As the daemon restores a fleet session: its generation, signed out until the fleet is read.
        var restored = try await store.load("api")
        restored?.state = .signedOut
        restored?.refreshToken = nil
        restored?.accessToken = nil
        coordinator = RefreshCoordinator(session: "api", source: fleet, store: fleet, restored: restored, clock: clock, wall: clock)
        watch = FleetWatch(backend: link, prefix: "/t", clock: clock, spawn: { work in Task { await work() } })
        let sync = await FleetSync(session: fleet, coordinator: coordinator, watch: watch)
        self.sync = sync
        following = Task { await sync.run() }
    }

    /// Stops as the daemon does: a flight waiting for another broker's gives up, the one under
    /// way lands, the loops end (also what is left of a killed host).
    func stop() async {
        await fleet.stopWaiting()
        await coordinator.retire()
        following.cancel()
        await following.value
    }

    /// Ends it at once (kill -9, or the end of a test): the flight is cancelled, the loops end.
    func kill() async {
        await coordinator.shutdown()
        following.cancel()
        await following.value
    }

    var token: String? { coordinator.currentToken()?.token.reveal }

    func saw(_ match: (FleetEvent) -> Bool) -> Bool { events.withLock { $0.contains(where: match) } }

    /// How many times this broker reported waiting for another broker's flight.
    var waits: Int { events.withLock { $0.filter { if case .waitingForHolder = $0 { return true } else { return false } }.count } }
}

/// A fleet of brokers on one in-memory etcd and one rotating issuer; each broker has its own
/// test clock, and the test moves time for all of them (but the stopped ones) at once.
struct FleetHarness {
    static let key = SecretBytes(Array(String(repeating: "5a", count: 32).utf8))
    static let stateKey = "/t/sessions/api/state"

    let etcd = MemoryEtcd()
    let issuer: RotatingIssuer
    var brokers: [TestBroker] = []

    init(brokers count: Int, ignoresCancellation: Bool = false) async throws {
        issuer = RotatingIssuer(ignoresCancellation: ignoresCancellation)
        for index in 0..<count { brokers.append(try await start("host-\(index)")) }
    }

    func start(_ name: String, store: InMemoryFleetStore = InMemoryFleetStore(), pendingLogoutFile: String? = nil) async throws -> TestBroker {
        try await TestBroker(name: name, etcd: etcd, issuer: issuer, store: store, pendingLogoutFile: pendingLogoutFile)
    }

    /// Kills broker `index` and starts it again on its own state (a restart): the new one.
    mutating func restart(_ index: Int) async throws -> TestBroker {
        let old = brokers[index]
        await old.kill()
        brokers[index] = try await start(old.name, store: old.store)
        return brokers[index]
    }

    /// Time passes for every broker but `stopped`.
    func advance(by duration: Duration, except stopped: [TestBroker] = []) {
        for broker in brokers where !stopped.contains(where: { $0 === broker }) { broker.clock.advance(by: duration) }
    }

    /// No broker's clock has moved.
    var timeStood: Bool { brokers.allSatisfy { $0.clock.now.offset == .zero } }

    /// Logs in on `broker` and makes its first token (one refresh); returns once every broker
    /// serves it.
    func logIn(on broker: Int = 0) async throws -> String {
        try await eventually("every broker has read the fleet") {
            await brokers.asyncAllSatisfy { $0.fleet.status.health == .healthy }
        }
        _ = try await brokers[broker].coordinator.login(refreshToken: issuer.login())
        let first = try await brokers[broker].coordinator.token().token.reveal
        try await eventually("every broker serves the first token") { brokers.allSatisfy { $0.token == first } }
        return first
    }

    /// Every watch ends, as when the members restart (a restore from a backup does): returns once
    /// each of `brokers` has paused (its clock moved past the pause) and reads the prefix again.
    func membersRestarted(_ brokers: [TestBroker]) async throws {
        let restarts = brokers.map { $0.fleet.status.counters.watchRestarts }
        etcd.endWatches()
        for (broker, before) in zip(brokers, restarts) {
            try await eventually("\(broker.name)'s watch has ended") { broker.fleet.status.counters.watchRestarts > before }
            // (Advancing the clock before the pause begins would move nothing.)
            try await eventually("\(broker.name) pauses before it reads and watches again") {
                let now = broker.clock.now.offset
                return broker.clock.wakeTimes.contains { $0 > now && $0 <= now + .seconds(5) }
            }
            broker.clock.advance(by: .seconds(5))
        }
    }

    func stopAll() async {
        for broker in brokers { await broker.kill() }
    }

    /// The state etcd holds, opened with the fleet key.
    func stored() throws -> FleetState? {
        guard let entry = etcd.entry(Self.stateKey) else { return nil }
        let record = EtcdKeyValue(key: Array(Self.stateKey.utf8), value: entry.value, createRevision: entry.createRevision,
                                  modRevision: entry.modRevision, version: entry.version, lease: 0)
        return try FleetHarness.codec().openState(record, unixNow: TestClock().unixTime()).get()
    }

    static func codec() throws -> FleetCodec {
        FleetCodec(cipher: try TokenCipher(keyMaterial: key.reveal, name: "fleet key"), keys: FleetKeys(prefix: "/t", session: "api"))
    }
}

extension Array where Element: Sendable {
    func asyncAllSatisfy(_ predicate: (Element) async -> Bool) async -> Bool {
        for element in self where !(await predicate(element)) { return false }
        return true
    }
}
