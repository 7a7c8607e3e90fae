import Foundation
import Sealing
import SQLiteStore
import Testing
import TestSupport
import TokenBrokerCore
import Varlink
import WireJSON

/// The state database is sealed with no key configured: under the package's systemd credential,
/// else a key file the daemon makes in its state directory at the first start. A key that was
/// used is never replaced: a sealed database whose key is gone or another is refused (exit 78).
@Suite("The state key", .serialized)
struct StateKeyTests {
    /// The daemon of `broker` again, on its configuration (or `config`), socket and state.
    static func serve(_ broker: Broker, config: String? = nil, environment: [String: String]? = nil) throws -> Child {
        var path = broker.configPath
        if let config {
            path = broker.directory + "/other.conf"
            try config.replacingOccurrences(of: "@DIR@", with: broker.directory).write(toFile: path, atomically: true, encoding: .utf8)
        }
        return try Child(Paths.tokenbroker, ["serve", "--config", path, "--socket", broker.socket, "--state-dir", broker.directory + "/state"],
                         environment: environment, directory: broker.directory)
    }

    /// Whether a token or the test upstream's token prefix is in a state.db file.
    static func inClear(_ state: String, _ tokens: [String]) -> Bool {
        ["", "-wal"].contains { suffix in
            let data = FileManager.default.contents(atPath: state + "/state.db" + suffix) ?? Data()
            return (tokens + ["tbtest."]).contains { data.range(of: Data($0.utf8)) != nil }
        }
    }

    static func mode(_ path: String) throws -> Int {
        try #require(try FileManager.default.attributesOfItem(atPath: path)[.posixPermissions] as? Int)
    }

    /// A broker that stored a token and stopped; its state directory holds state.db (and state.key).
    static func stoppedBroker(_ config: String = Broker.defaultConfig) async throws -> (broker: Broker, token: String) {
        let broker = try await Broker(config: config)
        let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
        #expect(await broker.stop() == 0)
        return (broker, token)
    }

    @Test("with no key configured, a fresh daemon makes state.key (0600, 64 hex digits) and seals the database under it; a restart reads it back and keeps the key")
    func sealedByDefault() async throws {
        let (broker, token) = try await Self.stoppedBroker()
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        let state = broker.directory + "/state"
        let key = try String(contentsOfFile: state + "/state.key", encoding: .utf8)
        #expect(try Self.mode(state + "/state.key") == 0o600)
        #expect(key.count == 65 && key.hasSuffix("\n") && key.dropLast().allSatisfy(\.isHexDigit), "not 64 hex digits and a newline")
        #expect(broker.child.stderr.contains("made a new state key, \(state)/state.key (mode 0600)"))
        #expect(broker.child.stderr.contains("(tokens encrypted), state key: \(state)/state.key"))
        #expect(!Self.inClear(state, [token]), "a token in clear in the state database")
        #expect(try SQLiteSessionStore.holdsSealedValues(directory: state))
        #expect(!FileManager.default.fileExists(atPath: state + "/.state.key.new"))

        let again = try Self.serve(broker)
        try await waitForSocket(broker.socket, server: again)
        #expect(fp(try broker.call("GetToken", ["session": "api"]).parameters["token"]) == fp(token))
        again.terminate()
        #expect(await again.wait() == 0)
        #expect(!again.stderr.contains("made a new state key"))
        #expect(fp(try String(contentsOfFile: state + "/state.key", encoding: .utf8)) == fp(key), "the key file changed")
    }

    @Test("a database an older version wrote in clear is sealed at the first start: its sessions kept, no clear token left in the files")
    func clearDatabaseMigrated() async throws {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let old = SessionRecord(name: "api", generation: 4, state: .active, refreshToken: Secret("old-refresh-PLAIN"),
                                accessToken: Secret("old-access-PLAIN"), expiresAt: 4_000_000_000, tokenSerial: 9)
        do {
            let store = try SQLiteSessionStore(directory: directory + "/state")
            #expect(try await store.write(StoreWrite(old, guardedBy: .newerGeneration)))
        }
        #expect(Self.inClear(directory + "/state", ["PLAIN"]))
        let broker = try await Broker(reusing: directory)
        let served = try broker.call("GetToken", ["session": "api"])
        #expect(fp(served.parameters["token"]) == fp("old-access-PLAIN") && served.parameters["generation"] == 4)
        #expect(await broker.stop() == 0)
        #expect(broker.child.stderr.contains("sealed the tokens of 1 session(s) stored in clear"))
        #expect(!Self.inClear(directory + "/state", ["PLAIN"]), "a clear token left in state.db or its WAL")
        #expect(try await StateDatabase.open(directory + "/state").load("api")?.refreshToken == Secret("old-refresh-PLAIN"))
    }

    @Test("a sealed database whose key is gone is refused (exit 78, saying where keys are looked for); no new key is made")
    func keyGone() async throws {
        let (broker, _) = try await Self.stoppedBroker()
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        let state = broker.directory + "/state"
        try FileManager.default.removeItem(atPath: state + "/state.key")
        let before = try Data(contentsOf: URL(fileURLWithPath: state + "/state.db"))
        for environment in [nil, ["CREDENTIALS_DIRECTORY": broker.directory]] {
            let refused = try Self.serve(broker, environment: environment)
            #expect(await refused.wait() == 78)
            #expect(refused.stderr.contains("the state database \(state)/state.db is sealed, but no state key was found"), "\(refused.stderr)")
            #expect(refused.stderr.contains("no new key is made over a sealed database"))
            #expect(!FileManager.default.fileExists(atPath: state + "/state.key"), "a new key was made")
        }
        #expect(try Data(contentsOf: URL(fileURLWithPath: state + "/state.db")) == before, "the database was touched")
    }

    @Test("a sealed database under another key is refused (exit 78); the key file is left as it is")
    func wrongKey() async throws {
        let (broker, _) = try await Self.stoppedBroker()
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        let state = broker.directory + "/state"
        let other = String(repeating: "5a", count: 32) + "\n"
        try FileManager.default.removeItem(atPath: state + "/state.key")
        try SecretFile.write(other, to: state + "/state.key")
        let refused = try Self.serve(broker)
        #expect(await refused.wait() == 78)
        #expect(refused.stderr.contains("the state database \(state)/state.db is sealed under another state key: session api does not decrypt "
                                        + "under the key in force (\(state)/state.key)"), "\(refused.stderr)")
        #expect(try String(contentsOfFile: state + "/state.key", encoding: .utf8) == other)
        #expect(!refused.stderr.contains(other.dropLast()), "the key in the log")
    }

    @Test("an operator's StateKeyFile= wins: a database sealed under the default key is sealed again under it; the default key then opens nothing")
    func operatorKeyWins() async throws {
        let (broker, token) = try await Self.stoppedBroker()
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        let state = broker.directory + "/state"
        let operatorKey = String(repeating: "c3", count: 32)
        try SecretFile.write(operatorKey, to: broker.directory + "/operator.key")
        let keyed = try Self.serve(broker, config: Broker.defaultConfig + "[Broker]\nStateKeyFile=@DIR@/operator.key\n")
        try await waitForSocket(broker.socket, server: keyed)
        #expect(fp(try broker.call("GetToken", ["session": "api"]).parameters["token"]) == fp(token))
        keyed.terminate()
        #expect(await keyed.wait() == 0)
        #expect(keyed.stderr.contains("the state database was sealed under \(state)/state.key; sealed again under StateKeyFile=/StateKeyCredential="),
                "\(keyed.stderr)")
        #expect(keyed.stderr.contains("state key: StateKeyFile=/StateKeyCredential="))
        #expect(!Self.inClear(state, [token]))
        #expect(throws: WrongStateKey.self) { try StateDatabase.open(state) }
        let store = try SQLiteSessionStore(directory: state, cipher: try TokenCipher(keyMaterial: Array(operatorKey.utf8)))
        #expect(fp(try await store.load("api")?.accessToken?.reveal) == fp(token))
    }

    @Test("the package's credential in $CREDENTIALS_DIRECTORY is the key where no operator's is set: no key file is made; a malformed one is refused")
    func credentialKey() async throws {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let credentials = directory + "/credentials"
        try FileManager.default.createDirectory(atPath: credentials, withIntermediateDirectories: true)
        let key = String(repeating: "e7", count: 32)
        try SecretFile.write(key, to: credentials + "/tokenbroker.default-state-key")
        let broker = try await Broker(environment: ["CREDENTIALS_DIRECTORY": credentials], reusing: directory)
        let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
        #expect(await broker.stop() == 0)
        #expect(broker.child.stderr.contains("state key: the systemd credential \(credentials)/tokenbroker.default-state-key"))
        #expect(!FileManager.default.fileExists(atPath: directory + "/state/state.key"), "a key file made beside the credential")
        let store = try SQLiteSessionStore(directory: directory + "/state", cipher: try TokenCipher(keyMaterial: Array(key.utf8)))
        #expect(fp(try await store.load("api")?.accessToken?.reveal) == fp(token))

        try SecretFile.write("not a key", to: credentials + "/tokenbroker.default-state-key")
        let refused = try Self.serve(broker, environment: ["CREDENTIALS_DIRECTORY": credentials])
        #expect(await refused.wait() == 78)
        #expect(refused.stderr.contains("the state key in \(credentials)/tokenbroker.default-state-key: the key must be 32 bytes or 64 hexadecimal digits"),
                "\(refused.stderr)")
    }

    @Test("state.key must be the daemon's own file: a symbolic link, one every user may read, another user's, or one that cannot be read is refused (78); one its group may read warns")
    func keyFileChecks() async throws {
        let (broker, _) = try await Self.stoppedBroker()
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        let state = broker.directory + "/state"
        let path = state + "/state.key"
        try FileManager.default.moveItem(atPath: path, toPath: broker.directory + "/saved.key")
        func refusedWith(_ message: String) async throws {
            let refused = try Self.serve(broker)
            #expect(await refused.wait() == 78, "\(message)")
            #expect(refused.stderr.contains(message), "\(refused.stderr)")
        }
        try FileManager.default.createSymbolicLink(atPath: path, withDestinationPath: broker.directory + "/saved.key")
        try await refusedWith("the state key file \(path) is a symbolic link; refusing to follow it")
        try FileManager.default.removeItem(atPath: path)
        try FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: false)
        try await refusedWith("cannot read the state key file: ")
        try FileManager.default.removeItem(atPath: path)
        try FileManager.default.copyItem(atPath: broker.directory + "/saved.key", toPath: path)
        chmod(path, 0o644)
        try await refusedWith("the state key file \(path) is readable by every user (mode 0644): refusing a secret in it")
        chmod(path, 0o600)
        chown(path, Broker.workerUID, Broker.workerUID)
        try await refusedWith("the state key file \(path) belongs to uid \(Broker.workerUID), not to the daemon's user")
        chown(path, geteuid(), getegid())
        chmod(path, 0o640)
        let warned = try Self.serve(broker)
        try await waitForSocket(broker.socket, server: warned)
        #expect(try broker.call("GetToken", ["session": "api"]).error == nil)
        warned.terminate()
        #expect(await warned.wait() == 0)
        #expect(warned.stderr.contains("<4>the state key file \(path) is readable by "), "\(warned.stderr)")
        #expect(warned.stderr.contains("(mode 0640)"))
    }

    @Test("development mode with a state directory seals its database under a key file there too")
    func developmentMode() async throws {
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let server = try Child(Paths.tokenbroker, ["serve", "--dev", "--socket", directory + "/dev.sock", "--state-dir", directory + "/state"],
                               directory: directory)
        try await waitForSocket(directory + "/dev.sock", server: server)
        let token = try await Child.run(Paths.tokenbroker, ["ctl", "--socket", directory + "/dev.sock", "token", "demo"])
        #expect(token.code == 0)
        kill(server.process.processIdentifier, SIGTERM)
        #expect(await server.wait() == 0)
        #expect(try Self.mode(directory + "/state/state.key") == 0o600)
        #expect(!Self.inClear(directory + "/state", [token.stdout.trimmingCharacters(in: .whitespacesAndNewlines), "dev-rt.", "dev-at."]))
        #expect(try SQLiteSessionStore.holdsSealedValues(directory: directory + "/state"))
    }
}
