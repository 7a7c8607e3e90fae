import Foundation
import Testing
import TestSupport
import Varlink

/// The real `tokenbroker serve` on a temporary socket with a temporary configuration.
final class Broker: @unchecked Sendable {
    // @unchecked: the fields are set once in init; `child` is only signalled and awaited.
    let directory: String
    let socket: String
    let configPath: String
    let child: Child

    /// A worker's uid for the permission tests: an ordinary id with no passwd entry (never the
    /// overflow id 65534, which stands for any unmapped peer and matches no allow list).
    static let workerUID: UInt32 = 61042
    /// The bearer token in `@DIR@/metrics-token` (`MetricsBearerTokenFile=`), a test value.
    static let metricsToken = "metrics-test-bearer-0123456789abcdef"

    static let defaultConfig = """
        [Broker]
        SocketMode=0666

        [Session]
        Name=api
        Upstream=test
        AllowUsers=\(workerUID)

        [Session]
        Name=private
        Upstream=test

        """

    /// - Parameter reusing: the directory of an earlier broker (stopped or killed), whose state
    ///   this one takes over; by default a new one.
    init(config: String = Broker.defaultConfig, extraArguments: [String] = [], environment: [String: String]? = nil,
         waitForSocket wait: Bool = true, reusing: String? = nil) async throws {
        directory = try reusing ?? Paths.temporaryDirectory()
        chmod(directory, 0o755)   // other users (the permission tests) must reach the socket
        socket = directory + "/broker.sock"
        configPath = directory + "/tokenbroker.conf"
        // `@DIR@` in the configuration stands for this broker's directory (for secret files).
        try SecretFile.write("dev-secret\n", to: directory + "/client-secret")
        try SecretFile.write(Broker.metricsToken + "\n", to: directory + "/metrics-token")
        try config.replacingOccurrences(of: "@DIR@", with: directory).write(toFile: configPath, atomically: true, encoding: .utf8)
        child = try Child(Paths.tokenbroker, ["serve", "--config", configPath, "--socket", socket, "--state-dir", directory + "/state"]
                          + extraArguments, environment: environment, directory: directory)
        if wait { try await waitForSocket(socket, server: child) }
    }

    /// A `[Session]` using the development issuer's token endpoint, with the client secret in
    /// the broker's directory.
    static func oauthSession(_ tokenEndpoint: String, name: String = "api") -> String {
        """
        [Session]
        Name=\(name)
        TokenEndpoint=\(tokenEndpoint)
        ClientID=tokenbroker
        ClientSecretFile=@DIR@/client-secret

        """
    }

    /// A daemon with one OAuth session, `api`, logged in at the issuer (a fresh refresh token).
    static func loggedIn(tokenEndpoint: String, refreshToken: String, environment: [String: String]? = nil) async throws -> Broker {
        let broker = try await Broker(config: oauthSession(tokenEndpoint), environment: environment)
        let reply = try broker.call("Login", ["session": "api", "refreshToken": .string(refreshToken)])
        #expect(reply.error == nil, "login: \(reply)")
        return broker
    }

    var address: VarlinkAddress { VarlinkAddress(path: socket) }

    func client(timeout: Double = 20) throws -> VarlinkClient { try VarlinkClient(address: address, timeout: timeout) }

    /// Calls `io.tokenbroker.Broker.<method>` on a new connection.
    func call(_ method: String, _ parameters: JSONObject = [:]) throws -> VarlinkReply {
        try client().call("io.tokenbroker.Broker." + method, parameters)
    }

    /// The Status entry of `session`.
    func status(_ session: String) throws -> JSONObject? {
        try call("Status").parameters["sessions"]?.arrayValue?.compactMap(\.objectValue).first { $0["name"] == .string(session) }
    }

    /// Runs `tokenbroker ctl --socket … <arguments>`, optionally as another user via setpriv.
    func ctl(_ arguments: [String], asUser uid: UInt32? = nil, stdin: String? = nil) async throws -> (code: Int32, out: String, err: String) {
        var executable = Paths.tokenbroker
        var argv = ["ctl", "--socket", socket] + arguments
        if let uid {
            // The build directory may sit under a home only root can enter: run a copy.
            let copy = directory + "/tokenbroker-ctl"
            if !FileManager.default.fileExists(atPath: copy) {
                try FileManager.default.copyItem(atPath: executable, toPath: copy)
                chmod(copy, 0o755)
            }
            argv = ["--reuid=\(uid)", "--regid=\(uid)", "--clear-groups", copy] + argv
            executable = "/usr/bin/setpriv"
        }
        let run = try Child(executable, argv, directory: directory, stdin: stdin)
        let code = await run.wait()
        return (code, run.stdout, run.stderr)
    }

    func stop() async -> Int32 {
        child.terminate()
        return await child.wait()
    }
}

/// Runs `body` with a broker and always stops it (SIGTERM, then waits for the exit).
func withBroker(config: String = Broker.defaultConfig, _ body: (Broker) async throws -> Void) async throws {
    let broker = try await Broker(config: config)
    defer { try? FileManager.default.removeItem(atPath: broker.directory) }
    do {
        try await body(broker)
    } catch {
        _ = await broker.stop()
        throw error
    }
    _ = await broker.stop()
}
