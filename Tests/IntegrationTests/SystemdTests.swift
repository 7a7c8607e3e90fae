import DevIssuer
import Foundation
import SQLiteStore
import Synchronization
import Testing
import TestSupport
import Varlink
import TokenBrokerCore

/// A datagram socket the test owns, standing in for systemd's notify socket (or journald's).
final class DatagramReceiver: @unchecked Sendable {
    // @unchecked: the descriptor is only read by the test task that owns the receiver.
    let path: String
    private let fd: Int32

    /// `path`: a file's path or, with a leading `@`, an abstract socket's name (as
    /// `NOTIFY_SOCKET` spells one).
    init(path: String) throws {
        self.path = path
        fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue), 0)
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        var bytes = Array(path.utf8)
        let abstract = bytes.first == UInt8(ascii: "@")
        if abstract { bytes[0] = 0 } else { bytes.append(0) }
        withUnsafeMutableBytes(of: &address.sun_path) { $0.copyBytes(from: bytes) }
        let rc = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sa_family_t>.size + bytes.count)) }
        }
        guard rc == 0 else { throw POSIXError(.EADDRINUSE) }
        if !abstract { chmod(path, 0o666) }
    }

    deinit {
        close(fd)
        if !path.hasPrefix("@") { unlink(path) }
    }

    /// The next datagram, or nil after `timeout`.
    func receive(timeout: Double = 10) -> String? {
        var pfd = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        guard poll(&pfd, 1, Int32(timeout * 1000)) > 0 else { return nil }
        var buffer = [UInt8](repeating: 0, count: 65_536)
        let n = buffer.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, 0) }
        return n > 0 ? String(decoding: buffer[0..<n], as: UTF8.self) : nil
    }

    /// Datagrams until one satisfies `condition` (included), skipping those `skip` matches.
    func receive(until condition: (String) -> Bool, timeout: Double = 10) -> [String] {
        var messages: [String] = []
        let deadline = Date().addingTimeInterval(timeout)
        while Date() < deadline, let message = receive(timeout: deadline.timeIntervalSinceNow) {
            messages.append(message)
            if condition(message) { break }
        }
        return messages
    }
}

@Suite("systemd integration", .serialized)
struct SystemdTests {
    static let config = """
        [Session]
        Name=api
        Upstream=test

        """

    @Test("notify: READY with STATUS, WATCHDOG pings, RELOADING then READY on SIGHUP (good and bad), STOPPING on SIGTERM")
    func notifications() async throws {
        let directory = try Paths.temporaryDirectory()
        let notify = try DatagramReceiver(path: directory + "/notify")
        let configPath = directory + "/tokenbroker.conf"
        try Self.config.write(toFile: configPath, atomically: true, encoding: .utf8)
        let socket = directory + "/tb.sock"
        let daemon = try Child(Paths.tokenbroker, ["serve", "--config", configPath, "--socket", socket, "--state-dir", directory + "/state"],
                               environment: ["NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "300000"], directory: directory)
        defer { daemon.terminate() }

        // READY=1 comes once the socket listens, with a status line.
        let ready = try #require(notify.receive())
        #expect(ready.hasPrefix("READY=1\nSTATUS=1 active, 0 signed out, 0 failed, 0 degraded"), "\(ready)")
        #expect(try VarlinkClient(address: VarlinkAddress(path: socket)).call("io.tokenbroker.Broker.GetToken", ["session": "api"]).error == nil)

        // The watchdog is pinged at half of WATCHDOG_USEC from the serving loop.
        let pings = notify.receive(until: { $0 == "WATCHDOG=1" })
        #expect(pings.last == "WATCHDOG=1")

        // A good reload: RELOADING=1 with MONOTONIC_USEC, then READY=1; the new session is served.
        try (Self.config + "[Session]\nName=extra\nUpstream=test\n").write(toFile: configPath, atomically: true, encoding: .utf8)
        kill(daemon.process.processIdentifier, SIGHUP)
        var messages = notify.receive(until: { $0.hasPrefix("READY=1") }).filter { $0 != "WATCHDOG=1" && !$0.hasPrefix("STATUS=") }
        #expect(messages.count == 2 && messages[0].hasPrefix("RELOADING=1\nMONOTONIC_USEC=") && messages[1].hasPrefix("READY=1"), "\(messages)")
        #expect(try VarlinkClient(address: VarlinkAddress(path: socket)).call("io.tokenbroker.Broker.GetToken", ["session": "extra"]).error == nil)

        // A bad reload keeps the old configuration, logs file:line, and STATUS= says so.
        try (Self.config + "[Session]\nName=extra\nUpstream=test\nRefreshAhead=eventually\n").write(toFile: configPath, atomically: true, encoding: .utf8)
        kill(daemon.process.processIdentifier, SIGHUP)
        messages = notify.receive(until: { $0.hasPrefix("READY=1") }).filter { $0 != "WATCHDOG=1" && !$0.hasPrefix("STATUS=") }
        #expect(messages.first?.hasPrefix("RELOADING=1") == true)
        let readyAgain = try #require(messages.last)
        #expect(readyAgain.contains("reload failed: \(configPath):7: RefreshAhead="), "\(readyAgain)")
        #expect(daemon.stderr.contains("\(configPath):7: RefreshAhead="))
        #expect(try VarlinkClient(address: VarlinkAddress(path: socket)).call("io.tokenbroker.Broker.GetToken", ["session": "extra"]).error == nil)

        // SIGTERM: STOPPING=1, then a clean exit.
        daemon.terminate()
        let stopping = notify.receive(until: { $0.hasPrefix("STOPPING=1") })
        #expect(stopping.last?.hasPrefix("STOPPING=1") == true)
        #expect(await daemon.wait() == 0)
    }

    @Test("a SIGHUP while the daemon is still starting neither kills it nor is lost: it reloads once ready")
    func signalDuringStart() async throws {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let configPath = directory + "/tokenbroker.conf"
        try "[Broker]\n".write(toFile: configPath, atomically: true, encoding: .utf8)
        try FileManager.default.createDirectory(atPath: configPath + ".d", withIntermediateDirectories: true)
        // The session's drop-in is a FIFO: reading the configuration blocks until the test
        // writes it, which holds the daemon in its start-up for as long as the test needs.
        let dropIn = configPath + ".d/api.conf"
        #expect(mkfifo(dropIn, 0o600) == 0)
        let socket = directory + "/tb.sock"
        let daemon = try Child(Paths.tokenbroker, ["serve", "--config", configPath, "--socket", socket, "--state-dir", directory + "/state"],
                               directory: directory)
        defer { daemon.kill() }
        try await writeFIFO(dropIn, Self.config) {
            // The daemon is blocked reading its configuration: a `systemctl reload` now.
            kill(daemon.process.processIdentifier, SIGHUP)
        }
        try await waitForSocket(socket, server: daemon)
        // The reload it was asked for reads the configuration again.
        try await writeFIFO(dropIn, Self.config + "[Session]\nName=extra\nUpstream=test\n")
        try await eventually("the early SIGHUP handled as a reload") { daemon.stderr.contains("configuration reloaded: 2 session(s)") }
        #expect(try VarlinkClient(address: VarlinkAddress(path: socket)).call("io.tokenbroker.Broker.GetToken", ["session": "extra"]).error == nil)
        kill(daemon.process.processIdentifier, SIGINT)
        #expect(await daemon.wait() == 0)
    }

    @Test("a SIGHUP already pending when the daemon is exec'd is neither fatal nor lost: it reloads once ready")
    func signalPendingAtExec() async throws {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let configPath = directory + "/tokenbroker.conf"
        try Self.config.write(toFile: configPath, atomically: true, encoding: .utf8)
        let socket = directory + "/tb.sock"
        // The launcher blocks SIGHUP, sends it to itself and execs the daemon: the signal is
        // pending before the daemon's first instruction (pending and blocked signals survive exec).
        let daemon = try Child("/usr/bin/env", ["python3", "-c", """
            import os, signal, sys
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGHUP])
            os.kill(os.getpid(), signal.SIGHUP)
            os.execv(sys.argv[1], sys.argv[1:])
            """, Paths.tokenbroker, "serve", "--config", configPath, "--socket", socket, "--state-dir", directory + "/state"],
                               directory: directory)
        defer { daemon.kill() }
        try await waitForSocket(socket, server: daemon)
        try await eventually("the pending SIGHUP handled as a reload") { daemon.stderr.contains("configuration reloaded") }
        kill(daemon.process.processIdentifier, SIGTERM)
        #expect(await daemon.wait() == 0)
    }

    @Test("a SIGHUP queued behind SIGTERM does not reload while the daemon stops")
    func reloadAfterStopIgnored() async throws {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let configPath = directory + "/tokenbroker.conf"
        try Self.config.write(toFile: configPath, atomically: true, encoding: .utf8)
        try FileManager.default.createDirectory(atPath: configPath + ".d", withIntermediateDirectories: true)
        let socket = directory + "/tb.sock"
        let daemon = try Child(Paths.tokenbroker, ["serve", "--config", configPath, "--socket", socket, "--state-dir", directory + "/state"],
                               directory: directory)
        defer { daemon.kill() }
        try await waitForSocket(socket, server: daemon)
        // A drop-in that is a FIFO holds the next reload in reading the configuration: every
        // reload after the first one would block there for good.
        let dropIn = configPath + ".d/extra.conf"
        #expect(mkfifo(dropIn, 0o600) == 0)
        let pid = daemon.process.processIdentifier
        kill(pid, SIGHUP)
        try await writeFIFO(dropIn, "[Session]\nName=extra\nUpstream=test\n") {
            // While that reload reads: a stop, then another reload, each read by the daemon
            // (no longer pending) before the next is sent.
            for number in [SIGTERM, SIGHUP] {
                kill(pid, number)
                try? await eventually("signal \(number) read") { !Self.pending(pid).contains(number) }
            }
        }
        #expect(await daemon.wait(timeout: 20) == 0)
        let log = daemon.stderr
        #expect(log.components(separatedBy: "configuration reloaded").count - 1 == 1)
        #expect(log.contains("stopping (signal 15)"))
        #expect(!log.contains("<3>"), "an error logged by a clean stop")
    }

    /// The signals pending for the process `pid` (its shared pending set).
    static func pending(_ pid: pid_t) -> Set<Int32> {
        guard let status = try? String(contentsOfFile: "/proc/\(pid)/status", encoding: .utf8),
              let line = status.split(separator: "\n").first(where: { $0.hasPrefix("ShdPnd:") }),
              let mask = UInt64(line.dropFirst("ShdPnd:".count).trimmingCharacters(in: .whitespaces), radix: 16) else { return [] }
        return Set((1...64).filter { mask & (1 << UInt64($0 - 1)) != 0 }.map(Int32.init))
    }

    /// Writes `text` into the FIFO at `path` once its reader has opened it; `opened` runs between.
    private func writeFIFO(_ path: String, _ text: String, opened: () async -> Void = {}) async throws {
        let writer = Mutex<Int32>(-1)
        try await eventually("the daemon opens \(path)") {
            let fd = open(path, O_WRONLY | O_NONBLOCK)   // fails with ENXIO until a reader has it open
            writer.withLock { $0 = fd }
            return fd >= 0
        }
        let fd = writer.withLock { $0 }
        await opened()
        let bytes = Array(text.utf8)
        #expect(write(fd, bytes, bytes.count) == bytes.count)
        close(fd)
    }

    @Test("notify to an abstract socket (NOTIFY_SOCKET=@name); WATCHDOG_PID or LISTEN_PID naming another process: no watchdog, no passed socket")
    func abstractNotifySocketAndOtherProcesses() async throws {
        let directory = try Paths.temporaryDirectory()
        let notify = try DatagramReceiver(path: "@tokenbroker-test-\(getpid())-\(UInt64.random(in: 0...UInt64.max))")
        let configPath = directory + "/tokenbroker.conf"
        try Self.config.write(toFile: configPath, atomically: true, encoding: .utf8)
        let socket = directory + "/tb.sock"
        // The variables systemd would set for another process (pid 1): they are not this daemon's.
        let daemon = try Child(Paths.tokenbroker, ["serve", "--config", configPath, "--socket", socket, "--state-dir", directory + "/state"],
                               environment: ["NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "100000", "WATCHDOG_PID": "1",
                                             "LISTEN_PID": "1", "LISTEN_FDS": "1"], directory: directory)
        defer { daemon.terminate() }
        let ready = try #require(notify.receive())
        #expect(ready.hasPrefix("READY=1\nSTATUS="), "\(ready)")
        // It bound its own socket rather than taking descriptor 3 for systemd's.
        #expect(try VarlinkClient(address: VarlinkAddress(path: socket)).call("io.tokenbroker.Broker.GetToken", ["session": "api"]).error == nil)
        #expect(!daemon.stderr.contains("using the socket passed by systemd"))
        // No watchdog: at 50 ms a ping, a second holds twenty.
        let later = notify.receive(until: { $0 == "WATCHDOG=1" }, timeout: 1)
        #expect(!later.contains("WATCHDOG=1"), "\(later)")
        daemon.terminate()
        #expect(notify.receive(until: { $0.hasPrefix("STOPPING=1") }).last?.hasPrefix("STOPPING=1") == true)
        #expect(await daemon.wait() == 0)
    }

    @Test("socket activation under systemd-socket-activate; more than one socket is refused")
    func socketActivation() async throws {
        let directory = try Paths.temporaryDirectory()
        let configPath = directory + "/tokenbroker.conf"
        try Self.config.write(toFile: configPath, atomically: true, encoding: .utf8)
        let socket = directory + "/activated.sock"
        let activator = try Child("/usr/bin/systemd-socket-activate",
                                  ["-l", socket, "--fdname=varlink", Paths.tokenbroker, "serve", "--config", configPath,
                                   "--socket", socket, "--state-dir", directory + "/state"], directory: directory)
        defer { activator.terminate() }
        // The first connection (this wait's own) starts the daemon, exec'd in place of the activator.
        try await waitForSocket(socket)
        let reply = try VarlinkClient(address: VarlinkAddress(path: socket)).call("io.tokenbroker.Broker.GetToken", ["session": "api"])
        #expect(reply.error == nil)
        try await eventually("the daemon's log") { activator.stderr.contains("using the socket passed by systemd") }
        activator.terminate()
        #expect(await activator.wait() == 0)
        // The socket belongs to the service manager: the daemon leaves it in place.
        #expect(FileManager.default.fileExists(atPath: socket))

        let two = try Child("/usr/bin/systemd-socket-activate",
                            ["-l", directory + "/a.sock", "-l", directory + "/b.sock", Paths.tokenbroker, "serve", "--config", configPath,
                             "--state-dir", directory + "/state2"], directory: directory)
        defer { two.kill() }
        // Connecting starts the daemon, which refuses the two sockets.
        try await waitForSocket(directory + "/a.sock")
        #expect(await two.wait() == 1)
        #expect(two.stderr.contains("socket activation passed 2 sockets; tokenbroker takes exactly one"))
    }

    @Test("a daemon that cannot start under socket activation answers the call that woke it with why (the error's first line to root, where to read it to others), then exits 78 once no call came for a second (issue 33)")
    func startFailureAnswers() async throws {
        let directory = try Paths.temporaryDirectory()
        chmod(directory, 0o755)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let configPath = directory + "/tokenbroker.conf"
        try "[Broker]\nSocketMode=0666\n\n[Session]\nName=api\nUpstream=test\nAllowGroups=no-such-group-tb\n".write(toFile: configPath, atomically: true, encoding: .utf8)
        let copy = directory + "/tokenbroker-ctl"
        try FileManager.default.copyItem(atPath: Paths.tokenbroker, toPath: copy)
        chmod(copy, 0o755)
        for worker in [false, true] {
            let socket = directory + "/activated-\(worker).sock"
            let activator = try Child("/usr/bin/systemd-socket-activate",
                                      ["-l", socket, Paths.tokenbroker, "serve", "--config", configPath, "--socket", socket,
                                       "--state-dir", directory + "/state"], directory: directory)
            defer { activator.kill() }
            try await eventually("the activator listens") { FileManager.default.fileExists(atPath: socket) }
            chmod(socket, 0o666)   // (the activator binds it under the test's umask)
            // This call starts the daemon, which answers it rather than leaving it to time out.
            let argv = (worker ? ["--reuid=\(Broker.workerUID)", "--regid=\(Broker.workerUID)", "--clear-groups", copy] : [copy])
                + ["ctl", "--socket", socket, "token", "api"]
            let call = try Child(worker ? "/usr/bin/setpriv" : copy, worker ? argv : Array(argv.dropFirst()), directory: directory)
            #expect(await call.wait() == 78)
            let said = worker
                ? "Error: the broker cannot start: its configuration has an error (an administrator can read it: systemctl status tokenbroker); once it is fixed, the next call starts the broker again\n"
                : "Error: the broker cannot start: configuration error: \(configPath):7: AllowGroups=: no such group 'no-such-group-tb'; once it is fixed, the next call starts the broker again\n"
            #expect(call.stderr == said)
            #expect(await activator.wait() == 78)
            #expect(activator.stderr.contains("configuration error: \(configPath):7: AllowGroups=: no such group 'no-such-group-tb'"))
        }
    }

    @Test("SIGTERM during an in-flight refresh: the refresh completes, its state is committed, exit 0")
    func sigtermDuringRefresh() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let broker = try await Broker.loggedIn(tokenEndpoint: issuer.tokenEndpoint, refreshToken: issuer.issueRefreshToken())
        issuer.inject([.hold])
        let answered = Mutex<VarlinkReply?>(nil)
        let caller = Thread {
            let reply = try? VarlinkClient(address: broker.address, timeout: 30).call("io.tokenbroker.Broker.GetToken", ["session": "api"])
            answered.withLock { $0 = reply }
        }
        caller.start()
        try await eventually("the refresh held at the issuer") { issuer.heldCount == 1 }
        broker.child.terminate()
        try await eventually("the daemon stops accepting") { !FileManager.default.fileExists(atPath: broker.socket) }
        issuer.releaseHeld()
        #expect(await broker.child.wait() == 0)
        try await eventually("the caller's answer") { answered.withLock { $0 } != nil }
        let token = try #require(answered.withLock { $0 }?.parameters["token"]?.stringValue)
        #expect(issuer.isValidAccessToken(token))
        let stored = try #require(try await StateDatabase.open(broker.directory + "/state").load("api"))
        let lineage = try #require(issuer.lineage(of: stored.refreshToken?.reveal ?? ""))
        #expect(lineage.index == lineage.newest && lineage.index == 1 && fp(stored.accessToken?.reveal) == fp(token))
    }

    @Test("SIGTERM while a refresh nobody waits for is in flight: systemd's stop timeout is extended, and it still lands and commits")
    func sigtermDuringOrphanedRefresh() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let notifyDirectory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: notifyDirectory) }
        let notify = try DatagramReceiver(path: notifyDirectory + "/notify")
        let broker = try await Broker.loggedIn(tokenEndpoint: issuer.tokenEndpoint, refreshToken: issuer.issueRefreshToken(),
                                               environment: ["NOTIFY_SOCKET": notify.path])
        issuer.inject([.hold])
        // The caller starts a refresh and goes away; the flight goes on (guarantee 6).
        let caller = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "refresh", "api"], directory: broker.directory)
        try await eventually("the refresh held at the issuer") { issuer.heldCount == 1 }
        caller.kill()
        broker.child.terminate()
        // STOPPING=1, then EXTEND_TIMEOUT_USEC while the refresh is still out, again and again
        // (every 5 s, each asking for 10 s more): systemd must not kill a rotation in progress.
        let stopping = notify.receive(until: { $0.hasPrefix("STOPPING=1") })
        #expect(stopping.last?.hasPrefix("STOPPING=1") == true)
        let extensions = notify.receive(until: { $0 == "EXTEND_TIMEOUT_USEC=10000000" })
        #expect(extensions.last == "EXTEND_TIMEOUT_USEC=10000000", "\(extensions)")
        #expect(notify.receive(until: { $0.hasPrefix("EXTEND_TIMEOUT_USEC=") }, timeout: 8).last == "EXTEND_TIMEOUT_USEC=10000000")
        try await eventually("the daemon stops accepting") { !FileManager.default.fileExists(atPath: broker.socket) }
        issuer.releaseHeld()
        #expect(await broker.child.wait() == 0)
        let stored = try #require(try await StateDatabase.open(broker.directory + "/state").load("api"))
        let lineage = try #require(issuer.lineage(of: stored.refreshToken?.reveal ?? ""))
        #expect(lineage.index == 1 && lineage.newest == 1, "the rotated refresh token was not committed")
    }

    @Test("the unit files pass systemd-analyze verify with no warning, and the service's exposure is at most 1.5")
    func unitFiles() async throws {
        let directory = try Paths.temporaryDirectory()
        let units = Paths.packageRoot.appendingPathComponent("systemd")
        // verify needs ExecStart to name an executable: the one just built.
        let service = try String(contentsOf: units.appendingPathComponent("tokenbroker.service"), encoding: .utf8)
            .replacingOccurrences(of: "/usr/local/libexec/tokenbroker/tokenbroker-daemon", with: Paths.daemon)
        try service.write(toFile: directory + "/tokenbroker.service", atomically: true, encoding: .utf8)
        try FileManager.default.copyItem(atPath: units.appendingPathComponent("tokenbroker.socket").path, toPath: directory + "/tokenbroker.socket")

        let verify = try Child("/usr/bin/systemd-analyze", ["verify", "--man=no", "--recursive-errors=yes",
                                                            directory + "/tokenbroker.service", directory + "/tokenbroker.socket"],
                               directory: directory)
        #expect(await verify.wait() == 0)
        #expect(verify.stderr.isEmpty && verify.stdout.isEmpty, "\(verify.stderr)")

        let security = try Child("/usr/bin/systemd-analyze", ["security", "--offline=true", directory + "/tokenbroker.service"],
                                 directory: directory)
        #expect(await security.wait() == 0)
        let score = security.stdout.components(separatedBy: "Overall exposure level for tokenbroker.service: ").last?
            .split(separator: " ").first.flatMap { Double($0) }
        let exposure = try #require(score, "\(security.stdout.suffix(300))")
        print("systemd-analyze security: exposure \(exposure)")
        #expect(exposure <= 1.5)
    }

    @Test("journal: structured entries with SESSION and GENERATION when stderr is the journal, and no token",
          .enabled(if: !FileManager.default.fileExists(atPath: "/run/systemd/journal/socket") && getuid() == 0))
    func journal() async throws {
        let createdDirectory = !FileManager.default.fileExists(atPath: "/run/systemd/journal")
        try FileManager.default.createDirectory(atPath: "/run/systemd/journal", withIntermediateDirectories: true)
        defer { if createdDirectory { try? FileManager.default.removeItem(atPath: "/run/systemd/journal") } }
        let journal = try DatagramReceiver(path: "/run/systemd/journal/socket")
        let directory = try Paths.temporaryDirectory()
        try Self.config.write(toFile: directory + "/tokenbroker.conf", atomically: true, encoding: .utf8)
        // Child sends stderr to a file it creates first: give the daemon that file's identity.
        let errPath = directory + "/journal-daemon.err"
        _ = FileManager.default.createFile(atPath: errPath, contents: nil)
        let socket = directory + "/j.sock"
        let daemon = try Child("/bin/sh", ["-c", "exec 2>>\(errPath); JOURNAL_STREAM=$(stat -c '%d:%i' \(errPath)) exec \"$0\" \"$@\"",
                                           Paths.tokenbroker, "serve", "--config", directory + "/tokenbroker.conf", "--socket", socket,
                                           "--state-dir", directory + "/state"], directory: directory)
        defer { daemon.terminate() }
        try await waitForSocket(socket)
        let token = try #require(try VarlinkClient(address: VarlinkAddress(path: socket))
            .call("io.tokenbroker.Broker.GetToken", ["session": "api"]).parameters["token"]?.stringValue)
        #expect(try VarlinkClient(address: VarlinkAddress(path: socket)).call("io.tokenbroker.Broker.Logout", ["session": "api"]).error == nil)
        let entries = journal.receive(until: { $0.contains("logout of session api") })
        let logout = try #require(entries.last)
        #expect(logout.contains("PRIORITY=5\n") && logout.contains("SYSLOG_IDENTIFIER=tokenbroker\n") && logout.contains("SESSION=api\n"))
        #expect(logout.contains("GENERATION=2\n"))
        let leaked = entries.contains { $0.contains(token) }
        #expect(!leaked)
        #expect(!daemon.stderr.contains("logout of session"))   // nothing on stderr: it went to the journal
    }
}
