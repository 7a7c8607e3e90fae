import DPoP
import TokenBrokerCore

/// A session's account at its authorization server, as the daemon speaks to it beyond fetching
/// tokens: the endpoints and client its logins use, its DPoP keys, what becomes of requests
/// their callers abandon, and revocation. `HTTPTokenSource` is the one there is; the daemon
/// holds this protocol, not the class.
public protocol UpstreamAccount: AnyObject, Sendable {
    /// The endpoints in force (configured, completed by discovery).
    func endpoints() async throws(FetchFailure) -> OAuthEndpoints
    /// What an authorization code login needs of the server.
    func codeLoginServer() async throws(FetchFailure) -> CodeLoginServer
    /// Forgets discovered metadata (a reload reads it again).
    func resetDiscovery()
    /// A client for the server; with `proofKey` its token requests carry DPoP proofs.
    func client(proofKey: Secret?) async throws(FetchFailure) -> OAuthClient
    /// A new DPoP key for a login (nil: the session's tokens are bearer tokens).
    func newProofKey() throws(FetchFailure) -> Secret?
    /// The session's DPoP key as its record keeps it, opened.
    func proofKey(_ kept: Secret) throws(FetchFailure) -> DPoPKey
    /// Receives what a token request brought after its caller stopped waiting for it.
    func whenAbandoned(_ handler: @escaping @Sendable (FetchRequest, Result<FetchedToken, any Error>) async -> Void)
    /// Best-effort RFC 7009 revocation of a refresh token.
    func revoke(_ refreshToken: Secret) async -> Revocation
    /// What the server's metadata lists for client assertions (nil: nothing, or no `Issuer=`).
    func assertionSigningAlgorithms() async throws(FetchFailure) -> [String]?
}

/// What an authorization code login needs of the server: its authorization endpoint
/// (configured, else from the metadata), and whether its redirects always carry `iss`.
public struct CodeLoginServer: Sendable {
    public var authorizationEndpoint: String
    /// The issuer a redirect's `iss` must name (`Issuer=`; nil without one).
    public var issuer: String?
    /// The metadata says every redirect carries `iss` (RFC 9207).
    public var issuerInRedirect: Bool
}

/// What became of a revocation.
public enum Revocation: Sendable, Equatable {
    case revoked
    /// No revocation endpoint is configured or discovered: nothing was sent.
    case noEndpoint
    case failed(String)
}
