#if canImport(Glibc)
import Glibc
#endif
import Basics
import Sealing
import Synchronization
import TokenBrokerCore

/// One session shared by the brokers of a fleet, through etcd: the coordinator's token source
/// and store, below it. (`FleetSync`, above it, follows the fleet into the coordinator.)
///
/// etcd holds one key per session, `<prefix>/sessions/<name>/state`, sealed with the fleet key
/// (`FleetCodec`): the session's state and tokens at a position of its history
/// (`FleetPosition`), who refreshes from it now (a claim of `FlightLease=`), and the backoff
/// after a failed refresh. Every login or logout anywhere starts a generation, every other write
/// adds a serial, each in a transaction that compares the key's revision: one history, moving
/// forward, and every fact a broker acts on in the one value nobody without the key can write.
///
/// The decisions are `FleetStateMachine`'s; this actor does the I/O they call for and re-asks
/// the machine after every `await`. As a **source** (`fetch`) it delivers another broker's
/// newer token, waits for another broker's flight, or takes the flight, redeems the refresh
/// token upstream, and commits the new state before anyone sees it. As a **store** (`write`)
/// it publishes this host's logins and logouts to the fleet first, and keeps this host's copy,
/// with the highest position it has reached (its mark, so that no restart or reload goes
/// back). Its watch (`watch`) reads the keys into a mirror; `FleetSync` applies what other
/// brokers did from there.
public actor FleetSession<C: Clock>: TokenSource, SessionStore where C.Duration == Duration {
    public enum Health: Sendable, Equatable {
        case starting
        case healthy
        /// etcd cannot be reached or has no quorum.
        case unavailable(String)
        /// etcd holds a state value that is not taken (written without the fleet key, altered,
        /// written back), or older history than this broker has seen, or an earlier version's
        /// layout: served from what this broker has, nothing refreshed.
        case untrusted(String)
    }

    /// What `Status` shows of the fleet.
    public struct Status: Sendable, Equatable {
        public var health: Health
        /// The etcd revision of the last read or watch event.
        public var revision: Int64
        public var generation: Int64?
        /// The highest position this broker has reached.
        public var position: FleetPosition
        /// The member holding the session's flight, if one does.
        public var flightHolder: String?
        public var counters: FleetCounters
    }

    public nonisolated let name: String
    public nonisolated let settings: FleetSettings
    let backend: any FleetBackend
    let codec: FleetCodec
    let keys: FleetKeys
    let upstream: any TokenSource
    let local: any FleetLocalStore
    let wall: any WallClock
    nonisolated let clock: C
    /// This broker's flight name: member, pid and a random tag.
    let holder: String
    /// Answers the fleet could not take (revoked upstream, best effort).
    let discarded: @Sendable (FetchedToken) -> Void
    let report: @Sendable (FleetEvent) -> Void
    let pendingLogoutFile: String?

    var machine: FleetStateMachine
    /// The token the coordinator hands out now (`FleetSync` gives it): what a refresh plan
    /// compares the fleet's with. The one thing this source reads of the coordinator above it.
    var heldToken: @Sendable () -> Secret? = { nil }
    /// The coordinator is being retired: a flight that waits for another broker's gives up.
    var stopping = false
    var synced = false
    /// The keys as last read and watched (the watch callback writes here, on the HTTP thread).
    nonisolated let mirror = Mutex(FleetMirror())
    nonisolated let changes: ChangeSignal<C>
    private nonisolated let shown: Mutex<Status>
    /// Orders this host's boundaries against the application of the fleet's.
    let serializer = AsyncSerializer()
    /// The session's monotonic time starts here (`now`).
    nonisolated let epoch: C.Instant
    /// A refresh this broker redeemed upstream but could not commit: the issuer has rotated,
    /// so it is committed as soon as etcd lets it, before anything else is tried. Kept in the
    /// state database too (`keep`), so that no stop, reload or restart loses it.
    var pendingCommit: PendingCommit?

    struct PendingCommit: Sendable {
        var next: FleetState
        var fetched: FetchedToken
        var over: FleetPlace
        var generation: Int
        /// `next` sealed for the write after `over` (nil: not sealed yet).
        var sealed: [UInt8]?
    }

    /// - Parameters:
    ///   - floor: the mark `local` holds for this session (the highest position reached before).
    ///   - pending: the refresh `local` keeps for a commit, from before a stop or reload.
    ///   - pendingLogoutFile: where a logout that could not reach etcd is remembered until it
    ///     does, across restarts (`nil`: in memory only).
    public init(name: String, settings: FleetSettings, backend: any FleetBackend, upstream: any TokenSource, local: any FleetLocalStore,
                floor: FleetPosition?, pending: FleetPendingCommit? = nil, clock: C, wall: any WallClock, pendingLogoutFile: String? = nil,
                discarded: @escaping @Sendable (FetchedToken) -> Void = { _ in },
                report: @escaping @Sendable (FleetEvent) -> Void = { _ in }) throws(TokenCipher.Failure) {
        self.name = name
        self.settings = settings
        self.backend = backend
        keys = FleetKeys(prefix: settings.prefix, session: name)
        codec = FleetCodec(cipher: try TokenCipher(keyMaterial: settings.key.reveal,
                                                   name: "fleet key"), keys: keys)
        self.upstream = upstream
        self.local = local
        self.clock = clock
        self.wall = wall
        self.discarded = discarded
        self.report = report
        self.pendingLogoutFile = pendingLogoutFile
        changes = ChangeSignal(clock: clock)
        epoch = clock.now
        var random = [UInt8](repeating: 0, count: 4)
        for index in random.indices { random[index] = UInt8.random(in: 0...255) }
        holder = "\(settings.member) pid \(getpid()) \(random.map { String($0, radix: 16) }.joined())"
        var machine = FleetStateMachine(session: name, floor: floor)
        if let pendingLogoutFile, let text = PendingLogoutFile.read(pendingLogoutFile) {
            // "<prefix> <generation or ->": a logout of this session under that prefix.
            if let space = text.lastIndex(of: " "), text[..<space] == settings.prefix {
                machine.pendingLogout = .some(PendingLogoutFile.generation(text[text.index(after: space)...]))
            } else {
                report(.pendingLogoutIgnored(path: pendingLogoutFile))
            }
        }
        self.machine = machine
        shown = Mutex(Status(health: .starting, revision: 0, position: floor ?? .start, counters: FleetCounters()))
        if let pending { pendingCommit = Self.restore(pending, codec: codec, unixNow: wall.unixTime()) }
    }

    /// A kept commit as it was before the stop: the state it writes, over the claim it was sealed for.
    private static func restore(_ kept: FleetPendingCommit, codec: FleetCodec, unixNow: Double) -> PendingCommit? {
        let place = EtcdKeyValue(key: codec.keys.state, value: kept.placeValue, createRevision: kept.createRevision,
                                 modRevision: kept.modRevision, version: kept.version, lease: 0)
        let written = EtcdKeyValue(key: codec.keys.state, value: kept.value, createRevision: kept.createRevision, modRevision: 0,
                                   version: kept.version + 1, lease: 0)
        guard let next = try? codec.openState(written, unixNow: unixNow).get(), let token = FleetStateMachine.usable(next, unixNow: unixNow)
              ?? next.accessToken.map({ FetchedToken(accessToken: $0, tokenType: next.tokenType, refreshToken: next.refreshToken) }) else { return nil }
        return PendingCommit(next: next, fetched: token, over: FleetPlace(record: place), generation: kept.generation, sealed: kept.value)
    }

    /// Keeps `pending` (nil: forgets the one kept), in memory and in the state database.
    func keep(_ pending: PendingCommit?) async {
        var pending = pending
        if let unsealed = pending, unsealed.sealed == nil { pending?.sealed = try? codec.seal(unsealed.next, over: unsealed.over.record) }
        pendingCommit = pending
        let kept = pending.flatMap { pending -> FleetPendingCommit? in
            guard let sealed = pending.sealed, let place = pending.over.record else { return nil }
            return FleetPendingCommit(value: sealed, placeValue: place.value, createRevision: place.createRevision, modRevision: place.modRevision,
                                      version: place.version, generation: pending.generation)
        }
        do {
            try await local.keepPendingCommit(name, kept)
        } catch {
            report(.pendingCommitNotDurable("\(error)"))
        }
    }

    /// Makes a refresh that waits for another broker's flight give up at once (the coordinator
    /// is retiring: its flight must land soon, and has nothing of its own to commit). A flight
    /// this broker holds goes on to its commit.
    public func stopWaiting() {
        stopping = true
        changes.signal()
    }

    /// Waits until the first read of the fleet has been applied, or has failed, or `limit`.
    public func firstSync(within limit: Duration) async {
        let deadline = clock.now.advanced(by: limit)
        while !synced, clock.now < deadline {
            let version = changes.version
            if synced { return }
            await changes.wait(after: version, upTo: clock.now.duration(to: deadline))
        }
    }

    public nonisolated var status: Status { shown.withLock { $0 } }

    /// The session's monotonic time.
    nonisolated func now() -> Duration { epoch.duration(to: clock.now) }

    // MARK: - Shared steps

    /// Reads the session's keys into the mirror and returns the view of them; records an
    /// unreachable etcd in the machine's health. (The fleet's watch reads every session's keys
    /// in one read of the prefix; a session reads its own when it must decide now.)
    func readView() async throws(EtcdError) -> FleetView {
        try await readViewAndVersion().view
    }

    /// As `readView`, with the change version the view is at: a caller that waits for the next
    /// change waits after it (never for its own read, never past a change the view lacks: the
    /// view is taken after the version, and every change is applied before it is signalled).
    func readViewAndVersion() async throws(EtcdError) -> (view: FleetView, version: UInt64) {
        do {
            let before = mirror.withLock { $0.revision }
            let (record, revision) = try await backend.get(keys.state)
            // Only when there is no state: is the session kept as an earlier version kept it?
            let earlier = record == nil ? try await backend.get(keys.earlierRecord).record != nil : false
            took(record, earlierLayout: earlier, revision: revision, before: before)
            let version = changes.version
            return (currentView(), version)
        } catch where error.kind == .cancelled {
            throw error   // nothing learnt about etcd
        } catch {
            unreachable(error.message)
            throw error
        }
    }

    /// Takes a read of the session's keys at `revision` (its own, or the fleet watch's of the
    /// prefix) into the mirror; `before`: the mirror's revision when the read was sent.
    func took(_ record: EtcdKeyValue?, earlierLayout earlier: Bool, revision: Int64, before: Int64) {
        let wasUnreachable = machine.isUnreachable
        machine.reached()
        let changed = mirror.withLock { mirror -> Bool in
            // The watch brought something newer while this read was out: the read is stale.
            // (An older read is taken only when nothing came meanwhile: etcd went back.)
            if mirror.loaded, revision < mirror.revision, mirror.revision != before { return false }
            let previous = (mirror.loaded, mirror.state, mirror.earlierLayout)
            mirror.reset(record, revision: revision, earlierLayout: earlier)
            return !previous.0 || previous.1 != record || previous.2 != mirror.earlierLayout
        }
        if wasUnreachable { settle() }
        if changed || wasUnreachable { changes.signal() }
    }

    /// etcd did not answer a read: the health says so, and `firstSync` returns.
    func unreachable(_ why: String) {
        machine.unavailable(why)
        settle()
        markSynced()
        changes.signal()   // the sync loop learns the health
    }

    /// What became of one write of the state key.
    struct Put: Sendable {
        /// The key holds our value: the write applied now, or before (its answer lost, the
        /// request sent again).
        var took: Bool
        /// What the key holds after the transaction (read back in it; nil: nothing, or an
        /// answer without it).
        var record: EtcdKeyValue?
        /// The revision of etcd's answer.
        var revision: Int64
    }

    /// Writes `sealed` over the state at `place`, in one transaction that compares its revision
    /// and value and reads the key back whichever branch runs. A write that took is in the
    /// mirror before this returns, ahead of its watch event: the machine counts a position this
    /// broker wrote as reached only after this, so no view of the mirror is older than it (a
    /// broker's own write never looks like a rollback to it).
    nonisolated func putState(_ sealed: [UInt8], over place: FleetPlace) async throws(EtcdError) -> Put {
        let done = try await backend.transaction(place.compare(keys.state),
                                                 success: [.put(key: keys.state, value: sealed, lease: 0), .get(key: keys.state)],
                                                 failure: [.get(key: keys.state)])
        let record = done.reads.first ?? nil
        let took = done.succeeded || (record != nil && record?.value == sealed)
        if took, let record, record.value == sealed, mirror.withLock({ $0.wrote(record) }) { changes.signal() }
        return Put(took: took, record: record, revision: done.revision)
    }

    /// The view of the mirror as it stands.
    func currentView() -> FleetView {
        codec.view(of: mirror.withLock { $0 }, unixNow: wall.unixTime())
    }

    /// After a step of the machine: its events to the log, its state to `status`.
    func settle(_ view: FleetView? = nil) {
        for event in machine.drainEvents() { report(event) }
        let health: Health
        switch machine.health {
        case .starting: health = .starting
        case .healthy: health = .healthy
        case let .unavailable(why): health = .unavailable(why)
        case .untrusted, .rolledBack, .earlierLayout: health = .untrusted(FleetStateMachine.describe(machine.health).replacingPrefix("fleet: "))
        }
        let revision = mirror.withLock { $0.revision }
        shown.withLock { status in
            status.health = health
            status.revision = max(status.revision, revision)
            status.position = machine.floor
            status.generation = machine.bound?.generation.generation ?? view?.validState?.position.generation ?? status.generation
            status.counters = machine.counters
            if let view { status.flightHolder = machine.holder(in: view, now: now()) }
        }
    }

    func countWatchRestart() {
        machine.countWatchRestart()
        settle()
    }

    /// The first read has been applied (or has failed): `firstSync` returns.
    func markSynced() {
        guard !synced else { return }
        synced = true
        changes.signal()
    }
}

extension String {
    fileprivate func replacingPrefix(_ prefix: String) -> String {
        hasPrefix(prefix) ? String(dropFirst(prefix.count)) : self
    }
}
