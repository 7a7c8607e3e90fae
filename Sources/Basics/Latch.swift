import Synchronization

/// A value given once: waiters get it once it is set, and at once after that. It can be closed
/// instead (no value from then on: waiters get nil). Waits are cancellable: a cancelled waiter
/// gets nil at once. `Latch` is the one without a value.
public final class OneShot<Value: Sendable>: Sendable {
    private struct State {
        var value: Value?
        var closed = false
        var next: UInt64 = 0
        var waiters: [UInt64: CheckedContinuation<Value?, Never>] = [:]
    }

    private let state = Mutex(State())

    public init() {}

    /// The value, once set.
    public var value: Value? { state.withLock { $0.value } }

    /// Sets the value unless one is set or the shot is closed; whether it took.
    @discardableResult
    public func set(_ value: Value) -> Bool {
        let waiters: [CheckedContinuation<Value?, Never>]? = state.withLock { state in
            guard state.value == nil, !state.closed else { return nil }
            state.value = value
            defer { state.waiters.removeAll() }
            return Array(state.waiters.values)
        }
        guard let waiters else { return false }
        for waiter in waiters { waiter.resume(returning: value) }
        return true
    }

    /// Takes no value from now on; returns the one set before, if any (waiters without one
    /// get nil).
    @discardableResult
    public func close() -> Value? {
        let (value, waiters) = state.withLock { state -> (Value?, [CheckedContinuation<Value?, Never>]) in
            state.closed = true
            defer { state.waiters.removeAll() }
            return (state.value, Array(state.waiters.values))
        }
        for waiter in waiters { waiter.resume(returning: value) }
        return value
    }

    /// The value once it is set; nil when the shot is closed without one, or the task is
    /// cancelled.
    public func wait() async -> Value? {
        let id = state.withLock { state -> UInt64 in
            state.next += 1
            return state.next
        }
        return await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Value?, Never>) in
                let now: Value?? = state.withLock { state in
                    if let value = state.value { return .some(value) }
                    if state.closed || Task.isCancelled { return .some(nil) }
                    state.waiters[id] = continuation
                    return .none
                }
                if let now { continuation.resume(returning: now) }
            }
        } onCancel: {
            state.withLock { $0.waiters.removeValue(forKey: id) }?.resume(returning: nil)
        }
    }

    /// Waits at most `duration`; the value if it was set by then.
    public func wait(upTo duration: Duration) async -> Value? {
        await withTaskGroup(of: Void.self) { group in
            group.addTask { _ = await self.wait() }
            group.addTask { try? await Task.sleep(for: duration) }
            await group.next()
            group.cancelAll()
        }
        return value
    }
}

/// A one-shot signal: waiters return once it has fired, and at once after that. Waits are
/// cancellable (a cancelled waiter returns at once, as if it had fired).
public final class Latch: Sendable {
    private let shot = OneShot<Bool>()

    public init() {}

    public var hasFired: Bool { shot.value != nil }

    /// Fires the latch (again: no effect).
    public func fire() {
        shot.set(true)
    }

    /// Returns once the latch has fired (or the task is cancelled).
    public func wait() async {
        _ = await shot.wait()
    }

    /// Waits at most `duration`; returns whether the latch has fired.
    public func wait(upTo duration: Duration) async -> Bool {
        await shot.wait(upTo: duration) != nil
    }
}
