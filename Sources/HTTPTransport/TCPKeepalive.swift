#if canImport(Glibc)
import Glibc
#endif

/// TCP keepalive for a transfer's connection: a connection that goes silent (a partition, a
/// host that vanished, a dropped NAT entry: nothing answers, not even a reset) is closed by
/// the kernel `deadline` after the last byte it received, and the transfer on it fails. The
/// probes are the kernel's (an empty ACK every `idle`, then every `interval`), never a request
/// to the server. While the server answers them nothing happens, however long it stays quiet.
public struct TCPKeepalive: Sendable, Equatable {
    /// Quiet time before the first probe, and between probes the peer answers.
    public var idle: Duration
    /// Time between unanswered probes.
    public var interval: Duration
    /// Unanswered probes after which the connection is dead.
    public var count: Int

    public init(idle: Duration, interval: Duration, count: Int) {
        (self.idle, self.interval, self.count) = (idle, interval, count)
    }

    /// The longest a dead connection goes unnoticed: from the last byte received, `idle`, then
    /// `count` unanswered probes. It is also the connection's TCP_USER_TIMEOUT, so data sent
    /// into a dead connection (which keeps keepalive from probing while it waits for its ACK)
    /// fails as soon.
    public var deadline: Duration { idle + interval * count }

    /// The options libcurl sets itself (CURLOPT_TCP_KEEPIDLE, CURLOPT_TCP_KEEPINTVL), whole
    /// seconds, at least one.
    var idleSeconds: Int { max(1, Int(idle.components.seconds)) }
    var intervalSeconds: Int { max(1, Int(interval.components.seconds)) }

    /// Sets what libcurl 7.88 cannot (CURLOPT_TCP_KEEPCNT came in 8.9.0): TCP_KEEPCNT and
    /// TCP_USER_TIMEOUT on a new connection's socket. Returns false when the kernel refused.
    func apply(to socket: Int32) -> Bool {
        var count = Int32(clamping: max(1, self.count))
        let whole = TCPKeepalive(idle: .seconds(idleSeconds), interval: .seconds(intervalSeconds), count: Int(count))
        var timeout = UInt32(clamping: whole.deadline.components.seconds * 1000)
        let size = socklen_t(MemoryLayout<Int32>.size)
        return setsockopt(socket, Int32(IPPROTO_TCP), TCP_KEEPCNT, &count, size) == 0
            && setsockopt(socket, Int32(IPPROTO_TCP), TCP_USER_TIMEOUT, &timeout, socklen_t(MemoryLayout<UInt32>.size)) == 0
    }
}
