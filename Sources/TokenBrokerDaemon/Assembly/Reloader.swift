#if canImport(Glibc)
import Glibc
#endif
import Basics
import Synchronization
import TokenBrokerCore
import Upstream
import Fleet
import SQLiteStore
import HTTPTransport

/// The configuration in force, and every change of it: the first one at start, each reload
/// (SIGHUP, the Reload method) one at a time, and the last retirement at stop. Its cost is
/// linear in the sessions, and a reload touches only the sessions it changes.
final class Reloader: Sendable {
    private let table: SessionTable
    private let factory: SessionFactory
    private let logger: Logger
    private let metrics: Metrics
    private let state: StateStore
    /// Reads the configuration again (the files, or the development environment's).
    private let read: @Sendable () throws -> BrokerConfiguration
    /// The configuration in force.
    let current: SynchronizedBox<BrokerConfiguration>
    /// The problem of the last failed reload, shown in STATUS= until a reload succeeds.
    let problem = SynchronizedBox<String?>(nil)
    /// Reloads happen one at a time, and none after the stop has begun retiring coordinators.
    private let reloads = AsyncSerializer()
    private let stopping = SynchronizedBox(false)
    /// Coordinators of removed sessions whose last write has not reached the store yet:
    /// retried by maintenance and at exit.
    private let unflushed = Mutex<[Coordinator]>([])
    /// The start could not read every stored session at once: the inert list is read whole at
    /// the next reload.
    private let inertUnknown = SynchronizedBox(false)
    /// How many sessions log in at once at start (their writes share transactions).
    static let concurrentLogins = 512
    /// The delegations' sockets, put as each reload's configuration says.
    let delegations: Delegations

    init(table: SessionTable, factory: SessionFactory, logger: Logger, metrics: Metrics, state: StateStore,
         configuration: BrokerConfiguration, delegations: Delegations, read: @escaping @Sendable () throws -> BrokerConfiguration) {
        self.delegations = delegations
        self.table = table
        self.factory = factory
        self.logger = logger
        self.metrics = metrics
        self.state = state
        self.read = read
        current = SynchronizedBox(configuration)
    }

    /// The first configuration: every session's stored state read in one query.
    func start(_ configuration: BrokerConfiguration) async {
        var stored: [String: SessionRecord]?
        if let database = state.database {
            do {
                stored = Dictionary(try await database.loadAll().map { ($0.name, $0) }, uniquingKeysWith: { first, _ in first })
            } catch {
                // One by one, then: a row that cannot be read fails only its own session.
                logger.error("cannot read the stored sessions at once: \(error); reading them one by one")
                inertUnknown.value = true
            }
        }
        await apply(configuration, stored: stored)
    }

    /// Re-reads the configuration and applies it; returns the problem when it cannot.
    func reload() async -> String? {
        let problem = await reloads.run { await self.reloadNow() }
        metrics.reload(ok: problem == nil)
        return problem
    }

    private func reloadNow() async -> String? {
        guard !stopping.value else { return "the daemon is stopping" }
        var configuration: BrokerConfiguration
        do {
            configuration = try read()
        } catch {
            return "\(error)"
        }
        for warning in configuration.warnings { logger.warning("\(warning)") }
        for warning in ProcessDefences.unmappedIDWarnings(configuration) { logger.warning(warning) }
        // The socket is bound once; its settings take effect at the next start.
        configuration.socketPath = current.value.socketPath
        // No delegation serves the new sessions under a grant that is ending.
        let sessions = configuration.sessions
        await delegations.narrow(to: configuration.delegations, sessions: { Set(sessions.map(\.name)) })
        await apply(configuration, stored: nil)
        prepareHTTP(for: configuration)
        var problems = await delegations.reconcile(configuration.delegations)
        problems += await delegations.files?.reconcile(configuration.outputs) ?? []
        logger.info("configuration reloaded: \(configuration.sessions.count) session(s), \(configuration.delegations.count) delegation(s), "
                    + "\(configuration.outputs.count) output(s)")
        // (The sessions are as configured: only the delegations named here are not served.)
        return problems.isEmpty ? nil : problems.joined(separator: "; ")
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
    ///
    /// - Parameter stored: every stored record by name (at start); `nil`: new sessions read
    ///   their own.
    private func apply(_ configuration: BrokerConfiguration, stored: [String: SessionRecord]?) async {
        let previous = table.snapshot
        // One pass over the new sessions, one over the old: which leave (removed, or rebuilt
        // because a key that shapes the coordinator changed) and which merely change.
        var names = Set<String>(minimumCapacity: configuration.sessions.count)
        var leavingSessions: [String: SessionTable.Session] = [:]
        var changedSessions: Set<String> = []
        for session in configuration.sessions {
            names.insert(session.name)
            guard let existing = previous.sessions[session.name],
                  existing.configuration != session || existing.configuration.origin != session.origin else { continue }
            changedSessions.insert(session.name)
            if existing.configuration.needsNewCoordinator(comparedTo: session) { leavingSessions[session.name] = existing }
        }
        for (name, existing) in previous.sessions where !names.contains(name) { leavingSessions[name] = existing }
        let (configured, leaving, changed) = (names, leavingSessions, changedSessions)
        await withTaskGroup(of: Void.self) { group in
            for (name, existing) in leaving {
                group.addTask { [logger] in
                    if existing.coordinator.statusSnapshot().refreshing {
                        logger.info("session \(name): settings changed; waiting for its refresh in flight", session: name)
                    }
                    await existing.fleet?.stopWaiting()
                    // Its keys were derived under its settings: they end with it.
                    await existing.keys?.endAll()
                    await existing.coordinator.quiesce()
                }
            }
        }
        await table.gate.exclusive { [self] in
            var snapshot = SessionTable.Snapshot(access: Access(daemonUID: getuid(), adminGroup: configuration.adminGroup))
            snapshot.serving = ServingIndex(configuration.sessions)
            for session in configuration.sessions {
                if let parent = session.settings.derivedFrom { snapshot.derived[parent, default: []].append(session.name) }
            }
            snapshot.sessions.reserveCapacity(configuration.sessions.count)
            snapshot.order.reserveCapacity(configuration.sessions.count)
            var logins: [SessionTable.Session] = []
            // The fleet sessions made here read etcd together, once they are all made.
            factory.holdFleetWatches()
            for session in configuration.sessions {
                let made: (session: SessionTable.Session, logIn: Bool)
                if let existing = previous.sessions[session.name], leaving[session.name] == nil {
                    // Same upstream and policy: keep tokens and flights; re-read discovery metadata.
                    existing.account?.resetDiscovery()
                    made = (changed.contains(session.name) ? existing.reconfigured(session) : existing, false)
                } else if let existing = leaving[session.name] {
                    let handedOver = await existing.coordinator.handOver()
                    await existing.stopFollowing()
                    factory.census.leave(existing.slot)
                    made = await factory.make(session, from: .handedOver(record: handedOver.record, pendingWrite: handedOver.pendingWrite,
                                                                         counters: handedOver.counters))
                } else if let earlier = takeUnflushed(session.name) {
                    // Configured again while its last write from before is still pending: the
                    // memory of that coordinator is newer than the store.
                    let handedOver = await earlier.handOver()
                    made = await factory.make(session, from: .handedOver(record: handedOver.record, pendingWrite: handedOver.pendingWrite,
                                                                         counters: handedOver.counters))
                } else {
                    let record: SessionRecord?
                    if let stored { record = stored[session.name] } else { record = await load(session.name) }
                    made = await factory.make(session, from: .stored(record))
                }
                if made.logIn { logins.append(made.session) }
                snapshot.sessions[session.name] = made.session
                snapshot.order.append(session.name)
            }
            await factory.releaseFleetWatches()
            await logIn(logins)
            var removed: [String] = []
            for (name, session) in leaving where !configured.contains(name) {
                removed.append(name)
                await session.coordinator.shutdown()
                await session.stopFollowing()
                factory.census.leave(session.slot)
                if await !session.coordinator.flushPendingWrite() {
                    logger.error("session \(name): removed from the configuration with a write still pending; retrying it", session: name)
                    unflushed.withLock { $0.append(session.coordinator) }
                }
            }
            // (The list as it stands now: a Forget since `previous` was read is not undone.)
            snapshot.inert = await inertSessions(previous: table.snapshot.inert, stored: stored, removed: removed, configured: configured)
            table.replace(snapshot)
            current.value = configuration
            await DerivedSessions.reconcile(snapshot, previous: previous, logger: logger)
        }
    }

    /// What the store holds for `name` (nothing, said, when it cannot be read).
    private func load(_ name: String) async -> SessionRecord? {
        do {
            return try await state.sessions.load(name)
        } catch {
            logger.error("cannot load the state of session \(name): \(error); it starts signed out", session: name)
            return nil
        }
    }

    /// Sessions whose kind starts logged in, with nothing stored: logged in many at a time (the
    /// store commits their writes together).
    private func logIn(_ sessions: [SessionTable.Session]) async {
        await withTaskGroup(of: Void.self) { group in
            var running = 0
            let logger = self.logger
            for session in sessions {
                if running == Self.concurrentLogins {
                    await group.next()
                } else {
                    running += 1
                }
                group.addTask {
                    // A DPoP session's login makes its key (a failure to make one is the login's).
                    let proofKey: Secret?
                    do throws(FetchFailure) { proofKey = try session.account?.newProofKey() } catch {
                        logger.error("session \(session.configuration.name): cannot log in: \(error.message)", session: session.configuration.name)
                        return
                    }
                    _ = try? await session.coordinator.login(refreshToken: nil, proofKey: proofKey)
                }
            }
        }
    }

    /// Stored sessions the configuration no longer names: shown by Status, kept until Forget.
    /// At start, from what was read; at a reload, the earlier list with the sessions it
    /// removed (read one by one) and without those it configures again.
    private func inertSessions(previous: [InertSession], stored: [String: SessionRecord]?, removed: [String],
                               configured: Set<String>) async -> [InertSession] {
        guard let database = state.database else { return [] }
        if stored == nil, inertUnknown.value {
            do {
                let all = try await database.loadAll()
                inertUnknown.value = false
                return all.filter { !configured.contains($0.name) }.map(InertSession.init)
            } catch {
                logger.error("cannot list stored sessions: \(error)")
                return []
            }
        }
        if let stored {
            return stored.values.filter { !configured.contains($0.name) }.sorted { $0.name < $1.name }.map(InertSession.init)
        }
        var inert = previous.filter { !configured.contains($0.name) }
        for name in removed {
            do {
                if let record = try await database.load(name) { inert.append(InertSession(record)) }
            } catch {
                logger.error("cannot read the stored state of removed session \(name): \(error)", session: name)
            }
        }
        return inert.sorted { $0.name < $1.name }
    }

    /// Removes and returns the unflushed coordinator of `session`, if there is one.
    private func takeUnflushed(_ session: String) -> Coordinator? {
        unflushed.withLock { list in
            guard let index = list.firstIndex(where: { $0.session == session }) else { return nil }
            return list.remove(at: index)
        }
    }

    /// Retries the last writes of removed sessions; returns whether none is left.
    func flushRemoved() async -> Bool {
        var allFlushed = true
        for coordinator in unflushed.withLock({ $0 }) {
            if await coordinator.flushPendingWrite() {
                unflushed.withLock { $0.removeAll { $0 === coordinator } }
                logger.notice("session \(coordinator.session): the last write of the removed session has landed", session: coordinator.session)
                await listInert(coordinator.session)
            } else {
                allFlushed = false
            }
        }
        return allFlushed
    }

    /// A removed session whose last write has landed: Status lists it as stored (unless a
    /// reload has configured it again meanwhile). With the boundary gate held alone, briefly: no
    /// Forget nor a reload's swap comes between the read and the change.
    private func listInert(_ name: String) async {
        await table.gate.exclusive { [self] in
            guard let database = state.database, table.snapshot.sessions[name] == nil else { return }
            let record = try? await database.load(name)
            table.modify { snapshot in
                snapshot.inert.removeAll { $0.name == name }
                if let record { snapshot.inert.append(InertSession(record)) }
                snapshot.inert.sort { $0.name < $1.name }
            }
        }
    }

    /// Removes a stored session the configuration no longer names. (Under the boundary gate,
    /// shared: a reload's swap, which rebuilds the inert list from the list as it then stands,
    /// comes wholly before or after it.)
    func forget(_ name: String) async throws -> Bool {
        // A pending write of the removed session would bring the row back: it is dropped too.
        if takeUnflushed(name) != nil { logger.notice("session \(name): its unwritten state is discarded with it", session: name) }
        // (The store's forget removes the session's client keys too, row or none: so does memory.)
        defer { factory.clientKeys.forget(name) }
        guard let database = state.database, try await database.forget(name) else { return false }
        table.modify { $0.inert.removeAll { $0.name == name } }
        logger.notice("forgot stored session \(name)")
        return true
    }

    /// The stop: every coordinator retires — a refresh still in flight (one nobody waits for any
    /// more, say) lands and commits; pending writes get a last try. After any reload under way
    /// (its new coordinators retire too), and no reload after it.
    func retireAll() async {
        await reloads.run { [self] in
            stopping.value = true
            await withTaskGroup(of: Void.self) { group in
                for session in table.snapshot.sessions.values {
                    group.addTask { [logger] in
                        await session.fleet?.stopWaiting()
                        await session.keys?.endAll()
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
    }

    /// Loads libcurl (once the daemon is ready: linked, it was most of the start-up) if a
    /// session needs HTTP, so that the first refresh finds it loaded and a missing library is
    /// said at once. A configuration with no `oauth` session never maps it.
    func prepareHTTP(for configuration: BrokerConfiguration) {
        let needsHTTP = configuration.sessions.contains { $0.settings.kind == .oauth }
        guard needsHTTP, let problem = CurlLoop.shared.problem else { return }
        logger.error("upstream requests will fail: \(problem)")
    }
}
