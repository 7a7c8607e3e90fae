import Foundation
import Sealing
import SQLiteStore
import Testing
import TestSupport
import TokenBrokerCore

@Suite("SQLite session store")
struct SQLiteStoreTests {
    static func directory() -> String {
        let scratch = FileManager.default.temporaryDirectory.appendingPathComponent("tb-store-\(UUID().uuidString.prefix(8))").path
        ScratchDirectories.removeAtExit(scratch)
        return scratch + "/state"
    }

    static func record(_ generation: Int, _ state: SessionRecord.State, refresh: String? = nil, access: String? = nil,
                       proofKey: String? = nil) -> SessionRecord {
        SessionRecord(name: "api", generation: generation, state: state, refreshToken: refresh.map(Secret.init), proofKey: proofKey.map(Secret.init),
                      accessToken: access.map(Secret.init), expiresAt: access == nil ? nil : 1_900_000_000, lastRefresh: 1_800_000_000,
                      tokenSerial: UInt64(generation), endReason: state == .ended ? "invalid_grant" : nil)
    }

    @Test("records round-trip and survive reopening; the directory is 0700 and the files 0600")
    func persistence() async throws {
        let directory = Self.directory()
        let written = Self.record(1, .active, refresh: "r+1/=", access: "a-1", proofKey: "MIGH+key/=")
        do {
            let store = try SQLiteSessionStore(directory: directory)
            #expect(try await store.write(StoreWrite(written, guardedBy: .newerGeneration)))
            #expect(try await store.load("api") == written)
            #expect(try await store.load("other") == nil)
        }
        let reopened = try SQLiteSessionStore(directory: directory)
        #expect(try await reopened.load("api") == written)
        #expect(try await reopened.loadAll().map(\.name) == ["api"])
        let attributes = try FileManager.default.attributesOfItem(atPath: directory + "/state.db")
        #expect((attributes[.posixPermissions] as? Int) == 0o600)
        let directoryAttributes = try FileManager.default.attributesOfItem(atPath: directory)
        #expect((directoryAttributes[.posixPermissions] as? Int) == 0o700)
    }

    @Test("same-generation writes apply only at their generation")
    func sameGeneration() async throws {
        let store = try SQLiteSessionStore(directory: Self.directory())
        #expect(try await !store.write(StoreWrite(Self.record(1, .active, refresh: "r1"), guardedBy: .sameGeneration)))
        #expect(try await store.write(StoreWrite(Self.record(1, .active, refresh: "r1"), guardedBy: .newerGeneration)))
        #expect(try await store.write(StoreWrite(Self.record(1, .active, refresh: "r2"), guardedBy: .sameGeneration)))
        #expect(try await !store.write(StoreWrite(Self.record(2, .active, refresh: "r3"), guardedBy: .sameGeneration)))
        #expect(try await store.load("api")?.refreshToken == Secret("r2"))
    }

    @Test("within a generation the token serial orders writes: an older record retried late is dropped; an end is never undone")
    func serialOrder() async throws {
        func write(_ serial: UInt64, _ state: SessionRecord.State, _ token: String?) -> StoreWrite {
            StoreWrite(SessionRecord(name: "api", generation: 1, state: state, refreshToken: token.map(Secret.init), tokenSerial: serial),
                       guardedBy: .sameGeneration)
        }
        let store = try SQLiteSessionStore(directory: Self.directory())
        #expect(try await store.write(StoreWrite(Self.record(1, .active, refresh: "r1"), guardedBy: .newerGeneration)))
        #expect(try await store.write(write(3, .active, "r3")))
        #expect(try await !store.write(write(2, .active, "r2")))
        #expect(try await store.load("api")?.refreshToken == Secret("r3"))
        #expect(try await store.write(write(3, .ended, nil)))
        #expect(try await !store.write(write(3, .active, "r3")))
        #expect(try await store.load("api")?.state == .ended)
    }

    @Test("boundary writes in any order: the newest generation wins; a late refresh never resurrects a logout")
    func anyOrder() async throws {
        let writes = [
            StoreWrite(Self.record(1, .active, refresh: "late", access: "late"), guardedBy: .sameGeneration),
            StoreWrite(Self.record(2, .signedOut), guardedBy: .newerGeneration),
            StoreWrite(Self.record(3, .active, refresh: "login"), guardedBy: .newerGeneration),
            StoreWrite(Self.record(4, .signedOut), guardedBy: .newerGeneration),
        ]
        for permutation in writes.permutations {
            let store = try SQLiteSessionStore(directory: Self.directory())
            _ = try await store.write(StoreWrite(Self.record(1, .active, refresh: "r1"), guardedBy: .newerGeneration))
            for write in permutation { _ = try await store.write(write) }
            let final = try await store.load("api")
            #expect(final?.generation == 4 && final?.state == .signedOut && final?.refreshToken == nil && final?.accessToken == nil)
        }
    }

    @Test("a corrupt database is moved aside with a timestamped name, never overwritten")
    func corrupt() async throws {
        let directory = Self.directory()
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        let garbage = Data(repeating: 0x5A, count: 8192)
        try garbage.write(to: URL(fileURLWithPath: directory + "/state.db"))
        let store = try SQLiteSessionStore(directory: directory)
        let moved = try #require(store.movedAside)
        #expect(moved.hasPrefix(directory + "/state.db.corrupt-"))
        #expect(try Data(contentsOf: URL(fileURLWithPath: moved)) == garbage)
        #expect(try await store.loadAll().isEmpty)
        #expect(try await store.write(StoreWrite(Self.record(1, .active, refresh: "r"), guardedBy: .newerGeneration)))
    }

    @Test("a database from a newer build is refused, not touched")
    func newerSchema() async throws {
        let directory = Self.directory()
        do {
            _ = try SQLiteSessionStore(directory: directory)
        }
        let python = try await Child.run("/usr/bin/env", ["python3", "-c",
            "import sqlite3; c = sqlite3.connect('\(directory)/state.db'); c.execute('PRAGMA user_version = 99'); c.commit()"])
        #expect(python.code == 0, "\(python.stderr)")
        #expect(throws: StoreError.self) { try SQLiteSessionStore(directory: directory) }
    }

    @Test("a database of schema 3 (before DPoP keys) is migrated: its rows read back, without a key, and keys are kept from then on")
    func migratesSchema3() async throws {
        let directory = Self.directory()
        let before = Self.record(1, .active, refresh: "r-3", access: "a-3")
        do {
            _ = try await SQLiteSessionStore(directory: directory).write(StoreWrite(before, guardedBy: .newerGeneration))
        }
        let python = try await Child.run("/usr/bin/env", ["python3", "-c",
            "import sqlite3; c = sqlite3.connect('\(directory)/state.db'); c.execute('ALTER TABLE sessions DROP COLUMN proof_key');"
            + " c.execute('ALTER TABLE fleet_marks DROP COLUMN history'); c.execute('DROP TABLE client_keys'); c.execute('PRAGMA user_version = 3'); c.commit()"])
        #expect(python.code == 0, "\(python.stderr)")
        let store = try SQLiteSessionStore(directory: directory)
        #expect(try await store.load("api") == before)
        let after = Self.record(2, .active, refresh: "r-4", proofKey: "key-4")
        #expect(try await store.write(StoreWrite(after, guardedBy: .newerGeneration)))
        #expect(try await store.load("api")?.proofKey == Secret("key-4"))
    }

    @Test("a logout's erased tokens do not linger in the database files")
    func erasedForGood() async throws {
        let directory = Self.directory()
        let store = try SQLiteSessionStore(directory: directory)
        _ = try await store.write(StoreWrite(Self.record(1, .active, refresh: "refresh-GONE", access: "access-GONE", proofKey: "key-GONE"),
                                             guardedBy: .newerGeneration))
        #expect(try EncryptionTests.fileContains(directory, "key-GONE"))
        #expect(try EncryptionTests.fileContains(directory, "refresh-GONE"))
        _ = try await store.write(StoreWrite(Self.record(2, .signedOut), guardedBy: .newerGeneration))
        #expect(try !EncryptionTests.fileContains(directory, "GONE"))
    }

    @Test("fleet marks compare by history first: a mark of schema 4 is in history 0; a later history's start replaces a higher generation of an earlier one, and nothing of an earlier history replaces a later one")
    func marksByHistory() async throws {
        let directory = Self.directory()
        do {
            _ = try await SQLiteSessionStore(directory: directory).write(StoreWrite(Self.record(1, .active, refresh: "r-1"), guardedBy: .newerGeneration),
                                                                          mark: .init(generation: 1 << 52, serial: 7), prefix: "/p")
        }
        let python = try await Child.run("/usr/bin/env", ["python3", "-c",
            "import sqlite3; c = sqlite3.connect('\(directory)/state.db'); c.execute('ALTER TABLE fleet_marks DROP COLUMN history');"
            + " c.execute('DROP TABLE client_keys'); c.execute('PRAGMA user_version = 4'); c.commit()"])
        #expect(python.code == 0, "\(python.stderr)")
        let store = try SQLiteSessionStore(directory: directory)
        #expect(try await store.mark("api", prefix: "/p") == .init(history: 0, generation: 1 << 52, serial: 7))
        let anew = SQLiteSessionStore.HistoryMark(history: 1, generation: 12, serial: 0)
        _ = try await store.write(StoreWrite(Self.record(2, .signedOut), guardedBy: .newerGeneration), mark: anew, prefix: "/p")
        #expect(try await store.mark("api", prefix: "/p") == anew)
        _ = try await store.write(StoreWrite(Self.record(3, .signedOut), guardedBy: .newerGeneration), mark: .init(generation: (1 << 52) + 1, serial: 0),
                                  prefix: "/p")
        #expect(try await store.mark("api", prefix: "/p") == anew)
        let later = SQLiteSessionStore.HistoryMark(history: 1, generation: 13, serial: 2)
        _ = try await store.write(StoreWrite(Self.record(4, .signedOut), guardedBy: .newerGeneration), mark: later, prefix: "/p")
        #expect(try await store.mark("api", prefix: "/p") == later)
    }

    @Test("a fleet mark read (and a pending commit read) leave nothing open: a logout after them still erases its tokens from the files")
    func readsLeaveNoTransactionOpen() async throws {
        let directory = Self.directory()
        let store = try SQLiteSessionStore(directory: directory)
        let mark = SQLiteSessionStore.HistoryMark(generation: 5, serial: 1)
        #expect(try await store.write(StoreWrite(Self.record(1, .active, refresh: "refresh-GONE", access: "access-GONE"), guardedBy: .newerGeneration),
                                      mark: mark, prefix: "/p"))
        try await store.keepPendingFleetCommit("api", prefix: "/p", .init(value: "v", placeValue: "p", createRevision: 1, modRevision: 2,
                                                                          version: 1, generation: 1))
        #expect(try await store.mark("api", prefix: "/p") == mark)
        #expect(try await store.pendingFleetCommit("api", prefix: "/p") != nil)
        #expect(try await store.write(StoreWrite(Self.record(2, .signedOut), guardedBy: .newerGeneration)))
        #expect(try !EncryptionTests.fileContains(directory, "GONE"))
    }

    @Test("a checkpoint another reader blocks fails the logout's write (its tokens are still in the WAL) and is owed: the next commit erases them")
    func blockedCheckpoint() async throws {
        let directory = Self.directory()
        let store = try SQLiteSessionStore(directory: directory)
        #expect(try await store.write(StoreWrite(Self.record(1, .active, refresh: "refresh-GONE", access: "access-GONE"), guardedBy: .newerGeneration)))
        // An outside reader (a backup tool, the sqlite3 shell) holds a read transaction.
        let reader = Process()
        reader.executableURL = URL(fileURLWithPath: "/usr/bin/python3")
        reader.arguments = ["-c", """
            import sqlite3, sys
            c = sqlite3.connect(sys.argv[1], isolation_level=None)
            c.execute("BEGIN"); c.execute("SELECT count(*) FROM sessions").fetchall()
            print("reading", flush=True); sys.stdin.read()
            """, directory + "/state.db"]
        let input = Pipe(), output = Pipe()
        reader.standardInput = input
        reader.standardOutput = output
        try reader.run()
        defer { if reader.isRunning { reader.terminate() } }
        // (Read until the line comes: a read of a pipe may come back empty when a signal interrupts it.)
        var ready = Data()
        let deadline = ContinuousClock.now + .seconds(20)
        while !String(decoding: ready, as: UTF8.self).contains("reading"), reader.isRunning, ContinuousClock.now < deadline {
            ready += output.fileHandleForReading.availableData
        }
        #expect(String(decoding: ready, as: UTF8.self).hasPrefix("reading"))
        await #expect(throws: StoreError.self) { try await store.write(StoreWrite(Self.record(2, .signedOut), guardedBy: .newerGeneration)) }
        try input.fileHandleForWriting.close()
        reader.waitUntilExit()
        // Any later commit pays the checkpoint owed.
        var other = Self.record(1, .active, refresh: "r")
        other.name = "other"
        #expect(try await store.write(StoreWrite(other, guardedBy: .newerGeneration)))
        #expect(try !EncryptionTests.fileContains(directory, "GONE"))
    }

    @Test("writes that come together are committed together, and each learns whether its own guard held")
    func groupCommit() async throws {
        let store = try SQLiteSessionStore(directory: Self.directory())
        func record(_ name: String, _ generation: Int) -> SessionRecord {
            SessionRecord(name: name, generation: generation, state: .active, refreshToken: Secret("r-\(name)"), tokenSerial: 1)
        }
        // Sessions s0..s199 exist at generation 1; then, at once: a refresh of each even one at
        // generation 1 (applies), of each odd one at generation 7 (does not), and a login of
        // n0..n199 (applies).
        await withTaskGroup(of: Void.self) { group in
            for index in 0..<200 { group.addTask { _ = try? await store.write(StoreWrite(record("s\(index)", 1), guardedBy: .newerGeneration)) } }
        }
        let results = await withTaskGroup(of: (String, Bool?).self) { group in
            for index in 0..<200 {
                var refresh = record("s\(index)", index % 2 == 0 ? 1 : 7)
                refresh.tokenSerial = 2
                group.addTask { ("s\(index)", try? await store.write(StoreWrite(refresh, guardedBy: .sameGeneration))) }
                group.addTask { ("n\(index)", try? await store.write(StoreWrite(record("n\(index)", 1), guardedBy: .newerGeneration))) }
            }
            var results: [String: Bool?] = [:]
            for await (name, applied) in group { results[name] = applied }
            return results
        }
        for index in 0..<200 {
            #expect(results["s\(index)"] == .some(index % 2 == 0), "s\(index)")
            #expect(results["n\(index)"] == .some(true), "n\(index)")
        }
        let stored = try await store.loadAll()
        #expect(stored.count == 400)
        #expect(stored.filter { $0.name.hasPrefix("s") && $0.tokenSerial == 2 }.count == 100)
    }

    @Test("forget removes a row")
    func forget() async throws {
        let store = try SQLiteSessionStore(directory: Self.directory())
        _ = try await store.write(StoreWrite(Self.record(1, .active, refresh: "r"), guardedBy: .newerGeneration))
        #expect(try await store.forget("api"))
        #expect(try await !store.forget("api"))
        #expect(try await store.load("api") == nil)
    }

    @Test("no secret in the store's errors")
    func errors() {
        #expect(throws: StoreError.self) { try SQLiteSessionStore(directory: "/proc/self/no-such-dir/state") }
    }
}


@Suite("Tokens encrypted at rest")
struct EncryptionTests {
    static let key = try! TokenCipher(keyMaterial: Array(String(repeating: "ab", count: 32).utf8))
    static let otherKey = try! TokenCipher(keyMaterial: Array(repeating: 7, count: 32))

    static func fileContains(_ directory: String, _ needle: String) throws -> Bool {
        for suffix in ["", "-wal"] {
            let path = directory + "/state.db" + suffix
            guard let data = FileManager.default.contents(atPath: path) else { continue }
            if data.range(of: Data(needle.utf8)) != nil { return true }
        }
        return false
    }

    @Test("with a key, no token appears in the database files, and records round-trip")
    func roundTrip() async throws {
        let directory = SQLiteStoreTests.directory()
        let record = SQLiteStoreTests.record(1, .active, refresh: "refresh-SECRET-1", access: "access-SECRET-1", proofKey: "key-SECRET-1")
        do {
            let store = try SQLiteSessionStore(directory: directory, cipher: Self.key)
            #expect(try await store.write(StoreWrite(record, guardedBy: .newerGeneration)))
        }
        #expect(try !Self.fileContains(directory, "SECRET"))
        #expect(try await SQLiteSessionStore(directory: directory, cipher: Self.key).load("api") == record)
    }

    @Test("a wrong key or no key is refused with a clear error, never read as signed out")
    func wrongKey() async throws {
        let directory = SQLiteStoreTests.directory()
        do {
            let store = try SQLiteSessionStore(directory: directory, cipher: Self.key)
            _ = try await store.write(StoreWrite(SQLiteStoreTests.record(1, .active, refresh: "r"), guardedBy: .newerGeneration))
        }
        #expect(try SQLiteSessionStore.holdsSealedValues(directory: directory))
        // Refused at open, before anything is read or written.
        #expect(throws: WrongStateKey(session: "api")) { try SQLiteSessionStore(directory: directory, cipher: Self.otherKey) }
        #expect(throws: WrongStateKey(session: "api")) {
            try SQLiteSessionStore(directory: directory, cipher: Self.otherKey, formerCiphers: [Self.otherKey])
        }
        #expect(try await SQLiteSessionStore(directory: directory, cipher: Self.key).load("api")?.refreshToken == Secret("r"))
        do {
            _ = try await SQLiteSessionStore(directory: directory).load("api")
            Issue.record("read without a key")
        } catch {
            #expect("\(error)".contains("holds encrypted tokens"))
        }
    }

    @Test("rows written in clear are encrypted once a key is configured")
    func sealsOldRows() async throws {
        let directory = SQLiteStoreTests.directory()
        let record = SQLiteStoreTests.record(1, .active, refresh: "refresh-PLAIN", access: "access-PLAIN", proofKey: "key-PLAIN")
        do {
            _ = try await SQLiteSessionStore(directory: directory).write(StoreWrite(record, guardedBy: .newerGeneration))
        }
        #expect(try Self.fileContains(directory, "refresh-PLAIN") && Self.fileContains(directory, "key-PLAIN"))
        let store = try SQLiteSessionStore(directory: directory, cipher: Self.key)
        #expect(try await store.load("api") == record)
        #expect(try !Self.fileContains(directory, "PLAIN"))
    }

    @Test("client keys (private_key_jwt) are sealed like tokens: never in clear in the files, sealed again under a new state key, refused under another, erased when dropped or forgotten")
    func clientKeys() async throws {
        let directory = SQLiteStoreTests.directory()
        let signing = StoredClientKey(kid: "kid-1", role: .signing, algorithm: "ES256", key: Secret("clientkey-SECRET-1"), created: 1)
        let next = StoredClientKey(kid: "kid-2", role: .next, algorithm: "ES256", key: Secret("clientkey-SECRET-2"), created: 2)
        do {
            let store = try SQLiteSessionStore(directory: directory, cipher: Self.key)
            try await store.replaceClientKeys("api", [signing, next])
            #expect(try await store.clientKeys("api") == [signing, next])
        }
        #expect(try !Self.fileContains(directory, "SECRET"))
        // A database with client keys and no session row is still known to be sealed.
        #expect(try SQLiteSessionStore.holdsSealedValues(directory: directory))
        #expect(throws: WrongStateKey(session: "api")) { try SQLiteSessionStore(directory: directory, cipher: Self.otherKey) }
        let resealed = try SQLiteSessionStore(directory: directory, cipher: Self.otherKey, formerCiphers: [Self.key])
        #expect(resealed.resealedFrom == 0)
        #expect(try await resealed.clientKeys("api") == [signing, next])
        let before = Self.sealedValues(directory)
        try await resealed.replaceClientKeys("api", [next])
        #expect(try await resealed.clientKeys("api") == [next])
        #expect(Self.sealedValues(directory).count < before.count, "the dropped key's sealed value stays in the files")
        _ = try await resealed.write(StoreWrite(SQLiteStoreTests.record(1, .signedOut), guardedBy: .newerGeneration))
        #expect(try await resealed.forget("api"))
        #expect(try await resealed.clientKeys("api").isEmpty)
    }

    /// Every sealed value in the database's files (`tbenc1:` and its Base64).
    static func sealedValues(_ directory: String) -> Set<String> {
        var found = Set<String>()
        for suffix in ["", "-wal"] {
            guard let data = FileManager.default.contents(atPath: directory + "/state.db" + suffix) else { continue }
            let text = String(decoding: data.map { $0 < 0x80 ? $0 : 0x20 }, as: UTF8.self)
            // (Values may lie side by side in a record: each runs until the next one's prefix.)
            for piece in text.components(separatedBy: "tbenc1:").dropFirst() {
                found.insert("tbenc1:" + piece.prefix { $0.isASCII && ($0.isLetter || $0.isNumber || "+/=".contains($0)) })
            }
        }
        return found
    }

    @Test("a database sealed under a former key is sealed again under the new one; the old sealed values are gone from its files")
    func resealsUnderNewKey() async throws {
        let directory = SQLiteStoreTests.directory()
        let record = SQLiteStoreTests.record(3, .active, refresh: "refresh-SECRET", access: "access-SECRET", proofKey: "key-SECRET")
        do {
            let store = try SQLiteSessionStore(directory: directory, cipher: Self.otherKey)
            #expect(try await store.write(StoreWrite(record, guardedBy: .newerGeneration)))
        }
        let before = Self.sealedValues(directory)
        #expect(before.count == 3)
        do {
            let store = try SQLiteSessionStore(directory: directory, cipher: Self.key, formerCiphers: [Self.key, Self.otherKey])
            #expect(store.resealedFrom == 1 && store.sealedInClear == 0)
            #expect(try await store.load("api") == record)
        }
        #expect(Self.sealedValues(directory).isDisjoint(with: before), "a value sealed under the former key is still in the files")
        #expect(throws: WrongStateKey(session: "api")) { try SQLiteSessionStore(directory: directory, cipher: Self.otherKey) }
        let again = try SQLiteSessionStore(directory: directory, cipher: Self.key, formerCiphers: [Self.otherKey])
        #expect(again.resealedFrom == nil && Self.sealedValues(directory).count == 3)
        #expect(try !Self.fileContains(directory, "SECRET"))
    }

    @Test("an old database in clear — rotated tokens in its free pages, frames still in its WAL — holds no clear value in any file once sealed")
    func sealsClearDatabaseEverywhere() async throws {
        let directory = SQLiteStoreTests.directory()
        let copy = SQLiteStoreTests.directory()
        try FileManager.default.createDirectory(atPath: copy, withIntermediateDirectories: true)
        let store = try SQLiteSessionStore(directory: directory)
        for serial in 1...20 {
            let padding = String(repeating: "x", count: serial % 2 == 0 ? 3000 : 10)
            let record = SessionRecord(name: "api", generation: 1, state: .active, refreshToken: Secret("refresh-PLAIN-\(serial)-\(padding)"),
                                       accessToken: Secret("access-PLAIN-\(serial)"), tokenSerial: UInt64(serial))
            #expect(try await store.write(StoreWrite(record, guardedBy: serial == 1 ? .newerGeneration : .sameGeneration)))
        }
        // A copy taken while the store is open: the WAL holds every rotation's frames.
        for suffix in ["", "-wal"] {
            try FileManager.default.copyItem(atPath: directory + "/state.db" + suffix, toPath: copy + "/state.db" + suffix)
        }
        #expect(try Self.fileContains(copy, "refresh-PLAIN-3-") && !SQLiteSessionStore.holdsSealedValues(directory: copy))
        let sealed = try SQLiteSessionStore(directory: copy, cipher: Self.key)
        #expect(sealed.sealedInClear == 1)
        #expect(try await sealed.load("api")?.refreshToken?.reveal.hasPrefix("refresh-PLAIN-20-") == true)
        #expect(try !Self.fileContains(copy, "PLAIN"), "a clear token in state.db or its WAL")
        #expect(try SQLiteSessionStore.holdsSealedValues(directory: copy))
        _ = store
    }

    @Test("holdsSealedValues: no file, an empty or clear database, a file that is no database: no; sealed, of this schema or of 3 (before proof_key): yes; it changes no file")
    func probe() async throws {
        let directory = SQLiteStoreTests.directory()
        #expect(try !SQLiteSessionStore.holdsSealedValues(directory: directory))
        do { _ = try SQLiteSessionStore(directory: directory) }
        #expect(try !SQLiteSessionStore.holdsSealedValues(directory: directory))
        do {
            _ = try await SQLiteSessionStore(directory: directory).write(StoreWrite(SQLiteStoreTests.record(1, .active, refresh: "r"),
                                                                                    guardedBy: .newerGeneration))
        }
        #expect(try !SQLiteSessionStore.holdsSealedValues(directory: directory))
        do { _ = try SQLiteSessionStore(directory: directory, cipher: Self.key) }
        #expect(try SQLiteSessionStore.holdsSealedValues(directory: directory))
        let python = try await Child.run("/usr/bin/env", ["python3", "-c",
            "import sqlite3; c = sqlite3.connect('\(directory)/state.db'); c.execute('ALTER TABLE sessions DROP COLUMN proof_key');"
            + " c.execute('PRAGMA user_version = 3'); c.commit()"])
        #expect(python.code == 0, "\(python.stderr)")
        let files = try FileManager.default.contentsOfDirectory(atPath: directory).sorted()
        let bytes = try files.map { try Data(contentsOf: URL(fileURLWithPath: directory + "/" + $0)) }
        #expect(try SQLiteSessionStore.holdsSealedValues(directory: directory), "a sealed database of schema 3")
        #expect(try files.map { try Data(contentsOf: URL(fileURLWithPath: directory + "/" + $0)) } == bytes, "the probe wrote")
        try Data(repeating: 0x42, count: 4096).write(to: URL(fileURLWithPath: directory + "/state.db"))
        #expect(try !SQLiteSessionStore.holdsSealedValues(directory: directory))
    }

    @Test("a sealed value moved to another session or column does not open")
    func boundToRowAndColumn() throws {
        let sealed = try Self.key.seal("token", associatedData: "api/refresh_token")
        #expect(try Self.key.open(sealed, associatedData: "api/refresh_token") == "token")
        #expect(throws: TokenCipher.Failure.self) { try Self.key.open(sealed, associatedData: "other/refresh_token") }
        #expect(throws: TokenCipher.Failure.self) { try Self.key.open(sealed, associatedData: "api/access_token") }
        #expect(throws: TokenCipher.Failure.self) { try TokenCipher(keyMaterial: Array("short".utf8)) }
    }
}
