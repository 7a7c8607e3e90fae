import DevIssuer
import Foundation
import Synchronization
import Testing
import TestSupport
import Varlink

/// The real daemon's metrics (`MetricsListen=`, `ctl metrics`), scraped during a storm,
/// checked with promtool, across a reload, and scraped by a real Prometheus.
@Suite("Metrics", .serialized)
struct MetricsTests {
    static func config(_ issuer: DevIssuer, port: Int, refreshAhead: String = "60s", bearer: Bool = true) -> String {
        """
        [Broker]
        SocketMode=0666
        MetricsListen=127.0.0.1:\(port)
        \(bearer ? "MetricsBearerTokenFile=@DIR@/metrics-token" : "")

        [Session]
        Name=api
        TokenEndpoint=\(issuer.tokenEndpoint)
        ClientID=tokenbroker
        ClientSecretFile=@DIR@/client-secret
        RefreshAhead=\(refreshAhead)

        """
    }

    /// `GET /metrics` on the listener (nil when nothing answers).
    static func scrape(_ port: Int, accept: String? = nil, bearer: String? = Broker.metricsToken) -> (head: String, body: String)? {
        get(port, "/metrics", accept: accept, bearer: bearer)
    }

    /// One HTTP/1.1 GET to 127.0.0.1:`port` (the connection closed after it).
    static func get(_ port: Int, _ target: String, accept: String? = nil, bearer: String? = nil) -> (head: String, body: String)? {
        let fd = LoopbackTCP.connect(port)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        let request = "GET \(target) HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + (accept.map { "Accept: \($0)\r\n" } ?? "")
            + (bearer.map { "Authorization: Bearer \($0)\r\n" } ?? "") + "\r\n"
        _ = request.withCString { send(fd, $0, strlen($0), 0) }
        var answer: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 65_536)
        while case let count = read(fd, &buffer, buffer.count), count > 0 { answer += buffer[..<count] }
        let text = String(decoding: answer, as: UTF8.self)
        guard let split = text.range(of: "\r\n\r\n") else { return nil }
        return (String(text[..<split.lowerBound]), String(text[split.upperBound...]))
    }

    /// The value of the sample `line` starts with (`name{labels}`), if present.
    static func value(_ body: String, _ sample: String) -> Double? {
        body.split(separator: "\n").first { $0.hasPrefix(sample + " ") }.flatMap { Double($0.split(separator: " ").last ?? "") }
    }

    static func promtool(_ exposition: String) async throws -> (code: Int32, output: String) {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        try exposition.write(toFile: directory + "/metrics.txt", atomically: true, encoding: .utf8)
        let run = try await Child.run("/bin/sh", ["-c", "promtool check metrics < '\(directory)/metrics.txt' 2>&1"])
        return (run.code, run.stdout + run.stderr)
    }

    /// A daemon with session `api` logged in at a development issuer, its metrics on `port`, and
    /// its first token.
    static func withLoggedInBroker(_ body: (DevIssuer, Broker, Int, String) async throws -> Void) async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let port = try EtcdCluster.freePort()
        try await withBroker(config: Self.config(issuer, port: port)) { broker in
            #expect(try broker.call("Login", ["session": "api", "refreshToken": .string(issuer.issueRefreshToken())]).error == nil)
            let first = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
            try await eventually("the metrics listener") { Self.scrape(port) != nil }
            try await body(issuer, broker, port, first)
        }
    }

    @Test("scraped during a storm of 30 Recover calls: one refresh, 30 calls ok, waiters joined, token expiry, state, store writes; promtool accepts it; ctl metrics prints the same families; no token in it")
    func storm() async throws {
        try await Self.withLoggedInBroker { issuer, broker, port, first in
            let results = Mutex<[String?]>([])
            let gate = Atomic<Int>(0)
            for _ in 0..<30 {
                Thread {
                    gate.add(1, ordering: .acquiringAndReleasing)
                    while gate.load(ordering: .acquiring) < 30 {}
                    let token = (try? broker.call("Recover", ["session": "api", "rejected": .string(first)]))?.parameters["token"]?.stringValue
                    results.withLock { $0.append(token) }
                }.start()
            }
            try await eventually("30 Recover calls return") { results.withLock { $0.count } == 30 }
            let tokens = results.withLock { $0 }
            #expect(Set(tokens.compactMap { $0 }).count == 1 && tokens.allSatisfy { $0 != nil })
            #expect(issuer.counters.refreshGrants == 2)

            let (head, body) = try #require(Self.scrape(port))
            #expect(head.hasPrefix("HTTP/1.1 200") && head.contains("Content-Type: text/plain; version=0.0.4"))
            #expect(Self.value(body, #"tokenbroker_refreshes_total{outcome="ok",session="api"}"#) == 2)
            #expect(Self.value(body, #"tokenbroker_calls_total{method="Recover",result="ok"}"#) == 30)
            #expect(Self.value(body, #"tokenbroker_calls_total{method="GetToken",result="ok"}"#) == 1)
            #expect((Self.value(body, #"tokenbroker_joined_waiters_total{session="api"}"#) ?? 0) >= 1)
            #expect(Self.value(body, #"tokenbroker_session_state{session="api",state="active"}"#) == 1)
            #expect((Self.value(body, #"tokenbroker_token_expiry_seconds{session="api"}"#) ?? 0) > 3000)
            #expect(Self.value(body, #"tokenbroker_upstream_request_duration_seconds_count{session="api"}"#) == 2)
            #expect((Self.value(body, "tokenbroker_store_write_duration_seconds_count") ?? 0) >= 3)
            #expect(Self.value(body, "tokenbroker_connections_open") != nil)
            for token in [first] + tokens.compactMap({ $0 }) { #expect(!body.contains(token), "a token in the metrics") }
            #expect(!body.contains("tokenbroker\"") && !body.contains("dev-secret"), "the client id or secret in the metrics")
            let check = try await Self.promtool(body)
            #expect(check.code == 0 && check.output.isEmpty, "promtool: \(check.output)")

            let open = try #require(Self.scrape(port, accept: "application/openmetrics-text; version=1.0.0"))
            #expect(open.head.contains("Content-Type: application/openmetrics-text; version=1.0.0") && open.body.hasSuffix("# EOF\n"))
            #expect(open.body.contains("# TYPE tokenbroker_refreshes counter"))

            let ctl = try await broker.ctl(["metrics"])
            #expect(ctl.code == 0 && ctl.out.contains("# TYPE tokenbroker_refreshes_total counter")
                    && Self.value(ctl.out, #"tokenbroker_refreshes_total{outcome="ok",session="api"}"#) == 2, "\(ctl.err)")
            let denied = try await broker.ctl(["metrics"], asUser: Broker.workerUID)
            #expect(denied.code != 0 && denied.out.isEmpty, "a non-admin read the metrics over the socket")
        }
    }

    @Test("counters survive a reload that replaces the session's coordinator; reloads are counted")
    func reload() async throws {
        try await Self.withLoggedInBroker { issuer, broker, port, first in
            _ = try broker.call("Recover", ["session": "api", "rejected": .string(first)])
            _ = try broker.call("Recover", ["session": "api", "rejected": .string(first)])   // stale
            let before = try #require(Self.scrape(port)).body
            #expect(Self.value(before, #"tokenbroker_stale_rejections_total{session="api"}"#) == 1)
            // RefreshAhead= changes the policy: a new coordinator takes over.
            try Self.config(issuer, port: port, refreshAhead: "30s").replacingOccurrences(of: "@DIR@", with: broker.directory)
                .write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            #expect(try broker.call("Reload").error == nil)
            let after = try #require(Self.scrape(port)).body
            #expect(Self.value(after, #"tokenbroker_stale_rejections_total{session="api"}"#) == 1)
            #expect(Self.value(after, #"tokenbroker_refreshes_total{outcome="ok",session="api"}"#) == 2)
            #expect(Self.value(after, #"tokenbroker_reloads_total{result="ok"}"#) == 1)
        }
    }

    @Test("a client that trickles its request is cut off 2 s after it connected, and scrapes are answered meanwhile")
    func slowClients() async throws {
        try await Self.withLoggedInBroker { _, _, port, _ in
            // A client sending one byte every 300 ms, and one that sends nothing.
            let trickler = LoopbackTCP.connect(port)
            let idle = LoopbackTCP.connect(port)
            defer {
                close(trickler)
                close(idle)
            }
            let started = ContinuousClock.now
            let cutOff = Atomic<Bool>(false)
            Thread {
                for byte in Array("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Padding: aaaaaaaaaaaaaaaa\r\n".utf8) {
                    var one = byte
                    guard send(trickler, &one, 1, Int32(MSG_NOSIGNAL)) == 1 else { break }
                    usleep(300_000)
                }
                cutOff.store(true, ordering: .releasing)
            }.start()
            let scrape = try #require(Self.scrape(port))
            #expect(scrape.head.hasPrefix("HTTP/1.1 200"), "a scrape waited for the slow clients")
            #expect(started.duration(to: .now) < .seconds(1))
            try await eventually("the trickling client is cut off", timeout: .seconds(10)) { cutOff.load(ordering: .acquiring) }
            let held = started.duration(to: .now)
            #expect(held >= .seconds(2) && held < .seconds(4), "the slow client was cut off after \(held)")
        }
    }

    @Test("a real Prometheus scrapes the daemon and answers a query about it")
    func prometheus() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let port = try EtcdCluster.freePort()
        let web = try EtcdCluster.freePort()
        try await withBroker(config: Self.config(issuer, port: port)) { broker in
            try """
                global:
                  scrape_interval: 1s
                scrape_configs:
                  - job_name: tokenbroker
                    authorization:
                      credentials_file: \(broker.directory)/metrics-token
                    static_configs:
                      - targets: ['127.0.0.1:\(port)']
                """.write(toFile: broker.directory + "/prometheus.yml", atomically: true, encoding: .utf8)
            let server = try Child("/usr/bin/prometheus", ["--config.file=\(broker.directory)/prometheus.yml",
                                                          "--storage.tsdb.path=\(broker.directory)/prometheus", "--web.listen-address=127.0.0.1:\(web)",
                                                          "--log.level=warn"], directory: broker.directory)
            let answer = Mutex("")
            do {
                // A per-session series: Prometheus authenticated with credentials_file.
                try await eventually("Prometheus has scraped tokenbroker_session_state of session api", timeout: .seconds(30)) {
                    let body = Self.get(web, "/api/v1/query?query=tokenbroker_session_state%7Bsession%3D%22api%22%7D")?.body ?? ""
                    answer.withLock { $0 = body }
                    return answer.withLock { $0 }.contains(#""job":"tokenbroker""#) && answer.withLock { $0 }.contains(#""session":"api""#)
                }
            } catch {
                server.terminate()
                _ = await server.wait(timeout: 20)
                throw error
            }
            #expect(answer.withLock { $0 }.contains(#""status":"success""#))
            server.terminate()
            _ = await server.wait(timeout: 20)
        }
    }

    @Test("over TCP: with no bearer token configured, a scrape names no session and shows no calls; with one, a scrape without it or with a wrong one gets 401 (counted), with it everything")
    func tcpAccess() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let port = try EtcdCluster.freePort()
        try await withBroker(config: Self.config(issuer, port: port, bearer: false)) { broker in
            #expect(try broker.call("Login", ["session": "api", "refreshToken": .string(issuer.issueRefreshToken())]).error == nil)
            _ = try broker.call("GetToken", ["session": "api"])
            try await eventually("the metrics listener") { Self.scrape(port, bearer: nil) != nil }
            let open = try #require(Self.scrape(port, bearer: nil))
            #expect(open.head.hasPrefix("HTTP/1.1 200"))
            #expect(!open.body.contains("session=") && !open.body.contains("tokenbroker_calls_total"), "\(open.body)")
            #expect(open.body.contains("tokenbroker_build_info{") && open.body.contains("tokenbroker_connections_open "))
            // A token presented where none is configured changes nothing.
            #expect(!(try #require(Self.scrape(port, bearer: Broker.metricsToken)).body.contains("session=")))
        }
        let second = try EtcdCluster.freePort()
        try await withBroker(config: Self.config(issuer, port: second)) { broker in
            // (The varlink socket accepts connections before the daemon has opened MetricsListen=.)
            try await eventually("the metrics listener") { Self.scrape(second, bearer: nil) != nil }
            for bearer in [nil, "wrong-token-0123456789", Broker.metricsToken + "x", String(Broker.metricsToken.dropLast())] {
                let refused = try #require(Self.scrape(second, bearer: bearer))
                #expect(refused.head.hasPrefix("HTTP/1.1 401") && refused.head.contains("WWW-Authenticate: Bearer"), "\(refused.head)")
                #expect(!refused.body.contains("session="))
            }
            let full = try #require(Self.scrape(second))
            #expect(full.head.hasPrefix("HTTP/1.1 200") && full.body.contains(#"tokenbroker_session_state{session="api""#))
            #expect(Self.value(full.body, #"tokenbroker_metrics_scrapes_refused_total{reason="unauthorized"}"#) == 5)
        }
    }

    @Test("on a Unix socket: admins and members of MetricsGroup= read per-session series; any other uid that can connect (65534 included) gets 403, counted; with MetricsGroup= the socket is in that group")
    func unixAccess() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let scratch = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: scratch) }
        chmod(scratch, 0o755)
        let script = scratch + "/scrape.py"
        try """
            import socket, sys
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            try:
                s.connect(sys.argv[1])
            except PermissionError:
                sys.stdout.write("EACCES")
                sys.exit(0)
            s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            sys.stdout.write(data.decode())
            """.write(toFile: script, atomically: true, encoding: .utf8)
        chmod(script, 0o644)
        func scrape(_ broker: Broker, _ identity: [String]) async throws -> String {
            try await eventually("the metrics socket") { FileManager.default.fileExists(atPath: broker.directory + "/metrics.sock") }
            let run = try await Child.run("/usr/bin/setpriv", identity + ["/usr/bin/python3", script, broker.directory + "/metrics.sock"])
            #expect(run.code == 0, "\(run.stderr)")
            return run.stdout
        }
        let base = Self.config(issuer, port: 0, bearer: false)
        // The socket in the daemon's group (root here), which workers are in: they can connect.
        try await withBroker(config: base.replacingOccurrences(of: "MetricsListen=127.0.0.1:0", with: "MetricsListen=@DIR@/metrics.sock")) { broker in
            for uid in ["61042", "65534"] {
                let answer = try await scrape(broker, ["--reuid=\(uid)", "--regid=0", "--clear-groups"])
                #expect(answer.hasPrefix("HTTP/1.1 403") && !answer.contains("session="), "uid \(uid): \(answer.prefix(200))")
            }
            let admin = try await scrape(broker, [])
            #expect(admin.hasPrefix("HTTP/1.1 200") && admin.contains(#"tokenbroker_session_state{session="api""#))
            #expect(admin.contains(#"tokenbroker_metrics_scrapes_refused_total{reason="forbidden"} 2"#))
        }
        // MetricsGroup=: the socket is in that group; its members read everything, others cannot connect.
        let grouped = base.replacingOccurrences(of: "MetricsListen=127.0.0.1:0", with: "MetricsListen=@DIR@/metrics.sock\nMetricsGroup=61043")
        try await withBroker(config: grouped) { broker in
            let member = try await scrape(broker, ["--reuid=61042", "--regid=61042", "--groups=61043"])
            #expect(member.hasPrefix("HTTP/1.1 200") && member.contains(#"tokenbroker_session_state{session="api""#), "\(member.prefix(200))")
            #expect(try await scrape(broker, ["--reuid=61042", "--regid=0", "--clear-groups"]) == "EACCES")
        }
    }

    static let idleConnections = 100

    @Test("100 idle connections (half of them sent one byte) that reconnect as soon as they are cut off do not stop one scrape every 200 ms from being answered")
    func idleConnectionsCannotStarveScrapes() async throws {
        try await Self.withLoggedInBroker { _, _, port, _ in
            let stop = Atomic<Bool>(false)
            let reconnects = Atomic<Int>(0)
            // Every other one sends a byte at once and nothing more (it must still be evictable).
            @Sendable func open(_ index: Int) -> Int32 {
                let fd = LoopbackTCP.connect(port)
                if index % 2 == 1 { _ = send(fd, "G", 1, Int32(MSG_NOSIGNAL)) }
                return fd
            }
            Foundation.Thread.detachNewThread {
                var fds = (0..<Self.idleConnections).map { open($0) }
                var buffer = [UInt8](repeating: 0, count: 64)
                while !stop.load(ordering: .acquiring) {
                    var polled = fds.map { pollfd(fd: $0, events: Int16(POLLIN), revents: 0) }
                    if poll(&polled, nfds_t(polled.count), 50) < 0 {
                        if errno == EINTR { continue }
                        break
                    }
                    for (index, entry) in polled.enumerated() where entry.revents != 0 {
                        if read(entry.fd, &buffer, buffer.count) <= 0 {
                            close(entry.fd)
                            fds[index] = open(index)
                            reconnects.add(1, ordering: .relaxed)
                        }
                    }
                }
                for fd in fds { close(fd) }
            }
            defer { stop.store(true, ordering: .releasing) }
            var answered = 0, asked = 0
            let end = ContinuousClock.now + .seconds(4)
            while ContinuousClock.now < end {
                asked += 1
                if let scrape = Self.scrape(port), scrape.head.hasPrefix("HTTP/1.1 200"), scrape.body.contains("session=\"api\"") { answered += 1 }
                try await Task.sleep(for: .milliseconds(200))
            }
            print("metrics: \(answered) of \(asked) scrapes answered beside \(Self.idleConnections) idle connections (\(reconnects.load(ordering: .relaxed)) reconnects)")
            #expect(answered == asked, "\(answered) of \(asked) scrapes answered")
            #expect(reconnects.load(ordering: .relaxed) >= 50, "the idle connections were cut off after their first-byte deadline: \(reconnects.load(ordering: .relaxed))")
        }
    }
}
