/// Where new tokens come from: the OAuth client in the daemon, a fake in tests.
///
/// A source is stateless with respect to credentials: it is handed the refresh token to use and
/// returns what the server answered. It never stores a credential itself; only the coordinator
/// commits one, under the generation guard (guarantee 3).
public protocol TokenSource: Sendable {
    /// Performs one upstream token request.
    ///
    /// Throw a `FetchFailure` to classify the outcome; any other error counts as transient.
    /// Cancellation is a hint: a source may ignore it and return, and the coordinator drops
    /// the late answer when its generation is over.
    func fetch(_ request: FetchRequest) async throws -> FetchedToken
}

/// What the coordinator asks the source for.
public struct FetchRequest: Sendable, Equatable {
    /// The session's name, for the source's own bookkeeping (never a secret).
    public var session: String
    /// The generation this request belongs to.
    public var generation: Int
    /// The refresh token to redeem, or `nil` for grants without one (`client_credentials`).
    public var refreshToken: Secret?
    /// The session's DPoP key, when its requests carry proofs (`SessionRecord.proofKey`).
    public var proofKey: Secret?
    /// The type of the generation's current token, if it has one: a generation keeps the kind
    /// of token its first one was (DPoP-bound or bearer).
    public var tokenType: String?
    /// How long the request may take from when the source receives it, whether or not its
    /// caller still waits (under the source's own timeouts): a fleet holder's request ends
    /// before its flight lease can lapse for the others, discovery included. A duration, not an
    /// instant: the caller measures its budget by its own clock, the source by the process's.
    public var timeLimit: Duration?

    public init(session: String, generation: Int, refreshToken: Secret?, proofKey: Secret? = nil, tokenType: String? = nil,
                timeLimit: Duration? = nil) {
        self.session = session
        self.generation = generation
        self.refreshToken = refreshToken
        self.proofKey = proofKey
        self.tokenType = tokenType
        self.timeLimit = timeLimit
    }
}

/// A successful token response.
public struct FetchedToken: Sendable {
    public var accessToken: Secret
    /// `Bearer` unless the server says otherwise.
    public var tokenType: String
    /// The lifetime the server gave (`expires_in`, or less where a JWT access token says so), or
    /// `nil` when it gave none.
    public var expiresIn: Duration?
    /// When `expiresIn` counts from, Unix seconds: the whole second the request was sent in (a
    /// server counts from its own receipt of it, in whole seconds at the earliest). `nil`: from
    /// the answer's arrival (tokens that come from elsewhere than a request of this host).
    public var lifetimeStart: Int64?
    /// An instant after which the token is dead whatever `expiresIn` says (a JWT's `exp` with no
    /// `iat` to count a lifetime from), Unix seconds.
    public var notAfter: Int64?
    /// `expiresIn` is what is left of a token that came from elsewhere, not the lifetime its
    /// issuer gave: it says nothing of how long the issuer's tokens live.
    public var lifetimeIsRemainder = false
    /// A rotated refresh token; `nil` keeps the one that was sent.
    public var refreshToken: Secret?
    /// The OpenID Connect ID token of a login's answer (`id_token`), if it brought one: read for
    /// its claims (the login checks its `nonce`), never stored, logged or handed out.
    public var idToken: Secret?
    /// The answer's `scope`, where the caller reads it (a narrowed refresh: a wider one than
    /// asked is refused). Not stored.
    public var grantedScope: String?

    public init(accessToken: Secret, tokenType: String = "Bearer", expiresIn: Duration? = nil, refreshToken: Secret? = nil,
                idToken: Secret? = nil) {
        self.accessToken = accessToken
        self.tokenType = tokenType
        self.expiresIn = expiresIn
        self.refreshToken = refreshToken
        self.idToken = idToken
    }
}

extension FetchedToken {
    /// The refresh token in force after this answer to a request that sent `sent`: the rotated
    /// one, or `sent` itself when the server did not rotate. The one rotation rule, for the
    /// coordinator and for a fleet's shared record alike.
    public func refreshToken(replacing sent: Secret?) -> Secret? {
        refreshToken ?? sent
    }

    /// When the token ends, Unix seconds, for an answer received at `unixNow`: `expiresIn` from
    /// `lifetimeStart` (never later than the arrival), or `notAfter` if that is earlier; `nil`
    /// when neither says. The one expiry rule, for the coordinator and a fleet's shared record
    /// alike: never a later instant than the issuer meant.
    public func expiresAt(receivedAt unixNow: Double) -> Double? {
        let counted = expiresIn.map { (lifetimeStart.map { min(Double($0), unixNow) } ?? unixNow) + $0.seconds }
        guard let notAfter else { return counted }
        return min(counted ?? Double(notAfter), Double(notAfter))
    }
}

/// A classified failed fetch. `reason` is shown to callers and operators, so it must not
/// contain a token or secret: use the OAuth error code, an HTTP status, a transport error name.
public struct FetchFailure: Error, Sendable, Equatable {
    public enum Kind: Sendable, Equatable {
        /// Worth retrying later: network, timeout, 5xx, 429. `retryAfter` is the server's own
        /// `Retry-After`, which the backoff honours as a lower bound.
        case transient(retryAfter: Duration?)
        /// The server refused the request without saying why (a 400, 401 or 403 with no OAuth
        /// error code: some servers answer a revoked, replayed or unknown refresh token, or a
        /// wrong client secret, with a bare `400`). Retried with backoff like a transient
        /// failure, but the `RefreshPolicy.refusalLimit`-th since the last success ends a
        /// session that holds a refresh token, and the server sees the dead token no more.
        case refused(retryAfter: Duration?)
        /// Retrying cannot help (`invalid_grant`, a revoked or unknown client): the session ends
        /// until the next login.
        case terminal
    }

    public var kind: Kind
    public var reason: String
    /// What the server said about it in its own words (`error_description`), made printable and
    /// bounded: shown to operators (`ctl`, the journal, `Status`), never to workers in a reply.
    public var detail: String?
    /// The server said the refresh token itself is dead (`invalid_grant`): no client, broker
    /// or retry can use it any more (unlike a terminal failure of this client's configuration).
    public var grantIsDead = false

    public init(_ kind: Kind, reason: String, detail: String? = nil) {
        self.kind = kind
        self.reason = reason
        self.detail = detail
    }

    /// The reason, with the server's own words when it gave some.
    public var message: String {
        detail.map { "\(reason) (the server says: \"\($0)\")" } ?? reason
    }

    public static func transient(_ reason: String, retryAfter: Duration? = nil) -> FetchFailure {
        FetchFailure(.transient(retryAfter: retryAfter), reason: reason)
    }

    public static func refused(_ reason: String, retryAfter: Duration? = nil) -> FetchFailure {
        FetchFailure(.refused(retryAfter: retryAfter), reason: reason)
    }

    public static func terminal(_ reason: String) -> FetchFailure {
        FetchFailure(.terminal, reason: reason)
    }

    /// `invalid_grant`: the refresh token is dead.
    public static var deadGrant: FetchFailure {
        var failure = FetchFailure.terminal("invalid_grant")
        failure.grantIsDead = true
        return failure
    }
}
