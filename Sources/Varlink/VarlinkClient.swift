#if canImport(Glibc)
import Glibc
#endif

/// Why a client call did not produce a reply.
public enum VarlinkClientError: Error, Sendable, Equatable, CustomStringConvertible {
    /// Could not connect (no such socket, refused, permission).
    case unreachable(SocketError)
    /// The connection broke or timed out mid-call.
    case io(SocketError)
    /// The service closed the connection before replying.
    case closed
    /// The service sent something that is not a varlink reply.
    case protocolViolation(String)

    public var description: String {
        switch self {
        case let .unreachable(error): return "cannot connect: \(error)"
        case let .io(error): return "connection failed: \(error)"
        case .closed: return "the service closed the connection"
        case let .protocolViolation(reason): return "invalid reply: \(reason)"
        }
    }
}

/// A blocking varlink client on one connection: one call at a time, replies in order.
/// Used by `ctl`, tests and the certification client. Not thread-safe: one owner.
public final class VarlinkClient {
    private let fd: Int32
    private var decoder: FrameDecoder
    /// What `read` fills, never zeroed: zeroing 64 KiB was a tenth of a `ctl token`'s
    /// instructions and 16 of its page faults.
    private let buffer: UnsafeMutableRawBufferPointer

    /// Connects to `address`; `timeout` bounds every send and every wait for a reply (0: no
    /// bound, for streams that may be quiet for long).
    public init(address: VarlinkAddress, timeout: Double = 45, maximumMessageSize: Int = 16 << 20) throws(VarlinkClientError) {
        do {
            fd = try UnixSocket.connect(path: address.path)
        } catch {
            throw .unreachable(error)
        }
        UnixSocket.setTimeout(fd, seconds: timeout)
        decoder = FrameDecoder(maximumSize: maximumMessageSize)
        // (Allocated once nothing can throw: deinit frees it.)
        buffer = .allocate(byteCount: 65_536, alignment: 1)
    }

    deinit {
        close(fd)
        buffer.deallocate()
    }

    /// Sends `call` and returns its reply (for `more` calls, the first one; read the rest with
    /// `nextReply()`). A oneway call returns an empty reply without waiting.
    @discardableResult
    public func call(_ call: VarlinkCall) throws(VarlinkClientError) -> VarlinkReply {
        try send(call.encoded())
        if call.oneway { return VarlinkReply() }
        return try nextReply()
    }

    /// Convenience: `interface.Method` with parameters.
    @discardableResult
    public func call(_ method: String, _ parameters: JSONObject = [:], more: Bool = false) throws(VarlinkClientError) -> VarlinkReply {
        try call(VarlinkCall(method: method, parameters: parameters, more: more))
    }

    /// Sends raw bytes (tests use it to send what a well-behaved client never would).
    public func send(_ bytes: [UInt8]) throws(VarlinkClientError) {
        var offset = 0
        while offset < bytes.count {
            let n = bytes.withUnsafeBytes { Glibc.send(fd, $0.baseAddress! + offset, bytes.count - offset, Int32(MSG_NOSIGNAL)) }
            if n > 0 {
                offset += n
            } else if n < 0 && errno == EINTR {
                continue
            } else {
                throw .io(SocketError("send"))
            }
        }
    }

    /// Waits for the next reply on the connection.
    public func nextReply() throws(VarlinkClientError) -> VarlinkReply {
        while true {
            let frame: ArraySlice<UInt8>?
            do {
                frame = try decoder.next()
            } catch {
                throw .protocolViolation("reply larger than \(decoder.maximumSize) bytes")
            }
            if let frame {
                do {
                    return try VarlinkReply.decode(frame)
                } catch {
                    throw .protocolViolation(error.reason)
                }
            }
            let n = read(fd, buffer.baseAddress, buffer.count)
            if n > 0 {
                decoder.append(UnsafeRawBufferPointer(rebasing: buffer[0..<n]))
            } else if n == 0 {
                throw .closed
            } else if errno != EINTR {
                throw .io(SocketError("read"))
            }
        }
    }

    /// The underlying descriptor (for tests that half-close or poll it).
    public var fileDescriptor: Int32 { fd }
}
