/// A fleet session's keys as this broker last knew them: a range read replaces them, watch
/// events move them on. Pure; the session applies what its reads and its watch bring.
struct FleetMirror: Sendable {
    private(set) var revision: Int64 = 0
    private(set) var state: EtcdKeyValue?
    private(set) var flight: EtcdKeyValue?
    private(set) var backoff: EtcdKeyValue?
    /// Keys of an earlier version's layout are present.
    private(set) var earlierLayout = false
    /// A range has been applied.
    private(set) var loaded = false

    /// Takes a range read of the session's keys at `revision`; returns false (and keeps what
    /// it has) when it already knows a later revision.
    mutating func reset(_ records: [EtcdKeyValue], revision: Int64, keys: FleetKeys) -> Bool {
        guard revision >= self.revision else { return false }
        self.revision = revision
        state = nil
        flight = nil
        backoff = nil
        earlierLayout = false
        for record in records { put(record, keys: keys) }
        loaded = true
        return true
    }

    /// Applies one batch of watch events; returns whether it changed anything. Events at or
    /// before the mirror's revision are already in it.
    mutating func apply(_ events: [EtcdEvent], revision: Int64, keys: FleetKeys) -> Bool {
        var changed = false
        for event in events where event.record.modRevision > self.revision {
            switch event.kind {
            case .put: put(event.record, keys: keys)
            case .delete: remove(event.record.key, keys: keys)
            }
            changed = true
        }
        self.revision = max(self.revision, revision)
        return changed
    }

    private mutating func put(_ record: EtcdKeyValue, keys: FleetKeys) {
        switch record.key {
        case keys.state: state = record
        case keys.flight: flight = record
        case keys.backoff: backoff = record
        default:
            let field = String(decoding: record.key.dropFirst(keys.base.utf8.count), as: UTF8.self)
            if FleetKeys.earlierLayout.contains(field) { earlierLayout = true }
        }
    }

    private mutating func remove(_ key: [UInt8], keys: FleetKeys) {
        switch key {
        case keys.state: state = nil
        case keys.flight: flight = nil
        case keys.backoff: backoff = nil
        default: break
        }
    }
}

/// What the session's keys say once opened and checked (`FleetCodec.view`): the only input the
/// state machine takes from etcd.
struct FleetView: Sendable {
    enum State: Sendable {
        case absent
        case valid(FleetState, FleetPlace)
        /// A value is there, but it is not taken (it still names the revision a write over it
        /// compares).
        case refused(FleetValueProblem, FleetPlace)
    }

    enum Flight: Sendable, Equatable {
        case none
        /// A claim of the current state, on its lease, in time.
        case held(FlightClaim, modRevision: Int64)
        /// A key that holds no claim worth waiting for (stale, past its time, off its lease,
        /// forged): the next flight replaces it, comparing its revision.
        case void(modRevision: Int64)
    }

    var revision: Int64
    var state: State
    var flight: Flight
    var backoff: BackoffNote?
    /// Values that were refused, by field, with the revision of the write that brought them.
    var refused: [Refusal] = []
    var earlierLayout = false

    struct Refusal: Sendable, Equatable {
        var field: String
        var problem: FleetValueProblem
        var modRevision: Int64
    }

    var validState: FleetState? {
        if case let .valid(state, _) = state { return state }
        return nil
    }
}

/// Where the state key stands in etcd: what a write over it compares and seals against.
struct FleetPlace: Sendable, Equatable {
    /// The record as read (nil: the key does not exist).
    var record: EtcdKeyValue?
    var modRevision: Int64 { record?.modRevision ?? 0 }

    static let absent = FleetPlace(record: nil)
}

extension FleetCodec {
    /// How far a flight claim may be past its time before it is void: the brokers' clocks may
    /// differ by this much.
    static let clockAllowance: Int64 = 5_000

    /// Opens and checks every value of `mirror`.
    func view(of mirror: FleetMirror, unixNow: Double) -> FleetView {
        var view = FleetView(revision: mirror.revision, state: .absent, flight: .none, earlierLayout: mirror.earlierLayout)
        var stateRevision: Int64?
        if let record = mirror.state {
            switch openState(record, unixNow: unixNow) {
            case let .success(state):
                view.state = .valid(state, FleetPlace(record: record))
                stateRevision = record.modRevision
            case let .failure(problem):
                view.state = .refused(problem, FleetPlace(record: record))
                view.refused.append(FleetView.Refusal(field: "state", problem: problem, modRevision: record.modRevision))
            }
        }
        let nowMilliseconds = Int64(min(max(unixNow, 0), 1e12) * 1000)
        if let record = mirror.flight {
            view.flight = .void(modRevision: record.modRevision)
            switch openFlight(record) {
            case let .success(claim):
                if claim.stateRevision == stateRevision, nowMilliseconds < claim.until + Self.clockAllowance {
                    view.flight = .held(claim, modRevision: record.modRevision)
                }
            case let .failure(problem):
                view.refused.append(FleetView.Refusal(field: "flight", problem: problem, modRevision: record.modRevision))
            }
        }
        if let record = mirror.backoff {
            switch openBackoff(record, unixNow: unixNow) {
            case let .success(note):
                if note.stateRevision == stateRevision { view.backoff = note }
            case let .failure(problem):
                view.refused.append(FleetView.Refusal(field: "backoff", problem: problem, modRevision: record.modRevision))
            }
        }
        return view
    }
}
