import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import TokenBrokerClient
import TokenBrokerCore

extension TokenBrokerClient {
    /// `URLSession.data(for:)` with the session's token — and, for a DPoP session, a fresh
    /// proof for this request, signed in the broker — and guarantee 4's single retry (see
    /// `perform(session:method:url:replay:send:inspect:)`, which also answers the resource
    /// server's `use_dpop_nonce`): a request with a body stream is never sent twice, and a
    /// non-idempotent method only with an `Idempotency-Key` header. `resource` and `scope`: a
    /// key of the session (`token(session:resource:scope:)`).
    public func data(for request: URLRequest, session: String, resource: String? = nil, scope: String? = nil,
                     using urlSession: URLSession = .shared) async throws -> (Data, HTTPURLResponse) {
        let method = request.httpMethod ?? "GET"
        guard let url = request.url?.absoluteString else { throw URLError(.badURL) }
        let replay = AuthRetryPolicy.replay(method: method,
                                            hasIdempotencyKey: request.value(forHTTPHeaderField: "Idempotency-Key") != nil,
                                            bodyIsStream: request.httpBodyStream != nil)
        return try await perform(session: session, method: method.uppercased(), url: url, resource: resource, scope: scope,
                                 replay: replay, send: { headers in
            var authorized = request
            for header in headers { authorized.setValue(header.value, forHTTPHeaderField: header.name) }
            let (data, response) = try await urlSession.data(for: authorized)
            guard let http = response as? HTTPURLResponse else { throw URLError(.badServerResponse) }
            return (data, http)
        }, inspect: { response in
            var challenges: [String] = []
            var nonce: String?
            for (key, value) in response.1.allHeaderFields {
                guard let name = (key as? String)?.lowercased(), let value = value as? String else { continue }
                if name == "www-authenticate" { challenges.append(value) } else if name == "dpop-nonce" { nonce = value }
            }
            return (response.1.statusCode, challenges, nonce)
        })
    }
}
