#if canImport(Glibc)
import Glibc
#endif
import CLinux

/// A failed socket operation: what was attempted and the `errno` it ended with.
public struct SocketError: Error, Sendable, Equatable, CustomStringConvertible {
    public var operation: String
    public var errno: Int32

    public init(_ operation: String, errno: Int32 = Glibc.errno) {
        self.operation = operation
        self.errno = errno
    }

    public var description: String { "\(operation): \(String(cString: strerror(errno)))" }
}

/// A varlink address: `unix:/path`, `unix:@abstract` or a bare path. Anything after `;` is a
/// parameter and ignored.
public struct VarlinkAddress: Sendable, Equatable, CustomStringConvertible {
    /// The socket path; a leading `@` names an abstract socket.
    public var path: String

    public init(path: String) { self.path = path }

    public init?(_ text: String) {
        var rest = Substring(text)
        if let semicolon = rest.firstIndex(of: ";") { rest = rest[..<semicolon] }
        if rest.hasPrefix("unix:") { rest = rest.dropFirst(5) } else if !rest.hasPrefix("/") && !rest.hasPrefix("@") { return nil }
        guard !rest.isEmpty else { return nil }
        path = String(rest)
    }

    public var description: String { "unix:\(path)" }
}

/// Thin helpers over AF_UNIX stream sockets.
public enum UnixSocket {
    /// Fills a `sockaddr_un` for `path` (`@name`: abstract) and calls `body` with it.
    static func withAddress<R>(_ path: String, _ body: (UnsafePointer<sockaddr>, socklen_t) -> R) throws(SocketError) -> R {
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        var bytes = Array(path.utf8)
        let abstract = bytes.first == UInt8(ascii: "@")
        if abstract { bytes[0] = 0 }
        let capacity = MemoryLayout.size(ofValue: address.sun_path)
        guard bytes.count < capacity else { throw SocketError("socket path too long", errno: ENAMETOOLONG) }
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            raw.copyBytes(from: bytes)
        }
        let length = socklen_t(MemoryLayout<sa_family_t>.size + bytes.count + (abstract ? 0 : 1))
        return withUnsafePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { body($0, length) }
        }
    }

    /// A new AF_UNIX stream socket, close-on-exec.
    static func makeSocket(nonBlocking: Bool) throws(SocketError) -> Int32 {
        var type = Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue)
        if nonBlocking { type |= Int32(SOCK_NONBLOCK.rawValue) }
        let fd = socket(AF_UNIX, type, 0)
        guard fd >= 0 else { throw SocketError("socket") }
        return fd
    }

    /// Binds and listens on `path`. The caller decides what to do with an existing file.
    public static func listen(path: String, backlog: Int32 = 4096) throws(SocketError) -> Int32 {
        let fd = try makeSocket(nonBlocking: true)
        let bound = try withAddress(path) { bind(fd, $0, $1) }
        guard bound == 0 else {
            let error = SocketError("bind \(path)")
            close(fd)
            throw error
        }
        guard Glibc.listen(fd, backlog) == 0 else {
            let error = SocketError("listen \(path)")
            close(fd)
            throw error
        }
        return fd
    }

    /// Connects a blocking socket to `path`.
    public static func connect(path: String) throws(SocketError) -> Int32 {
        let fd = try makeSocket(nonBlocking: false)
        let rc = try withAddress(path) { Glibc.connect(fd, $0, $1) }
        guard rc == 0 else {
            let error = SocketError("connect \(path)")
            close(fd)
            throw error
        }
        return fd
    }

    /// Whether something listens on `path`, without ever blocking: a listener whose backlog is
    /// full counts as listening.
    public static func isListening(_ path: String) -> Bool {
        guard let fd = try? makeSocket(nonBlocking: true) else { return false }
        defer { close(fd) }
        guard let rc = try? withAddress(path, { Glibc.connect(fd, $0, $1) }) else { return false }
        return rc == 0 || errno == EAGAIN || errno == EINPROGRESS
    }

    public static func setNonBlocking(_ fd: Int32) throws(SocketError) {
        let flags = fcntl(fd, F_GETFL)
        guard flags >= 0, fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0 else { throw SocketError("fcntl O_NONBLOCK") }
    }

    /// Sets send and receive timeouts on a blocking socket (0: none).
    public static func setTimeout(_ fd: Int32, seconds: Double) {
        var timeout = timeval(tv_sec: Int(seconds), tv_usec: Int((seconds - Double(Int(seconds))) * 1_000_000))
        _ = setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        _ = setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
    }

    /// The peer of a connected socket: pid, uid, gid and supplementary groups.
    public static func peer(_ fd: Int32) -> PeerCredentials? {
        var pid: Int32 = 0
        var uid: UInt32 = 0
        var gid: UInt32 = 0
        guard tb_peer_credentials(fd, &pid, &uid, &gid) == 0 else { return nil }
        var groups = [UInt32](repeating: 0, count: 64)
        var count: Int32 = 0
        if tb_peer_groups(fd, &groups, Int32(groups.count), &count) != 0 {
            if Glibc.errno == ERANGE && count > 0 {
                groups = [UInt32](repeating: 0, count: Int(count))
                if tb_peer_groups(fd, &groups, count, &count) != 0 { count = 0 }
            } else {
                count = 0
            }
        }
        return PeerCredentials(pid: pid, uid: uid, gid: gid, groups: Array(groups.prefix(Int(max(count, 0)))))
    }
}

/// Who is on the other end of a connection, as the kernel saw it at `connect()`.
public struct PeerCredentials: Sendable, Equatable, CustomStringConvertible {
    public var pid: Int32
    public var uid: UInt32
    public var gid: UInt32
    /// Supplementary groups (SO_PEERGROUPS).
    public var groups: [UInt32]
    /// The listening socket the peer connected to: 0 for the server's own, else the id an extra
    /// listener was added with (`VarlinkServer.addListener`). Set by the server, not the kernel.
    public var listener: UInt32 = 0

    public init(pid: Int32, uid: UInt32, gid: UInt32, groups: [UInt32] = [], listener: UInt32 = 0) {
        self.pid = pid
        self.uid = uid
        self.gid = gid
        self.groups = groups
        self.listener = listener
    }

    /// Whether the peer is in group `gid`, as primary or supplementary group.
    public func isMember(of gid: UInt32) -> Bool { self.gid == gid || groups.contains(gid) }

    public var description: String { "pid \(pid) uid \(uid)" + (listener == 0 ? "" : " through delegation #\(listener)") }
}
