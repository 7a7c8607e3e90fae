#if canImport(Glibc)
import Glibc
#endif
import Foundation
import Testing
import TestSupport
import Varlink

/// Delegations over a real OpenSSH (issue 36): Debian's `sshd` on a loopback port with a
/// configuration, host key and authorized key of the test's own, and `ssh -R` forwarding a
/// delegation's socket to a path on the "remote host" (this machine, through sshd: what runs
/// there is a shell sshd started). Tokens are compared by fingerprint only.
@Suite("Delegations over a real OpenSSH: ssh -R forwards a delegation's socket, and the far side gets its sessions' tokens and nothing else", .serialized)
struct SSHDelegationTests {
    @Test("ssh -R forwards a delegation's socket to a remote host, where root and uid 999 alike get the delegated session's token and every other session, logout, refresh and reload are refused; ctl undelegate closes a connection held open through the forward, and new ones fail")
    func forwarded() async throws {
        guard access(LoopbackSSHD.sshd, X_OK) == 0, access(LoopbackSSHD.ssh, X_OK) == 0 else {
            Issue.record("sshd or ssh is missing (make test-deps installs openssh-server)")
            return
        }
        try await withBroker(config: DelegationTests.config) { broker in
            let delegation = broker.directory + "/deleg.sock"
            let made = try await broker.ctl(["delegate", "private", "--socket", delegation, "--name", "remote", "--mode", "0600"])
            #expect(made.code == 0, "\(made.out) \(made.err)")
            var info = stat()
            #expect(stat(delegation, &info) == 0 && info.st_uid == 0 && info.st_mode & 0o777 == 0o600, "root's, 0600")

            let sshd = try await LoopbackSSHD(directory: broker.directory + "/ssh")
            defer { sshd.stop() }
            // The remote side: root's shell through sshd, the forwarded socket under the broker
            // socket's name, and a copy of tokenbroker uid 999 can run (the build directory may
            // sit under a home only root can enter).
            let remoteDirectory = broker.directory + "/remote"
            let remote = remoteDirectory + "/io.tokenbroker.Broker"
            let out = broker.directory + "/out"
            for directory in [remoteDirectory, out] {
                try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o755])
            }
            let tokenbroker = broker.directory + "/tokenbroker-remote"
            try FileManager.default.copyItem(atPath: Paths.tokenbroker, toPath: tokenbroker)
            chmod(tokenbroker, 0o755)
            // As root, then as uid 999 (setpriv): each line "WHO WHAT EXIT-STATUS"; the tokens
            // to files the test reads. Then it holds the forward until the test closes its input.
            let script = """
                set -u
                sock=\(remote); t=\(tokenbroker); out=\(out)
                i=0; while [ ! -S "$sock" ]; do i=$((i + 1)); [ "$i" -le 2000 ] || { echo "no forwarded socket"; exit 3; }; sleep 0.01; done
                for who in root 999; do
                  as=""; [ "$who" = root ] || as="/usr/bin/setpriv --reuid=999 --regid=999 --clear-groups"
                  $as $t ctl --socket "$sock" token private > "$out/token-$who"; echo "$who token $?"
                  $as $t ctl --socket "$sock" token api > /dev/null 2>&1; echo "$who other $?"
                  $as $t ctl --socket "$sock" logout private > /dev/null 2>&1; echo "$who logout $?"
                  $as $t ctl --socket "$sock" refresh private > /dev/null 2>&1; echo "$who refresh $?"
                  $as $t ctl --socket "$sock" reload > /dev/null 2>&1; echo "$who reload $?"
                  $as $t ctl --socket "$sock" status --json > "$out/status-$who"; echo "$who status $?"
                  echo "$who uid $($as /usr/bin/id -u)"
                done
                echo ready
                read -r _ || true
                """
            let ssh = try sshd.ssh(["-R", remote + ":" + delegation], command: script, output: broker.directory)
            defer { ssh.kill() }
            try await eventually("the remote side's calls through the forwarded socket", timeout: .seconds(60)) {
                ssh.stdout.contains("ready\n") || !ssh.process.isRunning
            }
            guard ssh.process.isRunning else {
                Issue.record("ssh exited (\(ssh.process.terminationStatus)): \(ssh.stdout) \(ssh.stderr.suffix(600)); sshd: \(sshd.log.suffix(600))")
                return
            }
            #expect(stat(remote, &info) == 0 && info.st_mode & S_IFMT == S_IFSOCK, "sshd's socket at the remote path")
            let results = Dictionary(ssh.stdout.split(separator: "\n").compactMap { line -> (String, String)? in
                let words = line.split(separator: " ")
                return words.count == 3 ? ("\(words[0]) \(words[1])", String(words[2])) : nil
            }, uniquingKeysWith: { first, _ in first })
            var expected: [String: String] = [:]
            for (who, uid) in [("root", "0"), ("999", "999")] {
                for (what, code) in [("token", "0"), ("other", "77"), ("logout", "77"), ("refresh", "77"), ("reload", "77"), ("status", "0"), ("uid", uid)] {
                    expected[who + " " + what] = code
                }
            }
            #expect(results == expected, "\(results); ssh: \(ssh.stderr.suffix(600))")
            #expect(try broker.status("private")?["state"] == "active", "the remote side logged nothing out")
            let main = try #require(try broker.call("GetToken", ["session": "private"]).parameters["token"]?.stringValue)
            for who in ["root", "999"] {
                let token = try String(contentsOfFile: "\(out)/token-\(who)", encoding: .utf8).trimmingCharacters(in: .newlines)
                #expect(fp(token) == fp(main), "the remote \(who)'s token is the delegated session's")
                let status = try String(contentsOfFile: "\(out)/status-\(who)", encoding: .utf8)
                #expect(status.contains("\"private\"") && !status.contains("\"api\""), "the remote \(who)'s Status shows the delegated session only")
            }

            // Undelegate with a connection held open through the forward (a Watch): the broker
            // closes it before undelegate returns, the ssh client sends the channel's end, sshd
            // closes the remote connection. A thread of its own notes when the remote end sees it,
            // on a descriptor of its own that it closes then (a connection left open on the remote
            // side after the close would hold the channel, and ssh, open).
            let watched: Int32
            do {
                let held = try VarlinkClient(address: VarlinkAddress(path: remote), timeout: 20)
                try held.send(VarlinkCall(method: "io.tokenbroker.Broker.Watch", parameters: ["session": "private"], more: true).encoded())
                #expect(try held.nextReply().parameters["event"] == "token")
                watched = dup(held.fileDescriptor)
            }
            let closed = Locked<ContinuousClock.Instant?>(nil)
            Thread {
                defer { close(watched) }
                var buffer = [UInt8](repeating: 0, count: 4096)
                let deadline = ContinuousClock.now + .seconds(30)
                while ContinuousClock.now < deadline {
                    var pending = pollfd(fd: watched, events: Int16(POLLIN), revents: 0)
                    let ready = poll(&pending, 1, 100)
                    if ready < 0 && errno != EINTR { return }
                    if ready <= 0 { continue }
                    let n = read(watched, &buffer, buffer.count)
                    if n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN) {
                        let now = ContinuousClock.now
                        closed.withLock { $0 = now }
                        return
                    }
                }
            }.start()
            let started = ContinuousClock.now
            let ended = try await broker.ctl(["undelegate", "remote"])
            let returned = ContinuousClock.now
            #expect(ended.code == 0, "\(ended.err)")
            try await eventually("the remote end of the held connection closed", timeout: .seconds(10)) { closed.value != nil }
            let at = try #require(closed.value)
            func ms(_ duration: Duration) -> String { String(format: "%.1f", duration / .milliseconds(1)) }
            // Measured from ctl's start, a bound on the time after its return (which Child sees
            // only within 5 ms).
            print("figure: undelegate → remote EOF: \(ms(started.duration(to: at))) ms after ctl undelegate started; its exit was seen at \(ms(started.duration(to: returned))) ms")
            #expect(access(delegation, F_OK) != 0, "the delegation's socket is gone")

            // sshd still listens at the remote path, but the ssh client finds no delegation to
            // connect to: the new connection is closed without an answer.
            #expect(throws: VarlinkClientError.self, "a new call through the forward fails") {
                _ = try VarlinkClient(address: VarlinkAddress(path: remote), timeout: 20).call("io.tokenbroker.Broker.GetToken", ["session": "private"])
            }
            #expect(try broker.status("private")?["state"] == "active")
            ssh.closeInput()
            #expect(await ssh.wait(timeout: 20) == 0, "\(ssh.stderr.suffix(600))")
            // sshd's processes for the connection end after ssh: stopped before, they would be
            // left to init.
            try await eventually("sshd's processes for the connection end") { sshd.connections == 0 }
        }
    }
}

/// Debian's `sshd` in the foreground on 127.0.0.1 at a free port, with its own configuration,
/// host key, authorized key (a client key made for it) and pid file in `directory`; root logs in
/// with the key. Stopped by `stop()` (and killed when dropped).
final class LoopbackSSHD: Sendable {
    static let sshd = "/usr/sbin/sshd"
    static let ssh = "/usr/bin/ssh"
    static let keygen = "/usr/bin/ssh-keygen"

    let directory: String
    let port: Int
    let child: Child
    var clientKey: String { directory + "/client_key" }
    var log: String { child.stderr }
    /// sshd's process id, from its pid file (written once it listens).
    var pid: pid_t? {
        (try? String(contentsOfFile: directory + "/sshd.pid", encoding: .utf8)).flatMap { pid_t($0.trimmingCharacters(in: .whitespacesAndNewlines)) }
    }
    /// How many processes sshd runs for connections (its children).
    var connections: Int {
        guard let pid, let children = try? String(contentsOfFile: "/proc/\(pid)/task/\(pid)/children", encoding: .utf8) else { return 0 }
        return children.split(separator: " ").count
    }

    init(directory: String) async throws {
        self.directory = directory
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700])
        // sshd's privilege separation directory (made by the package's service, which does not run here).
        if access("/run/sshd", F_OK) != 0 {
            try FileManager.default.createDirectory(atPath: "/run/sshd", withIntermediateDirectories: true, attributes: [.posixPermissions: 0o755])
        }
        for key in ["host_key", "client_key"] {
            let made = try await Child.run(Self.keygen, ["-q", "-t", "ed25519", "-N", "", "-C", "tokenbroker-test-" + key, "-f", directory + "/" + key])
            guard made.code == 0 else {
                Issue.record("ssh-keygen: \(made.stderr)")
                throw POSIXError(.EIO)
            }
        }
        try FileManager.default.copyItem(atPath: directory + "/client_key.pub", toPath: directory + "/authorized_keys")
        port = try EtcdCluster.freePort()
        // StrictModes no: the test's directory is under /tmp, which everyone may write, and sshd
        // refuses an authorized keys file there otherwise. StreamLocalBindMask 0111: the sockets
        // sshd binds for -R are 0666 (by default 0600, its user's only), so that uid 999 on the
        // remote side may connect too.
        let config = """
            ListenAddress 127.0.0.1:\(port)
            HostKey \(directory)/host_key
            PidFile \(directory)/sshd.pid
            AuthorizedKeysFile \(directory)/authorized_keys
            PermitRootLogin prohibit-password
            PubkeyAuthentication yes
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            UsePAM no
            StrictModes no
            AllowStreamLocalForwarding yes
            StreamLocalBindUnlink yes
            StreamLocalBindMask 0111
            PrintMotd no
            PrintLastLog no

            """
        try config.write(toFile: directory + "/sshd_config", atomically: true, encoding: .utf8)
        child = try Self.guarded(Self.sshd, ["-D", "-e", "-f", directory + "/sshd_config"], directory: directory)
        let (child, port) = (child, port)
        try await eventually("sshd listens on 127.0.0.1:\(port)") {
            child.stderr.contains("Server listening on 127.0.0.1 port \(port)") || !child.process.isRunning
        }
        guard child.process.isRunning else {
            Issue.record("sshd exited (\(child.process.terminationStatus)): \(child.stderr)")
            throw POSIXError(.ECHILD)
        }
    }

    /// `ssh` as root to this sshd with the client key, the known hosts in this sshd's directory,
    /// nothing from the machine's ssh configuration, never asking; `command` runs on the remote
    /// side, ssh's output files go to `output`, and its standard input is a pipe the test closes
    /// (`closeInput()`).
    func ssh(_ options: [String], command: String, output: String) throws -> Child {
        let common = ["-F", "none", "-T", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-o", "IdentitiesOnly=yes",
                      "-o", "StreamLocalBindUnlink=yes", "-o", "ExitOnForwardFailure=yes",
                      "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=\(directory)/known_hosts", "-i", clientKey, "-p", String(port)]
        return try Self.guarded(Self.ssh, common + options + ["root@127.0.0.1", command], directory: output, pipeInput: true)
    }

    /// Runs `executable` so that Foundation still sees when it ends. OpenSSH's programs close
    /// every descriptor they inherit when they start, the one Foundation's Process watches for a
    /// child's end among them: Foundation then waits for that child in a blocking waitpid, on
    /// the one thread that reports every child's end, and no other Child (a ctl the test awaits)
    /// is seen to end until sshd does. A shell keeps the descriptor and waits for the program,
    /// which gets SIGKILL when the shell ends (setpriv --pdeathsig): Child.kill() ends both. The
    /// shell hands its standard input on (an asynchronous command's would be /dev/null). A Child
    /// starts with the signal mask of the thread that spawned it, SIGCHLD and SIGTERM blocked
    /// among others, and dash's `wait` would never see its program end: env --default-signal
    /// unblocks every signal and sets each to its default.
    static func guarded(_ executable: String, _ arguments: [String], directory: String, pipeInput: Bool = false) throws -> Child {
        let wrapper = #"exec 3<&0; /usr/bin/setpriv --pdeathsig KILL -- "$@" <&3 3<&- & wait $!"#
        return try Child("/usr/bin/env", ["--default-signal", "/bin/sh", "-c", wrapper, "sh", executable] + arguments,
                         directory: directory, pipeInput: pipeInput)
    }

    /// SIGTERM to sshd, so that the shell that waits for it reaps it (killed with the shell, it
    /// would be left to init, which does not reap everywhere); after 5 s, SIGKILL to both.
    func stop() {
        if let pid { kill(pid, SIGTERM) }
        let deadline = ContinuousClock.now + .seconds(5)
        while child.process.isRunning && ContinuousClock.now < deadline { usleep(1000) }
        child.kill()
    }
}
