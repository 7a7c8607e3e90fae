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

/// Writes one line per message to stderr with a `<N>` priority prefix, which journald reads
/// as the priority (SyslogLevelPrefix=). Messages name sessions, generations, token serials,
/// uids and pids; never a token or a secret.
public final class Logger: Sendable {
    private let minimum: Mutex<LogLevel>

    public init(level: LogLevel = .info) {
        minimum = Mutex(level)
    }

    public var level: LogLevel {
        get { minimum.withLock { $0 } }
        set { minimum.withLock { $0 = newValue } }
    }

    public func log(_ level: LogLevel, _ message: String) {
        guard level <= self.level else { return }
        var line = "<\(level.rawValue)>"
        // One entry per line: a newline inside a message would forge a second entry.
        for character in message { line.append(character == "\n" ? " " : character) }
        line.append("\n")
        var bytes = Array(line.utf8)
        _ = bytes.withUnsafeMutableBytes { write(2, $0.baseAddress, $0.count) }
    }

    public func error(_ message: String) { log(.error, message) }
    public func warning(_ message: String) { log(.warning, message) }
    public func notice(_ message: String) { log(.notice, message) }
    public func info(_ message: String) { log(.info, message) }
    public func debug(_ message: String) { log(.debug, message) }
}
