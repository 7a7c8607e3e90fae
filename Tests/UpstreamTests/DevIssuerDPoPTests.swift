#if canImport(Glibc)
import Glibc
#endif
import Basics
import DevIssuer
import DPoP
import Testing
import TestSupport
import WireJSON

/// The development issuer's DPoP (RFC 9449), over real loopback HTTP: proofs at the token
/// endpoint and the resource, bound refresh token families and access tokens, nonces, replays.
/// No token is ever printed: answers describe themselves by status and OAuth error only, and
/// messages name tokens by position.
@Suite("Development issuer: DPoP", .serialized)
struct DevIssuerDPoPTests {
    // MARK: - A blocking HTTP/1.1 client (one request per connection, every wait with a deadline)

    /// An HTTP answer; its description shows the status and the OAuth error, never the body.
    struct Answer: CustomStringConvertible {
        var status: Int
        /// Header names lower-cased.
        var headers: [(name: String, value: String)]
        var body: [UInt8]

        func header(_ name: String) -> String? { headers.first { $0.name == name }?.value }
        func headers(_ name: String) -> [String] { headers.filter { $0.name == name }.map(\.value) }
        var json: JSONObject? { (try? JSONParser.parse(ArraySlice(body)))?.objectValue }
        /// The OAuth `error` of a JSON body.
        var error: String? { json?["error"]?.stringValue }
        /// The `error` of the `WWW-Authenticate: DPoP` challenge.
        var challengeError: String? {
            guard let challenge = headers("www-authenticate").first(where: { $0.hasPrefix("DPoP ") }),
                  let start = challenge.firstRange(of: "error=\"")?.upperBound,
                  let end = challenge[start...].firstIndex(of: "\"") else { return nil }
            return String(challenge[start..<end])
        }
        var description: String { "HTTP \(status)" + (error ?? challengeError).map { " \($0)" }.orEmpty }
    }

    struct HTTPFailure: Error, CustomStringConvertible {
        var description: String
    }

    static func monotonicNow() -> Double {
        var time = timespec()
        clock_gettime(CLOCK_MONOTONIC, &time)
        return Double(time.tv_sec) + Double(time.tv_nsec) / 1e9
    }

    /// Sends one request to 127.0.0.1:`port` and reads the whole answer (the server closes
    /// after it: `Connection: close`), within 10 s.
    static func exchange(port: UInt16, method: String, target: String, headers: [(String, String)] = [], body: [UInt8] = []) throws -> Answer {
        let fd = LoopbackTCP.connect(Int(port))
        guard fd >= 0 else { throw HTTPFailure(description: "cannot connect to 127.0.0.1:\(port)") }
        defer { close(fd) }
        var timeout = timeval(tv_sec: 2, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        var head = "\(method) \(target) HTTP/1.1\r\nHost: 127.0.0.1:\(port)\r\nConnection: close\r\nContent-Length: \(body.count)\r\n"
        for (name, value) in headers { head += "\(name): \(value)\r\n" }
        let request = Array((head + "\r\n").utf8) + body
        var offset = 0
        while offset < request.count {
            let n = request.withUnsafeBytes { send(fd, $0.baseAddress.map { $0 + offset }, request.count - offset, Int32(MSG_NOSIGNAL)) }
            if n > 0 { offset += n } else if n < 0, errno == EINTR { continue } else { throw HTTPFailure(description: "send failed") }
        }
        let deadline = monotonicNow() + 10
        var received: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 16_384)
        while true {
            guard monotonicNow() < deadline else { throw HTTPFailure(description: "no complete answer within 10 s") }
            let n = chunk.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, 0) }
            if n > 0 {
                received += chunk[0..<n]
                guard received.count <= 1 << 20 else { throw HTTPFailure(description: "answer too long") }
            } else if n == 0 {
                break
            } else if errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK {
                throw HTTPFailure(description: "recv failed")
            }
        }
        return try parse(received)
    }

    static func parse(_ bytes: [UInt8]) throws -> Answer {
        guard let end = (0..<max(0, bytes.count - 3)).first(where: { bytes[$0..<($0 + 4)].elementsEqual([13, 10, 13, 10]) }) else {
            throw HTTPFailure(description: "no end of head")
        }
        let lines = String(decoding: bytes[..<end], as: UTF8.self).split(separator: "\r\n").map(String.init)
        let statusLine = lines.first?.split(separator: " ") ?? []
        guard statusLine.count >= 2, let status = Int(statusLine[1]) else { throw HTTPFailure(description: "no status line") }
        let headers = lines.dropFirst().compactMap { line -> (name: String, value: String)? in
            guard let colon = line.firstIndex(of: ":") else { return nil }
            return (line[..<colon].lowercased(), String(line[line.index(after: colon)...].drop { $0 == " " }))
        }
        return Answer(status: status, headers: headers, body: Array(bytes[(end + 4)...]))
    }

    // MARK: - The issuer's side

    static func issuer(_ mode: DevIssuer.DPoPMode, nonces: Bool = false) throws -> DevIssuer {
        var options = DevIssuer.Options()
        options.dpop = mode
        options.dpopNonces = nonces
        options.deviceInterval = .zero
        return try DevIssuer(options: options)
    }

    static var unixNow: Int64 { Int64(time(nil)) }

    /// A proof for `POST /token`.
    static func tokenProof(_ issuer: DevIssuer, _ key: DPoPKey, nonce: String? = nil, jti: String = DPoPProof.randomJTI()) throws -> String {
        try DPoPProof.make(key: key, method: "POST", url: issuer.tokenEndpoint, issuedAt: unixNow, nonce: nonce, jti: jti)
    }

    /// A proof for a resource request.
    static func resourceProof(_ issuer: DevIssuer, _ key: DPoPKey, method: String = "GET", url: String? = nil, token: String?,
                              nonce: String? = nil) throws -> String {
        try DPoPProof.make(key: key, method: method, url: url ?? issuer.resourceURL, issuedAt: unixNow, nonce: nonce, accessToken: token)
    }

    /// `POST /token` with the form (client_secret_post) and these `DPoP` headers.
    static func tokenRequest(_ issuer: DevIssuer, _ fields: [(String, String)], proofs: [String] = []) throws -> Answer {
        let form = FormEncoding.encode(fields + [("client_id", "tokenbroker"), ("client_secret", "dev-secret")])
        return try exchange(port: issuer.port, method: "POST", target: "/token",
                            headers: [("Content-Type", "application/x-www-form-urlencoded")] + proofs.map { ("DPoP", $0) }, body: Array(form.utf8))
    }

    static func refresh(_ issuer: DevIssuer, _ refreshToken: String, proofs: [String] = []) throws -> Answer {
        try tokenRequest(issuer, [("grant_type", "refresh_token"), ("refresh_token", refreshToken)], proofs: proofs)
    }

    /// A resource request with `Authorization: <scheme> <token>` and these `DPoP` headers.
    static func resource(_ issuer: DevIssuer, method: String = "GET", query: String = "", scheme: String = "DPoP", token: String,
                         proofs: [String] = []) throws -> Answer {
        try exchange(port: issuer.port, method: method, target: "/resource" + query,
                     headers: [("Authorization", "\(scheme) \(token)")] + proofs.map { ("DPoP", $0) })
    }

    /// A string field of a JSON answer, or an issue naming `what` (never the answer's body).
    static func field(_ answer: Answer, _ name: String, _ what: String) throws -> String {
        guard let value = answer.json?[name]?.stringValue else {
            Issue.record("\(what): no \(name) in the answer (\(answer))")
            throw HTTPFailure(description: "no \(name)")
        }
        return value
    }

    /// `cnf.jkt` of a JWT-shaped access token (nil if it is not one).
    static func confirmedThumbprint(_ token: String) -> String? {
        let parts = token.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3 else { return nil }
        var text = String(parts[1].map { $0 == "-" ? "+" : $0 == "_" ? "/" : $0 })
        while text.utf8.count % 4 != 0 { text += "=" }
        guard let bytes = Base64.decode(text), case let .object(claims)? = try? JSONParser.parse(ArraySlice(bytes)) else { return nil }
        return claims["cnf"]?.objectValue?["jkt"]?.stringValue
    }

    // MARK: - Tests

    @Test("a refresh with a proof answers a DPoP token bound to the key (cnf.jkt), which the resource accepts with a fresh proof carrying ath")
    func boundRefresh() throws {
        let issuer = try Self.issuer(.required)
        defer { issuer.stop() }
        let key = try DPoPKey()
        let answer = try Self.refresh(issuer, issuer.issueRefreshToken(), proofs: [Self.tokenProof(issuer, key)])
        #expect(answer.status == 200)
        #expect(answer.json?["token_type"] == "DPoP")
        let access = try Self.field(answer, "access_token", "refresh 1")
        let claimed = Self.confirmedThumbprint(access), recorded = issuer.thumbprint(ofAccessToken: access)
        #expect(claimed == key.thumbprint, "access token 1's cnf.jkt names the proof's key")
        #expect(recorded == key.thumbprint, "the issuer recorded access token 1's key")

        let get = try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: access)])
        #expect(get.status == 200)
        // Another method, with a query (htu leaves it out).
        let post = try Self.resource(issuer, method: "POST", query: "?a=1", token: access,
                                     proofs: [Self.resourceProof(issuer, key, method: "POST", url: issuer.resourceURL + "?a=1", token: access)])
        #expect(post.status == 200)
        #expect(issuer.counters.dpopProofsRefused == 0)

        let metadata = try Self.exchange(port: issuer.port, method: "GET", target: "/.well-known/oauth-authorization-server")
        #expect(metadata.json?["dpop_signing_alg_values_supported"] == ["ES256"])
    }

    @Test("the resource refuses a replayed proof, one for another URL or method, the bound token as Bearer, another key's proof, no ath or another token's ath; each 401, each counted")
    func resourceRefusals() throws {
        let issuer = try Self.issuer(.accepted)
        defer { issuer.stop() }
        let key = try DPoPKey()
        let first = try Self.refresh(issuer, issuer.issueRefreshToken(), proofs: [Self.tokenProof(issuer, key)])
        let access = try Self.field(first, "access_token", "refresh 1")
        let refresh = try Self.field(first, "refresh_token", "refresh 1")
        let second = try Self.refresh(issuer, refresh, proofs: [Self.tokenProof(issuer, key)])
        let otherAccess = try Self.field(second, "access_token", "refresh 2")

        let proof = try Self.resourceProof(issuer, key, token: access)
        let firstUse = try Self.resource(issuer, token: access, proofs: [proof])
        #expect(firstUse.status == 200)
        let refusals: [(String, String, () throws -> Answer)] = [
            ("the same proof again", "invalid_dpop_proof", { try Self.resource(issuer, token: access, proofs: [proof]) }),
            ("a proof for another URL", "invalid_dpop_proof", {
                try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, url: issuer.baseURL + "/other", token: access)])
            }),
            ("a proof for another method", "invalid_dpop_proof", {
                try Self.resource(issuer, method: "PUT", token: access, proofs: [Self.resourceProof(issuer, key, method: "GET", token: access)])
            }),
            ("the bound token as Bearer, no proof", "invalid_token", { try Self.resource(issuer, scheme: "Bearer", token: access) }),
            ("the bound token as DPoP, no proof", "invalid_dpop_proof", { try Self.resource(issuer, token: access) }),
            ("another key's proof", "invalid_dpop_proof", {
                try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, try DPoPKey(), token: access)])
            }),
            ("a proof without ath", "invalid_dpop_proof", { try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: nil)]) }),
            ("a proof with access token 2's ath", "invalid_dpop_proof", {
                try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: otherAccess)])
            }),
            ("two proofs", "invalid_dpop_proof", {
                try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: access), Self.resourceProof(issuer, key, token: access)])
            }),
        ]
        for (index, (what, error, send)) in refusals.enumerated() {
            let answer = try send()
            #expect(answer.status == 401 && answer.challengeError == error, "\(what)")
            #expect(issuer.counters.dpopProofsRefused == index + 1, "\(what) is counted")
        }
        // Still good with a fresh proof of its own key; a dead token is invalid_token, not a proof refusal.
        let fresh = try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: access)])
        #expect(fresh.status == 200)
        issuer.revokeAccessToken(access)
        let dead = try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: access)])
        #expect(dead.status == 401 && dead.challengeError == "invalid_token")
        #expect(issuer.counters.dpopProofsRefused == refusals.count)
        let counters = try Self.exchange(port: issuer.port, method: "GET", target: "/_dev/counters")
        #expect(counters.json?["dpop_refused"]?.intValue == Int64(refusals.count))
    }

    @Test("a Bearer token keeps working with Bearer in .accepted; sent with the DPoP scheme it is invalid_token")
    func bearerBesideDPoP() throws {
        let issuer = try Self.issuer(.accepted)
        defer { issuer.stop() }
        let answer = try Self.tokenRequest(issuer, [("grant_type", "client_credentials")])
        #expect(answer.status == 200 && answer.json?["token_type"] == "Bearer")
        let access = try Self.field(answer, "access_token", "client credentials 1")
        let recorded = issuer.thumbprint(ofAccessToken: access)
        #expect(recorded == nil, "access token 1 is a Bearer token")
        let asBearer = try Self.resource(issuer, scheme: "Bearer", token: access)
        #expect(asBearer.status == 200)
        let misused = try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, try DPoPKey(), token: access)])
        #expect(misused.status == 401 && misused.challengeError == "invalid_token")
        #expect(issuer.counters.dpopProofsRefused == 1)
    }

    @Test("a bound family refreshed with another key's proof, or none, is invalid_grant and lives on (no replay, no revocation); .required refuses a proofless request")
    func boundFamily() throws {
        let issuer = try Self.issuer(.accepted)
        defer { issuer.stop() }
        let key = try DPoPKey()
        let refresh = issuer.issueRefreshToken(boundTo: key.thumbprint)
        let stranger = try Self.refresh(issuer, refresh, proofs: [Self.tokenProof(issuer, try DPoPKey())])
        #expect(stranger.status == 400 && stranger.error == "invalid_grant")
        let proofless = try Self.refresh(issuer, refresh)
        #expect(proofless.status == 400 && proofless.error == "invalid_grant")
        let standing = issuer.lineage(of: refresh)
        #expect(standing?.revoked == false && standing?.index == 0 && standing?.newest == 0, "refresh token 1 is still the newest of a live family")
        #expect(issuer.counters.replays == 0 && issuer.activeRefreshTokens == 1)
        #expect(issuer.counters.dpopProofsRefused == 2)
        let rightful = try Self.refresh(issuer, refresh, proofs: [Self.tokenProof(issuer, key)])
        #expect(rightful.status == 200 && rightful.json?["token_type"] == "DPoP")
        let access = try Self.field(rightful, "access_token", "refresh 3")
        let claimed = Self.confirmedThumbprint(access)
        #expect(claimed == key.thumbprint)
        // The rotated token stays bound too.
        let next = try Self.field(rightful, "refresh_token", "refresh 3")
        let nextByStranger = try Self.refresh(issuer, next, proofs: [Self.tokenProof(issuer, try DPoPKey())])
        #expect(nextByStranger.error == "invalid_grant")
        let nextByKey = try Self.refresh(issuer, next, proofs: [Self.tokenProof(issuer, key)])
        #expect(nextByKey.status == 200)
        #expect(issuer.counters.replays == 0)

        let strict = try Self.issuer(.required)
        defer { strict.stop() }
        let unbound = try Self.refresh(strict, strict.issueRefreshToken())
        #expect(unbound.status == 400 && unbound.error == "invalid_dpop_proof")
        let bound = try Self.refresh(strict, strict.issueRefreshToken(boundTo: key.thumbprint))
        #expect(bound.status == 400 && bound.error == "invalid_dpop_proof")
        #expect(strict.counters.dpopProofsRefused == 2 && strict.counters.refreshGrants == 0)
    }

    @Test("client_credentials and the device flow with a proof give bound tokens; the device login's family is bound")
    func otherGrants() throws {
        let issuer = try Self.issuer(.required)
        defer { issuer.stop() }
        let key = try DPoPKey()
        let credentials = try Self.tokenRequest(issuer, [("grant_type", "client_credentials")], proofs: [Self.tokenProof(issuer, key)])
        #expect(credentials.status == 200 && credentials.json?["token_type"] == "DPoP")
        let first = try Self.field(credentials, "access_token", "client credentials 1")
        let claimed = Self.confirmedThumbprint(first), recorded = issuer.thumbprint(ofAccessToken: first)
        #expect(claimed == key.thumbprint && recorded == key.thumbprint)

        let form = FormEncoding.encode([("client_id", "tokenbroker"), ("client_secret", "dev-secret")])
        let authorization = try Self.exchange(port: issuer.port, method: "POST", target: "/device_authorization",
                                              headers: [("Content-Type", "application/x-www-form-urlencoded")], body: Array(form.utf8))
        let code = try Self.field(authorization, "device_code", "device authorization")
        let userCode = try Self.field(authorization, "user_code", "device authorization")
        let grant = [("grant_type", "urn:ietf:params:oauth:grant-type:device_code"), ("device_code", code)]
        let pending = try Self.tokenRequest(issuer, grant, proofs: [Self.tokenProof(issuer, key)])
        #expect(pending.error == "authorization_pending")
        #expect(issuer.decide(userCode: userCode, approve: true))
        let approved = try Self.tokenRequest(issuer, grant, proofs: [Self.tokenProof(issuer, key)])
        #expect(approved.status == 200 && approved.json?["token_type"] == "DPoP")
        let access = try Self.field(approved, "access_token", "device grant")
        let deviceClaimed = Self.confirmedThumbprint(access)
        #expect(deviceClaimed == key.thumbprint)
        let refresh = try Self.field(approved, "refresh_token", "device grant")
        let deviceByStranger = try Self.refresh(issuer, refresh, proofs: [Self.tokenProof(issuer, try DPoPKey())])
        #expect(deviceByStranger.error == "invalid_grant")
        let deviceByKey = try Self.refresh(issuer, refresh, proofs: [Self.tokenProof(issuer, key)])
        #expect(deviceByKey.status == 200)
        // Revocation is unchanged for a bound access token.
        let revoke = FormEncoding.encode([("token", access), ("client_id", "tokenbroker"), ("client_secret", "dev-secret")])
        let revoked = try Self.exchange(port: issuer.port, method: "POST", target: "/revoke",
                                        headers: [("Content-Type", "application/x-www-form-urlencoded")], body: Array(revoke.utf8))
        let valid = issuer.isValidAccessToken(access)
        #expect(revoked.status == 200 && !valid, "the device grant's access token is revoked")
    }

    @Test("nonces: the token endpoint challenges a proof without its nonce (400 use_dpop_nonce + DPoP-Nonce), takes it, and challenges an old one after rotation; the resource alike with 401 and a nonce of its own")
    func nonces() throws {
        let issuer = try Self.issuer(.required, nonces: true)
        defer { issuer.stop() }
        let key = try DPoPKey()
        let refresh = issuer.issueRefreshToken()
        let challenged = try Self.refresh(issuer, refresh, proofs: [Self.tokenProof(issuer, key)])
        #expect(challenged.status == 400 && challenged.error == "use_dpop_nonce")
        #expect(challenged.json?["error_description"]?.stringValue?.isEmpty == false)
        let nonce = try #require(challenged.header("dpop-nonce"))
        #expect(nonce == issuer.currentTokenNonce)
        let answer = try Self.refresh(issuer, refresh, proofs: [Self.tokenProof(issuer, key, nonce: nonce)])
        #expect(answer.status == 200 && answer.header("dpop-nonce") == nonce, "a success names the nonce too")
        let access = try Self.field(answer, "access_token", "refresh 1")
        let next = try Self.field(answer, "refresh_token", "refresh 1")

        issuer.rotateDPoPNonces()
        let stale = try Self.refresh(issuer, next, proofs: [Self.tokenProof(issuer, key, nonce: nonce)])
        #expect(stale.status == 400 && stale.error == "use_dpop_nonce")
        let rotated = try #require(stale.header("dpop-nonce"))
        #expect(rotated != nonce && rotated == issuer.currentTokenNonce)
        let withRotated = try Self.refresh(issuer, next, proofs: [Self.tokenProof(issuer, key, nonce: rotated)])
        #expect(withRotated.status == 200)

        // The resource: its own nonce.
        let resourceChallenge = try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: access)])
        #expect(resourceChallenge.status == 401 && resourceChallenge.challengeError == "use_dpop_nonce")
        let resourceNonce = try #require(resourceChallenge.header("dpop-nonce"))
        #expect(resourceNonce == issuer.currentResourceNonce && resourceNonce != issuer.currentTokenNonce)
        // The token endpoint's nonce is not the resource's.
        let wrongNonce = try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: access, nonce: rotated)])
        #expect(wrongNonce.status == 401 && wrongNonce.challengeError == "use_dpop_nonce")
        let served = try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: access, nonce: resourceNonce)])
        #expect(served.status == 200 && served.header("dpop-nonce") == resourceNonce)
        issuer.rotateDPoPNonces()
        let old = try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: access, nonce: resourceNonce)])
        #expect(old.status == 401 && old.challengeError == "use_dpop_nonce" && old.header("dpop-nonce") == issuer.currentResourceNonce)
        #expect(old.header("dpop-nonce") != resourceNonce)
        let withCurrent = try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: access, nonce: issuer.currentResourceNonce)])
        #expect(withCurrent.status == 200)
        #expect(issuer.counters.dpopNonceChallenges == 5 && issuer.counters.dpopProofsRefused == 0)
        let counters = try Self.exchange(port: issuer.port, method: "GET", target: "/_dev/counters")
        #expect(counters.json?["dpop_nonce_challenges"]?.intValue == 5)
    }

    @Test("the token endpoint refuses a replayed jti, two DPoP headers, an invalid proof (even in .accepted) and an oversized one")
    func tokenEndpointRefusals() throws {
        let issuer = try Self.issuer(.accepted)
        defer { issuer.stop() }
        let key = try DPoPKey()
        let credentials = [("grant_type", "client_credentials")]
        let proof = try Self.tokenProof(issuer, key)
        let firstUse = try Self.tokenRequest(issuer, credentials, proofs: [proof])
        #expect(firstUse.status == 200)
        let replay = try Self.tokenRequest(issuer, credentials, proofs: [proof])
        #expect(replay.status == 400 && replay.error == "invalid_dpop_proof", "the same proof again")
        // Another proof reusing the jti.
        let jti = DPoPProof.randomJTI()
        let firstOfJTI = try Self.tokenRequest(issuer, credentials, proofs: [Self.tokenProof(issuer, key, jti: jti)])
        #expect(firstOfJTI.status == 200)
        let reused = try Self.tokenRequest(issuer, credentials, proofs: [Self.tokenProof(issuer, key, jti: jti)])
        #expect(reused.status == 400 && reused.error == "invalid_dpop_proof", "a new proof with a used jti")
        let two = try Self.tokenRequest(issuer, credentials, proofs: [Self.tokenProof(issuer, key), Self.tokenProof(issuer, key)])
        #expect(two.status == 400 && two.error == "invalid_dpop_proof", "two proofs")
        let elsewhere = try DPoPProof.make(key: key, method: "POST", url: issuer.baseURL + "/elsewhere", issuedAt: Self.unixNow)
        let elsewhereAnswer = try Self.tokenRequest(issuer, credentials, proofs: [elsewhere])
        #expect(elsewhereAnswer.error == "invalid_dpop_proof", "a proof for another URL")
        let stale = try DPoPProof.make(key: key, method: "POST", url: issuer.tokenEndpoint, issuedAt: Self.unixNow - 600)
        let staleAnswer = try Self.tokenRequest(issuer, credentials, proofs: [stale])
        #expect(staleAnswer.error == "invalid_dpop_proof", "a stale proof")
        let long = String(repeating: "a", count: DPoPVerifier.maximumLength + 1)
        let longAnswer = try Self.tokenRequest(issuer, credentials, proofs: [long])
        #expect(longAnswer.error == "invalid_dpop_proof", "an oversized proof")
        #expect(issuer.counters.dpopProofsRefused == 6 && issuer.counters.clientCredentialsGrants == 2)
    }

    @Test("dpop == .off: a DPoP header is ignored, tokens are Bearer as before, metadata does not list DPoP")
    func off() throws {
        let issuer = try Self.issuer(.off, nonces: true)
        defer { issuer.stop() }
        let key = try DPoPKey()
        let answer = try Self.refresh(issuer, issuer.issueRefreshToken(), proofs: ["not-a-proof", Self.tokenProof(issuer, key)])
        #expect(answer.status == 200 && answer.json?["token_type"] == "Bearer" && answer.header("dpop-nonce") == nil)
        let access = try Self.field(answer, "access_token", "refresh 1")
        let shape = access.hasPrefix("dev-at."), recorded = issuer.thumbprint(ofAccessToken: access)
        #expect(shape && recorded == nil, "access token 1 is a Bearer token")
        let asBearer = try Self.resource(issuer, scheme: "Bearer", token: access, proofs: ["not-a-proof"])
        #expect(asBearer.status == 200)
        let dpopScheme = try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: access)])
        #expect(dpopScheme.status == 401 && dpopScheme.headers("www-authenticate") == ["Bearer realm=\"dev\""])
        let metadata = try Self.exchange(port: issuer.port, method: "GET", target: "/.well-known/oauth-authorization-server")
        #expect(metadata.status == 200 && metadata.json?["dpop_signing_alg_values_supported"] == nil)
        #expect(issuer.counters.dpopProofsRefused == 0 && issuer.counters.dpopNonceChallenges == 0)
    }

    @Test("the bindToOtherKey fault: the next bound answer's cnf.jkt (and the issuer's record) names another key, and the resource refuses the real key's proof")
    func bindToOtherKey() throws {
        let issuer = try Self.issuer(.required)
        defer { issuer.stop() }
        let key = try DPoPKey()
        issuer.inject([.bindToOtherKey])
        let answer = try Self.refresh(issuer, issuer.issueRefreshToken(), proofs: [Self.tokenProof(issuer, key)])
        #expect(answer.status == 200 && answer.json?["token_type"] == "DPoP")
        let access = try Self.field(answer, "access_token", "refresh 1")
        let claimed = Self.confirmedThumbprint(access), recorded = issuer.thumbprint(ofAccessToken: access)
        #expect(claimed != nil && claimed != key.thumbprint, "access token 1 names another key")
        #expect(recorded == claimed, "the issuer's record agrees with access token 1's claim")
        let refused = try Self.resource(issuer, token: access, proofs: [Self.resourceProof(issuer, key, token: access)])
        #expect(refused.status == 401 && refused.challengeError == "invalid_dpop_proof")
        // One answer only: the next is bound to the key.
        let next = try Self.refresh(issuer, try Self.field(answer, "refresh_token", "refresh 1"), proofs: [Self.tokenProof(issuer, key)])
        let nextClaimed = Self.confirmedThumbprint(try Self.field(next, "access_token", "refresh 2"))
        #expect(nextClaimed == key.thumbprint)
    }
}

extension Optional where Wrapped == String {
    /// The string, or "" for nil.
    fileprivate var orEmpty: String { self ?? "" }
}
