import Testing
import TokenBrokerCore

/// The state machine alone: no tasks, no clock, every event fed by hand.
@Suite("RefreshStateMachine")
struct RefreshStateMachineTests {
    typealias Machine = RefreshStateMachine
    static let unix = 1_800_000_000.0

    static func active(expiresIn: Int64 = 3600, policy: RefreshPolicy = RefreshPolicy()) -> Machine {
        let record = SessionRecord(name: "api", generation: 1, state: .active, refreshToken: Secret("refresh-1"),
                                   accessToken: Secret("access-1"), expiresAt: Int64(unix) + expiresIn, tokenSerial: 1)
        return Machine(session: "api", policy: policy, restored: record, now: .zero, unixNow: unix)
    }

    @Test("nothing stored: signed out at generation 0, demands fail at once")
    func empty() throws {
        var machine = Machine(session: "api", policy: RefreshPolicy(), restored: nil, now: .zero, unixNow: Self.unix)
        #expect(machine.phase == .signedOut && machine.generation == 0)
        #expect(machine.demand(.get, now: .zero) == .fail(.signedOut))
        #expect(machine.publishable == nil)
    }

    @Test("a restored token keeps its remaining lifetime on the monotonic line")
    func restoredExpiry() throws {
        var machine = Self.active(expiresIn: 100, policy: RefreshPolicy(refreshAhead: .zero))
        let published = try #require(machine.publishable)
        #expect(published.freshUntil == .seconds(100) && published.token.serial == 1)
        #expect(machine.demand(.get, now: .seconds(99)).isDelivery)
        #expect(machine.demand(.get, now: .seconds(100)).startedFlight != nil)
    }

    @Test("one flight: the second demand waits on the first's flight")
    func oneFlight() throws {
        var machine = Self.active()
        let first = machine.demand(.recover(rejected: Secret("access-1")), now: .zero)
        let (request, id) = try #require(first.startedFlight)
        #expect(request.refreshToken == Secret("refresh-1") && request.generation == 1)
        #expect(machine.demand(.recover(rejected: Secret("access-1")), now: .zero) == .wait(id))
        #expect(machine.counters.fetches == 1 && machine.counters.joinedWaiters == 1)
    }

    @Test("the fetched token is written before it is installed; rotation keeps the old refresh token when none comes")
    func commitThenInstall() throws {
        var machine = Self.active()
        let id = try #require(machine.demand(.recover(rejected: Secret("access-1")), now: .zero).startedFlight).id
        let fetched = FetchedToken(accessToken: Secret("access-2"), expiresIn: .seconds(60), refreshToken: nil)
        let step1 = machine.fetchSucceeded(id, fetched, now: .seconds(1), unixNow: Self.unix + 1)
        let write = try #require(step1)
        #expect(write.guardedBy == .sameGeneration && write.record.generation == 1)
        #expect(write.record.refreshToken == Secret("refresh-1") && write.record.accessToken == Secret("access-2"))
        #expect(write.record.expiresAt == Int64(Self.unix) + 61 && write.record.tokenSerial == 2)
        // Not installed yet: still token #1, and demands still join the flight.
        #expect(machine.publishable?.token.serial == 1)
        #expect(machine.demand(.recover(rejected: Secret("access-1")), now: .seconds(1)) == .wait(id))
        let step2 = machine.commitFinished(id, .applied)
        let resolution = try #require(step2)
        #expect(resolution.result.value?.serial == 2 && resolution.event == .token(resolution.result.value!))
        #expect(machine.publishable?.token.serial == 2 && !machine.isRefreshing)
    }

    @Test("logout drops the flight: its answer and its commit are refused")
    func boundary() throws {
        var machine = Self.active()
        let id = try #require(machine.demand(.get, now: .seconds(3600)).startedFlight).id
        let boundary = machine.logout()
        #expect(boundary.cancelled == id && boundary.error == .signedOut && boundary.event == .signedOut(generation: 2))
        #expect(boundary.write?.guardedBy == .newerGeneration && boundary.write?.record.state == .signedOut)
        #expect(boundary.write?.record.refreshToken == nil && boundary.write?.record.accessToken == nil)
        #expect(machine.fetchSucceeded(id, FetchedToken(accessToken: Secret("x")), now: .zero, unixNow: Self.unix) == nil)
        #expect(machine.counters.droppedResults == 1)
        #expect(machine.demand(.get, now: .zero) == .fail(.signedOut))
    }

    @Test("a logout during the commit wins over it")
    func logoutDuringCommit() throws {
        var machine = Self.active()
        let id = try #require(machine.demand(.get, now: .seconds(3600)).startedFlight).id
        let step3 = machine.fetchSucceeded(id, FetchedToken(accessToken: Secret("x")), now: .zero, unixNow: Self.unix)
        _ = try #require(step3)
        _ = machine.logout()
        #expect(machine.commitFinished(id, .applied) == nil)
        #expect(machine.publishable == nil && machine.phase == .signedOut)
    }

    @Test("login is not usable until its write is durable, and a later boundary overtakes it")
    func loginTwoPhase() throws {
        var machine = Self.active()
        let boundary = machine.beginLogin(refreshToken: Secret("refresh-L"))
        let write = try #require(boundary.write)
        #expect(write.record.generation == 2 && write.record.state == .active && write.guardedBy == .newerGeneration)
        #expect(machine.demand(.get, now: .zero) == .fail(.signedOut))
        #expect(machine.loginFinished(write, .applied) == .success(2))
        let request = try #require(machine.demand(.get, now: .zero).startedFlight).request
        #expect(request.refreshToken == Secret("refresh-L"))

        let step4 = machine.beginLogin(refreshToken: Secret("refresh-M")).write
        let second = try #require(step4)
        _ = machine.logout()
        #expect(machine.loginFinished(second, .applied) == .failure(.signedOut))
        #expect(machine.phase == .signedOut)
    }

    @Test("a DPoP key belongs to its generation: the login installs it, every refresh request carries it and its writes keep it, the issued token names it, a logout erases it, a restart restores it")
    func proofKeyLifecycle() throws {
        var machine = Self.active()
        let begun = machine.beginLogin(refreshToken: Secret("refresh-D"), proofKey: Secret("key-D")).write
        let login = try #require(begun)
        #expect(login.record.proofKey == Secret("key-D"))
        #expect(machine.loginFinished(login, .applied) == .success(2))
        let demanded = machine.demand(.get, now: .zero).startedFlight
        let (request, id) = try #require(demanded)
        #expect(request.proofKey == Secret("key-D") && request.refreshToken == Secret("refresh-D"))
        let fetched = FetchedToken(accessToken: Secret("access-D"), tokenType: "DPoP", refreshToken: Secret("refresh-E"))
        let written = machine.fetchSucceeded(id, fetched, now: .zero, unixNow: Self.unix)
        let write = try #require(written)
        #expect(write.record.proofKey == Secret("key-D") && write.record.tokenType == "DPoP")
        let committed = machine.commitFinished(id, .applied)
        let resolution = try #require(committed)
        #expect(resolution.result.value?.proofKey == Secret("key-D") && resolution.result.value?.tokenType == "DPoP")

        var restored = Machine(session: "api", policy: RefreshPolicy(), restored: write.record, now: .zero, unixNow: Self.unix)
        #expect(restored.publishable?.token.proofKey == Secret("key-D"))
        #expect(restored.demand(.refresh, now: .zero).startedFlight?.request.proofKey == Secret("key-D"))

        let logout = machine.logout()
        #expect(logout.write?.record.proofKey == nil && logout.write?.record.refreshToken == nil)
        let again = machine.beginLogin(refreshToken: Secret("refresh-F")).write
        let bearer = try #require(again)
        #expect(machine.loginFinished(bearer, .applied) == .success(4))
        #expect(machine.demand(.get, now: .zero).startedFlight?.request.proofKey == nil, "a new login without a key: none")
    }

    @Test("a failed login write leaves the session signed out and says why")
    func loginWriteFails() throws {
        var machine = Self.active()
        let step5 = machine.beginLogin(refreshToken: Secret("refresh-L")).write
        let write = try #require(step5)
        #expect(machine.loginFinished(write, .failed(reason: "disk full")) == .failure(.storeFailed(reason: "disk full")))
        #expect(machine.phase == .signedOut)
        // The old generation (still active on disk) must end there too: a signed-out write is pending.
        let pending = try #require(machine.pendingWrite)
        #expect(pending.record.generation == 2 && pending.record.state == .signedOut && pending.record.refreshToken == nil)
        #expect(pending.guardedBy == .newerGeneration && machine.status(now: .zero).degraded)
    }

    @Test("a failed commit serves from memory and keeps the write pending (degraded)")
    func degradedCommit() throws {
        var machine = Self.active()
        let id = try #require(machine.demand(.get, now: .seconds(3600)).startedFlight).id
        let step6 = machine.fetchSucceeded(id, FetchedToken(accessToken: Secret("access-2"), refreshToken: Secret("refresh-2")),
                                                now: .seconds(3600), unixNow: Self.unix)
        _ = try #require(step6)
        let step7 = machine.commitFinished(id, .failed(reason: "disk full"))
        let resolution = try #require(step7)
        #expect(resolution.result.value?.serial == 2)
        let pending = try #require(machine.pendingWrite)
        #expect(pending.record.refreshToken == Secret("refresh-2") && pending.guardedBy == .sameGeneration)
        #expect(machine.status(now: .zero).degraded)
        machine.pendingWriteSettled(pending)
        #expect(!machine.status(now: .zero).degraded)
    }

    @Test("a store holding another generation ends this one")
    func commitRejected() throws {
        var machine = Self.active()
        let id = try #require(machine.demand(.get, now: .seconds(3600)).startedFlight).id
        let step8 = machine.fetchSucceeded(id, FetchedToken(accessToken: Secret("x")), now: .zero, unixNow: Self.unix)
        _ = try #require(step8)
        let step9 = machine.commitFinished(id, .rejected)
        let resolution = try #require(step9)
        #expect(resolution.result == .failure(.signedOut) && machine.phase == .signedOut && machine.generation == 2)
    }

    @Test("consecutive transient failures grow the backoff; success resets it")
    func backoffGrows() throws {
        let policy = RefreshPolicy(guardLimit: 100, backoff: Backoff(initial: .seconds(1), maximum: .seconds(5), jitter: 0))
        var machine = Self.active(policy: policy)
        var now = Duration.seconds(3600)
        var delays: [Duration] = []
        for _ in 0..<5 {
            let id = try #require(machine.demand(.get, now: now).startedFlight).id
            let step10 = machine.fetchFailed(id, .transient("HTTP 500"), now: now, unit: 0)
            let resolution = try #require(step10)
            let retryAfter = try #require(resolution.result.error?.retryAfter)
            delays.append(retryAfter)
            now += retryAfter
        }
        #expect(delays == [.seconds(1), .seconds(2), .seconds(4), .seconds(5), .seconds(5)])
        let id = try #require(machine.demand(.get, now: now).startedFlight).id
        _ = machine.fetchSucceeded(id, FetchedToken(accessToken: Secret("a"), expiresIn: .seconds(1)), now: now, unixNow: Self.unix)
        _ = machine.commitFinished(id, .applied)
        now += .seconds(2)
        let id2 = try #require(machine.demand(.get, now: now).startedFlight).id
        let step11 = machine.fetchFailed(id2, .transient("HTTP 500"), now: now, unit: 0)
        let resolution = try #require(step11)
        #expect(resolution.result.error == .refreshFailed(reason: "HTTP 500", retryable: true, retryAfter: .seconds(1)))
    }

    @Test("refusals without a reason end the session after refusalLimit in a row (transient failures between do not reset the count; a success does)")
    func refusalsEndTheSession() throws {
        let policy = RefreshPolicy(guardLimit: 100, backoff: Backoff(initial: .seconds(1), maximum: .seconds(1), jitter: 0), refusalLimit: 3)
        var machine = Self.active(policy: policy)
        var now = Duration.seconds(3600)
        func fail(_ failure: FetchFailure) throws -> RefreshStateMachine.Resolution {
            let id = try #require(machine.demand(.get, now: now).startedFlight).id
            let step = machine.fetchFailed(id, failure, now: now, unit: 0)
            now += .seconds(1)
            return try #require(step)
        }
        func retryable(_ resolution: RefreshStateMachine.Resolution) -> Bool {
            if case let .refreshFailed(_, retryable, _)? = resolution.result.error { return retryable }
            return false
        }
        // Refused, refused, then a success: the count starts again.
        for _ in 0..<2 { #expect(retryable(try fail(.refused("HTTP 400 without an OAuth error")))) }
        let id = try #require(machine.demand(.get, now: now).startedFlight).id
        _ = machine.fetchSucceeded(id, FetchedToken(accessToken: Secret("a"), expiresIn: .seconds(1)), now: now, unixNow: Self.unix)
        _ = machine.commitFinished(id, .applied)
        now += .seconds(2)
        // Refused, a network failure, refused: still active; the third refusal ends it.
        #expect(retryable(try fail(.refused("HTTP 400 without an OAuth error"))))
        #expect(retryable(try fail(.transient("transport: connection refused"))))
        #expect(retryable(try fail(.refused("HTTP 400 without an OAuth error"))))
        #expect(machine.phase == .active)
        let last = try fail(.refused("HTTP 400 without an OAuth error"))
        guard case let .refreshFailed(reason, retryable, _)? = last.result.error, case let .ended(ended) = machine.phase else {
            Issue.record("the session should have ended: \(machine.phase)")
            return
        }
        #expect(!retryable && reason == ended && reason.hasPrefix("HTTP 400 without an OAuth error, 3 times in a row") && reason.contains("ctl login"))
        #expect(last.write != nil, "the end is stored")
        #expect(machine.demand(.get, now: now) == .fail(.refreshFailed(reason: reason, retryable: false, retryAfter: nil)))
    }

    @Test("a session without a refresh token (client_credentials) is never ended by refusals: nothing of it can be dead")
    func refusalsWithoutRefreshToken() throws {
        let record = SessionRecord(name: "cc", generation: 1, state: .active, refreshToken: nil,
                                   accessToken: Secret("access-1"), expiresAt: Int64(Self.unix) + 10, tokenSerial: 1)
        let policy = RefreshPolicy(guardLimit: 100, backoff: Backoff(initial: .seconds(1), maximum: .seconds(1), jitter: 0), refusalLimit: 3)
        var machine = Machine(session: "cc", policy: policy, restored: record, now: .zero, unixNow: Self.unix)
        var now = Duration.seconds(20)
        for _ in 0..<5 {
            let id = try #require(machine.demand(.get, now: now).startedFlight).id
            _ = machine.fetchFailed(id, .refused("HTTP 401 without an OAuth error"), now: now, unit: 0)
            now += .seconds(2)
        }
        #expect(machine.phase == .active)
    }

    @Test("refresh-ahead opens no earlier than half-way through a token's life; the guard allows what the lifetime needs, and refresh-ahead never spends the last half of the burst beyond it")
    func refreshAheadBounded() throws {
        // Tokens that live 20 s against RefreshAhead=60s: without the bound, every demand would
        // start a refresh. The window opens half-way, so expiry needs 600 s / 10 s = 60 refreshes
        // per 600 s window; the guard allows those plus the burst of 4.
        let policy = RefreshPolicy(refreshAhead: .seconds(60), guardLimit: 4, guardWindow: .seconds(600))
        var machine = Self.active(expiresIn: 20, policy: policy)
        #expect(machine.publishable?.freshUntil == .seconds(10))
        #expect(machine.demand(.get, now: .seconds(9)) == .deliver(try #require(machine.publishable).token))
        #expect(machine.expiryRefreshes == 60)
        var now = Duration.seconds(10)
        // Two windows' worth of refreshes ahead of expiry, at the tokens' own pace: none is refused.
        for n in 1...130 {
            guard case let .deliverAndStart(_, _, id) = machine.demand(.get, now: now) else {
                Issue.record("refresh-ahead \(n) did not start")
                return
            }
            _ = machine.fetchSucceeded(id, FetchedToken(accessToken: Secret("a\(n)"), expiresIn: .seconds(20)), now: now, unixNow: Self.unix)
            _ = machine.commitFinished(id, .applied)
            #expect(machine.publishable?.freshUntil == now + .seconds(10), "the window of a new 20 s token opens 10 s after it came")
            now += .seconds(10)
        }

        // A storm of needless refreshes (rejections of the current token) at one instant, on a
        // fresh machine: 60 + 2 of them leave refresh-ahead no budget, but the refresh the session
        // cannot do without still has some; 60 + 4 are all the guard allows.
        func storm(_ count: Int) -> Machine {
            var machine = Self.active(expiresIn: 20, policy: policy)
            for n in 0..<count {
                let current = machine.publishable!.token.token
                guard case let .startAndWait(_, id) = machine.demand(.recover(rejected: current), now: .zero) else {
                    Issue.record("storm refresh \(n) refused")
                    return machine
                }
                _ = machine.fetchSucceeded(id, FetchedToken(accessToken: Secret("s\(n)"), expiresIn: .seconds(20)), now: .zero, unixNow: Self.unix)
                _ = machine.commitFinished(id, .applied)
            }
            return machine
        }
        var spent = storm(61)
        guard case .deliverAndStart = spent.demand(.get, now: .seconds(10)) else {
            Issue.record("61 of 62 spent: one refresh ahead was left")
            return
        }
        spent = storm(62)
        #expect(spent.demand(.get, now: .seconds(10)).isDelivery, "inside the window, 62 spent: served, no refresh")
        #expect(spent.demand(.get, now: .seconds(20)).startedFlight != nil, "expired: the mandatory refresh still has budget")
        spent = storm(64)
        let current = spent.publishable!.token.token
        #expect(spent.demand(.recover(rejected: current), now: .zero) == .fail(.throttled(retryAfter: .seconds(600))))
    }

    @Test("one worker's Recovers of the current token spend its share alone: it is throttled, another worker's genuine Recover and an expiry still refresh, a stale rejection still costs nothing (issue 32)")
    func fairBudget() throws {
        var machine = Self.active()
        let hog = Demander(uid: 1001), victim = Demander(uid: 1002)
        func land(_ action: Machine.DemandAction, _ n: Int) throws {
            let id = try #require(action.startedFlight, "refresh \(n) refused: \(action)").id
            _ = machine.fetchSucceeded(id, FetchedToken(accessToken: Secret("a\(n)"), expiresIn: .seconds(3600)), now: .zero, unixNow: Self.unix)
            _ = machine.commitFinished(id, .applied)
        }
        for n in 0..<5 { try land(machine.demand(.recover(rejected: machine.publishable!.token.token), now: .seconds(n), by: hog), n) }
        var current = machine.publishable!.token.token
        let refused = machine.demand(.recover(rejected: current), now: .seconds(6), by: hog)
        #expect(refused == .fail(.throttled(retryAfter: .seconds(54))))
        #expect(machine.hasSpentShare(hog, now: .seconds(6)) && machine.status(now: .seconds(6)).throttled == [hog])
        #expect(machine.demand(.recover(rejected: Secret("a0")), now: .seconds(6), by: hog).isDelivery, "a stale rejection is answered, throttled or not")
        try land(machine.demand(.recover(rejected: current), now: .seconds(6), by: victim), 5)
        current = machine.publishable!.token.token
        #expect(machine.demand(.recover(rejected: current), now: .seconds(7), by: hog) == .fail(.throttled(retryAfter: .seconds(53))))
        #expect(machine.status(now: .seconds(60)).throttled.isEmpty, "the share comes back as the window slides")
        // Callers that spend the whole callers' budget (and the newcomers' reserve) cannot
        // deny the session the refresh its token's expiry needs (the review's three uids).
        for (n, uid) in (6..<20).enumerated().map({ ($0.element, UInt32(2000 + $0.offset)) }) {
            guard case let .startAndWait(_, id) = machine.demand(.recover(rejected: machine.publishable!.token.token), now: .seconds(8), by: Demander(uid: uid))
            else { break }
            _ = machine.fetchSucceeded(id, FetchedToken(accessToken: Secret("b\(n)"), expiresIn: .seconds(30)), now: .seconds(8), unixNow: Self.unix)
            _ = machine.commitFinished(id, .applied)
        }
        #expect(machine.demand(.recover(rejected: machine.publishable!.token.token), now: .seconds(8), by: Demander(uid: 3000)).startedFlight == nil,
                "the callers' budget is spent")
        #expect(machine.demand(.get, now: .seconds(40)).startedFlight != nil, "expiry still refreshes")
    }

    @Test("a token that ended before its commit finished is installed (its refresh token is the session's) but handed to nobody: the waiters get a retryable failure saying so (review of issue 32)")
    func deadOnArrival() throws {
        var machine = Self.active()
        let id = try #require(machine.demand(.recover(rejected: Secret("access-1")), now: .zero).startedFlight).id
        _ = machine.fetchSucceeded(id, FetchedToken(accessToken: Secret("dead"), expiresIn: .seconds(1), refreshToken: Secret("refresh-2")),
                                   now: .zero, unixNow: Self.unix)
        let committed = machine.commitFinished(id, .applied, now: .seconds(2))
        guard let resolution = committed, case let .failure(.refreshFailed(reason, retryable, _)) = resolution.result else {
            Issue.record("the dead token was handed out")
            return
        }
        #expect(retryable && reason.contains("had ended when its answer arrived") && resolution.event == nil)
        #expect(machine.currentRefreshToken == Secret("refresh-2"), "the rotation is kept")
        #expect(machine.demand(.get, now: .seconds(2)).startedFlight != nil, "the next demand refreshes")
    }

    @Test("shutdown fails the flight's waiters and later demands")
    func shutdown() throws {
        var machine = Self.active()
        let id = try #require(machine.demand(.get, now: .seconds(3600)).startedFlight).id
        let boundary = machine.shutdown()
        #expect(boundary.cancelled == id && boundary.error == .shuttingDown)
        #expect(machine.demand(.get, now: .zero) == .fail(.shuttingDown))
    }
}

extension RefreshStateMachine.DemandAction {
    /// The flight a demand started and now waits on (`nil` for any other action), so that a test
    /// fails, rather than passes silently, when the expected flight never starts.
    var startedFlight: (request: FetchRequest, id: FlightID)? {
        if case let .startAndWait(request, id) = self { return (request, id) }
        return nil
    }

    var isDelivery: Bool {
        if case .deliver = self { return true }
        return false
    }
}

extension SessionError {
    /// The wait a `refreshFailed` or `throttled` error carries.
    var retryAfter: Duration? {
        switch self {
        case let .refreshFailed(_, _, retryAfter): return retryAfter
        case let .throttled(retryAfter): return retryAfter
        default: return nil
        }
    }
}
