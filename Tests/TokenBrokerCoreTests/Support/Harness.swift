import TokenBrokerCore

/// A coordinator for session `api` with a fake source, a gated in-memory store and a manual
/// clock. By default it starts logged in at generation 1 with token #1 (`access-1`, refresh
/// token `refresh-1`), valid for `expiresIn` seconds.
struct Harness {
    static let session = "api"
    static let firstToken = Secret("access-1")

    let clock = ManualClock()
    let source = FakeTokenSource()
    let store: GatedStore
    let coordinator: RefreshCoordinator<ManualClock>

    /// Answers the coordinator discarded (their access token values), in order.
    let discarded = DiscardLog()

    init(policy: RefreshPolicy = RefreshPolicy(), loggedIn: Bool = true, expiresIn: Int64 = 3600) {
        let record = SessionRecord(name: Self.session, generation: 1, state: .active, refreshToken: Secret("refresh-1"),
                                   accessToken: Self.firstToken, expiresAt: Int64(clock.unixStart) + expiresIn,
                                   lastRefresh: Int64(clock.unixStart), tokenSerial: 1)
        let restored = loggedIn ? record : nil
        store = GatedStore(restored.map { [$0] } ?? [])
        coordinator = RefreshCoordinator(session: Self.session, policy: policy, source: source, store: store,
                                         restored: restored, clock: clock, wall: clock, randomUnit: { 0 },
                                         discarded: { [discarded] in discarded.append($0.accessToken) })
    }

    /// What the store holds for the session now.
    func stored() async -> SessionRecord? {
        await store.inner.load(Self.session)
    }
}

import Synchronization

final class DiscardLog: Sendable {
    private let tokens = Mutex<[Secret]>([])
    func append(_ token: Secret) { tokens.withLock { $0.append(token) } }
    var all: [Secret] { tokens.withLock { $0 } }
}
