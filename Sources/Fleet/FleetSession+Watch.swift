import TokenBrokerCore
import Basics
import Synchronization

extension FleetSession {
    /// A batch of the fleet watch's events that touch this session's keys (`FleetWatch`
    /// dispatches them, on the HTTP loop's thread): they land in the mirror, and are signalled.
    nonisolated func watched(_ events: [EtcdEvent], revision: Int64) {
        let changed = mirror.withLock { $0.apply(events, revision: revision, key: keys.state) }
        if changed { changes.signal() }
    }

    /// The fleet watch ended early or failed, and pauses before it reads and watches again.
    func countWatchRestart(early troubles: Int) {
        countWatchRestart()
        if troubles == 5 || troubles % 100 == 0 { report(.watchEndingEarly(restarts: machine.counters.watchRestarts)) }
    }

    /// The session's last request to etcd went unanswered.
    var isUnreachable: Bool { machine.isUnreachable }

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
