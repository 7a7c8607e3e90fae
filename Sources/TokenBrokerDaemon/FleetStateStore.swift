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
    /// Marks of sessions without a database (development mode), for the daemon's lifetime.
    let memory: SynchronizedBox<[String: FleetPosition]>?

    func load(_ session: String) async throws -> SessionRecord? {
        try await state.sessions.load(session)
    }

    func write(_ write: StoreWrite, mark: FleetPosition) async throws -> Bool {
        let started = ContinuousClock.now
        do {
            let applied: Bool
            if let database = state.database {
                applied = try await database.write(write, mark: SQLiteSessionStore.HistoryMark(generation: mark.generation, serial: mark.serial),
                                                   prefix: prefix)
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

    func mark(_ session: String) async throws -> FleetPosition? {
        guard let database = state.database else { return memory?.value[session] }
        return try await database.mark(session, prefix: prefix).flatMap { FleetPosition(generation: $0.generation, serial: $0.serial) }
    }
}
