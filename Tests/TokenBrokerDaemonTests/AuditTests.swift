import BrokerContract
import Synchronization
import Testing
import TokenBrokerCore
@testable import TokenBrokerDaemon
import Varlink

/// The audit trail's bookkeeping (`Audit`), driven directly: records per token and peer,
/// the journal's share per peer and the line that says what was left out, the ring's order,
/// the unit read from a cgroup.
@Suite("The audit trail")
struct AuditTests {
    /// What was written, entry by entry: the fields.
    final class Journal: Sendable {
        let entries = Mutex<[[String]]>([])
        var all: [[String]] { entries.withLock { $0 } }
        func write(_ fields: [String], _ line: String) { entries.withLock { $0.append(fields) } }
    }

    /// Two coordinators' identities.
    static let issuers = (Audit.nextIssuer(), Audit.nextIssuer())

    static func token(_ serial: UInt64, generation: Int = 1, secret: String = "at-secret-value") -> IssuedToken {
        IssuedToken(token: Secret("\(secret)-\(serial)"), tokenType: "Bearer", expiresAt: 2_000_000_000, generation: generation, serial: serial)
    }

    @Test("one record per token and peer: the same token again counts, with its methods; another token, peer or delegation is a record of its own; the journal never sees the token")
    func recordsPerTokenAndPeer() async {
        let journal = Journal()
        let audit = Audit(burst: 100, write: journal.write, unitOf: { $0 == 42 ? "worker.service" : nil })
        let issuer = Self.issuers.0
        let worker = PeerCredentials(pid: 42, uid: 1000, gid: 1000)
        for _ in 0..<1000 { audit.handed(Self.token(1), of: "api", issuer: issuer, key: nil, to: worker, by: .getToken, delegation: nil) }
        audit.handed(Self.token(1), of: "api", issuer: issuer, key: nil, to: worker, by: .watch, delegation: nil)
        audit.handed(Self.token(2), of: "api", issuer: issuer, key: nil, to: worker, by: .recover, delegation: nil)
        audit.handed(Self.token(2), of: "api", issuer: issuer, key: nil, to: PeerCredentials(pid: 43, uid: 0, gid: 0, listener: 7), by: .getToken,
                     delegation: "ci")
        audit.handed(Self.token(2), of: "api", issuer: Self.issuers.1, key: TokenKey(resource: "https://r.example/", scope: nil),
                     to: worker, by: .getToken, delegation: nil)
        await audit.drain()
        let records = audit.recent(limit: 10)
        #expect(records.count == 4)
        #expect(audit.counts.records == 4 && journal.all.count == 4)
        // Newest first.
        #expect(records.map(\.serial) == [2, 2, 2, 1])
        #expect(records[3].count == 1001 && records[3].methods == [.getToken, .watch] && records[3].unit == "worker.service")
        #expect(records[1].delegation == "ci" && records[1].peer.listener == 7 && records[1].unit == nil)
        #expect(records[0].resource == "https://r.example/")
        let fields = journal.all[2]
        #expect(fields.contains("MESSAGE_ID=\(Audit.messageID)") && fields.contains("DELEGATION=ci") && fields.contains("TOKEN_SERIAL=2")
                && fields.contains("PEER_PID=43") && fields.contains("PEER_UID=0") && fields.contains("SESSION=api") && fields.contains("METHOD=GetToken"))
        #expect(journal.all[0].contains("PEER_UNIT=worker.service"))
        #expect(!journal.all.joined().contains { $0.contains("at-secret-value") }, "no token in the journal")
        #expect(audit.recent(limit: 10, session: "other").isEmpty)
    }

    @Test("the journal gets at most burst records per user per interval, whatever its processes (a user's many pids share one share); the rest are counted, and one line says how many once the interval is over; other users are not held back")
    func journalShare() async {
        let journal = Journal()
        let audit = Audit(burst: 3, interval: .seconds(60), write: journal.write, unitOf: { _ in nil })
        let issuer = Self.issuers.0
        let other = PeerCredentials(pid: 2, uid: 1001, gid: 1001)
        // The hog: a new process per call (as `ctl token` in a loop is).
        for serial in 1...10 {
            audit.handed(Self.token(UInt64(serial)), of: "api", issuer: issuer, key: nil, to: PeerCredentials(pid: Int32(100 + serial), uid: 1000, gid: 1000),
                         by: .getToken, delegation: nil)
        }
        audit.handed(Self.token(10), of: "api", issuer: issuer, key: nil, to: other, by: .getToken, delegation: nil)
        await audit.drain()
        #expect(journal.all.count == 4, "3 of the hog's, 1 of the other's")
        #expect(audit.counts == (records: 11, suppressed: 7))
        #expect(audit.recent(limit: 100).count == 11, "ctl audit has them all")
        audit.flushSuppressed(now: .now)
        await audit.drain()
        #expect(journal.all.count == 4, "nothing said before the interval is over")
        audit.flushSuppressed(now: .now + .seconds(61))
        await audit.drain()
        let said = journal.all.last ?? []
        #expect(journal.all.count == 5 && said.contains("MESSAGE_ID=\(Audit.suppressedMessageID)") && said.contains("SUPPRESSED=7")
                && said.contains("PEER_UID=1000"), "\(said)")
        // A new interval: the hog writes again.
        audit.handed(Self.token(11), of: "api", issuer: issuer, key: nil, to: PeerCredentials(pid: 1, uid: 1000, gid: 1000), by: .getToken, delegation: nil)
        await audit.drain()
        #expect(journal.all.count == 6)
    }

    @Test("the ring keeps the newest capacity records, newest first, and forgets the index of those it drops")
    func ring() async {
        let audit = Audit(capacity: 4, burst: 0, write: { _, _ in Issue.record("nothing goes to the journal with AuditBurst=0") }, unitOf: { _ in nil })
        let issuer = Self.issuers.0
        let peer = PeerCredentials(pid: 1, uid: 1, gid: 1)
        for serial in 1...10 { audit.handed(Self.token(UInt64(serial)), of: "api", issuer: issuer, key: nil, to: peer, by: .getToken, delegation: nil) }
        #expect(audit.recent(limit: 10).map(\.serial) == [10, 9, 8, 7])
        #expect(audit.recent(limit: 2).map(\.serial) == [10, 9])
        // Token 1 was dropped: handed again, it is a new record.
        audit.handed(Self.token(1), of: "api", issuer: issuer, key: nil, to: peer, by: .getToken, delegation: nil)
        #expect(audit.recent(limit: 10).map(\.serial) == [1, 10, 9, 8])
        audit.flushSuppressed(now: .now + .seconds(3600))
        await audit.drain()
    }

    @Test("the unit of a process, from its cgroup: the deepest .service or .scope of the unified hierarchy, else of name=systemd (a hybrid host); none for odd names")
    func units() {
        func unit(_ text: String) -> String? { Audit.unit(inCgroup: ArraySlice(Array(text.utf8))) }
        #expect(unit("0::/system.slice/build-runner.service\n") == "build-runner.service")
        #expect(unit("0::/user.slice/user-1000.slice/user@1000.service/app.slice/ci.service\n") == "ci.service")
        #expect(unit("0::/user.slice/user-1000.slice/session-3.scope\n") == "session-3.scope")
        #expect(unit("12:memory:/x\n1:name=systemd:/system.slice/cron.service\n0::/\n") == "cron.service", "a hybrid host: the named hierarchy's")
        #expect(unit("1:name=systemd:/system.slice/cron.service\n0::/system.slice/other.service\n") == "other.service", "the unified line first")
        #expect(unit("12:memory:/x\n1:name=systemd:/system.slice/cron.service\n") == "cron.service")
        #expect(unit("0::/system.slice/system-getty.slice/getty@tty1.service") == "getty@tty1.service", "no last newline")
        #expect(unit("0::/system.slice/run-r\\x2d1.scope\n") == "run-r\\x2d1.scope")
        #expect(unit("0::/a.service/b:c\n") == "a.service", "a colon in the path")
        #expect(unit("0::/\n") == nil)
        #expect(unit("0::/system.slice/evil\u{1b}[2J.service\n") == nil)
    }
}
