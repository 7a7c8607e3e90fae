#if canImport(Glibc)
import Glibc
#endif

/// Why a connection's byte stream cannot go on.
public enum FrameError: Error, Sendable, Equatable {
    /// A message grew past the limit before its NUL terminator arrived.
    case oversized(limit: Int)
}

/// Splits a byte stream into NUL-terminated varlink messages, holding at most `maximumSize`
/// bytes of an unfinished message.
public struct FrameDecoder: Sendable {
    public let maximumSize: Int
    private var buffer: [UInt8] = []
    /// Start of the unread part of `buffer`.
    private var start = 0
    /// Bytes before this index (from `start`) are known to hold no NUL.
    private var scanned = 0

    public init(maximumSize: Int) {
        self.maximumSize = maximumSize
    }

    /// Bytes received but not yet returned as messages.
    public var pendingCount: Int { buffer.count - start }

    public mutating func append(_ bytes: UnsafeRawBufferPointer) {
        compact()
        buffer.append(contentsOf: bytes)
    }

    public mutating func append<Bytes: Sequence<UInt8>>(contentsOf bytes: Bytes) {
        compact()
        buffer.append(contentsOf: bytes)
    }

    /// The next complete message without its NUL, or `nil` when more bytes are needed.
    /// Throws when an unfinished message exceeds the limit.
    public mutating func next() throws(FrameError) -> ArraySlice<UInt8>? {
        let from = max(scanned, start)
        if let end = Self.nul(in: buffer, from: from) {
            let message = buffer[start..<end]
            start = end + 1
            scanned = start
            guard message.count <= maximumSize else { throw .oversized(limit: maximumSize) }
            return message
        }
        scanned = buffer.count
        if buffer.count - start > maximumSize { throw .oversized(limit: maximumSize) }
        return nil
    }

    /// The index of the first NUL at or after `from` (memchr: the byte loop was most of the
    /// cost of framing a call).
    private static func nul(in buffer: [UInt8], from: Int) -> Int? {
        guard from < buffer.count else { return nil }
        return buffer.withUnsafeBytes { bytes in
            memchr(bytes.baseAddress! + from, 0, bytes.count - from).map { bytes.baseAddress!.distance(to: UnsafeRawPointer($0)) }
        }
    }

    private mutating func compact() {
        guard start > 0 else { return }
        if start == buffer.count {
            // An idle connection keeps at most a small buffer (thousands may be open).
            buffer.removeAll(keepingCapacity: buffer.capacity <= 4096)
        } else if start > 4096 && start * 2 > buffer.count {
            buffer.removeSubrange(0..<start)
        } else {
            return
        }
        scanned -= start
        start = 0
    }
}
