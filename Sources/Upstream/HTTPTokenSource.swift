import Synchronization
import TokenBrokerCore

/// The OAuth grant a session uses.
public enum OAuthGrant: String, Sendable, Equatable {
    /// Refresh tokens, obtained by a login (device flow or `Login`), rotated on each refresh.
    case refreshToken = "refresh_token"
    /// `client_credentials`: no refresh token; each refresh is a new grant request.
    case clientCredentials = "client_credentials"
}

/// A `TokenSource` backed by an authorization server. It holds no credential of a session:
/// the coordinator passes the refresh token in and commits what comes back.
public final class HTTPTokenSource: TokenSource {
    public let grant: OAuthGrant
    private let configuration: OAuthClientConfiguration
    /// Endpoints given explicitly (they win over discovery).
    private let explicit: OAuthEndpoints?
    private let issuer: String?
    private let cachedMetadata = Mutex<AuthorizationServerMetadata?>(nil)
    private let loop: CurlLoop

    /// - Parameters:
    ///   - endpoints: explicit endpoints; `token` may be empty when `issuer` supplies it.
    public init(grant: OAuthGrant, configuration: OAuthClientConfiguration, endpoints: OAuthEndpoints?, issuer: String?, loop: CurlLoop = .shared) {
        self.grant = grant
        self.configuration = configuration
        self.explicit = endpoints
        self.issuer = issuer
        self.loop = loop
    }

    /// The endpoints in force: explicit ones, completed from the (cached) metadata.
    public func endpoints() async throws(FetchFailure) -> OAuthEndpoints {
        var endpoints = explicit ?? OAuthEndpoints(token: "")
        if let issuer, endpoints.token.isEmpty || endpoints.revocation == nil || endpoints.deviceAuthorization == nil {
            let metadata: AuthorizationServerMetadata
            if let cached = cachedMetadata.withLock({ $0 }) {
                metadata = cached
            } else {
                metadata = try await Discovery.fetch(issuer: issuer, tls: configuration.tls, loop: loop)
                // Discovered endpoints obey the same policy as configured ones: metadata that
                // points a credential at http:// off loopback is refused, and not cached.
                for (name, url) in [("token_endpoint", metadata.tokenEndpoint), ("revocation_endpoint", metadata.revocationEndpoint),
                                    ("device_authorization_endpoint", metadata.deviceAuthorizationEndpoint)] {
                    if let url, let problem = EndpointPolicy.problem(with: url) {
                        throw .transient("discovery: \(name) refused: \(problem)")
                    }
                }
                cachedMetadata.withLock { $0 = metadata }
            }
            if endpoints.token.isEmpty { endpoints.token = metadata.tokenEndpoint ?? "" }
            endpoints.revocation = endpoints.revocation ?? metadata.revocationEndpoint
            endpoints.deviceAuthorization = endpoints.deviceAuthorization ?? metadata.deviceAuthorizationEndpoint
        }
        guard !endpoints.token.isEmpty else { throw .terminal("client configuration: no token endpoint (set TokenEndpoint= or Issuer=)") }
        return endpoints
    }

    /// Forgets the discovered metadata (on reload).
    public func resetDiscovery() {
        cachedMetadata.withLock { $0 = nil }
    }

    public func client() async throws(FetchFailure) -> OAuthClient {
        OAuthClient(endpoints: try await endpoints(), configuration: configuration, loop: loop)
    }

    public func fetch(_ request: FetchRequest) async throws -> FetchedToken {
        let client = try await client()
        switch grant {
        case .refreshToken:
            guard let refreshToken = request.refreshToken else { throw FetchFailure.terminal("no refresh token: log in first") }
            return try await client.refresh(refreshToken)
        case .clientCredentials:
            return try await client.clientCredentials()
        }
    }

    /// Best-effort RFC 7009 revocation of a refresh token.
    public func revoke(_ refreshToken: Secret) async -> Revocation {
        do {
            return try await client().revoke(refreshToken) ? .revoked : .noEndpoint
        } catch {
            return .failed(error.message)
        }
    }

    /// What became of a revocation.
    public enum Revocation: Sendable, Equatable {
        case revoked
        /// No revocation endpoint is configured or discovered: nothing was sent.
        case noEndpoint
        case failed(String)
    }
}
