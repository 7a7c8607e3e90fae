#if canImport(Glibc)
import Glibc
#endif
import Basics
import BrokerContract
import Synchronization
import TokenBrokerCore
import Varlink

/// The audit trail: who was handed which token (never the token itself).
///
/// A record is one token (a session's generation and serial) handed to one peer (pid, uid,
/// gid, the delegation it came through) by one or more methods, with a count: the thousands of
/// GetToken calls a worker makes with one token are one record, not thousands. A new record is
/// written to the journal as a structured entry (`MESSAGE_ID=` `Audit.messageID`, `SESSION=`,
/// `GENERATION=`, `TOKEN_SERIAL=`, `PEER_PID=`, `PEER_UID=`, `PEER_GID=`, `PEER_UNIT=` — the
/// peer's systemd unit, read from its cgroup —, `DELEGATION=`, `METHOD=`, `RESOURCE=`,
/// `SCOPE=`), at most `burst` per user (uid, and the delegation it came through: a user's
/// many processes share one share) per `interval`: beyond that they are counted, and one line
/// says how many were left out once the interval is over (`Maintenance` asks each second).
/// The journal is written on a thread of its own, never on the caller's (the varlink loop). The
/// newest `capacity` records stay in memory for `ctl audit`.
///
/// The hot path (a token already handed to this peer) is one lookup and an increment under a
/// lock, keyed by numbers only.
final class Audit: Sendable {
    /// The journal's MESSAGE_ID of an audit record, and of a "suppressed" line.
    static let messageID = "5f8c2a4e9b1d4c7a8e3f6b0d2c9a7e14"
    static let suppressedMessageID = "a93e1c7f5b2d4e8a9c6f0b3d7e2a5c18"

    /// One record as `ctl audit` shows it.
    struct Record: Sendable {
        var session: String
        var resource: String?
        var scope: String?
        var generation: Int
        var serial: UInt64
        var peer: PeerCredentials
        var unit: String?
        var delegation: String?
        var methods: Set<BrokerMethod>
        /// The method of the last call counted (the hot path looks at `methods` only when
        /// another method comes: hashing a method's name costs more than the rest of a count).
        var lastMethod: BrokerMethod
        var count: Int
        /// When it was first and last handed out (Unix seconds).
        var first: Int64
        var last: Int64
    }

    private struct Key: Hashable {
        let pid: Int32
        let user: UserKey
        let issuer: UInt64
        let generation: Int
        let serial: UInt64

        /// Two words hashed, not six fields (every call looks a key up); equality still
        /// compares every field.
        func hash(into hasher: inout Hasher) {
            hasher.combine(UInt64(UInt32(bitPattern: pid)) << 32 | UInt64(user.uid) ^ UInt64(user.listener) << 16)
            hasher.combine(issuer &* 0x9E37_79B9_7F4A_7C15 ^ UInt64(bitPattern: Int64(generation)) << 40 ^ serial)
        }
    }

    /// Whose journal share a record takes: a user, through the delegation it came by.
    private struct UserKey: Hashable {
        let uid: UInt32
        let listener: UInt32
    }

    private struct Window {
        var start: ContinuousClock.Instant
        var written = 0
        var suppressed = 0
    }

    private struct State {
        var ring: [Record] = []
        var keys: [Key?] = []
        /// The next slot to write in `ring` once it is full.
        var next = 0
        var index: [Key: Int] = [:]
        /// Per user: what was written and left out in its interval (at most `mostUsers`; the
        /// rest share one).
        var windows: [UserKey: Window] = [:]
        var records = 0
        var suppressed = 0
    }

    /// Users with a journal share of their own in one interval; the rest share one.
    static let mostUsers = 4096
    private static let others = UserKey(uid: UInt32.max, listener: UInt32.max)

    /// A new coordinator's identity in the records (never reused, unlike an address).
    static func nextIssuer() -> UInt64 { issuers.add(1, ordering: .relaxed).newValue }
    private static let issuers = Atomic<UInt64>(0)

    let capacity: Int
    let burst: Int
    let interval: Duration
    private let state = Mutex(State())
    private let write: @Sendable ([String], String) -> Void
    private let unitOf: @Sendable (Int32) -> String?
    /// The journal's writer, and the entries waiting for it (past `mostPending`, left out and
    /// counted: a stalled journal costs memory up to that, never the caller's time).
    private let writer = Mutex<SerialThread?>(nil)
    private let pending = Pending()
    static let mostPending = 4096

    /// The entries handed to the journal's thread and not yet written.
    private final class Pending: Sendable {
        let count = Atomic<Int>(0)
    }

    /// - Parameter write: writes one journal entry: its fields, and the line for stderr when
    ///   the journal is not there.
    init(capacity: Int = 512, burst: Int = 10, interval: Duration = .seconds(60), write: @escaping @Sendable ([String], String) -> Void,
         unitOf: @escaping @Sendable (Int32) -> String? = Audit.unit(of:)) {
        (self.capacity, self.burst, self.interval, self.write, self.unitOf) = (capacity, burst, interval, write, unitOf)
    }

    /// `token` of `session` (whose coordinator is `issuer`: a key's, a rebuilt session's, are
    /// others) handed to `peer` by `method` (through `delegation`, when the peer came through
    /// one; `key` when the token is a key's).
    func handed(_ token: IssuedToken, of session: String, issuer: UInt64, key: TokenKey?, to peer: PeerCredentials, by method: BrokerMethod,
                delegation: @autoclosure () -> String?) {
        let user = UserKey(uid: peer.uid, listener: peer.listener)
        let id = Key(pid: peer.pid, user: user, issuer: issuer, generation: token.generation, serial: token.serial)
        // The hot path: a record this peer has.
        let now = UTCTime.unixSeconds()
        let known = state.withLock { state -> Bool in
            guard let slot = state.index[id] else { return false }
            state.ring[slot].count += 1
            state.ring[slot].last = now
            if state.ring[slot].lastMethod != method {
                state.ring[slot].lastMethod = method
                state.ring[slot].methods.insert(method)
            }
            return true
        }
        if known { return }
        let record = Record(session: session, resource: key?.resource, scope: key?.scope, generation: token.generation,
                            serial: token.serial, peer: peer, unit: unitOf(peer.pid), delegation: delegation(), methods: [method], lastMethod: method, count: 1,
                            first: now, last: now)
        let written = state.withLock { state -> Bool in
            if let slot = state.index[id] {
                // (Another call of the same peer made it meanwhile.)
                state.ring[slot].count += 1
                state.ring[slot].last = now
                state.ring[slot].methods.insert(method)
                state.ring[slot].lastMethod = method
                return false
            }
            if state.ring.count < capacity {
                state.index[id] = state.ring.count
                state.ring.append(record)
                state.keys.append(id)
            } else {
                if let old = state.keys[state.next] { state.index[old] = nil }
                state.ring[state.next] = record
                state.keys[state.next] = id
                state.index[id] = state.next
                state.next = (state.next + 1) % capacity
            }
            state.records += 1
            let share = state.windows[user] != nil || state.windows.count < Self.mostUsers ? user : Self.others
            var window = state.windows[share] ?? Window(start: ContinuousClock.now)
            defer { state.windows[share] = window }
            guard window.written < burst else {
                window.suppressed += 1
                state.suppressed += 1
                return false
            }
            window.written += 1
            return true
        }
        if written { journal(Self.fields(record, method: method), Self.line(record, method: method)) }
    }

    /// Writes one entry on the journal's thread (made with the first), unless too many wait.
    private func journal(_ fields: [String], _ line: String) {
        guard pending.count.add(1, ordering: .relaxed).newValue <= Self.mostPending else {
            pending.count.subtract(1, ordering: .relaxed)
            state.withLock { $0.suppressed += 1 }
            return
        }
        let thread = writer.withLock { writer in
            if writer == nil { writer = SerialThread() }
            return writer!
        }
        let (write, pending) = (self.write, self.pending)
        thread.submit {
            write(fields, line)
            pending.count.subtract(1, ordering: .relaxed)
        }
    }

    /// Waits until every entry handed to the journal's thread so far is written (tests).
    func drain() async {
        guard let thread = writer.withLock({ $0 }) else { return }
        _ = try? await thread.run {}
    }

    /// Says, once a peer's interval is over, how many of its records were left out of the
    /// journal in it (each such line counted as such).
    func flushSuppressed(now: ContinuousClock.Instant = .now) {
        // (With no share at all, the journal has no audit; `ctl audit` still has them.)
        let burst = self.burst
        let over = state.withLock { state -> [(UserKey, Window)] in
            var over: [(UserKey, Window)] = []
            for (key, window) in state.windows where now - window.start >= interval {
                state.windows[key] = nil
                if window.suppressed > 0, burst > 0 { over.append((key, window)) }
            }
            return over
        }
        for (user, window) in over {
            let whom = user == Self.others ? "users beyond the first \(Self.mostUsers)"
                : "uid \(user.uid)" + (user.listener == 0 ? "" : " through delegation #\(user.listener)")
            let message = "audit: \(window.suppressed) record(s) of \(whom) left out of the journal in the last \(interval.components.seconds)s "
                + "(at most \(burst) per user); ctl audit lists the newest"
            var fields = ["MESSAGE=\(message)", "MESSAGE_ID=\(Self.suppressedMessageID)", "PRIORITY=5", "SYSLOG_IDENTIFIER=tokenbroker",
                          "SUPPRESSED=\(window.suppressed)"]
            if user != Self.others { fields.append("PEER_UID=\(user.uid)") }
            journal(fields, message)
        }
    }

    /// The newest records first, at most `limit`, of `session` only when given.
    func recent(limit: Int, session: String? = nil) -> [Record] {
        state.withLock { state in
            let count = state.ring.count
            var result: [Record] = []
            // Newest first: the slot before `next` once full, the last appended before that.
            let newest = count < capacity ? count - 1 : (state.next + capacity - 1) % capacity
            var slot = newest
            for _ in 0..<count {
                let record = state.ring[slot]
                if session == nil || record.session == session { result.append(record) }
                if result.count >= limit { break }
                slot = (slot + count - 1) % count
            }
            return result
        }
    }

    /// Records made, and left out of the journal, since the start.
    var counts: (records: Int, suppressed: Int) { state.withLock { ($0.records, $0.suppressed) } }

    // MARK: - Words

    static func fields(_ record: Record, method: BrokerMethod) -> [String] {
        var fields = ["MESSAGE=\(line(record, method: method))", "MESSAGE_ID=\(messageID)", "PRIORITY=6", "SYSLOG_IDENTIFIER=tokenbroker",
                      "SESSION=\(record.session)", "GENERATION=\(record.generation)", "TOKEN_SERIAL=\(record.serial)", "METHOD=\(method.rawValue)",
                      "PEER_PID=\(record.peer.pid)", "PEER_UID=\(record.peer.uid)", "PEER_GID=\(record.peer.gid)"]
        if let unit = record.unit { fields.append("PEER_UNIT=\(unit)") }
        if let delegation = record.delegation { fields.append("DELEGATION=\(delegation)") }
        if let resource = record.resource { fields.append("RESOURCE=\(Logger.printable(resource, limit: 512))") }
        if let scope = record.scope { fields.append("SCOPE=\(Logger.printable(scope, limit: 512))") }
        return fields
    }

    static func line(_ record: Record, method: BrokerMethod) -> String {
        var text = "audit: token #\(record.serial) of session \(record.session)"
        if let resource = record.resource { text += " for resource \(Logger.printable(resource, limit: 512))" }
        if let scope = record.scope { text += " scope \(Logger.printable(scope, limit: 512))" }
        text += " (generation \(record.generation)) to pid \(record.peer.pid) uid \(record.peer.uid) gid \(record.peer.gid)"
        if let unit = record.unit { text += " (\(unit))" }
        if let delegation = record.delegation { text += " through delegation \(delegation)" }
        return text + " by \(method.rawValue)"
    }

    /// The systemd unit of process `pid` (its cgroup's deepest `.service` or `.scope`), if it
    /// has one and it can be read (a process of another user is hidden under
    /// `ProtectProc=invisible`; one that has exited is gone).
    static func unit(of pid: Int32) -> String? {
        guard pid > 0 else { return nil }
        let fd = open("/proc/\(pid)/cgroup", O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        var buffer = [UInt8](repeating: 0, count: 4096)
        let count = buffer.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
        guard count > 0 else { return nil }
        return unit(inCgroup: buffer[0..<count])
    }

    /// The unit named in a `/proc/PID/cgroup` text: in the unified hierarchy's path (`0::`),
    /// else in systemd's named one (`name=systemd`, where systemd keeps its units on a hybrid or
    /// legacy host); the deepest component that is a unit name. (Read as bytes: it runs on the
    /// I/O thread for every new peer, a `ctl` or a credential helper each call.)
    static func unit(inCgroup text: ArraySlice<UInt8>) -> String? {
        let colon = UInt8(ascii: ":")
        var unified: ArraySlice<UInt8>?, named: ArraySlice<UInt8>?
        for line in text.split(separator: UInt8(ascii: "\n")) {
            // ID:CONTROLLERS:PATH
            guard let first = line.firstIndex(of: colon), let second = line[(first + 1)...].firstIndex(of: colon) else { continue }
            let controllers = line[(first + 1)..<second]
            if line[..<first].elementsEqual("0".utf8) && controllers.isEmpty { unified = line[(second + 1)...] }
            if controllers.elementsEqual("name=systemd".utf8) { named = line[(second + 1)...] }
        }
        return unified.flatMap(unit(inPath:)) ?? named.flatMap(unit(inPath:))
    }

    /// The deepest component of a cgroup path that is a unit name (`.service`, `.scope`); nil
    /// when there is none or it holds a character no unit name has.
    private static func unit(inPath path: ArraySlice<UInt8>) -> String? {
        func ends(_ component: ArraySlice<UInt8>, with suffix: String) -> Bool {
            component.count >= suffix.utf8.count && component.suffix(suffix.utf8.count).elementsEqual(suffix.utf8)
        }
        for component in path.split(separator: UInt8(ascii: "/")).reversed() where ends(component, with: ".service") || ends(component, with: ".scope") {
            guard component.count <= 256, component.allSatisfy({ byte in
                (0x30...0x39).contains(byte) || (0x41...0x5A).contains(byte) || (0x61...0x7A).contains(byte)
                    || byte == UInt8(ascii: ":") || byte == UInt8(ascii: "_") || byte == UInt8(ascii: ".") || byte == UInt8(ascii: "-")
                    || byte == UInt8(ascii: "@") || byte == UInt8(ascii: "\\")
            }) else { return nil }
            return String(decoding: component, as: UTF8.self)
        }
        return nil
    }
}

extension AuditEntry {
    /// A record as the contract lists it.
    init(_ record: Audit.Record) {
        self.init(session: record.session, resource: record.resource, scope: record.scope, generation: Int64(record.generation),
                  tokenSerial: Int64(record.serial), pid: Int64(record.peer.pid), uid: Int64(record.peer.uid), gid: Int64(record.peer.gid),
                  unit: record.unit, delegation: record.delegation, methods: record.methods.map(\.rawValue).sorted(), count: Int64(record.count),
                  first: record.first, last: record.last)
    }
}
