import Foundation
import Sealing
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

    static let key = SecretBytes(Array(String(repeating: "ab", count: 32).utf8))

    typealias Session = FleetSession<ContinuousClock>

    static func session(_ cluster: EtcdCluster, member: String, upstream: any TokenSource,
                        discarded: @escaping @Sendable (FetchedToken) -> Void = { _ in }) throws -> Session {
        let settings = FleetSettings(endpoints: cluster.clientURLs, prefix: "/t", key: key, flightLease: .seconds(6),
                                     requestTimeout: .seconds(1), member: member)
        return try session(settings, upstream: upstream, discarded: discarded)
    }

    static func session(_ settings: FleetSettings, upstream: any TokenSource,
                        discarded: @escaping @Sendable (FetchedToken) -> Void = { _ in }) throws -> Session {
        try Session(name: "api", settings: settings,
                    backend: EtcdClient(endpoints: settings.endpoints, tls: settings.tls, timeout: settings.requestTimeout),
                    upstream: upstream, local: InMemoryFleetStore(), floor: nil, clock: ContinuousClock(), wall: Wall(), discarded: discarded)
    }

    static func login(_ generation: Int, refreshToken: String) -> StoreWrite {
        StoreWrite(SessionRecord(name: "api", generation: generation, state: .active, refreshToken: Secret(refreshToken)), guardedBy: .newerGeneration)
    }

    static func logout(_ generation: Int) -> StoreWrite {
        StoreWrite(SessionRecord(name: "api", generation: generation, state: .signedOut), guardedBy: .newerGeneration)
    }

    /// The state etcd holds, opened with the fleet key.
    static func stored(_ cluster: EtcdCluster) async throws -> FleetState {
        let record = try await storedRecord(cluster)
        let codec = FleetCodec(cipher: try TokenCipher(keyMaterial: key.reveal), keys: FleetKeys(prefix: "/t", session: "api"))
        return try codec.openState(record, unixNow: Date().timeIntervalSince1970).get()
    }

    static func storedRecord(_ cluster: EtcdCluster) async throws -> EtcdKeyValue {
        try #require(try await EtcdClient(endpoints: cluster.clientURLs).get(Array("/t/sessions/api/state".utf8)).record)
    }

    @Test("a refresh answer that lands after a logout elsewhere is never committed: the commit compares the state's revision, and the answer is discarded")
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
            let loggedIn = try await Self.stored(cluster).position.generation
            let flight = Task { try await hostB.fetch(FetchRequest(session: "api", generation: 1, refreshToken: nil)) }
            try await eventually("B's upstream request is under way") { upstream.calls == 1 }
            // The state etcd holds names B as the one refreshing.
            #expect(try await Self.stored(cluster).flight?.holder.hasPrefix("b pid ") == true)

            // Host A logs out (it has no coordinator: nothing tells B's flight locally).
            #expect(try await hostA.write(Self.logout(1)))
            upstream.release()
            await #expect(throws: FetchFailure.self) { try await flight.value }
            #expect(discarded.withLock { $0 } == ["refresh-1"], "the uncommitted answer was not handed back for revocation")
            let state = try await Self.stored(cluster)
            #expect(state.position.generation > loggedIn && state.phase == .signedOut && state.refreshToken == nil && state.flight == nil,
                    "\(state.position)")
        } catch {
            await cluster.stop()
            throw error
        }
        await cluster.stop()
    }

    @Test("a state sealed under another fleet key is refused, not served: the fleet's state counts as untrusted, nothing is fetched, counted once")
    func wrongKey() async throws {
        let cluster = try await EtcdCluster(members: 3, answers: etcdAnswers)
        do {
            let hostA = try Self.session(cluster, member: "a", upstream: GatedSource())
            #expect(try await hostA.write(Self.login(1, refreshToken: "refresh-0")))
            let settings = FleetSettings(endpoints: cluster.clientURLs, prefix: "/t", key: SecretBytes(Array(String(repeating: "cd", count: 32).utf8)),
                                         flightLease: .seconds(6), requestTimeout: .seconds(1), member: "x")
            let upstream = GatedSource()
            let stranger = try Self.session(settings, upstream: upstream)
            // Its refreshes find nothing it can open.
            for _ in 0..<2 {
                await #expect(throws: FetchFailure.self) { try await stranger.fetch(FetchRequest(session: "api", generation: 0, refreshToken: nil)) }
            }
            guard case let .untrusted(why) = stranger.status.health else {
                Issue.record("health is \(stranger.status.health)")
                return
            }
            #expect(why.contains("does not open with the fleet key"), "\(why)")
            #expect(stranger.status.counters.refusedValues == 1, "the same refused write was counted \(stranger.status.counters.refusedValues) times")
            #expect(upstream.calls == 0)
            #expect(try await Self.stored(cluster).phase == .active)
        } catch {
            await cluster.stop()
            throw error
        }
        await cluster.stop()
    }

    @Test("answers lost after etcd applied the request (then sent again to the next member): a login bumps the generation once, the flight taken is recognised as ours, the refresh is committed once and returned")
    func lostAnswers() async throws {
        let cluster = try await EtcdCluster(members: 3, answers: etcdAnswers)
        let port = try #require(Int(cluster.clientURLs[0].split(separator: ":").last ?? ""))
        let proxy = try AnswerDroppingProxy(forwardingTo: port)
        do {
            let upstream = GatedSource()
            upstream.release()
            var settings = FleetSettings(endpoints: ["http://127.0.0.1:\(proxy.port)", cluster.clientURLs[0]], prefix: "/t", key: Self.key,
                                         flightLease: .seconds(6), requestTimeout: .seconds(1), member: "b")
            settings.requestTimeout = .seconds(2)
            let host = try Self.session(settings, upstream: upstream)
            #expect(try await host.write(Self.login(1, refreshToken: "refresh-0")))
            // (The first login creates the key, with no token, then logs in: two writes of the key.)
            #expect(try await Self.storedRecord(cluster).version == 2, "one login, one generation")
            let login = try await Self.stored(cluster).position
            let fetched = try await host.fetch(FetchRequest(session: "api", generation: 1, refreshToken: nil))
            #expect(fetched.accessToken.reveal == "access-1" && upstream.calls == 1)
            let state = try await Self.stored(cluster)
            #expect(state.position == FleetPosition(generation: login.generation, serial: 2) && state.accessToken?.reveal == "access-1"
                    && state.refreshToken?.reveal == "refresh-1", "\(state.position)")
            #expect(try await Self.storedRecord(cluster).version == 4, "the flight and the commit, each once")
            #expect(proxy.forwarded >= 4, "the proxy forwarded \(proxy.forwarded) requests")
        } catch {
            proxy.stop()
            await cluster.stop()
            throw error
        }
        proxy.stop()
        await cluster.stop()
    }
}

/// A loopback TCP proxy that hands each request to etcd, waits until etcd starts answering
/// (the request has been applied), then drops the connection: an answer lost on the way back.
final class AnswerDroppingProxy: Sendable {
    private let listener: LoopbackListener
    private let count: Locked<Int>

    var port: Int { listener.port }
    var forwarded: Int { count.value }

    init(forwardingTo target: Int) throws {
        let count = Locked(0)
        self.count = count
        listener = try LoopbackListener(backlog: 16) { client in Self.relay(client, to: target, count: count) }
    }

    func stop() { listener.stop() }

    private static func relay(_ client: Int32, to target: Int, count: Locked<Int>) {
        defer { close(client) }
        guard let (_, request) = LoopbackTCP.readRequest(client) else { return }
        let upstream = LoopbackTCP.connect(target)
        guard upstream >= 0 else { return }
        defer { close(upstream) }
        var buffer = [UInt8](repeating: 0, count: 1)
        guard request.withUnsafeBytes({ write(upstream, $0.baseAddress, $0.count) }) == request.count else { return }
        // The first byte of the answer: etcd has done it. The client never hears.
        guard read(upstream, &buffer, 1) == 1 else { return }
        count.withLock { $0 += 1 }
        var linger = linger(l_onoff: 1, l_linger: 0)
        setsockopt(client, SOL_SOCKET, SO_LINGER, &linger, socklen_t(MemoryLayout<linger>.size))
    }
}
