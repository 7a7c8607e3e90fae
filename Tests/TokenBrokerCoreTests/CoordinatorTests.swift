import Testing
import TestSupport
import TokenBrokerCore

/// Coordinator behaviour outside the races: store faults, shutdown, watch, the hot path.
@Suite("RefreshCoordinator")
struct CoordinatorTests {
    @Test("a failed commit still serves the token, flags the session degraded, and is flushed later")
    func degraded() async throws {
        let h = Harness()
        h.store.setFailing(true)
        let racer = Racers(3) { _ in try await h.coordinator.recover(rejected: Harness.firstToken) }
        try await h.source.started(1)
        h.source.succeed(1, with: FakeTokenSource.token(2))
        #expect(try await racer.all().allSatisfy { $0.value?.serial == 2 })
        var status = await h.coordinator.status()
        #expect(status.degraded && status.lastError == "store: disk full")
        #expect(await h.stored()?.refreshToken == Secret("refresh-1"))

        #expect(await !h.coordinator.flushPendingWrite())
        h.store.setFailing(false)
        #expect(await h.coordinator.flushPendingWrite())
        status = await h.coordinator.status()
        #expect(!status.degraded)
        #expect(await h.stored()?.refreshToken == Secret("refresh-2"))
    }

    @Test("a logout that cannot be persisted is in effect, reported, and persisted by the next flush")
    func logoutStoreFailure() async throws {
        let h = Harness()
        h.store.setFailing(true)
        await #expect(throws: SessionError.storeFailed(reason: "disk full")) { try await h.coordinator.logout() }
        await #expect(throws: SessionError.signedOut) { try await h.coordinator.token() }
        #expect(await h.coordinator.status().degraded)
        h.store.setFailing(false)
        #expect(await h.coordinator.flushPendingWrite())
        let stored = try #require(await h.stored())
        #expect(stored.state == .signedOut && stored.generation == 2 && stored.refreshToken == nil)
    }

    @Test("shutdown fails parked callers and later demands, and ends watch streams")
    func shutdown() async throws {
        let h = Harness()
        let events = await h.coordinator.watch()
        let racers = Racers(5) { _ in try await h.coordinator.recover(rejected: Harness.firstToken) }
        try await h.source.started(1)
        try await eventually("5 parked") { h.coordinator.parkedWaiters == 5 }
        await h.coordinator.shutdown()
        #expect(try await racers.all().allSatisfy { $0.error as? SessionError == .shuttingDown })
        await #expect(throws: SessionError.shuttingDown) { try await h.coordinator.token() }
        #expect(h.coordinator.freshToken() == nil)
        var seen: [SessionEvent] = []
        for await event in events { seen.append(event) }
        #expect(seen.map(\.kind) == ["token"])
        // The late answer of the cancelled flight is dropped.
        h.source.succeed(1, with: FakeTokenSource.token(2))
        try await eventually("the late answer dropped") { await h.coordinator.status().counters.droppedResults == 1 }
    }

    @Test("watch starts with the current state, then sends each new token and the logout")
    func watch() async throws {
        let signedOut = Harness(loggedIn: false)
        var initial = await signedOut.coordinator.watch().makeAsyncIterator()
        #expect(await initial.next() == .signedOut(generation: 0))

        let h = Harness()
        let events = await h.coordinator.watch()
        let racer = Racers(1) { _ in try await h.coordinator.recover(rejected: Harness.firstToken) }
        try await h.source.started(1)
        h.source.succeed(1, with: FakeTokenSource.token(2))
        _ = try await racer.all()
        try await h.coordinator.logout()
        await h.coordinator.shutdown()
        var serials: [String] = []
        for await event in events {
            switch event {
            case let .token(token): serials.append("#\(token.serial)")
            case let .signedOut(generation): serials.append("signedOut@\(generation)")
            }
        }
        #expect(serials == ["#1", "#2", "signedOut@2"])
    }

    @Test("the hot path serves a valid token without the actor, and stops at the refresh-ahead window")
    func hotPath() async throws {
        let h = Harness(policy: RefreshPolicy(refreshAhead: .seconds(60)), expiresIn: 600)
        #expect(h.coordinator.freshToken()?.serial == 1)
        h.clock.advance(by: .seconds(539))
        #expect(h.coordinator.freshToken()?.serial == 1)
        h.clock.advance(by: .seconds(1))
        #expect(h.coordinator.freshToken() == nil)
        #expect(Harness(loggedIn: false).coordinator.freshToken() == nil)
    }

    @Test("retire lets the flight under way land and commit, starts no new one, then shuts down")
    func retire() async throws {
        let h = Harness(policy: RefreshPolicy(refreshAhead: .zero))
        // A flight nobody waits for any more: its caller was cancelled.
        let orphan = Racers(1) { _ in try await h.coordinator.refresh() }
        try await h.source.started(1)
        try await eventually("parked") { h.coordinator.parkedWaiters == 1 }
        orphan.cancel(0)
        _ = try await orphan.all()
        let retiring = Racers(1) { _ in await h.coordinator.retire() }
        try await eventually("retiring") {
            // A demand that would need a new flight is refused; the current token is still served.
            (try? await h.coordinator.recover(rejected: Secret("other"))).map { $0.serial == 1 } == true
                && retiring.finished == 0
        }
        #expect(h.coordinator.freshToken()?.serial == 1)
        h.source.succeed(1, with: FakeTokenSource.token(2))
        _ = try await retiring.all()
        #expect(await h.stored()?.refreshToken == Secret("refresh-2"))
        #expect(h.source.fetchCount == 1)
        await #expect(throws: SessionError.shuttingDown) { try await h.coordinator.token() }
    }

    @Test("prefetch starts the due refresh without waiting for it, once; nothing when the token is fresh")
    func prefetch() async throws {
        let h = Harness(policy: RefreshPolicy(refreshAhead: .seconds(60)), expiresIn: 300)
        await h.coordinator.prefetch()
        #expect(h.source.fetchCount == 0)
        h.clock.advance(by: .seconds(250))
        await h.coordinator.prefetch()
        await h.coordinator.prefetch()
        try await h.source.started(1)
        #expect(h.source.fetchCount == 1 && h.coordinator.parkedWaiters == 0)
        let events = await h.coordinator.watch()
        #expect(h.coordinator.watcherCount == 1)
        h.source.succeed(1, with: FakeTokenSource.token(2))
        var iterator = events.makeAsyncIterator()
        #expect(await iterator.next() == .token(IssuedToken(token: Harness.firstToken, tokenType: "Bearer",
                                                            expiresAt: Int64(h.clock.unixStart) + 300, generation: 1, serial: 1)))
        guard case let .token(next)? = await iterator.next() else {
            Issue.record("expected the new token")
            return
        }
        #expect(next.serial == 2)
    }

    @Test("a forced refresh fetches even with a valid token, and joins a flight under way")
    func forcedRefresh() async throws {
        let h = Harness()
        let first = Racers(2) { _ in try await h.coordinator.refresh() }
        try await h.source.started(1)
        try await eventually("2 parked") { h.coordinator.parkedWaiters == 2 }
        h.source.succeed(1, with: FakeTokenSource.token(2))
        #expect(try await first.all().allSatisfy { $0.value?.serial == 2 })
        #expect(h.source.fetchCount == 1)
        try await h.coordinator.logout()
        await #expect(throws: SessionError.signedOut) { try await h.coordinator.refresh() }
    }

    @Test("login with no refresh token (client_credentials) fetches with none")
    func clientCredentials() async throws {
        let h = Harness(loggedIn: false)
        await #expect(throws: SessionError.signedOut) { try await h.coordinator.token() }
        #expect(try await h.coordinator.login(refreshToken: nil) == 1)
        let racer = Racers(1) { _ in try await h.coordinator.token() }
        try await h.source.started(1)
        #expect(h.source.request(1).refreshToken == nil && h.source.request(1).generation == 1)
        h.source.succeed(1, with: FakeTokenSource.token(1, rotate: false))
        #expect(try await racer.all().first?.value?.serial == 1)
        #expect(await h.stored()?.refreshToken == nil)
    }
}
