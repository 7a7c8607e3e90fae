import TokenBrokerCore

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
    public func perform<Response>(
        session: String,
        replay: AuthRetryPolicy.Replay,
        send: (String) async throws -> Response,
        inspect: (Response) -> (status: Int, wwwAuthenticate: [String])
    ) async throws -> Response {
        let token = try await self.token(session: session)
        return try await AuthRetryPolicy.perform(
            token: Secret(token.token), replay: replay,
            send: { try await send($0.reveal) },
            inspect: inspect,
            recover: { rejected in Secret(try await self.recover(session: session, rejected: rejected.reveal).token) })
    }
}
