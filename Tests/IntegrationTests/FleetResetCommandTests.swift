import Testing
import Varlink
import WireJSON

/// `ctl reset-fleet-history` against a daemon with no fleet session (the reset itself:
/// `FleetAttackTests.resetFleetHistory`, on real etcd).
@Suite("ctl reset-fleet-history outside a fleet")
struct FleetResetCommandTests {
    @Test("ctl reset-fleet-history on a session that is not a fleet session: exit 1 and says so; on no session: exit 1, no such session; no operand: usage, exit 64")
    func notAFleetSession() async throws {
        try await withBroker { broker in
            let plain = try await broker.ctl(["reset-fleet-history", "api"])
            #expect(plain.code == 1 && plain.err == "Error: 'api' is not a fleet session (Fleet=yes): it has no fleet history\n", "\(plain)")
            let none = try await broker.ctl(["reset-fleet-history", "nope"])
            #expect(none.code == 1 && none.err.contains("no session named 'nope'"), "\(none)")
            let usage = try await broker.ctl(["reset-fleet-history"])
            #expect(usage.code == 64 && usage.err.hasPrefix("Error: reset-fleet-history needs exactly one SESSION"), "\(usage)")
            #expect(try broker.call("GetToken", ["session": "api"]).error == nil)
        }
    }
}
