import DevIssuer
import Foundation
import Testing
import TestSupport
import TokenBrokerClient
import Varlink

/// Derived sessions (issue 35): the real daemon against the development issuer's RFC 8693 token
/// exchange. Tokens are compared by fingerprint only.
@Suite("Derived sessions: narrowed tokens by token exchange, one flight per derived session, the parent's boundary", .serialized)
struct DerivedSessionTests {
    static let readAudience = "https://read.example"
    static let storage = "https://storage.example/bucket"

    static func config(_ issuer: DevIssuer, extra: String = "") -> String {
        "[Broker]\nSocketMode=0666\n\n" + Broker.oauthSession(issuer.tokenEndpoint) + """
        RevocationEndpoint=\(issuer.revocationEndpoint)

        [Session]
        Name=api-read
        DerivedFrom=api
        Audience=\(readAudience)
        Scope=read

        [Session]
        Name=api-storage
        DerivedFrom=api
        Resource=\(storage)
        \(extra)
        """
    }

    /// `keys`: `api` allows keys per call (`keyed`).
    static func withIssuerAndBroker(extra: String = "", keys: Bool = false, _ body: (DevIssuer, Broker) async throws -> Void) async throws {
        var options = DevIssuer.Options()
        options.deviceInterval = .seconds(1)
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        try await withBroker(config: keys ? keyedConfig(issuer) : config(issuer, extra: extra)) { broker in
            try await body(issuer, broker)
        }
    }

    static func logIn(_ broker: Broker, _ issuer: DevIssuer, generation: Int = 1) async throws {
        let login = try await broker.ctl(["login", "api", "--refresh-token-stdin"], stdin: issuer.issueRefreshToken() + "\n")
        #expect(login.code == 0 && login.out == "logged in api (generation \(generation))\n", "\(login.err)")
    }

    /// A blocking call on a thread of its own (many at once really are at once).
    static func onThread<T: Sendable>(_ body: @escaping @Sendable () throws -> T) async throws -> T {
        try await withCheckedThrowingContinuation { continuation in
            Thread { continuation.resume(with: Result { try body() }) }.start()
        }
    }

    @Test("a derived session's token is the parent's exchanged (RFC 8693): narrowed to its audience, resource and scope, the parent's own token unchanged; it needs no refresh of the parent, and a parent refresh does not derive again")
    func narrowedTokens() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            try await Self.logIn(broker, issuer)
            let parent = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
            let refreshes = issuer.counters.refreshGrants
            let read = try #require(try broker.call("GetToken", ["session": "api-read"]).parameters["token"]?.stringValue)
            let storage = try #require(try broker.call("GetToken", ["session": "api-storage"]).parameters["token"]?.stringValue)
            #expect(fp(read) != fp(parent) && fp(storage) != fp(parent) && fp(read) != fp(storage))
            #expect(issuer.audiences(ofAccessToken: read) == [Self.readAudience] && issuer.scope(ofAccessToken: read) == "read")
            #expect(issuer.audiences(ofAccessToken: storage) == [Self.storage] && issuer.scope(ofAccessToken: storage) == nil)
            #expect(issuer.audiences(ofAccessToken: parent) == [], "the parent's token is not narrowed")
            #expect(issuer.counters.tokenExchanges == 2 && issuer.counters.refreshGrants == refreshes, "the parent's valid token was the subject")
            // Served from each one's cache from now on.
            #expect(fp(try broker.call("GetToken", ["session": "api-read"]).parameters["token"]) == fp(read))
            // A refresh of the parent does not derive again; the derived token stays.
            #expect(try broker.call("Refresh", ["session": "api"]).error == nil)
            #expect(fp(try broker.call("GetToken", ["session": "api-read"]).parameters["token"]) == fp(read))
            #expect(issuer.counters.tokenExchanges == 2)
            let status = try #require(try broker.status("api-read"))
            #expect(status["derivedFrom"] == "api" && status["state"] == "active")
            #expect(try broker.status("api")?["derivedFrom"] == nil)
            // The tree in the metrics too, and in ctl status.
            let metrics = try await broker.ctl(["metrics"])
            #expect(metrics.code == 0 && metrics.out.contains("tokenbroker_derived_session_info{parent=\"api\",session=\"api-read\"} 1"))
            #expect(metrics.out.contains("tokenbroker_derived_session_info{parent=\"api\",session=\"api-storage\"} 1"))
            #expect(metrics.out.split(separator: "\n").filter { $0.hasPrefix("tokenbroker_derived_session_info{") }.count == 2, "the parent has none")
            let table = try await broker.ctl(["status"])
            #expect(table.code == 0 && table.out.split(separator: "\n").contains { $0.hasPrefix("api-read ") && $0.contains("derived from api") })
        }
    }

    @Test("eight demands at once on a derived session share one exchange: they join its flight, and all get its token", arguments: 0..<3)
    func oneFlight(_ run: Int) async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            try await Self.logIn(broker, issuer)
            _ = try broker.call("GetToken", ["session": "api"])   // the subject token, at hand
            issuer.inject([.hold])
            let demands = (0..<8).map { _ in
                Task { try await Self.onThread { try broker.call("GetToken", ["session": "api-storage"]).parameters["token"]?.stringValue } }
            }
            try await eventually("the exchange is held") { issuer.heldCount == 1 }
            try await eventually("the other seven demands joined it") { (try? broker.status("api-storage"))?["joinedWaiters"] == 7 }
            issuer.releaseHeld()
            var tokens: Set<String> = []
            for demand in demands { tokens.insert(fp(try await demand.value)) }
            #expect(tokens.count == 1 && !tokens.contains(fp(nil as String?)), "one token for all: \(tokens)")
            #expect(issuer.counters.tokenExchanges == 1)
        }
    }

    @Test("the parent's logout is every derived session's: its workers get SignedOut naming the parent's login, its watchers are told, the parent's next login derives anew")
    func oneBoundary() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            try await Self.logIn(broker, issuer)
            let first = try broker.call("GetToken", ["session": "api-read"]).parameters
            let watcher = try broker.client()
            let initial = try watcher.call("io.tokenbroker.Broker.Watch", ["session": "api-read"], more: true)
            #expect(initial.parameters["event"] == "token" && fp(initial.parameters["token"]) == fp(first["token"]))

            #expect(try broker.call("Logout", ["session": "api"]) == VarlinkReply())
            // When the logout returns, the derived session is signed out already.
            #expect(try broker.call("GetToken", ["session": "api-read"])
                    == .error("io.tokenbroker.Broker.SignedOut", ["session": "api-read", "login": "tokenbroker ctl login api"]))
            #expect(try broker.call("GetToken", ["session": "api-storage"]).error == "io.tokenbroker.Broker.SignedOut")
            let last = try watcher.nextReply()
            #expect(last.parameters["event"] == "signedOut" && !last.continues)
            #expect(try broker.status("api-read")?["state"] == "signedOut")
            let exchanges = issuer.counters.tokenExchanges

            try await Self.logIn(broker, issuer, generation: 3)
            let next = try broker.call("GetToken", ["session": "api-read"]).parameters
            #expect(fp(next["token"]) != fp(first["token"]) && issuer.counters.tokenExchanges == exchanges + 1)
            #expect((next["generation"]?.intValue ?? 0) > (first["generation"]?.intValue ?? 0))
            #expect(issuer.audiences(ofAccessToken: try #require(next["token"]?.stringValue)) == [Self.readAudience])
        }
    }

    @Test("the parent's logout while exchanges are under way: none installs, their waiters get SignedOut, and nothing they issued lives on at the issuer, which ties them to the parent's grant (race suite: logout during derivations)", arguments: 0..<3)
    func logoutDuringExchanges(_ run: Int) async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            try await Self.logIn(broker, issuer)
            _ = try broker.call("GetToken", ["session": "api"])
            // Both exchanges are processed (their tokens issued), then held: answers that come late.
            issuer.inject([.holdAfterProcessing, .holdAfterProcessing])
            let read = Task { try await Self.onThread { try broker.call("GetToken", ["session": "api-read"]) } }
            let storage = Task { try await Self.onThread { try broker.call("GetToken", ["session": "api-storage"]) } }
            try await eventually("both exchanges are held") { issuer.heldCount == 2 }
            #expect(try broker.call("Logout", ["session": "api"]) == VarlinkReply())
            issuer.releaseHeld()
            #expect(try await read.value.error == "io.tokenbroker.Broker.SignedOut")
            #expect(try await storage.value.error == "io.tokenbroker.Broker.SignedOut")
            #expect(try broker.call("GetToken", ["session": "api-read"]).error == "io.tokenbroker.Broker.SignedOut")
            #expect(issuer.counters.tokenExchanges == 2)
            // What the exchanges issued is dead at the issuer, with the parent's refresh token
            // family the logout revoked (the broker revokes nothing with the parent's client for
            // a derived session: at some servers that would end the parent's grant).
            try await eventually("no exchanged token lives on") {
                issuer.liveAccessTokens(for: Self.readAudience) == 0 && issuer.liveAccessTokens(for: Self.storage) == 0
            }
        }
    }

    @Test("a parent ended by its issuer (invalid_grant at a refresh) signs its derived sessions out; an admin Login on a derived session is refused")
    func parentEnds() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            try await Self.logIn(broker, issuer)
            #expect(try broker.call("GetToken", ["session": "api-read"]).error == nil)
            issuer.inject([.status(400, error: "invalid_grant", retryAfter: nil)])
            #expect(try broker.call("Refresh", ["session": "api"]).error == "io.tokenbroker.Broker.RefreshFailed")
            #expect(try broker.status("api")?["state"] == "ended")
            // (Told once the parent's waiters have their answer.)
            try await eventually("the derived sessions are signed out") {
                (try? broker.status("api-read"))?["state"] == "signedOut" && (try? broker.status("api-storage"))?["state"] == "signedOut"
            }
            #expect(try broker.call("GetToken", ["session": "api-read"]).error == "io.tokenbroker.Broker.SignedOut")
            let refused = try broker.call("Login", ["session": "api-read", "refreshToken": "r"])
            #expect(refused.error == "io.tokenbroker.Broker.LoginFailed")
            #expect(try broker.status("api-read")?["state"] == "signedOut")
        }
    }

    @Test("a change of the parent's settings reaches its derived sessions at a reload: they are rebuilt and derive anew; a reload that changes nothing keeps their tokens")
    func parentChangeReachesChildren() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            try await Self.logIn(broker, issuer)
            let before = try broker.call("GetToken", ["session": "api-read"]).parameters["token"]
            #expect(before != nil)
            #expect(try broker.call("Reload").error == nil)
            #expect(fp(try broker.call("GetToken", ["session": "api-read"]).parameters["token"]) == fp(before), "nothing changed: kept")
            let exchanges = issuer.counters.tokenExchanges
            let changed = Self.config(issuer).replacingOccurrences(of: "ClientSecretFile=@DIR@/client-secret\n",
                                                                   with: "ClientSecretFile=@DIR@/client-secret\nConnectTimeout=4s\n")
            #expect(changed != Self.config(issuer))
            try changed.replacingOccurrences(of: "@DIR@", with: broker.directory).write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            #expect(try broker.call("Reload").error == nil)
            let after = try broker.call("GetToken", ["session": "api-read"]).parameters["token"]
            #expect(after != nil && fp(after) != fp(before) && issuer.counters.tokenExchanges == exchanges + 1, "derived anew under the new settings")
        }
    }

    @Test("a refused exchange (invalid_target) ends that derived session with the server's reason, not the parent nor its other derived sessions; the parent's next login brings it back")
    func failuresStayLocal() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            try await Self.logIn(broker, issuer)
            issuer.refuseTarget(Self.storage)
            let refused = try broker.call("GetToken", ["session": "api-storage"])
            #expect(refused.error == "io.tokenbroker.Broker.RefreshFailed", "\(refused.error ?? "")")
            #expect(refused.parameters["retryable"] == false)
            let status = try #require(try broker.status("api-storage"))
            #expect(status["state"] == "ended" && (status["lastError"]?.stringValue ?? "").contains("invalid_target"))
            #expect(try broker.call("GetToken", ["session": "api"]).error == nil)
            #expect(try broker.call("GetToken", ["session": "api-read"]).error == nil)
            #expect(try broker.status("api")?["state"] == "active")
            // Still ended while the parent's generation lasts; the parent's next login starts it anew.
            issuer.refuseTarget(Self.storage, false)
            #expect(try broker.call("GetToken", ["session": "api-storage"]).error == "io.tokenbroker.Broker.RefreshFailed")
            try await Self.logIn(broker, issuer, generation: 2)
            let back = try broker.call("GetToken", ["session": "api-storage"])
            #expect(back.error == nil && issuer.audiences(ofAccessToken: back.parameters["token"]?.stringValue ?? "") == [Self.storage])
        }
    }

    @Test("a derived session of a signed-out parent is signed out from the start; a restart derives anew from the stored parent")
    func followsAtStart() async throws {
        let issuer = try DevIssuer(options: DevIssuer.Options())
        defer { issuer.stop() }
        let broker = try await Broker(config: Self.config(issuer))
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        #expect(try broker.status("api-read")?["state"] == "signedOut")
        #expect(try broker.call("GetToken", ["session": "api-read"]).error == "io.tokenbroker.Broker.SignedOut")
        try await Self.logIn(broker, issuer)
        #expect(try broker.status("api-read")?["state"] == "active")
        let parent = try broker.call("GetToken", ["session": "api"]).parameters["token"]
        let before = try broker.call("GetToken", ["session": "api-read"]).parameters["token"]
        #expect(before != nil)
        #expect(await broker.stop() == 0)

        let restarted = try await Broker(config: Self.config(issuer), reusing: broker.directory)
        let exchanges = issuer.counters.tokenExchanges
        #expect(fp(try restarted.call("GetToken", ["session": "api"]).parameters["token"]) == fp(parent), "the parent's token is restored")
        let after = try restarted.call("GetToken", ["session": "api-read"]).parameters["token"]
        #expect(after != nil && fp(after) != fp(before) && issuer.counters.tokenExchanges == exchanges + 1, "derived anew")
        #expect(await restarted.stop() == 0)
    }

    static let k1 = "https://k1.example/"
    static let k2 = "https://k2.example/"
    static let keyed = "AllowResources=\(k1) \(k2)\nAllowScopes=read write\nMaxKeys=2\n"

    static func keyedConfig(_ issuer: DevIssuer) -> String {
        config(issuer).replacingOccurrences(of: "ClientSecretFile=@DIR@/client-secret\n", with: "ClientSecretFile=@DIR@/client-secret\n" + keyed)
    }

    @Test("keys asked for per call: GetToken with resource or scope gets the session's token narrowed to that key, its own cached token; the same key however its scope is written; a key the session does not allow is refused as one no session has")
    func keysPerCall() async throws {
        try await Self.withIssuerAndBroker(keys: true) { issuer, broker in
            try await Self.logIn(broker, issuer)
            let parent = try broker.call("GetToken", ["session": "api"]).parameters["token"]
            let k1 = try broker.call("GetToken", ["session": "api", "resource": .string(Self.k1)])
            #expect(k1.error == nil && k1.parameters["generation"] != nil, "\(k1.error ?? "")")
            let k1Token = try #require(k1.parameters["token"]?.stringValue)
            #expect(fp(k1Token) != fp(parent) && issuer.audiences(ofAccessToken: k1Token) == [Self.k1])
            let read = try #require(try broker.call("GetToken", ["session": "api", "scope": "read write"]).parameters["token"]?.stringValue)
            #expect(issuer.scope(ofAccessToken: read) == "read write" && issuer.audiences(ofAccessToken: read) == [])
            #expect(issuer.counters.tokenExchanges == 2)
            // Cached per key; the scope's words in any order are one key.
            #expect(fp(try broker.call("GetToken", ["session": "api", "resource": .string(Self.k1)]).parameters["token"]) == fp(k1Token))
            #expect(fp(try broker.call("GetToken", ["session": "api", "scope": "write read"]).parameters["token"]) == fp(read))
            #expect(issuer.counters.tokenExchanges == 2)
            #expect(fp(try broker.call("GetToken", ["session": "api"]).parameters["token"]) == fp(parent), "the session's own token unchanged")
            // Refused alike: a resource or scope the session does not allow, and a key on a session that allows none.
            let notAllowed = VarlinkReply.error("org.varlink.service.InvalidParameter", ["parameter": "resource"])
            #expect(try broker.call("GetToken", ["session": "api", "resource": "https://elsewhere.example/"]) == notAllowed)
            #expect(try broker.call("GetToken", ["session": "api-read", "resource": .string(Self.k1)]) == notAllowed)
            #expect(try broker.call("GetToken", ["session": "api", "scope": "read admin"])
                    == .error("org.varlink.service.InvalidParameter", ["parameter": "scope"]))
            #expect(try broker.call("GetToken", ["session": "api", "resource": .string(Self.k1), "scope": "admin"])
                    == .error("org.varlink.service.InvalidParameter", ["parameter": "scope"]))
            #expect(try broker.call("GetToken", ["session": "api", "resource": "not a url"])
                    == .error("org.varlink.service.InvalidParameter", ["parameter": "resource"]))
            #expect(issuer.counters.tokenExchanges == 2)
            // Recover per key: a stale token gets the key's current one, the current one a new one.
            let stale = try broker.call("Recover", ["session": "api", "rejected": "some-old-token", "resource": .string(Self.k1)])
            #expect(fp(stale.parameters["token"]) == fp(k1Token) && issuer.counters.tokenExchanges == 2)
            let next = try broker.call("Recover", ["session": "api", "rejected": .string(k1Token), "resource": .string(Self.k1)])
            #expect(next.error == nil && fp(next.parameters["token"]) != fp(k1Token) && issuer.counters.tokenExchanges == 3)
        }
    }

    @Test("keys through every face a worker has: GetProof, Credential (of the session that serves the URL), ctl token, recover and proof, a credential helper in real git, and the Swift client: each the key's one token; a key the session does not allow refused the same way everywhere")
    func keysEverywhere() async throws {
        let issuer = try DevIssuer(options: DevIssuer.Options())
        defer { issuer.stop() }
        let config = Self.keyedConfig(issuer).replacingOccurrences(of: "MaxKeys=2\n", with: "MaxKeys=2\nServes=https://git.example.test/\n")
        try await withBroker(config: config) { broker in
            try await Self.logIn(broker, issuer)
            let k1 = try #require(try broker.call("GetToken", ["session": "api", "resource": .string(Self.k1)]).parameters["token"]?.stringValue)
            let read = try #require(try broker.call("GetToken", ["session": "api", "scope": "read"]).parameters["token"]?.stringValue)
            #expect(issuer.counters.tokenExchanges == 2)
            let url = "https://git.example.test/org/repo.git"

            let proof = try broker.call("GetProof", ["session": "api", "method": "GET", "uri": .string(url), "resource": .string(Self.k1)])
            #expect(proof.error == nil && fp(proof.parameters["token"]) == fp(k1) && proof.parameters["proof"] == nil
                    && proof.parameters["tokenType"] == "Bearer", "GetProof with a key: \(proof.error ?? "")")
            let credential = try broker.call("Credential", ["url": .string(url), "scope": "read"])
            #expect(credential.error == nil && credential.parameters["session"] == "api" && fp(credential.parameters["token"]) == fp(read))

            let token = try await broker.ctl(["token", "api", "--resource", Self.k1])
            #expect(token.code == 0 && fp(token.out.trimmingCharacters(in: .newlines)) == fp(k1), "ctl token: \(token.err)")
            let headers = try await broker.ctl(["proof", "api", "GET", url, "--scope", "read"])
            #expect(headers.code == 0 && headers.out.hasPrefix("Authorization: Bearer ") && headers.out.filter({ $0 == "\n" }).count == 1
                    && fp(String(headers.out.dropFirst("Authorization: Bearer ".count).dropLast())) == fp(read), "ctl proof: \(headers.err)")
            let recovered = try await broker.ctl(["recover", "api", "--resource", Self.k1], stdin: "an-old-token")
            #expect(recovered.code == 0 && fp(recovered.out.trimmingCharacters(in: .newlines)) == fp(k1), "ctl recover: \(recovered.err)")
            let wrongVerb = try await broker.ctl(["status", "--resource", Self.k1])
            #expect(wrongVerb.code == 64 && wrongVerb.err.contains("--resource belongs to"), "\(wrongVerb.err)")
            let badResource = try await broker.ctl(["token", "api", "--resource", "not-a-url"])
            #expect(badResource.code == 64 && badResource.err.contains("--resource needs an absolute URL"), "\(badResource.err)")

            // Real git, its helper narrowed to the key.
            var environment = ProcessInfo.processInfo.environment
            (environment["HOME"], environment["GIT_CONFIG_NOSYSTEM"], environment["TOKENBROKER_SOCKET"]) = (broker.directory, "1", broker.socket)
            let git = try Child("/usr/bin/git", ["-c", "credential.helper=", "-c", "credential.helper=\(Paths.tokenbroker) credential git --resource \(Self.k1)",
                                                 "credential", "fill"], environment: environment, directory: broker.directory,
                                stdin: "protocol=https\nhost=git.example.test\npath=org/repo.git\n\n")
            #expect(await git.wait(timeout: 60) == 0)
            let password = git.stdout.split(separator: "\n").first { $0.hasPrefix("password=") }.map { String($0.dropFirst("password=".count)) }
            #expect(fp(password) == fp(k1), "git's credential is the key's token")

            // The Swift client.
            let client = TokenBrokerClient(socketPath: broker.socket)
            #expect(fp(try await client.token(session: "api", resource: Self.k1).token) == fp(k1))
            #expect(fp(try await client.proof(session: "api", method: "GET", url: url, scope: "read").token.token) == fp(read))
            #expect(issuer.counters.tokenExchanges == 2, "every face found the two keys' tokens: no exchange more")

            // Refused alike everywhere: a resource the session does not allow.
            let notAllowed = VarlinkReply.error("org.varlink.service.InvalidParameter", ["parameter": "resource"])
            #expect(try broker.call("GetProof", ["session": "api", "method": "GET", "uri": .string(url), "resource": "https://elsewhere.example/"]) == notAllowed)
            #expect(try broker.call("Credential", ["url": .string(url), "resource": "https://elsewhere.example/"]) == notAllowed)
            do {
                _ = try await client.token(session: "api", resource: "https://elsewhere.example/")
                Issue.record("the client got a key the session does not allow")
            } catch {}
            #expect(issuer.counters.tokenExchanges == 2)
        }
    }

    @Test("keys: at most MaxKeys=, the least recently used dropped (counted in the metrics) and derived anew when asked again")
    func keysBounded() async throws {
        try await Self.withIssuerAndBroker(keys: true) { issuer, broker in
            try await Self.logIn(broker, issuer)
            let k1 = try broker.call("GetToken", ["session": "api", "resource": .string(Self.k1)]).parameters["token"]
            let k2 = try broker.call("GetToken", ["session": "api", "resource": .string(Self.k2)]).parameters["token"]
            // k1 used after k2: k2 is the least recently used when a third key comes.
            #expect(fp(try broker.call("GetToken", ["session": "api", "resource": .string(Self.k1)]).parameters["token"]) == fp(k1))
            _ = try broker.call("GetToken", ["session": "api", "scope": "read"])
            #expect(issuer.counters.tokenExchanges == 3)
            let metrics = try await broker.ctl(["metrics"])
            #expect(metrics.out.contains("tokenbroker_derived_keys{session=\"api\"} 2"), "\(metrics.err)")
            #expect(metrics.out.contains("tokenbroker_derived_keys_evicted_total{session=\"api\"} 1"))
            // k1 kept, k2 gone (derived anew when asked again, which drops the next least recent: k1).
            #expect(fp(try broker.call("GetToken", ["session": "api", "resource": .string(Self.k1)]).parameters["token"]) == fp(k1))
            #expect(issuer.counters.tokenExchanges == 3)
            let again = try broker.call("GetToken", ["session": "api", "resource": .string(Self.k2)]).parameters["token"]
            #expect(again != nil && fp(again) != fp(k2) && issuer.counters.tokenExchanges == 4, "derived anew")
        }
    }

    @Test("keys end with the session's generation: a key's exchange under way at the logout installs nothing and its caller gets SignedOut; after the logout no key is held; the next login derives them anew", arguments: 0..<3)
    func keysEndAtLogout(_ run: Int) async throws {
        try await Self.withIssuerAndBroker(keys: true) { issuer, broker in
            try await Self.logIn(broker, issuer)
            let before = try broker.call("GetToken", ["session": "api", "resource": .string(Self.k1)]).parameters["token"]
            // k2's first exchange is processed at the issuer, then its answer held until after the logout.
            issuer.inject([.holdAfterProcessing])
            let pending = Task { try await Self.onThread { try broker.call("GetToken", ["session": "api", "resource": .string(Self.k2)]) } }
            try await eventually("k2's exchange is held") { issuer.heldCount == 1 }
            #expect(try broker.call("Logout", ["session": "api"]) == VarlinkReply())
            let metrics = try await broker.ctl(["metrics"])
            #expect(metrics.out.contains("tokenbroker_derived_keys{session=\"api\"} 0"), "no key outlives the logout")
            issuer.releaseHeld()
            #expect(try await pending.value.error == "io.tokenbroker.Broker.SignedOut")
            #expect(try broker.call("GetToken", ["session": "api", "resource": .string(Self.k1)])
                    == .error("io.tokenbroker.Broker.SignedOut", ["session": "api"]))
            try await Self.logIn(broker, issuer, generation: 3)
            let after = try broker.call("GetToken", ["session": "api", "resource": .string(Self.k1)])
            #expect(after.error == nil && fp(after.parameters["token"]) != fp(before))
            #expect(issuer.audiences(ofAccessToken: after.parameters["token"]?.stringValue ?? "") == [Self.k1])
        }
    }

    @Test("keys are made at most MaxKeys= (or the guard's burst) per RefreshLimitInterval=, one uid at most half of them: a caller cycling through keys gets Throttled and costs the issuer no more exchanges, while another uid still makes its keys")
    func keyCreationBudget() async throws {
        let issuer = try DevIssuer(options: DevIssuer.Options())
        defer { issuer.stop() }
        let config = Self.keyedConfig(issuer).replacingOccurrences(of: "MaxKeys=2\n", with: "MaxKeys=2\nAllowUsers=\(Broker.workerUID)\n")
        try await withBroker(config: config) { broker in
            try await Self.logIn(broker, issuer)
            // MaxKeys=2 with the default burst of 10: ten keys may be made per 60 s, five by one uid.
            var throttled: [Int] = []
            for index in 0..<14 {
                let reply = try broker.call("GetToken", ["session": "api", "resource": .string(index % 2 == 0 ? Self.k1 : Self.k2),
                                                         "scope": index % 4 < 2 ? "read" : "write"])
                if reply.error == "io.tokenbroker.Broker.Throttled" { throttled.append(index) } else { #expect(reply.error == nil) }
            }
            // Calls 0 to 4 each make a key (four keys in turn, two kept: k2 write and k1 read at
            // the end); those that would make more are Throttled, evicting nothing; the others
            // find the two keys kept.
            #expect(throttled == [5, 6, 9, 10, 13] && issuer.counters.tokenExchanges == 5, "throttled \(throttled), exchanges \(issuer.counters.tokenExchanges)")
            // Another uid has its share still.
            let worker = try await broker.ctl(["token", "api", "--resource", Self.k2, "--scope", "read"], asUser: Broker.workerUID)
            #expect(worker.code == 0 && issuer.counters.tokenExchanges == 6, "\(worker.err)")
            #expect(try broker.call("GetToken", ["session": "api", "resource": .string(Self.k1), "scope": "write"]).error
                    == "io.tokenbroker.Broker.Throttled", "the hog is throttled still")
        }
    }

    @Test("configuration: a derived session names an OAuth parent of its own, narrows something, and sets none of the parent's keys")
    func configuration() async throws {
        let issuer = try DevIssuer(options: DevIssuer.Options())
        defer { issuer.stop() }
        let base = Self.config(issuer)
        let cases: [(String, String)] = [
            (base + "\n[Session]\nName=orphan\nDerivedFrom=nowhere\nScope=read\n", "DerivedFrom=nowhere: no such session is configured"),
            (base + "\n[Session]\nName=self\nDerivedFrom=self\nScope=read\n", "a session cannot derive from itself"),
            (base + "\n[Session]\nName=shared\nDerivedFrom=api\nScope=read\nFleet=yes\n", "Fleet=yes"),
            (base + "\n[Session]\nName=chain\nDerivedFrom=api-read\nScope=read\n", "the parent must be an Upstream=oauth session of its own"),
            (base + "\n[Session]\nName=wide\nDerivedFrom=api\n", "needs Audience=, Resource= or Scope="),
            (base + "\n[Session]\nName=own\nDerivedFrom=api\nScope=read\nClientID=other\n", "ClientID= is the parent's"),
            (base + "\n[Session]\nName=aud\nDerivedFrom=api\nAudience=https://a.example\nDerivation=refresh\n",
             "Audience= is an RFC 8693 token exchange parameter"),
            (base + "\n[Session]\nName=machine\nTokenEndpoint=\(issuer.tokenEndpoint)\nClientID=c\nClientSecretFile=@DIR@/client-secret\n"
                + "Grant=client_credentials\n\n[Session]\nName=of-machine\nDerivedFrom=machine\nScope=read\nDerivation=refresh\n",
             "Grant=client_credentials has none"),
            (base + "\n[Session]\nName=bad\nDerivedFrom=api\nResource=not-a-url\n", "is not a valid resource"),
            (base + "\n[Session]\nName=plain\nUpstream=test\nAudience=x\n", "Audience= needs DerivedFrom="),
            (base + "\n[Session]\nName=plain\nUpstream=test\nAllowScopes=read\n", "AllowScopes= needs an Upstream=oauth session of its own"),
            (base + "\n[Session]\nName=keyed-child\nDerivedFrom=api\nScope=read\nAllowResources=https://x.example/\n", "AllowResources= needs an Upstream=oauth session of its own"),
        ]
        for (config, message) in cases {
            let directory = try Paths.temporaryDirectory()
            let path = directory + "/tokenbroker.conf"
            try SecretFile.write("dev-secret\n", to: directory + "/client-secret")
            try config.replacingOccurrences(of: "@DIR@", with: directory).write(toFile: path, atomically: true, encoding: .utf8)
            let run = try Child(Paths.tokenbroker, ["check-config", "--config", path], directory: directory)
            let code = await run.wait()
            #expect(code != 0 && run.stderr.contains(message), "\(message): \(run.stderr)")
        }
    }
}
