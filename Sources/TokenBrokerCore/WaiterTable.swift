import Synchronization

/// The parked callers of a coordinator's flights, one continuation per caller.
///
/// It lives outside the actor, behind a `Mutex`, so that a cancelled caller leaves *at once*:
/// its task's cancellation handler resumes its own continuation synchronously, without waiting
/// for the actor or for the flight. The flight itself is untouched (guarantee 6).
///
/// A waiter is `register`ed and `park`ed within one synchronous stretch of the actor, but its
/// cancellation handler and the flight's resolution may run on other threads at any moment;
/// every order of the four calls ends with the continuation resumed exactly once.
final class WaiterTable: Sendable {
    typealias Continuation = CheckedContinuation<IssuedToken, any Error>

    private enum Entry {
        case registered(FlightID)
        case parked(FlightID, Continuation)
        case cancelled
        case resolved(Result<IssuedToken, SessionError>)
    }

    private let entries = Mutex<[UInt64: Entry]>([:])

    func register(_ waiter: UInt64, on flight: FlightID) {
        entries.withLock { $0[waiter] = .registered(flight) }
    }

    func park(_ waiter: UInt64, _ continuation: Continuation) {
        let early: Result<IssuedToken, any Error>? = entries.withLock { entries in
            switch entries[waiter] {
            case let .registered(flight):
                entries[waiter] = .parked(flight, continuation)
                return nil
            case let .resolved(result):
                entries[waiter] = nil
                return result.mapError { $0 }
            case .cancelled, .parked, nil:
                entries[waiter] = nil
                return .failure(CancellationError())
            }
        }
        if let early { continuation.resume(with: early) }
    }

    func cancel(_ waiter: UInt64) {
        let continuation: Continuation? = entries.withLock { entries in
            switch entries[waiter] {
            case .registered:
                entries[waiter] = .cancelled
                return nil
            case let .parked(_, continuation):
                entries[waiter] = nil
                return continuation
            case .cancelled, .resolved, nil:
                return nil
            }
        }
        continuation?.resume(throwing: CancellationError())
    }

    /// Resolves every waiter of `flight` with `result`.
    func resolve(_ flight: FlightID, with result: Result<IssuedToken, SessionError>) {
        let parked: [Continuation] = entries.withLock { entries in
            var parked: [Continuation] = []
            for (waiter, entry) in entries {
                switch entry {
                case let .registered(f) where f == flight:
                    entries[waiter] = .resolved(result)
                case let .parked(f, continuation) where f == flight:
                    entries[waiter] = nil
                    parked.append(continuation)
                default:
                    break
                }
            }
            return parked
        }
        let outcome = result.mapError { $0 as any Error }
        for continuation in parked { continuation.resume(with: outcome) }
    }

    /// Waiters not yet resumed (for tests and status).
    var count: Int { entries.withLock { $0.count } }
}

/// The `watch()` subscribers of a coordinator.
final class WatcherList: Sendable {
    private struct State {
        var next = 0
        var continuations: [Int: AsyncStream<SessionEvent>.Continuation] = [:]
    }

    private let state = Mutex(State())
    /// Told the number of subscribers after each change, under the list's lock (so in order).
    private let countChanged: @Sendable (Int) -> Void

    init(countChanged: @escaping @Sendable (Int) -> Void = { _ in }) {
        self.countChanged = countChanged
    }

    func add(_ continuation: AsyncStream<SessionEvent>.Continuation) {
        let id = state.withLock { state in
            state.next += 1
            state.continuations[state.next] = continuation
            countChanged(state.continuations.count)
            return state.next
        }
        continuation.onTermination = { [weak self] _ in
            guard let self else { return }
            state.withLock { state in
                if state.continuations.removeValue(forKey: id) != nil { countChanged(state.continuations.count) }
            }
        }
    }

    func send(_ event: SessionEvent) {
        for continuation in state.withLock({ Array($0.continuations.values) }) { continuation.yield(event) }
    }

    func finishAll() {
        for continuation in state.withLock({ state in
            defer {
                if !state.continuations.isEmpty { countChanged(0) }
                state.continuations.removeAll()
            }
            return Array(state.continuations.values)
        }) { continuation.finish() }
    }

    var count: Int { state.withLock { $0.continuations.count } }
}
