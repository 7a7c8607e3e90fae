import Testing
import TestSupport
import TokenBrokerCore
@testable import Fleet

/// What a broker says while it refuses the fleet's state, and does.
@Suite("Fleet history: room below the limit, started anew on purpose")
struct FleetHistoryTests {
    static func messages(_ broker: TestBroker) -> [String] { broker.events.value.map(\.message) }

    @Test("a broker restarted while the fleet's state is refused serves nothing, and its journal says so; a running one says it serves the token it holds")
    func restartedOnARefusedValue() async throws {
        var h = try await FleetHarness(brokers: 2)
        let first = try await h.logIn()
        h.etcd.write(FleetHarness.stateKey, Array("garbage".utf8))
        let a = h.brokers[0]
        try await eventually("A refuses the value") { a.fleet.status.counters.refusedValues == 1 }
        #expect(a.token == first)
        #expect(Self.messages(a).contains { $0.contains("not taken") && $0.contains("serving the token this broker holds") }, "\(Self.messages(a))")
        let b = h.brokers[1]
        await b.kill()
        h.brokers[1] = try await h.start("host-1", store: b.store)
        let restarted = h.brokers[1]
        try await eventually("the restarted broker refuses the value") { restarted.fleet.status.counters.refusedValues == 1 }
        #expect(restarted.token == nil)
        await #expect(throws: SessionError.signedOut) { try await restarted.coordinator.token() }
        let said = Self.messages(restarted).filter { $0.contains("not taken") }
        #expect(said.count == 1 && said.allSatisfy { $0.contains("serves nothing") && !$0.contains("serving") }, "\(said)")
        await h.stopAll()
    }
}
