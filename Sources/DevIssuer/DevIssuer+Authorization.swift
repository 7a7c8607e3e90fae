import Basics
import DPoP
import WireJSON
import Synchronization

/// The authorization code grant with PKCE (RFC 6749 §4.1, RFC 7636) for native apps (RFC 8252).
///
/// `GET /authorize` checks the request in RFC 6749 §4.1.2.1's order: a missing, repeated or
/// unknown `client_id`, and a `redirect_uri` that is neither a loopback one nor registered, are
/// answered 400 on the page itself (no redirect to a URI nobody vouches for); every other
/// problem goes back through the redirect, with `error` and the request's `state`. PKCE is
/// required, S256 only, and so is `state`. Every redirect also carries `iss` (RFC 9207).
///
/// The ID token (scope `openid`) is a compact JWS signed HS256 with the client's secret as the
/// key (OpenID Connect Core §10.1), with `iss`, `aud`, `sub`, `iat`, `exp` and the request's
/// `nonce`. Nothing in tokenbroker verifies the signature; the test suite does, once.
extension DevIssuer {
    /// What `GET /authorize` makes of a request.
    private enum AuthorizationCheck {
        case accepted(AuthorizationGrant)
        /// Refused on the page: the client or the redirect URI cannot be trusted.
        case page(error: String, description: String)
        /// Refused through the redirect.
        case redirect(uri: String, error: String, description: String, state: String?)
    }

    /// `GET /authorize`: the request checked, then answered as the consent says.
    func authorize(_ request: HTTPServerRequest) -> HTTPServerAction {
        state.withLock { $0.counters.authorizationRequests += 1 }
        switch checkAuthorization(request.query) {
        case let .page(error, description):
            return Self.json(400, ["error": .string(error), "error_description": .string(description)])
        case let .redirect(uri, error, description, state):
            return Self.found(redirectURL(uri, [("error", error), ("error_description", description)], state: state))
        case let .accepted(grant):
            let consent = state.withLock { $0.consent } ?? options.consent
            switch consent {
            case .approve:
                return Self.found(codeRedirect(grant))
            case .deny:
                return Self.found(redirectURL(grant.redirectURI, [("error", "access_denied"), ("error_description", "The user denied the request.")],
                                              state: grant.state))
            case .ask:
                state.withLock { state in
                    forgetOldAuthorizations(&state)
                    state.pendingConsents[grant.state] = grant
                }
                let decide = baseURL + "/authorize/decide?" + FormEncoding.encode([("state", grant.state)])
                let text = """
                    tokenbroker development issuer: the client \(grant.clientID) asks for \(grant.scope.map { "the scope \($0)" } ?? "access").
                    Approve: \(decide)&action=approve
                    Deny:    \(decide)&action=deny

                    """
                return .respond(status: 200, headers: [("Content-Type", "text/plain; charset=utf-8"), ("Cache-Control", "no-store")],
                                body: Array(text.utf8))
            }
        }
    }

    /// `GET /authorize/decide?state=S&action=approve|deny`: the consent a person (or a test)
    /// gives to a request waiting with `Consent.ask`; answered with the redirect.
    func authorizationDecision(_ request: HTTPServerRequest) -> HTTPServerAction {
        let query = Dictionary(request.query, uniquingKeysWith: { first, _ in first })
        guard let requested = query["state"], let action = query["action"], action == "approve" || action == "deny" else {
            return .respond(status: 400, headers: [("Content-Type", "text/plain")],
                            body: Array("tokenbroker development issuer: open /authorize/decide?state=STATE&action=approve (or &action=deny)\n".utf8))
        }
        guard let location = action == "approve" ? approveAuthorization(state: requested) : denyAuthorization(state: requested) else {
            return .respond(status: 404, headers: [("Content-Type", "text/plain")], body: Array("no authorization request waits with that state\n".utf8))
        }
        return Self.found(location)
    }

    private func checkAuthorization(_ query: [(String, String)]) -> AuthorizationCheck {
        var parameters: [String: String] = [:]
        var repeated: Set<String> = []
        for (name, value) in query {
            if parameters[name] == nil { parameters[name] = value } else { repeated.insert(name) }
        }
        guard !repeated.contains("client_id"), let clientID = parameters["client_id"], options.clients[clientID] != nil else {
            return .page(error: "invalid_client", description: "Missing, repeated or unknown client_id.")
        }
        guard !repeated.contains("redirect_uri"), let uri = parameters["redirect_uri"],
              Self.isLoopbackRedirect(uri) || options.redirectURIs[clientID]?.contains(uri) == true else {
            return .page(error: "invalid_request", description: "Missing, repeated or unregistered redirect_uri "
                         + "(a loopback http://127.0.0.1:PORT/path or http://[::1]:PORT/path, or one the client registered).")
        }
        let state = repeated.contains("state") ? nil : parameters["state"].flatMap { Self.isVisible($0, upTo: 512) ? $0 : nil }
        func refuse(_ error: String, _ description: String) -> AuthorizationCheck {
            .redirect(uri: uri, error: error, description: description, state: state)
        }
        // RFC 6749 §3.1: no parameter more than once.
        guard repeated.isEmpty else { return refuse("invalid_request", "A parameter is repeated.") }
        guard let type = parameters["response_type"] else { return refuse("invalid_request", "Missing response_type.") }
        guard type == "code" else { return refuse("unsupported_response_type", "Only response_type=code is supported.") }
        guard let state else { return refuse("invalid_request", "Missing state: this server requires one (at most 512 visible characters).") }
        guard let challenge = parameters["code_challenge"] else { return refuse("invalid_request", "PKCE is required: missing code_challenge.") }
        guard parameters["code_challenge_method"] == "S256" else { return refuse("invalid_request", "code_challenge_method must be S256.") }
        guard Self.isPKCEValue(challenge, base64url: true) else {
            return refuse("invalid_request", "code_challenge must be 43 to 128 base64url characters.")
        }
        let scope = parameters["scope"]
        if let scope, !Self.isScope(scope) { return refuse("invalid_scope", "The scope is malformed.") }
        let nonce = parameters["nonce"]
        if let nonce, !Self.isVisible(nonce, upTo: 512) { return refuse("invalid_request", "The nonce must be at most 512 visible characters.") }
        return .accepted(AuthorizationGrant(clientID: clientID, redirectURI: uri, state: state, challenge: challenge, nonce: nonce, scope: scope,
                                            createdAt: Self.now()))
    }

    /// A new code for `grant`, and the redirect that carries it.
    func codeRedirect(_ grant: AuthorizationGrant) -> String {
        // `+`, `/` and `=` on purpose: the redirect and the token request must encode it right.
        let code = "dev-ac." + Self.random(32) + "+/="
        state.withLock { state in
            forgetOldAuthorizations(&state)
            state.codes[code] = CodeRecord(grant: grant, expiresAt: Self.now() + options.authorizationCodeLifetime.secondsValue)
        }
        return redirectURL(grant.redirectURI, [("code", code)], state: grant.state)
    }

    /// `uri` with `parameters`, `state` (unless a `wrongState` fault swaps it) and `iss` added
    /// to its query (a registered URI may have one of its own: RFC 6749 §3.1.2).
    func redirectURL(_ uri: String, _ parameters: [(String, String)], state requested: String?) -> String {
        var fields = parameters
        if let requested {
            let wrong = state.withLock { state in
                guard state.wrongStates > 0 else { return false }
                state.wrongStates -= 1
                return true
            }
            fields.append(("state", wrong ? "wrong-" + Self.random(32) : requested))
        }
        fields.append(("iss", baseURL))
        return uri + (uri.contains("?") ? "&" : "?") + FormEncoding.encode(fields)
    }

    /// Drops codes and waiting requests older than their use plus `authorizationMemory`.
    private func forgetOldAuthorizations(_ state: inout State) {
        let now = Self.now()
        state.codes = state.codes.filter { $0.value.expiresAt + Self.authorizationMemory > now }
        state.pendingConsents = state.pendingConsents.filter { $0.value.createdAt + Self.authorizationMemory > now }
    }

    /// `grant_type=authorization_code` (RFC 6749 §4.1.3, RFC 7636 §4.6) for the authenticated
    /// `clientID`: a code of its own, not redeemed before (a second redemption revokes the
    /// family the first started), not expired, the same `redirect_uri`, and a `code_verifier`
    /// whose S256 is the challenge. The first redemption spends the code whatever its outcome.
    func codeGrant(_ form: [String: String], clientID: String, jkt: String?) -> HTTPServerAction {
        guard let code = form["code"] else { return Self.oauthError("invalid_request", description: "Missing code.") }
        return state.withLock { state in
            state.counters.codeGrants += 1
            guard let record = state.codes[code], record.grant.clientID == clientID else { return Self.oauthError("invalid_grant") }
            if record.redeemed {
                // RFC 6749 §4.1.2: the tokens the code gave are revoked.
                state.counters.codeReplays += 1
                if let family = record.family { state.revokedFamilies.insert(family) }
                return Self.oauthError("invalid_grant", description: "The code was used before.")
            }
            state.codes[code]?.redeemed = true
            guard Self.now() < record.expiresAt else { return Self.oauthError("invalid_grant", description: "The code expired.") }
            guard form["redirect_uri"] == record.grant.redirectURI else {
                return Self.oauthError("invalid_grant", description: "redirect_uri is not the authorization request's.")
            }
            guard let verifier = form["code_verifier"], Self.isPKCEValue(verifier, base64url: false),
                  Base64.urlEncode(DPoPKey.sha256(Array(verifier.utf8))) == record.grant.challenge else {
                return Self.oauthError("invalid_grant", description: "PKCE verification failed.")
            }
            let family = state.nextFamily
            state.nextFamily += 1
            state.familyClients[family] = clientID
            state.familyJKT[family] = jkt
            state.codes[code]?.family = family
            let refresh = mintRefresh(&state, family: family)
            let access = mintAccess(&state, family: family, jkt: jkt)
            let openID = record.grant.scope?.split(separator: " ").contains("openid") ?? false
            return tokenAnswer(access, refresh: refresh, idToken: openID ? mintIDToken(&state, grant: record.grant) : nil)
        }
    }

    /// An OpenID Connect ID token (Core §2) for `grant`: HS256 under the client's secret.
    private func mintIDToken(_ state: inout State, grant: AuthorizationGrant) -> String {
        var nonce = grant.nonce
        if let forced = state.idTokenNonce {
            nonce = forced
            state.idTokenNonce = nil
        }
        let now = Int64(Self.now())
        var claims: JSONObject = ["iss": .string(baseURL), "aud": .string(grant.clientID), "sub": "dev-user", "iat": .int(now),
                                  "exp": .int(now + Int64(options.accessTokenLifetime.secondsValue))]
        if let nonce { claims["nonce"] = .string(nonce) }
        let header: JSON = ["alg": "HS256", "typ": "JWT"]
        let signingInput = Base64.urlEncode(header.encoded) + "." + Base64.urlEncode(JSON.object(claims).encoded)
        let key = Array((options.clients[grant.clientID] ?? "").utf8)
        return signingInput + "." + Base64.urlEncode(Self.hmacSHA256(key: key, Array(signingInput.utf8)))
    }

    /// HMAC-SHA-256 (RFC 2104).
    static func hmacSHA256(key: [UInt8], _ message: [UInt8]) -> [UInt8] {
        var block = key.count > 64 ? DPoPKey.sha256(key) : key
        block += [UInt8](repeating: 0, count: 64 - block.count)
        let inner = DPoPKey.sha256(block.map { $0 ^ 0x36 } + message)
        return DPoPKey.sha256(block.map { $0 ^ 0x5C } + inner)
    }

    private static func found(_ location: String) -> HTTPServerAction {
        .respond(status: 302, headers: [("Location", location), ("Cache-Control", "no-store")], body: [])
    }

    /// `http://127.0.0.1[:PORT]/…` or `http://[::1][:PORT]/…` (RFC 8252 §7.3: any port), of
    /// visible ASCII, with a path, without a fragment or a backslash.
    static func isLoopbackRedirect(_ uri: String) -> Bool {
        guard uri.utf8.count <= 2048, uri.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }), !uri.contains("#"), !uri.contains("\\") else { return false }
        for prefix in ["http://127.0.0.1", "http://[::1]"] where uri.hasPrefix(prefix) {
            var rest = uri.utf8.dropFirst(prefix.utf8.count)
            if rest.first == UInt8(ascii: ":") {
                rest = rest.dropFirst()
                let digits = rest.prefix { (0x30...0x39).contains($0) }
                guard (1...5).contains(digits.count), let port = Int(String(decoding: digits, as: UTF8.self)), (1...65535).contains(port) else {
                    return false
                }
                rest = rest.dropFirst(digits.count)
            }
            return rest.first == UInt8(ascii: "/")
        }
        return false
    }

    /// 43 to 128 characters of base64url (a challenge) or of RFC 7636's unreserved set (a verifier).
    static func isPKCEValue(_ text: String, base64url: Bool) -> Bool {
        (43...128).contains(text.utf8.count) && text.utf8.allSatisfy { byte in
            (0x41...0x5A).contains(byte) || (0x61...0x7A).contains(byte) || (0x30...0x39).contains(byte) || byte == UInt8(ascii: "-")
                || byte == UInt8(ascii: "_") || (!base64url && (byte == UInt8(ascii: ".") || byte == UInt8(ascii: "~")))
        }
    }

    /// RFC 6749 §3.3: scope tokens of %x21 / %x23-5B / %x5D-7E, one space apart.
    static func isScope(_ scope: String) -> Bool {
        scope.utf8.count <= 1024 && !scope.isEmpty
            && scope.utf8.split(separator: 0x20, omittingEmptySubsequences: false).allSatisfy { token in
                !token.isEmpty && token.allSatisfy { $0 >= 0x21 && $0 <= 0x7E && $0 != 0x22 && $0 != 0x5C }
            }
    }

    /// Not empty, at most `limit` bytes of printable ASCII (space included).
    static func isVisible(_ text: String, upTo limit: Int) -> Bool {
        !text.isEmpty && text.utf8.count <= limit && text.utf8.allSatisfy { $0 >= 0x20 && $0 <= 0x7E }
    }
}
