import Synchronization

/// Tasks that outlive the call that started them but not their owner: at most `limit` at once,
/// and awaited when the owner closes the pool (a part of the daemon's task tree), so that none
/// runs on, unseen, past the stop.
///
/// `spawn` refuses work when the pool is full or closed; the caller says what is skipped.
/// `enqueue` waits its turn instead, in a bounded backlog (work that must not be dropped under
/// a burst, such as a logout's revocation), and the backlog is drained at close.
public final class TaskPool: Sendable {
    public let limit: Int
    /// The most work `enqueue` keeps waiting.
    public let backlogLimit: Int

    private struct State {
        var active = 0
        var next: UInt64 = 0
        var closed = false
        var handles: [UInt64: Task<Void, Never>] = [:]
        /// Tasks that ended before their handle was recorded.
        var endedEarly: Set<UInt64> = []
        /// Work waiting for a free task, oldest first (from `backlogHead` on).
        var backlog: [(@Sendable () async -> Void)?] = []
        var backlogHead = 0
        var backlogCount: Int { backlog.count - backlogHead }
    }

    private let state = Mutex(State())
    /// Fires once the pool is closed and no task runs.
    private let drained = Latch()

    public init(limit: Int, backlog: Int = 0) {
        precondition(limit > 0, "a pool holds at least one task")
        self.limit = limit
        backlogLimit = backlog
    }

    /// The number of tasks running.
    public var count: Int { state.withLock { $0.active } }

    /// Starts `work`, or keeps it until a task is free (oldest first); false when the pool is
    /// closed or the backlog is full.
    @discardableResult
    public func enqueue(_ work: @escaping @Sendable () async -> Void) -> Bool {
        // (One decision under the lock: a task that ends meanwhile cannot strand the work.)
        enum Decision { case start(UInt64), queued, refused }
        let decision: Decision = state.withLock { state in
            guard !state.closed else { return .refused }
            if state.active < limit {
                state.active += 1
                state.next += 1
                return .start(state.next)
            }
            guard state.backlogCount < backlogLimit else { return .refused }
            state.backlog.append(work)
            return .queued
        }
        switch decision {
        case let .start(id):
            _ = track(id, work)
            return true
        case .queued: return true
        case .refused: return false
        }
    }

    /// Runs `work` in the pool (in turn, as `enqueue`) and returns its result: work that must
    /// outlive its caller's cancellation (a redemption that spends a code, a poll that may carry
    /// an approved login's tokens) and that the pool's owner awaits at its stop. `refused` is
    /// the result when the pool is closed or its backlog full. (Work still waiting when a close
    /// passes its deadline is dropped with the backlog: its caller is the stopping daemon's.)
    public func outliving<Value: Sendable>(_ work: @escaping @Sendable () async -> Value, refused: @autoclosure () -> Value) async -> Value {
        await withCheckedContinuation { continuation in
            let started = enqueue { continuation.resume(returning: await work()) }
            if !started { continuation.resume(returning: refused()) }
        }
    }

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
        return track(id, work)
    }

    private func track(_ id: UInt64, _ work: @escaping @Sendable () async -> Void) -> Task<Void, Never> {
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
        // The next waiting work takes the task's place (also while closing: the backlog drains).
        let (next, empty): ((@Sendable () async -> Void)?, Bool) = state.withLock { state in
            state.active -= 1
            if state.handles.removeValue(forKey: id) == nil { state.endedEarly.insert(id) }
            var next: (@Sendable () async -> Void)?
            if state.backlogCount > 0 {
                next = state.backlog[state.backlogHead]
                state.backlog[state.backlogHead] = nil
                state.backlogHead += 1
                if state.backlogHead == state.backlog.count { (state.backlog, state.backlogHead) = ([], 0) }
                state.active += 1
            }
            return (next, next == nil && state.closed && state.active == 0)
        }
        if let next { start(next) }
        if empty { drained.fire() }
    }

    /// Starts work already counted as active.
    private func start(_ work: @escaping @Sendable () async -> Void) {
        let id: UInt64 = state.withLock { state in
            state.next += 1
            return state.next
        }
        _ = track(id, work)
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
        // Past the deadline, what still waits is dropped, and what runs is cancelled.
        state.withLock { state in (state.backlog, state.backlogHead) = ([], 0) }
        let end = ContinuousClock.now + grace
        repeat {
            for task in state.withLock({ Array($0.handles.values) }) { task.cancel() }
            // (A cancelled caller's waits return at once: then once is all it does.)
            if Task.isCancelled { return state.withLock { $0.active == 0 } }
            if await drained.wait(upTo: min(.seconds(1), max(end - .now, .zero))) { return true }
        } while ContinuousClock.now < end
        return false
    }
}
