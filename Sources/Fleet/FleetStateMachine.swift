import TokenBrokerCore

/// Every decision of one fleet session, with no I/O: what to do with what etcd shows (follow a
/// login, logout, end or refresh made elsewhere), how a refresh demand is met (deliver another
/// broker's token, wait for its flight, take the flight), what a commit that lost its compare
/// does, and how this broker's own boundaries are published. `FleetSession` feeds it views
/// (`FleetView`, opened and checked by `FleetCodec`), the results of its etcd requests and the
/// time — `now` on the session's monotonic clock, `unixNow` the wall clock — and carries out
/// what it answers.
///
/// Invariants (each method keeps them; the preconditions callers rely on):
/// - **History only moves forward.** `floor` is the highest position this broker has applied,
///   published, committed or read authentically; it starts at the position its state database
///   remembers and never decreases. A state older than `floor` is never followed, delivered,
///   refreshed from or committed over: the session serves what it has and reports `rolledBack`.
///   Nor is a state written at an older etcd revision than one this broker has seen the key
///   hold (a restored backup, even at the position of the floor).
/// - **A view is never older than this broker's own writes.** The session puts each write etcd
///   acknowledged into its mirror of the key (`FleetSession.putState`) before it tells the
///   machine (`installed`, `published`, `wrote`), ahead of the write's watch event: a view older
///   than `floor` is one etcd showed after having shown more, never a watch that lags.
/// - **Only authentic values decide.** A refused state changes nothing but health and counters.
/// - **A flight claim holds for its lease from the moment this broker first saw it** (on its own
///   clock), and once more from scratch when etcd answers after it could not be reached (once
///   per claim): the holder gives up its upstream request a margin before its own lease ends,
///   so no second broker starts while the first one's request may still reach the issuer.
/// - `bound`, once set, pairs this host's local generation with the fleet generation it stands
///   for; `bound.generation <= floor.fleetGeneration`. A demand of another local generation is
///   refused (`notCaughtUp`): its session is over here.
/// - **A history is started anew only on purpose.** A state of a later history than `floor`'s
///   (an admin's `ResetFleetHistory` on some broker) comes after every position of the earlier
///   one, so it is followed — and said loudly (`newHistory`); one of an earlier history is a
///   rollback like any older position. This broker starts one only for `planReset`.
/// - **Room below the limit.** No value read leaves less than `FleetPosition.room` below the
///   limit (`FleetCodec` refuses it), so `floor` never rises that far by what etcd shows.
/// - `applied` is the position of what this host's coordinator holds (within `bound`): a state
///   at or before it is never installed again.
/// - While this host owes the fleet a logout, it follows no login it would end.
struct FleetStateMachine: Sendable {
    struct Bound: Sendable, Equatable {
        var local: Int
        var generation: FleetGeneration
    }

    enum Health: Sendable, Equatable {
        case starting
        case healthy
        /// etcd cannot be reached or has no quorum.
        case unavailable(String)
        /// The state value is refused (forged, altered, written back).
        case untrusted(String)
        /// The fleet shows older history than this broker has seen (nil: no state at all).
        case rolledBack(seen: FleetPosition?, floor: FleetPosition)
        /// The fleet holds only an earlier version's layout.
        case earlierLayout
    }

    /// What the sync loop does with a view.
    enum FollowAction: Sendable, Equatable {
        case none
        /// A login elsewhere, or first contact with an active session: log in here.
        case logIn(FleetState)
        /// A logout or end elsewhere, or first contact with a session that is not active (nil:
        /// the fleet has no state for it yet).
        case logOut(FleetState?)
        /// A refresh elsewhere: install its token.
        case adopt(FleetState)
    }

    /// How a refresh demand is met.
    enum RefreshPlan: Sendable, Equatable {
        case notCaughtUp
        /// Nothing in the fleet can be refreshed from (the reason is shown to callers).
        case unusable(String)
        /// Logged out, in or ended elsewhere: the sync loop applies it; this flight ends.
        case boundaryElsewhere
        /// Another broker refreshed: its token, with no upstream request.
        case deliver(FleetState)
        case backoff(BackoffNote)
        /// Another broker holds the flight, until `until` on this broker's clock at the latest.
        case wait(FlightClaim, until: Duration)
        /// Take the flight over this state.
        case takeFlight(FleetState, FleetPlace)
    }

    /// What a commit whose compare failed does, given what the key holds now.
    enum CommitVerdict: Sendable, Equatable {
        /// It holds our own write (applied, its answer lost, sent again).
        case committed
        case overtakenByBoundary
        case overtakenByRefresh
        /// A value nobody with the fleet key wrote, the only write since ours: write over it.
        case writeOver
        case failed(String)
    }

    let session: String
    private(set) var floor: FleetPosition
    private(set) var bound: Bound?
    private(set) var applied: FleetPosition?
    private(set) var counters = FleetCounters()
    /// A local login that could not reach the fleet: its generation's logout is local only.
    var failedLogin: Int?
    /// A logout of this host etcd has not taken yet: the fleet generation it ends (nil: the newest).
    var pendingLogout: FleetGeneration??
    /// Events for the log, drained by the session after each step.
    private(set) var events: [FleetEvent] = []
    /// What the fleet's values say (from the last view checked).
    private var trust = Health.starting
    /// Why the last request to etcd failed (nil: the last one answered).
    private var unreachable: String?
    /// The revision of the last refused state reported (each is reported once).
    private var reported: Int64?
    /// A state this broker is writing itself (an end): not to be followed as one made elsewhere.
    private var ownWrite: FleetPosition?
    /// The state revision whose flight claim this broker saw first, and when (its own clock).
    private var claimSeen: (revision: Int64, at: Duration)?
    /// The claim whose clock an outage has restarted already (each is restarted once).
    private var claimRestarted: Int64?
    /// The highest etcd revision at which this broker has seen the state key written.
    private var highestRevision: Int64 = 0

    init(session: String, floor: FleetPosition?) {
        self.session = session
        self.floor = floor ?? .start
    }

    /// Unreachable first, else what the values say.
    var health: Health { unreachable.map { .unavailable($0) } ?? trust }
    /// The last request to etcd went unanswered.
    var isUnreachable: Bool { unreachable != nil }

    mutating func drainEvents() -> [FleetEvent] {
        defer { events.removeAll() }
        return events
    }

    // MARK: - Health

    mutating func countWatchRestart() {
        counters.watchRestarts += 1
    }

    mutating func unavailable(_ why: String) {
        if unreachable == nil { events.append(.unavailable(why)) }
        unreachable = why
    }

    /// A request to etcd answered. After an outage every flight claim counts from now: its
    /// holder could not commit meanwhile either.
    mutating func reached() {
        if unreachable != nil {
            events.append(.available)
            if let seen = claimSeen, claimRestarted != seen.revision {
                claimRestarted = seen.revision
                claimSeen = nil
            }
        }
        unreachable = nil
    }

    /// Counts and reports a refused state, sets health from the view, notes when a claim was
    /// first seen. Returns the state that may be acted on: valid, and not older than `floor`
    /// (which it raises).
    private mutating func check(_ view: FleetView, now: Duration) -> FleetState? {
        let before = trust
        var usable: FleetState?
        let written = view.place.modRevision
        defer { highestRevision = max(highestRevision, written) }
        switch view.state {
        case let .refused(problem, place):
            if reported != place.modRevision {
                reported = place.modRevision
                counters.refusedValues += 1
                events.append(.valueRefused(field: "state", problem: problem.description, revision: place.modRevision, serving: bound != nil))
            }
            trust = .untrusted("the fleet's state \(problem)")
        case .absent where floor > .start:
            trust = .rolledBack(seen: nil, floor: floor)
        case .absent where view.earlierLayout:
            trust = .earlierLayout
            if before != .earlierLayout { events.append(.earlierLayout) }
        case .absent:
            trust = .healthy
        case let .valid(state, place) where state.position < floor || place.modRevision < highestRevision:
            trust = .rolledBack(seen: state.position, floor: floor)
        case let .valid(state, place):
            if state.position.history > floor.history, state.position != ownWrite { events.append(.newHistory(from: floor, to: state.position)) }
            floor = state.position
            trust = .healthy
            usable = state
            if state.flight != nil, claimSeen?.revision != place.modRevision { claimSeen = (place.modRevision, now) }
        }
        if case .rolledBack = trust, trust != before {
            counters.rollbacks += 1
            if case let .rolledBack(seen, floor) = trust { events.append(.rolledBack(seen: seen, floor: floor)) }
        }
        if trust == .healthy {
            switch before {
            case .untrusted, .rolledBack, .earlierLayout: events.append(.trusted(floor))
            case .starting, .healthy, .unavailable: break
            }
        }
        return usable
    }

    /// The claim of `state` at `place`, while it holds, and until when (this broker's clock).
    private func liveClaim(_ state: FleetState, _ place: FleetPlace, now: Duration) -> (claim: FlightClaim, until: Duration)? {
        guard let claim = state.flight, let seen = claimSeen, seen.revision == place.modRevision else { return nil }
        let until = seen.at + claim.lease
        return now < until ? (claim, until) : nil
    }

    /// The holder shown in status: the claim of the view's state, while it holds.
    func holder(in view: FleetView, now: Duration) -> String? {
        guard case let .valid(state, place) = view.state else { return nil }
        return liveClaim(state, place, now: now)?.claim.holder
    }

    // MARK: - Following the fleet

    /// What the sync loop does with `view`. `unixNow` decides whether a token is worth adopting;
    /// `held` is the token this host hands out now (a state that carries it — a flight taken,
    /// a failure noted — is only noted, not installed again).
    mutating func follow(_ view: FleetView, unixNow: Double, now: Duration, held: Secret?) -> FollowAction {
        let state = check(view, now: now)
        guard let state else {
            // First contact with a fleet that has no state for this session: signed out here.
            if case .absent = view.state, bound == nil, trust == .healthy { return .logOut(nil) }
            return .none
        }
        guard let bound, state.position.fleetGeneration <= bound.generation else {
            guard state.phase == .active else { return .logOut(state) }
            // A logout this host owes the fleet ends this login too: not followed meanwhile.
            if let pending = pendingLogout, state.position.fleetGeneration <= (pending ?? floor.fleetGeneration) { return .none }
            return .logIn(state)
        }
        guard state.position.fleetGeneration == bound.generation, state.position > (applied ?? .start), state.position != ownWrite else { return .none }
        switch state.phase {
        case .active:
            if let held, state.accessToken == held {
                installed(state.position)
                return .none
            }
            return Self.usable(state, unixNow: unixNow) == nil ? .none : .adopt(state)
        case .ended, .signedOut:
            return .logOut(state)
        }
    }

    /// This host logged in (as `local`) with the fleet's `state`, or out with it (nil: none).
    mutating func followed(_ state: FleetState?, local: Int) {
        bound = Bound(local: local, generation: state?.position.fleetGeneration ?? FleetPosition.start.fleetGeneration)
        applied = state?.position ?? .start
    }

    /// This host holds the token of `position` (adopted, delivered, or its own commit), or has
    /// seen a state of its own generation with the same token (a flight taken, a backoff noted).
    mutating func installed(_ position: FleetPosition) {
        guard let bound, position.fleetGeneration == bound.generation else { return }
        applied = max(applied ?? .start, position)
        floor = max(floor, position)
    }

    /// This broker is about to write the state at `position` (the end of its session).
    mutating func writing(_ position: FleetPosition) {
        ownWrite = position
    }

    /// The write of `position` is over: if it took, it is what this host holds.
    mutating func wrote(_ position: FleetPosition, succeeded: Bool) {
        if ownWrite == position { ownWrite = nil }
        if succeeded { installed(position) }
    }

    // MARK: - Refreshing

    /// How a demand of local generation `generation` is met, given a fresh `view`. `held` is
    /// the token this host hands out now, `holder` this broker's own flight name.
    mutating func planRefresh(generation: Int, view: FleetView, unixNow: Double, now: Duration, held: Secret?, holder: String) -> RefreshPlan {
        let state = check(view, now: now)
        guard let bound, bound.local == generation else { return .notCaughtUp }
        guard let state, case let .valid(_, place) = view.state else { return .unusable(Self.describe(health)) }
        guard state.position.fleetGeneration == bound.generation, state.phase == .active else { return .boundaryElsewhere }
        if state.position > (applied ?? .start), let token = Self.usable(state, unixNow: unixNow), token.accessToken != held {
            return .deliver(state)
        }
        if let note = state.backoff, note.until > Self.milliseconds(unixNow) { return .backoff(note) }
        if let (claim, until) = liveClaim(state, place, now: now), claim.holder != holder { return .wait(claim, until: until) }
        guard state.position.nextSerial?.nextSerial != nil else {
            events.append(.exhausted)
            return .unusable("the fleet's token serial has reached its limit; log in again")
        }
        return .takeFlight(state, place)
    }

    /// Once this broker's own flight is over without a token of its own: the newest token the
    /// fleet holds for this generation, if it is newer than what this host has.
    mutating func afterFlight(_ view: FleetView, generation: Int, unixNow: Double, now: Duration) -> FleetState? {
        guard let state = check(view, now: now), let bound, bound.local == generation, state.position.fleetGeneration == bound.generation,
              state.phase == .active, state.position > (applied ?? .start), Self.usable(state, unixNow: unixNow) != nil else { return nil }
        return state
    }

    /// A commit of `next` over `place` lost its compare; the key now holds `stored` (opened, or
    /// refused with its problem; nil: deleted). `sameBytes`: it holds exactly what we sent.
    func verdict(on stored: Result<FleetState, FleetValueProblem>?, record: EtcdKeyValue?, sameBytes: Bool, next: FleetState,
                 over place: FleetPlace) -> CommitVerdict {
        if sameBytes { return .committed }
        // A later generation is known here (a logout or login elsewhere): the answer is late.
        if floor.fleetGeneration > next.position.fleetGeneration { return .overtakenByBoundary }
        guard let stored, let record else { return .failed("the fleet's state was deleted") }
        switch stored {
        case let .success(current) where current.position.fleetGeneration > next.position.fleetGeneration:
            return .overtakenByBoundary
        case let .success(current) where current.position >= next.position:
            return .overtakenByRefresh
        case .success, .failure:
            // Written over only when it is the one write since ours (and no later generation is
            // known here, above): an attacker's value cannot beat an honest commit, nor can a
            // commit carry an ended generation back over a logout.
            guard let ours = place.record,
                  record.createRevision == ours.createRevision, record.version == ours.version + 1 else {
                return .failed("the fleet's state changed under the commit (written by someone without the fleet key?)")
            }
            return .writeOver
        }
    }

    // MARK: - Publishing this host's boundaries

    /// What to publish for this host's login or logout.
    enum PublishPlan: Sendable, Equatable {
        /// Published already, or superseded here, or the end of a login that never reached the fleet.
        case localOnly
        /// The fleet has moved past the generation the logout ends.
        case overtaken(generation: FleetGeneration)
        /// The key does not exist: create it first, with no token, at this position.
        case create(FleetState)
        /// Write `state` over `place`.
        case publish(FleetState, FleetPlace)
        /// The fleet's generation has reached its limit: nothing can be published.
        case exhausted
    }

    /// Whether this host's login or logout `record` stays on this host, decided before etcd is
    /// asked anything: this host is past its generation already (published, or superseded
    /// here), or it is the end of a login that never reached the fleet — whose generation the
    /// fleet never had, so its end is no logout of the fleet's (not even one owed for later,
    /// while etcd cannot be reached): the sync loop follows the fleet afresh.
    mutating func isLocalOnly(_ record: SessionRecord) -> Bool {
        if let bound, bound.local >= record.generation { return true }
        if failedLogin == record.generation, record.state != .active {
            failedLogin = nil
            bound = nil   // follow the fleet afresh
            return true
        }
        return false
    }

    /// What to publish for this host's login or logout `record` (nil: a logout this host owes
    /// from before), given a fresh `view`; `ending` is the fleet generation a logout that
    /// waited ends. The new generation is after every one this broker knows of, and after the
    /// revision read: every generation published stays below the revision of its own commit,
    /// so one published later is higher, whatever its publisher had seen.
    mutating func planPublish(_ record: SessionRecord?, view: FleetView, ending: FleetGeneration?, now: Duration) -> PublishPlan {
        if let record, isLocalOnly(record) { return .localOnly }
        _ = check(view, now: now)
        let phase = record?.state ?? .signedOut
        if phase != .active, let ending, let current = view.validState, current.position.fleetGeneration > ending {
            return .overtaken(generation: current.position.fleetGeneration)
        }
        // After every position known here, in the latest history known. (At most 2^32 past what
        // this broker knows: one answer with a huge revision, from a member that lies, cannot
        // use the generations up.)
        let known = max(floor, view.validState?.position ?? .start)
        guard let next = known.nextGeneration(atLeast: min(view.revision + 1, known.generation + (1 << 32))) else {
            events.append(.exhausted)
            return .exhausted
        }
        var published = FleetState(position: next, phase: phase)
        if phase == .active, let record {
            published.refreshToken = record.refreshToken
            published.accessToken = record.accessToken
            published.tokenType = record.tokenType
            published.expiresAt = record.expiresAt
            published.lastRefresh = record.lastRefresh
        }
        if view.place.record == nil, published.hasTokens {
            return .create(FleetState(position: next, phase: .signedOut))
        }
        return .publish(published, view.place)
    }

    /// The fleet took `state`, published by this host; its local generation is `local` (nil:
    /// a creation, or a logout that ends no local generation of its own).
    mutating func published(_ state: FleetState, local: Int?) {
        floor = max(floor, state.position)
        if let local {
            bound = Bound(local: local, generation: state.position.fleetGeneration)
            applied = state.position
        }
    }

    /// What to publish for an admin's reset of the session's fleet history, given a fresh
    /// `view`: a signed-out state that starts a history after every one this broker knows of
    /// (in its floor, or in the view) — its generation starts low again, at least the revision
    /// read (as a login's), so two resets made unaware of each other are still ordered. Every
    /// broker follows it as a logout; the next login starts the history's first session.
    mutating func planReset(view: FleetView, now: Duration) -> PublishPlan {
        _ = check(view, now: now)
        let known = max(floor, view.validState?.position ?? .start)
        guard let next = known.nextHistory(atLeast: view.revision + 1) else {
            events.append(.exhausted)
            return .exhausted
        }
        let state = FleetState(position: next, phase: .signedOut)
        return view.place.record == nil ? .create(state) : .publish(state, view.place)
    }

    // MARK: - Helpers

    /// The state's token for this host, when it has one that is not about to expire.
    /// (Its lifetime counts from the fleet's last refresh, when the state says when that was:
    /// a follower then knows how long the issuer's tokens live, as the holder does.)
    static func usable(_ state: FleetState, unixNow: Double) -> FetchedToken? {
        guard state.phase == .active, let token = state.accessToken else { return nil }
        var fetched = FetchedToken(accessToken: token, tokenType: state.tokenType, refreshToken: state.refreshToken)
        if let expiresAt = state.expiresAt {
            let left = Double(expiresAt) - unixNow
            guard left > 1 else { return nil }
            if let start = state.lastRefresh, Double(start) <= unixNow, start < expiresAt {
                fetched.lifetimeStart = start
                fetched.expiresIn = .milliseconds(Int64(min(Double(expiresAt - start), FleetCodec.timeBound * 2) * 1000))
            } else {
                fetched.expiresIn = .milliseconds(Int64(min(left, FleetCodec.timeBound * 2) * 1000))
                fetched.lifetimeIsRemainder = true
            }
        }
        return fetched
    }

    /// What the holder of a flight does after its upstream request failed (`cancelled`: a
    /// logout or login here ended the generation; `leaseLeft`: until the claim would lapse).
    enum FailedFlight: Equatable {
        /// The request goes on to its deadline: nobody takes the flight before the lease lapses.
        case leaveToLapse(for: Duration, reason: String)
        /// This broker's own problem (its client credentials, scope, endpoint): it lets the
        /// flight go, and the others go on.
        case release
        /// The refresh token is dead for every broker: the session ends fleet-wide.
        case endEverywhere(reason: String)
        /// A transient failure: every broker waits, then one tries again.
        case backOff(for: Duration, reason: String)
    }

    static func afterFailedFlight(_ failure: FetchFailure, cancelled: Bool, leaseLeft: Duration) -> FailedFlight {
        if cancelled { return .leaveToLapse(for: max(leaseLeft, .seconds(1)), reason: "the refresh was left to run out by a logout or login") }
        switch failure.kind {
        case .terminal:
            return failure.grantIsDead ? .endEverywhere(reason: failure.reason) : .release
        case let .transient(retryAfter), let .refused(retryAfter):
            let wait = Duration.seconds(1)
            return .backOff(for: max(wait, min(retryAfter ?? wait, .seconds(3600))), reason: failure.reason)
        }
    }

    static func milliseconds(_ unixNow: Double) -> Int64 {
        Int64(min(max(unixNow, 0), 1e12) * 1000)
    }

    static func describe(_ health: Health) -> String {
        switch health {
        case .starting: return "fleet: not read yet"
        case .healthy: return "fleet: the session has no state in the fleet"
        case let .unavailable(why): return "fleet: \(why)"
        case let .untrusted(why): return "fleet: \(why)"
        case let .rolledBack(seen, floor):
            return "fleet: it shows \(seen.map { "\($0)" } ?? "no state"), older than \(floor) seen here; log in again"
        case .earlierLayout: return "fleet: the session is in an earlier version's layout; log in again"
        }
    }
}
