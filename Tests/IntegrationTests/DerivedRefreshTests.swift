import DevIssuer
import Foundation
import Testing
import SQLiteStore
import TestSupport
import TokenBrokerCore
import Varlink

/// Derived sessions by refresh (`Derivation=refresh`, RFC 8707 §2.2): the real daemon against
/// the development issuer, whose refresh tokens rotate and whose reuse detection revokes a
/// family on any second redemption. The race suite for the one lineage: every redemption of the
/// parent's refresh token, the parent's own or a derivation's, one at a time.
@Suite("Derived sessions by refresh: one refresh-token lineage for the parent and all it derives", .serialized)
struct DerivedRefreshTests {
    static let resources = (0..<8).map { "https://r\($0).example/api" }

    static func config(_ issuer: DevIssuer) -> String {
        "[Broker]\nSocketMode=0666\n\n" + Broker.oauthSession(issuer.tokenEndpoint) + "RevocationEndpoint=\(issuer.revocationEndpoint)\n"
            + resources.enumerated().map { index, resource in
                "\n[Session]\nName=d\(index)\nDerivedFrom=api\nDerivation=refresh\nResource=\(resource)\n" + (index == 0 ? "Scope=read\n" : "")
            }.joined()
    }

    static func withIssuerAndBroker(_ body: (DevIssuer, Broker) async throws -> Void) async throws {
        let issuer = try DevIssuer(options: DevIssuer.Options())
        defer { issuer.stop() }
        try await withBroker(config: config(issuer)) { broker in
            try await body(issuer, broker)
        }
    }

    static func logIn(_ broker: Broker, _ issuer: DevIssuer) async throws -> String {
        let refreshToken = issuer.issueRefreshToken()
        let login = try await broker.ctl(["login", "api", "--refresh-token-stdin"], stdin: refreshToken + "\n")
        #expect(login.code == 0, "\(login.err)")
        return refreshToken
    }

    @Test("a derived session's token is the parent's refresh token redeemed with its resource and scope: narrowed, the parent's own token unchanged, the rotated refresh token the parent's (stored for it, none for the derived session), the parent's next refresh presents it")
    func narrowedByRefresh() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let login = try await Self.logIn(broker, issuer)
            let parent = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
            let d0 = try #require(try broker.call("GetToken", ["session": "d0"]).parameters["token"]?.stringValue)
            let d1 = try #require(try broker.call("GetToken", ["session": "d1"]).parameters["token"]?.stringValue)
            #expect(issuer.audiences(ofAccessToken: d0) == [Self.resources[0]] && issuer.scope(ofAccessToken: d0) == "read")
            #expect(issuer.audiences(ofAccessToken: d1) == [Self.resources[1]] && issuer.scope(ofAccessToken: d1) == nil)
            #expect(fp(try broker.call("GetToken", ["session": "api"]).parameters["token"]) == fp(parent), "the parent's token is its own still")
            #expect(issuer.counters.narrowedRefreshes == 2 && issuer.counters.tokenExchanges == 0)
            // The parent's first refresh, then two rotations by derivations: the parent holds the
            // newest, durably; the derived sessions hold none.
            let stored = try #require(try await StateDatabase.open(broker.directory + "/state").load("api"))
            let storedToken = try #require(stored.refreshToken?.reveal)
            let lineage = try #require(issuer.lineage(of: storedToken))
            #expect(lineage.index == 3 && lineage.newest == 3 && issuer.lineage(of: login)?.newest == 3, "\(lineage)")
            #expect(try await StateDatabase.open(broker.directory + "/state").load("d0")?.refreshToken == nil)
            // The parent's own refresh presents the rotated token: no reuse.
            #expect(try broker.call("Recover", ["session": "api", "rejected": .string(parent)]).error == nil)
            #expect(issuer.counters.replays == 0 && issuer.lineage(of: login)?.revoked == false)
            #expect(fp(try broker.call("GetToken", ["session": "d0"]).parameters["token"]) == fp(d0), "a parent refresh does not derive again")
            #expect(try broker.status("api")?["derivations"] == 2)
        }
    }

    @Test("storm: the parent's refresh held while 64 workers ask 8 derived sessions at once: every redemption waits its turn in the one lineage, exactly one derivation per derived session, 0 reuse", arguments: 0..<2)
    func stormPerKey(_ run: Int) async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            _ = try await Self.logIn(broker, issuer)
            let parent = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"])
            issuer.inject([.hold])
            let refresh = Task { try await DerivedSessionTests.onThread { try broker.call("Recover", ["session": "api", "rejected": parent]) } }
            try await eventually("the parent's refresh is held") { issuer.heldCount == 1 }
            let workers = (0..<64).map { worker in
                Task { try await DerivedSessionTests.onThread { try broker.call("GetToken", ["session": .string("d\(worker % 8)")]) } }
            }
            try await eventually("the derived sessions wait for the lineage") {
                (0..<8).allSatisfy { (try? broker.status("d\($0)"))?["refreshing"] == true }
            }
            #expect(issuer.counters.narrowedRefreshes == 0 && issuer.heldCount == 1, "nothing redeemed beside the held refresh")
            issuer.releaseHeld()
            #expect(try await refresh.value.error == nil)
            var tokens: [String: Set<String>] = [:]
            for (worker, task) in workers.enumerated() {
                let reply = try await task.value
                #expect(reply.error == nil, "worker \(worker): \(reply.error ?? "")")
                tokens["d\(worker % 8)", default: []].insert(fp(reply.parameters["token"]))
            }
            #expect(tokens.values.allSatisfy { $0.count == 1 } && Set(tokens.values.joined()).count == 8, "one token per derived session")
            #expect(issuer.counters.narrowedRefreshes == 8 && issuer.counters.replays == 0)
            // And the lineage goes on: the parent refreshes again with what the last derivation rotated.
            let next = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"])
            #expect(try broker.call("Recover", ["session": "api", "rejected": next]).error == nil && issuer.counters.replays == 0)
        }
    }

    @Test("keys by refresh (KeyDerivation=refresh): 32 workers on 4 keys with the parent's refresh held get one redemption per key in the one lineage, 0 reuse; the parent holds the newest refresh token; a stale rejection per key costs nothing; the logout signs the keys out")
    func keysByRefresh() async throws {
        let issuer = try DevIssuer(options: DevIssuer.Options())
        defer { issuer.stop() }
        let keys = (0..<4).map { "https://k\($0).example/" }
        let config = "[Broker]\nSocketMode=0666\n\n" + Broker.oauthSession(issuer.tokenEndpoint)
            + "RevocationEndpoint=\(issuer.revocationEndpoint)\nAllowResources=\(keys.joined(separator: " "))\nKeyDerivation=refresh\n"
        try await withBroker(config: config) { broker in
            let login = try await Self.logIn(broker, issuer)
            let parent = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"])
            issuer.inject([.hold])
            let refresh = Task { try await DerivedSessionTests.onThread { try broker.call("Recover", ["session": "api", "rejected": parent]) } }
            try await eventually("the parent's refresh is held") { issuer.heldCount == 1 }
            let workers = (0..<32).map { worker in
                Task { try await DerivedSessionTests.onThread { try broker.call("GetToken", ["session": "api", "resource": .string(keys[worker % 4])]) } }
            }
            try await eventually("the keys' redemptions wait for the lineage") { (try? broker.status("api"))?["keys"] == 4 }
            #expect(issuer.counters.narrowedRefreshes == 0, "nothing redeemed beside the held refresh")
            issuer.releaseHeld()
            #expect(try await refresh.value.error == nil)
            var tokens: [Int: Set<String>] = [:]
            for (worker, task) in workers.enumerated() {
                let reply = try await task.value
                #expect(reply.error == nil, "worker \(worker): \(reply.error ?? "")")
                tokens[worker % 4, default: []].insert(fp(reply.parameters["token"]))
                if let token = reply.parameters["token"]?.stringValue { #expect(issuer.audiences(ofAccessToken: token) == [keys[worker % 4]]) }
            }
            #expect(tokens.values.allSatisfy { $0.count == 1 } && Set(tokens.values.joined()).count == 4, "one token per key")
            #expect(issuer.counters.narrowedRefreshes == 4 && issuer.counters.replays == 0 && issuer.counters.tokenExchanges == 0)
            let stored = try #require(try await StateDatabase.open(broker.directory + "/state").load("api")?.refreshToken?.reveal)
            #expect(issuer.lineage(of: stored)?.index == issuer.lineage(of: login)?.newest, "the parent holds the newest refresh token")
            // Stale per key: the key's first token again gets its current one, no redemption.
            let k0 = try #require(try broker.call("GetToken", ["session": "api", "resource": .string(keys[0])]).parameters["token"])
            let next = try broker.call("Recover", ["session": "api", "rejected": k0, "resource": .string(keys[0])])
            #expect(next.error == nil && issuer.counters.narrowedRefreshes == 5)
            let stale = try broker.call("Recover", ["session": "api", "rejected": k0, "resource": .string(keys[0])])
            #expect(fp(stale.parameters["token"]) == fp(next.parameters["token"]) && issuer.counters.narrowedRefreshes == 5)
            #expect(try broker.call("Logout", ["session": "api"]) == VarlinkReply())
            #expect(try broker.call("GetToken", ["session": "api", "resource": .string(keys[1])]).error == "io.tokenbroker.Broker.SignedOut")
            #expect(issuer.counters.replays == 0 && issuer.activeRefreshTokens == 0)
        }
    }

    @Test("stale per derived session: a rejection of a derived token that is no longer current gets the current one at once, with no redemption")
    func stalePerKey() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            _ = try await Self.logIn(broker, issuer)
            let first = try #require(try broker.call("GetToken", ["session": "d3"]).parameters["token"])
            let second = try broker.call("Recover", ["session": "d3", "rejected": first])
            #expect(second.error == nil && fp(second.parameters["token"]) != fp(first))
            let narrowed = issuer.counters.narrowedRefreshes
            let stale = try broker.call("Recover", ["session": "d3", "rejected": first])
            #expect(fp(stale.parameters["token"]) == fp(second.parameters["token"]) && issuer.counters.narrowedRefreshes == narrowed)
            #expect(try broker.status("d3")?["staleRejections"] == 1 && issuer.counters.replays == 0)
        }
    }

    @Test("the parent's logout during a derivation (answered upstream, the answer held) and with seven more queued behind it: every derived session SignedOut, none installs, the rotated refresh token and the narrowed tokens are dead at the issuer (race suite: logout during derivations)", arguments: 0..<2)
    func logoutDuringDerivations(_ run: Int) async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let login = try await Self.logIn(broker, issuer)
            issuer.inject([.holdAfterProcessing])
            let demands = (0..<8).map { index in
                Task { try await DerivedSessionTests.onThread { try broker.call("GetToken", ["session": .string("d\(index)")]) } }
            }
            try await eventually("one derivation is held, seven queue behind it") {
                issuer.heldCount == 1 && (0..<8).allSatisfy { (try? broker.status("d\($0)"))?["refreshing"] == true }
            }
            #expect(try broker.call("Logout", ["session": "api"]) == VarlinkReply())
            issuer.releaseHeld()
            for (index, demand) in demands.enumerated() {
                let reply = try await demand.value
                #expect(reply.error == "io.tokenbroker.Broker.SignedOut", "d\(index): \(reply.error ?? "") \(reply.parameters["reason"] ?? "")")
            }
            #expect(issuer.counters.narrowedRefreshes == 1, "the queued ones never redeemed")
            for index in 0..<8 {
                #expect(try broker.call("GetToken", ["session": .string("d\(index)")]).error == "io.tokenbroker.Broker.SignedOut")
            }
            // The held answer's refresh token was nobody's: revoked, and its family with it.
            try await eventually("the lineage is revoked and no narrowed token lives") {
                issuer.lineage(of: login)?.revoked == true && Self.resources.allSatisfy { issuer.liveAccessTokens(for: $0) == 0 }
            }
            #expect(issuer.counters.replays == 0)
        }
    }

    @Test("a refused derivation (invalid_target) ends that derived session with the server's reason; the parent's refresh token is not spent, the parent and the others go on")
    func refusalStaysLocal() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            _ = try await Self.logIn(broker, issuer)
            let parent = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"])
            issuer.refuseTarget(Self.resources[2])
            let refused = try broker.call("GetToken", ["session": "d2"])
            #expect(refused.error == "io.tokenbroker.Broker.RefreshFailed" && refused.parameters["retryable"] == false)
            let status = try #require(try broker.status("d2"))
            #expect(status["state"] == "ended" && (status["lastError"]?.stringValue ?? "").contains("invalid_target"))
            let parentStatus = try broker.status("api")
            #expect(parentStatus?["state"] == "active" && parentStatus?["failures"] == 0)
            #expect(try broker.call("GetToken", ["session": "d5"]).error == nil)
            #expect(try broker.call("Recover", ["session": "api", "rejected": parent]).error == nil)
            #expect(issuer.counters.replays == 0)
        }
    }
}
