/// Orders session boundaries (logout, login, forget) against the moment a reload hands a
/// session over to a new coordinator.
///
/// Boundaries pass in shared mode, many at once; the hand-over is exclusive and waits until the
/// boundaries under way are done, while new ones wait for it. So a logout is either complete in
/// the old coordinator before its state is handed over, or starts after the swap and reaches
/// the new one: an acknowledged logout can never be left behind in a coordinator nobody uses.
/// (Waiting writers are preferred, so a stream of logouts cannot starve a reload.)
actor BoundaryGate {
    private var shared = 0
    private var exclusive = false
    private var waiting: [(exclusive: Bool, continuation: CheckedContinuation<Void, Never>)] = []

    /// Holders waiting to enter (for tests).
    var queued: Int { waiting.count }

    /// Runs `body` alongside other shared holders, never during an exclusive one.
    func shared<T: Sendable>(_ body: @Sendable () async throws -> T) async rethrows -> T {
        if exclusive || !waiting.isEmpty {
            await withCheckedContinuation { waiting.append((false, $0)) }
        } else {
            shared += 1
        }
        defer { release(exclusive: false) }
        return try await body()
    }

    /// Runs `body` alone.
    func exclusive<T: Sendable>(_ body: @Sendable () async throws -> T) async rethrows -> T {
        if exclusive || shared > 0 || !waiting.isEmpty {
            await withCheckedContinuation { waiting.append((true, $0)) }
        } else {
            exclusive = true
        }
        defer { release(exclusive: true) }
        return try await body()
    }

    /// Ends a hold and admits who may go next: one exclusive waiter, or every shared waiter up to
    /// the next exclusive one. (A waiter admitted here is counted before it resumes.)
    private func release(exclusive wasExclusive: Bool) {
        if wasExclusive { exclusive = false } else { shared -= 1 }
        guard !exclusive, shared == 0 || waiting.first?.exclusive == false else { return }
        while let next = waiting.first {
            if next.exclusive {
                guard shared == 0 else { return }
                waiting.removeFirst()
                exclusive = true
                next.continuation.resume()
                return
            }
            waiting.removeFirst()
            shared += 1
            next.continuation.resume()
        }
    }
}
