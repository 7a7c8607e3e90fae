import Basics
import Synchronization
import TokenBrokerCore

/// Above the coordinator: follows a fleet session's state in etcd into the coordinator. The
/// `FleetSession` below it is the coordinator's token source and store, and never calls into
/// the coordinator; every login, logout and adoption made elsewhere reaches the coordinator
/// from here, and so reaches watchers and the store the usual way. A fresh history
/// (`startHistoryAnew`) is made here too, as it logs this host out.
public struct FleetSync<C: Clock>: Sendable where C.Duration == Duration {
    public let session: FleetSession<C>
    let coordinator: any FleetFollower
    /// The broker's one watch of the fleet's prefix, which brings this session's changes.
    let watch: FleetWatch<C>

    /// Binds `coordinator` (made with `session` as its source and store) to the fleet: the
    /// session reads the token it hands out now, and nothing else of it; `watch` is the
    /// broker's watch of the session's prefix.
    public init(session: FleetSession<C>, coordinator: any FleetFollower, watch: FleetWatch<C>) async {
        self.session = session
        self.coordinator = coordinator
        self.watch = watch
        await session.reading(heldToken: { [coordinator] in coordinator.currentToken()?.token })
    }

    /// Follows the fleet until cancelled: the session joins the broker's watch of the prefix
    /// (every change of its key lands in its mirror), and a loop applies the mirror whenever it
    /// changes and writes what this host still owes the fleet (a logout, a commit). Leaves the
    /// watch when it ends.
    public func run() async {
        let live = watch.join(session)
        defer { watch.leave(session) }
        // The watch has read the prefix before this session joined: it reads its own keys (the
        // watch brings what changes after). Otherwise the watch's read brings them.
        if live, (try? await session.readView()) == nil, Task.isCancelled { return }
        await syncLoop()
    }

    /// Applies the mirror at every change; writes what this host owes the fleet. Asks etcd
    /// nothing while nothing changes: the watch brings every change, and its stream is what
    /// finds out that a member lost its quorum. Only while this session's last request went
    /// unanswered and the watch is up (so it will not read for it) does it read its keys after
    /// ten quiet seconds.
    private func syncLoop() async {
        var failures = 0
        var quiet = false
        while !Task.isCancelled {
            if quiet, await session.isUnreachable, watch.isLive { _ = try? await session.readView() }
            let version = session.changes.version
            var pause = Duration.seconds(10)
            if await session.owes() {
                do throws(EtcdError) {
                    try await session.publishPendingLogout()
                    if !(await coordinator.status().refreshing) { await session.commitPendingInBackground() }
                    failures = 0
                } catch where error.kind == .cancelled {
                    return
                } catch {
                    failures += 1
                    pause = min(.milliseconds(100) * (1 << min(failures, 6)), .seconds(5))
                }
            }
            let applied = await applyOnce()
            if applied == .afterFlight {
                // A refresh to adopt arrived during this host's own flight: once that flight has
                // landed (it may bring this very state, or have failed), look again.
                await coordinator.awaitFlight()
                continue
            }
            if applied == .again { continue }
            await session.changes.wait(after: version, upTo: pause)
            quiet = session.changes.version == version
        }
    }

    enum ApplyOutcome: Sendable, Equatable { case done, again, afterFlight }

    /// Applies what the fleet holds to the coordinator, ordered against this host's own
    /// boundaries (the session's serializer).
    func applyOnce() async -> ApplyOutcome {
        await session.serializer.run { await applyFleet() }
    }

    /// Applies what the fleet holds to the coordinator: a login, logout or end made elsewhere,
    /// or a refresh to adopt. `afterFlight`: a refresh was declined because a flight is under
    /// way here, and the caller looks again once it has landed; `again`: the coordinator's token
    /// changed meanwhile, look again now. No change the fleet made is ever left unapplied.
    private func applyFleet() async -> ApplyOutcome {
        guard session.mirror.withLock({ $0.loaded }) else { return .done }
        let outcome = await applySteps()
        await session.markSynced()
        return outcome
    }

    private func applySteps() async -> ApplyOutcome {
        for _ in 0..<8 {
            let step = await session.followStep()
            switch step.action {
            case .none:
                return .done
            case let .logIn(state):
                do {
                    let generation = try await coordinator.login(refreshToken: state.refreshToken,
                                                                 initial: FleetStateMachine.usable(state, unixNow: session.wall.unixTime()),
                                                                 replicated: true)
                    await session.followed(state, local: generation, saying: .loggedIn(state.position))
                } catch {
                    session.report(.loginNotApplied("\(error)"))
                    return .done
                }
            case let .logOut(state):
                let wasActive = await coordinator.status().state == .active
                let hadBound = await session.isBound
                // First contact with a fleet that is signed out, and nothing active here: there
                // is nothing to end (a logout now would only undo a login this host is making).
                if !hadBound, !wasActive { return .done }
                let generation = await coordinator.logoutReplicated { _ in }
                var event: FleetEvent?
                if let state, wasActive || hadBound {
                    event = .loggedOut(state.position, endReason: state.phase == .ended ? state.endReason ?? "ended" : nil)
                }
                await session.followed(state, local: generation, saying: event)
            case let .adopt(state):
                guard let local = step.boundLocal, let token = FleetStateMachine.usable(state, unixNow: session.wall.unixTime()) else { return .done }
                switch await coordinator.adopt(token, generation: local, replacing: step.held) {
                case .adopted: await session.installed(state.position)
                case .busy: return .afterFlight
                case .superseded: return .again
                case .over: return .done
                }
            }
        }
        return .again
    }

    /// Starts a new history of the session in etcd (`FleetSession.startHistoryAnewNow`) and logs
    /// this host out with it (`handingOver` gets the refresh token that was in force, for
    /// revocation). Returns the new history's first position.
    public func startHistoryAnew(handingOver: @escaping @Sendable (Secret) -> Void) async throws(EtcdError) -> FleetPosition {
        // What reaches etcd runs to its end even if the caller goes away.
        try await uncancelled {
            await session.serializer.run { () -> Result<FleetPosition, EtcdError> in
                do throws(EtcdError) {
                    let state = try await session.startHistoryAnewNow()
                    // This host ends its session with it, as every other broker does when it follows.
                    let local = await coordinator.logoutReplicated(handingOver: handingOver)
                    await session.followed(state, local: local, saying: nil)
                    session.changes.signal()
                    return .success(state.position)
                } catch {
                    return .failure(error)
                }
            }
        }.get()
    }
}
