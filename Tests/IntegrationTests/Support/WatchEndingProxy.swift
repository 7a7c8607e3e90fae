import Foundation
import TestSupport
#if canImport(Glibc)
import Glibc
#endif

/// A loopback HTTP relay in front of one etcd member that answers every watch with `created`
/// and closes the stream at once (a misbehaving member or proxy); every other request goes to
/// etcd, one request per connection. Counts the watches it ended.
final class WatchEndingProxy: Sendable {
    private let listener: LoopbackListener
    private let counter: Locked<Int>

    var port: Int { listener.port }
    var watches: Int { counter.value }

    init(forwardingTo target: Int) throws {
        let counter = Locked(0)
        self.counter = counter
        listener = try LoopbackListener { client in Self.serve(client, target: target, counter: counter) }
    }

    func stop() { listener.stop() }

    private static func serve(_ client: Int32, target: Int, counter: Locked<Int>) {
        defer { close(client) }
        var timeout = timeval(tv_sec: 5, tv_usec: 0)
        setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        guard let (head, request) = LoopbackTCP.readRequest(client) else { return }
        let path = head.split(separator: " ").dropFirst().first.map(String.init) ?? ""
        if path == "/v3/watch" {
            counter.withLock { $0 += 1 }
            let body = #"{"result":{"header":{"revision":"1"},"created":true}}"# + "\n"
            let answer = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: \(body.utf8.count)\r\nConnection: close\r\n\r\n" + body
            _ = Array(answer.utf8).withUnsafeBytes { write(client, $0.baseAddress, $0.count) }
            return
        }
        // Everything else to etcd, asking it to close after the answer, which is relayed whole.
        let headLength = head.utf8.count
        let rewritten = Array(head.split(separator: "\r\n").filter { !$0.lowercased().hasPrefix("connection:") }.joined(separator: "\r\n").utf8)
            + Array("\r\nConnection: close".utf8) + request[headLength...]
        let upstream = LoopbackTCP.connect(target)
        guard upstream >= 0 else { return }
        defer { close(upstream) }
        guard rewritten.withUnsafeBytes({ write(upstream, $0.baseAddress, $0.count) }) == rewritten.count else { return }
        var buffer = [UInt8](repeating: 0, count: 65_536)
        while case let n = read(upstream, &buffer, buffer.count), n > 0 {
            guard buffer.withUnsafeBytes({ write(client, $0.baseAddress, n) }) == n else { return }
        }
    }
}
