#if canImport(Glibc)
import Glibc
#endif
import Basics
import Dispatch
import Synchronization
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

/// A minimal HTTP/1.1 server for `GET /metrics`, on threads of its own: up to four scrapes at
/// once (more are closed at once), each with 2 s to send its whole request (8K at most) and 2 s
/// per write of the answer, so a slow or hostile client delays nobody's token call and holds a
/// scrape slot for 2 s at most.
final class MetricsServer: Sendable {
    private let fd: Int32
    let address: MetricsAddress

    init(_ address: MetricsAddress) throws(SocketError) {
        self.address = address
        switch address {
        case let .unix(path):
            do {
                fd = try SocketPath.bind(path, mode: 0o660, group: nil).fd
            } catch {
                throw SocketError("\(error)")
            }
            _ = fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK)
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
            if bound == 0 { bound = listen(socketFD, 16) }
            guard bound == 0 else {
                let error = SocketError("bind \(address)")
                close(socketFD)
                throw error
            }
            fd = socketFD
        }
    }

    private static func bind<Address>(_ fd: Int32, _ address: inout Address) -> Int32 {
        withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.bind(fd, $0, socklen_t(MemoryLayout<Address>.size)) }
        }
    }

    /// Serves until `stop()`; `render(openMetrics)` builds the exposition.
    func start(render: @escaping @Sendable (Bool) async -> String) {
        let fd = self.fd
        let address = self.address
        spawnThread { [self] in
            while true {
                let client = accept(fd, nil, nil)
                if client < 0 {
                    if errno == EINTR || errno == ECONNABORTED { continue }
                    if errno == EMFILE || errno == ENFILE {
                        usleep(100_000)   // out of descriptors: the token calls come first
                        continue
                    }
                    break   // shut down by stop()
                }
                _ = fcntl(client, F_SETFD, FD_CLOEXEC)
                // A few scrapes at once, each on a thread of its own; beyond that, closed at once.
                guard self.busy.add(1, ordering: .relaxed).newValue <= MetricsServer.concurrentScrapes else {
                    self.busy.subtract(1, ordering: .relaxed)
                    close(client)
                    continue
                }
                spawnThread { [self] in
                    MetricsServer.serve(client, render)
                    close(client)
                    self.busy.subtract(1, ordering: .relaxed)
                }
            }
            // The listener is closed here, by the thread that used it, once accept has returned.
            close(fd)
            if case let .unix(path) = address { unlink(path) }
        }
    }

    /// Scrapes served at once.
    static let concurrentScrapes = 4
    /// Time for a client to send its request, all of it.
    static let requestDeadline = Duration.seconds(2)

    private let busy = Atomic<Int>(0)

    /// Ends the accept loop (which then closes the listener).
    func stop() {
        shutdown(fd, Int32(SHUT_RDWR))
    }

    private static func serve(_ client: Int32, _ render: @escaping @Sendable (Bool) async -> String) {
        UnixSocket.setTimeout(client, seconds: 2)   // for sending the answer
        let deadline = ContinuousClock.now + requestDeadline
        var request: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 4096)
        while !request.contains(subsequence: [13, 10, 13, 10]) {
            guard request.count < 8192 else { return respond(client, 431, "request header fields too large\n") }
            // One deadline for the whole request, however slowly it trickles in.
            let left = ContinuousClock.now.duration(to: deadline)
            guard left > .zero else { return }
            var poller = pollfd(fd: client, events: Int16(POLLIN), revents: 0)
            let milliseconds = Int32(max(1, left.components.seconds * 1000 + left.components.attoseconds / 1_000_000_000_000_000))
            guard poll(&poller, 1, milliseconds) == 1 else { return }
            let count = read(client, &buffer, buffer.count)
            guard count > 0 else { return }
            request += buffer[..<count]
        }
        let head = String(decoding: request, as: UTF8.self)
        let lines = head.split(separator: "\r\n", omittingEmptySubsequences: false)
        let words = lines.first?.split(separator: " ") ?? []
        guard words.count == 3, words[2].hasPrefix("HTTP/1.") else { return respond(client, 400, "bad request\n") }
        guard words[0] == "GET" || words[0] == "HEAD" else { return respond(client, 405, "only GET\n") }
        guard words[1] == "/metrics" || words[1].hasPrefix("/metrics?") else { return respond(client, 404, "try /metrics\n") }
        let openMetrics = lines.dropFirst().contains { line in
            line.lowercased().hasPrefix("accept:") && line.lowercased().contains("application/openmetrics-text")
        }
        // The exposition reads the coordinators (actors): wait for it here, on this thread.
        let done = DispatchSemaphore(value: 0)
        let text = SynchronizedBox("")
        Task {
            text.value = await render(openMetrics)
            done.signal()
        }
        guard done.wait(timeout: .now() + 5) == .success else { return respond(client, 503, "the daemon did not answer in time\n") }
        let type = openMetrics ? "application/openmetrics-text; version=1.0.0; charset=utf-8" : "text/plain; version=0.0.4; charset=utf-8"
        respond(client, 200, words[0] == "HEAD" ? "" : text.value, type: type, length: text.value.utf8.count)
    }

    private static func respond(_ client: Int32, _ status: Int, _ body: String, type: String = "text/plain; charset=utf-8", length: Int? = nil) {
        let reason = [200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large",
                      503: "Service Unavailable"][status] ?? "Error"
        var answer = Array("HTTP/1.1 \(status) \(reason)\r\nContent-Type: \(type)\r\nContent-Length: \(length ?? body.utf8.count)\r\n".utf8)
        answer += Array("Connection: close\r\n\r\n".utf8) + Array(body.utf8)
        var sent = 0
        while sent < answer.count {
            let count = answer[sent...].withUnsafeBytes { send(client, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) }
            guard count > 0 else { return }
            sent += count
        }
    }
}

private extension Array where Element == UInt8 {
    func contains(subsequence: [UInt8]) -> Bool {
        guard count >= subsequence.count else { return false }
        for start in 0...(count - subsequence.count) where self[start..<(start + subsequence.count)].elementsEqual(subsequence) { return true }
        return false
    }
}
