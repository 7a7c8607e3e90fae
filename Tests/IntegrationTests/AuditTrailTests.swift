#if canImport(Glibc)
import Glibc
#endif
import Foundation
import Testing
import TestSupport
import Varlink

/// The audit trail (issue 36) through the real daemon: every token handed out is recorded
/// (who, which token by serial, how), in the log and in `ctl audit`, never the token.
@Suite("The audit trail: who was handed which token, never the token", .serialized)
struct AuditTrailTests {
    static let config = """
        [Broker]
        SocketMode=0666
        AuditBurst=3
        AuditInterval=1s

        [Session]
        Name=api
        Upstream=test
        AllowUsers=\(Broker.workerUID)
        Serves=https://api.example.test/
        RefreshLimitBurst=100

        [Session]
        Name=other
        Upstream=test

        [Delegation]
        Name=ci
        Sessions=api
        Socket=@DIR@/delegations/ci.sock
        SocketMode=0666

        """

    static func audit(_ broker: Broker, _ arguments: [String] = []) async throws -> [[String: Any]] {
        let run = try await broker.ctl(["audit", "--json"] + arguments)
        #expect(run.code == 0, "\(run.err)")
        let object = try JSONSerialization.jsonObject(with: Data(run.out.utf8)) as? [String: Any]
        return object?["records"] as? [[String: Any]] ?? []
    }

    @Test("each token handed out is a record: by method, peer (uid, pid), delegation, token serial; one record however often a peer is handed one token; ctl audit lists them, newest first, by session, to admins only; the log has one entry per record, never the token")
    func records() async throws {
        try await withBroker(config: Self.config) { broker in
            let token = try #require(try broker.call("GetToken", ["session": "api"]).parameters["token"]?.stringValue)
            // A worker's three processes; a worker through the delegation; Credential and Recover on one connection.
            for _ in 0..<3 { #expect(try await broker.ctl(["token", "api"], asUser: Broker.workerUID).code == 0) }
            let delegated = try await broker.ctl(["--socket", broker.directory + "/delegations/ci.sock", "token", "api"], asUser: Broker.workerUID + 5)
            #expect(delegated.code == 0, "\(delegated.err)")
            let client = try broker.client()
            for _ in 0..<50 { #expect(try client.call("io.tokenbroker.Broker.GetToken", ["session": "api"]).error == nil) }
            #expect(try client.call("io.tokenbroker.Broker.Credential", ["url": "https://api.example.test/x"]).error == nil)
            #expect(try client.call("io.tokenbroker.Broker.Recover", ["session": "api", "rejected": .string(token)]).error == nil)
            _ = try broker.call("GetToken", ["session": "other"])

            let records = try await Self.audit(broker)
            let api = try await Self.audit(broker, ["--session", "api"])
            #expect(records.count == api.count + 1 && records.contains { $0["session"] as? String == "other" })
            let workers = api.filter { $0["uid"] as? Int == Int(Broker.workerUID) }
            #expect(workers.count == 3 && workers.allSatisfy { $0["methods"] as? [String] == ["GetToken"] && $0["count"] as? Int == 1 && $0["delegation"] == nil })
            #expect(Set(workers.compactMap { $0["pid"] as? Int }).count == 3, "one record per process")
            let through = api.filter { $0["delegation"] as? String == "ci" }
            #expect(through.count == 1 && through.first?["uid"] as? Int == Int(Broker.workerUID + 5))
            // This process's connection: token 1 by GetToken and Credential (51 times, and the first call's), then token 2 by Recover.
            let mine = api.filter { $0["pid"] as? Int == Int(getpid()) }
            let first = mine.first { $0["tokenSerial"] as? Int == 1 }, second = mine.first { $0["tokenSerial"] as? Int == 2 }
            #expect(first?["count"] as? Int == 52 && Set(first?["methods"] as? [String] ?? []) == ["GetToken", "Credential"], "\(String(describing: first))")
            #expect(second?["methods"] as? [String] == ["Recover"])
            #expect(records.first?["session"] as? String == "other", "newest first")
            #expect(try await Self.audit(broker, ["--limit", "2"]).count == 2)
            let table = try await broker.ctl(["audit"])
            #expect(table.out.hasPrefix("LAST") && table.out.contains(" ci ") && table.out.contains("GetToken,Credential") == false
                    && table.out.contains("Credential,GetToken"), "\(table.out)")
            // Admins only; a worker learns nothing.
            let refused = try await broker.ctl(["audit"], asUser: Broker.workerUID)
            #expect(refused.code == 77 && refused.out.isEmpty)
            #expect(try await broker.ctl(["--socket", broker.directory + "/delegations/ci.sock", "audit"]).code == 77, "not through a delegation, even as root")
            // The log: one entry per record (the share is 3 per user: each of this test's records is
            // a user's first or second), never a token.
            // (Written on the audit's own thread: waited for.)
            let count = records.count
            try await eventually("an entry per record in the log") {
                broker.child.stderr.components(separatedBy: "audit: token #").count - 1 == count
            }
            let log = broker.child.stderr
            #expect(log.contains("to pid \(getpid()) uid 0 gid 0 by GetToken") && log.contains("through delegation ci by GetToken"))
            #expect(!log.contains(token) && !records.description.contains(token))
        }
    }

    @Test("the log gets AuditBurst= records per peer per AuditInterval=; then one line says how many were left out, and the metrics count them; ctl audit keeps them all")
    func share() async throws {
        try await withBroker(config: Self.config) { broker in
            let client = try broker.client()
            for _ in 0..<8 {
                #expect(try client.call("io.tokenbroker.Broker.Refresh", ["session": "api"]).error == nil)
                #expect(try client.call("io.tokenbroker.Broker.GetToken", ["session": "api"]).error == nil)
            }
            #expect(try await Self.audit(broker).count == 8)
            try await eventually("the line saying how many were left out") {
                broker.child.stderr.contains("audit: 5 record(s) of uid 0 left out of the journal in the last 1s (at most 3 per user)")
            }
            #expect(broker.child.stderr.components(separatedBy: "audit: token #").count - 1 == 3)
            let metrics = try await broker.ctl(["metrics"]).out
            #expect(metrics.contains("tokenbroker_audit_records_total 8") && metrics.contains("tokenbroker_audit_suppressed_total 5"), "\(metrics)")
        }
    }
}
