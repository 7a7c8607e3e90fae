import DevIssuer
import Foundation
import Testing
import TestSupport
import Varlink

/// Hostile local clients, upstreams and configurations against the real daemon: each attack
/// must cost only its sender. Attackers run as another uid (`Broker.workerUID + 1`, on no allow
/// list) through `setpriv`, as Python programs speaking raw varlink. The figures printed here
/// are for orientation; `make bench` measures them on the release build.
@Suite("Adversarial clients, upstreams and configurations", .serialized)
struct AdversarialTests {
    static let attackerUID = Broker.workerUID + 1

    /// Runs a Python program as `uid` (root when `nil`) with the broker's socket as argv[1].
    static func python(_ broker: Broker, _ program: String, as uid: UInt32? = attackerUID, arguments: [String] = []) throws -> Child {
        let python = ["/usr/bin/env", "python3", "-c", program, broker.socket] + arguments
        guard let uid else { return try Child(python[0], Array(python.dropFirst()), directory: broker.directory) }
        return try Child("/usr/bin/setpriv", ["--reuid=\(uid)", "--regid=\(uid)", "--clear-groups"] + python, directory: broker.directory)
    }

    /// Python helpers every attack program starts with.
    static let prelude = """
        import json, os, socket, sys, time, threading
        path = sys.argv[1]
        def connect():
            s = socket.socket(socket.AF_UNIX); s.connect(path); return s
        def call(s, method, parameters=None, timeout=10):
            message = {"method": method}
            if parameters is not None: message["parameters"] = parameters
            s.sendall(json.dumps(message).encode() + b"\\0")
            s.settimeout(timeout); data = b""
            while not data.endswith(b"\\0"):
                chunk = s.recv(65536)
                if not chunk: return None
                data += chunk
            return json.loads(data[:-1])

        """

    @Test("one message cannot stall the others: the worst message under MaxMessageSize= (many keys, deep arrays) costs a bystander milliseconds")
    func worstMessage() async throws {
        let config = Broker.defaultConfig.replacingOccurrences(of: "SocketMode=0666", with: "SocketMode=0666\nMaxMessageSize=1M")
        try await withBroker(config: config) { broker in
            let attack = try Self.python(broker, Self.prelude + """
                worst = [0.0]; stop = [False]
                def bystander():
                    s = connect()
                    while not stop[0]:
                        t = time.monotonic(); call(s, "org.varlink.service.GetInfo"); worst[0] = max(worst[0], time.monotonic() - t)
                threading.Thread(target=bystander, daemon=True).start(); time.sleep(0.2)
                for shape in ['"k%d":0', '"k%d":[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]', '"%d"']:
                    items, n, size = [], 0, 40
                    while size < (1 << 20) - 64:
                        item = shape % n if "%d" in shape else shape
                        items.append(item); size += len(item) + 1; n += 1
                    body = '{"method":"org.varlink.service.GetInfo","parameters":{"x":[' + ",".join(items) + ']}}' if shape == '"%d"' else \\
                           '{"method":"org.varlink.service.GetInfo","parameters":{' + ",".join(items) + '}}'
                    s = connect(); s.sendall(body.encode()[:(1 << 20) - 1] + b"\\0"); s.settimeout(10)
                    try: s.recv(100)
                    except Exception: pass
                    s.close()
                time.sleep(0.2); stop[0] = True
                print("%.1f" % (worst[0] * 1000))
                """)
            #expect(await attack.wait() == 0, "\(attack.stderr)")
            let worst = try #require(Double(attack.stdout.trimmingCharacters(in: .whitespacesAndNewlines)))
            print("adversarial: a bystander's worst GetInfo while 1 MiB messages were parsed: \(worst) ms")
            #expect(worst < 500, "a bystander waited \(worst) ms")   // quadratic parsing took 22,900 ms here
        }
    }

    @Test("one uid holds at most MaxConnectionsPerUser connections; root and an allowed user are still served; a half-sent message is cut off after MessageTimeout=")
    func connectionShare() async throws {
        let config = Broker.defaultConfig.replacingOccurrences(of: "SocketMode=0666", with: "SocketMode=0666\nMaxConnectionsPerUser=40\nMessageTimeout=2s")
        try await withBroker(config: config) { broker in
            let hog = try Self.python(broker, Self.prelude + """
                tried = []
                for i in range(60):
                    try:
                        s = connect(); s.sendall(b'{"method":"org.varlink.service.Get')   # never finished
                        tried.append(s)
                    except Exception: pass
                time.sleep(0.3)
                held = []
                for s in tried:
                    s.settimeout(0.05)
                    try:
                        if s.recv(1) != b"": held.append(s)
                    except socket.timeout: held.append(s)
                    except Exception: pass
                print(len(held), flush=True)
                time.sleep(3)   # past MessageTimeout=2s
                closed = 0
                for s in held:
                    s.settimeout(0.05)
                    try:
                        data = s.recv(65536)
                        closed += 1 if data == b"" or b"message not completed" in data else 0
                    except socket.timeout: pass
                    except Exception: closed += 1
                print(closed, flush=True)
                """)
            try await eventually("the hog holding its connections") { !hog.stdout.isEmpty }
            let held = Int(hog.stdout.split(separator: "\n").first ?? "") ?? -1
            print("adversarial: one non-admin uid asked for 60 connections and holds \(held)")
            #expect(held == 40)
            // Root and an allowed worker are still served while the hog holds its share.
            #expect(try broker.call("GetToken", ["session": "api"]).error == nil)
            let worker = try await broker.ctl(["token", "api"], asUser: Broker.workerUID)
            #expect(worker.code == 0, "\(worker.err)")
            #expect(await hog.wait(timeout: 30) == 0, "\(hog.stderr)")
            let closed = Int(hog.stdout.split(separator: "\n").last ?? "") ?? -1
            #expect(closed == held, "\(closed) of \(held) half-sent messages were cut off")
            try await eventually("refusals logged, rate-limited") { broker.child.stderr.contains("MaxConnectionsPerUser= reached") }
            let refusals = broker.child.stderr.components(separatedBy: "MaxConnectionsPerUser= reached").count - 1
            #expect(refusals <= 6, "\(refusals) refusal lines for one uid")
        }
    }

    @Test("100 connections of one uid pipelining calls and never reading: the daemon's memory stays bounded; others are served")
    func neverReading() async throws {
        try await withBroker { broker in
            let pid = broker.child.process.processIdentifier
            let before = try Self.residentKiB(pid)
            let flood = try Self.python(broker, Self.prelude + """
                call_ = (json.dumps({"method": "org.varlink.service.GetInterfaceDescription",
                                     "parameters": {"interface": "io.tokenbroker.Broker"}}) + "\\0").encode() * 200
                conns, total = [], 0
                for i in range(100):
                    s = connect(); s.setblocking(False); conns.append(s)
                for round in range(40):
                    for s in conns:
                        try: total += s.send(call_)
                        except (BlockingIOError, OSError): pass
                time.sleep(1)   # the daemon answers what it read
                print("sent", total, flush=True)
                time.sleep(3)
                """)
            try await eventually("the flood sent", timeout: .seconds(60)) { flood.stdout.contains("sent") }
            let during = try Self.residentKiB(pid)
            #expect(try broker.call("GetToken", ["session": "api"]).error == nil)
            _ = await flood.wait()
            let growth = (during - before) / 1024
            print("adversarial: RSS \(before / 1024) MB before, \(during / 1024) MB with 100 connections not reading (+\(growth) MB; \(flood.stdout))")
            #expect(growth <= 64, "RSS grew by \(growth) MB")
        }
    }

    @Test("probing: to a peer on no allow list, a session that exists and one that does not look the same")
    func probing() async throws {
        try await withBroker { broker in
            let existing = try await broker.ctl(["token", "private"], asUser: Self.attackerUID)
            let missing = try await broker.ctl(["token", "no-such-session"], asUser: Self.attackerUID)
            #expect(existing.code == 77 && missing.code == 77)
            #expect(existing.err.replacingOccurrences(of: "'private'", with: "X") == missing.err.replacingOccurrences(of: "'no-such-session'", with: "X"))
        }
    }

    @Test("log forging: CR, LF and U+2028 in what a client sends never start a new log line")
    func logForging() async throws {
        try await withBroker { broker in
            let forge = try Self.python(broker, Self.prelude + """
                for key in ["x\\r\\n<3>forged by a client", "y\\r<3>forged by a client", "z\\u2028<3>forged by a client"]:
                    s = connect()
                    s.sendall(json.dumps({"method": "io.tokenbroker.Broker.GetToken", "parameters": {"session": "api"}, key: 1}).encode() + b"\\0")
                    s.settimeout(5)
                    try: s.recv(1000)
                    except Exception: pass
                """)
            #expect(await forge.wait() == 0, "\(forge.stderr)")
            try await eventually("the protocol errors logged") { broker.child.stderr.contains("unknown call field") }
            let lines = broker.child.stderr.split(omittingEmptySubsequences: false) { $0 == "\n" || $0 == "\r" || $0 == "\u{2028}" }
            #expect(!lines.contains { $0.hasPrefix("<3>forged") }, "\(broker.child.stderr)")
        }
    }

    @Test("a reload with a value that used to crash the daemon keeps the old configuration and says why")
    func reloadCrashers() async throws {
        try await withBroker { broker in
            for line in ["[Broker]\nMaxMessageSize=1ß", "[Broker]\nMaxMessageSize=99999999999999G",
                         "[Session]\nName=api\nUpstream=test\nRefreshAhead=99999999999999999999999d"] {
                try (Broker.defaultConfig + line + "\n").write(toFile: broker.configPath, atomically: true, encoding: .utf8)
                let reload = try await broker.ctl(["reload"])
                #expect(reload.code == 78 && reload.err.contains("\(broker.configPath):"), "\(reload.err)")
                #expect(try broker.call("GetToken", ["session": "api"]).error == nil)
            }
        }
    }

    @Test("Socket= below a directory someone else may change is refused, symlinks resolved first")
    func unsafeSocketDirectory() async throws {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        try "[Session]\nName=api\nUpstream=test\n".write(toFile: directory + "/tokenbroker.conf", atomically: true, encoding: .utf8)
        for (name, setup) in [("open", { (path: String) in chmod(path, 0o777) }),
                              ("theirs", { (path: String) in chown(path, Self.attackerUID, Self.attackerUID) })] as [(String, (String) -> Int32)] {
            let unsafe = directory + "/" + name
            try FileManager.default.createDirectory(atPath: unsafe, withIntermediateDirectories: true)
            #expect(setup(unsafe) == 0)
            let daemon = try Child(Paths.tokenbroker, ["serve", "--config", directory + "/tokenbroker.conf", "--socket", unsafe + "/tb.sock",
                                                       "--state-dir", directory + "/state-" + name], directory: directory)
            #expect(await daemon.wait() == 1)
            #expect(daemon.stderr.contains("\(unsafe): ") && daemon.stderr.contains("the socket must live in a directory only root"),
                    "\(daemon.stderr)")
            #expect(!FileManager.default.fileExists(atPath: unsafe + "/tb.sock"))
        }
        // Directly in the sticky, world-writable /tmp: refused too (anyone could take the name
        // first); in a directory of its own below it: fine.
        let inTmp = try Child(Paths.tokenbroker, ["serve", "--config", directory + "/tokenbroker.conf", "--socket", "/tmp/tb-adv-\(getpid()).sock",
                                                  "--state-dir", directory + "/state-tmp"], directory: directory)
        #expect(await inTmp.wait() == 1)
        #expect(inTmp.stderr.contains("/tmp: writable by everyone"), "\(inTmp.stderr)")
        let own = try Child(Paths.tokenbroker, ["serve", "--config", directory + "/tokenbroker.conf", "--socket", directory + "/own/tb.sock",
                                                "--state-dir", directory + "/state-own"], directory: directory)
        try await waitForSocket(directory + "/own/tb.sock")
        own.terminate()
        #expect(await own.wait() == 0)
        // A symlink in the path is resolved first, and the real directories are what is checked.
        let open = directory + "/open"
        try FileManager.default.createSymbolicLink(atPath: directory + "/link", withDestinationPath: open)
        let linked = try Child(Paths.tokenbroker, ["serve", "--config", directory + "/tokenbroker.conf", "--socket", directory + "/link/tb.sock",
                                                   "--state-dir", directory + "/state-link"], directory: directory)
        #expect(await linked.wait() == 1)
        #expect(linked.stderr.contains("\(open): writable by everyone"), "\(linked.stderr)")
    }

    /// An authorization server nobody should trust, on loopback: its discovery metadata points
    /// the token endpoint at `http://localhost:TRAP/` (a name, not a loopback address), and its
    /// device authorization says `expires_in: 1e300`. A second listener, the trap, records any
    /// connection. Prints `ISSUER_PORT TRAP_PORT`.
    static let hostileIssuer = """
        import http.server, json, socket, sys, threading
        trap = socket.socket(); trap.bind(("127.0.0.1", 0)); trap.listen(16)
        hits = [0]
        def catch():
            while True:
                c, _ = trap.accept(); hits[0] += 1; c.close()
        threading.Thread(target=catch, daemon=True).start()
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a): pass
            def answer(self, status, body):
                data = body.encode(); self.send_response(status)
                self.send_header("Content-Type", "application/json"); self.send_header("Content-Length", str(len(data)))
                self.end_headers(); self.wfile.write(data)
            def do_GET(self):
                if self.path == "/trap-hits": return self.answer(200, str(hits[0]))
                port = self.server.server_address[1]
                self.answer(200, json.dumps({"issuer": "http://127.0.0.1:%d" % port,
                                             "token_endpoint": "http://localhost:%d/token" % trap.getsockname()[1]}))
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/device":
                    return self.answer(200, '{"device_code":"d","user_code":"ABCD-EFGH","verification_uri":"https://as.example/device",'
                                            '"expires_in":1e300,"interval":1e300}')
                self.answer(400, '{"error":"authorization_pending"}')
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        print(server.server_address[1], trap.getsockname()[1], flush=True)
        server.serve_forever()
        """

    @Test("an upstream that points discovery at http:// off loopback gets no secret; one that says expires_in 1e300 does not crash the daemon")
    func hostileUpstream() async throws {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let issuer = try Child("/usr/bin/env", ["python3", "-c", Self.hostileIssuer], directory: directory)
        defer { issuer.kill() }
        try await eventually("the hostile issuer listening") { issuer.stdout.contains(" ") }
        let ports = issuer.stdout.split(whereSeparator: { $0 == " " || $0 == "\n" }).compactMap { Int($0) }
        let base = "http://127.0.0.1:\(ports[0])"
        let config = """
            [Session]
            Name=discovered
            Grant=client_credentials
            Issuer=\(base)
            ClientID=tokenbroker
            ClientSecretFile=@DIR@/client-secret

            [Session]
            Name=device
            TokenEndpoint=\(base)/token
            DeviceAuthorizationEndpoint=\(base)/device
            ClientID=tokenbroker
            ClientSecretFile=@DIR@/client-secret

            """
        try await withBroker(config: config) { broker in
            let token = try await broker.ctl(["token", "discovered"])
            #expect(token.code != 0 && token.err.contains("token_endpoint refused"), "\(token.err)")
            let hits = try String(contentsOf: URL(string: base + "/trap-hits")!, encoding: .utf8)
            #expect(hits == "0", "the trap saw \(hits) connection(s): a credential went to a name, over plain HTTP")

            let login = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "login", "device"], directory: broker.directory)
            try await eventually("the device prompt") { login.stdout.contains("ABCD-EFGH") }
            login.kill()
            #expect(try broker.call("GetToken", ["session": "discovered"]).error != nil)   // still answering
            #expect(broker.child.process.isRunning)
        }
    }

    @Test("a proxy from the environment never carries plain-HTTP (loopback) requests: the credential would cross it in clear")
    func noProxyForLoopback() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        // Port 9 (discard) on loopback: nothing listens; a request through it would fail.
        let proxy = ["http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "all_proxy": "http://127.0.0.1:9"]
        let broker = try await Broker.loggedIn(tokenEndpoint: issuer.tokenEndpoint, refreshToken: issuer.issueRefreshToken(), environment: proxy)
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        let token = try broker.call("GetToken", ["session": "api"])
        #expect(token.error == nil, "\(token)")
        #expect(issuer.counters.refreshGrants == 1)
        _ = await broker.stop()
    }

    /// Resident memory of `pid`, in KiB.
    static func residentKiB(_ pid: Int32) throws -> Int {
        let status = try String(contentsOfFile: "/proc/\(pid)/status", encoding: .utf8)
        let line = try #require(status.split(separator: "\n").first { $0.hasPrefix("VmRSS:") })
        return Int(line.split(separator: " ", omittingEmptySubsequences: true)[1]) ?? 0
    }
}
