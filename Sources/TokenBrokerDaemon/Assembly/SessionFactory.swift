import Basics
import BrokerContract
import Fleet
import TokenBrokerCore
import Upstream

/// Turns a configured session into a served one: its token source (chosen by its kind, one
/// case below), its store, its coordinator and, for `Fleet=yes`, its fleet part. A new grant
/// or upstream kind is one case in `kind(of:)` and a `SessionKind` in a file of its own.
struct SessionFactory: Sendable {
    let logger: Logger
    let metrics: Metrics
    let state: StateStore
    let census: SessionCensus
    /// The sessions served, for a derived session's parent (looked up when it is needed: a
    /// reload may have rebuilt the parent).
    let sessions: SessionTable
    /// Token requests that outlive their callers (a logout overtook them): bounded, awaited at stop.
    let transfers: TaskPool
    /// Work that outlives its caller (revocations of refresh tokens nobody will use among it):
    /// bounded, awaited at stop.
    let outliving: TaskPool
    /// The fleet sessions' follow loops: awaited at stop.
    let followLoops: TaskPool
    /// The broker's watches of its fleets' prefixes, one per etcd and prefix (its sessions join
    /// and leave it; its loop runs among `followLoops` while one is joined).
    let fleetWatches = SynchronizedBox<(held: Bool, watches: [(settings: FleetSettings, watch: DaemonFleetWatch)])>((false, []))
    /// Fleet marks and kept commits of sessions without a state database (development mode).
    let fleetMarks = SynchronizedBox<[String: FleetPosition]>([:])
    let fleetPending = SynchronizedBox<[String: FleetPendingCommit]>([:])
    /// The client keys the daemon holds for `private_key_jwt` sessions.
    let clientKeys: ClientKeys

    /// The one place that chooses a session's kind.
    static func kind(of session: SessionConfiguration) -> any SessionKind {
        switch session.upstream {
        case let .test(lifetime):
            return TestUpstream(lifetime: lifetime)
        case let .oauth(settings):
            switch settings.grant {
            case .refreshToken: return RefreshTokenGrant(settings: settings)
            case .clientCredentials: return ClientCredentialsGrant(settings: settings)
            case .jwtBearer: return JWTBearerGrant(settings: settings)
            }
        case let .derived(settings):
            return DerivedSession(settings: settings)
        }
    }

    /// What a new coordinator starts from.
    enum Origin {
        /// What the store holds (read once for all sessions at start, one by one at a reload).
        case stored(SessionRecord?)
        /// A predecessor's whole state (a reload that changes the session's settings).
        case handedOver(record: SessionRecord, pendingWrite: StoreWrite?, counters: SessionCounters)
    }

    /// A served session, and whether it still has to log in (a kind that starts logged in,
    /// with nothing stored): the caller does that, many sessions at once.
    func make(_ session: SessionConfiguration, from origin: Origin) async -> (session: SessionTable.Session, logIn: Bool) {
        var restored: SessionRecord?
        var handedOver: (pendingWrite: StoreWrite?, counters: SessionCounters)?
        switch origin {
        case let .handedOver(record, pendingWrite, counters):
            restored = record
            handedOver = (pendingWrite, counters)
        case let .stored(record):
            restored = record
            if session.fleet != nil, restored?.state == .active {
                // The fleet decides: until its state has been read, this host's copy (from before
                // a restart, during which the fleet may have logged out) hands out nothing.
                restored?.state = .signedOut
                restored?.refreshToken = nil
                restored?.accessToken = nil
            }
        }
        let kind = Self.kind(of: session)
        if kind.parent != nil, restored?.state == .active {
            // What a derived session held was derived under a parent's generation that may have
            // ended meanwhile, or under other settings: nothing of it is served.
            // (`DerivedSessions.reconcile` logs it in anew when its parent is logged in.)
            restored?.state = .signedOut
            restored?.refreshToken = nil
            restored?.accessToken = nil
        }
        let (source, account) = kind.source(for: session, in: self)
        let fleet = session.fleet == nil ? nil : await fleetPart(session, source: source, account: account)
        let slot = census.enrol(session.name)
        let coordinator = Coordinator(session: session.name, policy: session.policy, source: fleet ?? source,
                                      store: fleet ?? MeasuredStore(inner: state.sessions, metrics: metrics), restored: restored,
                                      pendingWrite: handedOver?.pendingWrite, counters: handedOver?.counters ?? SessionCounters(),
                                      clock: ContinuousClock(), wall: SystemWallClock(),
                                      discarded: discardedTokenRevocation(session, account),
                                      outcomes: { [log = RefreshLog(logger: logger, policy: session.policy), metrics] outcome in
                                          log.record(outcome)
                                          metrics.record(outcome)
                                      },
                                      summaries: { [census] summary in census.tell(slot, summary) },
                                      boundaries: { [sessions, logger] boundary in
                                          await DerivedSessions.follow(session.name, boundary, in: sessions, logger: logger)
                                      })
        census.begin(slot, coordinator.summary)
        if fleet != nil, let account,
           let revocation = abandonedRequestRevocation(session, account, fleetGeneration: { coordinator.statusSnapshot().generation }) {
            account.whenAbandoned(revocation)
        }
        if let fleet {
            // The sync loop's first read of etcd logs the session in or out here as the fleet has it.
            let sync = await DaemonFleetSync(session: fleet, coordinator: coordinator, watch: fleetWatch(fleet.settings))
            let following = followLoops.spawn { await sync.run() }
            if following == nil { logger.error("session \(session.name): the daemon is stopping; it does not follow the fleet", session: session.name) }
            logger.log(.info, "session \(session.name): shared with the fleet (\(fleet.settings.prefix) on \(fleet.settings.endpoints.count) "
                       + "etcd endpoint(s)); it follows the fleet's state", session: session.name)
            return (SessionTable.Session(configuration: session, coordinator: coordinator, slot: slot, account: account,
                                         fleet: (sync, following)), false)
        }
        if let restored {
            if logger.enabled(.info) {
                logger.log(.info, "session \(session.name): restored \(restored.state.rawValue) at generation \(restored.generation)"
                           + (restored.accessToken == nil ? "" : ", token #\(restored.tokenSerial)"),
                           session: session.name, generation: restored.generation,
                           tokenSerial: restored.accessToken == nil ? nil : restored.tokenSerial)
            }
            return (SessionTable.Session(configuration: session, coordinator: coordinator, slot: slot, account: account, keys: keys(of: session, coordinator: coordinator)), false)
        }
        return (SessionTable.Session(configuration: session, coordinator: coordinator, slot: slot, account: account, keys: keys(of: session, coordinator: coordinator)),
                kind.logsInAtStart)
    }

    /// The keys callers may narrow `session`'s token to (`AllowResources=`, `AllowScopes=`), or
    /// nil when it allows none.
    func keys(of session: SessionConfiguration, coordinator: Coordinator) -> DerivedKeys? {
        let settings = session.settings
        guard !settings.allowResources.isEmpty || !settings.allowScopes.isEmpty, case let .oauth(oauth) = session.upstream else { return nil }
        return DerivedKeys(limit: settings.maxKeys, allowResources: settings.allowResources, allowScopes: settings.allowScopes,
                           creations: max(settings.maxKeys, settings.policy.guardLimit), window: settings.policy.guardWindow,
                           make: { [self] key, serial in makeKey(key, serial, of: session, oauth, proofKey: coordinator.proofKey) },
                           stop: { [self] in stopKeys($0) })
    }

    /// A key's session: a derived session of `parent`, active from the start with nothing
    /// fetched, its state in memory only. Its replies name the parent (the session its callers
    /// asked for); its coordinator is `<parent>~<serial>` in the journal.
    private func makeKey(_ key: TokenKey, _ serial: Int, of parent: SessionConfiguration, _ oauth: SessionConfiguration.OAuthSettings,
                         proofKey: Secret?)
        -> SessionTable.Session {
        let name = "\(parent.name)~\(serial)"
        let derived = SessionConfiguration.DerivedSettings(parent: parent.name, method: parent.settings.keyDerivation, audiences: [],
                                                           resources: key.resource.map { [$0] } ?? [], scope: key.scope, oauth: oauth)
        let configuration = SessionConfiguration(name: parent.name, upstream: .derived(derived), allowUsers: parent.allowUsers,
                                                 allowGroups: parent.allowGroups, policy: parent.policy, origin: parent.origin)
        let (source, account) = DerivedSession(settings: derived).source(for: configuration, in: self)
        // (In the census without a summary: the daemon's totals count configured sessions.)
        let slot = census.enrol(name)
        // A DPoP session's key is its generation's too (every boundary drops the keys, so a key
        // never outlives the generation it took the key from).
        let record = SessionRecord(name: name, generation: 1, state: .active, proofKey: proofKey)
        let coordinator = Coordinator(session: name, policy: parent.policy, source: source, store: InMemorySessionStore([record]),
                                      restored: record,
                                      clock: ContinuousClock(), wall: SystemWallClock(),
                                      outcomes: { [log = RefreshLog(logger: logger, policy: parent.policy)] outcome in log.record(outcome) })
        logger.limited(.info, key: parent.name + ":key", "session \(parent.name): key \(name) for" + (key.resource.map { " resource \($0)" } ?? "")
                       + (key.scope.map { " scope \($0)" } ?? ""))
        return SessionTable.Session(configuration: configuration, coordinator: coordinator, slot: slot, account: account)
    }

    /// Keys no longer reachable: out of the census, and stopped (a flight under way is cut
    /// off) in the pool of work that outlives its caller. (Unreachable, a key the pool cannot
    /// take hands out nothing more; its flight ends at its own deadline.)
    private func stopKeys(_ sessions: [SessionTable.Session]) {
        for session in sessions { census.leave(session.slot) }
        _ = outliving.enqueue {
            for session in sessions { await session.coordinator.shutdown() }
        }
    }

    /// The current access token of session `name` (a derived session's subject token): its
    /// coordinator's, valid for a while yet (an exchange must not present one that ends on the
    /// way), through its one flight when it must be refreshed; given the one a server refused,
    /// the next (the parent's Recover: its stale-rejection rule applies). What went wrong says
    /// nothing of the parent's own reasons (a derived session's workers are not the parent's).
    func currentToken(of name: String) -> @Sendable (_ rejected: Secret?) async throws(FetchFailure) -> Secret {
        { [sessions] (rejected: Secret?) async throws(FetchFailure) -> Secret in
            guard let parent = sessions.snapshot.sessions[name] else { throw .transient("the parent session \(name) is not served") }
            do {
                if let rejected { return try await parent.coordinator.recover(rejected: rejected).token }
                do {
                    return try await parent.coordinator.token(validFor: Self.subjectMargin).token
                } catch SessionError.lifetimeTooShort {
                    return try await parent.coordinator.token().token   // tokens that live less than the margin
                }
            } catch let error as SessionError {
                throw await Self.parentFailure(error, of: name)
            } catch {
                throw .transient("the parent session \(name) gives no token now")
            }
        }
    }

    /// A token derived from the refresh token of session `name` (`Derivation=refresh`) by
    /// `via`, in the parent's one lineage (`RefreshCoordinator.derive`); a scope wider than
    /// `scope` refused (after the parent kept the refresh token rotated with it).
    func lineage(of name: String, via: any TokenSource, scope: String?) -> any TokenSource {
        ParentLineage(parent: name, sessions: sessions, via: via, scope: scope)
    }

    /// What a parent's state means for the session derived from it: its own failure, which
    /// says nothing of the parent's reasons (a derived session's workers are not the parent's).
    /// A parent signed out or ended takes its derived sessions with it (`DerivedSessions.follow`,
    /// before its logout returns): the derived session's flight waits for that boundary, which
    /// cancels it and gives its waiters `SignedOut`, rather than end the derived session on its
    /// own first; only if none comes within `boundaryWait` does the failure end it.
    static func parentFailure(_ error: SessionError, of name: String) async -> FetchFailure {
        switch error {
        case .signedOut:
            try? await Task.sleep(for: boundaryWait)
            return .terminal("the parent session \(name) is signed out: log in to \(name)")
        case let .refreshFailed(_, retryable, retryAfter):
            if retryable { return .transient("the parent session \(name) cannot refresh now", retryAfter: retryAfter) }
            try? await Task.sleep(for: boundaryWait)
            return .terminal("the parent session \(name) has ended: log in to \(name)")
        case let .throttled(retryAfter): return .transient("the parent session \(name) is throttled", retryAfter: retryAfter)
        default: return .transient("the parent session \(name) gives no token now")
        }
    }

    /// How long a derived session's flight waits for its parent's boundary to reach it.
    static let boundaryWait = Duration.seconds(5)

    /// How long a subject token must stay valid when an exchange starts.
    static let subjectMargin = Duration.seconds(30)

    /// The OAuth source of a session, with what becomes of requests its callers abandon.
    func httpSource(_ session: SessionConfiguration, _ settings: SessionConfiguration.OAuthSettings, grant: some TokenGrant) -> HTTPTokenSource {
        var configuration = settings.client.configuration
        if settings.client.authentication == .privateKeyJWT {
            configuration.assertion = clientKeys.source(for: session.settings.derivedFrom ?? session.name, settings)
        }
        let http = HTTPTokenSource(grant: grant, configuration: configuration, endpoints: settings.endpoints,
                                   issuer: settings.issuer, tasks: transfers, dpop: settings.dpop)
        // (A fleet session's handler needs its coordinator: see `make`.)
        if session.fleet == nil, let revocation = abandonedRequestRevocation(session, http) { http.whenAbandoned(revocation) }
        return http
    }

    /// A fleet session's etcd side, from the position this broker has reached in the fleet.
    private func fleetPart(_ session: SessionConfiguration, source: any TokenSource, account: (any UpstreamAccount)?) async -> DaemonFleetSession? {
        guard let settings = session.fleet else { return nil }
        let local = FleetStateStore(state: state, prefix: settings.prefix, metrics: metrics, memory: state.database == nil ? fleetMarks : nil,
                                    pendingMemory: state.database == nil ? fleetPending : nil)
        var floor: FleetPosition?
        var pending: FleetPendingCommit?
        do {
            floor = try await local.mark(session.name)
            pending = try await local.pendingCommit(session.name)
        } catch {
            logger.error("session \(session.name): cannot read the position this broker has reached in the fleet: \(error); "
                         + "until a write succeeds, an older history in etcd would not be recognised", session: session.name)
        }
        do {
            return try DaemonFleetSession(
                name: session.name, settings: settings,
                backend: EtcdClient(endpoints: settings.endpoints, tls: settings.tls, timeout: settings.requestTimeout),
                upstream: source, local: local, floor: floor, pending: pending, clock: ContinuousClock(), wall: SystemWallClock(),
                pendingLogoutFile: state.directory.map { "\($0)/fleet-logout-\(session.name)" },
                discarded: discardedTokenRevocation(session, account), report: fleetReport(session.name))
        } catch {
            // The key was checked when the configuration was read.
            logger.error("session \(session.name): the fleet key cannot be used: \(error)", session: session.name)
            return nil
        }
    }

    /// The watch of the prefix that `settings` name, on their etcd: the one already made, or a
    /// new one (watches of settings no session uses any more are dropped; their loops ended with
    /// their last session).
    private func fleetWatch(_ settings: FleetSettings) -> DaemonFleetWatch {
        fleetWatches.modify { fleet in
            if let found = fleet.watches.first(where: { Self.sameWatch($0.settings, settings) }) { return found.watch }
            fleet.watches.removeAll { $0.watch.sessionCount == 0 }
            let watch = DaemonFleetWatch(backend: EtcdClient(endpoints: settings.endpoints, tls: settings.tls, timeout: settings.requestTimeout),
                                         prefix: settings.prefix, clock: ContinuousClock(), spawn: { [followLoops] in followLoops.spawn($0) })
            if fleet.held { watch.hold() }
            fleet.watches.append((settings, watch))
            return watch
        }
    }

    /// While the daemon starts or reloads its sessions: the fleet sessions made meanwhile read
    /// etcd together at `releaseFleetWatches` (one range read per prefix), not one by one.
    func holdFleetWatches() {
        fleetWatches.modify { fleet in
            fleet.held = true
            for entry in fleet.watches { entry.watch.hold() }
        }
    }

    /// Ends `holdFleetWatches`: the sessions made meanwhile read their prefix now.
    func releaseFleetWatches() async {
        let watches = fleetWatches.modify { fleet -> [DaemonFleetWatch] in
            guard fleet.held else { return [] }
            fleet.held = false
            return fleet.watches.map(\.watch)
        }
        for watch in watches { await watch.release() }
    }

    /// Whether two sessions' fleet settings watch the same keys the same way.
    private static func sameWatch(_ one: FleetSettings, _ other: FleetSettings) -> Bool {
        one.prefix == other.prefix && one.endpoints == other.endpoints && one.tls == other.tls && one.requestTimeout == other.requestTimeout
    }

    /// A fleet session's events, to the journal at their level (the noisy kinds rate-limited).
    private func fleetReport(_ name: String) -> @Sendable (FleetEvent) -> Void {
        let logger = self.logger
        return { event in
            let level: LogLevel
            switch event.level {
            case .error: level = .error
            case .warning: level = .warning
            case .notice: level = .notice
            case .info: level = .info
            }
            if let key = event.limitKey {
                logger.limited(level, key: name + ":" + key, "session \(name): \(event.message)")
            } else {
                logger.log(level, "session \(name): \(event.message)", session: name)
            }
        }
    }
}

/// A derived session's source by `Derivation=refresh`: its parent's coordinator redeems the
/// parent's refresh token through `via` (with the resource and scope), one redemption at a time
/// with the parent's own refreshes; the parent keeps the refresh token, durably, before the
/// derived token comes here.
struct ParentLineage: TokenSource {
    let parent: String
    let sessions: SessionTable
    let via: any TokenSource
    let scope: String?

    func fetch(_ request: FetchRequest) async throws -> FetchedToken {
        guard let coordinator = sessions.snapshot.sessions[parent]?.coordinator else {
            throw FetchFailure.transient("the parent session \(parent) is not served")
        }
        let token: FetchedToken
        do {
            token = try await coordinator.derive(by: via, timeLimit: request.timeLimit)
        } catch let error as SessionError {
            throw await SessionFactory.parentFailure(error, of: parent)
        }
        if RefreshTokenRequest.widens(token.grantedScope, asked: scope) {
            throw FetchFailure.terminal("refresh with resource: the server granted a wider scope than the one asked for")
        }
        return token
    }
}

/// A store whose writes are timed (and failures counted) for the metrics.
struct MeasuredStore: SessionStore {
    let inner: any SessionStore
    let metrics: Metrics

    func load(_ session: String) async throws -> SessionRecord? {
        try await inner.load(session)
    }

    func write(_ write: StoreWrite) async throws -> Bool {
        let started = ContinuousClock.now
        do {
            let applied = try await inner.write(write)
            metrics.storeWrite(seconds: started.duration(to: .now).seconds, failed: false)
            return applied
        } catch {
            metrics.storeWrite(seconds: started.duration(to: .now).seconds, failed: true)
            throw error
        }
    }
}
