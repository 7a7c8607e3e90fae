#if canImport(Glibc)
import Glibc
#endif
import Basics
import BrokerContract
import Dispatch
import Fleet
import Synchronization
import TokenBrokerCLI
import TokenBrokerCore
import Upstream
import Varlink

/// `tokenbroker serve`: loads the configuration, builds one coordinator per session, serves the
/// socket, and handles SIGTERM/SIGINT (graceful stop) and SIGHUP (reload).
public final class Daemon: Sendable {
    public struct Options: Sendable {
        public var configPath = BrokerConfiguration.defaultPath
        /// The configuration path was given explicitly (then it must exist).
        public var configPathGiven = false
        public var socketPath: String?
        public var logLevel = LogLevel.info
        /// Development mode: run the development issuer in this process and serve one logged-in
        /// session, `demo`, against it (the configuration file is not read; state stays in
        /// memory unless `stateDirectory` is given).
        public var dev = false
        /// Makes the development environment (given by the executable, which links it).
        public var makeDevelopment: (@Sendable () throws -> any DevelopmentEnvironment)?
        /// Where the state database lives (`--state-dir`; else `$STATE_DIRECTORY` from systemd's
        /// `StateDirectory=`; else /var/lib/tokenbroker).
        public var stateDirectory: String?
        /// How long in-flight calls may run after SIGTERM before they are cancelled.
        public var drainTimeout: Duration = .seconds(10)

        public init() {}
    }

    static let version = Command.version

    private let options: Options
    private let logger: Logger
    private let table: SessionTable
    /// The configuration in force (for reloads: what changed).
    private let current: SynchronizedBox<BrokerConfiguration>

    private let development: (any DevelopmentEnvironment)?
    private let state: StateStore
    private let metrics = Metrics(version: Daemon.version)
    /// Fleet marks of sessions kept in memory (development mode, no state database).
    private let fleetMarks = SynchronizedBox<[String: FleetPosition]>([:])
    private let fleetPending = SynchronizedBox<[String: FleetPendingCommit]>([:])
    /// The number of open client connections (set once the server exists).
    private let connectionCount = SynchronizedBox<@Sendable () -> Int>({ 0 })

    private init(options: Options, configuration: BrokerConfiguration, logger: Logger, development: (any DevelopmentEnvironment)?, state: StateStore) {
        self.options = options
        self.logger = logger
        self.development = development
        self.state = state
        table = SessionTable(access: Access(daemonUID: getuid(), adminGroup: configuration.adminGroup))
        current = SynchronizedBox(configuration)
    }

    /// Runs the daemon until SIGTERM or SIGINT; returns the exit code.
    public static func run(_ options: Options) async -> Int32 {
        // SIGTERM, SIGINT and SIGHUP have been blocked since the process's first instruction
        // (`TokenBrokerCommand.main`); from here on they are read, and queued until the
        // serving loop takes them: a stop or reload sent while the daemon starts is neither
        // fatal nor lost.
        let signals = Signals.stream()
        let logger = Logger(level: options.logLevel, journal: Systemd.stderrIsJournal())
        // Before any secret is read: a crash must not write tokens, client secrets or the
        // state key into a core file, and no process of the same uid may read this memory.
        if !ProcessDefences.makeUndumpable() { logger.warning("cannot make the process undumpable: \(String(cString: strerror(errno)))") }
        var development: (any DevelopmentEnvironment)?
        if options.dev {
            do {
                guard let make = options.makeDevelopment else { throw DevelopmentUnavailable() }
                development = try make()
            } catch {
                logger.error("cannot start the development issuer: \(error)")
                return ExitCode.failure
            }
        }
        var configuration: BrokerConfiguration
        do {
            configuration = try development?.configuration ?? ConfigLoader.load(path: options.configPath, requireMainFile: options.configPathGiven)
        } catch {
            logger.error("configuration error: \(error)")
            return ExitCode.config
        }
        for warning in configuration.warnings { logger.warning("\(warning)") }
        for warning in ProcessDefences.unmappedIDWarnings(configuration) { logger.warning(warning) }
        if configuration.sessions.isEmpty { logger.warning("no sessions are configured (\(options.configPath))") }
        if let socket = options.socketPath { configuration.socketPath = socket }
        let state: StateStore
        do {
            state = try StateStore.open(options, stateKey: configuration.stateKey, logger: logger)
        } catch {
            logger.error("cannot open the state database: \(error)")
            return ExitCode.failure
        }
        let daemon = Daemon(options: options, configuration: configuration, logger: logger, development: development, state: state)
        return await daemon.serve(configuration, signals: signals)
    }

    private func serve(_ configuration: BrokerConfiguration, signals: AsyncStream<Int32>) async -> Int32 {
        signal(SIGPIPE, SIG_IGN)
        raiseDescriptorLimit(to: configuration.maxConnections + 256)
        await apply(configuration)
        // Fleet sessions read etcd once before the daemon says it is ready (bounded: an
        // unreachable etcd delays the start by its deadlines, then the session waits signed out).
        await withTaskGroup(of: Void.self) { group in
            for session in table.snapshot.sessions.values {
                guard let fleet = session.fleet else { continue }
                group.addTask {
                    await fleet.firstSync(within: fleet.settings.requestTimeout * fleet.settings.endpoints.count + .seconds(1))
                }
            }
        }

        // The socket systemd passed (socket activation), else our own, bound here.
        let socket: (fd: Int32, inode: ino_t?)
        do {
            if let fd = try Systemd.activatedListener() {
                socket = (fd, nil)
                logger.info("using the socket passed by systemd")
            } else {
                let bound = try SocketPath.bind(configuration.socketPath, mode: configuration.socketMode, group: configuration.socketGroup)
                socket = (bound.fd, bound.inode)
            }
        } catch {
            logger.error("cannot listen: \(error)")
            return ExitCode.failure
        }
        let service = BrokerService(sessions: table, logger: logger, reload: { [self] in await self.reload() },
                                    forget: { [self] name in try await self.forget(name) }, metrics: metrics,
                                    metricsText: { [self] in await self.metricsText() })
        let server: VarlinkServer
        do {
            let logger = self.logger
            server = try VarlinkServer(
                listening: socket.fd,
                info: VarlinkServiceInfo(vendor: "tokenbroker", product: "tokenbroker", version: Self.version,
                                         url: "https://github.com/tokenbroker/tokenbroker"),
                interfaces: [BrokerContract.interface], handler: service,
                configuration: VarlinkServerConfiguration(
                    maximumMessageSize: configuration.maxMessageSize,
                    jsonLimits: JSONLimits(maximumMembers: configuration.maxObjectMembers),
                    maximumConnections: configuration.maxConnections,
                    maximumConnectionsPerUser: configuration.maxConnectionsPerUser,
                    // Admins (root, the daemon's user, AdminGroup=) may always reach the daemon.
                    isPrivileged: { [table] peer in table.isAdmin(peer) },
                    messageTimeout: configuration.messageTimeout,
                    maximumQueuedOutput: configuration.maxQueuedOutput,
                    protocolErrorName: BrokerError.protocolErrorName,
                    heartbeat: Systemd.watchdogInterval().map { ($0, { Systemd.watchdog() }) }),
                onEvent: { [metrics] event in
                    switch event {
                    case let .connectionRefused(peer, refusal):
                        let why: String
                        switch refusal {
                        case .serverFull:
                            why = "MaxConnections= reached"
                            metrics.refusedConnection("server_full")
                        case .userLimit:
                            why = "MaxConnectionsPerUser= reached"
                            metrics.refusedConnection("user_limit")
                        case .descriptors:
                            why = "out of file descriptors"
                            metrics.refusedConnection("descriptors")
                        }
                        logger.limited(.warning, key: "refused:\(peer.map { "\($0.uid)" } ?? "-")",
                                       "connection refused (\(why)): \(peer.map { "\($0)" } ?? "a client")")
                    case let .protocolError(peer, reason):
                        logger.limited(.notice, key: "protocol:\(peer.uid)", "protocol error from \(peer): \(reason)")
                    }
                })
        } catch {
            logger.error("cannot serve: \(error)")
            close(socket.fd)
            return ExitCode.failure
        }
        connectionCount.value = { [server] in server.connectionCount }
        var metricsServer: MetricsServer?
        if let address = configuration.metricsListen {
            do {
                let listener = try MetricsServer(address, group: configuration.metricsGroup)
                let metricsGroup = configuration.metricsGroup
                let authorization = MetricsAuthorization(peerMayRead: { [table] peer in
                    let access = table.snapshot.access
                    return access.isAdmin(peer) || metricsGroup.map { access.isMember(peer, of: $0) } == true
                }, bearerToken: configuration.metricsBearerToken)
                listener.start(authorization: authorization,
                               render: { [self] openMetrics, full in await self.metricsText(openMetrics: openMetrics, full: full) },
                               refused: { [metrics] reason in metrics.refusedScrape(reason) })
                metricsServer = listener
                logger.info("metrics on \(address)/metrics")
            } catch {
                // Tokens come first: the daemon serves them without metrics.
                logger.error("cannot serve metrics on \(address): \(error)")
            }
        }
        // (Metrics first: once the socket answers, so does MetricsListen=.)
        server.start()
        logger.info("listening on \(configuration.socketPath) with \(configuration.sessions.count) session(s)")
        if let development, let demo = table.snapshot.sessions[development.sessionName] {
            await development.logIn(demo.coordinator)
            var output = FileOutput.standardOutput
            output.write(development.guide(socket: configuration.socketPath))
        }
        // Ready means: the socket listens and the stored state is loaded (not that any
        // upstream is reachable).
        Systemd.ready(status: await statusLine())

        // Run: the daemon's parts as one task tree. Listed so that each outlives the ones after
        // it (they stop in reverse order): the stop-timeout extension, the HTTP loop, the
        // connections, the sessions, the listener, maintenance, signals.
        let shutdown = Latch()
        let group = ServiceGroup(parts: [
            DaemonPart("stop timeout") { [self] stop in
                // While the others stop, tell systemd, again and again, that the stop is making
                // progress: TimeoutStopSec= must never SIGKILL a rotation. For as long as the
                // slowest refresh may take.
                await shutdown.wait()
                await extendStopTimeout(for: options.drainTimeout + longestFlight(), until: stop)
            },
            DaemonPart("HTTP loop") { [self] stop in
                prepareHTTP(for: configuration)
                await stop.wait()
                CurlLoop.stopShared()
            },
            DaemonPart("connections") { stop in
                await stop.wait()
                await server.stop()
            },
            DaemonPart("sessions") { [self] stop in
                await stop.wait()
                // Every coordinator retires: a refresh still in flight (one nobody waits for any
                // more, say) lands and commits; pending writes get a last try. After any reload
                // under way (its new coordinators retire too), and no reload after it.
                await reloads.run { [self] in
                    stopping.value = true
                    await retireAll()
                }
            },
            DaemonPart("listener") { [self] stop in
                await stop.wait()
                server.stopAccepting()
                // A socket systemd passed belongs to systemd; one we bound is removed.
                if let inode = socket.inode { SocketPath.remove(configuration.socketPath, inode: inode) }
                if !(await server.callsDrained(within: options.drainTimeout)) {
                    logger.warning("\(server.callsInProgress) call(s) still running at the deadline; cancelling")
                }
            },
            DaemonPart("metrics") { [metricsServer] stop in
                await stop.wait()
                metricsServer?.stop()
            },
            DaemonPart("maintenance") { [self] stop in await maintain(until: stop) },
            DaemonPart("signals") { [self] stop in await handle(signals, shutdown: shutdown, until: stop) },
        ], shutdown: shutdown, report: { [logger] in logger.error($0) })
        let failed = await group.run()
        development?.stop()
        logger.info("stopped")
        return failed.isEmpty ? ExitCode.ok : ExitCode.failure
    }

    /// Loads libcurl (once the daemon is ready: linked, it was most of the start-up) if a
    /// session needs HTTP, so that the first refresh finds it loaded and a missing library is
    /// said at once. A configuration with no `oauth` session never maps it.
    private func prepareHTTP(for configuration: BrokerConfiguration) {
        let needsHTTP = configuration.sessions.contains { session in
            if case .oauth = session.upstream { return true }
            return false
        }
        guard needsHTTP, let problem = CurlLoop.shared.problem else { return }
        logger.error("upstream requests will fail: \(problem)")
    }

    /// SIGHUP reloads; SIGTERM and SIGINT start the graceful stop.
    private func handle(_ signals: AsyncStream<Int32>, shutdown: Latch, until stop: Latch) async {
        await withTaskGroup(of: Void.self) { group in
            group.addTask { [self] in
                for await signal in signals {
                    if signal == SIGHUP {
                        Systemd.reloading()
                        if let problem = await reload() {
                            logger.error("reload failed, keeping the old configuration: \(problem)")
                            reloadProblem.value = problem
                        } else {
                            reloadProblem.value = nil
                        }
                        Systemd.ready(status: await statusLine())
                        continue
                    }
                    Systemd.stopping()
                    logger.info("stopping (signal \(signal))")
                    shutdown.fire()
                    // Nothing after the stop: a SIGHUP queued behind it must not start a reload
                    // while the daemon retires. This part ends with the others (its end alone
                    // would read as a failure).
                    await stop.wait()
                    return
                }
            }
            group.addTask { await stop.wait() }
            await group.next()
            group.cancelAll()
        }
    }

    /// Set once the stop has begun retiring coordinators: reloads are refused from then on.
    private let stopping = SynchronizedBox(false)

    private func retireAll() async {
        await withTaskGroup(of: Void.self) { group in
            for session in table.snapshot.sessions.values {
                group.addTask { [logger] in
                    await session.fleet?.stopWaiting()
                    await session.coordinator.retire()
                    await session.stopFollowing()
                    if await !session.coordinator.flushPendingWrite() {
                        logger.error("session \(session.configuration.name): state could not be written before exit",
                                     session: session.configuration.name)
                    }
                }
            }
            for coordinator in unflushed.withLock({ $0 }) {
                group.addTask { [logger] in
                    if await !coordinator.flushPendingWrite() {
                        logger.error("session \(coordinator.session): state could not be written before exit", session: coordinator.session)
                    }
                }
            }
        }
    }

    /// The longest a refresh started now may take: discovery (when an issuer is configured)
    /// plus the token request, each under its own deadline.
    private func longestFlight() -> Duration {
        current.value.sessions.reduce(.zero) { longest, session in
            guard case let .oauth(settings) = session.upstream else { return longest }
            // A fleet session's flight may wait for another broker's, up to the lease and more.
            // (Its commit is retried for up to twice the lease once the issuer has rotated.)
            let fleet = session.fleet.map { $0.flightLease * 2 + .seconds(5) + $0.requestTimeout * 4 } ?? .zero
            return max(longest, fleet, settings.client.timeout + (settings.issuer.map(Discovery.longest(for:)) ?? .zero))
        }
    }

    /// Sends `EXTEND_TIMEOUT_USEC=` every few seconds until `stop` fires or until `budget`
    /// (plus a margin) has passed: past that, a stop that has not finished is stuck, and
    /// systemd's own timeout should end it.
    private func extendStopTimeout(for budget: Duration, until stop: Latch) async {
        let interval = Duration.seconds(5)
        let end = ContinuousClock.now + budget + interval
        // (A cancelled wait returns at once: the loop ends on cancellation rather than spin.)
        while !Task.isCancelled && ContinuousClock.now < end {
            Systemd.extendTimeout(by: interval * 2)
            if await stop.wait(upTo: interval) { return }
        }
    }

    /// Reloads (SIGHUP and the Reload method) happen one at a time.
    private let reloads = AsyncSerializer()

    /// Re-reads the configuration and applies it; returns the problem when it cannot.
    private func reload() async -> String? {
        let problem = await reloads.run { await self.reloadNow() }
        metrics.reload(ok: problem == nil)
        return problem
    }

    /// The metrics exposition (`MetricsListen=`, the Metrics method).
    func metricsText(openMetrics: Bool = false, full: Bool = true) async -> String {
        let snapshot = table.snapshot
        var views: [Metrics.SessionView] = []
        for name in snapshot.order where full {
            guard let session = snapshot.sessions[name] else { continue }
            views.append(Metrics.SessionView(status: await session.coordinator.status(), fleet: session.fleet?.status))
        }
        return metrics.render(sessions: views, connections: connectionCount.value(), unixNow: Int64(SystemWallClock().unixTime()),
                              openMetrics: openMetrics, full: full)
    }

    private func reloadNow() async -> String? {
        guard !stopping.value else { return "the daemon is stopping" }
        var configuration: BrokerConfiguration
        do {
            configuration = try development?.configuration ?? ConfigLoader.load(path: options.configPath, requireMainFile: options.configPathGiven)
        } catch {
            return "\(error)"
        }
        for warning in configuration.warnings { logger.warning("\(warning)") }
        for warning in ProcessDefences.unmappedIDWarnings(configuration) { logger.warning(warning) }
        let old = current.value
        // The socket is bound once; its settings take effect at the next start.
        configuration.socketPath = old.socketPath
        await apply(configuration)
        prepareHTTP(for: configuration)
        logger.info("configuration reloaded: \(configuration.sessions.count) session(s)")
        return nil
    }

    /// Builds the session table for `configuration`, keeping the coordinators (tokens and
    /// flights) of sessions whose upstream and policy did not change.
    ///
    /// A session whose settings changed gets a new coordinator that takes over the old one's
    /// state, and a session no longer configured is stopped, in two steps:
    /// 1. While everything keeps serving, their coordinators start no new refresh, and the one
    ///    under way lands and commits (a rotated refresh token must not be lost).
    /// 2. With logouts and logins held back (`BoundaryGate`), each old coordinator hands its
    ///    state as it stands in memory — with the write the store still owes, if it is degraded
    ///    — to its successor, and the table is swapped. A logout acknowledged before the swap is
    ///    in what is handed over; one after it reaches the new coordinator. A removed session's
    ///    pending write is flushed, or kept and retried until it lands.
    private func apply(_ configuration: BrokerConfiguration) async {
        let previous = table.snapshot
        let leaving = previous.sessions.filter { name, existing in
            configuration.session(named: name).map { $0.needsNewCoordinator(comparedTo: existing.configuration) } ?? true
        }
        for (name, existing) in leaving {
            if await existing.coordinator.status().refreshing {
                logger.info("session \(name): settings changed; waiting for its refresh in flight", session: name)
            }
            await existing.fleet?.stopWaiting()
            await existing.coordinator.quiesce()
        }
        await table.gate.exclusive { [self] in
            var snapshot = SessionTable.Snapshot(access: Access(daemonUID: getuid(), adminGroup: configuration.adminGroup))
            for session in configuration.sessions {
                if let existing = previous.sessions[session.name], leaving[session.name] == nil {
                    // Same upstream and policy: keep tokens and flights; re-read discovery metadata.
                    existing.upstream?.resetDiscovery()
                    snapshot.sessions[session.name] = SessionTable.Session(configuration: session, coordinator: existing.coordinator,
                                                                           upstream: existing.upstream, fleet: existing.fleetPart)
                } else if let existing = leaving[session.name] {
                    let handedOver = await existing.coordinator.handOver()
                    await existing.stopFollowing()
                    snapshot.sessions[session.name] = await makeSession(session, handedOver: handedOver)
                } else if let earlier = takeUnflushed(session.name) {
                    // Configured again while its last write from before is still pending: the
                    // memory of that coordinator is newer than the store.
                    snapshot.sessions[session.name] = await makeSession(session, handedOver: await earlier.handOver())
                } else {
                    snapshot.sessions[session.name] = await makeSession(session)
                }
                snapshot.order.append(session.name)
            }
            for (name, removed) in leaving where configuration.session(named: name) == nil {
                await removed.coordinator.shutdown()
                await removed.stopFollowing()
                if await !removed.coordinator.flushPendingWrite() {
                    logger.error("session \(name): removed from the configuration with a write still pending; retrying it", session: name)
                    unflushed.withLock { $0.append(removed.coordinator) }
                }
            }
            snapshot.inert = await inertSessions(configured: Set(snapshot.order))
            table.replace(snapshot)
            current.value = configuration
        }
    }

    /// Coordinators of removed sessions whose last write has not reached the store yet: retried
    /// by `maintain()` and at exit.
    private let unflushed = Mutex<[Coordinator]>([])

    /// Removes and returns the unflushed coordinator of `session`, if there is one.
    private func takeUnflushed(_ session: String) -> Coordinator? {
        unflushed.withLock { list in
            guard let index = list.firstIndex(where: { $0.session == session }) else { return nil }
            return list.remove(at: index)
        }
    }

    /// The state store, timed for the metrics.
    private var measuredStore: any SessionStore { MeasuredStore(inner: state.sessions, metrics: metrics) }

    /// A coordinator for `session`, from a predecessor's state when a reload replaces one, else
    /// from what the store holds.
    private func makeSession(_ session: SessionConfiguration,
                             handedOver: (record: SessionRecord, pendingWrite: StoreWrite?, counters: SessionCounters)? = nil) async
        -> SessionTable.Session {
        var restored: SessionRecord?
        if let handedOver {
            restored = handedOver.record
        } else {
            do {
                restored = try await state.sessions.load(session.name)
            } catch {
                logger.error("cannot load the state of session \(session.name): \(error); it starts signed out", session: session.name)
                restored = nil
            }
            if session.fleet != nil, restored?.state == .active {
                // The fleet decides: until its state has been read, this host's copy (from before
                // a restart, during which the fleet may have logged out) hands out nothing.
                restored?.state = .signedOut
                restored?.refreshToken = nil
                restored?.accessToken = nil
            }
        }
        let source: any TokenSource
        var upstream: HTTPTokenSource?
        switch session.upstream {
        case let .test(lifetime):
            source = TestTokenSource(lifetime: lifetime)
        case let .oauth(settings):
            let http = HTTPTokenSource(grant: settings.grant, configuration: settings.client.configuration,
                                       endpoints: settings.endpoints, issuer: settings.issuer)
            // (Not for fleet sessions: a holder whose lease runs out abandons its request so that
            // another broker may take over, and that request must not go on.)
            if session.fleet == nil { http.whenAbandoned(abandonedRequestRevocation(session, http)) }
            source = http
            upstream = http
        }
        var fleet: DaemonFleetSession?
        if let settings = session.fleet {
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
                fleet = try DaemonFleetSession(
                    name: session.name, settings: settings,
                    backend: EtcdClient(endpoints: settings.endpoints, tls: settings.tls, timeout: settings.requestTimeout),
                    upstream: source, local: local, floor: floor, pending: pending, clock: ContinuousClock(), wall: SystemWallClock(),
                    pendingLogoutFile: state.directory.map { "\($0)/fleet-logout-\(session.name)" },
                    discarded: discardedTokenRevocation(session, upstream), report: fleetReport(session.name))
            } catch {
                // The key was checked when the configuration was read.
                logger.error("session \(session.name): the fleet key cannot be used: \(error)", session: session.name)
            }
        }
        let coordinator = Coordinator(session: session.name, policy: session.policy, source: fleet ?? source,
                                      store: fleet ?? measuredStore, restored: restored, pendingWrite: handedOver?.pendingWrite,
                                      counters: handedOver?.counters ?? SessionCounters(),
                                      clock: ContinuousClock(), wall: SystemWallClock(),
                                      discarded: discardedTokenRevocation(session, upstream),
                                      outcomes: { [log = RefreshLog(logger: logger, policy: session.policy), metrics] outcome in
                                          log.record(outcome)
                                          metrics.record(outcome)
                                      })
        if let fleet {
            // The sync loop's first read of etcd logs the session in or out here as the fleet has it.
            await fleet.attach(coordinator)
            let following = Task { await fleet.run() }
            logger.log(.info, "session \(session.name): shared with the fleet (\(fleet.settings.prefix) on \(fleet.settings.endpoints.count) "
                       + "etcd endpoint(s)); it follows the fleet's state", session: session.name)
            return SessionTable.Session(configuration: session, coordinator: coordinator, upstream: upstream, fleet: (fleet, following))
        }
        if let restored {
            logger.log(.info, "session \(session.name): restored \(restored.state.rawValue) at generation \(restored.generation)"
                       + (restored.accessToken == nil ? "" : ", token #\(restored.tokenSerial)"),
                       session: session.name, generation: restored.generation,
                       tokenSerial: restored.accessToken == nil ? nil : restored.tokenSerial)
            return SessionTable.Session(configuration: session, coordinator: coordinator, upstream: upstream)
        }
        switch session.upstream {
        case .test:
            // A test upstream needs no credential: it starts logged in.
            _ = try? await coordinator.login(refreshToken: nil)
        case let .oauth(settings) where settings.grant == .clientCredentials:
            // client_credentials needs no login either: the grant itself is the credential.
            _ = try? await coordinator.login(refreshToken: nil)
        case .oauth:
            break   // refresh_token sessions wait for a login (Login or DeviceLogin)
        }
        return SessionTable.Session(configuration: session, coordinator: coordinator, upstream: upstream)
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

    /// What happens to an upstream answer that arrived after a logout (or login) had ended its
    /// generation: its refresh token is revoked, best effort, like the one the logout retired.
    private func discardedTokenRevocation(_ session: SessionConfiguration, _ upstream: HTTPTokenSource?) -> @Sendable (FetchedToken) -> Void {
        guard let upstream, case let .oauth(settings) = session.upstream, settings.revokeOnLogout else { return { _ in } }
        let logger = self.logger
        let name = session.name
        return { fetched in
            guard let refreshToken = fetched.refreshToken else { return }
            Task {
                if case let .failed(problem) = await upstream.revoke(refreshToken) {
                    logger.warning("revoking the refresh token of a discarded answer of session \(name) failed: \(problem)", session: name)
                }
            }
        }
    }

    /// What happens to a token request whose flight a logout, login or stop ended before the
    /// issuer answered: it goes on to its deadline, and a refresh token it brings (the issuer
    /// rotated already) is revoked, so that the logout leaves nothing usable upstream. What
    /// cannot be revoked is said.
    private func abandonedRequestRevocation(_ session: SessionConfiguration, _ upstream: HTTPTokenSource)
        -> @Sendable (FetchRequest, Result<FetchedToken, any Error>) -> Void {
        guard case let .oauth(settings) = session.upstream, settings.revokeOnLogout else { return { _, _ in } }
        let logger = self.logger
        let name = session.name
        return { request, result in
            switch result {
            case let .success(fetched):
                guard let refreshToken = fetched.refreshToken else { return }
                Task {
                    switch await upstream.revoke(refreshToken) {
                    case .revoked:
                        logger.log(.info, "session \(name): a refresh answer that came after the logout (or login) had ended its request "
                                   + "brought a new refresh token; it is revoked upstream", session: name, generation: request.generation)
                    case .noEndpoint:
                        logger.log(.warning, "session \(name): a refresh answer that came after the logout brought a new refresh token, "
                                   + "and there is no revocation endpoint: it stays valid upstream", session: name, generation: request.generation)
                    case let .failed(problem):
                        logger.log(.warning, "session \(name): revoking the refresh token that came after the logout failed (\(problem)): "
                                   + "it stays valid upstream", session: name, generation: request.generation)
                    }
                }
            case let .failure(error):
                // No answer: if the issuer rotated, the new refresh token is known to nobody and
                // cannot be revoked here; the logout revoked the one it knew.
                guard let failure = error as? FetchFailure, case .transient = failure.kind, request.refreshToken != nil else { return }
                logger.log(.notice, "session \(name): the refresh under way at the logout got no answer (\(failure.reason)): if the issuer "
                           + "rotated the refresh token, the new one cannot be revoked from here", session: name, generation: request.generation)
            }
        }
    }

    /// Stored sessions the configuration no longer names: shown by Status, kept until Forget.
    private func inertSessions(configured: Set<String>) async -> [InertSession] {
        guard let database = state.database else { return [] }
        do {
            return try await database.loadAll().filter { !configured.contains($0.name) }.map(InertSession.init)
        } catch {
            logger.error("cannot list stored sessions: \(error)")
            return []
        }
    }

    /// Removes a stored session the configuration no longer names.
    func forget(_ name: String) async throws -> Bool {
        // A pending write of the removed session would bring the row back: it is dropped too.
        if takeUnflushed(name) != nil { logger.notice("session \(name): its unwritten state is discarded with it", session: name) }
        guard let database = state.database, try await database.forget(name) else { return false }
        table.modify { $0.inert.removeAll { $0.name == name } }
        logger.notice("forgot stored session \(name)")
        return true
    }

    /// Once a second: retry the pending writes of degraded sessions (backing off while they
    /// keep failing), refresh ahead for sessions that have watchers, and keep systemd's STATUS=
    /// current.
    private func maintain(until stop: Latch) async {
        var delay = Duration.seconds(1)
        var nextFlush = ContinuousClock.now + delay
        var lastStatus = ""
        while !Task.isCancelled, !(await stop.wait(upTo: .seconds(1))) {
            if ContinuousClock.now >= nextFlush {
                var allFlushed = true
                for session in table.snapshot.sessions.values where await session.coordinator.status().degraded {
                    if await session.coordinator.flushPendingWrite() {
                        logger.notice("session \(session.configuration.name): pending state written; no longer degraded",
                                      session: session.configuration.name)
                    } else {
                        allFlushed = false
                    }
                }
                for coordinator in unflushed.withLock({ $0 }) {
                    if await coordinator.flushPendingWrite() {
                        unflushed.withLock { $0.removeAll { $0 === coordinator } }
                        logger.notice("session \(coordinator.session): the last write of the removed session has landed",
                                      session: coordinator.session)
                    } else {
                        allFlushed = false
                    }
                }
                delay = allFlushed ? .seconds(1) : min(delay * 2, .seconds(60))
                nextFlush = ContinuousClock.now + delay
            }
            // Sessions followed only by watchers get their refresh-ahead here: no demand would
            // start it otherwise.
            for session in table.snapshot.sessions.values where session.coordinator.watcherCount > 0 {
                await session.coordinator.prefetch()
            }
            let status = await statusLine()
            if status != lastStatus {
                Systemd.status(status)
                lastStatus = status
            }
        }
    }

    /// The problem of the last failed reload, shown in STATUS= until a reload succeeds.
    private let reloadProblem = SynchronizedBox<String?>(nil)

    /// One line for systemd's STATUS=: sessions by state, degraded ones, the last refresh.
    func statusLine() async -> String {
        var active = 0, signedOut = 0, ended = 0, degraded = 0
        var lastRefresh: Int64?
        for session in table.snapshot.sessions.values {
            let status = await session.coordinator.status()
            switch status.state {
            case .active: active += 1
            case .signedOut: signedOut += 1
            case .ended: ended += 1
            }
            if status.degraded { degraded += 1 }
            if let refreshed = status.lastRefresh { lastRefresh = max(lastRefresh ?? refreshed, refreshed) }
        }
        var line = "\(active) active, \(signedOut) signed out, \(ended) failed, \(degraded) degraded"
        if let lastRefresh { line += "; last refresh \(UTCTime.timeOfDay(lastRefresh)) UTC" }
        if let problem = reloadProblem.value { line += "; reload failed: \(problem)" }
        return line
    }

    private func raiseDescriptorLimit(to wanted: Int) {
        var limit = rlimit()
        guard getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit) == 0, limit.rlim_cur < rlim_t(wanted) else { return }
        limit.rlim_cur = min(rlim_t(wanted), limit.rlim_max)
        setrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit)
    }
}

/// `--dev` in a build without the development environment.
struct DevelopmentUnavailable: Error, CustomStringConvertible {
    var description: String { "this build has no development environment" }
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
