import Testing
import TokenBrokerCore
@testable import Fleet

/// What the holder of a flight does after its upstream request failed, decided by the state
/// machine from the failure's type (never from its words).
@Suite("Fleet: a failed flight")
struct FleetFlightDecisionTests {
    @Test("cancelled: left to lapse; a dead grant ends the session everywhere; any other terminal failure releases the flight; the rest back off, bounded (issue 34)")
    func decisions() {
        let lease = Duration.seconds(20)
        #expect(FleetStateMachine.afterFailedFlight(.deadGrant, cancelled: true, leaseLeft: lease)
                == .leaveToLapse(for: lease, reason: "the refresh was left to run out by a logout or login"))
        #expect(FleetStateMachine.afterFailedFlight(.transient("x"), cancelled: true, leaseLeft: .milliseconds(-5)) != .release)
        #expect(FleetStateMachine.afterFailedFlight(.deadGrant, cancelled: false, leaseLeft: lease) == .endEverywhere(reason: "invalid_grant"))
        #expect(FleetStateMachine.afterFailedFlight(.terminal("client configuration: invalid_client"), cancelled: false, leaseLeft: lease) == .release)
        // Typed: a terminal failure whose words happen to read invalid_grant is not a dead grant.
        #expect(FleetStateMachine.afterFailedFlight(.terminal("invalid_grant"), cancelled: false, leaseLeft: lease) == .release)
        #expect(FleetStateMachine.afterFailedFlight(.transient("HTTP 503", retryAfter: .seconds(7)), cancelled: false, leaseLeft: lease)
                == .backOff(for: .seconds(7), reason: "HTTP 503"))
        #expect(FleetStateMachine.afterFailedFlight(.refused("HTTP 400 without an OAuth error"), cancelled: false, leaseLeft: lease)
                == .backOff(for: .seconds(1), reason: "HTTP 400 without an OAuth error"))
        #expect(FleetStateMachine.afterFailedFlight(.transient("slow", retryAfter: .seconds(36_000)), cancelled: false, leaseLeft: lease)
                == .backOff(for: .seconds(3600), reason: "slow"))
    }
}
