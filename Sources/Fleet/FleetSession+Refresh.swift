import TokenBrokerCore

/// What became of a holder's commit.
enum CommitOutcome: Sendable, Equatable {
    case committed
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
            let view: FleetView
            let version: UInt64
            do {
                (view, version) = try await readViewAndVersion()
            } catch {
                throw FetchFailure.transient("fleet: \(error.message)")
            }
            let plan = machine.planRefresh(generation: request.generation, view: view, unixNow: wall.unixTime(),
                                           held: coordinator?.currentToken()?.token, holder: holder)
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
            case let .wait(claim):
                if !waited {
                    waited = true
                    report(.waitingForHolder(claim.holder))
                }
                guard clock.now < deadline else { throw FetchFailure.transient("fleet: another broker's refresh has not finished") }
                guard !stopping else { throw FetchFailure.transient("fleet: shutting down") }
                await changes.wait(after: version, upTo: min(.seconds(1), clock.now.duration(to: deadline)))
            case let .takeFlight(state, place, replacing):
                if let flight = try await takeFlight(over: place, replacing: replacing) {
                    return try await refreshAsHolder(request, state, place, flight: flight)
                }
            }
        }
    }

    /// A flight this broker holds: its claim, the lease and the flight key's create revision.
    struct HeldFlight: Sendable {
        var claim: FlightClaim
        var createRevision: Int64
        var taken: C.Instant
    }

    /// Takes the flight over the state at `place` (nil: another broker was faster).
    private func takeFlight(over place: FleetPlace, replacing: Int64?) async throws -> HeldFlight? {
        let taken = clock.now
        let lease: Int64
        let claim: FlightClaim
        let sealed: [UInt8]
        let took: EtcdTransaction
        do throws(EtcdError) {
            lease = try await backend.grantLease(ttl: settings.flightLease).id
            claim = FlightClaim(holder: holder, lease: lease, stateRevision: place.modRevision,
                                until: FleetStateMachine.milliseconds(wall.unixTime()) + settings.flightLease.milliseconds)
            sealed = try seal(claim)
            took = try await backend.transaction(
                [.modRevision(key: keys.state, equals: place.modRevision),
                 replacing.map { .modRevision(key: keys.flight, equals: $0) } ?? .createRevision(key: keys.flight, equals: 0)],
                success: [.put(key: keys.flight, value: sealed, lease: lease)], failure: [.get(key: keys.flight)])
        } catch {
            throw FetchFailure.transient("fleet: \(error.message)")
        }
        // Ours also when etcd applied the transaction but its answer was lost, and the request
        // was sent again (the flight key then holds our claim).
        if took.succeeded { return HeldFlight(claim: claim, createRevision: took.revision, taken: taken) }
        if let read = took.reads.first ?? nil, read.value == sealed {
            return HeldFlight(claim: claim, createRevision: read.createRevision, taken: taken)
        }
        revokeLater(lease)
        return nil
    }

    /// This broker holds the flight: one upstream request, given up before the lease can lapse,
    /// then the commit. A flight that brings nothing of its own still ends with the fleet's
    /// newest token when another broker committed one meanwhile.
    private func refreshAsHolder(_ request: FetchRequest, _ state: FleetState, _ place: FleetPlace, flight: HeldFlight) async throws
        -> FetchedToken {
        // The lease runs from before the transaction that took the flight; the upstream request
        // ends (or is abandoned) a margin before it can lapse.
        let margin = min(.seconds(2), settings.flightLease / 4)
        let budget = settings.flightLease - margin - flight.taken.duration(to: clock.now)
        let outcome = await within(budget) { [upstream, name] in
            try await upstream.fetch(FetchRequest(session: name, generation: request.generation, refreshToken: state.refreshToken))
        }
        switch outcome {
        case let .success(fetched):
            guard let next = state.refreshed(with: fetched, unixNow: wall.unixTime()), let sealed = try? codec.seal(next, over: place.record) else {
                revokeLater(flight.claim.lease)
                report(.exhausted)
                throw FetchFailure.transient("fleet: the refresh could not be sealed")
            }
            // The issuer has rotated: the record's refresh token is spent, so the new state is
            // committed whoever holds the flight now, retried while etcd is unreachable, and not
            // this task's cancellation to stop. Only a logout or login elsewhere makes it worthless.
            let committed = await Task { await self.commit(next, sealed, over: place, flight: flight) }.value
            revokeLater(flight.claim.lease)
            changes.signal()
            switch committed {
            case .committed:
                machine.installed(next.position)
                settle()
                return FetchedToken(accessToken: fetched.accessToken, tokenType: fetched.tokenType, expiresIn: fetched.expiresIn,
                                    refreshToken: next.refreshToken)
            case .overtakenByBoundary:
                // Never installed anywhere; its refresh token is revoked upstream (the fleet's
                // session it belonged to is over).
                discarded(fetched)
                report(.lateAnswerDiscarded)
                throw FetchFailure.transient("fleet: the session was logged out or in on another broker meanwhile")
            case .overtakenByRefresh:
                // Not revoked: at a server that does not rotate, it is the fleet's refresh token too.
                report(.overtakenByRefresh)
                if let newer = await newestAfterFlight(request) { return newer }
                throw FetchFailure.transient("fleet: another broker committed a refresh first")
            case let .failed(problem):
                report(.commitFailed(problem))
                throw FetchFailure.transient("fleet: the refresh could not be committed: \(problem)")
            }
        case let .failure(error):
            let cancelled = error is CancellationError
            let failure = (error as? FetchFailure) ?? .transient(cancelled ? "cancelled" : "unexpected error (\(type(of: error)))")
            var operations: [EtcdOperation] = [.delete(key: keys.flight)]
            var ended: FleetState?
            if cancelled {
                // Cancelled here (a logout or the stop of this broker): nothing to tell the fleet.
            } else if case .terminal = failure.kind, failure.reason != "invalid_grant" {
                // This broker's own configuration (its client credentials, scope, endpoint): it
                // ends here only, and the others go on.
            } else if case .terminal = failure.kind {
                // The refresh token itself is dead, for every broker: the session ends fleet-wide.
                if let end = state.ended(reason: failure.reason), let sealed = try? codec.seal(end, over: place.record) {
                    operations.append(.put(key: keys.state, value: sealed, lease: 0))
                    ended = end
                }
            } else {
                var wait = Duration.seconds(1)
                switch failure.kind {
                case let .transient(retryAfter), let .refused(retryAfter): wait = max(wait, min(retryAfter ?? wait, .seconds(3600)))
                case .terminal: break
                }
                let note = BackoffNote(stateRevision: place.modRevision,
                                       until: FleetStateMachine.milliseconds(wall.unixTime()) + wait.milliseconds, reason: failure.reason)
                if let sealed = try? seal(note) { operations.append(.put(key: keys.backoff, value: sealed, lease: 0)) }
            }
            let compares: [EtcdCompare] = [.modRevision(key: keys.state, equals: place.modRevision),
                                           .createRevision(key: keys.flight, equals: flight.createRevision)]
            // The end this broker writes is its own to apply (the coordinator ends the session with
            // this very failure): the sync loop must not take it for an end made elsewhere, even
            // when the watch brings it before this flight has landed.
            if let ended { machine.writing(ended.position) }
            let done = await Task { [backend] in try? await backend.transaction(compares, success: operations, failure: []) }.value
            if let ended { machine.wrote(ended.position, succeeded: done?.succeeded == true) }
            revokeLater(flight.claim.lease)
            changes.signal()
            // Stalled past the lease, say, while another broker refreshed: its token, not a failure.
            if !cancelled, let newer = await newestAfterFlight(request) { return newer }
            throw error
        }
    }

    /// The fleet's token for this generation when it is newer than what this host holds.
    private func newestAfterFlight(_ request: FetchRequest) async -> FetchedToken? {
        guard let view = try? await readView(),
              let state = machine.afterFlight(view, generation: request.generation, unixNow: wall.unixTime()) else { return nil }
        machine.installed(state.position)
        settle(view)
        return FleetStateMachine.usable(state, unixNow: wall.unixTime())
    }

    /// Commits `next` over the state at `place`: retried while etcd is unreachable (up to twice
    /// the lease from the flight's start, keeping the flight this broker's meanwhile), and over
    /// a value nobody with the fleet key wrote (an attacker's write cannot beat an honest commit).
    func commit(_ next: FleetState, _ sealed: [UInt8], over place: FleetPlace, flight: HeldFlight) async -> CommitOutcome {
        let commitBy = flight.taken.advanced(by: settings.flightLease * 2)
        var problem = "etcd did not answer"
        var place = place
        var sealed = sealed
        var attempts = 0
        while clock.now < commitBy, attempts < 64 {
            attempts += 1
            if attempts > 1 { await renew(flight) }
            do throws(EtcdError) {
                let done = try await backend.transaction(
                    [place.record == nil ? .createRevision(key: keys.state, equals: 0) : .modRevision(key: keys.state, equals: place.modRevision)],
                    success: [.put(key: keys.state, value: sealed, lease: 0), .delete(key: keys.backoff)],
                    failure: [.get(key: keys.state)])
                if done.succeeded { return .committed }
                guard let stored = done.reads.first ?? nil else { return .failed("the fleet's state was deleted") }
                // Our own commit, applied before its answer was lost and sent again.
                if stored.value == sealed { return .committed }
                switch codec.openState(stored, unixNow: wall.unixTime()) {
                case let .success(current) where current.position.generation > next.position.generation:
                    return .overtakenByBoundary
                case let .success(current) where current.position >= next.position:
                    return .overtakenByRefresh
                case .success, .failure:
                    // An older state written back, or a value that does not open: history goes on
                    // from ours, written over it.
                    place = FleetPlace(record: stored)
                    guard let resealed = try? codec.seal(next, over: stored) else { return .failed("cannot seal the state") }
                    sealed = resealed
                }
            } catch where error.kind == .unavailable {
                problem = error.message
                try? await clock.sleep(for: .milliseconds(200))
            } catch {
                return .failed(error.message)
            }
        }
        return .failed(problem)
    }

    /// Keeps a flight whose commit is retried this broker's: its lease alive, its claim's time
    /// renewed (only while the key is still the one it took).
    private func renew(_ flight: HeldFlight) async {
        _ = try? await backend.keepAlive(lease: flight.claim.lease)
        var claim = flight.claim
        claim.until = FleetStateMachine.milliseconds(wall.unixTime()) + settings.flightLease.milliseconds
        guard let sealed = try? seal(claim) else { return }
        _ = try? await backend.transaction([.createRevision(key: keys.flight, equals: flight.createRevision)],
                                           success: [.put(key: keys.flight, value: sealed, lease: claim.lease)], failure: [])
    }

    private func seal(_ claim: FlightClaim) throws(EtcdError) -> [UInt8] {
        do { return try codec.seal(claim) } catch { throw EtcdError(kind: .malformed, message: "cannot seal the flight: \(error)") }
    }

    private func seal(_ note: BackoffNote) throws(EtcdError) -> [UInt8] {
        do { return try codec.seal(note) } catch { throw EtcdError(kind: .malformed, message: "cannot seal the backoff: \(error)") }
    }

    /// Runs `body`, abandoning it (cancelled) once `budget` is spent.
    private func within(_ budget: Duration, _ body: @escaping @Sendable () async throws -> FetchedToken) async -> Result<FetchedToken, any Error> {
        guard budget > .zero else { return .failure(FetchFailure.transient("fleet: no time left in the flight lease")) }
        return await withTaskGroup(of: Result<FetchedToken, any Error>?.self) { [clock] group in
            group.addTask {
                do { return .success(try await body()) } catch { return .failure(error) }
            }
            group.addTask {
                do { try await clock.sleep(for: budget) } catch { return nil }
                return .failure(FetchFailure.transient("fleet: the upstream request was abandoned before the flight lease could lapse"))
            }
            var first: Result<FetchedToken, any Error>?
            while first == nil, let next = await group.next() { first = next }
            group.cancelAll()
            return first ?? .failure(CancellationError())
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
