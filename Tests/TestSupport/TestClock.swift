import Synchronization

/// A clock that moves only when the test says so, both monotonic and wall (from `unixStart`).
/// Sleepers wake when the test advances past their deadline, or at once when cancelled: a task
/// that waits "up to" some time on it waits for an event, never for time, unless the test moves it.
public final class TestClock: Clock, Sendable {
    public struct Instant: InstantProtocol {
        public var offset: Duration
        public func advanced(by duration: Duration) -> Instant { Instant(offset: offset + duration) }
        public func duration(to other: Instant) -> Duration { other.offset - offset }
        public static func < (lhs: Instant, rhs: Instant) -> Bool { lhs.offset < rhs.offset }
    }

    private struct Sleeper {
        var deadline: Instant
        var continuation: CheckedContinuation<Void, any Error>
    }

    private struct State {
        var now = Instant(offset: .zero)
        var sleepers: [UInt64: Sleeper] = [:]
        var cancelled: Set<UInt64> = []
        var next: UInt64 = 0
    }

    private let state = Mutex(State())
    public let unixStart: Double

    public init(unixStart: Double = 1_800_000_000) { self.unixStart = unixStart }

    public var now: Instant { state.withLock { $0.now } }
    public var minimumResolution: Duration { .zero }

    /// Seconds since the Unix epoch, moving with the clock.
    public func unixTime() -> Double {
        let offset = now.offset.components
        return unixStart + Double(offset.seconds) + Double(offset.attoseconds) / 1e18
    }

    /// How many tasks sleep on it now.
    public var sleeping: Int { state.withLock { $0.sleepers.count } }

    /// When they wake (for a failing test's message).
    public var wakeTimes: [Duration] { state.withLock { $0.sleepers.values.map(\.deadline.offset).sorted() } }

    public func advance(by duration: Duration) {
        let due = state.withLock { state -> [CheckedContinuation<Void, any Error>] in
            state.now = state.now.advanced(by: duration)
            let now = state.now
            let ids = state.sleepers.filter { $0.value.deadline <= now }.map(\.key)
            return ids.compactMap { state.sleepers.removeValue(forKey: $0)?.continuation }
        }
        for continuation in due { continuation.resume() }
    }

    public func sleep(until deadline: Instant, tolerance: Duration?) async throws {
        let id = state.withLock { state -> UInt64 in
            state.next += 1
            return state.next
        }
        try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Void, any Error>) in
                let outcome = state.withLock { state -> Result<Void, any Error>? in
                    if state.cancelled.remove(id) != nil { return .failure(CancellationError()) }
                    if deadline <= state.now { return .success(()) }
                    state.sleepers[id] = Sleeper(deadline: deadline, continuation: continuation)
                    return nil
                }
                if let outcome { continuation.resume(with: outcome) }
            }
        } onCancel: {
            let continuation = state.withLock { state -> CheckedContinuation<Void, any Error>? in
                if let sleeper = state.sleepers.removeValue(forKey: id) { return sleeper.continuation }
                state.cancelled.insert(id)
                return nil
            }
            continuation?.resume(throwing: CancellationError())
        }
    }
}

/// A value behind a lock, shared by reference (closures can capture it before `self` exists).
public final class Locked<Value: Sendable>: Sendable {
    private let state: Mutex<Value>

    public init(_ value: Value) { state = Mutex(value) }

    public func withLock<Result>(_ body: (inout Value) -> Result) -> Result {
        state.withLock { body(&$0) }
    }

    public var value: Value { state.withLock { $0 } }
}
