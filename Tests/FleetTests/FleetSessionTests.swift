import Foundation
import SQLiteStore
import Synchronization
import Testing
import TestSupport
import TokenBrokerCore
@testable import Fleet

/// `FleetSession` against a real etcd cluster, without a daemon and without a coordinator:
/// what etcd itself enforces, with nothing local to help.
@Suite("FleetSession on a real etcd cluster", .serialized)
struct FleetSessionTests {
    /// An upstream whose answers wait for `release()`; counts what it was asked.
    final class GatedSource: TokenSource {
        private let state = Mutex<(calls: Int, released: Bool, waiting: [CheckedContinuation<Void, Never>])>((0, false, []))
        var calls: Int { state.withLock { $0.calls } }

        func release() {
            let waiting = state.withLock { state in
                state.released = true
                defer { state.waiting = [] }
                return state.waiting
            }
            for continuation in waiting { continuation.resume() }
        }

        func fetch(_ request: FetchRequest) async throws -> FetchedToken {
            let serial = state.withLock { state in
                state.calls += 1
                return state.calls
            }
            await withCheckedContinuation { continuation in
                let now = state.withLock { state in
                    if state.released { return true }
                    state.waiting.append(continuation)
                    return false
                }
                if now { continuation.resume() }
            }
            return FetchedToken(accessToken: Secret("access-\(serial)"), expiresIn: .seconds(3600), refreshToken: Secret("refresh-\(serial)"))
        }
    }

    struct Wall: WallClock {
        func unixTime() -> Double { Date().timeIntervalSince1970 }
    }

    static let key = Secret(String(repeating: "ab", count: 32))

    static func session(_ cluster: EtcdCluster, member: String, upstream: any TokenSource,
                        discarded: @escaping @Sendable (FetchedToken) -> Void = { _ in }) throws -> FleetSession {
        let settings = FleetSettings(endpoints: cluster.clientURLs, prefix: "/t", key: key, flightLease: .seconds(6),
                                     requestTimeout: .seconds(1), member: member)
        return try FleetSession(name: "api", settings: settings, upstream: upstream, local: InMemorySessionStore(), wall: Wall(),
                                discarded: discarded)
    }

    static func login(_ generation: Int, refreshToken: String) -> StoreWrite {
        StoreWrite(SessionRecord(name: "api", generation: generation, state: .active, refreshToken: Secret(refreshToken)), guardedBy: .newerGeneration)
    }

    static func logout(_ generation: Int) -> StoreWrite {
        StoreWrite(SessionRecord(name: "api", generation: generation, state: .signedOut), guardedBy: .newerGeneration)
    }

    /// The record etcd holds, opened with the fleet key.
    static func stored(_ cluster: EtcdCluster) async throws -> (generation: String, record: FleetRecord) {
        let etcd = EtcdClient(endpoints: cluster.clientURLs)
        let generation = try #require(try await etcd.get(Array("/t/sessions/api/generation".utf8)).record)
        let record = try #require(try await etcd.get(Array("/t/sessions/api/record".utf8)).record)
        let cipher = try TokenCipher(keyMaterial: Array(key.reveal.utf8))
        return (String(decoding: generation.value, as: UTF8.self),
                try FleetRecord.open(record.value, with: cipher, associatedData: "/t/sessions/api/record"))
    }

    @Test("a refresh answer that lands after a logout elsewhere is never committed: the commit compares the generation, the record and the flight, and the answer is discarded")
    func lateAnswerAfterLogout() async throws {
        let cluster = try await EtcdCluster(members: 3, answers: etcdAnswers)
        do {
            let upstream = GatedSource()
            let discarded = Mutex<[String]>([])
            let hostB = try Self.session(cluster, member: "b", upstream: upstream) { fetched in
                discarded.withLock { $0.append(fetched.refreshToken?.reveal ?? "-") }
            }
            let hostA = try Self.session(cluster, member: "a", upstream: GatedSource())
            #expect(try await hostB.write(Self.login(1, refreshToken: "refresh-0")))
            let flight = Task { try await hostB.fetch(FetchRequest(session: "api", generation: 1, refreshToken: nil)) }
            try await eventually("B's upstream request is under way") { upstream.calls == 1 }
            #expect(hostB.status.flightHolder == nil || hostB.status.flightHolder?.hasPrefix("b ") == true)

            // Host A logs out (it has no coordinator: nothing tells B's flight locally).
            #expect(try await hostA.write(Self.logout(1)))
            upstream.release()
            await #expect(throws: FetchFailure.self) { try await flight.value }
            #expect(discarded.withLock { $0 } == ["refresh-1"], "the uncommitted answer was not handed back for revocation")
            let (generation, record) = try await Self.stored(cluster)
            #expect(generation == "2" && record.generation == 2 && record.state == .signedOut && record.refreshToken == nil)
            #expect(try await EtcdClient(endpoints: cluster.clientURLs).get(Array("/t/sessions/api/flight".utf8)).record == nil)
        } catch {
            await cluster.stop()
            throw error
        }
        await cluster.stop()
    }

    @Test("a record sealed under another fleet key is refused, not served: the fleet counts as unavailable and nothing is fetched")
    func wrongKey() async throws {
        let cluster = try await EtcdCluster(members: 3, answers: etcdAnswers)
        do {
            let hostA = try Self.session(cluster, member: "a", upstream: GatedSource())
            #expect(try await hostA.write(Self.login(1, refreshToken: "refresh-0")))
            let settings = FleetSettings(endpoints: cluster.clientURLs, prefix: "/t", key: Secret(String(repeating: "cd", count: 32)),
                                         flightLease: .seconds(6), requestTimeout: .seconds(1), member: "x")
            let upstream = GatedSource()
            let stranger = try FleetSession(name: "api", settings: settings, upstream: upstream, local: InMemorySessionStore(), wall: Wall())
            // Its logout cannot even read the fleet's state.
            await #expect(throws: EtcdError.self) { try await stranger.write(Self.logout(1)) }
            guard case let .unavailable(why) = stranger.status.health else {
                Issue.record("health is \(stranger.status.health)")
                return
            }
            #expect(why.contains("does not decrypt"), "\(why)")
            #expect(upstream.calls == 0)
            #expect(try await Self.stored(cluster).record.state == .active)
        } catch {
            await cluster.stop()
            throw error
        }
        await cluster.stop()
    }
}
