import TokenBrokerCore
import WireJSON

/// How a session asks its authorization server for a token: the one request that differs
/// between kinds of session. `HTTPTokenSource` does everything around it (discovery, DPoP,
/// deadlines, abandonment); a new grant is one type here and a session kind that chooses it.
public protocol TokenGrant: Sendable {
    /// The token request for `request` (its refresh token, if the grant has one), through `client`.
    func token(for request: FetchRequest, through client: OAuthClient) async throws(FetchFailure) -> FetchedToken
}

/// `grant_type=refresh_token` (RFC 6749 §6): redeems the refresh token a login obtained;
/// narrowed (a derived session's `Derivation=refresh`) to `resources` (RFC 8707 §2.2) and a
/// `scope` within the grant's (RFC 6749 §6). The answer's `scope` comes back in
/// `grantedScope`: whoever hands the token out refuses a wider one (`widens`) only after the
/// rotated refresh token, which is the grant's whatever the access token is worth, is kept.
public struct RefreshTokenRequest: TokenGrant {
    public var resources: [String]
    public var scope: String?

    public init(resources: [String] = [], scope: String? = nil) {
        self.resources = resources
        self.scope = scope
    }

    public func token(for request: FetchRequest, through client: OAuthClient) async throws(FetchFailure) -> FetchedToken {
        guard let refreshToken = request.refreshToken else { throw .terminal("no refresh token: log in first") }
        guard !resources.isEmpty || scope != nil else { return try await client.refresh(refreshToken) }
        var fields = [("grant_type", "refresh_token"), ("refresh_token", refreshToken.reveal)] + resources.map { ("resource", $0) }
        if let scope { fields.append(("scope", scope)) }
        var (token, body) = try await client.tokenRequestAndBody(fields, rotates: true)
        token.grantedScope = body?["scope"]?.stringValue
        return token
    }

    /// Whether a server that was asked for `asked` granted more (`granted`, its answer's `scope`).
    public static func widens(_ granted: String?, asked: String?) -> Bool {
        guard let asked, let granted else { return false }
        return !Set(granted.split(separator: " ")).isSubset(of: Set(asked.split(separator: " ")))
    }
}

/// `grant_type=client_credentials` (RFC 6749 §4.4): the client's own credentials, no refresh token.
public struct ClientCredentialsRequest: TokenGrant {
    public init() {}

    public func token(for request: FetchRequest, through client: OAuthClient) async throws(FetchFailure) -> FetchedToken {
        try await client.clientCredentials()
    }
}

/// `grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer` (RFC 7523 §2.1): a JWT a platform
/// issued (a Kubernetes service-account token, a CI OIDC token) as the grant itself, read from
/// its file at each request; no refresh token (each refresh presents the current JWT).
public struct JWTBearerRequest: TokenGrant {
    public static let grantType = "urn:ietf:params:oauth:grant-type:jwt-bearer"

    public let assertion: AssertionFile
    public var scope: String?

    public init(assertion: AssertionFile, scope: String?) {
        self.assertion = assertion
        self.scope = scope
    }

    public func token(for request: FetchRequest, through client: OAuthClient) async throws(FetchFailure) -> FetchedToken {
        var fields = [("grant_type", Self.grantType), ("assertion", try assertion.read())]
        if let scope { fields.append(("scope", scope)) }
        do {
            var token = try await client.tokenRequest(fields, rotates: false)
            token.refreshToken = nil
            return token
        } catch {
            // Whatever the server refuses (the platform's JWT expired by its clock and not yet
            // renewed, a client or scope it does not take), the grant is the file's next JWT or
            // the operator's fix, not a login: the session is never over.
            guard case .transient = error.kind else {
                var failure = FetchFailure.transient(error.grantIsDead ? "the server refused the assertion from \(assertion.path) (invalid_grant)"
                                                                       : error.reason)
                failure.detail = error.detail
                throw failure
            }
            throw error
        }
    }
}

extension TokenGrant where Self == RefreshTokenRequest {
    public static var refreshToken: RefreshTokenRequest { RefreshTokenRequest() }
}

extension TokenGrant where Self == ClientCredentialsRequest {
    public static var clientCredentials: ClientCredentialsRequest { ClientCredentialsRequest() }
}

/// RFC 8693 token exchange: another session's current access token (the subject token) for
/// one narrowed to `audiences`, `resources` (RFC 8707) and `scope`. An answer that is not
/// narrowed as asked is refused: the subject token itself back, another `issued_token_type`
/// than an access token, or a wider scope than the one asked for. A refresh token in the answer
/// is dropped, not kept and not revoked: revoking it with the parent's client may end the
/// parent's own grant at some servers.
public struct TokenExchangeRequest: TokenGrant {
    public static let grantType = "urn:ietf:params:oauth:grant-type:token-exchange"
    public static let accessTokenType = "urn:ietf:params:oauth:token-type:access_token"

    public var audiences: [String]
    public var resources: [String]
    public var scope: String?
    /// The subject token: the parent session's current access token (through its one flight
    /// when it has to be refreshed); given the one the server refused as `invalid_grant`, the
    /// parent's next (its Recover).
    public var subjectToken: @Sendable (_ rejected: Secret?) async throws(FetchFailure) -> Secret

    public init(audiences: [String], resources: [String], scope: String?,
                subjectToken: @escaping @Sendable (_ rejected: Secret?) async throws(FetchFailure) -> Secret) {
        self.audiences = audiences
        self.resources = resources
        self.scope = scope
        self.subjectToken = subjectToken
    }

    /// The form of one exchange of `subject`.
    public func fields(subject: Secret) -> [(String, String)] {
        var fields = [("grant_type", Self.grantType), ("subject_token", subject.reveal), ("subject_token_type", Self.accessTokenType),
                      ("requested_token_type", Self.accessTokenType)]
        fields += audiences.map { ("audience", $0) } + resources.map { ("resource", $0) }
        if let scope { fields.append(("scope", scope)) }
        return fields
    }

    public func token(for request: FetchRequest, through client: OAuthClient) async throws(FetchFailure) -> FetchedToken {
        let subject = try await subjectToken(nil)
        do {
            return try await exchange(subject, through: client)
        } catch where error.grantIsDead {
            // The subject token was refused (revoked, or it ended in flight): once more with the
            // parent's next one; a second refusal ends this session, not the parent.
            return try await exchange(try await subjectToken(subject), through: client)
        }
    }

    private func exchange(_ subject: Secret, through client: OAuthClient) async throws(FetchFailure) -> FetchedToken {
        var (token, body) = try await client.tokenRequestAndBody(fields(subject: subject))
        token.refreshToken = nil
        if let problem = Self.problem(with: token, body, subject: subject, asked: scope) { throw .terminal("token exchange: \(problem)") }
        return token
    }

    /// Why an exchange's answer is not the narrowed access token asked for, or nil.
    static func problem(with token: FetchedToken, _ body: JSONObject?, subject: Secret, asked scope: String?) -> String? {
        if token.accessToken == subject { return "the server answered the subject token itself, not a narrowed one" }
        if let issued = body?["issued_token_type"]?.stringValue, issued != accessTokenType {
            return "the server issued a \(issued.prefix(80)), not an access token"
        }
        if RefreshTokenRequest.widens(body?["scope"]?.stringValue, asked: scope) {
            return "the server granted a wider scope than the one asked for"
        }
        return nil
    }
}
