#if canImport(Glibc)
import Glibc
#endif
import Basics
import DevIssuer
import DPoP
import Foundation
import SQLiteStore
import Synchronization
import Testing
import TestSupport
import TokenBrokerCore
import Varlink
import WireJSON

/// Clients without a secret, through the real daemon against the development issuer, which
/// checks every assertion (signature by the registered JWKS, iss/sub, aud, exp, jti never seen
/// before): `private_key_jwt` with the daemon's own key (made, kept sealed, shown as a JWKS,
/// rotated in three steps, kept across a restart), a platform's JWT as the client assertion
/// (`ClientAssertionFile=`) and as the grant (`Grant=jwt-bearer`), the file swapped every
/// 100 ms while the daemon refreshes. Tokens and keys are never printed.
@Suite("Clients without a secret through the daemon", .serialized)
struct ClientAssertionDaemonTests {
    /// Forced refreshes per scenario (the goal's 1,000 with TB_ASSERTION_REFRESHES=1000).
    static let refreshes = ProcessInfo.processInfo.environment["TB_ASSERTION_REFRESHES"].flatMap(Int.init) ?? 200
    static let platform = "https://platform.test"

    static func session(_ issuer: DevIssuer, _ lines: String) -> String {
        """
        [Broker]
        SocketMode=0666

        [Session]
        Name=api
        Issuer=\(issuer.baseURL)
        RequestTimeout=5s
        RefreshLimitBurst=10000
        RefreshLimitInterval=1s
        \(lines)

        """
    }

    /// The JWKS `ctl client-key` prints, as the issuer registers it.
    static func jwks(_ broker: Broker, _ arguments: [String] = []) async throws -> [JSONObject] {
        let shown = try await broker.ctl(["client-key", "api"] + arguments)
        #expect(shown.code == 0, "ctl client-key \(arguments): \(shown.err)")
        let keys = try #require((try? JSONParser.parse(Array(shown.out.utf8)))?.objectValue?["keys"]?.arrayValue)
        return keys.compactMap(\.objectValue)
    }

    /// `count` forced refreshes; the number that failed, and the first failure.
    static func refresh(_ broker: Broker, _ count: Int) throws -> (failures: Int, first: String?) {
        var (failures, first): (Int, String?) = (0, nil)
        let client = try broker.client()
        for _ in 0..<count {
            let reply = try client.call("io.tokenbroker.Broker.Refresh", ["session": "api"])
            if let error = reply.error {
                failures += 1
                first = first ?? "\(error) \(reply.parameters["reason"]?.stringValue ?? "")"
            }
        }
        return (failures, first)
    }

    @Test("private_key_jwt with the daemon's key: ctl client-key prints the JWKS to register, every refresh carries a fresh assertion the issuer takes (N refreshes, N distinct jti, no replay), and the key is sealed: in no file, reply or log")
    func daemonKey() async throws {
        var options = DevIssuer.Options()
        options.clients = [:]
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        try await withBroker(config: Self.session(issuer, "ClientID=keyclient\nClientAuthentication=private_key_jwt\nGrant=client_credentials")) { broker in
            // No key registered yet: refused, and the session says why (the issuer's invalid_client).
            let keys = try await Self.jwks(broker)
            #expect(keys.count == 1)
            #expect(keys.first?["kty"] == "EC" && keys.first?["alg"] == "ES256" && keys.first?["d"] == nil)
            issuer.registerClientKeys("keyclient", jwks: keys)
            let before = issuer.counters
            let (failures, first) = try Self.refresh(broker, Self.refreshes)
            #expect(failures == 0, "\(failures) of \(Self.refreshes) refreshes failed; first: \(first ?? "")")
            let after = issuer.counters
            #expect(after.clientAssertions - before.clientAssertions >= Self.refreshes, "assertions the issuer took")
            #expect(after.assertionReplays == 0 && after.clientAssertionsRefused == before.clientAssertionsRefused)
            let token = try await broker.ctl(["token", "api"])
            #expect(token.code == 0 && issuer.isValidAccessToken(token.out.trimmingCharacters(in: .whitespacesAndNewlines)))
            // The secrets scan: the private key in clear is in no file, reply or log line.
            let status = try broker.call("Status").parameters
            let metrics = try broker.call("Metrics").parameters
            let reply = try broker.call("ClientKey", ["session": "api"]).parameters
            _ = await broker.stop()
            let stored = try await StateDatabase.open(broker.directory + "/state").clientKeys("api")
            #expect(stored.count == 1 && stored.first?.kid == keys.first?["kid"]?.stringValue)
            let secret = try #require(stored.first?.key.reveal)
            let der = try #require(Base64.decode(secret))
            let needles = [secret, String(secret.prefix(40)), Base64.urlEncode(der).prefix(40).description]
            for file in ["state/state.db", "state/state.db-wal"] {
                let bytes = (try? Data(contentsOf: URL(fileURLWithPath: broker.directory + "/" + file))) ?? Data()
                for needle in needles { #expect(bytes.range(of: Data(needle.utf8)) == nil, "the client key in clear in \(file)") }
                #expect(bytes.range(of: Data(der.prefix(48))) == nil, "the client key's DER in \(file)")
            }
            let texts = [broker.child.stdout, broker.child.stderr, JSON.object(status).text, JSON.object(metrics).text, JSON.object(reply).text]
            for text in texts { for needle in needles { #expect(!text.contains(needle), "the client key in the daemon's output or a reply") } }
            #expect(broker.child.stderr.contains("made a client key for private_key_jwt"))
        }
    }

    @Test("a rotation in three steps: --rotate publishes a next key that does not sign yet, --promote makes it sign and retires the old (still published), --retire drops it; the keys survive a restart")
    func rotation() async throws {
        var options = DevIssuer.Options()
        options.clients = [:]
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        let config = Self.session(issuer, "ClientID=keyclient\nClientAuthentication=private_key_jwt\nGrant=client_credentials")
        let first = try await Broker(config: config)
        defer { try? FileManager.default.removeItem(atPath: first.directory) }
        let old = try await Self.jwks(first)
        issuer.registerClientKeys("keyclient", jwks: old)
        #expect(try Self.refresh(first, 3).failures == 0)
        let both = try await Self.jwks(first, ["--rotate"])
        #expect(both.count == 2)
        let new = both.filter { $0["kid"] != old[0]["kid"] }
        #expect(new.count == 1)
        // Published, not signing: the issuer that knows only the old key still takes every request.
        #expect(try Self.refresh(first, 3).failures == 0)
        let again = try await first.ctl(["client-key", "api", "--rotate"])
        #expect(again.code != 0 && again.err.contains("next key already"))
        issuer.registerClientKeys("keyclient", jwks: both)
        #expect(try await Self.jwks(first, ["--promote"]).count == 2)
        // The new key signs: an issuer that knows only it takes them, one that knows only the old refuses.
        issuer.registerClientKeys("keyclient", jwks: new)
        #expect(try Self.refresh(first, 3).failures == 0)
        issuer.registerClientKeys("keyclient", jwks: old)
        let refused = try first.call("Refresh", ["session": "api"])
        #expect(refused.error == "io.tokenbroker.Broker.RefreshFailed" && refused.parameters["retryable"] == true)
        #expect(refused.parameters["reason"]?.stringValue?.contains("registered") == true)
        // A key not registered is the server's to fix, not the session's end: registered, it goes on.
        issuer.registerClientKeys("keyclient", jwks: new)
        try await eventually("a refresh once the new key is registered again (after the backoff)") {
            try first.call("Refresh", ["session": "api"]).error == nil
        }
        let roles = try first.call("ClientKey", ["session": "api"]).parameters["keys"]?.arrayValue?.compactMap { $0.objectValue?["role"]?.stringValue }
        #expect(roles?.sorted() == ["retiring", "signing"])
        #expect(try await Self.jwks(first, ["--retire"]).map { $0["kid"] } == new.map { $0["kid"] })
        _ = await first.stop()
        // A restart keeps them: the same key signs, from the sealed store.
        let second = try await Broker(config: config, reusing: first.directory)
        #expect(try await Self.jwks(second).map { $0["kid"] } == new.map { $0["kid"] })
        let afterRestart = try Self.refresh(second, 3)
        #expect(afterRestart.failures == 0, "\(afterRestart.first ?? "")")
        let jwk = try await second.ctl(["client-key", "api", "--jwk"])
        #expect(jwk.code == 0 && (try? JSONParser.parse(Array(jwk.out.utf8)))?.objectValue?["kid"] == new[0]["kid"])
        _ = await second.stop()
    }

    @Test("a refresh-token session whose key the server stops taking (a promotion ahead of the registration) is not ended: its failures are retried, its refresh token kept, and it goes on once the key is registered, with no new login")
    func unregisteredKeyKeepsTheSession() async throws {
        var options = DevIssuer.Options()
        options.clients = [:]
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        let config = Self.session(issuer, "ClientID=keyclient\nClientAuthentication=private_key_jwt\nBackoffInitial=10ms\nBackoffMax=50ms")
        try await withBroker(config: config) { broker in
            let keys = try await Self.jwks(broker)
            issuer.registerClientKeys("keyclient", jwks: keys)
            let login = try await broker.ctl(["login", "api", "--refresh-token-stdin"], stdin: issuer.issueRefreshToken(clientID: "keyclient") + "\n")
            #expect(login.code == 0, "\(login.err)")
            #expect(try Self.refresh(broker, 2).failures == 0)
            issuer.registerClientKeys("keyclient", jwks: [])
            // More refusals than any limit on refusals (3) would allow a refresh token.
            let refusedBefore = issuer.counters.clientAssertionsRefused
            try await eventually("ten refused assertions") {
                _ = try broker.call("Refresh", ["session": "api"])
                return issuer.counters.clientAssertionsRefused - refusedBefore >= 10
            }
            let status = try #require(try broker.status("api"))
            #expect(status["state"]?.stringValue == "active", "the session ended: \(status["state"]?.stringValue ?? "")")
            issuer.registerClientKeys("keyclient", jwks: keys)
            try await eventually("a refresh once the key is registered again") {
                try broker.call("Refresh", ["session": "api"]).error == nil
            }
            #expect(issuer.counters.replays == 0)
        }
    }

    @Test("a key of the wrong family for ClientAssertionAlgorithm= (changed and reloaded): requests fail saying to rotate, and --rotate, --promote make the new RSA key sign")
    func algorithmChangeNeedsRotation() async throws {
        var options = DevIssuer.Options()
        options.clients = [:]
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        let config = Self.session(issuer, "ClientID=keyclient\nClientAuthentication=private_key_jwt\nGrant=client_credentials")
        try await withBroker(config: config) { broker in
            let ec = try await Self.jwks(broker)
            #expect(ec.first?["kty"] == "EC")
            issuer.registerClientKeys("keyclient", jwks: ec)
            #expect(try Self.refresh(broker, 1).failures == 0)
            try (config + "ClientAssertionAlgorithm=RS256\n").replacingOccurrences(of: "@DIR@", with: broker.directory)
                .write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            #expect(try broker.call("Reload").error == nil)
            let refused = try broker.call("Refresh", ["session": "api"])
            #expect(refused.parameters["retryable"] == true && refused.parameters["reason"]?.stringValue?.contains("--rotate") == true,
                    "\(refused.parameters["reason"]?.stringValue ?? "")")
            let both = try await Self.jwks(broker, ["--rotate"])
            #expect(both.map { $0["kty"]?.stringValue ?? "" }.sorted() == ["EC", "RSA"])
            #expect(both.first { $0["kty"] == "RSA" }?["alg"] == "RS256")
            issuer.registerClientKeys("keyclient", jwks: both)
            #expect(try await broker.ctl(["client-key", "api", "--promote"]).code == 0)
            try await eventually("a refresh signed with the RSA key") {
                try broker.call("Refresh", ["session": "api"]).error == nil
            }
        }
    }

    /// Writes a platform JWT for `subject` to `path` atomically (a temporary file renamed over it).
    static func writePlatformToken(_ key: SigningKey, _ path: String, subject: String, audience: String, lifetime: Int64 = 600, serial: Int = 0) throws {
        let now = UTCTime.unixSeconds()
        let jwt = try key.jwt(["iss": .string(platform), "sub": .string(subject), "aud": .string(audience), "iat": .int(now),
                               "exp": .int(now + lifetime), "jti": .string("platform-\(serial)")], .es256)
        let temporary = path + ".tmp"
        try jwt.write(toFile: temporary, atomically: false, encoding: .utf8)
        rename(temporary, path)
    }

    /// Re-writes the platform's file every 100 ms until stopped; how many times it did.
    final class Swapper: Sendable {
        private let stop = Atomic<Bool>(false)
        private let count = Atomic<Int>(0)

        init(_ key: SigningKey, _ path: String, subject: String, audience: String) {
            let thread = Thread { [self] in
                var serial = 0
                while !stop.load(ordering: .relaxed) {
                    serial += 1
                    try? ClientAssertionDaemonTests.writePlatformToken(key, path, subject: subject, audience: audience, serial: serial)
                    count.add(1, ordering: .relaxed)
                    // (The platform's cadence the goal names, not a wait for an interleaving.)
                    usleep(100_000)
                }
            }
            thread.start()
        }

        func finish() -> Int {
            stop.store(true, ordering: .relaxed)
            return count.load(ordering: .relaxed)
        }
    }

    @Test("ClientAssertionFile=: a platform's JWT (federated at the issuer) is the client's credential; swapped every 100 ms during N refreshes, 0 fail")
    func platformClientAssertion() async throws {
        let platformKey = try SigningKey(for: .es256)
        var options = DevIssuer.Options()
        options.clients = [:]
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        issuer.trustIssuer(Self.platform, keys: [platformKey.publicJWK(algorithm: .es256)])
        issuer.federate(issuer: Self.platform, subject: "system:serviceaccount:apps:worker", client: "fedclient")
        try await withBroker(config: Self.session(issuer, "ClientID=fedclient\nClientAssertionFile=@DIR@/platform-token\nGrant=client_credentials")) { broker in
            let path = broker.directory + "/platform-token"
            try Self.writePlatformToken(platformKey, path, subject: "system:serviceaccount:apps:worker", audience: issuer.baseURL)
            let swapper = Swapper(platformKey, path, subject: "system:serviceaccount:apps:worker", audience: issuer.baseURL)
            let (failures, first) = try Self.refresh(broker, Self.refreshes)
            let swaps = swapper.finish()
            #expect(failures == 0, "\(failures) of \(Self.refreshes) refreshes failed with the file swapped \(swaps) times; first: \(first ?? "")")
            #expect(swaps > 1)
            // A session with its assertions from a file holds no key.
            let shown = try await broker.ctl(["client-key", "api"])
            #expect(shown.code != 0 && shown.err.contains("ClientAssertionFile="))
        }
    }

    @Test("Grant=jwt-bearer: the platform's JWT is the grant (no login, no client); swapped every 100 ms during N refreshes, 0 fail; an expired one is a retryable failure naming the file, not the session's end, and the next JWT goes on")
    func jwtBearerGrant() async throws {
        let platformKey = try SigningKey(for: .es256)
        let issuer = try DevIssuer(options: DevIssuer.Options())
        defer { issuer.stop() }
        issuer.trustIssuer(Self.platform, keys: [platformKey.publicJWK(algorithm: .es256)])
        let subject = "system:serviceaccount:apps:batch"
        let config = Self.session(issuer, "Grant=jwt-bearer\nAssertionFile=@DIR@/platform-token")
        let broker = try await Broker(config: config, waitForSocket: false)
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        // The file comes after the daemon: its first token waits for it, retried.
        let path = broker.directory + "/platform-token"
        try Self.writePlatformToken(platformKey, path, subject: subject, audience: issuer.baseURL)
        try await waitForSocket(broker.socket, server: broker.child)
        try await eventually("the first token, from the file written after the start") {
            try broker.call("GetToken", ["session": "api"]).error == nil
        }
        let run = try await broker.ctl(["token", "api"])
        #expect(run.code == 0)
        #expect(issuer.subject(ofAccessToken: run.out.trimmingCharacters(in: .whitespacesAndNewlines)) == subject)
        let swapper = Swapper(platformKey, path, subject: subject, audience: issuer.baseURL)
        let (failures, first) = try Self.refresh(broker, Self.refreshes)
        let swaps = swapper.finish()
        #expect(failures == 0, "\(failures) of \(Self.refreshes) refreshes failed with the file swapped \(swaps) times; first: \(first ?? "")")
        #expect(issuer.counters.jwtBearerGrants >= Self.refreshes)
        try Self.writePlatformToken(platformKey, path, subject: subject, audience: issuer.baseURL, lifetime: -30)
        let refused = try broker.call("Refresh", ["session": "api"])
        #expect(refused.error == "io.tokenbroker.Broker.RefreshFailed")
        #expect(refused.parameters["retryable"] == true)
        #expect(refused.parameters["reason"]?.stringValue?.contains("expired") == true)
        #expect(refused.parameters["reason"]?.stringValue?.contains("platform-token") == true)
        #expect(try broker.status("api")?["state"]?.stringValue != "ended")
        try Self.writePlatformToken(platformKey, path, subject: subject, audience: issuer.baseURL)
        try await eventually("a refresh with the file's next JWT") {
            try broker.call("Refresh", ["session": "api"]).error == nil
        }
        _ = await broker.stop()
    }
}
