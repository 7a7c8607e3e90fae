import DevIssuer
import DPoP
import Testing
import TokenBrokerCore
@testable import Upstream
import HTTPTransport

/// A DPoP session's token requests (RFC 9449 §5, §8) against the development issuer, which
/// requires proofs and a nonce of its own.
@Suite("DPoP token requests", .serialized)
struct DPoPTokenRequestTests {
    static func source(_ issuer: DevIssuer, nonces: DPoPNonces) -> HTTPTokenSource {
        HTTPTokenSource(grant: .refreshToken, configuration: OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("dev-secret")),
                        endpoints: OAuthEndpoints(token: issuer.tokenEndpoint, revocation: issuer.revocationEndpoint), issuer: nil, dpop: .on, nonces: nonces)
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
        let key = try #require(try source.newProofKey())
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

    @Test("a bound family refreshed with another key is refused; a token bound to another key ends the session and its answer's refresh token is revoked; a session without its key asks for a login, its refresh token revoked")
    func wrongKeys() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let source = Self.source(issuer, nonces: DPoPNonces())
        let key = try #require(try source.newProofKey())
        let first = try await source.fetch(FetchRequest(session: "s", generation: 1, refreshToken: Secret(issuer.issueRefreshToken()), proofKey: key))
        let refresh = try #require(first.refreshToken)
        let stranger = try #require(try source.newProofKey())
        let refused = await #expect(throws: FetchFailure.self) {
            try await source.fetch(FetchRequest(session: "s", generation: 1, refreshToken: refresh, proofKey: stranger))
        }
        #expect(refused?.kind == .terminal && refused?.reason == "invalid_grant")
        // A token bound to another key ends the session: the refresh token its answer brought
        // is revoked, and the spent one is never sent again (no replay).
        issuer.inject([.bindToOtherKey])
        #expect(issuer.activeRefreshTokens == 1)
        await #expect(throws: FetchFailure.terminal("dpop: the access token is bound to another key; the answer's new refresh token was revoked: log in again")) {
            try await source.fetch(FetchRequest(session: "s", generation: 1, refreshToken: refresh, proofKey: key))
        }
        #expect(issuer.activeRefreshTokens == 0 && issuer.counters.revocations == 1 && issuer.counters.replays == 0)
        // A session without its key (logged in before DPoP=yes): ended, its refresh token revoked.
        let other = try await source.fetch(FetchRequest(session: "s", generation: 2, refreshToken: Secret(issuer.issueRefreshToken()), proofKey: key))
        #expect(issuer.activeRefreshTokens == 1)
        await #expect(throws: FetchFailure.terminal("dpop: the session was logged in without a DPoP key (before DPoP=yes); log in again")) {
            try await source.fetch(FetchRequest(session: "s", generation: 2, refreshToken: other.refreshToken, proofKey: nil))
        }
        #expect(issuer.activeRefreshTokens == 0 && issuer.counters.revocations == 2)
        #expect(throws: FetchFailure.self) { try DPoPBinding.key(Secret("not-a-key")) }
    }

    @Test("DPoP=auto follows the server's metadata (also with every endpoint explicit); DPoP=yes refuses a server that lists other algorithms only, and one that answers a proof with a bearer token (revoking the refresh token that answer brought)")
    func metadataDecides() async throws {
        let configuration = OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("dev-secret"))
        func source(_ issuer: DevIssuer?, _ mode: DPoPMode, issuerURL: String? = nil, explicit: Bool = false) -> HTTPTokenSource {
            HTTPTokenSource(grant: .refreshToken, configuration: configuration,
                            endpoints: explicit ? issuer.map { OAuthEndpoints(token: $0.tokenEndpoint, revocation: $0.revocationEndpoint,
                                                                             deviceAuthorization: $0.deviceAuthorizationEndpoint) } : nil,
                            issuer: issuerURL ?? issuer?.baseURL, dpop: mode, nonces: DPoPNonces())
        }
        func refresh(_ source: HTTPTokenSource, _ issuer: DevIssuer) async throws -> FetchedToken {
            try await source.fetch(FetchRequest(session: "s", generation: 1, refreshToken: Secret(issuer.issueRefreshToken()),
                                                proofKey: try source.newProofKey()))
        }
        let dpop = try Self.issuer()
        defer { dpop.stop() }
        let bearer = try DevIssuer()
        defer { bearer.stop() }
        #expect(try await refresh(source(dpop, .auto), dpop).tokenType == "DPoP", "the server lists ES256")
        #expect(try await refresh(source(dpop, .auto, explicit: true), dpop).tokenType == "DPoP", "explicit endpoints: the metadata still decides")
        #expect(try await refresh(source(bearer, .auto), bearer).tokenType == "Bearer", "the server lists no DPoP algorithm")
        #expect(bearer.counters.refreshGrants == 1)

        // A generation keeps the kind of token it has: an auto session with a bearer token stays
        // bearer when its server starts to list ES256 (a proof on its unbound refresh token
        // would be refused by some), and one with a DPoP token keeps proving its key.
        var options = DevIssuer.Options()
        options.dpop = .accepted
        let accepting = try DevIssuer(options: options)
        defer { accepting.stop() }
        let pinned = source(accepting, .auto)
        let key = try pinned.newProofKey()
        let asBearer = try await pinned.fetch(FetchRequest(session: "s", generation: 1, refreshToken: Secret(accepting.issueRefreshToken()),
                                                           proofKey: key, tokenType: "Bearer"))
        #expect(asBearer.tokenType == "Bearer")
        let asBound = try await pinned.fetch(FetchRequest(session: "s", generation: 1, refreshToken: Secret(accepting.issueRefreshToken()),
                                                          proofKey: key, tokenType: "DPoP"))
        #expect(asBound.tokenType == "DPoP")
        let first = try await pinned.fetch(FetchRequest(session: "s", generation: 1, refreshToken: Secret(accepting.issueRefreshToken()),
                                                        proofKey: key))
        #expect(first.tokenType == "DPoP", "the first token of a generation: as the metadata says")

        let refused = await #expect(throws: FetchFailure.self) { try await refresh(source(bearer, .on), bearer) }
        #expect(refused?.kind == .terminal && refused?.reason.hasPrefix("dpop: the server answered a request with a proof with a bearer token") == true)
        #expect(bearer.activeRefreshTokens == 1, "the refused answer's refresh token was revoked; only auto's lives")

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
        let foreign = source(nil, .on, issuerURL: "http://127.0.0.1:\(port)")
        await #expect(throws: FetchFailure.terminal("dpop: the server takes DPoP proofs signed with PS256, EdDSA only; tokenbroker signs ES256")) {
            try await foreign.fetch(FetchRequest(session: "s", generation: 1, refreshToken: Secret("r"), proofKey: try foreign.newProofKey()))
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
