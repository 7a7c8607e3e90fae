import Varlink

/// What `ClientKey` does to a session's client keys before it lists them.
public enum ClientKeyChange: String, Sendable, Equatable, CaseIterable {
    /// Nothing (the signing key is made if the session has none yet).
    case show
    /// A next key, published (in the JWKS) before it signs.
    case rotate
    /// The next key signs from now on; the one that signed retires, still published.
    case promote
    /// The retiring keys are dropped from the JWKS.
    case retire
}

/// One client key as `ClientKey` lists it: its public part only.
public struct ClientKeyEntry: Sendable, Equatable {
    /// Its key id: the JWK thumbprint (RFC 7638).
    public var kid: String
    /// `signing`, `next` or `retiring`; `operator` for a `ClientKeyFile=` key.
    public var role: String
    /// The JWS algorithm it signs with (ES256, RS256, PS256).
    public var algorithm: String
    /// When it was made (Unix seconds; 0 for an operator's key).
    public var created: Int64
    /// The public key as a JWK (with `kid`, `use`, `alg`), compact JSON.
    public var jwk: String

    public init(kid: String, role: String, algorithm: String, created: Int64, jwk: String) {
        (self.kid, self.role, self.algorithm, self.created, self.jwk) = (kid, role, algorithm, created, jwk)
    }

    public init?(_ object: JSONObject) {
        guard let kid = object["kid"]?.stringValue, let role = object["role"]?.stringValue, let algorithm = object["algorithm"]?.stringValue,
              let created = object["created"]?.intValue, let jwk = object["jwk"]?.stringValue else { return nil }
        self.init(kid: kid, role: role, algorithm: algorithm, created: created, jwk: jwk)
    }

    public var parameters: JSONObject {
        ["kid": .string(kid), "role": .string(role), "algorithm": .string(algorithm), "created": .int(created), "jwk": .string(jwk)]
    }
}
