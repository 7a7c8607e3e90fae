#if canImport(Glibc)
import Glibc
#endif
import Basics
import Synchronization

/// One HTTP/1.1 request as the development issuer sees it.
public struct HTTPServerRequest: Sendable {
    public var method: String
    /// The path without the query.
    public var path: String
    public var query: [(String, String)]
    /// Header names lower-cased.
    public var headers: [(name: String, value: String)]
    public var body: [UInt8]

    public func header(_ name: String) -> String? {
        headers.last { $0.name == name.lowercased() }?.value
    }
}

/// What the server does with a request.
public enum HTTPServerAction: Sendable {
    /// Answer; `delay` waits before the answer, `trickle` waits between its bytes.
    case respond(status: Int, headers: [(String, String)], body: [UInt8], delay: Duration? = nil, trickle: Duration? = nil)
    /// Close the connection without an answer (a lost response).
    case drop
}

/// A small HTTP/1.1 server on 127.0.0.1 for the development issuer: a thread per connection,
/// keep-alive, `Content-Length` bodies. Loopback only, by construction.
public final class LoopbackHTTPServer: Sendable {
    public let port: UInt16
    private let listenFD: Int32
    private let handler: @Sendable (HTTPServerRequest) -> HTTPServerAction
    private let connections = Mutex<Set<Int32>>([])
    private let stopped = Atomic<Bool>(false)

    /// Listens on 127.0.0.1:`port` (0: any free port).
    public init(port: UInt16 = 0, handler: @escaping @Sendable (HTTPServerRequest) -> HTTPServerAction) throws {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw IssuerError("socket: \(String(cString: strerror(errno)))") }
        var one: Int32 = 1
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, socklen_t(MemoryLayout<Int32>.size))
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = port.bigEndian
        address.sin_addr.s_addr = UInt32(0x7F00_0001).bigEndian
        let bound = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard bound == 0, listen(fd, 256) == 0 else {
            let message = String(cString: strerror(errno))
            close(fd)
            throw IssuerError("bind 127.0.0.1:\(port): \(message)")
        }
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        withUnsafeMutablePointer(to: &address) {
            _ = $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) }
        }
        self.port = UInt16(bigEndian: address.sin_port)
        self.listenFD = fd
        self.handler = handler
        spawnThread { [self] in acceptLoop() }
    }

    /// Stops accepting and closes every connection.
    public func stop() {
        guard !stopped.exchange(true, ordering: .acquiringAndReleasing) else { return }
        shutdown(listenFD, Int32(SHUT_RDWR))
        // Under the lock: a connection's thread removes its descriptor from the set (under the
        // same lock) before closing it, so no number here can belong to another file yet.
        connections.withLock { fds in
            for fd in fds { shutdown(fd, Int32(SHUT_RDWR)) }
        }
    }

    private func acceptLoop() {
        while !stopped.load(ordering: .acquiring) {
            let fd = accept(listenFD, nil, nil)
            if fd < 0 {
                if errno == EINTR || errno == ECONNABORTED { continue }
                break
            }
            _ = fcntl(fd, F_SETFD, FD_CLOEXEC)
            var one: Int32 = 1
            setsockopt(fd, Int32(IPPROTO_TCP), TCP_NODELAY, &one, socklen_t(MemoryLayout<Int32>.size))
            connections.withLock { _ = $0.insert(fd) }
            spawnThread { [self] in
                serve(fd)
                connections.withLock { _ = $0.remove(fd) }
                close(fd)
            }
        }
        close(listenFD)
    }

    private func serve(_ fd: Int32) {
        var buffer: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 16_384)
        while !stopped.load(ordering: .acquiring) {
            // Read the head.
            var headEnd: Int?
            while headEnd == nil {
                headEnd = Self.find([13, 10, 13, 10], in: buffer).map { $0 + 4 }
                if headEnd != nil { break }
                guard buffer.count < 65_536 else { return }
                let n = chunk.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
                guard n > 0 else { return }
                buffer += chunk[0..<n]
            }
            guard let end = headEnd, var request = Self.parseHead(Array(buffer[0..<end])) else { return }
            let length = Int(request.header("content-length") ?? "0") ?? 0
            guard length >= 0, length <= 1 << 20 else { return }
            while buffer.count < end + length {
                let n = chunk.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
                guard n > 0 else { return }
                buffer += chunk[0..<n]
            }
            request.body = Array(buffer[end..<(end + length)])
            buffer.removeFirst(end + length)
            let keepAlive = request.header("connection")?.lowercased() != "close"
            switch handler(request) {
            case .drop:
                return
            case let .respond(status, headers, body, delay, trickle):
                if let delay { sleep(delay) }
                var head = "HTTP/1.1 \(status) \(Self.reason(status))\r\n"
                for (name, value) in headers { head += "\(name): \(value)\r\n" }
                head += "Content-Length: \(body.count)\r\n"
                head += keepAlive ? "\r\n" : "Connection: close\r\n\r\n"
                let bytes = Array(head.utf8) + body
                if let trickle {
                    for byte in bytes {
                        guard writeAll(fd, [byte]) else { return }
                        sleep(trickle)
                    }
                } else {
                    guard writeAll(fd, bytes) else { return }
                }
            }
            if !keepAlive { return }
        }
    }

    private func sleep(_ duration: Duration) {
        let (seconds, attoseconds) = duration.components
        var time = timespec(tv_sec: Int(seconds), tv_nsec: Int(attoseconds / 1_000_000_000))
        var remaining = timespec()
        while nanosleep(&time, &remaining) != 0 && errno == EINTR { time = remaining }
    }

    private func writeAll(_ fd: Int32, _ bytes: [UInt8]) -> Bool {
        var offset = 0
        while offset < bytes.count {
            let n = bytes.withUnsafeBytes { send(fd, $0.baseAddress! + offset, bytes.count - offset, Int32(MSG_NOSIGNAL)) }
            if n > 0 { offset += n } else if n < 0 && errno == EINTR { continue } else { return false }
        }
        return true
    }

    static func find(_ needle: [UInt8], in haystack: [UInt8]) -> Int? {
        guard haystack.count >= needle.count else { return nil }
        for index in 0...(haystack.count - needle.count) where haystack[index] == needle[0] {
            if Array(haystack[index..<(index + needle.count)]) == needle { return index }
        }
        return nil
    }

    static func parseHead(_ head: [UInt8]) -> HTTPServerRequest? {
        let text = String(decoding: head, as: UTF8.self)
        var lines = text.split(separator: "\r\n", omittingEmptySubsequences: true).map(String.init)
        guard !lines.isEmpty else { return nil }
        let requestLine = lines.removeFirst().split(separator: " ")
        guard requestLine.count == 3 else { return nil }
        let target = String(requestLine[1])
        var path = target
        var query: [(String, String)] = []
        if let mark = target.firstIndex(of: "?") {
            path = String(target[..<mark])
            query = FormEncoding.decode(String(target[target.index(after: mark)...]))
        }
        var headers: [(name: String, value: String)] = []
        for line in lines {
            guard let colon = line.firstIndex(of: ":") else { return nil }
            let name = line[..<colon].lowercased()
            let value = line[line.index(after: colon)...].trimmingCharacters(in: " \t")
            headers.append((name, value))
        }
        return HTTPServerRequest(method: String(requestLine[0]), path: path, query: query, headers: headers, body: [])
    }

    static func reason(_ status: Int) -> String {
        switch status {
        case 200: return "OK"
        case 302: return "Found"
        case 400: return "Bad Request"
        case 401: return "Unauthorized"
        case 403: return "Forbidden"
        case 404: return "Not Found"
        case 405: return "Method Not Allowed"
        case 429: return "Too Many Requests"
        case 500: return "Internal Server Error"
        case 502: return "Bad Gateway"
        case 503: return "Service Unavailable"
        default: return "Status"
        }
    }
}

public struct IssuerError: Error, CustomStringConvertible {
    public let description: String
    init(_ description: String) { self.description = description }
}

extension StringProtocol {
    func trimmingCharacters(in set: String) -> String {
        var slice = Substring(self)
        while let first = slice.first, set.contains(first) { slice = slice.dropFirst() }
        while let last = slice.last, set.contains(last) { slice = slice.dropLast() }
        return String(slice)
    }
}

