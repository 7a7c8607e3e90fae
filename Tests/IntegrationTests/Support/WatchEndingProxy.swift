import Foundation
import Synchronization
#if canImport(Glibc)
import Glibc
#endif

/// A loopback HTTP relay in front of one etcd member that answers every watch with `created`
/// and closes the stream at once (a misbehaving member or proxy); every other request goes to
/// etcd, one request per connection. Counts the watches it ended.
final class WatchEndingProxy: @unchecked Sendable {
    // @unchecked: `listener` and `port` are set once; `counter` is atomic.
    let port: Int
    private let listener: Int32
    private let counter = Atomic<Int>(0)

    var watches: Int { counter.load(ordering: .acquiring) }

    init(forwardingTo target: Int) throws {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        listener = fd
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        let listening = withUnsafeMutablePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                bind(fd, $0, length) == 0 && listen(fd, 64) == 0 && getsockname(fd, $0, &length) == 0
            }
        }
        guard listening else { throw POSIXError(.EADDRINUSE) }
        port = Int(UInt16(bigEndian: address.sin_port))
        Thread { [self] in
            while case let client = accept(listener, nil, nil), client >= 0 {
                Thread { [self] in serve(client, target: target) }.start()
            }
        }.start()
    }

    func stop() {
        shutdown(listener, Int32(SHUT_RDWR))
        close(listener)
    }

    private func serve(_ client: Int32, target: Int) {
        defer { close(client) }
        var timeout = timeval(tv_sec: 5, tv_usec: 0)
        setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        var request: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 65_536)
        var head = ""
        while true {
            let n = read(client, &buffer, buffer.count)
            guard n > 0 else { return }
            request += buffer[..<n]
            let text = String(decoding: request, as: UTF8.self)
            guard let end = text.range(of: "\r\n\r\n") else { continue }
            head = String(text[..<end.lowerBound])
            let length = head.lowercased().split(separator: "\r\n").first { $0.hasPrefix("content-length:") }
                .flatMap { Int($0.dropFirst("content-length:".count).trimmingCharacters(in: .whitespaces)) } ?? 0
            if request.count >= text.utf8.distance(from: text.utf8.startIndex, to: end.upperBound) + length { break }
        }
        let path = head.split(separator: " ").dropFirst().first.map(String.init) ?? ""
        if path == "/v3/watch" {
            counter.add(1, ordering: .acquiringAndReleasing)
            let body = #"{"result":{"header":{"revision":"1"},"created":true}}"# + "\n"
            let answer = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: \(body.utf8.count)\r\nConnection: close\r\n\r\n" + body
            _ = Array(answer.utf8).withUnsafeBytes { write(client, $0.baseAddress, $0.count) }
            return
        }
        // Everything else to etcd, asking it to close after the answer, which is relayed whole.
        let headEnd = String(decoding: request, as: UTF8.self).range(of: "\r\n\r\n").map {
            String(decoding: request, as: UTF8.self).utf8.distance(from: String(decoding: request, as: UTF8.self).utf8.startIndex, to: $0.lowerBound)
        } ?? request.count
        let rewritten = Array(head.split(separator: "\r\n").filter { !$0.lowercased().hasPrefix("connection:") }.joined(separator: "\r\n").utf8)
            + Array("\r\nConnection: close".utf8) + request[headEnd...]
        let upstream = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        defer { close(upstream) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = UInt16(target).bigEndian
        let connected = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(upstream, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) == 0 }
        }
        guard connected, rewritten.withUnsafeBytes({ write(upstream, $0.baseAddress, $0.count) }) == rewritten.count else { return }
        while case let n = read(upstream, &buffer, buffer.count), n > 0 {
            guard buffer.withUnsafeBytes({ write(client, $0.baseAddress, n) }) == n else { return }
        }
    }
}
