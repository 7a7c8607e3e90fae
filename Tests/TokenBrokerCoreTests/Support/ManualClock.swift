import Synchronization
import TokenBrokerCore

/// A clock that moves only when the test says so. It is both the coordinator's monotonic
/// clock and its wall clock (which starts at `unixStart`), so expiry arithmetic is exact.
final class ManualClock: Clock, WallClock, Sendable {
    struct Instant: InstantProtocol {
        var offset: Duration
        func advanced(by duration: Duration) -> Instant { Instant(offset: offset + duration) }
        func duration(to other: Instant) -> Duration { other.offset - offset }
        static func < (lhs: Instant, rhs: Instant) -> Bool { lhs.offset < rhs.offset }
    }

    private struct State {
        var now = Instant(offset: .zero)
        var sleepers: [(deadline: Instant, continuation: CheckedContinuation<Void, Never>)] = []
    }

    private let state = Mutex(State())
    let unixStart: Double

    init(unixStart: Double = 1_800_000_000) { self.unixStart = unixStart }

    var now: Instant { state.withLock { $0.now } }
    var minimumResolution: Duration { .zero }

    func unixTime() -> Double { unixStart + now.offset.seconds }

    func advance(by duration: Duration) {
        let due: [CheckedContinuation<Void, Never>] = state.withLock { state in
            state.now = state.now.advanced(by: duration)
            let now = state.now
            let due = state.sleepers.filter { $0.deadline <= now }.map(\.continuation)
            state.sleepers.removeAll { $0.deadline <= now }
            return due
        }
        for continuation in due { continuation.resume() }
    }

    /// Sleeps until the test advances past `deadline` (cancellation is not needed here).
    func sleep(until deadline: Instant, tolerance: Duration?) async throws {
        await withCheckedContinuation { continuation in
            let fire = state.withLock { state in
                if deadline <= state.now { return true }
                state.sleepers.append((deadline, continuation))
                return false
            }
            if fire { continuation.resume() }
        }
    }
}
