import DevIssuer
import Foundation
import Testing
import TestSupport
import Upstream
import Varlink
import HTTPTransport

/// The real daemon against the development issuer (running in this test process, on loopback).
@Suite("tokenbroker serve with an OAuth upstream", .serialized)
struct OAuthDaemonTests {
    /// `dpop`: session `api` is a DPoP session (`DPoP=yes`).
    static func config(_ issuer: DevIssuer, dpop: Bool = false) -> String {
        """
        [Broker]
        SocketMode=0666

        [Session]
        Name=api
        TokenEndpoint=\(issuer.tokenEndpoint)
        RevocationEndpoint=\(issuer.revocationEndpoint)
        DeviceAuthorizationEndpoint=\(issuer.deviceAuthorizationEndpoint)
        ClientID=tokenbroker
        ClientSecretFile=@DIR@/client-secret
        RequestTimeout=5s
        DPoP=\(dpop ? "yes" : "no")

        [Session]
        Name=machine
        Grant=client_credentials
        Issuer=\(issuer.baseURL)
        ClientID=tokenbroker
        ClientSecretFile=@DIR@/client-secret
        ClientAuthentication=client_secret_post

        """
    }

    /// `dpop`: the issuer requires DPoP proofs and nonces (at its token endpoint and resource).
    static func issuer(dpop: Bool = false, _ configure: (inout DevIssuer.Options) -> Void = { _ in }) throws -> DevIssuer {
        var options = DevIssuer.Options()
        options.deviceInterval = .seconds(1)
        if dpop {
            options.dpop = .required
            options.dpopNonces = true
        }
        configure(&options)
        return try DevIssuer(options: options)
    }

    /// Runs `body` with a development issuer and a daemon configured against it; with
    /// `loggedIn`, session `api` is logged in first; with `dpop`, as a DPoP session against an
    /// issuer that requires it.
    static func withIssuerAndBroker(loggedIn: Bool = true, dpop: Bool = false, _ body: (DevIssuer, Broker) async throws -> Void) async throws {
        let issuer = try Self.issuer(dpop: dpop)
        defer { issuer.stop() }
        try await withBroker(config: Self.config(issuer, dpop: dpop)) { broker in
            if loggedIn { try await Self.logIn(broker, issuer) }
            try await body(issuer, broker)
        }
    }

    static func logIn(_ broker: Broker, _ issuer: DevIssuer) async throws {
        let login = try await broker.ctl(["login", "api", "--refresh-token-stdin"], stdin: issuer.issueRefreshToken() + "\n")
        #expect(login.code == 0 && login.out == "logged in api (generation 1)\n", "\(login.err)")
    }

    @Test("a token is never served after the issuer ends it: its lifetime counts from the request's sending, not the answer's arrival (an issuer that counts in whole seconds and answers 1.2 s late); expiresAt names no later second (issue 32)")
    func neverPastExpiry() async throws {
        let issuer = try Self.issuer { options in
            options.accessTokenLifetime = .seconds(3)
            options.wholeSecondExpiry = true
        }
        defer { issuer.stop() }
        let config = Self.config(issuer).replacingOccurrences(of: "RequestTimeout=5s\n", with: "RequestTimeout=5s\nRefreshAhead=0\n")
        try await withBroker(config: config) { broker in
            try await Self.logIn(broker, issuer)
            issuer.inject([.delay(.milliseconds(1200))])
            #expect(try broker.call("Refresh", ["session": "api"]).error == nil)
            let reply = try broker.call("GetToken", ["session": "api"])
            let token = try #require(reply.parameters["token"]?.stringValue)
            let end = try #require(issuer.expiry(ofAccessToken: token))
            let reported = try #require(reply.parameters["expiresAt"]?.intValue)
            #expect(reported <= Int64(end), "expiresAt \(reported), the issuer's end \(end)")
            // Served until the broker takes it for expired: never after the issuer's end.
            var late: [Double] = [], served = 0
            while Date().timeIntervalSince1970 < end + 5 {
                let before = Date().timeIntervalSince1970
                guard try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue == token else { break }
                served += 1
                if before > end { late.append(before - end) }
                try await Task.sleep(for: .milliseconds(20))
            }
            #expect(served > 0 && late.isEmpty, "served \(served) times, \(late.count) of them after the issuer's end (up to \(late.max() ?? 0) s)")
        }
    }

    @Test("ctl token --min-valid: 50 processes that need the token longer than it has left cost one refresh; when the issuer's tokens live less than asked, all 50 hear so after one refresh, and the next ask costs none (issue 33)")
    func minimumValidity() async throws {
        let issuer = try Self.issuer { $0.accessTokenLifetime = .seconds(900) }
        defer { issuer.stop() }
        var broker = try await Broker(config: Self.config(issuer))
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        try await Self.logIn(broker, issuer)
        #expect(try broker.call("GetToken", ["session": "api"]).error == nil)
        /// 50 `ctl token api --min-valid 20m` at once, on a daemon restarted over the state (its
        /// token restored, with less than 20 minutes left); their exit codes, outputs and errors.
        func fifty() async throws -> [(code: Int32, out: String, err: String)] {
            _ = await broker.stop()
            broker = try await Broker(config: Self.config(issuer), reusing: broker.directory)
            let runs = try (0..<50).map { _ in
                try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "token", "api", "--min-valid", "20m"], directory: broker.directory)
            }
            var results: [(Int32, String, String)] = []
            for run in runs { results.append((await run.wait(), run.stdout, run.stderr)) }
            return results
        }
        // The issuer's tokens live 15 minutes: one refresh, then each caller hears so.
        var before = issuer.counters.refreshGrants
        let short = try await fifty()
        // (The lifetime as counted here: from the second the request was sent in, so 899 or 900.)
        let said = short.allSatisfy {
            $0.code == 1 && ($0.err.hasPrefix("Error: the tokens of 'api' live 89") || $0.err.hasPrefix("Error: the tokens of 'api' live 900s"))
                && $0.err.hasSuffix("s, less than the 1200s asked (--min-valid): no refresh gives a longer one; ask for less\n")
        }
        #expect(said, "\(short.map { "\($0.code) \($0.err)" }.prefix(3))")
        #expect(issuer.counters.refreshGrants == before + 1)
        let again = try await broker.ctl(["token", "api", "--min-valid", "20m"])
        #expect(again.code == 1 && issuer.counters.refreshGrants == before + 1, "no refresh loop")
        #expect(try await broker.ctl(["token", "api", "--min-valid", "10m"]).code == 0, "what it can give is given")
        // An hour now: one refresh for all 50, and each gets its token.
        issuer.setAccessTokenLifetime(.seconds(3600))
        before = issuer.counters.refreshGrants
        let long = try await fifty()
        #expect(long.allSatisfy { $0.code == 0 } && Set(long.map(\.out)).count == 1, "\(long.first { $0.code != 0 }?.err ?? "")")
        #expect(issuer.counters.refreshGrants == before + 1)
        let current = try #require(try broker.call("GetToken", ["session": "api"]).parameters["expiresAt"]?.intValue)
        #expect(current - Int64(Date().timeIntervalSince1970) > 1200)
        // A bad duration is a usage error, and minValid beside rejected is refused.
        #expect(try await broker.ctl(["token", "api", "--min-valid", "soon"]).code == 64)
        #expect(try broker.call("GetProof", ["session": "api", "method": "GET", "uri": "https://rs.example/", "rejected": "x", "minValid": 60]).error
                == "org.varlink.service.InvalidParameter")
        _ = await broker.stop()
    }

    @Test("libcurl is mapped only once a session needs HTTP: not by a daemon with test sessions alone, then at the reload that adds an oauth session")
    func libcurlOnlyWhenNeeded() async throws {
        try await withBroker { broker in
            let pid = broker.child.process.processIdentifier
            @Sendable func mapsLibcurl() -> Bool {
                // Read to the end by hand: /proc files report no size.
                let fd = open("/proc/\(pid)/maps", O_RDONLY | O_CLOEXEC)
                guard fd >= 0 else { return false }
                defer { close(fd) }
                var bytes: [UInt8] = [], chunk = [UInt8](repeating: 0, count: 65_536)
                while case let n = read(fd, &chunk, chunk.count), n > 0 { bytes += chunk[..<n] }
                return String(decoding: bytes, as: UTF8.self).contains("/libcurl.so")
            }
            #expect(try broker.call("GetToken", ["session": "api"]).error == nil)
            // A reload decides too, before it says it is done: after one, the answer is settled.
            kill(pid, SIGHUP)
            try await eventually("the first reload is done") { broker.child.stderr.contains("configuration reloaded") }
            #expect(!mapsLibcurl(), "a daemon with test sessions only mapped libcurl")
            try (Broker.defaultConfig + Broker.oauthSession("http://127.0.0.1:9/token", name: "remote"))
                .replacingOccurrences(of: "@DIR@", with: broker.directory)
                .write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            kill(pid, SIGHUP)
            try await eventually("libcurl is mapped after the reload that adds an oauth session") { mapsLibcurl() }
            #expect(!broker.child.stderr.contains("upstream requests will fail"))
        }
    }

    @Test("a server that keeps answering a bare 400 ends the session after 3 token requests, with a reason that says to log in again")
    func deadSessionEnds() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            issuer.inject(Array(repeating: .status(400, error: nil, retryAfter: nil), count: 10))
            let before = issuer.counters.tokenRequests
            // Workers keep asking; between backoffs each demand after the wait sends one request.
            try await eventually("the session ends", timeout: .seconds(30)) {
                _ = try? broker.call("GetToken", ["session": "api"])
                return (try? broker.status("api"))??["state"] == "ended"
            }
            #expect(issuer.counters.tokenRequests - before == 3, "the dead refresh token went out \(issuer.counters.tokenRequests - before) times")
            let status = try #require(try broker.status("api"))
            let error = status["lastError"]?.stringValue ?? ""
            #expect(error.hasPrefix("HTTP 400 without an OAuth error, 3 times in a row") && error.contains("ctl login"), "\(error)")
            let token = try broker.call("GetToken", ["session": "api"])
            #expect(token.error == "io.tokenbroker.Broker.RefreshFailed" && token.parameters["retryable"] == false, "\(token.error ?? "")")
            #expect(issuer.counters.tokenRequests - before == 3)
            // One journal line per outcome: two refusals at warning, the end at error.
            let lines = broker.child.stderr.components(separatedBy: "\n")
            let refused = lines.filter { $0.hasPrefix("<4>session api: refresh failed (refused): HTTP 400 without an OAuth error; retry in ") }
            #expect(refused.count == 2, "\(refused)")
            #expect(lines.filter { $0.hasPrefix("<3>session api: ended: HTTP 400 without an OAuth error, 3 times in a row") }.count == 1)
        }
    }

    @Test("1,000 Recover calls from 50 worker processes (Python varlink) with the same old token: 1 token request")
    func thousandRecoversFromFiftyProcesses() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let old = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
            #expect(issuer.counters.refreshGrants == 1)
            // Each worker: one connection, 20 Recover calls with the old token; it prints the
            // fingerprints of the tokens it got (never the tokens).
            let script = """
                import hashlib, sys, varlink
                old = sys.stdin.read()
                with varlink.Client("unix:\(broker.socket)") as client, client.open("io.tokenbroker.Broker") as broker:
                    seen = {hashlib.sha256(broker.Recover("api", old)["token"].encode()).hexdigest()[:12] for _ in range(20)}
                print(" ".join(sorted(seen)))
                """
            let workers = try (0..<50).map { _ in
                try Child(Paths.varlinkPython, ["-c", script], directory: broker.directory, stdin: old)
            }
            var fingerprints: Set<String> = []
            for worker in workers {
                #expect(await worker.wait() == 0, "\(worker.stderr.suffix(300))")
                fingerprints.insert(worker.stdout.trimmingCharacters(in: .whitespacesAndNewlines))
            }
            #expect(fingerprints.count == 1 && !(fingerprints.first ?? "").contains(" "), "\(fingerprints)")
            #expect(issuer.counters.refreshGrants == 2, "1,000 recovers made \(issuer.counters.refreshGrants - 1) token requests")
            #expect(issuer.counters.replays == 0)
            let status = try #require(try broker.status("api"))
            #expect((status["joinedWaiters"]?.intValue ?? 0) + (status["staleRejections"]?.intValue ?? 0) == 999)
        }
    }

    @Test("50 ctl processes recover the same old token at once: 1 token request (plus, on a DPoP session after a nonce change, 1 nonce round trip), 50 identical new tokens",
          arguments: [false, true])
    func fiftyWorkers(dpop: Bool) async throws {
        try await Self.withIssuerAndBroker(dpop: dpop) { issuer, broker in
            let old = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
            #expect(issuer.counters.refreshGrants == 1)
            if dpop { issuer.rotateDPoPNonces() }
            let requestsBefore = issuer.counters.tokenRequests
            let workers = try (0..<50).map { _ in
                try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "recover", "api"], directory: broker.directory, stdin: old)
            }
            var tokens: Set<String> = []
            for worker in workers {
                #expect(await worker.wait() == 0, "\(worker.stderr)")
                tokens.insert(worker.stdout)
            }
            #expect(tokens.count == 1 && fp(tokens.first) != fp(old + "\n"))
            #expect(issuer.counters.refreshGrants == 2, "the burst made \(issuer.counters.refreshGrants - 1) token requests")
            #expect(issuer.counters.tokenRequests - requestsBefore == (dpop ? 2 : 1), "one refresh, one nonce round trip on a DPoP session")
            #expect(issuer.counters.replays == 0 && issuer.counters.dpopProofsRefused == 0)
            #expect(issuer.isValidAccessToken(String(tokens.first!.dropLast())))
        }
    }

    @Test("device login through ctl: prompt, approval, and the session is logged in with the grant's tokens")
    func deviceLogin() async throws {
        try await Self.withIssuerAndBroker(loggedIn: false) { issuer, broker in
            #expect(try broker.call("GetToken", ["session": "api"]) == .error("io.tokenbroker.Broker.SignedOut", ["session": "api"]))
            let login = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "login", "api"], directory: broker.directory)
            try await eventually("a device code waits") { !issuer.pendingUserCodes.isEmpty }
            let code = try #require(issuer.pendingUserCodes.first)
            try await eventually("the prompt") { login.stdout.contains(code) }
            #expect(login.stdout.contains("open \(issuer.baseURL)/device and enter the code \(code)"))
            issuer.decide(userCode: code, approve: true)
            #expect(await login.wait() == 0, "\(login.stderr)")
            #expect(login.stdout.hasSuffix("logged in api (generation 1)\n"))
            let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
            #expect(issuer.isValidAccessToken(token) && issuer.counters.refreshGrants == 0)

            // A denied login is reported and leaves the session as it was.
            let denied = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "login", "api"], directory: broker.directory)
            try await eventually("a second device code") { !issuer.pendingUserCodes.isEmpty }
            issuer.decide(userCode: issuer.pendingUserCodes[0], approve: false)
            #expect(await denied.wait() == 1)
            #expect(denied.stderr == "Error: login of 'api' failed: the login was denied (access_denied)\n")
        }
    }

    @Test("device login: the caller leaving while the poll that carries the approved login's tokens is under way loses nothing: the poll runs to its answer and the session is logged in")
    func deviceCallerLeaves() async throws {
        try await Self.withIssuerAndBroker(loggedIn: false) { issuer, broker in
            let login = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "login", "api"], directory: broker.directory)
            try await eventually("a device code waits") { !issuer.pendingUserCodes.isEmpty }
            let code = try #require(issuer.pendingUserCodes.first)
            issuer.inject([.hold])
            try await eventually("a poll is held at the issuer") { issuer.heldCount == 1 }
            issuer.decide(userCode: code, approve: true)
            login.kill()   // the caller goes away while that poll is under way
            issuer.releaseHeld()
            // (Its generation shows as soon as the login begins; its token once it is stored.)
            try await eventually("the session is logged in and serves the login's token") {
                (try? broker.call("GetToken", ["session": "api"]))?.parameters["token"]?.stringValue != nil
            }
            let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
            #expect(try broker.status("api")?["generation"] == 1)
            #expect(issuer.isValidAccessToken(token) && issuer.counters.deviceGrants >= 1)
        }
    }

    @Test("device login with client_secret_basic against a server that requires client_id in the form (oauthlib); the server's error_description reaches ctl, Status and the journal, not the workers' reason")
    func strictServer() async throws {
        var options = DevIssuer.Options()
        options.deviceInterval = .seconds(1)
        options.deviceRequiresClientIDInBody = true
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        try await withBroker(config: Self.config(issuer)) { broker in
            let login = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "login", "api"], directory: broker.directory)
            try await eventually("a device code waits") { !issuer.pendingUserCodes.isEmpty || !login.process.isRunning }
            let code = try #require(issuer.pendingUserCodes.first, "\(login.stderr)")
            issuer.decide(userCode: code, approve: true)
            #expect(await login.wait() == 0, "\(login.stderr)")
            #expect(login.stdout.hasSuffix("logged in api (generation 1)\n"))

            // A poll refused with the server's own words: ctl shows them, bounded and on one line.
            let failing = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "login", "api"], directory: broker.directory)
            try await eventually("a second device code") { !issuer.pendingUserCodes.isEmpty }
            issuer.inject([.described(400, error: "invalid_scope", description: "Scope \"payroll\" is unknown.\n\u{1B}[2J")])
            #expect(await failing.wait() == 1)
            #expect(failing.stderr == "Error: login of 'api' failed: invalid_scope (the server says: \"Scope \"payroll\" is unknown. [2J\")\n")

            // A refresh refused so: the reason workers get is the code; Status and the journal say more.
            let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"])
            issuer.inject([.described(400, error: "invalid_request", description: "Missing refresh_token parameter.")])
            let refused = try broker.call("Recover", ["session": "api", "rejected": token])
            #expect(refused == .error("io.tokenbroker.Broker.RefreshFailed", ["session": "api", "reason": "invalid_request", "retryable": false]))
            #expect(try broker.status("api")?["lastError"] == "invalid_request (the server says: \"Missing refresh_token parameter.\")")
            try await eventually("the journal line") {
                broker.child.stderr.contains("<3>session api: ended: invalid_request (the server says: \"Missing refresh_token parameter.\")")
            }
        }
    }

    @Test("logout revokes the refresh token upstream, after the local boundary")
    func logoutRevokes() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
            #expect(try await broker.ctl(["logout", "api"]).code == 0)
            try await eventually("the revocation") { issuer.counters.revocations == 1 }
            #expect(!issuer.isValidAccessToken(token))
            try await eventually("the revocation's journal line") {
                broker.child.stderr.contains("<6>session api: the refresh token retired by the logout is revoked upstream")
            }
        }
    }

    @Test("logout during a refresh (bearer and DPoP sessions): the caller gets SignedOut at once, the transfer is abandoned, the family revoked",
          arguments: [false, true])
    func logoutDuringRefresh(dpop: Bool) async throws {
        try await Self.withIssuerAndBroker(dpop: dpop) { issuer, broker in
            issuer.inject([.hold])
            let caller = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "token", "api"], directory: broker.directory)
            try await eventually("the refresh held at the issuer") { issuer.heldCount == 1 }
            #expect(try await broker.ctl(["logout", "api"]).code == 0)
            #expect(await caller.wait() == 1)
            #expect(caller.stderr == "Error: not logged in: run `tokenbroker ctl login api`\n")
            // Logout cancelled the HTTP transfer; whatever the issuer does with the held request
            // now, its answer reaches nobody, and the family is revoked through the old token.
            try await eventually("the flight's end dropped") { try broker.status("api")?["droppedResults"] == 1 }
            try await eventually("the revocation") { issuer.counters.revocations == 1 }
            issuer.releaseHeld()
            #expect(try broker.call("GetToken", ["session": "api"]).error == "io.tokenbroker.Broker.SignedOut")
        }
    }

    @Test("logout while the issuer, having rotated, still holds its answer (and revoking a rotated token changes nothing there): the late answer's refresh token is revoked; no refresh token of the session stays active at the issuer (bearer and DPoP sessions)",
          arguments: [false, true])
    func logoutBeforeLateAnswer(dpop: Bool) async throws {
        let issuer = try Self.issuer(dpop: dpop) { $0.revokingARotatedTokenEndsItsFamily = false }
        defer { issuer.stop() }
        try await withBroker(config: Self.config(issuer, dpop: dpop)) { broker in
            try await Self.logIn(broker, issuer)
            let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"])
            #expect(issuer.activeRefreshTokens == 1)
            issuer.inject([.holdAfterProcessing])
            let caller = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "recover", "api"],
                                   directory: broker.directory, stdin: (token.stringValue ?? "") + "\n")
            try await eventually("the refresh rotated and its answer held at the issuer") { issuer.heldCount == 1 }
            #expect(try await broker.ctl(["logout", "api"]).code == 0)
            #expect(await caller.wait() == 1)
            // The logout revoked the token it knew, the rotated one: nothing changed upstream.
            try await eventually("the logout's revocation") { issuer.counters.revocations == 1 }
            #expect(issuer.activeRefreshTokens == 1, "the rotation's new refresh token is alive until the answer comes")
            issuer.releaseHeld()
            try await eventually("the late answer's refresh token revoked") { issuer.activeRefreshTokens == 0 }
            #expect(issuer.counters.revocations == 2 && issuer.counters.refreshGrants == 2, "a refresh at the first GetToken, the one held")
            try await eventually("the journal says so") {
                broker.child.stderr.contains("session api: a refresh answer that came after the logout (or login) had ended its request brought a new refresh token; it is revoked upstream")
            }
            #expect(try broker.call("GetToken", ["session": "api"]).error == "io.tokenbroker.Broker.SignedOut")
        }
    }

    @Test("upstream failures reach every caller as the contract's errors")
    func upstreamErrors() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"])
            issuer.inject([.status(503, error: nil, retryAfter: 9)])
            let transient = try broker.call("Recover", ["session": "api", "rejected": token])
            #expect(transient.error == "io.tokenbroker.Broker.RefreshFailed" && transient.parameters["retryable"] == true)
            #expect(transient.parameters["reason"] == "HTTP 503" && (transient.parameters["retryAfter"]?.doubleValue ?? 0) >= 8)
            // During the backoff the token is still served, and demands that need a refresh fail fast.
            #expect(fp(try broker.call("GetToken", ["session": "api"]).parameters["token"]) == fp(token))
            let fast = try broker.call("Recover", ["session": "api", "rejected": token])
            #expect(fast.error == "io.tokenbroker.Broker.RefreshFailed" && issuer.counters.tokenRequests == 2)
        }
        try await Self.withIssuerAndBroker { issuer, broker in
            issuer.inject([.status(400, error: "invalid_grant", retryAfter: nil)])
            let terminal = try broker.call("GetToken", ["session": "api"])
            #expect(terminal == .error("io.tokenbroker.Broker.RefreshFailed", ["session": "api", "reason": "invalid_grant", "retryable": false]))
            #expect(try broker.status("api")?["state"] == "ended")
            let ctl = try await broker.ctl(["token", "api"])
            #expect(ctl.code == 1 && ctl.err.contains("the session has ended: run `tokenbroker ctl login api`"))
        }
    }

    @Test("client_credentials with discovery works without a login")
    func clientCredentials() async throws {
        try await Self.withIssuerAndBroker(loggedIn: false) { issuer, broker in
            let token = try #require(try broker.call("GetToken", ["session": "machine"]).parameters["token"]?.stringValue)
            #expect(issuer.isValidAccessToken(token))
            #expect(issuer.counters.clientCredentialsGrants == 1 && issuer.counters.metadataRequests == 1)
        }
    }

    @Test("serve --dev, as help serve's example runs it: logged-in sessions against an issuer in the daemon; the guide's lines run as written")
    func serveDev() async throws {
        let directory = try Paths.temporaryDirectory()
        // `tokenbroker help serve`'s example, as written (issue 33).
        let help = try await Child.run(Paths.tokenbroker, ["help", "serve"])
        let example = try #require(help.stdout.split(separator: "\n").map { $0.trimmingCharacters(in: .whitespaces) }
            .first { $0.hasPrefix("tokenbroker serve --dev") })
        #expect(example == "tokenbroker serve --dev --socket ./tokenbroker.sock")
        let socket = directory + "/tokenbroker.sock"
        let daemon = try Child(Paths.tokenbroker, example.split(separator: " ").dropFirst().map(String.init), directory: directory,
                               workingDirectory: directory)
        defer { daemon.terminate() }
        try await waitForSocket(socket)
        try await eventually("the guide") { daemon.stdout.contains("Stop with Ctrl-C.") }
        let ctl = try Child(Paths.tokenbroker, ["ctl", "--socket", socket, "token", "demo"], directory: directory)
        #expect(await ctl.wait() == 0)
        let token = ctl.stdout.trimmingCharacters(in: .newlines)
        let resource = try #require(daemon.stdout.split(whereSeparator: \.isWhitespace).first { $0.hasPrefix("http://127.0.0.1:") && $0.hasSuffix("/resource") })
        let response = try await CurlLoop.shared.perform(HTTPRequest(url: String(resource), headers: [("Authorization", "Bearer " + token)]))
        #expect(response.status == 200)
        // The guide's lines run as written, in a shell of their own (issue 33): the export, the
        // README's short form, and git's helper against demo's Serves= entry.
        let lines = daemon.stdout.split(separator: "\n").map { $0.trimmingCharacters(in: .whitespaces) }
        let export = try #require(lines.first { $0.hasPrefix("export ") && $0.contains("TOKENBROKER_SOCKET=\(socket)") })
        let tokenLine = try #require(lines.first { $0 == "tokenbroker ctl token demo" })
        let helperLine = try #require(lines.first { $0.contains("| tokenbroker credential git get") })
        let helperCommand = String(helperLine[..<helperLine.range(of: "     (")!.lowerBound])
        let shell = try await Child.run("/bin/bash", ["-c", "\(export) && \(tokenLine) && \(helperCommand)"], environment: ["PATH": "/usr/bin:/bin"])
        #expect(shell.code == 0, "\(shell.stderr)")
        // (Compared aside: a failed expectation must not print a token.)
        let answered = shell.stdout.hasPrefix("\(token)\nusername=oauth2\npassword=\(token)\npassword_expiry_utc=")
        #expect(answered, "the token, then git's answer with it")
        // The derived session the guide names gives a token of its own (issue 35).
        let derivedLine = try #require(lines.first { $0.hasPrefix("tokenbroker ctl token demo-read") })
        let derived = try await Child.run("/bin/bash", ["-c", "\(export) && \(derivedLine[..<derivedLine.range(of: "     (")!.lowerBound])"],
                                          environment: ["PATH": "/usr/bin:/bin"])
        let derivedToken = derived.stdout.trimmingCharacters(in: .newlines)
        #expect(derived.code == 0 && !derivedToken.isEmpty && derivedToken != token, "demo-read: \(derived.stderr)")
        daemon.terminate()
        #expect(await daemon.wait() == 0)
    }
}
