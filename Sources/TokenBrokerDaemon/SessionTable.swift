import DPoP
import Fleet
import Synchronization
import TokenBrokerCore
import Upstream
import Varlink

typealias Coordinator = RefreshCoordinator<ContinuousClock>
typealias DaemonFleetSession = FleetSession<ContinuousClock>
typealias DaemonFleetSync = FleetSync<ContinuousClock>
typealias DaemonFleetWatch = FleetWatch<ContinuousClock>

/// The sessions the daemon serves, swapped as a whole on reload.
final class SessionTable: Sendable {
    /// One served session. A class: the hot path looks one up per call, and copies a reference
    /// rather than the whole configuration.
    final class Session: Sendable {
        let configuration: SessionConfiguration
        let coordinator: Coordinator
        /// The coordinator's place in the daemon's census.
        let slot: SessionCensus.Slot
        /// The session's account at its authorization server, if it has one (for logins,
        /// revocation, discovery, DPoP keys).
        let account: (any UpstreamAccount)?
        /// The GetToken reply for the current token, encoded once.
        let replies = TokenReplyCache()
        /// The session's Status entry, encoded once per change of its status.
        let statusEntry = EncodedCache()
        /// A session shared with a fleet (`Fleet=yes`): what follows the fleet into the
        /// coordinator, and the task doing so (in the factory's pool of follow loops).
        let fleetSync: DaemonFleetSync?
        private let following: Task<Void, Never>?
        /// Its etcd side, the coordinator's source and store.
        var fleet: DaemonFleetSession? { fleetSync?.session }
        /// The keys its callers narrow its token to (`AllowResources=`, `AllowScopes=`).
        let keys: DerivedKeys?

        /// Its coordinator's identity in the audit trail (kept by `reconfigured`, which keeps the
        /// coordinator).
        let auditID: UInt64
        /// Its `AllowUsers=` and `AllowGroups=`, read on every call (from the configuration, the
        /// whole session's settings were copied to read them).
        let allowUsers: [UInt32]
        let allowGroups: [UInt32]

        init(configuration: SessionConfiguration, coordinator: Coordinator, slot: SessionCensus.Slot, account: (any UpstreamAccount)? = nil,
             fleet: (sync: DaemonFleetSync, following: Task<Void, Never>?)? = nil, keys: DerivedKeys? = nil, auditID: UInt64? = nil) {
            self.auditID = auditID ?? Audit.nextIssuer()
            self.keys = keys
            kind = SessionFactory.kind(of: configuration)
            self.configuration = configuration
            (allowUsers, allowGroups) = (configuration.allowUsers, configuration.allowGroups)
            self.coordinator = coordinator
            self.slot = slot
            self.account = account
            self.fleetSync = fleet?.sync
            self.following = fleet?.following
        }

        /// What kind of session it is, and so what it offers (`SessionKind`): chosen once.
        let kind: any SessionKind

        /// The same served session under a configuration whose changes keep the coordinator.
        func reconfigured(_ configuration: SessionConfiguration) -> Session {
            Session(configuration: configuration, coordinator: coordinator, slot: slot, account: account,
                    fleet: fleetSync.map { ($0, following) }, keys: keys, auditID: auditID)
        }

        /// Stops following the fleet (the coordinator is retired or handed over), and returns
        /// once its loops have ended: before the HTTP loop stops, so that nothing they still
        /// had in flight fails for want of it.
        func stopFollowing() async {
            following?.cancel()
            await following?.value
        }
    }

    struct Snapshot: Sendable {
        var sessions: [String: Session] = [:]
        /// Configuration order, for Status.
        var order: [String] = []
        var access: Access
        /// Stored sessions no longer configured.
        var inert: [InertSession] = []
        /// Which sessions serve which hosts (`Serves=`), for `Credential`.
        var serving = ServingIndex()
        /// The sessions derived from each parent (`DerivedFrom=`), in configuration order.
        var derived: [String: [String]] = [:]
    }

    private let state: Mutex<Snapshot>
    /// Logouts, logins and forgets pass it shared; a reload's hand-over holds it alone.
    let gate = BoundaryGate()

    init(access: Access) {
        state = Mutex(Snapshot(access: access))
    }

    var snapshot: Snapshot { state.withLock { $0 } }

    func replace(_ snapshot: Snapshot) {
        state.withLock { $0 = snapshot }
        announceChange()
    }

    /// Changes the snapshot in place (no lost update between concurrent changes).
    func modify(_ change: (inout Snapshot) -> Void) {
        state.withLock { change(&$0) }
        announceChange()
    }

    /// One element after each change of the table (for streams that must re-check access).
    func changes() -> AsyncStream<Void> {
        let (stream, continuation) = AsyncStream.makeStream(of: Void.self, bufferingPolicy: .bufferingNewest(1))
        let id = listeners.withLock { listeners in
            listeners.next += 1
            listeners.all[listeners.next] = continuation
            return listeners.next
        }
        continuation.onTermination = { [weak self] _ in _ = self?.listeners.withLock { $0.all.removeValue(forKey: id) } }
        return stream
    }

    private let listeners = Mutex<(next: UInt64, all: [UInt64: AsyncStream<Void>.Continuation])>((0, [:]))

    private func announceChange() {
        for continuation in listeners.withLock({ Array($0.all.values) }) { continuation.yield() }
    }

    /// The session and whether `peer` may use it.
    func lookup(_ name: String, for peer: PeerCredentials) -> (Session, allowed: Bool)? {
        state.withLock { state in
            state.sessions[name].map { ($0, state.access.mayUse(allowUsers: $0.allowUsers, allowGroups: $0.allowGroups, peer)) }
        }
    }

    /// The session that serves `url` for `peer`: the most specific `Serves=` entry among the
    /// sessions `peer` may use (the first configured on a tie). Another user's session is
    /// never an answer, nor a hint.
    ///
    /// (On a copy of the snapshot, outside the lock: a host many sessions serve costs its
    /// caller, not the lookups of others.)
    /// (`within`: a delegation's sessions, the only ones its peers may use.)
    func serving(_ url: ServedURL, for peer: PeerCredentials, within delegated: Set<String>? = nil) -> Session? {
        serving(url, for: peer, within: delegated, most: .max).session
    }

    /// What `serving` finds, unless more than `most` entries serve the URL's host: then
    /// `tooMany`, and nothing was looked at.
    func serving(_ url: ServedURL, for peer: PeerCredentials, within delegated: Set<String>? = nil, most: Int) -> (session: Session?, tooMany: Bool) {
        let state = snapshot
        let candidates = state.serving.candidates(url.host)
        guard candidates.count <= most else { return (nil, true) }
        var best: (session: Session, specificity: Int)?
        for candidate in candidates {
            guard let specificity = candidate.entry.specificity(for: url), specificity > (best?.specificity ?? -1),
                  let session = state.sessions[candidate.session],
                  delegated.map({ $0.contains(candidate.session) }) ?? state.access.mayUse(session.configuration, peer) else { continue }
            best = (session, specificity)
        }
        return (best?.session, false)
    }

    func isAdmin(_ peer: PeerCredentials) -> Bool {
        state.withLock { $0.access.isAdmin(peer) }
    }
}

/// The GetToken reply for a session's current token, built and encoded once: every caller gets
/// the same bytes until the token changes. Holds nothing the coordinator does not already hold,
/// and lets go of it at the first call that finds no fresh token (after a logout, say).
final class TokenReplyCache: Sendable {
    /// (A reference: a hit costs a retain, where a tuple was copied member by member.)
    final class Entry: Sendable {
        let token: IssuedToken
        let reply: VarlinkReply
        /// A DPoP token's hash, base64url, as its proofs' `ath` claim has it (hashed once per
        /// token, not once per proof).
        let proofHash: String?

        init(token: IssuedToken, reply: VarlinkReply) {
            (self.token, self.reply) = (token, reply)
            proofHash = token.tokenType == "DPoP" ? DPoPProof.accessTokenHash(token.token.reveal) : nil
        }
    }

    private let cached = Mutex<Entry?>(nil)

    /// The reply for `token` (any field different, the token's value included, is a new reply).
    func reply(for token: IssuedToken, _ make: (IssuedToken) -> VarlinkReply) -> VarlinkReply {
        entry(for: token, make).reply
    }

    /// The reply for `token`, with what proofs for it need.
    func entry(for token: IssuedToken, _ make: (IssuedToken) -> VarlinkReply) -> Entry {
        if let entry = cached.withLock({ $0 }), entry.token == token { return entry }
        let entry = Entry(token: token, reply: make(token).preencoded())
        cached.withLock { $0 = entry }
        return entry
    }

    func clear() {
        cached.withLock { $0 = nil }
    }
}

/// Bytes made of a value that changes rarely, kept with the version they were made from.
final class EncodedCache: Sendable {
    private let cached = Mutex<(version: UInt64, bytes: [UInt8])?>(nil)

    /// The bytes for `version`, made by `make` unless those kept are of that version.
    func bytes(version: UInt64, _ make: () -> [UInt8]) -> [UInt8] {
        if let hit = cached.withLock({ $0.flatMap { $0.version == version ? $0.bytes : nil } }) { return hit }
        let bytes = make()
        cached.withLock { $0 = (version, bytes) }
        return bytes
    }
}

/// `Serves=` entries by host, in configuration order.
struct ServingIndex: Sendable {
    private var byHost: [String: [(entry: ServedURL, session: String)]] = [:]

    init() {}

    init(_ sessions: [SessionConfiguration]) {
        for session in sessions {
            for entry in session.settings.serves { byHost[entry.host, default: []].append((entry, session.name)) }
        }
    }

    func candidates(_ host: String) -> [(entry: ServedURL, session: String)] { byHost[host] ?? [] }
}
