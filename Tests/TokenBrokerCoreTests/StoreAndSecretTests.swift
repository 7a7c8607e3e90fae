import Testing
import TestSupport
import TokenBrokerCore

@Suite("Generation-guarded store writes")
struct StoreGuardTests {
    static func record(_ generation: Int, _ state: SessionRecord.State, token: String? = nil) -> SessionRecord {
        SessionRecord(name: "api", generation: generation, state: state, refreshToken: token.map(Secret.init))
    }

    @Test("a same-generation write applies only at its generation")
    func sameGeneration() async {
        let store = InMemorySessionStore([Self.record(1, .active, token: "r1")])
        #expect(await store.write(StoreWrite(Self.record(1, .active, token: "r2"), guardedBy: .sameGeneration)))
        #expect(await !store.write(StoreWrite(Self.record(2, .active, token: "r3"), guardedBy: .sameGeneration)))
        #expect(await !store.write(StoreWrite(Self.record(0, .active, token: "r4"), guardedBy: .sameGeneration)))
        #expect(await !InMemorySessionStore().write(StoreWrite(Self.record(0, .active), guardedBy: .sameGeneration)))
        #expect(await store.load("api")?.refreshToken == Secret("r2"))
    }

    @Test("within a generation the token serial orders writes: a late retry of an older record is dropped; active may end at its serial, an end is never undone")
    func serialOrder() async {
        func write(_ serial: UInt64, _ state: SessionRecord.State, _ token: String?) -> StoreWrite {
            StoreWrite(SessionRecord(name: "api", generation: 1, state: state, refreshToken: token.map(Secret.init), tokenSerial: serial),
                       guardedBy: .sameGeneration)
        }
        let store = InMemorySessionStore([SessionRecord(name: "api", generation: 1, state: .active, refreshToken: Secret("r1"), tokenSerial: 1)])
        #expect(await store.write(write(3, .active, "r3")))
        #expect(await !store.write(write(2, .active, "r2")))   // the degraded write of refresh #2, flushed late
        #expect(await store.write(write(3, .active, "r3")))    // the same record again: harmless
        #expect(await store.write(write(3, .ended, nil)))      // refresh #4 failed for good
        #expect(await !store.write(write(3, .active, "r3")))   // a late retry must not undo the end
        #expect(await store.load("api")?.state == .ended)
    }

    @Test("boundary writes may arrive in any order: the newest generation wins, late refreshes are dropped")
    func anyOrder() async {
        let writes = [
            StoreWrite(Self.record(1, .active, token: "late"), guardedBy: .sameGeneration),
            StoreWrite(Self.record(2, .signedOut), guardedBy: .newerGeneration),
            StoreWrite(Self.record(3, .active, token: "login"), guardedBy: .newerGeneration),
            StoreWrite(Self.record(4, .signedOut), guardedBy: .newerGeneration),
        ]
        for permutation in writes.permutations {
            let store = InMemorySessionStore([Self.record(1, .active, token: "r1")])
            for write in permutation { _ = await store.write(write) }
            let final = await store.load("api")
            #expect(final?.generation == 4 && final?.state == .signedOut && final?.refreshToken == nil)
        }
    }
}

@Suite("Secrets never print")
struct SecretTests {
    @Test("description, debug description, reflection and records hide the value")
    func redacted() {
        let secret = Secret("hunter2-refresh")
        let record = SessionRecord(name: "api", generation: 1, state: .active, refreshToken: secret, accessToken: Secret("hunter2-access"))
        let token = IssuedToken(token: Secret("hunter2-access"), tokenType: "Bearer", expiresAt: nil, generation: 1, serial: 7)
        var dumped = ""
        dump(record, to: &dumped)
        for text in ["\(secret)", String(reflecting: secret), "\(record)", String(reflecting: record), dumped,
                     "\(token)", String(reflecting: token), "\(FetchRequest(session: "api", generation: 1, refreshToken: secret))"] {
            #expect(!text.contains("hunter2"), "leaked: \(text.count) characters")
        }
        #expect("\(token)" == "token #7 (generation 1)")
        #expect(secret.reveal == "hunter2-refresh")
    }
}

