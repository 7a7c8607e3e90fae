import Basics
import TokenBrokerCore

/// What became of a holder's commit.
enum CommitOutcome: Sendable, Equatable {
    case committed(FleetState)
    /// Logged out or in elsewhere meanwhile.
    case overtakenByBoundary
    /// Another broker committed a refresh of this generation first.
    case overtakenByRefresh
    case failed(String)
}

extension FleetSession {
    // MARK: - The source

    public func fetch(_ request: FetchRequest) async throws -> FetchedToken {
        let deadline = clock.now.advanced(by: settings.flightLease + .seconds(5))
        var waited = false
        while true {
            try Task.checkCancellation()
            guard !stopping else { throw FetchFailure.transient("fleet: shutting down") }
            guard clock.now < deadline else { throw FetchFailure.transient("fleet: another broker's refresh has not finished") }
            // A refresh redeemed before but never committed goes first: the issuer has rotated.
            // (One of another local generation is the sync loop's to write, or to discard.)
            if let pending = pendingCommit, pending.generation == request.generation {
                if let token = try await commitPending(pending, for: request) { return token }
                continue
            }
            let view: FleetView
            let version: UInt64
            do {
                (view, version) = try await readViewAndVersion()
            } catch {
                throw FetchFailure.transient("fleet: \(error.message)")
            }
            let plan = machine.planRefresh(generation: request.generation, view: view, unixNow: wall.unixTime(), now: now(),
                                           held: heldToken(), holder: holder)
            settle(view)
            switch plan {
            case .notCaughtUp:
                throw FetchFailure.transient("fleet: this broker has not caught up with the fleet yet")
            case let .unusable(why):
                throw FetchFailure.transient(why)
            case .boundaryElsewhere:
                changes.signal()   // the sync loop applies it
                throw FetchFailure.transient("fleet: the session was logged out or in on another broker")
            case let .deliver(state):
                machine.installed(state.position)
                settle()
                if let token = FleetStateMachine.usable(state, unixNow: wall.unixTime()) { return token }
            case let .backoff(note):
                let left = note.until - FleetStateMachine.milliseconds(wall.unixTime())
                throw FetchFailure.transient("fleet: \(note.reason)", retryAfter: .milliseconds(max(left, 1)))
            case let .wait(claim, until):
                if !waited {
                    waited = true
                    report(.waitingForHolder(claim.holder))
                }
                // One instant, from the claim's end on this broker's clock, a second from now and
                // the demand's deadline: the earliest.
                let claimEnds = epoch.advanced(by: until)
                await changes.wait(after: version, until: min(claimEnds, clock.now.advanced(by: .seconds(1)), deadline))
            case let .takeFlight(state, place):
                if let flight = try await takeFlight(from: state, over: place) {
                    return try await refreshAsHolder(request, flight)
                }
                // Another broker's write came first: the watch brings it.
                await changes.wait(after: version, upTo: .milliseconds(50))
            }
        }
    }

    /// A flight this broker holds: the state it claimed, where that write landed, and when.
    struct HeldFlight: Sendable {
        var claimed: FleetState
        var place: FleetPlace
        var taken: C.Instant
    }

    /// Takes the flight over the state at `place`: the same state with this broker's claim, in
    /// a transaction on its revision (nil: another broker's write came first).
    private func takeFlight(from state: FleetState, over place: FleetPlace) async throws -> HeldFlight? {
        let taken = clock.now
        let claim = FlightClaim(holder: holder, lease: settings.flightLease, taken: FleetStateMachine.milliseconds(wall.unixTime()))
        guard let claimed = state.claimed(claim), let sealed = try? codec.seal(claimed, over: place.record) else {
            throw FetchFailure.transient("fleet: the flight could not be sealed")
        }
        let took: Put
        do throws(EtcdError) {
            took = try await putState(sealed, over: place)
        } catch {
            throw FetchFailure.transient("fleet: \(error.message)")
        }
        // Ours also when etcd applied the transaction but its answer was lost, and the request
        // was sent again: the key then holds our claim.
        guard took.took else { return nil }
        let record = took.record.flatMap { $0.value == sealed ? $0 : nil }
            ?? EtcdKeyValue(key: keys.state, value: sealed, createRevision: place.record?.createRevision ?? took.revision,
                            modRevision: took.revision, version: (place.record?.version ?? 0) + 1, lease: 0)
        machine.installed(claimed.position)
        return HeldFlight(claimed: claimed, place: FleetPlace(record: record), taken: taken)
    }

    /// This broker holds the flight: one upstream request, given up before its claim can lapse
    /// for the others, then the commit. A flight that brings nothing of its own still ends with
    /// the fleet's newest token when another broker committed one meanwhile.
    private func refreshAsHolder(_ request: FetchRequest, _ flight: HeldFlight) async throws -> FetchedToken {
        // Every other broker holds the claim for the lease from when it first saw it, which is
        // after the claim was taken: the upstream request ends (or is abandoned) a margin
        // before, and early enough for one commit to reach etcd.
        let margin = min(.seconds(2), settings.flightLease / 4) + min(settings.commitReserve, settings.flightLease / 4)
        let budget = settings.flightLease - margin - flight.taken.duration(to: clock.now)
        let refreshToken = flight.claimed.refreshToken
        // The request is cut off when the budget is spent, whoever still waits for it: what is
        // left of it when the request is made (never later than the budget's end).
        let budgetStart = clock.now
        let answer = await within(budget) { [upstream, name, clock] in
            try await upstream.fetch(FetchRequest(session: name, generation: request.generation, refreshToken: refreshToken,
                                                  timeLimit: budget - budgetStart.duration(to: clock.now)))
        }
        guard case let .answered(outcome) = answer else {
            // Abandoned: the request may still be processed. Nobody tries again (this broker
            // neither) before the claim would have run out: a backoff until then.
            let left = max(settings.flightLease - flight.taken.duration(to: clock.now), .seconds(1))
            let failure = FetchFailure.transient("fleet: the upstream request was abandoned before the flight lease could lapse",
                                                 retryAfter: left)
            if let after = flight.claimed.failed(BackoffNote(until: FleetStateMachine.milliseconds(wall.unixTime()) + left.milliseconds,
                                                             reason: "the upstream request was abandoned")) {
                _ = await write(after, over: flight.place)
            }
            if let newer = await newestAfterFlight(request) { return newer }
            throw failure
        }
        switch outcome {
        case let .success(fetched):
            // The issuer has rotated: the refresh token the state holds is spent, so the next
            // state is committed whoever holds the flight now, retried while etcd is unreachable,
            // and not this task's cancellation to stop. Only a logout or login elsewhere makes it
            // worthless; one etcd does not take in time is kept and committed first thereafter.
            guard let next = flight.claimed.refreshed(with: fetched, unixNow: wall.unixTime()) else {
                discarded(fetched)
                report(.commitFailed("the token serial has reached its limit"))
                throw FetchFailure.transient("fleet: the refresh could not be committed")
            }
            let pending = PendingCommit(next: next, fetched: fetched, over: flight.place, generation: request.generation,
                                        sealed: try? codec.seal(next, over: flight.place.record))
            let committed = await uncancelled { await self.commit(pending, retryUntil: flight.taken.advanced(by: self.settings.flightLease * 2)) }
            return try await conclude(committed, pending, request)
        case let .failure(error):
            let cancelled = error is CancellationError
            let failure = (error as? FetchFailure) ?? .transient(cancelled ? "cancelled" : "unexpected error (\(type(of: error)))")
            var after: FleetState?
            var ended: FleetState?
            switch FleetStateMachine.afterFailedFlight(failure, cancelled: cancelled, leaseLeft: settings.flightLease - flight.taken.duration(to: clock.now)) {
            case let .leaveToLapse(wait, reason), let .backOff(wait, reason):
                after = flight.claimed.failed(BackoffNote(until: FleetStateMachine.milliseconds(wall.unixTime()) + wait.milliseconds, reason: reason))
            case .release:
                after = flight.claimed.released()
            case let .endEverywhere(reason):
                ended = flight.claimed.ended(reason: reason)
                after = ended
            }
            // The end this broker writes is its own to apply (the coordinator ends the session with
            // this very failure): the sync loop must not take it for an end made elsewhere, even
            // when the watch brings it before this flight has landed.
            if let ended { machine.writing(ended.position) }
            var succeeded = false
            if let after { succeeded = await write(after, over: flight.place) }
            if let ended { machine.wrote(ended.position, succeeded: succeeded) }
            changes.signal()
            // Stalled past the lease, say, while another broker refreshed: its token, not a failure.
            if !cancelled, let newer = await newestAfterFlight(request) { return newer }
            throw error
        }
    }

    /// Writes `state` over the claim at `place`, once, to its end whatever this task's
    /// cancellation; returns whether it took.
    @discardableResult
    private func write(_ state: FleetState, over place: FleetPlace) async -> Bool {
        guard let sealed = try? codec.seal(state, over: place.record) else { return false }
        let done = await uncancelled { try? await self.putState(sealed, over: place) }
        let succeeded = done?.took == true
        if succeeded { machine.installed(state.position) }
        return succeeded
    }

    /// What the flight's caller gets once the commit is over.
    private func conclude(_ committed: CommitOutcome, _ pending: PendingCommit, _ request: FetchRequest) async throws -> FetchedToken {
        changes.signal()
        switch committed {
        case let .committed(state):
            await keep(nil)
            machine.installed(state.position)
            settle()
            var answered = pending.fetched
            (answered.refreshToken, answered.idToken) = (state.refreshToken, nil)
            return answered
        case .overtakenByBoundary:
            // Never installed anywhere; its refresh token is revoked upstream (the fleet's session
            // it belonged to is over).
            await keep(nil)
            discarded(pending.fetched)
            report(.lateAnswerDiscarded)
            throw FetchFailure.transient("fleet: the session was logged out or in on another broker meanwhile")
        case .overtakenByRefresh:
            // Not revoked: at a server that does not rotate, it is the fleet's refresh token too.
            await keep(nil)
            report(.overtakenByRefresh)
            if let newer = await newestAfterFlight(request) { return newer }
            throw FetchFailure.transient("fleet: another broker committed a refresh first")
        case let .failed(problem):
            await keep(pending)
            report(.commitFailed(problem))
            throw FetchFailure.transient("fleet: the refresh could not be committed yet: \(problem)")
        }
    }

    /// A commit left over from an earlier flight: tried once (no retries), then this demand
    /// goes on (nil) or ends with its outcome.
    private func commitPending(_ pending: PendingCommit, for request: FetchRequest) async throws -> FetchedToken? {
        let committed = await uncancelled { await self.commit(pending, retryUntil: self.clock.now) }
        if case .failed = committed, pendingCommit != nil {
            throw FetchFailure.transient("fleet: a refresh is waiting to be committed; etcd does not take it yet")
        }
        return try await conclude(committed, pending, request)
    }

    /// Commits `pending.next` over the state at `pending.over`: retried while etcd is
    /// unreachable (until `retryUntil`), recognised when its answer was lost, and written over a
    /// value nobody with the fleet key wrote when that is the only write since ours.
    func commit(_ pending: PendingCommit, retryUntil: C.Instant) async -> CommitOutcome {
        var place = pending.over
        var problem = "etcd did not answer"
        var attempts = 0
        // Sealed once per place: a commit sent again after its answer was lost is recognised by its bytes.
        guard var sealed = pending.sealed ?? (try? codec.seal(pending.next, over: place.record)) else { return .failed("cannot seal the state") }
        repeat {
            attempts += 1
            do throws(EtcdError) {
                let done = try await putState(sealed, over: place)
                if done.took { return .committed(pending.next) }
                let stored = done.record
                let verdict = machine.verdict(on: stored.map { codec.openState($0, unixNow: wall.unixTime()) }, record: stored,
                                              sameBytes: stored?.value == sealed, next: pending.next, over: place)
                switch verdict {
                case .committed: return .committed(pending.next)
                case .overtakenByBoundary: return .overtakenByBoundary
                case .overtakenByRefresh: return .overtakenByRefresh
                case let .failed(why): return .failed(why)
                case .writeOver:
                    place = FleetPlace(record: stored)
                    guard let resealed = try? codec.seal(pending.next, over: place.record) else { return .failed("cannot seal the state") }
                    sealed = resealed
                }
            } catch where error.kind == .unavailable {
                problem = error.message
                try? await clock.sleep(for: .milliseconds(200))
            } catch {
                return .failed(error.message)
            }
        } while clock.now < retryUntil && attempts < 64
        return .failed(problem)
    }

    /// The fleet's token for this generation when it is newer than what this host holds.
    private func newestAfterFlight(_ request: FetchRequest) async -> FetchedToken? {
        guard let view = try? await readView(),
              let state = machine.afterFlight(view, generation: request.generation, unixNow: wall.unixTime(), now: now()) else { return nil }
        machine.installed(state.position)
        settle(view)
        return FleetStateMachine.usable(state, unixNow: wall.unixTime())
    }

    /// How an upstream request under a budget ended.
    enum UpstreamAnswer: Sendable {
        case answered(Result<FetchedToken, any Error>)
        /// Given up at the budget, with no answer (the request may still be processed).
        case abandoned
    }

    /// Runs `body`, abandoning it (cancelled) once `budget` is spent — but a success that comes
    /// anyway (an upstream that ignores the cancellation) is taken: the issuer has rotated.
    private func within(_ budget: Duration, _ body: @escaping @Sendable () async throws -> FetchedToken) async -> UpstreamAnswer {
        guard budget > .zero else { return .answered(.failure(FetchFailure.transient("fleet: no time left in the flight lease"))) }
        // The deadline is fixed now, not when the timer task first runs: never later than the budget.
        let deadline = clock.now.advanced(by: budget)
        return await withTaskGroup(of: UpstreamAnswer?.self) { [clock] group in
            group.addTask {
                do { return .answered(.success(try await body())) } catch { return .answered(.failure(error)) }
            }
            group.addTask {
                do { try await clock.sleep(until: deadline, tolerance: nil) } catch { return nil }
                return .abandoned
            }
            var first: UpstreamAnswer?
            while let next = await group.next() {
                guard let next else { continue }
                if case .answered(.success) = next { first = next; break }
                if first == nil { first = next }
                group.cancelAll()
            }
            group.cancelAll()
            return first ?? .answered(.failure(CancellationError()))
        }
    }
}

extension Duration {
    /// Whole milliseconds (saturating).
    var milliseconds: Int64 {
        let (seconds, attoseconds) = components
        guard seconds < Int64.max / 1000 - 1 else { return Int64.max / 2 }
        return seconds * 1000 + attoseconds / 1_000_000_000_000_000
    }
}
