import DevIssuer
import Foundation
import SQLiteStore
import Synchronization
import Testing
import TestSupport
import TokenBrokerCore
import Varlink

/// Kills the real daemon with SIGKILL at random points while it refreshes against the
/// development issuer, restarts it, and checks every time that nothing was lost. Every other
/// refresh is a derived session's (`Derivation=refresh`), which rotates the parent's refresh
/// token in the parent's lineage: that rotation must be as durable as the parent's own.
///
/// After each kill the test reads the state database and asks the issuer where the stored
/// refresh token stands in its family:
/// - the newest one: the session continues (the next refresh must succeed);
/// - the one before the newest: the issuer answered a refresh the daemon died before
///   committing (the death window). The next refresh is then a replay, which the issuer
///   punishes by revoking the family; the test counts these and logs in again;
/// - anything else: a session was lost, which fails the test.
/// Some iterations log out instead and kill right after the acknowledgement: the restarted
/// daemon must still be signed out.
///
/// Iterations: `TB_CRASH_ITERATIONS` (default 300); the random seed is printed and can be
/// fixed with `TB_CRASH_SEED`.
@Suite("Crash safety", .serialized)
struct CrashTests {
    @Test("SIGKILL during refreshes and after logouts, then restart: nothing lost, no logout undone")
    func killAndRestart() async throws {
        let environment = ProcessInfo.processInfo.environment
        let iterations = environment["TB_CRASH_ITERATIONS"].flatMap(Int.init) ?? 300
        let seed = environment["TB_CRASH_SEED"].flatMap(UInt64.init) ?? UInt64.random(in: 1...UInt64.max)
        print("crash test: \(iterations) iterations, TB_CRASH_SEED=\(seed)")
        var random = SeededRandom(seed: seed)

        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let socket = directory + "/crash.sock"
        let stateDirectory = directory + "/state"
        try SecretFile.write("dev-secret\n", to: directory + "/secret")
        try """
            [Session]
            Name=api
            TokenEndpoint=\(issuer.tokenEndpoint)
            ClientID=tokenbroker
            ClientSecretFile=\(directory)/secret
            RefreshLimitBurst=10000
            RefreshLimitInterval=1s

            [Session]
            Name=derived
            DerivedFrom=api
            Derivation=refresh
            Resource=https://derived.example/api
            RefreshLimitBurst=10000
            RefreshLimitInterval=1s
            """.write(toFile: directory + "/tokenbroker.conf", atomically: true, encoding: .utf8)
        let arguments = ["serve", "--config", directory + "/tokenbroker.conf", "--socket", socket, "--state-dir", stateDirectory,
                         "--log-level", "warning"]
        let address = VarlinkAddress(path: socket)

        func start() async throws -> Child {
            let daemon = try Child(Paths.tokenbroker, arguments, directory: directory)
            try await waitForSocket(socket)
            return daemon
        }
        func call(_ method: String, _ parameters: JSONObject) throws -> VarlinkReply {
            try VarlinkClient(address: address, timeout: 20).call("io.tokenbroker.Broker." + method, parameters)
        }
        func login() throws {
            let reply = try call("Login", ["session": "api", "refreshToken": .string(issuer.issueRefreshToken())])
            #expect(reply.error == nil, "login: \(reply.error ?? "")")
        }
        func stored() async throws -> SessionRecord? {
            try await StateDatabase.open(stateDirectory).load("api")
        }

        var deathWindow = 0
        var continued = 0
        var logoutsKept = 0
        var lost = 0
        var expectSignedOut = false

        var daemon = try await start()
        try login()
        for iteration in 0..<iterations {
            // Let the daemon run: either a stream of refreshes, or a logout.
            if random.next() % 100 < 15 {
                #expect(try call("Logout", ["session": "api"]) == VarlinkReply())
                expectSignedOut = true
                kill(daemon.process.processIdentifier, SIGKILL)
            } else {
                // The refresher blocks on its socket, so it gets a thread of its own rather
                // than one of the cooperative pool's.
                let finished = Atomic<Bool>(false)
                let refresher = Thread {
                    // Each round: the current token, rejected, forces one refresh. It ends when
                    // the daemon dies under it.
                    // Every other round is the derived session's: a derivation, which redeems and
                    // rotates the parent's refresh token in the parent's lineage.
                    if let client = try? VarlinkClient(address: address, timeout: 20) {
                        var round = 0
                        while case let session: JSON = round % 2 == 0 ? "api" : "derived",
                              let token = try? client.call("io.tokenbroker.Broker.GetToken", ["session": session]).parameters["token"],
                              let reply = try? client.call("io.tokenbroker.Broker.Recover", ["session": session, "rejected": token]),
                              reply.error == nil { round += 1 }
                    }
                    finished.store(true, ordering: .releasing)
                }
                refresher.start()
                try await Task.sleep(for: .microseconds(Int(random.next() % 30_000)))
                kill(daemon.process.processIdentifier, SIGKILL)
                try await eventually("the refresher to notice") { finished.load(ordering: .acquiring) }
            }
            #expect(await daemon.wait() != 0)

            // The daemon is dead: what did it leave on disk?
            let record = try #require(try await stored(), "iteration \(iteration): no stored session")
            daemon = try await start()
            if expectSignedOut {
                expectSignedOut = false
                #expect(record.state == .signedOut && record.refreshToken == nil, "iteration \(iteration): a logout was undone on disk")
                #expect(try call("GetToken", ["session": "api"]).error == "io.tokenbroker.Broker.SignedOut",
                        "iteration \(iteration): a logout was undone after restart")
                logoutsKept += 1
                try login()
                continue
            }
            guard let refreshToken = record.refreshToken?.reveal, let lineage = issuer.lineage(of: refreshToken) else {
                Issue.record("iteration \(iteration): the stored session has no refresh token the issuer knows")
                lost += 1
                try login()
                continue
            }
            let token = try call("GetToken", ["session": "api"]).parameters["token"] ?? ""
            let refresh = try call("Recover", ["session": "api", "rejected": token])
            if lineage.index == lineage.newest && !lineage.revoked {
                #expect(refresh.error == nil, "iteration \(iteration): the newest refresh token was refused: \(refresh.error ?? "")")
                continued += 1
            } else if lineage.index == lineage.newest - 1 {
                // The death window: the issuer rotated, the daemon never committed the answer.
                #expect(refresh.parameters["reason"] == "invalid_grant", "iteration \(iteration): expected a detected replay")
                deathWindow += 1
                try login()
            } else {
                Issue.record("iteration \(iteration): stored refresh token \(lineage.index) of \(lineage.newest): a rotation was lost")
                lost += 1
                try login()
            }
        }
        daemon.terminate()
        _ = await daemon.wait()
        print("crash test: \(iterations) kills; \(continued) continued with the newest refresh token, "
              + "\(deathWindow) replays in the death window (issuer answered, daemon died before its commit), "
              + "\(logoutsKept) logouts kept, \(lost) lost; issuer replays \(issuer.counters.replays), "
              + "derivations \(issuer.counters.narrowedRefreshes) of \(issuer.counters.refreshGrants) refreshes")
        #expect(issuer.counters.narrowedRefreshes > 0, "the kills came during derivations too")
        #expect(lost == 0)
        #expect(issuer.counters.replays == deathWindow)
    }
}
