import DevIssuer
import Foundation
import Sealing
import Synchronization
import Testing
import TestSupport
import TokenBrokerCore
import Varlink
@testable import Fleet

/// Fleet mode against an attacker who can write to etcd but has no fleet key (a leaked etcd
/// credential, a compromised etcd host, a backup restored by mistake), and against values that
/// open under the real key but carry numbers no broker writes: real brokers, a real 3-member
/// etcd, the development issuer with reuse detection. Each figure the issue asks for is printed
/// as a `figure:` line.
@Suite("Fleet mode under attack: nothing read from etcd is trusted, history only moves forward", .serialized)
struct FleetAttackTests {
    typealias Fleet = FleetDaemonTests.Fleet
    static let base = "/tokenbroker-test/sessions/api/"

    static func etcd(_ fleet: Fleet) -> EtcdClient { EtcdClient(endpoints: fleet.cluster.clientURLs, timeout: .seconds(2)) }

    /// Every key of session `api`, as an attacker copies them.
    static func copy(_ fleet: Fleet) async throws -> [EtcdKeyValue] {
        try await etcd(fleet).range(prefix: Array(base.utf8)).records
    }

    /// Writes the copied values back, each with a plain put (no key needed).
    static func writeBack(_ records: [EtcdKeyValue], _ fleet: Fleet) async throws {
        for record in records { try await etcd(fleet).put(record.key, record.value) }
    }

    static func health(_ fleet: Fleet, _ member: Int) -> String { fleet.status(member)?["fleetHealth"]?.stringValue ?? "-" }

    /// The fleet key of the test fleet, as a broker holds it.
    static func codec(_ fleet: Fleet) throws -> FleetCodec {
        let key = try String(contentsOfFile: fleet.keyPath, encoding: .utf8)
        return FleetCodec(cipher: try TokenCipher(keyMaterial: Array(key.utf8), name: "fleet key"),
                          keys: FleetKeys(prefix: "/tokenbroker-test", session: "api"))
    }

    @Test("replay: the session's old values written back after a refresh → no broker serves the token of the past, no refresh presents the spent refresh token; the values are refused and counted; a new login recovers")
    func replay() async throws {
        try await FleetDaemonTests.withFleet { fleet in
            let first = try await fleet.logIn()
            let old = try await Self.copy(fleet)
            let second = try await fleet.refresh(on: 0, rejecting: first, "host A refreshes")
            try await eventually("every broker follows the refresh") { (0..<3).allSatisfy { fleet.token($0) == second } }
            let requests = fleet.issuer.counters.tokenRequests
            try await Self.writeBack(old, fleet)
            try await eventually("every broker refuses the values written back") {
                (0..<3).allSatisfy { Self.health(fleet, $0).hasPrefix("untrusted: ") }
            }
            var past = 0
            for _ in 0..<100 { for member in 0..<3 where fleet.token(member) == first { past += 1 } }
            for member in 0..<3 {
                #expect(fleet.token(member) == second, "host \(member) stopped serving the current token")
                let refused = try fleet.brokers[member].call("Recover", ["session": "api", "rejected": .string(second)])
                #expect(refused.error == "io.tokenbroker.Broker.RefreshFailed", "host \(member): \(refused)")
            }
            let replays = fleet.issuer.counters.replays
            print("figure: replay: \(past) of 300 GetToken calls served the token of the past; \(replays) replays at the issuer; "
                  + "\(fleet.issuer.counters.tokenRequests - requests) token requests after the write-back")
            #expect(past == 0 && replays == 0)
            #expect(fleet.issuer.counters.tokenRequests == requests, "a broker refreshed from the values written back")
            let metrics = try await fleet.brokers[2].ctl(["metrics"])
            #expect(metrics.out.contains("tokenbroker_fleet_healthy{session=\"api\"} 0"), "\(metrics.out)")
            #expect(!metrics.out.contains("tokenbroker_fleet_refused_values_total{session=\"api\"} 0"), "nothing was counted")
            #expect(fleet.brokers[2].child.stderr.contains("was written elsewhere in the key's history"))

            // A login (an operator's answer) starts a generation after the replayed one.
            _ = try await fleet.logIn(on: 1)
            try await eventually("every broker trusts the fleet again") { (0..<3).allSatisfy { Self.health(fleet, $0) == "healthy" } }
            #expect(fleet.issuer.counters.replays == 0)
        }
    }

    @Test("logout undone: after a fleet-wide logout the old values are written back, then a broker restarts and a new one joins → neither serves the ended token; the running ones stay signed out")
    func rollbackThenRestart() async throws {
        try await FleetDaemonTests.withFleet { fleet in
            let first = try await fleet.logIn()
            let old = try await Self.copy(fleet)
            #expect(try fleet.brokers[0].call("Logout", ["session": "api"]).error == nil)
            try await eventually("every broker is signed out") { (0..<3).allSatisfy { fleet.token($0) == nil } }
            try await Self.writeBack(old, fleet)
            try await eventually("every running broker refuses the values written back") {
                (0..<3).allSatisfy { Self.health(fleet, $0).hasPrefix("untrusted: ") }
            }
            let restarted = fleet.brokers[2]
            _ = await restarted.stop()
            fleet.brokers[2] = try await fleet.start(2, reusing: restarted.directory)
            fleet.brokers.append(try await fleet.start(3))   // a new host, with no state of its own
            try await eventually("the restarted and the new broker have read the fleet") {
                (2..<4).allSatisfy { Self.health(fleet, $0).hasPrefix("untrusted: ") }
            }
            var served = 0
            for _ in 0..<50 { for member in 0..<4 where fleet.token(member) == first { served += 1 } }
            print("figure: rollback: \(served) of 200 GetToken calls (2 running, 1 restarted, 1 new broker) served the token the logout ended")
            // What each says of it is what it does: the restarted and the new broker serve nothing.
            for member in 2..<4 {
                let log = fleet.brokers[member].child.stderr
                #expect(log.contains("not taken") && log.contains("so it serves nothing for the session"), "host \(member): \(log)")
                #expect(!log.contains("serving what this broker has") && !log.contains("serving the token"), "host \(member)")
            }
            #expect(served == 0)
            for member in 0..<4 {
                #expect(try fleet.brokers[member].call("GetToken", ["session": "api"]).error == "io.tokenbroker.Broker.SignedOut", "host \(member)")
            }
            #expect(fleet.issuer.counters.replays == 0)
        }
    }

    @Test("keys written next to the state without the fleet key (a flight, an hour's backoff with the attacker's text: where an earlier version kept them) → refreshes go on at once, no caller ever sees that text")
    func forgedFlightAndBackoff() async throws {
        try await FleetDaemonTests.withFleet(brokers: 2) { fleet in
            let first = try await fleet.logIn()
            let text = "ATTACKER " + String(repeating: "x", count: 300)
            try await Self.etcd(fleet).put(Array((Self.base + "flight").utf8), Array("host-9 pid 1 ffff".utf8))
            let until = Int64(Date().timeIntervalSince1970 * 1000) + 3_600_000
            try await Self.etcd(fleet).put(Array((Self.base + "backoff").utf8), Array(#"{"until":"\#(until)","reason":"\#(text)"}"#.utf8))
            let started = ContinuousClock.now
            let reply = try fleet.brokers[0].call("Recover", ["session": "api", "rejected": .string(first)])
            let blocked = started.duration(to: .now)
            print("figure: forged flight and backoff: the refresh went through after \(blocked); reply error \(reply.error ?? "none")")
            #expect(reply.error == nil, "\(reply)")
            #expect(reply.parameters["token"]?.stringValue != first)
            #expect(!"\(reply)".contains("ATTACKER"))
            for member in 0..<2 {
                #expect(!(fleet.status(member).map { "\($0)" } ?? "").contains("ATTACKER"))
                #expect(!fleet.brokers[member].child.stderr.contains("ATTACKER"), "host \(member) logged the attacker's text")
            }
        }
    }

    @Test("values that open under the real fleet key but carry numbers no broker writes (an expiry in year 285 billion, the serial at and past its limit) → no broker stops, before or after a restart; the expiry is clamped, the states at and beyond the limit are untrusted, the refresh is refused with a reason")
    func forgedNumbers() async throws {
        try await FleetDaemonTests.withFleet(brokers: 2) { fleet in
            _ = try await fleet.logIn()
            let codec = try Self.codec(fleet)
            let etcd = Self.etcd(fleet)
            let key = Array((Self.base + "state").utf8)
            func forge(_ change: (inout FleetState) -> Void) async throws {
                let record = try #require(try await etcd.get(key).record)
                var state = try codec.openState(record, unixNow: Date().timeIntervalSince1970).get()
                change(&state)
                try await etcd.put(key, try codec.seal(state, over: record))
            }
            try await forge { state in
                state.position = FleetPosition(generation: state.position.generation, serial: state.position.serial + 1)!
                state.accessToken = Secret("forged-access-1")
                state.expiresAt = 9_000_000_000_000_000_000
            }
            try await eventually("both brokers adopt the forged state") {
                (0..<2).allSatisfy { (fleet.status($0)?["expiresAt"]?.intValue ?? 0) > Int64(Date().timeIntervalSince1970) + 86_400 }
            }
            for member in 0..<2 {
                let expiresAt = try #require(fleet.status(member)?["expiresAt"]?.intValue)
                #expect(expiresAt <= Int64(Date().timeIntervalSince1970) + 310_000_000, "host \(member): expiry \(expiresAt) not clamped")
                #expect(fleet.brokers[member].child.process.isRunning)
            }
            // A restart reads it before it is ready: it starts, and serves.
            let restarted = fleet.brokers[1]
            _ = await restarted.stop()
            fleet.brokers[1] = try await fleet.start(1, reusing: restarted.directory)
            try await eventually("the restarted broker serves the fleet's token") { fleet.token(1) != nil }

            try await forge { state in
                state.position = FleetPosition(generation: state.position.generation, serial: FleetPosition.limit - 1)!
                state.accessToken = Secret("forged-access-2")
            }
            // At the serial limit, sealed with the key: refused as leaving no room (before, taken,
            // and its refresh refused); host A serves what it holds, and says what to do.
            try await eventually("both brokers refuse the state at the serial limit") {
                (0..<2).allSatisfy { Self.health(fleet, $0).hasPrefix("untrusted: the fleet's state is at generation") }
            }
            try await eventually("host A's refresh is refused, saying what to do") {
                guard let held = fleet.token(0) else { return false }
                let reply = try? fleet.brokers[0].call("Recover", ["session": "api", "rejected": .string(held)])
                return reply?.parameters["reason"]?.stringValue?.contains("log in again") == true
            }

            // Past the limit: the codec never writes it; written by hand under the real key.
            let record = try #require(try await etcd.get(key).record)
            let generation = try #require(fleet.status(0)?["fleetGeneration"]?.intValue)
            let plaintext = #"{"v":"1","c":"\#(record.createRevision)","k":"\#(record.version + 1)","g":"\#(generation)","n":"18446744073709551615","s":"active","tt":"Bearer","at":"x"}"#
            let key32 = try String(contentsOfFile: fleet.keyPath, encoding: .utf8)
            let sealed = try TokenCipher(keyMaterial: Array(key32.utf8)).seal(plaintext, associatedData: FleetCodec.associatedData(key))
            try await etcd.put(key, Array(sealed.utf8))
            try await eventually("both brokers refuse the state past the limit") {
                (0..<2).allSatisfy { Self.health(fleet, $0).hasPrefix("untrusted: the fleet's state is not a well-formed value") }
            }
            let alive = (0..<2).filter { fleet.brokers[$0].child.process.isRunning }.count
            print("figure: forged numbers: \(alive) of 2 brokers running after a huge expiry, a restart, and serials at and past the limit")
            #expect(alive == 2)
        }
    }

    @Test("a member (or proxy) that answers a watch with `created` and closes it → the broker watches again only after a pause that grows (not thousands of times a second), and keeps serving and refreshing")
    func watchEndingAtOnce() async throws {
        let proxyBox = Mutex<WatchEndingProxy?>(nil)
        defer { proxyBox.withLock { $0?.stop() } }
        try await FleetDaemonTests.withFleet(brokers: 1, prepare: { fleet in
            let port = try #require(Int(fleet.cluster.clientURLs[0].split(separator: ":").last ?? ""))
            let proxy = try WatchEndingProxy(forwardingTo: port)
            proxyBox.withLock { $0 = proxy }
            fleet.endpoints = ["http://127.0.0.1:\(proxy.port)"]
        }) { fleet in
            let proxy = try #require(proxyBox.withLock { $0 })
            let first = try await fleet.logIn()
            let started = ContinuousClock.now
            let before = proxy.watches
            try await eventually("the broker watched four more times") { proxy.watches >= before + 4 }
            let elapsed = started.duration(to: .now)
            // Pauses of 200, 400 and 800 ms at least come before the fourth watch after the first.
            print("figure: watch ending at once: 4 watches in \(elapsed) (\(Double(4) / elapsed.seconds) per second)")
            #expect(elapsed >= .milliseconds(1200), "4 watches in \(elapsed): restarts do not back off")
            let next = try await fleet.refresh(on: 0, rejecting: first, "the broker refreshes through the proxy")
            #expect(next != first)
            let metrics = try await fleet.brokers[0].ctl(["metrics"])
            #expect(!metrics.out.contains("tokenbroker_fleet_watch_restarts_total{session=\"api\"} 0"), "restarts not counted")
        }
    }

    @Test("the state deleted or garbled while a refresh is held at the issuer → no other broker refreshes from anything (no replay); a garbled state is written over by the commit; a deleted one waits for a new login", arguments: [false, true])
    func stateTamperedDuringFlight(deleted: Bool) async throws {
        try await FleetDaemonTests.withFleet(brokers: 2) { fleet in
            let first = try await fleet.logIn()
            let key = Array((Self.base + "state").utf8)
            let waiter = try await fleet.holdRefresh(on: 1, rejecting: first)
            if deleted {
                _ = try await Self.etcd(fleet).transaction([], success: [.delete(key: key)], failure: [])
            } else {
                try await Self.etcd(fleet).put(key, Array("garbage".utf8))
            }
            let requests = fleet.issuer.counters.tokenRequests
            try await eventually("host A sees the state gone or refused") { Self.health(fleet, 0).hasPrefix("untrusted: ") }
            let refused = try fleet.brokers[0].call("Recover", ["session": "api", "rejected": .string(first)])
            #expect(refused.error == "io.tokenbroker.Broker.RefreshFailed", "\(refused)")
            #expect(fleet.issuer.counters.tokenRequests == requests, "host A refreshed from a state it cannot trust")
            fleet.issuer.releaseHeld()
            try await eventually("host B's refresh is answered") { waiter.reply != nil }
            if deleted {
                #expect(waiter.reply?.error != nil, "host B served a token the fleet does not hold")
            } else {
                let token = try #require(waiter.reply?.parameters["token"]?.stringValue, "\(String(describing: waiter.reply))")
                try await eventually("host A follows B's commit, written over the garbage") { fleet.token(0) == token }
            }
            print("figure: state \(deleted ? "deleted" : "garbled") during a flight: \(fleet.issuer.counters.replays) replays at the issuer")
            #expect(fleet.issuer.counters.replays == 0)
            _ = try await fleet.logIn(on: 0)
            try await eventually("every broker trusts the fleet again") { (0..<2).allSatisfy { Self.health(fleet, $0) == "healthy" } }
        }
    }

    @Test("a clean stop of a fleet broker (SIGTERM after logins and refreshes) logs nothing at warning or worse")
    func cleanStop() async throws {
        try await FleetDaemonTests.withFleet(brokers: 2) { fleet in
            var token = try await fleet.logIn()
            for _ in 0..<3 { token = try await fleet.refresh(on: 0, rejecting: token, "host A refreshes") }
            for member in 0..<2 {
                let broker = fleet.brokers[member]
                let code = await broker.stop()
                let log = broker.child.stderr
                let tail = log.range(of: "stopping (signal").map { String(log[$0.lowerBound...]) } ?? log
                let loud = tail.split(separator: "\n").filter { ["<0>", "<1>", "<2>", "<3>", "<4>"].contains($0.prefix(3)) }
                print("figure: clean stop of host \(member): exit \(code), \(loud.count) line(s) at warning or worse")
                #expect(code == 0 && loud.isEmpty, "host \(member): \(loud)")
            }
        }
    }
}

/// The end of a fleet's numbers, against whoever holds the fleet key, and the way out an admin
/// has when a history got there anyway.
extension FleetAttackTests {
    static let limit = FleetPosition.limit

    @Test("a state sealed with the fleet key at the generation limit → refused and counted by every broker, which go on serving what they hold; a login on any broker works at once (before: every login failed, the fleet's generation having reached its limit)")
    func generationAtTheLimit() async throws {
        try await FleetDaemonTests.withFleet { fleet in
            let first = try await fleet.logIn()
            let (codec, etcd, key) = (try Self.codec(fleet), Self.etcd(fleet), Array((Self.base + "state").utf8))
            let record = try #require(try await etcd.get(key).record)
            var state = try codec.openState(record, unixNow: Date().timeIntervalSince1970).get()
            state.position = try #require(FleetPosition(generation: Self.limit - 1, serial: 0))
            try await etcd.put(key, try codec.seal(state, over: record))
            try await eventually("every broker refuses the state at the generation limit") {
                (0..<3).allSatisfy { Self.health(fleet, $0).hasPrefix("untrusted: the fleet's state is at generation \(Self.limit - 1)") }
            }
            for member in 0..<3 { #expect(fleet.token(member) == first, "host \(member) stopped serving its token") }
            let metrics = try await fleet.brokers[1].ctl(["metrics"])
            #expect(metrics.out.contains("tokenbroker_fleet_refused_values_total{session=\"api\"} 1"), "\(metrics.out)")
            let next = try await fleet.logIn(on: 2)
            print("figure: generation at the limit: refused by 3 of 3 brokers; a login afterwards: \(next == first ? "failed" : "worked")")
            try await eventually("every broker trusts the fleet again") { (0..<3).allSatisfy { Self.health(fleet, $0) == "healthy" } }
        }
    }

    @Test("marks at the generation limit (kept by brokers that followed such a value before it was refused) and the state key removed → a login fails, saying to run ctl reset-fleet-history, and changes nothing; ctl reset-fleet-history (admins only) on one broker → every broker follows it as a logout and says so in its journal; a login then works everywhere, and a restarted broker keeps the new history")
    func resetFleetHistory() async throws {
        try await FleetDaemonTests.withFleet { fleet in
            _ = try await fleet.logIn()
            for member in 0..<3 { _ = await fleet.brokers[member].stop() }
            for member in 0..<3 {
                let database = fleet.brokers[member].directory + "/state/state.db"
                let python = try await Child.run("/usr/bin/env", ["python3", "-c",
                    "import sqlite3; c = sqlite3.connect('\(database)'); c.execute('UPDATE fleet_marks SET generation = \(Self.limit - 1), serial = 0');"
                    + " c.commit()"])
                #expect(python.code == 0, "\(python.stderr)")
            }
            _ = try await Self.etcd(fleet).transaction([], success: [.delete(key: Array((Self.base + "state").utf8))])
            for member in 0..<3 { fleet.brokers[member] = try await fleet.start(member, reusing: fleet.brokers[member].directory) }
            try await eventually("every broker reports the fleet behind its mark") {
                (0..<3).allSatisfy { Self.health(fleet, $0).hasPrefix("untrusted: it shows no state, older than generation \(Self.limit - 1)") }
            }
            let refused = try fleet.brokers[0].call("Login", ["session": "api", "refreshToken": .string(fleet.issuer.issueRefreshToken())])
            #expect(refused.error == "io.tokenbroker.Broker.StoreFailed", "\(refused)")
            #expect(refused.parameters["reason"]?.stringValue?.contains("tokenbroker ctl reset-fleet-history api") == true, "\(refused)")

            let denied = try await fleet.brokers[1].ctl(["reset-fleet-history", "api"], asUser: Broker.workerUID)
            #expect(denied.code == 77, "\(denied)")
            let reset = try await fleet.brokers[1].ctl(["reset-fleet-history", "api"])
            #expect(reset.code == 0 && reset.out.hasPrefix("started the fleet history of api anew (history 1, fleet generation "), "\(reset)")
            try await eventually("every broker says it follows the new history") {
                fleet.brokers[1].child.stderr.contains("<4>session api: the session's fleet history was started anew here")
                    && [0, 2].allSatisfy { fleet.brokers[$0].child.stderr.contains("<4>session api: the fleet started the session's history anew") }
            }
            #expect(fleet.brokers[1].child.stderr.contains("<4>the fleet history of session api was started anew by "))
            let token = try await fleet.logIn(on: 0)
            try await eventually("every broker trusts the fleet") { (0..<3).allSatisfy { Self.health(fleet, $0) == "healthy" } }
            let restarted = fleet.brokers[2]
            _ = await restarted.stop()
            fleet.brokers[2] = try await fleet.start(2, reusing: restarted.directory)
            try await eventually("the restarted broker serves the new history's login") { fleet.token(2) == token }
            #expect(Self.health(fleet, 2) == "healthy")
            let mark = try await Child.run("/usr/bin/env", ["python3", "-c",
                "import sqlite3; print(sqlite3.connect('\(restarted.directory)/state/state.db').execute('SELECT history, generation FROM fleet_marks').fetchone())"])
            print("figure: reset past the generation limit: login before the reset \(refused.error ?? "ok"); after it, every broker serves the login; "
                  + "host 2's mark (history, generation) \(mark.stdout.trimmingCharacters(in: .whitespacesAndNewlines))")
            #expect(mark.stdout.hasPrefix("(1, "), "\(mark.stdout)")
            #expect(fleet.issuer.counters.replays == 0)
        }
    }
}
