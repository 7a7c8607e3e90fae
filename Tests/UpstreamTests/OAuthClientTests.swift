import DevIssuer
import Foundation
import Synchronization
import Testing
import TestSupport
import TokenBrokerCore
@testable import Upstream

/// The OAuth client against the development issuer, over real loopback HTTP.
@Suite("OAuth client against the development issuer", .serialized)
struct OAuthClientTests {
    static func issuer(_ configure: (inout DevIssuer.Options) -> Void = { _ in }) throws -> DevIssuer {
        var options = DevIssuer.Options()
        options.clients["post-client"] = "s3cret:+%/="
        configure(&options)
        return try DevIssuer(options: options)
    }

    static func client(_ issuer: DevIssuer, id: String = "tokenbroker", secret: String = "dev-secret",
                       authentication: ClientAuthentication = .basic, timeout: Duration = .seconds(10)) -> OAuthClient {
        OAuthClient(endpoints: OAuthEndpoints(token: issuer.tokenEndpoint, revocation: issuer.revocationEndpoint,
                                              deviceAuthorization: issuer.deviceAuthorizationEndpoint),
                    configuration: OAuthClientConfiguration(clientID: id, clientSecret: Secret(secret), authentication: authentication,
                                                            timeout: timeout))
    }

    @Test("a request's deadline (a fleet holder's lease) cuts it off, discovery included, whether or not its caller still waits; its abandoned transfer ends there too")
    func deadlineCutsTheRequestOff() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let configuration = OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("dev-secret"), timeout: .seconds(20))
        let source = HTTPTokenSource(grant: .refreshToken, configuration: configuration, endpoints: nil, issuer: issuer.baseURL)
        let ended = Locked<(Bool, ContinuousClock.Instant)?>(nil)
        source.whenAbandoned { _, result in
            let failed = if case .failure = result { true } else { false }
            ended.withLock { $0 = (failed, .now) }
        }
        issuer.inject([.hold])
        let started = ContinuousClock.now
        let request = FetchRequest(session: "s", generation: 1, refreshToken: Secret(issuer.issueRefreshToken()), timeLimit: .milliseconds(600))
        // Waited for: the deadline, not RequestTimeout=, ends it.
        await #expect(throws: FetchFailure.transient("the request was cut off at its deadline (the fleet's flight lease)")) {
            try await source.fetch(request)
        }
        let waited = started.duration(to: .now)
        #expect(waited >= .milliseconds(550) && waited < .seconds(5), "cut off after \(waited)")
        issuer.releaseHeld()

        // Abandoned by its caller: the transfer goes on, to the deadline and no further.
        issuer.inject([.hold])
        let second = ContinuousClock.now
        let abandoned = Task { try await source.fetch(FetchRequest(session: "s", generation: 1, refreshToken: Secret(issuer.issueRefreshToken()),
                                                                  timeLimit: .milliseconds(600))) }
        try await eventually("the request is held") { issuer.heldCount == 1 }
        abandoned.cancel()
        _ = await abandoned.result
        try await eventually("the abandoned transfer ends") { ended.value != nil }
        let (failed, at) = try #require(ended.value)
        #expect(failed && second.duration(to: at) < .seconds(5), "ended after \(second.duration(to: at))")
        issuer.releaseHeld()
    }

    @Test("refresh rotates; a replayed refresh token is invalid_grant and kills its family")
    func rotationAndReuseDetection() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let client = Self.client(issuer)
        let first = Secret(issuer.issueRefreshToken())
        let a = try await client.refresh(first)
        let second = try #require(a.refreshToken)
        #expect(second != first && a.expiresIn == .seconds(3600) && a.tokenType == "Bearer")
        #expect(issuer.isValidAccessToken(a.accessToken.reveal))
        let b = try await client.refresh(second)
        #expect(b.refreshToken != nil && b.refreshToken != second)

        // Replaying `second` (already rotated) is reuse: invalid_grant, and the newest dies too.
        await #expect(throws: FetchFailure.deadGrant) { try await client.refresh(second) }
        await #expect(throws: FetchFailure.deadGrant) { try await client.refresh(b.refreshToken!) }
        #expect(!issuer.isValidAccessToken(b.accessToken.reveal))
        #expect(issuer.counters.replays == 1 && issuer.counters.refreshGrants == 4)
    }

    @Test("client_credentials with client_secret_basic and client_secret_post (secret with : + % / =)")
    func clientCredentials() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        for authentication in [ClientAuthentication.basic, .post] {
            let token = try await Self.client(issuer, id: "post-client", secret: "s3cret:+%/=", authentication: authentication).clientCredentials()
            #expect(token.refreshToken == nil && issuer.isValidAccessToken(token.accessToken.reveal))
        }
        #expect(issuer.counters.clientCredentialsGrants == 2)
        await #expect(throws: FetchFailure.terminal("client configuration: invalid_client")) {
            try await Self.client(issuer, secret: "wrong").clientCredentials()
        }
    }

    @Test("error classes", arguments: [
        (DevIssuer.Fault.status(503, error: nil, retryAfter: 7), FetchFailure.transient("HTTP 503", retryAfter: .seconds(7))),
        (.status(429, error: nil, retryAfter: 30), .transient("HTTP 429", retryAfter: .seconds(30))),
        (.status(500, error: "server_error", retryAfter: nil), .transient("HTTP 500 server_error")),
        (.status(502, error: nil, retryAfter: nil), .transient("HTTP 502")),
        (.status(400, error: nil, retryAfter: nil), .refused("HTTP 400 without an OAuth error")),
        (.status(401, error: nil, retryAfter: nil), .refused("HTTP 401 without an OAuth error")),
        (.status(403, error: nil, retryAfter: nil), .refused("HTTP 403 without an OAuth error")),
        (.status(408, error: nil, retryAfter: nil), .transient("HTTP 408 without an OAuth error")),
        (.status(404, error: nil, retryAfter: nil), .transient("HTTP 404 without an OAuth error")),
        (.status(400, error: "invalid_grant", retryAfter: nil), .deadGrant),
        (.status(401, error: "invalid_client", retryAfter: nil), .terminal("client configuration: invalid_client")),
        (.status(400, error: "unauthorized_client", retryAfter: nil), .terminal("client configuration: unauthorized_client")),
        (.status(400, error: "invalid_scope", retryAfter: nil), .terminal("invalid_scope")),
        (.status(400, error: "temporarily_unavailable", retryAfter: nil), .transient("temporarily_unavailable")),
        (.malformedBody, .transient("malformed token response (HTTP 200, not a JSON object)")),
    ])
    func errorClasses(fault: DevIssuer.Fault, expected: FetchFailure) async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        issuer.inject([fault])
        await #expect(throws: expected) { try await Self.client(issuer).refresh(Secret(issuer.issueRefreshToken())) }
    }

    @Test("the server's error_description is kept as one printable, bounded line beside the reason (which workers see unchanged)")
    func errorDescription() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let cases: [(String, String?)] = [
            ("Missing client_id parameter.", "Missing client_id parameter."),
            ("two\nlines\r\n\u{1B}[31mred\u{2028}sep\u{202E}rtl\tend  ", "two lines [31mred sep rtl end"),
            (String(repeating: "é", count: 500), String(repeating: "é", count: 200) + "…"),
            ("\n\t ", nil),
        ]
        for (said, shown) in cases {
            issuer.inject([.described(400, error: "invalid_request", description: said)])
            do {
                _ = try await Self.client(issuer).refresh(Secret(issuer.issueRefreshToken()))
                Issue.record("no failure")
            } catch {
                #expect(error.reason == "invalid_request" && error.kind == .terminal)
                #expect(error.detail == shown)
                #expect(error.message == (shown.map { "invalid_request (the server says: \"\($0)\")" } ?? "invalid_request"))
            }
        }
    }

    @Test("a lost answer is transient, and the rotation it hid makes the retry a replay")
    func lostAnswer() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let client = Self.client(issuer)
        let token = Secret(issuer.issueRefreshToken())
        issuer.inject([.dropAfterProcessing])
        do {
            _ = try await client.refresh(token)
            Issue.record("a dropped answer succeeded")
        } catch {
            guard case .transient = error.kind else { Issue.record("expected transient, got \(error)"); return }
            #expect(error.reason.hasPrefix("transport:"))
        }
        await #expect(throws: FetchFailure.deadGrant) { try await client.refresh(token) }
        #expect(issuer.counters.replays == 1)
    }

    @Test("the total deadline holds against a server that trickles its answer")
    func trickleDeadline() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        issuer.inject([.trickle(.milliseconds(100))])
        let started = ContinuousClock.now
        do {
            _ = try await Self.client(issuer, timeout: .seconds(1)).refresh(Secret(issuer.issueRefreshToken()))
            Issue.record("a trickled answer arrived within the deadline")
        } catch {
            #expect(error.kind == .transient(retryAfter: nil) && error.reason.hasPrefix("timeout:"))
        }
        #expect(ContinuousClock.now - started < .seconds(5))
    }

    @Test("a cancelled request ends at once, even while the server holds it")
    func cancellation() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        issuer.inject([.hold])
        let client = Self.client(issuer)
        let token = Secret(issuer.issueRefreshToken())
        let task = Task { try await client.refresh(token) }
        while issuer.heldCount == 0 { await Task.yield() }
        let started = ContinuousClock.now
        task.cancel()
        await #expect(throws: FetchFailure.transient("cancelled")) { try await task.value }
        #expect(ContinuousClock.now - started < .seconds(2))
    }

    @Test("revocation of a refresh token ends its family; unknown tokens are fine")
    func revocation() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let client = Self.client(issuer)
        let token = Secret(issuer.issueRefreshToken())
        let fresh = try await client.refresh(token)
        try await client.revoke(fresh.refreshToken!)
        try await client.revoke(Secret("never-issued"))
        await #expect(throws: FetchFailure.deadGrant) { try await client.refresh(fresh.refreshToken!) }
        #expect(!issuer.isValidAccessToken(fresh.accessToken.reveal))
        #expect(issuer.counters.revocations == 2)
    }

    @Test("discovery: RFC 8414 URL placement, and the issuer must match")
    func discovery() async throws {
        #expect(Discovery.candidateURLs(for: "https://as.example/tenant1") ==
                ["https://as.example/.well-known/oauth-authorization-server/tenant1", "https://as.example/tenant1/.well-known/openid-configuration"])
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let metadata = try await Discovery.fetch(issuer: issuer.baseURL)
        #expect(metadata.tokenEndpoint == issuer.tokenEndpoint && metadata.revocationEndpoint == issuer.revocationEndpoint)
        #expect(metadata.deviceAuthorizationEndpoint == issuer.deviceAuthorizationEndpoint)

        let impostor = try LoopbackHTTPServer { _ in
            .respond(status: 200, headers: [], body: Array(#"{"issuer":"https://evil.example","token_endpoint":"https://evil.example/token"}"#.utf8))
        }
        defer { impostor.stop() }
        await #expect(throws: FetchFailure.self) { try await Discovery.fetch(issuer: "http://127.0.0.1:\(impostor.port)") }

        // A token source finds its endpoints through discovery; explicit ones win.
        let source = HTTPTokenSource(grant: .clientCredentials, configuration: OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("dev-secret")),
                                     endpoints: nil, issuer: issuer.baseURL)
        #expect(try await source.endpoints().token == issuer.tokenEndpoint)
        _ = try await source.fetch(FetchRequest(session: "s", generation: 1, refreshToken: nil))
        #expect(issuer.counters.metadataRequests == 2 && issuer.counters.clientCredentialsGrants == 1)
    }

    @Test("endpoint policy: https anywhere, http only to a loopback IP literal, as libcurl parses the URL",
          arguments: [
              ("https://as.example/token", true), ("https://as.example:8443/oauth/token?x=1", true),
              ("http://127.0.0.1:8080/token", true), ("http://127.9.8.7/token", true), ("http://[::1]:9/token", true),
              ("HTTP://127.0.0.1/token", true),
              ("http://as.example/token", false), ("http://localhost/token", false),
              ("http://127.0.0.1.attacker.example/token", false), ("http://127.0.0.1.attacker.example:80/", false),
              ("http://attacker.example#@127.0.0.1/", false), ("http://attacker.example?@127.0.0.1/", false),
              ("http://127.0.0.1@attacker.example/", false), ("http://attacker.example\\@127.0.0.1/", false),
              ("http://[::ffff:127.0.0.1]/", false), ("http://[::2]/", false), ("http://128.0.0.1/", false),
              ("http://0.0.0.0/", false), ("http://10.0.0.1/token", false),
              ("https://user:pw@as.example/token", false), ("ftp://127.0.0.1/", false), ("as.example/token", false), ("", false),
              ("https://as.example/to ken", false), ("https://as.example/\u{7}", false), ("https://bücher.example/", false),
              // The strict reading (configuration): no forms libcurl might read another way.
              ("http://127.1/", false), ("http://0x7f.0.0.1/", false), ("http://2130706433/", false),
              ("http://127.0.0.1:/", false), ("http://127.0.0.1:0/", false), ("http://127.0.0.1:65536/", false),
              ("https://as.example:65535/", true), ("https://as.example:8443x/", false), ("http://[::1%25lo]/", false),
              ("https://as%2eexample/", false), ("http:/127.0.0.1/", false), ("https://[::1/", false), ("https:///token", false),
              ("https://as.example\\token", false), ("https://AS.Example/token#frag", true),
          ])
    func endpointPolicy(url: String, allowed: Bool) {
        let problem = EndpointPolicy.problem(with: url)
        #expect((problem == nil) == allowed, "\(url): \(problem ?? "allowed")")
        // Configuration is checked before libcurl is loaded, on the strict reading alone: it
        // decides the same on every case here.
        let strict = EndpointPolicy.problemBeforeLibcurl(with: url)
        #expect((strict == nil) == allowed, "\(url) (strict reading): \(strict ?? "allowed")")
    }

    @Test("endpoint policy: whatever the strict reading (configuration) allows, libcurl's reading allows too, with the same scheme and host (seeded random URLs)")
    func strictReadingIsNarrower() {
        let pieces = ["http", "https", "HTTP", "://", ":", "/", "//", "@", "[", "]", "::1", ".", "127", "0", "1", "8080", "65536",
                      "#", "?", "a", "example", "%2e", "\\", "-", "_", "~", "x", "0x7f", "[::1]", "127.0.0.1", "user:pw@"]
        var random = SeededRandom(seed: UInt64(ProcessInfo.processInfo.environment["TB_FUZZ_SEED"] ?? "") ?? 13)
        let iterations = Int(ProcessInfo.processInfo.environment["TB_FUZZ_ITERATIONS"] ?? "") ?? 20_000
        var allowed = 0
        for _ in 0..<iterations {
            var url = ["http://", "https://", "HTTP://", "http:/", ""].randomElement(using: &random)!
            for _ in 0..<Int.random(in: 1...7, using: &random) { url += pieces.randomElement(using: &random)! }
            guard EndpointPolicy.problemBeforeLibcurl(with: url) == nil else { continue }
            allowed += 1
            let problem = EndpointPolicy.problem(with: url)
            #expect(problem == nil, "the strict reading allows \(url), libcurl's does not: \(problem ?? "")")
            // And both read the same host (what Serves= and DPoP's htu decide on).
            let strict = EndpointPolicy.strictParse(url), curl = EndpointPolicy.parse(url)
            #expect(strict?.host == curl?.host.lowercased() && strict?.scheme == curl?.scheme, "\(url): \(strict?.host ?? "-") against libcurl's \(curl?.host ?? "-")")
        }
        #expect(allowed > iterations / 50, "too few allowed URLs (\(allowed)) for the comparison to mean anything")
    }

    @Test("form encoding keeps + / = & % intact")
    func formEncoding() {
        #expect(FormEncodingProbe.encoded == "refresh_token=a%2Bb%2Fc%20d%3De%26f%25")
    }
}

import Basics
enum FormEncodingProbe {
    static let encoded = FormEncoding.encode([("refresh_token", "a+b/c d=e&f%")])
}
