#if canImport(Glibc)
import Glibc
#endif
import Basics
import Dispatch
import Synchronization
import TokenBrokerCore
import Varlink

/// Where `MetricsListen=` serves: a loopback TCP address or a Unix socket path.
public enum MetricsAddress: Sendable, Equatable, CustomStringConvertible {
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

/// Who may read what of the exposition (`MetricsGroup=`, `MetricsBearerTokenFile=`).
struct MetricsAuthorization: Sendable {
    /// Whether a peer on a Unix socket may read the per-session series (admins, `MetricsGroup=`).
    var peerMayRead: @Sendable (PeerCredentials) -> Bool
    /// The bearer token a scraper must present for the per-session series (TCP or Unix).
    var bearerToken: Secret?

    /// What a request may see: the whole exposition, the daemon-wide part, or nothing.
    enum View: Equatable { case full, daemonOnly, forbidden, unauthorized }

    func view(peer: PeerCredentials?, authorization: String?) -> View {
        if let bearerToken, let authorization, authorization.count > 7, authorization.prefix(7).lowercased() == "bearer ",
           Self.constantTimeEqual(Array(authorization.utf8.dropFirst(7)), Array(bearerToken.reveal.utf8)) {
            return .full
        }
        if let peer { return peerMayRead(peer) ? .full : .forbidden }
        // TCP: session names only to a scraper that authenticates; none configured, none shown.
        return bearerToken == nil ? .daemonOnly : .unauthorized
    }

    static func constantTimeEqual(_ a: [UInt8], _ b: [UInt8]) -> Bool {
        var difference = UInt8(a.count == b.count ? 0 : 1)
        for index in 0..<max(a.count, b.count) {
            difference |= (index < a.count ? a[index] : 0) ^ (index < b.count ? b[index] : 0)
        }
        return difference == 0
    }
}

/// A minimal HTTP/1.1 server for `GET /metrics`, one thread with a poll loop: every connection
/// is non-blocking, with 1 s for its first byte and 2 s for its whole request (8K at most);
/// at most `maximumConnections` at once (when full, the oldest that has not sent its whole
/// request makes room), `maximumPerUser` per uid on a Unix socket. Idle or slow clients cost a slot, never a
/// scraper's answer, and never a token call. Renders run as tasks, `concurrentRenders` at once.
final class MetricsServer: Sendable {
    private let fd: Int32
    private let wakeRead: Int32
    private let wakeWrite: Int32
    let address: MetricsAddress

    /// - Parameter group: the Unix socket's group (`MetricsGroup=`, so that its members can
    ///   connect); the daemon's own when nil.
    init(_ address: MetricsAddress, group: UInt32? = nil) throws(SocketError) {
        self.address = address
        switch address {
        case let .unix(path):
            do {
                fd = try SocketPath.bind(path, mode: 0o660, group: group).fd
            } catch {
                throw SocketError("\(error)")
            }
            _ = fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK)
        case let .tcp(host, port):
            let v6 = host.contains(":")
            let socketFD = socket(v6 ? AF_INET6 : AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
            guard socketFD >= 0 else { throw SocketError("socket") }
            var one: Int32 = 1
            setsockopt(socketFD, SOL_SOCKET, SO_REUSEADDR, &one, socklen_t(MemoryLayout<Int32>.size))
            var bound: Int32
            if v6 {
                var sockaddr = sockaddr_in6()
                sockaddr.sin6_family = sa_family_t(AF_INET6)
                sockaddr.sin6_port = port.bigEndian
                inet_pton(AF_INET6, host, &sockaddr.sin6_addr)
                bound = Self.bind(socketFD, &sockaddr)
            } else {
                var sockaddr = sockaddr_in()
                sockaddr.sin_family = sa_family_t(AF_INET)
                sockaddr.sin_port = port.bigEndian
                inet_pton(AF_INET, host, &sockaddr.sin_addr)
                bound = Self.bind(socketFD, &sockaddr)
            }
            if bound == 0 { bound = listen(socketFD, 128) }
            guard bound == 0 else {
                let error = SocketError("bind \(address)")
                close(socketFD)
                throw error
            }
            _ = fcntl(socketFD, F_SETFL, fcntl(socketFD, F_GETFL) | O_NONBLOCK)
            fd = socketFD
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

    private static func bind<Address>(_ fd: Int32, _ address: inout Address) -> Int32 {
        withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.bind(fd, $0, socklen_t(MemoryLayout<Address>.size)) }
        }
    }

    static let maximumConnections = 256
    static let maximumPerUser = 16
    static let concurrentRenders = 4
    static let firstByteDeadline = Duration.seconds(1)
    static let requestDeadline = Duration.seconds(2)
    static let answerDeadline = Duration.seconds(5)
    static let renderDeadline = Duration.seconds(5)

    private struct Connection {
        var fd: Int32
        var peer: PeerCredentials?
        var accepted: ContinuousClock.Instant
        var request: [UInt8] = []
        /// Set once the answer is ready: the bytes and how many are sent.
        var answer: [UInt8]?
        var sent = 0
        var answerStarted: ContinuousClock.Instant?
        /// While a render task works on it: since when, and its serial (a descriptor number is
        /// reused once closed; an answer goes only to the connection it was made for).
        var rendering = false
        var renderStarted: ContinuousClock.Instant?
        var serial: UInt64 = 0
    }

    /// Answers handed back by render tasks, for the loop to send.
    private let finished = Mutex<[(Int32, UInt64, [UInt8])]>([])

    /// Serves until `stop()`. `render(openMetrics, full)` builds the exposition; `refused(reason)`
    /// counts scrapes not answered in full (forbidden, unauthorized, busy, timeout, full).
    func start(authorization: MetricsAuthorization, render: @escaping @Sendable (Bool, Bool) async -> String,
               refused: @escaping @Sendable (String) -> Void) {
        spawnThread { [self] in
            loop(authorization, render, refused)
            close(fd)
            if case let .unix(path) = address { unlink(path) }
        }
    }

    /// The wake pipe is closed only when nothing can write to it any more (render tasks and the
    /// loop's thread hold the server): a descriptor number closed earlier could be reused by
    /// another part of the daemon, and a wake-up byte would land there.
    deinit {
        close(wakeRead)
        close(wakeWrite)
    }

    private let stopped = Atomic<Bool>(false)
    private let rendering = Atomic<Int>(0)

    /// Ends the loop (which then closes the listener).
    func stop() {
        stopped.store(true, ordering: .releasing)
        wake()
    }

    private func wake() {
        var byte: UInt8 = 1
        _ = write(wakeWrite, &byte, 1)
    }

    private func loop(_ authorization: MetricsAuthorization, _ render: @escaping @Sendable (Bool, Bool) async -> String,
                      _ refused: @escaping @Sendable (String) -> Void) {
        var connections: [Int32: Connection] = [:]
        var acceptPausedUntil: ContinuousClock.Instant?
        var serials: UInt64 = 0
        func drop(_ fd: Int32) {
            connections[fd] = nil
            close(fd)
        }
        /// Reads what `client` has sent; once its request is whole, answers or starts its render.
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
            if connection.request.count > 8192 {
                connections[client]?.answer = Self.response(431, "request header fields too large\n")
                connections[client]?.answerStarted = .now
                return
            }
            guard connection.request.contains(subsequence: [13, 10, 13, 10]) else { return }
            let outcome = Self.parse(connection.request, peer: connection.peer, authorization)
            switch outcome {
            case let .answer(bytes, reason):
                if let reason { refused(reason) }
                connections[client]?.answer = bytes
                connections[client]?.answerStarted = .now
            case let .render(openMetrics, full, head):
                guard rendering.add(1, ordering: .relaxed).newValue <= Self.concurrentRenders else {
                    rendering.subtract(1, ordering: .relaxed)
                    refused("busy")
                    connections[client]?.answer = Self.response(503, "busy\n")
                    connections[client]?.answerStarted = .now
                    return
                }
                serials += 1
                connections[client]?.rendering = true
                connections[client]?.renderStarted = .now
                connections[client]?.serial = serials
                let client = client
                let serial = serials
                Task { [self] in
                    let text = await render(openMetrics, full)
                    let type = openMetrics ? "application/openmetrics-text; version=1.0.0; charset=utf-8" : "text/plain; version=0.0.4; charset=utf-8"
                    let answer = Self.response(200, head ? "" : text, type: type, length: text.utf8.count)
                    rendering.subtract(1, ordering: .relaxed)
                    finished.withLock { $0.append((client, serial, answer)) }
                    wake()
                }
            }
        }
        while !stopped.load(ordering: .acquiring) {
            // Answers that are ready.
            for (client, serial, answer) in finished.withLock({ list in defer { list = [] }; return list }) {
                guard connections[client]?.serial == serial, connections[client]?.rendering == true else { continue }
                connections[client]?.answer = answer
                connections[client]?.answerStarted = .now
                connections[client]?.rendering = false
            }
            let now = ContinuousClock.now
            if let paused = acceptPausedUntil, paused <= now { acceptPausedUntil = nil }
            // (While out of descriptors, the listener is left alone for a moment: no busy loop.)
            var polled = [pollfd(fd: acceptPausedUntil == nil ? fd : -1, events: Int16(POLLIN), revents: 0),
                          pollfd(fd: wakeRead, events: Int16(POLLIN), revents: 0)]
            var nextDeadline = acceptPausedUntil ?? now + .seconds(1)
            for (client, connection) in connections {
                let deadline: ContinuousClock.Instant
                if connection.rendering {
                    // The daemon did not answer in time: 503, and the render's answer is dropped.
                    let limit = (connection.renderStarted ?? now) + Self.renderDeadline
                    if limit <= now {
                        refused("busy")
                        connections[client]?.rendering = false
                        connections[client]?.answer = Self.response(503, "the daemon did not answer in time\n")
                        connections[client]?.answerStarted = now
                    }
                    nextDeadline = min(nextDeadline, limit)
                    continue
                } else if connection.answer != nil {
                    deadline = (connection.answerStarted ?? now) + Self.answerDeadline
                } else {
                    deadline = connection.accepted + (connection.request.isEmpty ? Self.firstByteDeadline : Self.requestDeadline)
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
                        if connections.values.count(where: { $0.peer?.uid == uid }) >= Self.maximumPerUser {
                            refused("full")
                            close(client)
                            continue
                        }
                    }
                    if connections.count >= Self.maximumConnections {
                        // The oldest connection that has sent nothing makes room.
                        // (Whatever it has sent: one byte must not make a connection unevictable.
                        // A scraper sends its request within milliseconds of connecting.)
                        guard let idle = connections.values.filter({ $0.answer == nil && !$0.rendering })
                            .min(by: { $0.accepted < $1.accepted }) else {
                            refused("full")
                            close(client)
                            continue
                        }
                        refused("timeout")
                        drop(idle.fd)
                    }
                    connections[client] = Connection(fd: client, peer: peer, accepted: .now)
                    // A scraper's request is usually there already: read it now, so that no flood
                    // of new connections can push it out before the next turn of the loop.
                    readRequest(client)
                }
            }
        }
        for client in connections.keys { close(client) }
        // Render tasks still running find their connection gone: their answers are dropped.
    }

    private enum Parsed {
        case answer([UInt8], refusal: String?)
        case render(openMetrics: Bool, full: Bool, head: Bool)
    }

    private static func parse(_ request: [UInt8], peer: PeerCredentials?, _ authorization: MetricsAuthorization) -> Parsed {
        let head = String(decoding: request, as: UTF8.self)
        let lines = head.split(separator: "\r\n", omittingEmptySubsequences: false)
        let words = lines.first?.split(separator: " ") ?? []
        guard words.count == 3, words[2].hasPrefix("HTTP/1.") else { return .answer(response(400, "bad request\n"), refusal: nil) }
        guard words[0] == "GET" || words[0] == "HEAD" else { return .answer(response(405, "only GET\n"), refusal: nil) }
        guard words[1] == "/metrics" || words[1].hasPrefix("/metrics?") else { return .answer(response(404, "try /metrics\n"), refusal: nil) }
        func header(_ name: String) -> String? {
            for line in lines.dropFirst() {
                if line.isEmpty { break }   // the end of the header: what follows is not one
                guard let colon = line.firstIndex(of: ":"), line[..<colon].lowercased() == name else { continue }
                return line[line.index(after: colon)...].trimmingCharacters(in: " \t")
            }
            return nil
        }
        let openMetrics = header("accept")?.lowercased().contains("application/openmetrics-text") == true
        switch authorization.view(peer: peer, authorization: header("authorization")) {
        case .full: return .render(openMetrics: openMetrics, full: true, head: words[0] == "HEAD")
        case .daemonOnly: return .render(openMetrics: openMetrics, full: false, head: words[0] == "HEAD")
        case .forbidden: return .answer(response(403, "forbidden: per-session metrics are for admins and MetricsGroup=\n"), refusal: "forbidden")
        case .unauthorized:
            return .answer(response(401, "a bearer token is needed\n", extra: "WWW-Authenticate: Bearer realm=\"tokenbroker\"\r\n"), refusal: "unauthorized")
        }
    }

    private static func response(_ status: Int, _ body: String, type: String = "text/plain; charset=utf-8", length: Int? = nil,
                                 extra: String = "") -> [UInt8] {
        let reason = [200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
                      431: "Request Header Fields Too Large", 503: "Service Unavailable"][status] ?? "Error"
        return Array("HTTP/1.1 \(status) \(reason)\r\nContent-Type: \(type)\r\nContent-Length: \(length ?? body.utf8.count)\r\n\(extra)".utf8)
            + Array("Connection: close\r\n\r\n".utf8) + Array(body.utf8)
    }
}

private extension Substring {
    func trimmingCharacters(in set: String) -> String {
        var text = self
        while let first = text.first, set.contains(first) { text = text.dropFirst() }
        while let last = text.last, set.contains(last) { text = text.dropLast() }
        return String(text)
    }
}

private extension Array where Element == UInt8 {
    func contains(subsequence: [UInt8]) -> Bool {
        guard count >= subsequence.count else { return false }
        for start in 0...(count - subsequence.count) where self[start..<(start + subsequence.count)].elementsEqual(subsequence) { return true }
        return false
    }
}
