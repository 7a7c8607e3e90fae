#if canImport(Glibc)
import Glibc
#endif
import Sealing
import SQLiteStore
import TokenBrokerCore

/// Where session state lives: the SQLite database (the default), or memory in development mode.
struct StateStore: Sendable {
    static let defaultDirectory = "/var/lib/tokenbroker"

    let sessions: any SessionStore
    let database: SQLiteSessionStore?
    /// Held for the daemon's lifetime: one daemon per state directory (two would each run
    /// their own refresh flight for the same sessions).
    let lock: Int32?
    /// The state directory (`nil`: state in memory).
    var directory: String? = nil

    struct AlreadyInUse: Error, CustomStringConvertible {
        let directory: String
        var description: String { "another tokenbroker is using \(directory) (its lock file is held)" }
    }

    static func open(_ options: Daemon.Options, stateKey: Secret?, logger: Logger) throws -> StateStore {
        let environment = getenv("STATE_DIRECTORY").map { String(cString: $0) }
        // systemd may pass several directories separated by ':'; ours is the first.
        let fromSystemd = environment?.split(separator: ":").first.map(String.init)
        if options.dev && options.stateDirectory == nil {
            return StateStore(sessions: InMemorySessionStore(), database: nil, lock: nil)
        }
        let directory = options.stateDirectory ?? fromSystemd ?? defaultDirectory
        let cipher = try stateKey.map { key in
            try TokenCipher(keyMaterial: key.reveal.unicodeScalars.map { UInt8(truncatingIfNeeded: $0.value) })
        }
        // The lock first: opening the database may migrate it, encrypt rows written in clear, or
        // move an unreadable file aside — none of which may happen under another daemon.
        try SQLiteSessionStore.prepareDirectory(directory)
        let lock = Glibc.open(directory + "/state.lock", O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0o600)
        guard lock >= 0 else { throw StoreError("cannot open \(directory)/state.lock: \(String(cString: strerror(errno)))") }
        guard flock(lock, LOCK_EX | LOCK_NB) == 0 else {
            close(lock)
            throw AlreadyInUse(directory: directory)
        }
        let database: SQLiteSessionStore
        do {
            database = try SQLiteSessionStore(directory: directory, cipher: cipher)
        } catch {
            close(lock)
            throw error
        }
        if let moved = database.movedAside {
            logger.error("the state database \(database.path) was unreadable and has been moved aside to \(moved); starting with an empty one")
        }
        logger.info("state database: \(database.path)\(cipher == nil ? "" : " (tokens encrypted)")")
        return StateStore(sessions: database, database: database, lock: lock, directory: directory)
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
