#if canImport(Glibc)
import Glibc
#endif
import Basics
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

    /// Opens the state directory's database, sealed under the state key (`StateKey`: the
    /// operator's, the package's credential, else the state directory's key file, made here at
    /// the first start). Key problems throw `StateKeyProblem` (a configuration error).
    static func open(_ options: Daemon.Options, stateKey: SecretBytes?, logger: Logger) throws -> StateStore {
        let environment = getenv("STATE_DIRECTORY").map { String(cString: $0) }
        // systemd may pass several directories separated by ':'; ours is the first.
        let fromSystemd = environment?.split(separator: ":").first.map(String.init)
        if options.dev && options.stateDirectory == nil {
            return StateStore(sessions: InMemorySessionStore(), database: nil, lock: nil)
        }
        let directory = options.stateDirectory ?? fromSystemd ?? (options.user ? UserDirectories().state + "/tokenbroker" : defaultDirectory)
        // The lock first: reading or making the key, and opening the database (which may
        // migrate it, seal rows written in clear, or move an unreadable file aside), may not
        // happen under another daemon.
        try SQLiteSessionStore.prepareDirectory(directory)
        let lock = Glibc.open(directory + "/state.lock", O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0o600)
        guard lock >= 0 else { throw StoreError("cannot open \(directory)/state.lock: \(String(cString: strerror(errno)))") }
        guard flock(lock, LOCK_EX | LOCK_NB) == 0 else {
            close(lock)
            throw AlreadyInUse(directory: directory)
        }
        let database: SQLiteSessionStore
        let keys: [StateKey]
        var made = false
        do {
            var found = try StateKey.find(configured: stateKey, directory: directory,
                                          credentials: getenv("CREDENTIALS_DIRECTORY").map { String(cString: $0) },
                                          warn: { logger.warning($0) })
            if found.isEmpty {
                // A sealed database and no key: its key is gone (a credential removed, a file
                // deleted). A new key would not open it, and would stand in for the old one.
                guard try !SQLiteSessionStore.holdsSealedValues(directory: directory) else {
                    throw StateKeyProblem(description: "the state database \(directory)/state.db is sealed, but no state key was found "
                                          + "(no StateKeyFile= or StateKeyCredential=, no credential \(StateKey.credentialName) "
                                          + "\(getenv("CREDENTIALS_DIRECTORY") == nil ? "($CREDENTIALS_DIRECTORY is not set)" : "in $CREDENTIALS_DIRECTORY"), "
                                          + "no \(directory)/\(StateKey.fileName)): restore the key it was sealed with, or move state.db "
                                          + "aside to start with no sessions; no new key is made over a sealed database")
                }
                found = [try StateKey.make(in: directory)]
                made = true
            }
            keys = found
            do {
                database = try SQLiteSessionStore(directory: directory, cipher: keys[0].cipher, formerCiphers: keys.dropFirst().map(\.cipher))
            } catch let wrong as WrongStateKey {
                let others = keys.dropFirst().map(\.source.description)
                throw StateKeyProblem(description: "the state database \(directory)/state.db is sealed under another state key: session "
                                      + "\(wrong.session) does not decrypt under the key in force (\(keys[0].source))"
                                      + (others.isEmpty ? "" : " nor under \(others.joined(separator: ", "))")
                                      + "; restore the key it was sealed with, or move state.db aside to start with no sessions")
            }
        } catch {
            close(lock)
            throw error
        }
        if let moved = database.movedAside {
            logger.error("the state database \(database.path) was unreadable and has been moved aside to \(moved); starting with an empty one")
        }
        if made { logger.notice("made a new state key, \(keys[0].source) (mode 0600): the state database is sealed under it") }
        if let former = database.resealedFrom {
            logger.notice("the state database was sealed under \(keys[former + 1].source); sealed again under \(keys[0].source)")
        }
        if database.sealedInClear > 0 {
            logger.notice("sealed the tokens of \(database.sealedInClear) session(s) stored in clear (erased from the database's files)")
        }
        logger.info("state database: \(database.path) (tokens encrypted), state key: \(keys[0].source)")
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
