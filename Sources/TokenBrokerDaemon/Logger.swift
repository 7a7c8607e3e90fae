#if canImport(Glibc)
import Glibc
#endif
import Synchronization

/// Syslog priorities.
public enum LogLevel: Int, Sendable, Comparable, CaseIterable {
    case emergency = 0, alert, critical, error, warning, notice, info, debug

    public static func < (lhs: LogLevel, rhs: LogLevel) -> Bool { lhs.rawValue < rhs.rawValue }

    public init?(name: String) {
        switch name.lowercased() {
        case "emerg", "emergency": self = .emergency
        case "alert": self = .alert
        case "crit", "critical": self = .critical
        case "err", "error": self = .error
        case "warning", "warn": self = .warning
        case "notice": self = .notice
        case "info": self = .info
        case "debug": self = .debug
        default: return nil
        }
    }
}

/// Writes log entries: to the journal as structured entries (`MESSAGE`, `PRIORITY`,
/// `SESSION`, `GENERATION`, `TOKEN_SERIAL`) when stderr is the journal (`JOURNAL_STREAM`
/// matches it), else one line per entry on stderr with a `<N>` priority prefix, which journald
/// also understands. Entries name sessions, generations, token serials, uids and pids; never a
/// token or a secret.
public final class Logger: Sendable {
    private let minimum: Mutex<LogLevel>
    private let journal: Bool
    private let journalFailed = Atomic<Bool>(false)

    public init(level: LogLevel = .info, journal: Bool = false) {
        minimum = Mutex(level)
        self.journal = journal
    }

    public var level: LogLevel {
        get { minimum.withLock { $0 } }
        set { minimum.withLock { $0 = newValue } }
    }

    /// Whether a message at `level` would be written (to skip building one that would not).
    public func enabled(_ level: LogLevel) -> Bool { level <= self.level }

    public func log(_ level: LogLevel, _ message: String, session: String? = nil, generation: Int? = nil, tokenSerial: UInt64? = nil) {
        guard level <= self.level else { return }
        let flat = Self.printable(message)
        if journal {
            var fields = ["MESSAGE=\(flat)", "PRIORITY=\(level.rawValue)", "SYSLOG_IDENTIFIER=tokenbroker"]
            if let session { fields.append("SESSION=\(session)") }
            if let generation { fields.append("GENERATION=\(generation)") }
            if let tokenSerial { fields.append("TOKEN_SERIAL=\(tokenSerial)") }
            if sendToJournal(fields) { return }
        }
        Self.writeLine("<\(level.rawValue)>\(flat)\n")
    }

    /// An audit entry (`Audit`): written whatever the level (an audit trail is not chatter),
    /// with its own fields in the journal, else `line` at info priority on stderr.
    public func audit(_ fields: [String], line: String) {
        if journal, sendToJournal(fields) { return }
        Self.writeLine("<6>\(Self.printable(line))\n")
    }

    /// Opens the journal's library (when entries go to the journal) ahead of the next entry.
    public func prepare() {
        if journal, !Systemd.loadJournal() { journalFailedOnce() }
    }

    /// One entry to the journal; false when it was not sent, for the caller to write its line
    /// on stderr instead (the journal's stream, under systemd).
    private func sendToJournal(_ fields: [String]) -> Bool {
        if Systemd.journal(fields) { return true }
        journalFailedOnce()
        return false
    }

    /// The first time the journal fails, a line on stderr says why.
    private func journalFailedOnce() {
        guard !journalFailed.exchange(true, ordering: .relaxed) else { return }
        let why = Systemd.journalFailure() ?? "the journal refused an entry"
        Self.writeLine("<4>\(Self.printable("cannot write to the journal (\(why)); entries it refuses are written here"))\n")
    }

    private static func writeLine(_ line: String) {
        var bytes = Array(line.utf8)
        _ = bytes.withUnsafeMutableBytes { write(2, $0.baseAddress, $0.count) }
    }

    /// `message` as one line of bounded length that cannot forge another entry, whoever wrote
    /// parts of it: control characters (C0, DEL, C1 — `\r` and `\n` among them) and the Unicode
    /// line and paragraph separators become `\x..`/`\u{....}` escapes; past `limit` bytes it is
    /// cut, with `…`.
    static func printable(_ message: String, limit: Int = 2048) -> String {
        var result = ""
        var length = 0
        for scalar in message.unicodeScalars {
            let piece: String
            switch scalar.value {
            case 0x00..<0x20, 0x7F, 0x80...0x9F: piece = "\\x" + (scalar.value < 0x10 ? "0" : "") + String(scalar.value, radix: 16)
            case 0x2028, 0x2029: piece = "\\u{" + String(scalar.value, radix: 16) + "}"
            default: piece = String(scalar)
            }
            length += piece.utf8.count
            if length > limit {
                result += "…"
                break
            }
            result += piece
        }
        return result
    }

    /// Logs `message` unless more than `burst` entries with the same `key` came in the last
    /// `interval`: what an unauthenticated peer can trigger (refusals, protocol errors) must not
    /// flood the journal. The first entry after a quiet spell says how many were left out.
    public func limited(_ level: LogLevel, key: String, _ message: String) {
        guard level <= self.level else { return }
        let suppressed = limiter.withLock { $0.admit(key, now: ContinuousClock.now) }
        guard let suppressed else { return }
        log(level, suppressed > 0 ? message + " (\(suppressed) similar message(s) suppressed)" : message)
    }

    private let limiter = Mutex(RateLimiter())

    /// Per key, at most `burst` admissions per `interval`; at most `maximumKeys` keys tracked
    /// (beyond that, new keys share one).
    struct RateLimiter {
        let burst: Int
        let interval: Duration
        let maximumKeys: Int
        private var windows: [String: (start: ContinuousClock.Instant, admitted: Int, suppressed: Int)] = [:]

        init(burst: Int = 5, interval: Duration = .seconds(10), maximumKeys: Int = 1024) {
            self.burst = burst
            self.interval = interval
            self.maximumKeys = maximumKeys
        }

        /// `nil` when the entry is to be left out; else how many were left out before it.
        mutating func admit(_ key: String, now: ContinuousClock.Instant) -> Int? {
            if windows.count >= maximumKeys && windows[key] == nil {
                windows = windows.filter { now - $0.value.start < interval }
            }
            let key = windows.count >= maximumKeys && windows[key] == nil ? "(other)" : key
            var window = windows[key] ?? (now, 0, 0)
            if now - window.start >= interval {
                let suppressed = window.suppressed
                window = (now, 1, 0)
                windows[key] = window
                return suppressed
            }
            guard window.admitted < burst else {
                window.suppressed += 1
                windows[key] = window
                return nil
            }
            window.admitted += 1
            windows[key] = window
            return 0
        }
    }

    public func error(_ message: String, session: String? = nil) { log(.error, message, session: session) }
    public func warning(_ message: String, session: String? = nil) { log(.warning, message, session: session) }
    public func notice(_ message: String, session: String? = nil) { log(.notice, message, session: session) }
    public func info(_ message: String, session: String? = nil) { log(.info, message, session: session) }
    public func debug(_ message: String, session: String? = nil) { log(.debug, message, session: session) }
}
