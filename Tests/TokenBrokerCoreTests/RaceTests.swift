import Synchronization
import Testing
import TestSupport
import TokenBrokerCore

/// The race suite of the refresh coordinator. Every interleaving is driven by the test: fetches
/// park until released, store writes park until released, and the test waits for states
/// ("fetch 1 started", "k callers parked") — never for time. Each race repeats
/// `TB_RACE_ITERATIONS` times (default 500), varying the point at which the test lets go.
/// Each test is titled by the README guarantee (G1–G7) it proves.
@Suite("Race suite")
struct RaceTests {
    static let old = Harness.firstToken

    // MARK: 1

    @Test("G1 one flight: concurrent recovers with the same old token cause one fetch", arguments: [20, 1000])
    func concurrentRecoversShareOneFetch(callers: Int) async throws {
        let iterations = raceIterations()
        for iteration in 0..<iterations {
            let h = Harness()
            let racers = Racers(callers) { _ in try await h.coordinator.recover(rejected: Self.old) }
            try await h.source.started(1)
            // Vary how many callers are parked on the flight when it lands; the rest arrive
            // after the new token is installed and must be answered as stale rejections.
            let parkedBeforeRelease = 1 + (iteration * 7919) % callers
            try await eventually("\(parkedBeforeRelease) parked") { h.coordinator.parkedWaiters >= parkedBeforeRelease }
            h.source.succeed(1, with: FakeTokenSource.token(2))
            let results = try await racers.all()

            try #require(results.allSatisfy { $0.value?.serial == 2 }, "iteration \(iteration)")
            try #require(h.source.fetchCount == 1, "iteration \(iteration)")
            let counters = await h.coordinator.status().counters
            try #require(counters.fetches == 1)
            try #require(counters.joinedWaiters + counters.staleRejections == callers - 1)
            try #require(await h.stored()?.refreshToken == Secret("refresh-2"))
        }
    }

    // MARK: 2

    @Test("G2 stale rejections: a rejection of the old token arriving late never causes a second fetch")
    func lateRejectionDoesNotRefresh() async throws {
        for iteration in 0..<raceIterations() {
            let h = Harness()
            let first = Racers(1) { _ in try await h.coordinator.recover(rejected: Self.old) }
            try await h.source.started(1)
            let late: Racers<IssuedToken>
            switch iteration % 3 {
            case 0: // while the fetch is under way: joins it
                late = Racers(1) { _ in try await h.coordinator.recover(rejected: Self.old) }
                try await eventually("2 parked") { h.coordinator.parkedWaiters == 2 }
                h.source.succeed(1, with: FakeTokenSource.token(2))
            case 1: // while the new token is being committed: still joins the flight
                h.store.hold()
                h.source.succeed(1, with: FakeTokenSource.token(2))
                try await eventually("commit parked") { h.store.heldCount == 1 }
                late = Racers(1) { _ in try await h.coordinator.recover(rejected: Self.old) }
                try await eventually("2 parked") { h.coordinator.parkedWaiters == 2 }
                h.store.release()
            default: // after the new token is installed: answered at once
                h.source.succeed(1, with: FakeTokenSource.token(2))
                _ = try await first.all()
                late = Racers(1) { _ in try await h.coordinator.recover(rejected: Self.old) }
            }
            let results = try await first.all() + late.all()
            try #require(results.allSatisfy { $0.value?.serial == 2 }, "iteration \(iteration)")
            try #require(h.source.fetchCount == 1, "iteration \(iteration)")
            if iteration % 3 == 2 { try #require(await h.coordinator.status().counters.staleRejections == 1) }
        }
        // And long after: a rejection of token #1 while #2 is current still fetches nothing.
        let h = Harness()
        let first = Racers(1) { _ in try await h.coordinator.recover(rejected: Self.old) }
        try await h.source.started(1)
        h.source.succeed(1, with: FakeTokenSource.token(2))
        _ = try await first.all()
        h.clock.advance(by: .seconds(1800))
        #expect(try await h.coordinator.recover(rejected: Self.old).serial == 2)
        #expect(h.source.fetchCount == 1)
    }

    @Test("G7 durable rotation: the new token is committed before any waiter sees it")
    func commitBeforeDelivery() async throws {
        for iteration in 0..<raceIterations(100) {
            let h = Harness()
            let racers = Racers(10) { _ in try await h.coordinator.recover(rejected: Self.old) }
            try await h.source.started(1)
            h.store.hold()
            h.source.succeed(1, with: FakeTokenSource.token(2))
            try await eventually("commit parked") { h.store.heldCount == 1 }
            // While the write is parked, nobody has the new token: not the waiters, not the hot path.
            try #require(racers.finished == 0, "iteration \(iteration)")
            try #require(h.coordinator.freshToken()?.serial == 1)
            try #require(await h.stored()?.refreshToken == Secret("refresh-1"))
            h.store.release()
            let results = try await racers.all()
            try #require(results.allSatisfy { $0.value?.serial == 2 })
            try #require(await h.stored()?.refreshToken == Secret("refresh-2"))
        }
    }

    // MARK: 3

    @Test("G5 shared failure: a failed fetch reaches every waiter; backoff fails fast; then exactly one new fetch")
    func failureIsShared() async throws {
        let policy = RefreshPolicy(backoff: Backoff(initial: .seconds(10), maximum: .seconds(60), jitter: 0.2))
        let callers = 20
        for iteration in 0..<raceIterations() {
            let h = Harness(policy: policy)
            let racers = Racers(callers) { _ in try await h.coordinator.recover(rejected: Self.old) }
            try await h.source.started(1)
            let parked = 1 + iteration % callers
            try await eventually("\(parked) parked") { h.coordinator.parkedWaiters >= parked }
            h.source.fail(1, with: FetchFailure.transient("HTTP 503"))
            let results = try await racers.all()

            // The ones parked get the failure; any that arrived after it are in the backoff and fail fast
            // with what is left of it. Nobody fetched on their own.
            for result in results {
                guard case let .refreshFailed(reason, retryable, retryAfter)? = result.error as? SessionError else {
                    Issue.record("iteration \(iteration): expected refreshFailed, got \(result)")
                    return
                }
                try #require(reason == "HTTP 503" && retryable && retryAfter == .seconds(10))
            }
            try #require(h.source.fetchCount == 1)
            let status = await h.coordinator.status()
            try #require(!status.refreshing && status.counters.failures == 1 && status.backoffRemaining == .seconds(10))

            // During the backoff: fail fast, zero fetches.
            h.clock.advance(by: .seconds(4))
            let fast = try await Racers(callers) { _ in try await h.coordinator.recover(rejected: Self.old) }.all()
            try #require(fast.allSatisfy {
                $0.error as? SessionError == .refreshFailed(reason: "HTTP 503", retryable: true, retryAfter: .seconds(6))
            })
            try #require(h.source.fetchCount == 1)

            // After it: the next demands make exactly one fetch.
            h.clock.advance(by: .seconds(6))
            let again = Racers(callers) { _ in try await h.coordinator.recover(rejected: Self.old) }
            try await h.source.started(2)
            h.source.succeed(2, with: FakeTokenSource.token(2))
            try #require(try await again.all().allSatisfy { $0.value?.serial == 2 })
            try #require(h.source.fetchCount == 2)
        }
    }

    // MARK: 4

    @Test("G6 local cancellation: a cancelled waiter leaves at once; the others still succeed from the one fetch")
    func cancelledWaiterLeaves() async throws {
        let callers = 20
        for iteration in 0..<raceIterations() {
            let h = Harness()
            let racers = Racers(callers) { _ in try await h.coordinator.recover(rejected: Self.old) }
            try await h.source.started(1)
            // Cancel one caller (sometimes the one that started the flight), sometimes before
            // it has parked.
            let parked = 1 + (iteration * 13) % callers
            try await eventually("\(parked) parked") { h.coordinator.parkedWaiters >= parked }
            let victim = iteration % callers
            racers.cancel(victim)
            try await eventually("the cancelled caller to leave") { racers.result(victim) != nil }
            try #require(racers.result(victim)?.error is CancellationError, "iteration \(iteration)")
            // It left while the fetch is still parked.
            try #require(await h.coordinator.status().refreshing)

            h.source.succeed(1, with: FakeTokenSource.token(2))
            let results = try await racers.all()
            for (index, result) in results.enumerated() where index != victim {
                try #require(result.value?.serial == 2, "iteration \(iteration), caller \(index)")
            }
            try #require(h.source.fetchCount == 1)
        }
    }

    @Test("G6 local cancellation: when every waiter leaves, the flight still lands and installs its token")
    func flightOutlivesItsWaiters() async throws {
        let h = Harness()
        let racers = Racers(5) { _ in try await h.coordinator.recover(rejected: Self.old) }
        try await h.source.started(1)
        try await eventually("5 parked") { h.coordinator.parkedWaiters == 5 }
        for index in 0..<5 { racers.cancel(index) }
        let results = try await racers.all()
        #expect(results.allSatisfy { $0.error is CancellationError })
        h.source.succeed(1, with: FakeTokenSource.token(2))
        try await eventually("token #2 installed") { h.coordinator.freshToken()?.serial == 2 }
        #expect(try await h.coordinator.token().serial == 2)
        #expect(h.source.fetchCount == 1)
    }

    // MARK: 5

    @Test("G3 logout boundary: logout during the flight; the late success installs nothing, anywhere")
    func logoutDuringFlight() async throws {
        for iteration in 0..<raceIterations() {
            let h = Harness()
            let events = await h.coordinator.watch()
            let racers = Racers(20) { _ in try await h.coordinator.recover(rejected: Self.old) }
            try await h.source.started(1)
            let parked = 1 + iteration % 20
            try await eventually("\(parked) parked") { h.coordinator.parkedWaiters >= parked }

            switch iteration % 3 {
            case 0: // logout while the fetch is out; it then returns success (ignoring cancellation)
                try await h.coordinator.logout()
                h.source.succeed(1, with: FakeTokenSource.token(2))
            case 1: // logout while the token's commit is parked; the commit lands first, then the logout
                h.store.hold()
                h.source.succeed(1, with: FakeTokenSource.token(2))
                try await eventually("commit parked") { h.store.heldCount == 1 }
                let logout = Racers(1) { _ in try await h.coordinator.logout() }
                try await eventually("logout write parked") { h.store.heldCount == 2 }
                h.store.releaseOne(newest: false)
                try await eventually("commit done") { h.store.completedCount == 1 }
                h.store.release()
                _ = try await logout.all().map { try $0.get() }
            default: // the same, but the logout's write lands before the late commit
                h.store.hold()
                h.source.succeed(1, with: FakeTokenSource.token(2))
                try await eventually("commit parked") { h.store.heldCount == 1 }
                let logout = Racers(1) { _ in try await h.coordinator.logout() }
                try await eventually("logout write parked") { h.store.heldCount == 2 }
                h.store.releaseOne(newest: true)
                _ = try await logout.all().map { try $0.get() }
                h.store.release()
            }
            try await eventually("the late answer dropped") { await h.coordinator.status().counters.droppedResults == 1 }
            // The dropped answer is handed over (the daemon revokes it), never installed.
            try #require(h.discarded.all == [Secret("access-2")])

            let results = try await racers.all()
            try #require(results.allSatisfy { $0.error as? SessionError == .signedOut }, "iteration \(iteration)")
            let status = await h.coordinator.status()
            try #require(status.state == .signedOut && status.generation == 2 && status.tokenSerial == nil)
            let stored = try #require(await h.stored())
            try #require(stored.state == .signedOut && stored.generation == 2)
            try #require(stored.accessToken == nil && stored.refreshToken == nil)
            try #require(h.coordinator.freshToken() == nil)

            // After the logout: fail at once, fetch nothing.
            await #expect(throws: SessionError.signedOut) { try await h.coordinator.token() }
            await #expect(throws: SessionError.signedOut) { try await h.coordinator.recover(rejected: Self.old) }
            try #require(h.source.fetchCount == 1)

            // Watchers saw token #1, then the logout, and never token #2.
            await h.coordinator.shutdown()
            var seen: [SessionEvent] = []
            for await event in events { seen.append(event) }
            try #require(seen.count == 2, "iteration \(iteration): \(seen)")
            try #require(seen.last == .signedOut(generation: 2))
        }
    }

    // MARK: 6

    @Test("G4 one refresh, one retry: the freshly fetched token rejected again; the policy hands the 401 back, no second refresh")
    func rejectedAgainGoesBack() async throws {
        let h = Harness()
        let sent = Mutex<[Secret]>([])
        let request = Racers(1) { _ in
            try await AuthRetryPolicy.perform(
                token: Self.old, replay: .replayable,
                send: { token in
                    sent.withLock { $0.append(token) }
                    return (status: 401, wwwAuthenticate: [#"Bearer realm="api", error="invalid_token""#])
                },
                inspect: { $0 },
                recover: { rejected in try await h.coordinator.recover(rejected: rejected).token })
        }
        try await h.source.started(1)
        h.source.succeed(1, with: FakeTokenSource.token(2))
        let response = try #require(try await request.all().first?.get())
        #expect(response.status == 401)
        #expect(sent.withLock { $0 } == [Self.old, Secret("access-2")])
        #expect(h.source.fetchCount == 1)
        #expect(await h.coordinator.status().counters.fetches == 1)
    }

    // MARK: 7

    @Test("G5 shared failure: a terminal failure ends the session for every waiter until the next login")
    func terminalFailure() async throws {
        let h = Harness()
        let events = await h.coordinator.watch()
        let racers = Racers(20) { _ in try await h.coordinator.recover(rejected: Self.old) }
        try await h.source.started(1)
        try await eventually("20 parked") { h.coordinator.parkedWaiters == 20 }
        h.source.fail(1, with: FetchFailure.deadGrant)
        let ended = SessionError.refreshFailed(reason: "invalid_grant", retryable: false, retryAfter: nil)
        #expect(try await racers.all().allSatisfy { $0.error as? SessionError == ended })

        #expect(await h.coordinator.status().state == .ended)
        await #expect(throws: ended) { try await h.coordinator.token() }
        #expect(h.source.fetchCount == 1)
        try await eventually("the end persisted") { await h.stored()?.state == .ended }
        let stored = try #require(await h.stored())
        #expect(stored.refreshToken == nil && stored.accessToken == nil && stored.endReason == "invalid_grant")

        // A new login starts over at a higher generation with the new credential.
        #expect(try await h.coordinator.login(refreshToken: Secret("refresh-new")) == 2)
        let next = Racers(1) { _ in try await h.coordinator.token() }
        try await h.source.started(2)
        #expect(h.source.request(2).refreshToken == Secret("refresh-new"))
        #expect(h.source.request(2).generation == 2)
        h.source.succeed(2, with: FakeTokenSource.token(2))
        #expect(try await next.all().first?.value?.generation == 2)

        await h.coordinator.shutdown()
        var seen: [SessionEvent] = []
        for await event in events { seen.append(event) }
        #expect(seen.map(\.kind) == ["token", "signedOut", "token"])
    }

    @Test("G5 shared failure: a transient failure keeps the session and honours the server's Retry-After")
    func transientFailure() async throws {
        let h = Harness(policy: RefreshPolicy(backoff: Backoff(initial: .seconds(1), maximum: .seconds(60), jitter: 0)))
        let racers = Racers(3) { _ in try await h.coordinator.recover(rejected: Self.old) }
        try await h.source.started(1)
        h.source.fail(1, with: FetchFailure.transient("HTTP 429", retryAfter: .seconds(120)))
        let results = try await racers.all()
        #expect(results.allSatisfy {
            $0.error as? SessionError == .refreshFailed(reason: "HTTP 429", retryable: true, retryAfter: .seconds(120))
        })
        let status = await h.coordinator.status()
        #expect(status.state == .active && status.backoffRemaining == .seconds(120) && status.lastError == "HTTP 429")
        // The credential is kept: the next fetch (after the backoff) sends the same refresh token.
        h.clock.advance(by: .seconds(120))
        let again = Racers(1) { _ in try await h.coordinator.recover(rejected: Self.old) }
        try await h.source.started(2)
        #expect(h.source.request(2).refreshToken == Secret("refresh-1"))
        // An error the source did not classify counts as transient; consecutive failures grow the backoff.
        struct Weird: Error {}
        h.source.fail(2, with: Weird())
        let error = try await again.all().first?.error as? SessionError
        #expect(error == .refreshFailed(reason: "unexpected error (Weird)", retryable: true, retryAfter: .seconds(2)))
        #expect(await h.coordinator.status().state == .active)
    }

    // MARK: 8

    @Test("G4 refresh cap: the refresh guard caps fetches per sliding window (the burst, plus the one refresh per window that hour-long tokens need)")
    func refreshGuard() async throws {
        let h = Harness(policy: RefreshPolicy(refreshAhead: .zero, guardLimit: 3, guardWindow: .seconds(60)))
        var current = Self.old
        for n in 1...4 {
            let racer = Racers(1) { [current] _ in try await h.coordinator.recover(rejected: current) }
            try await h.source.started(n)
            h.source.succeed(n, with: FakeTokenSource.token(n + 1))
            current = try #require(try await racer.all().first?.get().token)
            h.clock.advance(by: .seconds(10))
        }
        // t = 40 s: four fetches since t = 0 (3 + 1); the oldest leaves the window at t = 60 s.
        // (A broken guard starts a fifth fetch, which nobody answers: the deadline fails it.)
        let throttled = Racers(1) { [current] _ in try await h.coordinator.recover(rejected: current) }
        #expect(try await throttled.all().first?.error as? SessionError == .throttled(retryAfter: .seconds(20)))
        #expect(h.source.fetchCount == 4)
        #expect(await h.coordinator.status().counters.throttled == 1)
        // A valid token is still handed out while throttled.
        #expect(try await h.coordinator.token().serial == 5)

        h.clock.advance(by: .seconds(20))
        let racer = Racers(1) { [current] _ in try await h.coordinator.recover(rejected: current) }
        try await h.source.started(5)
        h.source.succeed(5, with: FakeTokenSource.token(6))
        #expect(try await racer.all().first?.value?.serial == 6)
    }

    @Test("G1 one flight with a minimum validity: 50 callers that need the token for 10 minutes more, while it has 5, cause one refresh and all get its token; a lifetime shorter than asked is said at once, with no refresh loop (issue 33)")
    func minimumValidity() async throws {
        let h = Harness(policy: RefreshPolicy(refreshAhead: .zero), expiresIn: 300)
        #expect(h.coordinator.freshToken(validFor: .seconds(600)) == nil && h.coordinator.freshToken(validFor: .seconds(200))?.serial == 1)
        #expect(try await h.coordinator.token(validFor: .seconds(200)).serial == 1 && h.source.fetchCount == 0)
        let callers = Racers(50) { n in try await h.coordinator.token(validFor: .seconds(600), by: Demander(uid: UInt32(1000 + n % 3))) }
        try await h.source.started(1)
        try await eventually("50 parked") { h.coordinator.parkedWaiters == 50 }
        h.source.succeed(1, with: FakeTokenSource.token(2, expiresIn: .seconds(3600)))
        let answers = try await callers.all()
        #expect(answers.allSatisfy { $0.value?.serial == 2 } && h.source.fetchCount == 1)
        #expect(h.coordinator.freshToken(validFor: .seconds(600))?.serial == 2)

        // The issuer's tokens now live 300 s: the refresh for 3000 s gives one too short, and
        // says so; the next demand says so without another refresh.
        h.clock.advance(by: .seconds(700))
        let first = Racers(1) { _ in try await h.coordinator.token(validFor: .seconds(3000)) }
        try await h.source.started(2)
        h.source.succeed(2, with: FakeTokenSource.token(3, expiresIn: .seconds(300)))
        #expect(try await first.all().first?.error as? SessionError == .lifetimeTooShort(lifetime: .seconds(300), asked: .seconds(3000)))
        await #expect(throws: SessionError.lifetimeTooShort(lifetime: .seconds(300), asked: .seconds(3000))) {
            try await h.coordinator.token(validFor: .seconds(3000))
        }
        #expect(h.source.fetchCount == 2)
        #expect(try await h.coordinator.token(validFor: .seconds(200)).serial == 3, "what it can give is given")
    }

    @Test("G1 one flight: refresh-ahead is served at once, with one background refresh shared with reactive demands")
    func refreshAhead() async throws {
        let h = Harness(policy: RefreshPolicy(refreshAhead: .seconds(60)), expiresIn: 300)
        #expect(h.coordinator.freshToken()?.serial == 1)
        #expect(try await h.coordinator.token().serial == 1)
        #expect(h.source.fetchCount == 0)

        // Inside the window: everybody gets #1 at once; one background fetch starts.
        h.clock.advance(by: .seconds(250))
        #expect(h.coordinator.freshToken() == nil)
        let early = try await Racers(20) { _ in try await h.coordinator.token() }.all()
        #expect(early.allSatisfy { $0.value?.serial == 1 })
        try await h.source.started(1)
        #expect(h.source.fetchCount == 1)

        // A reactive demand (the server rejected #1) joins the same flight.
        let reactive = Racers(1) { _ in try await h.coordinator.recover(rejected: Self.old) }
        try await eventually("the recover parked") { h.coordinator.parkedWaiters == 1 }
        h.source.succeed(1, with: FakeTokenSource.token(2, expiresIn: .seconds(300)))
        #expect(try await reactive.all().first?.value?.serial == 2)
        try await eventually("#2 on the hot path") { h.coordinator.freshToken()?.serial == 2 }
        #expect(h.source.fetchCount == 1)
        #expect(await h.coordinator.status().counters.joinedWaiters == 1)

        // A failed background refresh fails nobody: #2 is still served, and no new fetch starts
        // during the backoff.
        h.clock.advance(by: .seconds(250))
        #expect(try await h.coordinator.token().serial == 2)
        try await h.source.started(2)
        h.source.fail(2, with: FetchFailure.transient("timeout"))
        try await eventually("the failure recorded") { await h.coordinator.status().counters.failures == 1 }
        #expect(try await h.coordinator.token().serial == 2)
        #expect(h.source.fetchCount == 2)
        h.clock.advance(by: .milliseconds(500))
        #expect(try await h.coordinator.token().serial == 2)
        #expect(h.source.fetchCount == 2)

        // Expired with no flight: the demand waits for a fetch.
        h.clock.advance(by: .seconds(60))
        let waiting = Racers(1) { _ in try await h.coordinator.token() }
        try await h.source.started(3)
        #expect(waiting.finished == 0)
        h.source.succeed(3, with: FakeTokenSource.token(3))
        #expect(try await waiting.all().first?.value?.serial == 3)
    }

    // MARK: 9

    @Test("G3 logout boundary: login after logout gives a higher generation, and the old flight can never install its token")
    func loginAfterLogout() async throws {
        for iteration in 0..<raceIterations() {
            let h = Harness()
            let waiter = Racers(1) { _ in try await h.coordinator.recover(rejected: Self.old) }
            try await h.source.started(1)
            try await h.coordinator.logout()
            let phase = iteration % 3
            if phase == 0 { h.source.succeed(1, with: FakeTokenSource.token(99)) }
            let generation = try await h.coordinator.login(refreshToken: Secret("refresh-L"))
            try #require(generation == 3)
            if phase == 1 { h.source.succeed(1, with: FakeTokenSource.token(99)) }
            let fresh = Racers(1) { _ in try await h.coordinator.token() }
            try await h.source.started(2)
            if phase == 2 { h.source.succeed(1, with: FakeTokenSource.token(99)) }
            try await eventually("the old answer dropped") { await h.coordinator.status().counters.droppedResults == 1 }

            // The new flight uses the new credential under the new generation.
            try #require(h.source.request(2).refreshToken == Secret("refresh-L") && h.source.request(2).generation == 3)
            try #require(h.coordinator.freshToken() == nil, "iteration \(iteration)")
            try #require(await h.stored()?.refreshToken == Secret("refresh-L"))
            h.source.succeed(2, with: FakeTokenSource.token(2))

            try #require(try await waiter.all().first?.error as? SessionError == .signedOut)
            let token = try #require(try await fresh.all().first?.get())
            try #require(token.generation == 3 && token.token == Secret("access-2"))
            let stored = try #require(await h.stored())
            try #require(stored.generation == 3 && stored.refreshToken == Secret("refresh-2"))
        }
    }
}

extension SessionEvent {
    var kind: String {
        switch self {
        case .token: return "token"
        case .signedOut: return "signedOut"
        }
    }
}
