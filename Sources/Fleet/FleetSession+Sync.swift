import TokenBrokerCore

extension FleetSession {
    /// Follows the fleet until cancelled: a loop that reads the session's keys and watches them
    /// (every change lands in the mirror), a loop that applies the mirror whenever it changes
    /// (and publishes a logout still owed to the fleet), and the revocation of finished flights'
    /// leases. Returns once all three have ended.
    public nonisolated func run() async {
        await withTaskGroup(of: Void.self) { group in
            group.addTask { await self.watchLoop() }
            group.addTask {
                for await lease in self.revocations.stream {
                    _ = try? await self.backend.revoke(lease: lease)
                }
            }
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
                await markSynced()
                let from = mirror.withLock { $0.revision } + 1
                let end = try await backend.watch(prefix: keys.prefixBytes, from: from, for: .seconds(30)) { [weak self] events, revision in
                    guard let self else { return }
                    let changed = self.mirror.withLock { $0.apply(events, revision: revision, keys: self.keys) }
                    if changed { self.changes.signal() }
                }
                troubles = end == .expired ? 0 : troubles + 1
            } catch where error.kind == .cancelled {
                return
            } catch {
                troubles += 1
                await markSynced()
                changes.signal()   // the sync loop learns the health
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

    /// Applies the mirror at every change; publishes a logout this host still owes the fleet.
    /// After ten quiet seconds it reads the keys anyway: a member without quorum may hold a
    /// watch open and silent, and the read is what finds out.
    private nonisolated func syncLoop() async {
        var failures = 0
        var quiet = false
        while !Task.isCancelled {
            if quiet { _ = try? await readView() }
            let version = changes.version
            var pause = Duration.seconds(10)
            if await owesLogout() {
                do throws(EtcdError) {
                    try await publishPendingLogout()
                    failures = 0
                } catch where error.kind == .cancelled {
                    return
                } catch {
                    failures += 1
                    pause = min(.milliseconds(100) * (1 << min(failures, 6)), .seconds(5))
                }
            }
            if await serializer.run({ await self.applyFleet() }) {
                // A refresh to adopt arrived during this host's own flight: once that flight has
                // landed (it may bring this very state, or have failed), look again.
                await awaitFlight()
                continue
            }
            await changes.wait(after: version, upTo: pause)
            quiet = changes.version == version
        }
    }

    private func owesLogout() -> Bool { machine.pendingLogout != nil }

    private func awaitFlight() async { await coordinator?.awaitFlight() }

    /// Applies what the fleet holds to the coordinator (under the serializer): a login, logout
    /// or end made elsewhere, or a refresh to adopt. Returns true when a refresh was declined
    /// because a flight is under way here: the caller looks again once it has landed, so no
    /// change the fleet made is ever left unapplied.
    func applyFleet() async -> Bool {
        guard let coordinator, mirror.withLock({ $0.loaded }) else { return false }
        for _ in 0..<8 {
            let view = currentView()
            let action = machine.follow(view, unixNow: wall.unixTime())
            settle(view)
            switch action {
            case .none:
                return false
            case let .logIn(state):
                do {
                    let generation = try await coordinator.login(refreshToken: state.refreshToken,
                                                                 initial: FleetStateMachine.usable(state, unixNow: wall.unixTime()),
                                                                 replicated: true)
                    machine.followed(state, local: generation)
                    report(.loggedIn(state.position))
                } catch {
                    report(.loginNotApplied("\(error)"))
                    return false
                }
            case let .logOut(state):
                let wasActive = await coordinator.status().state == .active
                let hadBound = machine.bound != nil
                let generation = await coordinator.logoutReplicated()
                machine.followed(state, local: generation)
                if let state, wasActive || hadBound {
                    report(.loggedOut(state.position, endReason: state.phase == .ended ? state.endReason ?? "ended" : nil))
                }
            case let .adopt(state):
                guard let bound = machine.bound, let token = FleetStateMachine.usable(state, unixNow: wall.unixTime()) else { return false }
                guard await coordinator.adopt(token, generation: bound.local) else {
                    // Declined: during a flight here, look again once it has landed; otherwise
                    // the generation is over here (or the coordinator retires): nothing to do.
                    return await coordinator.status().refreshing
                }
                machine.installed(state.position)
            }
            settle()
        }
        return false
    }
}
