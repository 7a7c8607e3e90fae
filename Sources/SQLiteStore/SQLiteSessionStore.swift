#if canImport(Glibc)
import Glibc
#endif
import Basics
import CSQLite
import Sealing
import Synchronization
import TokenBrokerCore

/// A failure of the state database. Messages name files and SQLite errors, never a value.
public struct StoreError: Error, Sendable, Equatable, CustomStringConvertible {
    public var message: String
    public init(_ message: String) { self.message = message }
    public var description: String { message }
}

/// The database's sealed values open under none of the keys the store was given: it was
/// sealed under another state key. Names the first session that did not open, never a value.
public struct WrongStateKey: Error, Sendable, Equatable, CustomStringConvertible {
    public var session: String
    public init(session: String) { self.session = session }
    public var description: String { "the state database is sealed under another state key (session \(session) does not decrypt)" }
}

/// Durable session state in SQLite (`state.db` in the state directory).
///
/// - WAL journal with `synchronous=FULL`: a commit returns only after its WAL frames are
///   fsynced, so a rotated refresh token survives power loss, not just a process crash, before
///   anyone sees the new access token (guarantee 7). `NORMAL` would be crash-safe but could lose
///   the last commits on power loss, and a lost rotation is a lost session.
/// - Every write is guarded by the generation (`StoreWrite.Guard`), in one statement:
///   `UPDATE … WHERE name = ? AND generation = ? AND <not older by token serial>` for refreshes
///   and ends, and an upsert that applies only over an older generation for logins and logouts.
/// - The directory is 0700 and the files 0600 (the daemon's umask is tightened while SQLite
///   creates them). With a `TokenCipher` the token columns are encrypted (AES-256-GCM); rows
///   written before the key was configured are encrypted when the store opens, and rows sealed
///   under a former key are sealed again under the new one.
/// - A database that cannot be read as one (corrupt, not a database) is moved aside as
///   `state.db.corrupt-<unix time>` and a new one is created; the caller is told.
///
/// All SQLite work runs on one dedicated thread, in order.
public final class SQLiteSessionStore: SessionStore {
    /// The schema version this build writes; older databases are migrated forward.
    public static let schemaVersion: Int32 = 6

    private final class Connection: @unchecked Sendable {
        // @unchecked: the handle and the statement cache are used only on the store's serial
        // thread.
        let db: OpaquePointer
        /// Prepared once, reset for each use: a start-up with thousands of sessions parses each
        /// statement once, not once per session.
        private var statements: [String: Statement] = [:]
        /// A checkpoint that erases tokens failed: the next commit job tries it again (until then
        /// the WAL may still hold them).
        var checkpointOwed = false

        init(_ db: OpaquePointer) { self.db = db }

        deinit {
            statements.removeAll()
            sqlite3_close_v2(db)
        }

        /// `sql`, prepared (once) and reset, its bindings cleared.
        func prepare(_ sql: String) throws -> Statement {
            if let statement = statements[sql] {
                statement.reset()
                return statement
            }
            let statement = try Statement(db, sql)
            statements[sql] = statement
            return statement
        }
    }

    /// Writes waiting for the store's thread: whoever finds the queue empty schedules a commit
    /// of everything queued by the time it runs (a group commit: at start-up, thousands of
    /// sessions' first writes share a few transactions, each fsynced once).
    private final class WriteQueue: Sendable {
        let entries = Mutex<[(write: QueuedWrite, continuation: CheckedContinuation<Bool, any Error>)]>([])
    }

    private let queue = WriteQueue()
    /// The most writes one transaction takes (the rest go in the next).
    static let batchLimit = 1024

    private let connection: Connection
    private let thread = SerialThread()
    private let cipher: TokenCipher?
    public let path: String
    /// Set when an unreadable database was moved aside at open: where it went.
    public let movedAside: String?

    /// Opens (or creates) `directory/state.db`; with `cipher`, token columns are encrypted.
    ///
    /// With `cipher`, values stored in clear (written before a key was used) are sealed, and a
    /// database sealed under one of `formerCiphers` instead (a key that was in force before) is
    /// sealed again under `cipher`: `resealedFrom` says which. A database sealed under none of
    /// them is refused (`WrongStateKey`), never read as signed out. Either way the clear or old
    /// versions are then erased from the file, its free pages and the WAL.
    public init(directory: String, cipher: TokenCipher? = nil, formerCiphers: [TokenCipher] = []) throws {
        self.cipher = cipher
        try Self.prepareDirectory(directory)
        path = directory + "/state.db"
        var moved: String?
        var handle: OpaquePointer
        do {
            handle = try Self.open(path)
        } catch let error as CorruptDatabase {
            moved = try Self.moveAside(path, reason: error.reason)
            handle = try Self.open(path)
        }
        let opened = Connection(handle)
        connection = opened
        movedAside = moved
        let sealing = try cipher.map { try Self.seal(opened, under: $0, formerCiphers) }
        resealedFrom = sealing?.former
        sealedInClear = sealing?.clear ?? 0
    }

    /// Which of the former keys the database was sealed under when it opened (it is sealed under
    /// the new one now); nil when none was.
    public let resealedFrom: Int?
    /// How many sessions had values stored in clear when it opened (sealed now).
    public let sealedInClear: Int

    /// Whether `directory/state.db` holds a value sealed under some key: a store opened there
    /// without that key could not read its sessions, and a new key would not open them.
    public static func holdsSealedValues(directory: String) throws -> Bool {
        let path = directory + "/state.db"
        guard access(path, F_OK) == 0 else { return false }
        // Read only: the probe writes nothing, not even a checkpoint at its close (SQLite may
        // make the WAL's index files, 0600 like the others).
        let previous = umask(0o077)
        defer { umask(previous) }
        var handle: OpaquePointer?
        _ = configured
        guard sqlite3_open_v2(path, &handle, SQLITE_OPEN_READONLY | SQLITE_OPEN_FULLMUTEX, nil) == SQLITE_OK, let db = handle else {
            let message = handle.map { String(cString: sqlite3_errmsg($0)) } ?? "cannot open"
            sqlite3_close_v2(handle)
            throw StoreError("cannot open \(path): \(message)")
        }
        defer { sqlite3_close_v2(db) }
        sqlite3_busy_timeout(db, 5000)
        do {
            // (A database of an older schema lacks the later columns: proof_key came with 4.)
            let info = try Statement(db, "SELECT name FROM pragma_table_info('sessions')")
            var columns: [String] = []
            while try info.step() {
                if let name = info.text(0), ["refresh_token", "access_token", "proof_key"].contains(name) { columns.append(name) }
            }
            guard !columns.isEmpty else { return false }
            let query = try Statement(db, "SELECT 1 FROM sessions WHERE "
                                      + columns.map { "substr(\($0), 1, 7) = ?1" }.joined(separator: " OR ") + " LIMIT 1")
            query.bind(1, TokenCipher.sealedPrefix)
            if try query.step() { return true }
            // (client_keys came with 6.)
            guard try Statement(db, "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'client_keys'").step() else { return false }
            let keys = try Statement(db, "SELECT 1 FROM client_keys WHERE substr(key, 1, 7) = ?1 LIMIT 1")
            keys.bind(1, TokenCipher.sealedPrefix)
            return try keys.step()
        } catch let error as StoreError where ["not a database", "malformed"].contains(where: error.message.contains) {
            // Unreadable (opening it moves it aside) or not yet made: nothing sealed to lose.
            return false
        }
    }

    /// Seals the token values stored in clear under `cipher`, and those sealed under one of
    /// `formers` again under `cipher`; returns the index of that former key, if any, and how many
    /// sessions had values in clear.
    private static func seal(_ connection: Connection, under cipher: TokenCipher, _ formers: [TokenCipher]) throws -> (former: Int?, clear: Int) {
        let db = connection.db
        let columns = ["refresh_token", "access_token", "proof_key"]
        let rows = try Statement(db, "SELECT name, refresh_token, access_token, proof_key FROM sessions")
        var stored: [(name: String, values: [String?])] = []
        while try rows.step() {
            guard let name = rows.text(0) else { continue }
            stored.append((name, [rows.text(1), rows.text(2), rows.text(3)]))
        }
        let keyRows = try Statement(db, "SELECT session, kid, key FROM client_keys")
        var keys: [(session: String, kid: String, value: String)] = []
        while try keyRows.step() {
            guard let session = keyRows.text(0), let kid = keyRows.text(1), let value = keyRows.text(2) else { continue }
            keys.append((session, kid, value))
        }
        // The key the database is under: the one that opens its first sealed value.
        var former: (index: Int, cipher: TokenCipher)?
        let sealed = stored.lazy.flatMap { row in zip(row.values, columns).compactMap { value, column in
            value.flatMap { TokenCipher.isEncrypted($0) ? (row.name, row.name + "/" + column, $0) : nil }
        } }.first ?? keys.lazy.filter { TokenCipher.isEncrypted($0.value) }.map { ($0.session, clientKeyData($0.session, $0.kid), $0.value) }.first
        if let (name, associatedData, value) = sealed, (try? cipher.open(value, associatedData: associatedData)) == nil {
            guard let index = formers.firstIndex(where: { (try? $0.open(value, associatedData: associatedData)) != nil }) else {
                throw WrongStateKey(session: name)
            }
            former = (index, formers[index])
        }
        var keyUpdates: [(session: String, kid: String, value: String)] = []
        for (session, kid, value) in keys where former != nil || !TokenCipher.isEncrypted(value) {
            let associatedData = clientKeyData(session, kid)
            do {
                let clear = TokenCipher.isEncrypted(value) ? try former!.cipher.open(value, associatedData: associatedData) : value
                keyUpdates.append((session, kid, try cipher.seal(clear, associatedData: associatedData)))
            } catch {
                throw StoreError("session \(session): client key \(kid): \(error)")
            }
        }
        var updates: [(name: String, values: [String?])] = []
        var clear = 0
        for (name, values) in stored {
            if values.contains(where: { $0.map { !TokenCipher.isEncrypted($0) } == true }) { clear += 1 }
            guard values.contains(where: { $0.map { former != nil || !TokenCipher.isEncrypted($0) } == true }) else { continue }
            updates.append((name, try zip(values, columns).map { (value, column) throws -> String? in
                guard let value else { return nil }
                let associatedData = name + "/" + column
                if TokenCipher.isEncrypted(value) {
                    guard let former else { return value }
                    do {
                        return try cipher.seal(try former.cipher.open(value, associatedData: associatedData), associatedData: associatedData)
                    } catch {
                        throw StoreError("session \(name): \(error)")
                    }
                }
                return try seal(value, cipher, name, column)
            }))
        }
        guard !updates.isEmpty || !keyUpdates.isEmpty else { return (nil, 0) }
        try execute(db, "BEGIN IMMEDIATE")
        do {
            for (name, values) in updates {
                let update = try Statement(db, "UPDATE sessions SET refresh_token = ?2, access_token = ?3, proof_key = ?4 WHERE name = ?1")
                update.bind(1, name)
                for (index, value) in values.enumerated() { update.bind(Int32(index + 2), value) }
                try update.run()
            }
            for (session, kid, value) in keyUpdates {
                let update = try Statement(db, "UPDATE client_keys SET key = ?3 WHERE session = ?1 AND kid = ?2")
                update.bind(1, session)
                update.bind(2, kid)
                update.bind(3, value)
                try update.run()
            }
            try execute(db, "COMMIT")
        } catch {
            try? execute(db, "ROLLBACK")
            throw error
        }
        // Rewrite the file (no free page keeps an old version) and empty the WAL, so the clear
        // or formerly sealed versions are gone from disk; a checkpoint a reader blocks is owed
        // (tried again at the next commit).
        try execute(db, "VACUUM")
        do { try checkpoint(db) } catch { connection.checkpointOwed = true }
        return (former?.index, clear)
    }

    /// What a client key's sealing is bound to: its session and id.
    private static func clientKeyData(_ session: String, _ kid: String) -> String { "client_key/" + session + "/" + kid }

    private static func seal(_ value: String, _ cipher: TokenCipher, _ name: String, _ column: String) throws -> String {
        if TokenCipher.isEncrypted(value) { return value }
        do { return try cipher.seal(value, associatedData: name + "/" + column) } catch { throw StoreError(error.description) }
    }

    private static func unseal(_ value: String?, _ cipher: TokenCipher?, _ name: String, _ column: String) throws -> Secret? {
        guard let value else { return nil }
        guard TokenCipher.isEncrypted(value) else { return Secret(value) }
        guard let cipher else {
            throw StoreError("the state database holds encrypted tokens (session \(name)); configure its key with StateKeyCredential= or StateKeyFile=")
        }
        do {
            return Secret(try cipher.open(value, associatedData: name + "/" + column))
        } catch {
            throw StoreError("session \(name): \(error.description)")
        }
    }

    private struct CorruptDatabase: Error {
        var reason: String
    }

    /// Creates `directory` (and missing parents, 0700) unless it exists; fails when it is not a
    /// directory.
    public static func prepareDirectory(_ directory: String) throws {
        var info = stat()
        if stat(directory, &info) != 0 {
            guard errno == ENOENT else { throw StoreError("\(directory): \(String(cString: strerror(errno)))") }
            if let slash = directory.lastIndex(of: "/"), slash != directory.startIndex {
                try prepareDirectory(String(directory[..<slash]))
                guard mkdir(directory, 0o700) == 0 || errno == EEXIST else {
                    throw StoreError("cannot create \(directory): \(String(cString: strerror(errno)))")
                }
            }
            return
        }
        guard info.st_mode & S_IFMT == S_IFDIR else { throw StoreError("\(directory) is not a directory") }
    }

    /// SQLite configured once, before its first connection: page caches grow as used, with no
    /// bulk allocation up front (a daemon's private memory; the state is small). (A process that
    /// used SQLite before keeps its configuration.)
    private static let configured: Void = { _ = tb_sqlite3_config_pages_on_demand() }()

    /// Opens the database, applies the pragmas and migrations, and checks it can be read.
    private static func open(_ path: String) throws -> OpaquePointer {
        let previous = umask(0o077)
        defer { umask(previous) }
        var handle: OpaquePointer?
        _ = configured
        let rc = sqlite3_open_v2(path, &handle, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, nil)
        guard rc == SQLITE_OK, let db = handle else {
            let message = handle.map { String(cString: sqlite3_errmsg($0)) } ?? String(cString: sqlite3_errstr(rc))
            sqlite3_close_v2(handle)
            throw StoreError("cannot open \(path): \(message)")
        }
        do {
            sqlite3_busy_timeout(db, 5000)
            // A file that is not a database fails here, at the first read.
            let check = try queryText(db, "PRAGMA quick_check")
            guard check == "ok" else { throw CorruptDatabase(reason: "integrity check: \(check ?? "no answer")") }
            try execute(db, "PRAGMA journal_mode=WAL")
            try execute(db, "PRAGMA synchronous=FULL")
            // Freed content (an erased token) is overwritten with zeros, not left in the file.
            try execute(db, "PRAGMA secure_delete=ON")
            try execute(db, "PRAGMA foreign_keys=ON")
            try migrate(db)
            for suffix in ["", "-wal", "-shm"] { chmod(path + suffix, 0o600) }
            return db
        } catch let error as StoreError where error.message.contains("not a database") || error.message.contains("malformed") {
            sqlite3_close_v2(db)
            throw CorruptDatabase(reason: error.message)
        } catch {
            sqlite3_close_v2(db)
            throw error
        }
    }

    /// Renames the database and its WAL files to `…corrupt-<unix time>`; returns the new path.
    private static func moveAside(_ path: String, reason: String) throws -> String {
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        let target = "\(path).corrupt-\(now.tv_sec)"
        guard rename(path, target) == 0 else {
            throw StoreError("\(path) is unreadable (\(reason)) and could not be moved aside: \(String(cString: strerror(errno)))")
        }
        for suffix in ["-wal", "-shm"] { rename(path + suffix, target + suffix) }
        return target
    }

    /// Forward migrations, one per schema version, each in its own transaction.
    private static let migrations: [String] = [
        // 1: the sessions table.
        """
        CREATE TABLE sessions (
            name TEXT PRIMARY KEY NOT NULL,
            generation INTEGER NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('active', 'signedOut', 'ended')),
            refresh_token TEXT,
            access_token TEXT,
            token_type TEXT NOT NULL DEFAULT 'Bearer',
            expires_at INTEGER,
            last_refresh INTEGER,
            token_serial INTEGER NOT NULL DEFAULT 0,
            end_reason TEXT,
            updated_at INTEGER NOT NULL
        ) STRICT;
        """,
        // 2: per session and fleet prefix, the highest position of the fleet's history this
        // broker has applied or published (a fleet that shows older history is not followed).
        """
        CREATE TABLE fleet_marks (
            session TEXT NOT NULL,
            prefix TEXT NOT NULL,
            generation INTEGER NOT NULL,
            serial INTEGER NOT NULL,
            PRIMARY KEY (session, prefix)
        ) STRICT;
        """,
        // 3: per session and fleet prefix, a refresh redeemed upstream but not yet committed to
        // the fleet (its values sealed with the fleet key), kept across stops.
        """
        CREATE TABLE fleet_pending (
            session TEXT NOT NULL,
            prefix TEXT NOT NULL,
            value TEXT NOT NULL,
            place_value TEXT NOT NULL,
            create_revision INTEGER NOT NULL,
            mod_revision INTEGER NOT NULL,
            version INTEGER NOT NULL,
            local_generation INTEGER NOT NULL,
            PRIMARY KEY (session, prefix)
        ) STRICT;
        """,
        // 4: a DPoP session's private key (RFC 9449), sealed like the refresh token.
        "ALTER TABLE sessions ADD COLUMN proof_key TEXT;",
        // 5: the fleet history a mark is in (0 until an admin starts the session's history anew):
        // marks compare by history first.
        "ALTER TABLE fleet_marks ADD COLUMN history INTEGER NOT NULL DEFAULT 0;",
        // 6: the client keys the daemon holds for private_key_jwt (RFC 7523), sealed like the
        // tokens: a session's signing key, the next one published before it signs, and retiring ones.
        """
        CREATE TABLE client_keys (
            session TEXT NOT NULL,
            kid TEXT NOT NULL,
            role TEXT NOT NULL CHECK (role IN ('signing', 'next', 'retiring')),
            algorithm TEXT NOT NULL,
            key TEXT NOT NULL,
            created INTEGER NOT NULL,
            PRIMARY KEY (session, kid)
        ) STRICT;
        """,
    ]

    private static func migrate(_ db: OpaquePointer) throws {
        let version = Int32(try queryText(db, "PRAGMA user_version").flatMap { Int32($0) } ?? 0)
        guard version <= schemaVersion else {
            throw StoreError("the database has schema version \(version), newer than this build's \(schemaVersion); refusing to touch it")
        }
        for target in (version + 1)...max(schemaVersion, version + 1) where target <= schemaVersion {
            try execute(db, "BEGIN IMMEDIATE")
            do {
                try execute(db, migrations[Int(target) - 1])
                try execute(db, "PRAGMA user_version = \(target)")
                try execute(db, "COMMIT")
            } catch {
                try? execute(db, "ROLLBACK")
                throw error
            }
        }
    }

    // MARK: - SessionStore

    public func load(_ session: String) async throws -> SessionRecord? {
        let (connection, cipher) = (self.connection, self.cipher)
        return try await thread.run { try Self.select(connection, name: session, cipher: cipher).first }
    }

    /// Every stored session, by name.
    public func loadAll() async throws -> [SessionRecord] {
        let (connection, cipher) = (self.connection, self.cipher)
        return try await thread.run { try Self.select(connection, name: nil, cipher: cipher) }
    }

    /// Durable when it returns (the commit's WAL frames fsynced). Writes that come while the
    /// thread is busy are committed together, each under its own savepoint: one that fails
    /// fails alone, and each answers whether its guard held, as it would have on its own.
    public func write(_ write: StoreWrite) async throws -> Bool {
        try await enqueue(QueuedWrite(write: write, mark: nil))
    }

    private func enqueue(_ write: QueuedWrite) async throws -> Bool {
        try await withCheckedThrowingContinuation { continuation in
            let first = queue.entries.withLock { entries in
                entries.append((write, continuation))
                return entries.count == 1
            }
            if first { scheduleCommit() }
        }
    }

    private func scheduleCommit() {
        let (connection, cipher, queue) = (self.connection, self.cipher, self.queue)
        // (`self` is held until the job has run: its callers are awaiting it.)
        thread.submit { [self] in
            let batch = queue.entries.withLock { entries in
                let batch = Array(entries.prefix(Self.batchLimit))
                entries.removeFirst(batch.count)
                return (batch, more: !entries.isEmpty)
            }
            let results = Self.commit(connection, batch.0.map(\.write), cipher: cipher)
            for (entry, result) in zip(batch.0, results) { entry.continuation.resume(with: result) }
            if batch.more { scheduleCommit() }
        }
    }

    /// Applies `writes` in one transaction (one alone: in its own), each under a savepoint of its
    /// own; returns each one's result, in order.
    private static func commit(_ connection: Connection, _ writes: [QueuedWrite], cipher: TokenCipher?) -> [Result<Bool, any Error>] {
        let db = connection.db
        var outcomes: [(result: Result<Bool, any Error>, erased: Bool)] = []
        outcomes.reserveCapacity(writes.count)
        do {
            try execute(db, "BEGIN IMMEDIATE")
            for write in writes {
                try execute(db, "SAVEPOINT one")
                let outcome: (applied: Bool, erased: Bool)
                do {
                    outcome = try apply(connection, write, cipher: cipher)
                } catch {
                    // Some errors (a full disk) roll the whole transaction back at once: then the
                    // batch fails with that error, not with the missing savepoint's.
                    if sqlite3_get_autocommit(db) != 0 { throw error }
                    try execute(db, "ROLLBACK TO one")
                    try execute(db, "RELEASE one")
                    outcomes.append((.failure(error), false))
                    continue
                }
                // (Counted only once released: a failed release fails the whole batch below.)
                try execute(db, "RELEASE one")
                outcomes.append((.success(outcome.applied), outcome.erased))
            }
            try execute(db, "COMMIT")
        } catch {
            try? execute(db, "ROLLBACK")
            return writes.map { _ in .failure(error) }
        }
        // Tokens were erased: the WAL's older page versions still hold them. A checkpoint that
        // fails fails the writes that erased (they are retried, and checkpoint again); the
        // others are durable and say so.
        if connection.checkpointOwed || outcomes.contains(where: \.erased) {
            do {
                try checkpoint(db)
                connection.checkpointOwed = false
            } catch {
                connection.checkpointOwed = true
                return outcomes.map { $0.erased ? .failure(error) : $0.result }
            }
        }
        return outcomes.map(\.result)
    }

    /// A write waiting for the store's thread, with the fleet mark it raises, if any.
    private struct QueuedWrite: Sendable {
        var write: StoreWrite
        var mark: (mark: HistoryMark, prefix: String)?
    }

    /// A position in a fleet's history: which history (0 until one is started anew), its
    /// generation and serial, compared in that order.
    public struct HistoryMark: Sendable, Equatable {
        public var history: Int64
        public var generation: Int64
        public var serial: Int64
        public init(history: Int64 = 0, generation: Int64, serial: Int64) {
            self.history = history
            self.generation = generation
            self.serial = serial
        }
    }

    /// Performs `write` (if its guard holds) and raises the session's mark under `prefix` to
    /// `mark` (never lowers it), in one transaction: both are durable, or neither. (Queued with
    /// the plain writes, in order.)
    public func write(_ write: StoreWrite, mark: HistoryMark, prefix: String) async throws -> Bool {
        try await enqueue(QueuedWrite(write: write, mark: (mark, prefix)))
    }

    /// One queued write's statements (inside the caller's transaction or savepoint).
    private static func apply(_ connection: Connection, _ queued: QueuedWrite, cipher: TokenCipher?) throws -> (applied: Bool, erased: Bool) {
        let outcome = try apply(connection, queued.write, cipher: cipher)
        guard let (mark, prefix) = queued.mark else { return outcome }
        let upsert = try connection.prepare("""
            INSERT INTO fleet_marks (session, prefix, history, generation, serial) VALUES (?1, ?2, ?5, ?3, ?4)
            ON CONFLICT (session, prefix) DO UPDATE SET history = excluded.history, generation = excluded.generation, serial = excluded.serial
            WHERE (excluded.history, excluded.generation, excluded.serial) > (fleet_marks.history, fleet_marks.generation, fleet_marks.serial)
            """)
        defer { upsert.reset() }
        upsert.bind(1, queued.write.record.name)
        upsert.bind(2, prefix)
        upsert.bind(3, mark.generation)
        upsert.bind(4, mark.serial)
        upsert.bind(5, mark.history)
        try upsert.run()
        return outcome
    }

    /// A fleet's commit still owed, as kept: its sealed values, revisions and local generation.
    public struct PendingFleetCommit: Sendable, Equatable {
        public var value: String
        public var placeValue: String
        public var createRevision: Int64
        public var modRevision: Int64
        public var version: Int64
        public var generation: Int64
        public init(value: String, placeValue: String, createRevision: Int64, modRevision: Int64, version: Int64, generation: Int64) {
            (self.value, self.placeValue, self.createRevision, self.modRevision, self.version, self.generation) =
                (value, placeValue, createRevision, modRevision, version, generation)
        }
    }

    /// Keeps `pending` for the session under `prefix` (nil: removes it), durably.
    public func keepPendingFleetCommit(_ session: String, prefix: String, _ pending: PendingFleetCommit?) async throws {
        let connection = self.connection
        try await thread.run {
            if let pending {
                let statement = try connection.prepare("""
                    INSERT OR REPLACE INTO fleet_pending (session, prefix, value, place_value, create_revision, mod_revision, version,
                                                          local_generation) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                    """)
                defer { statement.reset() }
                statement.bind(1, session)
                statement.bind(2, prefix)
                statement.bind(3, pending.value)
                statement.bind(4, pending.placeValue)
                statement.bind(5, pending.createRevision)
                statement.bind(6, pending.modRevision)
                statement.bind(7, pending.version)
                statement.bind(8, pending.generation)
                try statement.run()
            } else {
                let statement = try connection.prepare("DELETE FROM fleet_pending WHERE session = ?1 AND prefix = ?2")
                defer { statement.reset() }
                statement.bind(1, session)
                statement.bind(2, prefix)
                try statement.run()
            }
        }
    }

    /// The commit kept for the session under `prefix`, if any.
    public func pendingFleetCommit(_ session: String, prefix: String) async throws -> PendingFleetCommit? {
        let connection = self.connection
        return try await thread.run {
            let statement = try connection.prepare("""
                SELECT value, place_value, create_revision, mod_revision, version, local_generation FROM fleet_pending
                WHERE session = ?1 AND prefix = ?2
                """)
            defer { statement.reset() }
            statement.bind(1, session)
            statement.bind(2, prefix)
            guard try statement.step(), let value = statement.text(0), let place = statement.text(1), let created = statement.int(2),
                  let modified = statement.int(3), let version = statement.int(4), let generation = statement.int(5) else { return nil }
            return PendingFleetCommit(value: value, placeValue: place, createRevision: created, modRevision: modified, version: version,
                                      generation: generation)
        }
    }

    /// The session's mark under `prefix`, or nil when none is stored.
    public func mark(_ session: String, prefix: String) async throws -> HistoryMark? {
        let connection = self.connection
        return try await thread.run {
            let statement = try connection.prepare("SELECT history, generation, serial FROM fleet_marks WHERE session = ?1 AND prefix = ?2")
            defer { statement.reset() }
            statement.bind(1, session)
            statement.bind(2, prefix)
            guard try statement.step(), let history = statement.int(0), let generation = statement.int(1), let serial = statement.int(2) else {
                return nil
            }
            return HistoryMark(history: history, generation: generation, serial: serial)
        }
    }

    // MARK: - Client keys

    /// A session's client keys (`private_key_jwt`), opened.
    public func clientKeys(_ session: String) async throws -> [StoredClientKey] {
        let (connection, cipher) = (self.connection, self.cipher)
        return try await thread.run {
            let statement = try connection.prepare("SELECT kid, role, algorithm, key, created FROM client_keys WHERE session = ?1 ORDER BY created, kid")
            defer { statement.reset() }
            statement.bind(1, session)
            var keys: [StoredClientKey] = []
            while try statement.step() {
                guard let kid = statement.text(0), let role = statement.text(1).flatMap(StoredClientKey.Role.init(rawValue:)),
                      let algorithm = statement.text(2), let value = statement.text(3) else {
                    throw StoreError("a row of the client_keys table is malformed")
                }
                let key: Secret
                if TokenCipher.isEncrypted(value) {
                    guard let cipher else { throw StoreError("the state database holds sealed client keys (session \(session)); configure its key") }
                    do { key = Secret(try cipher.open(value, associatedData: Self.clientKeyData(session, kid))) } catch {
                        throw StoreError("session \(session): client key \(kid): \(error)")
                    }
                } else {
                    key = Secret(value)
                }
                keys.append(StoredClientKey(kid: kid, role: role, algorithm: algorithm, key: key, created: statement.int(4) ?? 0))
            }
            return keys
        }
    }

    /// Replaces a session's client keys with `keys`, durably; keys left out are erased from the
    /// files too (a checkpoint, as for tokens).
    public func replaceClientKeys(_ session: String, _ keys: [StoredClientKey]) async throws {
        let (connection, cipher) = (self.connection, self.cipher)
        try await thread.run {
            try Self.execute(connection.db, "BEGIN IMMEDIATE")
            var dropped = false
            do {
                let delete = try connection.prepare("DELETE FROM client_keys WHERE session = ?1")
                defer { delete.reset() }
                delete.bind(1, session)
                try delete.run()
                dropped = Int(sqlite3_changes(connection.db)) > keys.count
                let insert = try connection.prepare("INSERT INTO client_keys (session, kid, role, algorithm, key, created) VALUES (?1, ?2, ?3, ?4, ?5, ?6)")
                defer { insert.reset() }
                for key in keys {
                    insert.reset()
                    insert.bind(1, session)
                    insert.bind(2, key.kid)
                    insert.bind(3, key.role.rawValue)
                    insert.bind(4, key.algorithm)
                    var value = key.key.reveal
                    if let cipher {
                        do { value = try cipher.seal(value, associatedData: Self.clientKeyData(session, key.kid)) } catch {
                            throw StoreError("\(error)")
                        }
                    }
                    insert.bind(5, value)
                    insert.bind(6, key.created)
                    try insert.run()
                }
                try Self.execute(connection.db, "COMMIT")
            } catch {
                try? Self.execute(connection.db, "ROLLBACK")
                throw error
            }
            if dropped {
                do { try Self.checkpoint(connection.db) } catch { connection.checkpointOwed = true }
            }
        }
    }

    /// Removes a session's row; returns whether there was one.
    public func forget(_ session: String) async throws -> Bool {
        let connection = self.connection
        return try await thread.run {
            let statement = try connection.prepare("DELETE FROM sessions WHERE name = ?1")
            defer { statement.reset() }
            statement.bind(1, session)
            try statement.run()
            let removed = sqlite3_changes(connection.db) > 0
            for table in ["fleet_marks", "fleet_pending", "client_keys"] {
                let statement = try connection.prepare("DELETE FROM \(table) WHERE session = ?1")
                defer { statement.reset() }
                statement.bind(1, session)
                try statement.run()
            }
            // (The row is gone: a checkpoint that fails now is owed, and tried again at the next commit.)
            if removed {
                do { try Self.checkpoint(connection.db) } catch { connection.checkpointOwed = true }
            }
            return removed
        }
    }

    /// Runs the write's statement; returns whether it applied, and whether it erased tokens (the
    /// caller then checkpoints, outside any transaction).
    private static func apply(_ connection: Connection, _ write: StoreWrite, cipher: TokenCipher?) throws -> (applied: Bool, erased: Bool) {
        let db = connection.db
        let record = write.record
        let sql: String
        switch write.guardedBy {
        case .sameGeneration:
            sql = """
                UPDATE sessions SET state = ?3, refresh_token = ?4, access_token = ?5, token_type = ?6, expires_at = ?7,
                    last_refresh = ?8, token_serial = ?9, end_reason = ?10, updated_at = ?11, proof_key = ?12
                WHERE name = ?1 AND generation = ?2 AND (token_serial < ?9 OR (token_serial = ?9 AND state != 'ended'))
                """
        case .newerGeneration:
            sql = """
                INSERT INTO sessions (name, generation, state, refresh_token, access_token, token_type, expires_at,
                                      last_refresh, token_serial, end_reason, updated_at, proof_key)
                VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)
                ON CONFLICT (name) DO UPDATE SET generation = excluded.generation, state = excluded.state,
                    refresh_token = excluded.refresh_token, access_token = excluded.access_token,
                    token_type = excluded.token_type, expires_at = excluded.expires_at,
                    last_refresh = excluded.last_refresh, token_serial = excluded.token_serial,
                    end_reason = excluded.end_reason, updated_at = excluded.updated_at, proof_key = excluded.proof_key
                WHERE sessions.generation < excluded.generation
                """
        }
        let statement = try connection.prepare(sql)
        defer { statement.reset() }
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        statement.bind(1, record.name)
        statement.bind(2, Int64(record.generation))
        statement.bind(3, record.state.rawValue)
        if let cipher {
            statement.bind(4, try record.refreshToken.map { try seal($0.reveal, cipher, record.name, "refresh_token") })
            statement.bind(5, try record.accessToken.map { try seal($0.reveal, cipher, record.name, "access_token") })
            statement.bind(12, try record.proofKey.map { try seal($0.reveal, cipher, record.name, "proof_key") })
        } else {
            statement.bind(4, record.refreshToken?.reveal)
            statement.bind(5, record.accessToken?.reveal)
            statement.bind(12, record.proofKey?.reveal)
        }
        statement.bind(6, record.tokenType)
        statement.bind(7, record.expiresAt)
        statement.bind(8, record.lastRefresh)
        statement.bind(9, Int64(bitPattern: record.tokenSerial))
        statement.bind(10, record.endReason)
        statement.bind(11, Int64(now.tv_sec))
        try statement.run()
        let applied = sqlite3_changes(db) == 1
        return (applied, applied && record.refreshToken == nil && record.accessToken == nil && record.proofKey == nil)
    }

    /// Tokens were erased (logout, end): moves the WAL's older page versions, which still hold
    /// them, into the main file and empties the WAL.
    private static func checkpoint(_ db: OpaquePointer) throws {
        // A checkpoint another reader blocks does not fail: it answers busy (its first column).
        let statement = try Statement(db, "PRAGMA wal_checkpoint(TRUNCATE)")
        guard try statement.step() else { return }
        if statement.int(0) != 0 { throw StoreError("SQLite: the checkpoint that erases old tokens from the WAL was blocked by a reader") }
    }

    private static func select(_ connection: Connection, name: String?, cipher: TokenCipher?) throws -> [SessionRecord] {
        let statement = try connection.prepare("""
            SELECT name, generation, state, refresh_token, access_token, token_type, expires_at, last_refresh,
                   token_serial, end_reason, proof_key
            FROM sessions \(name == nil ? "" : "WHERE name = ?1") ORDER BY name
            """)
        defer { statement.reset() }
        if let name { statement.bind(1, name) }
        var records: [SessionRecord] = []
        while try statement.step() {
            guard let name = statement.text(0), let state = statement.text(2).flatMap(SessionRecord.State.init(rawValue:)) else {
                throw StoreError("a row of the sessions table is malformed")
            }
            records.append(SessionRecord(
                name: name, generation: Int(statement.int(1) ?? 0), state: state,
                refreshToken: try unseal(statement.text(3), cipher, name, "refresh_token"),
                proofKey: try unseal(statement.text(10), cipher, name, "proof_key"),
                accessToken: try unseal(statement.text(4), cipher, name, "access_token"),
                tokenType: statement.text(5) ?? "Bearer", expiresAt: statement.int(6), lastRefresh: statement.int(7),
                tokenSerial: UInt64(bitPattern: statement.int(8) ?? 0), endReason: statement.text(9)))
        }
        return records
    }

    // MARK: - SQLite helpers

    static func execute(_ db: OpaquePointer, _ sql: String) throws {
        var message: UnsafeMutablePointer<CChar>?
        guard sqlite3_exec(db, sql, nil, nil, &message) == SQLITE_OK else {
            let text = message.map { String(cString: $0) } ?? String(cString: sqlite3_errmsg(db))
            sqlite3_free(message)
            throw StoreError("SQLite: \(text)")
        }
    }

    static func queryText(_ db: OpaquePointer, _ sql: String) throws -> String? {
        let statement = try Statement(db, sql)
        return try statement.step() ? statement.text(0) : nil
    }

    /// A prepared statement, finalized when released.
    final class Statement {
        let db: OpaquePointer
        let handle: OpaquePointer

        init(_ db: OpaquePointer, _ sql: String) throws {
            var handle: OpaquePointer?
            guard sqlite3_prepare_v2(db, sql, -1, &handle, nil) == SQLITE_OK, let handle else {
                throw StoreError("SQLite: \(String(cString: sqlite3_errmsg(db)))")
            }
            self.db = db
            self.handle = handle
        }

        deinit { sqlite3_finalize(handle) }

        /// Ready to run again, with no value bound.
        func reset() {
            sqlite3_reset(handle)
            sqlite3_clear_bindings(handle)
        }

        func bind(_ index: Int32, _ value: String?) {
            if let value { tb_sqlite3_bind_text_transient(handle, index, value) } else { sqlite3_bind_null(handle, index) }
        }

        func bind(_ index: Int32, _ value: Int64?) {
            if let value { sqlite3_bind_int64(handle, index, value) } else { sqlite3_bind_null(handle, index) }
        }

        /// Steps once: true for a row, false when done.
        func step() throws -> Bool {
            switch sqlite3_step(handle) {
            case SQLITE_ROW: return true
            case SQLITE_DONE: return false
            default: throw StoreError("SQLite: \(String(cString: sqlite3_errmsg(db)))")
            }
        }

        func run() throws {
            while try step() {}
        }

        func text(_ column: Int32) -> String? {
            guard sqlite3_column_type(handle, column) != SQLITE_NULL, let pointer = sqlite3_column_text(handle, column) else { return nil }
            return String(cString: pointer)
        }

        func int(_ column: Int32) -> Int64? {
            sqlite3_column_type(handle, column) == SQLITE_NULL ? nil : sqlite3_column_int64(handle, column)
        }
    }
}

/// A client key the daemon holds for a session (`private_key_jwt`): its id (the JWK
/// thumbprint), its role, the algorithm it signs with, the private key (PKCS #8 DER in
/// base64, sealed in the database) and when it was made (Unix seconds).
public struct StoredClientKey: Sendable, Equatable {
    public enum Role: String, Sendable, Equatable {
        /// Signs the session's assertions.
        case signing
        /// Published (in the JWKS to register) before it signs: `ctl client-key --promote` makes it the signing key.
        case next
        /// Signed until the last promotion; still published until `ctl client-key --retire`.
        case retiring
    }

    public var kid: String
    public var role: Role
    public var algorithm: String
    public var key: Secret
    public var created: Int64

    public init(kid: String, role: Role, algorithm: String, key: Secret, created: Int64) {
        (self.kid, self.role, self.algorithm, self.key, self.created) = (kid, role, algorithm, key, created)
    }
}
