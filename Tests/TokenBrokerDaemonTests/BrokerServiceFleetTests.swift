import Testing
@testable import TokenBrokerDaemon
import Varlink

/// ResetFleetHistory's refusals, in memory (the reset itself: `FleetHistoryTests`, and through
/// the real daemon on etcd, `FleetAttackTests`).
@Suite("BrokerService: ResetFleetHistory")
struct BrokerServiceFleetTests {
    @Test("ResetFleetHistory: admins only (a session user and a stranger alike get PermissionDenied), NoSuchSession for a name nobody configured, and InvalidParameter (session) for a session that is not a fleet session; the session goes on")
    func refusals() async {
        let service = await BrokerServiceTests.service()
        for peer in [BrokerServiceTests.worker, BrokerServiceTests.stranger] {
            #expect(await BrokerServiceTests.call(service, "ResetFleetHistory", ["session": "api"], from: peer)
                == [.error("io.tokenbroker.Broker.PermissionDenied")])
        }
        #expect(await BrokerServiceTests.call(service, "ResetFleetHistory", ["session": "nope"])
            == [.error("io.tokenbroker.Broker.NoSuchSession", ["session": "nope"])])
        #expect(await BrokerServiceTests.call(service, "ResetFleetHistory", ["session": "api"]) == [.invalidParameter("session")])
        #expect(await BrokerServiceTests.call(service, "ResetFleetHistory", ["session": "api", "force": true]) == [.invalidParameter("force")])
        let token = await BrokerServiceTests.call(service, "GetToken", ["session": "api"], from: BrokerServiceTests.worker)
        #expect(token.first?.error == nil, "\(token)")
    }
}
