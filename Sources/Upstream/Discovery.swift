import TokenBrokerCore
import WireJSON
import HTTPTransport

/// Authorization server metadata (RFC 8414 §2), the fields tokenbroker uses.
public struct AuthorizationServerMetadata: Sendable, Equatable {
    public var issuer: String
    public var tokenEndpoint: String?
    public var revocationEndpoint: String?
    public var deviceAuthorizationEndpoint: String?
    public var tokenEndpointAuthMethods: [String]
    /// `dpop_signing_alg_values_supported` (RFC 9449 §5.1): nil when the server lists none.
    public var dpopSigningAlgorithms: [String]? = nil
    public var authorizationEndpoint: String? = nil
    /// `code_challenge_methods_supported` (RFC 8414 §2): nil when the server lists none (it may
    /// still take PKCE).
    public var codeChallengeMethods: [String]? = nil
    /// `authorization_response_iss_parameter_supported` (RFC 9207 §3): every authorization
    /// response carries `iss`, so one without it is not this server's.
    public var issuerInAuthorizationResponse = false
    /// `token_endpoint_auth_signing_alg_values_supported` (RFC 8414 §2): nil when the server lists none.
    public var assertionSigningAlgorithms: [String]? = nil
}

public enum Discovery {
    /// The deadline of each metadata request.
    public static let timeout: Duration = .seconds(10)

    /// The longest a discovery for `issuer` may take: every candidate URL timing out.
    public static func longest(for issuer: String) -> Duration {
        timeout * candidateURLs(for: issuer).count
    }

    /// The metadata URLs to try for `issuer`: RFC 8414 inserts the well-known path between host
    /// and path; OpenID Connect appends it.
    public static func candidateURLs(for issuer: String) -> [String] {
        let trimmed = issuer.hasSuffix("/") ? String(issuer.dropLast()) : issuer
        guard let scheme = ["https://", "http://"].first(where: { trimmed.hasPrefix($0) }) else { return [] }
        let afterScheme = trimmed.dropFirst(scheme.count)
        let pathStart = afterScheme.firstIndex(of: "/") ?? afterScheme.endIndex
        let origin = String(trimmed[..<pathStart])
        let path = String(trimmed[pathStart...])
        var urls = [origin + "/.well-known/oauth-authorization-server" + path]
        urls.append(trimmed + "/.well-known/openid-configuration")
        return urls
    }

    /// Fetches and validates the metadata: the first candidate that answers 200 with a JSON
    /// object whose `issuer` is exactly `issuer` (a mismatch is refused: mix-up defence).
    public static func fetch(issuer: String, tls: TLSOptions = TLSOptions(), timeout: Duration = Discovery.timeout,
                             loop: CurlLoop = .shared) async throws(FetchFailure) -> AuthorizationServerMetadata {
        var lastProblem = "no metadata URL for issuer"
        for url in candidateURLs(for: issuer) {
            // Every request checks its URL on both readings (configuration checked the strict one).
            if let problem = EndpointPolicy.problem(with: url) {
                lastProblem = "discovery: refused \(url): \(problem)"
                continue
            }
            let response: HTTPResponse
            do {
                response = try await loop.perform(HTTPRequest(url: url, headers: [("Accept", "application/json")], timeout: timeout, tls: tls))
            } catch {
                lastProblem = "discovery: \(error)"
                continue
            }
            guard response.status == 200 else {
                lastProblem = "discovery: HTTP \(response.status) from \(url)"
                continue
            }
            guard let object = (try? JSONParser.parse(response.body))?.objectValue else {
                lastProblem = "discovery: \(url) is not a JSON object"
                continue
            }
            return try AuthorizationServerMetadata(object, issuer: issuer, url: url)
        }
        throw .transient(lastProblem)
    }
}

extension AuthorizationServerMetadata {
    /// Reads a metadata document fetched from `url` for `issuer`; refuses one that names another
    /// issuer (mix-up defence).
    init(_ object: JSONObject, issuer: String, url: String) throws(FetchFailure) {
        guard object["issuer"]?.stringValue == issuer else {
            throw .transient("discovery: metadata at \(url) names another issuer; refused")
        }
        self.init(issuer: issuer, tokenEndpoint: object["token_endpoint"]?.stringValue,
                  revocationEndpoint: object["revocation_endpoint"]?.stringValue,
                  deviceAuthorizationEndpoint: object["device_authorization_endpoint"]?.stringValue,
                  tokenEndpointAuthMethods: object["token_endpoint_auth_methods_supported"]?.arrayValue?.compactMap(\.stringValue)
                      ?? ["client_secret_basic"],
                  // (Bounded: a few short names are all a server has to say.)
                  dpopSigningAlgorithms: Self.names(object["dpop_signing_alg_values_supported"]),
                  authorizationEndpoint: object["authorization_endpoint"]?.stringValue,
                  codeChallengeMethods: Self.names(object["code_challenge_methods_supported"]),
                  issuerInAuthorizationResponse: object["authorization_response_iss_parameter_supported"]?.boolValue == true,
                  assertionSigningAlgorithms: Self.names(object["token_endpoint_auth_signing_alg_values_supported"]))
    }

    /// A list of algorithm or method names, bounded: a few short names are all a server has to say.
    private static func names(_ value: JSON?) -> [String]? {
        value?.arrayValue.map { values in values.prefix(32).compactMap { $0.stringValue.flatMap { $0.utf8.count <= 32 ? $0 : nil } } }
    }
}
