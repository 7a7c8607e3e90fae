#if canImport(Glibc)
import Glibc
#endif
import CSystemd

/// The service manager's side of the daemon: `sd_notify` messages, the watchdog, and socket
/// activation. Without systemd (no `NOTIFY_SOCKET`, no `LISTEN_FDS`) every call is a no-op.
enum Systemd {
    /// Sends one notification (newline-separated `KEY=VALUE` lines).
    static func notify(_ state: String) {
        _ = sd_notify(0, state)
    }

    static func ready(status: String) { notify("READY=1\nSTATUS=\(oneLine(status))") }
    static func status(_ status: String) { notify("STATUS=\(oneLine(status))") }
    static func stopping() { notify("STOPPING=1\nSTATUS=stopping") }
    static func watchdog() { notify("WATCHDOG=1") }
    /// The current start, run or stop timeout is extended: systemd must hear from the daemon
    /// again within `duration`.
    static func extendTimeout(by duration: Duration) {
        notify("EXTEND_TIMEOUT_USEC=\(duration.components.seconds * 1_000_000 + duration.components.attoseconds / 1_000_000_000_000)")
    }

    /// `RELOADING=1` with the monotonic time the reload starts (systemd ≥ 253 uses it; 252
    /// ignores it).
    static func reloading() {
        var now = timespec()
        clock_gettime(CLOCK_MONOTONIC, &now)
        let microseconds = UInt64(now.tv_sec) * 1_000_000 + UInt64(now.tv_nsec) / 1000
        notify("RELOADING=1\nMONOTONIC_USEC=\(microseconds)\nSTATUS=reloading")
    }

    /// Half the watchdog timeout when the watchdog is on for this process.
    static func watchdogInterval() -> Duration? {
        var microseconds: UInt64 = 0
        guard sd_watchdog_enabled(0, &microseconds) > 0, microseconds > 0 else { return nil }
        return .microseconds(Int64(microseconds / 2))
    }

    enum ActivationError: Error, CustomStringConvertible {
        case tooMany(Int32)
        case notAListeningUnixStreamSocket
        case failed(Int32)

        var description: String {
            switch self {
            case let .tooMany(count): return "socket activation passed \(count) sockets; tokenbroker takes exactly one"
            case .notAListeningUnixStreamSocket: return "the socket systemd passed is not a listening AF_UNIX stream socket"
            case let .failed(code): return "sd_listen_fds failed: \(String(cString: strerror(-code)))"
            }
        }
    }

    /// The listening socket systemd passed (`LISTEN_FDS`), or `nil` when none was passed. The
    /// variables are removed so children do not inherit them.
    static func activatedListener() throws(ActivationError) -> Int32? {
        let count = sd_listen_fds(1)
        guard count >= 0 else { throw .failed(count) }
        guard count > 0 else { return nil }
        guard count == 1 else { throw .tooMany(count) }
        let fd = SD_LISTEN_FDS_START
        guard sd_is_socket_unix(fd, Int32(SOCK_STREAM.rawValue), 1, nil, 0) > 0 else { throw .notAListeningUnixStreamSocket }
        return fd
    }

    /// Whether stderr is connected to the journal (`JOURNAL_STREAM` names its device and inode).
    static func stderrIsJournal() -> Bool {
        guard let value = getenv("JOURNAL_STREAM").map({ String(cString: $0) }) else { return false }
        let parts = value.split(separator: ":")
        var info = stat()
        guard parts.count == 2, let device = UInt64(parts[0]), let inode = UInt64(parts[1]), fstat(2, &info) == 0 else { return false }
        return UInt64(info.st_dev) == device && UInt64(info.st_ino) == inode
    }

    /// Sends one structured journal entry.
    static func journal(_ fields: [String]) {
        let copies = fields.map { strdup($0)! }
        defer { copies.forEach { free($0) } }
        var vectors = copies.map { iovec(iov_base: UnsafeMutableRawPointer($0), iov_len: strlen($0)) }
        _ = sd_journal_sendv(&vectors, Int32(vectors.count))
    }

    private static func oneLine(_ text: String) -> String {
        String(text.map { $0 == "\n" ? " " : $0 })
    }
}
