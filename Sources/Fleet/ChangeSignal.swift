import Synchronization

/// A counter of changes that tasks wait on: `signal()` bumps it and wakes every waiter;
/// `wait(after:upTo:)` returns at the first change after the version the caller read, at the
/// deadline (on the injected clock), or at cancellation. A change between reading the version
/// and waiting is never lost: the wait compares versions under the lock.
final class ChangeSignal<C: Clock>: Sendable where C.Duration == Duration {
    private struct State {
        var version: UInt64 = 0
        var waiting: [UInt64: CheckedContinuation<Void, Never>] = [:]
        /// Waiters that were woken (timer, cancellation) before they parked.
        var woken: Set<UInt64> = []
        var active: Set<UInt64> = []
        var nextWaiter: UInt64 = 0
    }

    private let state = Mutex(State())
    private let clock: C

    init(clock: C) {
        self.clock = clock
    }

    var version: UInt64 { state.withLock { $0.version } }

    func signal() {
        let resumed = state.withLock { state -> [CheckedContinuation<Void, Never>] in
            state.version &+= 1
            defer { state.waiting.removeAll() }
            return Array(state.waiting.values)
        }
        for continuation in resumed { continuation.resume() }
    }

    /// Returns at the next change after `version`, after `limit`, or at cancellation.
    func wait(after version: UInt64, upTo limit: Duration) async {
        await wait(after: version, until: clock.now.advanced(by: limit))
    }

    /// Returns at the next change after `version`, at `deadline`, or at cancellation.
    func wait(after version: UInt64, until deadline: C.Instant) async {
        guard clock.now < deadline else { return }
        let id = state.withLock { state -> UInt64 in
            state.nextWaiter &+= 1
            state.active.insert(state.nextWaiter)
            return state.nextWaiter
        }
        let timer = Task { [clock, weak self] in
            try? await clock.sleep(until: deadline, tolerance: nil)
            self?.wake(id)
        }
        defer {
            timer.cancel()
            state.withLock { state in
                state.active.remove(id)
                state.woken.remove(id)
            }
        }
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let now = state.withLock { state -> Bool in
                    if state.version != version || state.woken.remove(id) != nil { return true }
                    state.waiting[id] = continuation
                    return false
                }
                if now { continuation.resume() }
            }
        } onCancel: {
            wake(id)
        }
    }

    private func wake(_ id: UInt64) {
        let continuation = state.withLock { state -> CheckedContinuation<Void, Never>? in
            if let continuation = state.waiting.removeValue(forKey: id) { return continuation }
            if state.active.contains(id) { state.woken.insert(id) }
            return nil
        }
        continuation?.resume()
    }
}
