import Basics
import DPoP
import Synchronization
import TokenBrokerCore
import HTTPTransport

/// A `TokenSource` backed by an authorization server, and the session's `UpstreamAccount`
/// there. It holds no credential of a session: the coordinator passes the refresh token in and
/// commits what comes back. Its grant (`TokenGrant`) is the one request it does not decide.
public final class HTTPTokenSource: TokenSource, UpstreamAccount {
    private let grant: any TokenGrant
    /// Whether the session's tokens are DPoP-bound (`DPoP=`): its logins make keys, and with
    /// `on` a refresh without one (a login from before the setting) is refused.
    public let dpop: DPoPMode
    private let configuration: OAuthClientConfiguration
    /// Endpoints given explicitly (they win over discovery).
    private let explicit: OAuthEndpoints?
    private let issuer: String?
    private let cachedMetadata = Mutex<AuthorizationServerMetadata?>(nil)
    private let loop: CurlLoop
    /// The servers' DPoP nonces (shared by the daemon's sessions unless a test gives its own).
    private let nonces: DPoPNonces
    /// Where a token request runs when its caller may abandon it (`nil`: a task of its own).
    private let tasks: TaskPool?

    /// - Parameters:
    ///   - endpoints: explicit endpoints; `token` may be empty when `issuer` supplies it.
    ///   - tasks: the owner of token requests that go on after their caller was cancelled (the
    ///     daemon's, awaited at stop). When it is full or closed, a cancelled caller's request
    ///     is cut off instead.
    public init(grant: some TokenGrant, configuration: OAuthClientConfiguration, endpoints: OAuthEndpoints?, issuer: String?, loop: CurlLoop = .shared,
                tasks: TaskPool? = nil, dpop: DPoPMode = .off, nonces: DPoPNonces = .shared) {
        self.grant = grant
        self.dpop = dpop
        self.nonces = nonces
        self.configuration = configuration
        self.explicit = endpoints
        self.issuer = issuer
        self.loop = loop
        self.tasks = tasks
    }

    /// The endpoints in force: explicit ones, completed from the (cached) metadata.
    public func endpoints() async throws(FetchFailure) -> OAuthEndpoints {
        var endpoints = explicit ?? OAuthEndpoints(token: "")
        if issuer != nil, endpoints.token.isEmpty || endpoints.revocation == nil || endpoints.deviceAuthorization == nil,
           let metadata = try await discover() {
            if endpoints.token.isEmpty { endpoints.token = metadata.tokenEndpoint ?? "" }
            endpoints.revocation = endpoints.revocation ?? metadata.revocationEndpoint
            endpoints.deviceAuthorization = endpoints.deviceAuthorization ?? metadata.deviceAuthorizationEndpoint
            endpoints.authorization = endpoints.authorization ?? metadata.authorizationEndpoint
        }
        guard !endpoints.token.isEmpty else { throw .terminal("client configuration: no token endpoint (set TokenEndpoint= or Issuer=)") }
        return endpoints
    }

    /// The server's metadata (`Issuer=`; nil without one): the cached copy, or fetched and
    /// checked once. Discovered endpoints that carry credentials obey the same policy as
    /// configured ones: metadata that points one at http:// off loopback is refused, and not
    /// cached. (The authorization endpoint, a browser's, is checked where a login uses it.)
    private func discover() async throws(FetchFailure) -> AuthorizationServerMetadata? {
        guard let issuer else { return nil }
        if let cached = cachedMetadata.withLock({ $0 }) { return cached }
        let metadata = try await Discovery.fetch(issuer: issuer, tls: configuration.tls, loop: loop)
        for (name, url) in [("token_endpoint", metadata.tokenEndpoint), ("revocation_endpoint", metadata.revocationEndpoint),
                            ("device_authorization_endpoint", metadata.deviceAuthorizationEndpoint)] {
            if let url, let problem = EndpointPolicy.problem(with: url) {
                throw .transient("discovery: \(name) refused: \(problem)")
            }
        }
        cachedMetadata.withLock { $0 = metadata }
        return metadata
    }

    /// The server as a code login sees it. A server whose metadata lists PKCE methods without
    /// S256 is refused (tokenbroker sends no other). (Only a login asks for this: the
    /// authorization endpoint never makes a refresh wait on discovery.)
    public func codeLoginServer() async throws(FetchFailure) -> CodeLoginServer {
        let endpoints = try await endpoints()
        let metadata = issuer != nil ? try await discover() : nil
        guard let authorization = endpoints.authorization ?? metadata?.authorizationEndpoint else {
            throw .terminal("client configuration: no authorization endpoint (set AuthorizationEndpoint= or Issuer=)")
        }
        if let problem = EndpointPolicy.problem(with: authorization) { throw .transient("refused authorization endpoint: \(problem)") }
        if let problem = AuthorizationRequest.endpointQueryProblem(authorization) { throw .terminal("refused authorization endpoint: \(problem)") }
        if let methods = metadata?.codeChallengeMethods, !methods.contains(PKCE.method) {
            throw .terminal("the server's metadata lists no S256 among its PKCE methods (code_challenge_methods_supported)")
        }
        return CodeLoginServer(authorizationEndpoint: authorization, issuer: issuer, issuerInRedirect: metadata?.issuerInAuthorizationResponse == true)
    }

    /// Forgets the discovered metadata (on reload).
    public func resetDiscovery() {
        cachedMetadata.withLock { $0 = nil }
    }

    /// The client for a request; with `proofKey` (a DPoP session's generation key, as the
    /// record keeps it) its token requests carry proofs. `tokenType` is the generation's
    /// current token's: a generation keeps the choice its first token made (a `DPoP=auto`
    /// session does not switch between bound and bearer tokens as the metadata changes);
    /// before one, the server's metadata decides `auto`, and a server that lists algorithms
    /// without ES256 (the one tokenbroker signs with) cannot be used with `DPoP=yes`.
    /// `deadline`: when its requests must be over (their timeouts, under `RequestTimeout=`, are
    /// the time left after discovery).
    public func client(proofKey: Secret?) async throws(FetchFailure) -> OAuthClient {
        try await client(proofKey: proofKey, tokenType: nil, deadline: nil)
    }

    public func client(proofKey: Secret?, tokenType: String?, deadline: ContinuousClock.Instant?) async throws(FetchFailure)
        -> OAuthClient {
        let endpoints = try await endpoints()
        var dpop: DPoPBinding?
        if let proofKey, try await provesKeys(tokenType: tokenType) {
            dpop = DPoPBinding(key: try self.proofKey(proofKey), client: configuration.clientID, required: self.dpop == .on, nonces: nonces)
        }
        var configuration = self.configuration
        if let deadline {
            let timeLimit = ContinuousClock.now.duration(to: deadline)
            guard timeLimit > .milliseconds(10) else { throw .transient("no time left for the request") }
            configuration.timeout = min(configuration.timeout, timeLimit)
            configuration.connectTimeout = min(configuration.connectTimeout, timeLimit)
        }
        var assertion: ClientAssertion?
        if configuration.authentication == .privateKeyJWT {
            guard let source = configuration.assertion else { throw .terminal("client configuration: private_key_jwt without a key or an assertion file") }
            // (Best effort: with TokenEndpoint= given, metadata that cannot be read now leaves the
            // key's own algorithm, rather than failing a request that needs none of it.)
            let listed = issuer != nil ? (try? await discover())?.assertionSigningAlgorithms : nil
            assertion = try await source.prepare(serverAlgorithms: listed)
        }
        return OAuthClient(endpoints: endpoints, configuration: configuration, dpop: dpop, clientAssertion: assertion, loop: loop)
    }

    /// The algorithms the server's metadata lists for client assertions
    /// (`token_endpoint_auth_signing_alg_values_supported`; nil without `Issuer=` or a list).
    public func assertionSigningAlgorithms() async throws(FetchFailure) -> [String]? {
        issuer != nil ? try await discover()?.assertionSigningAlgorithms : nil
    }

    /// Whether requests with a key carry proofs (see `client`).
    private func provesKeys(tokenType: String?) async throws(FetchFailure) -> Bool {
        guard dpop != .off else { return false }
        switch tokenType?.lowercased() {
        case "dpop": return true
        case "bearer" where dpop == .auto: return false
        default: break
        }
        guard issuer != nil else { return dpop == .on }
        let listed = try await discover()?.dpopSigningAlgorithms
        switch (dpop, listed) {
        case (.auto, nil): return false
        case let (_, listed?) where !listed.contains("ES256"):
            if dpop == .auto { return false }
            throw .terminal("dpop: the server takes DPoP proofs signed with \(listed.prefix(8).joined(separator: ", ")) only; tokenbroker signs ES256")
        default: return true
        }
    }

    /// A new DPoP key for a login of this session (no network: a login holds the session's
    /// boundary); nil for bearer tokens. With `DPoP=auto` the key is made too, and used when
    /// the server's metadata says it takes DPoP.
    public func newProofKey() throws(FetchFailure) -> Secret? {
        dpop == .off ? nil : try DPoPBinding.newKey()
    }

    /// The DPoP key last opened (a generation keeps one key: opened once, not per request).
    private let lastKey = Mutex<(kept: Secret, key: DPoPKey)?>(nil)

    /// The session's DPoP key as its record keeps it, opened (once per generation).
    public func proofKey(_ kept: Secret) throws(FetchFailure) -> DPoPKey {
        if let last = lastKey.withLock({ $0 }), last.kept == kept { return last.key }
        let key = try DPoPBinding.key(kept)
        lastKey.withLock { $0 = (kept, key) }
        return key
    }

    /// The token request, on a transfer of its own: cancelling the caller (a logout, a login,
    /// a stop overtook the refresh) returns at once, but the request goes on to its own
    /// deadline, and what it brings is given to the `abandoned` handler. An issuer that has
    /// rotated already would otherwise leave the new refresh token alive, known to nobody, and
    /// revoking the old one changes nothing at many servers.
    public func fetch(_ request: FetchRequest) async throws -> FetchedToken {
        // The time limit runs from here, by the process's clock (libcurl's).
        let deadline = request.timeLimit.map { ContinuousClock.now.advanced(by: $0) }
        // Without a handler, cancelling ends the transfer. (A fleet holder's request goes on
        // too, but never past its time limit: the flight lease.)
        guard abandoned.withLock({ $0 != nil }) else { return try await fetchNow(request, deadline: deadline) }
        try Task.checkCancellation()   // nothing sent yet: nothing to abandon
        let race = AbandonableResult<FetchedToken>()
        let transfer: @Sendable () async -> Void = { [self] in
            let result: Result<FetchedToken, any Error>
            do { result = .success(try await fetchNow(request, deadline: deadline)) } catch { result = .failure(error) }
            if !race.deliver(result), let handler = abandoned.withLock({ $0 }) { await handler(request, result) }
        }
        if let tasks {
            guard tasks.spawn(transfer) != nil else { return try await fetchNow(request, deadline: deadline) }
        } else {
            Task { await transfer() }
        }
        return try await race.value()
    }

    /// Receives the outcome of a token request whose caller was cancelled before it came, in the
    /// request's own task (so that what it does — a revocation — is awaited with it).
    public func whenAbandoned(_ handler: @escaping @Sendable (FetchRequest, Result<FetchedToken, any Error>) async -> Void) {
        abandoned.withLock { $0 = handler }
    }

    private let abandoned = Mutex<(@Sendable (FetchRequest, Result<FetchedToken, any Error>) async -> Void)?>(nil)

    /// The request, cut off at its deadline if it has one.
    private func fetchNow(_ request: FetchRequest, deadline: ContinuousClock.Instant?) async throws -> FetchedToken {
        guard let deadline else { return try await fetchUnbounded(request, deadline: nil) }
        return try await withThrowingTaskGroup(of: FetchedToken?.self) { group in
            group.addTask { try await self.fetchUnbounded(request, deadline: deadline) }
            group.addTask {
                try await Task.sleep(until: deadline, clock: .continuous)
                return nil
            }
            defer { group.cancelAll() }
            let cutOff = FetchFailure.transient("the request was cut off at its deadline (the fleet's flight lease)")
            let first: FetchedToken??
            do {
                first = try await group.next()
            } catch where error is FetchFailure && ContinuousClock.now.duration(to: deadline) < .milliseconds(50) {
                // libcurl's own timeout is the deadline's (`client`): whichever of the two
                // noticed first, at the deadline it is the deadline that cut the request off.
                throw cutOff
            }
            guard let first, let token = first else { throw cutOff }
            return token
        }
    }

    private func fetchUnbounded(_ request: FetchRequest, deadline: ContinuousClock.Instant?) async throws -> FetchedToken {
        if dpop == .on, request.proofKey == nil {
            // (Its refresh token would stay alive upstream, known to nobody: revoked first.)
            if let refreshToken = request.refreshToken { _ = await revoke(refreshToken) }
            throw FetchFailure.terminal("dpop: the session was logged in without a DPoP key (before DPoP=yes); log in again")
        }
        let client: OAuthClient
        do {
            client = try await self.client(proofKey: request.proofKey, tokenType: request.tokenType, deadline: deadline)
        } catch {
            // Ending the session before anything was sent (a kept key damaged, a server that
            // takes no ES256): its refresh token is revoked first, as above.
            if case .terminal = error.kind, request.proofKey != nil, let refreshToken = request.refreshToken { _ = await revoke(refreshToken) }
            throw error
        }
        return try await grant.token(for: request, through: client)
    }

    /// Best-effort RFC 7009 revocation of a refresh token.
    public func revoke(_ refreshToken: Secret) async -> Revocation {
        do {
            return try await client(proofKey: nil).revoke(refreshToken) ? .revoked : .noEndpoint
        } catch {
            return .failed(error.message)
        }
    }
}

/// One result that a waiter may stop waiting for: whoever comes first, the result or the
/// waiter's cancellation, decides; a result that comes after the cancellation is the
/// deliverer's to deal with.
final class AbandonableResult<Value: Sendable>: Sendable {
    private enum State {
        case pending
        case waiting(CheckedContinuation<Value, any Error>)
        case delivered(Result<Value, any Error>)
        case abandoned
    }

    private let state = Mutex<State>(.pending)

    /// The result, or `CancellationError` at once when the calling task is cancelled.
    func value() async throws -> Value {
        try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { continuation in
                let ready: Result<Value, any Error>? = state.withLock { state in
                    switch state {
                    case .pending:
                        state = .waiting(continuation)
                        return nil
                    case let .delivered(result):
                        return result
                    case .abandoned, .waiting:
                        return .failure(CancellationError())
                    }
                }
                if let ready { continuation.resume(with: ready) }
            }
        } onCancel: {
            let waiting: CheckedContinuation<Value, any Error>? = state.withLock { state in
                switch state {
                case let .waiting(continuation):
                    state = .abandoned
                    return continuation
                case .pending:
                    state = .abandoned
                    return nil
                case .delivered, .abandoned:
                    return nil
                }
            }
            waiting?.resume(throwing: CancellationError())
        }
    }

    /// Hands `result` to the waiter; false when it was abandoned (the result is the caller's).
    func deliver(_ result: Result<Value, any Error>) -> Bool {
        let waiting: CheckedContinuation<Value, any Error>?? = state.withLock { state in
            switch state {
            case let .waiting(continuation):
                state = .delivered(result)
                return .some(continuation)
            case .pending:
                state = .delivered(result)
                return .some(nil)
            case .delivered, .abandoned:
                return .none
            }
        }
        guard let waiting else { return false }
        waiting?.resume(with: result)
        return true
    }
}
