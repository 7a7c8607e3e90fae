import TokenBrokerCore
import Basics
import Synchronization

extension FleetSession {
    /// Reads the session's state key, then watches it from the revision read, for thirty
    /// seconds at a time, until cancelled: every change lands in the mirror (and is signalled).
    /// A watch that ends at once or fails is started again only after a pause that grows while
    /// it keeps doing so. (`FleetSync.run` runs it, and applies the mirror.)
    nonisolated func watch() async {
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

    // MARK: - Steps for the follower above the coordinator (`FleetSync`)

    /// Gives the session the one thing it reads of the coordinator: the token it hands out now.
    func reading(heldToken: @escaping @Sendable () -> Secret?) {
        self.heldToken = heldToken
    }

    /// Whether this host owes the fleet a write: a logout, a commit.
    func owes() -> Bool { machine.pendingLogout != nil || pendingCommit != nil }

    /// What following the fleet asks of the coordinator now, given the token it hands out; with
    /// the local generation the fleet's is bound to (for an adoption).
    func followStep() -> (action: FleetStateMachine.FollowAction, held: Secret?, boundLocal: Int?) {
        let view = currentView()
        let held = heldToken()
        let action = machine.follow(view, unixNow: wall.unixTime(), now: now(), held: held)
        settle(view)
        return (action, held, machine.bound?.local)
    }

    /// Whether this broker follows a generation of the fleet's (bound to a local one).
    var isBound: Bool { machine.bound != nil }

    /// The coordinator applied `state` as local generation `local`: the machine follows, and
    /// `event` is said.
    func followed(_ state: FleetState?, local: Int, saying event: FleetEvent?) {
        machine.followed(state, local: local)
        if let event { report(event) }
        settle()
    }

    /// The coordinator adopted the token of `position`.
    func installed(_ position: FleetPosition) {
        machine.installed(position)
        settle()
    }

    /// A commit no flight is waiting for any more (etcd was away for longer than two leases):
    /// written once etcd answers; the sync loop then adopts it like another broker's refresh.
    /// (The caller checks that no flight is under way here.)
    func commitPendingInBackground() async {
        guard let pending = pendingCommit else { return }
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
}
