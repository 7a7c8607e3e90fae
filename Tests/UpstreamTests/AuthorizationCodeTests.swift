import Basics
@testable import DevIssuer
import DPoP
import Testing
import TestSupport
import TokenBrokerCore
@testable import Upstream
import WireJSON
import HTTPTransport

/// The authorization code grant with PKCE (RFC 6749 §4.1, RFC 7636, RFC 8252) against the
/// development issuer over real loopback HTTP: the browser's part is a GET whose redirect is
/// read, not followed. No token or code is ever printed: they are named by position, and
/// compared as `Secret`s (which print redacted) or through Booleans.
@Suite("Authorization code with PKCE against the development issuer", .serialized)
struct AuthorizationCodeTests {
    typealias Answer = DevIssuerDPoPTests.Answer

    /// Nothing listens there: the redirect is read from the `Location` header.
    static let redirectURI = "http://127.0.0.1:49152/callback"

    static func issuer(_ configure: (inout DevIssuer.Options) -> Void = { _ in }) throws -> DevIssuer {
        var options = DevIssuer.Options()
        configure(&options)
        return try DevIssuer(options: options)
    }

    static func client(_ issuer: DevIssuer, dpop: DPoPBinding? = nil) -> OAuthClient {
        OAuthClient(endpoints: OAuthEndpoints(token: issuer.tokenEndpoint, revocation: issuer.revocationEndpoint,
                                              authorization: issuer.authorizationEndpoint),
                    configuration: OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("dev-secret")), dpop: dpop)
    }

    /// What a browser does first: GET the authorization URL (the redirect is not followed).
    static func open(_ issuer: DevIssuer, _ url: String) throws -> Answer {
        #expect(url.hasPrefix(issuer.baseURL + "/"))
        return try DevIssuerDPoPTests.exchange(port: issuer.port, method: "GET", target: String(url.dropFirst(issuer.baseURL.utf8.count)))
    }

    /// GET /authorize with exactly these parameters.
    static func authorize(_ issuer: DevIssuer, _ fields: [(String, String)]) throws -> Answer {
        try DevIssuerDPoPTests.exchange(port: issuer.port, method: "GET", target: "/authorize?" + FormEncoding.encode(fields))
    }

    /// The parameters of a redirect's query (first of each name).
    static func query(_ location: String) -> [String: String] {
        guard let mark = location.firstIndex(of: "?") else { return [:] }
        return Dictionary(FormEncoding.decode(String(location[location.index(after: mark)...])), uniquingKeysWith: { first, _ in first })
    }

    /// A login up to its redirect: the request, and what `readRedirect` makes of the answer's `Location`.
    static func login(_ issuer: DevIssuer, scope: String? = "openid profile", redirectURI: String = redirectURI) throws
        -> (request: AuthorizationRequest, outcome: RedirectOutcome) {
        let request = AuthorizationRequest(redirectURI: redirectURI)
        let answer = try open(issuer, request.url(authorizationEndpoint: issuer.authorizationEndpoint, clientID: "tokenbroker", scope: scope))
        #expect(answer.status == 302, "the authorization endpoint redirects (\(answer))")
        guard let location = answer.header("location") else {
            Issue.record("no Location in the authorization answer")
            return (request, .invalid("no Location"))
        }
        let toRedirectURI = location.hasPrefix(redirectURI + "?")
        #expect(toRedirectURI, "the redirect goes to the redirect URI")
        return (request, AuthorizationRequest.readRedirect(location, expecting: request))
    }

    /// The code of a redirect that must carry one.
    static func code(_ outcome: RedirectOutcome) throws -> Secret {
        guard case let .code(code) = outcome else {
            Issue.record("the redirect carries no code: \(outcome)")
            throw DevIssuerDPoPTests.HTTPFailure(description: "no code")
        }
        return code
    }

    /// A failed redemption's kind and reason (its detail is the server's words).
    static func refusal(_ body: () async throws -> FetchedToken) async -> (kind: FetchFailure.Kind, reason: String)? {
        do {
            _ = try await body()
            Issue.record("the redemption succeeded")
            return nil
        } catch let failure as FetchFailure {
            return (failure.kind, failure.reason)
        } catch {
            Issue.record("not a FetchFailure: \(error)")
            return nil
        }
    }

    // MARK: - The flow

    @Test("a login: 302 to the redirect URI with a code, the state and iss; the code redeems for a refresh token family and an access token; the ID token carries the nonce, the client, the issuer, HS256 under the client secret")
    func fullFlow() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let (request, outcome) = try Self.login(issuer)
        let code = try Self.code(outcome)
        // The same redirect as the listener receives it (a request-target) reads the same.
        let answer = try Self.open(issuer, request.url(authorizationEndpoint: issuer.authorizationEndpoint, clientID: "tokenbroker", scope: "openid"))
        let location = try #require(answer.header("location"))
        let parameters = Self.query(location)
        let iss = parameters["iss"], echoed = parameters["state"] == request.state
        #expect(iss == issuer.baseURL && echoed, "redirect 2 carries iss and the state")
        let target = String(location.dropFirst("http://127.0.0.1:49152".utf8.count))
        let targetForm = target.hasPrefix("/callback?")
        #expect(targetForm)
        guard case .code = AuthorizationRequest.readRedirect(target, expecting: request) else {
            Issue.record("the request-target form of redirect 2 carries no code")
            return
        }

        let client = Self.client(issuer)
        let token = try await client.redeem(code: code, request: request)
        let live = issuer.isValidAccessToken(token.accessToken.reveal)
        #expect(live && token.tokenType == "Bearer" && token.expiresIn == .seconds(3600), "access token 1 is live")
        let refresh = try #require(token.refreshToken)
        #expect(request.idTokenProblem(in: token, clientID: "tokenbroker", issuer: issuer.baseURL) == nil)
        let idToken = try #require(token.idToken)
        let claims = try #require(IDTokenClaims.read(idToken))
        #expect(claims.nonce == request.nonce && claims.audiences == ["tokenbroker"] && claims.issuer == issuer.baseURL && claims.subject == "dev-user")
        #expect((claims.expiresAt ?? 0) > Int64(DevIssuer.now()))
        // The signature: HS256 (RFC 7518 §3.2) under the client secret.
        let parts = idToken.reveal.split(separator: ".", omittingEmptySubsequences: false)
        let header = Base64.urlDecode(parts[0]).flatMap { try? JSONParser.parse(ArraySlice($0)) }
        #expect(header?.objectValue?["alg"] == "HS256")
        let signed = Base64.urlDecode(parts[2]) == DevIssuer.hmacSHA256(key: Array("dev-secret".utf8), Array((parts[0] + "." + parts[1]).utf8))
        #expect(signed, "ID token 1 is signed HS256 with the client secret")
        // Every other check of the ID token.
        #expect(request.idTokenProblem(in: token, clientID: "another", issuer: nil) == "the id_token is for another client (aud)")
        #expect(request.idTokenProblem(in: token, clientID: "tokenbroker", issuer: "https://elsewhere.example") == "the id_token names another issuer (iss)")

        // The family lives: its refresh token rotates.
        let refreshed = try await client.refresh(refresh)
        #expect(refreshed.refreshToken != nil && refreshed.idToken == nil)
        #expect(issuer.counters.authorizationRequests == 2 && issuer.counters.codeGrants == 1 && issuer.counters.codeReplays == 0)
        let counters = try DevIssuerDPoPTests.exchange(port: issuer.port, method: "GET", target: "/_dev/counters")
        #expect(counters.json?["authorization"]?.intValue == 2 && counters.json?["authorization_code"]?.intValue == 1
                && counters.json?["code_replays"]?.intValue == 0)
    }

    @Test("without the openid scope there is no ID token: a problem only when one is required")
    func noOpenID() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let (request, outcome) = try Self.login(issuer, scope: "profile")
        let token = try await Self.client(issuer).redeem(code: try Self.code(outcome), request: request)
        #expect(token.idToken == nil && token.refreshToken != nil)
        #expect(request.idTokenProblem(in: token, clientID: "tokenbroker", issuer: nil, required: false) == nil)
        #expect(request.idTokenProblem(in: token, clientID: "tokenbroker", issuer: nil) == "the token answer has no id_token")
        // No scope at all works too.
        let (bare, bareOutcome) = try Self.login(issuer, scope: nil)
        let bareToken = try await Self.client(issuer).redeem(code: try Self.code(bareOutcome), request: bare)
        #expect(bareToken.idToken == nil)
    }

    // MARK: - Each failure

    @Test("the wrongState fault: the next redirect carries another state, which readRedirect refuses; the one after is right again")
    func wrongState() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        issuer.inject([.wrongState])
        let (_, outcome) = try Self.login(issuer)
        #expect(outcome == .invalid("the redirect's state is not the login's"))
        let (request, next) = try Self.login(issuer)
        let token = try await Self.client(issuer).redeem(code: try Self.code(next), request: request)
        #expect(token.refreshToken != nil, "the fault did not reach the token endpoint")
        #expect(issuer.counters.tokenRequests == 1)
    }

    @Test("consent deny: 302 with error=access_denied and the state, read as .denied; setConsent(.approve) gives codes again")
    func denied() async throws {
        let issuer = try Self.issuer { $0.consent = .deny }
        defer { issuer.stop() }
        let (_, outcome) = try Self.login(issuer)
        #expect(outcome == .denied(error: "access_denied", description: "The user denied the request."))
        issuer.setConsent(.approve)
        let (_, approved) = try Self.login(issuer)
        _ = try Self.code(approved)
    }

    @Test("consent ask: a 200 page and a pending request; approveAuthorization gives the redirect once; the decide page answers the 302 (deny here); an unknown state is 404")
    func ask() async throws {
        let issuer = try Self.issuer { $0.consent = .ask }
        defer { issuer.stop() }
        let request = AuthorizationRequest(redirectURI: Self.redirectURI)
        let page = try Self.open(issuer, request.url(authorizationEndpoint: issuer.authorizationEndpoint, clientID: "tokenbroker", scope: "openid"))
        #expect(page.status == 200 && page.header("location") == nil)
        let text = String(decoding: page.body, as: UTF8.self)
        #expect(text.contains(issuer.baseURL + "/authorize/decide?state=") && text.contains("action=approve"))
        #expect(issuer.pendingAuthorizationStates == [request.state])
        let location = try #require(issuer.approveAuthorization(state: request.state))
        #expect(issuer.approveAuthorization(state: request.state) == nil, "decided once")
        let token = try await Self.client(issuer).redeem(code: try Self.code(AuthorizationRequest.readRedirect(location, expecting: request)),
                                                         request: request)
        #expect(request.idTokenProblem(in: token, clientID: "tokenbroker", issuer: issuer.baseURL) == nil)

        let second = AuthorizationRequest(redirectURI: Self.redirectURI)
        _ = try Self.open(issuer, second.url(authorizationEndpoint: issuer.authorizationEndpoint, clientID: "tokenbroker", scope: nil))
        let decide = "/authorize/decide?" + FormEncoding.encode([("state", second.state), ("action", "deny")])
        let decision = try DevIssuerDPoPTests.exchange(port: issuer.port, method: "GET", target: decide)
        #expect(decision.status == 302)
        let denied = AuthorizationRequest.readRedirect(try #require(decision.header("location")), expecting: second)
        #expect(denied == .denied(error: "access_denied", description: "The user denied the request."))
        let again = try DevIssuerDPoPTests.exchange(port: issuer.port, method: "GET", target: decide)
        #expect(again.status == 404 && issuer.pendingAuthorizationStates.isEmpty)
        #expect(issuer.denyAuthorization(state: "unknown") == nil)
    }

    @Test("a replayed code is invalid_grant, and the family the first redemption started is revoked (RFC 6749 §4.1.2)")
    func replay() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let (request, outcome) = try Self.login(issuer)
        let code = try Self.code(outcome)
        let client = Self.client(issuer)
        let first = try await client.redeem(code: code, request: request)
        let refresh = try #require(first.refreshToken)
        let replayed = await Self.refusal { try await client.redeem(code: code, request: request) }
        #expect(replayed?.kind == .terminal && replayed?.reason == "invalid_grant")
        let standing = issuer.lineage(of: refresh.reveal)
        let live = issuer.isValidAccessToken(first.accessToken.reveal)
        #expect(standing?.revoked == true && !live, "refresh token 1's family and access token 1 are revoked")
        #expect(issuer.counters.codeReplays == 1 && issuer.activeRefreshTokens == 0)
        let afterwards = await Self.refusal { try await client.refresh(refresh) }
        #expect(afterwards?.reason == "invalid_grant")
    }

    @Test("a wrong code_verifier is invalid_grant and spends the code; so is a malformed one")
    func wrongVerifier() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let client = Self.client(issuer)
        let (request, outcome) = try Self.login(issuer)
        let code = try Self.code(outcome)
        let other = AuthorizationRequest(redirectURI: request.redirectURI, state: request.state, nonce: request.nonce, pkce: .make())
        let wrong = await Self.refusal { try await client.redeem(code: code, request: other) }
        #expect(wrong?.kind == .terminal && wrong?.reason == "invalid_grant")
        let spent = await Self.refusal { try await client.redeem(code: code, request: request) }
        #expect(spent?.reason == "invalid_grant", "the right verifier after a wrong one: the code is spent")

        // A verifier too short for RFC 7636 §4.1, even with its own challenge.
        let short = PKCE(verifier: Secret("too-short"))
        let shortRequest = AuthorizationRequest(redirectURI: Self.redirectURI, state: "s", nonce: "n", pkce: short)
        let page = try Self.open(issuer, shortRequest.url(authorizationEndpoint: issuer.authorizationEndpoint, clientID: "tokenbroker", scope: nil))
        let shortCode = try Self.code(AuthorizationRequest.readRedirect(try #require(page.header("location")), expecting: shortRequest))
        let malformed = await Self.refusal { try await client.redeem(code: shortCode, request: shortRequest) }
        #expect(malformed?.reason == "invalid_grant")
        #expect(issuer.activeRefreshTokens == 0 && issuer.counters.codeGrants == 3)
    }

    @Test("a redirect_uri other than the authorization request's is invalid_grant")
    func wrongRedirectURI() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let (request, outcome) = try Self.login(issuer)
        let elsewhere = AuthorizationRequest(redirectURI: "http://127.0.0.1:49153/callback", state: request.state, nonce: request.nonce, pkce: request.pkce)
        let refused = await Self.refusal { try await Self.client(issuer).redeem(code: try Self.code(outcome), request: elsewhere) }
        #expect(refused?.kind == .terminal && refused?.reason == "invalid_grant")
        #expect(issuer.activeRefreshTokens == 0)
    }

    @Test("an expired code is invalid_grant (authorizationCodeLifetime)")
    func expired() async throws {
        let issuer = try Self.issuer { $0.authorizationCodeLifetime = .zero }
        defer { issuer.stop() }
        let (request, outcome) = try Self.login(issuer)
        let refused = await Self.refusal { try await Self.client(issuer).redeem(code: try Self.code(outcome), request: request) }
        #expect(refused?.kind == .terminal && refused?.reason == "invalid_grant")
        #expect(issuer.activeRefreshTokens == 0)
    }

    @Test("the idTokenNonce fault: the ID token carries another nonce, which idTokenProblem finds; the next one is right")
    func idTokenNonce() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let client = Self.client(issuer)
        let (request, outcome) = try Self.login(issuer)
        issuer.inject([.idTokenNonce("another-nonce")])
        let token = try await client.redeem(code: try Self.code(outcome), request: request)
        #expect(IDTokenClaims.read(try #require(token.idToken))?.nonce == "another-nonce")
        #expect(request.idTokenProblem(in: token, clientID: "tokenbroker", issuer: issuer.baseURL)
                == "the id_token's nonce is not the login's (a replayed or injected ID token)")
        let (next, nextOutcome) = try Self.login(issuer)
        let nextToken = try await client.redeem(code: try Self.code(nextOutcome), request: next)
        #expect(next.idTokenProblem(in: nextToken, clientID: "tokenbroker", issuer: issuer.baseURL) == nil)
    }

    @Test("a redemption with a DPoP proof (and the server's nonce, asked once) gives a DPoP token bound to the key, and a bound family")
    func dpopBound() async throws {
        let issuer = try Self.issuer {
            $0.dpop = .required
            $0.dpopNonces = true
        }
        defer { issuer.stop() }
        let key = try DPoPKey()
        let client = Self.client(issuer, dpop: DPoPBinding(key: key, client: "tokenbroker", nonces: DPoPNonces()))
        let (request, outcome) = try Self.login(issuer)
        let token = try await client.redeem(code: try Self.code(outcome), request: request)
        let bound = issuer.thumbprint(ofAccessToken: token.accessToken.reveal)
        #expect(token.tokenType == "DPoP" && bound == key.thumbprint, "access token 1 is bound to the key")
        #expect(issuer.counters.dpopNonceChallenges == 1 && issuer.counters.codeGrants == 1 && issuer.counters.tokenRequests == 2)
        // The family is bound: another key cannot refresh it, the key can.
        let refresh = try #require(token.refreshToken)
        let stranger = Self.client(issuer, dpop: DPoPBinding(key: try DPoPKey(), client: "tokenbroker", nonces: DPoPNonces()))
        let refused = await Self.refusal { try await stranger.refresh(refresh) }
        #expect(refused?.reason == "invalid_grant")
        let refreshed = try await client.refresh(refresh)
        #expect(refreshed.tokenType == "DPoP")
    }

    // MARK: - The authorization endpoint's checks

    @Test("refused on the page (400, no redirect): a missing, unknown or repeated client_id; a redirect_uri neither loopback nor registered, or repeated")
    func refusedOnThePage() throws {
        let issuer = try Self.issuer { $0.redirectURIs["tokenbroker"] = ["https://app.example/callback"] }
        defer { issuer.stop() }
        let good = AuthorizationRequest(redirectURI: Self.redirectURI)
        func fields(client: String? = "tokenbroker", redirect: String? = Self.redirectURI) -> [(String, String)] {
            var fields = [("response_type", "code"), ("state", good.state), ("code_challenge", good.pkce.challenge), ("code_challenge_method", "S256")]
            if let client { fields.append(("client_id", client)) }
            if let redirect { fields.append(("redirect_uri", redirect)) }
            return fields
        }
        let foreign = ["http://example.com/callback", "http://localhost:49152/callback", "https://127.0.0.1:49152/callback", "http://127.0.0.2:49152/callback",
                       "http://127.0.0.1:49152", "http://127.0.0.1:0/callback", "http://127.0.0.1:99999/callback", "http://127.0.0.1:/callback",
                       "http://127.0.0.1:49152/callback#top", "http://127.0.0.1.example.com/callback", "http://user@127.0.0.1:49152/callback",
                       "http://[::2]:49152/callback", "https://app.example/callback/other", "http://127.0.0.1:49152/call back"]
        let refused: [(String, [(String, String)])] = [
            ("no client_id", fields(client: nil)),
            ("an unknown client", fields(client: "stranger")),
            ("client_id twice", fields() + [("client_id", "tokenbroker")]),
            ("no redirect_uri", fields(redirect: nil)),
            ("redirect_uri twice", fields() + [("redirect_uri", Self.redirectURI)]),
        ] + foreign.map { uri in ("redirect_uri " + uri, fields(redirect: uri)) }
        for (what, query) in refused {
            let answer = try Self.authorize(issuer, query)
            let redirected = answer.header("location") != nil
            #expect(answer.status == 400 && !redirected, "\(what): \(answer)")
        }
        for accepted in ["http://[::1]:49152/callback", "http://127.0.0.1/callback", "https://app.example/callback", "http://127.0.0.1:65535/a/b?x=1"] {
            let answer = try Self.authorize(issuer, fields(redirect: accepted))
            let location = answer.header("location") ?? ""
            let toIt = location.hasPrefix(accepted + (accepted.contains("?") ? "&" : "?"))
            let parameters = Self.query(location)
            let hasCode = parameters["code"] != nil, echoed = parameters["state"] == good.state
            #expect(answer.status == 302 && toIt && hasCode && echoed, "redirect_uri \(accepted): a code, the state")
        }
        #expect(issuer.counters.authorizationRequests == refused.count + 4)
    }

    @Test("refused through the redirect, with the state: a response_type other than code, no PKCE or not S256, a malformed challenge or scope, a repeated parameter, no state")
    func refusedThroughTheRedirect() throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let request = AuthorizationRequest(redirectURI: Self.redirectURI)
        let base = [("client_id", "tokenbroker"), ("redirect_uri", Self.redirectURI), ("state", request.state)]
        let pkce = [("code_challenge", request.pkce.challenge), ("code_challenge_method", "S256")]
        let cases: [(String, [(String, String)], String)] = [
            ("response_type=token", base + [("response_type", "token")] + pkce, "unsupported_response_type"),
            ("no response_type", base + pkce, "invalid_request"),
            ("no code_challenge", base + [("response_type", "code"), ("code_challenge_method", "S256")], "invalid_request"),
            ("no code_challenge_method (plain by default)", base + [("response_type", "code"), ("code_challenge", request.pkce.challenge)], "invalid_request"),
            ("code_challenge_method=plain", base + [("response_type", "code"), ("code_challenge", request.pkce.challenge), ("code_challenge_method", "plain")],
             "invalid_request"),
            ("a 42-character challenge", base + [("response_type", "code"), ("code_challenge", String(repeating: "a", count: 42)), ("code_challenge_method", "S256")],
             "invalid_request"),
            ("a 129-character challenge", base + [("response_type", "code"), ("code_challenge", String(repeating: "a", count: 129)), ("code_challenge_method", "S256")],
             "invalid_request"),
            ("a challenge with padding", base + [("response_type", "code"), ("code_challenge", request.pkce.challenge + "="), ("code_challenge_method", "S256")],
             "invalid_request"),
            ("scope twice", base + [("response_type", "code")] + pkce + [("scope", "openid"), ("scope", "profile")], "invalid_request"),
            ("a scope with two spaces", base + [("response_type", "code")] + pkce + [("scope", "openid  profile")], "invalid_scope"),
            ("a nonce with a line break", base + [("response_type", "code")] + pkce + [("nonce", "a\nb")], "invalid_request"),
        ]
        for (what, query, error) in cases {
            let answer = try Self.authorize(issuer, query)
            let location = answer.header("location") ?? ""
            let parameters = Self.query(location)
            let toRedirectURI = location.hasPrefix(Self.redirectURI + "?")
            #expect(answer.status == 302 && toRedirectURI, "\(what): \(answer)")
            let given = parameters["error"], echoed = parameters["state"] == request.state, noCode = parameters["code"] == nil
            #expect(given == error && echoed && noCode, "\(what)")
            let outcome = AuthorizationRequest.readRedirect(location, expecting: request)
            #expect(outcome == .denied(error: error, description: parameters["error_description"]), "\(what): read as a denial")
        }
        let stateless = try Self.authorize(issuer, [("client_id", "tokenbroker"), ("redirect_uri", Self.redirectURI), ("response_type", "code")] + pkce)
        let parameters = Self.query(stateless.header("location") ?? "")
        let given = parameters["error"], noState = parameters["state"] == nil, noCode = parameters["code"] == nil
        #expect(stateless.status == 302 && given == "invalid_request" && noState && noCode, "no state: invalid_request, and no state in the redirect")
    }

    @Test("metadata lists the authorization endpoint, S256 and the authorization_code grant; discovery reads them, and endpoint policy applies to the authorization endpoint")
    func metadata() async throws {
        let issuer = try Self.issuer()
        defer { issuer.stop() }
        let answer = try DevIssuerDPoPTests.exchange(port: issuer.port, method: "GET", target: "/.well-known/oauth-authorization-server")
        #expect(answer.json?["authorization_endpoint"]?.stringValue == issuer.authorizationEndpoint)
        #expect(answer.json?["code_challenge_methods_supported"] == ["S256"])
        #expect(answer.json?["grant_types_supported"] == ["refresh_token", "client_credentials", "urn:ietf:params:oauth:grant-type:device_code", "authorization_code",
                                                          "urn:ietf:params:oauth:grant-type:token-exchange", "urn:ietf:params:oauth:grant-type:jwt-bearer"])
        let metadata = try await Discovery.fetch(issuer: issuer.baseURL)
        #expect(metadata.authorizationEndpoint == issuer.authorizationEndpoint && metadata.codeChallengeMethods == ["S256"])

        let configuration = OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("dev-secret"))
        let discovered = HTTPTokenSource(grant: .refreshToken, configuration: configuration, endpoints: nil, issuer: issuer.baseURL)
        #expect(try await discovered.endpoints().authorization == issuer.authorizationEndpoint)
        // Every other endpoint explicit: a refresh does not discover for the authorization endpoint, a login does.
        let explicit = OAuthEndpoints(token: issuer.tokenEndpoint, revocation: issuer.revocationEndpoint, deviceAuthorization: issuer.deviceAuthorizationEndpoint)
        let configured = HTTPTokenSource(grant: .refreshToken, configuration: configuration, endpoints: explicit, issuer: issuer.baseURL)
        let before = issuer.counters.metadataRequests
        #expect(try await configured.endpoints().authorization == nil && issuer.counters.metadataRequests == before)
        let seen = try await configured.codeLoginServer()
        #expect(seen.authorizationEndpoint == issuer.authorizationEndpoint && seen.issuer == issuer.baseURL && seen.issuerInRedirect,
                "the dev issuer's metadata promises iss on its redirects (RFC 9207)")
        let none = HTTPTokenSource(grant: .refreshToken, configuration: configuration, endpoints: explicit, issuer: nil)
        await #expect(throws: FetchFailure.terminal("client configuration: no authorization endpoint (set AuthorizationEndpoint= or Issuer=)")) {
            try await none.codeLoginServer()
        }

        // Metadata that points the authorization endpoint at http:// off loopback is refused by a
        // login; a refresh, which never sends anything there, is not held up by it.
        let placeholder = try LoopbackHTTPServer { _ in .respond(status: 404, headers: [], body: []) }
        let port = placeholder.port
        placeholder.stop()
        let server = try LoopbackHTTPServer(port: port) { _ in
            .respond(status: 200, headers: [("Content-Type", "application/json")], body: Array("""
                {"issuer":"http://127.0.0.1:\(port)","token_endpoint":"http://127.0.0.1:\(port)/token",
                 "authorization_endpoint":"http://192.0.2.1/authorize","code_challenge_methods_supported":["S256","plain"]}
                """.utf8))
        }
        defer { server.stop() }
        let hostile = HTTPTokenSource(grant: .refreshToken, configuration: configuration, endpoints: nil, issuer: "http://127.0.0.1:\(port)")
        #expect(try await hostile.endpoints().token == "http://127.0.0.1:\(port)/token")
        let refused = await #expect(throws: FetchFailure.self) { try await hostile.codeLoginServer() }
        #expect(refused?.reason.hasPrefix("refused authorization endpoint: http:// is allowed only for loopback") == true)
        let read = try await Discovery.fetch(issuer: "http://127.0.0.1:\(port)")
        #expect(read.codeChallengeMethods == ["S256", "plain"] && !read.issuerInAuthorizationResponse)

        // A server whose PKCE methods do not include S256 cannot be logged in with.
        let plainOnly = try LoopbackHTTPServer { request in
            .respond(status: 200, headers: [("Content-Type", "application/json")], body: Array("""
                {"issuer":"\(request.header("host").map { "http://" + $0 } ?? "")","token_endpoint":"http://127.0.0.1:1/token",
                 "authorization_endpoint":"http://127.0.0.1:1/authorize","code_challenge_methods_supported":["plain"]}
                """.utf8))
        }
        defer { plainOnly.stop() }
        let weak = HTTPTokenSource(grant: .refreshToken, configuration: configuration, endpoints: nil, issuer: "http://127.0.0.1:\(plainOnly.port)")
        await #expect(throws: FetchFailure.terminal("the server's metadata lists no S256 among its PKCE methods (code_challenge_methods_supported)")) {
            try await weak.codeLoginServer()
        }
    }

    @Test("an authorization endpoint whose own query sets a parameter the request sends, or does not decode, is refused; another query is kept")
    func endpointQuery() {
        #expect(AuthorizationRequest.endpointQueryProblem("https://as.example/authorize") == nil)
        #expect(AuthorizationRequest.endpointQueryProblem("https://as.example/authorize?tenant=a&prompt=login") == nil)
        #expect(AuthorizationRequest.endpointQueryProblem("https://as.example/authorize?tenant=a&redirect_uri=https://evil")
                == "its own query sets redirect_uri, which the login sends itself")
        #expect(AuthorizationRequest.endpointQueryProblem("https://as.example/authorize?st%61te=x") == "its own query sets state, which the login sends itself")
        #expect(AuthorizationRequest.endpointQueryProblem("https://as.example/authorize?%zz=1") == "its own query has a malformed parameter")
    }

    @Test("RFC 9207: with the issuer named, a redirect's iss must be it; with iss promised by the metadata, a redirect without one is refused; without an issuer to compare, iss is ignored")
    func issuerInRedirect() {
        let request = AuthorizationRequest(redirectURI: Self.redirectURI, issuer: "https://as.example", issuerRequired: true)
        func redirect(_ extra: String) -> String { Self.redirectURI + "?code=c1&state=\(request.state)" + extra }
        #expect(AuthorizationRequest.readRedirect(redirect("&iss=https%3A%2F%2Fas.example"), expecting: request) == .code(Secret("c1")))
        #expect(AuthorizationRequest.readRedirect(redirect("&iss=https%3A%2F%2Fevil.example"), expecting: request)
                == .invalid("the redirect's iss names another issuer (RFC 9207 mix-up defence)", answersLogin: true))
        #expect(AuthorizationRequest.readRedirect(redirect(""), expecting: request)
                == .invalid("the redirect has no iss, which the server's metadata says it always sends (RFC 9207)", answersLogin: true))
        let optional = AuthorizationRequest(redirectURI: Self.redirectURI, state: request.state, nonce: request.nonce, pkce: request.pkce,
                                            issuer: "https://as.example")
        #expect(AuthorizationRequest.readRedirect(redirect(""), expecting: optional) == .code(Secret("c1")))
        #expect(AuthorizationRequest.readRedirect(redirect("&iss=x"), expecting: optional) != .code(Secret("c1")))
        let unnamed = AuthorizationRequest(redirectURI: Self.redirectURI, state: request.state, nonce: request.nonce, pkce: request.pkce,
                                           issuerRequired: true)
        #expect(AuthorizationRequest.readRedirect(redirect("&iss=anything"), expecting: unnamed) == .code(Secret("c1")))
        // An error answer from another issuer is not believed either.
        #expect(AuthorizationRequest.readRedirect(Self.redirectURI + "?error=access_denied&state=\(request.state)&iss=https%3A%2F%2Fevil.example",
                                                  expecting: request) == .invalid("the redirect's iss names another issuer (RFC 9207 mix-up defence)", answersLogin: true))
    }

    @Test("HMAC-SHA-256 of the ID token's signature: RFC 4231 cases 2 and 6 (a key longer than a block)")
    func hmac() {
        func hex(_ bytes: [UInt8]) -> String { bytes.map { String($0, radix: 16).count == 1 ? "0" + String($0, radix: 16) : String($0, radix: 16) }.joined() }
        #expect(hex(DevIssuer.hmacSHA256(key: Array("Jefe".utf8), Array("what do ya want for nothing?".utf8)))
                == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843")
        #expect(hex(DevIssuer.hmacSHA256(key: [UInt8](repeating: 0xAA, count: 131), Array("Test Using Larger Than Block-Size Key - Hash Key First".utf8)))
                == "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54")
    }
}

/// The client's pieces without a server: PKCE, the authorization URL, `readRedirect` (unit cases
/// and fuzzing), ID token claims.
@Suite("Authorization code: PKCE, request URL, redirect reading")
struct AuthorizationRedirectTests {
    static let state = "Kq3vN0cZ7rT1yXw9uB4mE6sH2jL8pD5fG0aQiVoYtRn"
    static let request = AuthorizationRequest(redirectURI: "http://127.0.0.1:8123/callback", state: state, nonce: "n-0S",
                                              pkce: PKCE(verifier: Secret("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk")))

    @Test("PKCE: RFC 7636 appendix B's example; fresh pairs are 43 base64url characters, S256, each new; requests have fresh state and nonce")
    func pkce() {
        #expect(Self.request.pkce.challenge == "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM")
        let first = PKCE.make(), second = PKCE.make()
        #expect(first.verifier.reveal.utf8.count == 43 && DevIssuer.isPKCEValue(first.verifier.reveal, base64url: true))
        #expect(first.verifier != second.verifier && first.challenge == PKCE.challenge(of: first.verifier.reveal) && PKCE.method == "S256")
        let a = AuthorizationRequest(redirectURI: "http://127.0.0.1:1/cb"), b = AuthorizationRequest(redirectURI: "http://127.0.0.1:1/cb")
        #expect(a.state.utf8.count == 43 && a.nonce.utf8.count == 43 && a.state != b.state && a.nonce != b.nonce && a.state != a.nonce)
    }

    @Test("the authorization URL: every parameter percent-encoded (a space as %20), the endpoint's own query kept")
    func url() {
        let url = Self.request.url(authorizationEndpoint: "https://as.example/authorize", clientID: "my client/1", scope: "openid profile email")
        #expect(url == "https://as.example/authorize?response_type=code&client_id=my%20client%2F1"
                + "&redirect_uri=http%3A%2F%2F127.0.0.1%3A8123%2Fcallback&state=\(Self.state)"
                + "&code_challenge=E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM&code_challenge_method=S256&scope=openid%20profile%20email&nonce=n-0S")
        let kept = Self.request.url(authorizationEndpoint: "https://as.example/authorize?tenant=a", clientID: "c", scope: nil)
        #expect(kept.hasPrefix("https://as.example/authorize?tenant=a&response_type=code&client_id=c&") && !kept.contains("scope="))
        #expect(Self.request.url(authorizationEndpoint: "https://as.example/authorize?", clientID: "c", scope: nil)
                    .hasPrefix("https://as.example/authorize?response_type=code&"))
    }

    @Test("readRedirect: what it takes")
    func accepted() {
        let state = Self.state
        let cases: [(String, RedirectOutcome)] = [
            ("/callback?code=abc&state=\(state)", .code(Secret("abc"))),
            ("http://127.0.0.1:8123/callback?state=\(state)&code=abc&iss=http%3A%2F%2F127.0.0.1%3A9000&session_state=x", .code(Secret("abc"))),
            ("  http://127.0.0.1:8123/callback?code=abc&state=\(state)\r\n", .code(Secret("abc"))),
            ("/callback?code=dev-ac.x%2B%2F%3D&state=\(state)", .code(Secret("dev-ac.x+/="))),
            ("/callback?co%64e=abc&state=\(state)", .code(Secret("abc"))),
            ("/callback?error=access_denied&state=\(state)", .denied(error: "access_denied", description: nil)),
            ("/callback?error=server_error&error_description=User+said+%22no%22%0A%1B%5B31m%E2%80%AE&state=\(state)",
             .denied(error: "server_error", description: "User said \"no\" [31m")),
            ("/callback?error=access_denied&error_description=%0A%0A&state=\(state)", .denied(error: "access_denied", description: nil)),
        ]
        for (index, (target, expected)) in cases.enumerated() {
            #expect(AuthorizationRequest.readRedirect(target, expecting: Self.request) == expected, "case \(index)")
        }
        let long = "/callback?error=access_denied&error_description=" + String(repeating: "x", count: 500) + "&state=\(state)"
        guard case let .denied(_, description?) = AuthorizationRequest.readRedirect(long, expecting: Self.request) else {
            Issue.record("a long description")
            return
        }
        #expect(description.unicodeScalars.count == OAuthClient.longestDescription + 1 && description.hasSuffix("…"))
    }

    @Test("readRedirect: what it refuses, each with a reason that repeats nothing of the input")
    func refused() {
        let state = Self.state
        let other = String(state.dropLast()) + "m"
        let many = (0..<32).map { "p\($0)=1" }.joined(separator: "&")
        let cases: [(String, String)] = [
            ("/other?code=abc&state=\(state)", "the redirect is not to the login's redirect URI"),
            ("/callback/?code=abc&state=\(state)", "the redirect is not to the login's redirect URI"),
            ("/callbackx?code=abc&state=\(state)", "the redirect is not to the login's redirect URI"),
            ("/Callback?code=abc&state=\(state)", "the redirect is not to the login's redirect URI"),
            ("http://127.0.0.1:8124/callback?code=abc&state=\(state)", "the redirect is not to the login's redirect URI"),
            ("https://127.0.0.1:8123/callback?code=abc&state=\(state)", "the redirect is not to the login's redirect URI"),
            ("http://127.0.0.1:8123@evil.example/callback?code=abc&state=\(state)", "the redirect is not to the login's redirect URI"),
            ("callback?code=abc&state=\(state)", "the redirect is not to the login's redirect URI"),
            ("", "the redirect is not to the login's redirect URI"),
            ("/callback", "the redirect has no query"),
            ("/callback?", "the redirect has a parameter without a value"),
            ("/callback?code=abc&state=\(state)&", "the redirect has a parameter without a value"),
            ("/callback?code=abc&flag&state=\(state)", "the redirect has a parameter without a value"),
            ("/callback?code=abc&=x&state=\(state)", "the redirect has a malformed parameter"),
            ("/callback?code=a%zzb&state=\(state)", "the redirect has a malformed parameter"),
            ("/callback?code=a%4&state=\(state)", "the redirect has a malformed parameter"),
            ("/callback?state=\(state)&code=abc%", "the redirect has a malformed parameter"),
            ("/callback?code=abc&x=%FF&state=\(state)", "the redirect has a malformed parameter"),
            ("/callback?code=abc&state=\(other)", "the redirect's state is not the login's"),
            ("/callback?code=abc&state=\(state.dropLast())", "the redirect's state is not the login's"),
            ("/callback?code=abc&state=\(state)x", "the redirect's state is not the login's"),
            ("/callback?code=abc&state=", "the redirect's state is not the login's"),
            ("/callback?code=abc", "the redirect has no state"),
            ("/callback?code=abc&STATE=\(state)", "the redirect has no state"),
            ("/callback?state=\(state)", "the redirect has no code"),
            ("/callback?code=&state=\(state)", "the redirect's code is not visible ASCII of at most 2048 bytes"),
            ("/callback?code=a%0Ab&state=\(state)", "the redirect's code is not visible ASCII of at most 2048 bytes"),
            ("/callback?code=a+b&state=\(state)", "the redirect's code is not visible ASCII of at most 2048 bytes"),
            ("/callback?code=\(String(repeating: "c", count: 2049))&state=\(state)", "the redirect's code is not visible ASCII of at most 2048 bytes"),
            ("/callback?code=abc&code=abc&state=\(state)", "the redirect repeats a parameter"),
            ("/callback?code=abc&state=\(state)&state=\(state)", "the redirect repeats a parameter"),
            ("/callback?code=abc&st%61te=\(state)&state=\(state)", "the redirect repeats a parameter"),
            ("/callback?code=abc&error=access_denied&state=\(state)", "the redirect has both a code and an error"),
            ("/callback?error=access%20denied&state=\(state)", "the redirect's error is not a short plain code"),
            ("/callback?error=%3Cscript%3E&state=\(state)", "the redirect's error is not a short plain code"),
            ("/callback?error=&state=\(state)", "the redirect's error is not a short plain code"),
            ("/callback?error=\(String(repeating: "e", count: 65))&state=\(state)", "the redirect's error is not a short plain code"),
            ("/callback?code=abc&state=\(state)#x", "the redirect has a fragment"),
            ("/callback?code=a b&state=\(state)", "the redirect has spaces, control or non-ASCII characters"),
            ("/callback?code=a\u{01}b&state=\(state)", "the redirect has spaces, control or non-ASCII characters"),
            ("/callback?code=a\u{7F}b&state=\(state)", "the redirect has spaces, control or non-ASCII characters"),
            ("/callback?code=é&state=\(state)", "the redirect has spaces, control or non-ASCII characters"),
            ("/callback?code=abc&state=\(state)\0", "the redirect has spaces, control or non-ASCII characters"),
            ("/callback?code=abc&state=\(state)&pad=" + String(repeating: "x", count: 8192), "the redirect is longer than 8192 bytes"),
            ("/callback?\(many)&code=abc&state=\(state)", "the redirect has more than 32 parameters"),
        ]
        // (Past the state check, a refusal answers the login: it carried the login's state.)
        let pastState = ["the redirect has no code", "the redirect's code is not visible ASCII of at most 2048 bytes",
                         "the redirect has both a code and an error", "the redirect's error is not a short plain code"]
        for (index, (target, reason)) in cases.enumerated() {
            #expect(AuthorizationRequest.readRedirect(target, expecting: Self.request) == .invalid(reason, answersLogin: pastState.contains(reason)),
                    "case \(index)")
        }
        // 32 parameters are allowed.
        let most = (0..<30).map { "p\($0)=1" }.joined(separator: "&")
        #expect(AuthorizationRequest.readRedirect("/callback?\(most)&code=abc&state=\(state)", expecting: Self.request) == .code(Secret("abc")))
        // A request whose redirect URI readRedirect cannot match.
        for uri in ["http://127.0.0.1:8123/callback?x=1", "http://127.0.0.1:8123", "127.0.0.1:8123/callback", "http:///callback"] {
            let unusable = AuthorizationRequest(redirectURI: uri, state: state, nonce: "n", pkce: .make())
            #expect(AuthorizationRequest.readRedirect("/callback?code=abc&state=\(state)", expecting: unusable)
                    == .invalid("the login's redirect URI is not an http(s) URL with a path and no query or fragment"), "\(uri)")
        }
    }

    @Test("ID token claims: read unverified from a compact JWS, bounded; anything else is unreadable")
    func idTokenClaims() throws {
        func jwt(_ header: String, _ payload: String, signature: String = "c2ln") -> Secret {
            Secret(Base64.urlEncode(Array(header.utf8)) + "." + Base64.urlEncode(Array(payload.utf8)) + "." + signature)
        }
        let header = #"{"alg":"HS256"}"#
        let claims = IDTokenClaims.read(jwt(header, #"{"iss":"https://as.example","aud":["a","b"],"sub":"u","nonce":"n","exp":5}"#))
        #expect(claims == IDTokenClaims(issuer: "https://as.example", audiences: ["a", "b"], subject: "u", nonce: "n", expiresAt: 5))
        #expect(IDTokenClaims.read(jwt(header, #"{"aud":"a"}"#))?.audiences == ["a"])
        #expect(IDTokenClaims.read(jwt(header, "{}")) == IDTokenClaims(issuer: nil, audiences: [], subject: nil, nonce: nil, expiresAt: nil))
        let unreadable: [Secret] = [
            Secret(""), Secret("a.b"), Secret("a.b.c.d.e"), Secret("%%%.e30.c2ln"),
            jwt("{}", "{}"), jwt("[]", "{}"), jwt(header, "[]"), jwt(header, "not json"),
            jwt(header, #"{"nonce":5}"#), jwt(header, #"{"aud":["a",1]}"#), jwt(header, #"{"aud":{}}"#), jwt(header, #"{"exp":"soon"}"#),
            jwt(header, #"{"iss":null}"#), jwt(header, #"{"nonce":"n","x":""#),
            jwt(header, #"{"nonce":""# + String(repeating: "n", count: IDTokenClaims.longestToken) + #""}"#),
        ]
        for (index, token) in unreadable.enumerated() { #expect(IDTokenClaims.read(token) == nil, "case \(index)") }

        // A token answer keeps an id_token (bounded) and never shows it.
        func answer(_ idToken: String) throws -> FetchedToken {
            try OAuthClient.parseToken(HTTPResponse(status: 200, headers: [], body: JSON.object([
                "access_token": "a", "token_type": "Bearer", "id_token": .string(idToken)]).encoded, retryAfter: nil))
        }
        let kept = try answer(jwt(header, #"{"nonce":"n"}"#).reveal)
        #expect(kept.idToken != nil && "\(kept.idToken!)" == "<redacted>")
        #expect(try answer(String(repeating: "x", count: IDTokenClaims.longestToken + 1)).idToken == nil)
        #expect(try answer("").idToken == nil)
        let problem = Self.request.idTokenProblem(in: try answer("x.y.z"), clientID: "c", issuer: nil)
        #expect(problem == "the id_token is not a readable JWT")
        #expect(Self.request.idTokenProblem(in: try answer(jwt(header, #"{"aud":"c"}"#).reveal), clientID: "c", issuer: nil) == "the id_token has no nonce")
    }

    // MARK: - Fuzzing

    /// What a redirect says, by an independent reading of the rules (for the differential fuzz).
    enum Reading: Equatable {
        case code(String)
        case denied(String)
        case invalid
    }

    /// The rules of `readRedirect` read plainly, on characters rather than bytes where it can.
    static func reference(_ input: String, state expected: String) -> Reading {
        guard input.utf8.count <= 8192 else { return .invalid }
        var scalars = Substring(input).unicodeScalars
        while let first = scalars.first, first == " " || first == "\t" || first == "\r" || first == "\n" { scalars.removeFirst() }
        while let last = scalars.last, last == " " || last == "\t" || last == "\r" || last == "\n" { scalars.removeLast() }
        guard scalars.allSatisfy({ (0x21...0x7E).contains($0.value) && $0 != "#" }) else { return .invalid }
        let text = String(scalars)
        let halves = text.split(separator: "?", maxSplits: 1, omittingEmptySubsequences: false)
        guard halves[0] == "/callback" || halves[0] == "http://127.0.0.1:8123/callback", halves.count == 2 else { return .invalid }
        let pairs = halves[1].split(separator: "&", omittingEmptySubsequences: false)
        guard pairs.count <= 32 else { return .invalid }
        func decode(_ part: Substring) -> String? {
            var bytes: [UInt8] = []
            let characters = Array(part)
            var index = 0
            while index < characters.count {
                if characters[index] == "%" {
                    guard index + 2 < characters.count, characters[index + 1].isHexDigit, characters[index + 2].isHexDigit,
                          let value = UInt8(String(characters[(index + 1)...(index + 2)]), radix: 16) else { return nil }
                    bytes.append(value)
                    index += 3
                } else {
                    bytes += characters[index] == "+" ? [0x20] : Array(String(characters[index]).utf8)
                    index += 1
                }
            }
            return String(validating: bytes, as: UTF8.self)
        }
        var parameters: [String: String] = [:]
        for pair in pairs {
            let sides = pair.split(separator: "=", maxSplits: 1, omittingEmptySubsequences: false)
            guard sides.count == 2, let name = decode(sides[0]), !name.isEmpty, let value = decode(sides[1]), parameters[name] == nil else { return .invalid }
            parameters[name] = value
        }
        guard parameters["state"] == expected else { return .invalid }
        if let error = parameters["error"] {
            let plain = !error.isEmpty && error.count <= 64 && error.allSatisfy { $0.isASCII && ($0.isLetter || $0.isNumber || "_-.".contains($0)) }
            return parameters["code"] == nil && plain ? .denied(error) : .invalid
        }
        guard let code = parameters["code"], !code.isEmpty, code.utf8.count <= 2048,
              code.unicodeScalars.allSatisfy({ (0x21...0x7E).contains($0.value) }) else { return .invalid }
        return .code(code)
    }

    static func reading(_ outcome: RedirectOutcome) -> Reading {
        switch outcome {
        case let .code(code): return .code(code.reveal)
        case let .denied(error, _): return .denied(error)
        case .invalid: return .invalid
        }
    }

    /// One random change to a redirect.
    static func mutate(_ input: String, _ random: inout SeededRandom) -> String {
        var bytes = Array(input.utf8)
        func position() -> Int { bytes.isEmpty ? 0 : Int(random.next() % UInt64(bytes.count + 1)) }
        let pieces = ["%", "&", "=", "?", "#", "+", " ", "\0", "\n", "\u{7F}", "é", "/", "%2", "%zz", "%00", "%FF", "%26", "%3D", "state=", "code=",
                      "&state=" + state, "&code=other", "&error=access_denied", "&error=bad%20code", "&iss=x", "http://127.0.0.1:8123", "\r\n"]
        switch random.next() % 12 {
        case 0 where !bytes.isEmpty:
            bytes[Int(random.next() % UInt64(bytes.count))] = UInt8(truncatingIfNeeded: random.next())
        case 1:
            bytes.insert(contentsOf: Array(random.pick(pieces).utf8), at: position())
        case 2 where !bytes.isEmpty:
            let start = Int(random.next() % UInt64(bytes.count))
            bytes.removeSubrange(start..<min(bytes.count, start + 1 + Int(random.next() % 8)))
        case 3:
            // A parameter twice, or two swapped (the latter keeps it valid).
            var parts = input.split(separator: "?", maxSplits: 1).map(String.init)
            guard parts.count == 2 else { break }
            var pairs = parts[1].split(separator: "&", omittingEmptySubsequences: false).map(String.init)
            let a = Int(random.next() % UInt64(pairs.count)), b = Int(random.next() % UInt64(pairs.count))
            if random.next() % 2 == 0 { pairs.append(pairs[a]) } else { pairs.swapAt(a, b) }
            parts[1] = pairs.joined(separator: "&")
            return parts.joined(separator: "?")
        case 4 where !bytes.isEmpty:
            // Percent-encode one byte (the same redirect, written otherwise, unless it is a `?`, `&`, `=` or `%`).
            let index = Int(random.next() % UInt64(bytes.count))
            let hex = String(bytes[index], radix: 16, uppercase: random.next() % 2 == 0)
            bytes.replaceSubrange(index...index, with: Array(("%" + (hex.count == 1 ? "0" : "") + hex).utf8))
        case 5:
            // The state, one character off.
            if let range = input.firstRange(of: state) {
                var changed = input
                let offset = Int(random.next() % UInt64(state.count))
                let index = changed.index(range.lowerBound, offsetBy: offset)
                changed.replaceSubrange(index...index, with: random.pick(["A", "b", "0", "-", "_", "%41", ""]))
                return changed
            }
        case 6:
            bytes = Array(bytes.prefix(position()))
        case 7:
            for _ in 0..<Int(random.next() % 400) { bytes += Array("&pad=\(random.next() % 1000)".utf8) }
        case 8:
            return input.replacing("/callback", with: random.pick(["/callback/", "/cb", "", "/callback%3F", "/CALLBACK", "//callback"]), maxReplacements: 1)
        case 9:
            return random.pick([" ", "\t", "\n", "\r\n", "x", "\0"]) + input + random.pick([" ", "\n", "", "#", "&"])
        case 10:
            return input.replacing(random.pick(["code=", "state=", "error=", "="]), with: random.pick(["", "Code=", "code%3D", "state=x&state=", "=="]),
                                   maxReplacements: 1)
        default:
            break
        }
        return String(decoding: bytes, as: UTF8.self)
    }

    @Test("fuzz: seeded mutations of valid redirects never trap, and readRedirect agrees with an independent reading (only a valid redirect with the login's state yields a code)")
    func fuzz() {
        let iterations = SeededRandom.iterations(default: 10_000)
        let seed = SeededRandom.seed()
        print("redirect fuzz: \(iterations) redirects, TB_FUZZ_SEED=\(seed)")
        var random = SeededRandom(seed: seed)
        let state = Self.state
        let seeds = [
            "/callback?code=dev-ac.Abc%2B%2F%3D&state=\(state)",
            "http://127.0.0.1:8123/callback?state=\(state)&code=dev-ac.Q9&iss=http%3A%2F%2F127.0.0.1%3A9000",
            "/callback?error=access_denied&error_description=The+user+said+no&state=\(state)",
        ]
        var outcomes = (codes: 0, denials: 0, refusals: 0)
        var disagreements = 0
        for iteration in 0..<iterations {
            var input = random.pick(seeds)
            for _ in 0...Int(random.next() % 3) { input = Self.mutate(input, &random) }
            let outcome = AuthorizationRequest.readRedirect(input, expecting: Self.request)
            switch outcome {
            case .code: outcomes.codes += 1
            case .denied: outcomes.denials += 1
            case let .invalid(reason, _):
                outcomes.refusals += 1
                // A reason never repeats the input (no code, no state).
                if reason.contains("dev-ac") || reason.contains(state) { Issue.record("iteration \(iteration): the reason repeats the input") }
            }
            if Self.reading(outcome) != Self.reference(input, state: state) {
                disagreements += 1
                if disagreements <= 5 { Issue.record("iteration \(iteration) (TB_FUZZ_SEED=\(seed)): readRedirect and the reference disagree") }
            }
        }
        print("redirect fuzz: \(outcomes.codes) codes, \(outcomes.denials) denials, \(outcomes.refusals) refusals")
        #expect(disagreements == 0)
        #expect(outcomes.refusals > iterations / 4 && outcomes.codes + outcomes.denials > 0, "the mutations reach both sides")
    }
}
