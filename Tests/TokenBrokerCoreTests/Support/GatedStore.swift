import Synchronization
import TokenBrokerCore

/// An in-memory store the test can hold (writes park until released, one by one in a chosen
/// order, or all) or break (writes throw). The generation guard itself is
/// `InMemorySessionStore`'s.
final class GatedStore: SessionStore {
    struct DiskFull: Error, CustomStringConvertible {
        var description: String { "disk full" }
    }

    private struct State {
        var holding = false
        var failing = false
        var held: [CheckedContinuation<Void, Never>] = []
        var writes = 0
        var completed = 0
    }

    let inner: InMemorySessionStore
    private let state = Mutex(State())

    init(_ records: [SessionRecord] = []) {
        inner = InMemorySessionStore(records)
    }

    /// From now on, writes park until released; `heldCount` tells how many are parked.
    func hold() { state.withLock { $0.holding = true } }

    /// Lets every parked write go on; later writes no longer park.
    func release() {
        let held = state.withLock { state in
            state.holding = false
            defer { state.held.removeAll() }
            return state.held
        }
        for continuation in held { continuation.resume() }
    }

    /// Lets the oldest (`newest: false`) or newest parked write go on; the rest stay parked.
    func releaseOne(newest: Bool) {
        let continuation = state.withLock { state in
            state.held.isEmpty ? nil : (newest ? state.held.removeLast() : state.held.removeFirst())
        }
        continuation?.resume()
    }

    func setFailing(_ failing: Bool) { state.withLock { $0.failing = failing } }

    /// Writes that reached the store (parked or not).
    var writeCount: Int { state.withLock { $0.writes } }
    /// Writes parked now.
    var heldCount: Int { state.withLock { $0.held.count } }
    /// Writes that have finished (applied, refused or failed).
    var completedCount: Int { state.withLock { $0.completed } }

    func load(_ session: String) async throws -> SessionRecord? {
        await inner.load(session)
    }

    func write(_ write: StoreWrite) async throws -> Bool {
        await withCheckedContinuation { continuation in
            let park = state.withLock { state in
                state.writes += 1
                if state.holding { state.held.append(continuation) }
                return state.holding
            }
            if !park { continuation.resume() }
        }
        defer { state.withLock { $0.completed += 1 } }
        if state.withLock({ $0.failing }) { throw DiskFull() }
        return await inner.write(write)
    }
}
