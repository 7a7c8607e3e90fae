import Foundation
import Testing
import TestSupport
import TokenBrokerCore
@testable import Fleet
import Basics

/// Operations of the honest-traffic run: `TB_FLEET_HONEST_ITERATIONS` (capped), or the CI-sized default.
func honestIterations(_ fallback: Int) -> Int {
    guard let text = ProcessInfo.processInfo.environment["TB_FLEET_HONEST_ITERATIONS"], let value = Int(text), value > 0 else { return fallback }
    return min(value, 100_000)
}

/// An alarm that fires on honest traffic hides the real one: with no writer but the brokers, no
/// broker reports a rollback or a refused value, whatever its watch stream lags behind its own
/// writes (as a real etcd's does: the answer to a transaction comes before the watch event).
@Suite("Fleet honest traffic: no rollback alarm without a rollback")
struct FleetHonestTrafficTests {
    /// What the sync loop does at a wake-up, done now: apply the mirror as it stands.
    static func applyNow(_ broker: TestBroker) async {
        _ = await broker.sync.applyOnce()
    }

    static func alarms(_ brokers: [TestBroker]) -> [String] {
        brokers.compactMap { broker in
            let counters = broker.fleet.status.counters
            guard counters.rollbacks > 0 || counters.refusedValues > 0 else { return nil }
            return "\(broker.name): \(counters.rollbacks) rollback(s), \(counters.refusedValues) refused value(s)"
        }
    }

    @Test("a broker's own login, flight and commit acknowledged by etcd while its watch has not brought them yet → its sync loop, applying its copy of the key then, sees no rollback")
    func ownWritesBeforeTheirWatchEvents() async throws {
        let h = try await FleetHarness(brokers: 3)
        let first = try await h.logIn()
        let a = h.brokers[0]
        // A's watch stream lags: every event waits until the test lets it through.
        a.link.holdWatch()
        _ = try await a.coordinator.login(refreshToken: h.issuer.login())
        await Self.applyNow(a)
        #expect(Self.alarms(h.brokers).isEmpty, "after A's own login: \(Self.alarms(h.brokers))")
        let second = try await a.coordinator.token().token.reveal
        #expect(second != first)
        await Self.applyNow(a)
        #expect(Self.alarms(h.brokers).isEmpty, "after A's own refresh: \(Self.alarms(h.brokers))")
        let third = try await a.coordinator.recover(rejected: Secret(second)).token.reveal
        await Self.applyNow(a)
        #expect(Self.alarms(h.brokers).isEmpty, "after A's second refresh: \(Self.alarms(h.brokers))")
        a.link.releaseWatch()
        let brokers = h.brokers
        try await eventually("every broker serves A's token") { brokers.allSatisfy { $0.token == third } }
        #expect(Self.alarms(h.brokers).isEmpty, "\(Self.alarms(h.brokers))")
        #expect(h.issuer.counters.replays == 0)
        await h.stopAll()
    }

    @Test("1,000 logins and refreshes (TB_FLEET_HONEST_ITERATIONS) on 3 brokers, any broker's watch lagging at random and every sync loop applying its copy before the watch catches up → 0 rollbacks, 0 refused values, 0 replays; every broker serves each new token")
    func honestTraffic() async throws {
        let operations = honestIterations(1_000)
        let seed = SeededRandom.seed()
        var random = SeededRandom(seed: seed)
        let h = try await FleetHarness(brokers: 3)
        var current = try await h.logIn()
        var (logins, refreshes) = (1, 1)
        var firstAlarm: String?
        for operation in 0..<operations {
            // Time for the refresh guard (10 a minute on each broker), and for the sync loops'
            // quiet reads to come now and then.
            h.advance(by: .seconds(7))
            let broker = random.pick(h.brokers)
            let lagging = h.brokers.filter { _ in random.next() % 2 == 0 }
            for lagger in lagging { lagger.link.holdWatch() }
            let token: String
            if random.next() % 5 == 0 {
                _ = try await broker.coordinator.login(refreshToken: h.issuer.login())
                token = try await broker.coordinator.token().token.reveal
                logins += 1
            } else {
                token = try await broker.coordinator.recover(rejected: Secret(current)).token.reveal
                refreshes += 1
            }
            try #require(token != current, "operation \(operation) (seed \(seed)): \(broker.name) got no new token")
            // Each sync loop applies its copy of the key as it stands, before the watch has brought
            // what the broker itself just wrote.
            for each in h.brokers { await Self.applyNow(each) }
            if firstAlarm == nil, !Self.alarms(h.brokers).isEmpty { firstAlarm = "operation \(operation), on \(broker.name)" }
            for lagger in lagging { lagger.link.releaseWatch() }
            let brokers = h.brokers
            try await eventually("operation \(operation): every broker serves \(broker.name)'s new token") {
                brokers.allSatisfy { $0.token == token }
            }
            current = token
        }
        let alarms = Self.alarms(h.brokers)
        print("figure: honest traffic: \(logins) logins and \(refreshes) refreshes on 3 brokers (seed \(seed)): "
              + "\(h.brokers.map { $0.fleet.status.counters.rollbacks }.reduce(0, +)) rollbacks, "
              + "\(h.brokers.map { $0.fleet.status.counters.refusedValues }.reduce(0, +)) refused values, \(h.issuer.counters.replays) replays")
        #expect(alarms.isEmpty, "\(alarms); the first after \(firstAlarm ?? "-") (seed \(seed))")
        #expect(h.issuer.counters.replays == 0)
        await h.stopAll()
    }
}
