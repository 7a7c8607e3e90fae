import TokenBrokerCore

/// How a session asks its authorization server for a token: the one request that differs
/// between kinds of session. `HTTPTokenSource` does everything around it (discovery, DPoP,
/// deadlines, abandonment); a new grant is one type here and a session kind that chooses it.
public protocol TokenGrant: Sendable {
    /// The token request for `request` (its refresh token, if the grant has one), through `client`.
    func token(for request: FetchRequest, through client: OAuthClient) async throws(FetchFailure) -> FetchedToken
}

/// `grant_type=refresh_token` (RFC 6749 §6): redeems the refresh token a login obtained.
public struct RefreshTokenRequest: TokenGrant {
    public init() {}

    public func token(for request: FetchRequest, through client: OAuthClient) async throws(FetchFailure) -> FetchedToken {
        guard let refreshToken = request.refreshToken else { throw .terminal("no refresh token: log in first") }
        return try await client.refresh(refreshToken)
    }
}

/// `grant_type=client_credentials` (RFC 6749 §4.4): the client's own credentials, no refresh token.
public struct ClientCredentialsRequest: TokenGrant {
    public init() {}

    public func token(for request: FetchRequest, through client: OAuthClient) async throws(FetchFailure) -> FetchedToken {
        try await client.clientCredentials()
    }
}

extension TokenGrant where Self == RefreshTokenRequest {
    public static var refreshToken: RefreshTokenRequest { RefreshTokenRequest() }
}

extension TokenGrant where Self == ClientCredentialsRequest {
    public static var clientCredentials: ClientCredentialsRequest { ClientCredentialsRequest() }
}

/// RFC 8693 token exchange: another session's current access token (the subject token) for
/// one narrowed to `audiences`, `resources` (RFC 8707) and `scope`. A refresh token in the
/// answer is not kept (the next token is exchanged again) and is revoked, best effort.
public struct TokenExchangeRequest: TokenGrant {
    public static let grantType = "urn:ietf:params:oauth:grant-type:token-exchange"
    public static let accessTokenType = "urn:ietf:params:oauth:token-type:access_token"

    public var audiences: [String]
    public var resources: [String]
    public var scope: String?
    /// The subject token, when a request needs one: the parent session's current access token
    /// (through its one flight when it has to be refreshed).
    public var subjectToken: @Sendable () async throws(FetchFailure) -> Secret

    public init(audiences: [String], resources: [String], scope: String?,
                subjectToken: @escaping @Sendable () async throws(FetchFailure) -> Secret) {
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
        let subject = try await subjectToken()
        var token = try await client.tokenRequest(fields(subject: subject), rotates: false)
        if let stranded = token.refreshToken {
            token.refreshToken = nil
            _ = try? await client.revoke(stranded)
        }
        return token
    }
}
