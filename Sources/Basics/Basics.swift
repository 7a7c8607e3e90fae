#if canImport(Glibc)
import Glibc
#endif

/// Starts a detached POSIX thread that runs `body` (for I/O loops that must not live in the
/// cooperative pool).
public func spawnThread(_ body: @escaping @Sendable () -> Void) {
    final class Box: Sendable {
        let body: @Sendable () -> Void
        init(_ body: @escaping @Sendable () -> Void) { self.body = body }
    }
    let context = Unmanaged.passRetained(Box(body)).toOpaque()
    var thread = pthread_t()
    let rc = pthread_create(&thread, nil, { context in
        Unmanaged<Box>.fromOpaque(context!).takeRetainedValue().body()
        return nil
    }, context)
    precondition(rc == 0, "pthread_create failed: \(rc)")
    pthread_detach(thread)
}

/// `application/x-www-form-urlencoded` by hand: only `A–Z a–z 0–9 - . _ ~` stay literal, so
/// a `+`, `/` or `=` in a token survives.
public enum FormEncoding {
    public static func escape(_ text: String) -> String {
        var output = ""
        let hex = Array("0123456789ABCDEF")
        for byte in text.utf8 {
            switch byte {
            case UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "0")...UInt8(ascii: "9"),
                 UInt8(ascii: "-"), UInt8(ascii: "."), UInt8(ascii: "_"), UInt8(ascii: "~"):
                output.append(Character(Unicode.Scalar(byte)))
            default:
                output.append("%")
                output.append(hex[Int(byte >> 4)])
                output.append(hex[Int(byte & 0xF)])
            }
        }
        return output
    }

    public static func encode(_ fields: [(String, String)]) -> String {
        fields.map { escape($0.0) + "=" + escape($0.1) }.joined(separator: "&")
    }

    /// Decodes a form body (`+` is a space).
    public static func decode(_ text: String) -> [(String, String)] {
        text.split(separator: "&").map { pair in
            let parts = pair.split(separator: "=", maxSplits: 1, omittingEmptySubsequences: false)
            return (unescape(String(parts[0])), parts.count > 1 ? unescape(String(parts[1])) : "")
        }
    }

    public static func unescape(_ text: String) -> String {
        var bytes: [UInt8] = []
        var iterator = Array(text.utf8).makeIterator()
        while let byte = iterator.next() {
            if byte == UInt8(ascii: "+") {
                bytes.append(0x20)
            } else if byte == UInt8(ascii: "%"), let high = iterator.next(), let low = iterator.next(),
                      let value = UInt8(String(decoding: [high, low], as: UTF8.self), radix: 16) {
                bytes.append(value)
            } else {
                bytes.append(byte)
            }
        }
        return String(decoding: bytes, as: UTF8.self)
    }
}

/// Base64 (RFC 4648, with padding).
public enum Base64 {
    private static let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".utf8)

    public static func encode(_ bytes: [UInt8]) -> String {
        var output: [UInt8] = []
        output.reserveCapacity((bytes.count + 2) / 3 * 4)
        var index = 0
        while index < bytes.count {
            let chunk = bytes[index..<min(index + 3, bytes.count)]
            let b0 = chunk[chunk.startIndex]
            let b1 = chunk.count > 1 ? chunk[chunk.startIndex + 1] : 0
            let b2 = chunk.count > 2 ? chunk[chunk.startIndex + 2] : 0
            output.append(alphabet[Int(b0 >> 2)])
            output.append(alphabet[Int((b0 & 0x03) << 4 | b1 >> 4)])
            output.append(chunk.count > 1 ? alphabet[Int((b1 & 0x0F) << 2 | b2 >> 6)] : UInt8(ascii: "="))
            output.append(chunk.count > 2 ? alphabet[Int(b2 & 0x3F)] : UInt8(ascii: "="))
            index += 3
        }
        return String(decoding: output, as: UTF8.self)
    }

    public static func decode(_ text: String) -> [UInt8]? {
        var values: [UInt8] = []
        for byte in text.utf8 where byte != UInt8(ascii: "=") {
            guard let index = alphabet.firstIndex(of: byte) else { return nil }
            values.append(UInt8(index))
        }
        var output: [UInt8] = []
        var index = 0
        while index + 1 < values.count {
            output.append(values[index] << 2 | values[index + 1] >> 4)
            if index + 2 < values.count { output.append(values[index + 1] << 4 | values[index + 2] >> 2) }
            if index + 3 < values.count { output.append(values[index + 2] << 6 | values[index + 3]) }
            index += 4
        }
        return output
    }
}

/// A thread that runs submitted jobs one at a time, in order (for blocking work such as
/// database commits, kept off the cooperative pool).
public final class SerialThread: Sendable {
    private final class Queue: @unchecked Sendable {
        // @unchecked: every field is only touched with `mutex` held.
        var mutex = pthread_mutex_t()
        var condition = pthread_cond_t()
        /// `nil` ends the thread.
        var jobs: [(@Sendable () -> Void)?] = []

        init() {
            pthread_mutex_init(&mutex, nil)
            pthread_cond_init(&condition, nil)
        }
    }

    private let queue = Queue()

    public init() {
        let queue = self.queue
        spawnThread {
            while true {
                pthread_mutex_lock(&queue.mutex)
                while queue.jobs.isEmpty { pthread_cond_wait(&queue.condition, &queue.mutex) }
                let job = queue.jobs.removeFirst()
                pthread_mutex_unlock(&queue.mutex)
                guard let job else { return }
                job()
            }
        }
    }

    /// The thread ends once the jobs submitted so far have run.
    deinit { enqueue(nil) }

    public func submit(_ job: @escaping @Sendable () -> Void) {
        enqueue(job)
    }

    private func enqueue(_ job: (@Sendable () -> Void)?) {
        pthread_mutex_lock(&queue.mutex)
        queue.jobs.append(job)
        pthread_cond_signal(&queue.condition)
        pthread_mutex_unlock(&queue.mutex)
    }

    /// Runs `job` on the thread and returns its result to the awaiting task.
    public func run<T: Sendable>(_ job: @escaping @Sendable () throws -> T) async throws -> T {
        try await withCheckedThrowingContinuation { continuation in
            submit { continuation.resume(with: Result { try job() }) }
        }
    }
}

/// Runs async operations one at a time, in arrival order (an actor would interleave them at
/// every `await`).
public final class AsyncSerializer: Sendable {
    private final class State: @unchecked Sendable {
        // @unchecked: guarded by `mutex`.
        var mutex = pthread_mutex_t()
        var busy = false
        var waiters: [CheckedContinuation<Void, Never>] = []
        init() { pthread_mutex_init(&mutex, nil) }
    }

    private let state = State()

    public init() {}

    public func run<T: Sendable>(_ body: @Sendable () async -> T) async -> T {
        await acquire()
        defer { release() }
        return await body()
    }

    private func acquire() async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            pthread_mutex_lock(&state.mutex)
            if state.busy {
                state.waiters.append(continuation)
                pthread_mutex_unlock(&state.mutex)
            } else {
                state.busy = true
                pthread_mutex_unlock(&state.mutex)
                continuation.resume()
            }
        }
    }

    private func release() {
        pthread_mutex_lock(&state.mutex)
        if state.waiters.isEmpty {
            state.busy = false
            pthread_mutex_unlock(&state.mutex)
        } else {
            let next = state.waiters.removeFirst()
            pthread_mutex_unlock(&state.mutex)
            next.resume()
        }
    }
}
