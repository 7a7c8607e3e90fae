import Testing
import TokenBrokerCore

/// A derived session's redemption of its parent's refresh token (`Derivation=refresh`), in the
/// parent's state machine alone: one redemption of the refresh token at a time, its rotation
/// the parent's, its boundary the parent's, its failure not the parent's.
@Suite("RefreshStateMachine: derivations in the refresh-token lineage")
struct DerivationMachineTests {
    typealias Machine = RefreshStateMachine

    static func started(_ action: Machine.DerivationAction) -> (FetchRequest, FlightID)? {
        if case let .start(request, id) = action { return (request, id) }
        return nil
    }

    @Test("a derivation redeems the refresh token in a flight of the parent: the parent's refresh waits for it and the next derivation too, and none starts beside the parent's own refresh")
    func oneRedemptionAtATime() throws {
        var machine = RefreshStateMachineTests.active()
        let (request, id) = try #require(Self.started(machine.beginDerivation()))
        #expect(request.refreshToken == Secret("refresh-1") && request.generation == 1)
        #expect(machine.beginDerivation() == .waitForLineage(id), "a second derivation waits")
        #expect(machine.demand(.recover(rejected: Secret("access-1")), now: .zero) == .waitForLineage(id), "the parent's refresh waits")
        #expect(machine.demand(.get, now: .zero).isDelivery, "the parent's current token is still handed out")
        #expect(machine.derivationSucceeded(id, FetchedToken(accessToken: Secret("narrow-1"))) == .deliver)
        // Over: the parent's refresh starts, and a derivation waits for it in turn.
        let refresh = try #require(machine.demand(.recover(rejected: Secret("access-1")), now: .zero).startedFlight)
        #expect(machine.beginDerivation() == .waitForLineage(refresh.id))
        #expect(machine.counters.derivations == 1 && machine.counters.fetches == 1)
    }

    @Test("a rotated refresh token is the parent's, written before the derived token is handed out; the parent's access token is unchanged")
    func rotationIsTheParents() throws {
        var machine = RefreshStateMachineTests.active()
        let (_, id) = try #require(Self.started(machine.beginDerivation()))
        let landing = machine.derivationSucceeded(id, FetchedToken(accessToken: Secret("narrow-1"), refreshToken: Secret("refresh-2")))
        guard case let .commit(write) = landing else { Issue.record("no write: \(landing)"); return }
        #expect(write.guardedBy == .sameGeneration && write.record.refreshToken == Secret("refresh-2"))
        #expect(write.record.accessToken == Secret("access-1") && write.record.tokenSerial == 1, "the parent's token is kept")
        // Not yet installed: the lineage is still busy.
        #expect(machine.beginDerivation() == .waitForLineage(id))
        let finished = machine.derivationCommitted(id, .applied)
        #expect(finished?.error == nil && finished?.event == nil)
        #expect(machine.currentRefreshToken == Secret("refresh-2") && machine.publishable?.token.token == Secret("access-1"))
        let (next, _) = try #require(Self.started(machine.beginDerivation()))
        #expect(next.refreshToken == Secret("refresh-2"), "the next redemption presents the rotated token")
    }

    @Test("a failed write keeps the rotation in memory and pending; a rejected one (another writer's generation) signs the parent out")
    func writeOutcomes() throws {
        var degraded = RefreshStateMachineTests.active()
        let (_, id) = try #require(Self.started(degraded.beginDerivation()))
        _ = degraded.derivationSucceeded(id, FetchedToken(accessToken: Secret("narrow-1"), refreshToken: Secret("refresh-2")))
        #expect(degraded.derivationCommitted(id, .failed(reason: "disk full"))?.error == nil)
        #expect(degraded.currentRefreshToken == Secret("refresh-2") && degraded.pendingWrite?.record.refreshToken == Secret("refresh-2"))

        var rejected = RefreshStateMachineTests.active()
        let (_, other) = try #require(Self.started(rejected.beginDerivation()))
        _ = rejected.derivationSucceeded(other, FetchedToken(accessToken: Secret("narrow-1"), refreshToken: Secret("refresh-2")))
        let outcome = rejected.derivationCommitted(other, .rejected)
        #expect(outcome?.error == .signedOut && outcome?.event == .signedOut(generation: 2) && rejected.phase == .signedOut)
    }

    @Test("a boundary ends the derivation: its late answer is dropped, before or during its write")
    func boundaryEndsIt() throws {
        var machine = RefreshStateMachineTests.active()
        let (_, id) = try #require(Self.started(machine.beginDerivation()))
        let boundary = machine.logout()
        #expect(boundary.cancelled == id)
        #expect(machine.derivationSucceeded(id, FetchedToken(accessToken: Secret("narrow-1"), refreshToken: Secret("refresh-2"))) == .dropped)
        #expect(machine.beginDerivation() == .fail(.signedOut))

        var committing = RefreshStateMachineTests.active()
        let (_, flight) = try #require(Self.started(committing.beginDerivation()))
        _ = committing.derivationSucceeded(flight, FetchedToken(accessToken: Secret("narrow-1"), refreshToken: Secret("refresh-2")))
        _ = committing.logout()
        #expect(committing.derivationCommitted(flight, .applied) == nil && committing.currentRefreshToken == nil)
    }

    @Test("a refused derivation is the derived session's alone: no backoff, no end and no failure counted for the parent")
    func failureStaysLocal() throws {
        var machine = RefreshStateMachineTests.active()
        let (_, id) = try #require(Self.started(machine.beginDerivation()))
        let ended = machine.derivationFailed(id)
        #expect(ended)
        #expect(machine.phase == .active && machine.backoffUntil == nil && machine.counters.failures == 0)
        #expect(machine.currentRefreshToken == Secret("refresh-1"))
        let again = machine.derivationFailed(id)
        #expect(!again, "once")
        #expect(Self.started(machine.beginDerivation()) != nil)
    }

    @Test("no refresh token, no derivation; a signed-out or stopping parent refuses it")
    func refusals() throws {
        var empty = Machine(session: "api", policy: RefreshPolicy(), restored: nil, now: .zero, unixNow: RefreshStateMachineTests.unix)
        #expect(empty.beginDerivation() == .fail(.signedOut))
        let record = SessionRecord(name: "api", generation: 1, state: .active)
        var credentials = Machine(session: "api", policy: RefreshPolicy(), restored: record, now: .zero, unixNow: RefreshStateMachineTests.unix)
        guard case .fail(.refreshFailed(_, false, _)) = credentials.beginDerivation() else { Issue.record("derived without a refresh token"); return }
        var retiring = RefreshStateMachineTests.active()
        retiring.retire()
        #expect(retiring.beginDerivation() == .fail(.shuttingDown))
    }
}
