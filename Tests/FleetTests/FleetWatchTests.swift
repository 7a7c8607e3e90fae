import Synchronization
import Testing
import TestSupport
import TokenBrokerCore
@testable import Fleet

/// The broker's one watch of its fleet's prefix (`FleetWatch`): one read and one stream for
/// every session, each event to the session whose key it touches, sessions joining and leaving
/// one by one, a failed stream read again with back-off, nothing asked of etcd while idle.
@Suite("Fleet watch: one read and one stream per prefix")
struct FleetWatchTests {
    /// `count` sessions of one broker on `etcd` (prefix `/t`), with the broker's watch; the
    /// sessions have not joined it yet.
    static func sessions(_ count: Int, etcd: MemoryEtcd, clock: TestClock) throws -> (FleetWatch<TestClock>, [FleetSession<TestClock>]) {
        let settings = FleetSettings(endpoints: ["memory:"], prefix: "/t", key: FleetHarness.key, requestTimeout: .seconds(1), member: "host-0")
        let watch = FleetWatch(backend: etcd, prefix: "/t", clock: clock, spawn: { work in Task { await work() } })
        let sessions = try (0..<count).map { index in
            try FleetSession(name: "s\(index)", settings: settings, backend: etcd, upstream: RotatingIssuer(), local: InMemoryFleetStore(),
                             floor: nil, clock: clock, wall: clock)
        }
        return (watch, sessions)
    }

    static func loaded(_ session: FleetSession<TestClock>) -> Bool { session.mirror.withLock { $0.loaded } }
    static func value(_ session: FleetSession<TestClock>) -> [UInt8]? { session.mirror.withLock { $0.state?.value } }

    @Test("1,000 sessions: one range read of the prefix and one watch stream, not 1,000 of each; an event reaches the session whose key it touches and no other; keys under the prefix that no session owns are ignored")
    func oneReadOneStream() async throws {
        let etcd = MemoryEtcd()
        for index in stride(from: 0, to: 1000, by: 7) { etcd.write("/t/sessions/s\(index)/state", Array("v\(index)".utf8)) }
        let (watch, sessions) = try Self.sessions(1000, etcd: etcd, clock: TestClock())
        // As the daemon starts: every session joins, then the watch reads once for all.
        watch.hold()
        for session in sessions { #expect(!watch.join(session)) }
        await watch.release()
        try await eventually("every session has taken the read") { sessions.allSatisfy(Self.loaded) }
        try await eventually("the stream is up") { etcd.watching == 1 }
        #expect(etcd.requests(.range) == 1 && etcd.requests(.get) == 0 && etcd.requests(.watch) == 1)
        #expect(Self.value(sessions[7]) == Array("v7".utf8) && Self.value(sessions[8]) == nil)

        let revisions = sessions.map { $0.mirror.withLock { $0.revision } }
        etcd.write("/t/sessions/nobody/state", Array("x".utf8))       // no session of this broker
        etcd.write("/t/sessions/s8/record", Array("x".utf8))          // not a state key
        etcd.write("/t/sessions/s8/state/more", Array("x".utf8))      // under a state key, not it
        etcd.write("/t/sessions/s3/state", Array("new".utf8))
        try await eventually("s3 has the change") { Self.value(sessions[3]) == Array("new".utf8) }
        for (index, session) in sessions.enumerated() where index != 3 {
            #expect(session.mirror.withLock { $0.revision } == revisions[index], "s\(index) was told of another key")
        }
        #expect(Self.value(sessions[8]) == nil)
        #expect(etcd.requests(.range) == 1 && etcd.requests(.get) == 0 && etcd.requests(.watch) == 1)
        for session in sessions { watch.leave(session) }
        try await eventually("the stream has ended with the last session") { etcd.watching == 0 }
    }

    @Test("a session that joins the running watch on its own reads its own key once; one removed leaves it; the stream of the others is never restarted; the last to leave ends it")
    func joinAndLeave() async throws {
        let etcd = MemoryEtcd()
        etcd.write("/t/sessions/s2/state", Array("two".utf8))
        let (watch, sessions) = try Self.sessions(3, etcd: etcd, clock: TestClock())
        watch.hold()
        _ = watch.join(sessions[0])
        _ = watch.join(sessions[1])
        await watch.release()
        try await eventually("the first two have taken the read") { Self.loaded(sessions[0]) && Self.loaded(sessions[1]) }
        try await eventually("the stream is up") { etcd.watching == 1 }
        // s2 joins alone, the watch not held: it has read already, so s2 reads its own key
        // (FleetSync.run does).
        #expect(watch.join(sessions[2]))
        _ = try await sessions[2].readView()
        #expect(Self.value(sessions[2]) == Array("two".utf8))
        #expect(etcd.requests(.range) == 1 && etcd.requests(.get) == 1 && etcd.requests(.watch) == 1)
        etcd.write("/t/sessions/s2/state", Array("three".utf8))
        try await eventually("s2 follows through the shared stream") { Self.value(sessions[2]) == Array("three".utf8) }
        // A reload removes s0: the others keep their stream.
        watch.leave(sessions[0])
        etcd.write("/t/sessions/s0/state", Array("gone".utf8))
        etcd.write("/t/sessions/s1/state", Array("one".utf8))
        try await eventually("s1 follows") { Self.value(sessions[1]) == Array("one".utf8) }
        #expect(Self.value(sessions[0]) == nil, "a session that left was told")
        #expect(etcd.requests(.watch) == 1 && etcd.watching == 1 && watch.sessionCount == 2)
        watch.leave(sessions[1])
        watch.leave(sessions[2])
        try await eventually("the stream has ended with the last session") { etcd.watching == 0 }
        // A session joining later starts the loop again, with a read of the prefix.
        #expect(!watch.join(sessions[0]))
        try await eventually("a new stream is up") { etcd.watching == 1 }
        #expect(etcd.requests(.range) == 2 && Self.value(sessions[0]) == Array("gone".utf8))
        watch.leave(sessions[0])
        try await eventually("the stream has ended") { etcd.watching == 0 }
    }

    @Test("sessions made while the watch is held (a start, a reload) read etcd together: at a start the loop begins only at the release, with one read for all; a reload's 100 new sessions share one read of the prefix on the running stream, which goes on")
    func heldJoins() async throws {
        let etcd = MemoryEtcd()
        for index in 0..<200 { etcd.write("/t/sessions/s\(index)/state", Array("v\(index)".utf8)) }
        let (watch, sessions) = try Self.sessions(200, etcd: etcd, clock: TestClock())
        watch.hold()
        for session in sessions[..<100] { #expect(!watch.join(session)) }
        #expect(etcd.requests(.range) == 0 && etcd.watching == 0, "the loop began before the release")
        await watch.release()
        try await eventually("the first 100 have taken the loop's read") { sessions[..<100].allSatisfy(Self.loaded) }
        try await eventually("the stream is up") { etcd.watching == 1 }
        watch.hold()
        for session in sessions[100...] { #expect(!watch.join(session), "a session joining a held watch read for itself") }
        await watch.release()
        #expect(sessions.allSatisfy(Self.loaded) && Self.value(sessions[150]) == Array("v150".utf8))
        #expect(etcd.requests(.range) == 2 && etcd.requests(.get) == 0 && etcd.requests(.watch) == 1 && etcd.watching == 1)
        etcd.write("/t/sessions/s150/state", Array("next".utf8))
        try await eventually("a new session follows the running stream") { Self.value(sessions[150]) == Array("next".utf8) }
        for session in sessions { watch.leave(session) }
        try await eventually("the stream has ended") { etcd.watching == 0 }
    }

    @Test("the stream ends, then the read of the prefix fails: every session counts each restart and is unreachable; after growing pauses the prefix is read again (bringing what changed while nobody watched) and watched from that read's revision")
    func failureReadsAgain() async throws {
        let etcd = MemoryEtcd()
        let clock = TestClock()
        let (watch, sessions) = try Self.sessions(3, etcd: etcd, clock: clock)
        watch.hold()
        for session in sessions { _ = watch.join(session) }
        await watch.release()
        try await eventually("the stream is up") { etcd.watching == 1 && sessions.allSatisfy(Self.loaded) }
        etcd.failNext(.range)
        etcd.endWatches()
        try await eventually("every session counts the restart") { sessions.allSatisfy { $0.status.counters.watchRestarts == 1 } }
        etcd.write("/t/sessions/s1/state", Array("meanwhile".utf8))
        // The pauses grow: 200 ms, then 400 ms (on the watch's clock, once it sleeps in them).
        try await Self.pause(.milliseconds(200), clock)
        try await eventually("every session is unreachable") {
            sessions.allSatisfy { if case .unavailable = $0.status.health { true } else { false } }
        }
        try await eventually("every session counts the second restart") { sessions.allSatisfy { $0.status.counters.watchRestarts == 2 } }
        try await Self.pause(.milliseconds(400), clock)
        try await eventually("the prefix is read again, and watched") { Self.value(sessions[1]) == Array("meanwhile".utf8) && etcd.watching == 1 }
        try await eventually("every session is reachable again") { await sessions.asyncAllSatisfy { !(await $0.isUnreachable) } }
        #expect(etcd.requests(.range) == 3 && etcd.requests(.watch) == 2 && etcd.requests(.get) == 0,
                "\(etcd.requests(.range)) reads, \(etcd.requests(.watch)) watches, \(etcd.requests(.get)) gets")
        etcd.write("/t/sessions/s2/state", Array("after".utf8))
        try await eventually("the new stream brings changes") { Self.value(sessions[2]) == Array("after".utf8) }
        for session in sessions { watch.leave(session) }
        try await eventually("the stream has ended") { etcd.watching == 0 }
    }

    /// Waits until the watch sleeps in a pause of `pause`, then moves its clock past it.
    static func pause(_ pause: Duration, _ clock: TestClock) async throws {
        try await eventually("the watch pauses for \(pause)") {
            let now = clock.now.offset
            return clock.wakeTimes.contains { $0 == now + pause }
        }
        clock.advance(by: pause)
    }

    @Test("idle: a fleet of brokers that serve a session asks etcd nothing for ten minutes (no re-watch, no quiet read), then still follows a refresh at once")
    func idle() async throws {
        let h = try await FleetHarness(brokers: 3)
        let first = try await h.logIn()
        let kinds: [MemoryEtcd.Kind] = [.get, .range, .transaction, .watch]
        let before = kinds.map { h.etcd.requests($0) }
        for _ in 0..<60 {
            h.advance(by: .seconds(10))
            // (Each step lets the loops that woke go back to sleep.)
            try await eventually("the brokers are asleep again") { h.brokers.allSatisfy { !$0.clock.wakeTimes.isEmpty } }
        }
        #expect(kinds.map { h.etcd.requests($0) } == before, "requests while idle: \(zip(kinds, before).map { "\($0): \(h.etcd.requests($0) - $1)" })")
        let next = try await h.brokers[0].coordinator.recover(rejected: Secret(first)).token.reveal
        let brokers = h.brokers
        try await eventually("every broker follows") { brokers.allSatisfy { $0.token == next } }
        await h.stopAll()
    }
}
