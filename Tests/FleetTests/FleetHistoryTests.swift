import Testing
import TestSupport
import TokenBrokerCore
@testable import Fleet

/// A fleet's numbers end somewhere: what a value sealed with the fleet key near that end does
/// (nothing), how a history that reached it is started anew on purpose (and what still counts
/// as a rollback after), and what a broker says while it refuses the fleet's state.
@Suite("Fleet history: room below the limit, started anew on purpose")
struct FleetHistoryTests {
    /// The state etcd holds, changed and sealed with the fleet key over what it holds (as
    /// someone with the key writes it, with a plain put).
    static func forge(_ h: FleetHarness, _ change: (inout FleetState) -> Void) throws {
        let entry = try #require(h.etcd.entry(FleetHarness.stateKey))
        let record = EtcdKeyValue(key: Array(FleetHarness.stateKey.utf8), value: entry.value, createRevision: entry.createRevision,
                                  modRevision: entry.modRevision, version: entry.version, lease: 0)
        var state = try #require(try h.stored())
        change(&state)
        h.etcd.write(FleetHarness.stateKey, try FleetHarness.codec().seal(state, over: record))
    }

    static func messages(_ broker: TestBroker) -> [String] { broker.events.value.map(\.message) }

    /// A store whose mark is at the generation limit: what a broker kept after it followed a
    /// value there, before such values were refused.
    static func storeAtTheLimit() -> InMemoryFleetStore {
        InMemoryFleetStore([], marks: ["api": FleetPosition(generation: FleetPosition.limit - 1, serial: 0)!])
    }

    @Test("a state sealed with the fleet key at the generation limit → refused and counted by every broker, none of whose marks rises; they serve what they hold, and a login on any broker works at once")
    func valueAtTheLimitRefused() async throws {
        let h = try await FleetHarness(brokers: 3)
        let first = try await h.logIn()
        try Self.forge(h) { state in
            state.position = FleetPosition(generation: FleetPosition.limit - 1, serial: 0)!
            state.accessToken = Secret("forged-access")
        }
        let brokers = h.brokers
        try await eventually("every broker refuses the value") { brokers.allSatisfy { $0.fleet.status.counters.refusedValues == 1 } }
        for broker in brokers {
            #expect(broker.token == first, "\(broker.name) serves \(broker.token ?? "nothing")")
            #expect((try await broker.store.mark("api")).map { $0.generation < FleetPosition.limit - FleetPosition.room } == true)
            #expect(Self.messages(broker).contains { $0.contains("within 2^48 of the limit") }, "\(Self.messages(broker))")
        }
        _ = try await h.brokers[1].coordinator.login(refreshToken: h.issuer.login())
        let fresh = try await h.brokers[1].coordinator.token().token.reveal
        try await eventually("every broker follows the login") { brokers.allSatisfy { $0.token == fresh } }
        #expect(brokers.allSatisfy { $0.fleet.status.health == .healthy })
        #expect(h.issuer.counters.replays == 0)
        await h.stopAll()
    }

    @Test("marks at the generation limit (kept from before) and the key removed → a login fails saying how out, changing nothing; ResetFleetHistory on one broker → every broker follows it as a logout, says so, and keeps a mark of the new history; a login then works everywhere")
    func resetPastTheLimit() async throws {
        var h = try await FleetHarness(brokers: 0)
        for index in 0..<3 { h.brokers.append(try await h.start("host-\(index)", store: Self.storeAtTheLimit())) }
        let brokers = h.brokers
        try await eventually("every broker reports the fleet behind its mark") { brokers.allSatisfy { $0.fleet.status.counters.rollbacks == 1 } }
        let (a, b) = (h.brokers[0], h.brokers[1])
        do {
            _ = try await a.coordinator.login(refreshToken: h.issuer.login())
            Issue.record("a login past the generation limit went through")
        } catch let SessionError.storeFailed(reason) {
            #expect(reason.contains("reached its limit") && reason.contains("reset-fleet-history"), "\(reason)")
        }
        #expect(h.etcd.entry(FleetHarness.stateKey) == nil)

        let revoked = Locked<[String]>([])
        let started = try await b.sync.startHistoryAnew { token in revoked.withLock { $0.append(token.reveal) } }
        #expect(started.history == 1 && started.generation < 1 << 32, "\(started)")
        #expect(try h.stored()?.position == started && h.stored()?.phase == .signedOut)
        try await eventually("every broker follows the new history") { brokers.allSatisfy { $0.fleet.status.position == started } }
        #expect(b.saw { if case .historyStarted(started) = $0 { return true } else { return false } })
        for other in [h.brokers[0], h.brokers[2]] {
            #expect(other.saw { if case .newHistory(_, started) = $0 { return true } else { return false } }, "\(other.name): \(other.events.value)")
        }
        #expect(try await b.store.mark("api") == started, "the resetting broker's mark")
        _ = try await a.coordinator.login(refreshToken: h.issuer.login())
        let token = try await a.coordinator.token().token.reveal
        try await eventually("every broker serves the new history's first login") { brokers.allSatisfy { $0.token == token } }
        #expect(brokers.allSatisfy { $0.fleet.status.health == .healthy })
        for broker in brokers {
            let mark = try await broker.store.mark("api")
            #expect(mark.map { $0.history == 1 && $0 > started } == true, "\(broker.name)'s mark: \(String(describing: mark))")
        }
        #expect(revoked.value.isEmpty, "nothing was in force to revoke")
        await h.stopAll()
    }

    @Test("after ResetFleetHistory, a backup of the earlier history restored (its tokens, its revisions) → a rollback to every broker, running or restarted on its state: none serves or refreshes from it; the reset revoked the refresh token that was in force")
    func earlierHistoryIsARollback() async throws {
        var h = try await FleetHarness(brokers: 3)
        // The earlier history far along (a member that lied about its revision moved its
        // generation on by 2^32): past where the new one starts.
        let before = h.brokers
        try await eventually("every broker has read the fleet") { await before.asyncAllSatisfy { $0.fleet.status.health == .healthy } }
        h.brokers[0].link.forgedRevision.withLock { $0 = 1 << 40 }
        let first = try await h.logIn()
        let backup = h.etcd.snapshot
        #expect(try h.stored()!.position.generation > 1 << 32)
        let revoked = Locked<[String]>([])
        let started = try await h.brokers[0].sync.startHistoryAnew { token in revoked.withLock { $0.append(token.reveal) } }
        let brokers = h.brokers
        try await eventually("every broker is logged out by the reset") { brokers.allSatisfy { $0.token == nil } }
        #expect(revoked.value == ["refresh-2"], "the refresh token in force: \(revoked.value)")
        _ = try await h.brokers[1].coordinator.login(refreshToken: h.issuer.login())
        let fresh = try await h.brokers[1].coordinator.token().token.reveal
        try await eventually("every broker follows the login") { brokers.allSatisfy { $0.token == fresh } }
        let requests = h.issuer.counters.requests

        h.etcd.restore(backup)
        let restarted = try await h.restart(2)
        try await eventually("the restarted broker reports the rollback") { restarted.fleet.status.counters.rollbacks == 1 }
        try await h.membersRestarted(h.brokers)   // the restore restarted the members: each broker reads again
        let running = [h.brokers[0], h.brokers[1]]
        try await eventually("the running brokers report the rollback") { running.allSatisfy { $0.fleet.status.counters.rollbacks == 1 } }
        for broker in h.brokers {
            #expect(broker.token != first, "\(broker.name) serves the earlier history's token")
            #expect(broker.fleet.status.position >= started)
        }
        #expect(restarted.token == nil)
        await #expect(throws: SessionError.self) { try await running[0].coordinator.recover(rejected: Secret(fresh)) }
        #expect(h.issuer.counters.requests == requests, "a broker refreshed from the earlier history")
        #expect(h.issuer.counters.replays == 0)
        await h.stopAll()
    }

    @Test("a login that cannot be published (etcd refuses its write, or cannot be reached at all) fails and leaves the fleet as it was: once the login's end is written here (what maintenance does each second), this host serves the fleet's session again, with no watch event or quiet read to wake it, and no logout reaches the fleet when etcd answers again",
          arguments: [false, true])
    func failedLoginFollowsTheFleetAgain(unreachable: Bool) async throws {
        let h = try await FleetHarness(brokers: 2)
        let first = try await h.logIn()
        let (a, b) = (h.brokers[0], h.brokers[1])
        let before = try #require(try h.stored())
        if unreachable { h.etcd.setUnavailable(true) } else { h.etcd.failNext(.transaction) }
        await #expect(throws: SessionError.self) { _ = try await a.coordinator.login(refreshToken: h.issuer.login()) }
        #expect(a.token == nil && b.token == first)
        #expect(await a.coordinator.flushPendingWrite(), "the login's end is this host's alone to write")
        try await eventually("A serves the fleet's session again") { a.token == first }
        #expect(h.timeStood)
        h.etcd.setUnavailable(false)
        // The sync loops' pauses and quiet reads: anything A still owed the fleet goes out now.
        for round in 0..<3 {
            // (Once A's sync loop sleeps in its pause: advancing the clock earlier would move nothing.)
            try await eventually("A's sync loop waits out its pause (round \(round))") {
                let now = a.clock.now.offset
                return a.clock.wakeTimes.contains { $0 > now && $0 <= now + .seconds(10) }
            }
            h.advance(by: .seconds(10))
            try await eventually("A has read the fleet again (round \(round))") { a.fleet.status.health == .healthy }
        }
        let after = try h.stored()
        #expect(after == before, "the fleet's state changed: \(String(describing: after?.position))")
        #expect(a.token == first && b.token == first)
        await h.stopAll()
    }

    @Test("a broker restarted while the fleet's state is refused serves nothing, and its journal says so; a running one says it serves the token it holds")
    func restartedOnARefusedValue() async throws {
        var h = try await FleetHarness(brokers: 2)
        let first = try await h.logIn()
        h.etcd.write(FleetHarness.stateKey, Array("garbage".utf8))
        let a = h.brokers[0]
        try await eventually("A refuses the value") { a.fleet.status.counters.refusedValues == 1 }
        #expect(a.token == first)
        #expect(Self.messages(a).contains { $0.contains("not taken") && $0.contains("serving the token this broker holds") }, "\(Self.messages(a))")
        let restarted = try await h.restart(1)
        try await eventually("the restarted broker refuses the value") { restarted.fleet.status.counters.refusedValues == 1 }
        #expect(restarted.token == nil)
        await #expect(throws: SessionError.signedOut) { try await restarted.coordinator.token() }
        let said = Self.messages(restarted).filter { $0.contains("not taken") }
        #expect(said.count == 1 && said.allSatisfy { $0.contains("serves nothing") && !$0.contains("serving") }, "\(said)")
        await h.stopAll()
    }
}
