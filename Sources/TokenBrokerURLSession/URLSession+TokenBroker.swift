import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import TokenBrokerClient
import TokenBrokerCore

extension TokenBrokerClient {
    /// `URLSession.data(for:)` with the session's bearer token and guarantee 4's single retry
    /// (see `perform(session:replay:send:inspect:)`): a request with a body stream is never
    /// sent twice, and a non-idempotent method only with an `Idempotency-Key` header.
    public func data(for request: URLRequest, session: String, using urlSession: URLSession = .shared) async throws -> (Data, HTTPURLResponse) {
        let replay = AuthRetryPolicy.replay(method: request.httpMethod ?? "GET",
                                            hasIdempotencyKey: request.value(forHTTPHeaderField: "Idempotency-Key") != nil,
                                            bodyIsStream: request.httpBodyStream != nil)
        return try await perform(session: session, replay: replay, send: { token in
            var authorized = request
            authorized.setValue("Bearer \(token)", forHTTPHeaderField: "Authorization")
            let (data, response) = try await urlSession.data(for: authorized)
            guard let http = response as? HTTPURLResponse else { throw URLError(.badServerResponse) }
            return (data, http)
        }, inspect: { response in
            let challenges = response.1.allHeaderFields.compactMap { key, value -> String? in
                (key as? String)?.lowercased() == "www-authenticate" ? value as? String : nil
            }
            return (response.1.statusCode, challenges)
        })
    }
}
