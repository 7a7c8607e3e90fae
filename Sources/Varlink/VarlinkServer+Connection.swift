#if canImport(Glibc)
import Glibc
#endif
import Basics
import CLinux
import Synchronization

/// One client's connection, as the loop sees it (touched on the loop thread only).
extension VarlinkServer {
    final class Connection {
        let id: UInt64
        let fd: Int32
        let peer: PeerCredentials
        /// The listener it came through (0: the server's own).
        var listener: UInt32 { peer.listener }
        /// Exempt from the per-uid limit (decided once, at accept).
        let privileged: Bool
        var decoder: FrameDecoder
        /// When the first byte of the message still unfinished arrived, in `Loop.milliseconds()`
        /// (`nil`: none is).
        var messageStarted: Int64?
        var output: [UInt8] = []
        var outputStart = 0
        /// Events registered with epoll.
        var interest: UInt32 = EPOLLIN.rawValue
        /// The client has shut down its side; finish what is pending, then close.
        var inputClosed = false
        /// Close once the output is flushed.
        var closeAfterFlush = false
        var current: Call?
        var nextCall: UInt64 = 0

        struct Call {
            var id: UInt64
            var method: String
            var oneway: Bool
            var more: Bool
            var task: Task<Void, Never>
            var finalSent = false
        }

        init(id: UInt64, fd: Int32, peer: PeerCredentials, privileged: Bool, maximumMessageSize: Int) {
            self.id = id
            self.fd = fd
            self.peer = peer
            self.privileged = privileged
            decoder = FrameDecoder(maximumSize: maximumMessageSize)
        }

        var pendingOutput: Int { output.count - outputStart }
    }
}
