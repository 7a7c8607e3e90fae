#if canImport(Glibc)
import Glibc
#endif
import Basics
import Synchronization
import TokenBrokerCore
import Varlink

/// What an `HTTPListener` does with one request, once its head is whole.
enum HTTPRouting: Sendable {
    /// Answer now with these bytes (`HTTPListener.response`); `refusal` is counted when given.
    case answer([UInt8], refusal: String?)
    /// Answer with what `work` returns, run as a task (at most `concurrentWork` at once; a
    /// connection whose work takes longer than `workDeadline` gets a 503 instead).
    case work(@Sendable () async -> [UInt8])
}

/// The bounds of an `HTTPListener`.
struct HTTPListenerLimits: Sendable {
    var maximumConnections = 256
    /// Per uid, on a Unix socket.
    var maximumPerUser = 16
    var concurrentWork = 4
    var firstByteDeadline = Duration.seconds(1)
    var requestDeadline = Duration.seconds(2)
    var answerDeadline = Duration.seconds(5)
    var workDeadline = Duration.seconds(5)
    /// The longest request head read, in bytes (longer: 431).
    var longestRequest = 8192
}

/// Where an HTTP listener serves: a loopback TCP address or a Unix socket path (`MetricsListen=`, a code login's redirect).
public enum ListenAddress: Sendable, Equatable, CustomStringConvertible {
    case tcp(host: String, port: UInt16)
    case unix(path: String)

    /// `127.0.0.1:9464`, `[::1]:9464`, `localhost:9464` or `/run/tokenbroker/metrics.sock`;
    /// nil for anything else (an address that is not loopback included).
    public init?(_ text: String) {
        if text.hasPrefix("/") {
            guard text.utf8.count < 108 else { return nil }
            self = .unix(path: text)
            return
        }
        guard let colon = text.lastIndex(of: ":"), let port = UInt16(text[text.index(after: colon)...]), port > 0 else { return nil }
        var host = String(text[..<colon])
        if host == "localhost" { host = "127.0.0.1" }
        if host == "[::1]" {
            self = .tcp(host: "::1", port: port)
            return
        }
        var address = in_addr()
        guard inet_pton(AF_INET, host, &address) == 1, UInt32(bigEndian: address.s_addr) >> 24 == 127 else { return nil }
        self = .tcp(host: host, port: port)
    }

    public var description: String {
        switch self {
        case let .tcp(host, port): return host.contains(":") ? "[\(host)]:\(port)" : "\(host):\(port)"
        case let .unix(path): return path
        }
    }
}

/// A minimal HTTP/1.1 server, one thread with a poll loop: every connection is non-blocking,
/// with `firstByteDeadline` for its first byte and `requestDeadline` for its whole request head
/// (`longestRequest` at most, no body read); at most `maximumConnections` at once (when full,
/// the oldest that has not got its answer makes room), `maximumPerUser` per uid on a Unix
/// socket. Idle or slow clients cost a slot, never another client's answer, and never a token
/// call. What to answer is the `route`'s business: `MetricsServer` and `RedirectListener`.
final class HTTPListener: Sendable {
    private let fd: Int32
    private let wakeRead: Int32
    private let wakeWrite: Int32
    let address: ListenAddress
    /// The port bound (the one asked for, or the one the kernel chose for port 0); 0 on a Unix socket.
    let port: UInt16
    let limits: HTTPListenerLimits

    /// - Parameter group: the Unix socket's group (so that its members can connect); the
    ///   daemon's own when nil.
    init(_ address: ListenAddress, group: UInt32? = nil, limits: HTTPListenerLimits = HTTPListenerLimits()) throws(SocketError) {
        self.address = address
        self.limits = limits
        work = TaskPool(limit: max(1, limits.concurrentWork))
        switch address {
        case let .unix(path):
            do {
                fd = try SocketPath.bind(path, mode: 0o660, group: group).fd
            } catch {
                throw SocketError("\(error)")
            }
            _ = fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK)
            port = 0
        case let .tcp(host, port):
            let v6 = host.contains(":")
            let socketFD = socket(v6 ? AF_INET6 : AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
            guard socketFD >= 0 else { throw SocketError("socket") }
            var one: Int32 = 1
            setsockopt(socketFD, SOL_SOCKET, SO_REUSEADDR, &one, socklen_t(MemoryLayout<Int32>.size))
            var bound: Int32
            var chosen: UInt16
            if v6 {
                var sockaddr = sockaddr_in6()
                (sockaddr.sin6_family, sockaddr.sin6_port) = (sa_family_t(AF_INET6), port.bigEndian)
                inet_pton(AF_INET6, host, &sockaddr.sin6_addr)
                (bound, chosen) = Self.bind(socketFD, &sockaddr, port: port) { UInt16(bigEndian: $0.sin6_port) }
            } else {
                var sockaddr = sockaddr_in()
                (sockaddr.sin_family, sockaddr.sin_port) = (sa_family_t(AF_INET), port.bigEndian)
                inet_pton(AF_INET, host, &sockaddr.sin_addr)
                (bound, chosen) = Self.bind(socketFD, &sockaddr, port: port) { UInt16(bigEndian: $0.sin_port) }
            }
            if bound == 0 { bound = listen(socketFD, 128) }
            guard bound == 0 else {
                let error = SocketError("bind \(address)")
                close(socketFD)
                throw error
            }
            _ = fcntl(socketFD, F_SETFL, fcntl(socketFD, F_GETFL) | O_NONBLOCK)
            fd = socketFD
            self.port = chosen
        }
        var pipeFDs: [Int32] = [-1, -1]
        guard pipe(&pipeFDs) == 0 else {
            close(fd)
            throw SocketError("pipe")
        }
        for end in pipeFDs {
            _ = fcntl(end, F_SETFL, fcntl(end, F_GETFL) | O_NONBLOCK)
            _ = fcntl(end, F_SETFD, FD_CLOEXEC)
        }
        wakeRead = pipeFDs[0]
        wakeWrite = pipeFDs[1]
    }

    /// Binds `fd` to `address`; with port 0, reads back the port the kernel chose (`chosen`).
    private static func bind<Address>(_ fd: Int32, _ address: inout Address, port: UInt16, chosen: (Address) -> UInt16) -> (Int32, UInt16) {
        let bound = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.bind(fd, $0, socklen_t(MemoryLayout<Address>.size)) }
        }
        guard bound == 0, port == 0, name(fd, &address) == 0 else { return (bound, port) }
        return (bound, chosen(address))
    }

    private static func name<Address>(_ fd: Int32, _ address: inout Address) -> Int32 {
        var length = socklen_t(MemoryLayout<Address>.size)
        return withUnsafeMutablePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) }
        }
    }

    private struct Connection {
        var fd: Int32
        var peer: PeerCredentials?
        var accepted: ContinuousClock.Instant
        var request: [UInt8] = []
        /// Set once the answer is ready: the bytes and how many are sent.
        var answer: [UInt8]?
        var sent = 0
        var answerStarted: ContinuousClock.Instant?
        /// While a work task works on it: since when, and its serial (a descriptor number is
        /// reused once closed; an answer goes only to the connection it was made for).
        var working = false
        var workStarted: ContinuousClock.Instant?
        var serial: UInt64 = 0
    }

    /// Answers handed back by work tasks, for the loop to send.
    private let finished = Mutex<[(Int32, UInt64, [UInt8])]>([])

    /// Serves until `stop()`. `route(head, peer)` says what to answer a whole request head
    /// (`peer`: on a Unix socket); `refused(reason)` counts requests not answered as asked
    /// (the route's refusals, and busy, timeout, full).
    func start(route: @escaping @Sendable ([UInt8], PeerCredentials?) -> HTTPRouting, refused: @escaping @Sendable (String) -> Void) {
        spawnThread { [self] in
            loop(route, refused)
            close(fd)
            if case let .unix(path) = address { unlink(path) }
            ended.fire()
        }
    }

    /// Waits, up to `deadline`, until the loop's thread has closed the listener and every work
    /// task has ended (after `stop()` or `drain()`); false when something was still running.
    /// The work tasks belong to the listener's pool, so none outlives its owner unseen.
    func finished(within deadline: Duration) async -> Bool {
        let loopEnded = await ended.wait(upTo: deadline)
        return await work.close(within: deadline) && loopEnded
    }

    /// The wake pipe is closed only when nothing can write to it any more (work tasks and the
    /// loop's thread hold the listener): a descriptor number closed earlier could be reused by
    /// another part of the daemon, and a wake-up byte would land there.
    deinit {
        close(wakeRead)
        close(wakeWrite)
    }

    /// The requests' work (its `concurrentWork` tasks at most), awaited by `finished`.
    private let work: TaskPool
    /// Fires when the loop's thread has closed the listener.
    private let ended = Latch()
    private let stopped = Atomic<Bool>(false)
    private let draining = Atomic<Bool>(false)

    /// Ends the loop (which then closes the listener).
    func stop() {
        stopped.store(true, ordering: .releasing)
        wake()
    }

    /// Stops taking connections, and ends the loop once the answers under way are sent (or
    /// `drainDeadline` has passed); connections that have not sent a whole request are closed.
    func drain() {
        draining.store(true, ordering: .releasing)
        wake()
    }

    static let drainDeadline = Duration.seconds(5)

    private func wake() {
        var byte: UInt8 = 1
        _ = write(wakeWrite, &byte, 1)
    }

    private func loop(_ route: @escaping @Sendable ([UInt8], PeerCredentials?) -> HTTPRouting, _ refused: @escaping @Sendable (String) -> Void) {
        var connections: [Int32: Connection] = [:]
        var acceptPausedUntil: ContinuousClock.Instant?
        var serials: UInt64 = 0
        var drainUntil: ContinuousClock.Instant?
        func drop(_ fd: Int32) {
            connections[fd] = nil
            close(fd)
        }
        /// Reads what `client` has sent; once its request is whole, answers or starts its work.
        func readRequest(_ client: Int32) {
            guard var connection = connections[client] else { return }
            var buffer = [UInt8](repeating: 0, count: 4096)
            let count = read(client, &buffer, buffer.count)
            if count == 0 || (count < 0 && errno != EAGAIN && errno != EINTR) {
                drop(client)
                return
            }
            guard count > 0 else { return }
            connection.request += buffer[..<count]
            connections[client] = connection
            if connection.request.count > limits.longestRequest {
                connections[client]?.answer = Self.response(431, "request header fields too large\n")
                connections[client]?.answerStarted = .now
                return
            }
            guard connection.request.contains(subsequence: [13, 10, 13, 10]) else { return }
            switch route(connection.request, connection.peer) {
            case let .answer(bytes, reason):
                if let reason { refused(reason) }
                connections[client]?.answer = bytes
                connections[client]?.answerStarted = .now
            case let .work(work):
                let client = client
                let serial = serials + 1
                let started = self.work.spawn { [self] in
                    let answer = await work()
                    finished.withLock { $0.append((client, serial, answer)) }
                    wake()
                }
                guard started != nil else {
                    refused("busy")
                    connections[client]?.answer = Self.response(503, "busy\n")
                    connections[client]?.answerStarted = .now
                    return
                }
                serials = serial
                connections[client]?.working = true
                connections[client]?.workStarted = .now
                connections[client]?.serial = serial
            }
        }
        while !stopped.load(ordering: .acquiring) {
            // Answers that are ready.
            for (client, serial, answer) in finished.withLock({ list in defer { list = [] }; return list }) {
                guard connections[client]?.serial == serial, connections[client]?.working == true else { continue }
                connections[client]?.answer = answer
                connections[client]?.answerStarted = .now
                connections[client]?.working = false
            }
            let now = ContinuousClock.now
            if draining.load(ordering: .acquiring) {
                if drainUntil == nil {
                    drainUntil = now + Self.drainDeadline
                    for (client, connection) in connections where connection.answer == nil && !connection.working { drop(client) }
                }
                if connections.isEmpty || drainUntil! <= now { break }
                acceptPausedUntil = drainUntil
            }
            if let paused = acceptPausedUntil, paused <= now { acceptPausedUntil = nil }
            // (While out of descriptors, the listener is left alone for a moment: no busy loop.)
            var polled = [pollfd(fd: acceptPausedUntil == nil ? fd : -1, events: Int16(POLLIN), revents: 0),
                          pollfd(fd: wakeRead, events: Int16(POLLIN), revents: 0)]
            var nextDeadline = acceptPausedUntil ?? now + .seconds(1)
            for (client, connection) in connections {
                let deadline: ContinuousClock.Instant
                if connection.working {
                    // The work did not end in time: 503, and its answer is dropped.
                    let limit = (connection.workStarted ?? now) + limits.workDeadline
                    if limit <= now {
                        refused("busy")
                        connections[client]?.working = false
                        connections[client]?.answer = Self.response(503, "the daemon did not answer in time\n")
                        connections[client]?.answerStarted = now
                    }
                    nextDeadline = min(nextDeadline, limit)
                    continue
                } else if connection.answer != nil {
                    deadline = (connection.answerStarted ?? now) + limits.answerDeadline
                } else {
                    deadline = connection.accepted + (connection.request.isEmpty ? limits.firstByteDeadline : limits.requestDeadline)
                }
                if deadline <= now {
                    if connection.answer == nil { refused("timeout") }
                    drop(client)
                    continue
                }
                nextDeadline = min(nextDeadline, deadline)
                polled.append(pollfd(fd: client, events: Int16(connection.answer == nil ? POLLIN : POLLOUT), revents: 0))
            }
            let wait = now.duration(to: nextDeadline)
            let milliseconds = Int32(max(1, min(1000, wait.components.seconds * 1000 + wait.components.attoseconds / 1_000_000_000_000_000 + 1)))
            guard poll(&polled, nfds_t(polled.count), milliseconds) >= 0 || errno == EINTR else { break }
            if polled[1].revents != 0 {
                var buffer = [UInt8](repeating: 0, count: 64)
                while read(wakeRead, &buffer, buffer.count) > 0 {}
            }
            for entry in polled.dropFirst(2) where entry.revents != 0 {
                guard var connection = connections[entry.fd] else { continue }
                if connection.answer != nil {
                    let left = connection.answer![connection.sent...]
                    let count = left.withUnsafeBytes { send(entry.fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) }
                    if count > 0 { connection.sent += count }
                    if count <= 0 && errno != EAGAIN && errno != EINTR || connection.sent >= connection.answer!.count {
                        drop(entry.fd)
                        continue
                    }
                    connections[entry.fd] = connection
                    continue
                }
                readRequest(entry.fd)
            }
            // New connections.
            if polled[0].revents != 0 {
                while true {
                    let client = accept(fd, nil, nil)
                    if client < 0 {
                        if errno == EINTR || errno == ECONNABORTED { continue }
                        // Out of descriptors: the token calls come first.
                        if errno == EMFILE || errno == ENFILE { acceptPausedUntil = .now + .milliseconds(100) }
                        break
                    }
                    _ = fcntl(client, F_SETFD, FD_CLOEXEC)
                    _ = fcntl(client, F_SETFL, fcntl(client, F_GETFL) | O_NONBLOCK)
                    var peer: PeerCredentials?
                    if case .unix = address {
                        peer = UnixSocket.peer(client)
                        let uid = peer?.uid
                        if connections.values.count(where: { $0.peer?.uid == uid }) >= limits.maximumPerUser {
                            refused("full")
                            close(client)
                            continue
                        }
                    }
                    if connections.count >= limits.maximumConnections {
                        // The oldest connection that has sent nothing makes room.
                        // (Whatever it has sent: one byte must not make a connection unevictable.
                        // A client sends its request within milliseconds of connecting.)
                        guard let idle = connections.values.filter({ $0.answer == nil && !$0.working })
                            .min(by: { $0.accepted < $1.accepted }) else {
                            refused("full")
                            close(client)
                            continue
                        }
                        refused("timeout")
                        drop(idle.fd)
                    }
                    connections[client] = Connection(fd: client, peer: peer, accepted: .now)
                    // A request is usually there already: read it now, so that no flood of new
                    // connections can push it out before the next turn of the loop.
                    readRequest(client)
                }
            }
        }
        for client in connections.keys { close(client) }
        // Work tasks still running find their connection gone: their answers are dropped.
    }

    /// A whole HTTP/1.1 answer that closes the connection.
    static func response(_ status: Int, _ body: String, type: String = "text/plain; charset=utf-8", length: Int? = nil,
                         extra: String = "") -> [UInt8] {
        let reason = [200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
                      409: "Conflict", 410: "Gone", 431: "Request Header Fields Too Large", 503: "Service Unavailable"][status] ?? "Error"
        return Array("HTTP/1.1 \(status) \(reason)\r\nContent-Type: \(type)\r\nContent-Length: \(length ?? body.utf8.count)\r\n\(extra)".utf8)
            + Array("Connection: close\r\n\r\n".utf8) + Array(body.utf8)
    }

    /// The value of the header `name` (lower-case) in a request head, trimmed; nil when absent
    /// (the first of several).
    static func header(_ name: String, in head: [UInt8]) -> String? {
        let text = String(decoding: head, as: UTF8.self)
        for line in text.split(separator: "\r\n", omittingEmptySubsequences: false).dropFirst() {
            if line.isEmpty { break }
            guard let colon = line.firstIndex(of: ":"), line[..<colon].lowercased() == name else { continue }
            var value = line[line.index(after: colon)...]
            while value.first == " " || value.first == "\t" { value = value.dropFirst() }
            while value.last == " " || value.last == "\t" { value = value.dropLast() }
            return String(value)
        }
        return nil
    }

    /// The request line of a head: its method and target, nil when it is not `METHOD TARGET HTTP/1.x`.
    static func requestLine(_ head: [UInt8]) -> (method: Substring, target: Substring)? {
        let end = head.firstIndex(of: 13) ?? head.endIndex
        let line = String(decoding: head[..<end], as: UTF8.self)
        let words = line.split(separator: " ", omittingEmptySubsequences: false)
        guard words.count == 3, words[2].hasPrefix("HTTP/1."), !words[0].isEmpty, !words[1].isEmpty else { return nil }
        return (words[0], words[1])
    }
}

private extension Array where Element == UInt8 {
    func contains(subsequence: [UInt8]) -> Bool {
        guard count >= subsequence.count else { return false }
        for start in 0...(count - subsequence.count) where self[start..<(start + subsequence.count)].elementsEqual(subsequence) { return true }
        return false
    }
}
