#if canImport(Glibc)
import Glibc
#endif
import BrokerContract
import CLinux
import Varlink

/// A daemon that cannot start (a configuration error, a state key it cannot use) while systemd
/// hands it its socket: before it exits 78 it answers the calls that woke it, and any that come
/// while it lingers, with `ConfigurationError` — why, in one line, to root and its own user;
/// where to read why to everyone else (the text may name files and values of the
/// configuration). So a caller hears at once what is wrong instead of waiting for its timeout;
/// the queue is empty when it exits, so systemd does not start it again for the same calls; and
/// the next connection after the fix starts a daemon that works (the unit sets no start limit:
/// a failed start must not leave the socket dead until `systemctl reset-failed`).
///
/// It lingers until no connection came for `idle` (at most `longest`), answers at most
/// `mostConnections` at once, reads at most `longestMessage` bytes of each, and gives each
/// `messageDeadline` to send its call. Before it takes new connections it asks `stillFailing`
/// again (once per wake-up, whatever number wait): once the cause is fixed, it leaves them
/// queued and exits, and systemd starts a daemon that serves them.
enum StartFailure {
    static let idle = Duration.seconds(1)
    static let longest = Duration.seconds(10)
    static let mostConnections = 64
    static let longestMessage = 64 << 10
    static let messageDeadline = Duration.seconds(1)

    /// Answers on `listener` (the socket systemd passed) until it has been quiet for `idle`, or
    /// `stillFailing` (why it cannot start, asked again) says nothing is wrong any more.
    static func answer(on listener: Int32, reason: String, daemonUID: UInt32 = getuid(), stillFailing: () -> String? = { "" }) {
        let line = reason.split(separator: "\n", omittingEmptySubsequences: true).first.map(String.init) ?? reason
        let told = reply("the broker cannot start: \(line.prefix(400))")
        let hidden = reply("the broker cannot start: its configuration has an error (an administrator can read it: systemctl status tokenbroker)")
        try? UnixSocket.setNonBlocking(listener)
        let clock = ContinuousClock()
        let end = clock.now + longest
        var lastArrival = clock.now
        var open: [(fd: Int32, since: ContinuousClock.Instant, read: [UInt8], reply: [UInt8])] = []
        defer { for connection in open { close(connection.fd) } }
        while clock.now < end, clock.now - lastArrival < idle || !open.isEmpty {
            var fds = [pollfd(fd: listener, events: Int16(POLLIN), revents: 0)] + open.map { pollfd(fd: $0.fd, events: Int16(POLLIN), revents: 0) }
            let wait = min(end - clock.now, idle)
            _ = poll(&fds, nfds_t(fds.count), Int32(max(wait.components.seconds * 1000 + wait.components.attoseconds / 1_000_000_000_000_000, 1)))
            if fds[0].revents & Int16(POLLIN) != 0 {
                // Fixed: the queued connections are the next daemon's.
                if stillFailing() == nil { return }
                while open.count < mostConnections {
                    let fd = tb_accept_nonblocking(listener)
                    guard fd >= 0 else { break }
                    lastArrival = clock.now
                    let peer = UnixSocket.peer(fd)
                    let admin = peer.map { $0.uid == 0 || $0.uid == daemonUID } ?? false
                    open.append((fd, clock.now, [], admin ? told : hidden))
                }
            }
            var kept: [(fd: Int32, since: ContinuousClock.Instant, read: [UInt8], reply: [UInt8])] = []
            for (index, var connection) in open.enumerated() {
                var done = clock.now - connection.since > messageDeadline
                if fds.count > index + 1, fds[index + 1].revents != 0 {
                    var buffer = [UInt8](repeating: 0, count: 4096)
                    let count = read(connection.fd, &buffer, buffer.count)
                    if count > 0 {
                        connection.read += buffer[..<count]
                        // A whole call (NUL-terminated): answer it and close.
                        if connection.read.contains(0) {
                            _ = connection.reply.withUnsafeBytes { send(connection.fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) }
                            done = true
                        } else if connection.read.count > longestMessage {
                            done = true
                        }
                    } else if count == 0 || (errno != EAGAIN && errno != EINTR) {
                        done = true
                    }
                }
                if done { close(connection.fd) } else { kept.append(connection) }
            }
            open = kept
        }
    }

    /// The `ConfigurationError` reply, framed (NUL-terminated).
    private static func reply(_ reason: String) -> [UInt8] {
        VarlinkReply.error(BrokerContract.name + ".ConfigurationError", ["reason": .string(reason)]).encoded()
    }
}
