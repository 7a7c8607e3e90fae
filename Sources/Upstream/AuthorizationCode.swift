import Basics
import DPoP
import TokenBrokerCore
import WireJSON
import HTTPTransport

/// A PKCE pair (RFC 7636): the verifier the client keeps and the S256 challenge it sends.
public struct PKCE: Sendable {
    /// `code_verifier` (§4.1): sent only to the token endpoint, with the code.
    public let verifier: Secret
    /// `code_challenge` (§4.2): base64url(SHA-256(verifier)).
    public let challenge: String
    /// `code_challenge_method`: S256 only (`plain` gives the verifier away).
    public static let method = "S256"

    /// A fresh pair: 32 random bytes as a base64url verifier (43 characters, §4.1's recommendation).
    public static func make() -> PKCE {
        PKCE(verifier: Secret(Base64.urlEncode(AuthorizationRequest.randomBytes(32))))
    }

    /// The pair of a verifier kept earlier (or RFC 7636's example in tests).
    public init(verifier: Secret) {
        self.verifier = verifier
        challenge = Self.challenge(of: verifier.reveal)
    }

    /// base64url(SHA-256(ASCII(verifier))) (§4.2).
    public static func challenge(of verifier: String) -> String {
        Base64.urlEncode(DPoPKey.sha256(Array(verifier.utf8)))
    }
}

/// One authorization code login's request (RFC 6749 §4.1.1, RFC 7636, OpenID Connect Core
/// §3.1.2.1): what it sends the browser with, and what its answer must match.
public struct AuthorizationRequest: Sendable {
    /// Where the authorization server sends the browser back: an absolute `http(s)` URL with a
    /// path and no query or fragment (the daemon's loopback listener, RFC 8252 §7.3).
    /// `readRedirect` matches nothing else.
    public let redirectURI: String
    /// The CSRF defence (RFC 6749 §10.12): the redirect must carry it back.
    public let state: String
    /// OpenID Connect's replay defence: the ID token must carry it back.
    public let nonce: String
    public let pkce: PKCE
    /// The issuer the answer must come from (RFC 9207): a redirect's `iss`, when it has one,
    /// must be this; with `issuerRequired` (the server's metadata promises `iss`), it must
    /// have one. nil: `iss` is not checked (no `Issuer=` to compare it with).
    public let issuer: String?
    public let issuerRequired: Bool

    /// A fresh request: 32 random bytes each for `state`, `nonce` and the PKCE verifier.
    public init(redirectURI: String, issuer: String? = nil, issuerRequired: Bool = false) {
        self.init(redirectURI: redirectURI, state: Base64.urlEncode(Self.randomBytes(32)), nonce: Base64.urlEncode(Self.randomBytes(32)),
                  pkce: .make(), issuer: issuer, issuerRequired: issuerRequired)
    }

    /// A request kept earlier.
    public init(redirectURI: String, state: String, nonce: String, pkce: PKCE, issuer: String? = nil, issuerRequired: Bool = false) {
        self.redirectURI = redirectURI
        self.state = state
        self.nonce = nonce
        self.pkce = pkce
        self.issuer = issuer
        self.issuerRequired = issuer != nil && issuerRequired
    }

    /// The URL to open in a browser: `authorizationEndpoint` (whose own query is kept, RFC 6749
    /// §3.1) with `response_type=code`, the client, the redirect URI, `state`, the S256
    /// challenge, `scope` and RFC 8707 `resource`s when given, and `nonce`. Every value is percent-encoded but RFC 3986's
    /// unreserved characters (a space as `%20`), which a query and a form decoder read alike.
    public func url(authorizationEndpoint: String, clientID: String, scope: String?, resources: [String] = []) -> String {
        var fields = [("response_type", "code"), ("client_id", clientID), ("redirect_uri", redirectURI), ("state", state),
                      ("code_challenge", pkce.challenge), ("code_challenge_method", PKCE.method)]
        if let scope { fields.append(("scope", scope)) }
        fields += resources.map { ("resource", $0) }
        fields.append(("nonce", nonce))
        let separator = !authorizationEndpoint.contains("?") ? "?" : authorizationEndpoint.hasSuffix("?") || authorizationEndpoint.hasSuffix("&") ? "" : "&"
        return authorizationEndpoint + separator + FormEncoding.encode(fields)
    }

    /// The parameters `url` sends.
    static let parameterNames: Set<String> = ["response_type", "client_id", "redirect_uri", "state", "code_challenge", "code_challenge_method",
                                              "scope", "nonce", "resource"]

    /// Why the authorization endpoint's own query (configured, or from metadata) cannot carry
    /// a request: it sets a parameter the request sends too (a URL with both is read one way
    /// or the other by a server), or one that does not decode. nil when it can.
    public static func endpointQueryProblem(_ authorizationEndpoint: String) -> String? {
        guard let mark = authorizationEndpoint.firstIndex(of: "?") else { return nil }
        let query = ArraySlice(authorizationEndpoint[authorizationEndpoint.index(after: mark)...].utf8)
        for pair in query.split(separator: UInt8(ascii: "&")) {
            let name = pair.split(separator: UInt8(ascii: "="), maxSplits: 1, omittingEmptySubsequences: false).first ?? pair
            guard let decoded = unescape(name) else { return "its own query has a malformed parameter" }
            if parameterNames.contains(decoded) { return "its own query sets \(decoded), which the login sends itself" }
        }
        return nil
    }

    /// The longest redirect read, in bytes.
    public static let longestRedirect = 8192
    /// The most parameters a redirect's query may have.
    public static let mostParameters = 32
    /// The longest code taken, in bytes.
    static let longestCode = 2048

    /// Reads the redirect that ends a login (RFC 6749 §4.1.2): a request-target
    /// (`/path?query`, what the loopback listener receives) or a full URL (what a person
    /// pastes; surrounding spaces and line ends are dropped). Untrusted input, read strictly:
    /// at most `longestRedirect` bytes of visible ASCII, no fragment, the redirect URI's path
    /// (a full URL: its scheme, authority and path, exactly), at most `mostParameters`
    /// parameters, each `name=value` once, percent-encoding well formed and decoding to UTF-8,
    /// and the request's `state` (compared in constant time) before anything else is believed.
    /// Then `iss` (RFC 9207) when the request names its issuer; then an `error` (a short plain
    /// code) is `.denied`, with its description made one printable line; else a `code` of
    /// visible ASCII is `.code`. Other parameters (`session_state`) are ignored, as RFC 6749
    /// §4.1.2 asks.
    public static func readRedirect(_ target: String, expecting request: AuthorizationRequest) -> RedirectOutcome {
        guard target.utf8.count <= longestRedirect else { return .invalid("the redirect is longer than \(longestRedirect) bytes") }
        var bytes = ArraySlice(target.utf8)
        while let first = bytes.first, [0x20, 0x09, 0x0D, 0x0A].contains(first) { bytes.removeFirst() }
        while let last = bytes.last, [0x20, 0x09, 0x0D, 0x0A].contains(last) { bytes.removeLast() }
        guard bytes.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else { return .invalid("the redirect has spaces, control or non-ASCII characters") }
        guard !bytes.contains(UInt8(ascii: "#")) else { return .invalid("the redirect has a fragment") }
        guard let expected = Self.origin(request.redirectURI) else {
            return .invalid("the login's redirect URI is not an http(s) URL with a path and no query or fragment")
        }
        let mark = bytes.firstIndex(of: UInt8(ascii: "?"))
        let base = bytes[..<(mark ?? bytes.endIndex)]
        guard base.first == UInt8(ascii: "/") ? base.elementsEqual(expected.path) : base.elementsEqual(expected.full) else {
            return .invalid("the redirect is not to the login's redirect URI")
        }
        guard let mark else { return .invalid("the redirect has no query") }
        let pairs = bytes[(mark + 1)...].split(separator: UInt8(ascii: "&"), omittingEmptySubsequences: false)
        guard pairs.count <= mostParameters else { return .invalid("the redirect has more than \(mostParameters) parameters") }
        var parameters: [String: String] = [:]
        for pair in pairs {
            guard let equals = pair.firstIndex(of: UInt8(ascii: "=")) else { return .invalid("the redirect has a parameter without a value") }
            guard let name = Self.unescape(pair[..<equals]), !name.isEmpty, let value = Self.unescape(pair[(equals + 1)...]) else {
                return .invalid("the redirect has a malformed parameter")
            }
            guard parameters.updateValue(value, forKey: name) == nil else { return .invalid("the redirect repeats a parameter") }
        }
        guard let state = parameters["state"] else { return .invalid("the redirect has no state") }
        guard Self.constantTimeEqual(state, request.state) else { return .invalid("the redirect's state is not the login's") }
        // RFC 9207 §2.4: an answer from another issuer is a mix-up, whatever it says.
        if let expected = request.issuer {
            if let issuer = parameters["iss"] {
                guard issuer == expected else { return .invalid("the redirect's iss names another issuer (RFC 9207 mix-up defence)", answersLogin: true) }
            } else if request.issuerRequired {
                return .invalid("the redirect has no iss, which the server's metadata says it always sends (RFC 9207)", answersLogin: true)
            }
        }
        if let error = parameters["error"] {
            guard parameters["code"] == nil else { return .invalid("the redirect has both a code and an error", answersLogin: true) }
            guard Self.isPlainCode(error) else { return .invalid("the redirect's error is not a short plain code", answersLogin: true) }
            return .denied(error: error, description: parameters["error_description"].flatMap(OAuthClient.printableLine))
        }
        guard let code = parameters["code"] else { return .invalid("the redirect has no code", answersLogin: true) }
        guard !code.isEmpty, code.utf8.count <= longestCode, code.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else {
            return .invalid("the redirect's code is not visible ASCII of at most \(longestCode) bytes", answersLogin: true)
        }
        return .code(Secret(code))
    }

    /// `scheme://authority/path` and `/path` of a redirect URI (nil: not one `readRedirect` can match).
    static func origin(_ uri: String) -> (full: [UInt8], path: [UInt8])? {
        let bytes = Array(uri.utf8)
        guard bytes.count <= 2048, bytes.allSatisfy({ $0 > 0x20 && $0 < 0x7F }), !bytes.contains(UInt8(ascii: "?")), !bytes.contains(UInt8(ascii: "#")),
              let scheme = ["http://", "https://"].first(where: { uri.lowercased().hasPrefix($0) }) else { return nil }
        guard let slash = bytes[scheme.utf8.count...].firstIndex(of: UInt8(ascii: "/")), slash > scheme.utf8.count else { return nil }
        return (bytes, Array(bytes[slash...]))
    }

    /// Percent-decoding (`+` is a space, as forms have it): nil for a `%` without two hex
    /// digits, or bytes that are not UTF-8.
    static func unescape(_ text: ArraySlice<UInt8>) -> String? {
        var output: [UInt8] = []
        output.reserveCapacity(text.count)
        var index = text.startIndex
        func hex(_ byte: UInt8) -> UInt8? {
            switch byte {
            case 0x30...0x39: return byte - 0x30
            case 0x41...0x46: return byte - 0x41 + 10
            case 0x61...0x66: return byte - 0x61 + 10
            default: return nil
            }
        }
        while index < text.endIndex {
            let byte = text[index]
            if byte == UInt8(ascii: "%") {
                guard index + 2 < text.endIndex, let high = hex(text[index + 1]), let low = hex(text[index + 2]) else { return nil }
                output.append(high << 4 | low)
                index += 3
            } else {
                output.append(byte == UInt8(ascii: "+") ? 0x20 : byte)
                index += 1
            }
        }
        return String(validating: output, as: UTF8.self)
    }

    /// Equal, in time that depends on the lengths only.
    static func constantTimeEqual(_ lhs: String, _ rhs: String) -> Bool {
        let left = Array(lhs.utf8), right = Array(rhs.utf8)
        var difference: UInt8 = left.count == right.count ? 0 : 1
        for index in 0..<max(left.count, right.count) {
            difference |= (index < left.count ? left[index] : 0) ^ (index < right.count ? right[index] : 0)
        }
        return difference == 0
    }

    /// An OAuth error code: 1 to 64 letters, digits, `_`, `-` or `.`.
    static func isPlainCode(_ text: String) -> Bool {
        (1...64).contains(text.utf8.count) && text.utf8.allSatisfy { byte in
            (0x41...0x5A).contains(byte) || (0x61...0x7A).contains(byte) || (0x30...0x39).contains(byte)
                || byte == UInt8(ascii: "_") || byte == UInt8(ascii: "-") || byte == UInt8(ascii: ".")
        }
    }

    static func randomBytes(_ count: Int) -> [UInt8] {
        var generator = SystemRandomNumberGenerator()
        return (0..<count).map { _ in UInt8.random(in: 0...255, using: &generator) }
    }
}

/// What a login's redirect says.
public enum RedirectOutcome: Sendable, Equatable {
    /// The authorization code, to redeem (`OAuthClient.redeem`).
    case code(Secret)
    /// The server's error (`access_denied`, `invalid_request`, …) and its description, one
    /// printable line (nil when there was none).
    case denied(error: String, description: String?)
    /// Not this login's answer, or not an answer: why (never the input's values).
    /// `answersLogin`: it carries the login's `state` (a browser coming back from this login's
    /// authorization request, then refused: another or no `iss`, no code, …), which no one who
    /// has not seen the request can forge.
    case invalid(String, answersLogin: Bool = false)
}

/// The claims of an OpenID Connect ID token a login checks, read WITHOUT verifying its
/// signature: the token came straight from the token endpoint over the connection the client
/// opened (OpenID Connect Core §3.1.3.7 lets such a client skip it), and the claims serve only to
/// bind it to the login (`nonce`) and its client and issuer.
public struct IDTokenClaims: Sendable, Equatable {
    public var issuer: String?
    /// `aud`: one string or an array of them.
    public var audiences: [String]
    public var subject: String?
    public var nonce: String?
    public var expiresAt: Int64?

    /// The longest ID token read, in bytes (longer ones are not kept from a token answer).
    public static let longestToken = 16_384

    /// The claims of a compact JWS (`header.payload.signature`, base64url) whose header and
    /// payload are JSON objects; nil for anything else, or a claim of the wrong type.
    public static func read(_ idToken: Secret) -> IDTokenClaims? {
        let token = idToken.reveal
        guard token.utf8.count <= longestToken else { return nil }
        let parts = token.utf8.split(separator: UInt8(ascii: "."), omittingEmptySubsequences: false)
        guard parts.count == 3, let header = Base64.urlDecode(String(decoding: parts[0], as: UTF8.self)),
              case let .object(protected)? = try? JSONParser.parse(ArraySlice(header)), protected["alg"]?.stringValue != nil,
              let payload = Base64.urlDecode(String(decoding: parts[1], as: UTF8.self)),
              case let .object(claims)? = try? JSONParser.parse(ArraySlice(payload)) else { return nil }
        /// A string claim: `.some(nil)` when absent, nil when of another type.
        func string(_ name: String) -> String?? {
            guard let value = claims[name] else { return .some(nil) }
            guard let text = value.stringValue else { return .none }
            return .some(text)
        }
        guard let issuer = string("iss"), let subject = string("sub"), let nonce = string("nonce") else { return nil }
        let audiences: [String]
        switch claims["aud"] {
        case nil: audiences = []
        case let .string(audience)?: audiences = [audience]
        case let .array(values)?:
            let names = values.compactMap(\.stringValue)
            guard names.count == values.count else { return nil }
            audiences = names
        default: return nil
        }
        var expiresAt: Int64?
        if let exp = claims["exp"] {
            guard let seconds = exp.intValue else { return nil }
            expiresAt = seconds
        }
        return IDTokenClaims(issuer: issuer, audiences: audiences, subject: subject, nonce: nonce, expiresAt: expiresAt)
    }
}

extension AuthorizationRequest {
    /// Why the ID token `token` brought cannot be taken as this login's, or nil when it can:
    /// it must be readable, carry this request's `nonce` (compared in constant time), name
    /// `clientID` among its audiences and, when `issuer` is given, be that issuer's. Without an
    /// ID token: a problem when `required` (a login that asked for the `openid` scope).
    /// The expiry and the signature are not checked (see `IDTokenClaims`).
    public func idTokenProblem(in token: FetchedToken, clientID: String, issuer: String?, required: Bool = true) -> String? {
        guard let idToken = token.idToken else { return required ? "the token answer has no id_token" : nil }
        guard let claims = IDTokenClaims.read(idToken) else { return "the id_token is not a readable JWT" }
        guard let nonce = claims.nonce else { return "the id_token has no nonce" }
        guard Self.constantTimeEqual(nonce, self.nonce) else { return "the id_token's nonce is not the login's (a replayed or injected ID token)" }
        guard claims.audiences.contains(clientID) else { return "the id_token is for another client (aud)" }
        if let issuer, claims.issuer != issuer { return "the id_token names another issuer (iss)" }
        return nil
    }
}

extension OAuthClient {
    /// `grant_type=authorization_code` (RFC 6749 §4.1.3, RFC 7636 §4.5): the code, the
    /// request's redirect URI and PKCE verifier, and `client_id` in the form whatever the client
    /// authentication (§4.1.3 requires it of public clients), through the token endpoint's
    /// path (DPoP proofs and nonces apply); the answer read as every token answer is. A refused
    /// code is `invalid_grant` (terminal): the login is over, the code spent.
    public func redeem(code: Secret, request: AuthorizationRequest) async throws(FetchFailure) -> FetchedToken {
        let response = try await tokenEndpointPost([("grant_type", "authorization_code"), ("code", code.reveal),
                                                    ("redirect_uri", request.redirectURI), ("code_verifier", request.pkce.verifier.reveal)],
                                                   clientIDInBody: true)
        guard response.status == 200 else { throw Self.classify(response) }
        return try await accept(response)
    }
}
