#if canImport(Glibc)
import Glibc
#endif
import CSystemd

/// The service manager's side of the daemon: notifications, the watchdog, socket activation
/// and the journal. Without systemd (no `NOTIFY_SOCKET`, no `LISTEN_FDS`) every call is a
/// no-op.
///
/// The notification and socket-activation protocols are spoken here, as sd_notify(3) and
/// sd_listen_fds(3) describe them (stable interfaces, meant to be reimplemented): linking
/// libsystemd for them loaded it and six libraries more between exec and READY=1. The journal
/// is libsystemd's `sd_journal_sendv`, loaded at the first entry (`CSystemd`).
enum Systemd {
    /// Sends one notification (newline-separated `KEY=VALUE` lines) to `NOTIFY_SOCKET`: an
    /// absolute path or, with a leading `@`, an abstract socket. Anything else (unset, empty,
    /// relative, too long, another family) sends nothing, as libsystemd does. Each call uses
    /// a socket of its own, so any thread may notify.
    static func notify(_ state: String) {
        guard let variable = getenv("NOTIFY_SOCKET") else { return }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        let capacity = MemoryLayout.size(ofValue: address.sun_path)
        let length = strlen(variable)
        let abstract = variable[0] == CChar(UInt8(ascii: "@"))
        guard length >= 2, length < capacity, abstract || variable[0] == CChar(UInt8(ascii: "/")) else { return }
        withUnsafeMutableBytes(of: &address.sun_path) { path in
            path.copyMemory(from: UnsafeRawBufferPointer(start: variable, count: length))
            if abstract { path[0] = 0 }
        }
        // A path's terminating NUL is counted; an abstract name is exactly its bytes.
        let size = MemoryLayout<sa_family_t>.size + length + (abstract ? 0 : 1)
        let fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { return }
        defer { close(fd) }
        var message = state
        message.withUTF8 { bytes in
            withUnsafePointer(to: &address) { pointer in
                pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                    _ = sendto(fd, bytes.baseAddress, bytes.count, Int32(MSG_NOSIGNAL), $0, socklen_t(size))
                }
            }
        }
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

    /// Half the watchdog timeout when the watchdog is on for this process: `WATCHDOG_USEC` a
    /// positive number of microseconds, and `WATCHDOG_PID`, when set, this process's pid.
    static func watchdogInterval() -> Duration? {
        guard let microseconds = variable("WATCHDOG_USEC").flatMap({ UInt64($0) }), microseconds > 0,
              microseconds < UInt64(Int64.max) else { return nil }
        if let pid = variable("WATCHDOG_PID"), pid_t(pid) != getpid() { return nil }
        return .microseconds(Int64(microseconds / 2))
    }

    enum ActivationError: Error, CustomStringConvertible {
        case tooMany(Int)
        case notAListeningUnixStreamSocket
        case invalid(String)

        var description: String {
            switch self {
            case let .tooMany(count): return "socket activation passed \(count) sockets; tokenbroker takes exactly one"
            case .notAListeningUnixStreamSocket: return "the socket systemd passed is not a listening AF_UNIX stream socket"
            case let .invalid(why): return "socket activation: \(why)"
            }
        }
    }

    /// The first passed descriptor (`SD_LISTEN_FDS_START`).
    static let firstPassedDescriptor: Int32 = 3

    /// The listening socket systemd passed, or `nil` when none was passed to this process
    /// (`LISTEN_PID` unset or another process's, `LISTEN_FDS` unset or 0). `LISTEN_PID`,
    /// `LISTEN_FDS` and `LISTEN_FDNAMES` are removed, whatever they held, so that no child
    /// inherits them; the passed descriptors are made close-on-exec.
    static func activatedListener() throws(ActivationError) -> Int32? {
        let pidText = variable("LISTEN_PID"), countText = variable("LISTEN_FDS")
        unsetenv("LISTEN_PID")
        unsetenv("LISTEN_FDS")
        unsetenv("LISTEN_FDNAMES")
        guard let pidText else { return nil }
        guard let pid = pid_t(pidText), pid > 0 else { throw .invalid("LISTEN_PID is not a process id") }
        guard pid == getpid(), let countText else { return nil }
        guard let count = Int(countText), count >= 0, count <= 65_536 else { throw .invalid("LISTEN_FDS is not a count of descriptors") }
        guard count > 0 else { return nil }
        for fd in firstPassedDescriptor..<firstPassedDescriptor + Int32(count) {
            let flags = fcntl(fd, F_GETFD)
            guard flags >= 0, fcntl(fd, F_SETFD, flags | FD_CLOEXEC) == 0 else {
                throw .invalid("descriptor \(fd) was not passed: \(String(cString: strerror(errno)))")
            }
        }
        guard count == 1 else { throw .tooMany(count) }
        guard isListeningUnixStream(firstPassedDescriptor) else { throw .notAListeningUnixStreamSocket }
        return firstPassedDescriptor
    }

    /// Whether `fd` is an `AF_UNIX` stream socket that listens.
    static func isListeningUnixStream(_ fd: Int32) -> Bool {
        var info = stat()
        guard fstat(fd, &info) == 0, info.st_mode & S_IFMT == S_IFSOCK else { return false }
        var value: Int32 = 0
        var size = socklen_t(MemoryLayout<Int32>.size)
        guard getsockopt(fd, SOL_SOCKET, SO_TYPE, &value, &size) == 0, value == Int32(SOCK_STREAM.rawValue) else { return false }
        size = socklen_t(MemoryLayout<Int32>.size)
        guard getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &value, &size) == 0, value == 1 else { return false }
        var address = sockaddr_storage()
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        let named = withUnsafeMutablePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) }
        }
        return named == 0 && length >= socklen_t(MemoryLayout<sa_family_t>.size) && address.ss_family == sa_family_t(AF_UNIX)
    }

    /// Whether stderr is connected to the journal (`JOURNAL_STREAM` names its device and inode).
    static func stderrIsJournal() -> Bool {
        guard let value = variable("JOURNAL_STREAM") else { return false }
        let parts = value.split(separator: ":")
        var info = stat()
        guard parts.count == 2, let device = UInt64(parts[0]), let inode = UInt64(parts[1]), fstat(2, &info) == 0 else { return false }
        return UInt64(info.st_dev) == device && UInt64(info.st_ino) == inode
    }

    /// Sends one structured journal entry; false when it was not sent (libsystemd.so.0 could
    /// not be loaded, or the journal refused it), for the caller to write the line instead.
    static func journal(_ fields: [String]) -> Bool {
        let copies = fields.map { strdup($0)! }
        defer { copies.forEach { free($0) } }
        let vectors = copies.map { iovec(iov_base: UnsafeMutableRawPointer($0), iov_len: strlen($0)) }
        return tb_journal_sendv(vectors, Int32(vectors.count)) >= 0
    }

    /// Opens the journal's library now rather than at the next entry; false if it could not.
    static func loadJournal() -> Bool { tb_journal_load() == 0 }

    /// Why the journal library could not be loaded, if it could not.
    static func journalFailure() -> String? {
        var reason = [CChar](repeating: 0, count: 256)
        tb_journal_failure(&reason, reason.count)
        let why = String(decoding: reason.prefix(while: { $0 != 0 }).map { UInt8(bitPattern: $0) }, as: UTF8.self)
        return why.isEmpty ? nil : why
    }

    private static func variable(_ name: String) -> String? {
        getenv(name).map { String(cString: $0) }
    }

    private static func oneLine(_ text: String) -> String {
        String(text.map { $0 == "\n" ? " " : $0 })
    }
}
