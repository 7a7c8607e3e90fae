#if canImport(Glibc)
import Glibc
#endif
import Basics
import CLinux
import Synchronization

/// One client's connection, as the loop sees it (touched on the loop thread only).
extension VarlinkServer {
    ///
    /// Its state is the loop's alone: one thread, and no access to a property overlaps another
    /// to the same (a call's reply is queued after the handler returns). So the runtime's
    /// exclusivity checks are off for it (`@exclusivity(unchecked)`): they were a tenth of a
    /// GetToken's instructions.
    final class Connection {
        let id: UInt64
        let fd: Int32
        let peer: PeerCredentials
        /// The listener it came through (0: the server's own).
        var listener: UInt32 { peer.listener }
        /// Exempt from the per-uid limit (decided once, at accept).
        let privileged: Bool
        @exclusivity(unchecked) var decoder: FrameDecoder
        /// When the first byte of the message still unfinished arrived, in `Loop.milliseconds()`
        /// (`nil`: none is).
        @exclusivity(unchecked) var messageStarted: Int64?
        @exclusivity(unchecked) var output: [UInt8] = []
        @exclusivity(unchecked) var outputStart = 0
        /// Events registered with epoll.
        @exclusivity(unchecked) var interest: UInt32 = EPOLLIN.rawValue
        /// The client has shut down its side; finish what is pending, then close.
        @exclusivity(unchecked) var inputClosed = false
        /// Close once the output is flushed.
        @exclusivity(unchecked) var closeAfterFlush = false
        @exclusivity(unchecked) var current: Call?
        @exclusivity(unchecked) var nextCall: UInt64 = 0
        /// The last call read and what it decoded to: a worker sends the same bytes again and
        /// again (its GetToken), and the same bytes decode to the same call. Only small calls are
        /// kept (`memoLimit`), so that an idle connection holds little.
        @exclusivity(unchecked) var memo: Memo?
        static let memoLimit = 256

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

        /// A call read, and where it goes.
        final class Memo {
            let frame: [UInt8]
            let call: VarlinkCall
            let route: Loop.Route

            init(frame: ArraySlice<UInt8>, call: VarlinkCall, route: Loop.Route) {
                (self.frame, self.call, self.route) = (Array(frame), call, route)
            }
        }

        /// The last call, when `frame` is the same bytes.
        func remembered(_ frame: ArraySlice<UInt8>) -> Memo? {
            guard let memo, memo.frame.count == frame.count, !frame.isEmpty else { return nil }
            let same = memo.frame.withUnsafeBytes { kept in
                frame.withUnsafeBytes { frame in memcmp(kept.baseAddress!, frame.baseAddress!, frame.count) == 0 }
            }
            return same ? memo : nil
        }
    }
}
