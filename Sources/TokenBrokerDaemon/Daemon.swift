#if canImport(Glibc)
import Glibc
#endif
import Basics
import BrokerContract
import CLinux
import Dispatch
import Fleet
import Synchronization

import TokenBrokerCore
import Upstream
import Varlink
import HTTPTransport
import Sealing

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
        /// A user's own broker (`serve --user`): the configuration, state and socket in the
        /// user's XDG directories where not given (`UserDirectories`).
        public var user = false

        public init() {}
    }

    static let version = Product.version

    private let options: Options
    private let logger: Logger
    private let table: SessionTable
    private let development: (any DevelopmentEnvironment)?
    private let state: StateStore
    private let metrics = Metrics(version: Daemon.version)
    private let census = SessionCensus()
    /// Token requests that outlive their callers, and the other work that does (revocations, a
    /// device login's polling, a code's redemption): stopped after the sessions, before the
    /// HTTP loop. Beyond their limits, a request a logout overtakes is cut off, and
    /// a revocation skipped (and said).
    private let transfers = TaskPool(limit: 1 << 16)
    /// (256 at once, the rest in turn: a logout of thousands of sessions revokes every one.)
    private let outliving = TaskPool(limit: 256, backlog: 1 << 16)
    /// The fleet sessions' follow loops (stopped with the sessions).
    private let followLoops = TaskPool(limit: 1 << 20)
    private let reloader: Reloader
    private let maintenance: Maintenance
    /// The delegations' sockets, served on the varlink server's loop.
    private let delegations: Delegations
    /// Who was handed which token.
    private let audit: Audit
    /// The client keys the daemon holds (`private_key_jwt`).
    private let clientKeys: ClientKeys
    /// The number of open client connections (set once the server exists).
    private let connectionCount = SynchronizedBox<@Sendable () -> Int>({ 0 })

    private init(options: Options, configuration: BrokerConfiguration, logger: Logger, development: (any DevelopmentEnvironment)?, state: StateStore) {
        self.options = options
        self.logger = logger
        self.development = development
        self.state = state
        let table = SessionTable(access: Access(daemonUID: getuid(), adminGroup: configuration.adminGroup))
        self.table = table
        let clientKeys = ClientKeys(database: state.database, logger: logger)
        self.clientKeys = clientKeys
        let factory = SessionFactory(logger: logger, metrics: metrics, state: state, census: census, sessions: table, transfers: transfers,
                                     outliving: outliving, followLoops: followLoops, clientKeys: clientKeys)
        // (A token file never takes the place of the daemon's state or configuration: the state
        // directory, the configuration file and its drop-ins.)
        let files = TokenFiles(table: table, logger: logger, metrics: metrics,
                               forbidden: [state.directory.map { $0 + "/" }, options.configPath].compactMap { $0 })
        let delegations = Delegations(logger: logger, files: files)
        self.delegations = delegations
        reloader = Reloader(table: table, factory: factory, logger: logger, metrics: metrics, state: state, configuration: configuration,
                            delegations: delegations, read: { [options] in
                                try development?.configuration ?? ConfigLoader.load(path: options.configPath, requireMainFile: options.configPathGiven)
                            })
        let audit = Audit(burst: configuration.auditBurst, interval: configuration.auditInterval,
                          write: { [logger] fields, line in logger.audit(fields, line: line) })
        self.audit = audit
        maintenance = Maintenance(table: table, census: census, reloader: reloader, logger: logger, audit: audit)
    }

    /// At most two malloc arenas, set on the main thread before any other thread exists. glibc
    /// gives each thread that allocates an arena of its own, up to eight per CPU; the daemon's
    /// few threads (the I/O loop, the cooperative pool, libcurl's, the journal's) then each keep
    /// a partly used heap: 130 KB more private memory with an OAuth session, and no measurable
    /// gain in GetToken at 16 connections (the hot path allocates on the loop's thread only,
    /// and little).
    /// An operator's own setting (`MALLOC_ARENA_MAX=`, `GLIBC_TUNABLES=`) is left as it is.
    public static func limitMallocArenas() {
        guard getenv("MALLOC_ARENA_MAX") == nil, getenv("GLIBC_TUNABLES") == nil else { return }
        _ = tb_limit_malloc_arenas(2)
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
            for line in "\(error)".split(separator: "\n") { logger.error("configuration error: \(line)") }
            return failToStart("configuration error: \(error)") {
                do {
                    _ = try ConfigLoader.load(path: options.configPath, requireMainFile: options.configPathGiven)
                    return nil
                } catch {
                    return "\(error)"
                }
            }
        }
        for warning in configuration.warnings { logger.warning("\(warning)") }
        for warning in ProcessDefences.unmappedIDWarnings(configuration) { logger.warning(warning) }
        if configuration.sessions.isEmpty { logger.warning("no sessions are configured (\(options.configPath))") }
        if let socket = options.socketPath { configuration.socketPath = socket }
        let state: StateStore
        do {
            state = try StateStore.open(options, stateKey: configuration.stateKey, logger: logger)
        } catch let problem as StateKeyProblem {
            logger.error("cannot open the state database: \(problem)")
            return failToStart("cannot open the state database: \(problem)")
        } catch {
            logger.error("cannot open the state database: \(error)")
            return ExitCode.failure
        }
        let daemon = Daemon(options: options, configuration: configuration, logger: logger, development: development, state: state)
        return await daemon.serve(configuration, signals: signals)
    }

    /// Exit 78; under socket activation, after answering the calls that woke the daemon with
    /// why (`StartFailure`), and with it in systemd's status line.
    /// `stillFailing`: why, asked again (nil once it is fixed: `StartFailure` then leaves the
    /// next call to a new daemon).
    private static func failToStart(_ reason: String, stillFailing: () -> String? = { "" }) -> Int32 {
        if let listener = try? Systemd.activatedListener() {
            Systemd.status(reason)
            StartFailure.answer(on: listener, reason: reason, stillFailing: stillFailing)
        }
        return ExitCode.config
    }

    private func serve(_ configuration: BrokerConfiguration, signals: AsyncStream<Int32>) async -> Int32 {
        signal(SIGPIPE, SIG_IGN)
        raiseDescriptorLimit(to: configuration.maxConnections + 256)
        await reloader.start(configuration)
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

        guard let socket = listen(configuration), let server = makeServer(configuration, listening: socket.fd) else { return ExitCode.failure }
        connectionCount.value = { [server] in server.connectionCount }
        // The delegations' sockets, on the same loop (their connections wait in their backlogs
        // until it runs); one that cannot be bound is logged and left out.
        delegations.attach(server)
        _ = await delegations.reconcile(configuration.delegations)
        // The token files: each follows its session from now on.
        _ = await delegations.files?.reconcile(configuration.outputs)
        let metricsServer = startMetrics(configuration)
        // Development sessions are logged in before the first call is answered (a client that
        // connects at once waits in the listen backlog, and finds them logged in).
        if let development {
            for name in development.sessionNames {
                guard let demo = table.snapshot.sessions[name] else { continue }
                await development.logIn(demo.coordinator, proofKey: try? demo.account?.newProofKey())
            }
        }
        // Ready means: the socket listens and the stored state is loaded (not that any
        // upstream is reachable). Said before the serving loop starts, whose heartbeat pings the
        // watchdog: READY=1 is the first notification (a client that connects meanwhile waits
        // in the listen backlog).
        Systemd.ready(status: maintenance.statusLine())
        // libcrypto (which a start without a state key or DPoP does not need) and the journal's
        // library are opened now, on a thread of their own: not in a start, nor in the first
        // proof, sealed write or journal entry, nor where a full descriptor table could make
        // the load fail.
        spawnThread { [logger] in
            logger.prepare()
            if let why = CryptoLibrary.load() { logger.error("cannot load libcrypto.so.3 (OpenSSL 3): \(why); sealing and DPoP will end the daemon") }
        }
        // (Metrics first: once the socket answers, so does MetricsListen=.)
        server.start()
        logger.info("listening on \(configuration.socketPath) with \(configuration.sessions.count) session(s)")
        if let development {
            var output = FileOutput.standardOutput
            output.write(development.guide(socket: configuration.socketPath))
        }

        // Run: the daemon's parts as one task tree. Listed so that each outlives the ones after
        // it (they stop in reverse order): the stop-timeout extension, the HTTP loop, the
        // upstream tasks, the connections, the sessions, the listener, metrics, maintenance,
        // signals.
        let shutdown = Latch()
        let group = ServiceGroup(parts: [
            DaemonPart("stop timeout") { [self] stop in
                // While the others stop, tell systemd, again and again, that the stop is making
                // progress: TimeoutStopSec= must never SIGKILL a rotation. For as long as the
                // slowest refresh may take.
                await shutdown.wait()
                // (The drain timeout twice: the calls drain, then the upstream tasks do.)
                await extendStopTimeout(for: options.drainTimeout * 2 + longestFlight(), until: stop)
            },
            DaemonPart("HTTP loop") { [reloader] stop in
                reloader.prepareHTTP(for: configuration)
                await stop.wait()
                CurlLoop.stopShared()
            },
            DaemonPart("upstream tasks") { [transfers, outliving, options, logger] stop in
                // Abandoned token requests (each revokes what it brings) and work that outlives its caller: each
                // has its own deadline; at the drain timeout the rest are cancelled. (After the
                // sessions: their retirement may start one.)
                await stop.wait()
                async let requests = transfers.close(within: options.drainTimeout)
                let revoked = await outliving.close(within: options.drainTimeout)
                if !(await requests) || !revoked { logger.warning("upstream requests still running at the stop's deadline were left behind") }
            },
            DaemonPart("connections") { stop in
                await stop.wait()
                await server.stop()
            },
            DaemonPart("sessions") { [reloader, followLoops] stop in
                await stop.wait()
                await reloader.retireAll()
                // (Each loop has ended with its session; none is left, but none may outlive this.)
                await followLoops.close(within: .seconds(1))
            },
            DaemonPart("listener") { [self] stop in
                await stop.wait()
                await delegations.stop()
                await delegations.files?.stop()
                server.stopAccepting()
                // A socket systemd passed belongs to systemd; one we bound is removed.
                if let inode = socket.inode { SocketPath.remove(configuration.socketPath, inode: inode) }
                if !(await server.callsDrained(within: options.drainTimeout)) {
                    logger.warning("\(server.callsInProgress) call(s) still running at the deadline; cancelling")
                }
            },
            DaemonPart("metrics") { [metricsServer, logger] stop in
                await stop.wait()
                guard let metricsServer else { return }
                metricsServer.stop()
                // (Its thread and scrapes are the part's: it ends when they have.)
                if !(await metricsServer.finished(within: HTTPListener.drainDeadline)) {
                    logger.warning("the metrics listener did not end within \(HTTPListener.drainDeadline.seconds)s of the stop")
                }
            },
            DaemonPart("maintenance") { [maintenance] stop in await maintenance.run(until: stop) },
            DaemonPart("signals") { [self] stop in await handle(signals, shutdown: shutdown, until: stop) },
        ], shutdown: shutdown, report: { [logger] in logger.error($0) })
        let failed = await group.run()
        development?.stop()
        logger.info("stopped")
        return failed.isEmpty ? ExitCode.ok : ExitCode.failure
    }

    /// The socket systemd passed (socket activation), else our own, bound here.
    private func listen(_ configuration: BrokerConfiguration) -> (fd: Int32, inode: ino_t?)? {
        do {
            if let fd = try Systemd.activatedListener() {
                logger.info("using the socket passed by systemd")
                return (fd, nil)
            }
            let bound = try SocketPath.bind(configuration.socketPath, mode: configuration.socketMode, group: configuration.socketGroup)
            return (bound.fd, bound.inode)
        } catch {
            logger.error("cannot listen: \(error)")
            return nil
        }
    }

    /// The varlink server of io.tokenbroker.Broker on `fd`, with the configuration's limits (not
    /// started yet).
    private func makeServer(_ configuration: BrokerConfiguration, listening fd: Int32) -> VarlinkServer? {
        let service = BrokerService(sessions: table, logger: logger, reload: { [reloader] in await reloader.reload() },
                                    forget: { [reloader] name in try await reloader.forget(name) }, metrics: metrics,
                                    metricsText: { [self] in await self.metricsText() }, outliving: outliving, delegations: delegations, audit: audit,
                                    clientKeys: clientKeys)
        let (logger, metrics) = (self.logger, self.metrics)
        do {
            return try VarlinkServer(
                listening: fd,
                info: VarlinkServiceInfo(vendor: "tokenbroker", product: "tokenbroker", version: Self.version, url: Product.url),
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
                onEvent: { event in
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
                        case .listenerFull:
                            why = "the delegation's MaxConnections= reached"
                            metrics.refusedConnection("delegation_full")
                        }
                        logger.limited(.warning, key: "refused:\(peer.map { "\($0.uid)" } ?? "-")",
                                       "connection refused (\(why)): \(peer.map { "\($0)" } ?? "a client")")
                    case let .protocolError(peer, reason):
                        logger.limited(.notice, key: "protocol:\(peer.uid)", "protocol error from \(peer): \(reason)")
                    }
                })
        } catch {
            logger.error("cannot serve: \(error)")
            close(fd)
            return nil
        }
    }

    /// `MetricsListen=`, when configured and it can be opened (tokens come first: the daemon
    /// serves them without metrics).
    private func startMetrics(_ configuration: BrokerConfiguration) -> MetricsServer? {
        guard let address = configuration.metricsListen else { return nil }
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
            logger.info("metrics on \(address)/metrics")
            return listener
        } catch {
            logger.error("cannot serve metrics on \(address): \(error)")
            return nil
        }
    }

    /// SIGHUP reloads; SIGTERM and SIGINT start the graceful stop.
    private func handle(_ signals: AsyncStream<Int32>, shutdown: Latch, until stop: Latch) async {
        await withTaskGroup(of: Void.self) { group in
            group.addTask { [self] in
                for await signal in signals {
                    if signal == SIGHUP {
                        Systemd.reloading()
                        if let problem = await reloader.reload() {
                            // (One entry per error: the journal keeps each line as written.)
                            for line in problem.split(separator: "\n") { logger.error("reload failed, keeping the old configuration: \(line)") }
                            reloader.problem.value = problem
                        } else {
                            reloader.problem.value = nil
                        }
                        Systemd.ready(status: maintenance.statusLine())
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

    /// The longest a refresh started now may take: discovery (when an issuer is configured)
    /// plus the token request, each under its own deadline.
    private func longestFlight() -> Duration {
        reloader.current.value.sessions.reduce(.zero) { longest, session in
            // A fleet session's flight may wait for another broker's, up to the lease and more.
            // (Its commit is retried for up to twice the lease once the issuer has rotated.)
            let fleet = session.fleet.map { $0.flightLease * 2 + .seconds(5) + $0.requestTimeout * 4 } ?? .zero
            return max(longest, fleet, SessionFactory.kind(of: session).longestFlight)
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

    /// The metrics exposition (`MetricsListen=`, the Metrics method).
    func metricsText(openMetrics: Bool = false, full: Bool = true) async -> String {
        let snapshot = table.snapshot
        var views: [Metrics.SessionView] = []
        for name in snapshot.order where full {
            guard let session = snapshot.sessions[name] else { continue }
            views.append(Metrics.SessionView(status: session.coordinator.statusSnapshot(), fleet: session.fleet?.status, parent: session.kind.parent,
                                             keys: session.keys?.counts))
        }
        return metrics.render(sessions: views, connections: connectionCount.value(), unixNow: Int64(SystemWallClock().unixTime()),
                              openMetrics: openMetrics, full: full, audit: audit.counts)
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
