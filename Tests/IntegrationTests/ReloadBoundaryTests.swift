import DevIssuer
import Foundation
import SQLiteStore
import Testing
import TestSupport
import Varlink
import TokenBrokerCore

/// Reloads that replace coordinators, against the boundaries and the durability guarantees: the
/// real daemon, the development issuer in this process, interleavings held by the issuer (a
/// refresh parked until the test releases it) and by a really full filesystem.
@Suite("Reloads keep every boundary", .serialized)
struct ReloadBoundaryTests {
    /// Two OAuth sessions, `a` and `b`, with `RefreshAhead=` as given (changing it makes a
    /// reload replace their coordinators).
    static func config(_ issuer: DevIssuer, ahead: String, extra: String = "") -> String {
        ["a", "b"].map { name in
            """
            [Session]
            Name=\(name)
            TokenEndpoint=\(issuer.tokenEndpoint)
            ClientID=tokenbroker
            ClientSecretFile=@DIR@/client-secret
            RevokeOnLogout=no
            RefreshAhead=\(ahead)
            \(extra)

            """
        }.joined()
    }

    static func write(_ broker: Broker, _ text: String) throws {
        try text.replacingOccurrences(of: "@DIR@", with: broker.directory).write(toFile: broker.configPath, atomically: true, encoding: .utf8)
    }

    @Test("a logout acknowledged while a reload is waiting for another session's refresh is not undone by the reload")
    func logoutDuringReload() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        try await withBroker(config: "[Session]\nName=placeholder\nUpstream=test\n") { broker in
            try Self.write(broker, Self.config(issuer, ahead: "60s"))
            #expect(try await broker.ctl(["reload"]).code == 0)
            for name in ["a", "b"] {
                let login = try await broker.ctl(["login", name, "--refresh-token-stdin"], stdin: issuer.issueRefreshToken() + "\n")
                #expect(login.code == 0, "\(login.err)")
            }
            let before = try #require(try broker.call("GetToken", ["session": "a"]).parameters["token"]?.stringValue)
            // b's refresh is held at the issuer: a reload that changes b must wait for it to land.
            issuer.inject([.hold])
            let refresh = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "refresh", "b"], directory: broker.directory)
            try await eventually("b's refresh held at the issuer") { issuer.heldCount == 1 }
            try Self.write(broker, Self.config(issuer, ahead: "30s"))
            let reload = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "reload"], directory: broker.directory)
            try await eventually("the reload waiting for b") { broker.child.stderr.contains("session b: settings changed; waiting for its refresh in flight") }
            // Now, in the middle of the reload: log a out.
            let logout = try await broker.ctl(["logout", "a"])
            #expect(logout.code == 0, "\(logout.err)")
            issuer.releaseHeld()
            #expect(await reload.wait() == 0, "\(reload.stderr)")
            #expect(await refresh.wait() == 0)
            // The new coordinator of a must know about the logout.
            let after = try broker.call("GetToken", ["session": "a"])
            #expect(after.error == "io.tokenbroker.Broker.SignedOut", "served \(fp(after.parameters["token"])) (before: \(fp(before)))")
            #expect(try broker.status("a")?["state"] == "signedOut")
        }
    }

    @Test("a reload that replaces a degraded session carries its unwritten rotation over; it lands once the disk has room",
          .enabled(if: getuid() == 0, "needs root to mount a small tmpfs"))
    func degradedSessionAcrossReload() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        // A state directory on a tiny filesystem of its own, so that it can really fill up.
        let disk = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: disk) }
        // (The helpers' output files in a scratch directory of their own, removed after.)
        let scratch = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: scratch) }
        let mount = try Child("/bin/mount", ["-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", disk], directory: scratch)
        guard await mount.wait() == 0 else {
            Issue.record("cannot mount a tmpfs here: \(mount.stderr)")
            return
        }
        // (Detached at once, in this process: a helper process started in a defer was gone
        // with its value before it ran, and every run left its tmpfs mounted.)
        defer { _ = umount2(disk, Int32(MNT_DETACH)) }
        let broker = try await Broker(config: "[Session]\nName=placeholder\nUpstream=test\n", extraArguments: ["--state-dir", disk + "/state"])
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        do {
            try Self.write(broker, Self.config(issuer, ahead: "60s"))
            #expect(try await broker.ctl(["reload"]).code == 0)
            let login = try await broker.ctl(["login", "a", "--refresh-token-stdin"], stdin: issuer.issueRefreshToken() + "\n")
            #expect(login.code == 0, "\(login.err)")
            // Fill the filesystem, then refresh: the issuer rotates, the commit fails, the
            // session serves from memory (degraded) and holds the only copy of the new refresh token.
            let fill = try Child("/bin/sh", ["-c", "cat /dev/zero > \(disk)/filler 2>/dev/null; true"], directory: scratch)
            _ = await fill.wait()
            let refreshed = try await broker.ctl(["refresh", "a"])
            #expect(refreshed.code == 0, "\(refreshed.err)")
            try await eventually("a degraded") { try broker.status("a")?["degraded"] == true }
            // Replace a's coordinator.
            try Self.write(broker, Self.config(issuer, ahead: "30s"))
            #expect(try await broker.ctl(["reload"]).code == 0)
            #expect(try broker.status("a")?["degraded"] == true, "the pending write was dropped by the reload")
            // Room again: the pending write lands (the daemon retries it).
            try FileManager.default.removeItem(atPath: disk + "/filler")
            try await eventually("a written", timeout: .seconds(30)) { try broker.status("a")?["degraded"] == false }
            let stored = try #require(try await StateDatabase.open(disk + "/state").load("a"))
            let lineage = try #require(issuer.lineage(of: stored.refreshToken?.reveal ?? ""))
            #expect(lineage.index == 1 && lineage.newest == 1 && !lineage.revoked, "the stored refresh token is not the rotated one")
            // And the next refresh presents the newest token: no replay.
            #expect(try await broker.ctl(["refresh", "a"]).code == 0)
            #expect(issuer.counters.replays == 0)
        }
        _ = await broker.stop()
    }

    @Test("a watch ends with PermissionDenied as soon as a reload takes its peer off the allow list")
    func watchLosesPermission() async throws {
        let allowed = "[Broker]\nSocketMode=0666\n[Session]\nName=api\nUpstream=test\nAllowUsers=\(Broker.workerUID)\n"
        try await withBroker(config: allowed) { broker in
            let copy = broker.directory + "/tokenbroker-ctl"
            try FileManager.default.copyItem(atPath: Paths.tokenbroker, toPath: copy)
            chmod(copy, 0o755)
            let watcher = try Child("/usr/bin/setpriv", ["--reuid=\(Broker.workerUID)", "--regid=\(Broker.workerUID)", "--clear-groups",
                                                         copy, "ctl", "--socket", broker.socket, "watch", "api"], directory: broker.directory)
            defer { watcher.kill() }
            try await eventually("the watcher's first token") { watcher.stdout.contains("token #1") }
            try allowed.replacingOccurrences(of: "AllowUsers=\(Broker.workerUID)\n", with: "")
                .write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            #expect(try await broker.ctl(["reload"]).code == 0)
            #expect(await watcher.wait(timeout: 10) == 77)
            #expect(watcher.stderr.contains("permission denied"), "\(watcher.stderr)")
        }
    }
}
