import Basics
import Fleet
import SQLiteStore
import TokenBrokerCore

/// This host's copy of a fleet session: the state database (timed for the metrics), which keeps
/// the session's mark under the fleet's prefix in the same transaction as its row. In
/// development mode, without a database, the rows live in memory and so do the marks.
struct FleetStateStore: FleetLocalStore {
    let state: StateStore
    let prefix: String
    let metrics: Metrics
    /// Marks and kept commits of sessions without a database (development mode), for the
    /// daemon's lifetime.
    let memory: SynchronizedBox<[String: FleetPosition]>?
    let pendingMemory: SynchronizedBox<[String: FleetPendingCommit]>?

    func load(_ session: String) async throws -> SessionRecord? {
        try await state.sessions.load(session)
    }

    func write(_ write: StoreWrite, mark: FleetPosition) async throws -> Bool {
        let started = ContinuousClock.now
        do {
            let applied: Bool
            if let database = state.database {
                applied = try await database.write(write, mark: SQLiteSessionStore.HistoryMark(history: mark.history, generation: mark.generation,
                                                                                                serial: mark.serial), prefix: prefix)
            } else {
                memory?.modify { $0[write.record.name] = max($0[write.record.name] ?? .start, mark) }
                applied = try await state.sessions.write(write)
            }
            metrics.storeWrite(seconds: started.duration(to: .now).seconds, failed: false)
            return applied
        } catch {
            metrics.storeWrite(seconds: started.duration(to: .now).seconds, failed: true)
            throw error
        }
    }

    func pendingCommit(_ session: String) async throws -> FleetPendingCommit? {
        guard let database = state.database else { return pendingMemory?.value[session] }
        guard let kept = try await database.pendingFleetCommit(session, prefix: prefix) else { return nil }
        return FleetPendingCommit(value: Array(kept.value.utf8), placeValue: Array(kept.placeValue.utf8), createRevision: kept.createRevision,
                                  modRevision: kept.modRevision, version: kept.version, generation: Int(clamping: kept.generation))
    }

    func keepPendingCommit(_ session: String, _ pending: FleetPendingCommit?) async throws {
        guard let database = state.database else {
            pendingMemory?.modify { $0[session] = pending }
            return
        }
        try await database.keepPendingFleetCommit(session, prefix: prefix, pending.map {
            SQLiteSessionStore.PendingFleetCommit(value: String(decoding: $0.value, as: UTF8.self), placeValue: String(decoding: $0.placeValue, as: UTF8.self),
                                                  createRevision: $0.createRevision, modRevision: $0.modRevision, version: $0.version,
                                                  generation: Int64($0.generation))
        })
    }

    func mark(_ session: String) async throws -> FleetPosition? {
        guard let database = state.database else { return memory?.value[session] }
        return try await database.mark(session, prefix: prefix).flatMap { FleetPosition(history: $0.history, generation: $0.generation, serial: $0.serial) }
    }
}
