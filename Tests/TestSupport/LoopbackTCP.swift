import Foundation
#if canImport(Glibc)
import Glibc
#endif

/// A TCP listener on 127.0.0.1 at a port of the kernel's choosing; each connection is handed
/// to `handle` on a thread of its own (which owns the descriptor).
public final class LoopbackListener: @unchecked Sendable {
    // @unchecked: `listener` and `port` are set once, in init.
    public let port: Int
    private let listener: Int32

    public init(backlog: Int32 = 64, handle: @escaping @Sendable (Int32) -> Void) throws {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        listener = fd
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        let listening = withUnsafeMutablePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                bind(fd, $0, length) == 0 && listen(fd, backlog) == 0 && getsockname(fd, $0, &length) == 0
            }
        }
        guard listening else {
            close(fd)
            throw POSIXError(.EADDRINUSE)
        }
        port = Int(UInt16(bigEndian: address.sin_port))
        Thread {
            while case let client = accept(fd, nil, nil), client >= 0 {
                Thread { handle(client) }.start()
            }
        }.start()
    }

    public func stop() {
        shutdown(listener, Int32(SHUT_RDWR))
        close(listener)
    }
}

public enum LoopbackTCP {
    /// A blocking TCP connection to 127.0.0.1:`port` (-1 when it cannot be made).
    public static func connect(_ port: Int) -> Int32 {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        guard fd >= 0 else { return -1 }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = UInt16(port).bigEndian
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        let connected = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) == 0 }
        }
        guard connected else {
            close(fd)
            return -1
        }
        return fd
    }

    /// One HTTP/1.1 request read from `fd`: its head (up to the blank line, the request line
    /// first) and all its bytes, as many body bytes as Content-Length says. Nil if the peer
    /// closes first.
    public static func readRequest(_ fd: Int32) -> (head: String, bytes: [UInt8])? {
        var request: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 65_536)
        while true {
            let n = read(fd, &buffer, buffer.count)
            guard n > 0 else { return nil }
            request += buffer[..<n]
            let text = String(decoding: request, as: UTF8.self)
            guard let end = text.range(of: "\r\n\r\n") else { continue }
            let head = String(text[..<end.lowerBound])
            let length = head.lowercased().split(separator: "\r\n").first { $0.hasPrefix("content-length:") }
                .flatMap { Int($0.dropFirst("content-length:".count).trimmingCharacters(in: .whitespaces)) } ?? 0
            if request.count >= text.utf8.distance(from: text.utf8.startIndex, to: end.upperBound) + length { return (head, request) }
        }
    }
}
