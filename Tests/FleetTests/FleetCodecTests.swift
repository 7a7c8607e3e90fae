import Foundation
import Sealing
import Testing
import TestSupport
import TokenBrokerCore
import WireJSON
@testable import Fleet

/// What a fleet session takes from etcd: sealed under the fleet key, at its place in the key's
/// history, with bounded numbers — and everything else refused, named, never trapping.
@Suite("Fleet values: sealed, placed, bounded")
struct FleetCodecTests {
    static let keys = FleetKeys(prefix: "/t", session: "api")
    static let now = 1_800_000_000.0

    static func codec(_ key: String = String(repeating: "5a", count: 32), prefix: String = "/t", session: String = "api") throws -> FleetCodec {
        FleetCodec(cipher: try TokenCipher(keyMaterial: Array(key.utf8), name: "fleet key"), keys: FleetKeys(prefix: prefix, session: session))
    }

    static func record(_ value: [UInt8], key: [UInt8] = keys.state, created: Int64, version: Int64, modRevision: Int64 = 10) -> EtcdKeyValue {
        EtcdKeyValue(key: key, value: value, createRevision: created, modRevision: modRevision, version: version, lease: 0)
    }

    static func active(_ generation: Int64, _ serial: Int64) -> FleetState {
        FleetState(position: FleetPosition(generation: generation, serial: serial)!, phase: .active, refreshToken: Secret("rt"),
                   accessToken: Secret("at"), expiresAt: Int64(now) + 3600)
    }

    @Test("a state opens only at the place in its key's history it was sealed for: the next version of that key's life")
    func placed() throws {
        let codec = try Self.codec()
        let current = Self.record([], created: 5, version: 3)
        let sealed = try codec.seal(Self.active(2, 4), over: current)
        // Written as sealed: version 4 of the key created at revision 5.
        let opened = try codec.openState(Self.record(sealed, created: 5, version: 4), unixNow: Self.now).get()
        #expect(opened == Self.active(2, 4))
        // The same bytes written again (version 5), or into a key deleted and created anew.
        #expect(codec.openState(Self.record(sealed, created: 5, version: 5), unixNow: Self.now) == .failure(.misplaced))
        #expect(codec.openState(Self.record(sealed, created: 40, version: 4), unixNow: Self.now) == .failure(.misplaced))
    }

    @Test("the write that creates the state key carries no token, and opens only as version 1")
    func creation() throws {
        let codec = try Self.codec()
        #expect(throws: FleetValueProblem.self) { try codec.seal(Self.active(1, 0), over: nil) }
        let created = try codec.seal(FleetState(position: FleetPosition(generation: 1, serial: 0)!, phase: .signedOut), over: nil)
        #expect(try codec.openState(Self.record(created, created: 9, version: 1), unixNow: Self.now).get().phase == .signedOut)
        #expect(codec.openState(Self.record(created, created: 9, version: 2), unixNow: Self.now) == .failure(.misplaced))
    }

    @Test("a value moved to another field, session or prefix, or sealed under another key, or not sealed at all, does not open")
    func unsealed() throws {
        let codec = try Self.codec()
        let sealed = try codec.seal(Self.active(2, 1), over: Self.record([], created: 5, version: 1))
        let placed = Self.record(sealed, created: 5, version: 2)
        for other in [try Self.codec(session: "payroll"), try Self.codec(prefix: "/u"), try Self.codec(String(repeating: "a5", count: 32))] {
            guard case .failure(.unsealed) = other.openState(placed, unixNow: Self.now) else {
                Issue.record("opened elsewhere")
                continue
            }
        }
        guard case .failure(.unsealed("not sealed")) = codec.openState(Self.record(Array("{\"g\":\"9\"}".utf8), created: 5, version: 2), unixNow: Self.now) else {
            Issue.record("clear text taken")
            return
        }
    }

    @Test("numbers out of range are refused, expiries and times are clamped to ±10 years, texts are cut and printable")
    func bounds() throws {
        let codec = try Self.codec()
        let cipher = try TokenCipher(keyMaterial: Array(String(repeating: "5a", count: 32).utf8), name: "fleet key")
        func forge(_ fields: String) throws -> Result<FleetState, FleetValueProblem> {
            let sealed = try cipher.seal(#"{"v":"1","c":"5","k":"2",\#(fields)}"#, associatedData: FleetCodec.associatedData(Self.keys.state))
            return codec.openState(Self.record(Array(sealed.utf8), created: 5, version: 2), unixNow: Self.now)
        }
        let huge = try forge(#""g":"2","n":"1","s":"active","at":"a","exp":"9000000000000000000","er":"x\u0007y""#).get()
        #expect(huge.expiresAt == Int64(Self.now + FleetCodec.timeBound))
        #expect(try forge(#""g":"2","n":"1","s":"active","at":"a","exp":"-9000000000000000000""#).get().expiresAt == Int64(Self.now - FleetCodec.timeBound))
        for fields in [#""g":"9007199254740992","n":"1","s":"active""#, #""g":"2","n":"18446744073709551615","s":"active""#,
                       #""g":"-1","n":"1","s":"active""#, #""g":"2","n":"1","s":"awake""#, #""g":2,"n":"1","s":"active""#,
                       #""g":"2","n":"1","s":"signedOut","rt":"r""#, #""h":"-1","g":"2","n":"1","s":"active""#,
                       #""h":"x","g":"2","n":"1","s":"active""#] {
            guard case .failure(.malformed) = try forge(fields) else {
                Issue.record("taken: \(fields)")
                continue
            }
        }
        // Sealed with the key, but at the limit or within the room kept below it: refused, so that
        // no value can use the fleet's numbers up.
        let (limit, lowest) = (FleetPosition.limit, FleetPosition.limit - FleetPosition.room)
        for fields in [#""g":"\#(limit - 1)","n":"\#(limit - 1)","s":"active","at":"a""#, #""g":"\#(lowest)","n":"1","s":"active""#,
                       #""g":"2","n":"\#(lowest)","s":"active""#, #""h":"\#(lowest)","g":"2","n":"1","s":"active""#] {
            guard case .failure(.nearLimit) = try forge(fields) else {
                Issue.record("taken: \(fields)")
                continue
            }
        }
        let highest = try forge(#""h":"\#(lowest - 1)","g":"\#(lowest - 1)","n":"\#(lowest - 1)","s":"active","at":"a""#).get()
        #expect(highest.position.nextGeneration(atLeast: 0)?.generation == lowest && highest.position.nextSerial != nil)
        let last = try #require(FleetPosition(generation: limit - 1, serial: limit - 1))
        #expect(last.nextSerial == nil && last.nextGeneration(atLeast: 0) == nil)
        #expect(last.nextHistory(atLeast: 900) == FleetPosition(history: 1, generation: 900, serial: 0))
        #expect(FleetPosition(generation: 5, serial: 0)!.nextGeneration(atLeast: limit * 4)?.generation == limit - 1)
        let full = FleetState(position: last, phase: .active, accessToken: Secret("a"))
        #expect(full.refreshed(with: FetchedToken(accessToken: Secret("b")), unixNow: Self.now) == nil)
        #expect(FleetCodec.printable("a\nb\u{2028}" + String(repeating: "z", count: 400)).count == 200)
        #expect(!FleetCodec.printable("a\r\nb").contains("\n"))
    }

    @Test("a flight claim and a backoff note are part of the state: sealed with it, bounded, and only on an active state")
    func claimAndBackoff() throws {
        let codec = try Self.codec()
        var state = Self.active(2, 3)
        state.flight = FlightClaim(holder: "b pid 1 ab", lease: .seconds(7200), taken: Int64(Self.now * 1000))
        state.backoff = BackoffNote(until: Int64(Self.now * 1000) + 86_400_000, reason: "HTTP 503")
        let opened = try codec.openState(Self.record(try codec.seal(state, over: Self.record([], created: 5, version: 1)), created: 5, version: 2),
                                         unixNow: Self.now).get()
        #expect(opened.flight?.holder == "b pid 1 ab" && opened.flight?.lease == .seconds(3600), "the lease is bounded to an hour")
        #expect(opened.backoff == BackoffNote(until: Int64(Self.now * 1000) + 3_600_000, reason: "HTTP 503"), "the backoff is bounded to an hour")
        #expect(state.claimed(FlightClaim(holder: "c", lease: .seconds(6), taken: 0))?.position == FleetPosition(generation: 2, serial: 4))
        #expect(state.refreshed(with: FetchedToken(accessToken: Secret("new")), unixNow: Self.now)?.flight == nil)
        let cipher = try TokenCipher(keyMaterial: Array(String(repeating: "5a", count: 32).utf8), name: "fleet key")
        let sealed = try cipher.seal(#"{"v":"1","c":"5","k":"2","g":"2","n":"1","s":"signedOut","fh":"x","fl":"6000","ft":"0"}"#,
                                     associatedData: FleetCodec.associatedData(Self.keys.state))
        guard case .failure(.malformed) = codec.openState(Self.record(Array(sealed.utf8), created: 5, version: 2), unixNow: Self.now) else {
            Issue.record("a claim on a signed-out state was taken")
            return
        }
    }

    @Test("a claim holds for its lease from the moment this broker first saw it, by this broker's clock, and from scratch after an outage")
    func claimTiming() throws {
        let codec = try Self.codec()
        var state = Self.active(2, 3)
        state.flight = FlightClaim(holder: "b", lease: .seconds(6), taken: 0)
        let place = Self.record(try codec.seal(state, over: Self.record([], created: 5, version: 1)), created: 5, version: 2)
        var mirror = FleetMirror()
        mirror.reset(place, revision: 10, earlierLayout: false)
        let view = codec.view(of: mirror, unixNow: Self.now)
        var machine = FleetStateMachine(session: "api", floor: nil)
        machine.followed(Self.active(2, 3), local: 1)
        func plan(_ now: Duration) -> FleetStateMachine.RefreshPlan {
            machine.planRefresh(generation: 1, view: view, unixNow: Self.now, now: now, held: Secret("at"), holder: "a")
        }
        guard case .wait(_, let until) = plan(.seconds(100)) else { Issue.record("not waiting"); return }
        #expect(until == .seconds(106))
        guard case .wait = plan(.seconds(105)) else { Issue.record("not waiting within the lease"); return }
        guard case .takeFlight = plan(.seconds(106)) else { Issue.record("not taken over after the lease"); return }
        // etcd was away: the holder could not commit either; its claim counts from now.
        machine.unavailable("no quorum")
        machine.reached()
        guard case .wait(_, let again) = plan(.seconds(200)) else { Issue.record("not waiting after the outage"); return }
        #expect(again == .seconds(206))
    }
}

/// A fuzz of what etcd may answer: the gateway's JSON (range answers, watch lines) mutated at
/// random, and sealed values with random contents under the real key. Nothing traps, nothing
/// unbounded is kept, and every refusal is a named problem. `TB_FUZZ_ITERATIONS` (default
/// 2,000 values, 3,000 answers) and `TB_FUZZ_SEED` (printed).
@Suite("Fleet fuzz: etcd answers and value contents")
struct FleetFuzzTests {
    static let fields = ["v", "c", "k", "g", "n", "s", "rt", "at", "tt", "exp", "lr", "er", "fh", "fl", "ft", "bu", "br"]

    static func number(_ random: inout SeededRandom) -> String {
        if random.next() % 3 != 0 { return String(random.next() % 10_000_000) }
        return random.pick(["0", "1", "2", "-1", "5", "9007199254740991", "9007199254740992", "18446744073709551615", "9223372036854775807",
                     "-9223372036854775808", "1e3", "", "x", "10", String(random.next() % 1_000_000)])
    }

    static func value(_ random: inout SeededRandom) -> JSON {
        switch random.next() % 6 {
        case 0: return .string(number(&random))
        case 1: return .string(random.pick(["active", "signedOut", "ended", "1", "", "\u{0}", String(repeating: "a", count: 300)]))
        case 2: return .int(Int64(bitPattern: random.next()))
        case 3: return .array([.string("x")])
        case 4: return .null
        default: return .object(["v": "1"])
        }
    }

    @Test("random contents sealed under the real fleet key, at the right place or not, never trap and are either taken bounded or refused")
    func contents() throws {
        let iterations = SeededRandom.iterations(default: 2_000)
        let seed = SeededRandom.seed()
        print("fuzz: \(iterations) values, TB_FUZZ_SEED=\(seed)")
        var random = SeededRandom(seed: seed)
        let codec = try FleetCodecTests.codec()
        let cipher = try TokenCipher(keyMaterial: Array(String(repeating: "5a", count: 32).utf8), name: "fleet key")
        let now = FleetCodecTests.now
        var taken = 0
        for _ in 0..<iterations {
            // A well-formed state, flight claim and backoff note at once, some fields then changed or dropped.
            var object: JSONObject = ["v": "1", "c": "5", "k": "2", "g": .string(Self.number(&random)), "n": .string(Self.number(&random)),
                                      "s": "active", "tt": "Bearer", "at": "a", "rt": "r",
                                      "exp": .string(Self.number(&random)), "lr": .string(Self.number(&random)), "er": "why",
                                      "fh": "b pid 1 ab", "fl": .string(Self.number(&random)), "ft": .string(Self.number(&random)),
                                      "bu": .string(Self.number(&random)), "br": "HTTP 503"]
            if random.next() % 4 == 0 {
                object["s"] = .string(random.pick(["signedOut", "ended"]))
                if random.next() % 4 != 0 { object["at"] = nil; object["rt"] = nil; object["fh"] = nil; object["bu"] = nil }
            }
            if random.next() % 2 == 0 { object["fh"] = nil }
            if random.next() % 2 == 0 { object["bu"] = nil }
            for field in Self.fields where random.next() % 8 == 0 {
                if random.next() % 2 == 0 { object[field] = nil } else { object[field] = Self.value(&random) }
            }
            var bytes: [UInt8] = []
            object.encode(into: &bytes)
            let keys = FleetKeys(prefix: "/t", session: "api")
            let key = random.next() % 5 == 0 ? keys.earlierRecord : keys.state
            let sealed = Array(try cipher.seal(String(decoding: bytes, as: UTF8.self), associatedData: FleetCodec.associatedData(key)).utf8)
            let record = EtcdKeyValue(key: keys.state, value: sealed, createRevision: 5, modRevision: 10, version: random.next() % 3 == 0 ? 1 : 2,
                                      lease: 0)
            if case let .success(state) = codec.openState(record, unixNow: now) {
                taken += 1
                #expect(key == keys.state)
                #expect(state.position.generation < FleetPosition.limit && state.position.serial < FleetPosition.limit)
                #expect(abs(Double(state.expiresAt ?? 0) - now) <= FleetCodec.timeBound + 1 || state.expiresAt == nil)
                #expect((state.endReason?.count ?? 0) <= 200 && state.tokenType.count <= 40)
                _ = FleetStateMachine.usable(state, unixNow: now)
                _ = state.refreshed(with: FetchedToken(accessToken: Secret("a"), expiresIn: .seconds(Int64.max / 4)), unixNow: now)
            }
            var mirror = FleetMirror()
            mirror.reset(record, revision: 10, earlierLayout: false)
            let view = codec.view(of: mirror, unixNow: now)
            // A machine that follows the session at the state's generation, so that every plan
            // (deliver, wait, backoff, take the flight) is reached, and a commit's verdict.
            var machine = FleetStateMachine(session: "api", floor: FleetPosition(generation: 2, serial: 0))
            if let state = view.validState { machine.followed(state, local: 1) }
            _ = machine.follow(view, unixNow: now, now: .seconds(Int64(random.next() % 100)), held: Secret("a"))
            let plan = machine.planRefresh(generation: 1, view: view, unixNow: now, now: .seconds(Int64(random.next() % 100)), held: nil, holder: "x")
            if case let .takeFlight(state, place) = plan, let next = state.refreshed(with: FetchedToken(accessToken: Secret("b")), unixNow: now) {
                _ = machine.verdict(on: codec.openState(record, unixNow: now), record: record, sameBytes: false, next: next, over: place)
            }
            _ = machine.planPublish(nil, view: view, ending: nil, now: .zero)
        }
        print("fuzz: \(taken) of \(iterations) states taken")
        #expect(taken > iterations / 20, "the fuzz hardly ever builds a state that is taken: it tests only refusals")
    }

    @Test("etcd gateway answers and watch lines mutated at random never trap: a record, a batch of events, or a named error")
    func answers() throws {
        let iterations = SeededRandom.iterations(default: 3_000)
        let seed = SeededRandom.seed()
        print("fuzz: \(iterations) answers, TB_FUZZ_SEED=\(seed)")
        var random = SeededRandom(seed: seed)
        let range = #"{"header":{"revision":"12"},"kvs":[{"key":"L3Qvc2Vzc2lvbnMvYXBpL3N0YXRl","create_revision":"5","mod_revision":"10","version":"2","value":"eA==","lease":"7"}],"count":"1"}"#
        let watch = #"{"result":{"header":{"revision":"13"},"events":[{"kv":{"key":"L3Q=","create_revision":"5","mod_revision":"13","version":"3","value":"eA=="}},{"type":"DELETE","kv":{"key":"L3U=","mod_revision":"13"}}]}}"#
        let pieces = ["\"", "{", "}", "[", "]", ",", ":", "-1", "9223372036854775807", "99999999999999999999", "null", "\"DELETE\"",
                      "\"PUT\"", "\"x\"", "true", "1e400", "\\u0000", "\"created\":true", "\"canceled\":true", "\"compact_revision\":\"4\""]
        for _ in 0..<iterations {
            var bytes = Array(random.pick([range, watch]).utf8)
            for _ in 0..<(1 + random.next() % 4) {
                let at = Int(random.next() % UInt64(bytes.count + 1))
                switch random.next() % 3 {
                case 0: bytes.insert(contentsOf: Array(random.pick(pieces).utf8), at: at)
                case 1: if at < bytes.count { bytes.remove(at: at) }
                default: if at < bytes.count { bytes[at] = UInt8(truncatingIfNeeded: random.next()) }
                }
            }
            if let object = (try? JSONParser.parse(bytes))?.objectValue {
                if let records = try? EtcdClient.records(object["kvs"]) {
                    for record in records {
                        #expect((0..<etcdNumberLimit).contains(record.modRevision) && (0..<etcdNumberLimit).contains(record.version))
                    }
                }
                _ = try? EtcdClient.revision(object)
            }
            var started = false
            if let (events, revision) = (try? EtcdWatchStream.batch(bytes, started: &started)) ?? nil {
                #expect((0..<etcdNumberLimit).contains(revision))
                var mirror = FleetMirror()
                _ = mirror.apply(events, revision: revision, key: FleetKeys(prefix: "/t", session: "api").state)
            }
        }
    }
}
