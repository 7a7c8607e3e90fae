import TokenBrokerCore
import Varlink

extension TokenBrokerClient {
    /// Sends a business request with the session's token, following guarantee 4: on a `401`
    /// whose challenge says `invalid_token` (or names no error) it calls `Recover` with the
    /// token it actually sent and sends once more; never for `403`/`insufficient_scope`,
    /// never when the request cannot be sent again (`replay`), and a second `401` is returned
    /// to the caller as it is. Works with any HTTP stack.
    ///
    /// - Parameters:
    ///   - replay: whether the request can be sent twice; see `AuthRetryPolicy.replay(method:hasIdempotencyKey:bodyIsStream:)`.
    ///   - send: sends the request with `Authorization: Bearer <token>`.
    ///   - inspect: the response's status and `WWW-Authenticate` values.
    ///   - resource, scope: a key of the session (`token(session:resource:scope:)`).
    public func perform<Response>(
        session: String, resource: String? = nil, scope: String? = nil,
        replay: AuthRetryPolicy.Replay,
        send: (String) async throws -> Response,
        inspect: (Response) -> (status: Int, wwwAuthenticate: [String])
    ) async throws -> Response {
        let token = try await self.token(session: session, resource: resource, scope: scope)
        // A DPoP-bound token is refused without its proof (and each refusal would cost a refresh).
        guard token.tokenType.lowercased() == "bearer" else {
            throw TokenBrokerError.unexpected("session '\(session)' has \(token.tokenType.prefix(16))-bound tokens: "
                                              + "use perform(session:method:url:…) or data(for:session:), which send proofs")
        }
        return try await AuthRetryPolicy.perform(
            token: Secret(token.token), replay: replay,
            send: { try await send($0.reveal) },
            inspect: inspect,
            recover: { rejected in
                let fresh = try await self.recover(session: session, rejected: rejected.reveal, resource: resource, scope: scope)
                // (The session's tokens may have become bound meanwhile: never sent as bearer.)
                guard fresh.tokenType.lowercased() == "bearer" else {
                    throw TokenBrokerError.unexpected("session '\(session)' has \(fresh.tokenType.prefix(16))-bound tokens now")
                }
                return Secret(fresh.token)
            })
    }

    /// Sends a business request of `method` to `url` with the headers `GetProof` gives (a DPoP
    /// session's token and a fresh proof; a bearer session's token alone), with the same
    /// one-`Recover`-one-retry rule, plus the resource server's `use_dpop_nonce` answer: sent
    /// once more with a proof that carries its nonce (`AuthRetryPolicy.decideWithProof`).
    ///
    /// - Parameters:
    ///   - send: sends the request with these headers added.
    ///   - inspect: the response's status, `WWW-Authenticate` values and `DPoP-Nonce`.
    ///   - resource, scope: a key of the session (`token(session:resource:scope:)`).
    public func perform<Response>(
        session: String, method: String, url: String, resource: String? = nil, scope: String? = nil,
        replay: AuthRetryPolicy.Replay,
        send: ([(name: String, value: String)]) async throws -> Response,
        inspect: (Response) -> (status: Int, wwwAuthenticate: [String], dpopNonce: String?)
    ) async throws -> Response {
        /// The request as a bearer session's, through the bearer `perform` (which refuses a bound token).
        func asBearer() async throws -> Response {
            try await perform(session: session, resource: resource, scope: scope, replay: replay, send: { token in
                try await send([(name: "Authorization", value: "Bearer " + token)])
            }, inspect: { response in let (status, challenges, _) = inspect(response); return (status, challenges) })
        }
        // What a proof names: the method, and the URL without query and fragment (not sent).
        let target = String(url[..<(url.firstIndex { $0 == "?" || $0 == "#" } ?? url.endIndex)])
        guard (1...16).contains(method.utf8.count), method.utf8.allSatisfy({ (0x41...0x5A).contains($0) }), target.utf8.count <= 4096 else {
            // No proof can name this request: a bearer session's token serves it as before.
            return try await asBearer()
        }
        var nonce: String?
        var proven: ProvenToken
        do throws(TokenBrokerError) {
            proven = try await proof(session: session, method: method, url: target, resource: resource, scope: scope)
        } catch {
            // A broker from before GetProof (bearer tokens only) says it has no such method.
            guard case let .unexpected(name) = error, [VarlinkServiceError.methodNotFound, VarlinkServiceError.methodNotImplemented].contains(name)
            else { throw error }
            return try await asBearer()
        }
        var (nonceRetried, recovered) = (false, false)
        while true {
            let response = try await send(proven.headers)
            let (status, challenges, given) = inspect(response)
            switch AuthRetryPolicy.decideWithProof(status: status, wwwAuthenticate: challenges, nonce: given, sentNonce: nonce,
                                                   nonceRetried: nonceRetried, recovered: recovered, replay: replay,
                                                   scheme: proven.proof == nil ? "Bearer" : "DPoP") {
            case .deliver:
                return response
            case let .retryWithNonce(fresh):
                nonceRetried = true
                nonce = fresh
                proven = try await proof(session: session, method: method, url: target, nonce: fresh, resource: resource, scope: scope)
            case .recoverAndRetry:
                recovered = true
                proven = try await proof(session: session, method: method, url: target, nonce: nonce, rejected: proven.token.token,
                                         resource: resource, scope: scope)
            }
        }
    }
}
