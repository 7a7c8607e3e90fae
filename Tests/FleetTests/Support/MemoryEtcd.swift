import Fleet
import Synchronization
import TestSupport

/// etcd's data model in memory, as `FleetBackend`: one revision counter, keys with create and
/// mod revisions and versions, transactions applied atomically, range reads and watches of a
/// prefix fed from the history. The test steers it: it can hold the next requests of a kind
/// (until it lets them go), drop an answer after the request was applied (a lost answer), make
/// every request fail (no quorum), end every watch at once, and write keys as an attacker would.
final class MemoryEtcd: FleetBackend {
    enum Kind: Hashable, Sendable { case get, range, transaction, watch }

    struct Entry: Sendable, Equatable {
        var value: [UInt8]
        var createRevision: Int64
        var modRevision: Int64
        var version: Int64
    }

    private struct Watcher {
        var prefix: [UInt8]
        var changed: @Sendable ([EtcdEvent], Int64) -> Void
        var ended: CheckedContinuation<Void, Never>?
    }

    private struct State {
        var revision: Int64 = 1
        var keys: [[UInt8]: Entry] = [:]
        var history: [(revision: Int64, events: [EtcdEvent])] = []
        /// The changes of the revision being written.
        var pending: [EtcdEvent] = []
        var watchers: [UInt64: Watcher] = [:]
        var cancelledWatchers: Set<UInt64> = []
        var nextWatcher: UInt64 = 0
        var held: [Kind: Int] = [:]
        var parked: [(kind: Kind, continuation: CheckedContinuation<Void, Never>)] = []
        var dropAnswers: [Kind: Int] = [:]
        var failures: [Kind: Int] = [:]
        var unavailable = false
        var requests: [Kind: Int] = [:]
    }

    private let state = Mutex(State())

    // MARK: - Steering

    /// The next `count` requests of `kind` park until `release(kind)`.
    func hold(_ kind: Kind, count: Int = 1) { state.withLock { $0.held[kind, default: 0] += count } }

    func parkedCount(_ kind: Kind) -> Int { state.withLock { state in state.parked.filter { $0.kind == kind }.count } }

    /// Lets every parked request of `kind` go on.
    func release(_ kind: Kind) {
        let going = state.withLock { state -> [CheckedContinuation<Void, Never>] in
            let going = state.parked.filter { $0.kind == kind }.map(\.continuation)
            state.parked.removeAll { $0.kind == kind }
            state.held[kind] = 0
            return going
        }
        for continuation in going { continuation.resume() }
    }

    /// The next `count` requests of `kind` are applied, their answer is lost, and they are sent
    /// again (as the client's failover to the next member does): the caller gets the answer to
    /// the second sending.
    func dropAnswer(_ kind: Kind, count: Int = 1) { state.withLock { $0.dropAnswers[kind, default: 0] += count } }

    /// The next `count` requests of `kind` fail (`unavailable`), not applied.
    func failNext(_ kind: Kind, count: Int = 1) { state.withLock { $0.failures[kind, default: 0] += count } }

    /// Every request fails (`unavailable`) while set.
    func setUnavailable(_ value: Bool) { state.withLock { $0.unavailable = value } }

    func requests(_ kind: Kind) -> Int { state.withLock { $0.requests[kind] ?? 0 } }

    /// Ends every watch under way (as a member that closes its streams).
    func endWatches() {
        let ended = state.withLock { state -> [CheckedContinuation<Void, Never>] in
            defer { for id in state.watchers.keys { state.watchers[id]?.ended = nil } }
            return state.watchers.values.compactMap(\.ended)
        }
        for continuation in ended { continuation.resume() }
    }

    var watching: Int { state.withLock { $0.watchers.count } }

    func entry(_ key: String) -> Entry? { state.withLock { $0.keys[Array(key.utf8)] } }

    /// An attacker's write (a plain put, outside any transaction), or a delete when `value` is nil.
    func write(_ key: String, _ value: [UInt8]?) {
        mutate { state in
            let bytes = Array(key.utf8)
            if let value { Self.putLocked(&state, bytes, value) } else { Self.deleteLocked(&state, bytes) }
            Self.commitLocked(&state)
        }
    }

    /// A backup: every key, and the revision.
    var snapshot: (keys: [[UInt8]: Entry], revision: Int64) { state.withLock { ($0.keys, $0.revision) } }

    /// Puts every key back as it was in `snapshot` (a restored backup: the same revisions and
    /// versions as then; keys not in it are gone). With `rewinding`, the store's revision goes
    /// back too (`etcdutl snapshot restore` without `--bump-revision`); otherwise it moves on.
    /// Watches see nothing of it (a restore restarts the members).
    func restore(_ snapshot: (keys: [[UInt8]: Entry], revision: Int64), rewinding: Bool = false) {
        state.withLock { state in
            state.keys = snapshot.keys
            if rewinding {
                state.revision = snapshot.revision
                state.history.removeAll { $0.revision > snapshot.revision }
            } else {
                state.revision += 1
            }
        }
    }

    // MARK: - FleetBackend

    func get(_ key: [UInt8]) async throws(EtcdError) -> (record: EtcdKeyValue?, revision: Int64) {
        try await admit(.get)
        return try finish(.get) { state in (state.keys[key].map { Self.record(key, $0) }, state.revision) }
    }

    func transaction(_ compare: [EtcdCompare], success: [EtcdOperation], failure: [EtcdOperation]) async throws(EtcdError) -> EtcdTransaction {
        try await admit(.transaction)
        return try finish(.transaction) { state throws(EtcdError) in
            let holds = compare.allSatisfy { comparison in
                switch comparison {
                case let .createRevision(key, value): return (state.keys[key]?.createRevision ?? 0) == value
                case let .modRevision(key, value): return (state.keys[key]?.modRevision ?? 0) == value
                case let .value(key, value): return state.keys[key]?.value == value
                }
            }
            let operations = holds ? success : failure
            var reads: [EtcdKeyValue?] = []
            var wrote = false
            for operation in operations {
                switch operation {
                case let .put(key, value, _):
                    Self.putLocked(&state, key, value)
                    wrote = true
                case let .delete(key):
                    if state.keys[key] != nil { wrote = true }
                    Self.deleteLocked(&state, key)
                case let .get(key):
                    reads.append(state.keys[key].map { Self.record(key, $0) })
                }
            }
            if wrote { Self.commitLocked(&state) }
            return EtcdTransaction(succeeded: holds, revision: state.revision, reads: reads)
        }
    }

    func range(prefix: [UInt8]) async throws(EtcdError) -> (records: [EtcdKeyValue], revision: Int64) {
        try await admit(.range)
        return try finish(.range) { state in
            let records = state.keys.filter { $0.key.starts(with: prefix) }.map { Self.record($0.key, $0.value) }
            return (records.sorted { $0.key.lexicographicallyPrecedes($1.key) }, state.revision)
        }
    }

    func watch(prefix: [UInt8], from revision: Int64, for duration: Duration,
               changed: @escaping @Sendable ([EtcdEvent], Int64) -> Void) async throws(EtcdError) -> WatchEnd {
        try await admit(.watch)
        let id = state.withLock { state -> UInt64 in
            state.nextWatcher += 1
            return state.nextWatcher
        }
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let backlog = state.withLock { state -> [(Int64, [EtcdEvent])]? in
                    if state.cancelledWatchers.remove(id) != nil { return nil }
                    state.watchers[id] = Watcher(prefix: prefix, changed: changed, ended: continuation)
                    return state.history.filter { $0.revision >= revision }.map { ($0.revision, $0.events.filter { $0.record.key.starts(with: prefix) }) }
                        .filter { !$0.1.isEmpty }
                }
                guard let backlog else { return continuation.resume() }
                for (revision, events) in backlog { changed(events, revision) }
            }
            _ = state.withLock { $0.watchers.removeValue(forKey: id) }
        } onCancel: {
            let ended = state.withLock { state -> CheckedContinuation<Void, Never>? in
                guard state.watchers[id] != nil else {
                    state.cancelledWatchers.insert(id)
                    return nil
                }
                defer { state.watchers[id]?.ended = nil }
                return state.watchers[id]?.ended
            }
            ended?.resume()
        }
        if Task.isCancelled { throw EtcdError(kind: .cancelled, message: "cancelled") }
        return .endedEarly
    }

    // MARK: - Inside

    private func admit(_ kind: Kind) async throws(EtcdError) {
        if Task.isCancelled { throw EtcdError(kind: .cancelled, message: "cancelled") }
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let park = state.withLock { state -> Bool in
                state.requests[kind, default: 0] += 1
                guard let held = state.held[kind], held > 0 else { return false }
                state.held[kind] = held - 1
                state.parked.append((kind, continuation))
                return true
            }
            if !park { continuation.resume() }
        }
        let fails = state.withLock { state -> Bool in
            if let count = state.failures[kind], count > 0 {
                state.failures[kind] = count - 1
                return true
            }
            return state.unavailable
        }
        if fails { throw EtcdError(kind: .unavailable, message: "no quorum (test)") }
    }

    /// Runs `body` on the state; then tells the watches of the revisions it wrote.
    private func mutate<T>(_ body: (inout State) throws(EtcdError) -> T) throws(EtcdError) -> T {
        typealias Note = (@Sendable ([EtcdEvent], Int64) -> Void, [EtcdEvent], Int64)
        let (result, notify) = try state.withLock { state throws(EtcdError) -> (T, [Note]) in
            let before = state.history.count
            let result = try body(&state)
            var notify: [Note] = []
            for (revision, events) in state.history.dropFirst(before) {
                for watcher in state.watchers.values where watcher.ended != nil {
                    let mine = events.filter { $0.record.key.starts(with: watcher.prefix) }
                    if !mine.isEmpty { notify.append((watcher.changed, mine, revision)) }
                }
            }
            return (result, notify)
        }
        for (changed, events, revision) in notify { changed(events, revision) }
        return result
    }

    private func mutate<T>(_ body: (inout State) -> T) -> T {
        let outcome: Result<T, EtcdError> = Result { () throws(EtcdError) -> T in try mutate { (state: inout State) throws(EtcdError) -> T in body(&state) } }
        return try! outcome.get()
    }

    private func finish<T>(_ kind: Kind, _ body: (inout State) throws(EtcdError) -> T) throws(EtcdError) -> T {
        let drop = state.withLock { state -> Bool in
            guard let count = state.dropAnswers[kind], count > 0 else { return false }
            state.dropAnswers[kind] = count - 1
            return true
        }
        if drop { _ = try? mutate(body) }
        return try mutate(body)
    }

    private static func putLocked(_ state: inout State, _ key: [UInt8], _ value: [UInt8]) {
        let next = state.revision + 1
        let old = state.keys[key]
        let entry = Entry(value: value, createRevision: old?.createRevision ?? next, modRevision: next, version: (old?.version ?? 0) + 1)
        state.keys[key] = entry
        state.pending.append(EtcdEvent(kind: .put, record: record(key, entry)))
    }

    private static func deleteLocked(_ state: inout State, _ key: [UInt8]) {
        guard state.keys.removeValue(forKey: key) != nil else { return }
        state.pending.append(EtcdEvent(kind: .delete, record: EtcdKeyValue(key: key, value: [], createRevision: 0,
                                                                          modRevision: state.revision + 1, version: 0, lease: 0)))
    }

    /// Ends the revision being written: its changes become one entry of the history.
    private static func commitLocked(_ state: inout State) {
        guard !state.pending.isEmpty else { return }
        state.revision += 1
        state.history.append((state.revision, state.pending))
        state.pending = []
    }

    private static func record(_ key: [UInt8], _ entry: Entry) -> EtcdKeyValue {
        EtcdKeyValue(key: key, value: entry.value, createRevision: entry.createRevision, modRevision: entry.modRevision,
                     version: entry.version, lease: 0)
    }
}
