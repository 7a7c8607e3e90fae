#if canImport(Glibc)
import Glibc
#endif
import Foundation
import Testing
import TestSupport
import Varlink

/// Delegations (issue 36): chosen sessions on a socket of their own, through the real daemon.
/// The delegation is the principal: on its socket only its sessions' token methods answer, for
/// every peer alike (root included). Tokens are compared by fingerprint only.
@Suite("Delegations: a socket that serves chosen sessions' tokens and nothing else", .serialized)
struct DelegationTests {
    static let config = """
        [Broker]
        SocketMode=0666

        [Session]
        Name=api
        Upstream=test
        AllowUsers=\(Broker.workerUID)
        Serves=https://api.example.test/

        [Session]
        Name=private
        Upstream=test
        Serves=https://private.example.test/

        [Delegation]
        Name=ci
        Sessions=private
        Socket=@DIR@/delegations/ci.sock
        SocketMode=0666

        """

    static func client(_ path: String) throws -> VarlinkClient { try VarlinkClient(address: VarlinkAddress(path: path), timeout: 20) }

    static func call(_ path: String, _ method: String, _ parameters: JSONObject = [:]) throws -> VarlinkReply {
        try client(path).call("io.tokenbroker.Broker." + method, parameters)
    }

    static let denied = "io.tokenbroker.Broker.PermissionDenied"

    @Test("a configured delegation serves its sessions' tokens to whoever opens its socket, and nothing else: no admin call, no other session, no key, even for root; Status and Credential see its sessions only; a logout reaches its Watch and its GetToken")
    func onlyItsSessions() async throws {
        try await withBroker(config: Self.config) { broker in
            let socket = broker.directory + "/delegations/ci.sock"
            let main = try #require(try broker.call("GetToken", ["session": "private"]).parameters["token"]?.stringValue)
            // A worker that may not use `private` on the broker's socket gets it through the delegation.
            #expect(try await broker.ctl(["token", "private"], asUser: Broker.workerUID).code == 77)
            let worker = try await broker.ctl(["--socket", socket, "token", "private"], asUser: Broker.workerUID)
            #expect(worker.code == 0 && fp(worker.out.trimmingCharacters(in: .newlines)) == fp(main), "\(worker.err)")
            // Root through the delegation: its session's tokens, nothing more.
            #expect(fp(try Self.call(socket, "GetToken", ["session": "private"]).parameters["token"]) == fp(main))
            #expect(try Self.call(socket, "GetToken", ["session": "api"]).error == Self.denied, "another session, even for root")
            #expect(try Self.call(socket, "GetToken", ["session": "nowhere"]).error == Self.denied, "no session names are probed")
            for (method, parameters) in [("Logout", ["session": "private"]), ("Login", ["session": "private", "refreshToken": "r"]),
                                         ("Refresh", ["session": "private"]), ("Reload", [:]), ("Metrics", [:]), ("Forget", ["session": "gone"]),
                                         ("Delegations", [:]), ("Undelegate", ["name": "ci"]),
                                         ("Delegate", ["sessions": ["api"], "socket": .string(broker.directory + "/x.sock")])] as [(String, JSONObject)] {
                #expect(try Self.call(socket, method, parameters).error == Self.denied, "\(method) through the delegation")
            }
            #expect(try Self.call(socket, "GetToken", ["session": "private", "resource": "https://k.example/"])
                    == .error("org.varlink.service.InvalidParameter", ["parameter": "resource"]), "no keys through a delegation")
            let status = try Self.call(socket, "Status").parameters["sessions"]?.arrayValue?.compactMap { $0.objectValue?["name"]?.stringValue }
            #expect(status == ["private"])
            let served = try Self.call(socket, "Credential", ["url": "https://private.example.test/x"])
            #expect(served.parameters["session"] == "private" && fp(served.parameters["token"]) == fp(main))
            #expect(try Self.call(socket, "Credential", ["url": "https://api.example.test/x"]).error == "io.tokenbroker.Broker.NoSuchSession")
            #expect(try broker.status("private") != nil && Set(try broker.call("Delegations").parameters["delegations"]?.arrayValue?
                .compactMap { $0.objectValue?["name"]?.stringValue } ?? []) == ["ci"])

            // A logout of the session reaches the delegation's workers: its Watch, then SignedOut.
            let watch = try Self.client(socket)
            try watch.send(VarlinkCall(method: "io.tokenbroker.Broker.Watch", parameters: ["session": "private"], more: true).encoded())
            #expect(try watch.nextReply().parameters["event"] == "token")
            #expect(try broker.call("Logout", ["session": "private"]).error == nil)
            #expect(try watch.nextReply().parameters["event"] == "signedOut")
            #expect(try Self.call(socket, "GetToken", ["session": "private"]).error == "io.tokenbroker.Broker.SignedOut")
        }
    }

    @Test("ctl delegate makes one at run time; undelegate removes its socket and closes its connections before it returns; --ttl ends one by itself; bad requests are refused with the reason; a reload adds and removes configured ones")
    func lifecycle() async throws {
        try await withBroker(config: Self.config) { broker in
            let path = broker.directory + "/run/dev.sock"
            let made = try await broker.ctl(["delegate", "api", "private", "--socket", path, "--name", "dev", "--ttl", "1h", "--mode", "0666"])
            #expect(made.code == 0 && made.out.hasPrefix("delegated api private on \(path) as dev, until "), "\(made.out) \(made.err)")
            let listed = try await broker.ctl(["delegations"])
            #expect(listed.code == 0 && listed.out.contains("ci    private") && listed.out.contains("dev   api,private"), "\(listed.out)")
            #expect(try Self.call(path, "GetToken", ["session": "api"]).error == nil)

            // Undelegate: by the time it answers, the socket is gone and the connection on it closed.
            let watch = try Self.client(path)
            try watch.send(VarlinkCall(method: "io.tokenbroker.Broker.Watch", parameters: ["session": "api"], more: true).encoded())
            #expect(try watch.nextReply().parameters["event"] == "token")
            let started = ContinuousClock.now
            let ended = try await broker.ctl(["undelegate", "dev"])
            #expect(ended.code == 0, "\(ended.err)")
            #expect(access(path, F_OK) != 0, "the socket file is gone")
            #expect(throws: (any Error).self, "the connection is closed") { _ = try watch.nextReply() }
            let took = started.duration(to: .now)
            #expect(took < .seconds(5), "undelegate and the close took \(took)")
            #expect(try await broker.ctl(["undelegate", "dev"]).err.contains("no delegation named 'dev'"))

            // --ttl: it ends by itself.
            let short = broker.directory + "/run/short.sock"
            #expect(try await broker.ctl(["delegate", "api", "--socket", short, "--ttl", "1s"]).code == 0)
            try await eventually("the short delegation ends", timeout: .seconds(15)) { access(short, F_OK) != 0 }

            // At most --max-connections open on it, root's counted too (nobody is privileged there).
            let small = broker.directory + "/run/small.sock"
            #expect(try await broker.ctl(["delegate", "api", "--socket", small, "--max-connections", "2"]).code == 0)
            let held = [try Self.client(small), try Self.client(small)]
            for client in held { #expect(try client.call("io.tokenbroker.Broker.GetToken", ["session": "api"]).error == nil) }
            #expect(throws: (any Error).self, "a third connection is closed at once") {
                _ = try Self.call(small, "GetToken", ["session": "api"])
            }
            #expect(try broker.call("GetToken", ["session": "api"]).error == nil, "the broker's own socket is not affected")

            // Refused, with the reason: an unknown session, a name in use, a directory others can
            // write, a worker who is not an admin.
            #expect(try await broker.ctl(["delegate", "nowhere", "--socket", broker.directory + "/run/n.sock"]).err.contains("no session named 'nowhere'"))
            let taken = try await broker.ctl(["delegate", "api", "--socket", broker.directory + "/run/t.sock", "--name", "ci"])
            #expect(taken.code == 1 && taken.err.contains("a delegation or token file named ci exists already"), "\(taken.err)")
            let open = broker.directory + "/open"
            try FileManager.default.createDirectory(atPath: open, withIntermediateDirectories: true)
            chmod(open, 0o777)
            let unsafe = try await broker.ctl(["delegate", "api", "--socket", open + "/d.sock"])
            #expect(unsafe.code == 1 && unsafe.err.contains("writable by everyone"), "\(unsafe.err)")
            #expect(try await broker.ctl(["delegate", "api", "--socket", broker.directory + "/run/w.sock"], asUser: Broker.workerUID).code == 77)

            // A reload: a [Delegation] removed closes its socket, one added opens.
            let ci = broker.directory + "/delegations/ci.sock"
            #expect(access(ci, F_OK) == 0)
            let next = Self.config.replacingOccurrences(of: "Name=ci\n", with: "Name=ci2\n").replacingOccurrences(of: "ci.sock", with: "ci2.sock")
            try next.replacingOccurrences(of: "@DIR@", with: broker.directory).write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            #expect(try await broker.ctl(["reload"]).code == 0)
            #expect(access(ci, F_OK) != 0 && access(broker.directory + "/delegations/ci2.sock", F_OK) == 0)
            #expect(try Self.call(broker.directory + "/delegations/ci2.sock", "GetToken", ["session": "private"]).error == nil)

            // A delegation made at run time ends at the reload that removes a session it serves;
            // one whose sessions stay configured is kept.
            let keep = broker.directory + "/run/keep.sock", drop = broker.directory + "/run/drop.sock"
            #expect(try await broker.ctl(["delegate", "private", "--socket", keep, "--name", "keep"]).code == 0)
            #expect(try await broker.ctl(["delegate", "api", "--socket", drop, "--name", "drop"]).code == 0)
            let withoutAPI = next.replacingOccurrences(of: "[Session]\nName=api\nUpstream=test\nAllowUsers=\(Broker.workerUID)\nServes=https://api.example.test/\n",
                                                       with: "")
            #expect(withoutAPI != next)
            try withoutAPI.replacingOccurrences(of: "@DIR@", with: broker.directory).write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            #expect(try await broker.ctl(["reload"]).code == 0)
            #expect(access(drop, F_OK) != 0, "a run-time delegation of a session no longer configured ends")
            #expect(access(keep, F_OK) == 0)
            #expect(try Self.call(keep, "GetToken", ["session": "private"]).error == nil)
        }
        }

    @Test("a delegation's peers share one share of a session's refreshes, whatever uids they take: they are throttled while the host's callers still refresh; their connections do not count against a host uid's")
    func oneShare() async throws {
        let config = Self.config.replacingOccurrences(of: "Name=private\nUpstream=test\n", with: "Name=private\nUpstream=test\nRefreshLimitBurst=4\n")
        try await withBroker(config: config) { broker in
            let socket = broker.directory + "/delegations/ci.sock"
            // Through the delegation, as root and as a worker: each Recover of the current token forces a refresh.
            var throttled = 0
            for round in 0..<6 {
                let current = try #require(try broker.call("GetToken", ["session": "private"]).parameters["token"])
                let reply: Int32
                if round % 2 == 0 {
                    reply = try Self.call(socket, "Recover", ["session": "private", "rejected": current]).error == "io.tokenbroker.Broker.Throttled" ? 1 : 0
                } else {
                    let recovered = try await broker.ctl(["--socket", socket, "recover", "private"], asUser: Broker.workerUID + UInt32(round),
                                                         stdin: current.stringValue ?? "")
                    reply = recovered.err.contains("refresh limit reached") ? 1 : 0
                }
                throttled += Int(reply)
            }
            // A share is half the burst: two refreshes, then the delegation is throttled, both uids alike.
            #expect(throttled == 4, "throttled \(throttled) of 6")
            let host = try #require(try broker.call("GetToken", ["session": "private"]).parameters["token"])
            #expect(try broker.call("Recover", ["session": "private", "rejected": host]).error == nil, "the host's admin still refreshes")
        }
    }

    @Test("a real container (systemd-nspawn, no user namespace: its root is uid 0) with the delegation's directory bound at /run/tokenbroker: its tokenbroker finds the socket where it looks by default and gets the delegated session's token; as root in there, every admin call and every other session is refused")
    func realContainer() async throws {
        guard ContainerRoot.nspawnAvailable() else { return }
        try await withBroker(config: Self.config) { broker in
            let exposed = broker.directory + "/ct"
            #expect(try await broker.ctl(["delegate", "private", "--socket", exposed + "/io.tokenbroker.Broker", "--name", "ct", "--mode", "0666"]).code == 0)
            // The smallest root: the host's /usr read-only, the static tokenbroker, a directory for results.
            let root = broker.directory + "/root"
            try ContainerRoot.make(at: root, directories: ["run/tokenbroker", "opt", "out"])
            let script = """
                set -u
                t=/opt/tokenbroker
                $t ctl token private > /out/token; echo "token $?"
                $t ctl token api > /dev/null 2>&1; echo "other $?"
                $t ctl logout private > /dev/null 2>&1; echo "logout $?"
                $t ctl refresh private > /dev/null 2>&1; echo "refresh $?"
                $t ctl delegations > /dev/null 2>&1; echo "delegations $?"
                $t ctl reload > /dev/null 2>&1; echo "reload $?"
                $t ctl status --json > /out/status; echo "status $?"
                echo "uid $(id -u)"
                """
            let run = try Child("/usr/bin/systemd-nspawn", ["-q", "-D", root, "--bind-ro=/usr", "--register=no", "--keep-unit", "--console=pipe",
                                                          "--bind-ro=\(Paths.tokenbroker):/opt/tokenbroker", "--bind-ro=\(exposed):/run/tokenbroker",
                                                          "--bind=\(root)/out:/out", "/bin/sh", "-c", script], directory: broker.directory)
            #expect(await run.wait(timeout: 120) == 0, "\(run.stderr.suffix(400))")
            let results = Dictionary(run.stdout.split(separator: "\n").compactMap { line -> (String, String)? in
                let words = line.split(separator: " ")
                return words.count == 2 ? (String(words[0]), String(words[1])) : nil
            }, uniquingKeysWith: { first, _ in first })
            #expect(results == ["token": "0", "other": "77", "logout": "77", "refresh": "77", "delegations": "77", "reload": "77",
                                "status": "0", "uid": "0"], "\(results)")
            let token = try String(contentsOfFile: root + "/out/token", encoding: .utf8).trimmingCharacters(in: .newlines)
            #expect(fp(token) == fp(try broker.call("GetToken", ["session": "private"]).parameters["token"]))
            let status = try String(contentsOfFile: root + "/out/status", encoding: .utf8)
            #expect(status.contains("\"private\"") && !status.contains("\"api\""), "the container's Status shows the delegated session only")
            #expect(try broker.status("private")?["state"] == "active", "the container's root logged nothing out")
        }
    }
}
