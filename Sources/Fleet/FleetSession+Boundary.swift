import TokenBrokerCore
import Basics

extension FleetSession {
    // MARK: - The store

    public func load(_ session: String) async throws -> SessionRecord? {
        try await local.load(session)
    }

    public func write(_ write: StoreWrite) async throws -> Bool {
        // Changes that came from the fleet, and refresh results (committed to the fleet by
        // `fetch` already) or a local end: this host's copy only, with the position reached.
        // (A session ends fleet-wide only when the issuer says its refresh token is dead.)
        if write.replicated || write.guardedBy == .sameGeneration { return try await local.write(write, mark: machine.floor) }
        // What reaches etcd runs to its end even if the caller goes away (a client that hangs
        // up must not leave a boundary half-published).
        let published: Result<Void, EtcdError> = await uncancelled {
            await self.serializer.run { () -> Result<Void, EtcdError> in
                do throws(EtcdError) {
                    try await self.publishBoundary(write)
                    return .success(())
                } catch {
                    return .failure(error)
                }
            }
        }
        switch published {
        case .success:
            return try await local.write(write, mark: machine.floor)
        case let .failure(error) where write.record.state != .active:
            // A logout: in effect here at once and on disk, and remembered until etcd takes it
            // (across restarts too); the caller hears that the fleet has not.
            _ = try await local.write(write, mark: machine.floor)
            throw error
        case let .failure(error):
            throw error
        }
    }

    // MARK: - Publishing

    /// Moves the fleet on with this host's login or logout (under the serializer).
    private func publishBoundary(_ write: StoreWrite) async throws(EtcdError) {
        if machine.isLocalOnly(write.record) {
            changes.signal()   // the sync loop follows the fleet now, not at its next quiet read
            return
        }
        if write.record.state == .active {
            do throws(EtcdError) {
                try await publish(write.record, ending: nil)
            } catch {
                machine.failedLogin = write.record.generation
                throw error
            }
            // A login here supersedes this host's logout still waiting for etcd.
            forgetPendingLogout()
            return
        }
        // A logout ends the newest generation this host has read of the fleet: its own read
        // in `publish` is the ordering point. Only a logout that already waited for etcd (a
        // retry, or one remembered across a restart) gives way to a newer boundary made meanwhile.
        let waiting = machine.pendingLogout
        if waiting == nil {
            remember(pendingLogout: machine.bound?.generation ?? currentView().validState?.position.fleetGeneration ?? machine.floor.fleetGeneration)
        }
        try await publish(write.record, ending: waiting ?? nil)
        forgetPendingLogout()
    }

    /// A logout remembered from before a restart, or from a call that could not reach etcd.
    func publishPendingLogout() async throws(EtcdError) {
        try await serializer.run { () -> Result<Void, EtcdError> in
            await self.publishPendingLogoutNow()
        }.get()
    }

    private func publishPendingLogoutNow() async -> Result<Void, EtcdError> {
        guard let ending = machine.pendingLogout else { return .success(()) }
        do throws(EtcdError) {
            try await publish(nil, ending: ending)
        } catch {
            return .failure(error)
        }
        // Published, or overtaken by a newer boundary: either way it is done.
        forgetPendingLogout(ifStill: ending)
        return .success(())
    }

    /// One boundary: a new fleet generation holding `record`'s state (its tokens only for a
    /// login; nil: a logout this host owes from before), in a transaction on the state key's
    /// revision. A logout that ends `ending` is dropped once the fleet has gone past it.
    private func publish(_ record: SessionRecord?, ending: FleetGeneration?) async throws(EtcdError) {
        for _ in 0..<16 {
            let view = try await readView()
            let plan = machine.planPublish(record, view: view, ending: ending, now: now())
            settle(view)
            let state: FleetState
            let place: FleetPlace
            switch plan {
            case .localOnly:
                return
            case .exhausted:
                // (9: failed precondition, as gRPC names it.)
                throw EtcdError(kind: .refused(code: 9), message: "the fleet's generation has reached its limit; start the session's "
                                + "fleet history anew (tokenbroker ctl reset-fleet-history \(name)), then log in")
            case let .overtaken(generation):
                report(.logoutOvertaken(generation: generation))
                changes.signal()
                return
            case let .create(created):
                (state, place) = (created, .absent)
            case let .publish(published, current):
                (state, place) = (published, current)
            }
            let sealed: [UInt8]
            do {
                sealed = try codec.seal(state, over: place.record)
            } catch {
                throw EtcdError(kind: .malformed, message: "cannot seal the fleet's state: \(error)")
            }
            // (Also ours when an answer lost after etcd applied it made the client send it again.)
            guard try await putState(sealed, over: place).took else { continue }
            if case .create = plan {
                machine.published(state, local: nil)
                continue
            }
            machine.published(state, local: record?.generation)
            settle()
            report(.published(login: state.phase == .active, state.position))
            changes.signal()
            return
        }
        throw EtcdError(kind: .unavailable, message: "the fleet's state kept moving; try again")
    }

    // MARK: - Starting the history anew

    /// An admin's way out of a history at its limit (or one a value sealed with the fleet key
    /// has pushed there, before values too near the limit were refused): writes, in a
    /// transaction on the state key's revision, a signed-out state that starts a later history
    /// — its generation low again. The caller (`FleetSync.startHistoryAnew`, under the
    /// serializer) then logs this host out with it, its mark moving to the new history's start
    /// in the same write. Every other broker follows it as a logout, saying so; a value of the
    /// earlier history (a backup, a replay) stays a rollback to every broker that has seen the
    /// new one. Needs etcd: one that cannot be reached changes nothing. Returns the new
    /// history's first state.
    func startHistoryAnewNow() async throws(EtcdError) -> FleetState {
        for _ in 0..<16 {
            let view = try await readView()
            let plan = machine.planReset(view: view, now: now())
            settle(view)
            let state: FleetState
            let place: FleetPlace
            switch plan {
            case let .create(created):
                (state, place) = (created, .absent)
            case let .publish(published, current):
                (state, place) = (published, current)
            case .exhausted:
                throw EtcdError(kind: .refused(code: 9), message: "the fleet's history has reached its limit")
            case .localOnly, .overtaken:
                throw EtcdError(kind: .malformed, message: "no history to start")
            }
            let sealed: [UInt8]
            do {
                sealed = try codec.seal(state, over: place.record)
            } catch {
                throw EtcdError(kind: .malformed, message: "cannot seal the fleet's state: \(error)")
            }
            machine.writing(state.position)
            let took = try await putState(sealed, over: place).took
            machine.wrote(state.position, succeeded: false)
            guard took else { continue }
            machine.published(state, local: nil)
            report(.historyStarted(state.position))
            // A logout this host still owed the fleet is done: the new history ends every
            // generation of the old one.
            forgetPendingLogout()
            return state
        }
        throw EtcdError(kind: .unavailable, message: "the fleet's state kept moving; try again")
    }

    private func remember(pendingLogout ending: FleetGeneration?) {
        machine.pendingLogout = .some(ending)
        guard let pendingLogoutFile else { return }
        if !PendingLogoutFile.write(pendingLogoutFile, settings.prefix + " " + PendingLogoutFile.text(ending)) {
            report(.pendingLogoutNotDurable(path: pendingLogoutFile))
        }
    }

    /// Forgets the pending logout (only if it is still the one that ends `ending`, when given).
    private func forgetPendingLogout(ifStill ending: FleetGeneration?? = nil) {
        if let ending, machine.pendingLogout != ending { return }
        machine.pendingLogout = nil
        if let pendingLogoutFile { PendingLogoutFile.remove(pendingLogoutFile) }
    }
}
