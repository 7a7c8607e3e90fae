import DevIssuer
import DPoP
import Testing
import TokenBrokerCore
@testable import Upstream

/// A DPoP session's token requests (RFC 9449 §5, §8) against the development issuer, which
/// requires proofs and a nonce of its own.
@Suite("DPoP token requests", .serialized)
struct DPoPTokenRequestTests {
    static func source(_ issuer: DevIssuer, nonces: DPoPNonces) -> HTTPTokenSource {
        HTTPTokenSource(grant: .refreshToken, configuration: OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("dev-secret")),
                        endpoints: OAuthEndpoints(token: issuer.tokenEndpoint), issuer: nil, dpop: .on, nonces: nonces)
    }

    static func issuer() throws -> DevIssuer {
        var options = DevIssuer.Options()
        options.dpop = .required
        options.dpopNonces = true
        return try DevIssuer(options: options)
    }

    @Test("each nonce change costs one extra request, once: the first refresh, and the first after a rotation; none between; the token is DPoP-bound to the key")
    func nonceRoundTrips() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let nonces = DPoPNonces()
        let source = Self.source(issuer, nonces: nonces)
        let key = try #require(try await source.newProofKey())
        var refresh = Secret(issuer.issueRefreshToken())
        var tokens: [FetchedToken] = []
        for round in 0..<4 {
            if round == 2 { issuer.rotateDPoPNonces() }
            let fetched = try await source.fetch(FetchRequest(session: "s", generation: 1, refreshToken: refresh, proofKey: key))
            refresh = try #require(fetched.refreshToken)
            tokens.append(fetched)
        }
        #expect(issuer.counters.refreshGrants == 4 && issuer.counters.dpopNonceChallenges == 2 && issuer.counters.tokenRequests == 6)
        #expect(tokens.allSatisfy { $0.tokenType == "DPoP" })
        let thumbprint = try DPoPBinding.key(key).thumbprint
        #expect(tokens.allSatisfy { issuer.thumbprint(ofAccessToken: $0.accessToken.reveal) == thumbprint })
        #expect(nonces.nonce(for: issuer.tokenEndpoint, client: "tokenbroker") == issuer.currentTokenNonce)
        #expect(nonces.nonce(for: issuer.tokenEndpoint, client: "another") == nil, "nonces are kept per server and client")
        #expect(issuer.counters.dpopProofsRefused == 0)
    }

    @Test("a bound family refreshed with another key is refused; a session without its key asks for a login; a token bound to another key is refused")
    func wrongKeys() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let source = Self.source(issuer, nonces: DPoPNonces())
        let key = try #require(try await source.newProofKey())
        let first = try await source.fetch(FetchRequest(session: "s", generation: 1, refreshToken: Secret(issuer.issueRefreshToken()), proofKey: key))
        let refresh = try #require(first.refreshToken)
        let stranger = try #require(try await source.newProofKey())
        let refused = await #expect(throws: FetchFailure.self) {
            try await source.fetch(FetchRequest(session: "s", generation: 1, refreshToken: refresh, proofKey: stranger))
        }
        #expect(refused?.kind == .terminal && refused?.reason == "invalid_grant")
        await #expect(throws: FetchFailure.terminal("dpop: the session was logged in without a DPoP key (before DPoP=yes); log in again")) {
            try await source.fetch(FetchRequest(session: "s", generation: 1, refreshToken: refresh, proofKey: nil))
        }
        issuer.inject([.bindToOtherKey])
        await #expect(throws: FetchFailure.refused("dpop: the access token is bound to another key")) {
            try await source.fetch(FetchRequest(session: "s", generation: 1, refreshToken: refresh, proofKey: key))
        }
        #expect(throws: FetchFailure.self) { try DPoPBinding.key(Secret("not-a-key")) }
    }

    @Test("DPoP=auto follows the server's metadata; DPoP=yes with a server that lists other algorithms only fails the login")
    func metadataDecides() async throws {
        let configuration = OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("dev-secret"))
        func source(_ issuer: String, _ mode: DPoPMode) -> HTTPTokenSource {
            HTTPTokenSource(grant: .refreshToken, configuration: configuration, endpoints: nil, issuer: issuer, dpop: mode, nonces: DPoPNonces())
        }
        let dpop = try Self.issuer()
        defer { dpop.stop() }
        let bearer = try DevIssuer()
        defer { bearer.stop() }
        #expect(try await source(dpop.baseURL, .auto).newProofKey() != nil, "the server lists ES256")
        #expect(try await source(bearer.baseURL, .auto).newProofKey() == nil, "the server lists no DPoP algorithm")
        #expect(try await source(bearer.baseURL, .on).newProofKey() != nil, "yes: a key whatever the metadata omits")
        #expect(try await source(bearer.baseURL, .off).newProofKey() == nil)
        let other = try LoopbackHTTPServer { _ in .respond(status: 404, headers: [], body: []) }
        let port = other.port
        other.stop()
        let elsewhere = try LoopbackHTTPServer(port: port) { _ in
            .respond(status: 200, headers: [("Content-Type", "application/json")], body: Array("""
                {"issuer":"http://127.0.0.1:\(port)","token_endpoint":"http://127.0.0.1:\(port)/token",
                 "dpop_signing_alg_values_supported":["PS256","EdDSA"]}
                """.utf8))
        }
        defer { elsewhere.stop() }
        #expect(try await source("http://127.0.0.1:\(port)", .auto).newProofKey() == nil)
        await #expect(throws: FetchFailure.terminal("dpop: the server takes DPoP proofs signed with PS256, EdDSA only; tokenbroker signs ES256")) {
            try await source("http://127.0.0.1:\(port)", .on).newProofKey()
        }
    }

    @Test("nonces: kept per server, bounded in size and count, only visible ASCII")
    func nonceTable() {
        let nonces = DPoPNonces()
        func answer(_ nonce: String) -> HTTPResponse { HTTPResponse(status: 400, headers: [("dpop-nonce", nonce)], body: []) }
        #expect(nonces.learn(answer("n-1"), from: "https://AS.example/token?x", client: "c") == "n-1")
        #expect(nonces.nonce(for: "https://as.example/other", client: "c") == "n-1" && nonces.nonce(for: "https://as.example:8443/token", client: "c") == nil)
        for bad in ["", "a b", "a\"b", String(repeating: "x", count: 513), "ä"] { #expect(nonces.learn(answer(bad), from: "https://b.example/", client: "c") == nil) }
        for index in 0..<300 { nonces.learn(answer("n"), from: "https://host\(index).example/", client: "c") }
        #expect(nonces.nonce(for: "https://as.example/", client: "c") == nil && nonces.nonce(for: "https://host299.example/", client: "c") == "n",
                "the oldest is forgotten")
    }
}
