import Testing
import TokenBrokerCore

@Suite("Backoff and refresh guard")
struct BackoffAndGuardTests {
    @Test("backoff doubles up to its bound; jitter only shortens; Retry-After is a floor")
    func backoff() {
        let backoff = Backoff(initial: .seconds(1), maximum: .seconds(30), multiplier: 2, jitter: 0.5)
        #expect((1...7).map { backoff.delay(failures: $0, unit: 0, retryAfter: nil) }
                == [1, 2, 4, 8, 16, 30, 30].map { Duration.seconds($0) })
        #expect(backoff.delay(failures: 1, unit: 0.999, retryAfter: nil) >= .milliseconds(500))
        #expect(backoff.delay(failures: 3, unit: 1, retryAfter: nil) == .seconds(2))
        #expect(backoff.delay(failures: 1, unit: 0, retryAfter: .seconds(120)) == .seconds(120))
        #expect(backoff.delay(failures: 5, unit: 0, retryAfter: .seconds(3)) == .seconds(16))
        #expect(backoff.delay(failures: 10_000, unit: 0, retryAfter: nil) == .seconds(30))
    }

    @Test("the guard allows `limit` starts per sliding window")
    func slidingWindow() {
        var refreshGuard = RefreshGuard(limit: 2, window: .seconds(10))
        #expect(refreshGuard.retryAfter(now: .zero) == nil)
        refreshGuard.record(now: .zero)
        refreshGuard.record(now: .seconds(4))
        #expect(refreshGuard.retryAfter(now: .seconds(5)) == .seconds(5))
        #expect(refreshGuard.retryAfter(now: .seconds(10)) == nil)
        refreshGuard.record(now: .seconds(10))
        #expect(refreshGuard.retryAfter(now: .seconds(11)) == .seconds(3))
    }
}

@Suite("Refresh budget (guarantee 4, fairly)")
struct RefreshBudgetTests {
    let hog = Demander(uid: 1001), victim = Demander(uid: 1002), third = Demander(uid: 1003)

    @Test("a demander that spent its share (half the limit) is turned away alone; another still refreshes; the session's own needs only see the session's budget")
    func shares() {
        var budget = RefreshBudget(limit: 10, window: .seconds(60))
        #expect(budget.share == 5)
        for second in 0..<5 {
            #expect(budget.retryAfter(now: .seconds(second), for: hog) == nil)
            budget.record(now: .seconds(second), for: hog)
        }
        #expect(budget.retryAfter(now: .seconds(5), for: hog) == .seconds(55))
        #expect(budget.hasSpentShare(hog, now: .seconds(5)) && !budget.hasSpentShare(victim, now: .seconds(5)))
        #expect(budget.spentShares(now: .seconds(5)).map(\.demander) == [hog] && budget.spentShares(now: .seconds(5)).first?.until == .seconds(60))
        #expect(budget.retryAfter(now: .seconds(5), for: victim) == nil && budget.retryAfter(now: .seconds(5), for: nil) == nil)
        // The window slides for the hog too.
        #expect(budget.retryAfter(now: .seconds(60), for: hog) == nil && budget.spentShares(now: .seconds(60)).isEmpty)
    }

    @Test("with the callers' budget spent by others, a demander with nothing in the window gets one, up to twice the limit; one that has demanded waits with the rest; the session's own needs have a budget callers cannot spend, and the other way round")
    func newcomers() {
        var budget = RefreshBudget(limit: 4, window: .seconds(60))
        for (second, demander) in [(0, hog), (1, hog), (2, victim), (3, victim)] { budget.record(now: .seconds(second), for: demander) }
        #expect(budget.retryAfter(now: .seconds(4), for: nil) == nil, "the session's own need (expiry) is not the callers' to spend")
        #expect(budget.retryAfter(now: .seconds(4), for: hog) == .seconds(56), "spent its share")
        #expect(budget.retryAfter(now: .seconds(4), for: third) == nil, "a newcomer gets its one refresh")
        budget.record(now: .seconds(4), for: third)
        #expect(budget.retryAfter(now: .seconds(5), for: third) != nil, "and only one")
        for uid in 2000..<2003 { budget.record(now: .seconds(5), for: Demander(uid: UInt32(uid))) }
        #expect(budget.retryAfter(now: .seconds(5), for: Demander(uid: 9)) == .seconds(55), "twice the limit bounds the newcomers")
        // The session's own budget, spent, stops its own needs (beyond what lifetimes need), not the callers'.
        var own = RefreshBudget(limit: 2, window: .seconds(60))
        for second in 0..<2 { own.record(now: .seconds(second), for: nil) }
        #expect(own.retryAfter(now: .seconds(2), for: nil) == .seconds(58) && own.retryAfter(now: .seconds(2), for: nil, allowing: 1) == nil)
        #expect(own.retryAfter(now: .seconds(2), for: hog) == nil && own.ownCount(now: .seconds(2)) == 2)
    }

    @Test("only demanders with a request in the window are kept")
    func bounded() {
        var budget = RefreshBudget(limit: 10, window: .seconds(10))
        for uid in 0..<1000 { budget.record(now: .seconds(uid * 20), for: Demander(uid: UInt32(uid))) }
        #expect(budget.spentShares(now: .seconds(20_000)).isEmpty)
        #expect(budget.share == 5 && RefreshBudget(limit: 1, window: .seconds(1)).share == 1 && RefreshBudget.share(of: 3) == 1)
    }
}

@Suite("AuthRetryPolicy (guarantee 4)")
struct AuthRetryPolicyTests {
    typealias Policy = AuthRetryPolicy

    @Test("only a first 401 for an invalid or unspecified token is retried", arguments: [
        (401, [#"Bearer realm="api", error="invalid_token", error_description="expired""#], 1, Policy.Decision.recoverAndRetry),
        (401, [#"Bearer realm="api""#], 1, .recoverAndRetry),
        (401, [], 1, .recoverAndRetry),
        (401, [#"Basic realm="x", Bearer error="invalid_token""#], 1, .recoverAndRetry),
        (401, [#"Bearer error="invalid_token""#], 2, .deliver),
        (401, [#"Bearer error="insufficient_scope", scope="write""#], 1, .deliver),
        (401, [#"Bearer error="invalid_request""#], 1, .deliver),
        (403, [#"Bearer error="insufficient_scope""#], 1, .deliver),
        (403, [], 1, .deliver),
        (200, [], 1, .deliver),
        (500, [], 1, .deliver),
    ])
    func decisions(status: Int, challenges: [String], attempt: Int, expected: Policy.Decision) {
        #expect(Policy.decide(status: status, wwwAuthenticate: challenges, attempt: attempt, replay: .replayable) == expected)
    }

    @Test("requests that cannot be sent again are never retried")
    func replay() {
        #expect(Policy.replay(method: "GET", hasIdempotencyKey: false, bodyIsStream: false) == .replayable)
        #expect(Policy.replay(method: "put", hasIdempotencyKey: false, bodyIsStream: false) == .replayable)
        #expect(Policy.replay(method: "POST", hasIdempotencyKey: false, bodyIsStream: false) == .nonIdempotentWithoutKey)
        #expect(Policy.replay(method: "POST", hasIdempotencyKey: true, bodyIsStream: false) == .replayable)
        #expect(Policy.replay(method: "PUT", hasIdempotencyKey: true, bodyIsStream: true) == .consumedStream)
        for replay in [Policy.Replay.consumedStream, .nonIdempotentWithoutKey] {
            #expect(Policy.decide(status: 401, wwwAuthenticate: [#"Bearer error="invalid_token""#], attempt: 1, replay: replay) == .deliver)
        }
    }

    @Test("perform: 401 → one recover with the token sent → one retry; 403 → none")
    func perform() async throws {
        var recovered: [Secret] = []
        var sent: [Secret] = []
        let ok = try await Policy.perform(
            token: Secret("t1"), replay: .replayable,
            send: { token in sent.append(token); return token == Secret("t1") ? 401 : 200 },
            inspect: { (status: $0, wwwAuthenticate: [#"Bearer error="invalid_token""#]) },
            recover: { rejected in recovered.append(rejected); return Secret("t2") })
        #expect(ok == 200 && sent == [Secret("t1"), Secret("t2")] && recovered == [Secret("t1")])

        sent = []
        let forbidden = try await Policy.perform(
            token: Secret("t1"), replay: .replayable,
            send: { token in sent.append(token); return 403 },
            inspect: { (status: $0, wwwAuthenticate: [#"Bearer error="insufficient_scope""#]) },
            recover: { _ in Issue.record("no recover for 403"); return Secret("x") })
        #expect(forbidden == 403 && sent.count == 1)
    }

    @Test("with a DPoP proof: use_dpop_nonce with a new nonce is retried once with it; then the bearer rules, one recovery; never twice each", arguments: [
        // (status, challenge, nonce given, nonce sent, nonce retried, recovered, expected)
        (401, #"DPoP error="use_dpop_nonce""#, "n1", nil, false, false, Policy.Decision.retryWithNonce("n1")),
        (401, #"DPoP error="use_dpop_nonce""#, "n1", "n1", false, false, .deliver),     // the same nonce again: no loop
        (401, #"DPoP error="use_dpop_nonce""#, "n2", "n1", true, false, .deliver),      // a second change: the caller's
        (401, #"DPoP error="use_dpop_nonce""#, nil, nil, false, false, .deliver),       // asked, but no nonce given
        (401, #"DPoP error="invalid_token""#, nil, "n1", true, false, .recoverAndRetry),
        (401, #"DPoP error="invalid_token""#, nil, nil, false, true, .deliver),
        (401, #"DPoP error="invalid_dpop_proof""#, nil, nil, false, false, .deliver),
        (401, #"DPoP algs="ES256""#, nil, nil, false, false, .recoverAndRetry),
        (401, #"DPoP algs="ES256", Bearer error="invalid_token""#, nil, nil, false, false, .recoverAndRetry),
        (401, #"Bearer error="insufficient_scope", DPoP error="invalid_dpop_proof""#, nil, nil, false, false, .deliver),
        (403, #"DPoP error="insufficient_scope""#, nil, nil, false, false, .deliver),
        (401, #"Bearer error="invalid_token""#, nil, nil, false, false, .recoverAndRetry),   // no DPoP challenge at all
    ] as [(Int, String, String?, String?, Bool, Bool, AuthRetryPolicy.Decision)])
    func proofRetries(status: Int, challenge: String, nonce: String?, sent: String?, nonceRetried: Bool, recovered: Bool,
                      expected: Policy.Decision) {
        #expect(Policy.decideWithProof(status: status, wwwAuthenticate: [challenge], nonce: nonce, sentNonce: sent, nonceRetried: nonceRetried,
                                       recovered: recovered, replay: .replayable) == expected)
        #expect(Policy.decideWithProof(status: status, wwwAuthenticate: [challenge], nonce: nonce, sentNonce: sent, nonceRetried: nonceRetried,
                                       recovered: recovered, replay: .consumedStream) == .deliver)
    }

    @Test("a bearer request reads Bearer challenges only: a server that takes both schemes sends a bare DPoP challenge beside its verdict (RFC 9449 §7.1)")
    func mixedSchemes() {
        for header in [#"Bearer error="insufficient_scope", DPoP algs="ES256""#, #"Bearer error="invalid_request", DPoP algs="ES256""#] {
            #expect(Policy.decide(status: 401, wwwAuthenticate: [header], attempt: 1, replay: .replayable) == .deliver, "\(header)")
            #expect(Policy.decideWithProof(status: 401, wwwAuthenticate: [header], nonce: nil, sentNonce: nil, nonceRetried: false,
                                           recovered: false, replay: .replayable, scheme: "Bearer") == .deliver)
        }
        #expect(Policy.decide(status: 401, wwwAuthenticate: [#"Bearer error="invalid_token", DPoP algs="ES256""#], attempt: 1,
                              replay: .replayable) == .recoverAndRetry)
    }

    @Test("challenge parsing never traps on arbitrary header values")
    func parseAnything() {
        var generator = SystemRandomNumberGenerator()
        let alphabet = Array(#"Bearer Basic realm="x", error=invalid_token "=,;= abc=="#)
        for _ in 0..<5_000 {
            let length = Int(generator.next() % 60)
            let header = String((0..<length).map { _ in alphabet[Int(generator.next() % UInt64(alphabet.count))] })
            _ = AuthChallenge.parse(header)
            _ = Policy.decide(status: 401, wwwAuthenticate: [header], attempt: 1, replay: .replayable)
        }
    }

    @Test("challenge parsing: several schemes, quoted values, escapes, token68")
    func parse() {
        let parsed = AuthChallenge.parse(#"Basic abc==, Bearer realm="a \"b\"", error=invalid_token, DPoP algs="ES256""#)
        #expect(parsed.map(\.scheme) == ["Basic", "Bearer", "DPoP"])
        #expect(parsed[1].parameters == ["realm": #"a "b""#, "error": "invalid_token"])
        #expect(parsed[2].parameters == ["algs": "ES256"])
        #expect(AuthChallenge.parse("").isEmpty)
        #expect(AuthChallenge.parse("Bearer") == [AuthChallenge(scheme: "Bearer")])
    }
}
