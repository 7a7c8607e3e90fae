import Foundation
import Testing
import TestSupport
import TokenBrokerCore
@testable import Fleet
import Basics
import Synchronization

/// Iterations of each fleet race: `TB_RACE_ITERATIONS` (capped), or the CI-sized default.
func fleetIterations(_ fallback: Int) -> Int {
    guard let text = ProcessInfo.processInfo.environment["TB_RACE_ITERATIONS"], let value = Int(text), value > 0 else { return fallback }
    return min(value, fallback * 20)
}

/// `count` calls started at once, each a task of its own; `all()` waits for them under a deadline.
final class Calls: Sendable {
    private let results = Locked<[Int: Result<IssuedToken, any Error>]>([:])
    private let tasks: [Task<Void, Never>]
    let count: Int

    init(_ count: Int, _ work: @escaping @Sendable (Int) async throws -> IssuedToken) {
        self.count = count
        let results = self.results
        tasks = (0..<count).map { index in
            Task {
                let result: Result<IssuedToken, any Error>
                do { result = .success(try await work(index)) } catch { result = .failure(error) }
                results.withLock { $0[index] = result }
            }
        }
    }

    var finished: Int { results.value.count }

    func all(_ what: String = "the calls finish") async throws -> [Result<IssuedToken, any Error>] {
        try await eventually(what) { self.finished == self.count }
        let all = results.value
        return (0..<count).map { all[$0]! }
    }
}

extension Result {
    var value: Success? { try? get() }
}

/// The fleet's race suite: two and three real `FleetSession`s with real coordinators on one
/// in-memory etcd (`MemoryEtcd`) and one rotating issuer with reuse detection. Every
/// interleaving is driven by the test — requests held at the issuer or at etcd, links cut,
/// leases expired, answers lost — and waited for as states, never for time: the test clock
/// moves only where a test says so, so no timer can hide a lost wake-up. Titled by the
/// guarantee each proves, fleet-wide.
@Suite("Fleet race suite (in-memory etcd)")
struct FleetRaceTests {
    @Test("G1 fleet-wide: every broker's demands for the same rejected token, arriving in every order, before and after the holder's answer → 1 upstream request, one new token for all, no replay",
          arguments: [2, 3])
    func storm(brokers count: Int) async throws {
        let orders = Array(0..<count).permutations
        for iteration in 0..<fleetIterations(8 * orders.count) {
            let h = try await FleetHarness(brokers: count)
            let first = try await h.logIn()
            let refreshes = h.issuer.counters.refreshes
            let order = orders[iteration % orders.count]
            let releaseEarly = (iteration / orders.count) % 2 == 1
            h.issuer.hold()
            var calls: [Calls] = []
            for (position, index) in order.enumerated() {
                let broker = h.brokers[index]
                calls.append(Calls(6) { _ in try await broker.coordinator.recover(rejected: Secret(first)) })
                if position == 0 {
                    try await eventually("the first broker's refresh is held at the issuer") { h.issuer.parkedCount == 1 }
                    if releaseEarly { h.issuer.release() }
                } else if !releaseEarly {
                    try await eventually("\(broker.name) waits for the holder's flight") { broker.waits >= 1 }
                }
            }
            if !releaseEarly { h.issuer.release() }
            var tokens = Set<String>()
            for call in calls {
                for result in try await call.all() { tokens.insert((try? result.get())?.token.reveal ?? "failed: \(result)") }
            }
            try #require(tokens.count == 1 && !tokens.contains(first), "iteration \(iteration): \(tokens)")
            try #require(h.issuer.counters.refreshes == refreshes + 1, "iteration \(iteration): \(h.issuer.counters)")
            try #require(h.issuer.counters.replays == 0)
            let token = tokens.first!
            try await eventually("every broker serves the new token") { h.brokers.allSatisfy { $0.token == token } }
            await h.stopAll()
        }
    }

    @Test("G3 fleet-wide: a logout on A while B's refresh is on its way — before the issuer answers, while B commits, or just after — B's answer reaches no broker unless committed before the logout; a late one is handed back for revocation")
    func logoutDuringRefresh() async throws {
        for iteration in 0..<fleetIterations(60) {
            let point = iteration % 3
            let ignoresCancellation = (iteration / 3) % 2 == 1
            let h = try await FleetHarness(brokers: 3, ignoresCancellation: ignoresCancellation)
            let first = try await h.logIn()
            let loggedIn = try #require(try h.stored()).position.generation
            let (a, b) = (h.brokers[0], h.brokers[1])
            h.issuer.hold()
            let waiter = Calls(1) { _ in try await b.coordinator.recover(rejected: Secret(first)) }
            try await eventually("B's refresh is held at the issuer") { h.issuer.parkedCount == 1 }
            switch point {
            case 0:   // before the issuer answers
                try await a.coordinator.logout()
                try await eventually("B has followed the logout") { await b.coordinator.status().state == .signedOut }
                h.issuer.release()
            case 1:   // the issuer has answered; B's commit is held at etcd
                h.etcd.hold(.transaction)
                h.issuer.release()
                try await eventually("B's commit is held") { h.etcd.parkedCount(.transaction) == 1 }
                try await a.coordinator.logout()
                h.etcd.release(.transaction)
            default:  // just after B's commit
                h.issuer.release()
                _ = try await waiter.all()
                try await a.coordinator.logout()
            }
            let outcome = try await waiter.all()[0]
            try await eventually("every broker is signed out") { h.brokers.allSatisfy { $0.token == nil } }
            for broker in h.brokers {
                await #expect(throws: SessionError.signedOut) { try await broker.coordinator.token() }
            }
            let stored = try h.stored()
            try #require(stored?.phase == .signedOut && (stored?.position.generation ?? 0) > loggedIn && stored?.hasTokens == false,
                         "iteration \(iteration): \(String(describing: stored?.position))")
            let answered = point == 2 || point == 1 || ignoresCancellation
            try #require(h.issuer.counters.refreshes == (answered ? 2 : 1), "iteration \(iteration): \(h.issuer.counters)")
            if point == 2 {
                try #require(outcome.value?.token.reveal == "access-3", "iteration \(iteration)")
                try #require(b.discarded.value.isEmpty)
            } else {
                try #require(outcome.value == nil, "iteration \(iteration): B's caller got the late token")
                if answered {
                    try await eventually("B's late answer is handed back for revocation") { b.discarded.value == ["refresh-3"] }
                } else {
                    try #require(b.discarded.value.isEmpty, "iteration \(iteration): \(b.discarded.value)")
                }
            }
            try #require(h.issuer.counters.replays == 0)
            await h.stopAll()
        }
    }

    @Test("G1 across a dead holder: B dies (kill -9) holding the flight → the others wait for its lease (by their own clocks, from when they saw its claim), then one takes over; the issuer never sees the same refresh token twice")
    func holderKilled() async throws {
        for iteration in 0..<fleetIterations(20) {
            let h = try await FleetHarness(brokers: 3)
            let first = try await h.logIn()
            let (a, b, c) = (h.brokers[0], h.brokers[1], h.brokers[2])
            h.issuer.hold()
            let doomed = Calls(1) { _ in try await b.coordinator.recover(rejected: Secret(first)) }
            try await eventually("B's refresh is held at the issuer") { h.issuer.parkedCount == 1 }
            try await eventually("C has seen B's claim") { c.fleet.status.flightHolder?.hasPrefix("host-1 ") == true }
            let early = iteration % 2 == 0
            var waiter: Calls?
            if early {
                waiter = Calls(1) { _ in try await c.coordinator.recover(rejected: Secret(first)) }
                try await eventually("C waits for B's flight") { c.waits >= 1 }
            }
            // Killed: nothing B does reaches etcd any more, and its tasks end.
            b.link.sever()
            await b.kill()
            _ = try await doomed.all()
            if !early {
                waiter = Calls(1) { _ in try await c.coordinator.recover(rejected: Secret(first)) }
                try await eventually("C waits for B's flight") { c.waits >= 1 }
            }
            try #require(h.issuer.counters.refreshes == 1, "iteration \(iteration): a refresh went out while B's claim held")
            h.advance(by: .seconds(59), except: [b])
            let waiting = waiter!
            try await eventually("C still waits just before the lease is over") { c.waits >= 1 && waiting.finished == 0 }
            try #require(h.issuer.counters.requests == 2, "iteration \(iteration): C took over before the lease was over")
            h.advance(by: .seconds(1), except: [b])
            let token = try await waiter!.all()[0].get().token.reveal
            try #require(token != first && h.issuer.counters.refreshes == 2 && h.issuer.counters.replays == 0, "iteration \(iteration)")
            try await eventually("A follows") { a.token == token }
            await h.stopAll()
        }
    }

    @Test("no lost wake-up: B is stopped (SIGSTOP) holding the flight, its lease lapses, C refreshes; B resumes — its own flight failing before or after it hears of C's refresh, able to read etcd then or not — and serves C's token within one watch round trip, with no timer to help")
    func holderStalled() async throws {
        for iteration in 0..<fleetIterations(30) {
            let h = try await FleetHarness(brokers: 3)
            let first = try await h.logIn()
            let (a, b, c) = (h.brokers[0], h.brokers[1], h.brokers[2])
            h.issuer.hold()
            let stalled = Calls(1) { _ in try await b.coordinator.recover(rejected: Secret(first)) }
            try await eventually("B's refresh is held at the issuer") { h.issuer.parkedCount == 1 }
            try await eventually("C has seen B's claim") { c.fleet.status.flightHolder?.hasPrefix("host-1 ") == true }
            // Stopped: B reaches nothing, and its clock does not move; the others' does, past the lease.
            b.link.sever()
            h.advance(by: .seconds(60), except: [b])
            let token = try await c.coordinator.recover(rejected: Secret(first)).token.reveal
            try await eventually("A follows C") { a.token == token }
            try #require(b.token == first)
            let variant = iteration % 3
            if variant == 1 {
                // B's request fails while B still cannot reach etcd: its caller hears of the
                // failure; then B hears of C's refresh.
                h.issuer.fail(.transient("HTTP 503"))
                let outcome = try await stalled.all()[0]
                try #require(outcome.value == nil, "iteration \(iteration)")
                b.link.mend()
            } else {
                // B hears of C's refresh first (its adoption is declined: its flight is under way),
                // then its own request fails — and, in one variant, B cannot read etcd right then.
                b.link.mend()
                try await eventually("B has heard of C's refresh") { b.fleet.status.position.serial >= 2 }
                if variant == 2 { h.etcd.failNext(.get) }
                h.issuer.fail(.transient("HTTP 503"))
                let outcome = try await stalled.all()[0]
                if variant == 0 {
                    try #require(outcome.value?.token.reveal == token, "iteration \(iteration): B's caller got \(outcome)")
                }
            }
            try await eventually("B serves C's token") { b.token == token }
            try #require(h.issuer.counters.refreshes == 2 && h.issuer.counters.replays == 0, "iteration \(iteration): \(h.issuer.counters)")
            try #require(b.clock.now.offset == .zero, "B's clock moved")
            await h.stopAll()
        }
    }

    @Test("lost answers (etcd applied the request, the answer was lost, the client sent it again): of the login, the flight, the commit → one generation per login, the flight recognised as ours, the refresh committed once and returned")
    func lostAnswers() async throws {
        for lost in 0..<3 {
            let h = try await FleetHarness(brokers: 2)
            try await eventually("both brokers have read the fleet") { await h.brokers.asyncAllSatisfy { $0.fleet.status.health == .healthy } }
            let (a, b) = (h.brokers[0], h.brokers[1])
            if lost == 0 { h.etcd.dropAnswer(.transaction, count: 2) }   // the creation and the login
            _ = try await a.coordinator.login(refreshToken: h.issuer.login())
            // One creation (with no token) and one login: two writes of the key, whatever was lost.
            #expect(h.etcd.entry(FleetHarness.stateKey)?.version == 2, "case \(lost)")
            let login = try #require(try h.stored()).position
            if lost == 1 { h.etcd.dropAnswer(.transaction) }   // the flight
            if lost == 2 {
                h.etcd.dropAnswer(.transaction, count: 2)   // the flight, then the commit
            }
            let token = try await a.coordinator.token().token.reveal
            #expect(token == "access-2" && h.issuer.counters.refreshes == 1, "case \(lost): \(h.issuer.counters)")
            // The flight taken, the refresh committed: two writes more.
            #expect(h.etcd.entry(FleetHarness.stateKey)?.version == 4, "case \(lost)")
            #expect(try h.stored()?.position == FleetPosition(generation: login.generation, serial: 2), "case \(lost)")
            try await eventually("B follows") { b.token == token }
            await h.stopAll()
        }
    }

    @Test("replayed values: an etcd writer without the key writes the old state back (after a refresh, or during one) → nobody serves or refreshes from it, an honest commit is not beaten by it, the issuer sees no replay; a login recovers")
    func replayedValues() async throws {
        for during in [false, true] {
            let h = try await FleetHarness(brokers: 2)
            let first = try await h.logIn()
            let (a, b) = (h.brokers[0], h.brokers[1])
            let old = h.etcd.snapshot
            func writeBack() {
                for (key, entry) in old.keys { h.etcd.write(String(decoding: key, as: UTF8.self), entry.value) }
            }
            if during {
                h.issuer.hold()
                let waiter = Calls(1) { _ in try await a.coordinator.recover(rejected: Secret(first)) }
                try await eventually("A's refresh is held") { h.issuer.parkedCount == 1 }
                writeBack()
                h.issuer.release()
                let token = try await waiter.all()[0].get().token.reveal
                #expect(token == "access-3")
                try await eventually("B follows A's commit, made over the values written back") { b.token == token }
                #expect(try h.stored()?.accessToken?.reveal == token)
            } else {
                let second = try await a.coordinator.recover(rejected: Secret(first)).token.reveal
                try await eventually("B follows") { b.token == second }
                let requests = h.issuer.counters.requests
                writeBack()
                try await eventually("both brokers refuse the state written back") {
                    h.brokers.allSatisfy { if case .untrusted = $0.fleet.status.health { return true } else { return false } }
                }
                for broker in h.brokers {
                    #expect(broker.token == second)
                    await #expect(throws: SessionError.self) { try await broker.coordinator.recover(rejected: Secret(second)) }
                }
                #expect(h.issuer.counters.requests == requests, "a broker refreshed from the values written back")
                #expect(a.fleet.status.counters.refusedValues >= 1)
                // A login writes a new generation over them.
                _ = try await b.coordinator.login(refreshToken: h.issuer.login())
                let fresh = try await b.coordinator.token().token.reveal
                try await eventually("A follows the login") { a.token == fresh && a.fleet.status.health == .healthy }
            }
            #expect(h.issuer.counters.replays == 0)
            await h.stopAll()
        }
    }

    @Test("rolled back (etcd restored from a backup: the old values at their old revisions): a broker that restarts on its own state does not follow, nor does a running one; a new broker, with no history, does (the documented limit); a login moves the fleet past all of them")
    func rolledBack() async throws {
        var h = try await FleetHarness(brokers: 3)
        let first = try await h.logIn()
        let backup = h.etcd.snapshot
        try await h.brokers[0].coordinator.logout()
        let loggedOut = try #require(try h.stored()).position.generation
        let brokers = h.brokers
        try await eventually("every broker is signed out") { brokers.allSatisfy { $0.token == nil } }
        h.etcd.restore(backup)
        // A restart of C on its own state database.
        let restarted = try await h.restart(2)
        try await eventually("the restarted broker reports the rollback") { restarted.fleet.status.counters.rollbacks == 1 }
        #expect(restarted.token == nil)
        await #expect(throws: SessionError.signedOut) { try await restarted.coordinator.token() }
        if case let .untrusted(why) = restarted.fleet.status.health {
            #expect(why.contains("older than"), "\(why)")
        } else {
            Issue.record("health is \(restarted.fleet.status.health)")
        }
        // A running broker finds out when its watch reads again: the restore restarted the members.
        try await h.membersRestarted(h.brokers)
        let running = h.brokers[0]
        try await eventually("a running broker reports the rollback") { running.fleet.status.counters.rollbacks == 1 }
        #expect(h.brokers[0].token == nil)
        // A broker with no history of its own cannot tell: it follows the restored state.
        let newcomer = try await h.start("host-3")
        h.brokers.append(newcomer)
        try await eventually("the new broker follows the restored state") { newcomer.token == first }
        // A login on A starts a generation after everything any broker has seen.
        _ = try await h.brokers[0].coordinator.login(refreshToken: h.issuer.login())
        let fresh = try await h.brokers[0].coordinator.token().token.reveal
        let everyone = h.brokers
        try await eventually("every broker follows the login") { everyone.allSatisfy { $0.token == fresh } }
        #expect(try h.stored()!.position.generation > loggedOut)
        #expect(h.issuer.counters.replays == 0)
        await h.stopAll()
    }
}

/// What an etcd writer without the fleet key, and an etcd that goes back, cannot make a broker
/// do — the cases an adversarial review found, each shown failing before its fix.
@Suite("Fleet race suite: writes without the key, and an etcd that goes back")
struct FleetTamperTests {
    @Test("the state garbled or deleted while A's refresh is at the issuer → no other broker refreshes (no replay); A's commit is written over the garbage, or kept when the key is gone",
          arguments: [false, true])
    func stateTamperedDuringFlight(deleted: Bool) async throws {
        let h = try await FleetHarness(brokers: 2)
        let first = try await h.logIn()
        let (a, b) = (h.brokers[0], h.brokers[1])
        h.issuer.hold()
        let holder = Calls(1) { _ in try await a.coordinator.recover(rejected: Secret(first)) }
        try await eventually("A's refresh is held") { h.issuer.parkedCount == 1 }
        h.etcd.write(FleetHarness.stateKey, deleted ? nil : Array("garbage".utf8))
        await #expect(throws: SessionError.self) { try await b.coordinator.recover(rejected: Secret(first)) }
        #expect(h.issuer.counters.requests == 2, "B sent a request: \(h.issuer.counters)")
        h.issuer.release()
        let outcome = try await holder.all()[0]
        if deleted {
            #expect(outcome.value == nil, "A served an answer the fleet does not hold")
            // A keeps it for a commit; a login elsewhere makes it worthless: handed back for revocation.
            _ = try await b.coordinator.login(refreshToken: h.issuer.login())
            try await eventually("A's kept answer is handed back once the login is followed") { a.discarded.value == ["refresh-3"] }
        } else {
            let token = try #require(outcome.value?.token.reveal)
            try await eventually("B follows A's commit, written over the garbage") { b.token == token }
        }
        #expect(h.issuer.counters.replays == 0)
        await h.stopAll()
    }

    @Test("G5 fleet-wide: a refresh that fails with Retry-After → every broker backs off, with no request of its own")
    func backoffShared() async throws {
        let h = try await FleetHarness(brokers: 2)
        let first = try await h.logIn()
        let (a, b) = (h.brokers[0], h.brokers[1])
        h.issuer.hold()
        let failing = Calls(1) { _ in try await a.coordinator.recover(rejected: Secret(first)) }
        try await eventually("A's refresh is held") { h.issuer.parkedCount == 1 }
        h.issuer.fail(.transient("HTTP 429", retryAfter: .seconds(600)))
        _ = try await failing.all()
        let requests = h.issuer.counters.requests
        try await eventually("B has heard of the failure") { b.fleet.status.position.serial >= 3 }
        do {
            _ = try await b.coordinator.recover(rejected: Secret(first))
            Issue.record("B refreshed during the fleet's backoff")
        } catch let SessionError.refreshFailed(reason, retryable, retryAfter) {
            #expect(retryable && reason.contains("HTTP 429") && (retryAfter ?? .zero) > .seconds(500), "\(reason) \(String(describing: retryAfter))")
        }
        #expect(h.issuer.counters.requests == requests)
        await h.stopAll()
    }

    @Test("a logout remembered across a restart, whose first publication fails → the restarted broker never serves the token its logout ended; the logout reaches the fleet")
    func pendingLogoutAcrossRestart() async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("tb-fleet-\(UInt32.random(in: 0...UInt32.max))").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let path = directory + "/fleet-logout-api"
        var h = try await FleetHarness(brokers: 0)
        h.brokers.append(try await h.start("host-0", pendingLogoutFile: path))
        h.brokers.append(try await h.start("host-1"))
        let first = try await h.logIn()
        let a = h.brokers[0]
        a.link.sever()
        await #expect(throws: (any Error).self) { try await a.coordinator.logout() }
        #expect(a.token == nil && FileManager.default.fileExists(atPath: path))
        await a.kill()
        h.etcd.failNext(.transaction)
        let restarted = try await h.start("host-0", store: a.store, pendingLogoutFile: path)
        h.brokers[0] = restarted
        let b = h.brokers[1]
        try await eventually("the logout reaches the fleet") { b.token == nil && !FileManager.default.fileExists(atPath: path) }
        #expect(restarted.token == nil && restarted.token != first)
        #expect(!restarted.saw { if case .loggedIn = $0 { return true } else { return false } }, "the restarted broker logged in to what it logged out")
        await h.stopAll()
    }

    @Test("a refresh answered after a logout elsewhere, the state garbled meanwhile → the late commit does not write the ended generation back; a broker with history restarting then serves nothing")
    func lateCommitOverGarbage() async throws {
        var h = try await FleetHarness(brokers: 3, ignoresCancellation: true)
        let first = try await h.logIn()
        let (a, b, c) = (h.brokers[0], h.brokers[1], h.brokers[2])
        await c.kill()   // down during the logout
        h.issuer.hold()
        let waiter = Calls(1) { _ in try await b.coordinator.recover(rejected: Secret(first)) }
        let issuer = h.issuer
        try await eventually("B's refresh is held") { issuer.parkedCount == 1 }
        try await a.coordinator.logout()
        try await eventually("B has followed the logout") { await b.coordinator.status().state == .signedOut }
        h.etcd.write(FleetHarness.stateKey, Array("garbage".utf8))
        h.issuer.release()
        _ = try await waiter.all()
        try await eventually("B's late answer is handed back for revocation") { b.discarded.value == ["refresh-3"] }
        #expect(h.etcd.entry(FleetHarness.stateKey)?.value == Array("garbage".utf8), "the late commit was written over the garbage")
        let restarted = try await h.start("host-2", store: c.store)
        h.brokers[2] = restarted
        try await eventually("the restarted broker has read the fleet") {
            if case .untrusted = restarted.fleet.status.health { return true } else { return false }
        }
        #expect(restarted.token == nil)
        await h.stopAll()
    }

    @Test("etcd restored from a backup with its revision going back (no --bump-revision) → a running broker reads it, reports the rollback and does not follow; its refresh ends at once, and it stops cleanly")
    func revisionRewound() async throws {
        let h = try await FleetHarness(brokers: 2)
        let first = try await h.logIn()
        let (a, b) = (h.brokers[0], h.brokers[1])
        let backup = h.etcd.snapshot
        let second = try await a.coordinator.recover(rejected: Secret(first)).token.reveal
        try await eventually("B follows") { b.token == second }
        h.etcd.restore(backup, rewinding: true)
        try await h.membersRestarted(h.brokers)   // every watch ends, each broker reads again
        try await eventually("B reports the rollback") { b.fleet.status.counters.rollbacks == 1 }
        let transactions = h.etcd.requests(.transaction)
        await #expect(throws: SessionError.self) { try await b.coordinator.recover(rejected: Secret(second)) }
        #expect(h.etcd.requests(.transaction) == transactions && b.token == second)
        await b.stop()
        await h.stopAll()
    }

    @Test("firstSync returns once the fleet's state is applied: a new broker serves the fleet's token right after it", arguments: 0..<20)
    func firstSyncApplies(_ run: Int) async throws {
        var h = try await FleetHarness(brokers: 1)
        let first = try await h.logIn()
        let late = try await h.start("host-9")
        h.brokers.append(late)
        await late.fleet.firstSync(within: .seconds(5))
        #expect(late.token == first, "run \(run)")
        await h.stopAll()
    }
}

/// The cases a second adversarial review found, each failing before its fix: a claim brought
/// back by a restored backup, a commit kept across a clean stop, a read that comes back after
/// the watch brought something newer, a lying member's revision, a late commit over garbage
/// that its holder cannot tell from a logout, a slow commit within the holder's reserve, a
/// broker behind the others publishing over garbage, and a claim first seen late.
@Suite("Fleet race suite: a second review")
struct FleetSecondReviewTests {
    @Test("a backup taken while A's claim was current, restored after A's commit was blocked → B, which saw the claim replaced, does not take over from the spent token; A's kept commit lands")
    func restoredClaim() async throws {
        let h = try await FleetHarness(brokers: 2)
        let first = try await h.logIn()
        let (a, b) = (h.brokers[0], h.brokers[1])
        h.issuer.hold()
        let holder = Calls(1) { _ in try await a.coordinator.recover(rejected: Secret(first)) }
        let issuer = h.issuer
        try await eventually("A's refresh is held") { issuer.parkedCount == 1 }
        try await eventually("B has seen A's claim") { b.fleet.status.flightHolder?.hasPrefix("host-0 ") == true }
        let backup = h.etcd.snapshot
        h.etcd.write(FleetHarness.stateKey, Array("garbage-1".utf8))
        h.etcd.write(FleetHarness.stateKey, Array("garbage-2".utf8))
        try await eventually("B has seen the garbage") { b.fleet.status.counters.refusedValues >= 1 }
        issuer.release()
        #expect(try await holder.all()[0].value == nil, "A served a token it could not commit")
        h.advance(by: .seconds(61))
        h.etcd.restore(backup)
        // B refreshes nothing from the restored claim: it fails, or (when A's kept commit has
        // landed over its claim already) answers with A's token.
        if let token = try? await b.coordinator.recover(rejected: Secret(first)) { #expect(token.token.reveal == "access-3") }
        #expect(issuer.counters.replays == 0 && issuer.counters.requests == 2, "\(issuer.counters)")
        // A's kept commit is written over its own claim, now back in etcd; everyone follows.
        // (B watches again after a pause of at most 5 s on its clock, once it is asleep in it:
        // advancing the clock before the pause begins would move nothing.)
        let restarts = b.fleet.status.counters.watchRestarts
        h.etcd.endWatches()
        try await eventually("B's watch has ended") { b.fleet.status.counters.watchRestarts > restarts }
        try await eventually("B pauses before watching again") {
            let now = b.clock.now.offset
            return b.clock.wakeTimes.contains { $0 > now && $0 <= now + .seconds(5) }
        }
        h.advance(by: .seconds(5))
        try await eventually("B follows A's commit") { b.token == "access-3" }
        #expect(issuer.counters.replays == 0)
        await h.stopAll()
    }

    @Test("etcd away for longer than two leases after the issuer answered A: the refresh is kept in A's state database across a clean stop and committed after the restart; no broker presents the spent token")
    func keptCommitAcrossStop() async throws {
        var h = try await FleetHarness(brokers: 2)
        let first = try await h.logIn()
        let (a, b) = (h.brokers[0], h.brokers[1])
        let issuer = h.issuer
        issuer.hold()
        let holder = Calls(1) { _ in try await a.coordinator.recover(rejected: Secret(first)) }
        try await eventually("A's refresh is held") { issuer.parkedCount == 1 }
        h.etcd.setUnavailable(true)
        issuer.release()
        try await eventually("A has the answer and tries its commit") { issuer.counters.refreshes == 2 }
        // Time passes, a second at a time, past twice the lease: A gives the commit up for now.
        let brokers = h
        try await eventually("A gives its commit up for now") {
            brokers.advance(by: .seconds(1))
            return holder.finished == 1
        }
        #expect(try await holder.all()[0].value == nil)
        try await eventually("A keeps the refresh in its state database") { (try? await a.store.pendingCommit("api")) != nil }
        await a.stop()
        h.etcd.setUnavailable(false)
        let restarted = try await h.start("host-0", store: a.store)
        h.brokers[0] = restarted
        try await eventually("the kept commit lands and both brokers serve its token") { restarted.token == "access-3" && b.token == "access-3" }
        #expect(try await a.store.pendingCommit("api") == nil)
        let next = try await b.coordinator.recover(rejected: Secret("access-3")).token.reveal
        #expect(next == "access-4" && issuer.counters.replays == 0, "\(issuer.counters)")
        await h.stopAll()
    }

    @Test("a read answered before a logout elsewhere comes back after the watch brought the logout → it is dropped: B follows the logout at once, and reports no rollback")
    func staleReadDropped() async throws {
        let h = try await FleetHarness(brokers: 2)
        _ = try await h.logIn()
        let (a, b) = (h.brokers[0], h.brokers[1])
        b.link.holdNextAnswer()
        // B reads its key itself (as a refresh or a boundary does), while its watch runs.
        let read = Task { try? await b.fleet.readView() }
        try await eventually("B's read is answered and on its way") { b.link.answerParked }
        try await a.coordinator.logout()
        let revision = h.etcd.snapshot.revision
        try await eventually("B's watch has brought the logout") { b.fleet.mirror.withLock { $0.revision } >= revision }
        b.link.releaseAnswer()
        _ = await read.value
        try await eventually("B follows the logout") { b.token == nil }
        #expect(b.fleet.status.counters.rollbacks == 0 && b.fleet.status.health == .healthy)
        await h.stopAll()
    }

    @Test("one read answered with a huge revision (a member that lies) during a login → the generation moves on by a bounded step; later logouts still reach every broker")
    func forgedRevision() async throws {
        let h = try await FleetHarness(brokers: 2)
        _ = try await h.logIn()
        let (a, b) = (h.brokers[0], h.brokers[1])
        a.link.forgedRevision.withLock { $0 = FleetPosition.limit - 2 }
        _ = try await a.coordinator.login(refreshToken: h.issuer.login())
        let fresh = try await a.coordinator.token().token.reveal
        try await eventually("B follows the login") { b.token == fresh }
        #expect(try h.stored()!.position.generation < FleetPosition.limit / 2)
        try await a.coordinator.logout()
        try await eventually("B follows the logout") { b.token == nil }
        await h.stopAll()
    }

    @Test("a late commit whose holder has not applied the logout, the logout then garbled → not written over it: the one-write rule; a broker with history serves nothing after a restart")
    func lateCommitHolderUnaware() async throws {
        var h = try await FleetHarness(brokers: 3)
        let first = try await h.logIn()
        let (a, b, c) = (h.brokers[0], h.brokers[1], h.brokers[2])
        await c.kill()
        // B applies nothing the fleet does meanwhile: its serializer is held.
        let gate = Locked<CheckedContinuation<Void, Never>?>(nil)
        let blocker = Task { await b.fleet.serializer.run { await withCheckedContinuation { continuation in gate.withLock { $0 = continuation } } } }
        try await eventually("B's serializer is held") { gate.value != nil }
        let issuer = h.issuer
        issuer.hold()
        let waiter = Calls(1) { _ in try await b.coordinator.recover(rejected: Secret(first)) }
        try await eventually("B's refresh is held") { issuer.parkedCount == 1 }
        try await a.coordinator.logout()
        h.etcd.write(FleetHarness.stateKey, Array("garbage".utf8))
        issuer.release()
        #expect(try await waiter.all()[0].value == nil, "B served its late answer")
        gate.withLock { $0?.resume(); $0 = nil }
        await blocker.value
        #expect(h.etcd.entry(FleetHarness.stateKey)?.value == Array("garbage".utf8), "the late commit was written over the garbage")
        let restarted = try await h.start("host-2", store: c.store)
        h.brokers[2] = restarted
        try await eventually("the restarted broker has read the fleet") {
            if case .untrusted = restarted.fleet.status.health { return true } else { return false }
        }
        #expect(restarted.token == nil, "a broker with history serves the ended session")
        await h.stopAll()
    }

    @Test("the issuer answers late in the holder's budget and its commit takes the second it keeps for it → no other broker takes over meanwhile; no replay")
    func commitWithinReserve() async throws {
        let h = try await FleetHarness(brokers: 2)
        let first = try await h.logIn()
        let (a, b) = (h.brokers[0], h.brokers[1])
        let issuer = h.issuer
        issuer.hold()
        let holder = Calls(1) { _ in try await a.coordinator.recover(rejected: Secret(first)) }
        try await eventually("A's refresh is held") { issuer.parkedCount == 1 }
        try await eventually("B has seen A's claim") { b.fleet.status.flightHolder?.hasPrefix("host-0 ") == true }
        h.advance(by: .milliseconds(56_900))   // the budget: 60 s - 2 s margin - 1 s for the commit
        h.etcd.hold(.transaction)
        issuer.release()
        try await eventually("A's commit is on its way") { h.etcd.parkedCount(.transaction) == 1 }
        h.advance(by: .milliseconds(1_000))
        let waiting = Calls(1) { _ in try await b.coordinator.recover(rejected: Secret(first)) }
        try await eventually("B waits for A's claim") { b.waits >= 1 }
        h.etcd.release(.transaction)
        let token = try await holder.all()[0].get().token.reveal
        #expect(try await waiting.all()[0].get().token.reveal == token)
        #expect(issuer.counters.replays == 0 && issuer.counters.requests == 2, "\(issuer.counters)")
        await h.stopAll()
    }

    @Test("a broker whose history is behind the others' logs out over a garbled state → its generation is past etcd's revision, so the others follow it (not a rollback to them)")
    func laggingBrokerPublishes() async throws {
        var h = try await FleetHarness(brokers: 3)
        _ = try await h.logIn()
        let a = h.brokers[0]
        await a.kill()
        _ = try await h.brokers[1].coordinator.login(refreshToken: h.issuer.login())
        let second = try await h.brokers[1].coordinator.token().token.reveal
        let (b, c) = (h.brokers[1], h.brokers[2])
        try await eventually("C follows B's login") { c.token == second }
        h.etcd.write(FleetHarness.stateKey, Array("garbage".utf8))
        let restarted = try await h.start("host-0", store: a.store)
        h.brokers[0] = restarted
        try await eventually("A has read the garbage") {
            if case .untrusted = restarted.fleet.status.health { return true } else { return false }
        }
        try await restarted.coordinator.logout()
        try await eventually("B and C follow A's logout") { b.token == nil && c.token == nil }
        #expect(b.fleet.status.counters.rollbacks == 0 && c.fleet.status.counters.rollbacks == 0)
        await h.stopAll()
    }

    @Test("a broker that first sees a claim late (its link was down) holds it for a whole lease from then, by its own clock")
    func claimFirstSeenLate() async throws {
        let h = try await FleetHarness(brokers: 2)
        let first = try await h.logIn()
        let (b, c) = (h.brokers[0], h.brokers[1])
        c.link.sever()
        let issuer = h.issuer
        issuer.hold()
        _ = Calls(1) { _ in try await b.coordinator.recover(rejected: Secret(first)) }
        try await eventually("B's refresh is held") { issuer.parkedCount == 1 }
        c.clock.advance(by: .seconds(30))
        c.link.mend()   // the claim reaches C now, at 30 s on its clock
        try await eventually("C has seen B's claim") { c.fleet.status.flightHolder?.hasPrefix("host-0 ") == true }
        b.link.sever()
        await b.kill()
        let waiter = Calls(1) { _ in try await c.coordinator.recover(rejected: Secret(first)) }
        try await eventually("C waits") { c.waits >= 1 }
        c.clock.advance(by: .seconds(59))   // 89 s on C's clock: 59 s since it saw the claim
        try await eventually("C's wait has woken and waits on") { c.clock.wakeTimes.contains(.seconds(90)) }
        #expect(issuer.counters.requests == 2, "C took over before a lease had passed since it saw the claim")
        c.clock.advance(by: .seconds(1))
        let token = try await waiter.all()[0].get().token.reveal
        #expect(token == "access-3" && issuer.counters.replays == 0)
        await h.stopAll()
    }
}

extension FleetSecondReviewTests {
    @Test("the issuer has not answered when the holder's budget (its lease less the margin and its commit's second) is spent → the request is abandoned, never processed, and nobody tries again before the lease would have ended")
    func abandonedAtBudget() async throws {
        let h = try await FleetHarness(brokers: 2)
        let first = try await h.logIn()
        let (a, b) = (h.brokers[0], h.brokers[1])
        let issuer = h.issuer
        issuer.hold()
        let holder = Calls(1) { _ in try await a.coordinator.recover(rejected: Secret(first)) }
        try await eventually("A's refresh is held") { issuer.parkedCount == 1 }
        try await eventually("B has seen A's claim") { b.fleet.status.flightHolder?.hasPrefix("host-0 ") == true }
        h.advance(by: .milliseconds(57_500))
        let outcome = try await holder.all("A abandons its request")[0]
        #expect(outcome.value == nil && issuer.counters.refreshes == 1, "the abandoned request was processed: \(issuer.counters)")
        try await eventually("B has heard of the backoff") { b.fleet.status.flightHolder == nil }
        await #expect(throws: SessionError.self) { try await b.coordinator.recover(rejected: Secret(first)) }
        #expect(issuer.counters.requests == 2, "B tried again before A's lease would have ended")
        h.advance(by: .seconds(3))
        let token = try await b.coordinator.recover(rejected: Secret(first)).token.reveal
        #expect(token == "access-3" && issuer.counters.replays == 0)
        await h.stopAll()
    }
}
