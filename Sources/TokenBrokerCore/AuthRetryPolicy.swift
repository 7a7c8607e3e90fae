/// Guarantee 4: one refresh and one retry per business request.
///
/// The client library (and any worker) sends a request with a token and, on rejection, asks this
/// policy whether to call `Recover` with the token it actually sent and retry once. The rules:
/// - only a `401` whose Bearer challenge says `invalid_token`, or gives no error code at all;
///   never a `403`, never `insufficient_scope` or `invalid_request`;
/// - only on the first attempt: a second `401` goes back to the caller as it is;
/// - only when the request can be sent again: no consumed body stream, and a non-idempotent
///   method only with an `Idempotency-Key`.
public enum AuthRetryPolicy {
    /// Whether a request can be sent a second time.
    public enum Replay: Sendable, Equatable {
        case replayable
        /// The body was a stream that the first attempt consumed.
        case consumedStream
        /// POST/PATCH (or another non-idempotent method) without an `Idempotency-Key`.
        case nonIdempotentWithoutKey
    }

    public enum Decision: Sendable, Equatable {
        /// Hand the response to the caller.
        case deliver
        /// Call `Recover` with the token that was sent, then send once more.
        case recoverAndRetry
        /// The resource server asked for a DPoP nonce (`use_dpop_nonce`, RFC 9449 §9): send
        /// once more with the same token and a proof that carries it.
        case retryWithNonce(String)
    }

    /// Methods RFC 9110 §9.2.2 calls idempotent.
    static let idempotentMethods: Set<String> = ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"]

    public static func replay(method: String, hasIdempotencyKey: Bool, bodyIsStream: Bool) -> Replay {
        if bodyIsStream { return .consumedStream }
        if !idempotentMethods.contains(method.uppercased()) && !hasIdempotencyKey { return .nonIdempotentWithoutKey }
        return .replayable
    }

    /// - Parameters:
    ///   - attempt: 1 for the first send, 2 for the retry.
    ///   - wwwAuthenticate: every `WWW-Authenticate` header value of the response.
    ///   - scheme: the scheme the request was sent with (`Bearer`, or `DPoP` with a proof): only
    ///     its challenges are read (a server that takes both sends both, RFC 9449 §7.1, and a
    ///     bare challenge of the other says nothing of this token).
    public static func decide(status: Int, wwwAuthenticate: [String], attempt: Int, replay: Replay, scheme: String = "Bearer") -> Decision {
        guard status == 401, attempt == 1, replay == .replayable else { return .deliver }
        let wanted = scheme.lowercased()
        let bearer = wwwAuthenticate.flatMap(AuthChallenge.parse).filter { $0.scheme.lowercased() == wanted }
        // No challenge of that scheme at all: a 401 still says "this token was not accepted".
        guard !bearer.isEmpty else { return .recoverAndRetry }
        for challenge in bearer {
            guard let code = challenge.parameters["error"] else { return .recoverAndRetry }
            if code == "invalid_token" { return .recoverAndRetry }
        }
        return .deliver
    }

    /// For a request with a DPoP proof: a `401` whose DPoP challenge says `use_dpop_nonce`, with
    /// a nonce (`DPoP-Nonce`) other than the one sent, is retried once with it; otherwise the
    /// rules above (`Recover` and one retry). So a request is sent at most three times: a
    /// nonce round trip and a recovery, each at most once.
    /// - Parameters:
    ///   - nonce: the response's `DPoP-Nonce`; `sentNonce` the one the request's proof carried.
    ///   - nonceRetried: whether this request has had its nonce retry; `recovered`, its recovery.
    ///   - scheme: `DPoP` when the request carried a proof, else `Bearer`.
    public static func decideWithProof(status: Int, wwwAuthenticate: [String], nonce: String?, sentNonce: String?,
                                       nonceRetried: Bool, recovered: Bool, replay: Replay, scheme: String = "DPoP") -> Decision {
        guard status == 401, replay == .replayable else { return .deliver }
        let dpop = wwwAuthenticate.flatMap(AuthChallenge.parse).filter { $0.scheme.lowercased() == "dpop" }
        // (A nonce is asked of a request that carried a proof; a bearer one's has nothing to do with it.)
        if scheme.lowercased() == "dpop", dpop.contains(where: { $0.parameters["error"] == "use_dpop_nonce" }) {
            guard !nonceRetried, let nonce, !nonce.isEmpty, nonce != sentNonce else { return .deliver }
            return .retryWithNonce(nonce)
        }
        return recovered ? .deliver : decide(status: status, wwwAuthenticate: wwwAuthenticate, attempt: 1, replay: replay, scheme: scheme)
    }

    /// Sends a request with `token`, and at most once more with a recovered token, following
    /// the rules above.
    ///
    /// - Parameters:
    ///   - send: sends the request with the given bearer token.
    ///   - inspect: the response's status and `WWW-Authenticate` values.
    ///   - recover: calls the broker's `Recover` with the rejected token; returns the new one.
    public static func perform<Response>(
        token: Secret,
        replay: Replay,
        send: (Secret) async throws -> Response,
        inspect: (Response) -> (status: Int, wwwAuthenticate: [String]),
        recover: (Secret) async throws -> Secret
    ) async throws -> Response {
        let first = try await send(token)
        let (status, challenges) = inspect(first)
        guard decide(status: status, wwwAuthenticate: challenges, attempt: 1, replay: replay) == .recoverAndRetry else {
            return first
        }
        let fresh = try await recover(token)
        return try await send(fresh)
    }
}

/// One challenge of a `WWW-Authenticate` header (RFC 9110 §11.6.1): a scheme and its
/// `name=value` parameters (token68 forms are kept as a parameter-less challenge).
public struct AuthChallenge: Sendable, Equatable {
    public var scheme: String
    /// Parameter names are lower-cased; quoted values are unquoted.
    public var parameters: [String: String]

    public init(scheme: String, parameters: [String: String] = [:]) {
        self.scheme = scheme
        self.parameters = parameters
    }

    /// Parses one header value, which may hold several challenges:
    /// `Bearer realm="api", error="invalid_token", Basic realm="x"`.
    public static func parse(_ header: String) -> [AuthChallenge] {
        var scanner = Scanner(Array(header.utf8))
        var challenges: [AuthChallenge] = []
        while true {
            scanner.skipSeparators()
            let scheme = scanner.token()
            guard !scheme.isEmpty else { break }
            var challenge = AuthChallenge(scheme: scheme)
            scanner.skipSpaces()
            if !scanner.parameter(into: &challenge.parameters) {
                _ = scanner.token68()   // `Basic abc==`: the credentials-like blob carries no parameters
            }
            // More parameters follow a comma; a token not followed by "=" starts the next challenge.
            while true {
                scanner.skipSpaces()
                guard scanner.peek == UInt8(ascii: ",") else { break }
                let mark = scanner.position
                scanner.skipSeparators()
                guard scanner.parameter(into: &challenge.parameters) else {
                    scanner.position = mark
                    break
                }
            }
            challenges.append(challenge)
        }
        return challenges
    }

    private struct Scanner {
        let bytes: [UInt8]
        var position = 0
        init(_ bytes: [UInt8]) { self.bytes = bytes }

        var peek: UInt8? { position < bytes.count ? bytes[position] : nil }

        mutating func skip(while predicate: (UInt8) -> Bool) {
            while let byte = peek, predicate(byte) { position += 1 }
        }

        mutating func skipSpaces() {
            skip { $0 == UInt8(ascii: " ") || $0 == UInt8(ascii: "\t") }
        }

        mutating func skipSeparators() {
            skip { $0 == UInt8(ascii: " ") || $0 == UInt8(ascii: "\t") || $0 == UInt8(ascii: ",") }
        }

        /// `name = value` (token or quoted string); restores the position and returns false
        /// when what follows is not a parameter.
        mutating func parameter(into parameters: inout [String: String]) -> Bool {
            let mark = position
            let name = token()
            skipSpaces()
            guard !name.isEmpty, peek == UInt8(ascii: "=") else {
                position = mark
                return false
            }
            position += 1
            skipSpaces()
            let value = peek == UInt8(ascii: "\"") ? quoted() : token()
            // `abc==` is a token68 with padding, not a parameter with an empty value.
            guard peek != UInt8(ascii: "=") else {
                position = mark
                return false
            }
            parameters[name.lowercased()] = value
            return true
        }

        /// An RFC 9110 `token`.
        mutating func token() -> String {
            let start = position
            skip { Self.isTokenByte($0) }
            return String(decoding: bytes[start..<position], as: UTF8.self)
        }

        /// A token68, with its trailing `=` padding.
        mutating func token68() -> String {
            let start = position
            skip { Self.isTokenByte($0) || $0 == UInt8(ascii: "/") || $0 == UInt8(ascii: "=") }
            return String(decoding: bytes[start..<position], as: UTF8.self)
        }

        /// A quoted string, unescaped; the cursor is on the opening quote.
        mutating func quoted() -> String {
            position += 1
            var value: [UInt8] = []
            while let byte = peek {
                position += 1
                if byte == UInt8(ascii: "\"") { break }
                if byte == UInt8(ascii: "\\"), let next = peek {
                    position += 1
                    value.append(next)
                } else {
                    value.append(byte)
                }
            }
            return String(decoding: value, as: UTF8.self)
        }

        static func isTokenByte(_ byte: UInt8) -> Bool {
            switch byte {
            case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "0")...UInt8(ascii: "9"):
                return true
            default:
                return "!#$%&'*+-.^_`|~".utf8.contains(byte)
            }
        }
    }
}
