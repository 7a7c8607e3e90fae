import Synchronization
import SQLiteStore
import TokenBrokerCore
import Upstream
import Varlink

typealias Coordinator = RefreshCoordinator<ContinuousClock>

/// The sessions the daemon serves, swapped as a whole on reload.
final class SessionTable: Sendable {
    struct Session: Sendable {
        let configuration: SessionConfiguration
        let coordinator: Coordinator
        /// The OAuth source of an `oauth` session (for revocation, device logins, discovery).
        var upstream: HTTPTokenSource?
    }

    struct Snapshot: Sendable {
        var sessions: [String: Session] = [:]
        /// Configuration order, for Status.
        var order: [String] = []
        var access: Access
        /// Stored sessions no longer configured.
        var inert: [InertSession] = []
    }

    private let state: Mutex<Snapshot>
    /// Logouts, logins and forgets pass it shared; a reload's hand-over holds it alone.
    let gate = BoundaryGate()

    init(access: Access) {
        state = Mutex(Snapshot(access: access))
    }

    var snapshot: Snapshot { state.withLock { $0 } }

    func replace(_ snapshot: Snapshot) {
        state.withLock { $0 = snapshot }
        announceChange()
    }

    /// Changes the snapshot in place (no lost update between concurrent changes).
    func modify(_ change: (inout Snapshot) -> Void) {
        state.withLock { change(&$0) }
        announceChange()
    }

    /// One element after each change of the table (for streams that must re-check access).
    func changes() -> AsyncStream<Void> {
        let (stream, continuation) = AsyncStream.makeStream(of: Void.self, bufferingPolicy: .bufferingNewest(1))
        let id = listeners.withLock { listeners in
            listeners.next += 1
            listeners.all[listeners.next] = continuation
            return listeners.next
        }
        continuation.onTermination = { [weak self] _ in _ = self?.listeners.withLock { $0.all.removeValue(forKey: id) } }
        return stream
    }

    private let listeners = Mutex<(next: UInt64, all: [UInt64: AsyncStream<Void>.Continuation])>((0, [:]))

    private func announceChange() {
        for continuation in listeners.withLock({ Array($0.all.values) }) { continuation.yield() }
    }

    /// The session and whether `peer` may use it.
    func lookup(_ name: String, for peer: PeerCredentials) -> (Session, allowed: Bool)? {
        state.withLock { state in
            state.sessions[name].map { ($0, state.access.mayUse($0.configuration, peer)) }
        }
    }

    func isAdmin(_ peer: PeerCredentials) -> Bool {
        state.withLock { $0.access.isAdmin(peer) }
    }
}

/// Serves `io.tokenbroker.Broker` on top of the session coordinators.
///
/// A `GetToken` for a token that is fresh is answered inline on the server's I/O thread from
/// the coordinator's snapshot; everything else runs in a task. Errors are mapped to the
/// contract's named errors in exactly one place, `reply(for:session:)`.
final class BrokerService: VarlinkHandler {
    let sessions: SessionTable
    let logger: Logger
    /// Re-reads the configuration; returns its error text when it could not be applied.
    let reload: @Sendable () async -> String?
    /// Removes a stored, unconfigured session; returns whether there was one.
    let forget: @Sendable (String) async throws -> Bool

    init(sessions: SessionTable, logger: Logger, reload: @escaping @Sendable () async -> String?,
         forget: @escaping @Sendable (String) async throws -> Bool = { _ in false }) {
        self.sessions = sessions
        self.logger = logger
        self.reload = reload
        self.forget = forget
    }

    func handle(_ call: VarlinkCall, from peer: PeerCredentials) -> VarlinkHandling {
        let parameters = Parameters(call.parameters)
        do {
            switch call.member {
            case "GetToken":
                try parameters.only(["session"])
                let session = try use(try parameters.string("session"), peer, call)
                if let token = session.coordinator.freshToken() { return .reply(Self.tokenReply(token)) }
                return asyncReply(session.configuration.name) { Self.tokenReply(try await session.coordinator.token()) }
            case "Recover":
                try parameters.only(["session", "rejected"])
                let session = try use(try parameters.string("session"), peer, call)
                let rejected = Secret(try parameters.string("rejected"))
                return asyncReply(session.configuration.name) { Self.tokenReply(try await session.coordinator.recover(rejected: rejected)) }
            case "Watch":
                try parameters.only(["session"])
                let session = try use(try parameters.string("session"), peer, call)
                guard call.more else { return .reply(.error(VarlinkServiceError.expectedMore)) }
                return .async { [self] sink in await watch(session, peer, sink) }
            case "Logout":
                try parameters.only(["session"])
                let name = try administer(try parameters.string("session"), peer, call).configuration.name
                let logger = self.logger
                return asyncReply(name) { [self] in
                    try await boundary(name) { session in
                        try await session.coordinator.logout(handingOver: revocation(for: session))
                        logger.log(.notice, "logout of session \(name) by \(peer)", session: name,
                                   generation: await session.coordinator.status().generation)
                        return VarlinkReply()
                    }
                }
            case "Login":
                try parameters.only(["session", "refreshToken"])
                let name = try administer(try parameters.string("session"), peer, call).configuration.name
                let refreshToken = Secret(try parameters.string("refreshToken"))
                guard !refreshToken.isEmpty else { throw ParameterError(name: "refreshToken") }
                let logger = self.logger
                return asyncReply(name) { [self] in
                    try await boundary(name) { session in
                        let generation = try await session.coordinator.login(refreshToken: refreshToken)
                        logger.log(.notice, "login of session \(name) by \(peer)", session: name, generation: generation)
                        return VarlinkReply(parameters: ["generation": .int(Int64(generation))])
                    }
                }
            case "Refresh":
                try parameters.only(["session"])
                let session = try administer(try parameters.string("session"), peer, call)
                logger.notice("forced refresh of session \(session.configuration.name) by \(peer)", session: session.configuration.name)
                return asyncReply(session.configuration.name) {
                    let token = try await session.coordinator.refresh()
                    var parameters: JSONObject = ["generation": .int(Int64(token.generation)), "tokenSerial": .int(Int64(token.serial))]
                    if let expiresAt = token.expiresAt { parameters["expiresAt"] = .int(expiresAt) }
                    return VarlinkReply(parameters: parameters)
                }
            case "DeviceLogin":
                try parameters.only(["session"])
                let session = try administer(try parameters.string("session"), peer, call)
                guard call.more else { return .reply(.error(VarlinkServiceError.expectedMore)) }
                guard let upstream = session.upstream else {
                    return .reply(.error(BrokerInterface.Error.loginFailed,
                                         ["session": .string(session.configuration.name), "reason": "this session has no OAuth upstream"]))
                }
                logger.notice("device login of session \(session.configuration.name) started by \(peer)", session: session.configuration.name)
                return .async { [self] sink in await deviceLogin(session, upstream, sink) }
            case "Status":
                try parameters.only([])
                let snapshot = sessions.snapshot
                let visible = snapshot.order.compactMap { snapshot.sessions[$0] }
                    .filter { snapshot.access.mayUse($0.configuration, peer) }
                let inert = snapshot.access.isAdmin(peer) ? snapshot.inert : []
                return .async { sink in
                    var entries: [JSON] = []
                    for session in visible { entries.append(Self.statusEntry(await session.coordinator.status())) }
                    entries += inert.map(Self.statusEntry)
                    sink.send(VarlinkReply(parameters: ["sessions": .array(entries)]))
                }
            case "Forget":
                try parameters.only(["session"])
                let name = try parameters.string("session")
                guard sessions.isAdmin(peer) else { throw Refusal.permissionDenied }
                if sessions.lookup(name, for: peer) != nil {
                    return .reply(.error(BrokerInterface.Error.sessionConfigured, ["session": .string(name)]))
                }
                return .async { [self] sink in
                    // Under the gate, and checked again: a reload may configure it meanwhile.
                    let answer: VarlinkReply = await sessions.gate.shared { [self] in
                        guard sessions.lookup(name, for: peer) == nil else {
                            return .error(BrokerInterface.Error.sessionConfigured, ["session": .string(name)])
                        }
                        do {
                            return try await forget(name) ? VarlinkReply() : .error(BrokerInterface.Error.noSuchSession, ["session": .string(name)])
                        } catch {
                            return reply(for: error, session: name)
                        }
                    }
                    sink.send(answer)
                }
            case "Reload":
                try parameters.only([])
                guard sessions.isAdmin(peer) else { throw Refusal.permissionDenied }
                logger.notice("reload requested by \(peer)")
                return .async { [reload] sink in
                    if let problem = await reload() {
                        sink.send(.error(BrokerInterface.Error.configurationError, ["reason": .string(problem)]))
                    } else {
                        sink.send(VarlinkReply())
                    }
                }
            default:
                return .reply(.error(VarlinkServiceError.methodNotImplemented, ["method": .string(call.method)]))
            }
        } catch let error as ParameterError {
            return .reply(error.reply)
        } catch let refusal as Refusal {
            if case .permissionDenied = refusal {
                logger.limited(.warning, key: "denied:\(peer.uid)", "permission denied: \(call.method) by \(peer)")
            }
            return .reply(refusal.reply)
        } catch {
            return .reply(reply(for: error, session: ""))
        }
    }

    /// A refusal decided before any session work starts.
    private enum Refusal: Error {
        case noSuchSession(String)
        case permissionDenied

        var reply: VarlinkReply {
            switch self {
            case let .noSuchSession(name): return .error(BrokerInterface.Error.noSuchSession, ["session": .string(name)])
            case .permissionDenied: return .error(BrokerInterface.Error.permissionDenied)
            }
        }
    }

    /// The session `peer` may use. A peer that may not use it learns nothing more: whether it
    /// exists or not, the answer is `PermissionDenied` (only admins, who see every session
    /// anyway, are told `NoSuchSession`), so session names cannot be probed.
    private func use(_ name: String, _ peer: PeerCredentials, _ call: VarlinkCall) throws -> SessionTable.Session {
        guard let (session, allowed) = sessions.lookup(name, for: peer) else {
            throw sessions.isAdmin(peer) ? Refusal.noSuchSession(name) : Refusal.permissionDenied
        }
        guard allowed else { throw Refusal.permissionDenied }
        return session
    }

    private func administer(_ name: String, _ peer: PeerCredentials, _ call: VarlinkCall) throws -> SessionTable.Session {
        guard sessions.isAdmin(peer) else { throw Refusal.permissionDenied }
        guard let (session, _) = sessions.lookup(name, for: peer) else { throw Refusal.noSuchSession(name) }
        return session
    }

    /// Runs a boundary (logout, login) on the session's coordinator as the table holds it *now*,
    /// under the gate: never on one a reload is handing over (see `BoundaryGate`).
    private func boundary(_ name: String, _ body: @Sendable (SessionTable.Session) async throws -> VarlinkReply) async throws -> VarlinkReply {
        try await sessions.gate.shared { [sessions] in
            guard let session = sessions.snapshot.sessions[name] else {
                return .error(BrokerInterface.Error.noSuchSession, ["session": .string(name)])
            }
            return try await body(session)
        }
    }

    private func asyncReply(_ session: String, _ body: @escaping @Sendable () async throws -> VarlinkReply) -> VarlinkHandling {
        .async { [self] sink in
            do {
                sink.send(try await body())
            } catch is CancellationError {
                // The client is gone; nobody to answer.
            } catch {
                sink.send(reply(for: error, session: session))
            }
        }
    }

    /// What a logout does with the refresh token it retires: revoke it upstream (RFC 7009),
    /// best effort, in the background, so the logout is not delayed.
    private func revocation(for session: SessionTable.Session) -> @Sendable (Secret) -> Void {
        guard let upstream = session.upstream, case let .oauth(settings) = session.configuration.upstream, settings.revokeOnLogout else {
            return { _ in }
        }
        let logger = self.logger
        let name = session.configuration.name
        return { refreshToken in
            Task {
                if let problem = await upstream.revoke(refreshToken) {
                    logger.warning("revocation at logout of session \(name) failed: \(problem)", session: name)
                }
            }
        }
    }

    /// DeviceLogin: start the device grant, tell the caller where to approve it, poll, and log
    /// the session in with what it yields. The caller disconnecting cancels the polling.
    private func deviceLogin(_ session: SessionTable.Session, _ upstream: HTTPTokenSource, _ sink: VarlinkReplySink) async {
        let name = session.configuration.name
        func failed(_ reason: String) {
            logger.warning("device login of session \(name) failed: \(reason)", session: name)
            sink.send(.error(BrokerInterface.Error.loginFailed, ["session": .string(name), "reason": .string(reason)]))
        }
        let client: OAuthClient
        do {
            client = try await upstream.client()
        } catch {
            return failed(error.reason)
        }
        let authorization: DeviceAuthorization
        do {
            authorization = try await client.startDeviceAuthorization()
        } catch {
            return failed(error.description)
        }
        var prompt: JSONObject = ["event": "prompt", "verificationUri": .string(authorization.verificationURI),
                                  "userCode": .string(authorization.userCode),
                                  "expiresIn": .int(Int64(authorization.expiresIn.seconds))]
        if let complete = authorization.verificationURIComplete { prompt["verificationUriComplete"] = .string(complete) }
        sink.send(VarlinkReply(parameters: prompt, continues: true))
        let token: FetchedToken
        do {
            token = try await client.completeDeviceLogin(authorization, clock: ContinuousClock())
        } catch {
            if Task.isCancelled { return }
            return failed(error.description)
        }
        do {
            let logger = self.logger
            sink.send(try await boundary(name) { session in
                // A reload may have pointed the session at another server meanwhile: a token of
                // this one must not be installed there (it is revoked here instead).
                guard session.upstream === upstream else {
                    if let refreshToken = token.refreshToken { _ = await upstream.revoke(refreshToken) }
                    logger.warning("device login of session \(name) failed: the session was reconfigured during the login", session: name)
                    return .error(BrokerInterface.Error.loginFailed,
                                  ["session": .string(name), "reason": "the session was reconfigured during the login; log in again"])
                }
                let generation = try await session.coordinator.login(refreshToken: token.refreshToken, initial: token)
                logger.log(.notice, "device login of session \(name) done: generation \(generation)", session: name, generation: generation)
                return VarlinkReply(parameters: ["event": "done", "generation": .int(Int64(generation))])
            })
        } catch {
            sink.send(reply(for: error, session: name))
        }
    }

    /// The one place where errors become wire errors. Anything unexpected is logged (by type,
    /// never by content) and answered with `InternalError`.
    func reply(for error: any Error, session: String) -> VarlinkReply {
        let name: JSON = .string(session)
        switch error {
        case let error as SessionError:
            switch error {
            case .signedOut:
                return .error(BrokerInterface.Error.signedOut, ["session": name])
            case let .refreshFailed(reason, retryable, retryAfter):
                var parameters: JSONObject = ["session": name, "reason": .string(reason), "retryable": .bool(retryable)]
                if let retryAfter { parameters["retryAfter"] = .double(retryAfter.seconds) }
                return .error(BrokerInterface.Error.refreshFailed, parameters)
            case let .throttled(retryAfter):
                return .error(BrokerInterface.Error.throttled, ["session": name, "retryAfter": .double(retryAfter.seconds)])
            case let .storeFailed(reason):
                return .error(BrokerInterface.Error.storeFailed, ["session": name, "reason": .string(reason)])
            case .shuttingDown:
                return .error(BrokerInterface.Error.shuttingDown)
            }
        case let error as ParameterError:
            return error.reply
        case let error as StoreError:
            logger.error("state database error in session \(session): \(error)")
            return .error(BrokerInterface.Error.storeFailed, ["session": .string(session), "reason": .string(error.message)])
        default:
            logger.error("internal error in session \(session): \(type(of: error))")
            return .error(BrokerInterface.Error.internalError)
        }
    }

    static func tokenReply(_ token: IssuedToken) -> VarlinkReply {
        var parameters: JSONObject = ["token": .string(token.token.reveal), "tokenType": .string(token.tokenType)]
        if let expiresAt = token.expiresAt { parameters["expiresAt"] = .int(expiresAt) }
        parameters["generation"] = .int(Int64(token.generation))
        return VarlinkReply(parameters: parameters)
    }

    /// Watch, for as long as `peer` may use the session: a reload that takes the peer off its
    /// allow lists ends the stream with `PermissionDenied` at once, and no token is sent after
    /// such a change (each is checked against the table as it is when it goes out).
    func watch(_ session: SessionTable.Session, _ peer: PeerCredentials, _ sink: VarlinkReplySink) async {
        let name = session.configuration.name
        let sessions = self.sessions
        let allowed: @Sendable () -> Bool = { sessions.lookup(name, for: peer)?.allowed == true }
        // Listen for changes first, then check: a change between the call's check and now is
        // not missed.
        let changes = sessions.changes()
        if allowed() {
            await withTaskGroup(of: Void.self) { group in
                group.addTask { await Self.watch(session.coordinator, sink, while: allowed) }
                group.addTask { for await _ in changes where !allowed() { return } }
                await group.next()
                group.cancelAll()
            }
        }
        // Whichever side noticed first, the stream ends saying why (ignored after a final reply).
        if !allowed() { sink.send(.error(BrokerInterface.Error.permissionDenied)) }
    }

    /// Watch: the current state at once, then every event; `signedOut` ends the stream. Stops,
    /// silently, when `allowed` turns false (the caller says why).
    static func watch(_ coordinator: Coordinator, _ sink: VarlinkReplySink, while allowed: @Sendable () -> Bool = { true }) async {
        let events = await coordinator.watch()
        if await coordinator.status().state == .active && coordinator.freshToken() == nil {
            // Active but without a usable token: fetch one, so the stream starts with it.
            _ = try? await coordinator.token()
        }
        for await event in events {
            guard allowed() else { return }
            switch event {
            case let .token(token):
                var parameters: JSONObject = ["event": "token", "generation": .int(Int64(token.generation))]
                if let expiresAt = token.expiresAt { parameters["expiresAt"] = .int(expiresAt) }
                parameters["token"] = .string(token.token.reveal)
                parameters["tokenType"] = .string(token.tokenType)
                parameters["tokenSerial"] = .int(Int64(token.serial))
                sink.send(VarlinkReply(parameters: parameters, continues: true))
            case let .signedOut(generation):
                sink.send(VarlinkReply(parameters: ["event": "signedOut", "generation": .int(Int64(generation))]))
                return
            }
        }
        if !Task.isCancelled { sink.send(.error(BrokerInterface.Error.shuttingDown)) }
    }

    /// A stored, unconfigured session: its stored state, no activity, marked inert.
    static func statusEntry(_ inert: InertSession) -> JSON {
        let state: SessionStatus.State
        switch inert.state {
        case .active: state = .active
        case .signedOut: state = .signedOut
        case .ended: state = .ended
        }
        let status = SessionStatus(name: inert.name, state: state, generation: inert.generation, tokenSerial: inert.tokenSerial,
                                   expiresAt: inert.expiresAt, lastRefresh: inert.lastRefresh, refreshing: false, backoffRemaining: nil,
                                   lastError: nil, degraded: false, counters: SessionCounters())
        guard case var .object(entry) = statusEntry(status) else { return statusEntry(status) }
        entry["inert"] = true
        return .object(entry)
    }

    static func statusEntry(_ status: SessionStatus) -> JSON {
        var entry: JSONObject = ["name": .string(status.name), "state": .string(status.state.rawValue),
                                 "generation": .int(Int64(status.generation))]
        if let serial = status.tokenSerial { entry["tokenSerial"] = .int(Int64(serial)) }
        if let expiresAt = status.expiresAt { entry["expiresAt"] = .int(expiresAt) }
        if let lastRefresh = status.lastRefresh { entry["lastRefresh"] = .int(lastRefresh) }
        entry["refreshing"] = .bool(status.refreshing)
        if let remaining = status.backoffRemaining { entry["backoffRemaining"] = .double(remaining.seconds) }
        if let lastError = status.lastError { entry["lastError"] = .string(lastError) }
        entry["degraded"] = .bool(status.degraded)
        let counters = status.counters
        entry["fetches"] = .int(Int64(counters.fetches))
        entry["joinedWaiters"] = .int(Int64(counters.joinedWaiters))
        entry["failures"] = .int(Int64(counters.failures))
        entry["staleRejections"] = .int(Int64(counters.staleRejections))
        entry["throttled"] = .int(Int64(counters.throttled))
        entry["droppedResults"] = .int(Int64(counters.droppedResults))
        return .object(entry)
    }
}
