import Synchronization
import TokenBrokerCore

/// What the daemon counts of its sessions without asking each one: how many are in each state,
/// which are degraded (a write pending) and which are watched. Every coordinator tells its
/// summary when it changes, so that maintenance, systemd's STATUS= line and the reload cost
/// nothing per idle session.
final class SessionCensus: Sendable {
    /// A coordinator's place in the census (a session replaced at a reload gets a new one).
    struct Slot: Hashable, Sendable {
        fileprivate let id: UInt64
    }

    struct Totals: Sendable, Equatable {
        var active = 0
        var signedOut = 0
        var ended = 0
        var degraded = 0
        /// The newest successful refresh of any session, Unix seconds.
        var lastRefresh: Int64?
    }

    private struct Entry {
        var name: String
        var summary: SessionSummary?
    }

    private struct State {
        var next: UInt64 = 0
        var entries: [UInt64: Entry] = [:]
        var totals = Totals()
        var degraded: Set<UInt64> = []
        var watched: Set<UInt64> = []

        mutating func count(_ summary: SessionSummary, _ id: UInt64, _ sign: Int) {
            switch summary.state {
            case .active: totals.active += sign
            case .signedOut: totals.signedOut += sign
            case .ended: totals.ended += sign
            }
            if summary.degraded { totals.degraded += sign }
            if sign > 0 {
                if summary.degraded { degraded.insert(id) } else { degraded.remove(id) }
                if summary.watched { watched.insert(id) } else { watched.remove(id) }
                if let refreshed = summary.lastRefresh { totals.lastRefresh = max(totals.lastRefresh ?? refreshed, refreshed) }
            } else {
                degraded.remove(id)
                watched.remove(id)
            }
        }
    }

    private let state = Mutex(State())

    /// A new slot for a coordinator of session `name` (before it exists: it tells its changes
    /// from the start).
    func enrol(_ name: String) -> Slot {
        state.withLock { state in
            state.next += 1
            state.entries[state.next] = Entry(name: name)
            return Slot(id: state.next)
        }
    }

    /// The coordinator's summary changed (its observer; called in order).
    func tell(_ slot: Slot, _ summary: SessionSummary) {
        state.withLock { state in
            guard let entry = state.entries[slot.id] else { return }   // it has left
            if let old = entry.summary { state.count(old, slot.id, -1) }
            state.entries[slot.id]?.summary = summary
            state.count(summary, slot.id, 1)
        }
    }

    /// The coordinator's summary at creation: counted unless it has told a change already
    /// (which is newer).
    func begin(_ slot: Slot, _ summary: SessionSummary) {
        state.withLock { state in
            guard let entry = state.entries[slot.id], entry.summary == nil else { return }
            state.entries[slot.id]?.summary = summary
            state.count(summary, slot.id, 1)
        }
    }

    /// The coordinator is no longer served (replaced or removed at a reload).
    func leave(_ slot: Slot) {
        state.withLock { state in
            guard let entry = state.entries.removeValue(forKey: slot.id) else { return }
            if let summary = entry.summary { state.count(summary, slot.id, -1) }
        }
    }

    var totals: Totals { state.withLock { $0.totals } }

    /// Sessions with a write pending.
    var degradedSessions: [String] {
        state.withLock { state in state.degraded.compactMap { state.entries[$0]?.name } }
    }

    /// Sessions with at least one watch stream open.
    var watchedSessions: [String] {
        state.withLock { state in state.watched.compactMap { state.entries[$0]?.name } }
    }
}
