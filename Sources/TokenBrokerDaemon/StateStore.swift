#if canImport(Glibc)
import Glibc
#endif
import SQLiteStore
import TokenBrokerCore

/// Where session state lives: the SQLite database (the default), or memory in development mode.
struct StateStore: Sendable {
    static let defaultDirectory = "/var/lib/tokenbroker"

    let sessions: any SessionStore
    let database: SQLiteSessionStore?

    static func open(_ options: Daemon.Options, logger: Logger) throws -> StateStore {
        let environment = getenv("STATE_DIRECTORY").map { String(cString: $0) }
        // systemd may pass several directories separated by ':'; ours is the first.
        let fromSystemd = environment?.split(separator: ":").first.map(String.init)
        if options.dev && options.stateDirectory == nil {
            return StateStore(sessions: InMemorySessionStore(), database: nil)
        }
        let directory = options.stateDirectory ?? fromSystemd ?? defaultDirectory
        let database = try SQLiteSessionStore(directory: directory)
        if let moved = database.movedAside {
            logger.error("the state database \(database.path) was unreadable and has been moved aside to \(moved); starting with an empty one")
        }
        logger.info("state database: \(database.path)")
        return StateStore(sessions: database, database: database)
    }
}

/// A stored session the configuration no longer names: inert (no coordinator), listed by
/// Status for admins until `ctl forget` removes it.
struct InertSession: Sendable {
    var name: String
    var state: SessionRecord.State
    var generation: Int
    var tokenSerial: UInt64?
    var expiresAt: Int64?
    var lastRefresh: Int64?

    init(_ record: SessionRecord) {
        name = record.name
        state = record.state
        generation = record.generation
        tokenSerial = record.accessToken == nil ? nil : record.tokenSerial
        expiresAt = record.expiresAt
        lastRefresh = record.lastRefresh
    }
}
