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

    public init(level: LogLevel = .info, journal: Bool = false) {
        minimum = Mutex(level)
        self.journal = journal
    }

    public var level: LogLevel {
        get { minimum.withLock { $0 } }
        set { minimum.withLock { $0 = newValue } }
    }

    public func log(_ level: LogLevel, _ message: String, session: String? = nil, generation: Int? = nil, tokenSerial: UInt64? = nil) {
        guard level <= self.level else { return }
        // One entry per line: a newline inside a message would forge a second entry.
        let flat = String(message.map { $0 == "\n" ? " " : $0 })
        if journal {
            var fields = ["MESSAGE=\(flat)", "PRIORITY=\(level.rawValue)", "SYSLOG_IDENTIFIER=tokenbroker"]
            if let session { fields.append("SESSION=\(session)") }
            if let generation { fields.append("GENERATION=\(generation)") }
            if let tokenSerial { fields.append("TOKEN_SERIAL=\(tokenSerial)") }
            Systemd.journal(fields)
            return
        }
        var bytes = Array("<\(level.rawValue)>\(flat)\n".utf8)
        _ = bytes.withUnsafeMutableBytes { write(2, $0.baseAddress, $0.count) }
    }

    public func error(_ message: String, session: String? = nil) { log(.error, message, session: session) }
    public func warning(_ message: String, session: String? = nil) { log(.warning, message, session: session) }
    public func notice(_ message: String, session: String? = nil) { log(.notice, message, session: session) }
    public func info(_ message: String, session: String? = nil) { log(.info, message, session: session) }
    public func debug(_ message: String, session: String? = nil) { log(.debug, message, session: session) }
}
