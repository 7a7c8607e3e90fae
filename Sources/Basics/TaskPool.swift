import Synchronization

/// Tasks that outlive the call that started them but not their owner: at most `limit` at once,
/// and awaited when the owner closes the pool (a part of the daemon's task tree), so that none
/// runs on, unseen, past the stop.
///
/// `spawn` refuses work when the pool is full or closed; the caller says what is skipped.
public final class TaskPool: Sendable {
    public let limit: Int

    private struct State {
        var active = 0
        var next: UInt64 = 0
        var closed = false
        var handles: [UInt64: Task<Void, Never>] = [:]
        /// Tasks that ended before their handle was recorded.
        var endedEarly: Set<UInt64> = []
    }

    private let state = Mutex(State())
    /// Fires once the pool is closed and no task runs.
    private let drained = Latch()

    public init(limit: Int) {
        precondition(limit > 0, "a pool holds at least one task")
        self.limit = limit
    }

    /// The number of tasks running.
    public var count: Int { state.withLock { $0.active } }

    /// Starts `work` unless `limit` tasks are running or the pool is closed; returns its task, or
    /// `nil` when it was refused.
    @discardableResult
    public func spawn(_ work: @escaping @Sendable () async -> Void) -> Task<Void, Never>? {
        let id: UInt64? = state.withLock { state in
            guard !state.closed, state.active < limit else { return nil }
            state.active += 1
            state.next += 1
            return state.next
        }
        guard let id else { return nil }
        let task = Task { [self] in
            await work()
            ended(id)
        }
        state.withLock { state in
            if state.endedEarly.remove(id) == nil { state.handles[id] = task }
        }
        return task
    }

    private func ended(_ id: UInt64) {
        let empty = state.withLock { state in
            state.active -= 1
            if state.handles.removeValue(forKey: id) == nil { state.endedEarly.insert(id) }
            return state.closed && state.active == 0
        }
        if empty { drained.fire() }
    }

    /// Refuses new work from now on and returns once every task has ended. Tasks still running
    /// after `deadline` are cancelled, again each second (one whose handle was being recorded
    /// is caught by the next pass), for at most `grace`; a task that ignores cancellation longer
    /// is left to the process's exit. Returns whether every task ended.
    @discardableResult
    public func close(within deadline: Duration, grace: Duration = .seconds(5)) async -> Bool {
        let empty = state.withLock { state in
            state.closed = true
            return state.active == 0
        }
        if empty { drained.fire() }
        if await drained.wait(upTo: deadline) { return true }
        let end = ContinuousClock.now + grace
        repeat {
            for task in state.withLock({ Array($0.handles.values) }) { task.cancel() }
            if await drained.wait(upTo: min(.seconds(1), max(end - .now, .zero))) { return true }
        } while ContinuousClock.now < end
        return false
    }
}
