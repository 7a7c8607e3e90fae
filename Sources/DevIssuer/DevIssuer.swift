#if canImport(Glibc)
import Glibc
#endif
import Basics
import Dispatch
import DPoP
import Synchronization
import WireJSON

/// A small OAuth 2.0 authorization server on loopback HTTP/1.1, for development and tests.
///
/// - Refresh-token rotation with reuse detection: every refresh answers a new refresh token
///   and retires the old one; presenting a retired one revokes its whole family (RFC 9700
///   §4.14.2), so the legitimate holder's newest token dies too.
/// - `client_credentials`, the device flow (RFC 8628) with an approve hook, revocation
///   (RFC 7009), metadata (RFC 8414), and a protected resource at `/resource` that answers 200
///   for a valid token and 401 `invalid_token` otherwise.
/// - RFC 8693 token exchange and RFC 8707 resource indicators, with scope narrowing
///   (`DevIssuer+Exchange`): tokens restricted to the audiences and resources asked for.
/// - Counters per grant, and faults injected into the next token requests.
/// - DPoP (RFC 9449) when `Options.dpop` asks for it: proofs checked at the token endpoint and
///   the resource, refresh token families and access tokens bound to the proof's key, and
///   server nonces (§8, §9) on request.
/// - The authorization code grant with PKCE (RFC 6749 §4.1, RFC 7636 S256 only) for native apps
///   (RFC 8252: any loopback redirect URI, any port), with scripted consent (`Options.consent`),
///   single-use codes (a second redemption revokes what the first gave), and an OpenID Connect
///   ID token carrying the request's `nonce` when the scope has `openid`.
/// - The JWT-bearer grant (RFC 7523 §2.1) for identity tokens of trusted platforms
///   (`DevIssuer+ClientAssertion`).
///
/// Clients authenticate with `client_secret_basic`, `client_secret_post`, or `private_key_jwt`
/// (RFC 7523 §2.2: a JWT signed with a key registered for the client, or a trusted platform's
/// identity token federated to the client).
public final class DevIssuer: Sendable {
    /// How the issuer treats DPoP proofs (RFC 9449).
    public enum DPoPMode: Sendable {
        /// No DPoP: a `DPoP` header is ignored and every token is a Bearer token.
        case off
        /// A token request with a `DPoP` proof gets DPoP-bound tokens, one without gets Bearer
        /// tokens; an invalid proof is refused.
        case accepted
        /// Every token request must carry a valid proof (400 `invalid_dpop_proof` otherwise).
        case required
    }

    public struct Options: Sendable {
        public var port: UInt16 = 0
        public var accessTokenLifetime: Duration = .seconds(3600)
        /// Access tokens end at the whole second their request arrived in plus the lifetime, as
        /// servers that compute expiry in whole seconds do (else at the arrival itself plus it).
        public var wholeSecondExpiry = false
        /// Registered clients: id → secret.
        public var clients: [String: String] = ["tokenbroker": "dev-secret"]
        /// Polling interval the device flow asks for.
        public var deviceInterval: Duration = .seconds(5)
        public var deviceExpiresIn: Duration = .seconds(600)
        /// The device grant's two requests must carry `client_id` in the form, whatever the client
        /// authentication, as oauthlib (django-oauth-toolkit) requires; refused with its own words.
        public var deviceRequiresClientIDInBody = false
        /// Revoking a refresh token that has been rotated already ends its family (lenient), or,
        /// as many servers do, changes nothing: the family lives on through the newer token.
        public var revokingARotatedTokenEndsItsFamily = true
        /// Whether token requests may or must carry DPoP proofs (and tokens are bound to their key).
        public var dpop: DPoPMode = .off
        /// With `dpop` on, the token endpoint and the resource each demand a proof with their
        /// current server nonce (`use_dpop_nonce` and a `DPoP-Nonce` header otherwise), and
        /// name it in a `DPoP-Nonce` header on every answer.
        public var dpopNonces = false
        /// How `GET /authorize` answers a valid request: at once with a code, at once with
        /// `access_denied`, or with a page, the decision coming later (`approveAuthorization`,
        /// `denyAuthorization`, `GET /authorize/decide`).
        public var consent: Consent = .approve
        /// How long an authorization code can be redeemed (RFC 6749 §4.1.2 suggests at most 10 minutes).
        public var authorizationCodeLifetime: Duration = .seconds(60)
        /// Redirect URIs each client registered (exact strings), taken besides any loopback one
        /// (`http://127.0.0.1[:PORT]/…`, `http://[::1][:PORT]/…`, any port: RFC 8252 §7.3).
        public var redirectURIs: [String: [String]] = [:]
        /// Clients that authenticate with `private_key_jwt`: id → their public JWKs (replaced at
        /// run time by `registerClientKeys`).
        public var clientKeys: [String: [JSONObject]] = [:]
        /// Platforms whose identity tokens are taken as client assertions (when federated) and
        /// by the JWT-bearer grant: issuer → its public JWKs.
        public var trustedIssuers: [String: [JSONObject]] = [:]
        /// Federated clients: `"<iss> <sub>"` of a platform identity → the client it authenticates.
        public var federatedClients: [String: String] = [:]
        /// Which `aud` a client assertion or a JWT-bearer assertion must name.
        public var assertionAudience: AssertionAudience = .issuer
        /// The JWS algorithms of assertions accepted (and advertised as
        /// `token_endpoint_auth_signing_alg_values_supported`); among ES256, RS256 and PS256.
        public var assertionSigningAlgorithms: [String] = ["ES256", "RS256", "PS256"]
        /// How far ahead of now a client's own assertion may expire (RFC 7523 §3 leaves it to
        /// the server; short-lived, as each is used once).
        public var assertionMaximumLifetime: Duration = .seconds(600)
        /// How far ahead of now a platform's identity token may expire, as a federated client
        /// assertion or a JWT-bearer assertion: 48 hours, the longest a Kubernetes projected
        /// service-account token lives (its default is an hour; platforms reuse one until renewed).
        public var platformAssertionMaximumLifetime: Duration = .seconds(48 * 3600)

        public init() {}
    }

    /// The resource owner's answer to an authorization request, scripted.
    public enum Consent: Sendable, Equatable {
        /// Redirect with a code at once.
        case approve
        /// Redirect with `error=access_denied` at once.
        case deny
        /// Answer 200 with a page and keep the request until it is approved or denied.
        case ask
    }

    /// A fault applied to the next token endpoint request (one fault per request, in order).
    public enum Fault: Sendable, Equatable {
        /// Answer after this delay.
        case delay(Duration)
        /// Answer with this status and a JSON OAuth error (`nil`: an empty body), and
        /// optionally `Retry-After`.
        case status(Int, error: String?, retryAfter: Int?)
        /// Answer with this status, an OAuth error and its `error_description`.
        case described(Int, error: String, description: String)
        /// 200 with a body that is not JSON.
        case malformedBody
        /// Close the connection without answering, *after* processing the request (a lost
        /// answer: a rotation the client never sees).
        case dropAfterProcessing
        /// Answer one byte at a time, this far apart.
        case trickle(Duration)
        /// Hold the request until `releaseHeld()` (then process it normally).
        case hold
        /// Process the request (a refresh rotates), then hold the answer until `releaseHeld()`:
        /// an issuer that answers late after rotating.
        case holdAfterProcessing
        /// The next successful token answer that binds an access token to a DPoP key binds it to
        /// another, made-up thumbprint instead (in its `cnf.jkt` and the issuer's record), so a
        /// client can see the mismatch.
        case bindToOtherKey
        /// The next authorization redirect (a code or an error) carries another `state` than the
        /// request's. Not a token endpoint fault: queued for the authorization endpoint, apart.
        case wrongState
        /// The next ID token carries this `nonce` instead of the authorization request's (taken
        /// by the next token request, like `bindToOtherKey`, and kept for the next ID token).
        case idTokenNonce(String)
    }

    /// Requests per kind, for tests and `/_dev/counters`.
    public struct Counters: Sendable, Equatable {
        public var refreshGrants = 0
        public var clientCredentialsGrants = 0
        public var deviceGrants = 0
        public var deviceAuthorizations = 0
        public var revocations = 0
        public var resourceRequests = 0
        public var metadataRequests = 0
        /// Refresh requests that presented a retired refresh token (each revoked a family).
        public var replays = 0
        /// All token endpoint requests, whatever their outcome.
        public var tokenRequests = 0
        /// Requests refused for their DPoP proof, at the token endpoint and the resource: none,
        /// two, an invalid or replayed one, one by another key than the token's or the refresh
        /// token family's, a bound token without its proof (nonce challenges are not counted).
        public var dpopProofsRefused = 0
        /// `use_dpop_nonce` answers, at the token endpoint and the resource.
        public var dpopNonceChallenges = 0
        /// `GET /authorize` requests, whatever their outcome.
        public var authorizationRequests = 0
        /// `authorization_code` grant requests, whatever their outcome.
        public var codeGrants = 0
        /// Redemptions of a code redeemed before (each revoked what the first gave).
        public var codeReplays = 0
        /// RFC 8693 token exchange requests, whatever their outcome.
        public var tokenExchanges = 0
        /// Requests refused with `invalid_target` or `invalid_scope` (RFC 8707, RFC 6749 §5.2).
        public var narrowingsRefused = 0
        /// Refreshes that narrowed their access token (`resource` or `scope`, RFC 8707 §2.2),
        /// among `refreshGrants`, answered.
        public var narrowedRefreshes = 0
        /// Client assertions accepted (`private_key_jwt`, the client's own or a federated
        /// platform identity).
        public var clientAssertions = 0
        /// Requests refused for their client assertion, replays and a second method included.
        public var clientAssertionsRefused = 0
        /// Client assertions refused because their `jti` was accepted before and is unexpired
        /// (also among `clientAssertionsRefused`).
        public var assertionReplays = 0
        /// JWT-bearer grants (RFC 7523 §2.1) answered with an access token.
        public var jwtBearerGrants = 0
    }

    struct RefreshRecord {
        var family: Int
        /// Position in its family: 0 for the login's token, +1 per rotation.
        var index: Int
        var retired = false
    }

    struct AccessRecord {
        var family: Int?
        var expiresAt: Double
        /// The `expires_in` its answer gives.
        var lifetime: Duration = .zero
        var revoked = false
        /// The thumbprint of the DPoP key the token is bound to (`cnf.jkt`); nil for a Bearer token.
        var jkt: String?
        /// What it is restricted to: the audiences and resources it was asked for (empty: the
        /// client's own), and its scope (nil: every scope the issuer grants).
        var audiences: [String] = []
        var scope: String?
        /// Whom it was issued for, when that is not a client: a JWT-bearer assertion's `sub`.
        var subject: String?
    }

    /// The `jti`s of the proofs one endpoint accepted lately, to refuse a replay: at most
    /// `capacity`, the oldest forgotten first, and any whose `iat` has left the verifier's
    /// window (such a proof is refused for its age anyway).
    struct SeenProofs {
        static let capacity = 10_000
        private var members: Set<String> = []
        /// In arrival order from `head` on (the slots before it are forgotten, compacted now and then).
        private var queue: [(jti: String, issuedAt: Int64)] = []
        private var head = 0

        /// Records `jti`; false if it was seen already.
        mutating func insert(_ jti: String, issuedAt: Int64, now: Int64) -> Bool {
            while head < queue.count, queue.count - head >= Self.capacity || queue[head].issuedAt <= now - DevIssuer.proofWindow {
                members.remove(queue[head].jti)
                head += 1
            }
            if head >= Self.capacity {
                queue.removeFirst(head)
                head = 0
            }
            guard members.insert(jti).inserted else { return false }
            queue.append((jti, issuedAt))
            return true
        }
    }

    struct Device {
        var userCode: String
        var clientID: String
        var state: String = "pending"   // pending, approved, denied
        var expiresAt: Double
        var lastPoll: Double?
        var interval: Double
    }

    /// An authorization request the issuer took (RFC 6749 §4.1.1, RFC 7636 §4.3).
    struct AuthorizationGrant {
        var clientID: String
        var redirectURI: String
        var state: String
        /// The S256 `code_challenge`.
        var challenge: String
        var nonce: String?
        var scope: String?
        var createdAt: Double
    }

    /// A code given for a grant: single use, short-lived.
    struct CodeRecord {
        var grant: AuthorizationGrant
        var expiresAt: Double
        var redeemed = false
        /// The refresh token family its redemption started (revoked if the code comes again).
        var family: Int?
    }

    struct State {
        var refreshTokens: [String: RefreshRecord] = [:]
        var accessTokens: [String: AccessRecord] = [:]
        var revokedFamilies: Set<Int> = []
        var familyClients: [Int: String] = [:]
        var nextFamily = 0
        var devices: [String: Device] = [:]
        var counters = Counters()
        /// Audiences and resources asked for that this issuer refuses (`invalid_target`).
        var refusedTargets: Set<String> = []
        var faults: [Fault] = []
        /// The newest refresh token of each family.
        var newest: [Int: String] = [:]
        var familySize: [Int: Int] = [:]
        var held = 0
        /// `holdGrants`: answers of this grant type still to hold (after processing).
        var grantHolds: [String: Int] = [:]
        var resourceRejectsAll = false
        /// Set by `setAccessTokenLifetime`: the lifetime of tokens minted from then on.
        var accessTokenLifetime: Duration?
        /// The DPoP key's thumbprint each bound refresh token family is bound to.
        var familyJKT: [Int: String] = [:]
        /// The server nonces (RFC 9449 §8, §9), one for the token endpoint, one for the resource.
        var tokenNonce = DevIssuer.random(32)
        var resourceNonce = DevIssuer.random(32)
        var tokenProofs = SeenProofs()
        var resourceProofs = SeenProofs()
        /// A `bindToOtherKey` fault waiting for the next bound access token.
        var bindToOtherKey = false
        /// The authorization codes given, by code (redeemed ones kept a while, to see a replay).
        var codes: [String: CodeRecord] = [:]
        /// Authorization requests waiting for consent (`Consent.ask`), by `state`.
        var pendingConsents: [String: AuthorizationGrant] = [:]
        /// `setConsent`'s answer, in place of `Options.consent`.
        var consent: Consent?
        /// `wrongState` faults waiting for the next authorization redirects.
        var wrongStates = 0
        /// An `idTokenNonce` fault waiting for the next ID token.
        var idTokenNonce: String?
        /// Client keys, trusted platforms and federations: the options', then as registered.
        var registrations = AssertionRegistrations()
        /// The `jti`s of the clients' own assertions accepted and not yet expired.
        var clientAssertionIDs = SeenAssertions()
    }

    /// How long a redeemed code or an undecided request is remembered after it expired (seconds).
    static let authorizationMemory: Double = 600

    /// How far a proof's `iat` may be from now, in seconds, either way.
    static let proofWindow: Int64 = 60

    let options: Options
    let state: Mutex<State>
    private let gate = DispatchSemaphore(value: 0)
    private let server = Mutex<LoopbackHTTPServer?>(nil)
    public let port: UInt16

    public init(options: Options = Options()) throws {
        self.options = options
        var initial = State()
        initial.registrations = AssertionRegistrations(clientKeys: options.clientKeys, trustedIssuers: options.trustedIssuers,
                                                       federatedClients: options.federatedClients)
        state = Mutex(initial)
        let box = HandlerBox()
        let server = try LoopbackHTTPServer(port: options.port) { request in box.handle(request) }
        port = server.port
        self.server.withLock { $0 = server }
        box.issuer.withLock { $0 = self }
    }

    /// Breaks the init-time cycle: the server needs a handler before the issuer exists.
    private final class HandlerBox: Sendable {
        let issuer = Mutex<DevIssuer?>(nil)
        func handle(_ request: HTTPServerRequest) -> HTTPServerAction {
            guard let issuer = issuer.withLock({ $0 }) else { return .drop }
            return issuer.route(request)
        }
    }

    /// `http://127.0.0.1:PORT`, the issuer identifier.
    public var baseURL: String { "http://127.0.0.1:\(port)" }
    public var tokenEndpoint: String { baseURL + "/token" }
    public var revocationEndpoint: String { baseURL + "/revoke" }
    public var deviceAuthorizationEndpoint: String { baseURL + "/device_authorization" }
    public var resourceURL: String { baseURL + "/resource" }
    public var authorizationEndpoint: String { baseURL + "/authorize" }

    public func stop() {
        releaseHeld()
        server.withLock { $0?.stop() }
    }

    // MARK: - Test and development hooks

    /// A new refresh token in a new family, as if `clientID` had completed a login; with a
    /// `thumbprint`, the family is DPoP-bound to that key (as if the login had carried its proof).
    public func issueRefreshToken(clientID: String = "tokenbroker", boundTo thumbprint: String? = nil) -> String {
        state.withLock { state in
            let family = state.nextFamily
            state.nextFamily += 1
            state.familyClients[family] = clientID
            state.familyJKT[family] = thumbprint
            return mintRefresh(&state, family: family)
        }
    }

    /// Gives the token endpoint and the resource new nonces: a proof with an old one is
    /// challenged again (with `dpopNonces` on).
    public func rotateDPoPNonces() {
        state.withLock { state in
            state.tokenNonce = Self.random(32)
            state.resourceNonce = Self.random(32)
        }
    }

    /// The nonce the token endpoint currently demands (with `dpopNonces` on).
    public var currentTokenNonce: String { state.withLock { $0.tokenNonce } }

    /// The nonce the resource currently demands (with `dpopNonces` on).
    public var currentResourceNonce: String { state.withLock { $0.resourceNonce } }

    /// The thumbprint of the DPoP key the issuer bound `token` to (its `cnf.jkt`); nil for a
    /// Bearer token or one it never issued.
    public func thumbprint(ofAccessToken token: String) -> String? {
        state.withLock { $0.accessTokens[token]?.jkt }
    }

    /// Queues faults for the next token endpoint requests (`wrongState` for the next
    /// authorization redirects).
    public func inject(_ faults: [Fault]) {
        state.withLock { state in
            for fault in faults {
                if fault == .wrongState { state.wrongStates += 1 } else { state.faults.append(fault) }
            }
        }
    }

    /// Lets every request held by a `.hold` fault go on.
    public func releaseHeld() {
        let held = state.withLock { state in
            defer { state.held = 0 }
            return state.held
        }
        for _ in 0..<held { gate.signal() }
    }

    /// Holds the answers of the next `count` token requests of one grant type (processed, then
    /// held until `releaseHeld()`), letting the others through: a benchmark's flights in
    /// flight at once without catching a request it did not aim at.
    public func holdGrants(_ grantType: String, count: Int) {
        state.withLock { $0.grantHolds[grantType, default: 0] += count }
    }

    /// Requests currently held.
    public var heldCount: Int { state.withLock { $0.held } }

    /// Refresh tokens that would be honoured now: not rotated, in a family not revoked.
    public var activeRefreshTokens: Int {
        state.withLock { state in state.refreshTokens.values.count { !$0.retired && !state.revokedFamilies.contains($0.family) } }
    }

    public var counters: Counters { state.withLock { $0.counters } }

    /// Approves (or denies) the device login showing `userCode`; false if there is none.
    @discardableResult
    public func decide(userCode: String, approve: Bool) -> Bool {
        state.withLock { state in
            guard let code = state.devices.first(where: { $0.value.userCode == userCode && $0.value.state == "pending" })?.key else { return false }
            state.devices[code]?.state = approve ? "approved" : "denied"
            return true
        }
    }

    /// The user codes waiting for a decision.
    public var pendingUserCodes: [String] {
        state.withLock { $0.devices.values.filter { $0.state == "pending" }.map(\.userCode) }
    }

    /// The newest refresh token of the family `token` belongs to, and whether that family is
    /// revoked (for crash tests: what the issuer last issued).
    public func family(of token: String) -> (newest: String, revoked: Bool)? {
        state.withLock { state in
            guard let family = state.refreshTokens[token]?.family, let newest = state.newest[family] else { return nil }
            return (newest, state.revokedFamilies.contains(family))
        }
    }

    /// Where `token` stands in its family: its position, the newest position (the token the
    /// issuer last issued), and whether the family is revoked.
    public func lineage(of token: String) -> (index: Int, newest: Int, revoked: Bool)? {
        state.withLock { state in
            guard let record = state.refreshTokens[token] else { return nil }
            return (record.index, state.familySize[record.family, default: 1] - 1, state.revokedFamilies.contains(record.family))
        }
    }

    /// How `GET /authorize` answers from now on (in place of `Options.consent`).
    /// The lifetime of the access tokens minted from now on (the options' until this is called).
    public func setAccessTokenLifetime(_ lifetime: Duration) {
        state.withLock { $0.accessTokenLifetime = lifetime }
    }

    public func setConsent(_ consent: Consent) {
        state.withLock { $0.consent = consent }
    }

    /// Approves the authorization request waiting for consent with this `state`: the redirect
    /// URL (to `redirect_uri`, with `code` and `state`) a browser would be sent to; nil if no
    /// request with that state waits.
    @discardableResult
    public func approveAuthorization(state requested: String) -> String? {
        guard let grant = state.withLock({ $0.pendingConsents.removeValue(forKey: requested) }) else { return nil }
        return codeRedirect(grant)
    }

    /// Denies the authorization request waiting with this `state`: the redirect URL with
    /// `error=access_denied`; nil if no request with that state waits.
    @discardableResult
    public func denyAuthorization(state requested: String) -> String? {
        guard let grant = state.withLock({ $0.pendingConsents.removeValue(forKey: requested) }) else { return nil }
        return redirectURL(grant.redirectURI, [("error", "access_denied"), ("error_description", "The user denied the request.")], state: grant.state)
    }

    /// The `state`s of the authorization requests waiting for consent.
    public var pendingAuthorizationStates: [String] {
        state.withLock { Array($0.pendingConsents.keys) }
    }

    /// When an access token this issuer minted ends (Unix seconds), if it minted it.
    public func expiry(ofAccessToken token: String) -> Double? {
        state.withLock { $0.accessTokens[token]?.expiresAt }
    }

    /// Revokes one access token (the resource then answers 401 `invalid_token` for it).
    public func revokeAccessToken(_ token: String) {
        state.withLock { $0.accessTokens[token]?.revoked = true }
    }

    /// Makes the protected resource refuse every token (to test what a worker does with a
    /// second 401).
    public func setResourceRejectsAll(_ value: Bool) {
        state.withLock { $0.resourceRejectsAll = value }
    }

    /// Whether `token` is a live access token.
    public func isValidAccessToken(_ token: String) -> Bool {
        state.withLock { Self.valid(token, in: $0) }
    }

    // MARK: - Routing

    private func route(_ request: HTTPServerRequest) -> HTTPServerAction {
        switch (request.method, request.path) {
        case ("POST", "/token"): return token(request)
        case ("POST", "/device_authorization"): return deviceAuthorization(request)
        case ("POST", "/revoke"): return revoke(request)
        case ("GET", "/.well-known/oauth-authorization-server"), ("GET", "/.well-known/openid-configuration"): return metadata()
        case ("GET", "/resource"), ("POST", "/resource"), ("PUT", "/resource"): return resource(request)
        case ("GET", "/device"): return devicePage(request)
        case ("GET", "/authorize"): return authorize(request)
        case ("GET", "/authorize/decide"): return authorizationDecision(request)
        case ("GET", "/_dev/counters"): return counterReport()
        case ("POST", "/_dev/client-keys"): return clientKeysUpload(request)
        // For benchmarks on the real processes (make bench-derived): the next `count` token
        // requests (of `grant`'s type, if named) are answered, then held until a release; the
        // lifetime of tokens minted from now on; live tokens for a target.
        case ("POST", "/_dev/hold"):
            let count = min(max(request.query.first { $0.0 == "count" }.flatMap { Int($0.1) } ?? 1, 0), 64)
            if let grant = request.query.first(where: { $0.0 == "grant" })?.1 {
                holdGrants(String(grant.prefix(128)), count: count)
            } else {
                inject(Array(repeating: .holdAfterProcessing, count: count))
            }
            return Self.json(200, ["queued": .int(Int64(count))])
        case ("GET", "/_dev/held"): return Self.json(200, ["held": .int(Int64(heldCount))])
        case ("POST", "/_dev/release"):
            releaseHeld()
            return Self.json(200, [:])
        case ("POST", "/_dev/lifetime"):
            guard let seconds = request.query.first(where: { $0.0 == "seconds" }).flatMap({ Int($0.1) }), (1...86_400).contains(seconds) else {
                return Self.json(400, ["error": "invalid_request"])
            }
            setAccessTokenLifetime(.seconds(seconds))
            return Self.json(200, [:])
        case ("GET", "/_dev/live"):
            let target = request.query.first { $0.0 == "target" }?.1 ?? ""
            return Self.json(200, ["live": .int(Int64(liveAccessTokens(for: target)))])
        default: return Self.json(404, ["error": "not_found"])
        }
    }

    private func metadata() -> HTTPServerAction {
        state.withLock { $0.counters.metadataRequests += 1 }
        var body: JSONObject = [
            "issuer": .string(baseURL),
            "token_endpoint": .string(tokenEndpoint),
            "revocation_endpoint": .string(revocationEndpoint),
            "device_authorization_endpoint": .string(deviceAuthorizationEndpoint),
            "authorization_endpoint": .string(authorizationEndpoint),
            "grant_types_supported": ["refresh_token", "client_credentials", "urn:ietf:params:oauth:grant-type:device_code", "authorization_code",
                                      .string(Self.tokenExchange), .string(Self.jwtBearerGrant)],
            "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post", "private_key_jwt"],
            "token_endpoint_auth_signing_alg_values_supported": .array(options.assertionSigningAlgorithms.map { .string($0) }),
            "response_types_supported": ["code"],
            "code_challenge_methods_supported": ["S256"],
            "authorization_response_iss_parameter_supported": true,
            "id_token_signing_alg_values_supported": ["HS256"],
        ]
        if options.dpop != .off { body["dpop_signing_alg_values_supported"] = ["ES256"] }
        return Self.json(200, .object(body))
    }

    /// The client the request authenticates as, or the error answer (RFC 6749 §2.3.1: exactly
    /// one method).
    enum Authentication {
        case client(String)
        case refused(HTTPServerAction)
    }

    /// Authenticates the client of a request with a secret (Basic or in the form) or a client
    /// assertion (`DevIssuer+ClientAssertion`), exactly one of them.
    func authenticate(_ request: HTTPServerRequest, _ form: [String: String]) -> Authentication {
        if form["client_assertion"] != nil || form["client_assertion_type"] != nil { return authenticateAssertion(request, form) }
        var credentials: (String, String)?
        if let header = request.header("authorization"), header.hasPrefix("Basic ") {
            guard form["client_secret"] == nil, let decoded = Base64.decode(String(header.dropFirst(6))),
                  let colon = decoded.firstIndex(of: UInt8(ascii: ":")) else {
                return .refused(Self.invalidClient())
            }
            credentials = (FormEncoding.unescape(String(decoding: decoded[..<colon], as: UTF8.self)),
                           FormEncoding.unescape(String(decoding: decoded[(colon + 1)...], as: UTF8.self)))
            // A client_id in the form as well must name the same client.
            if let id = form["client_id"], id != credentials?.0 { return .refused(Self.invalidClient()) }
        } else if let id = form["client_id"], let secret = form["client_secret"] {
            credentials = (id, secret)
        }
        guard let (id, secret) = credentials, let expected = options.clients[id], expected == secret else {
            return .refused(Self.invalidClient())
        }
        return .client(id)
    }

    /// `POST /token`: the faults, then the grant; with DPoP nonces on, every answer names the
    /// current token endpoint nonce.
    private func token(_ request: HTTPServerRequest) -> HTTPServerAction {
        let answer = faultedToken(request)
        guard options.dpop != .off, options.dpopNonces, case let .respond(status, headers, body, delay, trickle) = answer else { return answer }
        return .respond(status: status, headers: headers + [("DPoP-Nonce", currentTokenNonce)], body: body, delay: delay, trickle: trickle)
    }

    /// The token endpoint's answer after the next queued fault, if any.
    private func faultedToken(_ request: HTTPServerRequest) -> HTTPServerAction {
        let fault: Fault? = state.withLock { state in
            state.counters.tokenRequests += 1
            return state.faults.isEmpty ? nil : state.faults.removeFirst()
        }
        switch fault {
        case let .status(status, error, retryAfter)?:
            var headers: [(String, String)] = [("Content-Type", "application/json")]
            if let retryAfter { headers.append(("Retry-After", "\(retryAfter)")) }
            return .respond(status: status, headers: headers, body: error.map { JSON.object(["error": .string($0)]).encoded } ?? [])
        case let .described(status, error, description)?:
            return Self.json(status, ["error": .string(error), "error_description": .string(description)])
        case .malformedBody?:
            return .respond(status: 200, headers: [("Content-Type", "application/json")], body: Array("{\"access_token\": ".utf8))
        case .hold?:
            state.withLock { $0.held += 1 }
            gate.wait()
        case .bindToOtherKey?:
            state.withLock { $0.bindToOtherKey = true }
        case let .idTokenNonce(nonce)?:
            state.withLock { $0.idTokenNonce = nonce }
        default:
            break
        }
        var answer = grant(request)
        switch fault {
        case let .delay(delay)?:
            if case let .respond(status, headers, body, _, _) = answer { answer = .respond(status: status, headers: headers, body: body, delay: delay) }
        case let .trickle(pause)?:
            if case let .respond(status, headers, body, _, _) = answer { answer = .respond(status: status, headers: headers, body: body, trickle: pause) }
        case .dropAfterProcessing?:
            return .drop
        case .holdAfterProcessing?:
            state.withLock { $0.held += 1 }
            gate.wait()
        default:
            if holdsGrant(of: request) { gate.wait() }
        }
        return answer
    }

    /// Whether a `holdGrants` hold takes this request (counted as held if so).
    private func holdsGrant(of request: HTTPServerRequest) -> Bool {
        guard state.withLock({ !$0.grantHolds.isEmpty }) else { return false }
        let type = FormEncoding.decode(String(decoding: request.body, as: UTF8.self)).first { $0.0 == "grant_type" }?.1
        return state.withLock { state in
            guard let type, let left = state.grantHolds[type] else { return false }
            state.grantHolds[type] = left > 1 ? left - 1 : nil
            state.held += 1
            return true
        }
    }

    private func grant(_ request: HTTPServerRequest) -> HTTPServerAction {
        let form = Dictionary(FormEncoding.decode(String(decoding: request.body, as: UTF8.self)), uniquingKeysWith: { first, _ in first })
        // Client authentication is optional for this grant: it authenticates by itself.
        if form["grant_type"] == Self.jwtBearerGrant { return jwtBearer(request, form) }
        let clientID: String
        switch authenticate(request, form) {
        case let .client(id): clientID = id
        case let .refused(answer): return answer
        }
        // The key the answer's tokens are bound to (nil: Bearer tokens).
        let jkt: String?
        switch tokenProof(request) {
        case let .key(thumbprint): jkt = thumbprint
        case .none: jkt = nil
        case let .refused(answer): return answer
        }
        switch form["grant_type"] {
        case "refresh_token":
            guard let presented = form["refresh_token"] else { return Self.oauthError("invalid_request") }
            return state.withLock { state in
                state.counters.refreshGrants += 1
                guard let record = state.refreshTokens[presented], state.familyClients[record.family] == clientID else {
                    return Self.oauthError("invalid_grant")
                }
                if let bound = state.familyJKT[record.family], bound != jkt {
                    // A bound family without its key's proof: refused, but not reuse (the
                    // token may have been stolen; its family and its holder carry on).
                    state.counters.dpopProofsRefused += 1
                    return Self.oauthError("invalid_grant", description: jkt == nil ? "The refresh token is DPoP-bound: a proof by its key is required."
                                                                                     : "The refresh token is bound to another DPoP key.")
                }
                if record.retired {
                    // Reuse of a rotated token: revoke the whole family.
                    state.counters.replays += 1
                    state.revokedFamilies.insert(record.family)
                    return Self.oauthError("invalid_grant")
                }
                guard !state.revokedFamilies.contains(record.family) else { return Self.oauthError("invalid_grant") }
                // RFC 8707 §2.2 and RFC 6749 §6: a refresh may narrow the access token. A
                // refused narrowing spends nothing: the refresh token stays the family's.
                let narrowing: Narrowing
                switch Self.narrowing(request.body, within: nil, in: state) {
                case let .success(value): narrowing = value
                case let .failure(refusal):
                    state.counters.narrowingsRefused += 1
                    return refusal.answer
                }
                state.refreshTokens[presented]?.retired = true
                // A family refreshed with a proof is bound from then on.
                if let jkt { state.familyJKT[record.family] = jkt }
                let refresh = mintRefresh(&state, family: record.family)
                let access = mintAccess(&state, family: record.family, jkt: jkt)
                state.accessTokens[access.token]?.audiences = narrowing.targets
                state.accessTokens[access.token]?.scope = narrowing.scope
                if !narrowing.targets.isEmpty || narrowing.scope != nil { state.counters.narrowedRefreshes += 1 }
                return tokenAnswer(access, refresh: refresh)
            }
        case Self.tokenExchange:
            return exchange(request, form, jkt: jkt)
        case "client_credentials":
            return state.withLock { state in
                state.counters.clientCredentialsGrants += 1
                return tokenAnswer(mintAccess(&state, family: nil, jkt: jkt), refresh: nil)
            }
        case "urn:ietf:params:oauth:grant-type:device_code":
            if options.deviceRequiresClientIDInBody, form["client_id"] == nil {
                return Self.oauthError("invalid_request", description: "Missing client_id parameter.")
            }
            guard let code = form["device_code"] else { return Self.oauthError("invalid_request") }
            return state.withLock { state in
                state.counters.deviceGrants += 1
                guard var device = state.devices[code], device.clientID == clientID else { return Self.oauthError("invalid_grant") }
                let now = Self.now()
                if now >= device.expiresAt {
                    state.devices[code] = nil
                    return Self.oauthError("expired_token")
                }
                switch device.state {
                case "denied":
                    state.devices[code] = nil
                    return Self.oauthError("access_denied")
                case "approved":
                    state.devices[code] = nil
                    let family = state.nextFamily
                    state.nextFamily += 1
                    state.familyClients[family] = clientID
                    state.familyJKT[family] = jkt
                    let refresh = mintRefresh(&state, family: family)
                    return tokenAnswer(mintAccess(&state, family: family, jkt: jkt), refresh: refresh)
                default:
                    let tooSoon = device.lastPoll.map { now - $0 < device.interval - 0.05 } ?? false
                    device.lastPoll = now
                    state.devices[code] = device
                    return Self.oauthError(tooSoon ? "slow_down" : "authorization_pending")
                }
            }
        case "authorization_code":
            return codeGrant(form, clientID: clientID, jkt: jkt)
        default:
            return Self.oauthError("unsupported_grant_type")
        }
    }

    /// What the token endpoint makes of a request's DPoP proof.
    enum ProofCheck {
        /// A valid proof by the key with this thumbprint.
        case key(String)
        /// No proof (where none is needed), or DPoP is off.
        case none
        /// The answer to a request refused for its proof.
        case refused(HTTPServerAction)
    }

    /// Checks the token request's `DPoP` header (RFC 9449 §4.3): at most one, valid for
    /// `POST` to the token endpoint, with the current nonce if nonces are on, its `jti` not
    /// seen before here.
    func tokenProof(_ request: HTTPServerRequest) -> ProofCheck {
        guard options.dpop != .off else { return .none }
        func refuse(_ why: String) -> ProofCheck {
            state.withLock { $0.counters.dpopProofsRefused += 1 }
            return .refused(Self.oauthError("invalid_dpop_proof", description: why))
        }
        let proofs = request.headers.filter { $0.name == "dpop" }
        guard let proof = proofs.first else { return options.dpop == .required ? refuse("A DPoP proof is required.") : .none }
        guard proofs.count == 1 else { return refuse("More than one DPoP header.") }
        let now = Int64(Self.now())
        let verified: DPoPVerifier.Verified
        do {
            verified = try DPoPVerifier.verify(proof.value, method: "POST", url: tokenEndpoint, now: now, window: Self.proofWindow)
        } catch {
            return refuse(error.description)
        }
        return state.withLock { state in
            if options.dpopNonces, verified.nonce != state.tokenNonce {
                state.counters.dpopNonceChallenges += 1
                return .refused(Self.oauthError("use_dpop_nonce", description: "Authorization server requires nonce in DPoP proof."))
            }
            guard state.tokenProofs.insert(verified.jti, issuedAt: verified.issuedAt, now: now) else {
                state.counters.dpopProofsRefused += 1
                return .refused(Self.oauthError("invalid_dpop_proof", description: "The proof's jti was used before."))
            }
            return .key(verified.thumbprint)
        }
    }

    private func deviceAuthorization(_ request: HTTPServerRequest) -> HTTPServerAction {
        let form = Dictionary(FormEncoding.decode(String(decoding: request.body, as: UTF8.self)), uniquingKeysWith: { first, _ in first })
        let clientID: String
        switch authenticate(request, form) {
        case let .client(id): clientID = id
        case let .refused(answer): return answer
        }
        if options.deviceRequiresClientIDInBody, form["client_id"] == nil {
            return Self.oauthError("invalid_request", description: "Missing client_id parameter.")
        }
        let code = Self.random(32)
        let userCode = Self.userCode()
        state.withLock { state in
            state.counters.deviceAuthorizations += 1
            state.devices[code] = Device(userCode: userCode, clientID: clientID, expiresAt: Self.now() + options.deviceExpiresIn.secondsValue,
                                         interval: options.deviceInterval.secondsValue)
        }
        return Self.json(200, [
            "device_code": .string(code), "user_code": .string(userCode),
            "verification_uri": .string(baseURL + "/device"),
            "verification_uri_complete": .string(baseURL + "/device?user_code=" + userCode),
            "expires_in": .int(Int64(options.deviceExpiresIn.secondsValue)),
            "interval": .int(Int64(max(1, options.deviceInterval.secondsValue.rounded(.up)))),
        ])
    }

    /// `GET /device?user_code=X&action=approve|deny`: the approve hook a person (or a test) uses.
    private func devicePage(_ request: HTTPServerRequest) -> HTTPServerAction {
        let query = Dictionary(request.query, uniquingKeysWith: { first, _ in first })
        guard let userCode = query["user_code"] else {
            return .respond(status: 200, headers: [("Content-Type", "text/plain")],
                            body: Array("tokenbroker development issuer: open /device?user_code=CODE&action=approve\n".utf8))
        }
        guard let action = query["action"], action == "approve" || action == "deny" else {
            return .respond(status: 200, headers: [("Content-Type", "text/plain")],
                            body: Array("Approve \(userCode)? Open this page with &action=approve (or &action=deny).\n".utf8))
        }
        let done = decide(userCode: userCode, approve: action == "approve")
        return .respond(status: done ? 200 : 404, headers: [("Content-Type", "text/plain")],
                        body: Array((done ? "\(action)d \(userCode)\n" : "no pending login with code \(userCode)\n").utf8))
    }

    private func revoke(_ request: HTTPServerRequest) -> HTTPServerAction {
        let form = Dictionary(FormEncoding.decode(String(decoding: request.body, as: UTF8.self)), uniquingKeysWith: { first, _ in first })
        if case let .refused(answer) = authenticate(request, form) { return answer }
        guard let token = form["token"] else { return Self.oauthError("invalid_request") }
        state.withLock { state in
            state.counters.revocations += 1
            if let record = state.refreshTokens[token] {
                if !record.retired || options.revokingARotatedTokenEndsItsFamily { state.revokedFamilies.insert(record.family) }
            } else if state.accessTokens[token] != nil {
                state.accessTokens[token]?.revoked = true
            }
        }
        return .respond(status: 200, headers: [], body: [])
    }

    /// The protected resource: 200 for a live token; 401 `invalid_token` otherwise (a bare
    /// challenge when no token was sent); `?scope=admin` answers 403 `insufficient_scope`.
    /// With DPoP on, a bound token must come with the `DPoP` scheme and its proof (and a
    /// Bearer token with the `Bearer` scheme); with nonces on, every answer names the
    /// resource's current nonce.
    private func resource(_ request: HTTPServerRequest) -> HTTPServerAction {
        state.withLock { $0.counters.resourceRequests += 1 }
        guard options.dpop != .off else { return bearerResource(request) }
        let answer = if let header = request.header("authorization"), header.hasPrefix("DPoP ") {
            dpopResource(request, token: String(header.dropFirst(5)))
        } else {
            bearerResource(request)
        }
        guard options.dpopNonces, case let .respond(status, headers, body, delay, trickle) = answer else { return answer }
        return .respond(status: status, headers: headers + [("DPoP-Nonce", currentResourceNonce)], body: body, delay: delay, trickle: trickle)
    }

    /// A resource request with the `Bearer` scheme (or none); a DPoP-bound token is refused.
    private func bearerResource(_ request: HTTPServerRequest) -> HTTPServerAction {
        guard let header = request.header("authorization"), header.hasPrefix("Bearer ") else {
            var challenges = [("WWW-Authenticate", "Bearer realm=\"dev\"")]
            if options.dpop != .off { challenges.append(("WWW-Authenticate", "DPoP algs=\"ES256\"")) }
            return .respond(status: 401, headers: challenges, body: [])
        }
        let token = String(header.dropFirst(7))
        let (live, bound) = state.withLock { (Self.valid(token, in: $0) && !$0.resourceRejectsAll, $0.accessTokens[token]?.jkt != nil) }
        guard live else {
            return .respond(status: 401, headers: [("WWW-Authenticate", "Bearer realm=\"dev\", error=\"invalid_token\"")], body: [])
        }
        // RFC 9449 §7.2: a DPoP-bound token used as a Bearer one.
        if bound { return refuseResourceProof("invalid_token", "A DPoP-bound token needs the DPoP scheme and a proof.") }
        return scopedResource(request, scheme: "Bearer")
    }

    /// A resource request with the `DPoP` scheme (RFC 9449 §7.1): a live bound token, exactly
    /// one proof for this method and URL, by the token's key, with the token's hash (`ath`),
    /// the resource's current nonce if nonces are on, and a `jti` not seen here before.
    private func dpopResource(_ request: HTTPServerRequest, token: String) -> HTTPServerAction {
        let (live, jkt) = state.withLock { (Self.valid(token, in: $0) && !$0.resourceRejectsAll, $0.accessTokens[token]?.jkt) }
        guard live else { return Self.dpopChallenge("invalid_token", "The access token is not valid.") }
        guard let jkt else { return refuseResourceProof("invalid_token", "A Bearer token cannot be used with the DPoP scheme.") }
        let proofs = request.headers.filter { $0.name == "dpop" }
        guard let proof = proofs.first else { return refuseResourceProof("invalid_dpop_proof", "A DPoP proof is required.") }
        guard proofs.count == 1 else { return refuseResourceProof("invalid_dpop_proof", "More than one DPoP header.") }
        let now = Int64(Self.now())
        let verified: DPoPVerifier.Verified
        do {
            verified = try DPoPVerifier.verify(proof.value, method: request.method, url: baseURL + request.path, now: now, window: Self.proofWindow,
                                               accessToken: token)
        } catch {
            return refuseResourceProof("invalid_dpop_proof", error.description)
        }
        guard verified.thumbprint == jkt else { return refuseResourceProof("invalid_dpop_proof", "The proof is signed by another key than the token's.") }
        let refusal: HTTPServerAction? = state.withLock { state in
            if options.dpopNonces, verified.nonce != state.resourceNonce {
                state.counters.dpopNonceChallenges += 1
                return Self.dpopChallenge("use_dpop_nonce", "Resource server requires nonce in DPoP proof.")
            }
            guard state.resourceProofs.insert(verified.jti, issuedAt: verified.issuedAt, now: now) else {
                state.counters.dpopProofsRefused += 1
                return Self.dpopChallenge("invalid_dpop_proof", "The proof's jti was used before.")
            }
            return nil
        }
        return refusal ?? scopedResource(request, scheme: "DPoP")
    }

    /// A 401 for a proof refused at the resource, counted.
    private func refuseResourceProof(_ error: String, _ description: String) -> HTTPServerAction {
        state.withLock { $0.counters.dpopProofsRefused += 1 }
        return Self.dpopChallenge(error, description)
    }

    /// The resource's answer to an accepted token: `?scope=admin` answers 403 `insufficient_scope`.
    private func scopedResource(_ request: HTTPServerRequest, scheme: String) -> HTTPServerAction {
        if request.query.contains(where: { $0 == ("scope", "admin") }) {
            return .respond(status: 403, headers: [("WWW-Authenticate", "\(scheme) realm=\"dev\", error=\"insufficient_scope\", scope=\"admin\"")], body: [])
        }
        return Self.json(200, ["ok": true, "bytes": .int(Int64(request.body.count))])
    }

    /// A 401 with a `DPoP` challenge (RFC 9449 §7.1): an error and why (our own words or the
    /// verifier's, never a token; a quote or backslash would be dropped to keep the quoted string).
    private static func dpopChallenge(_ error: String, _ description: String) -> HTTPServerAction {
        let quoted = description.filter { $0 != "\"" && $0 != "\\" }
        return .respond(status: 401, headers: [("WWW-Authenticate", "DPoP error=\"\(error)\", error_description=\"\(quoted)\"")], body: [])
    }

    private func counterReport() -> HTTPServerAction {
        let counters = self.counters
        return Self.json(200, [
            "refresh_token": .int(Int64(counters.refreshGrants)), "client_credentials": .int(Int64(counters.clientCredentialsGrants)),
            "device_code": .int(Int64(counters.deviceGrants)), "device_authorization": .int(Int64(counters.deviceAuthorizations)),
            "revocation": .int(Int64(counters.revocations)), "resource": .int(Int64(counters.resourceRequests)),
            "replays": .int(Int64(counters.replays)), "token_requests": .int(Int64(counters.tokenRequests)),
            "dpop_refused": .int(Int64(counters.dpopProofsRefused)), "dpop_nonce_challenges": .int(Int64(counters.dpopNonceChallenges)),
            "authorization": .int(Int64(counters.authorizationRequests)), "authorization_code": .int(Int64(counters.codeGrants)),
            "code_replays": .int(Int64(counters.codeReplays)), "token_exchange": .int(Int64(counters.tokenExchanges)),
            "narrowed_refresh": .int(Int64(counters.narrowedRefreshes)),
            "client_assertions": .int(Int64(counters.clientAssertions)), "client_assertions_refused": .int(Int64(counters.clientAssertionsRefused)),
            "assertion_replays": .int(Int64(counters.assertionReplays)), "jwt_bearer": .int(Int64(counters.jwtBearerGrants)),
        ])
    }

    // MARK: - Minting

    func mintRefresh(_ state: inout State, family: Int) -> String {
        let token = "dev-rt." + Self.random(24)
        let index = state.familySize[family, default: 0]
        state.familySize[family] = index + 1
        state.refreshTokens[token] = RefreshRecord(family: family, index: index)
        state.newest[family] = token
        return token
    }

    /// An access token: a Bearer one, or, bound to the key `jkt` names, JWT-shaped with
    /// `cnf.jkt` (RFC 9449 §6.1; unsigned: the broker only reads the claim).
    func mintAccess(_ state: inout State, family: Int?, jkt: String? = nil) -> (token: String, bound: Bool, lifetime: Duration) {
        let now = Self.now()
        let lifetime = state.accessTokenLifetime ?? options.accessTokenLifetime
        let expiresAt = (options.wholeSecondExpiry ? now.rounded(.down) : now) + lifetime.secondsValue
        guard var jkt else {
            // `+` and `/` on purpose: a client must form-encode tokens correctly.
            let token = "dev-at." + Self.random(24) + "+/="
            state.accessTokens[token] = AccessRecord(family: family, expiresAt: expiresAt, lifetime: lifetime)
            return (token, false, lifetime)
        }
        if state.bindToOtherKey {
            state.bindToOtherKey = false
            jkt = Base64.urlEncode(Self.randomBytes(32))
        }
        let header: JSON = ["alg": "none", "typ": "at+jwt"]
        let claims: JSON = ["cnf": ["jkt": .string(jkt)], "jti": .string(Self.random(24)), "exp": .int(Int64(expiresAt))]
        let token = Base64.urlEncode(header.encoded) + "." + Base64.urlEncode(claims.encoded) + "." + Base64.urlEncode(Self.randomBytes(32))
        state.accessTokens[token] = AccessRecord(family: family, expiresAt: expiresAt, lifetime: lifetime, jkt: jkt)
        return (token, true, lifetime)
    }

    func tokenAnswer(_ access: (token: String, bound: Bool, lifetime: Duration), refresh: String?, idToken: String? = nil) -> HTTPServerAction {
        var body: JSONObject = ["access_token": .string(access.token), "token_type": access.bound ? "DPoP" : "Bearer",
                                "expires_in": .int(Int64(access.lifetime.secondsValue))]
        if let refresh { body["refresh_token"] = .string(refresh) }
        if let idToken { body["id_token"] = .string(idToken) }
        return Self.json(200, .object(body), extra: [("Cache-Control", "no-store"), ("Pragma", "no-cache")])
    }

    static func valid(_ token: String, in state: State) -> Bool {
        guard let record = state.accessTokens[token], !record.revoked, record.expiresAt > now() else { return false }
        return record.family.map { !state.revokedFamilies.contains($0) } ?? true
    }

    /// A 401 `invalid_client`, with why in our own words (never a credential) if given.
    static func invalidClient(_ description: String? = nil) -> HTTPServerAction {
        var body: JSONObject = ["error": "invalid_client"]
        if let description { body["error_description"] = .string(description) }
        return .respond(status: 401, headers: [("Content-Type", "application/json"), ("WWW-Authenticate", "Basic realm=\"dev\"")],
                        body: JSON.object(body).encoded)
    }

    static func oauthError(_ code: String, description: String? = nil) -> HTTPServerAction {
        var body: JSONObject = ["error": .string(code)]
        if let description { body["error_description"] = .string(description) }
        return json(400, .object(body))
    }

    static func json(_ status: Int, _ value: JSON, extra: [(String, String)] = []) -> HTTPServerAction {
        .respond(status: status, headers: [("Content-Type", "application/json")] + extra, body: value.encoded)
    }

    static func now() -> Double {
        var time = timespec()
        clock_gettime(CLOCK_REALTIME, &time)
        return Double(time.tv_sec) + Double(time.tv_nsec) / 1e9
    }

    static func random(_ count: Int) -> String {
        var generator = SystemRandomNumberGenerator()
        let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
        return String((0..<count).map { _ in alphabet[Int(generator.next() % UInt64(alphabet.count))] })
    }

    static func randomBytes(_ count: Int) -> [UInt8] {
        var generator = SystemRandomNumberGenerator()
        return (0..<count).map { _ in UInt8.random(in: 0...255, using: &generator) }
    }

    /// `XXXX-XXXX` from letters that cannot be confused.
    static func userCode() -> String {
        var generator = SystemRandomNumberGenerator()
        let alphabet = Array("BCDFGHJKLMNPQRSTVWXZ")
        let letters = (0..<8).map { _ in alphabet[Int(generator.next() % UInt64(alphabet.count))] }
        return String(letters[0..<4]) + "-" + String(letters[4..<8])
    }
}

extension Duration {
    var secondsValue: Double {
        let (seconds, attoseconds) = components
        return Double(seconds) + Double(attoseconds) / 1e18
    }
}
