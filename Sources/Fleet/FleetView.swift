/// A fleet session's state key as this broker last knew it: a read replaces it, watch events
/// move it on. Pure; the session applies what its reads and its watch bring.
struct FleetMirror: Sendable {
    private(set) var revision: Int64 = 0
    private(set) var state: EtcdKeyValue?
    /// An earlier version's record is there, and no state of this one.
    private(set) var earlierLayout = false
    /// A read has been applied.
    private(set) var loaded = false

    /// Takes a read of the key at `revision`. A read at an older revision than the mirror has
    /// (etcd restored from a backup without bumping its revision) is taken too, as the store as
    /// it is now: the broker's floor, not the revision, keeps its history from going back.
    mutating func reset(_ record: EtcdKeyValue?, revision: Int64, earlierLayout: Bool) {
        self.revision = revision
        state = record
        self.earlierLayout = record == nil && earlierLayout
        loaded = true
    }

    /// Takes this broker's own write of the key, as etcd answered it (`record`, read back in the
    /// write's transaction): the key held it at its revision, whatever the watch has brought yet
    /// (a transaction's answer comes before its watch event). Returns whether it changed
    /// anything; a mirror already at or past that revision has it, or something newer.
    mutating func wrote(_ record: EtcdKeyValue) -> Bool {
        guard record.modRevision > revision else { return false }
        state = record
        earlierLayout = false
        revision = record.modRevision
        return true
    }

    /// Applies one batch of watch events of the key; returns whether it changed anything.
    /// Events at or before the mirror's revision are already in it.
    mutating func apply(_ events: [EtcdEvent], revision: Int64, key: [UInt8]) -> Bool {
        var changed = false
        for event in events where event.record.key == key && event.record.modRevision > self.revision {
            switch event.kind {
            case .put: state = event.record
            case .delete: state = nil
            }
            changed = true
        }
        self.revision = max(self.revision, revision)
        return changed
    }
}

/// What the session's state key says once opened and checked (`FleetCodec.view`): the only
/// input the state machine takes from etcd.
struct FleetView: Sendable {
    enum State: Sendable {
        case absent
        case valid(FleetState, FleetPlace)
        /// A value is there, but it is not taken (it still names the revision a write over it
        /// compares).
        case refused(FleetValueProblem, FleetPlace)
    }

    var revision: Int64
    var state: State
    var earlierLayout = false

    var validState: FleetState? {
        if case let .valid(state, _) = state { return state }
        return nil
    }

    var place: FleetPlace {
        switch state {
        case .absent: return .absent
        case let .valid(_, place), let .refused(_, place): return place
        }
    }
}

/// Where the state key stands in etcd: what a write over it compares and seals against.
struct FleetPlace: Sendable, Equatable {
    /// The record as read (nil: the key does not exist).
    var record: EtcdKeyValue?
    var modRevision: Int64 { record?.modRevision ?? 0 }

    static let absent = FleetPlace(record: nil)

    /// The comparisons a write over this place makes: its revision and its very value (a value
    /// is unique, its nonce random: no restore that sends revisions back can pass for it).
    func compare(_ key: [UInt8]) -> [EtcdCompare] {
        guard let record else { return [.createRevision(key: key, equals: 0)] }
        return [.modRevision(key: key, equals: record.modRevision), .value(key: key, equals: record.value)]
    }
}

extension FleetCodec {
    /// Opens and checks the mirror's state.
    func view(of mirror: FleetMirror, unixNow: Double) -> FleetView {
        guard let record = mirror.state else { return FleetView(revision: mirror.revision, state: .absent, earlierLayout: mirror.earlierLayout) }
        switch openState(record, unixNow: unixNow) {
        case let .success(state): return FleetView(revision: mirror.revision, state: .valid(state, FleetPlace(record: record)))
        case let .failure(problem): return FleetView(revision: mirror.revision, state: .refused(problem, FleetPlace(record: record)))
        }
    }
}
