import Foundation
import Testing
import TestSupport
import Varlink

/// The real daemon binary on a temporary socket: every method and error of the contract,
/// peer checks, ctl, and the life cycle.
@Suite("tokenbroker serve", .serialized)
struct DaemonTests {
    @Test("contract: GetToken answers a token with type, expiry and generation, the same one until it changes")
    func getToken() async throws {
        try await withBroker { broker in
            let first = try broker.call("GetToken", ["session": "api"])
            let token = try #require(first.parameters["token"]?.stringValue)
            #expect(first.parameters["tokenType"] == "Bearer" && first.parameters["generation"] == 1)
            #expect(first.parameters["expiresAt"]?.intValue.map { $0 > Int64(Date().timeIntervalSince1970) } == true)
            #expect(fp(try broker.call("GetToken", ["session": "api"]).parameters["token"]) == fp(token))
        }
    }

    @Test("contract: Recover returns the current token for a stale rejection and refreshes for the current one; Status counts it, without the token")
    func recover() async throws {
        try await withBroker { broker in
            let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
            #expect(fp(try broker.call("Recover", ["session": "api", "rejected": "some-old-token"]).parameters["token"]) == fp(token))
            let recovered = try #require(try broker.call("Recover", ["session": "api", "rejected": .string(token)]).parameters["token"]?.stringValue)
            #expect(fp(recovered) != fp(token))
            let status = try #require(try broker.status("api"))
            #expect(status["fetches"] == 2 && status["staleRejections"] == 1 && status["state"] == "active" && status["tokenSerial"] == 2)
            let statusLeaks = JSON.object(status).text.contains(recovered)
            #expect(!statusLeaks)
        }
    }

    @Test("contract: Watch sends the current token at once, then each new one, then the logout as its final reply; Login starts a new generation")
    func watchLogoutLogin() async throws {
        try await withBroker { broker in
            let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"])
            let watcher = try broker.client()
            let initial = try watcher.call("io.tokenbroker.Broker.Watch", ["session": "api"], more: true)
            #expect(initial.parameters["event"] == "token" && initial.continues && fp(initial.parameters["token"]) == fp(token))
            let next = try #require(try broker.call("Recover", ["session": "api", "rejected": token]).parameters["token"])
            let pushed = try watcher.nextReply()
            #expect(pushed.parameters["event"] == "token" && fp(pushed.parameters["token"]) == fp(next) && pushed.parameters["tokenSerial"] == 2)

            #expect(try broker.call("Logout", ["session": "api"]) == VarlinkReply())
            let last = try watcher.nextReply()
            #expect(last.parameters["event"] == "signedOut" && last.parameters["generation"] == 2 && !last.continues)
            #expect(try broker.call("GetToken", ["session": "api"]) == .error("io.tokenbroker.Broker.SignedOut", ["session": "api", "login": "printf x | tokenbroker ctl login api --refresh-token-stdin"]))
            #expect(try broker.call("Login", ["session": "api", "refreshToken": "r-new"]) == VarlinkReply(parameters: ["generation": 3]))
            #expect(try broker.call("GetToken", ["session": "api"]).parameters["generation"] == 3)
            #expect(try broker.status("api")?["generation"] == 3)
        }
    }

    @Test("contract: errors for an unknown session, bad parameters, an unknown method, Watch without more")
    func contractErrors() async throws {
        try await withBroker { broker async throws in
            #expect(try broker.call("GetToken", ["session": "nope"]) == .error("io.tokenbroker.Broker.NoSuchSession", ["session": "nope"]))
            #expect(try broker.call("GetToken", ["session": 1]) == .invalidParameter("session"))
            #expect(try broker.call("GetToken", ["session": "api", "x": 1]) == .invalidParameter("x"))
            #expect(try broker.call("Frobnicate") == .error("org.varlink.service.MethodNotFound", ["method": "io.tokenbroker.Broker.Frobnicate"]))
            #expect(try broker.call("Watch", ["session": "api"]) == .error("org.varlink.service.ExpectedMore"))
        }
    }

    @Test("contract: Status lists every session for an admin, in configuration order; Reload keeps a session whose settings did not change")
    func statusAndReload() async throws {
        try await withBroker { broker in
            let sessions = try broker.call("Status").parameters["sessions"]?.arrayValue?.compactMap { $0.objectValue?["name"] }
            #expect(sessions == ["api", "private"])
            let before = try broker.call("GetToken", ["session": "api"]).parameters["token"]
            #expect(try broker.call("Reload") == VarlinkReply())
            #expect(fp(try broker.call("GetToken", ["session": "api"]).parameters["token"]) == fp(before))
        }
    }

    @Test("org.varlink.service: GetInfo, and the interface text byte for byte as the Python parser reads it")
    func serviceInterface() async throws {
        try await withBroker { broker in
            let info = try broker.client().call("org.varlink.service.GetInfo")
            #expect(info.parameters["interfaces"] == ["org.varlink.service", "io.tokenbroker.Broker"])
            #expect(info.parameters["product"] == "tokenbroker")
            let description = try broker.client().call("org.varlink.service.GetInterfaceDescription", ["interface": "io.tokenbroker.Broker"])
            let file = try String(contentsOf: Paths.packageRoot.appendingPathComponent("Sources/BrokerContract/io.tokenbroker.Broker.varlink"), encoding: .utf8)
            #expect(description.parameters["description"]?.stringValue == file)

            // The Python varlink client parses the description every time it opens the interface.
            let python = try Child(Paths.varlinkPython, ["-c", """
                import sys, varlink
                with varlink.Client("unix:\(broker.socket)") as client, client.open("io.tokenbroker.Broker") as broker:
                    reply = broker.GetToken("api")
                    assert reply["tokenType"] == "Bearer" and reply["generation"] == 1, "bad reply"
                    try:
                        broker.GetToken("nope")
                    except varlink.VarlinkError as error:
                        assert error.error() == "io.tokenbroker.Broker.NoSuchSession", error.error()
                    print("python ok")
                """], directory: broker.directory)
            #expect(await python.wait() == 0, "\(python.stderr)")
            #expect(python.stdout == "python ok\n")
        }
    }

    @Test("peers: another uid is refused where it is not allowed and served where it is")
    func peers() async throws {
        try await withBroker { broker in
            let allowed = try await broker.ctl(["token", "api"], asUser: Broker.workerUID)
            let printedToken = allowed.out.hasPrefix("tbtest.")
            #expect(allowed.code == 0 && printedToken && allowed.err.isEmpty, "\(allowed.err)")
            let refused = try await broker.ctl(["token", "private"], asUser: Broker.workerUID)
            #expect(refused.code == 77 && refused.err.hasPrefix("Error: permission denied") && refused.out.isEmpty)
            let logout = try await broker.ctl(["logout", "api"], asUser: Broker.workerUID)
            #expect(logout.code == 77)
            // Status shows the stranger only the session it may use.
            let status = try await broker.ctl(["status", "--json"], asUser: Broker.workerUID)
            let sessions = try JSONParser.parse(status.out).objectValue?["sessions"]?.arrayValue?.compactMap { $0.objectValue?["name"] }
            #expect(sessions == ["api"])
            // The refusals were logged with uid and pid, and no token was.
            try await eventually("refusal logged") { broker.child.stderr.contains("permission denied: io.tokenbroker.Broker.GetToken by pid") }
            #expect(broker.child.stderr.contains("uid \(Broker.workerUID)"))
            let logged = broker.child.stderr.contains(allowed.out.trimmingCharacters(in: .whitespacesAndNewlines))
            #expect(!logged)
        }
    }

    @Test("the overflow uid 65534 (any unmapped peer) is refused even where an allow list names it; the daemon warns at start")
    func overflowUID() async throws {
        try await withBroker(config: "[Broker]\nSocketMode=0666\n[Session]\nName=api\nUpstream=test\nAllowUsers=65534\n") { broker in
            let refused = try await broker.ctl(["token", "api"], asUser: 65534)
            #expect(refused.code == 77 && refused.err.hasPrefix("Error: permission denied") && refused.out.isEmpty)
            #expect(broker.child.stderr.contains("AllowUsers=: '65534' is the kernel's overflow id"))
        }
    }

    @Test("the daemon is undumpable: running as an ordinary uid, its /proc files belong to root (no core file, no ptrace, no /proc/PID/mem by that uid)")
    func undumpable() async throws {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let binary = directory + "/tokenbroker-daemon"
        try FileManager.default.copyItem(atPath: Paths.daemon, toPath: binary)   // the build tree may be closed to others
        try "[Session]\nName=api\nUpstream=test\n".write(toFile: directory + "/tokenbroker.conf", atomically: true, encoding: .utf8)
        let uid = Broker.workerUID
        chown(directory, uid, uid)
        chmod(binary, 0o755)
        let daemon = try Child("/usr/bin/setpriv", ["--reuid=\(uid)", "--regid=\(uid)", "--clear-groups", binary, "serve",
                                                    "--config", directory + "/tokenbroker.conf", "--socket", directory + "/tb.sock",
                                                    "--state-dir", directory + "/state"], directory: directory)
        defer { daemon.kill() }
        try await waitForSocket(directory + "/tb.sock", server: daemon)
        var info = stat()
        #expect(stat("/proc/\(daemon.process.processIdentifier)/environ", &info) == 0)
        #expect(info.st_uid == 0, "/proc/PID/environ belongs to uid \(info.st_uid): the daemon is dumpable")
        #expect(!daemon.stderr.contains("cannot make the process undumpable"))
        daemon.terminate()
        #expect(await daemon.wait() == 0)
    }

    @Test("in a user namespace that does not map the configured ids (PrivateUsers=yes), the daemon names them at start")
    func userNamespaceWarning() async throws {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        try "[Session]\nName=api\nUpstream=test\nAllowUsers=\(Broker.workerUID)\n"
            .write(toFile: directory + "/tokenbroker.conf", atomically: true, encoding: .utf8)
        // unshare maps only root: the worker's uid has no mapping.
        let daemon = try Child("/usr/bin/unshare", ["--user", "--map-root-user", Paths.tokenbroker, "serve",
                                                    "--config", directory + "/tokenbroker.conf", "--socket", directory + "/tb.sock",
                                                    "--state-dir", directory + "/state"], directory: directory)
        defer { daemon.kill() }
        try await waitForSocket(directory + "/tb.sock", server: daemon)
        #expect(daemon.stderr.contains("<4>uid \(Broker.workerUID) has no mapping in this process's user namespace"))
        daemon.terminate()
        #expect(await daemon.wait() == 0)
        // Outside one, no such warning.
        try await withBroker { broker in
            #expect(!broker.child.stderr.contains("user namespace"))
        }
    }

    @Test("concurrent `ctl token` calls from many processes share one fetch")
    func oneFlightAcrossProcesses() async throws {
        try await withBroker { broker in
            // Log out and in: the session has no token, so the first demand must fetch.
            _ = try broker.call("Logout", ["session": "api"])
            _ = try broker.call("Login", ["session": "api", "refreshToken": "r-1"])
            let before = try #require(try broker.status("api")?["fetches"]?.intValue)
            let processes = 40
            let runs = try (0..<processes).map { _ in
                try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "token", "api"], directory: broker.directory)
            }
            var tokens: Set<String> = []
            for run in runs {
                #expect(await run.wait() == 0, "\(run.stderr)")
                tokens.insert(run.stdout)
            }
            #expect(tokens.count == 1)
            #expect(try broker.status("api")?["fetches"]?.intValue == before + 1)
        }
    }

    @Test("ctl: status table, token alone on stdout, logout, and helpful errors")
    func ctl() async throws {
        try await withBroker { broker in
            let token = try await broker.ctl(["token", "api"])
            let oneLine = token.out.hasPrefix("tbtest.") && token.out.hasSuffix("\n") && token.out.split(separator: "\n").count == 1
            #expect(token.code == 0 && oneLine)
            let status = try await broker.ctl(["status"])
            let leaked = status.out.contains(token.out.dropLast())
            #expect(status.code == 0 && status.out.hasPrefix("SESSION") && status.out.contains("api") && !leaked)
            let missing = try await broker.ctl(["token", "nope"])
            #expect(missing.code == 1 && missing.err == "Error: no session named 'nope' (see `tokenbroker ctl status`)\n")
            #expect(try await broker.ctl(["logout", "api"]).code == 0)
            let signedOut = try await broker.ctl(["token", "api"])
            // (A test session: the way back in is a refresh token on stdin, which its SignedOut names.)
            #expect(signedOut.code == 1 && signedOut.err == "Error: not logged in: run `printf x | tokenbroker ctl login api --refresh-token-stdin`\n")
        }
    }

    @Test("ctl watch, refresh, reload, check-config and --json shapes")
    func moreVerbs() async throws {
        try await withBroker { broker in
            // refresh: prints the serial, never the token.
            let refreshed = try await broker.ctl(["refresh", "api"])
            #expect(refreshed.code == 0 && refreshed.out.hasPrefix("refreshed api: token #1, generation 1, expires 20"), "\(refreshed.err)")
            let json = try await broker.ctl(["refresh", "api", "--json"])
            let reply = try JSONParser.parse(json.out).objectValue
            #expect(reply?.keys.sorted() == ["expiresAt", "generation", "tokenSerial"] && reply?["tokenSerial"] == 2)

            // watch: one line per event; the token only with --show-token.
            let watch = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "watch", "api"], directory: broker.directory)
            let shown = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "watch", "api", "--show-token", "--json"],
                                  directory: broker.directory)
            try await eventually("both watchers started") { watch.stdout.contains("token #2") && shown.stdout.contains("tokenSerial") }
            #expect(try await broker.ctl(["logout", "api"]).code == 0)
            #expect(await watch.wait() == 0)
            #expect(await shown.wait() == 0)
            let lines = watch.stdout.split(separator: "\n")
            #expect(lines.count == 2 && lines[0].hasPrefix("token generation 1 token #2 expires ") && lines[1] == "signedOut generation 2")
            #expect(!watch.stdout.contains("tbtest."))
            let events = shown.stdout.split(separator: "\n").map { try? JSONParser.parse(String($0)).objectValue }
            let shownToken = events.first??["token"]?.stringValue?.hasPrefix("tbtest.") == true
            #expect(shownToken && events.last??["event"] == "signedOut")

            // status --json: the Status reply.
            let status = try await broker.ctl(["status", "--json"])
            let sessions = try JSONParser.parse(status.out).objectValue?["sessions"]?.arrayValue
            #expect(sessions?.count == 2 && sessions?.first?.objectValue?["state"] == "signedOut")

            // reload: a bad configuration is refused with file:line and exit 78; the old stays.
            try "[Session]\nName=api\nUpstream=test\nRefreshAhead=later\n".write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            let badReload = try await broker.ctl(["reload"])
            #expect(badReload.code == 78 && badReload.err.hasPrefix("Error: configuration error: \(broker.configPath):4: RefreshAhead="))
            let check = try await broker.ctl(["check-config", "--config", broker.configPath])
            #expect(check.code == 78 && check.err.contains("\(broker.configPath):4:"))
            try Broker.defaultConfig.write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            #expect(try await broker.ctl(["reload"]) == (0, "reloaded\n", ""))
        }
    }

    @Test("ctl: a mistyped session name gets the closest one this user may see; a reload lists every error; version names the running broker's (issue 33)")
    func namesAndVersions() async throws {
        try await withBroker { broker in
            let typo = try await broker.ctl(["token", "apj"])
            #expect(typo == (1, "", "Error: no session named 'apj'; did you mean 'api'? (see `tokenbroker ctl status`)\n"))
            // The worker may use api only: 'privat' gets no hint that 'private' exists (a name a
            // worker may not use is PermissionDenied, whether it exists or not).
            let hidden = try await broker.ctl(["token", "privat"], asUser: Broker.workerUID)
            #expect(hidden.code == 77 && !hidden.err.contains("private"), "\(hidden)")
            #expect(try await broker.ctl(["token", "privat"]).err.contains("did you mean 'private'?"))
            let far = try await broker.ctl(["token", "billing"])
            #expect(far.err == "Error: no session named 'billing' (see `tokenbroker ctl status`)\n")

            try "[Session]\nName=api\nUpstream=test\nRefreshAhead=later\nBackoffMax=x\n".write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            let badReload = try await broker.ctl(["reload"])
            #expect(badReload.code == 78 && badReload.err == "Error: configuration error: \(broker.configPath):4: RefreshAhead= needs a time span between "
                    + "0.0s and 86400.0s, e.g. 60s or 5min\n\(broker.configPath):5: BackoffMax= needs a time span between 0.01s and 86400.0s, e.g. 60s or 5min\n",
                    "\(badReload.err)")
            try Broker.defaultConfig.write(toFile: broker.configPath, atomically: true, encoding: .utf8)

            // A logged-out test session names the way back in, and the way works.
            #expect(try await broker.ctl(["logout", "api"]).code == 0)
            let out = try await broker.ctl(["token", "api"])
            #expect(out == (1, "", "Error: not logged in: run `printf x | tokenbroker ctl login api --refresh-token-stdin`\n"), "\(out)")
            #expect(try await broker.ctl(["login", "api", "--refresh-token-stdin"], stdin: "x").code == 0)
            #expect(try await broker.ctl(["token", "api"]).code == 0)

            let own = try await Child.run(Paths.tokenbroker, ["--version"]).stdout   // "tokenbroker 0.1.0\n"
            let version = try await Child.run(Paths.tokenbroker, ["version", "--socket", broker.socket])
            #expect(version.code == 0 && version.stdout == own + "broker \(own.dropFirst("tokenbroker ".count).dropLast()) at \(broker.socket)\n", "\(version)")
        }
    }

    @Test("a session followed only by a watcher is refreshed ahead of expiry: the watcher gets the next token")
    func watcherOnlyRefreshAhead() async throws {
        try await withBroker(config: "[Session]\nName=api\nUpstream=test\nTestTokenLifetime=3s\nRefreshAhead=2s\nAllowUsers=\(Broker.workerUID)\n") { broker in
            let watcher = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "watch", "api"], directory: broker.directory)
            defer { watcher.kill() }
            // Nobody calls GetToken: the daemon's own refresh-ahead must produce token #2 (and on).
            try await eventually("token #2 pushed to the watcher") { watcher.stdout.contains("token #2") }
            #expect(try broker.status("api")?["fetches"]?.intValue ?? 0 >= 2)
        }
    }

    @Test("tokens that live 1 s against a guard of 2 refreshes per 10 s (RefreshAhead=60s): callers every 50 ms for 4 s are never throttled, refreshes come at most once per half lifetime, the guard's sizing said once")
    func shortLivedTokens() async throws {
        // The shape of 6-second tokens against the default 10 per 60 s (which failed one call in
        // ten), in CI time.
        let config = """
            [Session]
            Name=short
            Upstream=test
            TestTokenLifetime=1s
            RefreshLimitBurst=2
            RefreshLimitInterval=10s

            """
        try await withBroker(config: config) { broker in
            let clock = ContinuousClock()
            let end = clock.now + .seconds(4)
            var calls = 0, failures: [String] = []
            while clock.now < end {
                let reply = try broker.call("GetToken", ["session": "short"])
                calls += 1
                if let error = reply.error { failures.append(error) }
                try await Task.sleep(for: .milliseconds(50))
            }
            #expect(failures.isEmpty, "\(failures.count) of \(calls) calls failed: \(Set(failures))")
            let refreshed = broker.child.stderr.components(separatedBy: "\n").filter { $0.contains("session short: refreshed, token #") }
            #expect(refreshed.count >= 3 && refreshed.count <= 9, "\(refreshed.count) refreshes in 4 s of 1 s tokens")
            #expect(refreshed.allSatisfy { $0.contains("lifetime 1s, in ") }, "\(refreshed.first ?? "")")
            #expect(!broker.child.stderr.contains("refresh limit reached"))
            // Said once, naming the keys: 1 s tokens need more refreshes than the burst allows.
            let said = broker.child.stderr.components(separatedBy: "\n").filter {
                $0.contains("session short: tokens live 1s, so the refresh guard allows the 20 refreshes per 10s they need, on top of RefreshLimitBurst=2 per RefreshLimitInterval=10s")
            }
            #expect(said.count == 1, "the guard's sizing is said once: \(said.count)")
        }
    }

    @Test("one worker that rejects the current token again and again spends only its share of refreshes: it alone is throttled (Status and the journal name its uid), another worker's genuine Recover right after is served (issue 32)")
    func fairRefreshBudget() async throws {
        let hog = Broker.workerUID, victim = Broker.workerUID + 1
        try await withBroker(config: "[Broker]\nSocketMode=0666\n\n[Session]\nName=api\nUpstream=test\nAllowUsers=\(hog) \(victim)\n") { broker in
            var token = try #require(broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
            var refreshed = 0, throttled = 0
            for _ in 0..<30 {
                let run = try await broker.ctl(["recover", "api"], asUser: hog, stdin: token)
                if run.code == 0 {
                    refreshed += 1
                    token = String(run.out.dropLast())
                } else if run.err.contains("refresh limit reached") {
                    throttled += 1
                }
            }
            #expect(refreshed == 5 && throttled == 25, "the hog: \(refreshed) refreshes, \(throttled) throttled")
            // The victim, with the current token the hog's refreshes left, is refused by the server
            // and asks for the next one: served.
            let current = try #require(try await broker.ctl(["token", "api"], asUser: victim).out.split(separator: "\n").first.map(String.init))
            let before = try broker.status("api")?["fetches"]?.intValue ?? 0
            let genuine = try await broker.ctl(["recover", "api"], asUser: victim, stdin: current)
            let served = genuine.code == 0 && genuine.out != current + "\n"
            #expect(served, "the victim's Recover: \(genuine.code) \(genuine.err)")
            #expect(try broker.status("api")?["fetches"]?.intValue == before + 1)
            // Who is throttled: every uid for an admin, only itself for a worker.
            #expect(try broker.status("api")?["throttledUsers"]?.arrayValue?.compactMap(\.intValue) == [Int64(hog)])
            let asHog = try await broker.ctl(["status"], asUser: hog), asVictim = try await broker.ctl(["status"], asUser: victim)
            #expect(asHog.out.contains("throttled uid \(hog)") && !asVictim.out.contains("throttled"), "\(asHog.out)\n\(asVictim.out)")
            try await eventually("the journal names the hog once") {
                broker.child.stderr.contains("session api: uid \(hog) has spent its share of refreshes (5 per RefreshLimitInterval=60s")
            }
            let said = broker.child.stderr.components(separatedBy: "\n").filter { $0.contains("has spent its share") }
            #expect(said.count <= 5 && !broker.child.stderr.contains("uid \(victim) has spent"), "\(said.count) lines")
        }
    }

    @Test("SIGTERM: exit 0 at once (an open watch stream is not waited for) and the socket file is gone")
    func sigterm() async throws {
        let broker = try await Broker()
        _ = try broker.call("GetToken", ["session": "api"])
        let watcher = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "watch", "api"], directory: broker.directory)
        try await eventually("the watcher's first line") { watcher.stdout.contains("token") }
        let started = ContinuousClock.now
        #expect(await broker.stop() == 0)
        #expect(ContinuousClock.now - started < .seconds(5))
        _ = await watcher.wait()
        #expect(!FileManager.default.fileExists(atPath: broker.socket))
        #expect(broker.child.stderr.contains("<6>stopped"))
        // A clean stop logs nothing at warning level or above (no part "failed").
        let loud = broker.child.stderr.split(separator: "\n").filter { $0.hasPrefix("<0>") || $0.hasPrefix("<1>") || $0.hasPrefix("<2>") || $0.hasPrefix("<3>") || $0.hasPrefix("<4>") }
        #expect(loud.isEmpty, "\(loud)")
    }

    @Test("a bad configuration exits 78 with file:line")
    func badConfig() async throws {
        let broker = try await Broker(config: "[Session]\nName=api\nUpstream=test\nRefreshAhead=later\n", waitForSocket: false)
        #expect(await broker.child.wait() == 78)
        #expect(broker.child.stderr.contains("\(broker.configPath):4: RefreshAhead="))
    }

    @Test("a stale socket file is replaced; a live one is not taken over")
    func staleSocket() async throws {
        let first = try await Broker()
        // A second daemon on the same socket finds the first one answering and refuses.
        let second = try Child(Paths.tokenbroker, ["serve", "--config", first.configPath, "--socket", first.socket, "--state-dir", first.directory + "/state2"],
                               directory: first.directory)
        #expect(await second.wait() == 1)
        #expect(second.stderr.contains("another instance is listening"))
        #expect(try first.call("GetToken", ["session": "api"]).error == nil)
        // Killed hard, the first leaves its socket file behind; a new daemon replaces it.
        kill(first.child.process.processIdentifier, SIGKILL)
        _ = await first.child.wait()
        #expect(FileManager.default.fileExists(atPath: first.socket))
        let third = try Child(Paths.tokenbroker, ["serve", "--config", first.configPath, "--socket", first.socket, "--state-dir", first.directory + "/state"], directory: first.directory)
        defer { third.terminate() }
        try await eventually("the new daemon serves") { (try? first.call("GetToken", ["session": "api"]).error == nil) ?? false }
    }

    @Test("an oversized or malformed message closes only its own connection")
    func badMessages() async throws {
        try await withBroker(config: Broker.defaultConfig.replacingOccurrences(of: "SocketMode=0666", with: "SocketMode=0666\nMaxMessageSize=4K")) { broker in
            let bystander = try broker.client()
            #expect(try bystander.call("io.tokenbroker.Broker.GetToken", ["session": "api"]).error == nil)
            for garbage in [Array(repeating: UInt8(ascii: "a"), count: 8192), Array("{\"method\":}".utf8) + [0]] {
                let offender = try broker.client()
                try offender.send(garbage)
                #expect(try offender.nextReply().error == "io.tokenbroker.Broker.ProtocolError")
                #expect(throws: VarlinkClientError.closed) { try offender.nextReply() }
            }
            #expect(try bystander.call("io.tokenbroker.Broker.GetToken", ["session": "api"]).error == nil)
        }
    }
}

