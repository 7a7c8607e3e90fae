import Foundation
import Testing
import TestSupport
import Varlink
import WireJSON

/// Secret files (`ClientSecretFile=`, `StateKeyFile=`, `MetricsBearerTokenFile=`, `ClientKey=`,
/// `[Fleet] KeyFile=`) readable by every user are refused, by check-config and the daemon (at
/// start: exit 78; at a reload: the old configuration stays, and the reload says why); readable
/// by their group, they are warned about, naming the file and its mode.
@Suite("Secret files' modes", .serialized)
struct SecretFileTests {
    static let config = """
        [Session]
        Name=api
        TokenEndpoint=http://127.0.0.1:9/token
        ClientID=tokenbroker
        ClientSecretFile=@DIR@/client-secret

        [Session]
        Name=local
        Upstream=test

        """

    @Test("check-config: a secret file its group may read warns (exit 0), one every user may read is an error (exit 78), naming file and mode")
    func checkConfig() async throws {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let secret = directory + "/client-secret"
        try SecretFile.write("dev-secret\n", to: secret)
        try Self.config.replacingOccurrences(of: "@DIR@", with: directory).write(toFile: directory + "/tb.conf", atomically: true, encoding: .utf8)
        let check = { try await Child.run(Paths.tokenbroker, ["check-config", "--config", directory + "/tb.conf"]) }
        let clean = try await check()
        #expect(clean.code == 0 && clean.stderr.isEmpty, "\(clean.stderr)")
        chmod(secret, 0o640)
        let warned = try await check()
        #expect(warned.code == 0 && warned.stdout.contains("OK, 2 session(s)"))
        #expect(warned.stderr.hasPrefix("warning: \(directory)/tb.conf:5: ClientSecretFile=: \(secret) is readable by group "), "\(warned.stderr)")
        #expect(warned.stderr.contains("(mode 0640): every member can read the secret"))
        chmod(secret, 0o644)
        let refused = try await check()
        #expect(refused.code == 78 && refused.stdout.isEmpty)
        #expect(refused.stderr == "Error: \(directory)/tb.conf:5: ClientSecretFile=: \(secret) is readable by every user (mode 0644): "
                + "refusing a secret in it; make it readable by its owner only (chmod 600 \(secret))\n", "\(refused.stderr)")
        #expect(!refused.stderr.contains("dev-secret") && !warned.stderr.contains("dev-secret"))
    }

    @Test("the daemon: a world-readable secret file at start is exit 78; group-readable warns; a reload to world-readable keeps the old configuration and says why")
    func daemon() async throws {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let secret = directory + "/client-secret"
        // (The broker writes the secret 0600; the first daemon is started by hand, on 0644.)
        let first = try await Broker(config: Self.config, reusing: directory)
        #expect(await first.stop() == 0)
        chmod(secret, 0o644)
        let refused = try Child(Paths.tokenbroker, ["serve", "--config", first.configPath, "--socket", first.socket, "--state-dir", directory + "/state"],
                                directory: directory)
        #expect(await refused.wait() == 78)
        #expect(refused.stderr.contains("configuration error: \(first.configPath):5: ClientSecretFile=: \(secret) is readable by every user (mode 0644)"),
                "\(refused.stderr)")

        chmod(secret, 0o640)
        let daemon = try Child(Paths.tokenbroker, ["serve", "--config", first.configPath, "--socket", first.socket, "--state-dir", directory + "/state"],
                               directory: directory)
        defer { daemon.terminate() }
        try await waitForSocket(first.socket, server: daemon)
        #expect(daemon.stderr.contains("<4>\(first.configPath):5: ClientSecretFile=: \(secret) is readable by group "), "\(daemon.stderr)")
        #expect(daemon.stderr.contains("(mode 0640): every member can read the secret"))
        let broker = first
        #expect(try await broker.ctl(["reload"]) == (0, "reloaded\n", ""))
        try await eventually("the reload's warning") {
            daemon.stderr.components(separatedBy: "ClientSecretFile=: \(secret) is readable by group ").count == 3
        }

        chmod(secret, 0o604)
        let reload = try await broker.ctl(["reload"])
        #expect(reload.code == 78 && reload.err.contains("ClientSecretFile=: \(secret) is readable by every user (mode 0604)"), "\(reload.err)")
        #expect(try broker.call("GetToken", ["session": "local"]).error == nil, "the old configuration is not served")
        #expect(try broker.status("api") != nil)
        #expect(!daemon.stderr.contains("dev-secret"))
    }
}
