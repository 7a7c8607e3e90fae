import DevIssuer
import Foundation
import Testing
import TestSupport
import Varlink
import SQLiteStore
import TokenBrokerCore

/// State across restarts of the real daemon, with its SQLite store.
@Suite("Durable state", .serialized)
struct PersistenceTests {
    static func config(_ issuer: DevIssuer, sessions: [String] = ["api"]) -> String {
        sessions.map { Broker.oauthSession(issuer.tokenEndpoint, name: $0) }.joined()
    }

    /// Restarts `broker`'s daemon on the same configuration, socket and state.
    static func restart(_ broker: Broker) async throws -> Child {
        let daemon = try Child(Paths.tokenbroker, ["serve", "--config", broker.configPath, "--socket", broker.socket,
                                                   "--state-dir", broker.directory + "/state"], directory: broker.directory)
        try await waitForSocket(broker.socket)
        return daemon
    }

    @Test("a restart keeps the session: same generation, same token, no new refresh")
    func restartKeepsSession() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let broker = try await Broker(config: Self.config(issuer))
        #expect(try broker.call("Login", ["session": "api", "refreshToken": .string(issuer.issueRefreshToken())]).error == nil)
        let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"])
        #expect(await broker.stop() == 0)

        let daemon = try await Self.restart(broker)
        defer { daemon.terminate() }
        let again = try broker.call("GetToken", ["session": "api"])
        #expect(fp(again.parameters["token"]) == fp(token) && again.parameters["generation"] == 1)
        #expect(issuer.counters.refreshGrants == 1)
        #expect(daemon.stderr.contains("session api: restored active at generation 1, token #1"))
        // Logout is durable too.
        #expect(try broker.call("Logout", ["session": "api"]) == VarlinkReply())
        daemon.terminate()
        _ = await daemon.wait()
        let third = try await Self.restart(broker)
        defer { third.terminate() }
        #expect(try broker.call("GetToken", ["session": "api"]) == .error("io.tokenbroker.Broker.SignedOut", ["session": "api"]))
        #expect(try broker.status("api")?["generation"] == 2)
    }

    @Test("a session the configuration drops stays inert until forgotten")
    func inertAndForget() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let broker = try await Broker(config: Self.config(issuer, sessions: ["api", "old"]))
        #expect(try broker.call("Login", ["session": "old", "refreshToken": .string(issuer.issueRefreshToken())]).error == nil)
        #expect(await broker.stop() == 0)
        try Self.config(issuer, sessions: ["api"]).replacingOccurrences(of: "@DIR@", with: broker.directory)
            .write(toFile: broker.configPath, atomically: true, encoding: .utf8)
        let daemon = try await Self.restart(broker)
        defer { daemon.terminate() }

        let old = try #require(try broker.status("old"))
        #expect(old["inert"] == true && old["state"] == "active" && old["generation"] == 1)
        #expect(try broker.call("GetToken", ["session": "old"]).error == "io.tokenbroker.Broker.NoSuchSession")
        #expect(try broker.call("Forget", ["session": "api"]) == .error("io.tokenbroker.Broker.SessionConfigured", ["session": "api"]))
        let forgotten = try await broker.ctl(["forget", "old"])
        #expect(forgotten.code == 0 && forgotten.out == "forgot old\n")
        #expect(try broker.status("old") == nil)
        #expect(try broker.call("Forget", ["session": "old"]).error == "io.tokenbroker.Broker.NoSuchSession")
    }

    @Test("a reload that changes a session's settings during its refresh keeps the rotated token")
    func reloadDuringRefresh() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        try await withBroker(config: Self.config(issuer)) { broker in
            #expect(try broker.call("Login", ["session": "api", "refreshToken": .string(issuer.issueRefreshToken())]).error == nil)
            issuer.inject([.hold])
            let caller = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "token", "api"], directory: broker.directory)
            try await eventually("the refresh held at the issuer") { issuer.heldCount == 1 }
            // New refresh settings: the session gets a new coordinator once the old one's flight lands.
            try (Self.config(issuer) + "RefreshAhead=2min\n").replacingOccurrences(of: "@DIR@", with: broker.directory)
                .write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            let reload = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "reload"], directory: broker.directory)
            try await eventually("the reload waiting for the flight") { broker.child.stderr.contains("waiting for its refresh in flight") }
            issuer.releaseHeld()
            #expect(await reload.wait() == 0)
            #expect(await caller.wait() == 0)
            // The new coordinator continues from the rotated token: the next refresh is no replay.
            let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"])
            let refreshed = try broker.call("Recover", ["session": "api", "rejected": token])
            #expect(refreshed.error == nil && issuer.counters.replays == 0, "\(refreshed)")
        }
    }

    @Test("with StateKeyFile= the database holds no token in clear; a restart reads it back; a bad key is a configuration error")
    func encryptedState() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let directory = try Paths.temporaryDirectory()
        try SecretFile.write(String(repeating: "0123456789abcdef", count: 4), to: directory + "/state.key")
        let config = "[Broker]\nStateKeyFile=\(directory)/state.key\n" + Self.config(issuer)
        let broker = try await Broker(config: config)
        let refreshToken = issuer.issueRefreshToken()
        #expect(try broker.call("Login", ["session": "api", "refreshToken": .string(refreshToken)]).error == nil)
        let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
        #expect(await broker.stop() == 0)
        #expect(broker.child.stderr.contains("(tokens encrypted)"))
        for suffix in ["", "-wal"] {
            let data = FileManager.default.contents(atPath: broker.directory + "/state/state.db" + suffix) ?? Data()
            let inClear = data.range(of: Data(token.utf8)) != nil || data.range(of: Data("dev-rt.".utf8)) != nil
            #expect(!inClear, "a token in clear in state.db\(suffix)")
        }
        let daemon = try await Self.restart(broker)
        defer { daemon.terminate() }
        #expect(fp(try broker.call("GetToken", ["session": "api"]).parameters["token"]) == fp(token))

        try "[Broker]\nStateKeyFile=\(directory)/state.key\n".write(toFile: directory + "/bad.conf", atomically: true, encoding: .utf8)
        try SecretFile.write("too short", to: directory + "/state.key")
        let check = try Child(Paths.tokenbroker, ["check-config", "--config", directory + "/bad.conf"], directory: directory)
        #expect(await check.wait() == 78)
        #expect(check.stderr.contains("bad.conf:2: StateKeyFile=: the key must be 32 bytes or 64 hexadecimal digits"))
    }

    @Test("one daemon per state directory: a second one refuses to start before it touches the database (no re-encryption under the first)")
    func oneDaemonPerState() async throws {
        try await withBroker { broker in
            #expect(try broker.call("GetToken", ["session": "api"]).error == nil)   // a token stored, sealed under state/state.key
            // The second daemon has another state key: opening the database would seal it again under that one.
            try SecretFile.write(String(repeating: "ab", count: 32), to: broker.directory + "/state.key")
            try (Broker.defaultConfig + "[Broker]\nStateKeyFile=\(broker.directory)/state.key\n")
                .write(toFile: broker.directory + "/keyed.conf", atomically: true, encoding: .utf8)
            let second = try Child(Paths.tokenbroker, ["serve", "--config", broker.directory + "/keyed.conf",
                                                       "--socket", broker.directory + "/other.sock", "--state-dir", broker.directory + "/state"],
                                   directory: broker.directory)
            #expect(await second.wait() == 1)
            #expect(second.stderr.contains("another tokenbroker is using \(broker.directory)/state"))
            // A copy of the state still opens under the first daemon's key.
            let copy = try Paths.temporaryDirectory()
            for name in try FileManager.default.contentsOfDirectory(atPath: broker.directory + "/state")
            where name.hasPrefix("state.db") || name == "state.key" {
                try FileManager.default.copyItem(atPath: broker.directory + "/state/" + name, toPath: copy + "/" + name)
            }
            let kept = try await StateDatabase.open(copy).load("api")
            #expect(kept?.accessToken != nil, "the second daemon rewrote the first one's database")
            #expect(try broker.call("GetToken", ["session": "api"]).error == nil)
        }
    }

    @Test("a corrupt state database is reported and moved aside; the daemon starts")
    func corruptDatabase() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let directory = try Paths.temporaryDirectory()
        try FileManager.default.createDirectory(atPath: directory + "/state", withIntermediateDirectories: true)
        try Data(repeating: 0x42, count: 4096).write(to: URL(fileURLWithPath: directory + "/state/state.db"))
        try SecretFile.write("dev-secret\n", to: directory + "/client-secret")
        try Self.config(issuer).replacingOccurrences(of: "@DIR@", with: directory)
            .write(toFile: directory + "/tokenbroker.conf", atomically: true, encoding: .utf8)
        let daemon = try Child(Paths.tokenbroker, ["serve", "--config", directory + "/tokenbroker.conf", "--socket", directory + "/s.sock",
                                                   "--state-dir", directory + "/state"], directory: directory)
        defer { daemon.terminate() }
        try await waitForSocket(directory + "/s.sock")
        #expect(daemon.stderr.contains("<3>the state database \(directory)/state/state.db was unreadable and has been moved aside to"))
        let moved = try FileManager.default.contentsOfDirectory(atPath: directory + "/state").filter { $0.hasPrefix("state.db.corrupt-") }
        #expect(moved.count == 1)
    }
}
