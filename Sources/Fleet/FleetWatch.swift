import Synchronization

/// One watch of etcd for every fleet session a broker serves under one prefix: a range read of
/// `<prefix>/sessions/` (every session's keys at one revision), then one stream watching the
/// prefix from that revision on, each batch of events dispatched to the sessions whose state key
/// it touches (a key no session here owns is ignored; what a session takes is checked there, as
/// every value from etcd is: `FleetCodec`, `FleetMirror.apply`). Nothing is asked of etcd while
/// nothing changes: the stream lives for `lifetime` and is renewed from the last revision it
/// brought (its progress notes keep that recent), without a read.
///
/// A stream that fails (a member gone, a compacted history, a member that lost its leader) or
/// ends early is followed by a read of the prefix and a new stream from the read's revision,
/// after a pause that grows while it keeps doing so (each session counts the restart). A read
/// that fails marks every session unreachable.
///
/// Sessions join and leave one by one (`FleetSync.run`), a reload's new sessions among running
/// ones: the loop starts with the first to join and ends with the last to leave. A session that
/// joins before the loop has read takes the loop's read; one that joins after reads its own keys
/// — unless it joins while the watch is held (`hold`, while the daemon starts or reloads many
/// sessions): then those that joined take one read of the prefix at `release`, and the loop
/// starts only then.
public final class FleetWatch<C: Clock>: Sendable where C.Duration == Duration {
    private struct State {
        /// The sessions by state key (during a reload's hand-over, the old one and its successor).
        var sessions: [[UInt8]: [FleetSession<C>]] = [:]
        /// Which run of the loop is current (a new one starts when a session joins none).
        var run: UInt64 = 0
        var running = false
        var task: Task<Void, Never>?
        /// The current run has read the prefix and watches on from that read.
        var live = false
        /// The last revision the current stream brought (its events or its progress notes).
        var seen: Int64 = 0
        /// While held (`hold`), joiners wait for one read at `release`.
        var held = 0
        var joinedWhileHeld: [FleetSession<C>] = []
    }

    private let state = Mutex(State())
    let backend: any FleetBackend
    /// `<prefix>/sessions/`: every session's keys are under it.
    let prefix: [UInt8]
    let clock: C
    /// How long one stream lives before it is renewed.
    let lifetime: Duration
    /// Starts the loop as a task of the caller's tree (nil: the tree is stopping).
    private let spawn: @Sendable (@escaping @Sendable () async -> Void) -> Task<Void, Never>?

    public init(backend: any FleetBackend, prefix: String, clock: C, lifetime: Duration = .seconds(600),
                spawn: @escaping @Sendable (@escaping @Sendable () async -> Void) -> Task<Void, Never>?) {
        self.backend = backend
        self.prefix = Array((prefix + "/sessions/").utf8)
        self.clock = clock
        self.lifetime = lifetime
        self.spawn = spawn
    }

    /// How many sessions are in the dispatch.
    public var sessionCount: Int { state.withLock { $0.sessions.values.reduce(0) { $0 + $1.count } } }

    /// The loop has read the prefix and its stream is watching on from there.
    var isLive: Bool { state.withLock { $0.live } }

    /// Puts `session` in the dispatch (starting the loop if none runs); returns whether the loop
    /// has read already (then the session reads its own keys: the loop's stream brings what
    /// changes after).
    func join(_ session: FleetSession<C>) -> Bool {
        let (live, start) = state.withLock { state -> (Bool, UInt64?) in
            state.sessions[session.keys.state, default: []].append(session)
            if state.held > 0 {
                // (A loop that has not read yet brings it its keys anyway.)
                if state.live { state.joinedWhileHeld.append(session) }
                return (false, nil)
            }
            guard !state.running else { return (state.live, nil) }
            return (false, Self.starting(&state))
        }
        if let start { startLoop(start) }
        return live
    }

    /// Until as many `release` calls: sessions that join wait for one read of the prefix at the
    /// last release, and a loop that does not run yet starts only then.
    public func hold() {
        state.withLock { $0.held += 1 }
    }

    /// Ends a `hold`: at the last, the sessions that joined meanwhile read the prefix at once (in
    /// the caller's task), or the loop starts and reads it for them.
    public func release() async {
        let (start, joined) = state.withLock { state -> (UInt64?, [FleetSession<C>]) in
            state.held -= 1
            guard state.held == 0 else { return (nil, []) }
            defer { state.joinedWhileHeld = [] }
            if !state.running, !state.sessions.isEmpty { return (Self.starting(&state), []) }
            let members = Set(state.sessions.values.joined().map(ObjectIdentifier.init))
            return (nil, state.joinedWhileHeld.filter { members.contains(ObjectIdentifier($0)) })
        }
        if let start { startLoop(start) }
        guard !joined.isEmpty else { return }
        _ = try? await read(for: joined)
    }

    /// Marks a new run of the loop as started; returns its number.
    private static func starting(_ state: inout State) -> UInt64 {
        state.running = true
        state.live = false
        state.run &+= 1
        return state.run
    }

    private func startLoop(_ start: UInt64) {
        let task = spawn { [self] in await loop(start) }
        let stale = state.withLock { state -> Bool in
            guard state.run == start, state.running else { return true }
            guard let task else {
                state.running = false   // the tree is stopping: no loop
                return false
            }
            state.task = task
            return false
        }
        if stale { task?.cancel() }
    }

    /// Takes `session` out of the dispatch; the last one to leave ends the loop (and its stream).
    func leave(_ session: FleetSession<C>) {
        let task = state.withLock { state -> Task<Void, Never>? in
            let key = session.keys.state
            state.sessions[key]?.removeAll { $0 === session }
            if state.sessions[key]?.isEmpty == true { state.sessions[key] = nil }
            guard state.sessions.isEmpty, state.running else { return nil }
            state.running = false
            state.live = false
            state.run &+= 1
            defer { state.task = nil }
            return state.task
        }
        task?.cancel()
    }

    // MARK: - The loop

    private func loop(_ run: UInt64) async {
        var troubles = 0
        // Where the next stream starts without a read (nil: read the prefix first).
        var from: Int64?
        while !Task.isCancelled {
            do throws(EtcdError) {
                let start: Int64
                if let from { start = from } else { start = try await read(for: nil, run: run) + 1 }
                state.withLock { $0.seen = start - 1 }
                let end = try await backend.watch(prefix: prefix, from: start, for: lifetime) { [weak self] events, revision in
                    self?.dispatch(events, revision: revision)
                }
                if end == .expired {
                    troubles = 0
                    from = state.withLock { $0.seen } + 1
                } else {
                    troubles += 1
                    from = nil
                }
            } catch where error.kind == .cancelled {
                return
            } catch {
                troubles += 1
                from = nil
            }
            guard troubles > 0, !Task.isCancelled else { continue }
            state.withLock { state in if state.run == run { state.live = false } }
            for session in sessions() { await session.countWatchRestart(early: troubles) }
            try? await clock.sleep(for: min(.milliseconds(100) * (1 << min(troubles, 6)), .seconds(5)))
        }
    }

    private func sessions() -> [FleetSession<C>] {
        state.withLock { Array($0.sessions.values.joined()) }
    }

    /// Reads every key under the prefix and hands each session its keys (`only` those, or every
    /// session in the dispatch once it is read, one that joined meanwhile too); returns the
    /// read's revision. A failure marks those sessions unreachable. `run`: the loop's run, live
    /// once it has read.
    private func read(for only: [FleetSession<C>]?, run: UInt64? = nil) async throws(EtcdError) -> Int64 {
        let asked = only ?? sessions()
        let before = Dictionary(asked.map { (ObjectIdentifier($0), $0.mirror.withLock { $0.revision }) }, uniquingKeysWith: { first, _ in first })
        let records: [EtcdKeyValue]
        let revision: Int64
        do {
            (records, revision) = try await backend.range(prefix: prefix)
        } catch where error.kind == .cancelled {
            throw error
        } catch {
            for session in only ?? sessions() { await session.unreachable(error.message) }
            throw error
        }
        var byKey: [[UInt8]: EtcdKeyValue] = [:]
        for record in records { byKey[record.key] = record }
        // Every session in the dispatch now takes it (one that joined while it was out too).
        let takers = only ?? state.withLock { state -> [FleetSession<C>] in
            if state.run == run { state.live = true }
            return Array(state.sessions.values.joined())
        }
        for session in takers {
            let keys = session.keys
            let record = byKey[keys.state]
            await session.took(record, earlierLayout: record == nil && byKey[keys.earlierRecord] != nil, revision: revision,
                               before: before[ObjectIdentifier(session)] ?? session.mirror.withLock { $0.revision })
        }
        return revision
    }

    /// One batch of the stream: each session gets the events of its state key (a progress
    /// note, without events, only moves the stream's revision on).
    private func dispatch(_ events: [EtcdEvent], revision: Int64) {
        guard !events.isEmpty else { return state.withLock { $0.seen = max($0.seen, revision) } }
        var touched: [[UInt8]: [EtcdEvent]] = [:]
        for event in events { touched[event.record.key, default: []].append(event) }
        let targets = state.withLock { state in
            state.seen = max(state.seen, revision)
            return touched.compactMap { key, events in state.sessions[key].map { ($0, events) } }
        }
        for (sessions, events) in targets {
            for session in sessions { session.watched(events, revision: revision) }
        }
    }
}
