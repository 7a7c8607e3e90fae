import Basics
import Synchronization
import WireJSON

/// RFC 8693 token exchange, RFC 8707 resource indicators and scope narrowing: an access token
/// of this issuer (the subject token) for one restricted to the audiences and resources asked
/// for, with a scope within the subject's. A target in `refusedTargets`, or a resource that is
/// not an absolute URI without a fragment, is `invalid_target`; a wider scope `invalid_scope`.
/// The exchanged token belongs to the subject's family: revoking that family (a replay, the
/// parent's logout) ends it too. A DPoP-bound subject token needs a proof by its key, and the
/// exchanged token is bound to that key.
extension DevIssuer {
    static let tokenExchange = "urn:ietf:params:oauth:grant-type:token-exchange"
    static let accessTokenType = "urn:ietf:params:oauth:token-type:access_token"
    /// The scopes this issuer grants a token that was asked for none.
    static let fullScope: Set<Substring> = ["openid", "profile", "read", "write", "admin"]

    struct Narrowing {
        /// Audiences, then resources, as asked for.
        var targets: [String]
        var scope: String?
    }

    struct Refusal: Error {
        var answer: HTTPServerAction
    }

    /// What a token request asks to narrow to (`audience`, `resource`, `scope`, each as often
    /// as given), within `scope` (nil: the full scope), or its refusal.
    static func narrowing(_ body: [UInt8], within scope: String?, in state: State) -> Result<Narrowing, Refusal> {
        let pairs = FormEncoding.decode(String(decoding: body, as: UTF8.self))
        var targets: [String] = []
        for (name, value) in pairs where name == "audience" || name == "resource" {
            if name == "resource", !isResourceIndicator(value) {
                return .failure(Refusal(answer: oauthError("invalid_target", description: "A resource must be an absolute URI without a fragment.")))
            }
            if state.refusedTargets.contains(value) {
                return .failure(Refusal(answer: oauthError("invalid_target", description: "This issuer does not issue tokens for that target.")))
            }
            if !targets.contains(value) { targets.append(value) }
        }
        let granted = scope.map { Set($0.split(separator: " ")) } ?? fullScope
        guard let asked = pairs.last(where: { $0.0 == "scope" })?.1 else { return .success(Narrowing(targets: targets, scope: scope)) }
        let words = Set(asked.split(separator: " "))
        guard !words.isEmpty, words.isSubset(of: granted) else {
            return .failure(Refusal(answer: oauthError("invalid_scope", description: "The scope asked for is wider than the one granted.")))
        }
        return .success(Narrowing(targets: targets, scope: words.sorted().joined(separator: " ")))
    }

    /// RFC 8707 §2: an absolute URI (a scheme, `://`) without a fragment.
    static func isResourceIndicator(_ value: String) -> Bool {
        guard let colon = value.firstIndex(of: ":"), value[colon...].hasPrefix("://"), colon > value.startIndex else { return false }
        return !value.contains("#") && value.utf8.allSatisfy { $0 > 0x20 && $0 < 0x7F }
    }

    func exchange(_ request: HTTPServerRequest, _ form: [String: String], jkt: String?) -> HTTPServerAction {
        state.withLock { state in
            state.counters.tokenExchanges += 1
            guard let subject = form["subject_token"], form["subject_token_type"] == Self.accessTokenType else {
                return Self.oauthError("invalid_request", description: "subject_token and an access token subject_token_type are required.")
            }
            if let requested = form["requested_token_type"], requested != Self.accessTokenType {
                return Self.oauthError("invalid_request", description: "Only access tokens are issued by exchange.")
            }
            guard let record = state.accessTokens[subject], Self.valid(subject, in: state) else {
                return Self.oauthError("invalid_grant", description: "The subject token is not valid.")
            }
            // A DPoP-bound subject token is exchanged only with its key's proof (else whoever
            // saw the token could trade it for a bearer one), and the new token is bound to it.
            if let bound = record.jkt, bound != jkt {
                state.counters.dpopProofsRefused += 1
                return Self.oauthError("invalid_grant", description: jkt == nil ? "The subject token is DPoP-bound: a proof by its key is required."
                                                                                 : "The subject token is bound to another DPoP key.")
            }
            let narrowing: Narrowing
            switch Self.narrowing(request.body, within: record.scope, in: state) {
            case let .success(value): narrowing = value
            case let .failure(refusal):
                state.counters.narrowingsRefused += 1
                return refusal.answer
            }
            let access = mintAccess(&state, family: record.family, jkt: jkt)
            state.accessTokens[access.token]?.audiences = narrowing.targets
            state.accessTokens[access.token]?.scope = narrowing.scope
            var body: JSONObject = ["access_token": .string(access.token), "token_type": access.bound ? "DPoP" : "Bearer",
                                    "issued_token_type": .string(Self.accessTokenType),
                                    "expires_in": .int(Int64(access.lifetime.secondsValue))]
            if let scope = narrowing.scope { body["scope"] = .string(scope) }
            return Self.json(200, .object(body), extra: [("Cache-Control", "no-store"), ("Pragma", "no-cache")])
        }
    }

    /// The audiences and resources an access token is restricted to (empty: none), or nil for
    /// a token this issuer does not know.
    public func audiences(ofAccessToken token: String) -> [String]? {
        state.withLock { $0.accessTokens[token]?.audiences }
    }

    /// The scope an access token carries (nil: the full scope, or a token this issuer does not know).
    public func scope(ofAccessToken token: String) -> String? {
        state.withLock { $0.accessTokens[token]?.scope }
    }

    /// How many access tokens restricted to `target` are still valid here.
    public func liveAccessTokens(for target: String) -> Int {
        state.withLock { state in state.accessTokens.filter { $0.value.audiences.contains(target) && Self.valid($0.key, in: state) }.count }
    }

    /// Makes the issuer refuse tokens for `target` (an audience or resource) with `invalid_target`
    /// (or take them again).
    public func refuseTarget(_ target: String, _ refused: Bool = true) {
        state.withLock { state in
            if refused { state.refusedTargets.insert(target) } else { state.refusedTargets.remove(target) }
        }
    }
}
