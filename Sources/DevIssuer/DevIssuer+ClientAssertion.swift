import Basics
import DPoP
import Synchronization
import WireJSON

/// JWT client authentication and the JWT-bearer grant (RFC 7523):
/// - `private_key_jwt` (§2.2, OpenID Connect Core §9): a client registered with keys proves
///   itself by a JWT it signed, `iss` and `sub` its id, for this server (`aud`), short-lived,
///   its `jti` used once;
/// - a federated client assertion: a trusted platform's identity token (a Kubernetes service
///   account's, say) mapped to a client, reused until the platform renews it (no `jti` check);
/// - the JWT-bearer grant (§2.1): a trusted platform's identity token for an access token whose
///   subject is the token's, with or without client authentication.
/// Every time claim is checked with `assertionSkew` of leeway. A refusal says which check
/// failed, never what the assertion held.
extension DevIssuer {
    static let clientAssertionType = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
    static let jwtBearerGrant = "urn:ietf:params:oauth:grant-type:jwt-bearer"
    /// The clock skew allowed on every time claim of an assertion, in seconds.
    static let assertionSkew: Double = 60
    /// The longest `jti` taken, in bytes.
    static let maximumJTILength = 256

    /// Which `aud` an assertion must name (one of its values, when it is an array).
    public enum AssertionAudience: Sendable, Equatable {
        /// The issuer identifier (`baseURL`), as RFC 7523 §3 and RFC 9126 recommend.
        case issuer
        /// The token endpoint's URL, as OpenID Connect Core §9 describes.
        case tokenEndpoint
        /// Either of them.
        case either
    }

    /// The keys and trust the issuer holds for assertions: seeded from the options, replaced
    /// by the registration calls.
    struct AssertionRegistrations {
        /// Client id → its public JWKs.
        var clientKeys: [String: [JSONObject]] = [:]
        /// Platform issuer → its public JWKs.
        var trustedIssuers: [String: [JSONObject]] = [:]
        /// `"<iss> <sub>"` → client id.
        var federatedClients: [String: String] = [:]
    }

    /// The `jti`s of the clients' own assertions accepted lately, per client, to refuse a replay
    /// while the assertion is unexpired: at most `capacity`, each forgotten once its assertion
    /// has expired (beyond the skew). When every slot holds an unexpired one, new assertions are
    /// refused rather than a `jti` forgotten early.
    struct SeenAssertions {
        static let capacity = 10_000

        /// A `jti`, with the client that used it.
        struct Key: Hashable {
            var client: String
            var jti: String
        }

        /// What `insert` found.
        enum Outcome: Equatable {
            case fresh
            case replay
            case full
        }

        /// Key → when it may be forgotten (its assertion's `exp` plus the skew).
        private var members: [Key: Double] = [:]
        /// In arrival order from `head` on (the slots before it are forgotten, compacted now and then).
        private var queue: [(key: Key, forgetAt: Double)] = []
        private var head = 0

        /// Records `key` until `forgetAt`; `.replay` if it is recorded and unexpired already.
        mutating func insert(_ key: Key, forgetAt: Double, now: Double) -> Outcome {
            while head < queue.count, queue[head].forgetAt <= now {
                // (A key used again after it expired has a newer entry further on: keep it.)
                if let until = members[queue[head].key], until <= now { members[queue[head].key] = nil }
                head += 1
            }
            if head >= Self.capacity {
                queue.removeFirst(head)
                head = 0
            }
            if let until = members[key], until > now { return .replay }
            if members.count >= Self.capacity {
                // Entries behind a long-lived one may have expired: sweep them all (rare).
                members = members.filter { $0.value > now }
                queue = queue[head...].filter { members[$0.key] == $0.forgetAt }
                head = 0
                guard members.count < Self.capacity else { return .full }
            }
            members[key] = forgetAt
            queue.append((key, forgetAt))
            return .fresh
        }
    }

    /// Why an assertion was refused, in our own words (an `error_description`).
    struct AssertionRefusal: Error {
        var description: String
        init(_ description: String) { self.description = description }
    }

    // MARK: - Registration

    /// Replaces the public JWKs `clientID` authenticates with (`private_key_jwt`); no keys: the
    /// client no longer can.
    public func registerClientKeys(_ clientID: String, jwks: [JSONObject]) {
        state.withLock { $0.registrations.clientKeys[clientID] = jwks.isEmpty ? nil : jwks }
    }

    /// Trusts the platform `issuer`'s identity tokens signed with `keys` (replacing the keys it had).
    public func trustIssuer(_ issuer: String, keys: [JSONObject]) {
        state.withLock { $0.registrations.trustedIssuers[issuer] = keys }
    }

    /// Lets the platform identity `subject` of `issuer` authenticate as `client`.
    public func federate(issuer: String, subject: String, client: String) {
        state.withLock { $0.registrations.federatedClients[issuer + " " + subject] = client }
    }

    /// Whom an access token was issued for when that is not a client (a JWT-bearer assertion's
    /// `sub`); nil otherwise, or for a token this issuer does not know.
    public func subject(ofAccessToken token: String) -> String? {
        state.withLock { $0.accessTokens[token]?.subject }
    }

    /// `POST /_dev/client-keys?client=ID` with a JWKS (`{"keys": [...]}`, at most 64 KiB and 32
    /// keys): `registerClientKeys`, for `make run` and tests on the real processes.
    func clientKeysUpload(_ request: HTTPServerRequest) -> HTTPServerAction {
        guard let client = request.query.first(where: { $0.0 == "client" })?.1, !client.isEmpty, client.utf8.count <= 256 else {
            return Self.oauthError("invalid_request", description: "client must name a client.")
        }
        guard request.body.count <= 65_536, case let .object(body)? = try? JSONParser.parse(ArraySlice(request.body)),
              let keys = body["keys"]?.arrayValue, keys.count <= 32 else {
            return Self.oauthError("invalid_request", description: "The body must be a JWKS of at most 32 keys.")
        }
        let jwks = keys.compactMap(\.objectValue)
        guard jwks.count == keys.count else { return Self.oauthError("invalid_request", description: "Every key must be a JSON object.") }
        registerClientKeys(String(client), jwks: jwks)
        return Self.json(200, ["keys": .int(Int64(jwks.count))])
    }

    // MARK: - Client authentication

    /// Authenticates a request that carries a client assertion: the only method it uses, of the
    /// JWT type, valid for a client; counted either way.
    func authenticateAssertion(_ request: HTTPServerRequest, _ form: [String: String]) -> Authentication {
        let outcome: Result<String, AssertionRefusal>
        if request.header("authorization")?.hasPrefix("Basic ") == true || form["client_secret"] != nil {
            outcome = .failure(AssertionRefusal("Use exactly one client authentication method."))
        } else {
            outcome = clientAssertion(form)
        }
        switch outcome {
        case let .success(client):
            state.withLock { $0.counters.clientAssertions += 1 }
            return .client(client)
        case let .failure(refusal):
            state.withLock { $0.counters.clientAssertionsRefused += 1 }
            return .refused(Self.invalidClient(refusal.description))
        }
    }

    /// The client a `client_assertion` authenticates: a federated platform identity when its
    /// `iss` is a trusted platform, else the client's own assertion (`iss` = `sub` = its id).
    private func clientAssertion(_ form: [String: String]) -> Result<String, AssertionRefusal> {
        guard form["client_assertion_type"] == Self.clientAssertionType else {
            return .failure(AssertionRefusal("client_assertion_type must be \(Self.clientAssertionType)."))
        }
        guard let assertion = form["client_assertion"] else { return .failure(AssertionRefusal("client_assertion is missing.")) }
        guard let (issuer, subject) = Self.unverifiedIssuerAndSubject(assertion) else {
            return .failure(AssertionRefusal("The client assertion is not a JWT with iss and sub."))
        }
        let registrations = state.withLock { $0.registrations }
        let now = Self.now()
        if let platformKeys = registrations.trustedIssuers[issuer] {
            guard let client = registrations.federatedClients[issuer + " " + subject] else {
                return .failure(AssertionRefusal("No client is federated to this platform identity."))
            }
            if let named = form["client_id"], named != client { return .failure(AssertionRefusal("client_id is not the federated client.")) }
            do {
                _ = try verifiedAssertion(assertion, keys: platformKeys, now: now, maximumLifetime: options.platformAssertionMaximumLifetime)
            } catch {
                return .failure(error)
            }
            return .success(client)
        }
        guard issuer == subject else { return .failure(AssertionRefusal("The client assertion's iss and sub must both be the client id.")) }
        if let named = form["client_id"], named != subject { return .failure(AssertionRefusal("client_id is not the client assertion's sub.")) }
        guard let keys = registrations.clientKeys[subject] else {
            return .failure(AssertionRefusal("The client has no registered keys."))
        }
        let claims: JSONObject
        let expiry: Double
        do {
            (claims, expiry) = try verifiedAssertion(assertion, keys: keys, now: now, maximumLifetime: options.assertionMaximumLifetime)
        } catch {
            return .failure(error)
        }
        guard let jti = claims["jti"]?.stringValue, !jti.isEmpty, jti.utf8.count <= Self.maximumJTILength else {
            return .failure(AssertionRefusal("The client assertion needs a jti of at most \(Self.maximumJTILength) bytes."))
        }
        let outcome = state.withLock { state in
            let outcome = state.clientAssertionIDs.insert(SeenAssertions.Key(client: subject, jti: jti), forgetAt: expiry + Self.assertionSkew, now: now)
            if outcome == .replay { state.counters.assertionReplays += 1 }
            return outcome
        }
        switch outcome {
        case .fresh: return .success(subject)
        case .replay: return .failure(AssertionRefusal("The client assertion's jti was used before."))
        case .full: return .failure(AssertionRefusal("Too many unexpired client assertions; try again later."))
        }
    }

    // MARK: - The JWT-bearer grant

    /// `grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer` (RFC 7523 §2.1): a trusted
    /// platform's identity token (`assertion`) for an access token (no refresh token) whose
    /// subject is the token's `sub`. Client credentials are optional; if any come, they must be
    /// valid. A DPoP proof binds the access token as for the other grants.
    func jwtBearer(_ request: HTTPServerRequest, _ form: [String: String]) -> HTTPServerAction {
        let carriesCredentials = request.header("authorization")?.hasPrefix("Basic ") == true || form["client_secret"] != nil
            || form["client_assertion"] != nil || form["client_assertion_type"] != nil
        if carriesCredentials, case let .refused(answer) = authenticate(request, form) { return answer }
        let jkt: String?
        switch tokenProof(request) {
        case let .key(thumbprint): jkt = thumbprint
        case .none: jkt = nil
        case let .refused(answer): return answer
        }
        guard let assertion = form["assertion"] else { return Self.oauthError("invalid_request", description: "assertion is missing.") }
        guard let (issuer, subject) = Self.unverifiedIssuerAndSubject(assertion) else {
            return Self.oauthError("invalid_grant", description: "The assertion is not a JWT with iss and sub.")
        }
        guard let keys = state.withLock({ $0.registrations.trustedIssuers[issuer] }) else {
            return Self.oauthError("invalid_grant", description: "The assertion's issuer is not trusted.")
        }
        do {
            _ = try verifiedAssertion(assertion, keys: keys, now: Self.now(), maximumLifetime: options.platformAssertionMaximumLifetime)
        } catch {
            return Self.oauthError("invalid_grant", description: error.description)
        }
        return state.withLock { state in
            state.counters.jwtBearerGrants += 1
            let access = mintAccess(&state, family: nil, jkt: jkt)
            state.accessTokens[access.token]?.subject = subject
            return tokenAnswer(access, refresh: nil)
        }
    }

    // MARK: - Checks

    /// The `aud` values an assertion may name.
    var assertionAudiences: [String] {
        switch options.assertionAudience {
        case .issuer: [baseURL]
        case .tokenEndpoint: [tokenEndpoint]
        case .either: [baseURL, tokenEndpoint]
        }
    }

    /// The claims of an assertion signed with one of `keys` by an accepted algorithm, naming
    /// this server, unexpired, expiring within `maximumLifetime` of now, neither issued nor
    /// valid only in the future (each with the skew), and its `exp`.
    private func verifiedAssertion(_ assertion: String, keys: [JSONObject], now: Double,
                                   maximumLifetime: Duration) throws(AssertionRefusal) -> (claims: JSONObject, expiry: Double) {
        let claims: JSONObject
        do {
            claims = try JWSVerifier.verify(assertion, keys: keys, algorithms: Set(options.assertionSigningAlgorithms)).claims
        } catch {
            throw AssertionRefusal("The assertion's signature was refused: \(error.description).")
        }
        let audiences: [String]? = switch claims["aud"] {
        case let .string(value)?: [value]
        case let .array(values)?: values.allSatisfy { $0.stringValue != nil } ? values.compactMap(\.stringValue) : nil
        default: nil
        }
        guard let audiences else { throw AssertionRefusal("The assertion has no aud.") }
        guard audiences.contains(where: assertionAudiences.contains) else { throw AssertionRefusal("The assertion's aud is not this server.") }
        guard let expiry = claims["exp"]?.doubleValue else { throw AssertionRefusal("The assertion has no exp.") }
        guard expiry > now - Self.assertionSkew else { throw AssertionRefusal("The assertion has expired.") }
        guard expiry <= now + maximumLifetime.secondsValue + Self.assertionSkew else {
            throw AssertionRefusal("The assertion expires too far in the future.")
        }
        for name in ["iat", "nbf"] {
            guard let value = claims[name] else { continue }
            guard let time = value.doubleValue else { throw AssertionRefusal("The assertion's \(name) is not a number.") }
            guard time <= now + Self.assertionSkew else { throw AssertionRefusal("The assertion's \(name) is in the future.") }
        }
        return (claims, expiry)
    }

    /// The `iss` and `sub` an assertion claims, read before its signature is checked (only to
    /// choose the keys that check it); nil if it is no JWT with both, or too long.
    static func unverifiedIssuerAndSubject(_ assertion: String) -> (issuer: String, subject: String)? {
        guard assertion.utf8.count <= JWSVerifier.maximumLength else { return nil }
        let parts = assertion.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let bytes = Base64.urlDecode(parts[1]), case let .object(claims)? = try? JSONParser.parse(ArraySlice(bytes)),
              let issuer = claims["iss"]?.stringValue, let subject = claims["sub"]?.stringValue, !issuer.isEmpty, !subject.isEmpty else { return nil }
        return (issuer, subject)
    }
}
