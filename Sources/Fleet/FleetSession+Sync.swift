import TokenBrokerCore
import Basics
import Synchronization

extension FleetSession {
    /// Follows the fleet until cancelled: a loop that reads the session's state key and watches
    /// it (every change lands in the mirror), and a loop that applies the mirror whenever it
    /// changes (and writes what this host still owes the fleet: a logout, a commit). Returns
    /// once both have ended.
    public nonisolated func run() async {
        await withTaskGroup(of: Void.self) { group in
            group.addTask { await self.watchLoop() }
            await self.syncLoop()
            group.cancelAll()
        }
    }

    /// Read, then watch from the revision read, for thirty seconds at a time. A watch that ends
    /// at once or fails is started again only after a pause that grows while it keeps doing so.
    private nonisolated func watchLoop() async {
        var troubles = 0
        while !Task.isCancelled {
            do throws(EtcdError) {
                _ = try await readView()
                let from = mirror.withLock { $0.revision } + 1
                let end = try await backend.watch(key: keys.state, from: from, for: .seconds(30)) { [weak self] events, revision in
                    guard let self else { return }
                    let changed = self.mirror.withLock { $0.apply(events, revision: revision, key: self.keys.state) }
                    if changed { self.changes.signal() }
                }
                troubles = end == .expired ? 0 : troubles + 1
            } catch where error.kind == .cancelled {
                return
            } catch {
                troubles += 1
                await markSynced()   // the first read failed: nothing to wait for
                changes.signal()     // the sync loop learns the health
            }
            guard troubles > 0, !Task.isCancelled else { continue }
            await countWatchRestart(early: troubles)
            try? await clock.sleep(for: min(.milliseconds(100) * (1 << min(troubles, 6)), .seconds(5)))
        }
    }

    private func countWatchRestart(early troubles: Int) {
        countWatchRestart()
        if troubles == 5 || troubles % 100 == 0 { report(.watchEndingEarly(restarts: machine.counters.watchRestarts)) }
    }

    /// Applies the mirror at every change; writes what this host owes the fleet. After ten
    /// quiet seconds it reads the key anyway: a member without quorum may hold a watch open and
    /// silent, and the read is what finds out.
    private nonisolated func syncLoop() async {
        var failures = 0
        var quiet = false
        while !Task.isCancelled {
            if quiet { _ = try? await readView() }
            let version = changes.version
            var pause = Duration.seconds(10)
            if await owes() {
                do throws(EtcdError) {
                    try await publishPendingLogout()
                    await commitPendingInBackground()
                    failures = 0
                } catch where error.kind == .cancelled {
                    return
                } catch {
                    failures += 1
                    pause = min(.milliseconds(100) * (1 << min(failures, 6)), .seconds(5))
                }
            }
            let applied = await serializer.run { await self.applyFleet() }
            if applied == .afterFlight {
                // A refresh to adopt arrived during this host's own flight: once that flight has
                // landed (it may bring this very state, or have failed), look again.
                await awaitFlight()
                continue
            }
            if applied == .again { continue }
            await changes.wait(after: version, upTo: pause)
            quiet = changes.version == version
        }
    }

    private func owes() -> Bool { machine.pendingLogout != nil || pendingCommit != nil }

    private func awaitFlight() async { await coordinator?.awaitFlight() }

    /// A commit no flight is waiting for any more (etcd was away for longer than two leases):
    /// written once etcd answers; the sync loop then adopts it like another broker's refresh.
    private func commitPendingInBackground() async {
        guard let pending = pendingCommit, !(await coordinator?.status().refreshing ?? false) else { return }
        switch await commit(pending, retryUntil: clock.now) {
        case .committed:
            await keep(nil)
            changes.signal()
        case .overtakenByBoundary:
            await keep(nil)
            discarded(pending.fetched)
            report(.lateAnswerDiscarded)
        case .overtakenByRefresh:
            await keep(nil)
        case .failed:
            break
        }
    }

    enum ApplyOutcome: Sendable, Equatable { case done, again, afterFlight }

    /// Applies what the fleet holds to the coordinator (under the serializer): a login, logout
    /// or end made elsewhere, or a refresh to adopt. `afterFlight`: a refresh was declined
    /// because a flight is under way here, and the caller looks again once it has landed;
    /// `again`: the coordinator's token changed meanwhile, look again now. No change the fleet
    /// made is ever left unapplied.
    func applyFleet() async -> ApplyOutcome {
        guard let coordinator, mirror.withLock({ $0.loaded }) else { return .done }
        defer { markSynced() }
        for _ in 0..<8 {
            let view = currentView()
            let held = coordinator.currentToken()?.token
            let action = machine.follow(view, unixNow: wall.unixTime(), now: now(), held: held)
            settle(view)
            switch action {
            case .none:
                return .done
            case let .logIn(state):
                do {
                    let generation = try await coordinator.login(refreshToken: state.refreshToken,
                                                                 initial: FleetStateMachine.usable(state, unixNow: wall.unixTime()),
                                                                 replicated: true)
                    machine.followed(state, local: generation)
                    report(.loggedIn(state.position))
                } catch {
                    report(.loginNotApplied("\(error)"))
                    return .done
                }
            case let .logOut(state):
                let wasActive = await coordinator.status().state == .active
                let hadBound = machine.bound != nil
                // First contact with a fleet that is signed out, and nothing active here: there
                // is nothing to end (a logout now would only undo a login this host is making).
                if !hadBound, !wasActive { return .done }
                let generation = await coordinator.logoutReplicated { _ in }
                machine.followed(state, local: generation)
                if let state, wasActive || hadBound {
                    report(.loggedOut(state.position, endReason: state.phase == .ended ? state.endReason ?? "ended" : nil))
                }
            case let .adopt(state):
                guard let bound = machine.bound, let token = FleetStateMachine.usable(state, unixNow: wall.unixTime()) else { return .done }
                switch await coordinator.adopt(token, generation: bound.local, replacing: held) {
                case .adopted: machine.installed(state.position)
                case .busy: return .afterFlight
                case .superseded: return .again
                case .over: return .done
                }
            }
            settle()
        }
        return .again
    }
}
