import Basics
import DPoP
import TokenBrokerCore
import WireJSON
import HTTPTransport

/// How the client authenticates to the token endpoint (RFC 6749 §2.3.1).
public enum ClientAuthentication: String, Sendable, Equatable {
    /// `Authorization: Basic` with the form-encoded id and secret (the default).
    case basic = "client_secret_basic"
    /// `client_id` and `client_secret` in the form body.
    case post = "client_secret_post"
    /// A public client: `client_id` only.
    case none
    /// A JWT client assertion (RFC 7523 §2.2, OpenID Connect Core §9): signed with a key the
    /// daemon holds or the operator gives, or a platform's, from a file
    /// (`OAuthClientConfiguration.assertion`).
    case privateKeyJWT = "private_key_jwt"
}

/// Where and how to reach an authorization server.
public struct OAuthEndpoints: Sendable, Equatable {
    public var token: String
    public var revocation: String?
    public var deviceAuthorization: String?
    /// Where a browser is sent for the authorization code grant (RFC 6749 §3.1).
    public var authorization: String?

    public init(token: String, revocation: String? = nil, deviceAuthorization: String? = nil, authorization: String? = nil) {
        self.token = token
        self.revocation = revocation
        self.deviceAuthorization = deviceAuthorization
        self.authorization = authorization
    }
}

public struct OAuthClientConfiguration: Sendable {
    public var clientID: String
    public var clientSecret: Secret?
    public var authentication: ClientAuthentication
    /// Optional `scope` for client_credentials and device authorization requests.
    public var scope: String?
    /// RFC 8707 resources a login asks for (device and code flows): the grant's, which a
    /// narrowed refresh may later pick one of (at servers that tie a refresh's `resource` to
    /// the authorization's, such as Glewlwyd).
    public var loginResources: [String] = []
    public var tls: TLSOptions
    public var connectTimeout: Duration
    public var timeout: Duration
    /// With `private_key_jwt`: where its assertions come from.
    public var assertion: (any ClientAssertionSource)?

    public init(clientID: String, clientSecret: Secret? = nil, authentication: ClientAuthentication = .basic, scope: String? = nil,
                tls: TLSOptions = TLSOptions(), connectTimeout: Duration = .seconds(5), timeout: Duration = .seconds(30)) {
        self.clientID = clientID
        self.clientSecret = clientSecret
        self.authentication = authentication
        self.scope = scope
        self.tls = tls
        self.connectTimeout = connectTimeout
        self.timeout = timeout
    }
}

/// The token requests tokenbroker makes, and how their answers are read.
///
/// Classification of failures (every one becomes a `FetchFailure` whose reason names an OAuth
/// error code, an HTTP status or a transport problem, never a token):
/// - `invalid_grant` → terminal: the refresh token is dead (expired, revoked, replayed); the
///   session ends until the next login.
/// - `invalid_client`, `unauthorized_client` → terminal, reported as a configuration error
///   (`client configuration:` prefix): fixing the client id, secret or grants needs a reload.
/// - any other OAuth error code on a 4xx → terminal (`invalid_request`, `invalid_scope`,
///   `unsupported_grant_type`, …), except `server_error` and `temporarily_unavailable`.
/// - 5xx (with or without an error body), network errors, timeouts, malformed bodies → transient.
/// - 429 and 503 with `Retry-After` → transient, honouring it.
/// - a 4xx without an OAuth error body → transient, with backoff (a proxy or a gateway
///   problem more likely than a verdict on the grant).
public struct OAuthClient: Sendable {
    public var endpoints: OAuthEndpoints
    public var configuration: OAuthClientConfiguration
    /// A DPoP session's key: every token request carries a proof signed with it.
    public var dpop: DPoPBinding?
    /// With `private_key_jwt`: how each request's assertion is made (`ClientAssertionSource.prepare`).
    public var clientAssertion: ClientAssertion?
    private let loop: CurlLoop

    public init(endpoints: OAuthEndpoints, configuration: OAuthClientConfiguration, dpop: DPoPBinding? = nil,
                clientAssertion: ClientAssertion? = nil, loop: CurlLoop = .shared) {
        self.endpoints = endpoints
        self.configuration = configuration
        self.dpop = dpop
        self.clientAssertion = clientAssertion
        self.loop = loop
    }

    /// `grant_type=refresh_token`. Rotation is the caller's: a missing `refresh_token` in the
    /// answer means "keep the old one".
    public func refresh(_ refreshToken: Secret) async throws(FetchFailure) -> FetchedToken {
        try await tokenRequest([("grant_type", "refresh_token"), ("refresh_token", refreshToken.reveal)])
    }

    /// `grant_type=client_credentials` (no refresh token is expected or kept).
    public func clientCredentials() async throws(FetchFailure) -> FetchedToken {
        var fields = [("grant_type", "client_credentials")]
        if let scope = configuration.scope { fields.append(("scope", scope)) }
        var token = try await tokenRequest(fields, rotates: false)
        token.refreshToken = nil
        return token
    }

    /// One token endpoint request with client authentication; the answer read per RFC 6749 §5.
    /// `rotates`: the grant rotates a refresh token (not `client_credentials`).
    func tokenRequest(_ fields: [(String, String)], rotates: Bool = true) async throws(FetchFailure) -> FetchedToken {
        let response = try await tokenEndpointPost(fields)
        guard response.status == 200 else { throw refusal(response) }
        return try await accept(response, rotates: rotates)
    }

    /// As `tokenRequest`, with the answer's JSON object too (a token exchange's
    /// `issued_token_type` and `scope`, a narrowed refresh's `scope`, are checked by its caller).
    func tokenRequestAndBody(_ fields: [(String, String)], rotates: Bool = false) async throws(FetchFailure) -> (token: FetchedToken, body: JSONObject?) {
        let response = try await tokenEndpointPost(fields)
        guard response.status == 200 else { throw refusal(response) }
        let token = try await accept(response, rotates: rotates)
        return (token, (try? JSONParser.parse(response.body))?.objectValue)
    }

    /// A token endpoint's refusal, classified (`classify`). A platform's assertion the server
    /// refuses (`ClientAssertionFile=`: expired by its clock, not yet renewed) says nothing of the
    /// configuration: transient, tried again with the file's next JWT, never a session's end.
    /// A signed one refused is a key the server does not know (yet): transient too.
    func refusal(_ response: HTTPResponse) -> FetchFailure {
        var failure = Self.classify(response)
        guard let clientAssertion, response.status < 500, let code = Self.errorCode(response),
              code == "invalid_client" || code == "unauthorized_client" else { return failure }
        let detail = failure.detail
        switch clientAssertion {
        case let .file(file):
            failure = .transient("the server refused the client assertion from \(file.path) (\(code))")
        case let .signed(key, _, _):
            // Most often a key not registered yet (or not any more: a promotion or a retirement
            // ahead of the server): the operator's fix is at the server, and says nothing of the
            // session's grant. Retried with backoff, never the session's end.
            failure = .transient("the server refused the client assertion (\(code)): is the key \(key.thumbprint) registered "
                                 + "with it? (tokenbroker ctl client-key prints the JWKS)")
        }
        failure.detail = detail
        return failure
    }

    /// A 200 answer read (`parseToken`). One that is refused may still have rotated the refresh
    /// token: the one sent is spent then, and the new one alive upstream, known to nobody. So a
    /// refused answer that brings a refresh token ends the session (sending the spent one again
    /// would be a replay) and the new refresh token is revoked, best effort.
    func accept(_ response: HTTPResponse, rotates: Bool = true) async throws(FetchFailure) -> FetchedToken {
        do {
            return try Self.parseToken(response, dpop: dpop)
        } catch {
            guard rotates, let stranded = Self.refreshToken(in: response) else { throw error }
            let revoked = (try? await revoke(stranded)) ?? false
            throw .terminal("\(error.reason); the answer's new refresh token \(revoked ? "was revoked" : "could not be revoked"): log in again")
        }
    }

    /// The `refresh_token` of a token response's body, if it has one (whatever its length: a
    /// spent one must not be sent again because the new one was odd).
    static func refreshToken(in response: HTTPResponse) -> Secret? {
        guard let object = (try? JSONParser.parse(response.body))?.objectValue,
              let token = object["refresh_token"]?.stringValue, !token.isEmpty else { return nil }
        return Secret(token)
    }

    /// POSTs to the token endpoint, with a DPoP proof when the session has a key. A server that
    /// answers `use_dpop_nonce` with a nonce other than the one sent is asked once more with it
    /// (RFC 9449 §8): at most one extra request per nonce change, inside the caller's one flight.
    ///
    /// The answer carries `requestedAt`, the second its first request was sent in: a token's
    /// lifetime is counted from there, never from the answer's arrival (a server that counts in
    /// whole seconds ended tokens up to a second before the broker did).
    func tokenEndpointPost(_ fields: [(String, String)], clientIDInBody: Bool = false) async throws(FetchFailure) -> HTTPResponse {
        let requestedAt = UTCTime.unixSeconds()
        var response = try await tokenEndpointPostOnce(fields, clientIDInBody: clientIDInBody)
        response.requestedAt = requestedAt
        return response
    }

    private func tokenEndpointPostOnce(_ fields: [(String, String)], clientIDInBody: Bool) async throws(FetchFailure) -> HTTPResponse {
        guard let dpop else { return try await post(endpoints.token, fields, clientIDInBody: clientIDInBody) }
        let url = endpoints.token
        let (proof, sent) = try dpop.proof(method: "POST", url: url)
        let response = try await post(url, fields, clientIDInBody: clientIDInBody, proof: proof)
        let given = dpop.nonces.learn(response, from: url, client: dpop.client)
        guard response.status == 400 || response.status == 401, Self.errorCode(response) == "use_dpop_nonce",
              let given, given != sent else { return response }
        // (The nonce this answer gave, not the table's: another request may have changed that.)
        let retry = try dpop.proof(method: "POST", url: url, nonce: given)
        let second = try await post(url, fields, clientIDInBody: clientIDInBody, proof: retry.proof)
        dpop.nonces.learn(second, from: url, client: dpop.client)
        return second
    }

    /// POSTs a form with client authentication; transport failures are transient.
    /// `clientIDInBody`: `client_id` goes in the form with `client_secret_basic` too. RFC 8628
    /// §3.1 and §3.4 allow it always, and some servers (oauthlib: django-oauth-toolkit) require
    /// it for the device grant whatever the client authentication.
    func post(_ url: String, _ fields: [(String, String)], clientIDInBody: Bool = false, proof: String? = nil) async throws(FetchFailure) -> HTTPResponse {
        // The last line of defence: no credential leaves for an endpoint the policy refuses,
        // wherever its URL came from (checked at configuration and discovery already).
        if let problem = EndpointPolicy.problem(with: url) { throw .transient("refused endpoint: \(problem)") }
        var fields = fields
        var headers: [(name: String, value: String)] = [("Accept", "application/json"),
                                                         ("Content-Type", "application/x-www-form-urlencoded")]
        if let proof { headers.append(("DPoP", proof)) }
        switch configuration.authentication {
        case .basic:
            let secret = configuration.clientSecret?.reveal ?? ""
            let credentials = FormEncoding.escape(configuration.clientID) + ":" + FormEncoding.escape(secret)
            headers.append(("Authorization", "Basic " + Base64.encode(Array(credentials.utf8))))
            if clientIDInBody { fields.append(("client_id", configuration.clientID)) }
        case .post:
            fields.append(("client_id", configuration.clientID))
            if let secret = configuration.clientSecret { fields.append(("client_secret", secret.reveal)) }
        case .none:
            // (A JWT-bearer grant may have no client at all, RFC 7523 §3.1.)
            if !configuration.clientID.isEmpty { fields.append(("client_id", configuration.clientID)) }
        case .privateKeyJWT:
            // (A fresh assertion per request, a retry's too: servers refuse a `jti` seen before.)
            guard let clientAssertion else { throw .terminal("client configuration: private_key_jwt without a key or an assertion file") }
            fields.append(("client_id", configuration.clientID))
            fields.append(("client_assertion_type", ClientAssertion.type))
            fields.append(("client_assertion", try clientAssertion.assertion(clientID: configuration.clientID, url: url, tokenEndpoint: endpoints.token)))
        }
        let request = HTTPRequest(method: "POST", url: url, headers: headers, body: Array(FormEncoding.encode(fields).utf8),
                                  connectTimeout: configuration.connectTimeout, timeout: configuration.timeout, tls: configuration.tls)
        do {
            return try await loop.perform(request)
        } catch let error as HTTPError {
            switch error.kind {
            case .timeout: throw .transient("timeout: \(error.message)")
            case .tls: throw .transient("TLS: \(error.message)")
            default: throw .transient("transport: \(error.message)")
            }
        } catch {
            throw .transient("cancelled")
        }
    }

    /// Reads a successful token response.
    /// `dpop`: the key the request's proof was signed with; a `DPoP` token must be bound to it.
    static func parseToken(_ response: HTTPResponse, dpop: DPoPBinding? = nil) throws(FetchFailure) -> FetchedToken {
        guard let json = try? JSONParser.parse(response.body), case let .object(object) = json else {
            throw .transient("malformed token response (HTTP 200, not a JSON object)")
        }
        guard let accessToken = object["access_token"]?.stringValue, !accessToken.isEmpty else {
            throw .transient("malformed token response (no access_token)")
        }
        // A token goes into headers and credential-helper answers: visible ASCII only (RFC 6750's
        // b64token and more), bounded, never a line break a tool would read as another field.
        guard accessToken.utf8.count <= 16_384, accessToken.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else {
            throw .transient("malformed token response (access_token is not visible ASCII)")
        }
        guard let type = object["token_type"]?.stringValue else {
            throw .transient("malformed token response (no token_type)")
        }
        // Bearer tokens are handed to workers as they are; DPoP-bound ones only when this
        // request proved a key of the session's (workers then get proofs signed with it).
        // Other types (mTLS-bound, …) need a key the broker does not hold.
        let tokenType: String
        let claims = DPoPBinding.claims(ofAccessToken: accessToken)
        let binding = dpop == nil ? .none : DPoPBinding.binding(ofClaims: claims)
        switch type.lowercased() {
        case "bearer":
            if let dpop, binding == .key(dpop.key.thumbprint) {
                // Bound to our key, whatever the answer calls it: served with proofs.
                tokenType = "DPoP"
                break
            }
            // A server that does not do DPoP answers a proof with a bearer token (RFC 9449 §5):
            // `DPoP=auto` takes it (as `DPoP=no` would, whatever else binds it: mTLS's
            // `cnf.x5t#S256`), `DPoP=yes` does not (its tokens would not be bound).
            if let dpop, dpop.required {
                throw .terminal("dpop: the server answered a request with a proof with a bearer token: it does not bind tokens "
                                + "(DPoP=auto takes bearer tokens from such a server)")
            }
            tokenType = "Bearer"
        case "dpop" where dpop != nil:
            // A JWT access token names the key it is bound to: it must be ours (RFC 9449 §6.1).
            // A server that bound it to another cannot be used with proofs of this session's key.
            switch binding {
            case .none: break
            case let .key(bound) where bound == dpop?.key.thumbprint: break
            case .key, .unreadable: throw .terminal("dpop: the access token is bound to another key")
            }
            tokenType = "DPoP"
        default:
            throw .terminal("unsupported token_type \(type.prefix(20))")
        }
        var expiresIn = UpstreamNumbers.seconds(object["expires_in"], atMost: UpstreamNumbers.longestLifetime)
        // A JWT access token (RFC 9068) says its own end: the earlier of the two counts. Its
        // lifetime, exp - iat, counts from the request like expires_in (the issuer's clock and
        // ours need not agree); an exp with no iat is an instant, taken only while it lies ahead
        // (one behind this clock says more of the clocks than of the token).
        // (NumericDates may have fractions, RFC 7519 §2. An exp not after iat is a token dead at
        // birth: a lifetime of zero.)
        var notAfter: Int64?
        if let exp = claims?["exp"]?.doubleValue, exp.isFinite, abs(exp) < 1e15 {
            if let iat = claims?["iat"]?.doubleValue, iat.isFinite, abs(iat) < 1e15 {
                let lifetime = exp > iat ? UpstreamNumbers.seconds(.double(exp - iat), atMost: UpstreamNumbers.longestLifetime) ?? .zero : .zero
                expiresIn = min(expiresIn ?? lifetime, lifetime)
            } else if claims?["iat"] == nil, exp > Double(UTCTime.unixSeconds()) {
                notAfter = Int64(exp.rounded(.down))
            }
        }
        let refreshToken = object["refresh_token"]?.stringValue.flatMap { $0.isEmpty ? nil : Secret($0) }
        // (Read only for its claims, by `IDTokenClaims`, which checks its form: kept as it came, bounded.)
        let idToken = object["id_token"]?.stringValue.flatMap { $0.isEmpty || $0.utf8.count > IDTokenClaims.longestToken ? nil : Secret($0) }
        var token = FetchedToken(accessToken: Secret(accessToken), tokenType: tokenType, expiresIn: expiresIn, refreshToken: refreshToken, idToken: idToken)
        (token.lifetimeStart, token.notAfter) = (response.requestedAt, notAfter)
        return token
    }

    /// A failed token response as a classified failure (see the type's documentation).
    static func classify(_ response: HTTPResponse) -> FetchFailure {
        let status = response.status
        let retryAfter = response.retryAfter.map { min(Duration.seconds($0), UpstreamNumbers.longestRetryAfter) }
        var failure = classifyCode(response, status: status, retryAfter: retryAfter)
        failure.detail = errorDescription(response)
        return failure
    }

    private static func classifyCode(_ response: HTTPResponse, status: Int, retryAfter: Duration?) -> FetchFailure {
        let code = errorCode(response)
        if status == 429 || status == 503 || status >= 500 {
            return .transient(code.map { "HTTP \(status) \($0)" } ?? "HTTP \(status)", retryAfter: retryAfter)
        }
        guard let code else {
            // RFC 6749 §5.2: a token endpoint answers a refused grant with 400 and a refused
            // client with 401 (Glewlwyd: 403 for undecodable client credentials); some servers
            // leave out the body. The same request will be refused again: bounded
            // (RefreshPolicy.refusalLimit), not retried for ever. Other 4xx (404 during a
            // deploy, a proxy's 407, a load balancer's 413) say nothing about the grant.
            if [400, 401, 403].contains(status) {
                return .refused("HTTP \(status) without an OAuth error", retryAfter: retryAfter)
            }
            return .transient("HTTP \(status) without an OAuth error", retryAfter: retryAfter)
        }
        switch code {
        case "invalid_grant":
            return .deadGrant
        case "invalid_client", "unauthorized_client":
            return .terminal("client configuration: \(code)")
        case "server_error", "temporarily_unavailable":
            return .transient(code, retryAfter: retryAfter)
        case "use_dpop_nonce":
            // Asked again for a nonce right after the one it gave (rotating fast): later, with it.
            return .transient(code, retryAfter: retryAfter)
        case "invalid_dpop_proof":
            // A clock far off, or a server that does not take our proofs (Glewlwyd 2.7 will not
            // bind a refresh token issued without DPoP): bounded, like a bare 400.
            return .refused("invalid_dpop_proof (a clock far off, or a refresh token issued without DPoP, which some servers "
                            + "will not bind: log in with the device flow)", retryAfter: retryAfter)
        default:
            return .terminal(code)
        }
    }

    /// The `error` of an RFC 6749 §5.2 body, if the body is one (a short, plain code).
    static func errorCode(_ response: HTTPResponse) -> String? {
        guard let json = try? JSONParser.parse(response.body), let code = json.objectValue?["error"]?.stringValue,
              !code.isEmpty, code.count <= 64, code.allSatisfy({ $0.isASCII && ($0.isLetter || $0.isNumber || $0 == "_" || $0 == "-" || $0 == ".") })
        else { return nil }
        return code
    }

    /// The `error_description` of an RFC 6749 §5.2 body, as one short line an operator can
    /// read: controls and line separators become spaces, runs of spaces one, at most
    /// `longestDescription` characters (then `…`). Nil when there is none (or nothing printable).
    static func errorDescription(_ response: HTTPResponse) -> String? {
        guard response.body.count <= 65_536, let json = try? JSONParser.parse(response.body),
              let text = json.objectValue?["error_description"]?.stringValue else { return nil }
        return printableLine(text)
    }

    /// A server's text as one short line an operator can read (see `errorDescription`).
    static func printableLine(_ text: String) -> String? {
        var line = ""
        var count = 0
        for scalar in text.unicodeScalars {
            let printable = DeviceAuthorization.isSingleLine(scalar) && !(0x202A...0x202E).contains(scalar.value)
                && !(0x2066...0x2069).contains(scalar.value) && scalar.properties.generalCategory != .format
                && scalar.properties.generalCategory != .unassigned && scalar.properties.generalCategory != .surrogate
            let next: Unicode.Scalar = printable ? scalar : " "
            if next == " ", line.unicodeScalars.last == " " || line.isEmpty { continue }
            guard count < longestDescription else {
                line = line.trimmingSuffixSpaces() + "…"
                return line
            }
            line.unicodeScalars.append(next)
            count += 1
        }
        line = line.trimmingSuffixSpaces()
        return line.isEmpty ? nil : line
    }

    /// The longest server description kept, in Unicode scalars.
    static let longestDescription = 200

    // MARK: - Revocation (RFC 7009)

    /// Revokes `token`; false when there is no revocation endpoint to ask. 200 means done (also
    /// for an unknown token); anything else is reported.
    @discardableResult
    public func revoke(_ token: Secret, hint: String = "refresh_token") async throws(FetchFailure) -> Bool {
        guard let url = endpoints.revocation else { return false }
        let response = try await post(url, [("token", token.reveal), ("token_type_hint", hint)])
        guard response.status == 200 else { throw Self.classify(response) }
        return true
    }
}


private extension String {
    func trimmingSuffixSpaces() -> String {
        var text = self
        while text.unicodeScalars.last == " " { text.unicodeScalars.removeLast() }
        return text
    }
}
