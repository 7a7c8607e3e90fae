#if canImport(Glibc)
import Glibc
#endif
import Basics
import DevIssuer
import HTTPTransport
import Testing
import TestSupport
import WireJSON

/// The development issuer's JWT client authentication (`private_key_jwt`, federated platform
/// identities) and JWT-bearer grant (RFC 7523), over real loopback HTTP, with assertions signed
/// by the openssl command line (never by our own signer). No token, assertion or key is ever
/// printed: answers describe themselves by status, OAuth error and the issuer's own description.
@Suite("Development issuer: JWT client assertions", .serialized)
struct DevIssuerAssertionTests {
    static let assertionType = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
    static let jwtBearer = "urn:ietf:params:oauth:grant-type:jwt-bearer"
    static let platform = "https://kubernetes.default.svc.cluster.local"
    static let workload = "system:serviceaccount:build:runner"

    /// An HTTP answer; its description shows the status, the OAuth error and its description
    /// (the issuer's words, never a credential), never the body.
    struct Answer: CustomStringConvertible {
        var status: Int
        var json: JSONObject?
        var error: String? { json?["error"]?.stringValue }
        var why: String { json?["error_description"]?.stringValue ?? "" }
        var accessToken: String? { json?["access_token"]?.stringValue }
        var description: String { "HTTP \(status)" + (error.map { " \($0): \(why)" } ?? "") }
    }

    static var now: Int64 { Int64(time(nil)) }

    /// A random `jti`.
    static func randomID() -> String { Base64.urlEncode(randomBytes(16)) }

    /// Random bytes for made-up values.
    static func randomBytes(_ count: Int) -> [UInt8] {
        var generator = SystemRandomNumberGenerator()
        return (0..<count).map { _ in UInt8.random(in: 0...255, using: &generator) }
    }

    /// POSTs a form to the token endpoint (10 s deadline).
    static func token(_ issuer: DevIssuer, _ form: [(String, String)], basic: (String, String)? = nil) async throws -> Answer {
        var headers = [(name: "Content-Type", value: "application/x-www-form-urlencoded")]
        if let (id, secret) = basic {
            headers.append((name: "Authorization", value: "Basic " + Base64.encode(Array((FormEncoding.escape(id) + ":" + FormEncoding.escape(secret)).utf8))))
        }
        return try await send(HTTPRequest(method: "POST", url: issuer.tokenEndpoint, headers: headers, body: Array(FormEncoding.encode(form).utf8),
                                          timeout: .seconds(10)))
    }

    static func send(_ request: HTTPRequest) async throws -> Answer {
        let response = try await CurlLoop.shared.perform(request)
        return Answer(status: response.status, json: (try? JSONParser.parse(ArraySlice(response.body)))?.objectValue)
    }

    /// The public JWK of an openssl key.
    static func jwk(_ key: OpenSSLSigningKey, kid: String? = nil) -> JSONObject {
        var members = key.jwk.sorted { $0.key < $1.key }.map { (key: $0.key, value: JSON.string($0.value)) }
        if let kid { members.append((key: "kid", value: .string(kid))) }
        return JSONObject(members)
    }

    /// A JWT signed by `key`: `claims` as given (a nil value leaves the claim out).
    static func jwt(_ key: OpenSSLSigningKey, alg: String = "ES256", kid: String? = nil, _ claims: [(String, JSON?)]) async throws -> String {
        var header: JSONObject = ["alg": .string(alg), "typ": "JWT"]
        if let kid { header["kid"] = .string(kid) }
        let body = JSONObject(claims.compactMap { name, value in value.map { (key: name, value: $0) } })
        return try await key.jws(header: String(decoding: JSON.object(header).encoded, as: UTF8.self),
                                 claims: String(decoding: JSON.object(body).encoded, as: UTF8.self), algorithm: alg)
    }

    /// A client's own assertion's claims (RFC 7523 §3), each replaceable (`extra` replaces or adds).
    static func clientClaims(_ issuer: DevIssuer, client: String, iss: JSON? = nil, sub: JSON? = nil, aud: JSON? = nil, exp: JSON? = nil,
                             jti: JSON? = nil, extra: [(String, JSON?)] = []) -> [(String, JSON?)] {
        let base: [(String, JSON?)] = [("iss", iss ?? .string(client)), ("sub", sub ?? .string(client)), ("aud", aud ?? .string(issuer.baseURL)),
                                       ("exp", exp ?? .int(now + 120)), ("iat", .int(now)), ("jti", jti ?? .string(Self.randomID()))]
        return base.filter { member in !extra.contains { $0.0 == member.0 } } + extra
    }

    /// A client_credentials request authenticated by `assertion`.
    static func clientCredentials(_ assertion: String, clientID: String? = nil) -> [(String, String)] {
        var form = [("grant_type", "client_credentials"), ("client_assertion_type", assertionType), ("client_assertion", assertion)]
        if let clientID { form.append(("client_id", clientID)) }
        return form
    }

    @Test("a private_key_jwt assertion signed ES256, RS256 or PS256 with the client's registered key gets a token")
    func eachAlgorithm() async throws {
        let ec = try await OpenSSLSigningKey(.p256)
        let rsa = try await OpenSSLSigningKey(.rsa(bits: 2048))
        var options = DevIssuer.Options()
        options.clientKeys = ["svc-es": [Self.jwk(ec)]]
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        // Registered at run time: by the call, and through the development route.
        issuer.registerClientKeys("svc-rs", jwks: [Self.jwk(rsa, kid: "r1")])
        let upload = try await Self.send(HTTPRequest(method: "POST", url: issuer.baseURL + "/_dev/client-keys?client=svc-ps",
                                                     body: JSON.object(["keys": [.object(Self.jwk(rsa))]]).encoded, timeout: .seconds(10)))
        #expect(upload.status == 200)
        for (client, alg, kid) in [("svc-es", "ES256", nil), ("svc-rs", "RS256", "r1"), ("svc-ps", "PS256", nil)] as [(String, String, String?)] {
            let assertion = try await Self.jwt(alg == "ES256" ? ec : rsa, alg: alg, kid: kid, Self.clientClaims(issuer, client: client))
            let answer = try await Self.token(issuer, Self.clientCredentials(assertion, clientID: client))
            #expect(answer.status == 200, "\(alg): \(answer)")
            #expect(answer.json?["refresh_token"] == nil && answer.accessToken.map(issuer.isValidAccessToken) == true, "\(alg)")
        }
        #expect(issuer.counters.clientAssertions == 3 && issuer.counters.clientAssertionsRefused == 0)
        // Keys replaced: the old key no longer authenticates the client.
        issuer.registerClientKeys("svc-es", jwks: [Self.jwk(rsa)])
        let stale = try await Self.jwt(ec, Self.clientClaims(issuer, client: "svc-es"))
        #expect(try await Self.token(issuer, Self.clientCredentials(stale)).error == "invalid_client")
    }

    @Test("a replayed jti is refused while the first assertion is unexpired; another jti, or the same one by another client, is not")
    func replay() async throws {
        let key = try await OpenSSLSigningKey(.p256)
        var options = DevIssuer.Options()
        options.clientKeys = ["a": [Self.jwk(key)], "b": [Self.jwk(key)]]
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        let first = try await Self.jwt(key, Self.clientClaims(issuer, client: "a", jti: "once"))
        #expect(try await Self.token(issuer, Self.clientCredentials(first)).status == 200)
        let again = try await Self.token(issuer, Self.clientCredentials(first))
        #expect(again.status == 401 && again.error == "invalid_client" && again.why.contains("jti"), "\(again)")
        // A new assertion with the same jti is a replay too.
        let reused = try await Self.jwt(key, Self.clientClaims(issuer, client: "a", jti: "once", extra: [("n", 2)]))
        #expect(try await Self.token(issuer, Self.clientCredentials(reused)).status == 401)
        let fresh = try await Self.jwt(key, Self.clientClaims(issuer, client: "a", jti: "twice"))
        #expect(try await Self.token(issuer, Self.clientCredentials(fresh)).status == 200)
        let otherClient = try await Self.jwt(key, Self.clientClaims(issuer, client: "b", jti: "once"))
        #expect(try await Self.token(issuer, Self.clientCredentials(otherClient)).status == 200)
        let counters = issuer.counters
        #expect(counters.assertionReplays == 2 && counters.clientAssertionsRefused == 2 && counters.clientAssertions == 3, "\(counters)")
        let report = try await Self.send(HTTPRequest(url: issuer.baseURL + "/_dev/counters", timeout: .seconds(10)))
        #expect(report.json?["assertion_replays"] == 2 && report.json?["client_assertions"] == 3 && report.json?["client_assertions_refused"] == 2)
    }

    @Test("refused with invalid_client and the failed check named: wrong aud, expired, far-future exp, iat or nbf ahead, no or long jti, wrong iss or sub, another key, alg none or HS256, a changed claim, another client_id")
    func refusals() async throws {
        let key = try await OpenSSLSigningKey(.p256)
        let other = try await OpenSSLSigningKey(.p256)
        var options = DevIssuer.Options()
        options.clientKeys = ["svc": [Self.jwk(key)], "neighbour": [Self.jwk(other)]]
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        func claims(iss: JSON? = nil, sub: JSON? = nil, aud: JSON? = nil, exp: JSON? = nil, jti: JSON? = nil,
                    extra: [(String, JSON?)] = []) -> [(String, JSON?)] {
            Self.clientClaims(issuer, client: "svc", iss: iss, sub: sub, aud: aud, exp: exp, jti: jti, extra: extra)
        }
        /// An unsigned token with this header algorithm (and a signature of junk).
        func unsigned(_ alg: String) -> String {
            let body = JSONObject(claims().compactMap { name, value in value.map { (key: name, value: $0) } })
            return Base64.urlEncode(JSON.object(["alg": .string(alg), "typ": "JWT"]).encoded) + "." + Base64.urlEncode(JSON.object(body).encoded)
                + "." + (alg == "none" ? "" : Base64.urlEncode(Self.randomBytes(32)))
        }
        let good = try await Self.jwt(key, claims())
        let parts = good.split(separator: ".", omittingEmptySubsequences: false)
        let widened = JSONObject(claims(extra: [("scope", "admin")]).compactMap { name, value in value.map { (key: name, value: $0) } })
        let tampered = parts[0] + "." + Base64.urlEncode(JSON.object(widened).encoded) + "." + parts[2]
        let cases: [(String, String, [(String, String)], String)] = [
            ("wrong aud", try await Self.jwt(key, claims(aud: "https://elsewhere.example")), [], "aud"),
            ("token endpoint aud under .issuer", try await Self.jwt(key, claims(aud: .string(issuer.tokenEndpoint))), [], "aud"),
            ("no aud", try await Self.jwt(key, claims(aud: .null)), [], "aud"),
            ("expired", try await Self.jwt(key, claims(exp: .int(Self.now - 120))), [], "expired"),
            ("far-future exp", try await Self.jwt(key, claims(exp: .int(Self.now + 3600))), [], "future"),
            ("no exp", try await Self.jwt(key, claims(exp: .string("soon"))), [], "exp"),
            ("iat ahead", try await Self.jwt(key, claims(extra: [("iat", .int(Self.now + 600))])), [], "iat"),
            ("nbf ahead", try await Self.jwt(key, claims(extra: [("nbf", .int(Self.now + 600))])), [], "nbf"),
            ("no jti", try await Self.jwt(key, claims(jti: .int(7))), [], "jti"),
            ("long jti", try await Self.jwt(key, claims(jti: .string(String(repeating: "j", count: 257)))), [], "jti"),
            ("iss not sub", try await Self.jwt(key, claims(iss: "someone-else")), [], "iss"),
            ("another client's sub and iss", try await Self.jwt(key, claims(iss: "neighbour", sub: "neighbour")), [], "signature"),
            ("another key", try await Self.jwt(other, claims()), [], "signature"),
            ("an unregistered client", try await Self.jwt(key, claims(iss: "nobody", sub: "nobody")), [], "keys"),
            ("alg none", unsigned("none"), [], "algorithm"),
            ("alg HS256", unsigned("HS256"), [], "algorithm"),
            ("a changed claim", String(tampered), [], "signature"),
            ("another client_id", good, [("client_id", "neighbour")], "client_id"),
            ("another assertion type", good, [("client_assertion_type", "urn:ietf:params:oauth:client-assertion-type:saml2-bearer")], "client_assertion_type"),
        ]
        for (name, assertion, changes, word) in cases {
            var form = Self.clientCredentials(assertion)
            for (field, value) in changes {
                form.removeAll { $0.0 == field }
                form.append((field, value))
            }
            let answer = try await Self.token(issuer, form)
            #expect(answer.status == 401 && answer.error == "invalid_client" && answer.why.contains(word), "\(name): \(answer)")
            #expect(!answer.why.contains(assertion.prefix(40)), "\(name): the description echoes the assertion")
        }
        #expect(issuer.counters.clientAssertionsRefused == cases.count && issuer.counters.clientAssertions == 0)
        // The well-formed one was never spent by the refusals above: it still works, once.
        #expect(try await Self.token(issuer, Self.clientCredentials(good)).status == 200)
    }

    @Test("an assertion with Basic authentication or a client_secret as well is refused: exactly one method")
    func oneMethod() async throws {
        let key = try await OpenSSLSigningKey(.p256)
        var options = DevIssuer.Options()
        options.clientKeys = ["tokenbroker": [Self.jwk(key)]]
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        let withBasic = try await Self.jwt(key, Self.clientClaims(issuer, client: "tokenbroker"))
        let basic = try await Self.token(issuer, Self.clientCredentials(withBasic), basic: ("tokenbroker", "dev-secret"))
        #expect(basic.status == 401 && basic.error == "invalid_client" && basic.why.contains("exactly one"), "\(basic)")
        let withSecret = try await Self.jwt(key, Self.clientClaims(issuer, client: "tokenbroker"))
        let post = try await Self.token(issuer, Self.clientCredentials(withSecret, clientID: "tokenbroker") + [("client_secret", "dev-secret")])
        #expect(post.status == 401 && post.error == "invalid_client", "\(post)")
        // Each method alone still works.
        #expect(try await Self.token(issuer, [("grant_type", "client_credentials")], basic: ("tokenbroker", "dev-secret")).status == 200)
        let alone = try await Self.jwt(key, Self.clientClaims(issuer, client: "tokenbroker"))
        #expect(try await Self.token(issuer, Self.clientCredentials(alone)).status == 200)
    }

    @Test("assertionAudience: the token endpoint, or either; aud may be an array containing it")
    func audiences() async throws {
        let key = try await OpenSSLSigningKey(.p256)
        for (audience, takesIssuer, takesEndpoint) in [(DevIssuer.AssertionAudience.issuer, true, false), (.tokenEndpoint, false, true), (.either, true, true)] {
            var options = DevIssuer.Options()
            options.clientKeys = ["svc": [Self.jwk(key)]]
            options.assertionAudience = audience
            let issuer = try DevIssuer(options: options)
            defer { issuer.stop() }
            let toIssuer = try await Self.jwt(key, Self.clientClaims(issuer, client: "svc", aud: .string(issuer.baseURL)))
            let toEndpoint = try await Self.jwt(key, Self.clientClaims(issuer, client: "svc", aud: ["https://other.example", .string(issuer.tokenEndpoint)]))
            #expect(try await Self.token(issuer, Self.clientCredentials(toIssuer)).status == (takesIssuer ? 200 : 401), "\(audience) issuer")
            #expect(try await Self.token(issuer, Self.clientCredentials(toEndpoint)).status == (takesEndpoint ? 200 : 401), "\(audience) endpoint")
        }
    }

    @Test("a trusted platform's identity token authenticates the client federated to it, again and again; an unmapped, expired or untrusted one does not")
    func federated() async throws {
        let platformKey = try await OpenSSLSigningKey(.rsa(bits: 2048))
        let stranger = try await OpenSSLSigningKey(.rsa(bits: 2048))
        var options = DevIssuer.Options()
        options.trustedIssuers = [Self.platform: [Self.jwk(platformKey, kid: "k8s-1")]]
        options.federatedClients = ["\(Self.platform) \(Self.workload)": "tokenbroker"]
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        func platformToken(_ key: OpenSSLSigningKey, iss: String = Self.platform, sub: String = Self.workload, exp: Int64 = Self.now + 540) async throws -> String {
            // A projected service account token: no jti needed, reused until renewed.
            try await Self.jwt(key, alg: "RS256", kid: "k8s-1", [("iss", .string(iss)), ("sub", .string(sub)), ("aud", [.string(issuer.baseURL)]),
                                                                ("exp", .int(exp)), ("iat", .int(Self.now)), ("nbf", .int(Self.now))])
        }
        let identity = try await platformToken(platformKey)
        for round in 0..<3 {
            let answer = try await Self.token(issuer, Self.clientCredentials(identity, clientID: round == 0 ? "tokenbroker" : nil))
            #expect(answer.status == 200, "round \(round): \(answer)")
        }
        #expect(issuer.counters.clientAssertions == 3 && issuer.counters.assertionReplays == 0)
        let refused: [(String, String, String)] = [
            ("unmapped subject", try await platformToken(platformKey, sub: "system:serviceaccount:build:other"), "federated"),
            ("expired", try await platformToken(platformKey, exp: Self.now - 120), "expired"),
            ("another signer", try await platformToken(stranger), "signature"),
        ]
        for (name, assertion, word) in refused {
            let answer = try await Self.token(issuer, Self.clientCredentials(assertion))
            #expect(answer.status == 401 && answer.error == "invalid_client" && answer.why.contains(word), "\(name): \(answer)")
        }
        let wrongClient = try await Self.token(issuer, Self.clientCredentials(identity, clientID: "someone"))
        #expect(wrongClient.status == 401, "\(wrongClient)")
        // Registered at run time: a second platform and a mapping.
        issuer.trustIssuer("https://ci.example", keys: [Self.jwk(stranger, kid: "k8s-1")])
        issuer.federate(issuer: "https://ci.example", subject: "repo:main", client: "tokenbroker")
        let ci = try await platformToken(stranger, iss: "https://ci.example", sub: "repo:main")
        #expect(try await Self.token(issuer, Self.clientCredentials(ci)).status == 200)
    }

    @Test("the JWT-bearer grant: a trusted platform's token for an access token of its subject, no refresh token; refused for an untrusted issuer, expired or for another audience")
    func jwtBearerGrant() async throws {
        let platformKey = try await OpenSSLSigningKey(.p256)
        let stranger = try await OpenSSLSigningKey(.p256)
        var options = DevIssuer.Options()
        options.trustedIssuers = [Self.platform: [Self.jwk(platformKey)]]
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        func assertion(_ key: OpenSSLSigningKey, iss: String = Self.platform, aud: String? = nil, exp: Int64 = Self.now + 300) async throws -> String {
            try await Self.jwt(key, [("iss", .string(iss)), ("sub", .string(Self.workload)), ("aud", .string(aud ?? issuer.baseURL)), ("exp", .int(exp))])
        }
        let identity = try await assertion(platformKey)
        let grant = [("grant_type", Self.jwtBearer), ("assertion", identity)]
        // Without client authentication, twice (no jti, no replay check), and with a valid client.
        for basic in [nil, nil, ("tokenbroker", "dev-secret")] as [(String, String)?] {
            let answer = try await Self.token(issuer, grant, basic: basic)
            #expect(answer.status == 200 && answer.json?["refresh_token"] == nil && answer.json?["token_type"] == "Bearer", "\(answer)")
            let token = try #require(answer.accessToken)
            #expect(issuer.isValidAccessToken(token) && issuer.subject(ofAccessToken: token) == Self.workload)
        }
        #expect(issuer.counters.jwtBearerGrants == 3)
        // Credentials given must be valid.
        #expect(try await Self.token(issuer, grant, basic: ("tokenbroker", "wrong")).error == "invalid_client")
        let refused: [(String, String, String)] = [
            ("untrusted issuer", try await assertion(stranger, iss: "https://stranger.example"), "not trusted"),
            ("trusted issuer, another signer", try await assertion(stranger), "signature"),
            ("expired", try await assertion(platformKey, exp: Self.now - 120), "expired"),
            ("another audience", try await assertion(platformKey, aud: "https://elsewhere.example"), "aud"),
        ]
        for (name, token, word) in refused {
            let answer = try await Self.token(issuer, [("grant_type", Self.jwtBearer), ("assertion", token)])
            #expect(answer.status == 400 && answer.error == "invalid_grant" && answer.why.contains(word), "\(name): \(answer)")
        }
        #expect(try await Self.token(issuer, [("grant_type", Self.jwtBearer)]).error == "invalid_request")
        #expect(issuer.counters.jwtBearerGrants == 3)
    }

    @Test("metadata lists private_key_jwt, its signing algorithms and the JWT-bearer grant; the key route refuses a body that is no JWKS")
    func metadata() async throws {
        var options = DevIssuer.Options()
        options.assertionSigningAlgorithms = ["ES256", "PS256"]
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        let answer = try await Self.send(HTTPRequest(url: issuer.baseURL + "/.well-known/oauth-authorization-server", timeout: .seconds(10)))
        let methods = answer.json?["token_endpoint_auth_methods_supported"]?.arrayValue ?? []
        #expect(methods.contains("private_key_jwt") && methods.contains("client_secret_basic"))
        #expect(answer.json?["token_endpoint_auth_signing_alg_values_supported"] == ["ES256", "PS256"])
        #expect(answer.json?["grant_types_supported"]?.arrayValue?.contains(.string(Self.jwtBearer)) == true)
        // What is advertised is what is accepted: RS256 is not.
        let rsa = try await OpenSSLSigningKey(.rsa(bits: 2048))
        issuer.registerClientKeys("svc", jwks: [Self.jwk(rsa)])
        let rs256 = try await Self.jwt(rsa, alg: "RS256", Self.clientClaims(issuer, client: "svc"))
        let refused = try await Self.token(issuer, Self.clientCredentials(rs256))
        #expect(refused.status == 401 && refused.why.contains("algorithm"), "\(refused)")
        for body in [Array("not json".utf8), JSON.object(["keys": ["a string"]]).encoded, Array(repeating: UInt8(ascii: " "), count: 70_000)] {
            let upload = try await Self.send(HTTPRequest(method: "POST", url: issuer.baseURL + "/_dev/client-keys?client=svc", body: body, timeout: .seconds(10)))
            #expect(upload.status == 400)
        }
    }
}
