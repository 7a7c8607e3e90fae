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
